"""The trainer's options, checked once before training starts."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from .._options import check_options

__all__ = ["TrainConfig", "OPTIMIZERS", "SCHEDULES", "DECODERS", "PRECISIONS", "SCHEDULE_OPTIONS", "FREE_OPTIONS",
           "resume_changes"]

OPTIMIZERS = ("adam", "adamw", "sgd")
SCHEDULES = ("step", "inverse_sqrt")
DECODERS = ("greedy", "beam")
PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class TrainConfig:
    """Options of :func:`sinkformer.training.train` (all have defaults; ``--set train.KEY=VALUE``).

    Optimisation: ``optimizer`` (adam, adamw, sgd), ``lr``, ``weight_decay``, ``momentum``
    (sgd), ``betas`` (adam/adamw), ``grad_clip`` (max gradient norm, 0 = off),
    ``label_smoothing``.

    Schedule (:mod:`sinkformer.training.schedules`): ``schedule="step"`` multiplies ``lr`` by
    ``gamma`` after each epoch listed in ``milestones`` (the paper's step decay, e.g. ``[200]``
    for 300 epochs); ``"inverse_sqrt"`` is fairseq's ``lr * sqrt(warmup_steps / step)``.
    ``warmup_steps`` > 0 ramps the lr up linearly over the first steps with either schedule.
    ``schedule_offset`` (default 0) starts the step count there: step ``k`` of this run gets the
    lr of step ``schedule_offset + k`` (warm-up and ``inverse_sqrt``; epoch ``milestones`` are
    not shifted) — to continue a schedule, e.g. fine-tuning after ``t0`` steps of training.

    Data: ``batch_size`` is the *global* batch (split over processes), ``eval_batch_size``
    (0 = ``batch_size``), ``max_train_batches`` / ``max_eval_batches`` (0 = all; for quick
    runs), ``num_workers`` (DataLoader workers), ``seed`` (weights order, data order,
    augmentation, dropout).

    Gradient accumulation: ``accumulate`` (default 1) micro-batches of ``batch_size`` examples
    each are run forward and backward before one optimiser step, so an update sees
    ``accumulate * batch_size`` examples while only ``batch_size`` are in memory at once. The
    gradient is the one of the mean loss over the whole group (the sum over every example or
    token of the group divided by their total count, over all processes), so with the same
    seed ``batch_size=8, accumulate=4`` makes the same updates as ``batch_size=32`` (the data
    order depends on the seed and epoch only; dropout draws differ, and float sums may differ
    in their last bits). Everything counted in steps counts *optimiser steps* (groups of
    micro-batches), not micro-batches: the schedule's step (``warmup_steps``,
    ``inverse_sqrt``, ``schedule_offset``), ``max_train_batches`` (at most that many optimiser
    steps per epoch, i.e. ``max_train_batches * accumulate`` micro-batches) and the ``step``
    passed to :meth:`Callback.on_step_end`. The last group of an epoch may hold fewer
    micro-batches.

    Precision: ``precision="fp32"`` (default), ``"bf16"`` or ``"fp16"``: the forward passes of
    training and evaluation run under ``torch.autocast(device_type, dtype)`` (mixed precision:
    the weights, the optimiser and the loss stay float32). ``"fp16"`` also scales the loss with
    a ``torch.amp.GradScaler`` (its state is saved in checkpoints and restored on resume);
    ``"bf16"`` needs no scaler. Both work on CUDA and on the CPU (bf16 is the faster one there;
    fp16 autocast on the CPU needs a recent torch, e.g. 2.13); a device or torch build whose
    autocast cannot run the dtype is refused when training starts, with a ``ValueError`` naming
    the option.

    Evaluation: every ``eval_every`` epochs (and after the last); for translation, BLEU at the
    evaluations of epochs divisible by ``bleu_every`` (and after the last) with ``decode`` =
    greedy or beam (``beam_size``) on the first ``bleu_samples`` test sentences (0 = all).

    Run: ``checkpoint_every`` epochs (and after the last), ``record_attention`` (column sums of
    every attention matrix on the first ``attention_batches`` training batches of each epoch),
    ``progress`` (tqdm bar), ``device`` (``auto``: CUDA if available, else Apple's MPS if
    available, else the CPU; or ``cpu``, ``cuda``, ``cuda:N``, ``mps``). A device that is not
    available raises ``ValueError`` when training starts.
    """

    epochs: int = 10
    batch_size: int = 32
    eval_batch_size: int = 0
    optimizer: str = "adam"
    lr: float = 1e-3
    weight_decay: float = 0.0
    momentum: float = 0.9
    betas: tuple = (0.9, 0.999)
    schedule: str = "step"
    milestones: tuple = ()
    gamma: float = 0.1
    warmup_steps: int = 0
    schedule_offset: int = 0
    grad_clip: float = 0.0
    label_smoothing: float = 0.0
    seed: int = 0
    max_train_batches: int = 0
    max_eval_batches: int = 0
    num_workers: int = 0
    eval_every: int = 1
    bleu_every: int = 1
    bleu_samples: int = 0
    decode: str = "greedy"
    beam_size: int = 5
    checkpoint_every: int = 1
    record_attention: bool = False
    attention_batches: int = 1
    progress: bool = True
    device: str = "auto"
    precision: str = "fp32"
    accumulate: int = 1

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size", "eval_every", "bleu_every", "beam_size", "checkpoint_every",
                     "attention_batches", "accumulate"):
            if getattr(self, name) < 1:
                raise ValueError(f"train option {name} must be >= 1, got {getattr(self, name)}")
        for name in ("eval_batch_size", "max_train_batches", "max_eval_batches", "num_workers", "warmup_steps",
                     "schedule_offset", "bleu_samples", "weight_decay", "grad_clip", "momentum"):
            if getattr(self, name) < 0:
                raise ValueError(f"train option {name} must be >= 0, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"train option lr must be > 0, got {self.lr}")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"train option label_smoothing must be in [0, 1), got {self.label_smoothing}")
        for name, choices in (("optimizer", OPTIMIZERS), ("schedule", SCHEDULES), ("decode", DECODERS),
                              ("precision", PRECISIONS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"train option {name} must be one of {list(choices)}, got {getattr(self, name)!r}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"train option betas must be two numbers in [0, 1), got {list(self.betas)}")
        if not all(isinstance(m, int) and m > 0 for m in self.milestones):
            raise ValueError(f"train option milestones must be positive epoch numbers, got {list(self.milestones)}")
        if not _valid_device(self.device):
            raise ValueError(f"train option device must be auto, cpu, cuda, cuda:N or mps, got {self.device!r}")

    @classmethod
    def from_dict(cls, options: dict[str, Any] | None = None) -> "TrainConfig":
        """Build from a plain dict (a YAML section); unknown keys and wrong types raise, naming the key."""
        defaults = {f.name: f.default for f in fields(cls)}
        return cls(**check_options("train", dict(options or {}), defaults))

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


def _valid_device(device: str) -> bool:
    """``auto``, or a device string torch reads as a CPU, CUDA or MPS device."""
    if device == "auto":
        return True
    try:
        return torch.device(device).type in ("cpu", "cuda", "mps")
    except (RuntimeError, TypeError):
        return False


#: Options a resumed run may change with ``allow_schedule_changes=True`` (``--allow-schedule-changes``):
#: they decide how long the run goes on, where, and how often it evaluates, checkpoints or records,
#: not the updates of the epochs it already trained or what its metrics measure. (``data.path``: the
#: same dataset moved; nothing can check that it is the same.)
SCHEDULE_OPTIONS = frozenset({
    "train.epochs", "train.eval_every", "train.bleu_every", "train.checkpoint_every", "train.record_attention",
    "train.attention_batches", "train.num_workers", "train.eval_batch_size", "train.device", "data.path",
})
#: Options a resume may change freely: they change nothing that is computed.
FREE_OPTIONS = frozenset({"train.progress"})


def resume_changes(saved: dict[str, Any], given: dict[str, Any], *, allow_schedule_changes: bool = False,
                   where: str = "the run", trained_epochs: int = 0) -> dict[str, list]:
    """The options a resume changes, ``{"train.epochs": [10, 20], ...}``, checked: ``saved`` and ``given``
    are flat ``{"section.key": value}`` options of the run and of the resume (keys missing on one side
    read as ``None``).

    Raises ``ValueError`` listing the differences when a resume would change a model, data or
    optimisation option (anything outside :data:`SCHEDULE_OPTIONS` and :data:`FREE_OPTIONS`) — the run
    would continue as another run and its record would misdescribe the epochs already trained — or
    a schedule option without ``allow_schedule_changes``, or ``train.epochs`` below the
    ``trained_epochs`` the run has done. Free options are not returned."""
    changes = {key: [saved.get(key), given.get(key)] for key in sorted(set(saved) | set(given))
               if saved.get(key) != given.get(key) and key not in FREE_OPTIONS}
    fixed = {k: v for k, v in changes.items() if k not in SCHEDULE_OPTIONS}
    schedule = {k: v for k, v in changes.items() if k in SCHEDULE_OPTIONS}

    def listed(items: dict[str, list]) -> str:
        return ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in items.items())

    if fixed:
        also = f" (and the schedule: {listed(schedule)})" if schedule else ""
        raise ValueError(
            f"cannot resume {where} with other model, data or optimisation options than it started with: "
            f"{listed(fixed)}{also}. A resumed run continues with its own options (its config.yaml), so that its "
            f"epochs form one run; drop these options, or start a new run (another --out, or --overwrite)")
    if schedule and not allow_schedule_changes:
        raise ValueError(
            f"resuming {where} with {listed(schedule)} changes how the run goes on from here; pass "
            f"--allow-schedule-changes (allow_schedule_changes=True) to continue so (the change is recorded), or "
            f"resume without these options")
    epochs = given.get("train.epochs")
    if epochs is not None and epochs < trained_epochs:
        raise ValueError(f"cannot resume {where} with train option epochs={epochs}: the run has already trained "
                         f"{trained_epochs} epochs")
    return schedule
