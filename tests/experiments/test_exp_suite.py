"""The summary suite (`sinkformer run` with no name), its HTML report and the `run` command."""

import os
import json
import re
import time
from pathlib import Path

import pytest
import torch

from sinkformer.cli import main
from sinkformer.runs import registry as registry_module
from sinkformer.runs import suite
from sinkformer.runs.registry import Experiment, registry
from sinkformer.runs.report import render_html
from sinkformer.runs.verdicts import Comparison, count_verdicts

TINY_PATCH = {"patch_sizes": [4], "seeds": 2, "train": {"epochs": 1, "batch_size": 64, "max_train_batches": 2}}


def _boom(ctx):
    raise RuntimeError("the disk is full (on purpose)")


@pytest.fixture
def failing_experiment(monkeypatch):
    registry()  # discover the real experiments first
    exp = Experiment("boom", "always fails", "no paper", 0.01, None, {}, {}, _boom)
    monkeypatch.setitem(registry_module._REGISTRY, "boom", exp)
    return exp


def test_suite_reports_every_experiment_and_survives_a_failure(tmp_path, failing_experiment):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    lines = []
    try:
        path = suite.run_suite(tmp_path, names=["normalizations", "boom", "patch-size"],
                               overrides={"patch-size": TINY_PATCH}, echo=lines.append, plain=False)
    finally:
        torch.set_num_threads(threads)
    assert path.parent.parent == tmp_path / "summary" and path.name == "report.md"
    report = path.read_text()
    # overview: one row per experiment, the failure marked, measured times
    assert re.search(r"\| \[normalizations\]\(\.\./\.\./normalizations/[\d-]+/report\.md\) \| Sinkformers, Figure 1 \|", report)
    assert "| boom | no paper | — |" in report and "**failed**" in report
    assert "RuntimeError: the disk is full (on purpose)" in report  # the error, in the Failures section
    patch_dir = next((tmp_path / "patch-size").iterdir())
    assert "| [patch-size](../../patch-size/" in report  # the experiment after the failure still ran
    # the experiments' own reports, one heading level down, with figure links that resolve from the summary
    assert "\n## Normalisations of the attention matrix" in report and "\n## Accuracy vs patch size" in report
    figures = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", report)
    assert len(figures) == 2 and all((path.parent / f).is_file() for f in figures)
    assert any(str(Path(f).parent.name) == patch_dir.name for f in figures)
    # findings side by side, every paired comparison with its interval, the verdicts counted, provenance
    results = json.loads((patch_dir / "results.json").read_text())
    assert "## Paper vs these runs" in report and "patch-size" in report.split("## Paper vs these runs")[1]
    comparisons = results["comparisons"]
    assert len(comparisons) == 1 and comparisons[0]["seeds"] == 2
    counts = count_verdicts(comparisons)
    assert "1 paired comparisons" in report and all(f"**{n} {v}**" in report for v, n in counts.items())
    assert Comparison.from_dict(comparisons[0]).interval() in report.split("## Verdicts")[1]
    assert "## Reproducibility" in report and "BLAS" in report and '"git_commit"' in report
    assert json.loads((patch_dir / "provenance.json").read_text())["torch"] == torch.__version__
    html = (path.parent / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 2 and "<table>" in html
    # progress (on a terminal): a line before and after each experiment, and the total
    assert any(line.startswith("\n[2/3] boom") for line in lines)
    assert any("[2/3] boom: FAILED after" in line for line in lines)
    assert any("[3/3] patch-size: done in" in line for line in lines)
    assert lines[-1].strip().startswith("2 of 3 experiments done in") and lines[-1].endswith("failed: boom")


def _sleep(ctx):
    time.sleep(30)


def _slow_but_moving(ctx):
    """5 x its expected 0.6 s, logging a row every 0.3 s: slow, not stuck."""
    for step in range(10):
        time.sleep(0.3)
        ctx.log(step=step)
    ctx.write_report("# slow but moving")


@pytest.fixture
def fake_experiments(monkeypatch):
    registry()
    for name, fn in (("sleepy", _sleep), ("slowpoke", _slow_but_moving)):
        monkeypatch.setitem(registry_module._REGISTRY, name, Experiment(name, "a test", "no paper", 0.01, None, {}, {},
                                                                        fn))


def test_a_slow_experiment_that_shows_progress_completes(tmp_path, fake_experiments):
    # 3 s against an expected 0.6 s: the old limit (3x the expected time) stopped it as failed; now a slow
    # experiment is never a failure, and the stall detector (1 s here) sees its rows
    path = suite.run_suite(tmp_path, names=["slowpoke"], stall_minutes=1 / 60, echo=lambda line: None)
    report = path.read_text()
    assert "| ok |" in report and "**failed**" not in report
    (entry,) = json.loads((path.parent / "summary.json").read_text())["entries"]
    assert entry["ok"] and entry["seconds"] > 3 * 60 * 0.01


def test_a_stalled_experiment_is_stopped_and_the_suite_goes_on(tmp_path, fake_experiments):
    path = suite.run_suite(tmp_path, names=["sleepy", "slowpoke"], stall_minutes=1 / 60, echo=lambda line: None)
    sleepy, slowpoke = json.loads((path.parent / "summary.json").read_text())["entries"]
    assert not sleepy["ok"] and sleepy["seconds"] < 10  # it would sleep 30 s
    assert re.search(r"ExperimentStalled: stopped after 0 min 0\d s: no progress \(no logged row, no training "
                     r"step\) for 0 min 0\d s; it looks stuck", path.read_text())
    assert slowpoke["ok"]  # the next experiment ran (and, logging rows, never stalled)


def test_the_time_limit_is_opt_in(tmp_path, fake_experiments):
    path = suite.run_suite(tmp_path, names=["slowpoke"], time_limit=1 / 60, echo=lambda line: None)
    assert re.search(r"ExperimentTimeout: stopped after 0 min 0\d s: past the time limit of 0 min 01 s asked "
                     r"for \(--time-limit\)", path.read_text())
    with pytest.raises(ValueError, match="time_limit must be a positive number of minutes"):
        suite.run_suite(tmp_path, names=["slowpoke"], time_limit=0)


def _ctrl_c(ctx):
    ctx.log(step=0)
    raise KeyboardInterrupt


def test_ctrl_c_ends_the_suite_with_what_it_kept_and_no_summary(tmp_path, monkeypatch):
    registry()
    monkeypatch.setitem(registry_module._REGISTRY, "ctrl-c", Experiment("ctrl-c", "Ctrl-C", "no paper", 0.01, None,
                                                                          {}, {}, _ctrl_c))
    with pytest.raises(KeyboardInterrupt) as stop:
        suite.run_suite(tmp_path, names=["normalizations", "ctrl-c", "patch-size"], echo=lambda line: None)
    (finished,) = (tmp_path / "normalizations").iterdir()
    (partial,) = (tmp_path / "ctrl-c").iterdir()
    assert re.fullmatch(rf"interrupted after 0 min \d\d s, no summary written; kept the folders of 1 finished "
                        rf"experiment\(s\) under {tmp_path}/ \(normalizations\); partial folders of unfinished ones: "
                        rf"{partial}", str(stop.value))
    assert (finished / "report.md").is_file() and (partial / "metrics.csv").is_file()
    assert not (tmp_path / "summary").exists() and not (tmp_path / "patch-size").exists()
    # the command: one line, exit code 130, no traceback
    runs = tmp_path / "single"
    assert main(["run", "ctrl-c", "--runs-dir", str(runs)]) == 130


def test_ctrl_c_in_a_single_experiment_is_one_line(tmp_path, monkeypatch, capsys):
    registry()
    monkeypatch.setitem(registry_module._REGISTRY, "ctrl-c", Experiment("ctrl-c", "Ctrl-C", "no paper", 0.01, None,
                                                                          {}, {}, _ctrl_c))
    assert main(["run", "ctrl-c", "--runs-dir", str(tmp_path)]) == 130
    (partial,) = (tmp_path / "ctrl-c").iterdir()
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip() == (
        f"sinkformer run: interrupted: kept the unfinished run folder {partial} (config.yaml, metrics.csv, "
        f"provenance.json; no report)")


def test_durations_are_rounded_once():
    assert [suite._minutes(s) for s in (0, 59.4, 59.6, 1019.7, 3600)] == [
        "0 min 00 s", "0 min 59 s", "1 min 00 s", "17 min 00 s", "60 min 00 s"]  # never "16 min 60 s"


def test_the_run_help_states_the_stall_time(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    assert f"no progress for {suite.STALL_MINUTES:g} minutes is stopped as stalled" in " ".join(
        capsys.readouterr().out.split())


def test_the_watchdog_beats_re_arm_it():
    clock = [0.0]
    dog = suite._Watchdog(stall=10, limit=None, clock=lambda: clock[0])
    dog.start = dog.last = 0.0
    clock[0] = 9.0
    dog.beat()
    clock[0] = 15.0
    assert dog._due_in() == pytest.approx(4.0)  # 10 s after the last beat
    dog.active = False
    clock[0] = 19.5
    with pytest.raises(suite.ExperimentStalled, match="for 0 min 10 s"):
        dog._check()


def test_parallel_suite_reports_a_task_its_worker_could_not_run(tmp_path):
    # a lambda cannot be sent to a spawned worker: the experiment fails, the suite still reports
    path = suite.run_suite(tmp_path, names=["normalizations"], jobs=2,
                           overrides={"normalizations": {"seed": lambda: 0}}, echo=lambda line: None)
    text = path.read_text()
    assert "**failed**" in text and "the worker process could not run it" in text

def test_suite_refuses_unknown_names(tmp_path):
    with pytest.raises(ValueError, match="unknown experiment\\(s\\) nope; valid names: "):
        suite.run_suite(tmp_path, names=["nope"])


def test_run_without_a_name_runs_the_suite(tmp_path, monkeypatch, capsys):
    calls = []

    def fake_suite(runs_dir, *, seeds=None, jobs=1, time_limit=None):
        calls.append((runs_dir, seeds, torch.get_num_threads(), jobs))
        out = Path(runs_dir) / "summary" / "x" / "report.md"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("# summary")
        return out

    monkeypatch.setattr(suite, "run_suite", fake_suite)
    threads = torch.get_num_threads()
    assert main(["run", "--runs-dir", str(tmp_path), "--seeds", "2"]) == 0
    assert calls == [(str(tmp_path), 2, 1, min(2, os.cpu_count()))]  # quick runs use one thread, on 2 processes ...
    assert torch.get_num_threads() == threads  # ... and the caller's setting comes back
    out = capsys.readouterr().out
    assert f"summary report: {tmp_path.resolve()}/summary/x/report.md" in out and "report.html" in out
    assert main(["run", "--runs-dir", str(tmp_path), "--jobs", "3"]) == 0
    assert calls[-1][-1] == 3


def test_parallel_suite_runs_in_worker_processes_and_reports_in_registry_order(tmp_path, capsys):
    lines = []
    path = suite.run_suite(tmp_path, names=["riccati", "normalizations"], jobs=2, echo=lines.append, plain=False,
                           overrides={"riccati": {"n_particles": 200, "steps": 20}})
    text = path.read_text()
    assert "in each of 2 processes" in text and "**failed**" not in text
    overview = text.split("## Overview")[1]
    assert overview.index("riccati") < overview.index("normalizations")  # registry order, not finishing order
    assert any(line.startswith("normalizations: done in") for line in lines)
    assert any(line.startswith("riccati: done in") for line in lines)
    assert any(line.startswith("started riccati") for line in lines)
    assert (tmp_path / "normalizations").is_dir() and (tmp_path / "riccati").is_dir()
    # the terminal's bar: experiments done, and what runs for how long
    bar = capsys.readouterr().err
    assert "experiments: 100%" in bar and "2/2" in bar
    assert re.search(r"running: (normalizations|riccati) \((\d+ rows?, )?0:0[1-9]", bar)


def test_the_time_limit_works_inside_a_worker(tmp_path):
    lines = []
    path = suite.run_suite(tmp_path, names=["riccati"], jobs=2, time_limit=3 / 60, echo=lines.append, plain=True,
                           overrides={"riccati": {"n_particles": 200_000, "steps": 5000}})
    assert "**failed**" in path.read_text() and "ExperimentTimeout: stopped after" in path.read_text()
    assert any(re.search(r"riccati: FAILED after \d+ s: ExperimentTimeout", line) for line in lines)


@pytest.mark.parametrize("argv, message", [
    (["run", "--full"], "--full only apply to a single experiment"),
    (["run", "--set", "seed=1"], "--set only apply to a single experiment"),
    (["run", "normalizations", "--threads", "0"], "--threads must be >= 1, got 0"),
    (["run", "--jobs", "0"], "--jobs must be >= 1, got 0"),
    (["run", "normalizations", "--jobs", "2"], "--jobs only applies to the suite"),
    (["run", "normalizations", "--set", "nope=1"], "--set nope: unknown option"),
])
def test_run_errors_are_one_line(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_render_html_embeds_png_figures(tmp_path):
    from sinkformer.plotting import pyplot, save_png

    plt = pyplot()
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    save_png(fig, tmp_path / "sub" / "fig.png")
    markdown = "# Title\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n![plot](sub/fig.png)\n\n![missing](nope.png)\n"
    html = render_html(markdown, tmp_path, "T & co")
    assert "<title>T &amp; co</title>" in html and "<td>1</td>" in html
    assert html.count("data:image/png;base64,iVBOR") == 1  # the PNG signature, base64-encoded
    assert 'src="nope.png"' in html  # a missing file stays a link
