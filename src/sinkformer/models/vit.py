r"""Vision Transformers of the Sinkformers paper (§6.4, Appendix C.4).

:class:`ViT` (Dosovitskiy et al.): the image is cut into ``patch_size × patch_size`` patches,
each flattened and mapped linearly to ``dim``; a class token and learned positions are added,
pre-norm encoder layers follow, and the class token goes through LayerNorm + Linear. Paper (cats
vs dogs): depth 6, 8 heads, patch 16, Adam lr 5e-5 divided by 10 after 250 of 300 epochs.

:class:`AttentionOnlyViT` is the model of the patch-size study (Figure 6): one layer, one head,
no feed-forward block and no activation function (as in the authors' code: a pre-LayerNorm,
a class token and a LayerNorm before the linear classifier),

.. math::

    x = [c;\ W_e\,\mathrm{patch}_1 + p_1;\ \dots],\qquad y = x + \mathrm{Attn}(\mathrm{LN}(x)),\qquad
    \text{logits} = W_c\,\mathrm{LN}(y_0) + b .

The class token matters: pooling by the mean of the tokens would make a doubly stochastic
attention useless (:math:`\tfrac1n \mathbf 1^\top P V = \tfrac1n \mathbf 1^\top V`). With one
patch (``patch_size = image_size``) the matrix is ``2 × 2`` (class token + patch).
Paper (MNIST): batch 100, Adam lr 1e-3 (Transformer) / 2e-3 (Sinkformer), divided by 10 after
epochs 35 and 41 of 45.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

from ..attention import attention
from ..nn.heads import fused_self_attention
from ..nn.layers import TransformerEncoder
from ..nn.multihead import MultiheadAttention
from .attention_spec import dense_attention

__all__ = ["ViT", "AttentionOnlyViT", "PatchEmbedding"]


class PatchEmbedding(torch.nn.Module):
    """``(batch, channels, H, W)`` images -> ``(batch, n_patches, dim)`` linear patch embeddings."""

    def __init__(self, image_size: int, patch_size: int, channels: int, dim: int) -> None:
        super().__init__()
        if patch_size < 1 or image_size % patch_size:
            raise ValueError(f"patch_size must divide image_size={image_size}, got patch_size={patch_size}")
        self.image_size, self.patch_size, self.channels = image_size, patch_size, channels
        self.n_patches = (image_size // patch_size) ** 2
        self.proj = torch.nn.Linear(channels * patch_size**2, dim)

    def forward(self, images: Tensor) -> Tensor:
        expected = (self.channels, self.image_size, self.image_size)
        if tuple(images.shape[1:]) != expected:
            shape = ", ".join(map(str, expected))
            raise ValueError(f"images must have shape (batch, {shape}), got {tuple(images.shape)}")
        p = self.patch_size
        return self.proj(rearrange(images, "b c (h p1) (w p2) -> b (h w) (p1 p2 c)", p1=p, p2=p))


class ViT(torch.nn.Module):
    """Vision Transformer; images ``(batch, channels, image_size, image_size)`` -> logits ``(batch, n_classes)``.

    Args:
        n_classes, image_size, channels: task shape.
        patch_size: side of the square patches (divides ``image_size``).
        dim, depth, num_heads, dim_feedforward, dropout: encoder shape (paper: depth 6, 8 heads).
        head_dim: width of each head. ``None``: ``dim / num_heads`` (a standard encoder of
            :class:`sinkformer.nn.MultiheadAttention` layers). Given, the attention's inner width
            ``num_heads * head_dim`` is decoupled from ``dim``, as in the authors' cats-vs-dogs model
            (``vit-pytorch``: dim 128, 8 heads of 64, feed-forward 128).
        attention, n_iters: ``"softmax"`` (the Transformer) or ``"sinkhorn"`` with ``n_iters`` normalisations
            (paper's ViT Sinkformer: 3), see :mod:`~sinkformer.models.attention_spec`; ``normalization``: the
            old spelling of ``attention``.
    """

    input_kind = "images"

    def __init__(
        self,
        n_classes: int,
        image_size: int,
        channels: int = 3,
        *,
        patch_size: int = 16,
        dim: int = 128,
        depth: int = 6,
        num_heads: int = 8,
        dim_feedforward: int = 256,
        dropout: float = 0.0,
        head_dim: int | None = None,
        attention: str = "sinkhorn",
        n_iters: int = 5,
        normalization: str | None = None,
    ) -> None:
        super().__init__()
        normalization, n_iters = dense_attention(attention, n_iters, old=normalization)
        if head_dim is None and dim % num_heads:
            raise ValueError(f"dim must be divisible by num_heads, got dim={dim}, num_heads={num_heads}")
        self.patches = PatchEmbedding(image_size, patch_size, channels, dim)
        self.cls_token = torch.nn.Parameter(torch.randn(1, 1, dim))
        self.positions = torch.nn.Parameter(torch.randn(1, self.patches.n_patches + 1, dim))
        if head_dim is None:
            self.encoder = TransformerEncoder(
                dim, num_heads, depth, dim_feedforward=dim_feedforward, dropout=dropout, activation=F.gelu,
                norm_first=True, final_norm=True, normalization=normalization, n_iters=n_iters,
            )
        else:
            blocks = [_Block(dim, num_heads, head_dim, dim_feedforward, dropout, normalization, n_iters)
                      for _ in range(depth)]
            self.encoder = torch.nn.Sequential(*blocks, torch.nn.LayerNorm(dim))
        self.classifier = torch.nn.Linear(dim, n_classes)

    def forward(self, images: Tensor) -> Tensor:
        x = self.patches(images)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.positions
        return self.classifier(self.encoder(x)[:, 0])


class _Block(torch.nn.Module):
    """Pre-norm block with a decoupled head width: ``x + Attn(LN x)``, then ``+ FF(LN x)`` (GELU)."""

    def __init__(self, dim, heads, head_dim, dim_feedforward, dropout, normalization, n_iters) -> None:
        super().__init__()
        inner = heads * head_dim
        self.heads, self.normalization, self.n_iters, self.dropout = heads, normalization, n_iters, dropout
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.to_qkv = torch.nn.Linear(dim, 3 * inner, bias=False)
        self.to_out = torch.nn.Sequential(torch.nn.Linear(inner, dim), torch.nn.Dropout(dropout))
        self.ff = torch.nn.Sequential(torch.nn.Linear(dim, dim_feedforward), torch.nn.GELU(), torch.nn.Dropout(dropout),
                                      torch.nn.Linear(dim_feedforward, dim), torch.nn.Dropout(dropout))

    def forward(self, x: Tensor) -> Tensor:
        def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            return attention(q, k, v, normalization=self.normalization, n_iters=self.n_iters,
                             dropout_p=self.dropout if self.training else 0.0)

        x = x + fused_self_attention(self.norm1(x), self.to_qkv, self.to_out, self.heads, attend)
        return x + self.ff(self.norm2(x))


class AttentionOnlyViT(torch.nn.Module):
    """One single-head attention layer on patches and a class token, then linear (paper Figure 6).

    Args:
        n_classes, image_size, channels: task shape (MNIST: 10, 28, 1).
        patch_size: side of the square patches (divides ``image_size``).
        dim: embedding width.
        attention, n_iters: as :class:`ViT`'s.
    """

    input_kind = "images"

    def __init__(
        self,
        n_classes: int,
        image_size: int,
        channels: int = 1,
        *,
        patch_size: int = 7,
        dim: int = 128,
        attention: str = "sinkhorn",
        n_iters: int = 5,
        normalization: str | None = None,
    ) -> None:
        super().__init__()
        normalization, n_iters = dense_attention(attention, n_iters, old=normalization)
        self.patches = PatchEmbedding(image_size, patch_size, channels, dim)
        self.cls_token = torch.nn.Parameter(torch.randn(1, 1, dim))
        self.positions = torch.nn.Parameter(torch.randn(1, self.patches.n_patches + 1, dim))
        self.norm = torch.nn.LayerNorm(dim)
        self.attn = MultiheadAttention(dim, 1, batch_first=True, normalization=normalization, n_iters=n_iters)
        self.head_norm = torch.nn.LayerNorm(dim)
        self.classifier = torch.nn.Linear(dim, n_classes)

    def forward(self, images: Tensor) -> Tensor:
        x = self.patches(images)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.positions
        h = self.norm(x)
        y = x + self.attn(h, h, h, need_weights=False)[0]
        return self.classifier(self.head_norm(y[:, 0]))
