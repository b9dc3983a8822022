r"""Offset-attention of the Point Cloud Transformer (Guo et al. 2021), with switchable normalisation.

For point features :math:`F \in \mathbb{R}^{c \times n}` (channels first, as in PCT),

.. math::

    E = (W_q F)^\top (W_k F) \in \mathbb{R}^{n\times n}\ (W_q = W_k,\ c/4 \text{ rows}),\qquad
    F_{sa} = (W_v F)\, P,\qquad
    F \leftarrow F + \mathrm{ReLU}(\mathrm{BN}(W_t (F - F_{sa}))).

PCT normalises :math:`E` by a SoftMax over keys followed by an L1 normalisation over queries,
:math:`P = \mathrm{NC}(\mathrm{NR}(e^{E}))` — i.e. exactly two Sinkhorn normalisations
(``normalization="softmax"`` reproduces it, with PCT's ``1e-9`` in the denominator). The
Sinkformer replaces it by ``n_iters`` Sinkhorn normalisations of :math:`e^{E}`
(``normalization="sinkhorn"``). Output point ``j`` aggregates :math:`\sum_i P_{ij} v_i`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._validation import check_choice, check_positive_int
from ..sinkhorn import sinkhorn

__all__ = ["OffsetAttention"]


class OffsetAttention(torch.nn.Module):
    """PCT's offset-attention layer on ``(batch, channels, n)`` features.

    Args:
        channels: feature width ``c`` (divisible by 4).
        normalization: ``"softmax"`` (PCT: row SoftMax then column L1) or ``"sinkhorn"``.
        n_iters: Sinkhorn normalisations when ``normalization="sinkhorn"``.

    ``forward(x, need_weights=False)`` returns ``(output, weights)`` like
    :class:`torch.nn.MultiheadAttention`; ``weights`` is the ``(batch, n, n)`` matrix :math:`P`
    (or ``None``), which the attention diagnostics read.
    """

    def __init__(self, channels: int, *, normalization: str = "sinkhorn", n_iters: int = 5) -> None:
        super().__init__()
        if channels % 4:
            raise ValueError(f"channels must be divisible by 4, got {channels}")
        self.normalization = check_choice(normalization, "normalization", ("softmax", "sinkhorn"))
        self.n_iters = check_positive_int(n_iters, "n_iters")
        self.q_conv = torch.nn.Conv1d(channels, channels // 4, 1, bias=False)
        self.k_conv = torch.nn.Conv1d(channels, channels // 4, 1, bias=False)
        self.k_conv.weight = self.q_conv.weight  # PCT shares the query and key maps
        self.v_conv = torch.nn.Conv1d(channels, channels, 1)
        self.trans_conv = torch.nn.Conv1d(channels, channels, 1)
        self.after_norm = torch.nn.BatchNorm1d(channels)

    def extra_repr(self) -> str:
        return f"normalization={self.normalization!r}, n_iters={self.n_iters}"

    def attention_matrix(self, x: Tensor) -> Tensor:
        """The ``(batch, n, n)`` normalised attention :math:`P` of features ``x (batch, c, n)``."""
        energy = self.q_conv(x).transpose(1, 2) @ self.k_conv(x)
        if self.normalization == "sinkhorn":
            return sinkhorn(energy, self.n_iters)
        weights = torch.softmax(energy, dim=-1)
        return weights / (1e-9 + weights.sum(dim=1, keepdim=True))

    def forward(self, x: Tensor, need_weights: bool = False) -> tuple[Tensor, Tensor | None]:
        weights = self.attention_matrix(x)
        x_r = self.v_conv(x) @ weights
        x = x + torch.relu(self.after_norm(self.trans_conv(x - x_r)))
        return x, (weights if need_weights else None)
