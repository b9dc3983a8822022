"""Sinkhorn attention as a Schrödinger-bridge step vs the heat flow (docs/theory.md §10)."""

import math

import pytest
import torch
from dyn_helpers import D64, gen, rel, sample, slope

from sinkformer.dynamics import gaussian as G
from sinkformer.dynamics import heat as H
from sinkformer.dynamics.distances import w2_gaussian

S0 = torch.diag(torch.tensor([0.5, 1.0], dtype=D64))
M0 = torch.tensor([0.3, -0.2], dtype=D64)
EYE2 = torch.eye(2, dtype=D64)


def test_barycentric_closed_form_is_the_general_sinkhorn_formula():
    g = gen(31)
    W = torch.randn(2, 2, dtype=D64, generator=g)
    S = W @ W.T + 0.3 * EYE2
    for eps in (1.0, 0.3):
        Gm = H.barycentric_gaussian(S, eps)
        _, L = G.field("sinkhorn", M0, S, (EYE2, EYE2, EYE2), eps=eps)
        torch.testing.assert_close(Gm, L, atol=1e-13, rtol=0)
        torch.testing.assert_close(Gm @ S, S @ Gm, atol=1e-13, rtol=0)


def test_one_step_orders_three_and_two_with_the_predicted_constants():
    """W2(SB, heat) = eps^3/16 (sum s^-5)^1/2 + ..., W2(SB, EE) = eps^2/8 (sum s^-3)^1/2 + ... (exact Gaussians)."""
    s = torch.diagonal(S0)
    eps_list = [2.0**-k for k in range(5, 9)]
    sb_heat, sb_ee = [], []
    for eps in eps_list:
        m, c = H.sb_step_gaussian(M0, S0, eps)
        sb_heat.append(float(w2_gaussian(m, c, *H.heat_gaussian(M0, S0, eps))))
        sb_ee.append(float(w2_gaussian(m, c, *H.explicit_euler_gaussian(M0, S0, eps))))
    assert abs(slope(eps_list, sb_heat) - 3) < 0.05
    assert abs(slope(eps_list, sb_ee) - 2) < 0.02
    eps = eps_list[-1]
    assert sb_heat[-1] / (eps**3 / 16 * float(s.pow(-5).sum().sqrt())) == pytest.approx(1, abs=0.02)
    assert sb_ee[-1] / (eps**2 / 8 * float(s.pow(-3).sum().sqrt())) == pytest.approx(1, abs=0.01)


def test_t_over_eps_steps_approach_the_heat_flow_at_order_two():
    T = 1.0
    s = torch.diagonal(S0)
    eps_list = [0.05, 0.025, 0.0125]
    errs = []
    for eps in eps_list:
        m, c = H.sb_scheme_gaussian(M0, S0, eps, round(T / eps))
        errs.append(float(w2_gaussian(m, c, *H.heat_gaussian(M0, S0, T))))
    assert abs(slope(eps_list, errs) - 2) < 0.1
    eps = eps_list[-1]
    delta = eps**2 * T / (8 * s * (s + T))
    predicted = float((delta**2 / (4 * (s + T))).sum().sqrt())
    assert abs(errs[-1] / predicted - 1) < 0.02


def test_averaged_symmetric_sinkhorn_gives_the_pot_field():
    """A = I/eps is symmetric PSD: velocity() uses the averaged symmetric update; same field as POT."""
    import numpy as np
    import ot

    g = gen(35)
    x = sample(M0, S0, (200,), g)
    eps = 0.2
    res = H.barycentric_map(x, eps, tol=1e-12)
    a = np.full(200, 1 / 200)
    C = (x @ x.T / eps).numpy()
    plan = ot.sinkhorn(a, a, -C, reg=1.0, method="sinkhorn_log", stopThr=1e-13, numItermax=200_000)
    torch.testing.assert_close(res, 200 * torch.from_numpy(plan) @ x, atol=1e-9, rtol=0)


def test_particle_step_matches_the_gaussian_step_and_keeps_the_mean():
    g = gen(32)
    x = sample(M0, S0, (1500,), g)
    eps = 0.5
    y = H.sb_step(x, eps, tol=1e-10)
    assert (y.mean(0) - x.mean(0)).abs().max() < 1e-10  # column stochasticity: B preserves the mean
    emp_cov = torch.cov(x.T, correction=0)
    _, expected = H.sb_step_gaussian(x.mean(0), emp_cov, eps)  # closed form at the sample's moments
    assert rel(torch.cov(y.T, correction=0), expected) < 0.01
    # B on samples vs closed form (relative field error, 8 points)
    q = sample(M0, S0, (8,), g)
    B = H.barycentric_map(x, eps, at=q, tol=1e-10)
    cf = M0 + (q - M0) @ H.barycentric_gaussian(S0, eps).T
    assert rel(B, cf) < 0.05


def test_score_limit_has_the_factor_one_half():
    """(B - x)/eps -> (1/2) grad log rho: closed form with O(eps) error, and on particles (eps = 0.2)."""
    errs = []
    eps_list = [1e-1, 1e-2, 1e-3]
    for eps in eps_list:
        Gm = H.barycentric_gaussian(S0, eps)
        errs.append(rel((Gm - EYE2) / eps, -0.5 * torch.linalg.inv(S0)))
    assert abs(slope(eps_list, errs) - 1) < 0.05
    g = gen(33)
    x = torch.randn(2000, 2, dtype=D64, generator=g)  # rho = N(0, I): (1/2) grad log rho = -x/2
    eps = 0.2
    rescaled = (x - H.barycentric_map(x, eps, tol=1e-8)) / eps  # Sinkformer T-bar with V = -I
    c = float((rescaled * x).sum() / (x * x).sum())  # fit T-bar(x) ~ c x
    closed = float((EYE2 - H.barycentric_gaussian(EYE2, eps))[0, 0] / eps)
    assert abs(closed - 0.4751) < 1e-3  # docs/theory.md §10: 0.4751 at eps = 0.2, limit 0.5
    assert abs(c - closed) < 0.05 and abs(c - 1.0) > 0.4  # Sinkformers Thm 1 as printed would give 1


def test_particle_scheme_and_heat_map():
    g = gen(34)
    x0 = sample(M0, S0, (400,), g)
    traj = H.sb_scheme(x0, 0.25, 4, tol=1e-8)
    assert traj.positions.shape == (5, 400, 2) and math.isclose(float(traj.times[-1]), 1.0)
    m, c = H.sb_scheme_gaussian(x0.mean(0), torch.cov(x0.T, correction=0), 0.25, 4)
    assert rel(torch.cov(traj.final.T, correction=0), c) < 0.05
    pushed = H.heat_map(x0, M0, S0, 1.0)
    assert rel(torch.cov(pushed.T, correction=0), torch.cov(x0.T, correction=0) + EYE2) < 0.05
