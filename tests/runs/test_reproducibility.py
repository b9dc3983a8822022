"""The same command twice on one machine gives identical numbers; every run folder says where it came from."""

import json

import torch

from sinkformer.runs.provenance import WHAT_CHANGES_RESULTS, cpu_model, git_commit, provenance
from sinkformer.runs.registry import run_experiment

TINY_SENTIMENT = {"seeds": 2, "data_options": {"n_train": 64, "n_test": 32},
                  "model_options": {"dim": 8, "depth": 1, "num_heads": 2, "dim_feedforward": 8, "dropout": 0.1},
                  "train": {"epochs": 2, "batch_size": 16}}


def without_timings(x):
    """``x`` with every ``*seconds*`` entry removed (wall-clock times differ between runs), and the
    finding's sentence (which quotes them)."""
    if isinstance(x, dict):
        return {k: without_timings(v) for k, v in x.items() if "seconds" not in k and k != "this_run"}
    if isinstance(x, list):
        return [without_timings(v) for v in x]
    return x


def test_two_runs_of_one_command_give_identical_numbers(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runs = [run_experiment("sentiment", overrides=TINY_SENTIMENT, runs_dir=tmp_path / str(i)) for i in (1, 2)]
    finally:
        torch.set_num_threads(threads)
    first, second = (json.loads((r.out_dir / "results.json").read_text()) for r in runs)
    assert without_timings(first) == without_timings(second)
    assert first["comparisons"][0]["differences"] == second["comparisons"][0]["differences"]
    rows = [[{k: v for k, v in row.items() if "second" not in k} for row in r.rows] for r in runs]
    assert rows[0] == rows[1] and len(rows[0]) == 2 * 2 * 2  # 2 seeds x 2 models x 2 epochs, every loss equal


def test_every_run_folder_records_its_provenance(tmp_path):
    ctx = run_experiment("normalizations", runs_dir=tmp_path, command="sinkformer run normalizations")
    facts = json.loads((ctx.out_dir / "provenance.json").read_text())
    assert facts["command"] == "sinkformer run normalizations" and facts["torch"] == torch.__version__
    for key in ("sinkformer", "git_commit", "numpy", "python", "cpu", "cpu_count", "torch_threads", "device", "date"):
        assert facts[key] not in (None, "")
    assert facts["cpu"] == cpu_model() and facts["device"].startswith(("cpu", "cuda"))
    assert git_commit("/") == "not a git checkout"
    assert provenance("x")["command"] == "x" and "BLAS" in WHAT_CHANGES_RESULTS
