r"""Streamed (chunked) Sinkhorn: never an ``n × m`` matrix, memory linear in the sequence length.

Scores :math:`S = \mathrm{scale}\,QK^\top + \mathrm{bias}` are recomputed block by block: a
*sweep* visits blocks of ``chunk`` query rows, each against all keys (a ``(B, chunk, m)`` tile,
``B`` the flattened batch), so memory is :math:`O(B(n+m)d + B\cdot\mathrm{chunk}\cdot m)`.

Potentials are kept in the log domain (:math:`P = e^{S + f\oplus g}`) and one sweep performs a
row update *and* the following column update:

.. math::

    E = e^{S + f \oplus g}\ (\text{current plan}),\quad f \mathrel{+}= \log\frac{a}{E\mathbf 1},\quad
    \text{col} \mathrel{+}= (\mathrm{diag}(a/E\mathbf 1)E)^\top\mathbf 1\ \ \text{(over blocks)},\quad
    g \mathrel{+}= \log\frac{b}{\text{col}} .

After a column update every entry of the plan is at most :math:`b_j`, so :math:`E` never
overflows and one exponential per entry and sweep suffices (the first sweep subtracts the row
maximum; a row whose sum underflows is recomputed with its own maximum). ``n_iters`` updates take
:math:`\lceil n\_iters/2\rceil` sweeps; the attention output comes out of the last one.

The backward of :class:`StreamedSinkhornAttention` is the exact gradient of the ``n_iters`` map: the
potentials of every update are kept (:math:`O(n\,L)`), the reverse recursion runs in
:math:`\lceil L/2\rceil` sweeps (a column step and the preceding row step share one), and a last
sweep forms :math:`\partial\ell/\partial S = P\odot(dP - XY^\top)` block by block and contracts it
into :math:`dQ, dK` (same algebra as :mod:`sinkformer.attention.sinkhorn_fast`).

Building blocks for other callers (the dynamics toolkit): :func:`streamed_potentials` (Sinkhorn
potentials with marginals, warm start, tolerance; no gradient) and :func:`streamed_softmax`
(:math:`\mathrm{rowsoftmax}(S + \mathrm{bias})\,V`, e.g. out-of-sample evaluation with
:math:`\mathrm{bias} = g + \log w`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["streamed_sinkhorn_attention", "streamed_potentials", "streamed_softmax", "BLOCK_ELEMENTS"]

#: Elements of one ``(B, chunk, m)`` score tile when ``chunk_size`` is not given ...
BLOCK_ELEMENTS = 1 << 20
#: ... but at least this many query rows per block: thinner blocks waste the matrix products
#: (b=4, h=8, n=2048: forward 2.0 s with 16 rows, 0.8 s with 64). Memory stays linear in ``m``.
MIN_CHUNK = 64
#: Largest potential change across iterations for the one-exponential rank-L backward.
_MAX_LOG_RATIO = 80.0


@dataclass
class Streamed:
    """A batch of score matrices given by ``q, k`` (+ masks), visited in row blocks.

    ``q (B, n, d)``, ``k (B, m, d)``; ``keep``/``bias`` broadcast to ``batch + (n, m)`` (they are
    sliced per block, never expanded whole); ``a (B, n)``, ``b (B, m)`` the marginals.
    """

    q: Tensor
    k: Tensor
    scale: float
    batch: tuple[int, ...]
    chunk: int
    keep: Tensor | None = None
    bias: Tensor | None = None
    a: Tensor | None = None
    b: Tensor | None = None

    @classmethod
    def build(cls, q, k, scale, batch, chunk_size=None, keep=None, bias=None, row_marginals=None, col_marginals=None):
        B, n, m = q.shape[0], q.shape[1], k.shape[1]
        chunk = chunk_size or max(MIN_CHUNK, BLOCK_ELEMENTS // max(1, B * m))
        problem = cls(q, k, scale, batch, min(chunk, n), keep, bias)
        problem.a, problem.b = problem._marginals(row_marginals, col_marginals)
        return problem

    @property
    def n(self) -> int:
        return self.q.shape[1]

    @property
    def m(self) -> int:
        return self.k.shape[1]

    def blocks(self):
        for start in range(0, self.n, self.chunk):
            yield start, min(self.n, start + self.chunk)

    def _rows(self, t: Tensor | None, start: int, end: int) -> Tensor | None:
        if t is None:
            return None
        t = t[..., start:end, :] if t.shape[-2] != 1 else t
        return t.expand(self.batch + (end - start, self.m)).reshape(-1, end - start, self.m)

    def keep_of(self, start: int, end: int) -> Tensor | None:
        return self._rows(self.keep, start, end)

    def scores(self, start: int, end: int, row: Tensor | None = None, col: Tensor | None = None) -> Tensor:
        """``(B, end-start, m)`` tile of ``scale q k^T + bias (+ row_i + col_j)``, -inf where masked.

        ``row`` is the block's ``(B, end-start)`` slice (added inside the matrix product), ``col``
        a ``(B, m)`` vector."""
        q = self.q[:, start:end]
        if row is None:
            S = torch.baddbmm(q.new_empty(()), q, self.k.transpose(1, 2), beta=0.0, alpha=self.scale)
        else:
            S = torch.baddbmm(row.unsqueeze(-1), q, self.k.transpose(1, 2), alpha=self.scale)
        if col is not None:
            S.add_(col.unsqueeze(1))
        bias = self._rows(self.bias, start, end)
        if bias is not None:
            S.add_(bias)
        keep = self.keep_of(start, end)
        if keep is not None:
            S.masked_fill_(~keep, float("-inf"))
        return S

    def plan(self, start: int, end: int, f: Tensor, g: Tensor) -> Tensor:
        """``exp(S + f ⊕ g)`` on the rows ``[start, end)``."""
        return self.scores(start, end, f[:, start:end], g).exp_()

    def _marginals(self, a: Tensor | None, b: Tensor | None) -> tuple[Tensor, Tensor]:
        """Given marginals, or those of the valid sub-matrix (rows 1, columns n_valid/m_valid)."""
        B, n, m = self.q.shape[0], self.n, self.m
        like = self.q
        if self.keep is None:
            rows, cols = like.new_ones(B, n), like.new_ones(B, m)
        else:
            rows, cols = like.new_empty(B, n), torch.zeros(B, m, dtype=torch.bool, device=like.device)
            for start, end in self.blocks():
                keep = self.keep_of(start, end)
                rows[:, start:end] = keep.any(-1)
                cols |= keep.any(-2)
            cols = cols.to(like.dtype)
        if a is None and b is None:
            return rows, cols * (rows.sum(-1, keepdim=True) / cols.sum(-1, keepdim=True).clamp_min(1))
        if b is None:
            a = a.expand(B, n) * rows
            return a, cols * (a.sum(-1, keepdim=True) / cols.sum(-1, keepdim=True).clamp_min(1))
        if a is None:
            b = b.expand(B, m) * cols
            return rows * (b.sum(-1, keepdim=True) / rows.sum(-1, keepdim=True).clamp_min(1)), b
        return a.expand(B, n) * rows, b.expand(B, m) * cols


def _safe_log_ratio(num: Tensor, den: Tensor) -> Tensor:
    """``log(num/den)`` where ``num > 0``, else 0 (rows/columns without mass keep potential 0)."""
    ok = num > 0
    return torch.where(ok, torch.log(torch.where(ok, num, 1.0) / torch.where(ok, den, 1.0)), 0.0)


def _row_update(problem: Streamed, f: Tensor | None, g: Tensor, start: int, end: int):
    """Row update on one block: returns (new f of the block, row-normalised plan block)."""
    a = problem.a[:, start:end]
    if f is None:  # first sweep: stabilise by the row maximum of S + g
        E, base = _max_stabilised(problem, g, start, end)
    else:
        base = f[:, start:end]
        E = problem.plan(start, end, f, g)
    r = E.sum(-1)
    lost = (a > 0) & ~((r > 1e-30) & torch.isfinite(r))
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


def _sweeps(problem: Streamed, n_iters: int | None, tol: float | None, max_iters: int, g0: Tensor | None,
            v: Tensor | None = None, history: bool = False):
    """Run the updates; returns ``(f, g, done, converged, out, fs, gs)``.

    ``out = P V`` of the final plan when ``v`` is given. With ``history=True``, ``fs``/``gs`` hold
    the potentials after every update — after update ``t`` the plan is ``exp(S + fs[t-1] ⊕ gs[t])``
    (``gs[0]`` is the starting ``g``) — as the backward needs them."""
    B, n, m = problem.q.shape[0], problem.n, problem.m
    g = torch.zeros(B, m, dtype=problem.q.dtype, device=problem.q.device) if g0 is None else g0
    f = None
    done, converged = 0, None
    fs, gs = [], [g]
    out = None
    while True:
        last_row_update = tol is None and done + 1 >= n_iters
        f_new = torch.empty(B, n, dtype=g.dtype, device=g.device)
        col = torch.zeros_like(g)
        if last_row_update and v is not None:
            out = v.new_empty(B, n, v.shape[-1])
        for start, end in problem.blocks():
            f_new[:, start:end], plan = _row_update(problem, f, g, start, end)
            if last_row_update:
                if v is not None:
                    out[:, start:end] = torch.bmm(plan, v)
            else:
                col += plan.sum(-2)
        f = f_new
        done += 1
        if history:
            fs.append(f)
            gs.append(g)
        if tol is not None:
            gap = torch.where(problem.b > 0, (col - problem.b).abs(), 0.0)
            converged = bool(gap.max() <= tol)
            if converged or done + 2 > max_iters:
                break
        elif last_row_update:
            break
        g = torch.where(problem.b > 0, g + _safe_log_ratio(problem.b, col), 0.0)
        done += 1
        if history:
            fs.append(f)
            gs.append(g)
        if tol is None and done >= n_iters:
            break
    if v is not None and out is None:  # the plan was last normalised by columns (or tol mode)
        out = streamed_plan_times(problem, f, g, v)
    return f, g, done, converged, out, fs, gs


def streamed_plan_times(problem: Streamed, f: Tensor, g: Tensor, v: Tensor) -> Tensor:
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
) -> tuple[Tensor, Tensor, int, bool | None]:
    """Sinkhorn potentials of ``S = scale q k^T + bias`` without an ``n × m`` matrix (no gradient).

    ``q (B, n, d)``, ``k (B, m, d)``, marginals ``(B, n)``/``(B, m)`` (defaults as in
    :func:`sinkformer.sinkhorn`), ``bias``/``keep`` broadcastable to ``(B, n, m)``, ``warm_start``
    a previous ``g`` ``(B, m)``. Same iteration count convention as :func:`sinkformer.sinkhorn`.
    Returns ``(f, g, iterations, converged)`` with :math:`P = e^{S + f\\oplus g}`.
    """
    with torch.no_grad():
        problem = Streamed.build(q, k, scale, (q.shape[0],), chunk_size, keep, bias, row_marginals, col_marginals)
        f, g, done, converged, _, _, _ = _sweeps(problem, n_iters, tol, max_iters, warm_start)
    return f, g, done, converged


def streamed_softmax(
    q: Tensor, k: Tensor, v: Tensor, *, scale: float = 1.0, bias: Tensor | None = None,
    keep: Tensor | None = None, chunk_size: int | None = None,
) -> Tensor:
    """``rowsoftmax(scale q k^T + bias) @ v`` block by block (no gradient); empty rows give 0."""
    with torch.no_grad():
        problem = Streamed.build(q, k, scale, (q.shape[0],), chunk_size, keep, bias)
        out = v.new_empty(q.shape[0], problem.n, v.shape[-1])
        for start, end in problem.blocks():
            S = problem.scores(start, end)
            shift = S.amax(-1, keepdim=True)
            E = S.sub_(torch.where(torch.isfinite(shift), shift, 0.0)).exp_()
            out[:, start:end] = torch.bmm(E, v) / E.sum(-1, keepdim=True).clamp_min(torch.finfo(E.dtype).tiny)
    return out


def streamed_sinkhorn_attention(
    q: Tensor, k: Tensor, v: Tensor, *, scale: float, n_iters: int | None, tol: float | None = None,
    max_iters: int = 1000, keep: Tensor | None = None, bias: Tensor | None = None, chunk_size: int | None = None,
) -> Tensor:
    """Chunked Sinkhorn attention ``(..., n, d), (..., m, d), (..., m, e) -> (..., n, e)``."""
    batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    n, m = q.shape[-2], k.shape[-2]
    flat = lambda t, length: t.expand(batch + (length, t.shape[-1])).reshape(-1, length, t.shape[-1])  # noqa: E731
    out = StreamedSinkhornAttention.apply(
        flat(q, n), flat(k, m), flat(v, m), scale, n_iters, tol, max_iters, keep, bias, chunk_size, batch
    )
    return out.reshape(batch + (n, v.shape[-1]))


class StreamedSinkhornAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, n_iters, tol, max_iters, keep, bias, chunk_size, batch):
        problem = Streamed.build(q, k, scale, batch, chunk_size, keep, bias)
        f, g, done, _, out, fs, gs = _sweeps(problem, n_iters, tol, max_iters, None, v=v, history=True)
        ctx.save_for_backward(q, k, v, out)
        ctx.problem_args = (scale, batch, problem.chunk, keep, bias)
        ctx.marginals = (problem.a, problem.b)
        ctx.fs, ctx.gs, ctx.done = fs, gs, done
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out = ctx.saved_tensors
        scale, batch, chunk, keep, bias = ctx.problem_args
        problem = Streamed(q, k, scale, batch, chunk, keep, bias, *ctx.marginals)
        dq, dk, dv = _backward(problem, v, out, grad_out.contiguous(), ctx.fs, ctx.gs, ctx.done)
        return dq, dk, dv, None, None, None, None, None, None, None, None


def _backward(problem: Streamed, v, out, dO, fs, gs, L):
    """Exact reverse mode through ``L`` updates; see the module docstring."""
    a, b = problem.a, problem.b
    inv_a = torch.where(a > 0, 1 / a.clamp_min(1e-38), 0.0)
    inv_b = torch.where(b > 0, 1 / b.clamp_min(1e-38), 0.0)
    f_L, g_L = fs[L - 1], gs[L]  # potentials of the final plan P
    dF = (dO * out).sum(-1)  # d loss / d f of the final plan
    dv = torch.zeros_like(v)
    dG_next = torch.zeros_like(b)
    coefs: list[tuple[int, Tensor]] = []  # (t, coefficient vector) of each update's term

    # sweep A: dV = P^T dO, and (L odd) the row step t = L
    for start, end in problem.blocks():
        P = problem.plan(start, end, f_L, g_L)
        dv += torch.bmm(P.transpose(1, 2), dO[:, start:end])
        if L % 2:
            dG_next -= torch.bmm((dF[:, start:end] * inv_a[:, start:end]).unsqueeze(1), P).squeeze(1)
    dG = (v * dv).sum(-1)
    if L % 2:
        coefs.append((L, dF * inv_a))
        dG, dF = dG + dG_next, torch.zeros_like(dF)
    # pairs (t even, t - 1 odd), one sweep each
    for t in range(L - (L % 2), 0, -2):
        col_coef = dG * inv_b
        dG_next = torch.zeros_like(b)
        dF_pair = dF.clone()
        for start, end in problem.blocks():
            C = problem.plan(start, end, fs[t - 1], gs[t])  # plan after update t (columns)
            dF_pair[:, start:end] -= torch.bmm(C, col_coef.unsqueeze(-1)).squeeze(-1)
            if t > 2:  # the row step t - 1 feeds g of update t - 2 (g before update 1 is a constant)
                R = problem.plan(start, end, fs[t - 2], gs[t - 1])  # plan after update t - 1 (rows)
                row_coef = dF_pair[:, start:end] * inv_a[:, start:end]
                dG_next -= torch.bmm(row_coef.unsqueeze(1), R).squeeze(1)
        coefs += [(t, col_coef), (t - 1, dF_pair * inv_a)]
        dG, dF = dG_next, torch.zeros_like(dF)

    X, Y, exact_terms = _rank_factors(coefs, fs, gs, f_L, g_L)
    dq, dk = torch.empty_like(problem.q), torch.zeros_like(problem.k)
    for start, end in problem.blocks():
        P = problem.plan(start, end, f_L, g_L)
        T = torch.bmm(dO[:, start:end], v.transpose(1, 2))
        if exact_terms is None:
            T.baddbmm_(X[:, start:end], Y.transpose(1, 2), alpha=-1.0)
            dS = T.mul_(P)
        else:  # potentials moved too far for the rank-L form: one exponential per term
            dS = T.mul_(P)
            for t, coef in exact_terms:
                M = problem.plan(start, end, fs[t - 1], gs[t])
                dS -= M * (coef[:, start:end].unsqueeze(-1) if t % 2 else coef.unsqueeze(1))
        dq[:, start:end] = torch.bmm(dS, problem.k).mul_(problem.scale)
        dk += torch.bmm(dS.transpose(1, 2), problem.q[:, start:end]).mul_(problem.scale)
    return dq, dk, dv


def _rank_factors(coefs, fs, gs, f_L, g_L):
    """Write ``sum_t coef_t * M^t`` as ``P * (X Y^T)`` with ``M^t = P * exp(df_t ⊕ dg_t)``.

    Returns ``(X, Y, None)``, or ``(None, None, coefs)`` when a potential moved by more than
    :data:`_MAX_LOG_RATIO` between updates (the exponentials could overflow)."""
    xs, ys = [], []
    for t, coef in coefs:
        df, dg = fs[t - 1] - f_L, gs[t] - g_L  # potentials of the plan after update t
        if max(df.abs().max().item(), dg.abs().max().item()) > _MAX_LOG_RATIO:
            return None, None, coefs
        if t % 2:  # row update: coefficient on rows
            xs.append(coef * df.exp())
            ys.append(dg.exp())
        else:
            xs.append(df.exp())
            ys.append(coef * dg.exp())
    return torch.stack(xs, -1), torch.stack(ys, -1), None
