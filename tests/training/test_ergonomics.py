"""Trainer ergonomics: mixed precision, gradient accumulation, the MPS device, TensorBoard, logging."""

import logging
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import Subset

import sinkformer
from sinkformer.data import load_dataset
from sinkformer.data.base import DataBundle
from sinkformer.models import build_model
from sinkformer.training import Callback, TensorBoardLogger, TrainConfig, evaluate, train
from sinkformer.training import distributed
from sinkformer.training.checkpoint import latest_checkpoint
from sinkformer.training.distributed import setup_distributed
from sinkformer.training.schedules import steps_per_epoch

MPS = distributed.mps_available()


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


def _subset(data, n_train, n_test=32):
    return DataBundle(Subset(data.train, range(n_train)), Subset(data.test, range(n_test)), data.info, data.collate)


def _vit(data, **options):
    """A tiny ViT; SoftMax attention by default."""
    options = {"attention": "softmax", "n_iters": 1, "dropout": 0.0, **options}
    return build_model("vit", data.info, patch_size=4, dim=16, depth=1, num_heads=2, dim_feedforward=32, **options)


def _quiet(**options):
    return {"progress": False, **options}


# ------------------------------------------------------------------------------------------ options


def test_new_options_are_checked_with_messages_naming_them():
    assert TrainConfig().precision == "fp32" and TrainConfig().accumulate == 1
    assert TrainConfig.from_dict({"precision": "bf16", "accumulate": 4, "device": "mps"}).to_dict()["accumulate"] == 4
    with pytest.raises(ValueError, match=r"train option precision must be one of \['fp32', 'bf16', 'fp16'\], got 'fp8'"):
        TrainConfig(precision="fp8")
    with pytest.raises(ValueError, match="train option accumulate must be >= 1, got 0"):
        TrainConfig(accumulate=0)
    with pytest.raises(TypeError, match="option accumulate must be int"):
        TrainConfig.from_dict({"accumulate": "4"})
    for device in ("auto", "cpu", "cuda", "cuda:1", "mps", "mps:0"):
        assert TrainConfig(device=device).device == device
    for device in ("tpu", "cuda:x", "", "cpux"):
        with pytest.raises(ValueError, match=r"train option device must be auto, cpu, cuda, cuda:N or mps, got"):
            TrainConfig(device=device)


# ------------------------------------------------------------------------------------ precision


def test_bf16_trains_on_the_cpu_with_the_forward_in_bfloat16(digits):
    data = _subset(digits, 256, 64)
    torch.manual_seed(0)
    model = _vit(data)
    seen = []  # (training?, dtype of the first feed-forward layer's output)
    model.encoder.layers[0].linear1.register_forward_hook(lambda m, args, out: seen.append((m.training, out.dtype)))
    result = train(model, data, _quiet(epochs=3, batch_size=32, lr=1e-2, precision="bf16", device="cpu"))
    losses = [row["train_loss"] for row in result.history]
    assert losses[-1] < losses[0] - 0.1, losses
    assert all(math.isfinite(x) for x in losses)
    training = [dtype for was_training, dtype in seen if was_training]
    assert len(training) == 3 * 8 and set(training) == {torch.bfloat16}
    # evaluation runs under autocast too (the one float32 forward is the shape check before training)
    evaluation = [dtype for was_training, dtype in seen if not was_training]
    assert evaluation.count(torch.float32) == 1 and evaluation.count(torch.bfloat16) >= 3
    # mixed precision: weights (and so the optimiser and the checkpoints) stay float32
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    seen.clear()
    metrics = evaluate(model, data, _quiet(precision="bf16", device="cpu"))
    assert 0 <= metrics["test_acc"] <= 1 and set(dtype for _, dtype in seen) == {torch.bfloat16}


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_sinkformer_trains_in_mixed_precision(digits, precision):
    """Sinkhorn attention runs under autocast like SDPA (the engines compute in float32 inside)."""
    data = _subset(digits, 128, 32)
    torch.manual_seed(0)
    model = _vit(data, attention="sinkhorn", n_iters=5)
    result = train(model, data, _quiet(epochs=2, batch_size=32, lr=1e-2, precision=precision, device="cpu"))
    losses = [row["train_loss"] for row in result.history]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses


def test_fp16_on_the_cpu_runs_with_a_grad_scaler_saved_in_checkpoints_and_restored_on_resume(digits, tmp_path):
    """fp16 autocast does run on the CPU with torch 2.13 (checked here), so it is allowed there."""
    data = _subset(digits, 64, 16)
    options = _quiet(epochs=1, batch_size=16, lr=1e-2, precision="fp16", device="cpu", accumulate=2, grad_clip=1.0)
    seen = []
    torch.manual_seed(0)
    model = _vit(data)
    model.encoder.layers[0].linear1.register_forward_hook(lambda m, args, out: seen.append((m.training, out.dtype)))
    before = [p.detach().clone() for p in model.parameters()]
    result = train(model, data, options, out_dir=tmp_path)
    assert {dtype for was_training, dtype in seen if was_training} == {torch.float16}
    assert math.isfinite(result.final["train_loss"])
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    state = torch.load(latest_checkpoint(tmp_path / "checkpoints") / "state.pt", weights_only=True)
    assert state["scaler"]["scale"] > 0 and "growth_interval" in state["scaler"]
    assert state["config"]["precision"] == "fp16" and state["config"]["accumulate"] == 2

    # resume restores the scaler: a scale planted in the checkpoint is the one the run goes on with
    path = latest_checkpoint(tmp_path / "checkpoints") / "state.pt"
    state["scaler"]["scale"] = 8.0
    torch.save(state, path)
    torch.manual_seed(0)
    train(_vit(data), data, {**options, "epochs": 2}, out_dir=tmp_path, resume=True, allow_schedule_changes=True)
    resumed = torch.load(latest_checkpoint(tmp_path / "checkpoints") / "state.pt", weights_only=True)
    assert resumed["epoch"] == 2 and resumed["scaler"]["scale"] == 8.0  # fresh scalers start at 65536

    # and fp32 checkpoints carry no scaler state
    train(_vit(data), data, {**options, "precision": "fp32"}, out_dir=tmp_path / "fp32")
    assert "scaler" not in torch.load(tmp_path / "fp32" / "checkpoints" / "epoch_0001" / "state.pt", weights_only=True)


def test_a_precision_that_autocast_cannot_run_is_refused_naming_the_option(digits, monkeypatch):
    data = _subset(digits, 16, 4)

    class NoAutocast:  # what older torch builds do for fp16 on the CPU: warn, and compute in float32
        def __init__(self, device_type, dtype=None, enabled=True):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch, "autocast", NoAutocast)
    with pytest.raises(ValueError, match=r"train option precision='fp16' is not supported on cpu by torch .*"
                                         r"\(autocast computed in torch.float32\); use precision='bf16' or a CUDA device"):
        train(_vit(data), data, _quiet(epochs=1, precision="fp16", device="cpu"))
    with pytest.raises(ValueError, match="precision='bf16' is not supported on cpu"):
        evaluate(_vit(data), data, _quiet(precision="bf16", device="cpu"))


def test_a_model_that_fails_under_autocast_fails_before_training_naming_the_precision(digits):
    data = _subset(digits, 16, 4)

    class Fp32Only(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(64, 10)

        def forward(self, images):
            if torch.is_autocast_enabled("cpu"):
                raise RuntimeError("expected scalar type BFloat16 but found Float")
            return self.linear(images.flatten(1))

    with pytest.raises(ValueError, match=r"Fp32Only does not run under train option precision='bf16' "
                                         r"\(torch.autocast on cpu in torch.bfloat16\), though it does in float32: "
                                         r"expected scalar type"):
        train(Fp32Only(), data, _quiet(epochs=1, precision="bf16", device="cpu"))
    assert train(Fp32Only(), data, _quiet(epochs=1, device="cpu")).final["train_loss"] > 0


# --------------------------------------------------------------------------------- accumulation


def _weights_after_one_epoch(data, **options):
    torch.manual_seed(0)
    model = _vit(data)
    history = train(model, data, _quiet(epochs=1, optimizer="sgd", lr=0.1, momentum=0.9, device="cpu", **options))
    return {k: v.clone() for k, v in model.state_dict().items()}, history.final


@pytest.mark.parametrize("shuffle_seed", [0, 7])
def test_accumulating_4_batches_of_8_makes_the_updates_of_batches_of_32(digits, shuffle_seed):
    # 92 examples: groups of 8+8+8+8, 8+8+8+8 and 8+8+8+4 micro-batches against batches of 32, 32 and 28 —
    # the last group has unequal micro-batches, so its loss is the mean over 28 examples, not of 4 means
    data = _subset(digits, 92)
    big, big_row = _weights_after_one_epoch(data, batch_size=32, seed=shuffle_seed)
    acc, acc_row = _weights_after_one_epoch(data, batch_size=8, accumulate=4, seed=shuffle_seed)
    small, _ = _weights_after_one_epoch(data, batch_size=8, seed=shuffle_seed)
    for key in big:
        torch.testing.assert_close(acc[key], big[key], atol=1e-6, rtol=0, msg=key)
    assert max((small[k] - big[k]).abs().max().item() for k in big) > 1e-2  # 12 steps of 8 are another run
    assert acc_row["train_loss"] == pytest.approx(big_row["train_loss"], rel=1e-6)
    assert acc_row["train_acc"] == big_row["train_acc"]


def test_steps_schedule_and_max_train_batches_count_optimizer_steps(digits):
    data = _subset(digits, 200)

    class Record(Callback):
        def __init__(self):
            self.steps, self.losses = [], []

        def on_step_end(self, epoch, step, loss):
            self.steps.append((epoch, step))
            self.losses.append(loss)

    torch.manual_seed(0)
    model = _vit(data)
    micro = []
    model.register_forward_hook(lambda m, args, kwargs, out: micro.append(len(kwargs["images"])) if m.training else None,
                                with_kwargs=True)
    record = Record()
    options = _quiet(epochs=2, batch_size=8, accumulate=4, max_train_batches=3, lr=0.01, schedule="inverse_sqrt",
                     warmup_steps=100, device="cpu")
    result = train(model, data, options, callbacks=[record])
    # 3 optimiser steps per epoch, each of 4 micro-batches of 8
    assert record.steps == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert micro == [8] * 24
    assert all(math.isfinite(x) and x > 0 for x in record.losses)
    # warm-up counts optimiser steps: the last step of epoch 1 is step 3, of epoch 2 step 6
    assert [row["lr"] for row in result.history] == pytest.approx([0.01 * 3 / 100, 0.01 * 6 / 100])
    assert steps_per_epoch(len(data.train), TrainConfig.from_dict(options)) == 3
    # without the cap: ceil(micro-batches / accumulate) steps, the last group smaller
    record.steps.clear()
    train(model, data, {**options, "epochs": 1, "max_train_batches": 0}, callbacks=[record])
    n_micro = -(-len(data.train) // 8)
    assert len(record.steps) == -(-n_micro // 4) == steps_per_epoch(len(data.train), TrainConfig.from_dict(
        {**options, "max_train_batches": 0}))
    # the same as a run with batches of 32 (which has the same steps)
    big = train(_vit(data), data, {**options, "batch_size": 32, "accumulate": 1})
    assert [row["lr"] for row in big.history] == [row["lr"] for row in result.history]


DDP_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    torch.set_num_threads(1)
    from sinkformer.data import load_dataset
    from sinkformer.models import build_model
    from sinkformer.training import train

    out, batch_size, accumulate = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    data = load_dataset("digits")
    torch.manual_seed(0)
    model = build_model("vit", data.info, patch_size=4, dim=16, depth=1, num_heads=2, dim_feedforward=32, dropout=0.0)
    train(model, data, dict(epochs=2, batch_size=batch_size, accumulate=accumulate, max_train_batches=3,
                            max_eval_batches=1, optimizer="sgd", lr=0.1, progress=False), out_dir=out)
    """
)


@pytest.mark.slow
def test_accumulation_on_two_processes_matches_one_process_on_the_whole_group(tmp_path):
    """DDP synchronises gradients once per group (``no_sync`` before): 2 processes x 3 micro-batches of
    24 make the updates of one process with batches of 72."""
    script = tmp_path / "run.py"
    script.write_text(DDP_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
    ddp = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          str(script), str(tmp_path / "ddp"), "24", "3"], env=env, capture_output=True, text=True,
                         timeout=300)
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    single = subprocess.run([sys.executable, str(script), str(tmp_path / "single"), "72", "1"], env=env,
                            capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr[-3000:]
    two, one = (load_file(tmp_path / d / "model.safetensors") for d in ("ddp", "single"))
    for key in one:
        torch.testing.assert_close(two[key], one[key], atol=1e-6, rtol=1e-5, msg=key)


# ------------------------------------------------------------------------------------------ MPS


@pytest.mark.skipif(MPS, reason="MPS is available here")
def test_device_mps_without_mps_fails_at_setup_with_a_clear_error(digits):
    with pytest.raises(ValueError, match=r"train option device='mps' but MPS is not available"):
        setup_distributed("mps")
    data = _subset(digits, 16, 4)
    with pytest.raises(ValueError, match=r"device='mps' but MPS is not available"):
        train(_vit(data), data, _quiet(epochs=1, device="mps"))


def test_auto_picks_cuda_then_mps_then_cpu(monkeypatch):
    def machine(cuda, mps):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        monkeypatch.setattr(distributed, "mps_available", lambda: mps)

    machine(cuda=True, mps=True)
    assert distributed._pick_device("auto", 1) == torch.device("cuda:1")
    machine(cuda=False, mps=True)
    assert distributed._pick_device("auto", 0) == torch.device("mps")
    assert distributed._pick_device("auto", 0, world_size=2) == torch.device("cpu")  # no process group on MPS
    machine(cuda=False, mps=False)
    assert distributed._pick_device("auto", 0) == torch.device("cpu")
    assert distributed._pick_device("mps", 0) == torch.device("mps")


def test_mps_with_several_processes_is_refused(monkeypatch):
    monkeypatch.setattr(distributed, "mps_available", lambda: True)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="device='mps' runs a single process"):
        setup_distributed("mps")


# ---------------------------------------------------------------------------------- TensorBoard


def test_tensorboard_logger_without_tensorboard_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if not installed
    for name in [m for m in sys.modules if m.startswith("torch.utils.tensorboard")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(ImportError, match=r"TensorBoardLogger needs the tensorboard package.*"
                                          r"pip install 'sinkformer\[tensorboard\]'"):
        TensorBoardLogger(tmp_path)
    assert not any(tmp_path.iterdir())


def test_tensorboard_logger_writes_every_epochs_metrics(digits, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    data = _subset(digits, 64, 16)
    torch.manual_seed(0)
    logger = TensorBoardLogger(tmp_path / "tb", prefix="vit/")
    result = train(_vit(data), data, _quiet(epochs=3, batch_size=16, eval_every=2, device="cpu"), callbacks=[logger])
    assert logger._writer is None  # closed when training ended
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"vit/train_loss", "vit/train_acc", "vit/lr", "vit/test_acc", "vit/epoch_seconds"} <= tags
    assert "vit/epoch" not in tags
    train_loss = events.Scalars("vit/train_loss")
    assert [e.step for e in train_loss] == [1, 2, 3]
    assert [e.value for e in train_loss] == pytest.approx([row["train_loss"] for row in result.history], rel=1e-6)
    assert [e.step for e in events.Scalars("vit/test_acc")] == [2, 3]  # evaluated at epochs 2 and 3 only


# -------------------------------------------------------------------------------------- logging


def test_resume_messages_are_logged_not_printed(digits, tmp_path, caplog, capsys):
    data = _subset(digits, 32, 8)
    with caplog.at_level(logging.INFO, logger="sinkformer"):
        train(_vit(data), data, _quiet(epochs=1, batch_size=16, device="cpu"), out_dir=tmp_path, resume=True)
        train(_vit(data), data, _quiet(epochs=2, batch_size=16, device="cpu"), out_dir=tmp_path, resume=True,
              allow_schedule_changes=True)
    records = [(r.name, r.levelno, r.getMessage()) for r in caplog.records if r.name.startswith("sinkformer")]
    assert records[0] == ("sinkformer.training.loop", logging.INFO,
                          f"no checkpoint in {tmp_path / 'checkpoints'}: starting from scratch")
    assert records[1] == ("sinkformer.training.loop", logging.INFO, "resuming with train.epochs 1 -> 2")
    name, level, message = records[2]
    assert (name, level) == ("sinkformer.training.loop", logging.INFO)
    assert message.startswith(f"resuming from {tmp_path / 'checkpoints' / 'epoch_0001'} (epoch 1/2, 1 -> 1 process")
    assert capsys.readouterr().out == ""
    assert load_file(tmp_path / "model.safetensors")  # the resumed run finished


@pytest.mark.parametrize("progress, level", [(True, logging.INFO), (False, logging.DEBUG)])
def test_train_logs_each_epoch_and_prints_nothing(digits, progress, level, caplog, capsys):
    """Before: train() printed every epoch (tqdm.write to stdout) while the docs said the library prints nothing."""
    data = _subset(digits, 32, 8)
    with caplog.at_level(logging.DEBUG, logger="sinkformer"):
        train(_vit(data), data, {"epochs": 2, "batch_size": 16, "device": "cpu", "progress": progress})
    epochs = [r for r in caplog.records if r.getMessage().startswith("epoch ")]
    assert [(r.name, r.levelno) for r in epochs] == [("sinkformer.training.loop", level)] * 2
    assert epochs[1].getMessage().startswith("epoch 2/2  lr 0.001  train_loss ")
    assert capsys.readouterr().out == ""


def test_convert_is_quiet_by_default_and_logs_with_verbose(caplog, capsys):
    def encoder():
        layer = torch.nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, batch_first=True)
        return torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    with caplog.at_level(logging.DEBUG, logger="sinkformer"):
        sinkformer.convert(encoder(), n_iters=3)
        sinkformer.convert(encoder(), n_iters=3, verbose=True)
    assert capsys.readouterr().out == ""
    records = [(r.name, r.levelno, r.getMessage()) for r in caplog.records if r.name.startswith("sinkformer")]
    message = "sinkformer.convert: 2 attention module(s) now use 'sinkhorn' (n_iters=3)"
    assert records == [("sinkformer.nn.convert", logging.DEBUG, message),
                       ("sinkformer.nn.convert", logging.INFO, message)]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="sinkformer"):  # what the command line shows
        sinkformer.convert(encoder(), n_iters=3)
    assert not [r for r in caplog.records if r.name.startswith("sinkformer")]
