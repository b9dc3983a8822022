r"""Optimisers and learning-rate schedules.

The learning rate is a pure function of ``(epoch, step)`` — nothing to save in a checkpoint,
nothing to get wrong on resume:

* ``"step"`` (the Sinkformers paper, Appendix C):
  :math:`\eta_e = \eta_0\,\gamma^{\#\{m \in \text{milestones} : m \le e\}}` for the 0-based
  epoch ``e`` — e.g. ``milestones=[200]``, ``gamma=0.1``: epochs 0–199 at :math:`\eta_0`,
  then :math:`\eta_0/10` ("decayed by a factor 10 after 200 epochs");
* ``"inverse_sqrt"`` (fairseq, used for IWSLT'14): :math:`\eta_t = \eta_0\sqrt{w / t}` for the
  1-based step :math:`t \ge w` = ``warmup_steps``;
* with ``warmup_steps`` :math:`w > 0` both are multiplied by :math:`\min(1, t / w)` (linear
  warm-up from :math:`\eta_0/w`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from .config import TrainConfig

__all__ = ["learning_rate", "build_optimizer", "set_learning_rate"]


def learning_rate(config: TrainConfig, epoch: int, step: int) -> float:
    """Learning rate for 0-based ``epoch`` and 0-based global optimisation ``step``."""
    t = step + 1
    warm = min(1.0, t / config.warmup_steps) if config.warmup_steps else 1.0
    if config.schedule == "step":
        return config.lr * config.gamma ** sum(m <= epoch for m in config.milestones) * warm
    return config.lr * math.sqrt(max(config.warmup_steps, 1) / max(t, config.warmup_steps, 1)) * warm


def build_optimizer(params: Iterable[torch.nn.Parameter], config: TrainConfig) -> torch.optim.Optimizer:
    """Adam, AdamW or SGD (with momentum) as configured."""
    params = [p for p in params if p.requires_grad]
    if config.optimizer == "sgd":
        return torch.optim.SGD(params, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay)
    cls = torch.optim.AdamW if config.optimizer == "adamw" else torch.optim.Adam
    return cls(params, lr=config.lr, betas=tuple(config.betas), weight_decay=config.weight_decay)


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
