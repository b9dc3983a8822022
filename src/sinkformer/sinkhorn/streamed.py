r"""The streamed engine: never an ``n × m`` matrix, memory linear in the sequence length.

**On the CPU** it runs the scaling-domain passes of :mod:`.scaling` — the tiled engine's forward
and exact backward — on a tile that is never stored: every pass recomputes each block of query rows
(:func:`~.sizes.stream_rows`: about :data:`~.sizes.CACHE_BLOCK_ELEMENTS` scores, at least
:data:`~.sizes.MIN_BLOCK_ROWS` rows, one slice) from ``q`` and ``k`` by the same operations, so
every visit sees the same values and the results equal the tiled engine's. One slice per group,
the groups on the cores (:func:`~.cpu_parallel.map_groups`), one block of scratch memory per core.
It costs one score product and one exponential per pass where the tiled engine reads its tile back:
``5`` iterations take 4 forward and 3 backward passes.

**The log domain** (GPUs, and CPU slices whose scalings are not trusted, e.g. score ranges of 1e4):
the sweeps below, on the doubly shifted scores :math:`x = S - m_i - c_j` of
:func:`~.problem.double_shift` (computed by a first sweep, or taken from the scaling attempt), so
that the potentials stay small and float32 keeps its precision. Potentials
:math:`P = e^{x + f\oplus g}`; one sweep performs a row update *and* the column sums for the
following column update:

.. math::

    E = e^{x + f \oplus g}\ (\text{current plan}),\quad f \mathrel{+}= \log\frac{a}{E\mathbf 1},\quad
    \text{col} \mathrel{+}= (\mathrm{diag}(a/E\mathbf 1)E)^\top\mathbf 1\ \ \text{(over blocks)},\quad
    g \mathrel{+}= \log\frac{b}{\text{col}} .

After a column update every entry of the plan is at most :math:`b_j`, so :math:`E` never
overflows and one exponential per entry and sweep suffices. The first sweep subtracts the row
maximum; a row or column whose sum underflows (its scores more than ~88 below every maximum in
float32) is recomputed with a stable log-sum-exp (running maxima over blocks). ``n_iters``
updates take :math:`\lceil n\_iters/2\rceil` sweeps; the attention output comes out of the last.
Its backward (:func:`_backward`) is the exact gradient of the ``n_iters`` map: the reverse
recursion runs in :math:`\lceil L/2\rceil` sweeps (a column step and the preceding row step share
one), and a last sweep forms :math:`\partial\ell/\partial S = P\odot(dP - XY^\top)` block by block;
where potentials moved by more than :data:`_MAX_LOG_RATIO` between updates, each term's plan is
recomputed instead (the rank form would lose entries below float32's range).

Forward and backward are the custom ops ``sinkformer::streamed_forward`` /
``sinkformer::streamed_backward``. Building blocks for other callers (the dynamics toolkit):
:func:`streamed_potentials` (Sinkhorn potentials of the unshifted scores with marginals, warm
start, tolerance, the symmetric update; no gradient) and :func:`streamed_softmax`
(:math:`\mathrm{rowsoftmax}(S + \mathrm{bias})\,V`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .problem import (
    Problem,
    _finite_or_zero,
    column_error,
    log_marginal,
    warn_if_unconverged,
)
from .loop import sinkhorn_loop
from .ops import register_engine_autograd
from .sizes import row_block, stream_rows
from .scaling import GroupState, Options, run_backward, run_forward

__all__ = ["streamed_attention", "streamed_potentials", "streamed_softmax"]

ENGINE = "streamed"
#: Largest potential change across updates for the one-exponential rank-L backward: the final plan
#: then keeps every entry that matters to a term (those below float32's range weigh < e^{-87+20}).
_MAX_LOG_RATIO = 20.0
#: Largest column-potential change for which a row step's plan is taken from the column step's
#: (entries of that plan below float32's range are lost: they weigh < 1e-38 e^20 < 1e-29).
_MAX_PAIR_LOG_RATIO = 20.0
#: A row or column sum below this (or not finite) is recomputed with a stable log-sum-exp.
_UNDERFLOW = 1e-30


@dataclass
class Streamed:
    """The score matrices of a :class:`~.problem.Problem` (``group``: a group of its slices, or all of
    them) visited in row blocks of ``chunk`` rows; ``a (B, n)``, ``b (B, m)`` the marginals;
    ``row_shift (B, n)``, ``col_shift (B, m)``: the double shift subtracted from every score (``None``:
    the plain scores)."""

    group: Problem
    chunk: int
    a: Tensor | None = None
    b: Tensor | None = None
    row_shift: Tensor | None = None
    col_shift: Tensor | None = None

    @classmethod
    def build(cls, group: Problem, chunk_size: int | None = None, row_marginals: Tensor | None = None,
              col_marginals: Tensor | None = None) -> Streamed:
        """Row blocks of ``chunk_size`` rows (default :func:`~.sizes.row_block`) and the marginals."""
        streamed = cls(group, row_block(group.B, group.n, group.m, chunk_size))
        streamed.a, streamed.b = group.marginals(group.q, row_marginals, col_marginals)
        return streamed

    @property
    def q(self) -> Tensor:
        return self.group.q

    @property
    def n(self) -> int:
        return self.group.n

    @property
    def m(self) -> int:
        return self.group.m

    def blocks(self):
        for start in range(0, self.n, self.chunk):
            yield start, min(self.n, start + self.chunk)

    def shift(self) -> None:
        """A first sweep: the double shift of :func:`~.problem.double_shift` (row maxima, then column
        maxima of the row-shifted scores; 0 for rows/columns without a valid entry)."""
        B = self.q.shape[0]
        self.row_shift = self.col_shift = None
        row_shift = self.q.new_zeros(B, self.n)
        top = self.q.new_full((B, self.m), float("-inf"))
        for start, end in self.blocks():
            S = self.scores(start, end)
            shift = _finite_or_zero(S.amax(-1)) if self.m else S.new_zeros(S.shape[:-1])
            row_shift[:, start:end] = shift
            if self.m:
                top = torch.maximum(top, S.sub_(shift.unsqueeze(-1)).amax(-2))
        self.row_shift, self.col_shift = row_shift, _finite_or_zero(top)

    def scores(self, start: int, end: int, row: Tensor | None = None, col: Tensor | None = None) -> Tensor:
        """``(B, end-start, m)`` tile of ``scale q k^T + bias`` (-inf where masked), minus the double
        shift if any, ``+ row_i + col_j``: ``row`` the block's ``(B, end-start)`` slice, ``col`` a
        ``(B, m)`` vector. Without a shift ``row`` is added inside the matrix product."""
        group = self.group
        if self.row_shift is not None or (row is None and col is None):
            S = group.scores((start, end))  # the operations of the tiled engine's tile: the same shifted scores
            if self.row_shift is not None:
                S.sub_(self.row_shift[:, start:end].unsqueeze(-1)).sub_(self.col_shift.unsqueeze(1))
            if row is not None:
                S.add_(row.unsqueeze(-1))
            if col is not None:
                S.add_(col.unsqueeze(1))
            return S
        q, kT = group.q[:, start:end], group.k.transpose(1, 2)
        if row is None:
            S = torch.baddbmm(q.new_empty(()), q, kT, beta=0.0, alpha=group.scale)
        else:
            S = torch.baddbmm(row.unsqueeze(-1), q, kT, alpha=group.scale)
        if col is not None:
            S.add_(col.unsqueeze(1))
        bias = group.bias_of((start, end))
        if bias is not None:
            S.add_(bias)
        keep = group.keep_of((start, end))
        if keep is not None:
            S.masked_fill_(~keep, float("-inf"))
        return S

    def plan(self, start: int, end: int, f: Tensor, g: Tensor) -> Tensor:
        """``exp(S + f ⊕ g)`` on the rows ``[start, end)``."""
        return self.scores(start, end, f[:, start:end], g).exp_()


def _safe_log_ratio(num: Tensor, den: Tensor) -> Tensor:
    """``log(num/den)`` where ``num > 0``, else 0 (rows/columns without mass keep potential 0)."""
    ok = num > 0
    return torch.where(ok, torch.log(torch.where(ok, num, 1.0) / torch.where(ok, den, 1.0)), 0.0)


def _lost(marginal: Tensor, sums: Tensor) -> Tensor:
    """Rows/columns with mass whose sum underflowed (or overflowed)."""
    return (marginal > 0) & ~((sums > _UNDERFLOW) & torch.isfinite(sums))


def _row_update(problem: Streamed, f: Tensor | None, g: Tensor, start: int, end: int):
    """Row update on one block: returns (new f of the block, row-normalised plan block)."""
    a = problem.a[:, start:end]
    if f is None:  # first sweep: stabilise by the row maximum of S + g
        E, base = _max_stabilised(problem, g, start, end)
    else:
        base = f[:, start:end]
        E = problem.plan(start, end, f, g)
    r = E.sum(-1)
    lost = _lost(a, r)
    if bool(lost.any()):  # the row sum underflowed: use the row's own maximum
        E_max, base_max = _max_stabilised(problem, g, start, end)
        E = torch.where(lost.unsqueeze(-1), E_max, E)
        base = torch.where(lost, base_max, base)
        r = E.sum(-1)
    step = _safe_log_ratio(a, r)
    f_block = torch.where(a > 0, base + step, 0.0)
    return f_block, E.mul_(step.exp().unsqueeze(-1))


def _max_stabilised(problem: Streamed, g: Tensor, start: int, end: int) -> tuple[Tensor, Tensor]:
    """``exp(S + g - max_j(S + g))`` on a block, and the row term ``-max`` it used."""
    S = problem.scores(start, end, col=g)
    shift = S.amax(-1)
    base = -torch.where(torch.isfinite(shift), shift, 0.0)
    return S.add_(base.unsqueeze(-1)).exp_(), base


def _column_lse(problem: Streamed, f: Tensor) -> Tensor:
    """:math:`\\log\\sum_i e^{S_{ij} + f_i}` ``(B, m)`` with running column maxima (stable)."""
    top = torch.full_like(problem.b, float("-inf"))
    total = torch.zeros_like(problem.b)
    for start, end in problem.blocks():
        T = problem.scores(start, end, f[:, start:end])
        new_top = torch.maximum(top, T.amax(-2))
        safe = torch.where(torch.isfinite(new_top), new_top, 0.0)
        total = total * torch.exp(top - safe) + T.sub_(safe.unsqueeze(1)).exp_().sum(-2)
        top = new_top
    return torch.where(torch.isfinite(top), top + total.log(), float("-inf"))


def _column_update(problem: Streamed, f: Tensor, g: Tensor, col: Tensor) -> Tensor:
    """``g <- log b - LSE_i(S + f)`` from the column sums ``col`` of the row-normalised plan."""
    b = problem.b
    g_new = torch.where(b > 0, g + _safe_log_ratio(b, col), 0.0)
    lost = _lost(b, col)
    if bool(lost.any()):
        g_new = torch.where(lost, log_marginal(b) - _column_lse(problem, f), g_new)
    return g_new


def _sweeps(problem: Streamed, n_iters: int | None, tol: float | None, max_iters: int, g0: Tensor | None,
            v: Tensor | None = None, symmetric: bool = False):
    """:func:`~.loop.sinkhorn_loop` with one pass over the row blocks per row update, which also sums
    the columns for the next column update (or, the last of a fixed count, writes ``out``).

    Returns ``(fs, gs, counts, out, stop)``: ``fs = [f1, f3, ..]`` (after each row update), ``gs =
    [g0, g2, ..]`` (the start, then after each column update), ``counts (B,)`` the normalisations of
    each matrix, ``out = P V`` of the final plan when ``v`` is given, ``stop`` the
    :class:`~.problem.Tolerance` (``None`` for a fixed count; the caller warns about matrices that
    did not reach ``tol``). ``symmetric``: one row update per iteration followed by
    :math:`g \\leftarrow \\tfrac12(g + f - \\log b)` (see :func:`streamed_potentials`)."""
    B, n, m = problem.q.shape[0], problem.n, problem.m
    g0 = torch.zeros(B, m, dtype=problem.q.dtype, device=problem.q.device) if g0 is None else g0
    state = {"f": None, "col": None, "out": None}

    def row_update(g: Tensor, last: bool) -> Tensor:
        f_new = torch.empty(B, n, dtype=g.dtype, device=g.device)
        col = None if last else torch.zeros_like(g)
        out = v.new_empty(B, n, v.shape[-1]) if last and v is not None else None
        for start, end in problem.blocks():
            f_new[:, start:end], plan = _row_update(problem, state["f"], g, start, end)
            if out is not None:
                out[:, start:end] = torch.bmm(plan, v)
            if col is not None:
                col += plan.sum(-2)
        state.update(f=f_new, col=col, out=out)
        return f_new

    def col_update(f: Tensor, g: Tensor) -> tuple[Tensor, Tensor | None]:
        col, b = state["col"], problem.b
        error = None if tol is None else column_error(col, b)
        if symmetric:
            return torch.where(b > 0, 0.5 * (g + f - log_marginal(b)), 0.0), error
        return _column_update(problem, state["f"], g, col), error

    run = sinkhorn_loop(row_update, col_update, g0, n_iters=n_iters, tol=tol, max_iters=max_iters, engine=ENGINE,
                        symmetric=symmetric)
    out = state["out"]
    if v is not None and out is None:  # the plan was last normalised by columns (or tol mode)
        out = _plan_times(problem, run.fs[-1], run.gs[-1], v)
    return run.fs, run.gs, run.counts, out, run.stop


def _plan_times(problem: Streamed, f: Tensor, g: Tensor, v: Tensor) -> Tensor:
    """``exp(S + f ⊕ g) @ v`` block by block."""
    out = v.new_empty(v.shape[0], problem.n, v.shape[-1])
    for start, end in problem.blocks():
        out[:, start:end] = torch.bmm(problem.plan(start, end, f, g), v)
    return out


def streamed_potentials(
    q: Tensor,
    k: Tensor,
    *,
    scale: float = 1.0,
    n_iters: int | None = None,
    tol: float | None = None,
    max_iters: int = 1000,
    row_marginals: Tensor | None = None,
    col_marginals: Tensor | None = None,
    bias: Tensor | None = None,
    keep: Tensor | None = None,
    warm_start: Tensor | None = None,
    chunk_size: int | None = None,
    symmetric: bool = False,
) -> tuple[Tensor, Tensor, Tensor, bool | None]:
    """Sinkhorn potentials of ``S = scale q k^T + bias`` without an ``n × m`` matrix (no gradient).

    ``q (B, n, d)``, ``k (B, m, d)``, marginals ``(B, n)``/``(B, m)`` (defaults as in
    :func:`sinkformer.sinkhorn`), ``bias``/``keep`` broadcastable to ``(B, n, m)``, ``warm_start``
    a previous ``g`` ``(B, m)``. Iteration count and stop rule: :mod:`.problem`.

    ``symmetric=True`` (with ``tol``) is the averaged update of Feydy et al. (2019) for scores
    :math:`C_{ij} + \\log b_j + \\mathrm{const}` with :math:`C` symmetric and ``a = b``: each
    iteration is one row normalisation followed by :math:`g \\leftarrow \\tfrac12(g + f - \\log b)`,
    whose fixed point is the (symmetric) balanced plan. Alternating updates flip the sign of the
    slow error mode at every step, so for a PSD :math:`C` at small temperature they need
    :math:`O(1/\\varepsilon)` normalisations; averaging cancels that mode. ``max_iters`` then counts
    row normalisations.

    Returns ``(f, g, counts, converged)`` with :math:`P = e^{S + f\\oplus g}`, ``counts (B,)`` the
    normalisations each matrix ran and ``converged`` whether all reached ``tol`` (``None`` without
    ``tol``; those that did not emitted a :class:`~.problem.SinkhornConvergenceWarning`).
    """
    with torch.no_grad():
        problem = Streamed.build(Problem(q, k, None, keep, bias, (q.shape[0],), scale, n_iters, tol, max_iters),
                                 chunk_size, row_marginals, col_marginals)
        fs, gs, counts, _, stop = _sweeps(problem, n_iters, tol, max_iters, warm_start, symmetric=symmetric)
    converged = None
    if stop is not None:
        warn_if_unconverged([stop])
        converged = not bool(stop.active.any())
    return fs[-1], gs[-1], counts, converged


def streamed_softmax(
    q: Tensor, k: Tensor, v: Tensor, *, scale: float = 1.0, bias: Tensor | None = None,
    keep: Tensor | None = None, chunk_size: int | None = None,
) -> Tensor:
    """``rowsoftmax(scale q k^T + bias) @ v`` block by block (no gradient); empty rows give 0."""
    with torch.no_grad():
        problem = Streamed.build(Problem(q, k, v, keep, bias, (q.shape[0],), scale, 1), chunk_size)
        out = v.new_empty(q.shape[0], problem.n, v.shape[-1])
        for start, end in problem.blocks():
            S = problem.scores(start, end)
            shift = S.amax(-1, keepdim=True)
            E = S.sub_(torch.where(torch.isfinite(shift), shift, 0.0)).exp_()
            out[:, start:end] = torch.bmm(E, v) / E.sum(-1, keepdim=True).clamp_min(torch.finfo(E.dtype).tiny)
    return out


def streamed_attention(problem: Problem, *, chunk_size: int | None = None) -> Tensor:
    """Sinkhorn attention ``(B, n, d) x (B, m, d) x (B, m, e) -> (B, n, e)`` of a validated
    :class:`~.problem.Problem`, streamed; ``chunk_size``: query rows per block (default
    :func:`~.sizes.stream_rows`)."""
    rows = stream_rows(problem.n, problem.m, chunk_size)
    return _forward_autograd(*problem.fields(), rows)[0]


def _options(q: Tensor, rows: int) -> Options:
    """One slice per group on the CPU (the groups share the cores), every slice at once on a GPU."""
    group = 1 if q.device.type == "cpu" else max(1, q.shape[0])
    return Options("unrolled", 0.0, "auto", group, rows=rows, stored=False, engine=ENGINE)


def _forward_impl(
    q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None, bias: Tensor | None, batch: list[int], scale: float,
    n_iters: int | None, tol: float | None, max_iters: int, rows: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The problem's fields (:meth:`~.problem.Problem.fields`), then the rows per block. Returns ``out (B,
    n, e)``, the shifts ``(B, n)``, ``(B, m)``, the iterates ``(B, n, Lu)``, ``(B, m, Lv)`` (scalings, or
    potentials where the log domain ran), the normalisations run ``(B,)`` and the domain of each slice
    ``(B,)`` (True: log)."""
    problem = Problem(q, k, v, keep, bias, batch, scale, n_iters, tol, max_iters)
    return run_forward(problem, None, _options(q, rows), _log_forward)[:7]  # tiles: never kept


_forward_op = torch.library.custom_op("sinkformer::streamed_forward", _forward_impl, mutates_args=())


@_forward_op.register_fake
def _(q, k, v, keep, bias, batch, scale, n_iters, tol, max_iters, rows):
    B, n, m = q.shape[0], q.shape[1], k.shape[1]
    lengths = Problem(q, k, v, keep, bias, batch, scale, n_iters, tol, max_iters).history_length()
    if lengths is None:
        length = torch.library.get_ctx().new_dynamic_size()
        lengths = (length, length)
    return (q.new_empty(B, n, v.shape[-1]), q.new_empty(B, n), q.new_empty(B, m), q.new_empty(B, n, lengths[0]),
            q.new_empty(B, m, lengths[1]), q.new_empty(B, dtype=torch.int64), q.new_empty(B, dtype=torch.bool))


def _backward_impl(
    grad_out: Tensor, out: Tensor, q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None, bias: Tensor | None,
    batch: list[int], scale: float, n_iters: int | None, tol: float | None, max_iters: int, row_shift: Tensor,
    col_shift: Tensor, us: Tensor, vs: Tensor, counts: Tensor, log_domain: Tensor, rows: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients ``(dq, dk, dv)``: the output and its gradient, the problem's fields, the forward's saved
    state, the rows per block."""
    problem = Problem(q, k, v, keep, bias, batch, scale, n_iters, tol, max_iters)
    return run_backward(grad_out, problem, out, None, row_shift, col_shift, us, vs, counts, log_domain,
                        q.new_empty(0), _options(q, rows), _log_backward)


_backward_op = torch.library.custom_op("sinkformer::streamed_backward", _backward_impl, mutates_args=())


@_backward_op.register_fake
def _(grad_out, out, q, k, v, *rest):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, keep, bias, batch, scale, n_iters, tol, max_iters, rows = inputs
    out, row_shift, col_shift, us, vs, counts, log_domain = output
    ctx.save_for_backward(q, k, v, out, keep, bias, row_shift, col_shift, us, vs, counts, log_domain)
    ctx.schedule, ctx.rows = (batch, scale, n_iters, tol, max_iters), rows


def _first_derivatives(ctx, grad_out, backward):
    q, k, v, out, keep, bias, row_shift, col_shift, us, vs, counts, log_domain = ctx.saved_tensors
    return backward(grad_out, out, q, k, v, keep, bias, *ctx.schedule, row_shift, col_shift, us, vs, counts,
                    log_domain, ctx.rows)


def _second_derivatives(ctx, grad_out):
    from .dense import attention_grads_with_graph

    q, k, v, out, keep, bias, *_ = ctx.saved_tensors
    return attention_grads_with_graph(grad_out, Problem(q, k, v, keep, bias, *ctx.schedule))


_forward_autograd = register_engine_autograd(
    "sinkformer::streamed_forward", "sinkformer::streamed_backward", n_inputs=11, forward_impl=_forward_impl,
    backward_impl=_backward_impl,
    setup_context=_setup_context, first_derivatives=_first_derivatives, second_derivatives=_second_derivatives)


def _group_problem(group: Problem, options: Options, row_shift, col_shift) -> Streamed:
    """The row blocks of one group, on its doubly shifted scores (the shifts given, or computed by a
    first sweep)."""
    problem = Streamed.build(group, options.rows)
    if row_shift is None:
        problem.shift()
    else:
        problem.row_shift, problem.col_shift = row_shift, col_shift
    return problem


def _log_forward(group: Problem, options: Options, seed, out: Tensor, row_shift: Tensor | None,
                 col_shift: Tensor | None) -> GroupState:
    """Forward of one group in the log domain, on the doubly shifted scores (potentials of ``x = S - m -
    c`` started from ``g = c``: the iterates of ``S`` from ``g = 0``, Proposition 1)."""
    problem = _group_problem(group, options, row_shift, col_shift)
    fs, gs, counts, o, stop = _sweeps(problem, group.n_iters, group.tol, group.max_iters, problem.col_shift,
                                      v=group.v)
    out.copy_(o)
    return GroupState(problem.row_shift, problem.col_shift, torch.stack(fs, -1), torch.stack(gs, -1), counts, True,
                      stop)


def _log_backward(grad_out, group: Problem, out, options: Options, seed, row_shift, col_shift, fs, gs, counts,
                  grads) -> None:
    """Gradients of one group computed in the log domain, written into ``grads``."""
    problem = _group_problem(group, options, row_shift, col_shift)
    for grad, value in zip(grads, _backward(problem, group.v, out, grad_out, fs, gs, counts)):
        grad.copy_(value)


def _pots_after(t: int, fs: Tensor, gs: Tensor) -> tuple[Tensor, Tensor]:
    """Potentials of the plan after update ``t`` (odd: rows, even: columns)."""
    if t % 2:
        return fs[..., (t - 1) // 2], gs[..., (t - 1) // 2]
    return fs[..., t // 2 - 1], gs[..., t // 2]


def _backward(problem: Streamed, v, out, dO, fs, gs, counts):
    """Exact reverse mode through the updates; see the module docstring. Steps ``t > counts`` of a
    matrix were frozen (identity: the gradient passes through)."""
    a, b = problem.a, problem.b
    inv_a = torch.where(a > 0, 1 / a.clamp_min(1e-38), 0.0)
    inv_b = torch.where(b > 0, 1 / b.clamp_min(1e-38), 0.0)
    L = fs.shape[-1] + gs.shape[-1] - 1
    f_L, g_L = fs[..., -1], gs[..., -1]  # potentials of the final plan P
    dF = (dO * out).sum(-1)  # d loss / d f of the final plan
    dv = torch.zeros_like(v)
    dG_rows = torch.zeros_like(b)
    coefs: list[tuple[int, Tensor]] = []  # (t, coefficient vector) of each update's term
    active = lambda t: (counts >= t).unsqueeze(-1)  # noqa: E731

    # sweep A: dV = P^T dO, and (L odd) the row step t = L
    row_coef = torch.where(active(L), dF * inv_a, 0.0) if L % 2 else None
    for start, end in problem.blocks():
        P = problem.plan(start, end, f_L, g_L)
        dv += torch.bmm(P.transpose(1, 2), dO[:, start:end])
        if row_coef is not None:
            dG_rows -= torch.bmm(row_coef[:, start:end].unsqueeze(1), P).squeeze(1)
    dG = (v * dv).sum(-1)
    if row_coef is not None:
        coefs.append((L, row_coef))
        dG, dF = dG + dG_rows, torch.where(active(L), 0.0, dF)
    # pairs (t even, t - 1 odd), one sweep each
    for t in range(L - (L % 2), 0, -2):
        col_coef = torch.where(active(t), dG * inv_b, 0.0)
        dG = torch.where(active(t), 0.0, dG)
        dF_pair = dF.clone()
        row_coef = torch.empty_like(dF)
        act_rows = active(t - 1)
        fC, gC = _pots_after(t, fs, gs)
        fR, gR = _pots_after(t - 1, fs, gs)
        # the column update t leaves f alone: R = C diag(e^{gR - gC}), so R^T x = e^{gR - gC} (C^T x)
        # (one exponential per entry instead of two, while the factor stays moderate)
        col_factor = (gR - gC).exp() if t > 2 and _abs_max(gR - gC) <= _MAX_PAIR_LOG_RATIO else None
        dG_pair = torch.zeros_like(dG) if col_factor is not None else None
        for start, end in problem.blocks():
            C = problem.plan(start, end, fC, gC)  # plan after update t (columns)
            dF_pair[:, start:end] -= torch.bmm(C, col_coef.unsqueeze(-1)).squeeze(-1)
            row_coef[:, start:end] = torch.where(act_rows, dF_pair[:, start:end] * inv_a[:, start:end], 0.0)
            if col_factor is not None:
                dG_pair += torch.bmm(row_coef[:, start:end].unsqueeze(1), C).squeeze(1)
            elif t > 2:  # the row step t - 1 feeds g of update t - 2 (g before update 1 is a constant)
                R = problem.plan(start, end, fR, gR)  # plan after update t - 1 (rows)
                dG -= torch.bmm(row_coef[:, start:end].unsqueeze(1), R).squeeze(1)
        if col_factor is not None:
            dG -= col_factor * dG_pair
        coefs += [(t, col_coef), (t - 1, row_coef)]
        dF = torch.where(active(t - 1), 0.0, dF_pair)

    X, Y, exact_terms = _rank_factors(coefs, fs, gs, f_L, g_L)
    dq, dk = torch.empty_like(problem.q), torch.zeros_like(problem.group.k)
    for start, end in problem.blocks():
        P = problem.plan(start, end, f_L, g_L)
        T = torch.bmm(dO[:, start:end], v.transpose(1, 2))
        if exact_terms is None:
            T.baddbmm_(X[:, start:end], Y.transpose(1, 2), alpha=-1.0)
            dS = T.mul_(P)
        else:  # potentials moved too far for the rank-L form: one exponential per term
            dS = T.mul_(P)
            for t, coef in exact_terms:
                M = problem.plan(start, end, *_pots_after(t, fs, gs))
                dS -= M * (coef[:, start:end].unsqueeze(-1) if t % 2 else coef.unsqueeze(1))
        dq[:, start:end] = torch.bmm(dS, problem.group.k).mul_(problem.group.scale)
        dk += torch.bmm(dS.transpose(1, 2), problem.q[:, start:end]).mul_(problem.group.scale)
    return dq, dk, dv


def _rank_factors(coefs, fs, gs, f_L, g_L):
    """Write ``sum_t coef_t * M^t`` as ``P * (X Y^T)`` with ``M^t = P * exp(df_t ⊕ dg_t)``.

    Returns ``(X, Y, None)``, or ``(None, None, coefs)`` when a potential moved by more than
    :data:`_MAX_LOG_RATIO` between updates (the exponentials could overflow)."""
    xs, ys = [], []
    for t, coef in coefs:
        f_t, g_t = _pots_after(t, fs, gs)
        df, dg = f_t - f_L, g_t - g_L
        if max(_abs_max(df), _abs_max(dg)) > _MAX_LOG_RATIO:
            return None, None, coefs
        if t % 2:  # row update: coefficient on rows
            xs.append(coef * df.exp())
            ys.append(dg.exp())
        else:
            xs.append(df.exp())
            ys.append(coef * dg.exp())
    return torch.stack(xs, -1), torch.stack(ys, -1), None


def _abs_max(x: Tensor) -> float:
    return x.abs().max().item() if x.numel() else 0.0
