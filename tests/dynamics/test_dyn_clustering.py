"""Clustering diagnostics (docs/theory.md §16.4) against scipy, numpy and direct sums."""

import math

import numpy as np
import pytest
import torch
from dyn_helpers import D64, gen
from scipy.sparse.csgraph import connected_components

from sinkformer.dynamics import clustering as C
from sinkformer.dynamics.velocity import on_sphere


def clustered_cloud(g, centres=4, per=5, spread=0.03, d=3):
    c = on_sphere(torch.randn(centres, d, dtype=D64, generator=g))
    x = c.repeat_interleave(per, 0) + spread * torch.randn(centres * per, d, dtype=D64, generator=g)
    return x * (1 + torch.rand(centres * per, 1, dtype=D64, generator=g))  # lengths do not matter


def test_n_clusters_matches_scipy_connected_components_and_respects_the_mask():
    g = gen(41)
    for radius in (0.05, 0.3, 0.8):
        x = torch.randn(6, 20, 3, dtype=D64, generator=g)
        mask = torch.rand(6, 20, generator=g) > 0.3
        u = on_sphere(x)
        for b in range(6):
            keep = mask[b].numpy()
            dist = torch.cdist(u[b], u[b]).numpy()[np.ix_(keep, keep)]
            expected = connected_components(dist <= radius + 1e-12, directed=False)[0]
            assert int(C.n_clusters(x, radius, mask=mask)[b]) == expected
            assert int(C.n_clusters(x[b], radius)) == connected_components(torch.cdist(u[b], u[b]).numpy() <= radius)[0]


def test_single_cluster_is_a_diameter_and_ignores_padding():
    g = gen(42)
    x = clustered_cloud(g, centres=1, per=8, spread=0.01)
    assert bool(C.single_cluster(x, 0.1))
    far = torch.cat([x, -x[:1]])
    assert not bool(C.single_cluster(far, 0.1))
    mask = torch.ones(9, dtype=torch.bool)
    mask[-1] = False
    assert bool(C.single_cluster(far, 0.1, mask=mask))
    # a chain: linked neighbours (one cluster for single linkage) but a diameter above the radius
    theta = torch.arange(10, dtype=D64) * 0.08
    chain = torch.stack([theta.cos(), theta.sin()], -1)
    assert int(C.n_clusters(chain, 0.1)) == 1 and not bool(C.single_cluster(chain, 0.1))


def test_histogram_equals_numpy_over_the_pairs_i_less_than_j():
    g = gen(43)
    x = torch.randn(3, 15, 4, dtype=D64, generator=g)
    mask = torch.rand(3, 15, generator=g) > 0.2
    fractions, edges = C.inner_product_histogram(x, 12, mask=mask)
    u = on_sphere(x)
    for b in range(3):
        keep = mask[b]
        c = (u[b][keep] @ u[b][keep].T).numpy()
        values = c[np.triu_indices(int(keep.sum()), 1)]
        counts, _ = np.histogram(values, bins=edges.numpy())
        np.testing.assert_allclose(fractions[b].numpy(), counts / counts.sum(), atol=1e-15)


def test_span_dimension_is_the_rank_of_the_tokens():
    g = gen(44)
    basis = torch.randn(3, 8, dtype=D64, generator=g)
    x = torch.randn(2, 20, 3, dtype=D64, generator=g) @ basis  # 20 tokens in a 3-dimensional subspace of R^8
    assert C.span_dimension(x).tolist() == [3, 3]
    x[1, :, :] = torch.randn(20, 8, dtype=D64, generator=g)
    assert C.span_dimension(x).tolist() == [3, 8]
    mask = torch.zeros(2, 20, dtype=torch.bool)
    mask[:, :2] = True
    assert C.span_dimension(x, mask=mask).tolist() == [2, 2]


def test_interaction_energy_is_the_double_sum_and_one_for_a_single_cluster():
    g = gen(45)
    x = torch.randn(12, 3, dtype=D64, generator=g)
    w = torch.rand(12, dtype=D64, generator=g)
    A = torch.randn(3, 3, dtype=D64, generator=g)
    beta = 2.5
    u = on_sphere(x)
    wn = w / w.sum()
    direct = sum(float(wn[i] * wn[j]) * math.exp(beta * float(u[j] @ A @ u[i])) for i in range(12) for j in range(12))
    assert float(C.interaction_energy(x, beta, A=A, weights=w)) == pytest.approx(direct / (2 * beta), rel=1e-13)
    one = u[:1].repeat(7, 1) * torch.rand(7, 1, dtype=D64, generator=g)
    assert float(C.interaction_energy(one, 9.0, normalized=True)) == pytest.approx(1.0, abs=1e-14)
    # tight clusters far apart: close to the sum of the squared masses
    two = torch.cat([u[:1].repeat(3, 1), -u[:1].repeat(1, 1)])
    assert float(C.interaction_energy(two, 20.0, normalized=True)) == pytest.approx(0.75**2 + 0.25**2, abs=1e-13)
    # per-system beta broadcasts over a batch
    batch = torch.stack([x, -x])
    out = C.interaction_energy(batch, torch.tensor([1.0, 3.0], dtype=D64))
    assert out.shape == (2,) and float(out[1]) == pytest.approx(float(C.interaction_energy(x, 3.0)), rel=1e-14)


def test_diagnostics_equal_the_single_functions():
    g = gen(46)
    x = clustered_cloud(g).reshape(2, 10, 3)
    mask = torch.rand(2, 10, generator=g) > 0.2
    out = C.diagnostics(x, beta=4.0, bins=8, mask=mask)
    assert torch.equal(out["n_clusters"], C.n_clusters(x, mask=mask))
    assert torch.equal(out["single_cluster"], C.single_cluster(x, mask=mask))
    assert torch.equal(out["span_dimension"], C.span_dimension(x, mask=mask))
    torch.testing.assert_close(out["histogram"], C.inner_product_histogram(x, 8, mask=mask)[0])
    torch.testing.assert_close(out["energy"], C.interaction_energy(x, 4.0, weights=mask.double(), normalized=True))
    assert set(C.diagnostics(x, which=("n_clusters",))) == {"n_clusters"}
    with pytest.raises(ValueError, match="'energy' needs beta="):
        C.diagnostics(x, which=("energy",))
    with pytest.raises(ValueError, match="which must be one of"):
        C.diagnostics(x, which=("entropy",))


def test_hidden_states_of_a_hugging_face_encoder_are_a_trajectory():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=3, num_attention_heads=2,
                                     intermediate_size=32)
    model = transformers.AutoModel.from_config(config).eval()
    ids = torch.randint(0, 50, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 5:] = 0
    with torch.no_grad():
        hidden = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    traj = C.hidden_trajectory(hidden)
    assert traj.shape == (4, 2, 7, 16)
    assert torch.equal(traj[2], hidden[2])
    stats = C.diagnostics(traj, bins=10, mask=mask.bool().expand(4, 2, 7))
    assert stats["histogram"].shape == (4, 2, 10)
    torch.testing.assert_close(stats["histogram"][:, 1], C.inner_product_histogram(traj[:, 1, :5], 10)[0])


def test_bad_arguments_are_named():
    x = torch.randn(4, 3)
    with pytest.raises(ValueError, match=r"mask must have shape \(4,\)"):
        C.n_clusters(x, mask=torch.ones(5, dtype=torch.bool))
    with pytest.raises(ValueError, match="radius must be > 0"):
        C.single_cluster(x, 0.0)
    with pytest.raises(ValueError, match="beta must be > 0"):
        C.interaction_energy(x, 0.0)
    with pytest.raises(TypeError, match="hidden_states must be a non-empty tuple"):
        C.hidden_trajectory([])
