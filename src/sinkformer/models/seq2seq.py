r"""Encoder-decoder Transformer for translation (Sinkformers paper §6.3, fairseq's IWSLT'14 model).

By default Sinkhorn attention is used in the **encoder only** (§6.3): the decoder's
self-attention is causal SoftMax and its cross-attention SoftMax. ``decoder_attention=
"sinkhorn"`` makes the decoder's self-attention causal Sinkhorn (row :math:`t` balanced on the
prefix :math:`0..t` alone, ``sinkformer.attention(..., is_causal=True)``: no leak from the
future); the cross-attention stays SoftMax (its column normalisation would sum over all target
positions).

.. math::

    h^0 = \sqrt d\,E[x] + PE,\quad m = \mathrm{Encoder}(h^0),\qquad
    p(y_t \mid y_{<t}, x) = \mathrm{softmax}\big(E_{\text{tgt}}\,\mathrm{Decoder}(y_{<t}, m)_t\big)

with sinusoidal positions and the decoder's output projection tied to its input embedding.
fairseq's ``transformer_iwslt_de_en``: 6 + 6 post-norm layers, width 512, 4 heads, feed-forward
1024, dropout 0.3; label smoothing 0.1, Adam (0.9, 0.98), lr 5e-4 with 4000 warm-up steps and
inverse square-root decay. Decoding: :func:`sinkformer.models.decoding.greedy_decode` and
:func:`~sinkformer.models.decoding.beam_search`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..nn.layers import TransformerDecoder, TransformerEncoder, sinusoidal_positions
from .attention_spec import dense_attention

__all__ = ["Seq2SeqTransformer"]


class Seq2SeqTransformer(torch.nn.Module):
    """Translate token ids ``src (batch, S)`` into logits ``(batch, T, vocab_size)`` for ``tgt (batch, T)``.

    ``tgt`` is the decoder input (``<bos> y_1 ... y_{T-1}``); position ``t`` predicts ``y_{t+1}``.

    Args:
        vocab_size: size of the (joint source/target) vocabulary.
        pad_id, bos_id, eos_id: special token ids.
        max_len: longest sequence (position table size).
        dim, encoder_layers, decoder_layers, num_heads, dim_feedforward, dropout: shape
            (fairseq IWSLT: 512, 6, 6, 4, 1024, 0.3).
        attention, n_iters: encoder self-attention, ``"softmax"`` (the Transformer) or ``"sinkhorn"`` with
            ``n_iters`` normalisations (:mod:`~sinkformer.models.attention_spec`).
        decoder_attention: decoder self-attention: ``"softmax"`` (default, §6.3) or ``"sinkhorn"`` (causal
            Sinkhorn with the same ``n_iters``).
        normalization, decoder_normalization: the old spellings of ``attention`` and ``decoder_attention``.
    """

    input_kind = "translation"

    def __init__(
        self,
        vocab_size: int,
        *,
        pad_id: int = 0,
        bos_id: int = 1,
        eos_id: int = 2,
        max_len: int = 256,
        dim: int = 512,
        encoder_layers: int = 6,
        decoder_layers: int = 6,
        num_heads: int = 4,
        dim_feedforward: int = 1024,
        dropout: float = 0.3,
        attention: str = "sinkhorn",
        n_iters: int = 5,
        decoder_attention: str = "softmax",
        normalization: str | None = None,
        decoder_normalization: str | None = None,
    ) -> None:
        super().__init__()
        normalization, encoder_iters = dense_attention(attention, n_iters, old=normalization)
        decoder_normalization, n_iters = dense_attention(decoder_attention, n_iters, argument="decoder_attention",
                                                         old=decoder_normalization)
        if dim % num_heads:
            raise ValueError(f"dim must be divisible by num_heads, got dim={dim}, num_heads={num_heads}")
        self.pad_id, self.bos_id, self.eos_id, self.max_len = pad_id, bos_id, eos_id, max_len
        self.scale = math.sqrt(dim)
        self.src_embedding = torch.nn.Embedding(vocab_size, dim, padding_idx=pad_id)
        self.tgt_embedding = torch.nn.Embedding(vocab_size, dim, padding_idx=pad_id)
        with torch.no_grad():  # fairseq's embedding init: N(0, 1/dim), zero padding row
            for emb in (self.src_embedding, self.tgt_embedding):
                emb.weight.normal_(0.0, dim**-0.5)
                emb.weight[pad_id].zero_()
        self.register_buffer("positions", sinusoidal_positions(max_len, dim), persistent=False)
        self.dropout = torch.nn.Dropout(dropout)
        layer = dict(dim_feedforward=dim_feedforward, dropout=dropout)
        self.encoder = TransformerEncoder(
            dim, num_heads, encoder_layers, normalization=normalization, n_iters=encoder_iters, **layer
        )
        self.decoder = TransformerDecoder(dim, num_heads, decoder_layers, n_iters=n_iters,
                                          self_normalization=decoder_normalization, **layer)

    def _embed(self, embedding: torch.nn.Embedding, ids: Tensor) -> Tensor:
        length = ids.shape[1]
        if length > self.max_len:
            raise ValueError(f"sequences of length {length} exceed max_len={self.max_len}")
        return self.dropout(self.scale * embedding(ids) + self.positions[:length])

    def encode(self, src: Tensor, src_padding_mask: Tensor | None = None) -> Tensor:
        """``(batch, S)`` ids -> memory ``(batch, S, dim)``."""
        return self.encoder(self._embed(self.src_embedding, src), src_padding_mask)

    def decode(
        self,
        tgt: Tensor,
        memory: Tensor,
        memory_padding_mask: Tensor | None = None,
        tgt_padding_mask: Tensor | None = None,
    ) -> Tensor:
        """Decoder inputs ``(batch, T)`` and memory -> logits ``(batch, T, vocab_size)``."""
        h = self.decoder(self._embed(self.tgt_embedding, tgt), memory, tgt_padding_mask, memory_padding_mask)
        return h @ self.tgt_embedding.weight.T

    def forward(
        self,
        src: Tensor,
        tgt: Tensor,
        src_padding_mask: Tensor | None = None,
        tgt_padding_mask: Tensor | None = None,
    ) -> Tensor:
        memory = self.encode(src, src_padding_mask)
        return self.decode(tgt, memory, src_padding_mask, tgt_padding_mask)
