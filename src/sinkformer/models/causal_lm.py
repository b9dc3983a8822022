r"""A decoder-only byte-level language model whose causal self-attention is switched by ``n_iters``
(1: causal SoftMax, the Transformer; more: the causal Sinkformer), the model of ``sinkformer run
causal-lm``: :class:`CausalLM`, built for a dataset's ``info`` by :func:`build_lm`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from ..nn import MultiheadAttention
from ..nn.layers import sinusoidal_positions

__all__ = ["CausalLM", "build_lm"]


class _Block(nn.Module):
    """Pre-LayerNorm decoder block: ``x + attn(LN(x))`` (causal), then ``x + FF(LN(x))``."""

    def __init__(self, dim: int, heads: int, n_iters: int, ff_mult: int, dropout: float) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = MultiheadAttention(dim, heads, dropout=dropout, batch_first=True, normalization="sinkhorn",
                                       n_iters=n_iters)
        self.ff = nn.Sequential(nn.Linear(dim, ff_mult * dim), nn.GELU(), nn.Linear(ff_mult * dim, dim),
                                nn.Dropout(dropout))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor, need_weights: bool = False) -> tuple[Tensor, Tensor | None]:
        h = self.norm1(x)
        out, weights = self.attn(h, h, h, is_causal=True, need_weights=need_weights, average_attn_weights=False)
        x = x + self.drop(out)
        return x + self.ff(self.norm2(x)), weights


class CausalLM(nn.Module):
    r"""Decoder-only language model: ``tokens (B, L)`` -> next-token logits ``(B, L, vocab_size)``.

    Token embedding (scaled by :math:`\sqrt d`) and sinusoidal positions, as the library's
    :class:`~sinkformer.models.SinkhornTransformerLM`, ``depth`` pre-LayerNorm blocks with causal
    self-attention of ``n_iters`` normalisations (1: SoftMax, the Transformer; more: the causal
    Sinkformer), a final LayerNorm and an output layer tied to the token embedding. The
    parameters do not depend on ``n_iters``: seeded alike, every variant starts from the same
    weights. Position :math:`t` sees tokens :math:`\le t` only.
    """

    input_kind = "lm"

    def __init__(self, vocab_size: int, max_len: int, *, n_iters: int = 1, dim: int = 32, depth: int = 2,
                 heads: int = 2, ff_mult: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        self.max_len, self.n_iters = max_len, n_iters
        self.embedding = nn.Embedding(vocab_size, dim)
        nn.init.normal_(self.embedding.weight, 0.0, dim**-0.5)  # tied output: logits of unit scale at init
        self.scale = math.sqrt(dim)
        self.register_buffer("positions", sinusoidal_positions(max_len, dim), persistent=False)
        self.blocks = nn.ModuleList([_Block(dim, heads, n_iters, ff_mult, dropout) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.drop = nn.Dropout(dropout)

    def _embed(self, tokens: Tensor) -> Tensor:
        if tokens.shape[-1] > self.max_len:
            raise ValueError(f"tokens must hold at most max_len={self.max_len} positions, got {tokens.shape[-1]}")
        return self.drop(self.scale * self.embedding(tokens) + self.positions[: tokens.shape[-1]])

    def forward(self, tokens: Tensor) -> Tensor:
        x = self._embed(tokens)
        for block in self.blocks:
            x, _ = block(x)
        return self.norm(x) @ self.embedding.weight.T

    @torch.no_grad()
    def attention_weights(self, tokens: Tensor) -> list[Tensor]:
        """Each layer's attention matrices on ``tokens (B, L)``: a list of ``depth`` tensors ``(B, heads, L, L)``."""
        was_training = self.training
        self.eval()
        x, weights = self._embed(tokens), []
        for block in self.blocks:
            x, w = block(x, need_weights=True)
            weights.append(w)
        self.train(was_training)
        return weights


def build_lm(info: dict[str, Any], **options: Any) -> CausalLM:
    """:class:`CausalLM` for a dataset's ``info`` (``vocab_size``, ``max_len``) and model ``options``."""
    return CausalLM(info["vocab_size"], info["max_len"], **options)
