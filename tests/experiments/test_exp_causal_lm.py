"""`sinkformer run causal-lm`: Transformer vs causal Sinkformer language models, end to end at a tiny
size; the attention statistics on hand-made matrices; the model (no leak, same initial weights);
the WikiText-103 loader and the --full configuration's cost."""

import csv
import json
import math

import pytest
import torch

from sinkformer.experiments.sinkformers.causal_lm import attention_statistics, uniform_causal
from sinkformer.data import wikitext
from sinkformer.data.text_lm import encode_bytes
from sinkformer.data.wikitext import load_wikitext103
from sinkformer.models.causal_lm import CausalLM, build_lm
from sinkformer.runs.registry import get, run_experiment
from sinkformer.runs.verdicts import EXTENSION, VERDICTS, Comparison
from sinkformer.sinkhorn.prefix import prefix_sinkhorn


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


TINY = {"max_chars": 6000, "seq_len": 16, "n_iters": [1, 3, 5], "seeds": 2, "stats_windows": 4,
        "model_options": {"dim": 8, "depth": 1, "heads": 2, "ff_mult": 2, "dropout": 0.0},
        "train": {"epochs": 1, "batch_size": 16, "lr": 4e-3, "max_train_batches": 4, "max_eval_batches": 2}}


def test_tiny_run_writes_bpc_verdicts_times_and_attention_statistics(tmp_path):
    ctx = run_experiment("causal-lm", overrides=TINY, runs_dir=tmp_path)
    files = {p.name for p in ctx.out_dir.iterdir()}
    assert {"config.yaml", "metrics.csv", "results.json", "report.md", "report.html", "causal_lm.png"} <= files
    assert (ctx.out_dir / "causal_lm.png").stat().st_size > 10_000
    results = json.loads((ctx.out_dir / "results.json").read_text())
    report = (ctx.out_dir / "report.md").read_text()
    names = ["Transformer", "Sinkformer (3 it.)", "Sinkformer (5 it.)"]
    assert list(results["bits_per_character"]) == names
    for name in names:
        values = results["bits_per_character"][name]
        assert len(values) == 2 and all(math.isfinite(v) and v > 0 for v in values)
        assert results["epoch_seconds"][name] > 0 and f"| {name} |" in report
        assert [set(layer) for layer in results["attention"][name]] == [{"entropy", "column_distance", "diagonal"}]
    # the verdict lines: one paired comparison per Sinkformer with the Transformer, interval and verdict
    comparisons = results["comparisons"]
    assert [(c["baseline"], c["variant"]) for c in comparisons] == [("Transformer", n) for n in names[1:]]
    for c in comparisons:
        assert c["seeds"] == 2 and c["verdict"] in VERDICTS and c["higher_is_better"] is False
        diffs = [v - b for b, v in zip(results["bits_per_character"]["Transformer"],
                                       results["bits_per_character"][c["variant"]])]
        assert c["differences"] == pytest.approx(diffs)
        assert c["kind"] == EXTENSION  # no paper has a causal language model: listed apart from the paper claims
        line = f"| {c['variant']} − Transformer | {EXTENSION} | {c['paper']} | {Comparison.from_dict(c).interval()} |"
        assert line in report and f"| 2 | **{c['verdict']}** |" in report
    assert "## Paper vs this run" in report and "**Verdicts:**" in report and "Verdict rule" in report
    assert results["finding"]["this_run"] in report
    # uniform causal attention's statistics are the reference rows of the attention table
    uniform = results["references"]["uniform causal attention"]
    assert uniform["column_distance"] == 0 and f"| uniform causal attention | — | {uniform['entropy']:.3f} |" in report
    rows = list(csv.DictReader((ctx.out_dir / "metrics.csv").open()))
    assert len(rows) == 3 * 2 and {r["model"] for r in rows} == set(names) and all(r["epoch"] for r in rows)


def test_attention_statistics_of_hand_made_matrices():
    uniform = uniform_causal(3)
    expected_uniform = torch.tensor([[1, 0, 0], [1 / 2, 1 / 2, 0], [1 / 3, 1 / 3, 1 / 3]], dtype=torch.float64)
    torch.testing.assert_close(uniform, expected_uniform)
    # uniform causal attention: column sums u = (11/6, 5/6, 1/3), entropies (0, log 2, log 3), diagonal (1, 1/2, 1/3)
    assert attention_statistics(uniform) == pytest.approx(
        {"entropy": (math.log(2) + math.log(3)) / 3, "column_distance": 0.0, "diagonal": 11 / 18})
    # the identity: column sums (1, 1, 1), |1 - u| sums to 5/6 + 1/6 + 2/3 = 5/3, over 2n = 6
    assert attention_statistics(torch.eye(3)) == pytest.approx({"entropy": 0.0, "column_distance": 5 / 18,
                                                                "diagonal": 1.0})
    p = torch.tensor([[1.0, 0.0, 0.0], [0.25, 0.75, 0.0], [0.5, 0.25, 0.25]])
    entropy = (0.0 - (0.25 * math.log(0.25) + 0.75 * math.log(0.75)) + 1.5 * math.log(2)) / 3
    # column sums (1.75, 1, 0.25): |c - u| = 1/12 + 1/6 + 1/12 = 1/3, over 6
    expected = {"entropy": entropy, "column_distance": 1 / 18, "diagonal": 2 / 3}
    assert attention_statistics(p) == pytest.approx(expected)
    # a batch of matrices (..., n, n): the mean of the matrices' statistics
    batch = torch.stack([p, torch.eye(3)]).unsqueeze(0)
    assert attention_statistics(batch) == pytest.approx(
        {"entropy": entropy / 2, "column_distance": (1 / 18 + 5 / 18) / 2, "diagonal": (2 / 3 + 1) / 2})
    with pytest.raises(ValueError, match=r"weights must be square matrices \(\.\.\., n, n\), got shape \(3, 4\)"):
        attention_statistics(torch.ones(3, 4))


@pytest.mark.parametrize("n_iters", [1, 3, 5])
def test_the_model_is_causal_and_its_weights_are_the_prefix_sinkhorn_of_its_scores(n_iters):
    torch.manual_seed(0)
    model = CausalLM(20, 12, n_iters=n_iters, dim=8, depth=2, heads=2).double()
    tokens = torch.randint(0, 20, (3, 12))
    changed = tokens.clone()
    changed[:, 7:] = (changed[:, 7:] + 1) % 20
    logits, logits_changed = model(tokens), model(changed)
    # tokens after position 6 change nothing before them (and do change position 7 on)
    torch.testing.assert_close(logits[:, :7], logits_changed[:, :7])
    assert not torch.allclose(logits[:, 7:], logits_changed[:, 7:])
    # the first layer's weights: row t is Sinkhorn on the prefix 0..t of its own scores
    attn = model.blocks[0].attn
    h = model.blocks[0].norm1(model._embed(tokens))
    q, k, _ = attn._project(h, h, h)
    q, k = (x.view(3, 12, 2, 4).transpose(1, 2) for x in (q, k))
    expected = prefix_sinkhorn(q @ k.transpose(-1, -2) / 2.0, n_iters)
    weights = model.attention_weights(tokens)
    assert [w.shape for w in weights] == [(3, 2, 12, 12)] * 2
    torch.testing.assert_close(weights[0], expected)
    torch.testing.assert_close(weights[1].sum(-1), torch.ones(3, 2, 12, dtype=torch.float64))


def test_every_variant_starts_from_the_same_weights():
    states = []
    for n_iters in (1, 3, 5):
        torch.manual_seed(4)
        states.append(build_lm({"vocab_size": 30, "max_len": 8}, n_iters=n_iters, dim=8, depth=1).state_dict())
    for state in states[1:]:
        assert state.keys() == states[0].keys()
        assert all(torch.equal(state[key], states[0][key]) for key in state)


def _write_wikitext(folder, files=("train", "valid", "test")):
    folder.mkdir(exist_ok=True)
    texts = {"train": " = Homarus = \n The lobster is blue . " * 40, "valid": " = Valid = \n Café ! " * 10,
             "test": " = Test = \n Naïve text , déjà vu . " * 10}
    for split in files:
        (folder / f"wiki.{split}.raw").write_text(texts[split], encoding="utf-8")
    return texts


def test_wikitext_loader_reads_the_three_files(tmp_path):
    texts = _write_wikitext(tmp_path / "wikitext-103-raw")
    data, ratio = load_wikitext103(tmp_path / "wikitext-103-raw", seq_len=16)
    assert data.info == {"kind": "lm", "vocab_size": 260, "max_len": 16, "level": "char", "unit": "byte"}
    train_bytes, test_bytes = (texts[s].encode("utf-8") for s in ("train", "test"))
    assert len(data.train) == (len(train_bytes) - 1) // 16 and len(data.test) == (len(test_bytes) - 1) // 16
    assert bytes((data.train[0] - 4).tolist()) == train_bytes[:17]  # windows of 17 ids: 16 inputs + 1 target
    assert ratio == pytest.approx(len(test_bytes) / len(texts["test"])) and ratio > 1  # ï, é, à: two bytes each
    valid, _ = load_wikitext103(tmp_path / "wikitext-103-raw", seq_len=16, eval_split="valid", max_chars=100)
    assert bytes((valid.test[0] - 4).tolist()) == texts["valid"].encode("utf-8")[:17]
    assert len(valid.train) == (len(texts["train"][:100].encode("utf-8")) - 1) // 16
    for text in ("", "abc", "Naïve déjà vu\n"):  # the ids of encode_bytes, without its Python list
        torch.testing.assert_close(wikitext.byte_ids(text), encode_bytes(text))
    with pytest.raises(ValueError, match="eval_split must be 'test' or 'valid', got 'dev'"):
        load_wikitext103(tmp_path / "wikitext-103-raw", seq_len=16, eval_split="dev")


def test_a_missing_wikitext_says_what_to_download_and_where(tmp_path):
    _write_wikitext(tmp_path / "partial", files=("train", "test"))
    with pytest.raises(FileNotFoundError, match=r"lacks wiki\.valid\.raw\. Download WikiText-103 .*wikitext-103-raw-v1\.zip"):
        load_wikitext103(tmp_path / "partial", seq_len=16)
    with pytest.raises(FileNotFoundError, match=r"nope does not exist\. Download WikiText-103"):
        load_wikitext103(tmp_path / "nope", seq_len=16)
    with pytest.raises(FileNotFoundError, match=r"`sinkformer run causal-lm` needs --data PATH here: .*https://"):
        run_experiment("causal-lm", full=True, runs_dir=tmp_path)
    with pytest.raises(ValueError, match="--data .* is for WikiText-103, but this run uses the embedded text"):
        run_experiment("causal-lm", data=tmp_path, runs_dir=tmp_path)


def test_full_configuration_runs_on_wikitext_files(tmp_path):
    _write_wikitext(tmp_path / "wt")
    tiny = {**TINY, "n_iters": [1, 3], "max_chars": 0, "seq_len": 16}
    ctx = run_experiment("causal-lm", full=True, data=tmp_path / "wt", overrides=tiny, runs_dir=tmp_path)
    report = (ctx.out_dir / "report.md").read_text()
    assert "full (the paper's configuration) run" in report and "WikiText-103 (raw)" in report
    assert "held out: wiki.test.raw" in report and ctx.results["bytes_per_character"] > 1


def test_full_cost_counts_one_pass_over_wikitext_for_every_model_and_seed():
    exp = get("causal-lm")
    full = {**exp.defaults, **exp.full}
    assert full["dataset"] == "wikitext-103" and full["seq_len"] == 512 and full["seeds"] >= 5
    work = exp.cost(full)
    assert [w.label for w in work] == ["Transformer", "Sinkformer (3 it.)", "Sinkformer (5 it.)"]
    steps = wikitext.WIKITEXT103_TRAIN_BYTES // 512 // 32
    assert all(w.steps == steps and w.runs == full["seeds"] and w.batch_size == 32 for w in work)
    assert [w.options["n_iters"] for w in work] == [1, 3, 5]
    # the cost method measures a step of the experiment's own model (a builder, not a registry name)
    from sinkformer.runs import cost

    tiny = {**full, "seq_len": 16, "model_options": {"dim": 8, "depth": 1, "heads": 2, "ff_mult": 2, "dropout": 0.0}}
    row = cost.measure(exp.cost(tiny)[2], time_batch=2, repeats=1)
    assert row["label"] == "Sinkformer (5 it.)" and row["step_seconds"] > 0 and row["parameters"] > 0
