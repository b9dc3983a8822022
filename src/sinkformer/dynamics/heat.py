r"""Sinkhorn attention as a Schrödinger-bridge step and the heat flow (``docs/theory.md`` §10; Agarwal et al.).

With :math:`A = I/\varepsilon` and :math:`V = -I`, Sinkhorn attention of a measure :math:`\rho` gives the
barycentric projection of the Schrödinger bridge :math:`\pi_{\rho,\varepsilon}` (entropic OT of
:math:`\rho` to itself with cost :math:`|x-y|^2/2`),

.. math::

    B_{\rho,\varepsilon}(x) = \mathbb E_{\pi_{\rho,\varepsilon}}[y\mid x],\qquad
    T_{\rho,\varepsilon}(x) = 2x - B_{\rho,\varepsilon}(x),\qquad \rho_{k+1} = (T_{\rho_k,\varepsilon})_\#\rho_k .

:math:`T = x + \varepsilon\bar T_\varepsilon` is one Euler step of size :math:`\varepsilon` of the rescaled Sinkformer field
:math:`\bar T_\varepsilon = (x - B)/\varepsilon \to -\tfrac12\nabla\log\rho`, so :math:`T/\varepsilon` steps approximate the
heat flow :math:`\partial_t\rho = \tfrac12\Delta\rho`, i.e. :math:`\mathcal N(m, S) \mapsto \mathcal N(m, S + tI)`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._linalg import f64, sym_fn
from .simulate import ParticleField, Trajectory, integrate
from .velocity import velocity

__all__ = [
    "barycentric_map",
    "sb_step",
    "sb_scheme",
    "barycentric_gaussian",
    "sb_step_gaussian",
    "sb_scheme_gaussian",
    "explicit_euler_gaussian",
    "heat_gaussian",
    "heat_map",
]


def _unit(d: int, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    eye = torch.eye(d, dtype=dtype)
    return eye, eye, eye


def barycentric_map(x: Tensor, eps: float, *, weights: Tensor | None = None, at: Tensor | None = None,
                    **velocity_kwargs) -> Tensor:
    """:math:`B_{\\rho,\\varepsilon}` of the cloud ``x (..., N, d)`` at its points (or at ``at``):
    Sinkhorn attention with :math:`Q = K = V = I` and temperature ``eps``."""
    return velocity(x, _unit(x.shape[-1], x.dtype), "sinkhorn", weights=weights, at=at, eps=eps, **velocity_kwargs)


class _RescaledHeatField(ParticleField):
    """:math:`\\bar T_\\varepsilon(x) = (x - B_{\\rho,\\varepsilon}(x))/\\varepsilon`, warm-started between calls."""

    def __init__(self, d: int, dtype: torch.dtype, eps: float, **velocity_kwargs):
        super().__init__(_unit(d, dtype), "sinkhorn", eps=eps, **velocity_kwargs)
        self.eps = eps

    def __call__(self, t: float, x: Tensor) -> Tensor:
        return (x - super().__call__(t, x)) / self.eps


def sb_step(x: Tensor, eps: float, **velocity_kwargs) -> Tensor:
    """One Schrödinger-bridge step on particles: :math:`x_i \\mapsto 2x_i - B_{\\mu,\\varepsilon}(x_i)`."""
    return 2 * x - barycentric_map(x, eps, **velocity_kwargs)


def sb_scheme(x0: Tensor, eps: float, n_steps: int, *, record_every: int = 1, **velocity_kwargs) -> Trajectory:
    """:math:`\\rho_{k+1} = (T_{\\rho_k,\\varepsilon})_\\#\\rho_k` on particles for ``n_steps`` steps (time ``k * eps``),
    each Sinkhorn solve warm-started from the previous one."""
    rhs = _RescaledHeatField(x0.shape[-1], x0.dtype, eps, **velocity_kwargs)
    return integrate(rhs, x0, n_steps * eps, n_steps, method="euler", record_every=record_every)


def barycentric_gaussian(cov: Tensor, eps: float) -> Tensor:
    """:math:`G` with :math:`B(x) = m + G(x - m)` for :math:`\\rho = \\mathcal N(m, S)`:
    :math:`G = \\tfrac12\\big((\\varepsilon^2I + 4S^2)^{1/2} - \\varepsilon I\\big)S^{-1}` (symmetric, commutes with ``S``)."""
    cov = f64(cov)
    return sym_fn(cov, lambda s: ((eps**2 + 4 * s**2).sqrt() - eps) / (2 * s))


def sb_step_gaussian(mean: Tensor, cov: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """:math:`(T_{\\rho,\\varepsilon})_\\#\\mathcal N(m, S) = \\mathcal N(m, (2I - G)S(2I - G))`."""
    cov = f64(cov)
    step = 2 * torch.eye(cov.shape[-1], dtype=torch.float64) - barycentric_gaussian(cov, eps)
    return f64(mean), step @ cov @ step.transpose(-1, -2)


def sb_scheme_gaussian(mean: Tensor, cov: Tensor, eps: float, n_steps: int) -> tuple[Tensor, Tensor]:
    """``n_steps`` Schrödinger-bridge steps of a Gaussian; returns the final ``(mean, cov)``."""
    for _ in range(n_steps):
        mean, cov = sb_step_gaussian(mean, cov, eps)
    return mean, cov


def explicit_euler_gaussian(mean: Tensor, cov: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """The poster's explicit Euler step :math:`(\\mathrm{id} - \\tfrac\\varepsilon2\\nabla\\log\\rho)_\\#\\rho`:
    :math:`\\mathcal N(m, S + \\varepsilon I + \\tfrac{\\varepsilon^2}4 S^{-1})`."""
    cov = f64(cov)
    eye = torch.eye(cov.shape[-1], dtype=torch.float64)
    return f64(mean), cov + eps * eye + eps**2 / 4 * torch.linalg.inv(cov)


def heat_gaussian(mean: Tensor, cov: Tensor, t: float) -> tuple[Tensor, Tensor]:
    """The heat flow :math:`\\partial_t\\rho = \\tfrac12\\Delta\\rho` from :math:`\\mathcal N(m, S)`: :math:`\\mathcal N(m, S + tI)`."""
    cov = f64(cov)
    return f64(mean), cov + t * torch.eye(cov.shape[-1], dtype=torch.float64)


def heat_map(x: Tensor, mean: Tensor, cov: Tensor, t: float) -> Tensor:
    """Push particles of :math:`\\mathcal N(m, S)` to :math:`\\mathcal N(m, S+tI)` by the optimal (linear) map
    :math:`x \\mapsto m + (S+tI)^{1/2}S^{-1/2}(x - m)` (the two commute); a coupled sample of the heat flow."""
    cov = f64(cov)
    mean = f64(mean)
    slope = sym_fn(cov, lambda s: ((s + t) / s).sqrt())
    return (mean + (x.double() - mean) @ slope.transpose(-1, -2)).to(x.dtype)
