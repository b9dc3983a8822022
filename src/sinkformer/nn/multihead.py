"""A drop-in :class:`torch.nn.MultiheadAttention` with Sinkhorn (or other) normalisation.

It *is* a ``torch.nn.MultiheadAttention`` (subclass): same constructor, same parameters and
``state_dict`` keys, same ``forward`` arguments and return values, so trained weights load and
``nn.TransformerEncoderLayer`` accepts it. Only the normalisation of the attention matrix changes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .._validation import check_choice, check_positive_int
from ..attention import COSTS, NORMALIZATIONS, attention
from ..attention.masks import MASKING, additive_attn_mask, split_key_padding
from .heads import merge_heads, split_heads

__all__ = ["MultiheadAttention"]


def _keep_off_fused_encoder_path(module, args):
    """No-op pre-hook. ``nn.TransformerEncoderLayer`` skips its fused C++ path (which would
    bypass this module's ``forward`` and always use SoftMax) whenever a hook is attached."""
    return None


class MultiheadAttention(torch.nn.MultiheadAttention):
    """Multi-head attention whose weights are normalised by Sinkhorn's algorithm.

    Arguments are those of :class:`torch.nn.MultiheadAttention`, plus:

    Args:
        normalization: ``"sinkhorn"`` (default), ``"softmax"``, ``"linear"``, ``"sigmoid"``, ``"relu"``.
        n_iters: Sinkhorn normalisations (paper eq. (3)); 1 is exactly SoftMax.
        cost: ``"dot"`` or ``"l2"``.

    With ``normalization="sinkhorn"``, a ``key_padding_mask`` in self-attention (``query is key``)
    also marks the padded queries, which then take no part in the column normalisation and
    output zeros. ``need_weights`` returns the weights before dropout.

    Causal self-attention: ``is_causal=True`` (what ``nn.TransformerDecoderLayer`` passes with
    ``tgt_is_causal=True``, or ``nn.Transformer`` when ``tgt_mask`` is the causal mask; the
    ``attn_mask`` may be given too, or omitted) is *causal Sinkhorn*: row :math:`t` is row
    :math:`t` of Sinkhorn on the prefix :math:`0..t` alone (``sinkformer.attention(...,
    is_causal=True)``), so nothing after :math:`t` influences it; ``n_iters=1`` is causal SoftMax.
    A causal ``attn_mask`` *without* ``is_causal=True`` raises ``ValueError`` with Sinkhorn and
    ``n_iters >= 2`` (the whole matrix would be balanced: future queries would enter the column
    sums of past outputs), in any spelling (bool, ``-inf``, ``-1e9``, ``finfo.min``), and so does
    ``is_causal=True`` on cross-attention (``L != S``). Under Sinkhorn with ``n_iters >= 2`` a
    float ``key_padding_mask`` entry ``<= -1e4`` is padding, as ``attention`` reads ``attn_mask``.

    Shapes (``batch_first=True``): query ``(N, L, E)``, key/value ``(N, S, E_k/E_v)``, output
    ``(N, L, E)``, weights ``(N, L, S)`` (or ``(N, H, L, S)`` with ``average_attn_weights=False``).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        device=None,
        dtype=None,
        *,
        normalization: str = "sinkhorn",
        n_iters: int = 5,
        cost: str = "dot",
    ) -> None:
        super().__init__(
            embed_dim, num_heads, dropout, bias, add_bias_kv, add_zero_attn, kdim, vdim, batch_first, device, dtype
        )
        self.normalization = check_choice(normalization, "normalization", NORMALIZATIONS)
        self.n_iters = check_positive_int(n_iters, "n_iters")
        self.cost = check_choice(cost, "cost", COSTS)
        self.register_forward_pre_hook(_keep_off_fused_encoder_path)

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, normalization={self.normalization!r}, n_iters={self.n_iters}"

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        if query.is_nested:
            raise ValueError("sinkformer.nn.MultiheadAttention does not take nested tensors; pass padded tensors")
        self_attention = query is key
        unbatched = query.dim() == 2
        if unbatched:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        if self.batch_first and not unbatched:
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))
        # from here on: (L, N, E) as in torch's functional implementation
        tgt_len, bsz, _ = query.shape
        q, k, v = self._project(query, key, value)

        sinkhorn_iterations = self.normalization == "sinkhorn" and self.n_iters >= 2
        masked_from = MASKING if sinkhorn_iterations else float("-inf")  # as attention() reads a float attn_mask
        pad, bias = split_key_padding(key_padding_mask, bsz, key.shape[0], masked_from)
        mask = additive_attn_mask(attn_mask, bsz, self.num_heads, tgt_len, key.shape[0], q.dtype)
        if bias is not None:
            mask = bias if mask is None else mask + bias
        if self.bias_k is not None:
            k = torch.cat([k, self.bias_k.expand(1, bsz, -1)])
            v = torch.cat([v, self.bias_v.expand(1, bsz, -1)])
            pad, mask = _extend_keys(pad, mask)

        q, k, v = (split_heads(x.transpose(0, 1), self.num_heads) for x in (q, k, v))  # (N, h, L, e)
        if self.add_zero_attn:
            k = torch.cat([k, k.new_zeros(k.shape[:2] + (1, k.shape[-1]))], dim=2)
            v = torch.cat([v, v.new_zeros(v.shape[:2] + (1, v.shape[-1]))], dim=2)
            pad, mask = _extend_keys(pad, mask)

        query_pad = None
        if self.normalization == "sinkhorn" and self_attention and key_padding_mask is not None:
            query_pad = pad[:, :tgt_len]
        result = attention(
            q, k, v,
            normalization=self.normalization,
            n_iters=self.n_iters,
            cost=self.cost,
            attn_mask=mask,
            key_padding_mask=pad,
            query_padding_mask=query_pad,
            is_causal=is_causal,
            dropout_p=self.dropout if self.training else 0.0,
            return_weights=need_weights,
        )
        out, weights = result if need_weights else (result, None)
        out = self.out_proj(merge_heads(out).transpose(0, 1))

        if self.batch_first and not unbatched:
            out = out.transpose(0, 1)
        if weights is not None and average_attn_weights:
            weights = weights.mean(dim=1)
        if unbatched:
            out = out.squeeze(1)
            weights = weights.squeeze(0) if weights is not None else None
        return out, weights

    def _project(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Input projections, with the parameter layout of ``torch.nn.MultiheadAttention``."""
        if self._qkv_same_embed_dim:
            w_q, w_k, w_v = self.in_proj_weight.chunk(3)
        else:
            w_q, w_k, w_v = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        b_q = b_k = b_v = None
        if self.in_proj_bias is not None:
            b_q, b_k, b_v = self.in_proj_bias.chunk(3)
        return F.linear(query, w_q, b_q), F.linear(key, w_k, b_k), F.linear(value, w_v, b_v)


def _extend_keys(pad: Tensor | None, mask: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
    """One extra key (``bias_k`` or the zero key): it is never padding and never masked."""
    if pad is not None:
        pad = F.pad(pad, (0, 1), value=False)
    if mask is not None:
        mask = F.pad(mask, (0, 1), value=0.0)
    return pad, mask
