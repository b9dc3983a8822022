"""Sparse Sinkhorn Attention as modules (Tay et al. 2020): the sorting network, the multi-head
layer, and the baselines of the paper's tables (full, local and strided SoftMax attention, and
dense Sinkhorn self-attention: a Sinkformer layer, causal or not). The functions they call are in
:mod:`sinkformer.attention.sparse` and :mod:`sinkformer.attention.sparse_baselines`."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .._validation import check_choice, check_positive_int, check_tensor
from ..attention.functional import attention
from ..attention.sparse import (
    SORT_NETS, SparseOptions, block_pool, n_blocks, sort_matrix, sparse_sinkhorn_attention, sparse_sinkhorn_step,
)
from ..attention.sparse_baselines import PATTERNS, local_attention, sparse_transformer_attention
from .heads import fused_self_attention, merge_heads, split_heads

__all__ = ["SortNet", "SparseSinkhornAttention", "SparseSinkhornCache", "BaselineSelfAttention",
           "DenseSinkhornSelfAttention"]


class SortNet(nn.Module):
    """:math:`P`: pooled blocks ``(B, N_B, d)`` -> sorting logits ``(B, H, N_B, max_blocks)``
    (``forward(pooled, columns)``: the leading ``columns`` only, ``(B, H, N_B, columns)``).

    One independent network per head (§3.2.2), applied to every block (eq. 3). ``kind`` is one of
    :data:`SORT_NETS`; two-layer networks have ``hidden`` units per head (default ``dim``, the
    paper's :math:`W_P \\in \\mathbb R^{d\\times d}`). Linear layers are initialised like
    :class:`torch.nn.Linear`.
    """

    def __init__(self, dim: int, max_blocks: int, heads: int, kind: str = "linear", hidden: int | None = None) -> None:
        super().__init__()
        check_choice(kind, "sort_net", SORT_NETS)
        self.kind, self.max_blocks = kind, max_blocks
        self.ops = list(reversed(kind.split("_")))  # application order, inner to outer
        hidden = hidden or dim
        n_linear = self.ops.count("linear")
        sizes = [dim] + [hidden] * (n_linear - 1) + [max_blocks]
        self.weights = nn.ParameterList(
            nn.Parameter(torch.empty(heads, d_in, d_out)) for d_in, d_out in zip(sizes, sizes[1:])
        )
        self.biases = nn.ParameterList(nn.Parameter(torch.empty(heads, 1, d_out)) for d_out in sizes[1:])
        for w, b in zip(self.weights, self.biases):
            bound = 1.0 / math.sqrt(w.shape[1])
            nn.init.uniform_(w, -bound, bound)
            nn.init.uniform_(b, -bound, bound)

    def extra_repr(self) -> str:
        return f"kind={self.kind!r}, heads={self.weights[0].shape[0]}, max_blocks={self.max_blocks}"

    def forward(self, pooled: Tensor, columns: int | None = None) -> Tensor:
        """``pooled (B, N_B, d)`` -> ``(B, H, N_B, columns or max_blocks)``; ``columns``: the sorting's
        :math:`N_B` (its logits are square), so the last layer computes those columns alone.

        Each layer is one product for every head, ``(..., N_B, d_in) x (H, d_in, d_out)`` by
        :func:`torch.einsum`: the first layer's blocks are the same for every head (one
        ``(B N_B, d) x (d, H d_out)`` product), and no layer expands the weights over the batch
        (a broadcast ``@`` copies them ``B`` times, and its backward sums ``B`` copies of their gradient).
        """
        if columns is not None and not 0 <= columns <= self.max_blocks:
            raise ValueError(f"columns must be in [0, max_blocks={self.max_blocks}], got {columns}")
        x, layer, per_head = pooled, 0, False
        for op in self.ops:
            if op == "relu":
                x = torch.relu(x)
                continue
            w, b = self.weights[layer], self.biases[layer]
            if layer == len(self.weights) - 1 and columns is not None:
                w, b = w[..., :columns], b[..., :columns]
            x = torch.einsum("...hnd,hdo->...hno" if per_head else "...nd,hdo->...hno", x, w) + b
            layer, per_head = layer + 1, True
        return x


class SparseSinkhornAttention(nn.Module):
    """Multi-head Sparse Sinkhorn self-attention (batch first).

    Args:
        embed_dim: model width :math:`d`; num_heads: heads (``embed_dim`` divisible by it).
        block_size: :math:`b`, tokens per block.
        max_len: longest sequence accepted; fixes the SortNet output size
            :math:`\\lceil \\text{max\\_len}/b \\rceil` (shorter inputs use its leading logits).
        sort_iters: :math:`N_k` Sinkhorn iterations (paper's tuning set {2, 5, 10, 20}; 0 = none).
        temperature: Gumbel-Sinkhorn :math:`\\tau` (0.75, best in §6.2). Gumbel noise is added in
            training mode only; evaluation is deterministic.
        sort_net: one of :data:`SORT_NETS` (``"linear"``, best in Table 8); sort_hidden: hidden
            width of the two-layer sort nets (default ``embed_dim``).
        causal: causal variant (§3.3): cumulative-sum pooling, causal balancing, causal local
            attention.
        sortcut_budget: SortCut (§3.4): attend only to the first ``sortcut_budget`` sorted blocks.
        mixture: add vanilla attention (§3.2.3).
        share_kv: one projection for keys and values (Table 8's :math:`K = V`).
        dropout: dropout on attention weights; bias: biases of the projections.

    ``forward(x, key_padding_mask=None, return_sort=False)``: ``x`` ``(B, n, embed_dim)``,
    ``key_padding_mask`` ``(B, n)`` True = padding -> ``(B, n, embed_dim)`` (and the sorting
    matrices ``(B, H, N_B, N_B)``).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        block_size: int,
        max_len: int,
        sort_iters: int = SparseOptions.sort_iters,
        temperature: float = SparseOptions.temperature,
        sort_net: str = "linear",
        sort_hidden: int | None = None,
        causal: bool = False,
        sortcut_budget: int | None = None,
        mixture: bool = False,
        share_kv: bool = False,
        dropout: float = 0.0,
        bias: bool = True,
    ) -> None:
        super().__init__()
        check_positive_int(embed_dim, "embed_dim")
        check_positive_int(num_heads, "num_heads")
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim must be divisible by num_heads, got {embed_dim} and {num_heads}")
        self.options = SparseOptions(block_size, sort_iters, temperature, causal, sortcut_budget, mixture)
        check_positive_int(max_len, "max_len")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.embed_dim, self.num_heads, self.max_len = embed_dim, num_heads, max_len
        self.share_kv, self.dropout = share_kv, dropout
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.v_proj = None if share_kv else nn.Linear(embed_dim, embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.sort_net = SortNet(embed_dim, n_blocks(max_len, block_size), num_heads, sort_net, sort_hidden)

    def extra_repr(self) -> str:
        extras = [f"block_size={self.block_size}", f"sort_iters={self.sort_iters}", f"temperature={self.temperature}"]
        extras += [name for name in ("causal", "mixture", "share_kv") if getattr(self, name)]
        if self.sortcut_budget is not None:
            extras.append(f"sortcut_budget={self.sortcut_budget}")
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, " + ", ".join(extras)

    def forward(
        self, x: Tensor, key_padding_mask: Tensor | None = None, return_sort: bool = False
    ) -> Tensor | tuple[Tensor, Tensor]:
        check_tensor(x, "x", ndim=3, floating=True)
        if x.shape[-1] != self.embed_dim or x.shape[1] > self.max_len:
            raise ValueError(
                f"x must have shape (batch, n <= max_len={self.max_len}, embed_dim={self.embed_dim}), got {tuple(x.shape)}"
            )
        n = x.shape[1]
        if key_padding_mask is not None:
            check_tensor(key_padding_mask, "key_padding_mask", dtype_bool=True)
            if key_padding_mask.shape != x.shape[:2]:
                raise ValueError(f"key_padding_mask must have shape {tuple(x.shape[:2])}, got {tuple(key_padding_mask.shape)}")
        q, k = split_heads(self.q_proj(x), self.num_heads), split_heads(self.k_proj(x), self.num_heads)
        v = k if self.v_proj is None else split_heads(self.v_proj(x), self.num_heads)
        nb = n_blocks(n, self.block_size)
        pooled = block_pool(x, self.block_size, causal=self.causal, padding_mask=key_padding_mask)
        logits = self.sort_net(pooled, columns=nb)
        out, S = sparse_sinkhorn_attention(
            q, k, v, logits,
            **self.options.as_kwargs(),
            gumbel=self.training,
            key_padding_mask=key_padding_mask,
            dropout_p=self.dropout if self.training else 0.0,
            return_sort=True,
        )
        out = self.out_proj(merge_heads(out))
        return (out, S) if return_sort else out

    def step(self, x: Tensor, cache: "SparseSinkhornCache") -> Tensor:
        r"""Decoding: the outputs ``(B, m, embed_dim)`` of ``m`` new tokens ``x (B, m, embed_dim)`` placed after
        the tokens already in ``cache`` — the last ``m`` rows of :meth:`forward` on the whole sequence (causal
        layers in eval mode, no padding), to rounding.

        Per token :math:`O(t\,d)` (:func:`~sinkformer.attention.sparse.sparse_sinkhorn_step`); a token that
        begins a block also pools it and balances the blocks begun (:func:`~sinkformer.attention.sparse.sort_matrix`,
        causal): column :math:`p` of the sorting matrix depends on blocks :math:`0..p` only, so it is computed
        once per block.
        """
        if not self.causal:
            raise ValueError("step decodes causal layers; this SparseSinkhornAttention has causal=False")
        if self.training:
            raise RuntimeError("step runs in eval mode (training draws Gumbel noise for each forward): call .eval()")
        check_tensor(x, "x", ndim=3, floating=True)
        if x.shape[-1] != self.embed_dim or len(cache) + x.shape[1] > self.max_len:
            raise ValueError(f"x must have shape (batch, m, embed_dim={self.embed_dim}) with {len(cache)} + m <= "
                             f"max_len={self.max_len}, got {tuple(x.shape)}")
        q, k = split_heads(self.q_proj(x), self.num_heads), split_heads(self.k_proj(x), self.num_heads)
        v = k if self.v_proj is None else split_heads(self.v_proj(x), self.num_heads)
        outs = []
        for i in range(x.shape[1]):
            p, s = divmod(cache.append(x[:, i], k[:, :, i : i + 1], v[:, :, i : i + 1]), self.block_size)
            if s == 0:  # block p begins: its representative is the sum of every token so far (eq. 5)
                cache.pooled.append(cache.total)
                logits = self.sort_net(torch.stack(cache.pooled, 1), columns=p + 1)
                cache.mix = sort_matrix(logits, sort_iters=self.sort_iters, temperature=self.temperature,
                                        causal=True)[..., :, p]
            outs.append(sparse_sinkhorn_step(q[:, :, i : i + 1], cache.keys, cache.values, cache.mix,
                                             block_size=self.block_size, sort_iters=self.sort_iters,
                                             mixture=self.mixture))
        return self.out_proj(merge_heads(torch.cat(outs, -2)))


class SparseSinkhornCache:
    """The decoding state of one causal :class:`SparseSinkhornAttention` layer (all heads), for
    :meth:`SparseSinkhornAttention.step`: every token's keys and values ``(B, H, t, e)``, the running sum of
    the layer's inputs ``(B, D)`` (the causal pooling), the representatives of the blocks begun and the
    current block's column of the sorting matrix ``(B, H, p + 1)``."""

    def __init__(self) -> None:
        self.keys: Tensor | None = None
        self.values: Tensor | None = None
        self.total: Tensor | None = None
        self.pooled: list[Tensor] = []
        self.mix: Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]

    def append(self, x: Tensor, k: Tensor, v: Tensor) -> int:
        """Add one token (input ``(B, D)``, key and value ``(B, H, 1, e)``); returns its position."""
        position = len(self)
        self.keys = k if self.keys is None else torch.cat([self.keys, k], -2)
        self.values = v if self.values is None else torch.cat([self.values, v], -2)
        self.total = x if self.total is None else self.total + x
        return position


# the options read as attributes of the module (``module.block_size``, ...), from ``module.options``
for _name in SparseOptions.__dataclass_fields__:
    setattr(SparseSinkhornAttention, _name, property(lambda self, _name=_name: getattr(self.options, _name)))


class BaselineSelfAttention(nn.Module):
    """Multi-head self-attention (batch first) with a ``"full"``, ``"local"`` or ``"fixed"`` pattern.

    Same interface as :class:`~sinkformer.attention.SparseSinkhornAttention`:
    ``forward(x (B, n, D), key_padding_mask (B, n) True = padding) -> (B, n, D)``.
    ``block_size`` is the local block (``"local"``) or Child et al.'s :math:`l` (``"fixed"``),
    ``stride`` their :math:`c`.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        pattern: str = "full",
        block_size: int = 32,
        stride: int = 8,
        causal: bool = False,
        dropout: float = 0.0,
        bias: bool = True,
    ) -> None:
        super().__init__()
        check_choice(pattern, "pattern", PATTERNS)
        check_positive_int(embed_dim, "embed_dim")
        check_positive_int(num_heads, "num_heads")
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim must be divisible by num_heads, got {embed_dim} and {num_heads}")
        check_positive_int(block_size, "block_size")
        check_positive_int(stride, "stride")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.embed_dim, self.num_heads, self.pattern = embed_dim, num_heads, pattern
        self.block_size, self.stride, self.causal, self.dropout = block_size, stride, causal, dropout
        self.qkv_proj = nn.Linear(embed_dim, 3 * embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, pattern={self.pattern!r}, "
                f"block_size={self.block_size}, causal={self.causal}")

    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        check_tensor(x, "x", ndim=3, floating=True)
        kw = dict(key_padding_mask=key_padding_mask, dropout_p=self.dropout if self.training else 0.0)

        def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            if self.pattern == "full":
                return attention(q, k, v, normalization="softmax", is_causal=self.causal, **kw)
            if self.pattern == "local":
                return local_attention(q, k, v, block_size=self.block_size, causal=self.causal, **kw)
            return sparse_transformer_attention(q, k, v, block_size=self.block_size, stride=self.stride,
                                                causal=self.causal, **kw)

        return fused_self_attention(x, self.qkv_proj, self.out_proj, self.num_heads, attend)


class DenseSinkhornSelfAttention(BaselineSelfAttention):
    r"""Dense multi-head Sinkhorn self-attention (a Sinkformer layer), causal or not.

    The projections of :class:`~sinkformer.nn.BaselineSelfAttention` (``qkv_proj``, ``out_proj``:
    a ``softmax`` model's weights load as they are) with :math:`P = \mathrm{Sinkhorn}_{n\_iters}(QK^\top/\sqrt e)`;
    ``causal=True`` is causal Sinkhorn (``sinkformer.attention(..., is_causal=True)``: row
    :math:`t` balanced on the prefix :math:`0..t` alone). ``n_iters=1`` is SoftMax attention.

    ``forward(x (B, n, D), key_padding_mask (B, n) True = padding) -> (B, n, D)``; padded tokens
    are removed as keys and as queries (no mass in the column normalisation).
    """

    def __init__(self, embed_dim: int, num_heads: int, *, n_iters: int = 5, causal: bool = False,
                 dropout: float = 0.0, bias: bool = True) -> None:
        super().__init__(embed_dim, num_heads, pattern="full", causal=causal, dropout=dropout, bias=bias)
        self.n_iters = check_positive_int(n_iters, "n_iters")

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, n_iters={self.n_iters}, causal={self.causal}"

    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        check_tensor(x, "x", ndim=3, floating=True)
        def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            return attention(
                q, k, v, n_iters=self.n_iters, is_causal=self.causal, key_padding_mask=key_padding_mask,
                query_padding_mask=key_padding_mask, dropout_p=self.dropout if self.training else 0.0,
            )

        return fused_self_attention(x, self.qkv_proj, self.out_proj, self.num_heads, attend)
