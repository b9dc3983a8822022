"""The dynamics experiments run end to end (tiny configurations) and write their figures and reports."""

import json

import pytest

from sinkformer.runs.registry import run_experiment

TINY = {
    "riccati": {"n_particles": 100, "steps": 10},
    "gaussian-cone": {"grid": 3, "grid_diverge": 3, "max_time": 20.0, "max_time_diverge": 5.0,
                      "n_particles_check": 100},
    "rank-histograms": {"dims": [3], "n_per_dim": 3, "horizon": 100.0},
    "heat-flow": {"n_particles": 150, "eps_particles_one": [0.4, 0.2], "eps_particles_multi": [0.4, 0.2],
                  "floor_sizes": [100, 150]},
    "sinkformer-diffusion": {"n_particles": 150, "steps": 4},
    "mean-field": {"ns": [50, 100], "ns_sinkhorn": [50, 100], "reps": 2, "ns_masked": [50, 100],
                   "n_reference": 150, "steps": 4},
    "drifting": {"n_particles": 150, "steps": 100},
    "phase-diagram": {"n_betas": 3, "n_systems": 4, "n_systems_sinkhorn": 2, "n_tokens": 6, "t1": 2.0, "dt": 0.2,
                      "record_every": 2},
    "metastability": {"betas": [4.0], "n_systems": 1, "n_tokens": 8, "t1": 5.0, "dt": 0.5},
    "causal-clustering": {"betas": [1.0], "n_systems": 3, "n_tokens": 6, "t1": 3.0, "dt": 0.2},
    "twisted-wasserstein": {"n_particles": 8, "steps": [4, 8]},
    "hidden-states": {"hf_config": {"vocab_size": 100, "hidden_size": 16, "num_hidden_layers": 2,
                                    "num_attention_heads": 2, "intermediate_size": 32, "initializer_range": 0.1},
                      "hf_sequences": 2, "hf_tokens": 6, "test_sentences": 8, "train_fraction": 0.05,
                      "model_options": {"dim": 16, "depth": 1, "num_heads": 2, "dim_feedforward": 16, "dropout": 0.0},
                      "train": {"epochs": 1, "batch_size": 64, "lr": 2e-3, "milestones": []}},
}
FIGURES = {
    "riccati": ["riccati"],
    "gaussian-cone": ["cone_convergence", "disk_divergence"],
    "rank-histograms": ["ranks_softmax", "ranks_l2"],
    "heat-flow": ["heat_flow"],
    "sinkformer-diffusion": ["sinkformer_diffusion"],
    "mean-field": ["mean_field"],
    "drifting": ["drifting"],
    "phase-diagram": ["phase_diagram"],
    "metastability": ["metastability"],
    "causal-clustering": ["causal_clustering"],
    "twisted-wasserstein": ["twisted_wasserstein"],
    "hidden-states": ["hidden_states"],
}


@pytest.mark.parametrize("name", list(TINY))
def test_experiment_writes_figures_and_report(name, tmp_path):
    ctx = run_experiment(name, overrides=TINY[name], runs_dir=tmp_path)
    for fig in FIGURES[name]:
        assert (ctx.out_dir / f"{fig}.png").stat().st_size > 10_000
    report = (ctx.out_dir / "report.md").read_text()
    assert all(f"({fig}.png)" in report for fig in FIGURES[name])
    assert "nan" not in report.lower().replace("nanmedian", "")
    assert json.loads((ctx.out_dir / "results.json").read_text())
