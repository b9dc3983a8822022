r"""Velocity fields of attention on weighted point clouds (``docs/theory.md`` §6, §16).

A cloud :math:`\mu = \sum_i w_i\delta_{x_i}` and parameters ``(Q, K, V)`` (or a list of head
triples) define the field :math:`\Gamma_\mu(x)`, the output of an attention layer whose keys and
values are the particles. With :math:`q = xQ^\top`, :math:`k = xK^\top`, :math:`v = xV^\top` and
temperature :math:`\varepsilon` (scores :math:`\langle Qx, Ky\rangle/\varepsilon`; an inverse temperature
:math:`\beta` is ``eps = 1/beta``):

=============  ======================================================================================
``kind``       :math:`\Gamma_\mu(x)`
=============  ======================================================================================
``softmax``    :math:`\sum_j \mathrm{softmax}_j(\langle Qx,Kx_j\rangle/\varepsilon + \log w_j)\,Vx_j` (SA)
``exp``        :math:`\sum_j w_j\,e^{\langle Qx,Kx_j\rangle/\varepsilon}\,Vx_j` (unnormalised, USA of Geshkovski et al.)
``l2``         the same as ``softmax`` with :math:`-|Qx-Kx_j|^2/(2\varepsilon)` (Kim et al.)
``linear``     :math:`\sum_j w_j\,\langle Qx,Kx_j\rangle/\varepsilon\;Vx_j`
``sigmoid``    :math:`\sum_j w_j\,\sigma(\langle Qx,Kx_j\rangle/\varepsilon)\,Vx_j` (``relu``: :math:`\max(\cdot,0)`)
``sinkhorn``   :math:`\sum_j k^\infty(x,x_j)\,w_j\,Vx_j`, :math:`k^\infty` bistochastic w.r.t. :math:`\mu\otimes\mu`;
               off the cloud :math:`\sum_j\mathrm{softmax}_j(\langle Qx,Kx_j\rangle/\varepsilon+g_j+\log w_j)Vx_j`
``masked``     Softmax restricted to the particles with token position :math:`s_j \le s` (causal attention)
``causal``     token :math:`i` sees the tokens :math:`j \le i` (storage order): ``n_iters=1`` causal SoftMax
               (Karagodin et al.), ``n_iters >= 2`` causal Sinkhorn, every prefix balanced on its own
=============  ======================================================================================

``geometry="sphere"`` puts the tokens on the unit sphere as LayerNorm does (:math:`x \mapsto x/|x|`)
and returns the tangent field :math:`P^\perp_x\Gamma_\mu(x) = \Gamma_\mu(x) - \langle x,\Gamma_\mu(x)\rangle x`
(Geshkovski et al., *A mathematical perspective on Transformers*).

A list of head triples sums the head fields (multi-head, ``docs/theory.md`` §6.7); matrices with leading
dimensions give every cloud of a batch its own parameters. Every field but ``exp`` is computed by
:func:`sinkformer.attention` (the Sinkhorn potentials by the streamed sweeps of
:mod:`sinkformer.sinkhorn.streamed`, causal Sinkhorn by its prefix-balanced engine); queries are
processed in chunks, so that memory stays ``O(N * chunk)`` and ``N = 50,000`` particles never build an
``N x N`` matrix.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .._validation import broadcastable, check_choice, check_finite, check_positive_int, check_tensor, compute_dtype
from ..attention.functional import attention
from ._linalg import single_threaded
from ._streaming import log_weights, sinkhorn_potentials
from .params import Params, as_heads, interaction, stack_heads

__all__ = ["velocity", "FieldResult", "KINDS", "GEOMETRIES", "DEFAULT_BLOCK_ENTRIES", "on_sphere", "tangent"]

KINDS = ("softmax", "exp", "l2", "linear", "sigmoid", "relu", "sinkhorn", "masked", "causal")
GEOMETRIES = ("euclidean", "sphere")

#: Score entries (batch x heads x queries x keys) computed at once; above this, queries are chunked.
DEFAULT_BLOCK_ENTRIES = 2**24
#: Up to this many (batch x queries x keys) entries a field is computed in one thread.
SMALL_ENTRIES = 2**18

_NORMALIZATION = {"softmax": ("softmax", "dot"), "l2": ("softmax", "l2"), "masked": ("softmax", "dot"),
                  "sinkhorn": ("softmax", "dot"), "linear": ("linear", "dot"), "sigmoid": ("sigmoid", "dot"),
                  "relu": ("relu", "dot"), "exp": ("exp", "dot"), "causal": ("sinkhorn", "dot")}


@dataclass
class FieldResult:
    """What :func:`velocity` returns with ``return_result=True``.

    Attributes:
        field: ``(..., M, d)`` the velocity at the query points.
        potential: Sinkhorn column potential ``g`` ``(..., H, N)`` (``None`` for other kinds); pass it
            back as ``warm_start`` at the next time step.
        sinkhorn_iters: normalisations run (0 for other kinds).
        converged: whether Sinkhorn reached ``tol``.
    """

    field: Tensor
    potential: Tensor | None = None
    sinkhorn_iters: int = 0
    converged: bool = True


def _single_threaded_when_small(fn):
    """Run ``fn`` in one torch thread for small clouds, where waking the thread pool costs more than the work."""

    @functools.wraps(fn)
    def wrapper(x, *args, at=None, **kwargs):
        small = isinstance(x, Tensor) and x.dim() >= 2 and (
            x[..., 0, 0].numel() * x.shape[-2] * (x.shape[-2] if at is None else at.shape[-2]) <= SMALL_ENTRIES
        )
        with single_threaded() if small else contextlib.nullcontext():
            return fn(x, *args, at=at, **kwargs)

    return wrapper


def _dot(x: Tensor, v: Tensor) -> Tensor:
    """:math:`\\langle x, v\\rangle` over the last dimension, kept. For a few coordinates, a sum of slices: PyTorch's
    reduction over a last dimension of 3 took 10-100x the time of the product (2 threads, loaded CPU)."""
    if x.shape[-1] > 8:
        return (x * v).sum(-1, keepdim=True)
    xv = x * v
    return sum(xv[..., i : i + 1] for i in range(1, x.shape[-1])) + xv[..., :1]


def on_sphere(x: Tensor) -> Tensor:
    """:math:`x/|x|` along the last dimension: tokens projected on the unit sphere as LayerNorm does."""
    return x * torch.rsqrt(_dot(x, x))


def tangent(x: Tensor, v: Tensor) -> Tensor:
    """:math:`P^\\perp_x v = v - \\langle x, v\\rangle x` for unit ``x`` (``(..., d)`` both)."""
    return v - _dot(x, v) * x


@_single_threaded_when_small
def velocity(
    x: Tensor,
    params: Params,
    kind: str = "softmax",
    *,
    weights: Tensor | None = None,
    at: Tensor | None = None,
    eps: float = 1.0,
    geometry: str = "euclidean",
    token_positions: Tensor | None = None,
    at_positions: Tensor | None = None,
    n_iters: int | None = None,
    tol: float | None = None,
    max_iters: int = 10_000,
    warm_start: Tensor | None = None,
    chunk_size: int | None = None,
    return_result: bool = False,
) -> Tensor | FieldResult:
    """The attention velocity field :math:`\\Gamma_\\mu` of the cloud ``x``, at the particles or at ``at``.

    Args:
        x: ``(..., N, d)`` particles (leading dimensions: independent clouds).
        params: ``(Q, K, V)`` with ``Q, K (k, d)``, ``V (d, d)``, or a list of such triples (heads);
            the matrices may carry leading dimensions broadcastable to those of ``x`` (one parameter
            set per cloud, e.g. an inverse temperature folded into ``Q``).
        kind: one of :data:`KINDS`.
        weights: ``(..., N)`` non-negative masses of the particles (normalised here); default uniform.
        at: ``(..., M, d)`` evaluation points; default the particles themselves.
        eps: temperature; the scores are :math:`\\langle Qx, Ky\\rangle/\\varepsilon` (``eps = 1/beta``).
        geometry: ``"euclidean"`` or ``"sphere"`` (particles and ``at`` normalised, field projected on the
            tangent space :math:`P^\\perp_x`).
        token_positions: ``(..., N)`` positions :math:`s_j` for ``kind="masked"``.
        at_positions: ``(..., M)`` positions of ``at`` (masked kind only).
        n_iters: normalisations of ``kind="causal"`` (default 1: causal SoftMax; 2 or more: causal Sinkhorn).
        tol: Sinkhorn stopping rule, relative marginal error :math:`\\max_j|\\sum_i\\pi_{ij}/w_j-1|`;
            default 1e-9 in float64, 1e-5 in float32.
        max_iters: cap on Sinkhorn normalisations (a warning is raised if reached).
        warm_start: ``(..., H, N)`` Sinkhorn potential ``g`` of a previous call.
        chunk_size: queries (and Sinkhorn rows/columns) per block; default from a budget of
            :data:`DEFAULT_BLOCK_ENTRIES` score entries.
        return_result: return a :class:`FieldResult` (with the Sinkhorn potential) instead of the field.

    Returns:
        ``(..., M, d)`` field (or a :class:`FieldResult`), in the dtype of ``x``.
    """
    check_tensor(x, "x", min_dim=2, floating=True)
    check_finite(x, "x")
    check_choice(kind, "kind", KINDS)
    check_choice(geometry, "geometry", GEOMETRIES)
    if not (isinstance(eps, (int, float)) and eps > 0):
        raise ValueError(f"eps must be a positive float, got {eps!r}")
    batch, n, d = tuple(x.shape[:-2]), x.shape[-2], x.shape[-1]
    Q, K, V = _stacked_params(params, batch, d, compute_dtype(x.dtype))
    dtype = Q.dtype
    sphere = geometry == "sphere"
    xs = on_sphere(x.to(dtype)) if sphere else x.to(dtype)
    if sphere and not bool(torch.isfinite(xs.sum())):
        raise ValueError("geometry='sphere' projects every token on the unit sphere, x / |x|: x has a token of norm 0")
    xq = xs
    if at is not None:
        check_tensor(at, "at", min_dim=2, floating=True)
        check_finite(at, "at")
        if at.shape[-1] != d or tuple(at.shape[:-2]) != batch:
            raise ValueError(f"at must have shape {batch + ('M', d)} to match x {tuple(x.shape)}, got {tuple(at.shape)}")
        xq = on_sphere(at.to(dtype)) if sphere else at.to(dtype)
    w = _weights(weights, batch, n, dtype)
    pos_q, pos_k = _positions(kind, token_positions, at_positions, at, batch, n, xq.shape[-2], dtype)
    n_iters = _causal_iters(kind, n_iters, at, weights)

    # (..., H, points, k) queries/keys and (..., H, N, d) values of every head.
    if at is None:  # one product for the three projections (many tiny clouds: one batched matmul, not three)
        q, k, v = (xs.unsqueeze(-3) @ torch.cat([Q, K, V], -2).transpose(-1, -2)).split(
            [Q.shape[-2], K.shape[-2], V.shape[-2]], -1)
    else:
        q = xq.unsqueeze(-3) @ Q.transpose(-1, -2)
        k = xs.unsqueeze(-3) @ K.transpose(-1, -2)
        v = xs.unsqueeze(-3) @ V.transpose(-1, -2)
    H = Q.shape[-3]
    rows_per_block = max(1, DEFAULT_BLOCK_ENTRIES // max(1, math.prod(batch) * H * n))
    chunk = chunk_size if chunk_size is not None else rows_per_block
    check_positive_int(chunk, "chunk_size")

    normalization, cost = _NORMALIZATION[kind]
    # SoftMax-normalised kinds take the key measure as a bias log w_j; the others as key_weights.
    key_bias = None if w is None or normalization not in ("softmax", "exp") else log_weights(w).unsqueeze(-2)
    key_weights = None if normalization in ("softmax", "exp") else w
    if normalization == "exp" and key_bias is None:  # uniform measure: the unnormalised kernel needs its 1/N
        key_bias = xs.new_full((1, 1), -math.log(n))
    g, iters, converged = None, 0, True
    if kind == "sinkhorn":
        tol = tol if tol is not None else (1e-9 if dtype == torch.float64 else 1e-5)
        k_queries = q if at is None else xs.unsqueeze(-3) @ Q.transpose(-1, -2)  # queries of the particles
        w_heads = (xs.new_full(batch + (1, n), 1.0 / n) if w is None else w.unsqueeze(-2)).expand(batch + (H, n))
        if warm_start is not None:
            check_tensor(warm_start, "warm_start", floating=True)
            if tuple(warm_start.shape) != batch + (H, n):
                raise ValueError(f"warm_start must have shape {batch + (H, n)} (..., heads, N), got {tuple(warm_start.shape)}")
        g, iters, converged = sinkhorn_potentials(
            k_queries, k, w_heads, scale=1.0 / eps, tol=tol, max_iters=max_iters, chunk=chunk, warm_start=warm_start,
            symmetric=_symmetric_psd(interaction(Q, K)),
        )
        key_bias = g if key_bias is None else g + key_bias

    if kind == "causal":  # every prefix balanced on its own: all queries at once (no chunks)
        out = _attention_4d(q, k, v, normalization="sinkhorn", n_iters=n_iters, is_causal=True, scale=1.0 / eps)
    else:
        outs = []
        for s in range(0, q.shape[-2], chunk):
            rows = slice(s, s + chunk)
            attn_mask = None if key_bias is None else key_bias.unsqueeze(-2)  # (..., H|1, 1, N)
            if pos_q is not None:  # (..., 1, rows, N): key position <= query position
                keep = pos_k.unsqueeze(-2) <= pos_q[..., rows].unsqueeze(-1)
                attn_mask = keep if attn_mask is None else attn_mask.masked_fill(~keep, float("-inf"))
            if normalization == "exp":
                outs.append(_exp_kernel(q[..., rows, :], k, v, 1.0 / eps, attn_mask))
            else:
                outs.append(_attention_4d(q[..., rows, :], k, v, normalization=normalization, cost=cost, scale=1.0 / eps,
                                          attn_mask=attn_mask, key_weights=key_weights))
        out = torch.cat(outs, dim=-2)
    field = out.sum(-3)
    if sphere:
        field = tangent(xq, field)
    field = field.to(x.dtype)
    return FieldResult(field, g, iters, converged) if return_result else field


def _attention_4d(q: Tensor, k: Tensor, v: Tensor, *, attn_mask: Tensor | None = None,
                  key_weights: Tensor | None = None, **kwargs) -> Tensor:
    """:func:`sinkformer.attention` on ``(B, H, n, k)`` tensors: several leading dimensions are flattened into one
    (PyTorch's fused SDPA kernels take 4-D inputs; with 5-D ones it fell back to a path 3.6x slower)."""
    lead = tuple(q.shape[:-3])
    if len(lead) <= 1:
        return attention(q, k, v, attn_mask=attn_mask, key_weights=key_weights, **kwargs)

    def flat(t: Tensor | None, tail: int) -> Tensor | None:
        return None if t is None else t.expand(lead + tuple(t.shape[-tail:])).reshape((-1,) + tuple(t.shape[-tail:]))

    out = attention(flat(q, 3), flat(k, 3), flat(v, 3), attn_mask=flat(attn_mask, 3),
                    key_weights=flat(key_weights, 1), **kwargs)
    return out.reshape(lead + tuple(out.shape[-3:]))


def _exp_kernel(q: Tensor, k: Tensor, v: Tensor, scale: float, bias: Tensor | None) -> Tensor:
    """:math:`\\sum_j e^{\\mathrm{scale}\\,q\\cdot k_j + b_j} v_j` (``bias`` :math:`b = \\log w`), the unnormalised kernel."""
    scores = scale * (q @ k.transpose(-1, -2))
    return (scores if bias is None else scores + bias).exp() @ v


def _stacked_params(params: Params, batch: tuple[int, ...], d: int, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """``Q, K (..., H, k, d)``, ``V (..., H, d, d)``; leading dimensions must broadcast to the clouds' ``batch``."""
    Q, K, V = stack_heads(as_heads(params, d, batched=True), dtype)
    lead = tuple(Q.shape[:-3])
    if lead and (len(lead) > len(batch) or not broadcastable(lead, batch)):
        raise ValueError(f"params with leading dimensions {lead} must broadcast to the clouds' leading dimensions "
                         f"{batch} (one parameter set per cloud)")
    return Q, K, V


def _causal_iters(kind: str, n_iters: int | None, at: Tensor | None, weights: Tensor | None) -> int | None:
    """The normalisations of ``kind="causal"`` (default 1); ``n_iters`` belongs to that kind only."""
    if kind != "causal":
        if n_iters is not None:
            raise ValueError(f"n_iters is only used by kind='causal' (kind='sinkhorn' iterates to tol), got kind={kind!r}")
        return None
    if at is not None or weights is not None:
        raise ValueError("kind='causal' is the field at the tokens themselves with uniform weights: at= and weights= "
                         "are not supported (use kind='masked' with token_positions for a weighted causal measure)")
    return check_positive_int(1 if n_iters is None else n_iters, "n_iters")


def _weights(weights: Tensor | None, batch: tuple[int, ...], n: int, dtype: torch.dtype) -> Tensor | None:
    """Normalised ``(..., N)`` masses, or ``None`` for the uniform measure."""
    if weights is None:
        return None
    check_tensor(weights, "weights", floating=True)
    check_finite(weights, "weights")
    if weights.shape[-1] != n:
        raise ValueError(f"weights must have shape (..., {n}) like the particles, got {tuple(weights.shape)}")
    w = weights.to(dtype).expand(batch + (n,))
    if bool((w < 0).any()) or not bool((w.sum(-1) > 0).all()):
        raise ValueError("weights must be non-negative with a positive sum per cloud")
    return w / w.sum(-1, keepdim=True)


def _positions(kind, token_positions, at_positions, at, batch, n, m, dtype):
    """``(query positions, key positions)`` for the masked kind, else ``(None, None)``."""
    if kind != "masked":
        if token_positions is not None or at_positions is not None:
            raise ValueError(f"token_positions/at_positions are only used by kind='masked', got kind={kind!r}")
        return None, None
    if token_positions is None:
        raise ValueError("kind='masked' needs token_positions (..., N): the position s in [0, 1] of each particle")
    check_tensor(token_positions, "token_positions")
    if token_positions.shape[-1] != n:
        raise ValueError(f"token_positions must have shape (..., {n}), got {tuple(token_positions.shape)}")
    pos_k = token_positions.to(dtype).expand(batch + (n,))
    if at is None:
        if at_positions is not None:
            raise ValueError("at_positions is only meaningful together with at")
        return pos_k.unsqueeze(-2), pos_k.unsqueeze(-2)
    if at_positions is None or at_positions.shape[-1] != m:
        raise ValueError(f"kind='masked' with at needs at_positions of shape (..., {m})")
    return at_positions.to(dtype).expand(batch + (m,)).unsqueeze(-2), pos_k.unsqueeze(-2)


def _symmetric_psd(A: Tensor) -> bool:
    """Whether every head's :math:`A` is symmetric PSD (diffusive Sinkhorn: averaged updates converge fastest)."""
    scale = float(A.abs().max()) or 1.0
    if float((A - A.transpose(-1, -2)).abs().max()) > 1e-12 * scale:
        return False
    return bool((torch.linalg.eigvalsh(A) >= -1e-12 * scale).all())
