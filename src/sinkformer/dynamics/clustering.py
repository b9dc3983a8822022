r"""Clustering diagnostics of token clouds (``docs/theory.md`` §16.4): simulated particles or hidden states.

Every function takes ``x (..., n, d)`` — one cloud, a batch of clouds, or a whole trajectory
``(T, ..., n, d)`` (a :class:`~sinkformer.dynamics.Trajectory`'s ``positions``, or the hidden states of a
model stacked by :func:`hidden_trajectory`) — and an optional ``mask (..., n)`` (True = a real token,
False = padding, which takes no part). Tokens are compared by direction, :math:`\hat x = x/|x|`, as
on the sphere of Geshkovski et al. (a LayerNorm-ed hidden state).

* :func:`cosines` — the Gram matrix :math:`\langle\hat x_i,\hat x_j\rangle`;
* :func:`n_clusters` — connected components of the graph :math:`|\hat x_i-\hat x_j|\le r` (single linkage);
* :func:`single_cluster` — every pair within :math:`r` (diameter :math:`\le r`); its mean over systems is the
  single-cluster probability of a phase diagram;
* :func:`inner_product_histogram` — the distribution of :math:`\langle\hat x_i,\hat x_j\rangle`, :math:`i<j`;
* :func:`span_dimension` — the numerical rank of the tokens;
* :func:`interaction_energy` — :math:`E_\beta=\frac1{2\beta}\sum_{ij}w_iw_je^{\beta\langle A\hat x_i,\hat x_j\rangle}`;
* :func:`diagnostics` — all of them at once (the ``observe`` callable of :func:`~sinkformer.dynamics.simulate`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from .._validation import check_choice, check_tensor
from .energies import _log_w, _scores
from .velocity import on_sphere

__all__ = [
    "cosines",
    "n_clusters",
    "single_cluster",
    "inner_product_histogram",
    "span_dimension",
    "interaction_energy",
    "diagnostics",
    "DIAGNOSTICS",
    "hidden_trajectory",
]

#: Default linkage radius: tokens closer than this (chordal distance on the sphere) are one cluster.
RADIUS = 0.1


def _check(x: Tensor, mask: Tensor | None) -> Tensor | None:
    check_tensor(x, "x", min_dim=2, floating=True)
    if mask is None:
        return None
    check_tensor(mask, "mask", dtype_bool=True)
    if tuple(mask.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"mask must have shape {tuple(x.shape[:-1])} (..., n) like the tokens, got {tuple(mask.shape)}")
    return mask


def _pairs(mask: Tensor | None, x: Tensor) -> Tensor:
    """``(..., n, n)`` bool: pairs of distinct real tokens."""
    n = x.shape[-2]
    off = ~torch.eye(n, dtype=torch.bool, device=x.device)
    if mask is None:
        return off.expand(x.shape[:-2] + (n, n))
    return mask.unsqueeze(-1) & mask.unsqueeze(-2) & off


def cosines(x: Tensor) -> Tensor:
    """:math:`\\langle\\hat x_i,\\hat x_j\\rangle` ``(..., n, n)`` of the directions of ``x (..., n, d)``."""
    check_tensor(x, "x", min_dim=2, floating=True)
    u = on_sphere(x)
    return u @ u.transpose(-1, -2)


def _linked(c: Tensor, radius: float) -> Tensor:
    """:math:`|\\hat x_i-\\hat x_j|\\le r`, i.e. :math:`\\langle\\hat x_i,\\hat x_j\\rangle\\ge1-r^2/2`, from the cosines ``c``."""
    if not radius > 0:
        raise ValueError(f"radius must be > 0, got {radius!r}")
    return c >= 1 - radius**2 / 2


def n_clusters(x: Tensor, radius: float = RADIUS, *, mask: Tensor | None = None) -> Tensor:
    """Number of clusters ``(...)``: connected components of the graph linking tokens within ``radius``.

    The transitive closure of the ``n x n`` graph is computed by at most :math:`\\lceil\\log_2 n\\rceil` boolean
    squarings (batched, any device; stops when a squaring adds no link); the count is :math:`\\sum_i 1/|\\mathrm{component}(i)|`.
    """
    mask = _check(x, mask)
    return _n_clusters(cosines(x), radius, mask)


def _n_clusters(c: Tensor, radius: float, mask: Tensor | None) -> Tensor:
    n = c.shape[-1]
    eye = torch.eye(n, dtype=torch.bool, device=c.device)
    reach = (_linked(c, radius) & _pairs(mask, c)) | eye
    for _ in range(max(1, math.ceil(math.log2(max(n, 2))))):
        longer = (reach.to(c.dtype) @ reach.to(c.dtype)) > 0
        if bool((longer == reach).all()):
            break
        reach = longer
    sizes = reach.sum(-1).to(c.dtype)
    share = 1.0 / sizes if mask is None else torch.where(mask, 1.0 / sizes, 0.0)
    return share.sum(-1).round().long()


def single_cluster(x: Tensor, radius: float = RADIUS, *, mask: Tensor | None = None) -> Tensor:
    """``(...)`` bool: every pair of (real) tokens within ``radius`` of each other (diameter :math:`\\le r`)."""
    mask = _check(x, mask)
    return _single_cluster(cosines(x), radius, mask)


def _single_cluster(c: Tensor, radius: float, mask: Tensor | None) -> Tensor:
    linked = _linked(c, radius)
    return (linked if mask is None else linked | ~_pairs(mask, c)).flatten(-2).all(-1)


def inner_product_histogram(x: Tensor, bins: int | Sequence[float] = 40, *, mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Histogram of :math:`\\langle\\hat x_i,\\hat x_j\\rangle` over the pairs :math:`i<j` of each cloud.

    Args:
        x: ``(..., n, d)`` tokens. bins: a number of equal bins on :math:`[-1, 1]`, or the bin edges.
        mask: ``(..., n)`` real tokens.

    Returns:
        ``(fractions (..., bins), edges (bins + 1,))``: the fraction of pairs in each bin (sums to 1 per cloud).
    """
    mask = _check(x, mask)
    edges = torch.linspace(-1, 1, bins + 1, dtype=x.dtype, device=x.device) if isinstance(bins, int) else \
        torch.as_tensor(bins, dtype=x.dtype, device=x.device)
    return _histogram(cosines(x), edges, mask), edges


def _histogram(c: Tensor, edges: Tensor, mask: Tensor | None) -> Tensor:
    pairs = _pairs(mask, c).triu(1)
    c = c.clamp(float(edges[0]), float(edges[-1]))
    which = (torch.bucketize(c, edges[1:-1], right=True))  # bin index 0 .. bins-1
    onehot = torch.nn.functional.one_hot(which, len(edges) - 1).to(c.dtype) * pairs.unsqueeze(-1).to(c.dtype)
    counts = onehot.sum((-3, -2))
    return counts / counts.sum(-1, keepdim=True).clamp_min(1)


def span_dimension(x: Tensor, rtol: float = 1e-3, *, mask: Tensor | None = None) -> Tensor:
    """Dimension of the span of the tokens ``(...)``: singular values of ``x (n, d)`` above ``rtol`` times the largest."""
    mask = _check(x, mask)
    y = x if mask is None else x * mask.unsqueeze(-1).to(x.dtype)
    return torch.linalg.matrix_rank(y, rtol=rtol)


def interaction_energy(
    x: Tensor, beta: float | Tensor, *, A: Tensor | None = None, weights: Tensor | None = None, normalized: bool = False
) -> Tensor:
    """Interaction energy :math:`E_\\beta=\\frac1{2\\beta}\\sum_{ij}w_iw_je^{\\beta\\langle A\\hat x_i,\\hat x_j\\rangle}` ``(...)``.

    SA and USA on the sphere with :math:`Q=K=V=I` increase it (docs/theory.md §16.5). With
    ``normalized=True`` the value is :math:`2\\beta e^{-\\beta}E_\\beta=\\sum_{ij}w_iw_je^{\\beta(\\langle\\hat x_i,\\hat x_j\\rangle-1)}`
    (:math:`A = I`): 1 for one cluster and close to :math:`\\sum_k m_k^2` for tight clusters of masses
    :math:`m_k` far apart — the staircase of metastable states.

    Args:
        x: ``(..., n, d)`` tokens. beta: inverse temperature, a float or a tensor broadcastable to ``(...)``.
        A: ``(d, d)`` interaction matrix (default identity). weights: ``(..., n)`` token masses (default uniform;
            zero for padding).
    """
    check_tensor(x, "x", min_dim=2, floating=True)
    beta = torch.as_tensor(beta, dtype=x.dtype, device=x.device)
    if not bool((beta > 0).all()):
        raise ValueError(f"beta must be > 0, got {beta}")
    if normalized and A is not None:
        raise ValueError("normalized=True is defined for A = I (the sphere's maximum e^beta); pass A=None")
    u = on_sphere(x)
    scores = u @ u.transpose(-1, -2) if A is None else _scores(u, A)
    return _energy(scores, beta, _log_w(u, weights), normalized)


def _energy(scores: Tensor, beta: Tensor, lw: Tensor, normalized: bool) -> Tensor:
    """From :math:`\\langle A\\hat x_i,\\hat x_j\\rangle` and :math:`\\log w`: :math:`\\log(2\\beta E_\\beta)=\\log\\sum_{ij}w_iw_je^{\\beta\\cdot}`
    (the log of :func:`~sinkformer.dynamics.energies.f0`'s sum at :math:`\\beta A`)."""
    b = beta.reshape(beta.shape + (1, 1))
    log_sum = torch.logsumexp(b * scores + lw.unsqueeze(-1) + lw.unsqueeze(-2), dim=(-1, -2))
    return torch.exp(log_sum - beta) if normalized else torch.exp(log_sum) / (2 * beta)


DIAGNOSTICS = ("n_clusters", "single_cluster", "span_dimension", "energy", "histogram")


def diagnostics(
    x: Tensor,
    *,
    radius: float = RADIUS,
    beta: float | Tensor | None = None,
    bins: int | None = None,
    rtol: float = 1e-3,
    mask: Tensor | None = None,
    which: Sequence[str] | None = None,
) -> dict[str, Tensor]:
    """The diagnostics of ``x (..., n, d)`` from one Gram matrix: ``n_clusters``, ``single_cluster``,
    ``span_dimension``, ``energy`` (normalised :func:`interaction_energy`; needs ``beta``) and ``histogram``
    (fractions of :func:`inner_product_histogram`; needs ``bins``). ``which`` selects some (default: all
    those whose arguments are given). Use as ``simulate(..., observe=lambda x: diagnostics(x, beta=beta))``."""
    mask = _check(x, mask)
    if which is None:
        which = [k for k in DIAGNOSTICS if (k != "energy" or beta is not None) and (k != "histogram" or bins is not None)]
    for name in which:
        check_choice(name, "which", DIAGNOSTICS)
    if "energy" in which and beta is None or "histogram" in which and bins is None:
        raise ValueError("diagnostics: 'energy' needs beta= and 'histogram' needs bins=")
    c = cosines(x)
    out = {}
    if "n_clusters" in which:
        out["n_clusters"] = _n_clusters(c, radius, mask)
    if "single_cluster" in which:
        out["single_cluster"] = _single_cluster(c, radius, mask)
    if "span_dimension" in which:
        out["span_dimension"] = span_dimension(x, rtol, mask=mask)
    if "energy" in which:
        beta = torch.as_tensor(beta, dtype=x.dtype, device=x.device)
        weights = None if mask is None else mask.to(x.dtype)
        out["energy"] = _energy(c, beta, _log_w(x, weights), normalized=True)
    if "histogram" in which:
        out["histogram"] = _histogram(c, torch.linspace(-1, 1, bins + 1, dtype=x.dtype, device=x.device), mask)
    return out


def hidden_trajectory(hidden_states: Sequence[Tensor] | Tensor) -> Tensor:
    """A model's hidden states as a trajectory ``(L + 1, batch, n, d)``: layer :math:`\\ell` is time :math:`\\ell`.

    ``hidden_states`` is the tuple a Hugging Face model returns with ``output_hidden_states=True``
    (embeddings, then the output of every layer), or any list of ``(batch, n, d)`` tensors. Pass the
    tokenizer's ``attention_mask.bool()`` as the diagnostics' ``mask`` to leave padding out.
    """
    if isinstance(hidden_states, Tensor):
        check_tensor(hidden_states, "hidden_states", ndim=4, floating=True)
        return hidden_states
    if not isinstance(hidden_states, (list, tuple)) or not hidden_states:
        raise TypeError("hidden_states must be a non-empty tuple/list of (batch, n, d) tensors "
                        f"(a model's output_hidden_states), got {type(hidden_states).__name__}")
    for i, h in enumerate(hidden_states):
        check_tensor(h, f"hidden_states[{i}]", ndim=3, floating=True)
    return torch.stack([h.detach() for h in hidden_states])
