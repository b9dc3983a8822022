r"""Sinkhorn attention with a custom autograd: SoftMax-like time, O(n) memory beyond q, k, v.

The score matrix is never kept. For a group of (batch·head) slices at a time, the forward builds
:math:`S = \mathrm{scale}\,QK^\top + \mathrm{bias}` and its *doubly shifted* kernel

.. math::

    \tilde K_{ij} = \exp(S_{ij} - m_i - c_j),\qquad m_i = \max_j S_{ij},\quad c_j = \max_i (S_{ij} - m_i),

whose every row and every column has maximum 1, then runs the paper's iterations in the
scaling domain, :math:`P^{(t)} = \mathrm{diag}(u)\,\tilde K\,\mathrm{diag}(\tilde v)`, starting
from :math:`\tilde v^{(0)} = e^{c}` (i.e. :math:`g = 0`):

.. math::

    u \leftarrow a \oslash (\tilde K \tilde v)\ \ (t \text{ odd, rows}),\qquad
    \tilde v \leftarrow b \oslash (\tilde K^\top u)\ \ (t \text{ even, columns}).

Each iteration is a matrix-vector product on a cached tile (no exponential), and the output
:math:`u \odot \tilde K(\tilde v \odot V)` is one matrix product: after an odd count this is
exactly :math:`\mathrm{rowsoftmax}(S + \mathbf 1 g^\top)V` with :math:`g = \log\tilde v - c`, the
identity :math:`K^{2m+1} = \mathrm{rowsoftmax}(S + \mathbf 1 g^\top)`, computed from the tile
already in cache rather than by a second SDPA pass.

Only the shifts and the scaling vectors of every iteration are saved (:math:`O(n\,L)` per slice).
The backward recomputes :math:`\tilde K` once and returns the **exact** gradient of the
``n_iters`` map by reverse-mode through the vector recursion: every iteration contributes a rank-one
term to :math:`\partial\ell/\partial\tilde K`, so

.. math::

    \frac{\partial\ell}{\partial S} = \tilde K \odot\big(\mathrm{diag}(u)\,dP\,\mathrm{diag}(\tilde v) + XY^\top\big),
    \qquad dP = dO\,V^\top,

with :math:`X, Y` of rank ``n_iters`` — the same seven matrix products as SoftMax attention.
``backward="implicit"`` instead differentiates the balanced fixed point (implicit function
theorem): :math:`\partial\ell/\partial S = P\odot(dP - \alpha\oplus\beta)` where
:math:`(\alpha, \beta)` solves :math:`[\mathrm{diag}(a)\ P;\ P^\top\ \mathrm{diag}(b)][\alpha;\beta]
= [(P\odot dP)\mathbf 1;\ (P\odot dP)^\top\mathbf 1]` by conjugate gradients.

Scaling-domain arithmetic is exact up to rounding as long as the scalings stay moderate. When a
group's scalings leave :math:`\max u \cdot \max\tilde v < e^{60}` (extreme score ranges, e.g. 1e4),
that group falls back to the log-domain reference (:func:`sinkformer.sinkhorn`) in the forward and
to autograd through it in the backward: slower, never wrong.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..sinkhorn import double_shift, sinkhorn

__all__ = ["sinkhorn_attention", "GROUP_ELEMENTS"]

#: Score-tile size (elements) processed at once: small enough to stay in cache and bound memory.
GROUP_ELEMENTS = 1 << 20
#: Largest log(max u) + log(max v) the scaling domain is trusted with (lost entries < e^{60-87}).
_LOG_SCALING_LIMIT = 60.0


def sinkhorn_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float,
    n_iters: int | None,
    tol: float | None = None,
    max_iters: int = 1000,
    keep: Tensor | None = None,
    bias: Tensor | None = None,
    backward: str = "unrolled",
    dropout_p: float = 0.0,
    group_elements: int = GROUP_ELEMENTS,
) -> Tensor:
    """Sinkhorn attention ``(..., n, d) x (..., m, d) x (..., m, e) -> (..., n, e)``.

    ``keep`` (bool) and ``bias`` (float, no gradient) broadcast to ``(..., n, m)``; validation
    happened in :func:`sinkformer.attention`. Inputs are in compute precision (float32/64).
    ``dropout_p`` drops attention weights after normalisation (the mask of each tile is drawn
    from a seed taken from the global generator and drawn again in the backward).
    """
    batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    n, m = q.shape[-2], k.shape[-2]
    flat = lambda t, length, dim: t.expand(batch + (length, dim)).reshape(-1, length, dim)  # noqa: E731
    qf, kf, vf = flat(q, n, q.shape[-1]), flat(k, m, k.shape[-1]), flat(v, m, v.shape[-1])
    masks = _GroupMasks(keep, bias, batch, n, m)
    group = max(1, group_elements // max(1, n * m))
    seed = int(torch.randint(0, 2**62, (1,)).item()) if dropout_p > 0 else None
    options = (scale, n_iters, tol, max_iters, backward, dropout_p, seed)
    out = _SinkhornAttention.apply(qf, kf, vf, masks, options, group)
    return out.reshape(batch + (n, v.shape[-1]))


class _GroupMasks:
    """Slices of the broadcast ``keep``/``bias`` for flat batch indices ``[start, end)``."""

    def __init__(self, keep: Tensor | None, bias: Tensor | None, batch: tuple[int, ...], n: int, m: int):
        self.keep = None if keep is None else keep.expand(batch + (n, m))
        self.bias = None if bias is None else bias.expand(batch + (n, m))
        self.batch = batch

    def _slice(self, t: Tensor | None, start: int, end: int) -> Tensor | None:
        if t is None:
            return None
        if len(self.batch) <= 1:
            return t.reshape((-1,) + t.shape[-2:])[start:end] if self.batch else t.unsqueeze(0)
        index = torch.unravel_index(torch.arange(start, end, device=t.device), self.batch)
        return t[index]

    def keep_of(self, start: int, end: int) -> Tensor | None:
        return self._slice(self.keep, start, end)

    def bias_of(self, start: int, end: int) -> Tensor | None:
        return self._slice(self.bias, start, end)


def _scores(q: Tensor, k: Tensor, scale: float, keep: Tensor | None, bias: Tensor | None) -> Tensor:
    """``scale * q k^T + bias`` with masked entries at -inf, shape ``(c, n, m)``."""
    S = torch.baddbmm(q.new_empty(()), q, k.transpose(1, 2), beta=0.0, alpha=scale)
    if bias is not None:
        S.add_(bias)
    if keep is not None:
        S.masked_fill_(~keep, float("-inf"))
    return S


def _shifted_kernel(S: Tensor, row_shift: Tensor | None = None, col_shift: Tensor | None = None):
    """In place: ``S -> exp(S - m_i - c_j)`` (:func:`sinkformer.sinkhorn.double_shift`); the
    backward passes the shifts saved by the forward."""
    if row_shift is None:
        S, row_shift, col_shift = double_shift(S, inplace=True)
    else:
        S.sub_(row_shift.unsqueeze(-1)).sub_(col_shift.unsqueeze(-2))
    return S.exp_(), row_shift, col_shift


def _marginals(keep: Tensor | None, c: int, n: int, m: int, like: Tensor) -> tuple[Tensor, Tensor]:
    """Default marginals of the valid sub-matrix: rows 1, columns n_valid/m_valid, 0 elsewhere."""
    if keep is None:
        return like.new_ones(c, n), like.new_full((c, m), n / m)
    rows, cols = keep.any(-1).to(like.dtype), keep.any(-2).to(like.dtype)
    ratio = rows.sum(-1, keepdim=True) / cols.sum(-1, keepdim=True).clamp_min(1)
    return rows, cols * ratio


def _ratio(num: Tensor, den: Tensor) -> Tensor:
    """``num / den`` with 0 where ``num == 0`` (masked rows/columns carry no mass)."""
    return torch.where(num > 0, num / den, torch.zeros_like(num))


def _mv(K: Tensor, x: Tensor) -> Tensor:
    return torch.bmm(K, x.unsqueeze(-1)).squeeze(-1)


def _mtv(K: Tensor, x: Tensor) -> Tensor:
    """``K^T x`` as a row-vector product (much faster than a transposed batched GEMV)."""
    return torch.bmm(x.unsqueeze(1), K).squeeze(1)


def _iterate(K: Tensor, a: Tensor, b: Tensor, v0: Tensor, n_iters: int | None, tol: float | None, max_iters: int):
    """The scaling-domain recursion. Returns the lists of iterates ``us = [u1, u3, ..]``,
    ``vs = [v0, v2, ..]`` and the number of normalisations run (odd in tolerance mode)."""
    us, vs = [], [v0]
    if tol is None:
        for t in range(1, n_iters + 1):
            if t % 2:
                us.append(_ratio(a, _mv(K, vs[-1])))
            else:
                vs.append(_ratio(b, _mtv(K, us[-1])))
        return us, vs, n_iters
    done = 0
    while True:
        us.append(_ratio(a, _mv(K, vs[-1])))
        done += 1
        col = _mtv(K, us[-1])
        if bool(((vs[-1] * col - b).abs()).max() <= tol) or done + 2 > max_iters:
            return us, vs, done
        vs.append(_ratio(b, col))
        done += 1


class _SinkhornAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, masks, options, group):
        scale, n_iters, tol, max_iters, backward, dropout_p, seed = options
        B, n, m = q.shape[0], q.shape[1], k.shape[1]
        out = q.new_empty(B, n, v.shape[-1])
        states = []
        for start in range(0, B, group):
            end = min(B, start + group)
            keep, bias = masks.keep_of(start, end), masks.bias_of(start, end)
            K, row_shift, col_shift = _shifted_kernel(_scores(q[start:end], k[start:end], scale, keep, bias))
            a, b = _marginals(keep, end - start, n, m, K)
            us, vs, done = _iterate(K, a, b, col_shift.exp(), n_iters, tol, max_iters)
            u, vt = us[-1], vs[-1]  # the last (u, v) pair: P = diag(u) K diag(v)
            drop = _dropout_mask(K, dropout_p, seed, start)
            if _trustworthy(us, vs):
                if drop is not None:
                    K.mul_(drop)
                torch.bmm(K, vt.unsqueeze(-1) * v[start:end], out=out[start:end]).mul_(u.unsqueeze(-1))
                states.append((row_shift, col_shift, us, vs, done))
            else:  # extreme scores: log-domain reference for this group
                del K
                P = _reference_weights(q[start:end], k[start:end], keep, bias, options)
                out[start:end] = (P if drop is None else P * drop) @ v[start:end]
                states.append(None)
        ctx.save_for_backward(q, k, v, out)
        ctx.masks, ctx.options, ctx.group, ctx.states = masks, options, group, states
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out = ctx.saved_tensors
        scale, n_iters, tol, max_iters, backward, dropout_p, seed = ctx.options
        grad_out = grad_out.contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        B = q.shape[0]
        for index, start in enumerate(range(0, B, ctx.group)):
            end = min(B, start + ctx.group)
            sl = slice(start, end)
            keep, bias = ctx.masks.keep_of(start, end), ctx.masks.bias_of(start, end)
            state = ctx.states[index]
            if state is None:
                dq[sl], dk[sl], dv[sl] = _reference_backward(
                    q[sl], k[sl], v[sl], keep, bias, grad_out[sl], ctx.options, start
                )
                continue
            row_shift, col_shift, us, vs, done = state
            K, _, _ = _shifted_kernel(_scores(q[sl], k[sl], scale, keep, bias), row_shift, col_shift)
            u, vt = us[-1], vs[-1]
            dO, V = grad_out[sl], v[sl]
            uO = u.unsqueeze(-1) * dO
            # diag(u) dP diag(v) with dP = dO V^T, the gradient w.r.t. the (dropped-out) weights
            dP = torch.bmm(uO, (vt.unsqueeze(-1) * V).transpose(1, 2))
            drop = _dropout_mask(K, dropout_p, seed, start)
            if drop is None:
                D = _mtv_matrix(K, uO)  # K^T (u * dO): (c, m, e)
            else:  # out = diag(u) (K * drop) diag(v) V
                dP.mul_(drop)
                D = _mtv_matrix(drop.mul_(K), uO)
                del drop
            dvt = (V * D).sum(-1)  # sum_i u_i K_ij dP_ij
            dv[sl] = D.mul_(vt.unsqueeze(-1))
            du = _ratio_rows((dO * out[sl]).sum(-1), u)  # sum_j K_ij v_j dP_ij
            if backward == "implicit":  # dS = P * (dP - alpha ⊕ beta)
                alpha, beta = _implicit_duals(K, u, vt, du * u, dvt * vt)
                X, Y = torch.stack([u * alpha, u], -1), torch.stack([vt, vt * beta], -1)
                dP.baddbmm_(X, Y.transpose(1, 2), alpha=-1.0)
            else:  # dS = K * (diag(u) dP diag(v) + X Y^T)
                a, b = _marginals(keep, end - start, q.shape[1], k.shape[1], K)
                X, Y = _reverse_recursion(K, a, b, us, vs, done, du, dvt)
                dP.baddbmm_(X, Y.transpose(1, 2))
            dS = dP.mul_(K)
            torch.bmm(dS, k[sl], out=dq[sl]).mul_(scale)
            torch.bmm(dS.transpose(1, 2), q[sl], out=dk[sl]).mul_(scale)
        return dq, dk, dv, None, None, None


def _mtv_matrix(K: Tensor, X: Tensor) -> Tensor:
    return torch.bmm(K.transpose(1, 2), X)


def _ratio_rows(num: Tensor, den: Tensor) -> Tensor:
    return torch.where(den > 0, num / den, torch.zeros_like(num))


def _trustworthy(us: list[Tensor], vs: list[Tensor]) -> bool:
    """Scalings finite and moderate: entries lost to underflow in K weigh < e^{60-87}."""
    u_max = torch.stack([u.amax() for u in us]).amax()
    v_max = torch.stack([x.amax() for x in vs]).amax()
    if not (torch.isfinite(u_max) and torch.isfinite(v_max)):
        return False
    if u_max <= 0 or v_max <= 0:
        return True
    return bool(torch.log(u_max) + torch.log(v_max) < _LOG_SCALING_LIMIT)


def _reverse_recursion(K, a, b, us, vs, done, du, dvt):
    """Reverse-mode through the scaling recursion.

    ``du``/``dvt`` are the gradients w.r.t. the final ``u``/``v``. Returns ``X (c, n, L)`` and
    ``Y (c, m, L)`` with :math:`\\partial\\ell/\\partial K \\mathrel{+}= XY^\\top` (one rank-one
    term per iteration)."""
    xs, ys = [], []
    for t in range(done, 0, -1):
        if t % 2:  # u_t = a / (K v_{t-1})
            u_t, v_prev = us[(t - 1) // 2], vs[(t - 1) // 2]
            dr = -_ratio(a, a.square()) * du * u_t.square()  # -du * u^2 / a
            xs.append(dr)
            ys.append(v_prev)
            dvt = dvt + _mtv(K, dr)
            du = torch.zeros_like(du)
        else:  # v_t = b / (K^T u_{t-1})
            v_t, u_prev = vs[t // 2], us[t // 2 - 1]
            ds = -_ratio(b, b.square()) * dvt * v_t.square()
            xs.append(u_prev)
            ys.append(ds)
            du = du + _mv(K, ds)
            dvt = torch.zeros_like(dvt)
    return torch.stack(xs, -1), torch.stack(ys, -1)


def _implicit_duals(K, u, vt, r, c, tol=1e-9, max_iters=1000):
    """Solve ``[diag(a) P; P^T diag(b)] [alpha; beta] = [r; c]`` by Jacobi-preconditioned CG,
    with ``P = diag(u) K diag(vt)`` and ``a, b`` its actual row/column sums."""
    Pv = lambda y: u * _mv(K, vt * y)  # noqa: E731
    Ptv = lambda x: vt * _mtv(K, u * x)  # noqa: E731
    a, b = Pv(torch.ones_like(vt)), Ptv(torch.ones_like(u))
    H = lambda x, y: (a * x + Pv(y), Ptv(x) + b * y)  # noqa: E731
    pa, pb = torch.where(a > 0, 1 / a, torch.ones_like(a)), torch.where(b > 0, 1 / b, torch.ones_like(b))
    x, y = torch.zeros_like(r), torch.zeros_like(c)
    rx, ry = r.clone(), c.clone()
    zx, zy = pa * rx, pb * ry
    px, py = zx.clone(), zy.clone()
    rz = (rx * zx).sum(-1) + (ry * zy).sum(-1)
    norm0 = torch.sqrt((r.square().sum(-1) + c.square().sum(-1))).clamp_min(1e-30)
    for _ in range(max_iters):
        hx, hy = H(px, py)
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


def _dropout_mask(like: Tensor, p: float, seed: int | None, start: int) -> Tensor | None:
    """The scaled Bernoulli keep-mask ``(c, n, m)`` of the group starting at ``start`` (or None)."""
    if not p:
        return None
    generator = torch.Generator(device=like.device).manual_seed(seed + start)
    return torch.empty_like(like).bernoulli_(1.0 - p, generator=generator).div_(1.0 - p)


def _reference_weights(q, k, keep, bias, options) -> Tensor:
    """The log-domain reference weights of one group (for groups the scaling domain cannot take)."""
    scale, n_iters, tol, max_iters = options[:4]
    S = torch.baddbmm(q.new_empty(()), q, k.transpose(1, 2), beta=0.0, alpha=scale)
    if bias is not None:
        S = S + bias
    return sinkhorn(S, None if tol is not None else n_iters, tol=tol, max_iters=max_iters, mask=keep)


def _reference_backward(q, k, v, keep, bias, grad_out, options, start):
    """Autograd through the log-domain reference (used only for groups that fell back)."""
    dropout_p, seed = options[5], options[6]
    with torch.enable_grad():
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        P = _reference_weights(q, k, keep, bias, options)
        drop = _dropout_mask(P, dropout_p, seed, start)
        return torch.autograd.grad((P if drop is None else P * drop) @ v, (q, k, v), grad_out)
