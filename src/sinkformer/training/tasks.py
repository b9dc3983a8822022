r"""What the trainer optimises and measures, per kind of data.

* :class:`Classification` (images, points, tokens): cross-entropy (with optional label
  smoothing) and accuracy, per example.
* :class:`Translation`: token-level cross-entropy and accuracy over the non-padding target
  tokens; evaluation adds corpus BLEU (sacreBLEU) of greedy or beam-search translations.

A task's :meth:`~Classification.sums` returns *sums* (loss, correct, count) over a batch, so
that batches and processes of different sizes combine exactly: the mean is the total sum over
the total count. A new kind of data needs a task with the same two methods, ``sums(model,
inputs, targets)`` and ``evaluate(model, data, batches, ctx, config, with_bleu=...)``, passed
as ``train(..., task=...)``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor

from ..data.base import DataBundle
from ..data.parallel_text import bleu
from ..models.decoding import beam_search, greedy_decode
from .config import TrainConfig
from .distributed import Distributed, all_gather_objects, all_reduce_sum

__all__ = ["Classification", "Translation", "task_for", "to_device"]


def to_device(inputs: dict[str, Tensor], targets: Tensor, device: torch.device) -> tuple[dict[str, Tensor], Tensor]:
    """A collated batch ``(inputs, targets)`` on ``device``."""
    return {k: v.to(device, non_blocking=True) for k, v in inputs.items()}, targets.to(device, non_blocking=True)


class Classification:
    """Per-example cross-entropy and accuracy."""

    def __init__(self, label_smoothing: float = 0.0) -> None:
        self.label_smoothing = label_smoothing

    def sums(self, model: torch.nn.Module, inputs: dict[str, Tensor], targets: Tensor) -> dict[str, Tensor]:
        """``{"loss": summed loss (differentiable), "correct": ..., "count": ...}`` of one batch."""
        logits = model(**inputs)
        loss = F.cross_entropy(logits, targets, reduction="sum", label_smoothing=self.label_smoothing)
        correct = (logits.detach().argmax(-1) == targets).sum()
        return {"loss": loss, "correct": correct, "count": torch.tensor(targets.numel(), device=targets.device)}

    @torch.no_grad()
    def evaluate(
        self, model: torch.nn.Module, data: DataBundle, batches: Iterable[list[int]], ctx: Distributed,
        config: TrainConfig, *, with_bleu: bool = False,
    ) -> dict[str, float]:
        """Mean loss and accuracy over this process's ``batches`` of ``data.test``, summed over processes."""
        totals = torch.zeros(3, dtype=torch.float64, device=ctx.device)
        for batch in batches:
            inputs, targets = to_device(*data.collate([data.test[i] for i in batch]), ctx.device)
            s = self.sums(model, inputs, targets)
            totals += torch.stack([s["loss"].double(), s["correct"].double(), s["count"].double()])
        loss, correct, count = all_reduce_sum(totals, ctx).tolist()
        return {"loss": loss / max(count, 1), "acc": correct / max(count, 1)}


class Translation(Classification):
    """Token-level cross-entropy over non-padding targets; BLEU of decoded test sentences."""

    def __init__(self, pad_id: int, label_smoothing: float = 0.0) -> None:
        super().__init__(label_smoothing)
        self.pad_id = pad_id

    def sums(self, model: torch.nn.Module, inputs: dict[str, Tensor], targets: Tensor) -> dict[str, Tensor]:
        logits = model(**inputs)
        keep = targets != self.pad_id
        loss = F.cross_entropy(
            logits.flatten(0, 1), targets.flatten(), ignore_index=self.pad_id, reduction="sum",
            label_smoothing=self.label_smoothing,
        )
        correct = ((logits.detach().argmax(-1) == targets) & keep).sum()
        return {"loss": loss, "correct": correct, "count": keep.sum()}

    @torch.no_grad()
    def evaluate(self, model, data, batches, ctx, config, *, with_bleu: bool = False) -> dict[str, float]:
        batches = list(batches)
        metrics = super().evaluate(model, data, batches, ctx, config)
        if with_bleu:
            metrics["bleu"] = self.bleu(model, data, batches, ctx, config)
        return metrics

    def bleu(self, model, data: DataBundle, batches: list[list[int]], ctx: Distributed, config: TrainConfig) -> float:
        """Corpus BLEU (sacreBLEU) of the translations of the sentences in ``batches`` (all processes together)."""
        hypotheses, references = self.translations(model, data, batches, ctx, config)
        return bleu(hypotheses, references) if hypotheses else float("nan")

    def translations(self, model, data: DataBundle, batches: list[list[int]], ctx: Distributed,
                     config: TrainConfig) -> tuple[list[str], list[str]]:
        """``(hypotheses, references)`` of the test sentences in ``batches`` (greedy or beam decoding as
        ``config.decode`` says; at most ``config.bleu_samples`` sentences), in sentence order."""
        translated: list[tuple[int, str]] = []
        for batch in batches:
            if config.bleu_samples:
                batch = [i for i in batch if i < config.bleu_samples]
            if not batch:
                continue
            inputs, _ = to_device(*data.collate([data.test[i] for i in batch]), ctx.device)
            if config.decode == "beam":
                ids = beam_search(model, inputs["src"], inputs["src_padding_mask"], beam_size=config.beam_size)
            else:
                ids = greedy_decode(model, inputs["src"], inputs["src_padding_mask"])
            translated += [(i, data.tokenizer.decode(x, skip_special_tokens=True)) for i, x in zip(batch, ids)]
        merged = sorted(pair for part in all_gather_objects(translated, ctx) for pair in part)
        return [hyp for _, hyp in merged], [data.test.references[i] for i, _ in merged]


class TokenLevel(Translation):
    """Per-token cross-entropy and accuracy over non-padding targets (the translation task)
    without its BLEU decoding: for language models (kind ``"lm"``), and for sorting, scored by its
    own decoding. ``pad_id=None``: every target counts."""

    def __init__(self, pad_id: int | None = None, label_smoothing: float = 0.0) -> None:
        super().__init__(IGNORE_INDEX if pad_id is None else pad_id, label_smoothing)

    def evaluate(self, model, data, batches, ctx, config, *, with_bleu: bool = False) -> dict[str, float]:
        return Classification.evaluate(self, model, data, batches, ctx, config)


#: torch's cross-entropy ``ignore_index``: the target no real token has.
IGNORE_INDEX = -100


def task_for(data: DataBundle, config: TrainConfig) -> Classification:
    """The task matching the kind of ``data``."""
    if data.kind == "translation":
        return Translation(data.info["pad_id"], config.label_smoothing)
    if data.kind == "lm":
        return TokenLevel(data.info.get("pad_id"), config.label_smoothing)
    return Classification(config.label_smoothing)
