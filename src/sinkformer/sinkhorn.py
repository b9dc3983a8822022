r"""The Sinkhorn core: scale a (batched) score matrix to prescribed marginals.

Given scores :math:`S \in \mathbb{R}^{n\times m}` (any leading batch shape), Sinkhorn's
algorithm finds log-potentials :math:`f \in \mathbb{R}^n`, :math:`g \in \mathbb{R}^m` such that

.. math::

    P_{ij} = \exp(S_{ij} + f_i + g_j),\qquad P\mathbf 1 = a,\qquad P^\top \mathbf 1 = b .

It alternates, in the log domain (Sinkformers paper, eq. (3) and Appendix B), starting from
:math:`g = 0`:

.. math::

    f_i \leftarrow \log a_i - \log\sum_j e^{S_{ij} + g_j} \quad(\text{rows}),\qquad
    g_j \leftarrow \log b_j - \log\sum_i e^{S_{ij} + f_i} \quad(\text{columns}).

``n_iters`` counts these normalisations: ``n_iters=1`` is a row SoftMax (times ``a``), 2 adds a
column normalisation, and so on; odd counts end with exactly row-stochastic matrices. This is
POT's scaling convention (``ot.sinkhorn(a, b, M=-S, reg=1)`` gives the same limit).

Defaults: rows sum to 1 and columns to ``n/m`` (square: doubly stochastic). Masked entries
(``mask`` False, or a score of ``-inf``) carry no mass; rows and columns with no valid entry
are dropped from both normalisations, so the default marginals are those of the valid
sub-matrix, and an empty row comes back as zeros, never NaN.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ._validation import broadcastable, check_finite, check_positive_int, check_tensor, compute_dtype

__all__ = ["sinkhorn", "SinkhornResult", "log_sinkhorn_loop", "double_shift"]

#: Marginal error under which a fixed-count run reports ``converged=True``.
CONVERGED_TOL = 1e-5


@dataclass
class SinkhornResult:
    """Everything a Sinkhorn solve produced.

    Attributes:
        matrix: ``(..., n, m)`` the scaled matrix :math:`P = e^{S + f\\oplus g}`, input dtype.
        f: ``(..., n)`` row log-potentials (0 on rows with no valid entry).
        g: ``(..., m)`` column log-potentials (0 on columns with no valid entry).
        row_error: ``(...)`` :math:`\\max_i |\\sum_j P_{ij} - a_i|` per matrix.
        col_error: ``(...)`` :math:`\\max_j |\\sum_i P_{ij} - b_j|` per matrix.
        n_iters: number of normalisations run.
        converged: whether every matrix has both errors <= ``tol`` (or <= 1e-5 when a fixed
            ``n_iters`` was asked for).
    """

    matrix: Tensor
    f: Tensor
    g: Tensor
    row_error: Tensor
    col_error: Tensor
    n_iters: int
    converged: bool


def log_sinkhorn_loop(
    row_lse: Callable[[Tensor], Tensor],
    col_lse: Callable[[Tensor], Tensor],
    log_a: Tensor,
    log_b: Tensor,
    *,
    n_iters: int | None,
    tol: float | None = None,
    max_iters: int = 1000,
    b: Tensor | None = None,
    row_valid: Tensor | None = None,
    col_valid: Tensor | None = None,
    g: Tensor | None = None,
) -> tuple[Tensor, Tensor, int, bool | None]:
    """The alternating log-domain updates, independent of how the log-sum-exps are computed.

    ``row_lse(g)`` must return :math:`\\log\\sum_j e^{S_{ij}+g_j}` of shape ``(..., n)`` and
    ``col_lse(f)`` :math:`\\log\\sum_i e^{S_{ij}+f_i}` of shape ``(..., m)`` — dense here,
    streamed over blocks by the chunked attention. ``log_a``/``log_b`` are the log-marginals
    (finite: 0 on invalid rows/columns), ``row_valid``/``col_valid`` the valid rows/columns
    (``None``: all valid). With ``tol`` set, iterates (ending on a row update) until the column
    error :math:`\\max_j|\\sum_i P_{ij}-b_j|` is <= ``tol`` or ``max_iters`` normalisations ran;
    ``b`` must then be given.

    Returns ``(f, g, iterations_run, converged)``; ``converged`` is ``None`` in fixed-count mode.
    """

    def update(log_marginal: Tensor, lse: Tensor, valid: Tensor | None) -> Tensor:
        pot = log_marginal - lse
        return pot if valid is None else torch.where(valid, pot, torch.zeros_like(pot))

    if g is None:
        g = torch.zeros_like(log_b)
    f = torch.zeros_like(log_a)
    if tol is None:
        assert n_iters is not None
        for it in range(n_iters):
            if it % 2 == 0:
                f = update(log_a, row_lse(g), row_valid)
            else:
                g = update(log_b, col_lse(f), col_valid)
        return f, g, n_iters, None

    assert b is not None
    done = 0
    while True:
        f = update(log_a, row_lse(g), row_valid)
        done += 1
        lse = col_lse(f)
        gap = (torch.exp(g + lse) - b).abs()
        if col_valid is not None:
            gap = torch.where(col_valid, gap, torch.zeros_like(gap))
        converged = bool(gap.max() <= tol) if gap.numel() else True
        if converged or done + 2 > max_iters:
            return f, g, done, converged
        g = update(log_b, lse, col_valid)
        done += 1


def sinkhorn(
    scores: Tensor,
    n_iters: int | None = 5,
    *,
    tol: float | None = None,
    max_iters: int = 1000,
    mask: Tensor | None = None,
    row_marginals: Tensor | None = None,
    col_marginals: Tensor | None = None,
    warm_start: Tensor | None = None,
    return_result: bool = False,
) -> Tensor | SinkhornResult:
    """Sinkhorn-normalise ``scores`` over its last two dimensions, in the log domain.

    Args:
        scores: ``(..., n, m)`` floating tensor :math:`S`; the matrix is :math:`e^{S}` scaled.
            ``-inf`` entries are treated as masked. NaN raises.
        n_iters: number of normalisations (paper eq. (3)): 1 = SoftMax over the last dim,
            2 = then columns, ... Must be ``None`` when ``tol`` is given.
        tol: iterate until the marginal error (max abs deviation of a column sum from its
            target; rows are exact) is <= ``tol`` or ``max_iters`` normalisations ran.
        max_iters: cap on normalisations in ``tol`` mode.
        mask: bool, broadcastable to ``scores``; True = keep. Masked entries get no mass;
            rows/columns with no kept entry are excluded from both normalisations.
        row_marginals: ``(..., n)`` non-negative target row sums :math:`a` (default 1 per
            valid row, or uniform with the column total if only ``col_marginals`` is given).
        col_marginals: ``(..., m)`` non-negative target column sums :math:`b` (default
            uniform over valid columns with the row total, i.e. ``n/m`` when unmasked).
            Both totals must agree.
        warm_start: ``(..., m)`` column log-potential ``g`` of an earlier solve to start from
            (the first update recomputes ``f``).
        return_result: return a :class:`SinkhornResult` instead of the matrix.

    Returns:
        The ``(..., n, m)`` matrix :math:`P` in the input dtype, or a :class:`SinkhornResult`.
        Computation runs in float32 (float64 for float64 input).

    Example:
        >>> P = sinkhorn(torch.randn(4, 6, 6), n_iters=None, tol=1e-6)
        >>> torch.allclose(P.sum(-2), torch.ones(4, 6), atol=1e-5)
        True
    """
    check_tensor(scores, "scores", min_dim=2, floating=True)
    if tol is None:
        if n_iters is None:
            raise ValueError("n_iters must be an int >= 1 when tol is None, got None")
        check_positive_int(n_iters, "n_iters")
    else:
        if n_iters is not None:
            raise ValueError(
                f"n_iters and tol are exclusive: pass n_iters=None to iterate to tolerance, got n_iters={n_iters}"
            )
        if not (isinstance(tol, (int, float)) and tol > 0):
            raise ValueError(f"tol must be a positive float, got {tol!r}")
        check_positive_int(max_iters, "max_iters")
    check_finite(scores, "scores", allow_neg_inf=True)

    problem = _Problem.build(scores, mask, row_marginals, col_marginals)
    if warm_start is not None:
        check_tensor(warm_start, "warm_start", floating=True)
        if not broadcastable(warm_start.shape, problem.log_b.shape):
            raise ValueError(
                f"warm_start must broadcast to {tuple(problem.log_b.shape)} (the column potential g), "
                f"got shape {tuple(warm_start.shape)}"
            )
        warm_start = warm_start.to(problem.x.dtype).expand_as(problem.log_b)
        if problem.col_valid is not None:
            warm_start = torch.where(problem.col_valid, warm_start, torch.zeros_like(warm_start))
    # potentials of the shifted scores: g = 0 on S is g = c on S - m - c
    g0 = problem.col_shift if warm_start is None else warm_start + problem.col_shift

    f, g, done, converged = log_sinkhorn_loop(
        problem.row_lse,
        problem.col_lse,
        problem.log_a,
        problem.log_b,
        n_iters=n_iters,
        tol=tol,
        max_iters=max_iters,
        b=problem.b,
        row_valid=problem.row_valid,
        col_valid=problem.col_valid,
        g=g0,
    )
    plan = problem.matrix(f, g, last_update_was_rows=done % 2 == 1)
    f, g = f - problem.row_shift, g - problem.col_shift  # back to potentials of the input scores
    if not return_result:
        return plan.to(scores.dtype)

    with torch.no_grad():
        row_error = (plan.sum(-1) - problem.a).abs().amax(-1)
        col_error = (plan.sum(-2) - problem.b).abs().amax(-1)
        if converged is None:
            converged = bool(torch.maximum(row_error, col_error).max() <= CONVERGED_TOL)
        elif not converged:
            converged = bool(torch.maximum(row_error, col_error).max() <= tol)
    return SinkhornResult(plan.to(scores.dtype), f, g, row_error, col_error, done, converged)


@dataclass
class _Problem:
    """Masked scores and marginals in compute precision, ready for the loop."""

    x: Tensor  # (..., n, m) shifted scores S - m_i - c_j, -inf where masked
    row_shift: Tensor  # (..., n) m_i
    col_shift: Tensor  # (..., m) c_j
    x_rows: Tensor  # x with invalid rows set to 0 (finite row log-sum-exps)
    x_cols: Tensor  # x with invalid columns set to 0
    a: Tensor  # (..., n) row marginals, 0 on invalid rows
    b: Tensor  # (..., m)
    log_a: Tensor  # finite: 0 on invalid rows
    log_b: Tensor
    row_valid: Tensor | None  # (..., n) bool, None = all valid
    col_valid: Tensor | None

    def matrix(self, f: Tensor, g: Tensor, last_update_was_rows: bool) -> Tensor:
        """:math:`e^{S + f \\oplus g}`, written as a SoftMax along the last normalised axis.

        After a row update :math:`P = a \\odot \\mathrm{softmax}_j(S + g)` (rows exact even when
        the potentials are ~1e4 in float32); after a column update, the transpose statement.
        """
        if last_update_was_rows:
            return self.a.unsqueeze(-1) * torch.softmax(self.x_rows + g.unsqueeze(-2), dim=-1)
        return self.b.unsqueeze(-2) * torch.softmax(self.x_cols + f.unsqueeze(-1), dim=-2)

    def row_lse(self, g: Tensor) -> Tensor:
        return torch.logsumexp(self.x_rows + g.unsqueeze(-2), dim=-1)

    def col_lse(self, f: Tensor) -> Tensor:
        return torch.logsumexp(self.x_cols + f.unsqueeze(-1), dim=-2)

    @classmethod
    def build(cls, scores: Tensor, mask: Tensor | None, a: Tensor | None, b: Tensor | None) -> "_Problem":
        x = scores.to(compute_dtype(scores.dtype))
        shape = x.shape
        m = shape[-1]
        a = _check_marginal(a, "row_marginals", shape[:-1], x.dtype)
        b = _check_marginal(b, "col_marginals", shape[:-2] + (m,), x.dtype)

        keep = x > float("-inf")
        if mask is not None:
            check_tensor(mask, "mask", dtype_bool=True)
            if not broadcastable(mask.shape, shape):
                raise ValueError(
                    f"mask must broadcast to the scores shape {tuple(shape)}, got shape {tuple(mask.shape)}"
                )
            keep = keep & mask
        if a is not None:
            keep = keep & (a > 0).unsqueeze(-1)
        if b is not None:
            keep = keep & (b > 0).unsqueeze(-2)
        masked = not bool(keep.all())
        row_valid = keep.any(-1) if masked else None
        col_valid = keep.any(-2) if masked else None

        ones_r = row_valid.to(x.dtype) if masked else torch.ones(shape[:-1], dtype=x.dtype, device=x.device)
        ones_c = col_valid.to(x.dtype) if masked else torch.ones(shape[:-2] + (m,), dtype=x.dtype, device=x.device)
        n_valid = ones_r.sum(-1, keepdim=True).clamp_min(1)
        m_valid = ones_c.sum(-1, keepdim=True).clamp_min(1)
        if a is None and b is None:
            a, b = ones_r, ones_c * (n_valid / m_valid)
        elif b is None:
            a = a.expand(shape[:-1])
            b = ones_c * (a.sum(-1, keepdim=True) / m_valid)
        elif a is None:
            b = b.expand(shape[:-2] + (m,))
            a = ones_r * (b.sum(-1, keepdim=True) / n_valid)
        else:
            a, b = a.expand(shape[:-1]), b.expand(shape[:-2] + (m,))
            total_a, total_b = a.sum(-1), b.sum(-1)
            if not torch.allclose(total_a, total_b, rtol=1e-4, atol=1e-6):
                worst = (total_a - total_b).abs().argmax()
                raise ValueError(
                    "row_marginals and col_marginals must have equal totals per matrix, got "
                    f"{total_a.flatten()[worst].item():.6g} vs {total_b.flatten()[worst].item():.6g}"
                )
        if masked:
            for name, marg, valid in (("row_marginals", a, row_valid), ("col_marginals", b, col_valid)):
                if bool(((marg > 0) & ~valid).any()):
                    raise ValueError(
                        f"{name} puts mass on a {name[:3]} whose entries are all masked; "
                        "expected zero marginal there (the problem is infeasible otherwise)"
                    )
            x, row_shift, col_shift = double_shift(x.masked_fill(~keep, float("-inf")))
            x_rows = x.masked_fill(~row_valid.unsqueeze(-1), 0.0)
            x_cols = x.masked_fill(~col_valid.unsqueeze(-2), 0.0)
            log_a = torch.where(row_valid, a.clamp_min(1e-38).log(), torch.zeros_like(a))
            log_b = torch.where(col_valid, b.clamp_min(1e-38).log(), torch.zeros_like(b))
        else:
            x, row_shift, col_shift = double_shift(x)
            x_rows = x_cols = x
            log_a, log_b = a.log(), b.log()
        return cls(x, row_shift, col_shift, x_rows, x_cols, a, b, log_a, log_b, row_valid, col_valid)


def double_shift(x: Tensor, inplace: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """``x - m_i - c_j`` with :math:`m_i = \\max_j x_{ij}`, :math:`c_j = \\max_i (x_{ij} - m_i)`.

    Every row and every column of the result has maximum 0 (``-inf`` rows/columns keep shift 0).
    Sinkhorn on the shifted scores, started from :math:`g = c`, has the same iterates as on ``x``
    from :math:`g = 0` (Proposition 1 applied to each iterate), but its potentials stay small, so
    float32 keeps full precision even for score ranges of 1e4. The shifts are constants (no gradient).
    """
    row_shift = _finite_or_zero(x.detach().amax(-1))
    x = x.sub_(row_shift.unsqueeze(-1)) if inplace else x - row_shift.unsqueeze(-1)
    col_shift = _finite_or_zero(x.detach().amax(-2))
    x = x.sub_(col_shift.unsqueeze(-2)) if inplace else x - col_shift.unsqueeze(-2)
    return x, row_shift, col_shift


def _finite_or_zero(x: Tensor) -> Tensor:
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def _check_marginal(marginal: Tensor | None, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor | None:
    if marginal is None:
        return None
    check_tensor(marginal, name, floating=True)
    if not broadcastable(marginal.shape, shape):
        raise ValueError(f"{name} must broadcast to {tuple(shape)}, got shape {tuple(marginal.shape)}")
    check_finite(marginal, name)
    if bool((marginal < 0).any()):
        raise ValueError(f"{name} must be non-negative, got a minimum of {marginal.min().item():.6g}")
    return marginal.to(dtype)
