"""Ready-made :class:`~sinkformer.training.Callback` objects for :func:`~sinkformer.training.train`.

* :class:`TensorBoardLogger` — every epoch's metrics to TensorBoard event files (needs the
  optional ``tensorboard`` package: ``pip install 'sinkformer[tensorboard]'``).

::

    from sinkformer.training import train
    from sinkformer.training.callbacks import TensorBoardLogger

    train(model, data, config, out_dir="runs/vit", callbacks=[TensorBoardLogger("runs/vit/tensorboard")])
    # then: tensorboard --logdir runs/vit/tensorboard
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from .loop import Callback, TrainResult

__all__ = ["TensorBoardLogger", "TENSORBOARD_INSTALL"]

#: What to install for :class:`TensorBoardLogger`.
TENSORBOARD_INSTALL = "pip install 'sinkformer[tensorboard]'"


def _summary_writer_class():
    """``torch.utils.tensorboard.SummaryWriter``, imported only when a logger is made."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as err:  # tensorboard missing (or too old for torch)
        raise ImportError(
            f"TensorBoardLogger needs the tensorboard package, which sinkformer does not install by default: "
            f"{TENSORBOARD_INSTALL} (or pip install tensorboard); the import failed with: {err}"
        ) from err
    return SummaryWriter


class TensorBoardLogger(Callback):
    """Write every epoch's metrics row to TensorBoard, one scalar per metric.

    Each finite number of a :func:`~sinkformer.training.train` row (``lr``, ``train_loss``,
    ``train_acc``, ``test_loss``, ``test_acc``, ``test_bleu``, ``epoch_seconds``, ...) becomes
    the scalar ``{prefix}{name}`` at step = the 1-based epoch. Only the main process writes
    (``train`` calls :meth:`on_epoch_end` there only); the event file is flushed after each
    epoch and closed when training ends.

    Args:
        log_dir: the folder of the event files (``tensorboard --logdir`` it), e.g.
            ``out_dir / "tensorboard"``.
        prefix: prepended to every scalar name, e.g. ``"vit/"`` to group runs' plots.

    Raises ``ImportError`` naming the extra to install (``pip install 'sinkformer[tensorboard]'``)
    when ``tensorboard`` is missing — when the logger is made, before training starts.
    """

    def __init__(self, log_dir: str | Path, *, prefix: str = "") -> None:
        self._writer_class = _summary_writer_class()
        self.log_dir = Path(log_dir)
        self.prefix = prefix
        self._writer = None  # made at the first write: processes other than the main one write nothing

    @property
    def writer(self):
        """The ``SummaryWriter`` (made on first use)."""
        if self._writer is None:
            self._writer = self._writer_class(log_dir=str(self.log_dir))
        return self._writer

    def on_epoch_end(self, row: dict[str, Any]) -> None:
        epoch = int(row["epoch"])
        for name, value in row.items():
            if name == "epoch" or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if math.isfinite(value):
                self.writer.add_scalar(f"{self.prefix}{name}", float(value), global_step=epoch)
        self.writer.flush()

    def on_train_end(self, result: TrainResult) -> None:
        self.close()

    def close(self) -> None:
        """Flush and close the event file (a later epoch opens a new one)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
