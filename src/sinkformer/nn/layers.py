r"""Transformer encoder/decoder layers and stacks whose attention is :class:`MultiheadAttention`.

The layers *are* ``torch.nn.TransformerEncoderLayer`` / ``TransformerDecoderLayer`` (subclasses:
same constructor, parameter names, ``forward`` and post-/pre-norm behaviour) with their
attention modules replaced by :class:`sinkformer.nn.MultiheadAttention`, so a Transformer and
its Sinkformer differ by ``normalization=`` only and share one ``state_dict`` layout.

An encoder layer computes (post-norm; ``norm_first=True`` moves the norms inside the residuals)

.. math::

    x \leftarrow \mathrm{LN}(x + \mathrm{Attn}(x)),\qquad
    x \leftarrow \mathrm{LN}(x + W_2\,\sigma(W_1 x)),

with :math:`\mathrm{Attn}` normalised by SoftMax or ``n_iters`` Sinkhorn iterations.

The stacks (:class:`TransformerEncoder`, :class:`TransformerDecoder`) build each layer
independently (``torch.nn.TransformerEncoder`` deep-copies one layer, so every layer would start
from the same weights) and take ``batch_first`` tensors ``(batch, length, d_model)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from .multihead import MultiheadAttention

__all__ = [
    "TransformerEncoderLayer",
    "TransformerDecoderLayer",
    "TransformerEncoder",
    "TransformerDecoder",
    "sinusoidal_positions",
]


class TransformerEncoderLayer(torch.nn.TransformerEncoderLayer):
    """``torch.nn.TransformerEncoderLayer`` with Sinkhorn (or any sinkformer) self-attention.

    Arguments are torch's, plus the keyword-only ``normalization``, ``n_iters`` and ``cost`` of
    :class:`sinkformer.nn.MultiheadAttention`. A ``src_key_padding_mask`` (True = padding) also
    removes the padded queries from Sinkhorn's column normalisation.
    """

    def __init__(
        self,
        d_model: int,
        nhead: int,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        activation: str | Callable[[Tensor], Tensor] = F.relu,
        layer_norm_eps: float = 1e-5,
        batch_first: bool = False,
        norm_first: bool = False,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        normalization: str = "sinkhorn",
        n_iters: int = 5,
        cost: str = "dot",
    ) -> None:
        super().__init__(
            d_model, nhead, dim_feedforward, dropout, activation, layer_norm_eps, batch_first, norm_first, bias,
            device, dtype,
        )
        self.self_attn = MultiheadAttention(
            d_model, nhead, dropout=dropout, bias=bias, batch_first=batch_first, device=device, dtype=dtype,
            normalization=normalization, n_iters=n_iters, cost=cost,
        )


class TransformerDecoderLayer(torch.nn.TransformerDecoderLayer):
    """``torch.nn.TransformerDecoderLayer`` whose two attentions are sinkformer modules.

    Defaults follow §6.3 of the Sinkformers paper: SoftMax in both the (causal) self-attention
    and the cross-attention. ``self_normalization="sinkhorn"`` makes the self-attention, called
    with ``tgt_is_causal=True``, causal Sinkhorn (each prefix :math:`0..t` balanced on its own:
    no leak from the future). ``cross_normalization="sinkhorn"`` is for decoders whose queries
    are *not* causal (e.g. DETR's object queries): with causal queries the column normalisation of
    the cross-attention sums over all target positions, which :class:`TransformerDecoder` refuses.
    """

    def __init__(
        self,
        d_model: int,
        nhead: int,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        activation: str | Callable[[Tensor], Tensor] = F.relu,
        layer_norm_eps: float = 1e-5,
        batch_first: bool = False,
        norm_first: bool = False,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        self_normalization: str = "softmax",
        cross_normalization: str = "softmax",
        n_iters: int = 5,
    ) -> None:
        super().__init__(
            d_model, nhead, dim_feedforward, dropout, activation, layer_norm_eps, batch_first, norm_first, bias,
            device, dtype,
        )
        common = dict(dropout=dropout, bias=bias, batch_first=batch_first, device=device, dtype=dtype, n_iters=n_iters)
        self.self_attn = MultiheadAttention(d_model, nhead, normalization=self_normalization, **common)
        self.multihead_attn = MultiheadAttention(d_model, nhead, normalization=cross_normalization, **common)


class TransformerEncoder(torch.nn.Module):
    """``num_layers`` independent :class:`TransformerEncoderLayer` (batch first), optional final norm.

    ``layer_options`` go to every layer (``dim_feedforward``, ``dropout``, ``activation``,
    ``norm_first``, ``normalization``, ``n_iters``, ...). ``final_norm`` adds a LayerNorm after
    the last layer (usual with ``norm_first=True``).

    Shapes: ``x (batch, length, d_model)``, ``padding_mask (batch, length)`` bool, True = padding.
    """

    def __init__(self, d_model: int, nhead: int, num_layers: int, *, final_norm: bool = False, **layer_options) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            TransformerEncoderLayer(d_model, nhead, batch_first=True, **layer_options) for _ in range(num_layers)
        )
        self.norm = torch.nn.LayerNorm(d_model) if final_norm else None

    def forward(self, x: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        for layer in self.layers:
            x = layer(x, src_key_padding_mask=padding_mask)
        return x if self.norm is None else self.norm(x)


class TransformerDecoder(torch.nn.Module):
    """``num_layers`` independent :class:`TransformerDecoderLayer` with causal self-attention.

    ``self_normalization="sinkhorn"`` (with ``n_iters``) gives a causal Sinkformer decoder: causal
    Sinkhorn self-attention, row :math:`t` balanced on the prefix :math:`0..t` alone.
    ``cross_normalization="sinkhorn"`` with ``n_iters >= 2`` raises ``ValueError``: the
    cross-attention's column normalisation would sum over all target positions (a leak).

    Shapes: ``tgt (batch, T, d_model)``, ``memory (batch, S, d_model)``, padding masks
    ``(batch, T)`` / ``(batch, S)`` bool, True = padding. Position ``t`` sees targets ``<= t``.
    """

    def __init__(self, d_model: int, nhead: int, num_layers: int, *, final_norm: bool = False, **layer_options) -> None:
        super().__init__()
        n_iters = layer_options.get("n_iters", 5)
        if layer_options.get("cross_normalization") == "sinkhorn" and n_iters >= 2:
            raise ValueError(
                f"cross_normalization='sinkhorn' with n_iters={n_iters} in a causal decoder: Sinkhorn's column "
                "normalisation sums over all target positions, so the output at position t would depend on targets "
                "after t. Use 'softmax' (or n_iters=1) for the cross-attention; self_normalization='sinkhorn' is "
                "causal Sinkhorn (no leak)."
            )
        self.layers = torch.nn.ModuleList(
            TransformerDecoderLayer(d_model, nhead, batch_first=True, **layer_options) for _ in range(num_layers)
        )
        self.norm = torch.nn.LayerNorm(d_model) if final_norm else None

    def forward(
        self,
        tgt: Tensor,
        memory: Tensor,
        tgt_padding_mask: Tensor | None = None,
        memory_padding_mask: Tensor | None = None,
    ) -> Tensor:
        x = tgt
        for layer in self.layers:
            x = layer(
                x, memory, tgt_key_padding_mask=tgt_padding_mask, memory_key_padding_mask=memory_padding_mask,
                tgt_is_causal=True,
            )
        return x if self.norm is None else self.norm(x)


def sinusoidal_positions(length: int, dim: int, *, dtype: torch.dtype = torch.float32) -> Tensor:
    r"""The ``(length, dim)`` sinusoidal table of Vaswani et al.

    :math:`PE_{p,2i} = \sin(p / 10000^{2i/d})`, :math:`PE_{p,2i+1} = \cos(p / 10000^{2i/d})`.
    """
    position = torch.arange(length, dtype=torch.float64).unsqueeze(1)
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float64) * (-math.log(10000.0) / dim))
    table = torch.zeros(length, dim, dtype=torch.float64)
    table[:, 0::2] = torch.sin(position * freq)
    table[:, 1::2] = torch.cos(position * freq[: dim // 2])
    return table.to(dtype)
