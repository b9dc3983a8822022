r"""Gaussian closed forms of the attention dynamics (``docs/theory.md`` §7–9).

For :math:`\mu = \mathcal N(\alpha, \Sigma)` the Softmax, linear, L2 and Sinkhorn fields (and
sums of them: multi-head) are affine, :math:`\Gamma_\mu(x) = b + Lx`, so the flow stays Gaussian
with the moment ODEs (the *affine rule*, ``docs/theory.md`` §5)

.. math::

    \dot\alpha = b + L\alpha,\qquad \dot\Sigma = L\Sigma + \Sigma L^\top .

:func:`field` gives ``(b, L)``; :func:`flow` integrates the moments. The integrator evolves a
factor :math:`R` with :math:`\Sigma = RR^\top` and :math:`\dot R = LR` (the flow map of the
affine field), so :math:`\Sigma` stays in the PSD cone by construction, for RK4 as for the
Euler recursion :math:`R \leftarrow (I + hL)R`, which is the exact :math:`N\to\infty` law of
particle Euler steps (*EulerG*). Also here: the Riccati solution of Softmax with :math:`V = I`,
the non-affine ReLU / Sigmoid / masked fields, and the drifting model (``docs/theory.md`` §8, §7.6, §9).

Everything is batched over leading dimensions of ``mean (..., d)`` and ``cov (..., d, d)`` and
computed in float64.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from .._validation import check_choice, check_positive_int, check_tensor
from ._linalg import f64, single_threaded, sym_fn, sym_inv_sqrt, sym_pinv_sqrt, sym_sqrt
from .params import Params, as_heads, interaction

__all__ = [
    "GAUSSIAN_KINDS",
    "GaussianFlow",
    "field",
    "moments_rhs",
    "flow",
    "integrate_affine",
    "sym_sqrt",
    "riccati",
    "riccati_mean",
    "riccati_flow_map",
    "blowup_time",
    "riccati_limit",
    "relu_field",
    "sigmoid_field",
    "masked_field",
    "drifting_field",
    "drifting_mean",
    "drifting_flow",
]

GAUSSIAN_KINDS = ("softmax", "linear", "l2", "sinkhorn")
AffineField = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]


# ----------------------------------------------------------------------------------------------
# small linear algebra


def _eye_like(M: Tensor) -> Tensor:
    return torch.eye(M.shape[-1], dtype=M.dtype, device=M.device).expand_as(M)


def _T(M: Tensor) -> Tensor:
    return M.transpose(-1, -2)


def _check_moments(mean: Tensor, cov: Tensor) -> tuple[Tensor, Tensor]:
    check_tensor(mean, "mean", min_dim=1, floating=True)
    check_tensor(cov, "cov", min_dim=2, floating=True)
    d = mean.shape[-1]
    if cov.shape[-2:] != (d, d):
        raise ValueError(f"cov must have shape (..., {d}, {d}) to match mean {tuple(mean.shape)}, got {tuple(cov.shape)}")
    mean, cov = f64(mean), f64(cov)
    batch = torch.broadcast_shapes(mean.shape[:-1], cov.shape[:-2])
    return mean.expand(batch + (d,)).contiguous(), cov.expand(batch + (d, d)).contiguous()  # LAPACK is slow on stride 0


def _heads64(params: Params, d: int) -> list[tuple[Tensor, Tensor, Tensor]]:
    return [(f64(Q), f64(K), f64(V)) for Q, K, V in as_heads(params, d, batched=True)]


def _mv(M: Tensor, v: Tensor) -> Tensor:
    """Batched matrix-vector product ``M (..., d, d) @ v (..., d)``."""
    return (M @ v.unsqueeze(-1)).squeeze(-1)


# ----------------------------------------------------------------------------------------------
# affine fields and moment ODEs (docs/theory.md §7.1–7.5)


def field(kind: str, mean: Tensor, cov: Tensor, params: Params, eps: float = 1.0) -> tuple[Tensor, Tensor]:
    r"""The affine field :math:`\Gamma_{\mathcal N(\alpha,\Sigma)}(x) = b + Lx` of attention ``kind``.

    With :math:`A = K^\top Q/\varepsilon` (``docs/theory.md`` §7):

    * ``softmax``: :math:`b = V\alpha,\ L = V\Sigma A` (tilting lemma);
    * ``linear``: :math:`b = 0,\ L = V(\Sigma+\alpha\alpha^\top)A`;
    * ``l2``: :math:`b = V(I+\Sigma K^\top K/\varepsilon)^{-1}\alpha,\ L = V(I+\Sigma K^\top K/\varepsilon)^{-1}\Sigma A`;
    * ``sinkhorn``: :math:`b = V(\alpha - C^\top\Sigma^{-1}\alpha),\ L = VC^\top\Sigma^{-1}` with
      :math:`C^\top\Sigma^{-1} = \Sigma A\Sigma^{1/2}P\Sigma^{-1/2}`, :math:`P = 2(I+(I+4M)^{1/2})^{-1}`,
      :math:`M = \Sigma^{1/2}A^\top\Sigma A\Sigma^{1/2}` (entropic OT between Gaussians; for singular
      :math:`\Sigma` the pseudo-inverse gives the field on the support).

    A list of head triples sums the head fields.

    Args:
        kind: one of :data:`GAUSSIAN_KINDS`.
        mean: ``(..., d)``. cov: ``(..., d, d)`` PSD.
        params: ``(Q, K, V)`` or a list of triples.
        eps: temperature.

    Returns:
        ``(b (..., d), L (..., d, d))`` in float64.
    """
    check_choice(kind, "kind", GAUSSIAN_KINDS)
    mean, cov = _check_moments(mean, cov)
    b_total = torch.zeros_like(mean)
    L_total = torch.zeros_like(cov)
    for Q, K, V in _heads64(params, mean.shape[-1]):
        A = interaction(Q, K) / eps
        if kind == "softmax":
            b, L = _mv(V, mean), V @ cov @ A
        elif kind == "linear":
            b, L = torch.zeros_like(mean), V @ (cov + mean.unsqueeze(-1) * mean.unsqueeze(-2)) @ A
        elif kind == "l2":
            G = _eye_like(cov) + cov @ (_T(K) @ K) / eps
            b = _mv(V, torch.linalg.solve(G, mean.unsqueeze(-1)).squeeze(-1))
            L = V @ torch.linalg.solve(G, cov @ A)
        else:
            CtSinv = _sinkhorn_regression(cov, A)
            L = V @ CtSinv
            b = _mv(V, mean - _mv(CtSinv, mean))
        b_total = b_total + b
        L_total = L_total + L
    return b_total, L_total


def _sinkhorn_regression(cov: Tensor, A: Tensor) -> Tensor:
    """:math:`C^\\top\\Sigma^{-1}`, the slope of :math:`\\mathbb E_\\pi[y|x]` for the Gaussian EOT coupling (``docs/theory.md`` §7.5)."""
    root = sym_sqrt(cov)
    M = root @ _T(A) @ cov @ A @ root
    P = sym_fn(M, lambda m: 2.0 / (1.0 + (1.0 + 4.0 * m.clamp_min(0)).sqrt()))
    return cov @ A @ root @ P @ sym_pinv_sqrt(cov)


def moments_rhs(kind: str, mean: Tensor, cov: Tensor, params: Params, eps: float = 1.0) -> tuple[Tensor, Tensor]:
    """Right-hand side of the moment ODEs: :math:`(\\dot\\alpha, \\dot\\Sigma) = (b + L\\alpha, L\\Sigma + \\Sigma L^\\top)`."""
    mean, cov = _check_moments(mean, cov)
    b, L = field(kind, mean, cov, params, eps)
    return b + _mv(L, mean), L @ cov + cov @ _T(L)


@dataclass
class GaussianFlow:
    """Moments along an integrated Gaussian flow.

    Attributes:
        times: ``(T,)`` recorded times.
        mean: ``(T, ..., d)``; cov: ``(T, ..., d, d)``. A member that blew up or converged keeps its
            last state in the later records.
        flow_map: ``(T, ..., d, d)`` :math:`M(t)`, the particle flow map :math:`x(t) = \\alpha(t) + M(t)(x_0 - \\alpha_0)`
            of the affine field (:math:`\\dot M = LM`, :math:`M(0) = I`; on the range of a singular :math:`\\Sigma_0`).
        blowup_time: ``(...)`` time at which the largest eigenvalue of :math:`\\Sigma` crossed the
            threshold (``inf``: never), interpolated linearly in :math:`1/\\lambda_{\\max}`.
        converged: ``(...)`` whether the velocity norm fell below ``stop_below``.
    """

    times: Tensor
    mean: Tensor
    cov: Tensor
    flow_map: Tensor
    blowup_time: Tensor
    converged: Tensor


def integrate_affine(
    field_fn: AffineField,
    mean0: Tensor,
    cov0: Tensor,
    t1: float,
    steps: int,
    *,
    method: str = "rk4",
    record_every: int = 1,
    blowup: float = 1e8,
    stop_below: float | None = None,
) -> GaussianFlow:
    """Integrate the moments of a Gaussian under an affine field ``field_fn(mean, cov) -> (b, L)``.

    The state is :math:`(\\alpha, R)` with :math:`\\Sigma = RR^\\top`, :math:`\\dot\\alpha = b + L\\alpha`,
    :math:`\\dot R = LR`; ``method="rk4"`` is classical Runge–Kutta, ``"euler"`` the EulerG
    recursion :math:`\\alpha \\leftarrow \\alpha + h(b+L\\alpha)`, :math:`R \\leftarrow (I+hL)R`.
    A member stops when :math:`\\lambda_{\\max}(\\Sigma)` exceeds ``blowup`` (or turns non-finite)
    or, with ``stop_below``, when :math:`\\max(|\\dot\\alpha|, \\|\\dot\\Sigma\\|_F) <` ``stop_below``.
    """
    check_choice(method, "method", ("rk4", "euler"))
    check_positive_int(steps, "steps")
    check_positive_int(record_every, "record_every")
    with single_threaded():  # tiny matrices: thread wake-ups would dominate
        return _integrate_affine(field_fn, mean0, cov0, float(t1), steps, method, record_every, blowup, stop_below)


def _integrate_affine(field_fn, mean0, cov0, t1, steps, method, record_every, blowup, stop_below) -> GaussianFlow:
    mean, cov = _check_moments(mean0, cov0)
    batch = mean.shape[:-1]
    h = t1 / steps
    R = sym_sqrt(cov)
    R0_inv = sym_pinv_sqrt(cov)

    def deriv(a: Tensor, R: Tensor) -> tuple[Tensor, Tensor]:
        b, L = field_fn(a, R @ _T(R))
        return b + _mv(L, a), L @ R

    active = torch.ones(batch, dtype=torch.bool)
    converged = torch.zeros(batch, dtype=torch.bool)
    blow = torch.full(batch, math.inf, dtype=torch.float64)
    lam = torch.linalg.eigvalsh(cov)[..., -1]
    inv_older = 1.0 / lam  # 1/lambda_max one accepted step back
    times, means, covs, maps = [0.0], [mean], [cov], [R @ R0_inv]
    a = mean
    for step in range(steps):
        da, dR = deriv(a, R)
        if stop_below is not None:
            dcov = dR @ _T(R) + R @ _T(dR)
            speed = torch.maximum(da.norm(dim=-1), dcov.flatten(-2).norm(dim=-1))
            newly = active & (speed < stop_below)
            converged |= newly
            active &= ~newly
        if not bool(active.any()):
            break
        if method == "euler":
            a_new, R_new = a + h * da, R + h * dR
        else:
            k2 = deriv(a + h / 2 * da, R + h / 2 * dR)
            k3 = deriv(a + h / 2 * k2[0], R + h / 2 * k2[1])
            k4 = deriv(a + h * k3[0], R + h * k3[1])
            a_new = a + h / 6 * (da + 2 * k2[0] + 2 * k3[0] + k4[0])
            R_new = R + h / 6 * (dR + 2 * k2[1] + 2 * k3[1] + k4[1])
        finite = torch.isfinite(a_new).all(-1) & torch.isfinite(R_new).flatten(-2).all(-1)
        lam_new = torch.linalg.eigvalsh(torch.where(finite[..., None, None], R_new @ _T(R_new), R @ _T(R)))[..., -1]
        crossed = active & (~finite | (lam_new > blowup))
        if bool(crossed.any()):
            # Near a blow-up 1/lambda_max is close to linear in t: extrapolate it from the last two
            # accepted states (the crossing step itself is inaccurate) down to 1/blowup.
            slope = (inv_older - 1.0 / lam) / h if step > 0 else (1.0 / lam - torch.where(finite, 1.0 / lam_new, 0.0)) / h
            reach = step * h + (1.0 / lam - 1.0 / blowup) / slope.clamp_min(1e-300)
            blow = torch.where(crossed, reach.clamp(step * h, (step + 1) * h), blow)
        inv_older = 1.0 / lam
        move = active & ~crossed
        a = torch.where(move[..., None], a_new, a)
        R = torch.where(move[..., None, None], R_new, R)
        lam = torch.where(move, lam_new, lam)
        active = move
        if (step + 1) % record_every == 0 or step + 1 == steps or not bool(active.any()):
            times.append((step + 1) * h)
            means.append(a)
            covs.append(R @ _T(R))
            maps.append(R @ R0_inv)
        if not bool(active.any()):
            break
    return GaussianFlow(f64(times), torch.stack(means), torch.stack(covs), torch.stack(maps), blow, converged)


def flow(
    kind: str,
    mean0: Tensor,
    cov0: Tensor,
    params: Params,
    t1: float,
    steps: int = 1000,
    *,
    method: str = "rk4",
    eps: float = 1.0,
    record_every: int = 1,
    blowup: float = 1e8,
    stop_below: float | None = None,
) -> GaussianFlow:
    """Integrate the moment ODEs of :math:`\\mathcal N(\\alpha_0, \\Sigma_0)` under attention ``kind``.

    See :func:`integrate_affine` for the method, the PSD-preserving state and the stopping rules.

    Example:
        >>> Q = K = V = torch.eye(2, dtype=torch.float64)
        >>> out = flow("softmax", torch.zeros(2), torch.eye(2), (Q, K, V), t1=1.0)
        >>> float(out.blowup_time)  # Riccati: t* = 1 / (2 lambda_max) = 0.5
        0.5...
    """
    check_choice(kind, "kind", GAUSSIAN_KINDS)
    as_heads(params, mean0.shape[-1], batched=True)
    return integrate_affine(
        lambda m, c: field(kind, m, c, params, eps), mean0, cov0, t1, steps,
        method=method, record_every=record_every, blowup=blowup, stop_below=stop_below,
    )


# ----------------------------------------------------------------------------------------------
# Riccati closed form: Softmax with V = I or V commuting (docs/theory.md §8)


def _riccati_setup(cov0: Tensor, A: Tensor, V: Tensor | None, need_symmetric_A: bool = False):
    """Return ``(Sigma0, root0, VA_s, A_tilde)`` after checking the assumptions of ``docs/theory.md`` §8."""
    check_tensor(cov0, "cov0", ndim=2, floating=True)
    check_tensor(A, "A", ndim=2, floating=True)
    cov0, A = f64(cov0), f64(A)
    d = cov0.shape[0]
    if cov0.shape != (d, d) or A.shape != (d, d):
        raise ValueError(f"cov0 and A must be square of the same size, got {tuple(cov0.shape)} and {tuple(A.shape)}")
    scale = max(float(A.abs().max()), 1e-300)
    if need_symmetric_A and float((A - A.T).abs().max()) > 1e-10 * scale:
        raise ValueError("the Riccati mean and flow map need a symmetric A (the covariance formula uses sym(A))")
    A_s = (A + A.T) / 2
    if V is None:
        VA = A_s
    else:
        check_tensor(V, "V", ndim=2, floating=True)
        V = f64(V)
        v_scale = max(float(V.abs().max()), 1e-300)
        for what, err in (
            ("V symmetric", V - V.T),
            ("V A = A V", V @ A - A @ V),
            ("V Sigma0 = Sigma0 V", V @ cov0 - cov0 @ V),
        ):
            if float(err.abs().max()) > 1e-10 * v_scale * max(scale, float(cov0.abs().max())):
                raise ValueError(f"the Riccati closed form needs V = I or {what}; this V does not satisfy it")
        VA = V @ A_s
    root0 = sym_sqrt(cov0)
    return cov0, root0, VA, root0 @ VA @ root0


def riccati(cov0: Tensor, A: Tensor, t: float | Tensor, V: Tensor | None = None) -> Tensor:
    """:math:`\\Sigma(t) = \\Sigma_0^{1/2}(I - 2t\\tilde A)^{-1}\\Sigma_0^{1/2}`, :math:`\\tilde A = \\Sigma_0^{1/2}VA_s\\Sigma_0^{1/2}`.

    The covariance of the Softmax flow when :math:`V = I` (``V=None``) or :math:`V` is symmetric and
    commutes with :math:`A` and :math:`\\Sigma_0` (then :math:`\\mathrm{sym}(VA) = VA_s`); ``A`` may be
    non-symmetric, only :math:`A_s = \\mathrm{sym}(A)` enters.
    ``t`` scalar gives ``(d, d)``, ``t`` of shape ``(T,)`` gives ``(T, d, d)``; valid for :math:`t < t^*`.
    """
    _, root0, _, At = _riccati_setup(cov0, A, V)
    t = f64(t)
    I = torch.eye(At.shape[0], dtype=torch.float64)
    inner = I - 2 * t.reshape(t.shape + (1, 1)) * At
    return root0 @ torch.linalg.solve(inner, root0.expand_as(inner))


def riccati_flow_map(cov0: Tensor, A: Tensor, t: float | Tensor, V: Tensor | None = None) -> Tensor:
    """:math:`M(t) = \\Sigma_0^{1/2}(I-2t\\tilde A)^{-1/2}\\Sigma_0^{-1/2}`: particles move as
    :math:`x(t) = \\alpha(t) + M(t)(x_0 - \\alpha_0)` (symmetric ``A``)."""
    cov0, root0, _, At = _riccati_setup(cov0, A, V, need_symmetric_A=True)
    t = f64(t)
    I = torch.eye(At.shape[0], dtype=torch.float64)
    inner = I - 2 * t.reshape(t.shape + (1, 1)) * At
    return root0 @ sym_fn(inner, torch.rsqrt) @ sym_inv_sqrt(cov0)


def riccati_mean(mean0: Tensor, cov0: Tensor, A: Tensor, t: float | Tensor, V: Tensor | None = None) -> Tensor:
    """:math:`\\alpha(t) = e^{tV}M(t)\\alpha_0` (``(d,)`` or ``(T, d)``; symmetric ``A``)."""
    M = riccati_flow_map(cov0, A, t, V)
    t = f64(t)
    d = M.shape[-1]
    Vm = torch.eye(d, dtype=torch.float64) if V is None else f64(V)
    expV = torch.linalg.matrix_exp(t.reshape(t.shape + (1, 1)) * Vm)
    return (expV @ M @ f64(mean0).unsqueeze(-1)).squeeze(-1)


def blowup_time(cov0: Tensor, A: Tensor, V: Tensor | None = None) -> float:
    """:math:`t^* = 1/(2\\lambda_{\\max}(\\tilde A))` if :math:`\\lambda_{\\max}(\\tilde A) > 0`, else ``inf``."""
    _, _, _, At = _riccati_setup(cov0, A, V)
    lam = float(torch.linalg.eigvalsh((At + At.T) / 2)[-1])
    return 1.0 / (2.0 * lam) if lam > 1e-14 * max(float(At.abs().max()), 1e-300) else math.inf


def riccati_limit(cov0: Tensor, A: Tensor, V: Tensor | None = None, *, tol: float = 1e-10) -> Tensor:
    """:math:`\\Sigma_\\infty = U(U^\\top\\Sigma_0^{-1}U)^{-1}U^\\top`, ``U`` an orthonormal basis of :math:`\\ker(VA_s)`.

    The long-time limit when :math:`\\tilde A \\preceq 0`: the mass collapses onto an affine subspace of
    dimension :math:`\\dim\\ker(VA_s)` (clustering). Raises if the flow blows up instead.
    """
    cov0, _, VA, At = _riccati_setup(cov0, A, V)
    lam, U = torch.linalg.eigh((VA + VA.T) / 2)
    scale = max(float(lam.abs().max()), 1e-300)
    if float(lam[-1]) > tol * scale:
        raise ValueError(f"V A_s has a positive eigenvalue {float(lam[-1]):.3g}: the covariance blows up at "
                         f"t* = {blowup_time(cov0, VA):.6g}, there is no limit")
    U = U[:, lam.abs() <= tol * scale]
    if U.shape[1] == 0:
        return torch.zeros_like(cov0)
    return U @ torch.linalg.inv(U.T @ torch.linalg.solve(cov0, U)) @ U.T


# ----------------------------------------------------------------------------------------------
# non-affine closed forms (docs/theory.md §7.6): Gaussians are not preserved, fields for checking particles


def _projections(x: Tensor, mean: Tensor, cov: Tensor, A: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(m, s, Sigma A x)``: :math:`u = \\langle Qx, Ky\\rangle \\sim \\mathcal N(m, s^2)` for :math:`y \\sim \\mathcal N(\\alpha, \\Sigma)`."""
    Ax = x @ A.T
    m = Ax @ mean
    SAx = Ax @ cov  # rows (Sigma A x)^T, Sigma symmetric
    s = (SAx * Ax).sum(-1).clamp_min(0).sqrt()
    return m, s, SAx


def _pointwise_field(x: Tensor, mean: Tensor, cov: Tensor, params: Params, eps: float,
                     expectations: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]) -> Tensor:
    """:math:`\\Gamma(x) = \\sum_h V_h[\\alpha\\,\\mathbb E\\sigma(u) + \\Sigma A_h x\\,\\mathbb E\\sigma'(u)]` (Stein's lemma)."""
    x, mean, cov = f64(x), f64(mean), f64(cov)
    out = torch.zeros_like(x)
    for Q, K, V in _heads64(params, x.shape[-1]):
        m, s, SAx = _projections(x, mean, cov, interaction(Q, K) / eps)
        e_sigma, e_dsigma = expectations(m, s)
        out = out + (e_sigma.unsqueeze(-1) * mean + e_dsigma.unsqueeze(-1) * SAx) @ V.T
    return out


def relu_field(x: Tensor, mean: Tensor, cov: Tensor, params: Params, eps: float = 1.0) -> Tensor:
    """ReLU attention field of :math:`\\mathcal N(\\alpha,\\Sigma)` at ``x (..., d)``:
    :math:`V[\\alpha(m\\Phi(m/s)+s\\varphi(m/s)) + \\Sigma Ax\\,\\Phi(m/s)]`."""
    normal = torch.distributions.Normal(f64(0.0), f64(1.0))

    def expectations(m: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
        z = m / s.clamp_min(1e-300)
        cdf, pdf = normal.cdf(z), normal.log_prob(z).exp()
        return m * cdf + s * pdf, cdf

    return _pointwise_field(x, mean, cov, params, eps, expectations)


def sigmoid_field(x: Tensor, mean: Tensor, cov: Tensor, params: Params, eps: float = 1.0, n_quad: int = 64) -> Tensor:
    """Sigmoid attention field of :math:`\\mathcal N(\\alpha,\\Sigma)` at ``x``, with ``n_quad``-point Gauss–Hermite quadrature."""
    nodes, wts = np.polynomial.hermite_e.hermegauss(n_quad)
    nodes, wts = f64(nodes), f64(wts / wts.sum())

    def expectations(m: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
        sig = torch.sigmoid(m.unsqueeze(-1) + s.unsqueeze(-1) * nodes)
        return sig @ wts, (sig * (1 - sig)) @ wts

    return _pointwise_field(x, mean, cov, params, eps, expectations)


def masked_field(x: Tensor, s: Tensor, mean: Tensor, drift: Tensor, cov: Tensor, params: Params,
                 eps: float = 1.0) -> Tensor:
    r"""Masked Softmax field of :math:`\mathrm{Unif}[0,1](ds)\otimes\mathcal N(\alpha+s\beta,\Sigma)(dy)` at ``(s, x)``.

    :math:`\Gamma(s,x) = \sum_h V_h(\alpha + \Sigma A_h x + \beta\tau)`,
    :math:`\tau = \frac{s e^{sb}}{e^{sb}-1} - \frac1b`, :math:`b = \beta^\top A_h x` (:math:`\tau = s/2` at :math:`b = 0`).

    Args:
        x: ``(..., d)`` points; s: ``(...)`` their positions in ``(0, 1]``; mean :math:`\alpha`, drift :math:`\beta`.
    """
    x, s, mean, drift, cov = (f64(t) for t in (x, s, mean, drift, cov))
    out = torch.zeros_like(x)
    for Q, K, V in _heads64(params, x.shape[-1]):
        Ax = x @ (interaction(Q, K) / eps).T
        b = Ax @ drift
        sb = s * b
        small = sb.abs() < 1e-6
        safe_b = torch.where(small, torch.ones_like(b), b)
        safe_sb = torch.where(small, torch.ones_like(sb), sb)
        tau = torch.where(small, s / 2 + s * sb / 12, -s / torch.expm1(-safe_sb) - 1 / safe_b)
        out = out + (mean + Ax @ cov + tau.unsqueeze(-1) * drift) @ V.T
    return out


# ----------------------------------------------------------------------------------------------
# drifting model (docs/theory.md §9)


def drifting_field(mean: Tensor, cov: Tensor, target_mean: Tensor, target_cov: Tensor) -> tuple[Tensor, Tensor]:
    """Drifting velocity :math:`v = m_q - m_p` as ``(b, L)``, with the mean-shift field
    :math:`m_\\rho(x) = (I+S)^{-1}a + (I+S)^{-1}Sx` of :math:`\\rho = \\mathcal N(a, S)` (the L2 field with Q=K=V=I)."""
    mean, cov = _check_moments(mean, cov)
    eye = torch.eye(mean.shape[-1], dtype=torch.float64)
    unit = (eye, eye, eye)
    b_q, L_q = field("l2", target_mean, target_cov, unit)
    b_p, L_p = field("l2", mean, cov, unit)
    return b_q - b_p, L_q - L_p


def drifting_mean(t: float | Tensor, mean0: Tensor, target_mean: Tensor, target_cov: Tensor) -> Tensor:
    """:math:`\\mu(t) = \\mu_q + e^{-t(I+S_q)^{-1}}(\\mu_0 - \\mu_q)` (``(d,)`` or ``(T, d)``)."""
    t, mean0, target_mean, target_cov = (f64(v) for v in (t, mean0, target_mean, target_cov))
    rate = torch.linalg.inv(torch.eye(target_cov.shape[-1], dtype=torch.float64) + target_cov)
    decay = torch.linalg.matrix_exp(-t.reshape(t.shape + (1, 1)) * rate)
    return target_mean + (decay @ (mean0 - target_mean).unsqueeze(-1)).squeeze(-1)


def drifting_flow(mean0: Tensor, cov0: Tensor, target_mean: Tensor, target_cov: Tensor, t1: float,
                  steps: int = 1000, **kwargs) -> GaussianFlow:
    """Integrate the drifting moments :math:`\\dot\\mu = b + L\\mu`, :math:`\\dot S = LS + SL` (keywords of :func:`integrate_affine`)."""
    return integrate_affine(lambda m, c: drifting_field(m, c, target_mean, target_cov), mean0, cov0, t1, steps, **kwargs)
