r"""Sinkhorn Transformers (Tay et al. 2020) and the baselines they are compared with, from one set of parts.

Every model is a stack of pre-norm layers (Tensor2Tensor's layout, which the paper used)

.. math::

    x \leftarrow x + \mathrm{SelfAttn}(\mathrm{LN}(x)),\quad
    [\,x \leftarrow x + \mathrm{CrossAttn}(\mathrm{LN}(x), m)\,],\quad
    x \leftarrow x + W_2\,\mathrm{ReLU}(W_1\,\mathrm{LN}(x)),

on :math:`\sqrt d\,E[x_t] + PE_t` (sinusoidal positions), with a final LN. Only the
self-attention changes, chosen by :class:`AttentionConfig` ``kind``:

==============  ====================================================================
``vanilla``     dense SoftMax attention (the Transformer)
``local``       block-local attention, blocks of ``block_size``
``fixed``       Sparse Transformer fixed pattern (Child et al.): block ``block_size``,
                ``stride`` summary positions per block
``sinkhorn``    Sparse Sinkhorn Attention, blocks of ``block_size``
``sortcut``     SortCut Sinkhorn: first ``sortcut_budget`` sorted blocks (encoders only)
``mixture``     Sparse Sinkhorn plus vanilla attention
==============  ====================================================================

Models: :class:`SinkhornTransformerEncoder`, :class:`SinkhornTransformerDecoder`,
:class:`SinkhornTransformerLM` (causal, with sampling), :class:`SinkhornSeq2Seq` (encoder-decoder,
decoded by :func:`sinkformer.models.decoding.greedy_decode`) and :class:`SinkhornClassifier`.
Decoder cross-attention is always vanilla (the paper sparsifies self-attention).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from .._validation import check_choice, check_positive_int, check_tensor
from ..nn.sparse import BaselineSelfAttention, SparseSinkhornAttention
from ..nn.layers import sinusoidal_positions

__all__ = [
    "ATTENTION_KINDS",
    "AttentionConfig",
    "SinkhornTransformerLayer",
    "SinkhornTransformerEncoder",
    "SinkhornTransformerDecoder",
    "SinkhornTransformerLM",
    "SinkhornSeq2Seq",
    "SinkhornClassifier",
]

ATTENTION_KINDS = ("vanilla", "local", "fixed", "sinkhorn", "sortcut", "mixture")


@dataclass
class AttentionConfig:
    """Which self-attention a model uses, with its options (see the module table).

    ``block_size``: local/Sinkhorn block :math:`b` (Child et al.'s :math:`l` for ``fixed``);
    ``sort_iters``, ``temperature``, ``sort_net``, ``share_kv``: Sinkhorn options
    (:class:`~sinkformer.attention.SparseSinkhornAttention`); ``sortcut_budget``: blocks kept by
    SortCut; ``stride``: summary positions per block of the fixed pattern (the paper's :math:`c = 8`).
    """

    kind: str = "sinkhorn"
    block_size: int = 16
    sort_iters: int = 5
    temperature: float = 0.75
    sort_net: str = "linear"
    share_kv: bool = False
    sortcut_budget: int = 2
    stride: int = 8

    def __post_init__(self) -> None:
        check_choice(self.kind, "attention kind", ATTENTION_KINDS)
        check_positive_int(self.block_size, "block_size")

    @classmethod
    def parse(cls, value: "AttentionConfig | str | dict | None" = None, **options) -> "AttentionConfig":
        """An ``AttentionConfig`` from itself, a dict of its fields, ``None`` (the default), or a spec
        string ``KIND[:BLOCK]`` / ``sortcut:BUDGETxBLOCK`` (``"local:32"``, ``"sortcut:2x8"``);
        ``options`` set further fields (e.g. ``temperature=0.5``)."""
        if isinstance(value, cls):
            return replace(value, **options) if options else value
        if value is None or isinstance(value, dict):
            return cls(**{**(value or {}), **options})
        if not isinstance(value, str):
            raise TypeError(f"attention must be an AttentionConfig, a dict, a spec string or None, got {type(value).__name__}")
        kind, _, size = value.partition(":")
        try:
            if kind == "sortcut" and "x" in size:
                budget, _, size = size.partition("x")
                options["sortcut_budget"] = int(budget)
            if size:
                options["block_size"] = int(size)
        except ValueError:
            raise ValueError(f"attention spec must look like 'sinkhorn:16' or 'sortcut:2x8', got {value!r}") from None
        return cls(kind, **options)

    @property
    def label(self) -> str:
        """The paper's name for this model, e.g. ``"Sinkhorn Transformer (32)"``, ``"SortCut (2x8)"``."""
        b = self.block_size
        return {
            "vanilla": "Transformer",
            "local": f"Local Attention ({b})",
            "fixed": f"Sparse Transformer ({b})",
            "sinkhorn": f"Sinkhorn Transformer ({b})",
            "sortcut": f"SortCut Sinkhorn ({self.sortcut_budget}x{b})",
            "mixture": f"Sinkhorn Mixture ({b})",
        }[self.kind]

    def build(self, dim: int, heads: int, *, max_len: int, causal: bool, dropout: float = 0.0) -> nn.Module:
        """The self-attention module: ``forward(x (B, n, dim), key_padding_mask (B, n)) -> (B, n, dim)``."""
        if self.kind in ("vanilla", "local", "fixed"):
            pattern = {"vanilla": "full", "local": "local", "fixed": "fixed"}[self.kind]
            stride = min(self.stride, self.block_size)
            return BaselineSelfAttention(dim, heads, pattern=pattern, block_size=self.block_size, stride=stride,
                                         causal=causal, dropout=dropout)
        if self.kind == "sortcut" and causal:
            raise ValueError("attention kind 'sortcut' cannot be causal: SortCut is an encoder-only scheme (§3.4)")
        return SparseSinkhornAttention(
            dim, heads, block_size=self.block_size, max_len=max_len, sort_iters=self.sort_iters,
            temperature=self.temperature, sort_net=self.sort_net, causal=causal,
            sortcut_budget=self.sortcut_budget if self.kind == "sortcut" else None,
            mixture=self.kind == "mixture", share_kv=self.share_kv, dropout=dropout,
        )


class SinkhornTransformerLayer(nn.Module):
    """One pre-norm layer: self-attention (``attention``), optional vanilla cross-attention, feed-forward."""

    def __init__(
        self,
        dim: int,
        heads: int,
        attention: AttentionConfig,
        *,
        max_len: int,
        causal: bool = False,
        cross_attention: bool = False,
        ff_mult: int = 4,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.norm_self = nn.LayerNorm(dim)
        self.self_attn = attention.build(dim, heads, max_len=max_len, causal=causal, dropout=dropout)
        self.cross_attn = nn.MultiheadAttention(dim, heads, dropout=dropout, batch_first=True) if cross_attention else None
        self.norm_cross = nn.LayerNorm(dim) if cross_attention else None
        self.norm_ff = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, ff_mult * dim), nn.ReLU(), nn.Dropout(dropout), nn.Linear(ff_mult * dim, dim))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, padding_mask: Tensor | None = None, memory: Tensor | None = None,
                memory_padding_mask: Tensor | None = None) -> Tensor:
        x = x + self.dropout(self.self_attn(self.norm_self(x), padding_mask))
        if self.cross_attn is not None:
            h = self.norm_cross(x)
            x = x + self.dropout(self.cross_attn(h, memory, memory, key_padding_mask=memory_padding_mask, need_weights=False)[0])
        return x + self.dropout(self.ff(self.norm_ff(x)))


class _Stack(nn.Module):
    """Token embedding (scaled by :math:`\\sqrt d`) + sinusoidal positions, layers, final LayerNorm."""

    def __init__(self, vocab_size: int, *, dim: int, depth: int, heads: int, max_len: int, attention: AttentionConfig,
                 causal: bool, cross_attention: bool, ff_mult: int, dropout: float, pad_id: int | None) -> None:
        super().__init__()
        for name, value in (("vocab_size", vocab_size), ("dim", dim), ("depth", depth), ("heads", heads), ("max_len", max_len)):
            check_positive_int(value, name)
        if dim % heads:
            raise ValueError(f"dim must be divisible by heads, got dim={dim}, heads={heads}")
        self.max_len, self.scale = max_len, math.sqrt(dim)
        self.embedding = nn.Embedding(vocab_size, dim, padding_idx=pad_id)
        nn.init.normal_(self.embedding.weight, 0.0, dim**-0.5)
        if pad_id is not None:
            with torch.no_grad():
                self.embedding.weight[pad_id].zero_()
        self.register_buffer("positions", sinusoidal_positions(max_len, dim), persistent=False)
        self.dropout = nn.Dropout(dropout)
        self.layers = nn.ModuleList(
            SinkhornTransformerLayer(dim, heads, attention, max_len=max_len, causal=causal,
                                     cross_attention=cross_attention, ff_mult=ff_mult, dropout=dropout)
            for _ in range(depth)
        )
        self.norm = nn.LayerNorm(dim)

    def forward(self, tokens: Tensor, padding_mask: Tensor | None = None, memory: Tensor | None = None,
                memory_padding_mask: Tensor | None = None) -> Tensor:
        check_tensor(tokens, "tokens", ndim=2)
        if tokens.shape[1] > self.max_len:
            raise ValueError(f"sequences of length {tokens.shape[1]} exceed max_len={self.max_len}")
        x = self.dropout(self.scale * self.embedding(tokens) + self.positions[: tokens.shape[1]])
        for layer in self.layers:
            x = layer(x, padding_mask, memory, memory_padding_mask)
        return self.norm(x)


class SinkhornTransformerEncoder(_Stack):
    """Bidirectional encoder: ``tokens (B, n)`` (``padding_mask`` True = pad) -> ``(B, n, dim)``."""

    def __init__(self, vocab_size: int, *, dim: int = 128, depth: int = 2, heads: int = 4, max_len: int = 512,
                 attention: AttentionConfig | str | dict | None = None, ff_mult: int = 4, dropout: float = 0.0, pad_id: int = 0) -> None:
        super().__init__(vocab_size, dim=dim, depth=depth, heads=heads, max_len=max_len,
                         attention=AttentionConfig.parse(attention), causal=False, cross_attention=False,
                         ff_mult=ff_mult, dropout=dropout, pad_id=pad_id)

    def forward(self, tokens: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        return super().forward(tokens, padding_mask)


class SinkhornTransformerDecoder(_Stack):
    """Causal decoder with vanilla cross-attention: ``tokens (B, T)``, ``memory (B, S, dim)`` -> ``(B, T, dim)``."""

    def __init__(self, vocab_size: int, *, dim: int = 128, depth: int = 2, heads: int = 4, max_len: int = 512,
                 attention: AttentionConfig | str | dict | None = None, ff_mult: int = 4, dropout: float = 0.0, pad_id: int = 0) -> None:
        super().__init__(vocab_size, dim=dim, depth=depth, heads=heads, max_len=max_len,
                         attention=AttentionConfig.parse(attention), causal=True, cross_attention=True,
                         ff_mult=ff_mult, dropout=dropout, pad_id=pad_id)


class SinkhornTransformerLM(nn.Module):
    """Causal language model: ``tokens (B, n)`` -> next-token logits ``(B, n, vocab_size)``.

    Output projection tied to the input embedding; ``pad_id`` (default none: every id is a
    real symbol) gets a zero, frozen embedding. Position :math:`t` predicts token
    :math:`t + 1` from tokens :math:`\\le t` only (causal Sinkhorn balancing, §3.3).
    """

    input_kind = "lm"

    def __init__(self, vocab_size: int, *, dim: int = 128, depth: int = 2, heads: int = 4, max_len: int = 512,
                 attention: AttentionConfig | str | dict | None = None, ff_mult: int = 4, dropout: float = 0.0,
                 pad_id: int | None = None) -> None:
        super().__init__()
        self.vocab_size, self.max_len = vocab_size, max_len
        self.body = _Stack(vocab_size, dim=dim, depth=depth, heads=heads, max_len=max_len,
                           attention=AttentionConfig.parse(attention), causal=True, cross_attention=False,
                           ff_mult=ff_mult, dropout=dropout, pad_id=pad_id)

    def forward(self, tokens: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        return self.body(tokens, padding_mask) @ self.body.embedding.weight.T

    @torch.no_grad()
    def generate(self, prompt: Tensor, max_new_tokens: int, *, temperature: float = 1.0, top_k: int | None = None,
                 generator: torch.Generator | None = None) -> Tensor:
        """Sample ``max_new_tokens`` tokens after ``prompt (B, t)``; returns ``(B, t + max_new_tokens)``.

        Each step re-runs the model on the last ``max_len`` tokens (no cache) and samples from
        :math:`\\mathrm{softmax}(\\text{logits}/T)`, restricted to the ``top_k`` most likely tokens
        if given; ``temperature=0`` is greedy decoding.
        """
        check_tensor(prompt, "prompt", ndim=2)
        if prompt.shape[1] < 1:
            raise ValueError("prompt must hold at least one token per sequence, got length 0")
        check_positive_int(max_new_tokens, "max_new_tokens", minimum=0)
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if top_k is not None:
            check_positive_int(top_k, "top_k")
        was_training = self.training
        self.eval()
        tokens = prompt
        for _ in range(max_new_tokens):
            logits = self(tokens[:, -self.max_len :])[:, -1]
            if temperature == 0:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = logits.topk(min(top_k, logits.shape[-1]), -1).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)
            tokens = torch.cat([tokens, nxt], 1)
        self.train(was_training)
        return tokens


class SinkhornSeq2Seq(nn.Module):
    """Encoder-decoder: ``src (B, S)``, decoder input ``tgt (B, T)`` (``<bos> y_1 ..``) -> logits ``(B, T, vocab)``.

    Sparse attention in both the encoder and the decoder's self-attention (as in the paper's
    sorting task, §5.1); ``decoder_attention`` defaults to ``attention`` (a SortCut encoder needs
    another one, SortCut being encoder-only). Shared embeddings, tied output projection.
    ``encode``/``decode``, ``bos_id``, ``eos_id`` and ``max_len`` make it usable with
    :func:`sinkformer.models.decoding.greedy_decode`.
    """

    input_kind = "translation"

    def __init__(self, vocab_size: int, *, dim: int = 128, depth: int = 2, heads: int = 4, max_len: int = 512,
                 attention: AttentionConfig | str | dict | None = None, decoder_attention: AttentionConfig | str | dict | None = None,
                 ff_mult: int = 4, dropout: float = 0.0, pad_id: int = 0, bos_id: int = 1, eos_id: int = 2) -> None:
        super().__init__()
        attention = AttentionConfig.parse(attention)
        self.pad_id, self.bos_id, self.eos_id, self.max_len = pad_id, bos_id, eos_id, max_len
        shape = dict(dim=dim, depth=depth, heads=heads, max_len=max_len, ff_mult=ff_mult, dropout=dropout, pad_id=pad_id)
        self.encoder = SinkhornTransformerEncoder(vocab_size, attention=attention, **shape)
        decoder_attention = attention if decoder_attention is None else AttentionConfig.parse(decoder_attention)
        self.decoder = SinkhornTransformerDecoder(vocab_size, attention=decoder_attention, **shape)
        self.decoder.embedding = self.encoder.embedding

    def encode(self, src: Tensor, src_padding_mask: Tensor | None = None) -> Tensor:
        return self.encoder(src, src_padding_mask)

    def decode(self, tgt: Tensor, memory: Tensor, memory_padding_mask: Tensor | None = None,
               tgt_padding_mask: Tensor | None = None) -> Tensor:
        h = self.decoder(tgt, tgt_padding_mask, memory, memory_padding_mask)
        return h @ self.encoder.embedding.weight.T

    def forward(self, src: Tensor, tgt: Tensor, src_padding_mask: Tensor | None = None,
                tgt_padding_mask: Tensor | None = None) -> Tensor:
        return self.decode(tgt, self.encode(src, src_padding_mask), src_padding_mask, tgt_padding_mask)


class SinkhornClassifier(nn.Module):
    """Sequence classifier: encoder, mean over non-padding tokens, linear layer -> ``(B, n_classes)``."""

    input_kind = "tokens"

    def __init__(self, vocab_size: int, n_classes: int = 2, *, dim: int = 128, depth: int = 2, heads: int = 4,
                 max_len: int = 512, attention: AttentionConfig | str | dict | None = None, ff_mult: int = 4, dropout: float = 0.0,
                 pad_id: int = 0) -> None:
        super().__init__()
        check_positive_int(n_classes, "n_classes", minimum=2)
        self.encoder = SinkhornTransformerEncoder(vocab_size, dim=dim, depth=depth, heads=heads, max_len=max_len,
                                                  attention=attention, ff_mult=ff_mult, dropout=dropout, pad_id=pad_id)
        self.classifier = nn.Linear(dim, n_classes)

    def forward(self, tokens: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        h = self.encoder(tokens, padding_mask)
        if padding_mask is None:
            return self.classifier(h.mean(1))
        keep = (~padding_mask).unsqueeze(-1).to(h.dtype)
        return self.classifier((h * keep).sum(1) / keep.sum(1).clamp_min(1.0))
