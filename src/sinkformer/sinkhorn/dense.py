r"""The dense engine: the log-domain reference, differentiated by autograd.

Given scores :math:`S \in \mathbb{R}^{n\times m}` (any leading batch shape), Sinkhorn's
algorithm finds log-potentials :math:`f \in \mathbb{R}^n`, :math:`g \in \mathbb{R}^m` such that

.. math::

    P_{ij} = \exp(S_{ij} + f_i + g_j),\qquad P\mathbf 1 = a,\qquad P^\top \mathbf 1 = b .

It alternates, in the log domain (Sinkformers paper, eq. (3) and Appendix B), starting from
:math:`g = 0`:

.. math::

    f_i \leftarrow \log a_i - \log\sum_j e^{S_{ij} + g_j} \quad(\text{rows}),\qquad
    g_j \leftarrow \log b_j - \log\sum_i e^{S_{ij} + f_i} \quad(\text{columns}).

This is POT's scaling convention (``ot.sinkhorn(a, b, M=-S, reg=1)`` gives the same limit). The
whole ``n × m`` matrix exists and autograd records every iteration, so memory is
:math:`O(nm\cdot n\_iters)` when differentiated; every other engine is held to this one by the
conformance suite. Marginals, masks, iteration count and stop rule: :mod:`.problem`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .._validation import (
    _skip_data_checks, broadcastable, check_finite, check_tensor, compute_dtype, data_checks_run, require,
)
from .loop import sinkhorn_loop
from .problem import (
    CONVERGED_TOL,
    Problem,
    SinkhornResult,
    check_iterations,
    column_error,
    double_shift,
    log_marginal,
    marginals,
    warn_if_unconverged,
)

__all__ = ["sinkhorn", "log_sinkhorn_loop", "attention_grads_with_graph"]


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
    engine: str = "dense",
) -> tuple[Tensor, Tensor, Tensor]:
    """The alternating log-domain updates (:func:`~.loop.sinkhorn_loop`) against log-sum-exp operators.

    ``row_lse(g)`` returns :math:`\\log\\sum_j e^{S_{ij}+g_j}` ``(..., n)`` and ``col_lse(f)``
    :math:`\\log\\sum_i e^{S_{ij}+f_i}` ``(..., m)``. ``log_a``/``log_b`` are the log-marginals
    (finite: 0 on invalid rows/columns), ``row_valid``/``col_valid`` the valid rows/columns
    (``None``: all valid), ``g`` the starting column potential. With ``tol`` (``b`` given), each
    matrix iterates until its column error is <= ``tol`` (:class:`~.problem.Tolerance`).

    Returns ``(f, g, iterations)`` with ``iterations`` the ``(...)`` int64 count per matrix.
    """

    def update(log_marginal: Tensor, lse: Tensor, valid: Tensor | None) -> Tensor:
        pot = log_marginal - lse
        return pot if valid is None else torch.where(valid, pot, torch.zeros_like(pot))

    def col_update(f: Tensor, g: Tensor) -> tuple[Tensor, Tensor | None]:
        lse = col_lse(f)
        error = None if tol is None else column_error(torch.exp(g + lse), b)
        return update(log_b, lse, col_valid), error

    run = sinkhorn_loop(lambda g, last: update(log_a, row_lse(g), row_valid), col_update,
                        torch.zeros_like(log_b) if g is None else g, n_iters=n_iters, tol=tol, max_iters=max_iters,
                        engine=engine)
    if run.stop is not None:
        warn_if_unconverged([run.stop])
    return run.fs[-1], run.gs[-1], run.counts


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
        tol: a finite number > 0: each matrix iterates (ending on a row update) until its column
            error :math:`\\max_j|\\sum_i P_{ij} - b_j|` is <= ``tol`` (rows are exact), or
            ``max_iters`` normalisations ran — then a
            :class:`~sinkformer.SinkhornConvergenceWarning` states the error reached.
        max_iters: cap on normalisations in ``tol`` mode.
        mask: bool, broadcastable to ``scores``; True = keep. Masked entries get no mass;
            rows/columns with no kept entry are excluded from both normalisations.
        row_marginals: ``(..., n)`` non-negative target row sums :math:`a` (default 1 per
            valid row, or uniform with the column total if only ``col_marginals`` is given).
        col_marginals: ``(..., m)`` non-negative target column sums :math:`b` (default
            uniform over valid columns with the row total, i.e. ``n/m`` when unmasked).
            Both totals must agree.
        warm_start: ``(..., m)`` finite column log-potential ``g`` of an earlier solve to start
            from (the first update recomputes ``f``).
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
    check_iterations(n_iters, tol, max_iters)
    check_finite(scores, "scores", allow_neg_inf=True)

    problem = _Problem.build(scores, mask, row_marginals, col_marginals)
    if warm_start is not None:
        check_tensor(warm_start, "warm_start", floating=True)
        if not broadcastable(warm_start.shape, problem.log_b.shape):
            raise ValueError(
                f"warm_start must broadcast to {tuple(problem.log_b.shape)} (the column potential g), "
                f"got shape {tuple(warm_start.shape)}"
            )
        check_finite(warm_start, "warm_start")
        warm_start = warm_start.to(problem.x.dtype).expand_as(problem.log_b)
        if problem.col_valid is not None:
            warm_start = torch.where(problem.col_valid, warm_start, torch.zeros_like(warm_start))
    # potentials of the shifted scores: g = 0 on S is g = c on S - m - c
    g0 = problem.col_shift if warm_start is None else warm_start + problem.col_shift

    f, g, counts = log_sinkhorn_loop(
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
    # every matrix ends on a row update in tol mode; with a fixed count, on n_iters' parity
    plan = problem.matrix(f, g, last_update_was_rows=tol is not None or n_iters % 2 == 1)
    f, g = f - problem.row_shift, g - problem.col_shift  # back to potentials of the input scores
    if not return_result:
        return plan.to(scores.dtype)

    with torch.no_grad():
        row_error = _max_or_zero((plan.sum(-1) - problem.a).abs())
        col_error = _max_or_zero((plan.sum(-2) - problem.b).abs())
        limit = CONVERGED_TOL if tol is None else tol
        converged = bool(torch.maximum(row_error, col_error).max() <= limit) if row_error.numel() else True
    done = int(counts.max()) if counts.numel() else (n_iters or 0)
    return SinkhornResult(plan.to(scores.dtype), f, g, row_error, col_error, done, converged, counts)


def _max_or_zero(x: Tensor) -> Tensor:
    return x.amax(-1) if x.shape[-1] else x.sum(-1)


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
        shape = tuple(x.shape)
        a = _check_marginal(a, "row_marginals", shape[:-1], x.dtype)
        b = _check_marginal(b, "col_marginals", shape[:-2] + shape[-1:], x.dtype)

        keep = x > float("-inf")
        if mask is not None:
            check_tensor(mask, "mask", dtype_bool=True)
            if not broadcastable(mask.shape, shape):
                raise ValueError(
                    f"mask must broadcast to the scores shape {shape}, got shape {tuple(mask.shape)}"
                )
            keep = keep & mask
        if a is not None:
            keep = keep & (a > 0).unsqueeze(-1)
        if b is not None:
            keep = keep & (b > 0).unsqueeze(-2)
        # under graph capture the masked form always runs (it is exact for unmasked scores too)
        masked = _skip_data_checks() or not bool(keep.all())
        row_valid = keep.any(-1) if masked else None
        col_valid = keep.any(-2) if masked else None
        if data_checks_run(x, on_gpus=True):
            if a is not None and b is not None:
                _check_totals(a.expand(shape[:-1]), b.expand(shape[:-2] + shape[-1:]))
            if masked:
                _check_feasible(row_marginals=(a, row_valid), col_marginals=(b, col_valid))
        a, b = marginals(row_valid, col_valid, shape, x, a, b)
        if masked:
            x, row_shift, col_shift = double_shift(x.masked_fill(~keep, float("-inf")))
            x_rows = x.masked_fill(~row_valid.unsqueeze(-1), 0.0)
            x_cols = x.masked_fill(~col_valid.unsqueeze(-2), 0.0)
            log_a, log_b = log_marginal(a, row_valid), log_marginal(b, col_valid)
        else:
            x, row_shift, col_shift = double_shift(x)
            x_rows = x_cols = x
            log_a, log_b = log_marginal(a), log_marginal(b)
        return cls(x, row_shift, col_shift, x_rows, x_cols, a, b, log_a, log_b, row_valid, col_valid)


def _check_totals(a: Tensor, b: Tensor) -> None:
    total_a, total_b = a.sum(-1), b.sum(-1)
    message = "row_marginals and col_marginals must have equal totals per matrix"

    def named() -> str:
        worst = (total_a - total_b).abs().argmax()
        return f"{message}, got {total_a.flatten()[worst].item():.6g} vs {total_b.flatten()[worst].item():.6g}"

    require(torch.isclose(total_a, total_b, rtol=1e-4, atol=1e-6).all(), message, named=named)


def _check_feasible(**given: tuple[Tensor | None, Tensor]) -> None:
    """Mass on a row/column whose entries are all masked makes the problem infeasible."""
    for name, (marg, valid) in given.items():
        if marg is not None:
            require(~((marg > 0) & ~valid).any(), f"{name} puts mass on a {name[:3]} whose entries are all masked; "
                    "expected zero marginal there (the problem is infeasible otherwise)")


def _check_marginal(marginal: Tensor | None, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor | None:
    if marginal is None:
        return None
    check_tensor(marginal, name, floating=True)
    if not broadcastable(marginal.shape, shape):
        raise ValueError(f"{name} must broadcast to {tuple(shape)}, got shape {tuple(marginal.shape)}")
    check_finite(marginal, name)
    if data_checks_run(marginal, on_gpus=True):
        require(~(marginal < 0).any(), f"{name} must be non-negative",
                named=lambda: f"{name} must be non-negative, got a minimum of {marginal.min().item():.6g}")
    return marginal.to(dtype)


def attention_grads_with_graph(grad_out: Tensor, problem: Problem, *, drop: Tensor | None = None
                               ) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of Sinkhorn attention ``(P ⊙ drop) V`` of ``problem`` (``(B, n, d)`` operands, flat
    batch) recorded by autograd, so that they can be differentiated again: how the other engines serve
    second derivatives (``create_graph=True``), at this engine's memory."""
    q, k, v, B, n, m = problem.q, problem.k, problem.v, problem.B, problem.n, problem.m
    S = problem.scale * (q @ k.transpose(1, 2))
    bias = problem.bias_of()
    if bias is not None:
        S = S + bias
    keep = problem.keep_of()
    P = sinkhorn(S, problem.n_iters if problem.tol is None else None, tol=problem.tol, max_iters=problem.max_iters,
                 mask=None if keep is None else keep.expand(B, n, m))
    if drop is not None:
        P = P * drop
    return torch.autograd.grad(P @ v, (q, k, v), grad_out, create_graph=True)
