"""The experiment registry, run folders and the `sinkformer experiments` / `sinkformer run` commands."""

import json

import pytest
import yaml

from sinkformer.cli import main
from sinkformer.runs.registry import get, parse_overrides, registry, run_experiment


def test_registry_lists_normalizations(capsys):
    assert "normalizations" in registry()
    assert main(["experiments"]) == 0
    assert "normalizations" in capsys.readouterr().out


def test_run_writes_the_run_folder(tmp_path):
    ctx = run_experiment("normalizations", overrides={"seed": 1}, runs_dir=tmp_path)
    files = {p.name for p in ctx.out_dir.iterdir()}
    assert {"config.yaml", "metrics.csv", "results.json", "report.md", "normalizations.png"} <= files
    config = yaml.safe_load((ctx.out_dir / "config.yaml").read_text())
    assert config["seed"] == 1 and config["mode"] == "quick"
    results = json.loads((ctx.out_dir / "results.json").read_text())
    assert results["sinkhorn_keys_used"] == 10 and results["softmax_keys_used"] < 10
    report = (ctx.out_dir / "report.md").read_text()
    assert f"{results['summary'][1]['entropy']:.3f}" in report and "![" in report
    assert (ctx.out_dir / "metrics.csv").read_text().startswith("matrix,")


def test_overrides_are_typed_and_checked():
    defaults = get("normalizations").defaults
    assert parse_overrides(["seed=3"], defaults) == {"seed": 3}
    with pytest.raises(ValueError, match="unknown option; valid keys: n_points, seed"):
        parse_overrides(["lr=1"], defaults)
    with pytest.raises(ValueError, match="expects key=value"):
        parse_overrides(["seed"], defaults)


def test_cli_errors_are_one_line(capsys):
    assert main(["run", "no-such-experiment"]) == 2
    assert "unknown experiment 'no-such-experiment'; valid names:" in capsys.readouterr().err
    assert main(["run", "normalizations", "--data", "/no/such/path"]) == 2
