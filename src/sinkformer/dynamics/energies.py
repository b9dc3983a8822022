r"""Sinkformer energies (Sander et al. 2022, Prop. 2–3; ``docs/theory.md`` §11).

With :math:`k_0(x,y) = e^{y^\top Ax}` (:math:`A = K^\top Q`, symmetric under Assumption 1) and
:math:`k_\infty` its Sinkhorn normalisation w.r.t. :math:`\mu\otimes\mu`,

.. math::

    F_0(\mu) = \tfrac12\int k_0\,d\mu\otimes\mu,\qquad
    F_\infty(\mu) = -\tfrac12\int k_\infty\log\frac{k_\infty}{k_0}\,d\mu\otimes\mu = -\tfrac12\Big(\int f\,d\mu + \int g\,d\mu\Big).

Under :math:`V = -A`, the fields :math:`T^0_\mu = \int k_0(\cdot,y)Vy\,d\mu` and :math:`T^\infty_\mu = \Gamma^{\rm Sk}_\mu`
are Wasserstein gradients: for particles :math:`\partial F(\mu_N)/\partial x_i = -T_{\mu_N}(x_i)/N`, so
:math:`F` decreases along the particle flow. The SoftMax field is not a gradient (Prop. 3): the
Jacobian of :math:`X \mapsto (\Gamma(x_i))_i` is not symmetric (:func:`jacobian_asymmetry`); it is a gradient
flow of :math:`F_0` for a twisted metric instead (Castin et al. §5.4, ``docs/theory.md`` §16.5:
:func:`twisted_mobility`, :func:`twisted_dissipation`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from .._validation import check_tensor
from ._linalg import f64, sym_sqrt
from ._streaming import log_weights
from .velocity import on_sphere, velocity

__all__ = ["f0", "t0_field", "f_inf", "f_inf_gaussian", "jacobian_asymmetry", "twisted_mobility", "twisted_dissipation"]


def _log_w(x: Tensor, weights: Tensor | None) -> Tensor:
    n = x.shape[-2]
    if weights is None:
        return x.new_full(x.shape[:-1], -math.log(n))
    w = weights.to(x.dtype)
    return log_weights(w / w.sum(-1, keepdim=True))


def _scores(x: Tensor, A: Tensor) -> Tensor:
    """:math:`C_{ij} = x_j^\\top A x_i` (``(..., N, N)``)."""
    return (x @ A.to(x.dtype).T) @ x.transpose(-1, -2)


def f0(x: Tensor, A: Tensor, weights: Tensor | None = None) -> Tensor:
    """:math:`F_0(\\mu) = \\tfrac12\\sum_{ij}w_iw_je^{x_j^\\top Ax_i}` of the cloud ``x (..., N, d)`` (``(...)``)."""
    check_tensor(x, "x", min_dim=2, floating=True)
    lw = _log_w(x, weights)
    return 0.5 * torch.logsumexp(_scores(x, A) + lw.unsqueeze(-1) + lw.unsqueeze(-2), dim=(-1, -2)).exp()


def t0_field(x: Tensor, A: Tensor, V: Tensor, weights: Tensor | None = None) -> Tensor:
    """:math:`T^0_\\mu(x_i) = \\sum_j w_j e^{x_j^\\top Ax_i}Vx_j` (the unnormalised kernel :math:`k_0`: ``velocity(kind="exp")``)."""
    check_tensor(x, "x", min_dim=2, floating=True)
    return velocity(x, (A.to(x.dtype), torch.eye(x.shape[-1], dtype=x.dtype), V.to(x.dtype)), "exp", weights=weights)


def f_inf(x: Tensor, A: Tensor, weights: Tensor | None = None, *, tol: float = 1e-12, **velocity_kwargs) -> Tensor:
    """:math:`F_\\infty(\\mu) = -\\tfrac12\\sum_i w_i(f(x_i) + g(x_i))` from the Sinkhorn potentials of :math:`k_0`.

    ``A`` is any ``(d, d)`` interaction matrix (:math:`Q = A`, :math:`K = I`); the potentials are
    normalised as in ``docs/theory.md`` §6.4 (:math:`k_\\infty = e^{C + f\\oplus g}`), ``f`` from the exact row update.
    """
    check_tensor(x, "x", min_dim=2, floating=True)
    d = x.shape[-1]
    eye = torch.eye(d, dtype=x.dtype)
    res = velocity(x, (A.to(x.dtype), eye, eye), "sinkhorn", weights=weights, tol=tol, return_result=True,
                   **velocity_kwargs)
    g = res.potential[..., 0, :]
    lw = _log_w(x, weights)
    f = -torch.logsumexp(_scores(x, A) + (lw + g).unsqueeze(-2), dim=-1)
    return -0.5 * (lw.exp() * (f + g)).sum(-1)


def f_inf_gaussian(mean: Tensor, cov: Tensor, A: Tensor) -> Tensor:
    """:math:`F_\\infty(\\mathcal N(\\alpha,\\Sigma)) = \\tfrac12\\alpha^\\top A\\alpha + \\tfrac14\\sum_i\\big[\\sqrt{1+4m_i} - 1 + \\log\\frac{2}{1+\\sqrt{1+4m_i}}\\big]`,
    :math:`m_i` the eigenvalues of :math:`\\Sigma^{1/2}A^\\top\\Sigma A\\Sigma^{1/2}` (any ``A``)."""
    mean, cov, A = (f64(t) for t in (mean, cov, A))
    root = sym_sqrt(cov)
    m = torch.linalg.eigvalsh(root @ A.T @ cov @ A @ root).clamp_min(0)
    r = (1 + 4 * m).sqrt()
    return 0.5 * mean @ A @ mean + 0.25 * (r - 1 + torch.log(2 / (1 + r))).sum(-1)


def jacobian_asymmetry(field: Callable[[Tensor], Tensor], x: Tensor) -> float:
    """:math:`\\|J - J^\\top\\|_F / \\|J\\|_F` for the ``Nd x Nd`` Jacobian :math:`J` of :math:`X \\mapsto (T_{\\mu_X}(x_i))_i`.

    Zero (up to rounding) for gradient fields — :math:`k_0` (:func:`t0_field`) and Sinkhorn under
    Assumption 1 — and not for SoftMax (Sinkformers Prop. 3). ``field(x (N, d)) -> (N, d)``, e.g.
    ``lambda z: velocity(z, params, "softmax")``; differentiated by autograd (through the Sinkhorn loop).
    """
    check_tensor(x, "x", ndim=2, floating=True)
    n, d = x.shape
    J = torch.autograd.functional.jacobian(field, x).reshape(n * d, n * d)
    return float((J - J.T).norm() / J.norm())


def twisted_mobility(A: Tensor, V: Tensor) -> Tensor:
    """:math:`B = VA^{-1}` of the twisted-Wasserstein structure (``docs/theory.md`` §16.5), checked symmetric positive definite.

    The SoftMax flow with :math:`A = K^\\top Q` symmetric and :math:`V = BA` is the gradient ascent of
    :math:`F_0` for the metric :math:`\\lVert v\\rVert^2_\\mu=\\int Z_\\mu\\langle v, B^{-1}v\\rangle d\\mu`; raises
    ``ValueError`` when :math:`A` is not symmetric invertible or :math:`B` not symmetric positive definite.
    """
    A, V = f64(A), f64(V)
    scale = float(A.abs().max()) or 1.0
    if float((A - A.T).abs().max()) > 1e-10 * scale:
        raise ValueError("the twisted-Wasserstein structure needs a symmetric A = K^T Q; got a non-symmetric A")
    try:
        B = torch.linalg.solve(A.T, V.T).T  # V A^{-1}
    except RuntimeError as err:
        raise ValueError(f"the twisted-Wasserstein structure needs an invertible A = K^T Q ({err})") from None
    if float((B - B.T).abs().max()) > 1e-8 * (float(B.abs().max()) or 1.0) or float(torch.linalg.eigvalsh(B).min()) <= 0:
        raise ValueError("the twisted-Wasserstein structure needs V = B A with B symmetric positive definite; "
                         f"V A^-1 = {B.tolist()} is not")
    return (B + B.T) / 2


def twisted_dissipation(x: Tensor, A: Tensor, V: Tensor, weights: Tensor | None = None, *,
                        geometry: str = "euclidean") -> Tensor:
    """:math:`\\lVert\\Gamma_\\mu\\rVert^2_{\\mu}=\\sum_iw_i\\,Z_\\mu(x_i)\\,\\langle\\Gamma_\\mu(x_i),B^{-1}\\Gamma_\\mu(x_i)\\rangle` ``(...)``.

    The rate :math:`\\frac{d}{dt}F_0(\\mu_t)` that the twisted-Wasserstein structure predicts along the SoftMax flow
    (``docs/theory.md`` §16.5): :math:`Z_\\mu(x)=\\sum_jw_je^{\\langle Ax,x_j\\rangle}`, :math:`\\Gamma` the SoftMax field of
    ``(Q, K, V) = (A, I, V)``, :math:`B=VA^{-1}` (:func:`twisted_mobility`). With ``geometry="sphere"`` the tokens are
    normalised, :math:`\\Gamma` is the tangent field, and :math:`B` must be a multiple of the identity.
    """
    check_tensor(x, "x", min_dim=2, floating=True)
    B = twisted_mobility(A, V).to(x.dtype)
    d = x.shape[-1]
    if geometry == "sphere":
        if float((B - B[0, 0] * torch.eye(d, dtype=x.dtype)).abs().max()) > 1e-10 * float(B.abs().max()):
            raise ValueError("on the sphere the twisted structure needs V = b A with b > 0 (B a multiple of I)")
        x = on_sphere(x)
    field = velocity(x, (A.to(x.dtype), torch.eye(d, dtype=x.dtype), V.to(x.dtype)), "softmax", weights=weights,
                     geometry=geometry)
    lw = _log_w(x, weights)
    Z = torch.logsumexp(_scores(x, A) + lw.unsqueeze(-2), dim=-1).exp()
    quad = (field * torch.linalg.solve(B, field.unsqueeze(-1)).squeeze(-1)).sum(-1)
    return (lw.exp() * Z * quad).sum(-1)
