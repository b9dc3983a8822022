"""Turning the user's masks into one ``keep`` mask and one additive bias.

Conventions (those of the libraries the arguments come from):

* ``attn_mask`` follows :func:`torch.nn.functional.scaled_dot_product_attention`: a bool mask
  with True = *take part*, or a float mask added to the scores (``-inf`` = excluded). For Sinkhorn
  attention (``masked_from=MASKING``) an entry at or below :data:`MASKING` (-10⁴) is excluded too:
  the conventions ``-1e4`` (BERT), ``-1e9`` (the official Sinkformers code) and
  ``torch.finfo(dtype).min`` (Hugging Face) all mean masking, and Sinkhorn's column
  normalisation would undo a finite bias shared by a whole column.
* ``key_padding_mask`` / ``query_padding_mask`` follow :class:`torch.nn.MultiheadAttention`:
  True = *padding* (excluded).

Every entry point reads its masks here: :func:`combine_masks` gives :func:`sinkformer.attention`'s
``(keep, bias)``, which the engines receive; :func:`split_key_padding` and :func:`additive_attn_mask`
read :class:`torch.nn.MultiheadAttention`'s conventions (float key padding, ``(N·H, L, S)`` masks with
True = *not* allowed) for :class:`sinkformer.nn.MultiheadAttention`; :func:`self_attention_mask` and
:func:`causal_key_padding` read the 4-D masks ``transformers`` builds, for
:mod:`sinkformer.integrations.huggingface`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._validation import _skip_data_checks, broadcastable, check_finite, check_tensor, data_checks_run, require

__all__ = [
    "MASKING", "align_to_batch", "combine_masks", "excluded", "split_key_padding", "additive_attn_mask",
    "self_attention_mask", "causal_key_padding",
]

#: Additive mask entries at or below this value are masking under Sinkhorn attention (module docstring).
MASKING = -1e4


def align_to_batch(t: Tensor, name: str, batch: tuple[int, ...], length: int) -> Tensor:
    """View a per-sequence tensor ``(*prefix, length)`` as ``(*prefix, 1, ..., 1, length)``.

    ``prefix`` must be the leading part of ``batch`` (e.g. a ``(B, n)`` padding mask for
    ``(B, H, n, d)`` queries), so that the result broadcasts against ``(*batch, length)``.
    """
    prefix = tuple(t.shape[:-1])
    if t.shape[-1] != length or prefix != batch[: len(prefix)]:
        raise ValueError(
            f"{name} must have shape (*batch_prefix, {length}) with batch_prefix a leading part of the "
            f"batch shape {batch}, got shape {tuple(t.shape)}"
        )
    return t.reshape(prefix + (1,) * (len(batch) - len(prefix)) + (length,))


def combine_masks(
    score_shape: tuple[int, ...],
    *,
    attn_mask: Tensor | None,
    key_padding_mask: Tensor | None,
    query_padding_mask: Tensor | None,
    dtype: torch.dtype,
    masked_from: float = float("-inf"),
) -> tuple[Tensor | None, Tensor | None]:
    """Return ``(keep, bias)`` for scores of shape ``(*batch, n_q, n_k)``.

    ``keep``: bool, broadcastable to the scores, True = entry takes part (``None``: all do).
    ``bias``: float, broadcastable, finite, to add to the scores (``None``: no bias).
    ``masked_from``: float ``attn_mask`` entries ``<=`` this are excluded (default: ``-inf`` only).
    """
    score_shape = tuple(score_shape)
    batch, n_q, n_k = score_shape[:-2], score_shape[-2], score_shape[-1]
    keep: Tensor | None = None
    bias: Tensor | None = None
    if attn_mask is not None:
        check_tensor(attn_mask, "attn_mask")
        if not broadcastable(attn_mask.shape, score_shape):
            raise ValueError(
                f"attn_mask must broadcast to the score shape {score_shape} (..., n_q, n_k), "
                f"got shape {tuple(attn_mask.shape)}"
            )
        if attn_mask.dtype == torch.bool:
            keep = attn_mask
        elif attn_mask.is_floating_point():
            check_finite(attn_mask, "attn_mask", allow_neg_inf=True)
            taking_part = ~excluded(attn_mask, masked_from)
            # without a data check (graph capture, GPUs) the keep mask is always formed
            keep = taking_part if _skip_data_checks(attn_mask) or not bool(taking_part.all()) else None
            bias = attn_mask.to(dtype) if keep is None else attn_mask.to(dtype).masked_fill(~taking_part, 0.0)
        else:
            raise TypeError(f"attn_mask must be a bool or floating tensor, got {attn_mask.dtype}")
    for name, pad, length, axis in (
        ("key_padding_mask", key_padding_mask, n_k, -2),
        ("query_padding_mask", query_padding_mask, n_q, -1),
    ):
        if pad is None:
            continue
        check_tensor(pad, name, dtype_bool=True)
        valid = ~align_to_batch(pad, name, batch, length).unsqueeze(axis)
        keep = valid if keep is None else keep & valid
    return keep, bias


def excluded(mask: Tensor, masked_from: float = float("-inf")) -> Tensor:
    """The entries a bool (True = take part) or additive float mask excludes: ``~mask``, or the
    float entries ``<= masked_from`` (``-inf`` always)."""
    if mask.dtype == torch.bool:
        return ~mask
    return mask <= masked_from if masked_from > float("-inf") else torch.isneginf(mask)


def split_key_padding(key_padding_mask: Tensor | None, bsz: int, src_len: int,
                      masked_from: float = float("-inf")) -> tuple[Tensor | None, Tensor | None]:
    """A :class:`torch.nn.MultiheadAttention` key padding mask ``(N, S)`` (bool True = padding, or
    float added to the scores) as ``(bool padding (N, S), additive bias (N, 1, 1, S) or None)``;
    float entries ``<= masked_from`` are padding (:func:`excluded`)."""
    if key_padding_mask is None:
        return None, None
    if key_padding_mask.shape != (bsz, src_len):
        raise ValueError(
            f"key_padding_mask must have shape (batch, source_length) = {(bsz, src_len)}, got {tuple(key_padding_mask.shape)}"
        )
    if key_padding_mask.dtype == torch.bool:
        return key_padding_mask, None
    if not key_padding_mask.is_floating_point():
        raise TypeError(f"key_padding_mask must be bool or float, got {key_padding_mask.dtype}")
    pad = excluded(key_padding_mask, masked_from)
    rest = key_padding_mask.masked_fill(pad, 0.0)
    # without a data check (graph capture, GPUs) the finite part is always kept as a bias
    keep_bias = _skip_data_checks(key_padding_mask) or bool(rest.any())
    return pad, (rest[:, None, None, :] if keep_bias else None)


def additive_attn_mask(
    attn_mask: Tensor | None, bsz: int, heads: int, tgt_len: int, src_len: int, dtype: torch.dtype
) -> Tensor | None:
    """:class:`torch.nn.MultiheadAttention`'s ``attn_mask`` (``(L, S)`` or ``(N·H, L, S)``; bool True =
    *not* allowed, or float added) as an additive float mask ``(L, S)`` or ``(N, H, L, S)``."""
    if attn_mask is None:
        return None
    if attn_mask.dim() == 2:
        if attn_mask.shape != (tgt_len, src_len):
            raise ValueError(f"2-D attn_mask must have shape {(tgt_len, src_len)}, got {tuple(attn_mask.shape)}")
    elif attn_mask.dim() == 3:
        if attn_mask.shape != (bsz * heads, tgt_len, src_len):
            raise ValueError(
                f"3-D attn_mask must have shape {(bsz * heads, tgt_len, src_len)}, got {tuple(attn_mask.shape)}"
            )
        attn_mask = attn_mask.reshape(bsz, heads, tgt_len, src_len)
    else:
        raise ValueError(f"attn_mask must be 2-D or 3-D, got shape {tuple(attn_mask.shape)}")
    if attn_mask.dtype == torch.bool:
        return torch.zeros(attn_mask.shape, dtype=dtype, device=attn_mask.device).masked_fill(attn_mask, float("-inf"))
    if not attn_mask.is_floating_point():
        raise TypeError(f"attn_mask must be bool or float, got {attn_mask.dtype}")
    return attn_mask.to(dtype)


def self_attention_mask(attention_mask: Tensor | None, position_bias: Tensor | None = None) -> Tensor | None:
    """The ``attn_mask`` for :func:`sinkformer.attention` from a self-attention layer's 4-D mask.

    ``keep`` is the bool mask itself, or for a float mask the entries above
    :data:`~sinkformer.attention.masks.MASKING` (``transformers`` writes ``finfo.min``, or ``-inf``,
    where a pair is excluded). A token no query may attend to — column ``j`` all excluded, i.e. padding
    — is removed as a query as well: ``keep[..., j, :] = False``.

    Args:
        attention_mask: ``None`` or ``(B, 1 | H, n, n)``. position_bias: ``None`` or a float bias
            broadcastable to ``(B, H, n, n)``.

    Returns:
        ``position_bias`` (possibly ``None``) when there is no mask; the bool ``keep`` when there
        is no bias; otherwise the float bias with ``-inf`` where ``keep`` is False.
    """
    if attention_mask is None:
        return position_bias
    keep = ~excluded(attention_mask, MASKING)
    bias = None if attention_mask.dtype == torch.bool else attention_mask.masked_fill(~keep, 0.0)
    is_token = keep.any(dim=-2, keepdim=True)  # (B, h, 1, n): False on padding
    keep = keep & is_token.transpose(-1, -2)
    if position_bias is not None:
        bias = position_bias if bias is None else bias + position_bias
    return keep if bias is None else bias.masked_fill(~keep, float("-inf"))


def causal_key_padding(attention_mask: Tensor | None, n_q: int, n_k: int) -> Tensor | None:
    """The ``(B, n_k)`` key padding (True = padding) of a causal layer's 4-D mask, or ``None``.

    The queries are the last ``n_q`` of ``n_k`` positions. The mask must be the causal mask with key
    padding — ``keep[b, :, i, j] = (j <= n_k - n_q + i) and not pad[b, j]``, bool (True = attend)
    or additive float (entries <= ``MASKING``, e.g. ``finfo.min``, excluded) — or ``ValueError`` is raised (sliding
    windows and packed sequences cannot be served by causal Sinkhorn's incremental state).
    Padding is read from the last query row, which sees every key.
    """
    if attention_mask is None:
        return None
    keep = ~excluded(attention_mask, MASKING)
    if keep.dim() != 4 or keep.shape[-2:] != (n_q, n_k):
        raise ValueError(f"attention_mask of a causal layer must be (B, 1 | H, {n_q}, {n_k}), got {tuple(keep.shape)}")
    valid = keep[:, 0, -1, :]
    causal = torch.ones(n_q, n_k, dtype=torch.bool, device=keep.device).tril(n_k - n_q)
    if data_checks_run(keep):
        require((keep == (causal & valid[:, None, None, :])).all(),
                "causal sinkhorn attention needs the causal mask with key padding (True = attend where j <= i and "
                "key j is not padding); this layer's attention_mask has another pattern (sliding window, packed "
                "sequences?)")
    # without a data check (graph capture, GPUs) the padding is always passed on (all False: no padding)
    return ~valid if _skip_data_checks(valid) or not bool(valid.all()) else None
