r"""The attention baselines of Sparse Sinkhorn Attention's experiments, built from the same parts.

* **vanilla**: dense SoftMax attention (:func:`sinkformer.attention`, ``normalization="softmax"``).
* **local** (Luong et al. 2015; Tay et al. §2): each query attends to the keys of its own block
  of ``block_size`` tokens — :math:`O(\ell b)` memory.
* **fixed** Sparse Transformer pattern (Child et al. 2019, §4.2, "fixed"): query :math:`i`
  attends to key :math:`j` if they share a block of length :math:`l`
  (:math:`\lfloor j/l\rfloor = \lfloor i/l\rfloor`) or if :math:`j` is one of the last
  :math:`c` "summary" positions of its block (:math:`j \bmod l \ge l - c`); both patterns in
  every head (Child et al.'s merged head). As in Tay et al. §5.2 it is simulated with a mask over
  the dense score matrix (no custom kernel), so it has the quality, not the memory, of the real one.
"""

from __future__ import annotations

import torch
from einops import rearrange
from torch import Tensor

from .._validation import broadcast_shapes, check_positive_int, check_qkv
from .functional import attention
from .sparse import n_blocks, to_blocks, token_validity

__all__ = ["PATTERNS", "fixed_pattern_mask", "local_attention", "sparse_transformer_attention"]

PATTERNS = ("full", "local", "fixed")


def local_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    block_size: int,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> Tensor:
    """Block-local SoftMax attention: query block :math:`i` attends to key block :math:`i` only.

    ``q, k, v``: ``(..., n, d)`` (one length); ``n`` need not be a multiple of ``block_size`` (the
    last block is padded and masked). ``key_padding_mask``: ``(*batch_prefix, n)``, True = padding.
    Returns ``(..., n, d_v)``.
    """
    check_qkv(q, k, v)
    check_positive_int(block_size, "block_size")
    n = q.shape[-2]
    if k.shape[-2] != n:
        raise ValueError(f"q and k must have the same length (self-attention), got q {tuple(q.shape)} and k {tuple(k.shape)}")
    batch = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    valid = token_validity(key_padding_mask, batch, n, n_blocks(n, block_size) * block_size, q.device)
    keep = None if valid is None else rearrange(valid, "... (n b) -> ... n 1 b", b=block_size)
    if causal:
        tri = torch.ones(block_size, block_size, dtype=torch.bool, device=q.device).tril()
        keep = tri if keep is None else keep & tri
    out = attention(*(to_blocks(t, block_size) for t in (q, k, v)), normalization="softmax", attn_mask=keep,
                    scale=scale, dropout_p=dropout_p)
    return out.flatten(-3, -2)[..., :n, :]


def fixed_pattern_mask(length: int, *, block_size: int, stride: int, causal: bool = False, device=None) -> Tensor:
    """The Sparse Transformer "fixed" pattern as a bool ``(length, length)`` mask (True = attend).

    ``block_size`` is Child et al.'s :math:`l`, ``stride`` their :math:`c` (summary positions per
    block, ``1 <= c <= l``). ``causal`` also requires :math:`j \\le i`.
    """
    check_positive_int(length, "length")
    check_positive_int(block_size, "block_size")
    check_positive_int(stride, "stride")
    if stride > block_size:
        raise ValueError(f"stride (summary positions per block) must be <= block_size={block_size}, got {stride}")
    i = torch.arange(length, device=device)
    same_block = (i[:, None] // block_size) == (i[None, :] // block_size)
    summary = (i % block_size >= block_size - stride)[None, :]
    keep = same_block | summary
    return keep & (i[None, :] <= i[:, None]) if causal else keep


def sparse_transformer_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    block_size: int,
    stride: int,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> Tensor:
    """SoftMax attention restricted to :func:`fixed_pattern_mask` (shapes as :func:`local_attention`)."""
    check_qkv(q, k, v)
    mask = fixed_pattern_mask(q.shape[-2], block_size=block_size, stride=stride, causal=causal, device=q.device)
    return attention(q, k, v, normalization="softmax", attn_mask=mask, key_padding_mask=key_padding_mask,
                     scale=scale, dropout_p=dropout_p)

