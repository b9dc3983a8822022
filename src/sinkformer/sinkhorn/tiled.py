r"""The tiled engine: Sinkhorn attention at SoftMax-like cost, O(n) saved per slice.

For a group of (batch·head) slices at a time (:func:`~.problem.group_size`: a cache-sized tile
on the CPU, a memory budget on a GPU) the forward builds :math:`S = \mathrm{scale}\,QK^\top +
\mathrm{bias}`, doubly shifts it (:func:`~.problem.double_shift`: every row and column of
:math:`x = S - m_i - c_j` has maximum 0) and runs the iterations of :mod:`.problem` on that
cached tile in one of two domains:

* **scaling** (CPU default): :math:`\tilde K = e^{x}`, :math:`P^{(t)} = \mathrm{diag}(u)\tilde K
  \mathrm{diag}(\tilde v)` from :math:`\tilde v^{(0)} = e^{c}`; each normalisation is one
  matrix-vector product (:math:`u \leftarrow a \oslash \tilde K\tilde v`, :math:`\tilde v
  \leftarrow b \oslash \tilde K^\top u`), no exponential, and the output
  :math:`u \odot \tilde K(\tilde v \odot V)` is one matrix product.
* **log** (GPUs, and any CPU group whose scalings leave :math:`\max u\cdot\max\tilde v < e^{60}`,
  e.g. score ranges of 1e4): :math:`f \leftarrow \log a - \mathrm{LSE}_j(x + g)`,
  :math:`g \leftarrow \log b - \mathrm{LSE}_i(x + f)` on the cached tile. Never wrong, one
  exponential of the tile per normalisation, and no data-dependent branch — so on a GPU the
  engine never synchronises with the host (fixed ``n_iters``).

Only the shifts and the scalings (or potentials) of every iteration are saved. The backward
recomputes the tile once and returns the **exact** gradient of the ``n_iters`` map by reverse
mode through the vector recursion: in the scaling domain every iteration adds a rank-one term,

.. math::

    \frac{\partial\ell}{\partial S} = \tilde K \odot\big(\mathrm{diag}(u)\,dP\,\mathrm{diag}(\tilde v) + XY^\top\big),
    \qquad dP = dO\,V^\top,

(:math:`X, Y` of rank ``n_iters``: the seven matrix products of SoftMax attention); in the log
domain each iteration's plan is recomputed. ``backward="implicit"`` differentiates the balanced
fixed point instead (implicit function theorem): :math:`\partial\ell/\partial S = P\odot(dP -
\alpha\oplus\beta)` where :math:`[\mathrm{diag}(a)\ P;\ P^\top\ \mathrm{diag}(b)][\alpha;\beta] =
[(P\odot dP)\mathbf 1;\ (P\odot dP)^\top\mathbf 1]` is solved by conjugate gradients.

The forward and backward are ``torch.library`` custom ops (``sinkformer::tiled_forward``,
``sinkformer::tiled_backward``) with fake implementations, so ``torch.compile(fullgraph=True)``
and ``torch.export`` see one opaque node each. Second derivatives (``create_graph=True``)
recompute the weights with the dense engine and differentiate them by autograd: exact, at the
dense engine's memory.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .problem import (
    Masks,
    compute_in_float32_under_autocast,
    column_error,
    Tolerance,
    converged_tol,
    double_shift,
    group_size,
    marginals,
    valid_rows_cols,
    warn_if_unconverged,
    warn_unbalanced,
)

__all__ = ["tiled_attention"]

ENGINE = "tiled"
#: Iteration domain: ``"auto"`` (scaling on the CPU, log on GPUs), ``"scaling"`` or ``"log"``. The
#: conformance suite sets ``"log"`` to hold the GPUs' domain to the reference on the CPU.
DOMAIN = "auto"
#: Largest log(max u) + log(max v) the scaling domain is trusted with (lost entries < e^{60-87}).
_LOG_SCALING_LIMIT = 60.0


def tiled_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    batch: tuple[int, ...],
    scale: float,
    n_iters: int | None,
    tol: float | None = None,
    max_iters: int = 1000,
    keep: Tensor | None = None,
    bias: Tensor | None = None,
    backward: str = "unrolled",
    dropout_p: float = 0.0,
    domain: str | None = None,
) -> Tensor:
    """Sinkhorn attention ``(B, n, d) x (B, m, d) x (B, m, e) -> (B, n, e)``.

    ``q, k, v`` are flat over ``batch`` (``B = prod(batch)``) and in compute precision; ``keep``
    (bool) and ``bias`` (float, no gradient) broadcast to ``batch + (n, m)``. Arguments were
    validated by :func:`sinkformer.attention`. ``dropout_p`` drops weights after normalisation
    (the mask of each group is drawn from a seed taken from the global generator, and drawn
    again in the backward). ``domain``: :data:`DOMAIN` by default.
    """
    domain = DOMAIN if domain is None else domain
    seed = torch.randint(0, 2**62, (1,)) if dropout_p > 0 else None
    group = group_size(q.shape[0], q.shape[1], k.shape[1], q.device)
    options = _Options(scale, n_iters, tol, max_iters, backward, dropout_p, domain, group)
    return torch.ops.sinkformer.tiled_forward(q, k, v, keep, bias, list(batch), seed, *options.args())[0]


class _Options:
    """The non-tensor arguments of both ops, in schema order."""

    def __init__(self, scale, n_iters, tol, max_iters, backward, dropout_p, domain, group):
        self.scale, self.n_iters, self.tol, self.max_iters = scale, n_iters, tol, max_iters
        self.backward, self.dropout_p, self.domain, self.group = backward, dropout_p, domain, group

    def args(self) -> tuple:
        return (self.scale, self.n_iters, self.tol, self.max_iters, self.backward, self.dropout_p, self.domain,
                self.group)

    def history_length(self) -> tuple[int, int] | None:
        """Saved (u or f, v or g) iterates per slice; ``None`` when data-dependent (``tol``)."""
        if self.backward == "implicit":
            return 1, 1
        if self.tol is not None:
            return None
        return (self.n_iters + 1) // 2, self.n_iters // 2 + 1


@torch.library.custom_op("sinkformer::tiled_forward", mutates_args=())
def _forward_op(
    q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None, bias: Tensor | None, batch: list[int], seed: Tensor | None,
    scale: float, n_iters: int | None, tol: float | None, max_iters: int, backward: str, dropout_p: float, domain: str,
    group: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns ``out (B, n, e)``, the shifts ``(B, n)``, ``(B, m)``, the iterates ``(B, n, Lu)``,
    ``(B, m, Lv)``, the normalisations run ``(B,)`` and the domain of each slice ``(B,)`` (True: log).
    ``group``: slices per group (the backward and the dropout masks use the same groups)."""
    options = _Options(scale, n_iters, tol, max_iters, backward, dropout_p, domain, group)
    B, n = q.shape[0], q.shape[1]
    masks = Masks(keep, bias, tuple(batch))
    out = q.new_empty(B, n, v.shape[-1])
    shifts_r, shifts_c, us, vs, counts, logs = [], [], [], [], [], []
    stops, col_errors = [], []
    for start in range(0, B, group):
        end = min(B, start + group)
        sl = slice(start, end)
        state = _forward_group(q[sl], k[sl], v[sl], masks, start, end, options, seed, out[sl])
        shifts_r.append(state.row_shift)
        shifts_c.append(state.col_shift)
        us.append(state.us)
        vs.append(state.vs)
        counts.append(state.counts)
        logs.append(torch.full((end - start,), state.log_domain, dtype=torch.bool, device=q.device))
        stops += [state.stop] if state.stop is not None else []
        col_errors += [state.col_error] if state.col_error is not None else []
    implicit = backward == "implicit"
    warn_if_unconverged(stops, implicit=implicit)
    if implicit and tol is None and col_errors:
        warn_unbalanced(torch.cat(col_errors), n_iters, converged_tol(q.dtype), ENGINE)
    if B == 0:
        m, lu, lv = k.shape[1], *(options.history_length() or (0, 0))
        return (out, q.new_zeros(0, n), q.new_zeros(0, m), q.new_zeros(0, n, lu), q.new_zeros(0, m, lv),
                torch.zeros(0, dtype=torch.int64, device=q.device), torch.zeros(0, dtype=torch.bool, device=q.device))
    return (out, torch.cat(shifts_r), torch.cat(shifts_c), _pad_cat(us), _pad_cat(vs), torch.cat(counts),
            torch.cat(logs))


@_forward_op.register_fake
def _(q, k, v, keep, bias, batch, seed, scale, n_iters, tol, max_iters, backward, dropout_p, domain, group):
    B, n, m = q.shape[0], q.shape[1], k.shape[1]
    lengths = _Options(scale, n_iters, tol, max_iters, backward, dropout_p, domain, group).history_length()
    if lengths is None:
        length = torch.library.get_ctx().new_dynamic_size()
        lengths = (length, length)
    return (q.new_empty(B, n, v.shape[-1]), q.new_empty(B, n), q.new_empty(B, m), q.new_empty(B, n, lengths[0]),
            q.new_empty(B, m, lengths[1]), q.new_empty(B, dtype=torch.int64), q.new_empty(B, dtype=torch.bool))


def _pad_cat(parts: list[Tensor]) -> Tensor:
    """Concatenate ``(c, n, L_i)`` iterate stacks along slices, repeating each one's last iterate
    up to the longest ``L`` (a matrix that stopped early keeps its values: frozen)."""
    longest = max(p.shape[-1] for p in parts)
    return torch.cat([p if p.shape[-1] == longest else torch.cat(
        [p, p[..., -1:].expand(p.shape[:-1] + (longest - p.shape[-1],))], -1) for p in parts])


class _GroupState:
    def __init__(self, row_shift, col_shift, us, vs, counts, log_domain, stop, col_error):
        self.row_shift, self.col_shift, self.us, self.vs = row_shift, col_shift, us, vs
        self.counts, self.log_domain, self.stop, self.col_error = counts, log_domain, stop, col_error


def _forward_group(q, k, v, masks: Masks, start: int, end: int, options: _Options, seed, out: Tensor) -> _GroupState:
    """Forward of slices ``[start, end)``; writes ``out`` and returns what the backward needs."""
    keep, bias = masks.keep_of(start, end), masks.bias_of(start, end)
    x, row_shift, col_shift = double_shift(_scores(q, k, options.scale, keep, bias), inplace=True)
    a, b = marginals(*valid_rows_cols(keep, x.shape), x.shape, x)
    drop = _dropout_mask(x, options.dropout_p, seed, start)
    keep_all = options.backward != "implicit"
    use_scaling = options.domain == "scaling" or (options.domain == "auto" and q.device.type == "cpu")
    if use_scaling:
        K = x.exp_()
        us, vs, counts, stop = _scaling_iterate(K, a, b, col_shift.exp(), options)
        if _trustworthy(us, vs):
            u, vt = us[-1], vs[-1]
            col_error = None
            if options.backward == "implicit" and options.tol is None:
                col_error = column_error(vt * _mtv(K, u), b)
            if drop is not None:
                K.mul_(drop)
            torch.bmm(K, vt.unsqueeze(-1) * v, out=out).mul_(u.unsqueeze(-1))
            if not keep_all:
                us, vs = us[-1:], vs[-1:]
            return _GroupState(row_shift, col_shift, torch.stack(us, -1), torch.stack(vs, -1), counts, False, stop,
                               col_error)
        del K  # extreme scores: the log domain for this group
        x = _shifted_scores(q, k, options.scale, keep, bias, row_shift, col_shift)
    fs, gs, counts, stop = _log_iterate(x, a, b, col_shift, options)
    P = x.add_(fs[-1].unsqueeze(-1)).add_(gs[-1].unsqueeze(-2)).exp_()
    col_error = column_error(P.sum(-2), b) if options.backward == "implicit" and options.tol is None else None
    torch.bmm(P if drop is None else P.mul_(drop), v, out=out)
    if not keep_all:
        fs, gs = fs[-1:], gs[-1:]
    return _GroupState(row_shift, col_shift, torch.stack(fs, -1), torch.stack(gs, -1), counts, True, stop, col_error)


def _scores(q: Tensor, k: Tensor, scale: float, keep: Tensor | None, bias: Tensor | None) -> Tensor:
    """``scale * q k^T + bias`` with masked entries at -inf, shape ``(c, n, m)``."""
    S = torch.baddbmm(q.new_empty(()), q, k.transpose(1, 2), beta=0.0, alpha=scale)
    if bias is not None:
        S.add_(bias)
    if keep is not None:
        S.masked_fill_(~keep, float("-inf"))
    return S


def _shifted_scores(q, k, scale, keep, bias, row_shift, col_shift) -> Tensor:
    """The forward's shifted tile again, from the saved shifts (same operations, same values)."""
    return _scores(q, k, scale, keep, bias).sub_(row_shift.unsqueeze(-1)).sub_(col_shift.unsqueeze(-2))


def _ratio(num: Tensor, den: Tensor) -> Tensor:
    """``num / den`` with 0 where ``num == 0`` (masked rows/columns carry no mass)."""
    return torch.where(num > 0, num / den, torch.zeros_like(num))


def _mv(K: Tensor, x: Tensor) -> Tensor:
    return torch.bmm(K, x.unsqueeze(-1)).squeeze(-1)


def _mtv(K: Tensor, x: Tensor) -> Tensor:
    """``K^T x`` as a row-vector product (much faster than a transposed batched GEMV)."""
    return torch.bmm(x.unsqueeze(1), K).squeeze(1)


def _scaling_iterate(K: Tensor, a: Tensor, b: Tensor, v0: Tensor, options: _Options):
    """The scaling-domain recursion: ``us = [u1, u3, ..]``, ``vs = [v0, v2, ..]``, the ``(c,)``
    normalisations run and the :class:`~.problem.Tolerance` (``None`` for a fixed count)."""
    us, vs = [], [v0]
    c = K.shape[0]
    if options.tol is None:
        for t in range(1, options.n_iters + 1):
            if t % 2:
                us.append(_ratio(a, _mv(K, vs[-1])))
            else:
                vs.append(_ratio(b, _mtv(K, us[-1])))
        return us, vs, torch.full((c,), options.n_iters, dtype=torch.int64, device=K.device), None
    stop = Tolerance(options.tol, options.max_iters, (c,), K.device, ENGINE)
    done = 0
    while True:
        u = _ratio(a, _mv(K, vs[-1]))
        us.append(u if not us else torch.where(stop.active.unsqueeze(-1), u, us[-1]))
        done += 1
        col = _mtv(K, us[-1])
        if stop.check(column_error(vs[-1] * col, b), done):
            return us, vs, stop.counts, stop
        vs.append(torch.where(stop.active.unsqueeze(-1), _ratio(b, col), vs[-1]))
        done += 1


def _log_iterate(x: Tensor, a: Tensor, b: Tensor, g0: Tensor, options: _Options):
    """The log-domain recursion on the shifted tile ``x``: ``fs = [f1, f3, ..]``, ``gs = [g0, g2, ..]``."""
    log_a = torch.where(a > 0, a.clamp_min(1e-38).log(), torch.zeros_like(a))
    log_b = torch.where(b > 0, b.clamp_min(1e-38).log(), torch.zeros_like(b))

    def rows(g: Tensor) -> Tensor:
        return torch.where(a > 0, log_a - torch.logsumexp(x + g.unsqueeze(-2), -1), torch.zeros_like(a))

    def col_lse(f: Tensor) -> Tensor:
        return torch.logsumexp(x + f.unsqueeze(-1), -2)

    fs, gs = [], [g0]
    c = x.shape[0]
    if options.tol is None:
        for t in range(1, options.n_iters + 1):
            if t % 2:
                fs.append(rows(gs[-1]))
            else:
                gs.append(torch.where(b > 0, log_b - col_lse(fs[-1]), torch.zeros_like(b)))
        return fs, gs, torch.full((c,), options.n_iters, dtype=torch.int64, device=x.device), None
    stop = Tolerance(options.tol, options.max_iters, (c,), x.device, ENGINE)
    done = 0
    while True:
        f = rows(gs[-1])
        fs.append(f if not fs else torch.where(stop.active.unsqueeze(-1), f, fs[-1]))
        done += 1
        lse = col_lse(fs[-1])
        if stop.check(column_error(torch.exp(gs[-1] + lse), b), done):
            return fs, gs, stop.counts, stop
        g = torch.where(b > 0, log_b - lse, torch.zeros_like(b))
        gs.append(torch.where(stop.active.unsqueeze(-1), g, gs[-1]))
        done += 1


def _trustworthy(us: list[Tensor], vs: list[Tensor]) -> bool:
    """Scalings finite and moderate: entries lost to underflow in K weigh < e^{60-87}."""
    if us[0].numel() == 0 or vs[0].numel() == 0:
        return True
    u_max = torch.stack([u.amax() for u in us]).amax()
    v_max = torch.stack([x.amax() for x in vs]).amax()
    if not (torch.isfinite(u_max) and torch.isfinite(v_max)):
        return False
    if u_max <= 0 or v_max <= 0:
        return True
    return bool(torch.log(u_max) + torch.log(v_max) < _LOG_SCALING_LIMIT)


# ------------------------------------------------------------------------------------------------
# backward


@torch.library.custom_op("sinkformer::tiled_backward", mutates_args=())
def _backward_op(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, keep: Tensor | None, bias: Tensor | None,
    batch: list[int], seed: Tensor | None, row_shift: Tensor, col_shift: Tensor, us: Tensor, vs: Tensor,
    counts: Tensor, log_domain: Tensor, scale: float, n_iters: int | None, tol: float | None, max_iters: int,
    backward: str, dropout_p: float, domain: str, group: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients ``(dq, dk, dv)`` of the forward op (its saved state: shifts, iterates, counts)."""
    options = _Options(scale, n_iters, tol, max_iters, backward, dropout_p, domain, group)
    B = q.shape[0]
    masks = Masks(keep, bias, tuple(batch))
    grad_out = grad_out.contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for start in range(0, B, group):
        sl = slice(start, min(B, start + group))
        kp, bs = masks.keep_of(sl.start, sl.stop), masks.bias_of(sl.start, sl.stop)
        x = _shifted_scores(q[sl], k[sl], scale, kp, bs, row_shift[sl], col_shift[sl])
        a, b = marginals(*valid_rows_cols(kp, x.shape), x.shape, x)
        drop = _dropout_mask(x, dropout_p, seed, start)
        backward_group = _log_backward if _in_log_domain(options, q.device, log_domain, sl.start) else _scaling_backward
        dS, dv[sl] = backward_group(x, a, b, us[sl], vs[sl], counts[sl], grad_out[sl], v[sl], out[sl], drop, options)
        torch.bmm(dS, k[sl], out=dq[sl]).mul_(scale)
        torch.bmm(dS.transpose(1, 2), q[sl], out=dk[sl]).mul_(scale)
    return dq, dk, dv


def _in_log_domain(options: _Options, device: torch.device, log_domain: Tensor, start: int) -> bool:
    """The domain the forward used for the group at ``start`` (read from the flags only where the
    choice depended on the data: the CPU's scaling domain with its fallback)."""
    if options.domain == "log" or (options.domain == "auto" and device.type != "cpu"):
        return True
    return bool(log_domain[start])


@_backward_op.register_fake
def _(grad_out, q, k, v, out, keep, bias, batch, seed, *rest):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _scaling_backward(x, a, b, us, vs, counts, dO, V, out, drop, options):
    """``(dS, dV)`` of one group in the scaling domain; ``x`` (the shifted tile) becomes ``K``."""
    K = x.exp_()
    u, vt = us[..., -1], vs[..., -1]
    uO = u.unsqueeze(-1) * dO
    # diag(u) dP diag(v) with dP = dO V^T, the gradient w.r.t. the (dropped-out) weights
    dP = torch.bmm(uO, (vt.unsqueeze(-1) * V).transpose(1, 2))
    if drop is None:
        D = torch.bmm(K.transpose(1, 2), uO)  # K^T (u * dO): (c, m, e)
    else:  # out = diag(u) (K * drop) diag(v) V
        dP.mul_(drop)
        D = torch.bmm(drop.mul_(K).transpose(1, 2), uO)
        del drop
    dvt = (V * D).sum(-1)  # sum_i u_i K_ij dP_ij
    dV = D.mul_(vt.unsqueeze(-1))
    du = torch.where(u > 0, (dO * out).sum(-1) / u, torch.zeros_like(u))  # sum_j K_ij v_j dP_ij
    if options.backward == "implicit":  # dS = P * (dP - alpha ⊕ beta)
        alpha, beta = _implicit_duals(K, u, vt, du * u, dvt * vt)
        X, Y = torch.stack([u * alpha, u], -1), torch.stack([vt, vt * beta], -1)
        dP.baddbmm_(X, Y.transpose(1, 2), alpha=-1.0)
    else:  # dS = K * (diag(u) dP diag(v) + X Y^T)
        X, Y = _reverse_recursion(K, a, b, us, vs, counts, du, dvt)
        dP.baddbmm_(X, Y.transpose(1, 2))
    return dP.mul_(K), dV


def _reverse_recursion(K, a, b, us, vs, counts, du, dvt):
    """Reverse mode through the scaling recursion.

    ``du``/``dvt`` are the gradients w.r.t. the final ``u``/``v``; ``us (c, n, Lu)``,
    ``vs (c, m, Lv)`` the iterates (``Lu + Lv - 1`` normalisations). Steps ``t > counts`` of a
    matrix were frozen (identity: the gradient passes through).
    Returns ``X (c, n, L)``, ``Y (c, m, L)`` with :math:`\\partial\\ell/\\partial K \\mathrel{+}= XY^\\top`
    (one rank-one term per iteration)."""
    xs, ys = [], []
    inv_a = _ratio(a, a.square())
    inv_b = _ratio(b, b.square())
    for t in range(us.shape[-1] + vs.shape[-1] - 1, 0, -1):
        act = (counts >= t).unsqueeze(-1)
        if t % 2:  # u_t = a / (K v_{t-1})
            u_t, v_prev = us[..., (t - 1) // 2], vs[..., (t - 1) // 2]
            dr = torch.where(act, -inv_a * du * u_t.square(), torch.zeros_like(du))
            xs.append(dr)
            ys.append(v_prev)
            dvt = dvt + _mtv(K, dr)
            du = torch.where(act, torch.zeros_like(du), du)
        else:  # v_t = b / (K^T u_{t-1})
            v_t, u_prev = vs[..., t // 2], us[..., t // 2 - 1]
            ds = torch.where(act, -inv_b * dvt * v_t.square(), torch.zeros_like(dvt))
            xs.append(u_prev)
            ys.append(ds)
            du = du + _mv(K, ds)
            dvt = torch.where(act, torch.zeros_like(dvt), dvt)
    return torch.stack(xs, -1), torch.stack(ys, -1)


def _log_backward(x, a, b, fs, gs, counts, dO, V, out, drop, options):
    """``(dS, dV)`` of one group in the log domain (every iteration's plan recomputed)."""
    P = torch.exp(x + fs[..., -1].unsqueeze(-1) + gs[..., -1].unsqueeze(-2))
    dP = torch.bmm(dO, V.transpose(1, 2))
    if drop is not None:
        dP.mul_(drop)
    dV = torch.bmm((P if drop is None else P * drop).transpose(1, 2), dO)
    if options.backward == "implicit":
        dF, dG = (P * dP).sum(-1), (P * dP).sum(-2)
        alpha, beta = _implicit_duals(P, torch.ones_like(a), torch.ones_like(b), dF, dG)
        return dP.sub_(alpha.unsqueeze(-1)).sub_(beta.unsqueeze(-2)).mul_(P), dV
    dS = dP.mul_(P)
    dF, dG = dS.sum(-1), dS.sum(-2)
    del P
    inv_a, inv_b = _ratio(a, a.square()), _ratio(b, b.square())  # 1/a, 0 where a = 0
    for t in range(fs.shape[-1] + gs.shape[-1] - 1, 0, -1):
        act = (counts >= t).unsqueeze(-1)
        if t % 2:  # f_t = log a - LSE_j(x + g_{t-1}); R = exp(x + f_t ⊕ g_{t-1}) has rows a
            i = (t - 1) // 2
            R = torch.exp(x + fs[..., i].unsqueeze(-1) + gs[..., i].unsqueeze(-2))
            coef = torch.where(act, dF * inv_a, torch.zeros_like(dF))
            dS.sub_(R.mul_(coef.unsqueeze(-1)))
            dG = dG - R.sum(-2)
            dF = torch.where(act, torch.zeros_like(dF), dF)
        else:  # g_t = log b - LSE_i(x + f_{t-1}); C = exp(x + f_{t-1} ⊕ g_t) has columns b
            i = t // 2
            C = torch.exp(x + fs[..., i - 1].unsqueeze(-1) + gs[..., i].unsqueeze(-2))
            coef = torch.where(act, dG * inv_b, torch.zeros_like(dG))
            dS.sub_(C.mul_(coef.unsqueeze(-2)))
            dF = dF - C.sum(-1)
            dG = torch.where(act, torch.zeros_like(dG), dG)
    return dS, dV


def _implicit_duals(K, u, vt, r, c, max_iters=1000):
    """Solve ``[diag(a) P; P^T diag(b)] [alpha; beta] = [r; c]`` by Jacobi-preconditioned CG,
    with ``P = diag(u) K diag(vt)`` and ``a, b`` its actual row/column sums.

    CG stops at a relative residual of 1e-10 (float64) or 1e-6 (float32): asking float32 for
    less makes it run on past its rounding floor, and the drift costs 0.1-10 % of the gradient."""
    tol = 1e-10 if K.dtype == torch.float64 else 1e-6
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


def _dropout_mask(like: Tensor, p: float, seed: Tensor | None, start: int) -> Tensor | None:
    """The scaled Bernoulli keep-mask ``(c, n, m)`` of the group starting at ``start`` (or None)."""
    if not p:
        return None
    generator = torch.Generator(device=like.device).manual_seed(int(seed.item()) + start)
    return torch.empty_like(like).bernoulli_(1.0 - p, generator=generator).div_(1.0 - p)


# ------------------------------------------------------------------------------------------------
# autograd


def _setup_context(ctx, inputs, output):
    q, k, v, keep, bias, batch, seed, *options = inputs
    out, row_shift, col_shift, us, vs, counts, log_domain = output
    ctx.save_for_backward(q, k, v, out, keep, bias, seed, row_shift, col_shift, us, vs, counts, log_domain)
    ctx.batch, ctx.options = batch, options


def _backward(ctx, grad_out, *unused):
    q, k, v, out, keep, bias, seed, row_shift, col_shift, us, vs, counts, log_domain = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph=True: second derivatives through the dense engine
        dq, dk, dv = _dense_grads(grad_out, q, k, v, keep, bias, ctx.batch, seed, _Options(*ctx.options))
    else:
        dq, dk, dv = torch.ops.sinkformer.tiled_backward(
            grad_out, q, k, v, out, keep, bias, ctx.batch, seed, row_shift, col_shift, us, vs, counts, log_domain,
            *ctx.options,
        )
    return (dq, dk, dv) + (None,) * 12


torch.library.register_autograd("sinkformer::tiled_forward", _backward, setup_context=_setup_context)
compute_in_float32_under_autocast("sinkformer::tiled_forward", "sinkformer::tiled_backward")


def _dense_grads(grad_out, q, k, v, keep, bias, batch, seed, options: _Options):
    """First derivatives with a graph (for second derivatives): the dense engine's weights with
    the same dropout masks, differentiated by autograd."""
    from .dense import attention_grads_with_graph

    if options.backward == "implicit":
        raise NotImplementedError(
            "second derivatives of backward='implicit' are not implemented (engine 'tiled'); "
            "use backward='unrolled' for double backward (e.g. gradient penalties)"
        )
    B, n, m = q.shape[0], q.shape[1], k.shape[1]
    drop = None
    if options.dropout_p:
        like, group = q.new_empty(B, n, m), options.group
        drop = torch.cat([_dropout_mask(like[s:s + group], options.dropout_p, seed, s) for s in range(0, B, group)])
    return attention_grads_with_graph(grad_out, q, k, v, Masks(keep, bias, tuple(batch)), scale=options.scale,
                                      n_iters=options.n_iters, tol=options.tol, max_iters=options.max_iters, drop=drop)
