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

``domain="scaling"`` computes the same fixed count of normalisations with one exponential and
matrix-vector products (:meth:`_Problem.scaling_plan`), for callers that balance many small matrices
(the block sorting of Sparse Sinkhorn Attention); matrices whose scalings it cannot trust
(:func:`~.problem.trusted_scalings`) are recomputed in the log domain.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .._capture import exact_path, patched
from .._validation import (
    _skip_data_checks, broadcastable, check_finite, check_tensor, compute_dtype, data_checks_run, require,
)
from .loop import sinkhorn_loop
from .problem import (
    CONVERGED_TOL,
    Problem,
    SinkhornResult,
    all_of,
    any_along,
    check_iterations,
    trusted_scalings,
    column_error,
    double_shift,
    log_marginal,
    marginals,
    warn_if_unconverged,
)

__all__ = ["DOMAINS", "sinkhorn", "log_sinkhorn_loop", "attention_grads_with_graph"]

#: What :func:`sinkhorn`'s ``domain`` accepts.
DOMAINS = ("log", "scaling")


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
    domain: str = "log",
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
        domain: ``"log"`` (the reference) or ``"scaling"``: the same ``n_iters`` normalisations
            with one exponential and matrix-vector products, several times faster on small
            matrices; a matrix whose scalings are not trusted (score ranges of about 60 and more)
            is computed in the log domain. A fixed ``n_iters`` only, without ``warm_start`` or
            ``return_result``.

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
    if domain not in DOMAINS:
        raise ValueError(f"domain must be one of {DOMAINS}, got {domain!r}")
    if domain == "scaling" and (tol is not None or warm_start is not None or return_result):
        raise ValueError("domain='scaling' runs a fixed n_iters without warm_start or return_result; got "
                         f"tol={tol!r}, warm_start={'given' if warm_start is not None else None}, "
                         f"return_result={return_result!r} (use domain='log')")

    problem = _Problem.build(scores, mask, row_marginals, col_marginals)
    if domain == "scaling" and problem.x.numel():
        plan, trusted = problem.scaling_plan(n_iters)
        plan = patched(plan, ~trusted[..., None, None], _log_domain_plan, scores, problem.x.detach(), problem.a,
                       problem.b, n_iters=n_iters)
        return plan.to(scores.dtype)
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


@exact_path
def _log_domain_plan(scores: Tensor, shifted: Tensor, a: Tensor, b: Tensor, *, n_iters: int) -> Tensor:
    """:func:`sinkhorn` of ``scores`` in the log domain, with the mask (the finite entries of its problem's
    ``shifted`` scores) and the marginals its problem found (an exact path of :func:`patched`): the same plan
    as the call without them. The mask is made here, only for the calls that take this path."""
    return sinkhorn(scores, n_iters, mask=shifted > float("-inf"), row_marginals=a, col_marginals=b)


def _max_or_zero(x: Tensor) -> Tensor:
    return x.amax(-1) if x.shape[-1] else x.sum(-1)


@dataclass
class _Problem:
    """Masked scores and marginals in compute precision, ready for the loop."""

    x: Tensor  # (..., n, m) shifted scores S - m_i - c_j, -inf where masked
    row_shift: Tensor  # (..., n) m_i
    col_shift: Tensor  # (..., m) c_j
    a: Tensor  # (..., n) row marginals, 0 on invalid rows
    b: Tensor  # (..., m)
    log_a: Tensor  # finite: 0 on invalid rows
    log_b: Tensor
    row_valid: Tensor | None  # (..., n) bool, None = all valid
    col_valid: Tensor | None
    rows_zeroed: Tensor | None = None  # x with invalid rows set to 0: made on first use (the log domain's)
    cols_zeroed: Tensor | None = None

    @property
    def x_rows(self) -> Tensor:
        """``x`` with invalid rows set to 0 (finite row log-sum-exps)."""
        if self.rows_zeroed is None:
            self.rows_zeroed = self.x if self.row_valid is None else \
                torch.where(self.row_valid.unsqueeze(-1), self.x, 0.0)
        return self.rows_zeroed

    @property
    def x_cols(self) -> Tensor:
        """``x`` with invalid columns set to 0."""
        if self.cols_zeroed is None:
            self.cols_zeroed = self.x if self.col_valid is None else \
                torch.where(self.col_valid.unsqueeze(-2), self.x, 0.0)
        return self.cols_zeroed

    def matrix(self, f: Tensor, g: Tensor, last_update_was_rows: bool) -> Tensor:
        """:math:`e^{S + f \\oplus g}`, written as a SoftMax along the last normalised axis.

        After a row update :math:`P = a \\odot \\mathrm{softmax}_j(S + g)` (rows exact even when
        the potentials are ~1e4 in float32); after a column update, the transpose statement.
        """
        if last_update_was_rows:
            return self.a.unsqueeze(-1) * torch.softmax(self.x_rows + g.unsqueeze(-2), dim=-1)
        return self.b.unsqueeze(-2) * torch.softmax(self.x_cols + f.unsqueeze(-1), dim=-2)

    def scaling_plan(self, n_iters: int) -> tuple[Tensor, Tensor]:
        r"""The plan after ``n_iters`` normalisations in the scaling domain (:class:`_ScalingPlan`), and the
        ``(...)`` bool of the matrices it serves (the others' plans are finite, to be replaced by the log
        domain's): those whose scalings are trusted and where no sum with mass fell below ``tiny ** (1/4)``."""
        v0 = self.col_shift.exp().unsqueeze(-2)  # g = 0 on the scores
        plan, u_max, v_max, low, *_ = _ScalingPlan.apply(self.x, v0, self.a.unsqueeze(-2), self.b.unsqueeze(-2),
                                                        n_iters)
        return plan, trusted_scalings(u_max, v_max) & (low >= _floor(plan.dtype))

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

        keep = None if _unmasked(x, mask, a, b) else _kept(x, mask, a, b, shape)
        # under graph capture the masked form always runs (it is exact for unmasked scores too)
        masked = _skip_data_checks() or (keep is not None and not all_of(keep))
        row_valid = any_along(keep, -1) if masked else None
        col_valid = any_along(keep, -2) if masked else None
        if data_checks_run(x, on_gpus=True):
            if a is not None and b is not None:
                _check_totals(a.expand(shape[:-1]), b.expand(shape[:-2] + shape[-1:]))
            if masked:
                _check_feasible(row_marginals=(a, row_valid), col_marginals=(b, col_valid))
        a, b = marginals(row_valid, col_valid, shape, x, a, b)
        if masked:
            x, row_shift, col_shift = double_shift(torch.where(keep, x, float("-inf")), inplace=True)
            log_a, log_b = log_marginal(a, row_valid), log_marginal(b, col_valid)
        else:
            x, row_shift, col_shift = double_shift(x)
            log_a, log_b = log_marginal(a), log_marginal(b)
        return cls(x, row_shift, col_shift, a, b, log_a, log_b, row_valid, col_valid)


def _unmasked(x: Tensor, mask: Tensor | None, a: Tensor | None, b: Tensor | None) -> bool:
    """Whether no entry of the scores ``x`` is masked, told by one reduction (no mask, no marginals given,
    no ``-inf`` score), not by a bool tile: on CPUs ``x > -inf`` and its reduction took 2.4 ms at
    (128, 96, 96), the minimum 0.2 ms (informal). Never under graph capture (the masked form runs)."""
    return (mask is None and a is None and b is None and not _skip_data_checks() and x.numel() > 0
            and bool(x.amin() > float("-inf")))


def _kept(x: Tensor, mask: Tensor | None, a: Tensor | None, b: Tensor | None, shape: tuple[int, ...]) -> Tensor:
    """The entries that carry mass: a finite score, kept by ``mask``, on a row and a column of positive marginal."""
    keep = x > float("-inf")
    if mask is not None:
        check_tensor(mask, "mask", dtype_bool=True)
        if not broadcastable(mask.shape, shape):
            raise ValueError(f"mask must broadcast to the scores shape {shape}, got shape {tuple(mask.shape)}")
        keep = keep & mask
    if a is not None:
        keep = keep & (a > 0).unsqueeze(-1)
    if b is not None:
        keep = keep & (b > 0).unsqueeze(-2)
    return keep


def _floor(dtype: torch.dtype) -> float:
    """The smallest sum the scaling domain divides by: ``tiny ** (1/4)``, so that every value and
    derivative of a matrix it does not serve stays finite (its zero gradient stays zero)."""
    return torch.finfo(dtype).tiny ** 0.25


def _scaling_iterates(K: Tensor, v0: Tensor, a: Tensor, b: Tensor, n_iters: int):
    r""":func:`~.loop.sinkhorn_loop` on the scalings of :math:`K` ``(..., n, m)`` from ``v0``: :math:`u \leftarrow
    a \oslash K v` and :math:`v \leftarrow b \oslash K^\top u`, as row vectors ``(..., 1, n)`` and ``(..., 1, m)``
    (a row vector times a matrix is the fast product on CPUs), every sum clamped at :func:`_floor`.

    Returns ``us = [u_1, u_3, ..]``, ``vs = [v_0, v_2, ..]``, the sums of every update in order (before the
    clamp) and the ``(...)`` smallest sum with mass."""
    floor, sums = _floor(K.dtype), []

    def divide(marginal: Tensor, total: Tensor) -> Tensor:
        sums.append(total)
        return marginal / total.clamp_min(floor)  # no mass: 0

    run = sinkhorn_loop(lambda v, last: divide(a, v @ K.mT), lambda u, v: (divide(b, u @ K), None), v0,
                        n_iters=n_iters)
    mass = torch.cat([a > 0 if t % 2 else b > 0 for t in range(1, n_iters + 1)], -1)
    return run.fs, run.gs, sums, torch.where(mass, torch.cat(sums, -1), 1.0).amin((-2, -1))


class _ScalingPlan(torch.autograd.Function):
    r""":math:`P = \mathrm{diag}(u)\,K\,\mathrm{diag}(v)`, :math:`K = e^{x}`, after ``n_iters`` normalisations
    (:func:`_scaling_iterates`); also returns each matrix's largest scalings and smallest sum, and for its
    backward :math:`K` and the iterates, stacked (no gradient: vectors, but for :math:`K`).

    Backward: the reverse mode of the vector recursion, each update one rank-one term of :math:`dK`, collected
    into one product: :math:`dx = K \odot (\mathrm{diag}(u)\,dP\,\mathrm{diag}(v) + X^\top Y)`, where a row
    update :math:`u_t = a \oslash s_t` contributes :math:`(ds_t, v_{t-1})` with :math:`ds_t = -du_t \odot u_t
    \oslash s_t` and passes :math:`ds_t K` on to :math:`v_{t-1}`, and a column update the transposed pair.
    Differentiated twice (``create_graph=True``), the backward differentiates the recorded loop instead."""

    @staticmethod
    def forward(x: Tensor, v0: Tensor, a: Tensor, b: Tensor, n_iters: int):
        K = x.exp()  # masked entries: exp(-inf) = 0
        us, vs, sums, low = _scaling_iterates(K, v0, a, b, n_iters)
        us, vs = torch.cat(us, -2), torch.cat(vs, -2)
        plan = torch.mul(K, us[..., -1:, :].mT).mul_(vs[..., -1:, :])
        return plan, us.amax((-2, -1)), vs.amax((-2, -1)), low, K, us, vs, torch.cat(sums, -1)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, v0, a, b, ctx.n_iters = inputs
        ctx.save_for_backward(x, v0, a, b, *output[4:])
        ctx.mark_non_differentiable(*output[1:])

    @staticmethod
    def backward(ctx, dP: Tensor, *_):
        x, v0, a, b, K, us, vs, sums = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: the recorded loop, differentiable again
            K = x.exp()
            us, vs, _, _ = _scaling_iterates(K, v0, a, b, ctx.n_iters)
            needs = (ctx.needs_input_grad[0], *ctx.needs_input_grad[2:4])
            leaves = [t for t, need in zip((x, a, b), needs) if need]
            plan = us[-1].mT * K * vs[-1]
            grads = iter(torch.autograd.grad(plan, leaves, dP, create_graph=True, allow_unused=True))
            dx, da, db = (next(grads) if need else None for need in needs)
            return dx, None, da, db, None
        sums = torch.split(sums, [us.shape[-1] if t % 2 else vs.shape[-1] for t in range(1, ctx.n_iters + 1)], -1)
        us, vs = us.split(1, -2), vs.split(1, -2)
        u, v, floor = us[-1], vs[-1], _floor(K.dtype)
        G = dP * K
        du, dv = v @ G.mT, u @ G  # the plan's own dependence on its last scalings
        da = torch.zeros_like(a) if ctx.needs_input_grad[2] else None
        db = torch.zeros_like(b) if ctx.needs_input_grad[3] else None
        X, Y = [], []
        for t in range(ctx.n_iters, 0, -1):  # update t: odd a row update (u_{(t+1)/2}), even a column update
            total = sums[t - 1].clamp_min(floor)
            if t % 2:  # u_t = a / (K v_{t-1})
                if da is not None:
                    da += du / total
                ds = -du * us[(t - 1) // 2] / total
                X.append(ds), Y.append(vs[(t - 1) // 2])
                du, dv = None, ds @ K if dv is None else dv + ds @ K
            else:  # v_t = b / (K^T u_{t-1})
                if db is not None:
                    db += dv / total
                dr = -dv * vs[t // 2] / total
                X.append(us[t // 2 - 1]), Y.append(dr)
                du, dv = dr @ K.mT if du is None else du + dr @ K.mT, None
        # dx = K ⊙ XᵀY + G ⊙ u ⊙ v, in the product's output: four passes over the tile with G's
        dx = torch.matmul(torch.cat(X, -2).mT, torch.cat(Y, -2)).mul_(K)
        return dx.addcmul_(G.mul_(u.mT), v), None, da, db, None


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
