"""Run folders (``--out``): refused when they hold a run, replaced only file by file, unusable paths
named, incomplete checkpoint files recognised, leftovers of killed writes removed; a resume continues
its own run; provenance recorded; a run stopped before its first checkpoint leaves nothing."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from sinkformer.cli import main
from sinkformer.training.checkpoint import (
    IncompleteCheckpointWarning,
    capture_rng,
    checkpoint_problem,
    file_problem,
    latest_checkpoint,
    load_checkpoint,
    load_weights,
    save_checkpoint,
)
from sinkformer.training import Callback
from sinkformer.training.runner import RunFolderError, prepare_run_folder, resolve_config, run_training

TINY = ["model.patch_size=4", "model.dim=16", "model.depth=1", "model.num_heads=2", "model.dim_feedforward=32",
        "train.batch_size=64", "train.max_train_batches=2", "train.max_eval_batches=1", "train.progress=false"]


def _config(epochs, *more):
    return resolve_config(model="vit", data="digits", sets=[*TINY, f"train.epochs={epochs}", *more])


def _rows(path):
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def _cut(path, keep=0.5):
    """Truncate ``path`` to a fraction of its size (0: empty), as an interrupted copy leaves it."""
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def test_reusing_out_is_refused_instead_of_mixing_two_runs(tmp_path, capsys):
    """Before: a second run into the same --out silently mixed with the first. Its epoch_0001 checkpoint
    was deleted by the keep-newest rule (the first run's epoch_0002 is "newer") and a later --resume
    restored the first run's weights. Now the second run is refused and the first is left intact."""
    out = tmp_path / "run"
    run_training(_config(2), out_dir=out)
    first = load_file(out / "model.safetensors")
    with pytest.raises(RunFolderError) as err:
        run_training(_config(1, "train.lr=0.01"), out_dir=out)
    message = str(err.value)
    assert isinstance(err.value, ValueError) and "\n" not in message
    assert f"--out {out} already holds a run" in message and "--resume" in message and "--overwrite" in message
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["epoch_0002"]  # the first run is untouched
    assert len(_rows(out)) == 2
    assert all(torch.equal(t, first[k]) for k, t in load_file(out / "model.safetensors").items())
    # the command line reports it as a user error
    assert main(["train", "--model", "vit", "--data", "digits", *sum((["--set", s] for s in TINY), []),
                 "--set", "train.epochs=1", "--out", str(out)]) == 2
    assert f"sinkformer train: error: --out {out} already holds a run" in capsys.readouterr().err

    # overwrite=True replaces it: exactly the run a fresh folder gets
    run_training(_config(1, "train.lr=0.01"), out_dir=out, overwrite=True)
    run_training(_config(1, "train.lr=0.01"), out_dir=tmp_path / "fresh")
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["epoch_0001"] and len(_rows(out)) == 1
    replaced, fresh = (load_file(d / "model.safetensors") for d in (out, tmp_path / "fresh"))
    assert all(torch.equal(replaced[k], fresh[k]) for k in fresh)
    # and resume=True continues it (here: already finished, nothing left to do)
    assert len(run_training(_config(1, "train.lr=0.01"), out_dir=out, resume=True).history) == 1


def test_overwrite_deletes_only_what_a_run_writes(tmp_path):
    out = tmp_path / "run"
    for name in ("config.yaml", "data_info.json", "tokenizer.json", "metrics.csv", "metrics.jsonl",
                 "model.safetensors", ".metrics.csv.tmp123", "checkpoints/epoch_0001/state.pt",
                 "checkpoints/.tmp-epoch_0002-77/state.pt", "attention/epoch_0001.safetensors",
                 "checkpoints/my notes.txt", "notes.md", "data/train.txt"):
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text("x")
    removed, kept = prepare_run_folder(out, overwrite=True)
    assert removed == ["config.yaml", "data_info.json", "tokenizer.json", "metrics.csv", "metrics.jsonl",
                       "model.safetensors", "checkpoints", "attention"]
    assert kept == ["checkpoints/my notes.txt", "data", "notes.md"]
    left = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    assert left == ["checkpoints", "checkpoints/my notes.txt", "data", "data/train.txt", "notes.md"]
    # a folder with other files but no run is not refused (nothing of a run is there to mix with)
    assert prepare_run_folder(out) == ([], [])


def test_unusable_out_folders_fail_with_one_line_naming_the_path(tmp_path, capsys):
    file = tmp_path / "file.txt"
    file.write_text("not a folder")
    for out in (file / "run", file, file / "a" / "b"):
        with pytest.raises(RunFolderError, match=f"--out {out}: cannot create the run folder: {file} is a file, "
                                                 f"not a folder") as err:
            prepare_run_folder(out)
        assert "\n" not in str(err.value)
    assert main(["train", "--model", "vit", "--data", "digits", "--out", str(file / "run")]) == 2
    assert f"sinkformer train: error: --out {file / 'run'}: cannot create the run folder" in capsys.readouterr().err
    with pytest.raises(RunFolderError, match="give one of them"):
        prepare_run_folder(tmp_path / "x", resume=True, overwrite=True)
    if os.geteuid() != 0:  # permission bits do not stop root
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        try:
            with pytest.raises(RunFolderError, match=f"--out {locked}: cannot write in the run folder"):
                prepare_run_folder(locked)
        finally:
            locked.chmod(0o700)


def _checkpoints(folder, epochs, keep):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    for epoch in epochs:
        save_checkpoint(folder, epoch, model, optimizer, {"global_step": epoch, "history": [], "rng": [capture_rng()]},
                        keep=keep)
    return model, optimizer


@pytest.mark.parametrize("name", ["state.pt", "model.safetensors"])
@pytest.mark.parametrize("keep", [0, 0.5, 0.99])
def test_empty_or_truncated_checkpoint_files_are_named_incomplete(tmp_path, name, keep):
    model, optimizer = _checkpoints(tmp_path, [1], keep=1)
    path = tmp_path / "epoch_0001" / name
    assert file_problem(path) is None and checkpoint_problem(path.parent) is None
    _cut(path, keep)
    what = "weights" if name == "model.safetensors" else "training state"
    with pytest.raises(ValueError, match=rf"cannot load {what} from {path}: the file is incomplete \(the write was "
                                         rf"interrupted or the file was cut short\): ") as err:
        load_checkpoint(path.parent, model, optimizer)
    assert ("empty (0 bytes)" in str(err.value)) == (keep == 0)
    assert checkpoint_problem(path.parent).startswith(f"{path} is incomplete")
    if name == "model.safetensors":
        with pytest.raises(ValueError, match=f"cannot load weights from {path}: the file is incomplete"):
            load_weights(model, path)


def test_resume_skips_an_incomplete_newest_checkpoint_and_refuses_when_none_is_complete(tmp_path):
    _checkpoints(tmp_path, [1, 2], keep=2)
    _cut(tmp_path / "epoch_0002" / "state.pt")
    with pytest.warns(IncompleteCheckpointWarning, match=r"epoch_0002/state.pt is incomplete.*resuming from the "
                                                         r"older epoch_0001"):
        assert latest_checkpoint(tmp_path) == tmp_path / "epoch_0001"
    _cut(tmp_path / "epoch_0001" / "model.safetensors", 0)
    with pytest.raises(ValueError, match=r"no complete checkpoint in .*epoch_0002/state.pt is incomplete.*; "
                                         r".*epoch_0001/model.safetensors is incomplete"):
        latest_checkpoint(tmp_path)


def test_resume_falls_back_to_the_previous_checkpoint_and_removes_leftovers(tmp_path):
    out = tmp_path / "run"
    run_training(_config(1), out_dir=out)
    checkpoints = out / "checkpoints"
    shutil.copytree(checkpoints / "epoch_0001", checkpoints / "epoch_0002")  # a newer checkpoint ...
    _cut(checkpoints / "epoch_0002" / "state.pt")                            # ... cut short
    (checkpoints / ".tmp-epoch_0003-99").mkdir()                             # a killed write's leftover
    (checkpoints / ".tmp-epoch_0003-99" / "state.pt").write_bytes(b"")
    with pytest.warns(IncompleteCheckpointWarning, match="epoch_0002/state.pt is incomplete"):
        result = run_training(_config(2), out_dir=out, resume=True, allow_schedule_changes=True)
    assert [row["epoch"] for row in result.history] == [1, 2]
    assert sorted(p.name for p in checkpoints.iterdir()) == ["epoch_0002"]
    assert checkpoint_problem(checkpoints / "epoch_0002") is None
    # resumed from epoch_0001: the same metrics and weights as a run never interrupted
    run_training(_config(2), out_dir=tmp_path / "reference")
    timing = ("epoch_seconds", "samples_per_second", "eval_seconds")
    assert [{k: v for k, v in row.items() if k not in timing} for row in _rows(out)] == \
        [{k: v for k, v in row.items() if k not in timing} for row in _rows(tmp_path / "reference")]
    final, expected = (load_file(d / "model.safetensors") for d in (out, tmp_path / "reference"))
    assert all(torch.equal(final[k], expected[k]) for k in expected)

    # when no checkpoint is complete, resuming is refused before any data is loaded
    _cut(checkpoints / "epoch_0002" / "model.safetensors", 0)
    with pytest.raises(RunFolderError, match=rf"--out {out}: cannot resume, no checkpoint is complete: "
                                             rf"{checkpoints / 'epoch_0002' / 'model.safetensors'} is incomplete.*"
                                             rf"use --overwrite"):
        run_training(_config(3), out_dir=out, resume=True)


def test_a_fresh_run_removes_leftover_temporary_checkpoints(tmp_path):
    out = tmp_path / "run"
    (out / "checkpoints" / ".tmp-epoch_0001-42").mkdir(parents=True)
    prepare_run_folder(out, resume=True)  # resume=True: a folder with checkpoints/ holds a run
    assert list((out / "checkpoints").iterdir()) == []


# --- a resume continues the run it resumes -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def one_epoch_run(tmp_path_factory):
    """A finished 1-epoch run to resume (copied by each test that writes into it)."""
    out = tmp_path_factory.mktemp("resume") / "run"
    run_training(_config(1), out_dir=out)
    return out


def _copy(run, tmp_path):
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


@pytest.mark.parametrize("flags, listed", [
    ({"attention": "softmax", "sets": ["train.lr=0.5"]},
     ["model.attention 'sinkhorn' -> 'softmax'", "train.lr 0.001 -> 0.5"]),  # the issue's case
    ({"n_iters": 3}, ["model.n_iters 5 -> 3"]),
    ({"sets": ["model.dim=32"]}, ["model.dim 16 -> 32"]),
    ({"sets": ["train.batch_size=32"]}, ["train.batch_size 64 -> 32"]),
    ({"sets": ["train.seed=1"]}, ["train.seed 0 -> 1"]),
    ({"sets": ["train.precision=bf16"]}, ["train.precision 'fp32' -> 'bf16'"]),
    ({"sets": ["train.accumulate=2"]}, ["train.accumulate 1 -> 2"]),
    ({"sets": ["train.milestones=[1]"]}, ["train.milestones [] -> [1]"]),
    ({"sets": ["train.max_eval_batches=2"]}, ["train.max_eval_batches 1 -> 2"]),  # what the metrics measure
    ({"sets": ["data.test_fraction=0.3"]}, ["data.test_fraction 0.2 -> 0.3"]),
    ({"sets": ["model.patch_size=2", "train.epochs=3"]}, ["model.patch_size 4 -> 2 (and the schedule: train.epochs 1 -> 3)"]),
])
def test_a_resume_with_other_options_is_refused_listing_them(one_epoch_run, tmp_path, flags, listed):
    """Before: resuming a Sinkformer run with --attention softmax --set train.lr=0.5 continued it as a
    Transformer and rewrote config.yaml, which then misdescribed the epochs already trained."""
    out = _copy(one_epoch_run, tmp_path)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    sets = flags.pop("sets", [])
    config = resolve_config(out / "config.yaml", sets=sets, **flags)
    with pytest.raises(RunFolderError) as err:
        run_training(config, out_dir=out, resume=True, allow_schedule_changes=True)
    message = str(err.value)
    assert message.startswith(f"--out {out}: cannot resume the run in {out} with other model, data or optimisation")
    assert all(item in message for item in listed) and "start a new run" in message
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before  # nothing written


def test_the_command_line_refuses_the_issues_resume(one_epoch_run, tmp_path, capsys):
    out = _copy(one_epoch_run, tmp_path)
    assert main(["train", "--resume", "--out", str(out), "--attention", "softmax", "--set", "train.lr=0.5",
                 "--threads", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"sinkformer train: error: --out {out}: cannot resume the run in {out} with other model")
    assert "model.attention 'sinkhorn' -> 'softmax', train.lr 0.001 -> 0.5" in err


def test_schedule_changes_need_the_flag_and_are_recorded(one_epoch_run, tmp_path):
    out = _copy(one_epoch_run, tmp_path)
    with pytest.raises(RunFolderError, match=r"resuming the run in .* with train.epochs 1 -> 2 changes how the run "
                                             r"goes on from here; pass --allow-schedule-changes"):
        run_training(_config(2), out_dir=out, resume=True)
    assert not (out / "resumes.jsonl").exists()
    # progress changes nothing computed: free; the schedule with the flag: recorded, config.yaml says the new schedule
    result = run_training(_config(2, "train.progress=true", "train.checkpoint_every=2"), out_dir=out, resume=True,
                          allow_schedule_changes=True)
    assert [row["epoch"] for row in result.history] == [1, 2]
    (line,) = [json.loads(x) for x in (out / "resumes.jsonl").read_text().splitlines()]
    assert line["from"] == "epoch_0001" and line["changes"] == {"train.epochs": [1, 2], "train.checkpoint_every": [1, 2]}
    assert line["provenance"]["sinkformer"] and "git_commit" in line["provenance"]
    assert "epochs: 2" in (out / "config.yaml").read_text()
    # fewer epochs than trained: refused
    with pytest.raises(RunFolderError, match="with train option epochs=1: the run has already trained 2 epochs"):
        run_training(_config(1), out_dir=out, resume=True, allow_schedule_changes=True)


def test_train_refuses_a_resume_with_other_train_options(one_epoch_run, tmp_path):
    from sinkformer.data import load_dataset
    from sinkformer.models import build_model
    from sinkformer.training import TrainConfig, train
    from sinkformer.training.runner import check_config

    out = _copy(one_epoch_run, tmp_path)
    plan = check_config(_config(1))
    data = load_dataset("digits")
    model = build_model("vit", data.info, **plan.model_options)
    changed = TrainConfig.from_dict({**plan.train.to_dict(), "lr": 0.5})
    with pytest.raises(ValueError, match=r"cannot resume from .*epoch_0001 with other model, data or optimisation "
                                         r"options than it started with: train.lr 0.001 -> 0.5"):
        train(model, data, changed, out_dir=out, resume=True)


# --- what a run folder records, and what a stopped run leaves -----------------------------------------------------

def test_train_run_folders_record_provenance(one_epoch_run):
    from sinkformer.provenance import library_commit

    facts = json.loads((one_epoch_run / "provenance.json").read_text())
    assert facts["sinkformer"] == __import__("sinkformer").__version__ and facts["torch"] == torch.__version__
    assert facts["git_commit"] == library_commit()


def test_a_failed_start_leaves_nothing_behind(tmp_path):
    """Before: `sinkformer train --model vit --dataset digits` failed on patch_size=16 and left an empty run folder."""
    out = tmp_path / "new" / "run"
    with pytest.raises(ValueError) as err:
        run_training(_config(1, "model.patch_size=3"), out_dir=out)
    assert str(err.value) == ("model 'vit' cannot be built for dataset 'digits' (n_classes=10, image_size=8, "
                              "channels=1): patch_size must divide image_size=8, got patch_size=3; set it with "
                              "--set model.patch_size=VALUE")
    assert not (tmp_path / "new").exists()  # the folders the run made are gone
    # a folder that was there keeps what is not the run's
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        run_training(resolve_config(model="vit", data="mnist", data_path=str(tmp_path / "no-mnist"),
                                    sets=["train.progress=false"]), out_dir=tmp_path / "mine")
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]
    # --resume of a folder holding no run is a new run: it too leaves nothing
    with pytest.raises(ValueError, match="patch_size must divide"):
        run_training(_config(1, "model.patch_size=3"), out_dir=tmp_path / "nothing" / "here", resume=True)
    assert not (tmp_path / "nothing").exists()


class _StopAt(Callback):
    """Ctrl-C at the end of epoch ``epoch`` (before its checkpoint is written)."""

    def __init__(self, epoch):
        self.epoch = epoch

    def on_epoch_end(self, row):
        if row["epoch"] == self.epoch:
            raise KeyboardInterrupt


def test_ctrl_c_keeps_a_resumable_run_and_nothing_else(tmp_path):
    with pytest.raises(KeyboardInterrupt) as stop:
        run_training(_config(3), out_dir=tmp_path / "a", callbacks=[_StopAt(2)])
    assert str(stop.value) == (f"interrupted: kept the run in {tmp_path / 'a'} (its checkpoint of epoch 1); continue "
                               f"it with: sinkformer train --resume --out {tmp_path / 'a'}")
    assert run_training(_config(3), out_dir=tmp_path / "a", resume=True).history[-1]["epoch"] == 3
    with pytest.raises(KeyboardInterrupt, match="interrupted: nothing kept: the run stopped before its first "
                                                "checkpoint"):
        run_training(_config(3), out_dir=tmp_path / "b", callbacks=[_StopAt(1)])
    assert not (tmp_path / "b").exists()


def test_ctrl_c_in_the_command_is_one_line(tmp_path, monkeypatch, capsys):
    from sinkformer.training import loop

    epoch = loop._train_epoch

    def interrupted(*args):
        if args[7] == 1:  # the second epoch
            raise KeyboardInterrupt
        return epoch(*args)

    monkeypatch.setattr(loop, "_train_epoch", interrupted)
    out = tmp_path / "run"
    assert main(["train", "--model", "vit", "--dataset", "digits", *sum((["--set", s] for s in TINY), []),
                 "--set", "train.epochs=3", "--out", str(out), "--threads", "1"]) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == (f"sinkformer train: interrupted: kept the run in {out} (its checkpoint of "
                                            f"epoch 1); continue it with: sinkformer train --resume --out {out}")
