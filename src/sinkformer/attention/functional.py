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
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .._capture import exact_path, patched
from .._validation import (
    capturing, check_choice, check_finite, check_positive_int, check_qkv, check_scores_fit, check_tensor,
    compute_dtype, data_checks_run, require,
)
from ..sinkhorn import sinkhorn
from ..sinkhorn.causal_blocks import causal_block_attention
from ..sinkhorn.prefix import prefix_sinkhorn
from ..sinkhorn.problem import check_iterations, check_scale, flatten
from ..sinkhorn.flash import flash_attention
from ..sinkhorn.streamed import streamed_attention
from ..sinkhorn.tiled import tiled_attention
from .backends import BACKENDS, Call, Choice, choose
from .masks import MASKING, align_to_batch, combine_masks, excluded

__all__ = ["attention", "explain", "NORMALIZATIONS", "COSTS", "BACKWARDS", "BACKENDS"]

NORMALIZATIONS = ("softmax", "sinkhorn", "linear", "sigmoid", "relu")
COSTS = ("dot", "l2")
BACKWARDS = ("unrolled", "implicit")

_POINTWISE = {"linear": lambda s: s, "sigmoid": torch.sigmoid, "relu": torch.relu}


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
        return _prepare(q, k, v, **options).run()
    # Under autocast, attention behaves like SDPA: q, k, v in the autocast dtype, output in it too. The
    # engines already compute in float32 internally, so autocast is switched off inside (it would turn
    # their float32 products into half-precision ones).
    q, k, v = (t.to(amp) if t.is_floating_point() else t for t in (q, k, v))
    with torch.autocast(q.device.type, enabled=False):
        return _prepare(q, k, v, **options).run()


@exact_path
def _prefix_attention(q: Tensor, k: Tensor, v: Tensor, *keep: Tensor, scale: float, n_iters: int) -> Tensor:
    """Causal Sinkhorn attention from :func:`~sinkformer.sinkhorn.prefix.prefix_sinkhorn`'s weights
    (log domain where sums underflow): ``(B, n, d)`` → ``(B, n, d_v)``; ``keep`` ``(B, n)``."""
    return prefix_sinkhorn(scale * (q @ k.transpose(-1, -2)), n_iters, mask=keep[0].unsqueeze(-2) if keep else None) @ v


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast casts matrix products to on ``device_type``, or ``None`` when it is off."""
    try:
        if not torch.is_autocast_enabled(device_type):
            return None
        return torch.get_autocast_dtype(device_type)
    except TypeError:  # torch < 2.4: per-device functions
        if device_type == "cpu":
            return torch.get_autocast_cpu_dtype() if torch.is_autocast_cpu_enabled() else None
        return torch.get_autocast_gpu_dtype() if torch.is_autocast_enabled() else None


def explain(q: Tensor, k: Tensor, v: Tensor, **kwargs) -> Choice:
    """Which engine :func:`attention` would use for these arguments, and why (nothing is computed).

    Takes exactly the arguments of :func:`attention`; returns a
    :class:`~sinkformer.attention.backends.Choice` (``.engine``, ``.reason``; ``str()`` reads
    ``"tiled: Sinkhorn on cached tiles, O(n) saved per slice"``). Raises as :func:`attention` does.
    """
    return _prepare(q, k, v, **kwargs).choice


@dataclass
class _Prepared:
    """A validated call: inputs in compute precision, masks combined, engine chosen."""

    q: Tensor
    k: Tensor
    v: Tensor
    batch: tuple[int, ...]
    keep: Tensor | None
    bias: Tensor | None
    wk: Tensor | None
    wq: Tensor | None
    scale: float
    options: dict
    out_dtype: torch.dtype
    choice: Choice
    key_padding_mask: Tensor | None

    def run(self) -> Tensor | tuple[Tensor, Tensor]:
        n_q, n_k, d_v = self.q.shape[-2], self.k.shape[-2], self.v.shape[-1]
        if n_k == 0 or n_q == 0 or d_v == 0 or math.prod(self.batch) == 0:
            return self._empty()
        engine = self.choice.engine
        if engine == "sdpa":
            if self.options["sdpa_is_causal"]:
                out = F.scaled_dot_product_attention(self.q, self.k, self.v, dropout_p=self.options["dropout_p"],
                                                     is_causal=True, scale=self.scale)
            else:
                out = _sdpa(self.q, self.k, self.v, self.keep, self.bias, self.scale, self.options["dropout_p"])
            return out.to(self.out_dtype)
        if engine == "dense":
            return self._dense()
        if engine == "causal":
            if self._in_causal_blocks():
                return self._causal_blocks()
            _warn_if_cubic(self.options["n_iters"], n_q, math.prod(self.batch))
            return self._dense(causal=True)
        opts = self.options
        qf, kf, vf = flatten(self.q, self.batch, n_q), flatten(self.k, self.batch, n_k), flatten(self.v, self.batch, n_k)
        common = dict(batch=self.batch, scale=self.scale, n_iters=opts["n_iters"], tol=opts["tol"],
                      max_iters=opts["max_iters"], keep=self.keep, bias=self.bias)
        if engine == "tiled":
            out = tiled_attention(qf, kf, vf, backward=opts["backward"], dropout_p=opts["dropout_p"], **common)
        elif engine == "flash":
            out = flash_attention(qf, kf, vf, backward=opts["backward"], **common)
        else:
            out = streamed_attention(qf, kf, vf, chunk_size=opts["chunk_size"], **common)
        return out.reshape(self.batch + (n_q, d_v)).to(self.out_dtype)

    def _empty(self) -> Tensor | tuple[Tensor, Tensor]:
        """No key, no query or no value dimension: zeros (connected to the inputs, zero gradients)."""
        zero = 0.0 * (self.q.sum() + self.k.sum() + self.v.sum())
        out = (self.q.new_zeros(self.batch + (self.q.shape[-2], self.v.shape[-1])) + zero).to(self.out_dtype)
        if not self.options["return_weights"]:
            return out
        weights = self.q.new_zeros(self.batch + (self.q.shape[-2], self.k.shape[-2])) + zero
        return out, weights.to(self.out_dtype)

    def _in_causal_blocks(self) -> bool:
        """Causal Sinkhorn that :func:`~sinkformer.sinkhorn.causal_blocks.causal_block_attention` serves
        without an ``n × n`` matrix: 2 or 3 iterations, dot-product scores, no bias, no weights
        returned, no dropout, at most a key padding mask."""
        opts = self.options
        return (opts["n_iters"] in (2, 3) and opts["cost"] == "dot" and self.bias is None
                and not opts["return_weights"] and not opts["dropout_p"]
                and (self.keep is None or self.keep.shape[-2] == 1))

    def _causal_blocks(self) -> Tensor:
        """Causal Sinkhorn in row blocks; rows whose sums underflow come from the log domain (:meth:`_dense`)."""
        n, batch, B = self.q.shape[-2], self.batch, math.prod(self.batch)
        q, k, v = flatten(self.q, batch, n), flatten(self.k, batch, n), flatten(self.v, batch, n)
        keep = None if self.keep is None else self.keep.expand(batch + (1, n)).reshape(B, n)
        n_iters, scale = self.options["n_iters"], self.scale
        out, inexact = causal_block_attention(q, k, v, keep, scale, n_iters)
        # the rows whose sums underflow, from the log domain: row t of prefix_sinkhorn (read rows <= t only)
        out = patched(out, inexact.unsqueeze(-1), _prefix_attention, q, k, v, *(() if keep is None else (keep,)),
                      scale=scale, n_iters=n_iters)
        return out.reshape(batch + (n, self.v.shape[-1])).to(self.out_dtype)

    def _dense(self, causal: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """The weights materialised: SoftMax, Sinkhorn (the reference), causal Sinkhorn (every prefix
        balanced on its own, :func:`~sinkformer.sinkhorn.prefix.prefix_sinkhorn`) or pointwise."""
        q, k, v, opts = self.q, self.k, self.v, self.options
        scores = self.scale * (q @ k.transpose(-1, -2))
        if opts["cost"] == "l2":
            scores = scores - (self.scale / 2) * (q.square().sum(-1, keepdim=True) + k.square().sum(-1).unsqueeze(-2))
        if self.bias is not None:
            scores = scores + self.bias
        normalization = opts["normalization"]
        if causal:
            weights = prefix_sinkhorn(scores, opts["n_iters"], mask=self.keep, marginals="causal")
        elif normalization == "softmax":
            weights = sinkhorn(_add_log(scores, self.wk), 1, mask=self.keep)
        elif normalization == "sinkhorn":
            weights = _sinkhorn(scores, self.keep, self.wk, self.wq, opts["n_iters"], opts["tol"], opts["max_iters"])
        else:
            wk = self.wk
            if wk is None:
                wk = _uniform_keys(self.key_padding_mask, self.batch, k.shape[-2], q.dtype, q.device)
            weights = _POINTWISE[normalization](scores) * wk.unsqueeze(-2)
            if self.keep is not None:
                weights = weights.masked_fill(~self.keep, 0.0)
        dropped = F.dropout(weights, opts["dropout_p"]) if opts["dropout_p"] > 0 else weights
        out = (dropped @ v).to(self.out_dtype)
        return (out, weights.to(self.out_dtype)) if opts["return_weights"] else out


#: Multiply-adds of causal Sinkhorn's O(n^3) path (``n_iters >= 4``) from which a call warns, once per
#: process: ``slices * n^3 * (n_iters - 3)`` (n = 1024, 8 slices, 5 iterations: 1.7e10, seconds on a CPU).
CUBIC_WARN_FROM = 1 << 33
_cubic_warned = False


def _warn_if_cubic(n_iters: int, n: int, slices: int) -> None:
    """Warn (once per process) that causal Sinkhorn with ``n_iters >= 4`` is about to cost O(n^3)."""
    global _cubic_warned
    work = slices * n**3 * (n_iters - 3)
    if n_iters < 4 or work < CUBIC_WARN_FROM or _cubic_warned or capturing():
        return
    _cubic_warned = True
    warnings.warn(
        f"causal Sinkhorn with n_iters={n_iters} at n={n} ({slices} slice(s)) takes the O(n^3) path: each "
        f"normalisation beyond the third is an n x n x n log-sum-exp matrix product ({work:.2g} multiply-adds here, "
        f"and O(n^2 * n_iters) memory per slice), while n_iters <= 3 costs O(n^2) like SoftMax. Use n_iters=3 for "
        "long sequences. (This warning is shown once per process.)", UserWarning, stacklevel=4)


def _prepare(
    q: Tensor, k: Tensor, v: Tensor, *, normalization: str = "sinkhorn", n_iters: int | None = 5,
    tol: float | None = None, max_iters: int = 1000, cost: str = "dot", scale: float | None = None,
    attn_mask: Tensor | None = None, key_padding_mask: Tensor | None = None, query_padding_mask: Tensor | None = None,
    is_causal: bool = False, key_weights: Tensor | None = None, query_weights: Tensor | None = None,
    dropout_p: float = 0.0, return_weights: bool = False, backward: str = "unrolled", backend: str = "auto",
    chunk_size: int | None = None,
) -> _Prepared:
    """Validate a call of :func:`attention`, combine its masks and choose its engine."""
    check_qkv(q, k, v)
    check_choice(normalization, "normalization", NORMALIZATIONS)
    check_choice(cost, "cost", COSTS)
    check_choice(backward, "backward", BACKWARDS)
    check_choice(backend, "backend", BACKENDS)
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
    batch = tuple(torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2]))
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

    call = Call(
        normalization, n_iters, tol, n_q, n_k, return_weights=return_weights,
        measure_weights=wk is not None or wq is not None, bias_requires_grad=bias is not None and bias.requires_grad,
        dropout_p=dropout_p, backward=backward, chunk_size=chunk_size, causal=is_causal, device=q.device.type,
        dtype=out_dtype, head_dim=d + (cost == "l2" and normalization in ("softmax", "sinkhorn")), value_dim=v.shape[-1],
    )
    choice = choose(call, backend)
    # the flash kernels take half-precision operands on CUDA (tensor cores, float32 accumulation): no copies
    if not (choice.engine == "flash" and q.is_cuda and out_dtype in (torch.float16, torch.bfloat16)):
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if cost == "l2" and normalization in ("softmax", "sinkhorn"):
        q, k, cost = *_l2_as_dot(q, k), "dot"
    check_scores_fit(*((q, k) if cost == "dot" else _l2_as_dot(q, k, both=True)), scale, bias)
    options = dict(normalization=normalization, n_iters=n_iters, tol=tol, max_iters=max_iters, cost=cost,
                   dropout_p=dropout_p, return_weights=return_weights, backward=backward, chunk_size=chunk_size,
                   sdpa_is_causal=options_causal)
    return _Prepared(q, k, v, batch, keep, bias, wk, wq, scale, options, out_dtype, choice, key_padding_mask)


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


def _add_log(scores: Tensor, wk: Tensor | None) -> Tensor:
    """``S_ij + log w_j`` (zero weights become -inf, i.e. masked)."""
    return scores if wk is None else scores + wk.log().unsqueeze(-2)


def _uniform_keys(key_padding_mask: Tensor | None, batch: tuple[int, ...], n_k: int, dtype, device) -> Tensor:
    """The empirical key measure: ``1/n`` on each non-padding key."""
    if key_padding_mask is None:
        return torch.full((n_k,), 1.0 / n_k, dtype=dtype, device=device)
    valid = (~align_to_batch(key_padding_mask, "key_padding_mask", batch, n_k)).to(dtype)
    return valid / valid.sum(-1, keepdim=True).clamp_min(1)


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


def _sdpa(q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None, bias: Tensor | None, scale: float,
          dropout_p: float) -> Tensor:
    """SoftMax attention through PyTorch's fused kernel; rows with no valid key give zeros."""
    mask = bias
    if keep is not None:
        mask = keep if bias is None else bias.masked_fill(~keep, float("-inf"))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale)
    if keep is not None:
        out = out * keep.any(-1, keepdim=True)
    return out


def _sinkhorn(
    scores: Tensor, keep: Tensor | None, wk: Tensor | None, wq: Tensor | None, n_iters: int | None,
    tol: float | None, max_iters: int,
) -> Tensor:
    """Sinkhorn weights; with measure weights the coupling is taken w.r.t. ``mu_q x mu_k``.

    The coupling :math:`\\pi = e^{S + \\log w_k + f \\oplus g}` has marginals ``(w_q, w_k)`` and
    the attention is :math:`\\pi_{ij}/w_{q,i}`, so that one iteration is the weighted SoftMax.
    """
    if wk is None and wq is None:
        return sinkhorn(scores, n_iters, tol=tol, max_iters=max_iters, mask=keep)
    n_q, n_k = scores.shape[-2:]
    wk = wk if wk is not None else scores.new_full((n_k,), 1.0 / n_k)
    wq = wq if wq is not None else scores.new_full((n_q,), 1.0 / n_q)
    if keep is not None:  # no mass on rows/columns that are entirely masked
        full = keep.expand(scores.shape)
        wq, wk = wq * full.any(-1), wk * full.any(-2)
        tiny = torch.finfo(scores.dtype).tiny
        wq = wq / wq.sum(-1, keepdim=True).clamp_min(tiny)
        wk = wk / wk.sum(-1, keepdim=True).clamp_min(tiny)
    plan = sinkhorn(_add_log(scores, wk), n_iters, tol=tol, max_iters=max_iters, mask=keep, row_marginals=wq,
                    col_marginals=wk)
    return plan / wq.unsqueeze(-1).clamp_min(torch.finfo(plan.dtype).tiny)
