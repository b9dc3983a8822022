"""The training loop shared by every experiment: :func:`train`.

::

    from sinkformer.data import load_dataset
    from sinkformer.models import build_model
    from sinkformer.training import TrainConfig, train

    data = load_dataset("shapes3d")
    torch.manual_seed(0)
    model = build_model("set_transformer", data.info, attention="sinkhorn", n_iters=21, dim=64)
    result = train(model, data, TrainConfig(epochs=20, lr=1e-3, milestones=(15,)), out_dir="runs/st")
    result.final["test_acc"], result.history        # one dict per epoch

Per epoch it logs ``epoch``, ``lr``, ``train_loss``, ``train_acc``, ``test_loss``, ``test_acc``
(``test_bleu`` for translation), ``epoch_seconds`` (training time of the epoch, the figure the
paper compares between Transformer and Sinkformer), ``samples_per_second`` and
``eval_seconds`` to ``metrics.csv`` / ``metrics.jsonl``; checkpoints go to
``out_dir/checkpoints/`` and the final weights to ``out_dir/model.safetensors``.
``resume=True`` continues from the newest checkpoint in ``out_dir`` and ends with the same
metrics and weights as a run that was never interrupted.

A resume continues with the options the run started with: a ``config`` whose optimisation
options differ from the checkpoint's is refused (:func:`~sinkformer.training.config.resume_changes`);
schedule options (more ``epochs``, ``eval_every``, ...) need ``allow_schedule_changes=True``.

Mixed precision (``precision="bf16"`` / ``"fp16"``) and gradient accumulation (``accumulate``)
are options of :class:`~sinkformer.training.TrainConfig`.

Output: :func:`train` writes nothing to stdout. Its messages (resuming, starting from scratch)
and one line per epoch go to the :mod:`logging` logger ``"sinkformer.training.loop"`` (a child of
``"sinkformer"``) at INFO — the epoch lines at DEBUG when ``progress=False`` — so they show only
when the application configures logging, as ``sinkformer train`` does. With ``progress=True``
(the default) a tqdm bar on stderr shows the batches of the running epoch and disappears when it
ends.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .._optional import require
from ..data.base import DataBundle
from .batches import epoch_batches, shard
from .checkpoint import capture_rng, latest_checkpoint, load_checkpoint, restore_rng, save_checkpoint, save_weights
from .config import TrainConfig, resume_changes
from .diagnostics import AttentionRecorder
from .distributed import Distributed, all_gather_objects, all_reduce_sum, barrier, setup_distributed
from .metrics import write_metrics
from .schedules import build_optimizer, learning_rate, set_learning_rate
from .tasks import Classification, task_for, to_device

tqdm = require("tqdm.auto", "the trainer's progress bars").tqdm

__all__ = ["train", "evaluate", "TrainResult", "Callback"]

logger = logging.getLogger(__name__)

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Callback:
    """Hooks into :func:`train`; subclass and override what you need (all no-ops here)."""

    def on_step_end(self, epoch: int, step: int, loss: float) -> None:
        """After each optimisation step: 0-based ``epoch``, ``step`` within it (optimiser steps:
        with ``accumulate`` > 1 once per group of micro-batches), mean loss of the step's
        examples on this process."""

    def on_epoch_end(self, row: dict[str, Any]) -> None:
        """After each epoch, with its metrics row (main process only)."""

    def on_train_end(self, result: "TrainResult") -> None:
        """After the last epoch and the final weights, with the result (main process only)."""


@dataclass
class TrainResult:
    """What :func:`train` returns: the trained model and one metrics dict per epoch."""

    model: torch.nn.Module
    history: list[dict[str, Any]]
    out_dir: Path | None

    @property
    def final(self) -> dict[str, Any]:
        return self.history[-1] if self.history else {}


def train(
    model: torch.nn.Module,
    data: DataBundle,
    config: TrainConfig | dict[str, Any] | None = None,
    *,
    out_dir: str | Path | None = None,
    resume: bool = False,
    callbacks: tuple[Callback, ...] | list[Callback] = (),
    task: Classification | None = None,
    allow_schedule_changes: bool = False,
) -> TrainResult:
    """Train ``model`` on ``data`` (evaluating on ``data.test``) and return the history.

    Args:
        model: a model whose ``forward`` takes the keyword inputs of ``data.collate``.
        data: a :class:`~sinkformer.data.DataBundle`.
        config: a :class:`TrainConfig` or a dict of its options.
        out_dir: where metrics, checkpoints, attention diagnostics and the final weights go
            (``None``: nothing is written and ``resume`` is impossible).
        resume: continue from the newest checkpoint in ``out_dir`` (from scratch if none).
        callbacks: :class:`Callback` objects.
        task: what to optimise and measure (default: chosen by ``data.kind``, see
            :mod:`sinkformer.training.tasks`); pass your own for a new kind of data.
        allow_schedule_changes: let a resume change the schedule options of
            :data:`~sinkformer.training.config.SCHEDULE_OPTIONS` (e.g. more ``epochs``); any other
            option that differs from the checkpoint's is refused with ``ValueError``.

    Runs on all processes of a ``torchrun`` launch (see :mod:`sinkformer.training.distributed`).
    """
    config = config if isinstance(config, TrainConfig) else TrainConfig.from_dict(config)
    if resume and out_dir is None:
        raise ValueError("resume=True needs out_dir (the folder holding checkpoints/)")
    out_dir = Path(out_dir) if out_dir is not None else None
    ctx = setup_distributed(config.device)
    _check_precision(config, ctx.device)
    model.to(ctx.device)
    task = task if task is not None else task_for(data, config)
    _check_batch(model, data, ctx, config)
    optimizer = build_optimizer(model.parameters(), config)
    scaler = _grad_scaler(config, ctx.device)

    start_epoch, step, history = 0, 0, []
    checkpoint = latest_checkpoint(out_dir / "checkpoints") if resume else None
    if checkpoint is not None:
        state = load_checkpoint(checkpoint, model, optimizer)
        start_epoch, step, history = state["epoch"], state["global_step"], state["history"]
        _check_resumed_config(config, state, checkpoint, allow_schedule_changes)
        if scaler is not None and state.get("scaler"):
            scaler.load_state_dict(state["scaler"])
        if len(state["rng"]) == ctx.world_size:
            restore_rng(state["rng"][ctx.rank])
        else:  # another number of processes: the data order is kept, dropout draws differ
            torch.manual_seed(config.seed + ctx.rank + start_epoch)
        if ctx.is_main:
            logger.info("resuming from %s (epoch %d/%d, %d -> %d process(es))", checkpoint, start_epoch,
                        config.epochs, len(state["rng"]), ctx.world_size)
    else:
        if resume and ctx.is_main:
            logger.info("no checkpoint in %s: starting from scratch", out_dir / "checkpoints")
        torch.manual_seed(config.seed + ctx.rank)

    ddp = model
    if ctx.enabled:
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    recorder = AttentionRecorder(model) if config.record_attention else None
    for epoch in range(start_epoch, config.epochs):
        row, step = _train_epoch(ddp, data, task, optimizer, scaler, config, ctx, epoch, step, recorder, callbacks)
        done, last = epoch + 1, epoch + 1 == config.epochs
        if done % config.eval_every == 0 or last:
            row.update(_evaluate(model, data, task, config, ctx, with_bleu=done % config.bleu_every == 0 or last))
        if recorder is not None:
            row["attn_colsum_cv"] = _save_attention(recorder, out_dir, epoch, ctx)
        history.append(row)
        if ctx.is_main:
            logger.log(logging.INFO if config.progress else logging.DEBUG, "%s", _format_row(row, config.epochs))
            if out_dir is not None:
                write_metrics(out_dir, history)
            for callback in callbacks:
                callback.on_epoch_end(row)
        if out_dir is not None and (done % config.checkpoint_every == 0 or last):
            rng = all_gather_objects(capture_rng(), ctx)
            if ctx.is_main:
                state = {"global_step": step, "history": history, "rng": rng, "config": config.to_dict()}
                if scaler is not None:
                    state["scaler"] = scaler.state_dict()
                save_checkpoint(out_dir / "checkpoints", done, model, optimizer, state)
            barrier(ctx)
    if out_dir is not None and ctx.is_main:
        save_weights(model, out_dir / "model.safetensors")
    result = TrainResult(model, history, out_dir)
    if ctx.is_main:
        for callback in callbacks:
            callback.on_train_end(result)
    return result


def _check_resumed_config(config: TrainConfig, state: dict[str, Any], checkpoint: Path,
                          allow_schedule_changes: bool) -> None:
    """Refuse a resume whose train options differ from the checkpoint's, or whose ``epochs`` are fewer
    than those already trained (see :func:`resume_changes`); log the schedule changes it makes."""
    if "config" not in state:  # a checkpoint written before the options were saved in it
        return
    saved = {f"train.{k}": v for k, v in state["config"].items()}
    given = {f"train.{k}": v for k, v in config.to_dict().items()}
    changes = resume_changes(saved, given, allow_schedule_changes=allow_schedule_changes,
                             where=f"from {checkpoint}", trained_epochs=state["epoch"])
    if changes:
        logger.info("resuming with %s", ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changes.items()))


def evaluate(
    model: torch.nn.Module,
    data: DataBundle,
    config: TrainConfig | dict[str, Any] | None = None,
    *,
    task: Classification | None = None,
) -> dict[str, Any]:
    """Test metrics of ``model`` on ``data.test`` without training: the ``test_*`` entries of a
    :func:`train` row (BLEU included for translation), with ``config``'s evaluation options."""
    config = config if isinstance(config, TrainConfig) else TrainConfig.from_dict(config)
    ctx = setup_distributed(config.device)
    _check_precision(config, ctx.device)
    model.to(ctx.device)
    task = task if task is not None else task_for(data, config)
    return _evaluate(model, data, task, config, ctx, with_bleu=True)


def _autocast(config: TrainConfig, device: torch.device) -> contextlib.AbstractContextManager:
    """``torch.autocast`` in the configured precision (nothing for fp32)."""
    if config.precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=_DTYPES[config.precision])


def _check_precision(config: TrainConfig, device: torch.device) -> None:
    """Refuse a precision whose autocast this device / torch build cannot run (it would silently
    fall back to float32, or fail in the middle of the first epoch)."""
    if config.precision == "fp32":
        return
    dtype = _DTYPES[config.precision]
    hint = "use precision='bf16' or a CUDA device" if config.precision == "fp16" else "use precision='fp32'"
    try:
        with warnings.catch_warnings():  # torch warns, and disables autocast, for an unsupported dtype
            warnings.simplefilter("ignore")
            with torch.autocast(device.type, dtype=dtype):
                x = torch.ones(2, 2, device=device)
                got = torch.nn.functional.linear(x, x).dtype
    except (RuntimeError, ValueError) as err:
        raise ValueError(f"train option precision={config.precision!r} is not supported on {device.type} by "
                         f"torch {torch.__version__} ({err}); {hint}") from None
    if got != dtype:
        raise ValueError(f"train option precision={config.precision!r} is not supported on {device.type} by "
                         f"torch {torch.__version__} (autocast computed in {got}); {hint}")


def _grad_scaler(config: TrainConfig, device: torch.device) -> torch.amp.GradScaler | None:
    """fp16's loss scaler (float16 gradients underflow without it); ``None`` otherwise."""
    if config.precision != "fp16":
        return None
    try:
        return torch.amp.GradScaler(device.type)
    except (RuntimeError, ValueError, AssertionError) as err:
        raise ValueError(f"train option precision='fp16' needs torch.amp.GradScaler, which does not run on "
                         f"{device.type} here ({err}); use precision='bf16'") from None


def _format_row(row: dict[str, Any], epochs: int) -> str:
    """One line per epoch for the terminal."""
    parts = [f"epoch {row['epoch']}/{epochs}"]
    parts += [f"{k} {v:.4g}" for k, v in row.items() if k not in ("epoch", "epoch_seconds") and isinstance(v, float)]
    return "  ".join(parts + [f"{row['epoch_seconds']:.1f} s"])


def _check_batch(model: torch.nn.Module, data: DataBundle, ctx: Distributed, config: TrainConfig | None = None) -> None:
    """Run two test examples through the model, so shape mistakes fail before training starts
    (and, with mixed precision, once more under autocast, so that a model that cannot run in it
    fails here, with the option named)."""
    inputs, targets = data.collate([data.test[i] for i in range(min(2, len(data.test)))])
    inputs = to_device(inputs, targets, ctx.device)[0]
    was_training = model.training
    model.eval()
    try:
        try:
            with torch.no_grad():
                model(**inputs)
        except (RuntimeError, ValueError, TypeError) as err:
            raise ValueError(
                f"{type(model).__name__} cannot read a batch of this {data.kind} dataset "
                f"(inputs {', '.join(f'{k} {tuple(v.shape)}' for k, v in inputs.items())}): {err}"
            ) from err
        if config is not None and config.precision != "fp32":
            try:
                with torch.no_grad(), _autocast(config, ctx.device):
                    model(**inputs)
            except (RuntimeError, ValueError, TypeError) as err:
                raise ValueError(
                    f"{type(model).__name__} does not run under train option precision={config.precision!r} "
                    f"(torch.autocast on {ctx.device.type} in {_DTYPES[config.precision]}), though it does in "
                    f"float32: {err}; use precision='fp32'"
                ) from err
    finally:
        model.train(was_training)


def _train_epoch(
    model, data, task: Classification, optimizer, scaler, config: TrainConfig, ctx: Distributed, epoch: int,
    step: int, recorder: AttentionRecorder | None, callbacks,
) -> tuple[dict[str, Any], int]:
    """One pass over the training set; returns the epoch's metrics row and the new global step.

    Micro-batches of ``batch_size`` are grouped by ``accumulate``; each group is one optimiser step
    whose gradient is the one of the mean loss over the whole group (see :class:`TrainConfig`).
    """
    if hasattr(data.train, "set_epoch"):
        data.train.set_epoch(epoch)
    batches = epoch_batches(len(data.train), config.batch_size, seed=config.seed, epoch=epoch)
    batches = [b for b in batches if len(b) >= ctx.world_size]  # every process needs an example
    groups = [batches[i : i + config.accumulate] for i in range(0, len(batches), config.accumulate)]
    if config.max_train_batches:  # counts optimiser steps
        groups = groups[: config.max_train_batches]
    batches = [b for group in groups for b in group]
    # (index of the group, position in it, size of it) of every micro-batch
    plan = [(g, j, len(group)) for g, group in enumerate(groups) for j in range(len(group))]
    loader = torch.utils.data.DataLoader(
        data.train, batch_sampler=[shard(b, ctx.rank, ctx.world_size) for b in batches], collate_fn=data.collate,
        num_workers=config.num_workers, pin_memory=ctx.device.type == "cuda",
    )
    model.train()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    totals = torch.zeros(3, dtype=torch.float64, device=ctx.device)  # loss, correct, count (this process)
    bar = tqdm(loader, desc=f"epoch {epoch + 1}/{config.epochs}", unit="batch", leave=False,
               disable=not (config.progress and ctx.is_main))
    lr, seen, start = learning_rate(config, epoch, step), 0, time.perf_counter()
    divisor = group_count = group_totals = None
    for i, (inputs, targets) in enumerate(bar):
        g, j, size = plan[i]
        first, last = j == 0, j + 1 == size
        if recorder is not None and i == 0:
            recorder.attach()
        if recorder is not None and i == config.attention_batches:
            recorder.detach()
        if first:
            lr = learning_rate(config, epoch, step)
            set_learning_rate(optimizer, lr)
            optimizer.zero_grad(set_to_none=True)
            group_totals = torch.zeros(2, dtype=torch.float64, device=ctx.device)  # loss, count (this process)
        # DDP averages gradients over processes in the backward of the group's last micro-batch only
        sync = contextlib.nullcontext() if last or not ctx.enabled else model.no_sync()
        with sync:
            with _autocast(config, ctx.device):
                sums = task.sums(model, *to_device(inputs, targets, ctx.device))
            global_count = all_reduce_sum(sums["count"].double(), ctx)
            if first:
                # mean over the *global* batch: DDP averages gradients over processes, hence * world_size;
                # over a group, the divisor assumes micro-batches of equal counts, corrected below if not
                divisor, group_count = global_count.clamp_min(1) * size, global_count
            else:
                group_count = group_count + global_count
            loss = sums["loss"] * (ctx.world_size / divisor)
            (scaler.scale(loss) if scaler is not None else loss).backward()
        totals += torch.stack([sums["loss"].detach().double(), sums["correct"].double(), sums["count"].double()])
        group_totals += torch.stack([sums["loss"].detach().double(), sums["count"].double()])
        seen += len(batches[i])
        if not bar.disable and (i % 10 == 0 or i + 1 == len(batches)):
            loss_sum, correct, count = totals.tolist()
            bar.set_postfix(loss=f"{loss_sum / max(count, 1):.4f}", acc=f"{correct / max(count, 1):.3f}",
                            samples_s=f"{seen / max(time.perf_counter() - start, 1e-9):.0f}")
        if not last:
            continue
        if size > 1:  # the gradient of the group's summed loss over its true total count
            correction = (divisor / group_count.clamp_min(1)).float()
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(correction)
        if scaler is not None:
            if config.grad_clip:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
            scaler.step(optimizer)
            scaler.update()
        else:
            if config.grad_clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
            optimizer.step()
        step += 1
        if callbacks:
            loss_sum, count = group_totals.tolist()
            for callback in callbacks:
                callback.on_step_end(epoch, g, loss_sum / max(count, 1))
    if recorder is not None:
        recorder.detach()
    seconds = time.perf_counter() - start
    loss_sum, correct, count = all_reduce_sum(totals, ctx).tolist()
    row = {"epoch": epoch + 1, "lr": lr, "train_loss": loss_sum / max(count, 1), "train_acc": correct / max(count, 1),
           "epoch_seconds": round(seconds, 3), "samples_per_second": round(seen / max(seconds, 1e-9), 1)}
    return row, step


def _evaluate(model, data, task: Classification, config: TrainConfig, ctx: Distributed, with_bleu: bool) -> dict:
    """Test metrics (each process evaluates every ``world_size``-th batch; sums are combined)."""
    start = time.perf_counter()
    batch_size = config.eval_batch_size or config.batch_size
    batches = epoch_batches(len(data.test), batch_size, seed=config.seed, epoch=0, shuffle=False)
    if config.max_eval_batches:
        batches = batches[: config.max_eval_batches]
    model.eval()
    with _autocast(config, ctx.device):
        metrics = task.evaluate(model, data, batches[ctx.rank :: ctx.world_size], ctx, config, with_bleu=with_bleu)
    model.train()
    row = {f"test_{k}": v for k, v in metrics.items()}
    row["eval_seconds"] = round(time.perf_counter() - start, 3)
    return row


def _save_attention(recorder: AttentionRecorder, out_dir: Path | None, epoch: int, ctx: Distributed) -> float:
    """Write this epoch's recorded column sums (main process) and return their coefficient of variation."""
    cv = recorder.coefficient_of_variation()
    if out_dir is not None and ctx.is_main:
        save_file = require("safetensors.torch", "recording attention").save_file

        path = out_dir / "attention" / f"epoch_{epoch + 1:04d}.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        save_file(recorder.column_sums(), str(tmp))
        os.replace(tmp, path)  # atomic, like every file the trainer writes
    recorder.reset()
    return cv
