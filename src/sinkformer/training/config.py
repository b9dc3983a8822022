"""The trainer's options, checked once before training starts."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from .._options import check_options

__all__ = ["TrainConfig", "OPTIMIZERS", "SCHEDULES", "DECODERS"]

OPTIMIZERS = ("adam", "adamw", "sgd")
SCHEDULES = ("step", "inverse_sqrt")
DECODERS = ("greedy", "beam")


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

    Evaluation: every ``eval_every`` epochs (and after the last); for translation, BLEU at the
    evaluations of epochs divisible by ``bleu_every`` (and after the last) with ``decode`` =
    greedy or beam (``beam_size``) on the first ``bleu_samples`` test sentences (0 = all).

    Run: ``checkpoint_every`` epochs (and after the last), ``record_attention`` (column sums of
    every attention matrix on the first ``attention_batches`` training batches of each epoch),
    ``progress`` (tqdm bar), ``device`` (auto, cpu, cuda, cuda:N).
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

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size", "eval_every", "bleu_every", "beam_size", "checkpoint_every",
                     "attention_batches"):
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
        for name, choices in (("optimizer", OPTIMIZERS), ("schedule", SCHEDULES), ("decode", DECODERS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"train option {name} must be one of {list(choices)}, got {getattr(self, name)!r}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"train option betas must be two numbers in [0, 1), got {list(self.betas)}")
        if not all(isinstance(m, int) and m > 0 for m in self.milestones):
            raise ValueError(f"train option milestones must be positive epoch numbers, got {list(self.milestones)}")
        if not self.device == "auto" and not self.device.startswith(("cpu", "cuda")):
            raise ValueError(f"train option device must be auto, cpu, cuda or cuda:N, got {self.device!r}")

    @classmethod
    def from_dict(cls, options: dict[str, Any] | None = None) -> "TrainConfig":
        """Build from a plain dict (a YAML section); unknown keys and wrong types raise, naming the key."""
        defaults = {f.name: f.default for f in fields(cls)}
        return cls(**check_options("train", dict(options or {}), defaults))

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}
