r"""The sentiment classifier of the Sinkformers paper (§6.2, Appendix C.2).

.. math::

    h^0_t = E[w_t] + PE_t,\qquad h^{\ell+1} = \mathrm{EncoderLayer}(h^\ell),\qquad
    \text{logits} = W \max_t h^L_t + b

(token embedding plus fixed sinusoidal positions, post-norm encoder layers, max-pooling over the
non-padding tokens, a linear classifier). Paper: depth 6, 8 heads, Adam, batch 32, lr 1e-4
divided by 10 after 12 of 15 epochs; Sinkhorn with 3 iterations is already doubly stochastic.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..nn.layers import TransformerEncoder, sinusoidal_positions
from .attention_spec import dense_attention

__all__ = ["TextClassifier"]


class TextClassifier(torch.nn.Module):
    """Classify token sequences ``(batch, length)`` (with ``padding_mask``, True = pad) into ``n_classes``.

    Args:
        vocab_size: token ids are ``< vocab_size``. n_classes: number of labels.
        max_len: longest sequence (size of the position table).
        pad_id: id of the padding token (its embedding stays zero).
        dim, depth, num_heads, dim_feedforward, dropout: encoder shape (paper: depth 6, 8 heads).
        attention, n_iters: ``"softmax"`` (the Transformer) or ``"sinkhorn"`` with ``n_iters`` normalisations,
            see :mod:`~sinkformer.models.attention_spec`; ``normalization``: the old spelling of ``attention``.
    """

    input_kind = "tokens"

    def __init__(
        self,
        vocab_size: int,
        n_classes: int = 2,
        *,
        max_len: int = 512,
        pad_id: int = 0,
        dim: int = 256,
        depth: int = 6,
        num_heads: int = 8,
        dim_feedforward: int = 256,
        dropout: float = 0.1,
        attention: str = "sinkhorn",
        n_iters: int = 5,
        normalization: str | None = None,
    ) -> None:
        super().__init__()
        normalization, n_iters = dense_attention(attention, n_iters, old=normalization)
        if dim % num_heads:
            raise ValueError(f"dim must be divisible by num_heads, got dim={dim}, num_heads={num_heads}")
        self.embedding = torch.nn.Embedding(vocab_size, dim, padding_idx=pad_id)
        self.register_buffer("positions", sinusoidal_positions(max_len, dim), persistent=False)
        self.encoder = TransformerEncoder(
            dim, num_heads, depth, dim_feedforward=dim_feedforward, dropout=dropout,
            normalization=normalization, n_iters=n_iters,
        )
        self.classifier = torch.nn.Linear(dim, n_classes)

    def forward(self, tokens: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        length = tokens.shape[1]
        if length > self.positions.shape[0]:
            raise ValueError(f"sequences of length {length} exceed max_len={self.positions.shape[0]}")
        h = self.encoder(self.embedding(tokens) + self.positions[:length], padding_mask)
        if padding_mask is not None:
            h = h.masked_fill(padding_mask.unsqueeze(-1), float("-inf"))
        return self.classifier(h.amax(dim=1))
