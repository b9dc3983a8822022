r"""Attention as a function of ``(q, k, v)``, shaped like ``scaled_dot_product_attention``.

.. math::

    \mathrm{out}_i = \sum_j P_{ij} v_j ,\qquad P = \mathcal N(S),\qquad
    S_{ij} = \mathrm{scale}\cdot c(q_i, k_j) + \mathrm{bias}_{ij}

with the cost :math:`c` either ``"dot"`` (:math:`q\cdot k`) or ``"l2"``
(:math:`-|q-k|^2/2`, the L2 attention of Kim et al. 2021), and the normalisation
:math:`\mathcal N` one of

* ``"softmax"``: :math:`P_{ij} = e^{S_{ij}} w_j / \sum_{j'} e^{S_{ij'}} w_{j'}` (row-stochastic);
* ``"sinkhorn"``: ``n_iters`` alternate row/column normalisations (paper eq. (3));
  ``n_iters=1`` is SoftMax, large odd ``n_iters`` doubly stochastic;
* ``"linear"``, ``"sigmoid"``, ``"relu"``: :math:`P_{ij} = \sigma(S_{ij})\,w_j` with
  :math:`\sigma` the identity, the logistic function or :math:`\max(\cdot,0)` — not
  normalised, the integral against the key measure :math:`w` (uniform over non-padding keys
  by default), as in Castin et al. §2 (``docs/theory.md``).

The engine that computes a call is chosen by :mod:`.backends` (``backend="auto"``) or named
(``backend="tiled"``, ...); :func:`explain` says which and why.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .._validation import (
    broadcast_shapes, capturing, check_choice, check_finite, check_positive_int, check_qkv, check_qkv_values,
    check_scores_fit, check_tensor, check_values_and_scores, compute_dtype, data_checks_run, require,
)
from ..sinkhorn.ops import autocast_dtype
from ..sinkhorn.problem import check_iterations, check_scale
from . import backends, engines  # noqa: F401  (engines: the built-in engines register on import)
from .backends import Call, Choice, Prepared, choose
from .masks import MASKING, align_to_batch, combine_masks, excluded

__all__ = ["attention", "explain", "NORMALIZATIONS", "COSTS", "BACKWARDS"]

NORMALIZATIONS = ("softmax", "sinkhorn") + backends.POINTWISE
COSTS = ("dot", "l2")
BACKWARDS = ("unrolled", "implicit")


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    normalization: str = "sinkhorn",
    n_iters: int | None = 5,
    tol: float | None = None,
    max_iters: int = 1000,
    cost: str = "dot",
    scale: float | None = None,
    attn_mask: Tensor | None = None,
    key_padding_mask: Tensor | None = None,
    query_padding_mask: Tensor | None = None,
    is_causal: bool = False,
    key_weights: Tensor | None = None,
    query_weights: Tensor | None = None,
    dropout_p: float = 0.0,
    return_weights: bool = False,
    backward: str = "unrolled",
    backend: str = "auto",
    chunk_size: int | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention with SoftMax, Sinkhorn or unnormalised weights.

    Args:
        q: ``(..., n_q, d)`` queries. k: ``(..., n_k, d)`` keys. v: ``(..., n_k, d_v)`` values.
            Batch dimensions broadcast. Empty shapes are allowed (a query without keys gives 0).
        normalization: ``"sinkhorn"`` (default), ``"softmax"``, ``"linear"``, ``"sigmoid"``
            or ``"relu"``.
        n_iters: Sinkhorn normalisations (1 = SoftMax, odd counts end row-stochastic). Must be
            ``None`` when ``tol`` is given. Ignored by the other normalisations.
        tol: a finite number > 0: each matrix iterates, ending on a row update, until its
            column error :math:`\\max_j|\\sum_i P_{ij} - b_j|` is <= ``tol``; one that does not
            within ``max_iters`` normalisations emits a
            :class:`~sinkformer.SinkhornConvergenceWarning` stating the error reached.
        max_iters: cap on Sinkhorn normalisations with ``tol``.
        cost: ``"dot"`` (:math:`q\\cdot k`) or ``"l2"`` (:math:`-|q-k|^2/2`).
        scale: a finite float multiplying the cost; default :math:`1/\\sqrt d` (1 when ``d = 0``).
            Scores that could exceed ``finfo.max / 4`` of the compute dtype raise ``ValueError``.
        attn_mask: bool (True = take part) or float (added to the scores), broadcastable to
            ``(..., n_q, n_k)`` — as in ``scaled_dot_product_attention``. For Sinkhorn with
            ``n_iters >= 2`` a float entry ``<= -1e4`` (:data:`~.masks.MASKING`) is masking, like
            ``-inf`` (``-1e9``, ``finfo.min``: the column normalisation would undo a finite bias).
        key_padding_mask: ``(*batch_prefix, n_k)`` bool, True = padding key.
        query_padding_mask: ``(*batch_prefix, n_q)`` bool, True = padding query: its row is
            zero and, for Sinkhorn, it takes no part in the column normalisation.
        is_causal: the causal mask ``j <= i`` (top-left aligned, as SDPA). Sinkhorn with
            ``n_iters >= 2`` (or ``tol``) raises under it, and under an ``attn_mask`` that is
            causal in some slice, in any spelling: the column normalisation sums over all
            queries, so past outputs would depend on future tokens.
        key_weights: ``(*batch_prefix, n_k)`` non-negative weights of the key measure
            (normalised here); default uniform. Used by the dynamics toolkit.
        query_weights: ``(*batch_prefix, n_q)`` weights of the query measure (Sinkhorn's row
            marginal); default uniform.
        dropout_p: dropout probability on the attention weights.
        return_weights: also return the ``(..., n_q, n_k)`` weights (before dropout).
        backward: Sinkhorn gradient: ``"unrolled"`` (exact gradient of the ``n_iters`` map) or
            ``"implicit"`` (implicit function theorem at the balanced fixed point; use with
            ``tol=``; warns when the matrix is not balanced).
        backend: the engine: ``"auto"`` (default: the rules of
            :mod:`sinkformer.attention.backends`), ``"sdpa"``, ``"dense"``, ``"tiled"``,
            ``"streamed"`` or ``"flash"`` (Triton kernels, CUDA). A forced engine that cannot serve
            the call raises ``ValueError`` with the reason; :func:`explain` tells which engine a call uses and why.
        chunk_size: query rows per block of the streamed engine (implies it).

    Returns:
        ``(..., n_q, d_v)`` output in the dtype of ``q`` (and the weights if asked).
        Computation runs in float32 (float64 for float64 inputs).

    Example:
        >>> q = k = v = torch.randn(2, 4, 16, 8)
        >>> out, W = attention(q, k, v, n_iters=None, tol=1e-5, return_weights=True)
        >>> bool((W.sum(-2) - 1).abs().max() < 1e-5)
        True
    """
    options = dict(
        normalization=normalization, n_iters=n_iters, tol=tol, max_iters=max_iters, cost=cost, scale=scale,
        attn_mask=attn_mask, key_padding_mask=key_padding_mask, query_padding_mask=query_padding_mask,
        is_causal=is_causal, key_weights=key_weights, query_weights=query_weights, dropout_p=dropout_p,
        return_weights=return_weights, backward=backward, backend=backend, chunk_size=chunk_size,
    )
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(t, name)
    amp = autocast_dtype(q.device.type)
    if amp is None:
        return _run(_prepare(q, k, v, **options))
    # Under autocast, attention behaves like SDPA: q, k, v in the autocast dtype, output in it too. The
    # engines already compute in float32 internally, so autocast is switched off inside (it would turn
    # their float32 products into half-precision ones).
    q, k, v = (t.to(amp) if t.is_floating_point() else t for t in (q, k, v))
    with torch.autocast(q.device.type, enabled=False):
        return _run(_prepare(q, k, v, **options))


def explain(q: Tensor, k: Tensor, v: Tensor, **kwargs) -> Choice:
    """Which engine :func:`attention` would use for these arguments, and why (nothing is computed).

    Takes exactly the arguments of :func:`attention`; returns a
    :class:`~sinkformer.attention.backends.Choice` (``.engine``, ``.reason``, and ``.passed_over``:
    every reason of each engine ``"auto"`` tried first; ``str()`` reads ``"tiled: Sinkhorn on cached
    tiles, O(n) saved per slice"``). Raises as :func:`attention` does.
    """
    return _prepare(q, k, v, **kwargs).choice


def _run(p: Prepared) -> Tensor | tuple[Tensor, Tensor]:
    """Run a prepared call on its engine; empty shapes give zeros on every engine."""
    n_q, n_k, d_v = p.q.shape[-2], p.k.shape[-2], p.v.shape[-1]
    if n_k == 0 or n_q == 0 or d_v == 0 or math.prod(p.batch) == 0:
        return _empty(p)
    return backends.engine(p.choice.engine).run(p)


def _empty(p: Prepared) -> Tensor | tuple[Tensor, Tensor]:
    """No key, no query or no value dimension: zeros (connected to the inputs, zero gradients)."""
    zero = 0.0 * (p.q.sum() + p.k.sum() + p.v.sum())
    out = (p.q.new_zeros(p.batch + (p.q.shape[-2], p.v.shape[-1])) + zero).to(p.out_dtype)
    if not p.call.return_weights:
        return out
    weights = p.q.new_zeros(p.batch + (p.q.shape[-2], p.k.shape[-2])) + zero
    return out, weights.to(p.out_dtype)


def _prepare(
    q: Tensor, k: Tensor, v: Tensor, *, normalization: str = "sinkhorn", n_iters: int | None = 5,
    tol: float | None = None, max_iters: int = 1000, cost: str = "dot", scale: float | None = None,
    attn_mask: Tensor | None = None, key_padding_mask: Tensor | None = None, query_padding_mask: Tensor | None = None,
    is_causal: bool = False, key_weights: Tensor | None = None, query_weights: Tensor | None = None,
    dropout_p: float = 0.0, return_weights: bool = False, backward: str = "unrolled", backend: str = "auto",
    chunk_size: int | None = None,
) -> Prepared:
    """Validate a call of :func:`attention`, combine its masks and choose its engine."""
    check_qkv(q, k, v, values=False)  # the values: with the scores' bound, below
    check_choice(normalization, "normalization", NORMALIZATIONS)
    check_choice(cost, "cost", COSTS)
    check_choice(backward, "backward", BACKWARDS)
    check_choice(backend, "backend", backends.BACKENDS)
    if normalization == "sinkhorn":
        check_iterations(n_iters, tol, max_iters)
    if chunk_size is not None:
        check_positive_int(chunk_size, "chunk_size")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not (0.0 <= dropout_p < 1.0):
        raise ValueError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
    d = q.shape[-1]
    scale = (1.0 / math.sqrt(d) if d > 0 else 1.0) if scale is None else check_scale(scale)
    out_dtype = q.dtype
    dtype = compute_dtype(out_dtype)
    batch = tuple(broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2]))
    n_q, n_k = q.shape[-2], k.shape[-2]
    sinkhorn_iterations = normalization == "sinkhorn" and (tol is not None or n_iters >= 2)
    # Sinkhorn's column normalisation would undo a large finite bias on a whole column: such entries are masking
    masked_from = MASKING if sinkhorn_iterations else float("-inf")
    keep, bias = combine_masks(
        batch + (n_q, n_k), attn_mask=attn_mask, key_padding_mask=key_padding_mask,
        query_padding_mask=query_padding_mask, dtype=dtype, masked_from=masked_from,
    )
    if sinkhorn_iterations:
        _check_causal_sinkhorn(is_causal, attn_mask, n_iters, tol, n_q, n_k)
    # SDPA's own is_causal when the causal mask is the only one (no n_q x n_k mask, no safe-softmax path)
    options_causal = is_causal and not sinkhorn_iterations and keep is None and bias is None
    if is_causal and not sinkhorn_iterations:  # (causal Sinkhorn applies the causal mask itself)
        causal = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril()
        keep = causal if keep is None else keep & causal
    wk = _measure(key_weights, "key_weights", batch, n_k, dtype)
    wq = _measure(query_weights, "query_weights", batch, n_q, dtype)

    l2_as_dot = cost == "l2" and normalization in ("softmax", "sinkhorn")
    call = Call(
        normalization, n_iters, tol, n_q, n_k, return_weights=return_weights,
        measure_weights=wk is not None or wq is not None, bias_requires_grad=bias is not None and bias.requires_grad,
        dropout_p=dropout_p, backward=backward, chunk_size=chunk_size, causal=is_causal, device=q.device.type,
        dtype=out_dtype, head_dim=d + l2_as_dot, value_dim=v.shape[-1], max_iters=max_iters,
        cost="dot" if l2_as_dot else cost,
    )
    # the values before the engine's choice, so that bad inputs are named first (with the dot cost the scores'
    # bound in the same read), in compute precision: a no-op cast for float32 and float64; half-precision CUDA
    # tensors, which these checks do not read (data_checks_run), are not cast before the choice
    half_cuda = q.is_cuda and out_dtype in (torch.float16, torch.bfloat16)
    checked = (q, k, v) if half_cuda or dtype == out_dtype else (q.to(dtype), k.to(dtype), v.to(dtype))
    if cost == "dot":
        check_values_and_scores(*checked, scale, bias)
    else:
        check_qkv_values(*checked)
    choice = choose(call, backend)
    # an engine whose kernels take half-precision operands (float32 accumulation) gets them without copies
    half_operands = half_cuda and backends.engine(choice.engine).half_operands
    q, k, v = (t.to(dtype) for t in checked) if half_cuda and not half_operands else checked
    if l2_as_dot:
        q, k = _l2_as_dot(q, k)
    if cost == "l2":  # the bound of the scores as dot products (q and k extended)
        check_scores_fit(*((q, k) if l2_as_dot else _l2_as_dot(q, k, both=True)), scale, bias)
    return Prepared(q, k, v, batch, keep, bias, wk, wq, scale, call, out_dtype, choice, key_padding_mask,
                    sdpa_is_causal=options_causal)


def _check_causal_sinkhorn(is_causal: bool, attn_mask: Tensor | None, n_iters: int | None, tol: float | None,
                           n_q: int, n_k: int) -> None:
    """Causal Sinkhorn is the prefix definition (:mod:`sinkformer.sinkhorn.prefix`), asked for by
    ``is_causal=True`` on self-attention with a fixed ``n_iters``; every other causal form leaks."""
    if is_causal and tol is not None:
        raise ValueError(
            f"is_causal=True with Sinkhorn attention needs a fixed n_iters (each prefix is balanced with the same "
            f"count), got tol={tol!r}; pass n_iters=... and tol=None"
        )
    if is_causal and n_q != n_k:
        raise ValueError(
            f"is_causal=True with Sinkhorn attention (n_iters={n_iters}) needs self-attention (n_q == n_k), got "
            f"n_q={n_q}, n_k={n_k}: cross-attention from causal queries would let query t's weights depend on the "
            "queries after t. Use normalization='softmax' for causal cross-attention."
        )
    if not is_causal and attn_mask is not None and n_q >= 2 and n_k >= 2 and data_checks_run(attn_mask, on_gpus=True):
        what = f"tol={tol!r}" if tol is not None else f"n_iters={n_iters}"
        require(~_causal_slices(attn_mask, n_q, n_k), (
            f"a causal attn_mask with Sinkhorn attention and {what}: the column normalisation sums over all "
            "queries, so the weights of query t would depend on the queries after t — a leak from the future. "
            "Pass is_causal=True instead (causal Sinkhorn: each prefix balanced on its own), or use n_iters=1 "
            "(exactly causal SoftMax)."
        ))


def _causal_slices(attn_mask: Tensor, n_q: int, n_k: int) -> Tensor:
    """One-element bool: whether some slice of ``attn_mask`` (bool, or additive with entries at or
    below :data:`~.masks.MASKING` excluded) excludes every key after its query (``j > i``) — a causal
    mask, whatever its spelling (``nn.Transformer.generate_square_subsequent_mask``, ``-1e9``,
    ``finfo.min``, a bool ``tril``), its shape or the padding it also excludes."""
    full = attn_mask.expand(attn_mask.shape[:-2] + (n_q, n_k))
    # eagerly an O(n) test first: a causal slice excludes every (i, i + 1)
    if not capturing() and not bool(excluded(full.diagonal(1, -2, -1), MASKING).all(-1).any()):
        return torch.zeros((), dtype=torch.bool, device=attn_mask.device)
    future = torch.ones(n_q, n_k, dtype=torch.bool, device=attn_mask.device).triu(1)
    return (excluded(full, MASKING) | ~future).flatten(-2).all(-1).any()


def _measure(w: Tensor | None, name: str, batch: tuple[int, ...], n: int, dtype: torch.dtype) -> Tensor | None:
    """Normalised measure weights aligned to ``(*batch_prefix, 1.., n)``, or ``None``."""
    if w is None:
        return None
    check_tensor(w, name, floating=True)
    check_finite(w, name)
    if data_checks_run(w):
        message = f"{name} must be non-negative with a positive sum per sequence"
        require(~(w < 0).any() & (w.sum(-1) > 0).all(), message,
                named=lambda: f"{message}, got min {w.min().item():.3g}")
    w = align_to_batch(w.to(dtype), name, batch, n)
    return w / w.sum(-1, keepdim=True)


def _l2_as_dot(q: Tensor, k: Tensor, both: bool = False) -> tuple[Tensor, Tensor]:
    """``[q, 1] . [k, -|k|^2/2] = q.k - |k|^2/2``: the L2 cost :math:`-|q-k|^2/2` up to the query
    term :math:`-|q|^2/2`, which cancels in every row normalisation (SoftMax and each Sinkhorn
    iterate) — so L2 attention runs on the dot-product kernels, gradients included. ``both``: with
    the query term too, ``[q, 1, -|q|^2/2] . [k, -|k|^2/2, 1]``, the cost itself."""
    ones = q.new_ones(q.shape[:-1] + (1,))
    q_aug, k_aug = torch.cat([q, ones], -1), torch.cat([k, -0.5 * k.square().sum(-1, keepdim=True)], -1)
    if not both:
        return q_aug, k_aug
    q_term = -0.5 * q.square().sum(-1, keepdim=True)
    return torch.cat([q_aug, q_term], -1), torch.cat([k_aug, k.new_ones(k.shape[:-1] + (1,))], -1)
