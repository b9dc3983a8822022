"""Turning the user's masks into one ``keep`` mask and one additive bias.

Conventions (those of the libraries the arguments come from):

* ``attn_mask`` follows :func:`torch.nn.functional.scaled_dot_product_attention`: a bool mask
  with True = *take part*, or a float mask added to the scores (``-inf`` = excluded).
* ``key_padding_mask`` / ``query_padding_mask`` follow :class:`torch.nn.MultiheadAttention`:
  True = *padding* (excluded).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._validation import _skip_data_checks, broadcastable, check_finite, check_tensor


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
) -> tuple[Tensor | None, Tensor | None]:
    """Return ``(keep, bias)`` for scores of shape ``(*batch, n_q, n_k)``.

    ``keep``: bool, broadcastable to the scores, True = entry takes part (``None``: all do).
    ``bias``: float, broadcastable, finite, to add to the scores (``None``: no bias).
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
            finite = attn_mask > float("-inf")
            # without a data check (graph capture, GPUs) the keep mask is always formed
            keep = finite if _skip_data_checks(attn_mask) or not bool(finite.all()) else None
            bias = attn_mask.to(dtype) if keep is None else attn_mask.to(dtype).masked_fill(~finite, 0.0)
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
