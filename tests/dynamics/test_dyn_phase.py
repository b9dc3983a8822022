"""Phase diagrams (docs/theory.md §16.6): the batch equals single simulations; weight ensembles and layers."""

import pytest
import torch
from dyn_helpers import D64

from sinkformer.dynamics import simulate
from sinkformer.dynamics.clustering import interaction_energy
from sinkformer.dynamics.phase import LayerWeights, phase_diagram, random_weights, uniform_on_sphere


@pytest.mark.parametrize("kind", ["softmax", "causal"])
def test_the_batch_equals_one_simulation_per_system(kind):
    betas, S, n, d = [0.5, 3.0], 3, 7, 3
    seen = []
    pd = phase_diagram(kind, betas, n_systems=S, n_tokens=n, d=d, t1=2.0, dt=0.25, record_every=2, seed=4,
                       ensemble="gaussian", dtype=D64, progress=seen.append)
    assert seen == pd.times.tolist()
    gen = torch.Generator().manual_seed(4)
    x0 = uniform_on_sphere((2, S, n), d, generator=gen, dtype=D64)
    Q, K, V = LayerWeights("gaussian", (1, S), d, seed=5, dtype=D64)(0.0)
    for b, beta in enumerate(betas):
        for s in range(S):
            traj = simulate(x0[b, s], (beta * Q[0, s], K[0, s], V[0, s]), t1=2.0, steps=8, kind=kind,
                            geometry="sphere", record_every=2)
            energy = interaction_energy(traj.positions, beta, normalized=True)
            torch.testing.assert_close(pd.energy_systems[:, b, s], energy, atol=1e-12, rtol=0)
            assert pd.single_cluster.shape == (5, 2)
    assert torch.equal(pd.times, torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0], dtype=D64))


def test_at_beta_zero_every_system_ends_in_one_cluster_and_probabilities_fall_with_beta():
    pd = phase_diagram("softmax", [0.0, 12.0], n_systems=16, n_tokens=16, d=3, t1=20.0, dt=0.2, record_every=25)
    assert pd.single_cluster[-1, 0] == 1.0  # beta = 0: every token follows the mean direction
    assert pd.single_cluster[0].sum() == 0  # tokens uniform at t = 0
    assert pd.single_cluster[-1, 1] < 0.5  # beta = 12: metastable clusters at t = 20
    assert torch.isnan(pd.energy[:, 0]).all() and not torch.isnan(pd.energy[:, 1]).any()
    assert float(pd.n_clusters[1]) > float(pd.n_clusters[0]) == 1.0


def test_weight_ensembles():
    g = torch.Generator().manual_seed(0)
    Q, K, V = random_weights("goe", (5,), 4, generator=g, dtype=D64)
    torch.testing.assert_close(Q, Q.transpose(-1, -2))
    torch.testing.assert_close(V, V.transpose(-1, -2))
    assert not torch.allclose(Q, K)
    Q, K, V = random_weights("gaussian", (2000,), 4, value_identity=True, generator=g, dtype=D64)
    assert torch.equal(V, torch.eye(4, dtype=D64).expand(2000, 4, 4))
    assert abs(float(Q.var()) - 0.25) < 0.01  # entries N(0, 1/d)
    eye = torch.eye(3, dtype=D64)
    assert all(torch.equal(t, eye.expand(2, 3, 3)) for t in random_weights("identity", (2,), 3, dtype=D64))
    with pytest.raises(ValueError, match="ensemble must be one of"):
        random_weights("wishart", (2,), 3)


def test_layers_are_redrawn_every_period_reproducibly():
    layers = LayerWeights("gaussian", (2,), 3, every=1.5, seed=7, dtype=D64)
    first, again, second = layers(0.2)[0], layers(1.4)[0], layers(1.6)[0]
    assert torch.equal(first, again) and not torch.equal(first, second)
    assert torch.equal(LayerWeights("gaussian", (2,), 3, every=1.5, seed=7, dtype=D64)(1.6)[0], second)
    assert torch.equal(LayerWeights("gaussian", (2,), 3, seed=7, dtype=D64)(100.0)[0], first)  # one layer
    betas = torch.tensor([[2.0], [3.0]], dtype=D64)
    scaled = LayerWeights("gaussian", (1, 2), 3, betas=betas, seed=7, dtype=D64)(0.0)[0]
    torch.testing.assert_close(scaled[1], 3.0 * first)
    with pytest.raises(ValueError, match="every .* must be > 0"):
        LayerWeights("gaussian", (2,), 3, every=0.0)


def test_regeneration_changes_the_flow_only_when_a_new_layer_starts():
    kwargs = dict(n_systems=4, n_tokens=6, d=3, t1=1.0, dt=0.1, ensemble="gaussian", record_every=5, dtype=D64)
    fixed = phase_diagram("softmax", [2.0], **kwargs)
    late = phase_diagram("softmax", [2.0], regenerate_every=5.0, **kwargs)  # no new layer before t = 1
    redrawn = phase_diagram("softmax", [2.0], regenerate_every=0.6, **kwargs)  # layer 2 from t = 0.6
    assert torch.equal(fixed.energy_systems, late.energy_systems)
    assert torch.equal(fixed.energy_systems[1], redrawn.energy_systems[1])  # t = 0.5: still the first layer
    assert not torch.allclose(fixed.energy_systems[-1], redrawn.energy_systems[-1])


@pytest.mark.parametrize("ensemble, regenerate_every", [("identity", None), ("gaussian", 0.5)])
def test_chunks_of_systems_give_the_results_of_one_batch(ensemble, regenerate_every):
    """Systems are simulated in chunks (on a CPU, to stay in the caches): every field equals the one-batch
    diagram's bit for bit, and progress rises once from 0 to t1."""
    kwargs = dict(n_systems=10, n_tokens=8, d=3, t1=1.5, dt=0.1, record_every=3, ensemble=ensemble,
                  regenerate_every=regenerate_every)
    whole = phase_diagram("softmax", [0.0, 1.0, 4.0], systems_per_chunk=10, **kwargs)
    times = []
    chunked = phase_diagram("softmax", [0.0, 1.0, 4.0], systems_per_chunk=3, progress=times.append, **kwargs)
    for name in ("times", "single_cluster", "n_clusters", "span_dimension", "energy", "energy_systems"):
        assert torch.equal(getattr(whole, name).nan_to_num(), getattr(chunked, name).nan_to_num()), name
    assert times[0] == 0.0 and times[-1] == pytest.approx(1.5) and all(a < b for a, b in zip(times, times[1:]))
    with pytest.raises(ValueError, match="systems_per_chunk"):
        phase_diagram("softmax", [1.0], systems_per_chunk=0, **kwargs)
