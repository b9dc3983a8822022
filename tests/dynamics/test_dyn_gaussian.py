"""Gaussian closed forms (docs/theory.md §7–9) against particles, ODE integrators and algebra."""

import math

import pytest
import torch
from dyn_helpers import D64, gen, rand_gaussian, rand_params, rel, sample

from sinkformer.dynamics import gaussian as G
from sinkformer.dynamics import simulate, velocity

EYE2, EYE3 = torch.eye(2, dtype=D64), torch.eye(3, dtype=D64)


def field_error(kind, params, mean, cov, n, reps, g, eps=1.0):
    """docs/theory.md §5 'field rel.err': max over 8 query points of |emp - cf| / max |cf|, mean over reps."""
    x = sample(mean, cov, (reps, n), g)
    queries = sample(mean, cov, (reps, 8), g)
    b, L = G.field(kind, mean, cov, params, eps)
    cf = b + queries @ L.T
    emp = velocity(x, params, kind, at=queries, eps=eps, tol=1e-7)
    return float(((emp - cf).norm(dim=-1).amax(-1) / cf.norm(dim=-1).amax(-1)).mean())


# (kind, params maker, N small, N large, reps). The error must drop like N^-1/2: ratio sqrt(N2/N1).
SCALING = [
    ("softmax", lambda g: rand_params(g=g), 250, 4000, 8),
    ("linear", lambda g: rand_params(g=g), 250, 4000, 8),
    ("l2", lambda g: rand_params(g=g), 250, 4000, 8),
    ("multihead", lambda g: [rand_params(d=4, k=2, s=0.3, g=g) for _ in range(2)], 250, 4000, 8),
    ("sinkhorn", lambda g: rand_params(g=g), 200, 1600, 4),
]


@pytest.mark.parametrize("kind, make, n1, n2, reps", SCALING, ids=[s[0] for s in SCALING])
def test_field_closed_form_vs_particles_error_scales_like_inverse_sqrt_n(kind, make, n1, n2, reps):
    g = gen(7)
    params = make(g)
    d = 4 if kind == "multihead" else 3
    mean, cov = rand_gaussian(d, g, scale=0.4 if kind == "multihead" else 0.6)  # mild tilts (docs/theory.md §7.4)
    kind = "softmax" if kind == "multihead" else kind
    e1 = field_error(kind, params, mean, cov, n1, reps, g)
    e2 = field_error(kind, params, mean, cov, n2, reps, g)
    expected = math.sqrt(n2 / n1)
    assert e2 < 0.06
    assert expected / 1.8 < e1 / e2 < expected * 1.8, (e1, e2)


def test_sinkhorn_field_with_rank_deficient_A_and_temperature():
    g = gen(11)
    params = rand_params(d=3, k=2, g=g)  # A = K^T Q has rank 2: no inverse anywhere
    mean, cov = rand_gaussian(3, g)
    assert field_error("sinkhorn", params, mean, cov, 1000, 2, g, eps=0.7) < 0.07


def test_sinkhorn_coupling_algebra():
    """The Gaussian EOT coupling: joint precision block -A^T, d=1 form, mean identity."""
    g = gen(1)
    Q, K, V = rand_params(d=3, k=3, g=g)
    mean, cov = rand_gaussian(3, g)
    _, L = G.field("sinkhorn", mean, cov, (Q, K, EYE3))
    C = cov @ L.T  # C = Cov_pi(x, y): L = C^T Sigma^-1
    joint = torch.cat([torch.cat([cov, C], 1), torch.cat([C.T, cov], 1)])
    precision = torch.linalg.inv(joint)
    torch.testing.assert_close(precision[:3, 3:], -(K.T @ Q).T, atol=1e-12, rtol=0)
    # d = 1: C = (sqrt(1 + 4 a^2 s^2) - 1) / (2a), field slope C / s
    a, v, s = 0.8, -0.6, 1.7
    one = lambda z: torch.tensor([[z]], dtype=D64)  # noqa: E731
    _, L1 = G.field("sinkhorn", torch.zeros(1, dtype=D64), one(s), (one(a), one(1.0), one(v)))
    c = (math.sqrt(1 + 4 * a * a * s * s) - 1) / (2 * a)
    assert abs(float(L1) - v * c / s) < 1e-14
    # dα/dt = Vα for every kind of A
    dmean, _ = G.moments_rhs("sinkhorn", mean, cov, (Q, K, V))
    torch.testing.assert_close(dmean, V @ mean, atol=1e-14, rtol=0)


@pytest.mark.parametrize("kind, n, bound_star", [("softmax", 1000, 0.03), ("l2", 1000, 0.01),
                                                 ("sinkhorn", 400, 0.01), ("multihead", 1000, 0.01)])
def test_moment_ode_vs_euler_particles(kind, n, bound_star):
    """Euler particles vs the EulerG recursion (same step) from the true moments (sampling error,
    docs/theory.md §5 'vs EulerG') and from the sample's own moments ('vs EulerG*', much smaller)."""
    g = gen(3)
    if kind == "multihead":
        params, d = [rand_params(d=4, k=2, s=0.3, g=g) for _ in range(2)], 4
    else:
        params, d = rand_params(g=g), 3
    mean, cov = rand_gaussian(d, g, scale=0.4 if kind == "multihead" else 0.6)
    gkind = "softmax" if kind == "multihead" else kind
    x0 = sample(mean, cov, (n,), g)
    xs = simulate(x0, params, t1=0.5, steps=20, kind=gkind, tol=1e-6).final
    eulerg = G.flow(gkind, mean, cov, params, t1=0.5, steps=20, method="euler")
    star = G.flow(gkind, x0.mean(0), torch.cov(x0.T, correction=0), params, t1=0.5, steps=20, method="euler")
    emp = torch.cov(xs.T, correction=0)
    assert rel(emp, eulerg.cov[-1]) < 3 / math.sqrt(n)
    assert rel(emp, star.cov[-1]) < bound_star
    assert rel(xs.mean(0), eulerg.mean[-1]) < 0.1
    assert rel(eulerg.cov[-1], cov) > 0.1  # the covariance did move


def test_linear_moments_close_for_any_measure_and_sinkhorn_mean_is_exact():
    """Linear: the moment ODE holds for the empirical measure itself (EulerG* exact). Sinkhorn: α' = Vα exactly."""
    g = gen(4)
    params = rand_params(g=g)
    x0 = torch.rand(300, 3, dtype=D64, generator=g)  # not Gaussian
    emp_mean, emp_cov = x0.mean(0), torch.cov(x0.T, correction=0)
    traj = simulate(x0, params, t1=0.5, steps=20, kind="linear")
    ref = G.flow("linear", emp_mean, emp_cov, params, t1=0.5, steps=20, method="euler")
    assert rel(torch.cov(traj.final.T, correction=0), ref.cov[-1]) < 1e-12
    sk = simulate(x0, params, t1=0.5, steps=20, kind="sinkhorn", tol=1e-12)
    V = params[2]
    expected = emp_mean
    for _ in range(20):
        expected = expected + 0.025 * V @ expected
    assert rel(sk.final.mean(0), expected) < 1e-10


def test_euler_recursion_is_first_order_and_rk4_fourth_order():
    g = gen(5)
    params = rand_params(g=g)
    mean, cov = rand_gaussian(3, g)
    ref = G.flow("softmax", mean, cov, params, t1=0.5, steps=4000).cov[-1]
    err = {n: rel(G.flow("softmax", mean, cov, params, t1=0.5, steps=n, method="euler").cov[-1], ref) for n in (20, 40)}
    assert 1.8 < err[20] / err[40] < 2.2
    err4 = {n: rel(G.flow("softmax", mean, cov, params, t1=0.5, steps=n).cov[-1], ref) for n in (5, 10)}
    assert 12 < err4[5] / err4[10] < 20


# ---------------------------------------------------------------- Riccati (docs/theory.md §8)


def riccati_case(seed=0, d=3):
    g = gen(seed)
    B = torch.randn(d, d, dtype=D64, generator=g)
    A = 0.5 * (B + B.T)
    W = torch.randn(d, d, dtype=D64, generator=g)
    return A, W @ W.T / d + 0.3 * torch.eye(d, dtype=D64)  # A and Sigma0 do not commute


def test_riccati_closed_form_vs_integrator():
    A, cov0 = riccati_case()
    mean0 = torch.tensor([0.3, -0.2, 0.5], dtype=D64)
    t_star = G.blowup_time(cov0, A)
    out = G.flow("softmax", mean0, cov0, (A, EYE3, EYE3), t1=0.9 * t_star, steps=4000, record_every=400)
    closed = G.riccati(cov0, A, out.times)
    assert max(rel(c, r) for c, r in zip(out.cov, closed)) < 1e-8
    assert rel(out.mean[-1], G.riccati_mean(mean0, cov0, A, out.times[-1])) < 1e-8
    assert rel(out.flow_map[-1], G.riccati_flow_map(cov0, A, out.times[-1])) < 1e-8
    # V symmetric, commuting with a non-symmetric A and with Sigma0: only sym(A) enters
    S = torch.diag(torch.tensor([1.0, 1.0, 2.0], dtype=D64))
    V = torch.diag(torch.tensor([0.7, 0.7, -0.4], dtype=D64))
    A_ns = torch.tensor([[-0.3, 0.4, 0.0], [-0.1, 0.2, 0.0], [0.0, 0.0, -0.1]], dtype=D64)
    out = G.flow("softmax", torch.zeros(3, dtype=D64), S, (A_ns, EYE3, V), t1=1.0, steps=2000)
    assert rel(out.cov[-1], G.riccati(S, A_ns, 1.0, V)) < 1e-9
    # negative control: V not commuting with A, the closed form does not apply and says so
    V_bad = torch.diag(torch.tensor([0.7, -0.4, 0.2], dtype=D64))
    with pytest.raises(ValueError, match="V A = A V"):
        G.riccati(S, A_ns, 1.0, V_bad)


def test_riccati_particle_flow_map():
    """RK4 particles (N=2000, A/3) follow x(t) = alpha(t) + M(t)(x0 - alpha0) up to sampling error."""
    A, cov0 = riccati_case(seed=2)
    A = A / 3
    mean0 = torch.tensor([0.2, 0.1, -0.3], dtype=D64)
    T = G.blowup_time(cov0, A) / 2
    g = gen(2)
    x0 = sample(mean0, cov0, (2000,), g)
    traj = simulate(x0, (A, EYE3, EYE3), t1=T, steps=10, method="rk4")
    target = G.riccati_mean(mean0, cov0, A, T) + (x0 - mean0) @ G.riccati_flow_map(cov0, A, T).T
    err = float((traj.final - target).norm(dim=-1).mean() / target.norm(dim=-1).mean())
    assert err < 0.04


def test_blowup_is_detected_at_the_riccati_time():
    A, cov0 = riccati_case()
    t_star = G.blowup_time(cov0, A)
    out = G.flow("softmax", torch.zeros(3, dtype=D64), cov0, (A, EYE3, EYE3), t1=2 * t_star, steps=2000)
    assert abs(float(out.blowup_time) - t_star) < 1e-3 * t_star
    assert float(out.times[-1]) < t_star * 1.01 and torch.isfinite(out.cov).all()
    # d = 1: sigma(t) = s0 / (1 - 2 v a s0 t), t* = 1 / (2 v a s0)
    a, v, s0 = 0.5, 2.0, 0.8
    one = lambda z: torch.tensor([[z]], dtype=D64)  # noqa: E731
    assert G.blowup_time(one(s0), one(v * a)) == pytest.approx(1 / (2 * v * a * s0), rel=1e-14)
    sig = G.riccati(one(s0), one(a), 0.3, one(v))
    assert float(sig) == pytest.approx(s0 / (1 - 2 * v * a * s0 * 0.3), rel=1e-14)
    assert G.blowup_time(cov0, -A @ A) == math.inf


def test_rank_deficient_limit_is_reached_and_has_the_kernel_rank():
    g = gen(8)
    q = torch.randn(1, 3, dtype=D64, generator=g)
    A = -q.T @ q  # rank 1, negative: Sigma -> rank-2 limit (clustering onto a plane)
    _, cov0 = riccati_case(seed=8)
    limit = G.riccati_limit(cov0, A)
    assert int(torch.linalg.matrix_rank(limit, atol=1e-9)) == 2
    assert rel(G.riccati(cov0, A, 1e8), limit) < 1e-6  # Sigma(t) - Sigma_inf = O(1/t)
    out = G.flow("softmax", torch.zeros(3, dtype=D64), cov0, (A, EYE3, EYE3), t1=100.0, steps=1000)
    assert rel(out.cov[-1], G.riccati(cov0, A, 100.0)) < 1e-6
    assert rel(out.cov[-1], limit) < 5e-3
    # Euler steps far beyond stability: the naive update Sigma + h dSigma leaves the PSD cone,
    # the factor recursion R <- (I + hL)R cannot
    h = 0.5
    naive = cov0 + h * G.moments_rhs("softmax", torch.zeros(3, dtype=D64), cov0, (A, EYE3, EYE3))[1]
    assert float(torch.linalg.eigvalsh(naive).min()) < 0
    big = G.flow("softmax", torch.zeros(3, dtype=D64), cov0, (A, EYE3, EYE3), t1=20 * h, steps=20, method="euler")
    assert float(torch.linalg.eigvalsh(big.cov).min()) > -1e-9 * float(big.cov.abs().max())
    with pytest.raises(ValueError, match="blows up"):
        G.riccati_limit(cov0, -A)


@pytest.mark.parametrize("kind", ["softmax", "l2", "sinkhorn", "linear"])
def test_batched_parameters_equal_a_loop(kind):
    g = gen(10)
    params = [rand_params(g=g) for _ in range(4)]
    stacked = tuple(torch.stack(t) for t in zip(*params))
    mean, cov = rand_gaussian(3, g)
    b, L = G.field(kind, mean.expand(4, 3), cov.expand(4, 3, 3), stacked)
    for i, p in enumerate(params):
        bi, Li = G.field(kind, mean, cov, p)
        torch.testing.assert_close((b[i], L[i]), (bi, Li), atol=1e-13, rtol=0)


def test_flow_stops_when_converged_and_batches():
    g = gen(9)
    covs = torch.stack([rand_gaussian(2, g)[1] for _ in range(5)])
    B = torch.randn(2, 2, dtype=D64, generator=g)
    A = -(B @ B.T)  # negative definite: every member converges to 0
    out = G.flow("softmax", torch.zeros(5, 2, dtype=D64), covs, (A, EYE2, EYE2), t1=1e4, steps=100_000,
                 method="euler", stop_below=1e-3)
    assert bool(out.converged.all()) and out.times[-1] < 1e4
    assert out.cov.shape[1:] == (5, 2, 2)


# ---------------------------------------------------------------- non-affine fields (docs/theory.md §7.6)


@pytest.mark.parametrize("kind", ["relu", "sigmoid"])
def test_pointwise_fields_vs_particles(kind):
    g = gen(12)
    params = rand_params(g=g)
    mean, cov = rand_gaussian(3, g)
    fn = G.relu_field if kind == "relu" else G.sigmoid_field
    errs = []
    for n in (500, 8000):
        x = sample(mean, cov, (6, n), g)
        q = sample(mean, cov, (6, 8), g)
        cf = fn(q, mean, cov, params)
        emp = velocity(x, params, kind, at=q)
        errs.append(float(((emp - cf).norm(dim=-1).amax(-1) / cf.norm(dim=-1).amax(-1)).mean()))
    assert errs[1] < 0.05 and 4 / 1.8 < errs[0] / errs[1] < 4 * 1.8


def test_masked_field_vs_particles():
    g = gen(13)
    params = rand_params(g=g)
    mean, cov = rand_gaussian(3, g)
    drift = torch.tensor([0.5, -0.3, 0.2], dtype=D64)
    n = 8000
    s = torch.rand(n, dtype=D64, generator=g)
    x = mean + s[:, None] * drift + sample(torch.zeros(3, dtype=D64), cov, (n,), g)
    qs = torch.full((8,), 1.0, dtype=D64)
    q = mean + drift + sample(torch.zeros(3, dtype=D64), cov, (8,), g)
    cf = G.masked_field(q, qs, mean, drift, cov, params)
    emp = velocity(x, params, "masked", token_positions=s, at=q, at_positions=qs)
    assert rel(emp, cf) < 0.05
    # b -> 0 limit of tau is s/2 (no cancellation blow-up)
    tiny = G.masked_field(torch.zeros(1, 3), torch.tensor([0.5]), mean, drift, cov, params)
    assert torch.isfinite(tiny).all()


# ---------------------------------------------------------------- drifting model (docs/theory.md §9)


def test_drifting_closed_forms():
    g = gen(14)
    mean0, cov0 = rand_gaussian(2, g)
    tmean, tcov = rand_gaussian(2, g)
    out = G.drifting_flow(mean0, cov0, tmean, tcov, t1=3.0, steps=600, record_every=100)
    torch.testing.assert_close(out.mean, G.drifting_mean(out.times, mean0, tmean, tcov), atol=1e-12, rtol=0)
    far = G.drifting_flow(mean0, cov0, tmean, tcov, t1=200.0, steps=1000)
    assert rel(far.cov[-1], tcov) < 1e-8 and rel(far.mean[-1], tmean) < 1e-8
    # field of samples: m_q - m_p with both measures from 8000 samples
    p = sample(mean0, cov0, (8000,), g)
    qs = sample(tmean, tcov, (8000,), g)
    b, L = G.drifting_field(mean0, cov0, tmean, tcov)
    pts = sample(mean0, cov0, (8,), g)
    unit = (EYE2, EYE2, EYE2)
    emp = velocity(qs, unit, "l2", at=pts) - velocity(p, unit, "l2", at=pts)
    assert rel(emp, b + pts @ L.T) < 0.08
    # d = 1: sigma' = 2 sigma (sigma_q - sigma) / ((1 + sigma)(1 + sigma_q))
    _, dcov = G.moments_rhs("l2", torch.zeros(1), torch.tensor([[1.0]]), (torch.eye(1),) * 3)
    b1, L1 = G.drifting_field(torch.zeros(1), torch.tensor([[0.5]]), torch.zeros(1), torch.tensor([[2.0]]))
    assert float(2 * L1 * 0.5) == pytest.approx(2 * 0.5 * (2.0 - 0.5) / (1.5 * 3.0), rel=1e-14)
    assert dcov.shape == (1, 1)
