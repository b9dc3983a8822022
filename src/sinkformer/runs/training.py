"""The one way experiments train a model: :func:`fit`, over :func:`sinkformer.training.train`."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from .._optional import require
from ..data import DataBundle
from ..training import Callback, TrainConfig, TrainResult, train
from .registry import _DEVICE, Run, on_device, progress_beat

__all__ = ["fit", "training_seconds", "on_device"]

class _EpochBar(Callback):
    """One progress bar per training run, advanced per epoch, showing the latest test metrics; with
    ``log``, each epoch's row is also logged as it ends (so the suite's progress moves per epoch).
    Every optimisation step is a :func:`~.registry.progress_beat`."""

    def __init__(self, label: str, epochs: int, log: Callable[[dict[str, Any]], None] | None = None) -> None:
        tqdm = require("tqdm.auto", "progress bars").tqdm
        self.bar = tqdm(total=epochs, desc=label, unit="epoch", leave=True, dynamic_ncols=True)
        self.log = log

    def on_step_end(self, epoch: int, step: int, loss: float) -> None:
        progress_beat()  # the suite's stall detector sees every step, not only every epoch

    def on_epoch_end(self, row: dict[str, Any]) -> None:
        shown = {k: v for k, v in row.items() if k in ("train_loss", "test_acc", "test_bleu")}
        self.bar.set_postfix({k: f"{v:.3g}" for k, v in shown.items()}, refresh=False)
        self.bar.update(1)
        if self.log is not None:
            self.log(row)


def fit(
    module: torch.nn.Module,
    data: DataBundle,
    train_options: dict[str, Any],
    *,
    seed: int,
    ctx: Run | None = None,
    label: str = "",
    task=None,
    out_dir: str | Path | None = None,
    **fields: Any,
) -> TrainResult:
    """Train ``module`` on ``data`` with :func:`sinkformer.training.train`, seeded, one progress bar.

    ``train_options`` are :class:`~sinkformer.training.TrainConfig` keys (``seed`` and ``progress``
    are set here, ``device`` from :func:`on_device` unless given); ``task`` the trainer's task (default: from the data). With ``ctx``, every epoch's
    row is logged to the run's ``metrics.csv``, prefixed by ``fields`` (``model=``, ``n_iters=``, ...)
    and the seed; ``label`` names the run on its progress bar.
    """
    config = TrainConfig.from_dict({"device": _DEVICE.get(), **train_options, "seed": seed, "progress": False})
    name = f"{ctx.name} | " if ctx is not None else ""
    log = (lambda row: ctx.log(**fields, seed=seed, **row)) if ctx is not None else None
    bar = _EpochBar(f"{name}{label} (seed {seed})", config.epochs, log)
    torch.manual_seed(seed)
    try:
        return train(module, data, config, out_dir=out_dir, callbacks=[bar], task=task)
    finally:
        bar.bar.close()


def training_seconds(result: TrainResult) -> float:
    """Training time of a run (the sum of its epochs' ``epoch_seconds``; evaluation excluded)."""
    return float(sum(row.get("epoch_seconds", 0.0) for row in result.history))
