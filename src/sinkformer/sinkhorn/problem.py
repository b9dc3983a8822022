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
* **Batches and tiles**: :func:`flatten` turns broadcast batch dimensions into one, :class:`Masks`
  slices ``keep``/``bias`` by flat batch range and row range without expanding them, and the
  tile-size policy (:func:`group_size`, :func:`row_block`, :data:`STREAM_ABOVE`) is one set of
  constants.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "SinkhornConvergenceWarning",
    "SinkhornResult",
    "Tolerance",
    "warn_if_unconverged",
    "warn_unbalanced",
    "Masks",
    "check_iterations",
    "check_scale",
    "marginals",
    "column_error",
    "double_shift",
    "flatten",
    "group_size",
    "row_block",
    "stream_rows",
    "converged_tol",
    "TILE_ELEMENTS",
    "GPU_TILE_ELEMENTS",
    "CACHE_BLOCK_ELEMENTS",
    "cache_blocks",
    "CacheBlocks",
    "implicit_duals",
    "BLOCK_ELEMENTS",
    "MIN_BLOCK_ROWS",
    "STREAM_ABOVE",
    "SAVED_TILE_SCORES",
    "CONVERGED_TOL",
    "compute_in_float32_under_autocast",
]

#: Scores per group of (batch·head) slices on the CPU: small enough to stay in cache.
TILE_ELEMENTS = 1 << 20
#: Scores per group on a GPU: a memory budget (512 MiB of float32 per tile), not a cache size.
GPU_TILE_ELEMENTS = 1 << 27
#: Scores per cache block of the tiled engine: each pass over a group's tile visits it in blocks of
#: about this many scores (2 MiB, a core's L2 on the 2-core EPYC the benchmarks run on), and runs
#: every product that needs a block while it is in cache. Against 2^18, one thread, CPU time,
#: forward+backward, 5 iterations, b=4, h=8: n=128 -9 % (one block instead of two), 256 +3 %,
#: 512 -1 %; b=1, n=4096 (128-row blocks instead of 64) -7 %.
CACHE_BLOCK_ELEMENTS = 1 << 19
#: ... but a slice of at most this many budgets is one block: splitting it costs more operations
#: than the cache saves (2-core Xeon, b=4, h=8, n=1024, 5 iterations, forward+backward: 225 ms in
#: whole slices, 246 ms in 256-row blocks; on the EPYC whole slices and 256- or 512-row blocks are
#: within 3 %).
WHOLE_SLICE_BUDGETS = 2
#: Scores per row block of the streamed log domain (blocks over all slices: GPUs, building blocks) ...
BLOCK_ELEMENTS = 1 << 20
#: ... but at least this many query rows per block: thinner blocks waste the matrix products
#: (b=4, h=8, n=2048: forward 2.0 s with 16 rows, 0.8 s with 64). Memory stays linear in ``m``.
MIN_BLOCK_ROWS = 64
#: Calls of at most this many scores (all slices) keep their tiles from the forward for the backward,
#: which then recomputes nothing (b=4, h=8: n <= 256; 8 MiB of float32).
SAVED_TILE_SCORES = 1 << 21
#: Above this many scores per slice, ``backend="auto"`` streams (never an ``n × m`` tile).
STREAM_ABOVE = 1 << 24
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
    x = x.sub_(col_shift.unsqueeze(-2)) if inplace else x - col_shift.unsqueeze(-2)
    return x, row_shift, col_shift


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
    """``(*b, length, d)`` broadcast to ``batch`` and viewed (copied only if needed) as ``(B, length, d)``."""
    return t.expand(batch + (length, t.shape[-1])).reshape(math.prod(batch), length, t.shape[-1])


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


def valid_rows_cols(keep: Tensor | None, shape: tuple[int, int, int]) -> tuple[Tensor | None, Tensor | None]:
    """Bool ``(c, n)`` valid rows and ``(c, m)`` valid columns of a ``keep`` slice (``None``: all valid)."""
    if keep is None:
        return None, None
    keep = keep.expand(shape)
    return keep.any(-1), keep.any(-2)


def group_size(slices: int, n: int, m: int, device: torch.device) -> int:
    """How many (batch·head) slices the tiled engine processes at once: a tile of
    :data:`TILE_ELEMENTS` scores on the CPU (cache), :data:`GPU_TILE_ELEMENTS` on a GPU (memory)."""
    budget = TILE_ELEMENTS if device.type == "cpu" else GPU_TILE_ELEMENTS
    return max(1, min(slices, budget // max(1, n * m)))


@dataclass(frozen=True)
class CacheBlocks:
    """How the tiled engine covers a ``(c, n, m)`` tile with cache blocks of about ``budget`` scores,
    each contiguous in memory: ``step`` whole slices per block when one slice fits the budget
    (``rows is None``), else ``rows`` rows of one slice per block (at least one row).

    :meth:`rows_of` and :meth:`slices_of` return the blocks' views of a per-row tensor ``(c, n, ...)``
    and of a per-slice tensor ``(c, ...)`` in block order, made by one ``split`` per call (or per
    slice) rather than one indexing per block: a pass over the tile then costs a handful of
    operations per block."""

    c: int
    n: int
    step: int
    rows: int | None

    @property
    def index(self) -> list[tuple[slice, slice]]:
        """``(slices, rows)`` of every block."""
        if self.rows is None:
            return [(slice(s, min(self.c, s + self.step)), slice(0, self.n)) for s in range(0, self.c, self.step)]
        return [(slice(s, s + 1), slice(r, min(self.n, r + self.rows)))
                for s in range(self.c) for r in range(0, self.n, self.rows)]

    def rows_of(self, t: Tensor) -> list[Tensor]:
        """Views ``t[slices, rows]`` of every block, ``t`` of shape ``(c, n, ...)``."""
        if self.rows is None:
            return [t] if self.step >= self.c else list(t.split(self.step, 0))
        return [b for s in range(self.c) for b in t[s:s + 1].split(self.rows, 1)]

    def slices_of(self, t: Tensor) -> list[Tensor]:
        """Views ``t[slices]`` of every block, ``t`` of shape ``(c, ...)`` (one view per block)."""
        if self.rows is None:
            return [t] if self.step >= self.c else list(t.split(self.step, 0))
        per_slice = -(-self.n // self.rows)
        return [view for s in range(self.c) for view in [t[s:s + 1]] * per_slice]


def cache_blocks(c: int, n: int, m: int, budget: int) -> CacheBlocks:
    """The :class:`CacheBlocks` of a ``(c, n, m)`` tile: whole slices when a slice has at most
    :data:`WHOLE_SLICE_BUDGETS` times ``budget`` scores, else row ranges of one slice.
    ``budget``: :data:`CACHE_BLOCK_ELEMENTS` by default."""
    per_slice = n * m
    if per_slice <= WHOLE_SLICE_BUDGETS * budget:
        return CacheBlocks(c, n, max(1, budget // max(1, per_slice)), None)
    return CacheBlocks(c, n, 1, max(1, budget // max(1, m)))


def stream_rows(n: int, m: int, chunk_size: int | None) -> int:
    """Query rows per block of the streamed engine on the CPU (one slice per block, ``chunk_size``
    if given): about :data:`CACHE_BLOCK_ELEMENTS` scores, at least :data:`MIN_BLOCK_ROWS` rows."""
    if chunk_size is not None:
        return max(1, min(chunk_size, n))
    return max(1, min(n, max(MIN_BLOCK_ROWS, CACHE_BLOCK_ELEMENTS // max(1, m))))


def row_block(slices: int, n: int, m: int, chunk_size: int | None) -> int:
    """Query rows per block of the streamed log domain, whose blocks span all ``slices`` (GPUs, the
    building blocks of :mod:`.streamed`; ``chunk_size`` if given)."""
    if chunk_size is not None:
        return max(1, min(chunk_size, n))
    return max(1, min(n, max(MIN_BLOCK_ROWS, BLOCK_ELEMENTS // max(1, slices * m))))


def compute_in_float32_under_autocast(*op_names: str) -> None:
    """Make autocast leave the engine ops ``op_names`` alone: their float32 inputs stay float32 and
    autocast is off inside them (the engines compute in float32 on purpose; autocast would turn their
    products into half-precision ones). float64 inputs are never touched. :func:`sinkformer.attention`
    casts q, k, v to the autocast dtype first, so its output dtype is SDPA's."""
    register = getattr(torch.library, "register_autocast", None)
    if register is None:  # torch < 2.5: attention() switches autocast off around the engines itself
        return
    for name in op_names:
        for device_type in ("cpu", "cuda"):
            register(name, device_type, torch.float32)


def implicit_duals(Pv, Ptv, r: Tensor, c: Tensor, *, tol: float, max_iters: int = 1000) -> tuple[Tensor, Tensor]:
    """Solve ``[diag(a) P; P^T diag(b)] [alpha; beta] = [r; c]`` by Jacobi-preconditioned conjugate
    gradients, given only the products ``Pv(y) = P y`` and ``Ptv(x) = P^T x`` (``a = P 1``, ``b = P^T 1``:
    the matrix's actual row and column sums) — the duals of the implicit backward of every engine.

    ``r``: ``(..., n)``, ``c``: ``(..., m)``. Stops at a relative residual ``tol`` (engines pass 1e-10
    in float64, 1e-6 in float32: asking float32 for less runs past its rounding floor, and the drift
    costs 0.1-10 % of the gradient) or after ``max_iters`` steps.
    """
    a, b = Pv(torch.ones_like(c)), Ptv(torch.ones_like(r))
    pa, pb = torch.where(a > 0, 1 / a, torch.ones_like(a)), torch.where(b > 0, 1 / b, torch.ones_like(b))
    x, y = torch.zeros_like(r), torch.zeros_like(c)
    rx, ry = r.clone(), c.clone()
    zx, zy = pa * rx, pb * ry
    px, py = zx.clone(), zy.clone()
    rz = (rx * zx).sum(-1) + (ry * zy).sum(-1)
    norm0 = torch.sqrt((r.square().sum(-1) + c.square().sum(-1))).clamp_min(1e-30)
    for _ in range(max_iters):
        hx, hy = a * px + Pv(py), Ptv(px) + b * py
        curvature = (px * hx).sum(-1) + (py * hy).sum(-1)
        step = torch.where(curvature > 0, rz / curvature, torch.zeros_like(rz))
        x, y = x + step.unsqueeze(-1) * px, y + step.unsqueeze(-1) * py
        rx, ry = rx - step.unsqueeze(-1) * hx, ry - step.unsqueeze(-1) * hy
        if bool((torch.sqrt(rx.square().sum(-1) + ry.square().sum(-1)) / norm0).max() <= tol):
            break
        zx, zy = pa * rx, pb * ry
        rz_new = (rx * zx).sum(-1) + (ry * zy).sum(-1)
        beta = torch.where(rz > 0, rz_new / rz, torch.zeros_like(rz))
        px, py = zx + beta.unsqueeze(-1) * px, zy + beta.unsqueeze(-1) * py
        rz = rz_new
    return x, y
