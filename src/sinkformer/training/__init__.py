"""One trainer for every model and dataset: :func:`train` and the pieces it is made of.

* :mod:`~sinkformer.training.config` — :class:`TrainConfig`, the options, checked up front;
* :mod:`~sinkformer.training.loop` — :func:`train`, :class:`TrainResult`, :class:`Callback`;
* :mod:`~sinkformer.training.callbacks` — :class:`TensorBoardLogger` (``sinkformer[tensorboard]``);
* :mod:`~sinkformer.training.schedules` — optimisers, step decay, inverse square root;
* :mod:`~sinkformer.training.batches` — seeded data order and per-process shards;
* :mod:`~sinkformer.training.checkpoint` — atomic safetensors checkpoints, RNG state, resume;
* :mod:`~sinkformer.training.distributed` — ``torchrun`` / DistributedDataParallel;
* :mod:`~sinkformer.training.tasks` — losses and metrics (accuracy, BLEU);
* :mod:`~sinkformer.training.metrics` — ``metrics.csv`` / ``metrics.jsonl``;
* :mod:`~sinkformer.training.diagnostics` — column sums of attention matrices (Figure 2);
* :mod:`~sinkformer.training.runner` — config files -> data + model + :func:`train` (the CLI).
"""

from .callbacks import TensorBoardLogger
from .checkpoint import load_checkpoint, load_weights, save_weights
from .config import TrainConfig
from .diagnostics import AttentionRecorder
from .loop import Callback, TrainResult, evaluate, train

__all__ = [
    "TrainConfig",
    "train",
    "evaluate",
    "TrainResult",
    "Callback",
    "TensorBoardLogger",
    "AttentionRecorder",
    "save_weights",
    "load_weights",
    "load_checkpoint",
]
