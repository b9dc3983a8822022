"""Attention on the sphere (docs/theory.md §16.1–16.3): closed forms, an independent integration, mean field."""

import math

import numpy as np
import pytest
import torch
from dyn_helpers import D64, gen
from scipy.integrate import solve_ivp
from scipy.special import ive

from sinkformer.dynamics import simulate, velocity
from sinkformer.dynamics.velocity import on_sphere

I3 = torch.eye(3, dtype=D64)


def equiangular(n: int, rho: float) -> torch.Tensor:
    """``n`` unit vectors of R^n with every pairwise inner product ``rho`` (rows of a Cholesky factor)."""
    G = torch.full((n, n), rho, dtype=D64)
    G.fill_diagonal_(1.0)
    return torch.linalg.cholesky(G)


def off_diagonal(X: torch.Tensor) -> torch.Tensor:
    G = X @ X.transpose(-1, -2)
    n = G.shape[-1]
    return G[..., ~torch.eye(n, dtype=torch.bool)]


def rho_rate(kind: str, n: int, beta: float):
    """The scalar ODE of the common inner product (docs/theory.md §16.2)."""
    if kind == "exp":
        return lambda t, r: 2 / n * np.exp(beta * r) * (1 - r) * (1 + (n - 1) * r)
    return lambda t, r: 2 * (1 - r) * (1 + (n - 1) * r) / (np.exp(beta * (1 - r)) + n - 1)


def scalar_reference(kind, n, beta, rho0, t1):
    sol = solve_ivp(rho_rate(kind, n, beta), (0, t1), [rho0], rtol=1e-13, atol=1e-15, method="DOP853")
    return float(sol.y[0, -1])


def test_two_particles_at_beta_zero_follow_tanh():
    """SA with beta = 0, Q = K = V = I: rho' = 1 - rho^2, rho(t) = tanh(t + artanh rho0)."""
    rho0, t1 = -0.6, 2.0
    x0 = equiangular(2, rho0)
    traj = simulate(x0, (torch.eye(2, dtype=D64),) * 3, t1=t1, steps=200, method="rk4", geometry="sphere", eps=1e12)
    rho = (traj.positions[:, 0] * traj.positions[:, 1]).sum(-1)
    exact = torch.tanh(traj.times + math.atanh(rho0))
    assert float((rho - exact).abs().max()) < 1e-8


@pytest.mark.parametrize("n, rho0", [(4, 0.1), (5, -0.2)])
def test_equiangular_closed_form_at_beta_zero(n, rho0):
    """SA, beta = 0: (1 + (n-1) rho) / (1 - rho) = R0 e^{2t}."""
    x0 = equiangular(n, rho0)
    eye = torch.eye(n, dtype=D64)
    traj = simulate(x0, (eye, eye, eye), t1=1.5, steps=150, method="rk4", geometry="sphere", eps=1e12)
    R = (1 + (n - 1) * rho0) / (1 - rho0) * torch.exp(2 * traj.times)
    exact = (R - 1) / (R + n - 1)
    err = (off_diagonal(traj.positions) - exact[:, None]).abs().max()
    assert float(err) < 1e-8


@pytest.mark.parametrize("kind", ["softmax", "exp", "sinkhorn"])
@pytest.mark.parametrize("beta", [1.0, 4.0])
def test_equiangular_inner_product_obeys_the_scalar_ode(kind, beta):
    """All pairwise inner products stay equal and follow rho' = 2c(1-rho)(1+(n-1)rho); Sinkhorn = SA here."""
    n, rho0, t1 = 4, -0.15, 1.0
    x0 = equiangular(n, rho0)
    eye = torch.eye(n, dtype=D64)
    kw = {"tol": 1e-14} if kind == "sinkhorn" else {}
    steps = {"exp": 800, "softmax": 200, "sinkhorn": 100}[kind]  # USA moves e^beta / n times faster
    traj = simulate(x0, (eye, eye, eye), t1=t1, steps=steps, method="rk4", kind=kind, geometry="sphere",
                    eps=1 / beta, **kw)
    rho = off_diagonal(traj.final)
    assert float(rho.max() - rho.min()) < 1e-12
    assert abs(float(rho.mean()) - scalar_reference(kind, n, beta, rho0, t1)) < 1e-8
    assert float((traj.final.norm(dim=-1) - 1).abs().max()) < 1e-14


def _raw_rhs(kind, Q, K, V, beta, n, d):
    """The particle ODE on the sphere written out in numpy (an independent implementation)."""

    def rhs(t, flat):
        X = flat.reshape(n, d)
        C = beta * (X @ Q.T) @ (X @ K.T).T
        if kind == "softmax":
            P = np.exp(C - C.max(1, keepdims=True))
            P /= P.sum(1, keepdims=True)
        elif kind == "exp":
            P = np.exp(C) / n
        else:  # Sinkhorn: alternate row and column normalisations of exp(C) to a bistochastic matrix
            P = np.exp(C - C.max())
            for _ in range(20_000):
                P /= P.sum(1, keepdims=True)
                P /= P.sum(0, keepdims=True)
                if np.abs(P.sum(1) - 1).max() < 1e-14:
                    break
        F = P @ X @ V.T
        return (F - (F * X).sum(1, keepdims=True) * X).ravel()

    return rhs


@pytest.mark.parametrize("kind", ["softmax", "exp", "sinkhorn"])
def test_random_parameters_match_an_independent_integration(kind):
    """simulate(geometry="sphere", RK4) vs scipy's DOP853 on the raw ODE, random Q, K, V, beta = 2."""
    g = gen(5)
    n, d, beta, t1 = 6, 3, 2.0, 1.0
    Q, K, V = (torch.randn(d, d, dtype=D64, generator=g) / math.sqrt(d) for _ in range(3))
    x0 = on_sphere(torch.randn(n, d, dtype=D64, generator=g))
    kw = {"tol": 1e-14} if kind == "sinkhorn" else {}
    ours = simulate(x0, (Q, K, V), t1=t1, steps=100, method="rk4", kind=kind, geometry="sphere", eps=1 / beta, **kw)
    rhs = _raw_rhs(kind, Q.numpy(), K.numpy(), V.numpy(), beta, n, d)
    ref = solve_ivp(rhs, (0, t1), x0.numpy().ravel(), rtol=1e-12, atol=1e-13, method="DOP853")
    assert float(np.abs(ours.final.numpy().ravel() - ref.y[:, -1]).max()) < 1e-8
    assert float(np.abs(ours.final.numpy() - x0.numpy()).max()) > 0.05  # the tokens moved


def test_field_is_tangent_and_tokens_are_projected_like_layernorm():
    g = gen(6)
    x = 3 * torch.randn(2, 10, 4, dtype=D64, generator=g)
    params = tuple(torch.randn(4, 4, dtype=D64, generator=g) for _ in range(3))
    for kind in ("softmax", "exp", "sinkhorn", "l2", "causal"):
        v = velocity(x, params, kind, geometry="sphere")
        assert float((v * on_sphere(x)).sum(-1).abs().max()) < 1e-13
        # the field of the projected cloud, projected on the tangent space
        flat = velocity(on_sphere(x), params, kind)
        u = on_sphere(x)
        torch.testing.assert_close(v, flat - (flat * u).sum(-1, keepdim=True) * u, atol=1e-12, rtol=0)


@pytest.mark.parametrize("kind", ["softmax", "exp"])
def test_mean_field_on_the_circle_matches_the_bessel_closed_form(kind):
    """mu = (1 + a cos phi) dphi / 2pi on S^1, Q = K = V = I: the tangential field at angle theta is
    -a sin(theta) I1(beta) / (beta (I0(beta) + a cos(theta) I1(beta))) for SA, without the denominator
    (times e^0 = the I0 normalisation) for USA; a weighted cloud on a uniform grid (the trapezoidal rule,
    spectrally accurate for periodic integrands) is the mean-field measure."""
    a, beta, m = 0.6, 3.0, 256
    phi = torch.arange(m, dtype=D64) * 2 * math.pi / m
    cloud = torch.stack([phi.cos(), phi.sin()], -1)
    w = 1 + a * phi.cos()
    theta = torch.linspace(0, 2 * math.pi, 13, dtype=D64)[:-1]
    at = torch.stack([theta.cos(), theta.sin()], -1)
    eye = torch.eye(2, dtype=D64)
    v = velocity(cloud, (eye, eye, eye), kind, weights=w, at=at, eps=1 / beta, geometry="sphere")
    tangential = (v * torch.stack([-theta.sin(), theta.cos()], -1)).sum(-1)
    I0, I1 = (float(ive(k, beta)) * math.exp(beta) for k in (0, 1))
    numerator = -a * theta.sin() * I1 / beta
    exact = numerator / (I0 + a * theta.cos() * I1) if kind == "softmax" else numerator
    torch.testing.assert_close(tangential, exact, atol=1e-12, rtol=0)
    assert float((v * at).sum(-1).abs().max()) < 1e-14


def test_batched_parameters_equal_one_call_per_cloud():
    g = gen(8)
    x = torch.randn(3, 2, 7, 3, dtype=D64, generator=g)
    Q, K, V = (torch.randn(3, 2, 3, 3, dtype=D64, generator=g) for _ in range(3))
    for kind in ("softmax", "sinkhorn", "exp"):
        out = velocity(x, (Q, K, V), kind, geometry="sphere")
        for i in range(3):
            for j in range(2):
                ref = velocity(x[i, j], (Q[i, j], K[i, j], V[i, j]), kind, geometry="sphere")
                torch.testing.assert_close(out[i, j], ref, atol=1e-11, rtol=0)
    with pytest.raises(ValueError, match="must broadcast to the clouds' leading dimensions"):
        velocity(x, tuple(t[:, :1].expand(3, 4, 3, 3) for t in (Q, K, V)))


def test_sphere_options_are_validated():
    x = torch.randn(5, 3, dtype=D64)
    with pytest.raises(ValueError, match="geometry must be one of"):
        velocity(x, (I3, I3, I3), geometry="torus")
    with pytest.raises(ValueError, match="n_iters is only used by kind='causal'"):
        velocity(x, (I3, I3, I3), "softmax", n_iters=3)
    with pytest.raises(ValueError, match="a token of norm 0"):
        velocity(torch.cat([x, torch.zeros(1, 3, dtype=D64)]), (I3, I3, I3), geometry="sphere")
    with pytest.raises(ValueError, match="kind='causal' is the field at the tokens themselves"):
        velocity(x, (I3, I3, I3), "causal", at=x)
