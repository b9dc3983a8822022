r"""The flash engine: fused Triton kernels that never write the ``n × m`` matrix (GPUs).

Sinkhorn in the log domain is a sequence of row-wise log-sum-exps of biased dot-product scores
:math:`s_{ij} = \mathrm{scale}\,q_i\cdot k_j + \mathrm{bias}_{ij}`, from :math:`g^{(0)} = 0`:

.. math::

    f_i \leftarrow \log a_i - \mathrm{LSE}_j(s_{ij} + g_j), \qquad
    g_j \leftarrow \log b_j - \mathrm{LSE}_i(s_{ij} + f_i),

the normalisation of attention with a key bias, so each one tiles and streams like FlashAttention
(:mod:`._flash_kernels`: a column update is the same kernel on the transposed problem, no atomics).
The last row update is fused with the output :math:`o = Pv` (online rescaling); after an even count
the output is one more sweep with both potentials known. Only the potentials of every iteration
are saved, :math:`O((n+m)\,n\_iters)` per slice.

The backward is the **exact gradient of the** ``n_iters`` **map**, the recursion of the tiled
engine's log domain (:func:`.tiled._log_backward`) without its tile: with
:math:`P = e^{s + F\oplus G}` the final plan, :math:`dP = dO\,V^\top`,

.. math::

    \frac{\partial\ell}{\partial s_{ij}} = P_{ij}\,dP_{ij} - \sum_{t=1}^{n\_iters}
    e^{s_{ij} + \alpha_{ti} + \beta_{tj}}\,(\gamma_{ti} + \delta_{tj}),

one term per normalisation (:math:`\alpha, \beta` that iteration's potentials, :math:`\gamma` or
:math:`\delta` its coefficient, the other 0). The coefficients come from a vector recursion that
needs one matrix-vector sweep per normalisation (:data:`._flash_kernels.MATVEC`): its start
:math:`\sum_j P_{ij}dP_{ij} = dO_i\cdot o_i` costs nothing and
:math:`\sum_i P_{ij}dP_{ij} = v_j\cdot dV_j` comes with :math:`dV = P^\top dO`. Then
:math:`dq = \mathrm{scale}\;\partial S\,k` and :math:`dk = \mathrm{scale}\;\partial S^\top q` are one
sweep each (:func:`._flash_kernels.dscore`). ``tol=`` runs the same sweeps with the stop rule of
:class:`~.problem.Tolerance` (one host synchronisation per iteration). ``backward="implicit"``
differentiates the balanced fixed point instead, as the tiled engine does: one term,
:math:`\partial S = P\odot(dP - \alpha\oplus\beta)`, with the duals solved by conjugate gradients
whose products with :math:`P` and :math:`P^\top` are matrix-vector sweeps.

Cost: the forward runs ``n_iters`` log-sum-exp sweeps (the last fused with the output; one more
after an even count); the backward one sweep for ``dV``, ``n_iters - 1`` matrix-vector sweeps and
the ``dq`` and ``dk`` sweeps, which evaluate ``n_iters + 1`` exponentials per score.

On CUDA tensors the kernels compile for the GPU; on CPU tensors they run only under Triton's
interpreter (``TRITON_INTERPRET=1`` set before the first call), which is how they are tested
without a GPU. ``triton`` is optional (``pip install 'sinkformer[gpu]'``) and imported on first use.
"""

from __future__ import annotations

import importlib.util
import os

import torch
from torch import Tensor

from .problem import (
    Masks,
    Tolerance,
    column_error,
    compute_in_float32_under_autocast,
    converged_tol,
    implicit_duals,
    marginals,
    valid_rows_cols,
    warn_if_unconverged,
    warn_unbalanced,
)

__all__ = ["flash_attention", "unavailable"]

ENGINE = "flash"
#: (rows, columns) per block of a kernel program on GPUs, by operand dtype: every kernel then needs
#: < 100 KiB of shared memory on sm_90 (compiled for that target: float32 with 64 x 64 blocks
#: needed 132 KiB, float64 263 KiB, over an H100's 227; float64 with 32 x 32, 105 KiB).
GPU_BLOCKS = {torch.float16: (64, 64), torch.bfloat16: (64, 64), torch.float32: (64, 32), torch.float64: (32, 16)}
#: ... and under Triton's interpreter (CPU tests): few programs, several blocks already at n = 40.
INTERPRETER_BLOCKS = (32, 32)
#: the grid's second axis (slices) is limited to 65535 programs: larger batches run in chunks.
_MAX_SLICES = 65535


def _interpreter_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def unavailable(device_type: str) -> str | None:
    """Why the flash engine cannot run on ``device_type`` here (a sentence), or ``None``.

    It needs the ``triton`` package, and either CUDA tensors or CPU tensors with Triton's
    interpreter switched on (``TRITON_INTERPRET=1`` before the kernels are first imported)."""
    if importlib.util.find_spec("triton") is None:
        return ("engine 'flash' needs triton, which the core of sinkformer does not install: "
                "pip install 'sinkformer[gpu]' (Linux x86-64)")
    if device_type == "cuda":
        return None
    if device_type == "cpu":
        import sys

        loaded = sys.modules.get(__name__.rsplit(".", 1)[0] + "._flash_kernels")
        interpreted = loaded.INTERPRETED if loaded is not None else _interpreter_requested()
        if interpreted:
            return None
        return (f"engine 'flash' runs Triton kernels on CUDA tensors, got device {device_type!r} (CPU tensors run "
                "only under Triton's interpreter: set TRITON_INTERPRET=1 before the first call)")
    return f"engine 'flash' runs Triton kernels on CUDA tensors, got device {device_type!r}"


def _kernels():
    from . import _flash_kernels

    return _flash_kernels


def flash_attention(
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
) -> Tensor:
    """Sinkhorn attention ``(B, n, d) x (B, m, d) x (B, m, e) -> (B, n, e)`` on the fused kernels.

    ``q, k, v`` are flat over ``batch`` (``B = prod(batch)``), validated by
    :func:`sinkformer.attention`, all of one dtype (float32/float64, or float16/bfloat16 whose
    products the kernels run on tensor cores with float32 accumulation). ``keep`` (bool) and
    ``bias`` (float, no gradient) broadcast to ``batch + (n, m)``. Returns ``(B, n, e)`` in the
    dtype of ``v`` for half inputs, else in the compute dtype (float64 for float64, else float32).
    ``backward``: ``"unrolled"`` (exact gradient of the ``n_iters`` map) or ``"implicit"`` (the
    balanced fixed point's, by conjugate gradients on matrix-vector sweeps).
    """
    why = unavailable(q.device.type)
    if why is not None:
        raise ValueError(f"backend='flash' cannot serve this call: {why}")
    return torch.ops.sinkformer.flash_forward(q, k, v, keep, bias, list(batch), scale, n_iters, tol, max_iters,
                                              backward)[0]


# ------------------------------------------------------------------------------------------------
# launching the kernels


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _pow2(x: int) -> int:
    return max(16, 1 << max(0, x - 1).bit_length())


class _Problem:
    """One call's operands as the kernels see them: slices, masks (strided, never expanded),
    marginals and the launch configuration."""

    def __init__(self, q: Tensor, k: Tensor, keep: Tensor | None, bias: Tensor | None, batch: list[int],
                 scale: float):
        self.q, self.k, self.scale = q, k, scale
        self.B, self.n, self.m, self.d = q.shape[0], q.shape[1], k.shape[1], q.shape[2]
        self.acc = _acc_dtype(q.dtype)
        masks = Masks(keep, bias, tuple(batch))
        keep_s, bias_s = masks.keep_of(0, self.B), masks.bias_of(0, self.B)
        self.keep = None if keep_s is None else keep_s.view(torch.uint8)
        self.bias = None if bias_s is None else bias_s.to(self.acc)
        shape = (self.B, self.n, self.m)
        a, b = marginals(*valid_rows_cols(keep_s, shape), shape, q.new_empty((), dtype=self.acc))
        self.a, self.b = a.contiguous(), b.contiguous()
        self.log_a, self.log_b = _log_marginal(self.a), _log_marginal(self.b)
        self.dummy = torch.zeros(1, dtype=self.acc, device=q.device)
        self.blocks = INTERPRETER_BLOCKS if q.device.type == "cpu" else GPU_BLOCKS[q.dtype]
        self.precision = "ieee" if q.dtype in (torch.float32, torch.float64) else "tf32"

    def _mask(self, t: Tensor | None, transposed: bool) -> tuple:
        """``(pointer, batch stride, row stride, column stride)`` of a mask in one orientation."""
        if t is None:
            return self.dummy, 0, 0, 0
        sb, sr, sc = (0 if t.shape[i] == 1 else t.stride(i) for i in range(3))
        return (t, sb, sc, sr) if transposed else (t, sb, sr, sc)

    def _orient(self, transposed: bool) -> tuple:
        """``(R, C, n_r, n_c, keep, bias)``: the query orientation, or the key orientation."""
        if transposed:
            return self.k, self.q, self.m, self.n, self._mask(self.keep, True), self._mask(self.bias, True)
        return self.q, self.k, self.n, self.m, self._mask(self.keep, False), self._mask(self.bias, False)

    def sweep(self, mode: int, transposed: bool, pot_c: Tensor, *, pot_r: Tensor | None = None,
              log_a: Tensor | None = None, w: Tensor | None = None, v: Tensor | None = None) -> tuple:
        """Run :func:`._flash_kernels.sweep`; returns ``(row vector, output or None)``."""
        K = _kernels()
        R, C, n_r, n_c, keep, bias = self._orient(transposed)
        vec = torch.empty(self.B, n_r, dtype=self.acc, device=R.device)
        e = v.shape[-1] if v is not None else 0
        out = torch.empty(self.B, n_r, e, dtype=_out_dtype(v), device=R.device) if v is not None else None
        vv, oo = (v, out) if v is not None else (self.dummy.view(1, 1, 1), self.dummy.view(1, 1, 1))
        block_r, block_c = self.blocks
        for s in range(0, self.B, _MAX_SLICES):
            sl = slice(s, min(self.B, s + _MAX_SLICES))
            grid = (triton_cdiv(n_r, block_r), sl.stop - sl.start)
            args = [R[sl], C[sl], vv[sl] if v is not None else vv, oo[sl] if v is not None else oo,
                    _row(pot_r, sl, self.dummy), pot_c[sl], _row(log_a, sl, self.dummy), _row(w, sl, self.dummy),
                    vec[sl], _at(keep, sl), _at(bias, sl)]
            K.sweep[grid](
                *args, n_r, n_c, self.d, e, self.scale,
                *R.stride(), *C.stride(), *_strides3(v), *_strides3(out), n_r, n_c,
                keep[1], keep[2], keep[3], bias[1], bias[2], bias[3],
                MODE=mode, HAS_KEEP=self.keep is not None, HAS_BIAS=self.bias is not None, BLOCK_R=block_r,
                BLOCK_C=block_c, BLOCK_D=_pow2(self.d), BLOCK_E=_pow2(e), PRECISION=self.precision,
            )
        return vec, out

    def dscore(self, transposed: bool, x: Tensor, y: Tensor, pot_r: Tensor, pot_c: Tensor, terms: tuple) -> Tensor:
        """Run :func:`._flash_kernels.dscore`: ``scale * dS @ C`` (``dq``; ``dk`` when transposed)."""
        K = _kernels()
        R, C, n_r, n_c, keep, bias = self._orient(transposed)
        alpha, beta, gamma, delta = terms
        out = torch.empty(self.B, n_r, self.d, dtype=_out_dtype(R), device=R.device)
        e = x.shape[-1]
        block_r, block_c = self.blocks
        for s in range(0, self.B, _MAX_SLICES):
            sl = slice(s, min(self.B, s + _MAX_SLICES))
            grid = (triton_cdiv(n_r, block_r), sl.stop - sl.start)
            K.dscore[grid](
                R[sl], C[sl], x[sl], y[sl], out[sl], pot_r[sl], pot_c[sl], alpha[sl], beta[sl], gamma[sl], delta[sl],
                _at(keep, sl), _at(bias, sl), n_r, n_c, self.d, e, alpha.shape[1], self.scale,
                *R.stride(), *C.stride(), *x.stride(), *y.stride(), *out.stride(), n_r, n_c,
                alpha.shape[1] * n_r, alpha.shape[1] * n_c, keep[1], keep[2], keep[3], bias[1], bias[2], bias[3],
                HAS_KEEP=self.keep is not None, HAS_BIAS=self.bias is not None, BLOCK_R=block_r, BLOCK_C=block_c,
                BLOCK_D=_pow2(self.d), BLOCK_E=_pow2(e), PRECISION=self.precision,
            )
        return out


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _row(t: Tensor | None, sl: slice, dummy: Tensor) -> Tensor:
    return dummy if t is None else t[sl]


def _at(mask: tuple, sl: slice) -> Tensor:
    """The mask pointer for slices ``sl`` (a broadcast batch dimension stays as it is)."""
    t, sb = mask[0], mask[1]
    return t if sb == 0 else t[sl]


def _strides3(t: Tensor | None) -> tuple[int, int, int]:
    return (0, 0, 0) if t is None else tuple(t.stride())


def _log_marginal(a: Tensor) -> Tensor:
    """``log a`` with ``-inf`` where ``a = 0`` (rows/columns without mass keep potential 0)."""
    return torch.where(a > 0, a.clamp_min(torch.finfo(a.dtype).tiny).log(), torch.full_like(a, float("-inf")))


def _half_operands(q: Tensor, k: Tensor, v: Tensor) -> bool:
    return q.dtype in (torch.float16, torch.bfloat16)


def _out_dtype(operand: Tensor) -> torch.dtype:
    """A kernel output's dtype: the operand's when half (as FlashAttention), else float32/float64."""
    return operand.dtype if operand.dtype in (torch.float16, torch.bfloat16) else _acc_dtype(operand.dtype)


# ------------------------------------------------------------------------------------------------
# forward


@torch.library.custom_op("sinkformer::flash_forward", mutates_args=())
def _forward_op(
    q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None, bias: Tensor | None, batch: list[int], scale: float,
    n_iters: int | None, tol: float | None, max_iters: int, backward: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Returns ``out (B, n, e)``, the row potentials ``(B, n, Lf)`` (``f_1, f_3, ..``), the column
    potentials ``(B, m, Lg)`` (``g_0 = 0, g_2, ..``) and the normalisations each slice ran ``(B,)``.
    ``backward="implicit"`` keeps the last potentials only (``Lf = Lg = 1``)."""
    problem = _Problem(q, k, keep, bias, batch, scale)
    if tol is None:
        fs, gs, out = _fixed_iterations(problem, v, n_iters)
        counts = torch.full((problem.B,), n_iters, dtype=torch.int64, device=q.device)
    else:
        fs, gs, out, counts = _tolerance_iterations(problem, v, tol, max_iters, implicit=backward == "implicit")
    if backward == "implicit":
        fs, gs = fs[-1:], gs[-1:]
        if tol is None:
            col_sums = problem.sweep(_kernels().MATVEC, True, fs[0], pot_r=gs[0], w=torch.ones_like(problem.a))[0]
            warn_unbalanced(column_error(col_sums, problem.b), n_iters, converged_tol(q.dtype), ENGINE)
    return out, torch.stack(fs, -1), torch.stack(gs, -1), counts


@_forward_op.register_fake
def _(q, k, v, keep, bias, batch, scale, n_iters, tol, max_iters, backward):
    B, n, m = q.shape[0], q.shape[1], k.shape[1]
    acc = _acc_dtype(q.dtype)
    if backward == "implicit":
        lf = lg = 1
    elif tol is None:
        lf, lg = (n_iters + 1) // 2, n_iters // 2 + 1
    else:
        lf = torch.library.get_ctx().new_dynamic_size()
        lg = lf
    return (q.new_empty(B, n, v.shape[-1], dtype=_out_dtype(v)), q.new_empty(B, n, lf, dtype=acc),
            q.new_empty(B, m, lg, dtype=acc), q.new_empty(B, dtype=torch.int64))


def _fixed_iterations(p: _Problem, v: Tensor, n_iters: int):
    """``n_iters`` normalisations from ``g = 0``: ``fs = [f1, f3, ..]``, ``gs = [g0, g2, ..]``, out."""
    K = _kernels()
    fs, gs = [], [torch.zeros(p.B, p.m, dtype=p.acc, device=v.device)]
    out = None
    for t in range(1, n_iters + 1):
        if t % 2:
            last = t == n_iters
            f, out_t = p.sweep(K.LSE_OUT if last else K.LSE, False, gs[-1], log_a=p.log_a, v=v if last else None)
            fs.append(f)
            out = out_t if last else out
        else:
            gs.append(p.sweep(K.LSE, True, fs[-1], log_a=p.log_b)[0])
    if out is None:  # an even count ends on a column update: o = e^{s + f ⊕ g} v
        out = p.sweep(K.FIXED_OUT, False, gs[-1], pot_r=fs[-1], v=v)[1]
    return fs, gs, out


def _tolerance_iterations(p: _Problem, v: Tensor, tol: float, max_iters: int, implicit: bool = False):
    """Iterate until each slice's column error after a row update is ``<= tol`` (its potentials then
    freeze), or ``max_iters``: the rule of :class:`~.problem.Tolerance`. The column error comes from
    the next column update: :math:`\\sum_i P_{ij} = b_j e^{g_j - g'_j}` for the new potential ``g'``."""
    K = _kernels()
    stop = Tolerance(tol, max_iters, (p.B,), v.device, ENGINE)
    fs, gs = [], [torch.zeros(p.B, p.m, dtype=p.acc, device=v.device)]
    done = 0
    while True:
        f = p.sweep(K.LSE, False, gs[-1], log_a=p.log_a)[0]
        fs.append(f if not fs else torch.where(stop.active.unsqueeze(-1), f, fs[-1]))
        done += 1
        g = p.sweep(K.LSE, True, fs[-1], log_a=p.log_b)[0]
        gap = torch.where(p.b > 0, (p.b * torch.exp(gs[-1] - g) - p.b).abs(), torch.zeros_like(p.b))
        if stop.check(gap.amax(-1) if p.m else gap.sum(-1), done):
            break
        gs.append(torch.where(stop.active.unsqueeze(-1), g, gs[-1]))
        done += 1
    warn_if_unconverged([stop], implicit=implicit)
    out = p.sweep(K.FIXED_OUT, False, gs[-1], pot_r=fs[-1], v=v)[1]
    return fs, gs, out, stop.counts


# ------------------------------------------------------------------------------------------------
# backward


@torch.library.custom_op("sinkformer::flash_backward", mutates_args=())
def _backward_op(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, keep: Tensor | None, bias: Tensor | None,
    batch: list[int], fs: Tensor, gs: Tensor, counts: Tensor, scale: float, backward: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients ``(dq, dk, dv)`` of the forward op from its saved potentials."""
    p = _Problem(q, k, keep, bias, batch, scale)
    K = _kernels()
    dO = grad_out.to(v.dtype if _half_operands(q, k, v) else p.acc).contiguous()
    F, G = fs[..., -1].contiguous(), gs[..., -1].contiguous()
    dv = p.sweep(K.FIXED_OUT, True, F, pot_r=G, v=dO)[1]  # dV = P^T dO
    dF = (grad_out.to(p.acc) * out.to(p.acc)).sum(-1)  # sum_j P_ij dP_ij = dO_i . o_i
    dG = (v.to(p.acc) * dv.to(p.acc)).sum(-1)  # sum_i P_ij dP_ij = v_j . dV_j
    if backward == "implicit":  # dS = P * (dP - alpha ⊕ beta): one term
        alpha, beta = _implicit_duals(p, F, G, dF, dG)
        terms = (F.unsqueeze(1), G.unsqueeze(1), alpha.unsqueeze(1).contiguous(), beta.unsqueeze(1).contiguous())
    else:
        terms = _reverse_recursion(p, fs, gs, counts, dF, dG)
    dq = p.dscore(False, dO, v, F, G, terms)
    dk = p.dscore(True, v, dO, G, F, (terms[1], terms[0], terms[3], terms[2]))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@_backward_op.register_fake
def _(grad_out, q, k, v, out, keep, bias, batch, fs, gs, counts, scale, backward):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _reverse_recursion(p: _Problem, fs: Tensor, gs: Tensor, counts: Tensor, dF: Tensor, dG: Tensor) -> tuple:
    """Reverse mode through the potentials (as :func:`.tiled._log_backward`, the tile replaced by
    sweeps). Step ``t`` (odd: ``f_t = log a - LSE_j(s + g_{t-1})``; even: the column update) adds the
    term :math:`e^{s + \\alpha_t\\oplus\\beta_t}(\\gamma_t\\oplus\\delta_t)` to :math:`-\\partial S`
    and passes its row (column) sums on to ``dG`` (``dF``). Steps past a slice's count were frozen.

    Returns ``alpha, gamma (B, T, n)`` and ``beta, delta (B, T, m)``, contiguous."""
    K = _kernels()
    alphas, betas, gammas, deltas = [], [], [], []
    inv_a = torch.where(p.a > 0, 1 / p.a, torch.zeros_like(p.a))
    inv_b = torch.where(p.b > 0, 1 / p.b, torch.zeros_like(p.b))
    zero_n, zero_m = torch.zeros_like(dF), torch.zeros_like(dG)
    for t in range(fs.shape[-1] + gs.shape[-1] - 1, 0, -1):
        act = (counts >= t).unsqueeze(-1)
        if t % 2:  # R = e^{s + f_t ⊕ g_{t-1}} has rows a
            i = (t - 1) // 2
            alpha, beta = fs[..., i].contiguous(), gs[..., i].contiguous()
            gamma = torch.where(act, dF * inv_a, zero_n)
            alphas.append(alpha), betas.append(beta), gammas.append(gamma), deltas.append(zero_m)
            if t > 1:  # dG -= R^T gamma (not needed after the first step: g_0 is a constant)
                dG = dG - p.sweep(K.MATVEC, True, alpha, pot_r=beta, w=gamma)[0]
            dF = torch.where(act, zero_n, dF)
        else:  # C = e^{s + f_{t-1} ⊕ g_t} has columns b
            i = t // 2
            alpha, beta = fs[..., i - 1].contiguous(), gs[..., i].contiguous()
            delta = torch.where(act, dG * inv_b, zero_m)
            alphas.append(alpha), betas.append(beta), gammas.append(zero_n), deltas.append(delta)
            dF = dF - p.sweep(K.MATVEC, False, beta, pot_r=alpha, w=delta)[0]
            dG = torch.where(act, zero_m, dG)
    return (torch.stack(alphas, 1).contiguous(), torch.stack(betas, 1).contiguous(),
            torch.stack(gammas, 1).contiguous(), torch.stack(deltas, 1).contiguous())


def _implicit_duals(p: _Problem, F: Tensor, G: Tensor, r: Tensor, c: Tensor, max_iters: int = 1000):
    """:func:`~.problem.implicit_duals` for :math:`P = e^{s + F\\oplus G}`, its products with ``P`` and
    ``P^T`` matrix-vector sweeps."""
    K = _kernels()
    tol = 1e-10 if p.acc == torch.float64 else 1e-6
    return implicit_duals(lambda y: p.sweep(K.MATVEC, False, G, pot_r=F, w=y.contiguous())[0],
                          lambda x: p.sweep(K.MATVEC, True, F, pot_r=G, w=x.contiguous())[0], r, c, tol=tol,
                          max_iters=max_iters)


# ------------------------------------------------------------------------------------------------
# autograd


def _setup_context(ctx, inputs, output):
    q, k, v, keep, bias, batch, scale, n_iters, tol, max_iters, backward = inputs
    out, fs, gs, counts = output
    ctx.save_for_backward(q, k, v, out, keep, bias, fs, gs, counts)
    ctx.batch, ctx.options = batch, (scale, n_iters, tol, max_iters, backward)


def _backward(ctx, grad_out, *unused):
    q, k, v, out, keep, bias, fs, gs, counts = ctx.saved_tensors
    scale, n_iters, tol, max_iters, backward = ctx.options
    if torch.is_grad_enabled():  # create_graph=True: second derivatives through the dense engine
        from .dense import attention_grads_with_graph

        if backward == "implicit":
            raise NotImplementedError(
                "second derivatives of backward='implicit' are not implemented (engine 'flash'); "
                "use backward='unrolled' for double backward (e.g. gradient penalties)"
            )

        dq, dk, dv = attention_grads_with_graph(
            grad_out, q, k, v, Masks(keep, bias, tuple(ctx.batch)), scale=scale, n_iters=n_iters, tol=tol,
            max_iters=max_iters, drop=None)
    else:
        dq, dk, dv = torch.ops.sinkformer.flash_backward(grad_out, q, k, v, out, keep, bias, ctx.batch, fs, gs,
                                                         counts, scale, backward)
    return (dq, dk, dv) + (None,) * 8


torch.library.register_autograd("sinkformer::flash_forward", _backward, setup_context=_setup_context)
compute_in_float32_under_autocast("sinkformer::flash_forward", "sinkformer::flash_backward")
