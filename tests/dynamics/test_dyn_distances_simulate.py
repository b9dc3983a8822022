"""W2 distances and the particle integrators."""

import math

import pytest
import torch
from dyn_helpers import D64, gen, rand_params, rel

from sinkformer.dynamics import ParticleField, integrate, simulate, velocity
from sinkformer.dynamics.distances import conditional_w2, gaussian_ot_map, w2_gaussian, w2_particles


def bures(m1, S1, m2, S2):
    r = torch.linalg.eigh(S1)
    root = (r.eigenvectors * r.eigenvalues.sqrt()) @ r.eigenvectors.T
    inner = torch.linalg.eigvalsh(root @ S2 @ root).clamp_min(0).sqrt().sum()
    return math.sqrt(float((m1 - m2).square().sum() + S1.trace() + S2.trace() - 2 * inner))


def test_w2_gaussian_matches_bures_and_resolves_tiny_distances():
    g = gen(41)
    W1, W2 = torch.randn(3, 3, dtype=D64, generator=g), torch.randn(3, 3, dtype=D64, generator=g)
    S1, S2 = W1 @ W1.T + 0.1 * torch.eye(3, dtype=D64), W2 @ W2.T + 0.1 * torch.eye(3, dtype=D64)
    m1, m2 = torch.randn(3, dtype=D64, generator=g), torch.randn(3, dtype=D64, generator=g)
    assert float(w2_gaussian(m1, S1, m2, S2)) == pytest.approx(bures(m1, S1, m2, S2), rel=1e-10)
    T = gaussian_ot_map(S1, S2)
    torch.testing.assert_close(T @ S1 @ T.T, S2, atol=1e-10, rtol=0)
    # commuting covariances differing by 1e-12: W2 = ||S1^1/2 - S2^1/2||_F, far below Bures' 1e-8 floor
    D1 = torch.diag(torch.tensor([0.5, 1.0, 2.0], dtype=D64))
    D2 = D1 + 1e-12 * torch.eye(3, dtype=D64)
    exact = float((D1.sqrt() - D2.sqrt()).norm())
    assert float(w2_gaussian(m1, D1, m1, D2)) == pytest.approx(exact, rel=1e-3)


def test_w2_particles_and_conditional_w2():
    g = gen(42)
    x = torch.randn(50, 2, dtype=D64, generator=g)
    shift = torch.tensor([0.3, -0.4], dtype=D64)
    assert w2_particles(x, x[torch.randperm(50, generator=g)]) == pytest.approx(0, abs=1e-7)  # sqrt of rounding
    assert w2_particles(x, x + shift) == pytest.approx(0.5, rel=1e-12)
    s = (torch.arange(50) % 5).to(D64) / 5  # five positions, ten tokens each
    y = x[torch.randperm(50, generator=g)]
    # the plain W2 may swap tokens across positions, the conditional one may not
    assert conditional_w2(x, s, y, s) >= w2_particles(x, y) - 1e-12
    assert conditional_w2(x, s, x + shift, s) == pytest.approx(0.5, rel=1e-12)
    with pytest.raises(ValueError, match="same set of token positions"):
        conditional_w2(x, s, y, s + 0.1)


def test_rk4_is_fourth_order_and_euler_first_order_on_particles():
    g = gen(43)
    params = rand_params(d=2, k=2, g=g)
    x0 = torch.randn(30, 2, dtype=D64, generator=g)
    ref = simulate(x0, params, 1.0, 400, method="rk4").final
    e4 = [rel(simulate(x0, params, 1.0, n, method="rk4").final, ref) for n in (10, 20)]
    e1 = [rel(simulate(x0, params, 1.0, n).final, ref) for n in (50, 100)]
    assert 12 < e4[0] / e4[1] < 20
    assert 1.8 < e1[0] / e1[1] < 2.2


def test_time_dependent_layers_records_and_energies():
    g = gen(44)
    layers = [rand_params(d=2, k=2, g=g) for _ in range(3)]
    x0 = torch.randn(10, 2, dtype=D64, generator=g)
    traj = simulate(x0, lambda t: layers[int(t)], t1=3.0, steps=3, energy=lambda z: z.square().sum())
    x = x0
    for p in layers:  # three different residual layers
        x = x + velocity(x, p)
    torch.testing.assert_close(traj.final, x, atol=1e-13, rtol=0)
    assert traj.energies.shape == (4,) and float(traj.energies[-1]) == pytest.approx(float(x.square().sum()))
    sparse = simulate(x0, layers[0], t1=1.0, steps=10, record_every=4)
    assert sparse.times.tolist() == pytest.approx([0.0, 0.4, 0.8, 1.0])


def test_warm_started_flow_equals_cold_flow():
    g = gen(45)
    params = rand_params(d=2, k=2, g=g)
    x0 = torch.randn(80, 2, dtype=D64, generator=g)
    warm = ParticleField(params, "sinkhorn", tol=1e-11)
    traj = integrate(warm, x0, 0.5, 10, method="rk4")
    x = x0
    h = 0.05
    cold = lambda z: velocity(z, params, "sinkhorn", tol=1e-11)  # noqa: E731
    for _ in range(10):
        k1 = cold(x)
        k2 = cold(x + h / 2 * k1)
        k3 = cold(x + h / 2 * k2)
        k4 = cold(x + h * k3)
        x = x + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
    torch.testing.assert_close(traj.final, x, atol=1e-9, rtol=0)
    assert warm.sinkhorn_iters > 0
