"""The Sparse Sinkhorn experiments run end to end through the registry and the one trainer."""

import json
import math

import pytest
import torch

from sinkformer.data.sorting import load_sorting
from sinkformer.experiments.sparse._common import TokenLevel, train
from sinkformer.runs.registry import registry, run_experiment
from sinkformer.experiments.sparse.sortcut import read_sst_trees
from sinkformer.models.sinkhorn_transformer import AttentionConfig, SinkhornTransformerLM

NAMES = ["sort", "charlm", "wordlm", "pixels", "sortcut", "nli", "sparse-ablations"]
TINY = {"dim": 16, "depth": 1, "heads": 2, "epochs": 1, "max_train_batches": 2, "seeds": 2}
CASES = {
    "sort": {"models": ["vanilla", "sinkhorn:4"], "n_train": 64, "n_test": 8, "length": 8, "test_length": 12},
    "charlm": {"models": ["local:8", "mixture:8"], "max_chars": 20000, "seq_len": 32, "max_eval_batches": 2,
               "sample_chars": 10},
    "pixels": {"models": ["fixed:8", "sinkhorn:8"], "max_eval_batches": 2},
    "sortcut": {"word_models": ["sinkhorn:4"], "char_models": ["sortcut:2x16"], "n_train": 64, "n_test": 16,
                "char_max_len": 64},
    "nli": {"models": ["vanilla", "sortcut:2x8"], "n_train": 64, "n_test": 16},
    "sparse-ablations": {"temperatures": [0.5, 0.75], "iterations": [0, 5], "max_chars": 20000, "seq_len": 32,
                         "max_eval_batches": 2, "seeds": 1},
    "wordlm": {"models": ["vanilla", "sinkhorn:8"], "max_chars": 20000, "seq_len": 32, "max_eval_batches": 2,
               "sample_chars": 10, "vocab_size": 300},
}
#: the Sparse Sinkhorn models of each case compared with its vanilla Transformer (with verdicts)
COMPARED = {"sort": ["Sinkhorn Transformer (4)"], "nli": ["SortCut (2x8)"], "wordlm": ["Sinkhorn Transformer (8)"]}


def test_experiments_are_registered_with_quick_and_full_forms():
    experiments = registry()
    for name in NAMES:
        assert name in experiments and experiments[name].full and "Sparse Sinkhorn" in experiments[name].paper


@pytest.mark.parametrize("name", NAMES)
def test_tiny_run_writes_report_table_and_figure(name, tmp_path):
    ctx = run_experiment(name, overrides={**TINY, **CASES[name]}, runs_dir=tmp_path)
    report = (ctx.out_dir / "report.md").read_text()
    assert "easured" in report and "aper" in report  # measured next to the paper's values
    assert "| " in report and list(ctx.out_dir.glob("*.png"))
    results = json.loads((ctx.out_dir / "results.json").read_text())
    assert results and (ctx.out_dir / "metrics.csv").read_text().count("\n") >= 2
    comparisons = results.get("comparisons", [])
    assert [c["variant"] for c in comparisons] == COMPARED.get(name, [])
    for c in comparisons:
        assert c["baseline"] == "Transformer" and c["seeds"] == 2 and c["verdict"] in report


def test_token_level_task_ignores_padding():
    logits = torch.randn(2, 3, 5)
    targets = torch.tensor([[1, 2, 0], [3, 0, 0]])  # 0 = padding
    sums = TokenLevel(pad_id=0).sums(lambda: logits, {}, targets)
    expected = torch.nn.functional.cross_entropy(logits[targets != 0], targets[targets != 0], reduction="sum")
    torch.testing.assert_close(sums["loss"], expected)
    assert sums["count"] == 3
    assert TokenLevel().sums(lambda: logits, {}, targets)["count"] == 6


def test_language_model_learns_a_repeating_text():
    """The trainer + LM reach far below the uniform 8 bits per byte on a periodic corpus."""
    from sinkformer.data.base import DataBundle
    from sinkformer.data.text_lm import LMCollate, LMDataset, encode_bytes

    ids = encode_bytes("abcdefgh" * 300)
    data = DataBundle(LMDataset(ids, 32), LMDataset(ids[:400], 32), {"kind": "lm", "vocab_size": 260, "max_len": 32},
                      LMCollate())
    model = SinkhornTransformerLM(260, dim=32, depth=1, heads=2, max_len=32, attention=AttentionConfig.parse("sinkhorn:8"))
    final, _ = train(model, data, {"epochs": 6, "batch_size": 8, "lr": 3e-3}, seed=0, sequence=True)
    assert final["test_loss"] / math.log(2) < 1.0




def test_sst_trees_binary_labels(tmp_path):
    file = tmp_path / "train.txt"
    file.write_text("(3 (2 It) (4 (2 works) (2 .)))\n(2 (2 Just) (2 fine))\n(0 (1 Bad) (2 film))\n")
    assert read_sst_trees(file) == (["It works .", "Bad film"], [1, 0])
    file.write_text("not a tree\n")
    with pytest.raises(ValueError, match="expected a PTB tree"):
        read_sst_trees(file)


def test_sorting_decoding_metrics_after_training_the_copy_of_short_sequences():
    """A vanilla seq2seq trained briefly on length <= 4 sorting decodes most short test items exactly."""
    from sinkformer.experiments.sparse.sort import decode_metrics
    from sinkformer.models.sinkhorn_transformer import SinkhornSeq2Seq

    data = load_sorting(length=4, test_length=4, n_train=1500, n_test=50, n_symbols=4)
    model = SinkhornSeq2Seq(data.info["vocab_size"], dim=32, depth=1, heads=2, max_len=data.info["max_len"],
                            attention=AttentionConfig.parse("vanilla"))
    train(model, data, {"epochs": 2, "batch_size": 32, "lr": 3e-3}, seed=0, sequence=True)
    metrics = decode_metrics(model, data, 50)
    assert metrics["exact_match"] > 60 and metrics["edit_distance"] < 0.2


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_quick_form_runs(name, tmp_path):
    ctx = run_experiment(name, runs_dir=tmp_path)
    assert (ctx.out_dir / "report.md").exists()
