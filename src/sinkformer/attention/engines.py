r"""The built-in attention engines: how each runs a validated call, and its registration.

Registered in ``"auto"``'s priority order (:mod:`.backends` reads their capabilities):

``sdpa`` (SoftMax on PyTorch's fused kernel) → ``causal`` (causal Sinkhorn, every prefix balanced on
its own) → ``flash`` (Triton kernels, CUDA) → ``streamed`` (row blocks, long sequences) → ``tiled``
(cached tiles, the default) → ``dense`` (the weights materialised: the reference, and every option).

Each ``run`` receives a :class:`~.backends.Prepared` call (operands in compute precision, masks
combined into ``keep``/``bias``) with non-empty shapes and returns ``(*batch, n_q, d_v)`` in
``prepared.out_dtype`` (and the weights with ``return_weights``).
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor

from .._capture import exact_path, patched
from .._validation import capturing
from ..sinkhorn import flash, sinkhorn, sizes
from ..sinkhorn.causal_blocks import causal_block_attention, key_mask
from ..sinkhorn.prefix import prefix_sinkhorn
from ..sinkhorn.streamed import streamed_attention
from ..sinkhorn.tiled import tiled_attention
from .backends import POINTWISE, Call, Engine, Prepared, causal_cost, register
from .masks import align_to_batch

__all__ = ["run_sdpa", "run_dense", "run_causal", "run_tiled", "run_streamed", "run_flash", "sdpa"]

_POINTWISE = {"linear": lambda s: s, "sigmoid": torch.sigmoid, "relu": torch.relu}


# ---- SoftMax on PyTorch's fused kernel ---------------------------------------------------------


def sdpa(q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None, bias: Tensor | None, scale: float,
         dropout_p: float) -> Tensor:
    """SoftMax attention through PyTorch's fused kernel; rows with no valid key give zeros."""
    mask = bias
    if keep is not None:
        mask = keep if bias is None else bias.masked_fill(~keep, float("-inf"))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale)
    if keep is not None:
        out = out * keep.any(-1, keepdim=True)
    return out


def run_sdpa(p: Prepared) -> Tensor:
    """SoftMax (or Sinkhorn with one normalisation) on ``scaled_dot_product_attention``."""
    if p.sdpa_is_causal:
        out = F.scaled_dot_product_attention(p.q, p.k, p.v, dropout_p=p.call.dropout_p, is_causal=True, scale=p.scale)
    else:
        out = sdpa(p.q, p.k, p.v, p.keep, p.bias, p.scale, p.call.dropout_p)
    return out.to(p.out_dtype)


# ---- the weights materialised ------------------------------------------------------------------


def run_dense(p: Prepared, causal: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """The weights materialised: SoftMax, Sinkhorn (the reference), causal Sinkhorn (every prefix
    balanced on its own, :func:`~sinkformer.sinkhorn.prefix.prefix_sinkhorn`) or pointwise."""
    q, k, v, call = p.q, p.k, p.v, p.call
    scores = p.scale * (q @ k.transpose(-1, -2))
    if call.cost == "l2":
        scores = scores - (p.scale / 2) * (q.square().sum(-1, keepdim=True) + k.square().sum(-1).unsqueeze(-2))
    if p.bias is not None:
        scores = scores + p.bias
    if causal:
        weights = prefix_sinkhorn(scores, call.n_iters, mask=p.keep, marginals="causal")
    elif call.normalization == "softmax":
        weights = sinkhorn(_add_log(scores, p.wk), 1, mask=p.keep)
    elif call.normalization == "sinkhorn":
        weights = _sinkhorn(scores, p.keep, p.wk, p.wq, call.n_iters, call.tol, call.max_iters)
    else:
        wk = p.wk
        if wk is None:
            wk = _uniform_keys(p.key_padding_mask, p.batch, k.shape[-2], q.dtype, q.device)
        weights = _POINTWISE[call.normalization](scores) * wk.unsqueeze(-2)
        if p.keep is not None:
            weights = weights.masked_fill(~p.keep, 0.0)
    dropped = F.dropout(weights, call.dropout_p) if call.dropout_p > 0 else weights
    out = (dropped @ v).to(p.out_dtype)
    return (out, weights.to(p.out_dtype)) if call.return_weights else out


def _add_log(scores: Tensor, wk: Tensor | None) -> Tensor:
    """``S_ij + log w_j`` (zero weights become -inf, i.e. masked)."""
    return scores if wk is None else scores + wk.log().unsqueeze(-2)


def _uniform_keys(key_padding_mask: Tensor | None, batch: tuple[int, ...], n_k: int, dtype, device) -> Tensor:
    """The empirical key measure: ``1/n`` on each non-padding key."""
    if key_padding_mask is None:
        return torch.full((n_k,), 1.0 / n_k, dtype=dtype, device=device)
    valid = (~align_to_batch(key_padding_mask, "key_padding_mask", batch, n_k)).to(dtype)
    return valid / valid.sum(-1, keepdim=True).clamp_min(1)


def _sinkhorn(
    scores: Tensor, keep: Tensor | None, wk: Tensor | None, wq: Tensor | None, n_iters: int | None,
    tol: float | None, max_iters: int,
) -> Tensor:
    r"""Sinkhorn weights; with measure weights the coupling is taken w.r.t. ``mu_q x mu_k``.

    The coupling :math:`\pi = e^{S + \log w_k + f \oplus g}` has marginals ``(w_q, w_k)`` and
    the attention is :math:`\pi_{ij}/w_{q,i}`, so that one iteration is the weighted SoftMax.
    """
    if wk is None and wq is None:
        return sinkhorn(scores, n_iters, tol=tol, max_iters=max_iters, mask=keep)
    n_q, n_k = scores.shape[-2:]
    wk = wk if wk is not None else scores.new_full((n_k,), 1.0 / n_k)
    wq = wq if wq is not None else scores.new_full((n_q,), 1.0 / n_q)
    if keep is not None:  # no mass on rows/columns that are entirely masked
        full = keep.expand(scores.shape)
        wq, wk = wq * full.any(-1), wk * full.any(-2)
        tiny = torch.finfo(scores.dtype).tiny
        wq = wq / wq.sum(-1, keepdim=True).clamp_min(tiny)
        wk = wk / wk.sum(-1, keepdim=True).clamp_min(tiny)
    plan = sinkhorn(_add_log(scores, wk), n_iters, tol=tol, max_iters=max_iters, mask=keep, row_marginals=wq,
                    col_marginals=wk)
    return plan / wq.unsqueeze(-1).clamp_min(torch.finfo(plan.dtype).tiny)


# ---- causal Sinkhorn ---------------------------------------------------------------------------

#: Multiply-adds of causal Sinkhorn's O(n^3) path (``n_iters >= 4``) from which a call warns, once per
#: process: ``slices * n^3 * (n_iters - 3)`` (n = 1024, 8 slices, 5 iterations: 1.7e10, seconds on a CPU).
CUBIC_WARN_FROM = 1 << 33
_cubic_warned = False


def run_causal(p: Prepared) -> Tensor | tuple[Tensor, Tensor]:
    """Causal Sinkhorn: row blocks for 2-3 iterations (:func:`in_causal_blocks`), else the weights
    materialised (:func:`run_dense`, O(n^3) time from 4 iterations on)."""
    if in_causal_blocks(p):
        return _causal_blocks(p)
    _warn_if_cubic(p.call.n_iters, p.q.shape[-2], math.prod(p.batch))
    return run_dense(p, causal=True)


def in_causal_blocks(p: Prepared) -> bool:
    """Causal Sinkhorn that :func:`~sinkformer.sinkhorn.causal_blocks.causal_block_attention` serves
    without an ``n × n`` matrix: 2 or 3 iterations, dot-product scores, no bias, no weights
    returned, no dropout, at most a key padding mask."""
    call = p.call
    return (call.n_iters in (2, 3) and call.cost == "dot" and p.bias is None and not call.return_weights
            and not call.dropout_p and (p.keep is None or p.keep.shape[-2] == 1))


def _causal_blocks(p: Prepared) -> Tensor:
    """Causal Sinkhorn in row blocks; rows whose sums underflow come from the log domain."""
    problem = p.problem()
    out, inexact = causal_block_attention(problem)
    keep = key_mask(problem)
    # the rows whose sums underflow, from the log domain: row t of prefix_sinkhorn (read rows <= t only)
    out = patched(out, inexact.unsqueeze(-1), _prefix_attention, problem.q, problem.k, problem.v,
                  *(() if keep is None else (keep,)), scale=problem.scale, n_iters=problem.n_iters)
    return out.reshape(p.batch + (problem.n, p.v.shape[-1])).to(p.out_dtype)


@exact_path
def _prefix_attention(q: Tensor, k: Tensor, v: Tensor, *keep: Tensor, scale: float, n_iters: int) -> Tensor:
    """Causal Sinkhorn attention from :func:`~sinkformer.sinkhorn.prefix.prefix_sinkhorn`'s weights
    (log domain where sums underflow): ``(B, n, d)`` → ``(B, n, d_v)``; ``keep`` ``(B, n)``."""
    return prefix_sinkhorn(scale * (q @ k.transpose(-1, -2)), n_iters, mask=keep[0].unsqueeze(-2) if keep else None) @ v


def _warn_if_cubic(n_iters: int, n: int, slices: int) -> None:
    """Warn (once per process) that causal Sinkhorn with ``n_iters >= 4`` is about to cost O(n^3)."""
    global _cubic_warned
    work = slices * n**3 * (n_iters - 3)
    if n_iters < 4 or work < CUBIC_WARN_FROM or _cubic_warned or capturing():
        return
    _cubic_warned = True
    warnings.warn(
        f"causal Sinkhorn with n_iters={n_iters} at n={n} ({slices} slice(s)) takes the O(n^3) path: each "
        f"normalisation beyond the third is an n x n x n matrix product ({work:.2g} multiply-adds here, "
        f"and O(n^2 * n_iters) memory per slice), while n_iters <= 3 costs O(n^2) like SoftMax. Use n_iters=3 for "
        "long sequences. (This warning is shown once per process.)", UserWarning, stacklevel=5)


# ---- the engines on flattened slices -----------------------------------------------------------


def _on_slices(p: Prepared, fn, **options) -> Tensor:
    """``fn`` on the call's :class:`~sinkformer.sinkhorn.problem.Problem` (flat ``(B, n, d)`` slices), with
    the engine's own ``options``."""
    out = fn(p.problem(), **options)
    return out.reshape(p.batch + (p.q.shape[-2], p.v.shape[-1])).to(p.out_dtype)


def run_tiled(p: Prepared) -> Tensor:
    """:func:`~sinkformer.sinkhorn.tiled.tiled_attention`: cached tiles, custom backward."""
    return _on_slices(p, tiled_attention, backward=p.call.backward, dropout_p=p.call.dropout_p)


def run_streamed(p: Prepared) -> Tensor:
    """:func:`~sinkformer.sinkhorn.streamed.streamed_attention`: row blocks, never an ``n_q × n_k`` tile."""
    return _on_slices(p, streamed_attention, chunk_size=p.call.chunk_size)


def run_flash(p: Prepared) -> Tensor:
    """:func:`~sinkformer.sinkhorn.flash.flash_attention`: fused Triton kernels."""
    return _on_slices(p, flash.flash_attention, backward=p.call.backward)


# ---- the registrations, in "auto"'s priority order ---------------------------------------------


def _streams(call: Call) -> str | None:
    if call.chunk_size is not None:
        return f"chunk_size={call.chunk_size} asks for row blocks (memory linear in the length)"
    if call.scores > sizes.STREAM_ABOVE:
        return f"one slice has n_q*n_k = {call.scores} > 2^24 scores: never an n_q x n_k tile"
    return None


_SLICE_RECOMPUTE = "exact (the weights recomputed by the dense engine)"

register(Engine(
    "sdpa", "PyTorch's fused `scaled_dot_product_attention`: SoftMax, and Sinkhorn with `n_iters=1`",
    "PyTorch's fused kernel", run_sdpa, normalizations=("softmax", "sinkhorn"), iterations=False, tol=False, dropout=True,
    learned_bias=True, double_backward="exact (autograd)", module="torch.nn.functional",
    prefers=lambda call: "SoftMax (n_iters=1 is exactly SoftMax) runs PyTorch's fused kernel" if call.softmax else None,
))
register(Engine(
    "causal", "causal Sinkhorn (`is_causal=True`): row t is row t of the balanced prefix 0..t; 2-3 iterations "
    "with at most key padding in row blocks with a custom backward, otherwise the weights materialised",
    "`O(n)` per slice in row blocks; else `O(n²·n_iters)`, `O(n³)` time from 4 iterations",
    run_causal, tol=False, causal="prefix", return_weights=True, dropout=True, learned_bias=True,
    double_backward="exact (row blocks: the weights recomputed, autograd)", module="sinkformer.sinkhorn.prefix, .causal_blocks", cost=causal_cost,
    prefers=lambda call: ("is_causal=True: every prefix 0..t balanced on its own, row t kept (zero leakage)"
                          if call.causal and call.iterations else None),
))
register(Engine(
    "flash", "fused Triton kernels, exact custom backward; CUDA tensors (CPU ones under Triton's interpreter)",
    "never an `n_q × n_k` matrix; `O(n)` saved per slice", run_flash, implicit_backward=True,
    devices=("cuda", "cpu"), double_backward=_SLICE_RECOMPUTE + "; not for backward='implicit'", half_operands=True,
    module="sinkformer.sinkhorn.flash",
    limits=lambda call: flash.unavailable(call.device, call.dtype, call.head_dim, call.value_dim),
    prefers=lambda call: ("fused Triton kernels on CUDA: never an n_q x n_k matrix, O(n) saved per slice"
                          if call.device == "cuda" else None),
))
register(Engine(
    "streamed", "Sinkhorn streamed over row blocks, custom backward: for long sequences",
    "never an `n_q × n_k` tile; linear in the length", run_streamed, chunk_size=True,
    double_backward=_SLICE_RECOMPUTE, module="sinkformer.sinkhorn.streamed", prefers=_streams,
))
register(Engine(
    "tiled", "Sinkhorn on cached tiles (scaling or log domain; on CPUs, the passes of unmasked slices run in C where "
    "a compiler is found), exact or implicit custom backward: the default",
    "`O(n)` saved per slice", run_tiled, implicit_backward=True, dropout=True,
    double_backward=_SLICE_RECOMPUTE + "; not for backward='implicit'", module="sinkformer.sinkhorn.tiled, .native",
    prefers=lambda call: "Sinkhorn on cached tiles, O(n) saved per slice",
))
register(Engine(
    "dense", "the `n_q × n_k` weights materialised, autograd through the log-domain iterations: the reference, "
    "every normalisation and option", "`O(n_q·n_k·n_iters)` when differentiated", run_dense,
    normalizations=("softmax", "sinkhorn") + POINTWISE, return_weights=True, measure_weights=True, dropout=True,
    learned_bias=True, double_backward="exact (autograd)", module="sinkformer.sinkhorn.dense",
    prefers=lambda call: "the n_q x n_k weights materialised (O(n_q*n_k*n_iters) memory when differentiated)",
))
