"""A claim is a test: the README's results are what the script renders from the committed run."""

import json

import pytest
import torch

from sinkformer.runs import readme
from sinkformer.runs.suite import run_suite


def test_readme_and_docs_equal_the_rendering_of_the_committed_files():
    data = json.loads(readme.DIGEST.read_text())
    pages = readme.render_docs(data)
    assert readme.README in pages and readme.EXPERIMENTS_PAGE in pages
    for page, text in pages.items():
        assert page.read_text() == text, f"{page.name} differs from `python -m sinkformer.runs.readme render`"
    assert readme.main(["check"]) == 0
    # the README's summary and the experiments page's results are both there, from the same run
    assert readme.render_summary(data) in readme.README.read_text()
    experiments_page = readme.EXPERIMENTS_PAGE.read_text()
    assert readme.render(data) in experiments_page and data["provenance"]["cpu"] in experiments_page
    # the committed run is a whole suite, with 5 seeds behind every paired comparison
    assert all(e["ok"] for e in data["experiments"]) and len(data["experiments"]) >= 20
    comparisons = [c for e in data["experiments"] for c in e["comparisons"]]
    assert comparisons and all(c["seeds"] >= 5 for c in comparisons)
    assert data["provenance"]["git_commit"]


def test_included_benchmark_tables_equal_their_files(tmp_path, monkeypatch):
    """``<!-- begin: include PATH -->`` blocks hold the committed file verbatim; a stale copy is rewritten."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "table.md").write_text("| a |\n|---|\n| 1 |\n")
    page = tmp_path / "docs" / "page.md"
    page.write_text("intro\n<!-- begin: include table.md -->\nold copy\n<!-- end: include table.md -->\nrest\n")
    (tmp_path / "README.md").write_text(f"{readme.SUMMARY_BEGIN}\n{readme.SUMMARY_END}\n")
    (tmp_path / "docs" / "experiments.md").write_text(f"{readme.BEGIN}\n{readme.END}\n")
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
    assert "**1 paired comparisons**" in section and "patch-size" in section and "no paired comparison" in section
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
