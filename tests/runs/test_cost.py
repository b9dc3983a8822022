"""GPU-hour estimates of the full runs: the paper's step counts, and a measured step on this CPU."""

import pytest

from sinkformer.cli import main
from sinkformer.runs import cost
from sinkformer.runs.registry import get, registry


def full_config(name):
    exp = get(name)
    return {**exp.defaults, **exp.full}


@pytest.mark.parametrize("name, steps", [
    ("sort", 200_000),       # Tensor2Tensor sorting: 200k steps
    ("charlm", 305_175),     # LM1B characters: 25 epochs of 12.2k steps ~ the paper's 300k
    ("nli", 498_437),        # 500k steps
    ("pixels", 500_000),     # 500k steps of batch 1
])
def test_full_runs_train_the_papers_step_counts(name, steps):
    work = get(name).cost(full_config(name))
    assert work and all(w.steps == steps for w in work)
    assert {w.runs for w in work} == {6}  # the paper's single runs, 6 seeds for paired intervals and a sign-flip test


def test_every_training_experiment_has_a_cost_model():
    trains = {"column-sums", "modelnet", "sentiment", "translation", "vit", "patch-size", "sort", "charlm", "wordlm",
              "pixels", "sortcut", "nli", "sparse-ablations", "causal-lm"}
    assert {name for name, exp in registry().items() if exp.cost is not None} == trains
    for name in trains:
        for w in get(name).cost(full_config(name)):
            assert w.steps > 0 and w.batch_size > 0 and w.runs >= 1 and w.label


def test_estimate_times_a_step_here_and_converts_to_gpu_hours():
    tiny = {**get("vit").defaults, "seeds": 2, "model_options": {"patch_size": 4, "dim": 16, "depth": 1, "num_heads": 2,
                                                                 "dim_feedforward": 16},
            "data_options": {"image_size": 16}}
    result = cost.estimate("vit", config=tiny, time_batch=2)
    assert [w["label"] for w in result["workloads"]] == ["Transformer", "Sinkformer"]
    for w in result["workloads"]:
        assert w["step_seconds"] > 0 and w["runs"] == 2 and w["steps"] == 10 * 20_000 // 64
        assert w["cpu_hours"] == pytest.approx(w["step_seconds"] * w["steps"] * 2 / 3600)
    assert result["gpu_hours"] == pytest.approx(result["cpu_hours"] * result["cpu_matmul_gflops"] * 1e9 / cost.GPU_FLOPS)
    with pytest.raises(ValueError, match="no GPU cost model"):
        cost.estimate("riccati")


def test_experiments_listing_shows_quick_times_and_full_costs(capsys):
    assert main(["experiments"]) == 0
    out = capsys.readouterr().out
    assert "quick here" in out and "--full" in out and "GPU-hours" in out and "CPU-min" in out
