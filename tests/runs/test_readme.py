"""A claim is a test: the README's results are what the script renders from the committed run."""

import json

import pytest
import torch

from sinkformer.runs import readme
from sinkformer.runs.suite import run_suite


def test_readme_results_equal_the_rendering_of_the_committed_run():
    data = json.loads(readme.DIGEST.read_text())
    text = readme.README.read_text()
    assert readme.update(text, readme.render(data)) == text, (
        "README.md's results differ from the committed run: `python -m sinkformer.runs.readme render`")
    assert readme.main(["check"]) == 0
    # the committed run is a whole suite, with 5 seeds behind every paired comparison
    assert all(e["ok"] for e in data["experiments"]) and len(data["experiments"]) >= 20
    comparisons = [c for e in data["experiments"] for c in e["comparisons"]]
    assert comparisons and all(c["seeds"] >= 5 for c in comparisons)
    assert data["provenance"]["git_commit"] and data["provenance"]["cpu"] in text


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
