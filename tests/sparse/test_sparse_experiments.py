"""The Sparse Sinkhorn experiments run end to end through the registry and the one trainer."""

import json
import math

import pytest
import torch

from sinkformer.data.sorting import load_sorting
from sinkformer.experiments.sparse import charlm, nli, pixels, sort, sortcut
from sinkformer.experiments.sparse._common import (
    TokenLevel,
    paper_row,
    scale_blocks,
    seeded,
    table_models,
    train,
    versus_vanilla,
)
from sinkformer.experiments.sparse.sortcut import read_sst_trees
from sinkformer.models.sinkhorn_transformer import (
    AttentionConfig,
    SinkhornClassifier,
    SinkhornSeq2Seq,
    SinkhornTransformerLM,
    share_weights,
)
from sinkformer.runs.registry import get, registry, run_experiment
from sinkformer.runs.verdicts import CLAIM, KINDS, MIN_SEEDS, NOISE, WORSE

NAMES = ["sort", "charlm", "wordlm", "pixels", "sortcut", "nli", "sparse-ablations"]
TINY = {"dim": 16, "depth": 1, "heads": 2, "epochs": 1, "max_train_batches": 2, "seeds": 2}
CASES = {  # models are the paper's rows, trained with the paper's numbers of blocks at these lengths
    "sort": {"models": ["softmax", "sparse:32"], "n_train": 64, "n_test": 8, "length": 16, "test_length": 20},
    "charlm": {"models": ["local:128", "mixture:128"], "max_chars": 20000, "seq_len": 32, "max_eval_batches": 2,
               "sample_chars": 10},
    "pixels": {"models": ["fixed:256", "sparse:256"], "max_eval_batches": 2},
    "sortcut": {"word_models": ["sparse:32"], "char_models": ["sortcut:2x32"], "n_train": 64, "n_test": 16,
                "char_max_len": 64},
    "nli": {"models": ["softmax", "sortcut:2x16"], "n_train": 64, "n_test": 16},
    "sparse-ablations": {"temperatures": [0.5, 0.75], "iterations": [0, 5], "max_chars": 20000, "seq_len": 32,
                         "max_eval_batches": 2, "seeds": 1},
    "wordlm": {"models": ["softmax", "sparse:64"], "max_chars": 20000, "seq_len": 32, "max_eval_batches": 2,
               "sample_chars": 10, "vocab_size": 300},
}
#: the Sparse Sinkhorn models of each case compared with its vanilla Transformer (with verdicts): the
#: paper's row, then the block trained (the same number of blocks at this length)
COMPARED = {"sort": ["Sinkhorn Transformer (32 → 2)"], "nli": ["SortCut (2x16 → 2x"],
            "wordlm": ["Sinkhorn Transformer (64 → 8)"]}


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
    assert len(comparisons) == len(COMPARED.get(name, []))
    for c, variant in zip(comparisons, COMPARED.get(name, [])):
        assert c["variant"].startswith(variant) and c["kind"] in KINDS
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
    model = SinkhornTransformerLM(260, dim=32, depth=1, heads=2, max_len=32, attention=AttentionConfig.parse("sparse:8"))
    final, _ = train(model, data, {"epochs": 6, "batch_size": 8, "lr": 3e-3}, seed=0, sequence=True)
    assert final["test_loss"] / math.log(2) < 1.0




@pytest.mark.parametrize("options,evaluations", [({}, 1), ({"eval_every": 1}, 3), ({"eval_every": 2}, 2)])
def test_the_test_set_is_scored_after_the_last_epoch_unless_the_config_asks(monkeypatch, options, evaluations):
    from sinkformer.data.base import DataBundle
    from sinkformer.data.text_lm import LMCollate, LMDataset, encode_bytes
    from sinkformer.training import loop

    calls, evaluate = [], loop._evaluate
    monkeypatch.setattr(loop, "_evaluate", lambda *args, **kw: calls.append(1) or evaluate(*args, **kw))
    ids = encode_bytes("abcdefgh" * 40)
    data = DataBundle(LMDataset(ids, 16), LMDataset(ids[:64], 16), {"kind": "lm", "vocab_size": 260, "max_len": 16},
                      LMCollate())
    model = SinkhornTransformerLM(260, dim=16, depth=1, heads=2, max_len=16,
                                  attention=AttentionConfig.parse("sparse:8"))
    final, _ = train(model, data, {"epochs": 3, "batch_size": 8, "max_train_batches": 1, **options}, seed=0,
                     sequence=True)
    assert len(calls) == evaluations and math.isfinite(final["test_loss"])


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
                            attention=AttentionConfig.parse("softmax"))
    train(model, data, {"epochs": 2, "batch_size": 32, "lr": 3e-3}, seed=0, sequence=True)
    metrics = decode_metrics(model, data, 50)
    assert metrics["exact_match"] > 60 and metrics["edit_distance"] < 0.2


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_quick_form_runs(name, tmp_path):
    ctx = run_experiment(name, runs_dir=tmp_path)
    assert (ctx.out_dir / "report.md").exists()


def test_one_block_rule_keeps_the_papers_number_of_blocks():
    models = table_models(["softmax", "sparse:32", "sortcut:2x16", "local:32"], 32 / 256, short=True)
    assert [m.label for m in models] == ["Transformer", "Sinkhorn (32 → 4)", "SortCut (2x16 → 2x2)",
                                         "Local Attention (32 → 4)"]
    assert [m.attention.block_size for m in models[1:]] == [4, 2, 4] and models[2].attention.sortcut_budget == 2
    assert [m.paper.block_size for m in models[1:]] == [32, 16, 32]
    assert table_models(["sparse:32"], 1.0)[0].label == "Sinkhorn Transformer (32)"  # --full: the paper's blocks
    assert scale_blocks(AttentionConfig.parse("sparse:256"), 64 / 3072).block_size == 5  # 5.33 rounded
    with pytest.raises(ValueError, match=r"blocks of 8 at the paper's length scale to 0.25 tokens"):
        scale_blocks(AttentionConfig.parse("sparse:8"), 1 / 32)


@pytest.mark.parametrize("module, name, length", [
    (sort, "sort", lambda cfg: cfg["length"]),
    (charlm, "charlm", lambda cfg: cfg["seq_len"]),
    (charlm, "wordlm", lambda cfg: cfg["seq_len"]),
    (pixels, "pixels", lambda cfg: 64),  # 8 x 8 digits
])
def test_quick_forms_train_the_papers_rows_with_their_numbers_of_blocks(module, name, length):
    cfg = get(name).defaults
    paper_length = module.PAPER_LENGTH if isinstance(module.PAPER_LENGTH, int) else module.PAPER_LENGTH[cfg["level"]]
    paper = module.PAPER if hasattr(module, "PAPER") else (module.PAPER_CHAR if cfg["level"] == "char" else module.PAPER_WORD)
    for m in table_models(cfg["models"], length(cfg) / paper_length):
        if m.attention.kind == "softmax":
            continue
        assert paper_row(paper, m.paper) is not None, m.label  # a row of the paper's table ...
        blocks_here, blocks_paper = length(cfg) / m.attention.block_size, paper_length / m.paper.block_size
        assert blocks_here == pytest.approx(blocks_paper, rel=0.07), m.label  # ... with its number of blocks


def test_the_paper_row_is_the_block_size_of_the_row_never_another():
    assert paper_row(sort.PAPER, AttentionConfig.parse("sparse:32")) == "Sinkhorn Transformer (32)"
    assert paper_row(sort.PAPER, AttentionConfig.parse("sparse:4")) is None  # no such row: no verdict
    assert paper_row(charlm.PAPER_CHAR, AttentionConfig.parse("sparse:128")) == "Sinkhorn Transformer"
    assert paper_row(nli.PAPER, AttentionConfig.parse("sortcut:2x16")) == "SortCut (2x16)"


def test_each_comparison_declares_what_it_tests():
    """The headline rows are claims of the paper; the others are listed apart by the paper's own numbers."""
    seeds = [[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], [1.5, 2.5, 3.0, 4.2, 5.1, 6.3]]
    cases = [(sort, "sort", 32 / 256, lambda p: {k: v[1] for k, v in p.items()}, True,
              {"Sinkhorn Transformer (16 → 2)": CLAIM, "Sinkhorn Transformer (32 → 4)": CLAIM}),
             (charlm, "wordlm", 128 / 256, lambda p: {k: v[0] for k, v in p.items()}, False,
              {"Sinkhorn Transformer (32 → 16)": NOISE, "Sinkhorn Transformer (64 → 32)": CLAIM,
               "Sinkhorn Mixture (32 → 16)": CLAIM}),
             (nli, "nli", 1.0, lambda p: {k: v[0] for k, v in p.items()}, True,
              {"SortCut (2x16)": CLAIM, "Sinkhorn (32)": NOISE, "SortCut (2x32)": NOISE})]
    for module, name, scale, column, higher, expected in cases:
        models = table_models(get(name).defaults["models"], scale, short=name == "nli")
        per_seed = {m.label: seeds[m.attention.kind != "softmax"] for m in models}
        paper = column(module.PAPER if name != "wordlm" else module.PAPER_WORD)
        kinds = {c.variant: c.kind for c in versus_vanilla(per_seed, models, paper, metric="m", higher_is_better=higher)}
        assert kinds == expected, name
    words = {m.label: seeds[m.attention.kind != "softmax"]
             for m in table_models(["softmax", "sortcut:2x16", "sortcut:2x32"], 1.0, short=True)}
    kinds = [c.kind for c in versus_vanilla(words, table_models(["softmax", "sortcut:2x16", "sortcut:2x32"], 1.0,
                                                                short=True),
                                            {k: v[0] for k, v in sortcut.PAPER.items()}, metric="m", higher_is_better=True)]
    assert kinds == [WORSE, NOISE]  # IMDb word level: 80.12 and 84.43 against 85.12


BUILDERS = {
    "classifier": lambda a: SinkhornClassifier(50, 3, dim=16, depth=2, heads=2, max_len=32, attention=a),
    "language model": lambda a: SinkhornTransformerLM(50, dim=16, depth=2, heads=2, max_len=32, attention=a),
    "seq2seq": lambda a: SinkhornSeq2Seq(50, dim=16, depth=1, heads=2, max_len=32, attention=a),
}


@pytest.mark.parametrize("builder", BUILDERS)
@pytest.mark.parametrize("spec", ["sparse:8", "sortcut:2x8", "mixture:8", "local:8"])
def test_every_model_of_a_seed_starts_from_the_transformers_weights(builder, spec):
    build = BUILDERS[builder]
    if spec.startswith("sortcut") and builder != "classifier":
        return  # SortCut is encoder-only
    attention = AttentionConfig.parse(spec)
    transformer, variant = seeded(build, AttentionConfig("softmax"), 7), seeded(build, attention, 7)
    ref, var = transformer.state_dict(), variant.state_dict()
    for name, tensor in ref.items():
        if name in var:
            assert torch.equal(var[name], tensor), name
        else:  # a fused projection: its q, k and v rows
            owner = name.replace(".qkv_proj.", ".{}.")
            parts = [var[owner.format(p)] for p in ("q_proj", "k_proj", "v_proj")]
            assert torch.equal(torch.cat(parts), tensor), name
    torch.manual_seed(7)  # without sharing, the attention's extra tensors shift the random stream
    unshared = build(attention).state_dict()
    if spec != "local:8":
        assert any(not torch.equal(unshared[k], var[k]) for k in var if k in ref), "the test would not catch a change"


def test_share_weights_copies_only_tensors_of_the_same_shape():
    torch.manual_seed(0)
    small, large = BUILDERS["classifier"](AttentionConfig("softmax")), SinkhornClassifier(
        50, 3, dim=32, depth=2, heads=2, max_len=32, attention="sparse:8")
    assert share_weights(large, small) == ["classifier.bias"]  # every other shape differs


def test_seeds_of_the_quick_and_full_forms_give_a_sign_flip_test():
    for name in ("sort", "charlm", "wordlm", "pixels", "sortcut", "nli"):
        exp = get(name)
        assert exp.defaults["seeds"] >= MIN_SEEDS and exp.full["seeds"] >= MIN_SEEDS, name
        assert exp.defaults["train_fraction"] < 1 and exp.full["train_fraction"] == 1, name
    assert get("nli").full["heads"] == get("sortcut").full["heads"] == 4  # Tensor2Tensor's transformer_tiny


def test_charlm_reports_bits_per_byte(tmp_path):
    ctx = run_experiment("charlm", overrides={**TINY, **CASES["charlm"], "models": ["softmax", "sparse:128"]},
                         runs_dir=tmp_path)
    results = json.loads((ctx.out_dir / "results.json").read_text())
    assert results["unit"] == "bits per byte" and results["comparisons"][0]["metric"] == "bits per byte"
    report = (ctx.out_dir / "report.md").read_text()
    assert "## Measured (bits per byte, lower is better)" in report and "| bits per byte ↓ |" in report
