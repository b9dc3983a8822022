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
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._validation import _skip_data_checks, broadcastable, check_finite, check_tensor

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
