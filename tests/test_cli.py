"""The `sinkformer` command: --version, `python -m sinkformer`, help texts, one meaning of --data,
"did you mean" suggestions, and the suite's progress and time estimate."""

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import torch_threads

import sinkformer
from sinkformer._options import check_options, close_matches, did_you_mean
from sinkformer.cli import build_parser, main
from sinkformer.data import get_dataset
from sinkformer.models import get_model_class
from sinkformer.runs import suite
from sinkformer.runs.registry import get, parse_overrides

TINY_PATCH = {"patch_sizes": [4], "seeds": 2, "train": {"epochs": 1, "batch_size": 64, "max_train_batches": 2}}
STAMP = r"\[\d\d:\d\d:\d\d\] "


# --- --version and python -m sinkformer ---------------------------------------------------------

def test_version_flag(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"sinkformer {sinkformer.__version__}\n"
    assert re.fullmatch(r"\d+\.\d+\.\d+", sinkformer.__version__)


def test_python_dash_m_sinkformer_is_the_command():
    def run(*argv):
        return subprocess.run([sys.executable, "-m", "sinkformer", *argv], capture_output=True, text=True,
                              timeout=120)

    version = run("--version")
    assert version.returncode == 0 and version.stdout == f"sinkformer {sinkformer.__version__}\n"
    mistake = run("run", "modelnt")  # a user mistake: one line, exit code 2, as with `sinkformer`
    assert mistake.returncode == 2 and mistake.stdout == ""
    assert mistake.stderr.startswith("sinkformer run: error: unknown experiment 'modelnt'; did you mean 'modelnet'?")


# --- help ---------------------------------------------------------------------------------------

def _help(capsys, *command) -> str:
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    return {"": build_parser(), **build_parser().commands}


@pytest.mark.parametrize("command", ["", "demo", "experiments", "run", "train"])
def test_every_help_states_each_default_once(command, capsys):
    text = _help(capsys, *([command] if command else []))
    assert "(default: None)" not in text and "(default: False)" not in text and "==SUPPRESS==" not in text
    parser = _subparsers()[command]
    formatter = parser.formatter_class(parser.prog)
    for action in parser._actions:
        if action.help is argparse.SUPPRESS:
            flags = text.split("\nmodels (")[0]  # train's help ends with the models and datasets
            assert not any(option in flags for option in action.option_strings)  # hidden old spellings
            continue
        shown = formatter._get_help_string(action) % {"default": action.default}
        assert shown.count("(default:") <= 1, (action.option_strings, shown)
    if command:
        assert text.startswith(f"usage: sinkformer {command}") and "\n\n" in text.split("options:")[0]  # a description


def test_help_texts(capsys):
    top = _help(capsys)
    assert "--version" in top and "commands:" in top and "`sinkformer COMMAND --help`" in top
    demo = " ".join(_help(capsys, "demo").split())
    assert "--points N points per cloud (default: 10)" in demo and "--seed N random seed (default: 0)" in demo
    run = " ".join(_help(capsys, "run").split())  # help texts wrap: compare with single spaces
    assert "--quick" not in run and "--full the paper's configuration" in run
    assert "--data PATH folder (or file) of the real dataset, for --full (default: the embedded data)" in run
    assert "--runs-dir DIR where run folders go (default: runs)" in run and "(default: auto)" in run
    assert "examples: sinkformer run every experiment" in run
    train = " ".join(_help(capsys, "train").split())
    assert "--dataset NAME dataset name (data.name; listed below)" in train
    assert "--data PATH folder (or file) of a real dataset (data.path)" in train
    assert "--data-path" not in train.split("models (")[0]  # the old name works, but is not offered


def test_old_quick_flag_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["run", "normalizations", "--quick"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: sinkformer run") and "sinkformer run: error: unrecognized arguments: --quick" in err
    assert "the quick form is what runs without --full" in err


def test_mistyped_commands_and_flags_get_suggestions(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["rn"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "error: argument COMMAND: invalid choice: 'rn' (choose from " in err and err.endswith("; did you mean 'run'?\n")
    with pytest.raises(SystemExit):
        main(["run", "vit", "--seedz", "2"])
    assert "unrecognized arguments: --seedz 2 (--seedz: did you mean '--seeds'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--datset=digits"])
    assert "(--datset: did you mean '--dataset'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["demo", "--zzz"])
    assert capsys.readouterr().err.rstrip().endswith("error: unrecognized arguments: --zzz")


# --- one meaning of --data -----------------------------------------------------------------------

@pytest.fixture
def train_flags(monkeypatch, tmp_path):
    """What `sinkformer train` hands to resolve_config (which then stops the command)."""
    from sinkformer.training import runner

    seen = {}

    def resolve_config(file, **flags):
        seen.update(flags)
        raise ValueError("stopped by the test")

    monkeypatch.setattr(runner, "resolve_config", resolve_config)
    monkeypatch.chdir(tmp_path)
    return seen


@pytest.mark.parametrize("argv, dataset, path, warning", [
    (["--dataset", "digits"], "digits", None, None),
    (["--dataset", "mnist", "--data", "mnist"], "mnist", "mnist", None),  # --data is always a path
    (["--data", "digits"], "digits", None, "read as --dataset digits"),  # the old spelling of a name
    (["--data", "mnist", "--data-path", "/d/mnist"], "mnist", "/d/mnist", "read as --data /d/mnist"),
    (["--dataset", "mnist", "--data-path", "/d/mnist"], "mnist", "/d/mnist", "--data-path is the old name of --data"),
    (["--data", "existing"], None, "existing", None),  # a folder of that name: a path
])
def test_train_dataset_and_data(argv, dataset, path, warning, train_flags, tmp_path, capsys):
    (tmp_path / "existing").mkdir()
    assert main(["train", "--model", "vit", *argv]) == 2
    assert (train_flags["data"], train_flags["data_path"]) == (dataset, path)
    err = capsys.readouterr().err
    if warning is None:
        assert "warning" not in err
    else:
        assert "sinkformer train: warning: " in err and warning in err


def test_train_data_given_twice_is_an_error(train_flags, capsys):
    assert main(["train", "--dataset", "mnist", "--data", "/a", "--data-path", "/b"]) == 2
    assert "--data-path is the old name of --data (the dataset's folder): give one of them" in capsys.readouterr().err
    assert train_flags == {}


def test_train_options_and_threads_reach_run_training(monkeypatch, capsys):
    from sinkformer.training import runner

    calls = []
    monkeypatch.setattr(runner, "resolve_config", lambda file, **flags: {})
    monkeypatch.setattr(runner, "check_config", lambda config: None)

    def run_training(config, callbacks=(), **options):
        calls.append({**options, "callbacks": [type(c).__name__ for c in callbacks], "threads": torch.get_num_threads()})
        raise ValueError("stopped by the test")

    monkeypatch.setattr(runner, "run_training", run_training)
    threads = torch.get_num_threads()
    free = [(1, 1.0)]
    monkeypatch.setattr("sinkformer.training.threads.free_cores", lambda: free[0])
    assert main(["train", "--out", "x", "--overwrite"]) == 2
    assert main(["train", "--out", "x", "--threads", "3"]) == 2
    assert main(["train", "--out", "x", "--resume", "--allow-schedule-changes"]) == 2
    # without --threads: the free cores, followed while training; with it: that many, fixed
    assert calls == [{"out_dir": "x", "resume": False, "overwrite": True, "callbacks": ["FollowFreeCores"], "threads": 1},
                     {"out_dir": "x", "resume": False, "callbacks": [], "threads": 3},
                     {"out_dir": "x", "resume": True, "allow_schedule_changes": True, "callbacks": ["FollowFreeCores"],
                      "threads": 1}]
    assert torch.get_num_threads() == threads  # the caller's setting comes back
    assert "1 torch thread(s): other processes keep 1.0 of this machine's cores busy" in capsys.readouterr().err
    free[0] = None  # where the cores' use cannot be read, torch's own setting stays
    assert main(["train", "--out", "x"]) == 2 and calls[-1]["threads"] == threads
    assert main(["train", "--out", "x", "--allow-schedule-changes"]) == 2
    assert "--allow-schedule-changes only applies with --resume" in capsys.readouterr().err
    assert main(["train", "--out", "x", "--threads", "0"]) == 2
    assert "--threads must be >= 1, got 0" in capsys.readouterr().err


def test_run_data_is_a_path(capsys):
    assert main(["run", "normalizations", "--data", "/no/such/path"]) == 2
    assert "--data /no/such/path: no such file or folder" in capsys.readouterr().err


# --- did you mean --------------------------------------------------------------------------------

def test_did_you_mean():
    names = ["modelnet", "nli", "normalizations", "patch-size", "vit", "vit_attention_only"]
    assert did_you_mean("modelnt", names) == "did you mean 'modelnet'? "
    assert did_you_mean("ViT", names) == "did you mean 'vit'? "  # case ...
    assert did_you_mean("patch_size", names) == "did you mean 'patch-size'? "  # ... and - vs _ are ignored
    assert did_you_mean("qqqq", names) == ""
    assert close_matches("sortcu", ["sort", "sortcut", "pixels"]) == ["sortcut", "sort"]  # best first
    assert len(close_matches("nl", ["nli", "nlp", "nla", "nlq"])) == 3  # three at most
    assert did_you_mean("sortcu", ["sort", "sortcut"]) == "did you mean 'sortcut' or 'sort'? "
    assert re.fullmatch(r"did you mean 'nl\w', 'nl\w' or 'nl\w'\? ", did_you_mean("nl", ["nli", "nlp", "nla", "nlq"]))


def test_unknown_names_suggest_the_closest(capsys):
    with pytest.raises(ValueError, match=r"^unknown model 'vitt'; did you mean 'vit'\? valid models: set_transformer"):
        get_model_class("vitt")
    with pytest.raises(ValueError, match=r"^unknown dataset 'digit'; did you mean 'digits'\? valid datasets: digits"):
        get_dataset("digit")
    with pytest.raises(ValueError, match=r"^unknown experiment 'modelnt'; did you mean 'modelnet'\? valid names: "):
        get("modelnt")
    with pytest.raises(ValueError, match=r"^--set sed: unknown option; did you mean 'seed'\? valid keys: n_points, seed"):
        parse_overrides(["sed=1"], get("normalizations").defaults)
    with pytest.raises(ValueError, match=r"^model 'x': unknown option\(s\) dimm; did you mean 'dim'\? valid options: "
                                         r"dim=1, depth=2$"):
        check_options("model 'x'", {"dimm": 1}, {"dim": 1, "depth": 2})
    with pytest.raises(ValueError, match=r"unknown option\(s\) deph, dimm, zz; deph: did you mean 'depth'\? "
                                         r"dimm: did you mean 'dim'\? valid options"):
        check_options("model 'x'", {"dimm": 1, "deph": 2, "zz": 3}, {"dim": 1, "depth": 2})
    with pytest.raises(ValueError, match=r"unknown experiment\(s\) modelnt; did you mean 'modelnet'\? valid names: "):
        suite.run_suite("unused", names=["modelnt"])
    assert main(["run", "normalisations"]) == 2
    assert "unknown experiment 'normalisations'; did you mean 'normalizations'" in capsys.readouterr().err
    assert main(["train", "--model", "vit", "--dataset", "digts"]) == 2
    assert "unknown dataset 'digts'; did you mean 'digits'?" in capsys.readouterr().err


# --- the suite: time estimate and progress -------------------------------------------------------

def test_expected_wall_minutes_is_the_longest_first_makespan():
    # longest first, each to the first free worker: 5+3 | 4+3+3 -> 10 (the best split, 5+4 | 3+3+3, is 9)
    assert suite.expected_wall_minutes([3, 5, 3, 4, 3], jobs=2) == 10
    assert suite.expected_wall_minutes([3, 5, 3, 4, 3], jobs=1) == 18
    assert suite.expected_wall_minutes([3, 5, 3, 4, 3], jobs=3) == 7  # 5 | 4+3 | 3+3
    assert suite.expected_wall_minutes([3, 5, 3, 4, 3], jobs=8) == 5
    assert suite.expected_wall_minutes([], jobs=2) == 0
    with pytest.raises(ValueError, match="jobs must be >= 1"):
        suite.expected_wall_minutes([1], jobs=0)


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_progress_lines_in_plain_mode():
    lines, clock = [], _Clock()
    progress = suite._Progress(2, lines.append, plain=True, clock=clock)
    progress.start("nli", "started nli")
    progress.start("sort", "started sort")
    progress.update("nli", rows=3, epochs=3)  # at 0 s: too soon after the start line
    clock.now = 31
    progress.update("nli", rows=12, epochs=12)
    progress.update("sort", rows=2, epochs=0)
    clock.now = 45
    progress.update("nli", rows=20, epochs=20)  # 14 s after nli's last line: not yet
    progress.tick()
    clock.now = 61
    progress.tick()  # now it is
    clock.now = 155
    progress.tick()  # sort logged nothing for 124 s: "still running"
    texts = [re.sub(STAMP, "", line) for line in lines]
    assert all(re.match(STAMP, line) for line in lines)
    assert texts == ["started nli", "started sort", "nli: 12 epochs done, 0 min 31 s so far",
                     "sort: 2 rows logged, 0 min 31 s so far", "nli: 20 epochs done, 1 min 01 s so far",
                     "sort: still running (2 rows done), 2 min 35 s so far"]
    entry = suite.SuiteEntry("nli", "paper", 1.0, 160.0, out_dir=Path("runs/nli/x"))
    progress.finish(entry, suite_clock=0.0)
    assert re.fullmatch(STAMP + r"nli: done in 160 s \(20 epochs\) -> runs/nli/x/report\.md  \(1/2 done, suite "
                        r"elapsed \d+ min \d\d s\)", lines[-1])
    assert progress.postfix() == "running: sort (2 rows, 2:35)"


def test_progress_postfix_on_a_terminal():
    lines, clock = [], _Clock()
    progress = suite._Progress(2, lines.append, plain=False, clock=clock)
    progress.start("sort", "started sort")
    progress.start("nli", "started nli")
    clock.now = 80
    progress.update("nli", rows=12, epochs=12)
    progress.tick()
    assert lines == ["started sort", "started nli"]  # no progress lines: the bar shows it
    assert progress.postfix() == "running: nli (12 epochs, 1:20), sort (1:20)"


def test_row_counter_sends_rows_and_epochs():
    class Sink:
        def __init__(self):
            self.events = []

        def put(self, event):
            self.events.append(event)

    sink = Sink()
    counter = suite._RowCounter("sort", sink)  # by default: every row
    for row in ({"epoch": 1}, {"epoch": 2}, {"n": 8}):
        counter(None, row)
    counter.flush()  # nothing new
    assert sink.events == [("sort", 1, 1), ("sort", 2, 2), ("sort", 3, 2)]

    sink = Sink()
    counter = suite._RowCounter("nli", sink, every=3600)
    counter(None, {"epoch": 1, "loss": 1.0})  # the first row goes at once
    counter(None, {"epoch": 2})
    counter(None, {"accuracy": 0.5})
    assert sink.events == [("nli", 1, 1)]
    counter.flush()
    counter.flush()  # nothing new
    assert sink.events == [("nli", 1, 1), ("nli", 3, 2)]

    class Broken:
        def put(self, event):
            raise BrokenPipeError

    counter = suite._RowCounter("nli", Broken())
    counter(None, {"epoch": 1})  # the parent went away: the experiment goes on
    assert counter.sink is None and counter.rows == 1


def _epochs(name: str, runs_dir: Path) -> int:
    import csv

    with next((runs_dir / name).iterdir()).joinpath("metrics.csv").open() as fh:
        return sum(1 for row in csv.DictReader(fh) if row.get("epoch"))


@pytest.fixture
def one_thread():
    with torch_threads(1):
        yield


@pytest.fixture
def calibrated(monkeypatch):
    """This machine measured twice as slow as the committed run."""
    monkeypatch.setattr(suite, "calibration", lambda: {"step_ms": 5.0, "threads": 1})
    monkeypatch.setattr(suite, "_committed_calibration", lambda: {"step_ms": 2.5, "threads": 1})
    return "the committed times x 2: a calibration step took 5 ms here, 2.5 ms for the committed run"


def test_the_announced_time_is_the_committed_times_scaled_by_the_calibration(monkeypatch, calibrated):
    names = ["normalizations", "patch-size", "sort"]
    committed = suite.committed_seconds(names)
    from sinkformer.runs.readme import load_quick_run
    assert all(committed[n] == load_quick_run().get(n, 60 * get(n).quick_minutes) for n in names)
    minutes = [2 * committed[n] / 60 for n in names]
    assert suite._announcement(names, 1, {"step_ms": 5.0, "threads": 1}) == (
        f"sinkformer run: 3 experiments, quick form on embedded data (expected about {sum(minutes):.1f} min; "
        f"{calibrated})")
    wall = suite.expected_wall_minutes(minutes, 2)
    assert suite._announcement(names, 2, {"step_ms": 5.0, "threads": 1}) == (
        f"sinkformer run: 3 experiments, quick form on embedded data (expected about {wall:.1f} min with 2 "
        f"processes, {sum(minutes):.1f} min of work; {calibrated})")
    # a committed run measured with another thread count (or none) is no reference: the times as committed
    assert suite._announcement(names, 1, {"step_ms": 5.0, "threads": 2}).endswith(
        f"(expected about {sum(minutes) / 2:.1f} min; the committed times, not calibrated: the committed run has "
        f"no calibration with 2 thread(s) and this workload)")
    # nor is one measured with another workload (the committed run's calibration above has none)
    assert suite._announcement(names, 1, {"step_ms": 5.0, "threads": 1, "workload": "another"}).endswith(
        "no calibration with 1 thread(s) and this workload)")


def test_the_calibration_is_a_mean_step_time_that_leaves_the_random_state_alone(one_thread):
    state = torch.get_rng_state()
    measured = suite.calibration(budget=0.05)
    assert measured["threads"] == 1 and 0 < measured["step_ms"] < 1000
    assert measured["workload"] == suite.CALIBRATION_WORKLOAD
    assert torch.equal(torch.get_rng_state(), state)


def test_plain_suite_one_process(tmp_path, monkeypatch, one_thread, calibrated):
    monkeypatch.setattr(suite, "PROGRESS_INTERVAL", 0.0)
    lines = []
    suite.run_suite(tmp_path, names=["normalizations", "patch-size"], overrides={"patch-size": TINY_PATCH},
                    echo=lines.append, plain=True)
    assert lines[0] == suite._announcement(["normalizations", "patch-size"], 1, suite.calibration())
    epochs = _epochs("patch-size", tmp_path)
    assert epochs == 4  # 2 seeds x Transformer, Sinkformer x 1 epoch
    body = lines[1:-1]
    assert all(re.match(STAMP, line) for line in body)
    texts = [re.sub(STAMP, "", line) for line in body]

    def where(pattern: str) -> int:
        return next(i for i, t in enumerate(texts) if re.fullmatch(pattern, t))

    order = [where(r"started normalizations \(1/2\) — Sinkformers, Figure 1: .*"),
             where(r"normalizations: done in \d+ s \(\d+ rows?\) -> .*/report\.md  \(1/2 done, suite elapsed .*\)"),
             where(r"started patch-size \(2/2\) — .*"),
             where(r"patch-size: [1-4] epochs? done, 0 min \d\d s so far"),  # while it runs
             where(r"patch-size: done in \d+ s \(4 epochs\) -> .*  \(2/2 done, suite elapsed .*\)")]
    assert order == sorted(order) and order[-1] == len(texts) - 1
    assert lines[-1].startswith("\n2 of 2 experiments done in")


def test_plain_suite_two_processes(tmp_path, monkeypatch, capsys, one_thread, calibrated):
    monkeypatch.setattr(suite, "PROGRESS_INTERVAL", 0.0)
    lines = []
    suite.run_suite(tmp_path, names=["normalizations", "patch-size"], overrides={"patch-size": TINY_PATCH},
                    echo=lines.append, jobs=2, plain=True)
    assert lines[0] == suite._announcement(["normalizations", "patch-size"], 2, suite.calibration())
    texts = [re.sub(STAMP, "", line) for line in lines[1:-1]]
    assert all(re.match(STAMP, line) for line in lines[1:-1])
    assert {t.split(" — ")[0] for t in texts[:2]} == {"started normalizations", "started patch-size"}
    # the counts come from the worker processes
    assert any(re.fullmatch(r"patch-size: done in \d+ s \(4 epochs\) -> .*/report\.md  \([12]/2 done, .*\)", t)
               for t in texts)
    assert any(re.fullmatch(r"normalizations: done in \d+ s \(\d+ rows?\) -> .*", t) for t in texts)
    assert "experiments:" not in capsys.readouterr().err  # no bar drawn


class _Stdout:
    def __init__(self, tty: bool):
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


def test_plain_is_the_default_when_stdout_is_not_a_terminal(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(suite, "_run_sequential", lambda names, task, clock, echo, plain, done: seen.append(plain))
    monkeypatch.setattr(suite, "summary_markdown", lambda *args, **kwargs: "# summary\n")
    monkeypatch.setattr(suite, "_summary_json", lambda *args: {})
    for tty in (False, True):
        monkeypatch.setattr(sys, "stdout", _Stdout(tty))
        suite.run_suite(tmp_path, names=[], echo=lambda line: None)
    assert seen == [True, False]


def test_a_command_whose_extra_is_missing_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    assert main(["demo"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == ("sinkformer demo: error: sinkformer demo needs the 'experiments' extra (matplotlib not "
                           "installed): pip install 'sinkformer[experiments]' (or 'sinkformer[all]')")
    monkeypatch.setitem(sys.modules, "yaml", None)
    assert main(["train", "--model", "vit", "--dataset", "digits"]) == 2
    assert "pip install 'sinkformer[train]'" in capsys.readouterr().err


def test_the_command_shows_the_library_logs():
    import logging

    logger = logging.getLogger("sinkformer")
    handlers = list(logger.handlers)
    try:
        with pytest.raises(SystemExit):
            main(["--version"])
        main(["experiments"])
        assert logger.level == logging.INFO and any(isinstance(h, logging.StreamHandler) for h in logger.handlers)
    finally:
        logger.handlers[:] = handlers
        logger.setLevel(logging.NOTSET)
