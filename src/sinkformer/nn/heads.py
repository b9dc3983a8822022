"""The multi-head body, written once: a projection split into heads, attention, the heads merged.

Every multi-head module of the library (``MultiheadAttention``, the Set Transformer's blocks, the
Sparse Sinkhorn and baseline layers, the Sinkhorn Transformer's dense layer, the ViT's blocks) goes
through these three functions; :func:`fused_self_attention` is the whole body for a fused ``q, k, v``
projection.
"""

from __future__ import annotations

from collections.abc import Callable

from einops import rearrange
from torch import Tensor

__all__ = ["split_heads", "split_qkv", "merge_heads", "fused_self_attention"]


def split_heads(x: Tensor, heads: int) -> Tensor:
    """``(B, n, heads·e)`` → ``(B, heads, n, e)``."""
    return rearrange(x, "b n (h e) -> b h n e", h=heads)


def split_qkv(x: Tensor, heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """A fused projection ``(B, n, 3·heads·e)`` (``q | k | v``) → ``q, k, v``, each ``(B, heads, n, e)``."""
    q, k, v = rearrange(x, "b n (three h e) -> three b h n e", three=3, h=heads)
    return q, k, v


def merge_heads(x: Tensor) -> Tensor:
    """``(B, heads, n, e)`` → ``(B, n, heads·e)``: the heads concatenated, as the output projection reads them."""
    return rearrange(x, "b h n e -> b n (h e)")


def fused_self_attention(x: Tensor, qkv_proj: Callable[[Tensor], Tensor], out_proj: Callable[[Tensor], Tensor],
                         heads: int, attend: Callable[[Tensor, Tensor, Tensor], Tensor]) -> Tensor:
    """``out_proj(merge(attend(q, k, v)))`` with ``q, k, v = split(qkv_proj(x))``: ``x (B, n, D)`` →
    ``(B, n, D_out)``; ``attend`` maps ``(B, heads, n, e)`` operands to ``(B, heads, n, e_v)``."""
    q, k, v = split_qkv(qkv_proj(x), heads)
    return out_proj(merge_heads(attend(q, k, v)))
