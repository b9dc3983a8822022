r"""What every Sinkhorn engine obeys: one definition of the problem, the iteration count and the stop.

An engine (:mod:`.dense`, :mod:`.tiled`, :mod:`.streamed`) only supplies the operators — how the
row and column sums of :math:`P = e^{S + f\oplus g}` are computed. Everything else lives here:

* **Valid rows and columns.** An entry takes part unless it is masked (``keep`` False or a score
  of ``-inf``); a row (column) with no valid entry is *invalid*: it carries no mass, is excluded
  from both normalisations, keeps potential 0 and its output row is 0.
* **Marginals** (:func:`marginals`): given ones are honoured; by default rows sum to 1 and columns
  to ``n_valid / m_valid`` (square and unmasked: doubly stochastic), 0 on invalid rows/columns.
* **Iterations** (:func:`check_iterations`): ``n_iters`` counts normalisations (paper eq. (3)):
  odd ``t`` normalises rows, even ``t`` columns, so ``n_iters=1`` is SoftMax. With ``tol`` (then
  ``n_iters`` must be ``None``) every matrix iterates, ending on a row update, until its column
  error :math:`\max_j|\sum_i P_{ij} - b_j|` is ``<= tol``, or ``max_iters`` normalisations ran
  (:class:`Tolerance`). Each matrix stops on its own, so a matrix's result never depends on the
  rest of its batch; one that does not reach ``tol`` emits a :class:`SinkhornConvergenceWarning`.
* **The double shift** (:func:`double_shift`): the iterations run on
  :math:`S_{ij} - m_i - c_j`, whose rows and columns all have maximum 0, which keeps the
  potentials small (same iterates, Proposition 1).
* **Batches**: :func:`flatten` turns broadcast batch dimensions into one, and :class:`Masks`
  slices ``keep``/``bias`` by flat batch range and row range without expanding them.
* **The attention problem** (:class:`Problem`): what every attention engine receives — the flat
  operands, the masks, the scale and the schedule — with the scores, valid rows and columns and
  marginals of any group of its slices, computed here once for all engines.

The tile-size policy is :mod:`.sizes`, the implicit backward's linear solve :mod:`.implicit`, the
custom-op setup the engines share :mod:`.ops`.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from .._capture import capturing

__all__ = [
    "LOG_SCALING_LIMIT",
    "trusted_scalings",
    "scalings_trusted",
    "scaling_limit",
    "any_along",
    "all_of",
    "SinkhornConvergenceWarning",
    "SinkhornResult",
    "Tolerance",
    "warn_if_unconverged",
    "warn_unbalanced",
    "Masks",
    "Problem",
    "check_iterations",
    "check_scale",
    "marginals",
    "log_marginal",
    "column_error",
    "double_shift",
    "flatten",
    "converged_tol",
    "CONVERGED_TOL",
]

#: Marginal error under which a fixed-count run reports ``converged=True``.
CONVERGED_TOL = 1e-5


class SinkhornConvergenceWarning(UserWarning):
    """Sinkhorn stopped before reaching the balanced fixed point it was asked for: a ``tol`` not
    reached within ``max_iters``, or ``backward="implicit"`` on a matrix that is not balanced."""


@dataclass
class SinkhornResult:
    """Everything a Sinkhorn solve produced.

    Attributes:
        matrix: ``(..., n, m)`` the scaled matrix :math:`P = e^{S + f\\oplus g}`, input dtype.
        f: ``(..., n)`` row log-potentials (0 on rows with no valid entry).
        g: ``(..., m)`` column log-potentials (0 on columns with no valid entry).
        row_error: ``(...)`` :math:`\\max_i |\\sum_j P_{ij} - a_i|` per matrix.
        col_error: ``(...)`` :math:`\\max_j |\\sum_i P_{ij} - b_j|` per matrix.
        n_iters: normalisations run (the largest over the batch with ``tol``).
        converged: whether every matrix has both errors <= ``tol`` (or <= 1e-5 when a fixed
            ``n_iters`` was asked for).
        iterations: ``(...)`` int64 normalisations run by each matrix (each stops on its own).
    """

    matrix: Tensor
    f: Tensor
    g: Tensor
    row_error: Tensor
    col_error: Tensor
    n_iters: int
    converged: bool
    iterations: Tensor | None = None


def check_iterations(n_iters: object, tol: object, max_iters: object) -> None:
    """The ``n_iters``/``tol`` contract, identical for every engine (raises ``TypeError``/``ValueError``).

    Either a fixed count ``n_iters >= 1`` (``tol=None``), or ``tol`` a finite number > 0 with
    ``n_iters=None`` and ``max_iters >= 1`` the cap on normalisations.
    """
    from .._validation import check_positive_int

    if tol is None:
        if n_iters is None:
            raise ValueError("n_iters must be an int >= 1 when tol is None, got None")
        check_positive_int(n_iters, "n_iters")
        return
    if isinstance(tol, bool) or not isinstance(tol, (int, float)):
        raise TypeError(f"tol must be a finite number > 0 (a marginal error), got {type(tol).__name__} {tol!r}")
    if not (math.isfinite(tol) and tol > 0):
        raise ValueError(f"tol must be a finite number > 0 (a marginal error), got {tol!r}")
    if n_iters is not None:
        raise ValueError(
            f"n_iters and tol are exclusive: pass n_iters=None to iterate to tol={tol!r}, got n_iters={n_iters!r}"
        )
    check_positive_int(max_iters, "max_iters")


def check_scale(scale: object) -> float:
    """``scale`` must be a finite real number (it multiplies the cost)."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a finite float, got {type(scale).__name__} {scale!r}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be a finite float, got {scale!r}")
    return float(scale)


def converged_tol(dtype: torch.dtype) -> float:
    """Column error under which a matrix counts as balanced for ``backward="implicit"``."""
    return 1e-8 if dtype == torch.float64 else 1e-4


def marginals(
    row_valid: Tensor | None,
    col_valid: Tensor | None,
    shape: tuple[int, ...],
    like: Tensor,
    a: Tensor | None = None,
    b: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Row and column marginals ``(..., n)``, ``(..., m)`` of a problem of shape ``(..., n, m)``.

    ``row_valid``/``col_valid``: bool validity (``None``: all valid). Given marginals ``a``/``b``
    are kept (times validity); a missing one is uniform over the valid entries with the other's
    total; both missing: rows 1, columns ``n_valid/m_valid``. Invalid rows/columns get 0.
    """
    batch, n, m = tuple(shape[:-2]), shape[-2], shape[-1]
    if row_valid is None and col_valid is None and a is None and b is None:  # no mask: no reduction needed
        return like.new_ones(batch + (n,)), like.new_full(batch + (m,), n / max(m, 1))
    rows = like.new_ones(batch + (n,)) if row_valid is None else row_valid.to(like.dtype).expand(batch + (n,))
    cols = like.new_ones(batch + (m,)) if col_valid is None else col_valid.to(like.dtype).expand(batch + (m,))
    n_valid = rows.sum(-1, keepdim=True)
    m_valid = cols.sum(-1, keepdim=True).clamp_min(1)
    if a is None and b is None:
        return rows, cols * (n_valid / m_valid)
    if b is None:
        a = a.expand(batch + (n,)) * rows
        return a, cols * (a.sum(-1, keepdim=True) / m_valid)
    if a is None:
        b = b.expand(batch + (m,)) * cols
        return rows * (b.sum(-1, keepdim=True) / n_valid.clamp_min(1)), b
    return a.expand(batch + (n,)) * rows, b.expand(batch + (m,)) * cols


def log_marginal(m: Tensor, valid: Tensor | None = None, empty: float = 0.0) -> Tensor:
    """:math:`\\log m` on the ``valid`` entries (default all), ``empty`` elsewhere — the one convention of
    every engine's log-marginals. A row or column without mass keeps potential 0 (``empty=0``; the flash
    kernels take ``-inf``), and a valid entry of marginal 0 gets ``log(finfo.tiny)``: finite, no mass."""
    logs = m.clamp_min(torch.finfo(m.dtype).tiny).log()
    return logs if valid is None else torch.where(valid, logs, torch.full_like(m, empty))


def double_shift(x: Tensor, inplace: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """``x - m_i - c_j`` with :math:`m_i = \\max_j x_{ij}`, :math:`c_j = \\max_i (x_{ij} - m_i)`.

    Every row and every column of the result has maximum 0 (``-inf`` rows/columns keep shift 0).
    Sinkhorn on the shifted scores, started from :math:`g = c`, has the same iterates as on ``x``
    from :math:`g = 0` (Proposition 1 applied to each iterate), but its potentials stay small, so
    float32 keeps full precision even for score ranges of 1e4. The shifts are constants (no gradient).
    """
    row_shift = _finite_or_zero(x.detach().amax(-1)) if x.shape[-1] else x.new_zeros(x.shape[:-1])
    x = x.sub_(row_shift.unsqueeze(-1)) if inplace else x - row_shift.unsqueeze(-1)
    col_shift = _finite_or_zero(x.detach().amax(-2)) if x.shape[-2] else x.new_zeros(x.shape[:-2] + x.shape[-1:])
    x = x.sub_(col_shift.unsqueeze(-2))  # x is the input only when inplace: one new tile at most
    return x, row_shift, col_shift


#: Largest :math:`\log\max u + \log\max v` the scaling domain is trusted with: an entry of
#: :math:`\tilde K = e^{x}` lost to float32 underflow (:math:`e^{x} <` ``tiny`` :math:`\approx e^{-87}`)
#: would weigh less than :math:`e^{60-87}` in the plan, 11 orders of :math:`e` below float32's rounding.
LOG_SCALING_LIMIT = 60.0
#: The same margin in float64 (``tiny`` :math:`\approx e^{-708}`, rounding :math:`e^{-36}`).
LOG_SCALING_LIMIT_FLOAT64 = 660.0


def scaling_limit(dtype: torch.dtype) -> float:
    """:data:`LOG_SCALING_LIMIT`, or :data:`LOG_SCALING_LIMIT_FLOAT64` for float64 scalings."""
    return LOG_SCALING_LIMIT_FLOAT64 if dtype == torch.float64 else LOG_SCALING_LIMIT


def trusted_scalings(u_max: Tensor, v_max: Tensor) -> Tensor:
    r"""Whether scalings whose largest entries are ``u_max`` and ``v_max`` (non-negative, any shape: one
    per matrix or group) are trusted: finite, and :math:`\log u_{\max} + \log v_{\max}` below
    :func:`scaling_limit`. The one criterion of every scaling-domain path (:func:`scalings_trusted` for
    two numbers)."""
    return torch.isfinite(u_max) & torch.isfinite(v_max) & (u_max.log() + v_max.log() < scaling_limit(u_max.dtype))


def scalings_trusted(u_max: float, v_max: float, dtype: torch.dtype) -> bool:
    """:func:`trusted_scalings` of two numbers, without tensor operations (a group's verdict in the tiled
    engine, where each operation is a cost at short sequences)."""
    if not (math.isfinite(u_max) and math.isfinite(v_max)):
        return False
    return u_max <= 0 or v_max <= 0 or math.log(u_max) + math.log(v_max) < scaling_limit(dtype)


def any_along(mask: Tensor, dim: int) -> Tensor:
    """``mask.any(dim)`` for a bool tensor, as the maximum of its bytes on CPUs: a third of the time of
    torch's bool reduction there (0.66 against 2.07 ms at (32, 4, 96, 96), one thread, informal). Under
    graph capture ``mask.any(dim)`` itself: inductor fuses it, and its C++ code for the bytes viewed as
    bools does not compile (torch 2.13: ``Vectorized<bool>`` has no member ``to``)."""
    if mask.device.type != "cpu" or mask.shape[dim] == 0 or capturing():
        return mask.any(dim)
    return mask.view(torch.uint8).amax(dim).view(torch.bool)


def all_of(mask: Tensor) -> bool:
    """``bool(mask.all())`` for a bool tensor, as the minimum of its bytes on CPUs (40 times faster there
    at (32, 4, 96, 96), informal)."""
    if mask.device.type != "cpu" or mask.numel() == 0:
        return bool(mask.all())
    return bool(mask.view(torch.uint8).amin())


def _finite_or_zero(x: Tensor) -> Tensor:
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


class Tolerance:
    """The stop rule of tolerance mode for a batch of matrices, shared by every engine.

    After each *row* update an engine calls :meth:`check` with the per-matrix column error; a
    matrix whose error is ``<= tol`` becomes inactive (engines freeze its potentials with
    ``torch.where(tol.active, new, old)``), and the loop stops when none is active or when two
    more normalisations would exceed ``max_iters``. ``counts`` holds the normalisations each
    matrix ran (odd: every matrix ends on a row update). ``step``: normalisations per iteration
    (2 for alternating updates, 1 for the symmetric update of the streamed engine).
    """

    def __init__(self, tol: float, max_iters: int, batch: tuple[int, ...], device: torch.device, engine: str,
                 step: int = 2):
        self.tol, self.max_iters, self.engine, self.step = tol, max_iters, engine, step
        self.active = torch.ones(batch, dtype=torch.bool, device=device)
        self.counts = torch.zeros(batch, dtype=torch.int64, device=device)
        self.error = torch.zeros(batch, dtype=torch.float64, device=device)
        self.done = 0

    def check(self, gap: Tensor, done: int) -> bool:
        """Record the column error ``gap`` (per matrix) after ``done`` normalisations; True = stop."""
        self.done = done
        self.counts = torch.where(self.active, done, self.counts)
        self.error = torch.where(self.active, gap.detach().to(self.error.dtype), self.error)
        self.active = self.active & ~(gap <= self.tol)  # NaN counts as not converged
        if not bool(self.active.any()):
            return True
        return done + self.step > self.max_iters



def warn_if_unconverged(stops: list[Tolerance], implicit: bool = False) -> None:
    """One :class:`SinkhornConvergenceWarning` for the matrices (of all ``stops``, e.g. the
    groups of one call) that did not reach ``tol``."""
    bad = [s for s in stops if bool(s.active.any())]
    if not bad:
        return
    s = bad[0]
    worst = max(float(b.error[b.active].amax()) for b in bad)
    n_bad = sum(int(b.active.sum()) for b in bad)
    n_all = sum(b.active.numel() for b in stops)
    extra = " The implicit gradient assumes the fixed point and will be inaccurate." if implicit else ""
    warnings.warn(
        f"Sinkhorn did not reach tol={s.tol:g} within max_iters={s.max_iters} normalisations "
        f"({n_bad} of {n_all} matrices, engine {s.engine!r}): column error {worst:.3g} after "
        f"{max(b.done for b in bad)} normalisations.{extra} Raise max_iters, loosen tol, or lower the score "
        "range (scale).",
        SinkhornConvergenceWarning,
        stacklevel=3,
    )


def warn_unbalanced(col_error: Tensor, n_iters: int, threshold: float, engine: str) -> None:
    """``backward="implicit"`` after a fixed count: warn when a matrix is not balanced."""
    worst = float(col_error.amax()) if col_error.numel() else 0.0
    if worst > threshold:
        warnings.warn(
            f"backward='implicit' differentiates the balanced fixed point, but after n_iters={n_iters} "
            f"normalisations the column error is {worst:.3g} (> {threshold:g}, engine {engine!r}): the implicit "
            "gradient will be inaccurate. Use n_iters=None with tol=, more n_iters, or backward='unrolled'.",
            SinkhornConvergenceWarning,
            stacklevel=3,
        )


def flatten(t: Tensor, batch: tuple[int, ...], length: int) -> Tensor:
    """``(*b, length, d)`` broadcast to ``batch`` and viewed (copied only if needed) as ``(B, length, d)``; expanded
    only where ``b`` is not ``batch`` (an expansion is a node in autograd's graph)."""
    if tuple(t.shape[:-2]) != tuple(batch):
        t = t.expand(batch + (length, t.shape[-1]))
    return t.reshape(math.prod(batch), length, t.shape[-1])


class Masks:
    """``keep`` (bool) and ``bias`` (float), each broadcastable to ``batch + (n, m)``, sliced by flat
    batch range and row range without ever expanding the whole ``(B, n, m)``.

    Slices come back broadcastable to ``(end - start, rows, m)`` (a dimension of size 1 stays 1).
    """

    def __init__(self, keep: Tensor | None, bias: Tensor | None, batch: tuple[int, ...]):
        self.keep, self.bias, self.batch = (self._align(keep, batch), self._align(bias, batch), batch)

    @staticmethod
    def _align(t: Tensor | None, batch: tuple[int, ...]) -> Tensor | None:
        if t is None:
            return None
        return t.reshape((1,) * (len(batch) + 2 - t.dim()) + tuple(t.shape))

    def _slice(self, t: Tensor | None, start: int, end: int, row_start: int, row_end: int | None) -> Tensor | None:
        if t is None:
            return None
        if t.shape[-2] != 1:
            t = t[..., row_start:row_end, :]
        lead = t.shape[:-2]
        if all(s == 1 for s in lead):
            return t.reshape((1,) + t.shape[-2:])
        index = torch.unravel_index(torch.arange(start, end, device=t.device), self.batch)
        index = tuple(i if s != 1 else torch.zeros_like(i) for i, s in zip(index, lead))
        return t[index]

    def keep_of(self, start: int, end: int, row_start: int = 0, row_end: int | None = None) -> Tensor | None:
        return self._slice(self.keep, start, end, row_start, row_end)

    def bias_of(self, start: int, end: int, row_start: int = 0, row_end: int | None = None) -> Tensor | None:
        return self._slice(self.bias, start, end, row_start, row_end)


def column_error(col_sums: Tensor, b: Tensor) -> Tensor:
    """Per-matrix column error :math:`\\max_j |\\sum_i P_{ij} - b_j|` ``(...)`` (0 on columns without mass)."""
    gap = torch.where(b > 0, (col_sums - b).abs(), torch.zeros_like(b))
    return gap.amax(-1) if gap.shape[-1] else gap.sum(-1)


#: Scores per block when :meth:`Problem.valid` reads a mask row block by row block.
_VALID_BLOCK = 1 << 22


@dataclass
class Problem:
    r"""The Sinkhorn attention problem of one call, as every attention engine receives it.

    ``B = prod(batch)`` slices, flat: ``q (B, n, d)``, ``k (B, m, d)``, ``v (B, m, e)`` (``None`` for a
    problem without values, e.g. potentials only) in compute precision; the scores
    :math:`S = \mathrm{scale}\,qk^\top + \mathrm{bias}`, ``-inf`` where ``keep`` is False, both
    broadcastable to ``batch + (n, m)`` and never expanded (:class:`Masks`); the schedule: ``n_iters``
    normalisations, or ``tol`` within ``max_iters`` (:func:`check_iterations`). Validated by
    :func:`sinkformer.attention`, built once (:meth:`~sinkformer.attention.backends.Prepared.problem`).

    An engine's custom op cannot take an object: it receives :meth:`fields` first among its inputs and
    rebuilds the problem with ``Problem(*fields)``. An engine works on groups of slices: :meth:`group`
    is the problem of slices ``[start, end)`` (``first``: the flat batch index of its first slice in the
    masks), whose :meth:`scores`, :meth:`valid` rows and columns and :meth:`marginals` it reads.
    """

    q: Tensor
    k: Tensor
    v: Tensor | None
    keep: Tensor | None
    bias: Tensor | None
    batch: tuple[int, ...]
    scale: float
    n_iters: int | None
    tol: float | None = None
    max_iters: int = 1000
    first: int = 0
    masks: Masks = field(init=False, repr=False)

    def __post_init__(self):
        self.batch = tuple(self.batch)
        self.masks = Masks(self.keep, self.bias, self.batch)

    def fields(self) -> tuple:
        """The problem as a custom op receives it: ``(q, k, v, keep, bias, batch, scale, n_iters, tol,
        max_iters)`` (``batch`` a list); ``Problem(*problem.fields())`` is the same problem."""
        return (self.q, self.k, self.v, self.keep, self.bias, list(self.batch), self.scale, self.n_iters, self.tol,
                self.max_iters)

    @property
    def B(self) -> int:
        return self.q.shape[0]

    @property
    def n(self) -> int:
        return self.q.shape[1]

    @property
    def m(self) -> int:
        return self.k.shape[1]

    @property
    def masked(self) -> bool:
        """Whether the scores have a mask or a bias (else they are ``scale q k^T`` alone)."""
        return self.keep is not None or self.bias is not None

    def history_length(self, implicit: bool = False) -> tuple[int, int] | None:
        """Iterates a forward saves per slice: ``(f_1, f_3, ..)`` and ``(g_0, g_2, ..)``; the last
        pair only for the ``implicit`` backward; ``None`` when data-dependent (``tol``)."""
        if implicit:
            return 1, 1
        if self.tol is not None:
            return None
        return (self.n_iters + 1) // 2, self.n_iters // 2 + 1

    def group(self, start: int, end: int) -> Problem:
        """The problem of slices ``[start, end)`` (the same masks, read from flat index ``first + start``); this one
        for all of its slices."""
        if start == 0 and end == self.B:
            return self
        v = None if self.v is None else self.v[start:end]
        return replace(self, q=self.q[start:end], k=self.k[start:end], v=v, first=self.first + start)

    def keep_of(self, rows: tuple[int, int | None] = (0, None)) -> Tensor | None:
        """``keep`` of these slices and query rows ``rows``, broadcastable to ``(B, rows, m)``."""
        return self.masks.keep_of(self.first, self.first + self.B, *rows)

    def bias_of(self, rows: tuple[int, int | None] = (0, None)) -> Tensor | None:
        """``bias`` of these slices and query rows ``rows``, broadcastable to ``(B, rows, m)``."""
        return self.masks.bias_of(self.first, self.first + self.B, *rows)

    def scores(self, rows: tuple[int, int | None] = (0, None), out: Tensor | None = None) -> Tensor:
        """``scale q k^T + bias`` of query rows ``rows``, ``-inf`` where masked: ``(B, rows, m)``,
        written into ``out`` when given."""
        q = self.q[:, rows[0]:rows[1]]
        kT = self.k.transpose(1, 2)
        S = (torch.baddbmm(q.new_empty(()), q, kT, beta=0.0, alpha=self.scale) if out is None
             else out.baddbmm_(q, kT, beta=0.0, alpha=self.scale))
        if not self.masked:
            return S
        bias = self.bias_of(rows)
        if bias is not None:
            S.add_(bias)
        keep = self.keep_of(rows)
        if keep is not None:
            S.masked_fill_(~keep, float("-inf"))
        return S

    def valid(self) -> tuple[Tensor | None, Tensor | None]:
        """Bool valid rows ``(B, n)`` and columns ``(B, m)`` (``None``: all valid): a row (column) is
        valid when it keeps an entry. Read in row blocks, never the whole ``(B, n, m)`` mask at once."""
        if self.keep is None:
            return None, None
        B, n, m = self.B, self.n, self.m
        keep = self.keep_of()
        if keep.shape[-2] == 1:  # the same in every row (e.g. key padding)
            row = keep.expand(B, 1, m)
            return row.any(-1).expand(B, n), row[:, 0]
        rows = torch.zeros(B, n, dtype=torch.bool, device=self.q.device)
        cols = torch.zeros(B, m, dtype=torch.bool, device=self.q.device)
        step = max(1, _VALID_BLOCK // max(1, B * m))
        for start in range(0, n, step):
            end = min(n, start + step)
            block = self.keep_of((start, end)).expand(B, end - start, m)
            rows[:, start:end] = block.any(-1)
            cols |= block.any(-2)
        return rows, cols

    def marginals(self, like: Tensor, a: Tensor | None = None, b: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Row and column marginals ``(B, n)``, ``(B, m)`` of these slices (:func:`marginals`: given
        ones kept; by default rows 1 and columns ``n_valid / m_valid``; 0 where invalid), in ``like``'s
        dtype."""
        return marginals(*self.valid(), (self.B, self.n, self.m), like, a, b)
