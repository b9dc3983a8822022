r"""Attention parameters as the dynamics toolkit sees them (``docs/theory.md`` §5, §6.7).

One head is a triple ``(Q, K, V)`` with :math:`Q, K \in \mathbb R^{k\times d}` and
:math:`V \in \mathbb R^{d\times d}`; its interaction matrix is :math:`A = K^\top Q`, so that
:math:`\langle Qx, Ky\rangle = y^\top A x`. There is no :math:`1/\sqrt k` factor (absorb it
into ``Q``). Several heads are a list of triples; the field is the sum of the head fields
(the output projection is absorbed into each :math:`V_h`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from .._validation import check_tensor

__all__ = ["Params", "as_heads", "stack_heads", "interaction", "split_heads", "from_multihead"]

#: ``(Q, K, V)`` or a list of such triples (multi-head).
Params = tuple[Tensor, Tensor, Tensor] | Sequence[tuple[Tensor, Tensor, Tensor]]


def _is_triple(p: object) -> bool:
    return isinstance(p, (tuple, list)) and len(p) == 3 and all(isinstance(t, Tensor) for t in p)


def as_heads(params: Params, d: int | None = None, *, batched: bool = False) -> list[tuple[Tensor, Tensor, Tensor]]:
    """Validate ``params`` and return it as a list of head triples ``[(Q, K, V), ...]``.

    ``d``, if given, is the token dimension the heads must act on. With ``batched=True`` the
    matrices may carry leading batch dimensions (``Q (..., k, d)``): one parameter set per member
    of a batch of Gaussians (used by :mod:`~sinkformer.dynamics.gaussian`).
    """
    if _is_triple(params):
        heads = [tuple(params)]
    elif isinstance(params, (tuple, list)) and params and all(_is_triple(p) for p in params):
        heads = [tuple(p) for p in params]
    else:
        raise TypeError(
            "params must be a triple (Q, K, V) of tensors or a non-empty list of such triples (one per head), "
            f"got {type(params).__name__}"
        )
    for h, (Q, K, V) in enumerate(heads):
        where = f"params head {h}" if len(heads) > 1 else "params"
        for name, t in (("Q", Q), ("K", K), ("V", V)):
            check_tensor(t, f"{where} {name}", floating=True, **({"min_dim": 2} if batched else {"ndim": 2}))
        dim = Q.shape[-1] if d is None else d
        if Q.shape[-2:] != K.shape[-2:] or Q.shape[-1] != dim or V.shape[-2:] != (dim, dim):
            raise ValueError(
                f"{where}: expected Q, K of shape (k, {dim}) and V of shape ({dim}, {dim}), "
                f"got Q {tuple(Q.shape)}, K {tuple(K.shape)}, V {tuple(V.shape)}"
            )
        d = dim
    return heads  # type: ignore[return-value]


def stack_heads(heads: list[tuple[Tensor, Tensor, Tensor]], dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """Stack heads into ``Q, K (..., H, k_max, d)`` and ``V (..., H, d, d)`` in ``dtype``.

    Heads with fewer rows are padded with zero rows, which changes neither
    :math:`\\langle Qx, Ky\\rangle` nor :math:`|Qx - Ky|^2`. Leading (batch) dimensions of the
    matrices, if any, are broadcast against each other and kept in front of the head dimension.
    """
    k_max = max(Q.shape[-2] for Q, _, _ in heads)

    def pad(t: Tensor) -> Tensor:
        missing = k_max - t.shape[-2]
        return torch.cat([t, t.new_zeros(t.shape[:-2] + (missing, t.shape[-1]))], -2) if missing else t

    Qs, Ks, Vs = ([pad(h[i]) if i < 2 else h[i] for h in heads] for i in range(3))
    try:
        batch = tuple(np.broadcast_shapes(*(tuple(t.shape[:-2]) for t in Qs + Ks + Vs)))
    except ValueError:
        shapes = [tuple(t.shape) for t in Qs + Ks + Vs]
        raise ValueError(f"the leading (batch) dimensions of the parameters must broadcast together, got shapes {shapes}") from None
    stack = lambda ts: torch.stack([t.expand(batch + t.shape[-2:]) for t in ts], dim=-3).to(dtype)  # noqa: E731
    return stack(Qs), stack(Ks), stack(Vs)


def interaction(Q: Tensor, K: Tensor) -> Tensor:
    """:math:`A = K^\\top Q` (``(..., d, d)``), so that :math:`\\langle Qx, Ky\\rangle = y^\\top A x`."""
    return K.transpose(-1, -2) @ Q


def split_heads(Q: Tensor, K: Tensor, V: Tensor, n_heads: int) -> list[tuple[Tensor, Tensor, Tensor]]:
    r"""Concatenated heads with output projection :math:`W^O = I` (``docs/theory.md`` §6.7).

    The rows of ``Q``, ``K`` (``(k, d)``) and ``V`` (``(d, d)``) are cut into ``n_heads`` consecutive
    blocks; head :math:`h` is :math:`(Q_h, K_h, E_h^\top\tilde V_h)` with :math:`\tilde V_h` the value rows of
    block :math:`h` and :math:`E_h^\top` their embedding back into :math:`\mathbb R^d`. A block may be empty
    (``k < n_heads``): that head has :math:`A_h = 0`.
    """
    d = V.shape[0]
    q_rows = -(-Q.shape[0] // n_heads)  # ceil: rows of Q, K per head
    v_rows = d // n_heads
    if d % n_heads:
        raise ValueError(f"n_heads must divide d = {d}, got {n_heads}")
    heads = []
    for h in range(n_heads):
        rows = slice(h * q_rows, (h + 1) * q_rows)
        Qh, Kh = Q[rows], K[rows]
        if Qh.shape[0] == 0:
            Qh = Kh = Q.new_zeros(1, Q.shape[1])
        Vh = torch.zeros_like(V)
        Vh[h * v_rows : (h + 1) * v_rows] = V[h * v_rows : (h + 1) * v_rows]
        heads.append((Qh, Kh, Vh))
    return heads


def from_multihead(mha: torch.nn.MultiheadAttention) -> list[tuple[Tensor, Tensor, Tensor]]:
    r"""The head triples of a :class:`torch.nn.MultiheadAttention` (self-attention, no biases).

    The layer computes :math:`\sum_h W^O_h\,\mathrm{softmax}(\langle W^Q_h x, W^K_h y\rangle/\sqrt{d_h})\,W^V_h y`,
    so head :math:`h` is :math:`Q_h = W^Q_h/\sqrt{d_h}`, :math:`K_h = W^K_h`,
    :math:`V_h = W^O_h W^V_h` (``docs/theory.md`` §6.7). A residual layer ``x + mha(x, x, x)`` is then one
    Euler step of size 1 of the Softmax particle flow with these parameters.
    """
    if not isinstance(mha, torch.nn.MultiheadAttention):
        raise TypeError(f"mha must be a torch.nn.MultiheadAttention, got {type(mha).__name__}")
    if not mha._qkv_same_embed_dim:
        raise ValueError("mha must use the same embedding dimension for queries, keys and values (kdim = vdim = embed_dim)")
    biases = [b for b in (mha.in_proj_bias, mha.out_proj.bias, mha.bias_k, mha.bias_v) if b is not None]
    if any(bool(b.detach().abs().max() > 0) for b in biases):
        raise ValueError("mha has non-zero biases; the particle dynamics have none (build it with bias=False)")
    d, H = mha.embed_dim, mha.num_heads
    dh = d // H
    Wq, Wk, Wv = mha.in_proj_weight.detach().chunk(3)
    Wo = mha.out_proj.weight.detach()
    heads = []
    for h in range(H):
        rows = slice(h * dh, (h + 1) * dh)
        heads.append((Wq[rows] / dh**0.5, Wk[rows], Wo[:, rows] @ Wv[rows]))
    return heads
