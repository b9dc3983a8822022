"""Causal particle systems (docs/theory.md §16.3): causal SoftMax and prefix-balanced causal Sinkhorn."""

import math

import numpy as np
import pytest
import torch
from dyn_helpers import D64, gen

from sinkformer.dynamics import simulate, velocity
from sinkformer.dynamics.phase import random_weights
from sinkformer.dynamics.velocity import on_sphere


def prefix_reference(x, params, n_iters, eps=1.0):
    """Row t of n_iters alternating normalisations (rows first) of exp(S) on the prefix 0..t alone, columns
    normalised to the causal marginals b_j = sum_{i=j}^t 1/(i+1) (docs/theory.md §3.7), times V x: numpy."""
    Q, K, V = (p.numpy() for p in params)
    X = x.numpy()
    S = (X @ Q.T) @ (X @ K.T).T / eps
    n = len(X)
    out = np.zeros_like(X)
    for t in range(n):
        P = np.tril(np.exp(S[: t + 1, : t + 1] - S[: t + 1, : t + 1].max()))
        b = np.array([sum(1.0 / (i + 1) for i in range(j, t + 1)) for j in range(t + 1)])
        for step in range(n_iters):
            if step % 2 == 0:
                P /= P.sum(1, keepdims=True)
            else:
                P *= b / P.sum(0)
        out[t] = P[t] @ X[: t + 1] @ V.T
    return torch.from_numpy(out)


def test_causal_softmax_is_the_masked_kind_in_token_order():
    g = gen(51)
    x = torch.randn(2, 9, 3, dtype=D64, generator=g)
    params = tuple(torch.randn(3, 3, dtype=D64, generator=g) for _ in range(3))
    positions = torch.arange(9, dtype=D64) / 9
    for geometry in ("euclidean", "sphere"):
        torch.testing.assert_close(velocity(x, params, "causal", geometry=geometry),
                                   velocity(x, params, "masked", token_positions=positions, geometry=geometry),
                                   atol=1e-13, rtol=0)


@pytest.mark.parametrize("n_iters", [2, 3, 4])
def test_causal_sinkhorn_balances_every_prefix_on_its_own(n_iters):
    g = gen(52)
    x = torch.randn(8, 3, dtype=D64, generator=g)
    params = tuple(torch.randn(3, 3, dtype=D64, generator=g) / math.sqrt(3) for _ in range(3))
    field = velocity(x, params, "causal", n_iters=n_iters, eps=0.5)
    torch.testing.assert_close(field, prefix_reference(x, params, n_iters, eps=0.5), atol=1e-12, rtol=0)


def test_no_token_sees_the_future():
    g = gen(53)
    x = torch.randn(10, 3, dtype=D64, generator=g)
    params = tuple(torch.randn(3, 3, dtype=D64, generator=g) for _ in range(3))
    later = x.clone()
    later[6:] += torch.randn(4, 3, dtype=D64, generator=g)
    for n_iters in (1, 3):
        a, b = (velocity(z, params, "causal", n_iters=n_iters, geometry="sphere") for z in (x, later))
        assert torch.equal(a[:6], b[:6]) and not torch.allclose(a[6:], b[6:])


@pytest.mark.parametrize("n_iters", [1, 3])
def test_every_token_converges_to_the_first_with_v_identity(n_iters):
    """Karagodin et al.: V = I, any Q, K: token 1 never moves and the others converge to it."""
    g = gen(54)
    Q, K, V = random_weights("gaussian", (), 3, value_identity=True, generator=g, dtype=D64)
    x0 = on_sphere(torch.randn(6, 3, dtype=D64, generator=g))
    traj = simulate(x0, (Q, K, V), t1=40.0, steps=400, kind="causal", n_iters=n_iters, geometry="sphere",
                    record_every=100)
    assert float((traj.positions[:, 0] - x0[0]).norm(dim=-1).max()) < 1e-14
    assert float((traj.final - x0[0]).norm(dim=-1).max()) < 1e-3
    assert float((traj.positions[1] - x0[0]).norm(dim=-1).max()) > 1e-2  # not there at t = 10 already
