r"""Wasserstein distances used to compare flows: Gaussians (closed form), point clouds (POT), and
the conditional distance of masked measures (Castin et al., Def. 3.2).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from .._optional import require
from .._validation import check_tensor
from ._linalg import f64, sym_inv_sqrt, sym_sqrt

__all__ = ["gaussian_ot_map", "w2_gaussian", "w2_particles", "conditional_w2"]


def gaussian_ot_map(cov1: Tensor, cov2: Tensor) -> Tensor:
    """The optimal linear map :math:`T = \\Sigma_1^{-1/2}(\\Sigma_1^{1/2}\\Sigma_2\\Sigma_1^{1/2})^{1/2}\\Sigma_1^{-1/2}`
    sending :math:`\\mathcal N(0, \\Sigma_1)` to :math:`\\mathcal N(0, \\Sigma_2)` (``Sigma_1`` invertible)."""
    cov1, cov2 = f64(cov1), f64(cov2)
    root, inv_root = sym_sqrt(cov1), sym_inv_sqrt(cov1)
    return inv_root @ sym_sqrt(root @ cov2 @ root) @ inv_root


def w2_gaussian(mean1: Tensor, cov1: Tensor, mean2: Tensor, cov2: Tensor) -> Tensor:
    """:math:`W_2(\\mathcal N(m_1,\\Sigma_1), \\mathcal N(m_2,\\Sigma_2))`, batched over leading dimensions.

    Computed as :math:`\\big(|m_1-m_2|^2 + \\|(I-T)\\Sigma_1^{1/2}\\|_F^2\\big)^{1/2}` with :math:`T` the optimal
    map (:func:`gaussian_ot_map`), which resolves distances down to ~1e-16 of the scale where the
    textbook Bures formula :math:`\\mathrm{tr}\\Sigma_1+\\mathrm{tr}\\Sigma_2-2\\mathrm{tr}(\\cdot)^{1/2}` loses
    everything below ~1e-8 to cancellation. ``cov1`` must be invertible.
    """
    mean1, cov1, mean2, cov2 = (f64(t) for t in (mean1, cov1, mean2, cov2))
    T = gaussian_ot_map(cov1, cov2)
    eye = torch.eye(cov1.shape[-1], dtype=torch.float64)
    spread = ((eye - T) @ sym_sqrt(cov1)).square().sum((-1, -2))
    return ((mean1 - mean2).square().sum(-1) + spread).sqrt()


def _uniform(n: int) -> np.ndarray:
    return np.full(n, 1.0 / n)


def w2_particles(x: Tensor, y: Tensor, wx: Tensor | None = None, wy: Tensor | None = None) -> float:
    """Exact :math:`W_2` between :math:`\\sum_i w^x_i\\delta_{x_i}` and :math:`\\sum_j w^y_j\\delta_{y_j}` (POT's network simplex).

    ``x (n, d)``, ``y (m, d)``; weights default to uniform and are normalised.
    """
    ot = require("ot", "exact Wasserstein distances (POT)")

    check_tensor(x, "x", ndim=2, floating=True)
    check_tensor(y, "y", ndim=2, floating=True)
    if x.shape[1] != y.shape[1]:
        raise ValueError(f"x and y must have the same dimension, got {tuple(x.shape)} and {tuple(y.shape)}")
    xn, yn = x.detach().double().cpu().numpy(), y.detach().double().cpu().numpy()
    a = _uniform(len(xn)) if wx is None else (wx.detach().double().cpu().numpy() / float(wx.sum()))
    b = _uniform(len(yn)) if wy is None else (wy.detach().double().cpu().numpy() / float(wy.sum()))
    cost = ot.emd2(a, b, ot.dist(xn, yn), numItermax=10_000_000)
    return math.sqrt(max(float(cost), 0.0))


def conditional_w2(x: Tensor, sx: Tensor, y: Tensor, sy: Tensor) -> float:
    r"""Conditional Wasserstein distance between clouds with token positions (Castin et al., Def. 3.2).

    Transport plans must preserve the position: with :math:`m` the common position marginal,
    :math:`W_c(\mu,\nu)^2 = \sum_s m(s)\,W_2^2(\mu_s, \nu_s)`, :math:`\mu_s` the conditional law of the
    tokens at position :math:`s`. Both clouds (uniform weights) must put the same mass on each
    position value.

    Args:
        x: ``(n, d)`` tokens, sx: ``(n,)`` their positions; y, sy likewise.
    """
    values = torch.unique(sx)
    if not torch.equal(values, torch.unique(sy)):
        raise ValueError("x and y must carry the same set of token positions (same position marginal)")
    total = 0.0
    for s in values:
        in_x, in_y = sx == s, sy == s
        mass_x, mass_y = float(in_x.double().mean()), float(in_y.double().mean())
        if not math.isclose(mass_x, mass_y, rel_tol=1e-9):
            raise ValueError(f"position {float(s):.4g} has mass {mass_x:.4g} in x but {mass_y:.4g} in y; "
                             "the conditional distance needs equal position marginals")
        total += mass_x * w2_particles(x[in_x], y[in_y]) ** 2
    return math.sqrt(total)
