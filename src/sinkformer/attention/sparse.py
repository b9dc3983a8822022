r"""Sparse Sinkhorn Attention (Tay, Bahri, Yang, Metzler, Juan — ICML 2020).

The sequence of :math:`\ell` tokens is cut into :math:`N_B = \lceil \ell / b\rceil` blocks of
``block_size`` :math:`b` tokens (the last one padded and masked). A sorting network learns, per
head, a relaxed permutation of the blocks, and each query attends to its own block and to the
block *sorted* to its position — quasi-global attention at the memory cost of local attention,
:math:`O(\ell b + N_B^2)`.

1. **Pooling** (eq. 2): :math:`X'_i = \sum_{t \in \text{block } i} X_t`; causal (eq. 5): the
   cumulative sum up to and including the first token of block :math:`i`.
2. **SortNet** (eq. 3–4, Table 8): :math:`R_i = P(X'_i) \in \mathbb R^{N_B}`, one network per
   head: row :math:`i` of :math:`R` scores the positions block :math:`i` may be moved to.
3. **Gumbel-Sinkhorn balancing** (§3.1.1, §3.2.1):
   :math:`S = \mathcal S\big((R + \epsilon)/\tau\big)`, :math:`\epsilon` i.i.d. Gumbel noise in
   training only, :math:`\mathcal S` = ``sort_iters`` iterations :math:`F_c \circ F_r` in the log
   domain (``sort_iters=0`` is :math:`S^0 = e^{R}`, the paper's "no Sinkhorn" ablation). The last
   normalisation is over blocks, so every column (position) of :math:`S` sums to exactly 1.
4. **Sorting** (§3.1.2): sorted block :math:`p` is :math:`\sum_i S_{ip}\,K_{\text{block } i}`, a
   convex combination of blocks (the paper's :math:`U(R\,B(K))`, with :math:`R` indexed
   [block, position] as in eq. 3 and eq. 6); the same :math:`S` sorts the values.
5. **Attention** (§3.2): each query of block :math:`p` attends, in one SoftMax, to the :math:`b`
   keys of sorted block :math:`p` and the :math:`b` keys of its own block (the paper's two terms
   :math:`Q_i\psi_S(K)_j^\top` and the local :math:`Q_iK_j^\top`).

Variants: **causal** (§3.3), **SortCut** (§3.4: every query attends only to the first
``sortcut_budget`` sorted blocks — memory :math:`O(\ell\,n\,b + N_B^2)`, linear in :math:`\ell`)
and the **mixture** (§3.2.3: plus vanilla SoftMax attention).

Causal balancing. Block :math:`i` may only be moved to positions :math:`p \ge i` (eq. 6: a block
sorted into an earlier position is masked out), and within the sorted block a query only sees
slots at or before its own (causal local attention). Balancing the whole masked
:math:`N_B\times N_B` matrix at once would still leak the future: from the third normalisation
on, column :math:`p` is rescaled by row sums that include later positions. Here column :math:`p`
of :math:`S` is column :math:`p` of the balanced *prefix* matrix (blocks and positions
:math:`0..p`, the future masked in every row *and* column normalisation), so the output at
position :math:`t` has exactly zero gradient with respect to every input after :math:`t`, for
any ``sort_iters``. All prefixes are balanced at once by :func:`~sinkformer.sinkhorn.prefix.prefix_sinkhorn`:
:math:`O(N_B^2)` memory, the first two normalisations and the last in :math:`O(N_B^2)`, each other
one a matrix product of scalings (:math:`O(N_B^3)` multiply-adds at matmul speed; the brute force,
one Sinkhorn per prefix, took :math:`O(N_B^3)` memory and exponentials).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

from .._validation import broadcast_shapes, broadcastable, check_positive_int, check_qkv, check_tensor, compute_dtype
from ..sinkhorn import sinkhorn
from ..sinkhorn.prefix import prefix_sinkhorn
from .engines import sdpa as _sdpa
from .functional import attention
from .masks import align_to_batch

__all__ = [
    "SORT_NETS",
    "SparseOptions",
    "block_pool",
    "gumbel_noise",
    "n_blocks",
    "sort_matrix",
    "sparse_sinkhorn_attention",
    "sparse_sinkhorn_step",
    "to_blocks",
    "token_validity",
]

#: Sorting networks of Table 8, written outer to inner (σ = ReLU, F = linear layer):
#: ``"linear"`` F1 (4, best, default); ``"relu_linear"`` σ∘F1 (3); ``"linear_relu_linear"``
#: F2∘σ∘F1 (2); ``"relu_linear_relu_linear"`` σ∘F2∘σ∘F1 (1, eq. 4).
SORT_NETS = ("linear", "relu_linear", "linear_relu_linear", "relu_linear_relu_linear")

#: Without balancing (``sort_iters=0``) :math:`e^{R/\tau}` is taken with :math:`R/\tau` clamped at
#: this value, so that it stays finite in float32 (which overflows at 88).
EXP_MAX = 30.0


@dataclass(frozen=True)
class SparseOptions:
    """The options of Sparse Sinkhorn Attention, written and checked once for the function
    (:func:`sparse_sinkhorn_attention`), the module (:class:`sinkformer.nn.SparseSinkhornAttention`)
    and the models (:class:`sinkformer.models.sinkhorn_transformer.AttentionConfig`).

    ``block_size``: :math:`b`, tokens per block; ``sort_iters``: :math:`N_k` Sinkhorn iterations of
    the sorting matrix (0 = none); ``temperature``: Gumbel-Sinkhorn :math:`\\tau > 0` (0.75, best in
    §6.2); ``causal``: the causal variant (§3.3); ``sortcut_budget``: SortCut's sorted blocks (§3.4,
    encoders only); ``mixture``: plus vanilla attention (§3.2.3).
    """

    block_size: int
    sort_iters: int = 5
    temperature: float = 0.75
    causal: bool = False
    sortcut_budget: int | None = None
    mixture: bool = False

    def __post_init__(self) -> None:
        check_positive_int(self.block_size, "block_size")
        _check_sorting(self.sort_iters, self.temperature)
        if self.sortcut_budget is not None:
            check_positive_int(self.sortcut_budget, "sortcut_budget")
            if self.causal:
                raise ValueError("sortcut_budget cannot be used with causal=True: SortCut is an encoder-only scheme (§3.4)")

    def as_kwargs(self) -> dict[str, Any]:
        """The options as keyword arguments of :func:`sparse_sinkhorn_attention`."""
        return asdict(self)


def _check_sorting(sort_iters: int, temperature: float) -> None:
    """The checks of the sorting options, for :class:`SparseOptions` and :func:`sort_matrix`."""
    check_positive_int(sort_iters, "sort_iters", minimum=0)
    if not (isinstance(temperature, (int, float)) and temperature > 0):
        raise ValueError(f"temperature must be a positive float, got {temperature!r}")


def n_blocks(length: int, block_size: int) -> int:
    """Number of blocks :math:`N_B = \\lceil \\ell / b \\rceil` (the last one may be partial)."""
    return -(-length // block_size)


def to_blocks(x: Tensor, block_size: int) -> Tensor:
    """``(..., n, d) -> (..., N_B, b, d)``, zero-padding the sequence to ``N_B * b`` tokens."""
    pad = n_blocks(x.shape[-2], block_size) * block_size - x.shape[-2]
    if pad:
        x = F.pad(x, (0, 0, 0, pad))
    return rearrange(x, "... (n b) d -> ... n b d", b=block_size)


def token_validity(
    key_padding_mask: Tensor | None, batch: tuple[int, ...], length: int, padded_length: int, device
) -> Tensor | None:
    """Valid tokens of the block-padded sequence, ``(*prefix, 1.., padded_length)`` bool.

    ``None`` when every token is valid (no ``key_padding_mask`` and ``length`` a multiple of the
    block size). ``key_padding_mask`` is ``(*batch_prefix, length)`` with True = padding.
    """
    if key_padding_mask is None and padded_length == length:
        return None
    valid = torch.ones(length, dtype=torch.bool, device=device)
    if key_padding_mask is not None:
        check_tensor(key_padding_mask, "key_padding_mask", dtype_bool=True)
        valid = ~align_to_batch(key_padding_mask, "key_padding_mask", batch, length)
    return F.pad(valid, (0, padded_length - length), value=False)


def block_pool(x: Tensor, block_size: int, *, causal: bool = False, padding_mask: Tensor | None = None) -> Tensor:
    """The SortNet's block pooling :math:`\\psi_P`: ``(..., n, d) -> (..., N_B, d)``.

    Non-causal (eq. 2): the sum of the block's tokens. Causal (eq. 5): the sum of every token up
    to and including the block's first token (its representative), so that block :math:`i`'s
    sorting logits never see a later token. ``padding_mask`` ``(..., n)``: True = padding,
    excluded from the sums.
    """
    if padding_mask is not None:
        x = x.masked_fill(padding_mask.unsqueeze(-1), 0.0)
    sums = to_blocks(x, block_size).sum(-2)  # (..., N_B, d)
    if causal:  # the sums of the earlier blocks, and the block's first token: O(N_B d) after the block sums
        earlier = torch.cat([torch.zeros_like(sums[..., :1, :]), sums[..., :-1, :].cumsum(-2)], dim=-2)
        return earlier + x[..., ::block_size, :]
    return sums


def without_subnormals(t: Tensor) -> Tensor:
    """``t`` with its entries below float32's normal range (``finfo(float32).tiny``, or ``t``'s own
    dtype's when wider) set to 0.

    The sorting weights are mixed in the keys' dtype: at long sequences the causal sorting's float64
    weights, cast to float32, leave some below its normal range (5 % of the 16k-token layer's), and
    products with subnormal operands run in microcode on many x86 CPUs (a float32
    ``(4, 256, 256) @ (4, 256, 4096)``: 2.3 s with subnormal entries, 10 ms without, on an Intel Xeon).
    What they add is below every rounding of weights that sum to 1. (Half-precision weights keep
    their subnormals: their products are computed in float32, where those are normal.)"""
    tiny = torch.finfo(torch.promote_types(t.dtype, torch.float32)).tiny
    return t.masked_fill(t.abs() < tiny, 0.0)


def gumbel_noise(shape: torch.Size | tuple[int, ...], *, generator: torch.Generator | None = None,
                 dtype=torch.float32, device=None) -> Tensor:
    """Standard i.i.d. Gumbel samples :math:`-\\log(-\\log U)`, :math:`U \\sim \\mathcal U(0, 1)`."""
    u = torch.rand(shape, generator=generator, dtype=dtype, device=device)
    tiny = torch.finfo(dtype).tiny
    return u.clamp_(tiny, 1.0 - 1e-7).log_().neg_().log_().neg_()  # in place: one buffer, the same values


def sort_matrix(
    logits: Tensor,
    *,
    sort_iters: int = SparseOptions.sort_iters,
    temperature: float = SparseOptions.temperature,
    causal: bool = False,
    gumbel: bool = False,
    generator: torch.Generator | None = None,
    block_mask: Tensor | None = None,
) -> Tensor:
    r"""The relaxed block permutation :math:`S = \mathcal S((R + \epsilon)/\tau)`, ``(..., N_B, N_B)``.

    Indexed [block, position]: column :math:`p` holds the weights of the blocks mixed into
    sorted block :math:`p` (it sums to 1 when ``sort_iters >= 1``).

    Args:
        logits: ``(..., N_B, N_B)`` SortNet output :math:`R` (row :math:`i` from block :math:`i`).
        sort_iters: :math:`N_k`, iterations of :math:`F_c \circ F_r` (a row then a column
            normalisation each); 0 returns :math:`e^{R/\tau}` unnormalised (exponent clamped
            at :data:`EXP_MAX`).
        temperature: :math:`\tau > 0`; low temperatures push :math:`S` towards a permutation.
        causal: block :math:`i` only goes to positions :math:`p \ge i` (eq. 6), balanced prefix
            by prefix (see the module docstring): column :math:`p` depends on rows
            :math:`0..p` only.
        gumbel: add standard Gumbel noise :math:`\epsilon` (training); ``generator`` seeds it.
        block_mask: ``(..., N_B)`` bool, False = a block made only of padding: it is excluded
            from the balancing (zero row and column).
    """
    check_tensor(logits, "logits", min_dim=2, floating=True)
    if logits.shape[-1] != logits.shape[-2]:
        raise ValueError(f"logits must be square (..., N_B, N_B), got shape {tuple(logits.shape)}")
    _check_sorting(sort_iters, temperature)
    n = logits.shape[-1]
    if gumbel:  # (R + ε) / τ, formed in the noise's buffer
        x = gumbel_noise(logits.shape, generator=generator, dtype=logits.dtype, device=logits.device)
        x = x.add_(logits).div_(temperature)
    else:
        x = logits / temperature

    keep = torch.ones(n, n, dtype=torch.bool, device=x.device).triu() if causal else None  # eq. (6)
    if block_mask is not None:
        pair = block_mask.unsqueeze(-1) & block_mask.unsqueeze(-2)
        keep = pair if keep is None else keep & pair
    if sort_iters == 0:  # S^0 = e^R, finite: the (cumulative) sums fed to the SortNet can be large
        s = torch.exp(x.clamp(max=EXP_MAX))
        return s if keep is None else s.masked_fill(~keep, 0.0)
    if not causal:  # many small matrices: the scaling domain (the log domain where it cannot be trusted)
        return sinkhorn(x, 2 * sort_iters, mask=keep, domain="scaling")
    # Column p of the balanced prefix p. Transposed (rows = positions, columns = blocks), that is row p
    # of prefix p with the first normalisation over the rows of each column: the prefix Sinkhorn.
    pair = None if block_mask is None else keep.transpose(-1, -2)
    # in float64: causal SortNet logits grow with the position (cumulative pooling), and float64's range keeps
    # the prefix Sinkhorn in its scaling domain (the quick sort experiment, informal: no row of ~2e6 left it in
    # float64, 11 % in float32, with scores from -200 to 174)
    sorted_t = prefix_sinkhorn(x.transpose(-1, -2).double(), 2 * sort_iters, mask=pair, marginals="uniform",
                               start="columns")
    return sorted_t.transpose(-1, -2).to(x.dtype)


def sparse_sinkhorn_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    sort_logits: Tensor,
    *,
    block_size: int,
    sort_iters: int = SparseOptions.sort_iters,
    temperature: float = SparseOptions.temperature,
    causal: bool = False,
    sortcut_budget: int | None = None,
    mixture: bool = False,
    gumbel: bool = False,
    generator: torch.Generator | None = None,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    return_sort: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Sparse Sinkhorn self-attention of ``(q, k, v)`` given the SortNet's logits.

    Args:
        q, k, v: ``(..., n, d)``, ``(..., n, d)``, ``(..., n, d_v)`` (self-attention: one length).
        sort_logits: ``(..., N_B, N_B)`` with :math:`N_B = \\lceil n / b\\rceil` (see :class:`SortNet`).
        block_size, sort_iters, temperature, causal, sortcut_budget, mixture: the
            :class:`SparseOptions`. ``n`` need not be a multiple of ``block_size`` (the last block
            is padded and masked); with ``sortcut_budget`` every query attends only to the keys of
            the first ``sortcut_budget`` sorted blocks (all blocks if the budget exceeds :math:`N_B`).
        gumbel, generator: as in :func:`sort_matrix`.
        key_padding_mask: ``(*batch_prefix, n)`` bool, True = padding key: it is never attended,
            takes no part in the sorting, and blocks made only of padding leave the balancing.
        scale: score scale, default :math:`1/\\sqrt d`. dropout_p: dropout on attention weights.
        return_sort: also return the sorting matrix :math:`S`.

    Returns:
        ``(..., n, d_v)`` in the dtype of ``q`` (and :math:`S`, ``(..., N_B, N_B)``).
    """
    check_qkv(q, k, v)
    SparseOptions(block_size, sort_iters, temperature, causal, sortcut_budget, mixture)  # checks them
    n = q.shape[-2]
    if k.shape[-2] != n:
        raise ValueError(f"q and k must have the same length (self-attention), got q {tuple(q.shape)} and k {tuple(k.shape)}")
    batch = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    nb = n_blocks(n, block_size)
    check_tensor(sort_logits, "sort_logits", floating=True)
    if sort_logits.shape[-2:] != (nb, nb) or not broadcastable(sort_logits.shape[:-2], batch):
        raise ValueError(
            f"sort_logits must have shape (*batch, N_B, N_B) = (*{tuple(batch)}, {nb}, {nb}) for n={n} and "
            f"block_size={block_size}, got shape {tuple(sort_logits.shape)}"
        )

    valid = token_validity(key_padding_mask, batch, n, nb * block_size, q.device)
    kb, vb = to_blocks(k, block_size), to_blocks(v, block_size)
    valid_blocks = block_mask = None
    if valid is not None:
        valid_blocks = valid.unflatten(-1, (nb, block_size))  # (..., N_B, b)
        kb, vb = kb * valid_blocks.unsqueeze(-1), vb * valid_blocks.unsqueeze(-1)  # padding carries nothing
        block_mask = valid_blocks.any(-1)
    S = sort_matrix(sort_logits, sort_iters=sort_iters, temperature=temperature, causal=causal, gumbel=gumbel,
                    generator=generator, block_mask=block_mask)
    # sorted block p = sum_i S_ip (block i); SortCut needs only the first positions
    mix = (S if sortcut_budget is None else S[..., : min(sortcut_budget, nb)]).transpose(-1, -2).to(kb.dtype)
    # (..., positions, b): a slot of a sorted block is valid where a block it mixes (any weight > 0) has it valid
    sorted_valid = None if valid_blocks is None else ((mix > 0).to(mix.dtype) @ valid_blocks.to(mix.dtype)) > 0
    mix = without_subnormals(mix)

    if sortcut_budget is not None:
        ks = (mix @ kb.flatten(-2)).unflatten(-1, kb.shape[-2:])  # (..., positions, b, d)
        vs = (mix @ vb.flatten(-2)).unflatten(-1, vb.shape[-2:])
        keep = None if sorted_valid is None else sorted_valid.flatten(-2).unsqueeze(-2)
        out = _softmax(q, ks.flatten(-3, -2), vs.flatten(-3, -2), keep, scale=scale, dropout_p=dropout_p,
                       fused=sort_iters > 0)
    else:
        keep = _block_keep(sorted_valid, valid_blocks, block_size, causal, q.device)
        out = _block_attention(q, _SortedAndOwn.apply(mix, kb), _SortedAndOwn.apply(mix, vb), keep,
                               block_size=block_size, batch=tuple(batch), scale=scale, dropout_p=dropout_p,
                               fused=sort_iters > 0)
    if mixture:
        out = out + attention(q, k, v, normalization="softmax", is_causal=causal, key_padding_mask=key_padding_mask,
                              scale=scale, dropout_p=dropout_p)
    return (out, S) if return_sort else out


def sparse_sinkhorn_step(q: Tensor, k: Tensor, v: Tensor, mix: Tensor, *, block_size: int, sort_iters: int,
                         mixture: bool = False, scale: float | None = None) -> Tensor:
    r"""The last token's row of causal :func:`sparse_sinkhorn_attention`, from the tokens so far: decoding.

    Token :math:`t` (block :math:`p`, slot :math:`s`) attends, in one SoftMax, to slots :math:`0..s` of its
    sorted block :math:`\sum_{i \le p} S_{ip} K_i` and of its own block :math:`K_p` (the later slots are its
    future), plus SoftMax attention to every token with ``mixture``: :math:`O(t\,d)` per token.

    Args:
        q: ``(..., 1, d)`` the last token's query; k, v: ``(..., t + 1, d)``, ``(..., t + 1, d_v)`` the keys
            and values of every token so far, the last token's included.
        mix: ``(..., p + 1)`` column :math:`p` of the causal sorting matrix (:func:`sort_matrix` with
            ``causal=True`` on the logits of blocks :math:`0..p`): fixed once block :math:`p` began.
        block_size, sort_iters, mixture, scale: the layer's (:class:`SparseOptions`).

    Returns:
        ``(..., 1, d_v)``: that row of the full forward without padding or dropout, to rounding.
    """
    p, s = divmod(k.shape[-2] - 1, block_size)

    def sorted_and_own(x: Tensor) -> Tensor:  # slots 0..s of [sorted block p, block p]: (..., 2 (s + 1), d)
        blocks = to_blocks(x, block_size)  # (..., p + 1, b, d): block p zero-padded
        weights = without_subnormals(mix.to(blocks.dtype)).unsqueeze(-2)  # (..., 1, p + 1), as the forward
        mixed = (weights @ blocks.flatten(-2)).unflatten(-1, blocks.shape[-2:])[..., 0, : s + 1, :]
        return torch.cat([mixed, blocks[..., p, : s + 1, :]], -2)

    out = _softmax(q, sorted_and_own(k), sorted_and_own(v), None, scale=scale, dropout_p=0.0, fused=sort_iters > 0)
    if mixture:
        out = out + attention(q, k, v, normalization="softmax", scale=scale)
    return out


class _SortedAndOwn(torch.autograd.Function):
    r"""Every position's keys (or values): ``[sorted block p, block p]``, in one buffer.

    ``forward(mix, blocks)``: ``mix`` :math:`= S^\top` ``(..., N_B, N_B)`` (position, block),
    ``blocks`` :math:`X` ``(..., N_B, b, d)`` -> ``(*batch, N_B, 2b, d)`` whose rows
    :math:`0..b-1` at position :math:`p` are :math:`\sum_i S_{ip} X_i` and rows :math:`b..2b-1`
    are :math:`X_p`. The product writes straight into the buffer, and the backward reads the blocks
    back from it: no concatenation, and no copy of the blocks kept besides the buffer (which the
    attention keeps anyway). Backward: :math:`\partial\,\text{mix} = G_s X^\top`,
    :math:`\partial X = \text{mix}^\top G_s + G_o` (:math:`G_s`, :math:`G_o`: the gradient's
    sorted and own halves), summed over broadcast dimensions.
    """

    @staticmethod
    def forward(ctx, mix: Tensor, blocks: Tensor) -> Tensor:
        nb, b, d = blocks.shape[-3:]
        batch = broadcast_shapes(mix.shape[:-2], blocks.shape[:-3])
        out = blocks.new_empty(*batch, nb, 2 * b, d)
        out[..., b:, :] = blocks
        torch.bmm(mix.expand(*batch, nb, nb).reshape(-1, nb, nb), out[..., b:, :].view(-1, nb, b * d),
                  out=out[..., :b, :].view(-1, nb, b * d))
        ctx.save_for_backward(mix, out)
        ctx.shapes = mix.shape, blocks.shape
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        mix, out = ctx.saved_tensors
        mix_shape, blocks_shape = ctx.shapes
        *batch, nb, b2, d = out.shape
        b = b2 // 2
        g_sorted = grad[..., :b, :].reshape(-1, nb, b * d)
        d_mix = d_blocks = None
        if ctx.needs_input_grad[0]:
            own = out[..., b:, :].view(-1, nb, b * d)
            d_mix = torch.bmm(g_sorted, own.transpose(1, 2)).view(*batch, nb, nb).sum_to_size(mix_shape)
        if ctx.needs_input_grad[1]:
            m = mix.expand(*batch, nb, nb).reshape(-1, nb, nb)
            d_blocks = torch.baddbmm(grad[..., b:, :].reshape(-1, nb, b * d), m.transpose(1, 2), g_sorted)
            d_blocks = d_blocks.view(*batch, nb, b, d).sum_to_size(blocks_shape)
        return d_mix, d_blocks


def _block_attention(q: Tensor, keys: Tensor, values: Tensor, keep: Tensor | None, *, block_size: int,
                     batch: tuple[int, ...], scale: float | None, dropout_p: float, fused: bool = True) -> Tensor:
    """Query block :math:`p` attends to its keys ``[sorted block p, block p]`` in one SoftMax.

    ``q`` ``(..., n, d)``, ``keys`` / ``values`` ``(*batch, N_B, 2b, d | d_v)``, ``keep`` as
    :func:`_block_keep` -> ``(*batch, n, d_v)``. The blocks run as one 4-D call
    ``(prod(batch), N_B, b, 2b)``: the layout of PyTorch's fused attention kernels, which keep
    no weights for the backward (a 5-D call falls back to the unfused kernel, which does).
    ``fused=False`` forces the unfused (dense) engine: without balancing (``sort_iters=0``) the
    sorted keys can be :math:`e^{30}` (:data:`EXP_MAX`) times the keys, and the fused CPU kernel's
    backward overflows (NaN) on scores that large.
    """
    n = q.shape[-2]
    flat = lambda t: t.expand(*batch, *t.shape[-3:]).reshape(-1, *t.shape[-3:])  # noqa: E731
    if keep is not None and keep.dim() > 3:
        keep = flat(keep)
    out = _softmax(flat(to_blocks(q, block_size)), flat(keys), flat(values), keep, scale=scale, dropout_p=dropout_p,
                   fused=fused)
    return out.reshape(*batch, -1, out.shape[-1])[..., :n, :]


def _softmax(q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None, *, scale: float | None, dropout_p: float,
             fused: bool) -> Tensor:
    """SoftMax attention of tensors built here from validated inputs (as :func:`attention`, without
    validating them again: that second pass cost a few per cent of a layer at 1k tokens).

    ``fused``: PyTorch's fused kernel (:func:`~sinkformer.attention.engines.sdpa`, in float32 at
    least, autocast off, as :func:`attention` runs it); else the unfused dense engine, for scores too
    large for the fused kernel's backward (no balancing, see :func:`_block_attention`).
    """
    if not fused:
        return attention(q, k, v, normalization="softmax", attn_mask=keep, scale=scale, dropout_p=dropout_p,
                         backend="dense")
    dtype = compute_dtype(q.dtype)
    with torch.autocast(q.device.type, enabled=False):
        out = _sdpa(q.to(dtype), k.to(dtype), v.to(dtype), keep, None, scale, dropout_p)
    return out.to(q.dtype)


def _block_keep(sorted_valid: Tensor | None, valid_blocks: Tensor | None, b: int, causal: bool, device) -> Tensor | None:
    """Keep mask ``(..., N_B, b | 1, 2b)`` over [sorted block keys, own block keys]."""
    if sorted_valid is None and not causal:
        return None
    keep_sorted = None if sorted_valid is None else sorted_valid.unsqueeze(-2)
    keep_local = None if valid_blocks is None else valid_blocks.unsqueeze(-2)
    if causal:  # query slot t sees slots <= t of both blocks
        tri = torch.ones(b, b, dtype=torch.bool, device=device).tril()
        keep_sorted = tri if keep_sorted is None else keep_sorted & tri
        keep_local = tri if keep_local is None else keep_local & tri
    keep_sorted, keep_local = torch.broadcast_tensors(keep_sorted, keep_local)
    return torch.cat([keep_sorted, keep_local], -1)

