"""Sinkformer energies (docs/theory.md §11): gradients, monotone decrease, Prop. 3, Gaussian closed form."""

import pytest
import torch
from dyn_helpers import D64, gen, rand_gaussian, rel, sample

from sinkformer import sinkhorn
from sinkformer.dynamics import energies as E
from sinkformer.dynamics import gaussian as G
from sinkformer.dynamics import simulate, velocity


def sym_A(kind, g, d=2):
    B = torch.randn(d, d, dtype=D64, generator=g)
    if kind == "negative":
        return -0.3 * B @ B.T
    return 0.4 * (B + B.T)  # indefinite


def finite_difference_gradient(F, x, h=1e-5):
    grad = torch.zeros_like(x)
    for idx in range(x.numel()):
        e = torch.zeros_like(x).view(-1)
        e[idx] = h
        e = e.view_as(x)
        grad.view(-1)[idx] = (F(x + e) - F(x - e)) / (2 * h)
    return grad


@pytest.mark.parametrize("a_kind", ["negative", "indefinite"])
def test_energy_gradients_are_minus_the_fields_over_n(a_kind):
    """dF/dx_i = -T(x_i)/N for F0 with k0 and F_inf with Sinkhorn (Assumption 1: V = -A)."""
    g = gen(21)
    A = sym_A(a_kind, g)
    x = torch.randn(15, 2, dtype=D64, generator=g)
    n = x.shape[0]
    eye = torch.eye(2, dtype=D64)
    t0 = E.t0_field(x, A, -A)
    assert rel(finite_difference_gradient(lambda z: E.f0(z, A), x), -t0 / n) < 1e-7
    t_inf = velocity(x, (A, eye, -A), "sinkhorn", tol=1e-13)
    assert rel(finite_difference_gradient(lambda z: E.f_inf(z, A), x), -t_inf / n) < 1e-7


def test_dual_form_equals_the_defining_integral_with_the_core_sinkhorn():
    g = gen(22)
    A = sym_A("indefinite", g, d=3)
    x = torch.randn(40, 3, dtype=D64, generator=g)
    C = x @ A @ x.T  # symmetric A: C_ij = x_j^T A x_i
    K = sinkhorn(C, None, tol=1e-13, max_iters=100_000)  # doubly stochastic: K = k_inf / N (rows sum to 1)
    k_inf = 40 * K
    integral = -0.5 * (k_inf * (k_inf.log() - C)).mean()
    assert abs(float(E.f_inf(x, A)) - float(integral)) < 1e-11


@pytest.mark.parametrize("a_kind", ["negative", "indefinite"])
def test_f_inf_decreases_along_the_sinkformer_flow(a_kind):
    g = gen(23)
    A = sym_A(a_kind, g)
    eye = torch.eye(2, dtype=D64)
    x0 = torch.randn(60, 2, dtype=D64, generator=g)
    h = 0.01
    traj = simulate(x0, (A, eye, -A), t1=60 * h, steps=60, kind="sinkhorn", tol=1e-12, energy=lambda z: E.f_inf(z, A))
    dF = traj.energies.diff()
    assert int((dF > 0).sum()) == 0
    # dF/dt = -(1/N) sum |T|^2, up to O(h)
    speed = torch.stack([velocity(z, (A, eye, -A), "sinkhorn", tol=1e-12).square().sum() / 60 for z in traj.positions[:-1]])
    assert float(((dF / h + speed) / speed).abs().median()) < 0.05


def test_softmax_jacobian_is_not_symmetric_but_sinkhorn_and_k0_are():
    g = gen(24)
    A = sym_A("indefinite", g)
    eye = torch.eye(2, dtype=D64)
    x = torch.randn(12, 2, dtype=D64, generator=g)
    assert E.jacobian_asymmetry(lambda z: E.t0_field(z, A, -A), x) < 1e-12
    assert E.jacobian_asymmetry(lambda z: velocity(z, (A, eye, -A), "sinkhorn", tol=1e-13), x) < 1e-8
    assert E.jacobian_asymmetry(lambda z: velocity(z, (A, eye, -A), "softmax"), x) > 0.1


def test_gaussian_f_inf_vs_particles_and_bures_wasserstein_gradient():
    g = gen(25)
    mean, cov = rand_gaussian(2, g)
    A = sym_A("indefinite", g) * 0.5
    x = sample(mean, cov, (4, 1000), g)
    estimate = E.f_inf(x, A, tol=1e-8).mean()
    exact = E.f_inf_gaussian(mean, cov, A)
    assert abs(float(estimate - exact)) / abs(float(exact)) < 0.1
    # Sinkhorn moment ODE (V = -A) is the Bures-Wasserstein gradient flow: dSigma = -2(G Sigma + Sigma G)
    grad = torch.zeros(2, 2, dtype=D64)
    h = 1e-6
    for i in range(2):
        for j in range(2):
            e = torch.zeros(2, 2, dtype=D64)
            e[i, j] = e[j, i] = h / (2 if i != j else 1)
            grad[i, j] = (E.f_inf_gaussian(mean, cov + e, A) - E.f_inf_gaussian(mean, cov - e, A)) / (2 * h)
    dmean, dcov = G.moments_rhs("sinkhorn", mean, cov, (A, torch.eye(2, dtype=D64), -A))
    assert rel(dcov, -2 * (grad @ cov + cov @ grad)) < 1e-7
    assert rel(dmean, -A @ mean) < 1e-14  # = -grad_alpha F_inf
