r"""Causal Sinkhorn attention: incremental decoding.

The full forward is ``attention(q, k, v, is_causal=True, n_iters=N)`` (engine ``"causal"``):
output row :math:`t` is row :math:`t` of Sinkhorn attention on the prefix :math:`0..t` alone,
with the column marginals of uniform causal attention (:mod:`sinkformer.sinkhorn.prefix`).

Generating token :math:`t` needs only that row, so a decoder carries, per layer and head, the
keys and values (a KV cache) and two running column sums over the rows seen so far:

* :math:`L_j = \log\sum_{i \le t} \mathrm{softmax}(S_{i\cdot})_j` — the column sums of causal
  SoftMax (the first row update does not depend on the prefix);
* :math:`b_j = \sum_{i \le t} 1/|\{j' \le i \text{ kept}\}|` — the prefix's column marginals.

With them, ``n_iters = 2`` gives :math:`w_j = \mathrm{softmax}(S_{t\cdot})_j\, b_j / e^{L_j}` and
``n_iters = 3`` the SoftMax of :math:`S_{tj} + \log b_j - L_j`: :math:`O(t)` per new token, like
SoftMax with a KV cache. From ``n_iters = 4`` on, the prefix's rows are re-balanced against the
new column potentials, so the state also keeps the :math:`t \times t` scores and a step costs
:math:`O(t^2\, n\_iters)` (one dense Sinkhorn on the prefix, keeping its last row).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .._validation import (
    broadcast_shapes, broadcastable, check_positive_int, check_qkv, check_scores_fit, check_tensor, compute_dtype,
)
from ..sinkhorn import sinkhorn
from ..sinkhorn.problem import check_scale

__all__ = ["CausalSinkhornCache"]


class CausalSinkhornCache:
    r"""The decoding state of one causal Sinkhorn attention layer (all heads).

    Feed the tokens in order with :meth:`step` — one or several at a time; the outputs equal the
    rows of the full forward ``attention(q, k, v, is_causal=True, n_iters=n_iters,
    key_padding_mask=...)`` (to floating-point rounding).

    Args:
        n_iters: Sinkhorn normalisations per prefix (1 = causal SoftMax).
        scale: multiplies :math:`q\cdot k`; default :math:`1/\sqrt d`.

    Example:
        >>> from sinkformer import attention
        >>> cache = CausalSinkhornCache(n_iters=3)
        >>> q = k = v = torch.randn(1, 4, 10, 8)
        >>> out = torch.cat([cache.step(q[..., t:t+1, :], k[..., t:t+1, :], v[..., t:t+1, :]) for t in range(10)], -2)
        >>> full = attention(q, k, v, is_causal=True, n_iters=3)
        >>> bool((out - full).abs().max() < 1e-5)
        True
    """

    def __init__(self, n_iters: int, scale: float | None = None) -> None:
        self.n_iters = check_positive_int(n_iters, "n_iters")
        self.scale = None if scale is None else check_scale(scale)
        self.keys: Tensor | None = None  # (..., t, d)
        self.values: Tensor | None = None  # (..., t, d_v)
        self.valid: Tensor | None = None  # (..., t) bool: key j is not padding
        self.log_softmax_columns: Tensor | None = None  # (..., t) L_j
        self.marginals: Tensor | None = None  # (..., t) b_j
        self.scores: Tensor | None = None  # (..., t, t), only for n_iters >= 4

    def __len__(self) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]

    def step(self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        """Append ``m`` tokens and return their outputs.

        Args:
            q, k: ``(..., m, d)``; v: ``(..., m, d_v)`` — the new tokens' projections.
            key_padding_mask: ``(..., m)`` bool broadcastable to the batch, True = padding.

        Returns:
            ``(..., m, d_v)`` in the dtype of ``q``.

        Raises ``TypeError``/``ValueError`` as :func:`sinkformer.attention` does (and before changing the
        state), also when the batch shape, head size or dtype differs from the earlier steps'.
        """
        self._check_step(q, k, v, key_padding_mask)
        outs = []
        for i in range(q.shape[-2]):
            pad = None if key_padding_mask is None else key_padding_mask[..., i]
            outs.append(self._one(q[..., i, :], k[..., i, :], v[..., i, :], pad))
        return torch.stack(outs, dim=-2).to(q.dtype)

    def _check_step(self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None) -> None:
        """The checks of :meth:`step`: those of :func:`sinkformer.attention` and agreement with the state."""
        for name, x in (("q", q), ("k", k), ("v", v)):
            check_tensor(x, name, min_dim=2, floating=True)
        if not q.shape[-2] == k.shape[-2] == v.shape[-2]:
            raise ValueError(f"q, k and v must hold the same new tokens (dim -2), got shapes {tuple(q.shape)}, "
                             f"{tuple(k.shape)} and {tuple(v.shape)}")
        check_qkv(q, k, v)
        batch, m = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2]), q.shape[-2]
        if key_padding_mask is not None:
            check_tensor(key_padding_mask, "key_padding_mask", dtype_bool=True)
            if key_padding_mask.dim() < 1 or not broadcastable(key_padding_mask.shape, batch + (m,)):
                raise ValueError(f"key_padding_mask must broadcast to (*batch, m) = {tuple(batch) + (m,)} (True = "
                                 f"padding), got shape {tuple(key_padding_mask.shape)}")
        if self.keys is not None:
            state = (tuple(self.keys.shape[:-2]), self.keys.shape[-1], self.values.shape[-1], self.keys.dtype)
            given = (tuple(batch), q.shape[-1], v.shape[-1], compute_dtype(q.dtype))
            if state != given:
                raise ValueError(
                    "each step must continue the same sequences: (batch shape, head size of q/k, of v, compute "
                    f"dtype) were {state} in the earlier steps, got {given}; start a new CausalSinkhornCache"
                )
        dtype = compute_dtype(q.dtype)
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(q.shape[-1]) if q.shape[-1] else 1.0
        for keys in (k, self.keys):
            if keys is not None:
                check_scores_fit(q.to(dtype), keys.to(dtype), scale)

    def _one(self, q: Tensor, k: Tensor, v: Tensor, pad: Tensor | None) -> Tensor:
        dtype = compute_dtype(q.dtype)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        batch = broadcast_shapes(q.shape[:-1], k.shape[:-1], v.shape[:-1])
        valid = torch.ones(batch, dtype=torch.bool, device=q.device) if pad is None else (~pad).expand(batch)
        self._append(k.expand(batch + k.shape[-1:]), v.expand(batch + v.shape[-1:]), valid)
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(q.shape[-1]) if q.shape[-1] else 1.0
        s = scale * (self.keys @ q.unsqueeze(-1)).squeeze(-1)  # (..., t): the new query's scores
        s = s.masked_fill(~self.valid, float("-inf"))
        row_valid = self.valid.any(-1, keepdim=True)
        lse = torch.where(row_valid, s, torch.zeros_like(s)).logsumexp(-1, keepdim=True)
        softmax = torch.where(row_valid, torch.exp(s - lse), torch.zeros_like(s))
        # running column sums: of causal SoftMax (the first row update) and of uniform causal attention
        self.log_softmax_columns = torch.logaddexp(self.log_softmax_columns, softmax.log())
        count = self.valid.sum(-1, keepdim=True).clamp_min(1)
        self.marginals = self.marginals + self.valid.to(dtype) / count
        g = torch.where(self.valid, self.marginals.log() - self.log_softmax_columns, torch.zeros_like(s))
        if self.n_iters == 1:
            w = softmax
        elif self.n_iters == 2:
            w = softmax * torch.exp(g)
        elif self.n_iters == 3:
            w = torch.where(row_valid, torch.softmax(torch.where(row_valid, s + g, torch.zeros_like(s)), -1),
                            torch.zeros_like(s))
        else:
            w = self._rebalanced_row(s)
        return (w.unsqueeze(-2) @ self.values).squeeze(-2)

    def _append(self, k: Tensor, v: Tensor, valid: Tensor) -> None:
        if self.keys is None:
            shape = valid.shape + (0,)
            self.keys, self.values = k.new_zeros(shape + k.shape[-1:]), v.new_zeros(shape + v.shape[-1:])
            self.valid = valid.new_zeros(shape)
            self.log_softmax_columns = k.new_full(shape, float("-inf"))
            self.marginals = k.new_zeros(shape)
            if self.n_iters >= 4:
                self.scores = k.new_zeros(shape + (0,))
        self.keys = torch.cat([self.keys, k.unsqueeze(-2)], -2)
        self.values = torch.cat([self.values, v.unsqueeze(-2)], -2)
        self.valid = torch.cat([self.valid, valid.unsqueeze(-1)], -1)
        self.log_softmax_columns = torch.cat([self.log_softmax_columns, k.new_full(valid.shape + (1,), float("-inf"))], -1)
        self.marginals = torch.cat([self.marginals, k.new_zeros(valid.shape + (1,))], -1)

    def _rebalanced_row(self, s: Tensor) -> Tensor:
        """Row ``t`` of the dense Sinkhorn on the whole prefix (``n_iters >= 4``): O(t^2 n_iters)."""
        t = s.shape[-1]
        scores = torch.nn.functional.pad(self.scores, (0, 1))  # new column (above the diagonal: unused)
        self.scores = torch.cat([scores, s.unsqueeze(-2)], -2)
        keep = torch.ones(t, t, dtype=torch.bool, device=s.device).tril() & self.valid.unsqueeze(-2)
        P = sinkhorn(self.scores, self.n_iters, mask=keep, col_marginals=self.marginals)
        return P[..., -1, :]
