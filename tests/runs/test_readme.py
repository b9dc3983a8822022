"""A claim is a test: the README's results are what the script renders from the committed run."""

import json

import pytest
import torch

from sinkformer.runs import readme
from sinkformer.runs.suite import run_suite
from sinkformer.runs.verdicts import CLAIM, EXTENSION, INCONCLUSIVE, MIN_SEEDS, NOISE, SAME, WORSE, paired

COMMITTED = json.loads(readme.DIGEST.read_text())


def test_readme_and_docs_equal_the_rendering_of_the_committed_files():
    data = COMMITTED
    pages = readme.render_docs(data)
    assert readme.README in pages and readme.EXPERIMENTS_PAGE in pages
    for page, text in pages.items():
        assert page.read_text() == text, f"{page.name} differs from `python -m sinkformer.runs.readme render`"
    assert readme.main(["check"]) == 0
    # the README's summary and the experiments page's headline and results are there, from the same run
    assert readme.render_summary(data) in readme.README.read_text()
    experiments_page = readme.EXPERIMENTS_PAGE.read_text()
    assert readme.render(data) in experiments_page and data["provenance"]["cpu"] in experiments_page
    # the experiments page says in its first lines what the quick forms are and what they found, by kind
    first = experiments_page.split("\n", 4)[3]
    assert first == readme.render_headline(data) and first.startswith(readme.QUICK_FORMS)
    summary = readme.README.read_text().split(readme.SUMMARY_BEGIN + "\n", 1)[1]
    assert summary.startswith(readme.QUICK_FORMS)


def test_the_committed_digest_is_a_whole_suite_with_kinds_and_six_seeds():
    data = COMMITTED
    assert all(e["ok"] for e in data["experiments"]) and len(data["experiments"]) >= 20
    comparisons = [c for e in data["experiments"] for c in e["comparisons"]]
    assert comparisons and all(c["seeds"] >= MIN_SEEDS for c in comparisons)
    assert {c["kind"] for c in comparisons} >= {CLAIM, EXTENSION}
    assert data["provenance"]["git_commit"]


def _digest(experiments: dict[str, list]) -> dict:
    """A small digest as :func:`readme.digest` writes it."""
    facts = {"cpu": "a CPU", "cpu_count": 2, "torch": "2.13", "sinkformer": "0.1", "git_commit": "0123456789abcdef"}
    return {"provenance": facts, "seconds": 125, "jobs": 2, "started": "2026-11-26T10:00:00",
            "experiments": [{"name": name, "paper": f"paper of {name}", "ok": True, "seconds": 60,
                             "comparisons": [c.to_dict() for c in comparisons], "finding": None}
                            for name, comparisons in experiments.items()]}


def _comparison(diffs, kind, name="m"):
    return paired([0.0] * len(diffs), diffs, metric=name, higher_is_better=True, paper_better=True, paper="p",
                  kind=kind, variant_name=f"variant {name}")


def test_the_headline_counts_only_the_paper_claims_before_and_after_holm():
    strong, weak = [1.0, 1.1, 0.9, 1.2, 1.0, 1.05], [0.3, 0.1, -0.05, 0.2, 0.25, 0.4]
    data = _digest({"a": [_comparison(strong, CLAIM, "a1"), _comparison(weak, CLAIM, "a2")],
                    "b": [_comparison(strong, EXTENSION, "b1"), _comparison(strong, WORSE, "b2")],
                    "c": [_comparison([0.1, -0.1, 0.0, 0.2, -0.2, 0.05], NOISE, "c1")], "d": []})
    headline = readme.render_headline(data)
    assert headline.startswith(readme.QUICK_FORMS) and readme.SEEDS_VARY in headline
    assert "**2 of its 5 paired comparisons** (6 seeds each) **test a claim of the papers at the papers' settings**" \
        in headline
    assert f"by the 95 % interval **2 {SAME}**, **0 opposite**, **0 {INCONCLUSIVE}**" in headline
    assert f"after Holm's correction for all 5 comparisons, 1 {SAME}, 0 opposite, 1 {INCONCLUSIVE}" in headline
    assert ("Listed apart: 1 settings the papers themselves report as worse; 1 gaps the papers report within noise; "
            "1 comparisons with no paper claim (our extensions)") in headline
    section = readme.render(data)
    assert "**2 paper claims at the papers' settings** (of 5 paired comparisons, 6 seeds each)" in section
    for kind in (CLAIM, WORSE, NOISE, EXTENSION):
        assert f"### {kind[0].upper()}{kind[1:]}:" in section
    assert "| a | paper of a | 2 / 0 / 0 | — |" in section and f"| b | paper of b | — | 1 {WORSE}, 1 {EXTENSION} |" in section
    assert "| d | paper of d | — (a measurement, no paired comparison) | — |" in section
    assert readme.render_summary(data) == readme.render_headline(data, "docs/experiments.md#what-the-quick-runs-found")


def test_the_headline_gives_the_machines_speed_beside_the_runs_time():
    """The run's time is read with its calibration step (the machine's speed then); a digest without one says none."""
    data = _digest({"a": [_comparison([1.0, 1.1, 0.9, 1.2, 1.0, 1.05], CLAIM)]})
    data.update(seconds=1155, calibration={"step_ms": 7.022, "threads": 1, "workload": "torch-encoder-layer-1"})
    assert ("experiments in 19 min 15 s (a training step of PyTorch's own encoder layer, the suite's calibration, "
            "took 7.02 ms at its start: the machine's speed then). ") in readme.render_headline(data)
    data["calibration"] = None
    assert "experiments in 19 min 15 s. " in readme.render_headline(data)


def test_an_old_digest_renders_its_comparisons_as_unclassified():
    old = _digest({"a": [_comparison([1.0, 1.1, 0.9, 1.2, 1.0, 1.05], CLAIM)]})
    for c in old["experiments"][0]["comparisons"]:
        del c["kind"], c["p_value"], c["p_sign_flip"]
    headline = readme.render_headline(old)
    assert "**0 of its 1 paired comparisons**" in headline and readme.STALE in headline
    assert readme.SEEDS_VARY not in headline and "### Unclassified:" in readme.render(old)


def test_included_benchmark_tables_equal_their_files(tmp_path, monkeypatch):
    """``<!-- begin: include PATH -->`` blocks hold the committed file verbatim; a stale copy is rewritten."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "table.md").write_text("| a |\n|---|\n| 1 |\n")
    page = tmp_path / "docs" / "page.md"
    page.write_text("intro\n<!-- begin: include table.md -->\nold copy\n<!-- end: include table.md -->\nrest\n")
    (tmp_path / "README.md").write_text(f"{readme.SUMMARY_BEGIN}\n{readme.SUMMARY_END}\n")
    (tmp_path / "docs" / "experiments.md").write_text(
        f"{readme.HEADLINE_BEGIN}\n{readme.HEADLINE_END}\n{readme.BEGIN}\n{readme.END}\n")
    for name, value in (("ROOT", tmp_path), ("README", tmp_path / "README.md"), ("DOCS", tmp_path / "docs"),
                        ("EXPERIMENTS_PAGE", tmp_path / "docs" / "experiments.md")):
        monkeypatch.setattr(readme, name, value)
    assert readme.main(["check"]) == 1
    assert readme.main(["render"]) == 0 and readme.main(["check"]) == 0
    assert page.read_text() == ("intro\n<!-- begin: include table.md -->\n| a |\n|---|\n| 1 |\n"
                                "<!-- end: include table.md -->\nrest\n")


def test_digest_and_render_of_a_suite_run(tmp_path):
    tiny_patch = {"patch_sizes": [4], "seeds": 2, "train": {"epochs": 1, "batch_size": 64, "max_train_batches": 2}}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        path = run_suite(tmp_path, names=["normalizations", "patch-size"], overrides={"patch-size": tiny_patch},
                         echo=lambda line: None)
    finally:
        torch.set_num_threads(threads)
    data = readme.digest(path.parent)
    assert [e["name"] for e in data["experiments"]] == ["normalizations", "patch-size"]
    section = readme.render(data)
    assert "**1 paper claims at the papers' settings** (of 1 paired comparisons, 2 seeds each)" in section
    assert "patch-size" in section and "no paired comparison" in section
    text = f"intro\n{readme.BEGIN}\nold\n{readme.END}\nrest\n"
    assert readme.update(text, section) == f"intro\n{readme.BEGIN}\n{section}\n{readme.END}\nrest\n"
    with pytest.raises(ValueError, match="no results markers"):
        readme.update("no markers here", section)


def test_the_suite_estimate_agrees_with_the_committed_run():
    """What `sinkformer run` announces (the longest-first makespan of the experiments' expected
    minutes) is within 25 % of the committed run's measured wall time, which the README states."""
    from sinkformer.runs.registry import get
    from sinkformer.runs.suite import expected_wall_minutes

    data = json.loads(readme.DIGEST.read_text())
    expected = expected_wall_minutes([get(e["name"]).quick_minutes for e in data["experiments"]], data["jobs"])
    measured = data["seconds"] / 60
    assert 0.8 <= expected / measured <= 1.25, (expected, measured)
    for e in data["experiments"]:  # and no single experiment is off by more than a factor 2.5
        assert 0.4 <= get(e["name"]).quick_minutes * 60 / max(e["seconds"], 1) <= 2.5 or e["seconds"] < 20, e["name"]
