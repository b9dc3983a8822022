"""sinkformer.dynamics.velocity: every kind against a direct formula, POT or torch."""

import numpy as np
import ot
import pytest
import torch
import torch.nn.functional as F

from sinkformer.dynamics import from_multihead, simulate, velocity

D64 = torch.float64


def rand_params(d=3, k=2, s=0.5, gen=None):
    return tuple(s * torch.randn(*shape, dtype=D64, generator=gen) for shape in ((k, d), (k, d), (d, d)))


def direct(x, params, kind, w=None, eps=1.0):
    """Literal docs/theory.md §6 sums for one head (float64)."""
    Q, K, V = params
    n = x.shape[0]
    w = torch.full((n,), 1.0 / n, dtype=D64) if w is None else w / w.sum()
    S = (x @ Q.T) @ (x @ K.T).T / eps
    if kind == "l2":
        S = -((x @ Q.T)[:, None, :] - (x @ K.T)[None, :, :]).square().sum(-1) / (2 * eps)
    if kind in ("softmax", "l2"):
        P = torch.softmax(S + w.log(), -1)
    else:
        sigma = {"linear": lambda s: s, "sigmoid": torch.sigmoid, "relu": torch.relu}[kind]
        P = sigma(S) * w
    return P @ x @ V.T


@pytest.mark.parametrize("kind", ["softmax", "l2", "linear", "sigmoid", "relu"])
def test_kinds_match_direct_sums_with_weights_and_eps(kind):
    x = torch.randn(40, 3, dtype=D64)
    params = rand_params()
    w = torch.rand(40, dtype=D64) + 0.1
    out = velocity(x, params, kind, weights=w, eps=0.7)
    torch.testing.assert_close(out, direct(x, params, kind, w, eps=0.7), atol=1e-12, rtol=0)


def test_sinkhorn_matches_pot_and_is_bistochastic():
    n = 200
    x = torch.randn(n, 3, dtype=D64)
    Q, K, V = rand_params(k=3)
    C = ((x @ Q.T) @ (x @ K.T).T).numpy()
    a = np.full(n, 1.0 / n)
    plan = ot.sinkhorn(a, a, -C, reg=1.0, method="sinkhorn_log", stopThr=1e-14, numItermax=100_000)
    ref = n * torch.from_numpy(plan) @ x @ V.T  # K_inf = N P (docs/theory.md §6.4)
    res = velocity(x, (Q, K, V), "sinkhorn", tol=1e-12, return_result=True)
    assert res.converged and res.sinkhorn_iters > 2
    torch.testing.assert_close(res.field, ref, atol=1e-10, rtol=0)
    # the exact identity E_mu[Gamma] = V E_mu[x] (column stochasticity)
    torch.testing.assert_close(res.field.mean(0), x.mean(0) @ V.T, atol=1e-11, rtol=0)


def test_sinkhorn_out_of_sample_and_weights_equal_duplicated_points():
    x = torch.randn(60, 2, dtype=D64)
    params = rand_params(d=2)
    inside = velocity(x, params, "sinkhorn", tol=1e-12)
    torch.testing.assert_close(velocity(x, params, "sinkhorn", at=x[:7].clone(), tol=1e-12), inside[:7],
                               atol=1e-12, rtol=0)
    # weight 3 on point 0 is the same measure as point 0 repeated three times
    w = torch.ones(60, dtype=D64)
    w[0] = 3.0
    dup = torch.cat([x, x[:1], x[:1]])
    torch.testing.assert_close(velocity(x, params, "sinkhorn", weights=w, tol=1e-12),
                               velocity(dup, params, "sinkhorn", tol=1e-12)[:60], atol=1e-10, rtol=0)
    # zero weight: the point is a test particle, the others do not see it
    w0 = torch.ones(60, dtype=D64)
    w0[5] = 0.0
    keep = torch.arange(60) != 5
    torch.testing.assert_close(velocity(x, params, "sinkhorn", weights=w0, tol=1e-12)[keep],
                               velocity(x[keep], params, "sinkhorn", tol=1e-12), atol=1e-10, rtol=0)


def test_masked_is_causal_attention_and_positions_order_the_mask():
    n = 30
    x = torch.randn(n, 3, dtype=D64)
    Q, K, V = rand_params(k=3)
    s = torch.arange(n, dtype=D64) / n
    ref = F.scaled_dot_product_attention(x @ Q.T, x @ K.T, x @ V.T, is_causal=True, scale=1.0)
    torch.testing.assert_close(velocity(x, (Q, K, V), "masked", token_positions=s), ref, atol=1e-13, rtol=0)
    perm = torch.randperm(n)  # the mask follows the positions, not the storage order
    out = velocity(x[perm], (Q, K, V), "masked", token_positions=s[perm])
    torch.testing.assert_close(out, ref[perm], atol=1e-13, rtol=0)
    at = velocity(x, (Q, K, V), "masked", token_positions=s, at=x[:4].clone(), at_positions=s[:4])
    torch.testing.assert_close(at, ref[:4], atol=1e-13, rtol=0)


@pytest.mark.parametrize("kind", ["softmax", "sinkhorn", "relu"])
def test_multihead_is_the_sum_of_heads(kind):
    x = torch.randn(50, 4, dtype=D64)
    heads = [rand_params(d=4, k=2), rand_params(d=4, k=1)]  # different k: zero-padded internally
    total = sum(velocity(x, h, kind, tol=1e-12) for h in heads)
    torch.testing.assert_close(velocity(x, heads, kind, tol=1e-12), total, atol=1e-11, rtol=0)


def test_residual_multihead_layers_are_euler_steps_of_step_one():
    torch.manual_seed(3)
    mha = torch.nn.MultiheadAttention(4, 2, bias=False, batch_first=True).double()
    x0 = torch.randn(1, 12, 4, dtype=D64)
    x = x0
    for _ in range(3):  # three tied residual layers
        x = x + mha(x, x, x, need_weights=False)[0]
    traj = simulate(x0, from_multihead(mha), t1=3.0, steps=3, method="euler")
    torch.testing.assert_close(traj.final, x.detach(), atol=1e-12, rtol=0)


@pytest.mark.parametrize("kind", ["softmax", "sinkhorn", "masked", "linear"])
def test_chunked_equals_dense_and_batches_are_independent(kind):
    x = torch.randn(2, 3, 45, 2, dtype=D64)
    params = rand_params(d=2)
    kw = {"token_positions": torch.rand(45, dtype=D64)} if kind == "masked" else {"tol": 1e-12}
    dense = velocity(x, params, kind, **kw)
    torch.testing.assert_close(velocity(x, params, kind, chunk_size=7, **kw), dense, atol=1e-12, rtol=0)
    torch.testing.assert_close(velocity(x[1, 2], params, kind, **kw), dense[1, 2], atol=1e-11, rtol=0)


def test_warm_start_cuts_iterations():
    x = torch.randn(300, 2, dtype=D64)
    params = rand_params(d=2, k=2, s=1.0)
    cold = velocity(x, params, "sinkhorn", tol=1e-9, return_result=True)
    moved = x + 1e-3 * cold.field  # one small time step: the old potential is close to the new one
    warm = velocity(moved, params, "sinkhorn", tol=1e-9, warm_start=cold.potential, return_result=True)
    again = velocity(moved, params, "sinkhorn", tol=1e-9, return_result=True)
    # linear convergence: iterations ~ log(initial error / tol), initial error ~1e-3 instead of ~1
    assert warm.sinkhorn_iters < 0.8 * again.sinkhorn_iters
    torch.testing.assert_close(warm.field, again.field, atol=1e-8, rtol=0)


def test_float32_input_gives_float32_output():
    x = torch.randn(20, 2)
    out = velocity(x, rand_params(d=2), "sinkhorn", tol=1e-5)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


def test_errors_name_the_argument():
    x = torch.randn(10, 3, dtype=D64)
    params = rand_params()
    with pytest.raises(ValueError, match="kind must be one of"):
        velocity(x, params, "cosine")
    with pytest.raises(ValueError, match="token_positions"):
        velocity(x, params, "masked")
    with pytest.raises(ValueError, match=r"params: expected Q, K of shape \(k, 3\)"):
        velocity(x, rand_params(d=2))
    with pytest.raises(TypeError, match="params must be a triple"):
        velocity(x, torch.eye(3))
    with pytest.raises(ValueError, match="weights must be non-negative"):
        velocity(x, params, weights=-torch.ones(10, dtype=D64))
    with pytest.raises(ValueError, match="eps must be a positive float"):
        velocity(x, params, eps=0.0)
    with pytest.raises(ValueError, match="warm_start must have shape"):
        velocity(x, params, "sinkhorn", warm_start=torch.zeros(10, dtype=D64))
    with pytest.warns(UserWarning, match="Sinkhorn did not reach"):
        velocity(x, params, "sinkhorn", tol=1e-15, max_iters=3)
