r"""Sinkhorn Transformers (Tay et al. 2020) and the baselines they are compared with, from one set of parts.

Every model is a stack of pre-norm layers (Tensor2Tensor's layout, which the paper used)

.. math::

    x \leftarrow x + \mathrm{SelfAttn}(\mathrm{LN}(x)),\quad
    [\,x \leftarrow x + \mathrm{CrossAttn}(\mathrm{LN}(x), m)\,],\quad
    x \leftarrow x + W_2\,\mathrm{ReLU}(W_1\,\mathrm{LN}(x)),

on :math:`\sqrt d\,E[x_t] + PE_t` (sinusoidal positions), with a final LN. Only the
self-attention changes, chosen by ``attention=`` in the models' one vocabulary
(:mod:`sinkformer.models.attention_spec`): ``"softmax"`` (the Transformer), ``"sinkhorn"``
(dense Sinkhorn attention with ``n_iters`` normalisations, the Sinkformer; causal models use
causal Sinkhorn: row :math:`t` balanced on the prefix :math:`0..t` alone, no leak from the
future), ``"local:B"``, ``"fixed:B"`` (Child et al.), ``"sparse:B"`` (Sparse Sinkhorn Attention,
blocks of ``B``), ``"sortcut:KxB"`` (encoders only) and ``"mixture:B"``; or an
:class:`~sinkformer.models.attention_spec.AttentionConfig` with further options.

Models: :class:`SinkhornTransformerEncoder`, :class:`SinkhornTransformerDecoder`,
:class:`SinkhornTransformerLM` (causal, with sampling), :class:`SinkhornSeq2Seq` (encoder-decoder,
decoded by :func:`sinkformer.models.decoding.greedy_decode`) and :class:`SinkhornClassifier`.
Decoder cross-attention is always SoftMax (the paper sparsifies self-attention).

:meth:`SinkhornTransformerLM.generate` decodes incrementally when every layer's self-attention
is ``softmax`` or ``sinkhorn``: each layer carries a
:class:`~sinkformer.attention.CausalSinkhornCache` (keys, values and the running column sums;
``n_iters=1`` for ``softmax``, a plain KV cache), so a new token costs :math:`O(t)` per layer
(:math:`O(t^2 n\_iters)` for ``sinkhorn`` with ``n_iters >= 4``) instead of a forward over the
whole prefix; the outputs are those of the full forward.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .._validation import check_positive_int, check_tensor
from ..attention import CausalSinkhornCache
from ..nn.heads import fused_self_attention
from ..nn.layers import sinusoidal_positions
from ..nn.sparse import BaselineSelfAttention, DenseSinkhornSelfAttention, SparseSinkhornAttention, SparseSinkhornCache
from .attention_spec import ATTENTION_KINDS, AttentionConfig, model_attention

__all__ = [
    "ATTENTION_KINDS",
    "AttentionConfig",
    "SinkhornTransformerLayer",
    "SinkhornTransformerEncoder",
    "SinkhornTransformerDecoder",
    "SinkhornTransformerLM",
    "SinkhornSeq2Seq",
    "SinkhornClassifier",
    "share_weights",
]

def decoding_cache(self_attn: nn.Module) -> CausalSinkhornCache | SparseSinkhornCache | None:
    """The incremental decoding state of a causal self-attention module, or ``None`` if it has none.

    :class:`DenseSinkhornSelfAttention`: causal Sinkhorn with its ``n_iters``; ``softmax``
    (:class:`~sinkformer.nn.BaselineSelfAttention` with the full pattern): ``n_iters=1``, causal
    SoftMax with a KV cache; causal Sparse Sinkhorn: a :class:`~sinkformer.nn.SparseSinkhornCache`.
    The local and fixed patterns have none.
    """
    if isinstance(self_attn, DenseSinkhornSelfAttention):
        return CausalSinkhornCache(self_attn.n_iters)
    if isinstance(self_attn, BaselineSelfAttention) and self_attn.pattern == "full":
        return CausalSinkhornCache(1)
    if isinstance(self_attn, SparseSinkhornAttention) and self_attn.causal:
        return SparseSinkhornCache()
    return None


def _attention_step(self_attn: nn.Module, x: Tensor, cache: CausalSinkhornCache | SparseSinkhornCache) -> Tensor:
    """The outputs ``(B, m, D)`` of ``self_attn`` for ``m`` new tokens ``x (B, m, D)`` that follow the
    tokens already in ``cache`` (causal, no padding): equal to the last ``m`` rows of the full forward."""
    if isinstance(cache, SparseSinkhornCache):
        return self_attn.step(x, cache)
    return fused_self_attention(x, self_attn.qkv_proj, self_attn.out_proj, self_attn.num_heads, cache.step)


class SinkhornTransformerLayer(nn.Module):
    """One pre-norm layer: self-attention (``attention``), optional SoftMax cross-attention, feed-forward."""

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

    def step(self, x: Tensor, cache: CausalSinkhornCache, memory: Tensor | None = None,
             memory_padding_mask: Tensor | None = None) -> Tensor:
        """Incremental forward of ``m`` new positions ``x (B, m, dim)`` of a causal layer, the earlier
        positions being in ``cache`` (from :func:`decoding_cache`); the cross-attention rows of the new
        positions need only ``memory``."""
        x = x + self.dropout(_attention_step(self.self_attn, self.norm_self(x), cache))
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

    def decoding_caches(self) -> list[CausalSinkhornCache | SparseSinkhornCache] | None:
        """One empty decoding state per layer (:func:`decoding_cache`), or ``None`` when a layer's
        self-attention has no incremental form (the local and fixed patterns)."""
        caches = [decoding_cache(layer.self_attn) for layer in self.layers]
        return None if any(cache is None for cache in caches) else caches

    def step(self, tokens: Tensor, caches: list[CausalSinkhornCache], memory: Tensor | None = None,
             memory_padding_mask: Tensor | None = None) -> Tensor:
        """Hidden states ``(B, m, dim)`` of ``m`` new tokens ``(B, m)`` placed after the ``len(caches[0])``
        tokens already decoded: the last ``m`` rows of :meth:`forward` on the whole sequence."""
        start = len(caches[0])
        if start + tokens.shape[1] > self.max_len:
            raise ValueError(f"sequences of length {start + tokens.shape[1]} exceed max_len={self.max_len}")
        x = self.dropout(self.scale * self.embedding(tokens) + self.positions[start : start + tokens.shape[1]])
        for layer, cache in zip(self.layers, caches):
            x = layer.step(x, cache, memory, memory_padding_mask)
        return self.norm(x)


class SinkhornTransformerEncoder(_Stack):
    """Bidirectional encoder: ``tokens (B, n)`` (``padding_mask`` True = pad) -> ``(B, n, dim)``."""

    def __init__(self, vocab_size: int, *, dim: int = 128, depth: int = 2, heads: int = 4, max_len: int = 512,
                 attention: AttentionConfig | str | dict | None = None, n_iters: int = 5, ff_mult: int = 4,
                 dropout: float = 0.0, pad_id: int = 0) -> None:
        super().__init__(vocab_size, dim=dim, depth=depth, heads=heads, max_len=max_len,
                         attention=model_attention(attention, n_iters), causal=False, cross_attention=False,
                         ff_mult=ff_mult, dropout=dropout, pad_id=pad_id)

    def forward(self, tokens: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        return super().forward(tokens, padding_mask)


class SinkhornTransformerDecoder(_Stack):
    """Causal decoder with SoftMax cross-attention: ``tokens (B, T)``, ``memory (B, S, dim)`` -> ``(B, T, dim)``."""

    def __init__(self, vocab_size: int, *, dim: int = 128, depth: int = 2, heads: int = 4, max_len: int = 512,
                 attention: AttentionConfig | str | dict | None = None, n_iters: int = 5, ff_mult: int = 4,
                 dropout: float = 0.0, pad_id: int = 0) -> None:
        super().__init__(vocab_size, dim=dim, depth=depth, heads=heads, max_len=max_len,
                         attention=model_attention(attention, n_iters), causal=True, cross_attention=True,
                         ff_mult=ff_mult, dropout=dropout, pad_id=pad_id)


class SinkhornTransformerLM(nn.Module):
    """Causal language model: ``tokens (B, n)`` -> next-token logits ``(B, n, vocab_size)``.

    Output projection tied to the input embedding; ``pad_id`` (default none: every id is a
    real symbol) gets a zero, frozen embedding. Position :math:`t` predicts token
    :math:`t + 1` from tokens :math:`\\le t` only (causal Sinkhorn balancing, §3.3, for the sparse
    kinds; causal Sinkhorn attention for ``attention="sinkhorn"``, the causal Sinkformer with
    ``n_iters`` normalisations).
    """

    input_kind = "lm"

    def __init__(self, vocab_size: int, *, dim: int = 128, depth: int = 2, heads: int = 4, max_len: int = 512,
                 attention: AttentionConfig | str | dict | None = None, n_iters: int = 5, ff_mult: int = 4,
                 dropout: float = 0.0, pad_id: int | None = None) -> None:
        super().__init__()
        self.vocab_size, self.max_len = vocab_size, max_len
        self.body = _Stack(vocab_size, dim=dim, depth=depth, heads=heads, max_len=max_len,
                           attention=model_attention(attention, n_iters), causal=True, cross_attention=False,
                           ff_mult=ff_mult, dropout=dropout, pad_id=pad_id)

    def forward(self, tokens: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        return self.body(tokens, padding_mask) @ self.body.embedding.weight.T

    @torch.no_grad()
    def generate(self, prompt: Tensor, max_new_tokens: int, *, temperature: float = 1.0, top_k: int | None = None,
                 generator: torch.Generator | None = None, use_cache: bool = True,
                 return_logits: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        r"""Sample ``max_new_tokens`` tokens after ``prompt (B, t)``; returns ``(B, t + max_new_tokens)``.

        Each step samples from :math:`\mathrm{softmax}(\text{logits}/T)`, restricted to the
        ``top_k`` most likely tokens if given; ``temperature=0`` is greedy decoding.

        With ``use_cache`` (default) and a self-attention that has an incremental form
        (``softmax``, ``sinkhorn``, causal ``sparse``), the prompt is run once and each new token goes
        through the layers alone, against per-layer states (:func:`decoding_cache`): :math:`O(t)` per
        token and layer (:math:`O(t^2 n\_iters)` for ``sinkhorn`` with ``n_iters >= 4``), the same
        logits as the full forward. Otherwise — or once the
        sequence is longer than ``max_len`` — each step re-runs the model on the last
        ``max_len`` tokens (a sliding window).

        ``return_logits=True`` also returns the ``(B, max_new_tokens, vocab_size)`` logits each
        token was drawn from (before temperature and ``top_k``).
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
        caches = self.body.decoding_caches() if use_cache else None
        tokens, drawn_from = prompt, []
        for _ in range(max_new_tokens):
            if caches is not None and tokens.shape[1] <= self.max_len:
                new = tokens[:, len(caches[0]):]  # the prompt at first, then the last token
                logits = self.body.step(new, caches)[:, -1] @ self.body.embedding.weight.T
            else:
                logits = self(tokens[:, -self.max_len :])[:, -1]
            drawn_from.append(logits)
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
        if not return_logits:
            return tokens
        empty = prompt.new_zeros((prompt.shape[0], 0, self.vocab_size), dtype=self.body.embedding.weight.dtype)
        return tokens, torch.stack(drawn_from, 1) if drawn_from else empty


class SinkhornSeq2Seq(nn.Module):
    """Encoder-decoder: ``src (B, S)``, decoder input ``tgt (B, T)`` (``<bos> y_1 ..``) -> logits ``(B, T, vocab)``.

    Sparse attention in both the encoder and the decoder's self-attention (as in the paper's
    sorting task, §5.1); ``decoder_attention`` defaults to ``attention`` (a SortCut encoder needs
    another one, SortCut being encoder-only). Shared embeddings, tied output projection.
    ``encode``/``decode``, ``bos_id``, ``eos_id`` and ``max_len`` make it usable with
    :func:`sinkformer.models.decoding.greedy_decode`, which decodes incrementally through
    ``decoding_caches``/``decode_step`` when the decoder attention is ``softmax``, ``sinkhorn`` or
    causal Sparse Sinkhorn (``sparse``, with or without ``mixture``).
    """

    input_kind = "translation"

    def __init__(self, vocab_size: int, *, dim: int = 128, depth: int = 2, heads: int = 4, max_len: int = 512,
                 attention: AttentionConfig | str | dict | None = None, n_iters: int = 5,
                 decoder_attention: AttentionConfig | str | dict | None = None, ff_mult: int = 4, dropout: float = 0.0,
                 pad_id: int = 0, bos_id: int = 1, eos_id: int = 2) -> None:
        super().__init__()
        attention = model_attention(attention, n_iters)
        self.pad_id, self.bos_id, self.eos_id, self.max_len = pad_id, bos_id, eos_id, max_len
        shape = dict(dim=dim, depth=depth, heads=heads, max_len=max_len, ff_mult=ff_mult, dropout=dropout, pad_id=pad_id)
        self.encoder = SinkhornTransformerEncoder(vocab_size, attention=attention, **shape)
        decoder_attention = attention if decoder_attention is None else model_attention(decoder_attention, n_iters)
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

    def decoding_caches(self) -> list[CausalSinkhornCache | SparseSinkhornCache] | None:
        """Empty per-layer decoder states for :meth:`decode_step`, or ``None`` when the decoder's
        self-attention has no incremental form (the local and fixed patterns)."""
        return self.decoder.decoding_caches()

    def decode_step(self, tgt: Tensor, memory: Tensor, memory_padding_mask: Tensor | None,
                    caches: list[CausalSinkhornCache]) -> Tensor:
        """Logits ``(B, m, vocab)`` of ``m`` new decoder inputs ``tgt (B, m)`` after those in ``caches``:
        the last ``m`` rows of :meth:`decode` on the whole prefix (no target padding)."""
        return self.decoder.step(tgt, caches, memory, memory_padding_mask) @ self.encoder.embedding.weight.T


class SinkhornClassifier(nn.Module):
    """Sequence classifier: encoder, mean over non-padding tokens, linear layer -> ``(B, n_classes)``."""

    input_kind = "tokens"

    def __init__(self, vocab_size: int, n_classes: int = 2, *, dim: int = 128, depth: int = 2, heads: int = 4,
                 max_len: int = 512, attention: AttentionConfig | str | dict | None = None, n_iters: int = 5,
                 ff_mult: int = 4, dropout: float = 0.0, pad_id: int = 0) -> None:
        super().__init__()
        check_positive_int(n_classes, "n_classes", minimum=2)
        self.encoder = SinkhornTransformerEncoder(vocab_size, dim=dim, depth=depth, heads=heads, max_len=max_len,
                                                  attention=attention, n_iters=n_iters, ff_mult=ff_mult,
                                                  dropout=dropout, pad_id=pad_id)
        self.classifier = nn.Linear(dim, n_classes)

    def forward(self, tokens: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        h = self.encoder(tokens, padding_mask)
        if padding_mask is None:
            return self.classifier(h.mean(1))
        keep = (~padding_mask).unsqueeze(-1).to(h.dtype)
        return self.classifier((h * keep).sum(1) / keep.sum(1).clamp_min(1.0))


def share_weights(model: nn.Module, reference: nn.Module) -> list[str]:
    """Copy into ``model`` every tensor it shares with ``reference``; returns the names copied.

    A tensor is shared when ``reference`` has one of the same name and shape, or when it is a
    ``q_proj`` / ``k_proj`` / ``v_proj`` weight or bias and ``reference`` has the fused ``qkv_proj`` of
    the same module (SoftMax, local and fixed attention fuse them; rows ``[q; k; v]``). Seeded alike,
    the models of one comparison then start from the Transformer's weights wherever they have them;
    what only the variant has (a SortNet) keeps its own initialisation.
    """
    source, copied = reference.state_dict(), []
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            value = source.get(name)
            if value is None:
                module, _, leaf = name.rpartition(".")
                owner, _, projection = module.rpartition(".")
                fused = source.get(f"{owner}.qkv_proj.{leaf}") if projection in ("q_proj", "k_proj", "v_proj") else None
                value = None if fused is None else fused.chunk(3, dim=0)["qkv".index(projection[0])]
            if value is not None and value.shape == tensor.shape:
                tensor.copy_(value)
                copied.append(name)
    return copied
