r"""Attention as a function of ``(q, k, v)``, shaped like ``scaled_dot_product_attention``.

.. math::

    \mathrm{out}_i = \sum_j P_{ij} v_j ,\qquad P = \mathcal N(S),\qquad
    S_{ij} = \mathrm{scale}\cdot c(q_i, k_j) + \mathrm{bias}_{ij}

with the cost :math:`c` either ``"dot"`` (:math:`q\cdot k`) or ``"l2"``
(:math:`-|q-k|^2/2`, the L2 attention of Kim et al. 2021), and the normalisation
:math:`\mathcal N` one of

* ``"softmax"``: :math:`P_{ij} = e^{S_{ij}} w_j / \sum_{j'} e^{S_{ij'}} w_{j'}` (row-stochastic);
* ``"sinkhorn"``: ``n_iters`` alternate row/column normalisations (paper eq. (3));
  ``n_iters=1`` is SoftMax, large odd ``n_iters`` doubly stochastic;
* ``"linear"``, ``"sigmoid"``, ``"relu"``: :math:`P_{ij} = \sigma(S_{ij})\,w_j` with
  :math:`\sigma` the identity, the logistic function or :math:`\max(\cdot,0)` — not
  normalised, the integral against the key measure :math:`w` (uniform over non-padding keys
  by default), as in Castin et al. §2 and ``FORMULAS.md`` §1.2/§1.5.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .._validation import check_choice, check_finite, check_positive_int, check_tensor, compute_dtype
from ..sinkhorn import sinkhorn
from .masks import align_to_batch, combine_masks
from .sinkhorn_fast import sinkhorn_attention
from .streaming import streamed_sinkhorn_attention

__all__ = ["attention", "NORMALIZATIONS", "COSTS"]

NORMALIZATIONS = ("softmax", "sinkhorn", "linear", "sigmoid", "relu")
COSTS = ("dot", "l2")
BACKWARDS = ("unrolled", "implicit")
#: Above this many score entries per matrix, Sinkhorn attention switches to the chunked mode.
STREAM_ABOVE = 1 << 24

_POINTWISE = {"linear": lambda s: s, "sigmoid": torch.sigmoid, "relu": torch.relu}


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    normalization: str = "sinkhorn",
    n_iters: int | None = 5,
    tol: float | None = None,
    cost: str = "dot",
    scale: float | None = None,
    attn_mask: Tensor | None = None,
    key_padding_mask: Tensor | None = None,
    query_padding_mask: Tensor | None = None,
    is_causal: bool = False,
    key_weights: Tensor | None = None,
    query_weights: Tensor | None = None,
    dropout_p: float = 0.0,
    return_weights: bool = False,
    backward: str = "unrolled",
    chunk_size: int | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention with SoftMax, Sinkhorn or unnormalised weights.

    Args:
        q: ``(..., n_q, d)`` queries. k: ``(..., n_k, d)`` keys. v: ``(..., n_k, d_v)`` values.
            Batch dimensions broadcast.
        normalization: ``"sinkhorn"`` (default), ``"softmax"``, ``"linear"``, ``"sigmoid"``
            or ``"relu"``.
        n_iters: Sinkhorn normalisations (1 = SoftMax); ``None`` with ``tol`` to iterate to
            convergence. Ignored by the other normalisations.
        tol: Sinkhorn marginal tolerance (requires ``n_iters=None``).
        cost: ``"dot"`` (:math:`q\\cdot k`) or ``"l2"`` (:math:`-|q-k|^2/2`).
        scale: multiplies the cost; default :math:`1/\\sqrt d`.
        attn_mask: bool (True = take part) or float (added to the scores), broadcastable to
            ``(..., n_q, n_k)`` — as in ``scaled_dot_product_attention``.
        key_padding_mask: ``(*batch_prefix, n_k)`` bool, True = padding key.
        query_padding_mask: ``(*batch_prefix, n_q)`` bool, True = padding query: its row is
            zero and, for Sinkhorn, it takes no part in the column normalisation.
        is_causal: add the causal mask ``j <= i`` (top-left aligned, as SDPA).
        key_weights: ``(*batch_prefix, n_k)`` non-negative weights of the key measure
            (normalised here); default uniform. Used by the dynamics toolkit.
        query_weights: ``(*batch_prefix, n_q)`` weights of the query measure (Sinkhorn's row
            marginal); default uniform.
        dropout_p: dropout probability on the attention weights.
        return_weights: also return the ``(..., n_q, n_k)`` weights (before dropout).
        backward: Sinkhorn gradient: ``"unrolled"`` (exact gradient of the ``n_iters`` map) or
            ``"implicit"`` (implicit function theorem at the balanced fixed point; use with
            ``tol=`` or many iterations).

        chunk_size: Sinkhorn only: stream over blocks of ``chunk_size`` queries (each against all
            keys) so that no ``n_q × n_k`` matrix exists; memory grows linearly in the length.
            Chosen automatically when ``n_q * n_k`` exceeds :data:`STREAM_ABOVE`.

    Sinkhorn attention without ``return_weights``, dropout or measure weights runs the fast path
    of :mod:`sinkformer.attention.sinkhorn_fast` (custom autograd, no stored score matrix), or its
    chunked form :mod:`sinkformer.attention.streaming`; ``n_iters=1`` and ``"softmax"`` run
    PyTorch's SDPA kernel.

    Returns:
        ``(..., n_q, d_v)`` output in the dtype of ``q`` (and the weights if asked).
    """
    _check_qkv(q, k, v)
    check_choice(normalization, "normalization", NORMALIZATIONS)
    check_choice(cost, "cost", COSTS)
    check_choice(backward, "backward", BACKWARDS)
    if normalization == "sinkhorn" and tol is None:
        check_positive_int(n_iters, "n_iters")
    if chunk_size is not None:
        check_positive_int(chunk_size, "chunk_size")
    if not (0.0 <= dropout_p < 1.0):
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])

    out_dtype = q.dtype
    dtype = compute_dtype(out_dtype)
    batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    n_q, n_k = q.shape[-2], k.shape[-2]
    keep, bias = combine_masks(
        batch + (n_q, n_k),
        attn_mask=attn_mask,
        key_padding_mask=key_padding_mask,
        query_padding_mask=query_padding_mask,
        dtype=dtype,
    )
    if is_causal:
        causal = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril()
        keep = causal if keep is None else keep & causal
    wk = _measure(key_weights, "key_weights", batch, n_k, dtype)
    wq = _measure(query_weights, "query_weights", batch, n_q, dtype)

    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if cost == "l2" and normalization in ("softmax", "sinkhorn"):
        q, k, cost = *_l2_as_dot(q, k), "dot"
    plain = wk is None and wq is None and not return_weights
    if plain and (normalization == "softmax" or (normalization == "sinkhorn" and n_iters == 1 and tol is None)):
        return _sdpa(q, k, v, keep, bias, scale, dropout_p).to(out_dtype)
    if plain and normalization == "sinkhorn" and (bias is None or not bias.requires_grad):
        if chunk_size is None and (n_q * n_k <= STREAM_ABOVE or dropout_p > 0):
            out = sinkhorn_attention(
                q, k, v, scale=scale, n_iters=n_iters, tol=tol, keep=keep, bias=bias, backward=backward,
                dropout_p=dropout_p,
            )
        elif backward == "implicit" or dropout_p > 0:
            raise ValueError(
                f"backward={backward!r} with dropout_p={dropout_p} needs the tiled mode, not the chunked mode "
                f"(chunk_size={chunk_size}); use backward='unrolled' and dropout_p=0 with chunk_size"
            )
        else:
            out = streamed_sinkhorn_attention(
                q, k, v, scale=scale, n_iters=n_iters, tol=tol, keep=keep, bias=bias, chunk_size=chunk_size
            )
        return out.to(out_dtype)
    if backward != "unrolled":
        raise ValueError(
            f"backward={backward!r} needs the fast Sinkhorn path, which return_weights and key/query "
            "weights do not take; use backward='unrolled'"
        )

    scores = scale * (q @ k.transpose(-1, -2))
    if cost == "l2":
        scores = scores - (scale / 2) * (q.square().sum(-1, keepdim=True) + k.square().sum(-1).unsqueeze(-2))
    if bias is not None:
        scores = scores + bias

    if normalization == "softmax":
        weights = sinkhorn(_add_log(scores, wk), 1, mask=keep)
    elif normalization == "sinkhorn":
        weights = _sinkhorn(scores, keep, wk, wq, n_iters, tol)
    else:
        if wk is None:
            wk = _uniform_keys(key_padding_mask, batch, n_k, dtype, q.device)
        weights = _POINTWISE[normalization](scores) * wk.unsqueeze(-2)
        if keep is not None:
            weights = weights.masked_fill(~keep, 0.0)

    dropped = F.dropout(weights, dropout_p) if dropout_p > 0 else weights
    out = (dropped @ v).to(out_dtype)
    return (out, weights.to(out_dtype)) if return_weights else out


def _check_qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(t, name, min_dim=2, floating=True)
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same last dimension d, got q {tuple(q.shape)} and k {tuple(k.shape)}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"k and v must have the same length n_k (dim -2), got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must have the same dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    try:
        torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    except RuntimeError:
        raise ValueError(
            f"q, k and v batch dimensions must broadcast, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        ) from None
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_finite(t, name)


def _measure(w: Tensor | None, name: str, batch: tuple[int, ...], n: int, dtype: torch.dtype) -> Tensor | None:
    """Normalised measure weights aligned to ``(*batch_prefix, 1.., n)``, or ``None``."""
    if w is None:
        return None
    check_tensor(w, name, floating=True)
    check_finite(w, name)
    if bool((w < 0).any()) or not bool((w.sum(-1) > 0).all()):
        raise ValueError(f"{name} must be non-negative with a positive sum per sequence, got min {w.min().item():.3g}")
    w = align_to_batch(w.to(dtype), name, batch, n)
    return w / w.sum(-1, keepdim=True)


def _add_log(scores: Tensor, wk: Tensor | None) -> Tensor:
    """``S_ij + log w_j`` (zero weights become -inf, i.e. masked)."""
    return scores if wk is None else scores + wk.log().unsqueeze(-2)


def _uniform_keys(key_padding_mask: Tensor | None, batch: tuple[int, ...], n_k: int, dtype, device) -> Tensor:
    """The empirical key measure: ``1/n`` on each non-padding key."""
    if key_padding_mask is None:
        return torch.full((n_k,), 1.0 / n_k, dtype=dtype, device=device)
    valid = (~align_to_batch(key_padding_mask, "key_padding_mask", batch, n_k)).to(dtype)
    return valid / valid.sum(-1, keepdim=True).clamp_min(1)


def _l2_as_dot(q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
    """``[q, 1] . [k, -|k|^2/2] = q.k - |k|^2/2``: the L2 cost :math:`-|q-k|^2/2` up to the query
    term :math:`-|q|^2/2`, which cancels in every row normalisation (SoftMax and each Sinkhorn
    iterate) — so L2 attention runs on the dot-product kernels, gradients included."""
    ones = q.new_ones(q.shape[:-1] + (1,))
    return torch.cat([q, ones], -1), torch.cat([k, -0.5 * k.square().sum(-1, keepdim=True)], -1)


def _sdpa(q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None, bias: Tensor | None, scale: float,
          dropout_p: float) -> Tensor:
    """SoftMax attention through PyTorch's fused kernel; rows with no valid key give zeros."""
    mask = bias
    if keep is not None:
        mask = keep if bias is None else bias.masked_fill(~keep, float("-inf"))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale)
    if keep is not None:
        out = out * keep.any(-1, keepdim=True)
    return out


def _sinkhorn(
    scores: Tensor, keep: Tensor | None, wk: Tensor | None, wq: Tensor | None, n_iters: int | None, tol: float | None
) -> Tensor:
    """Sinkhorn weights; with measure weights the coupling is taken w.r.t. ``mu_q x mu_k``.

    The coupling :math:`\\pi = e^{S + \\log w_k + f \\oplus g}` has marginals ``(w_q, w_k)`` and
    the attention is :math:`\\pi_{ij}/w_{q,i}`, so that one iteration is the weighted SoftMax.
    """
    if wk is None and wq is None:
        return sinkhorn(scores, n_iters, tol=tol, mask=keep)
    n_q, n_k = scores.shape[-2:]
    wk = wk if wk is not None else scores.new_full((n_k,), 1.0 / n_k)
    wq = wq if wq is not None else scores.new_full((n_q,), 1.0 / n_q)
    if keep is not None:  # no mass on rows/columns that are entirely masked
        full = keep.expand(scores.shape)
        wq, wk = wq * full.any(-1), wk * full.any(-2)
        tiny = torch.finfo(scores.dtype).tiny
        wq = wq / wq.sum(-1, keepdim=True).clamp_min(tiny)
        wk = wk / wk.sum(-1, keepdim=True).clamp_min(tiny)
    plan = sinkhorn(_add_log(scores, wk), n_iters, tol=tol, mask=keep, row_marginals=wq, col_marginals=wk)
    return plan / wq.unsqueeze(-1).clamp_min(torch.finfo(plan.dtype).tiny)
