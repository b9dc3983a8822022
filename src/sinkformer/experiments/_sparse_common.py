"""Pieces shared by the Sparse Sinkhorn Attention experiments (sort, charlm, pixels, sortcut, nli, ablations).

* :func:`fit` — train a model with the one trainer (:func:`sinkformer.training.train`);
  sequence models (language models, sorting) with the per-token task :class:`TokenLevel`;
* :func:`train_language_model`, :func:`train_classifier` — one model of a comparison, trained
  and scored (bits / perplexity per token, or accuracy);
* :func:`markdown_table`, :func:`bar_figure` — the report's table and figure.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..data.base import DataBundle
from ..models.sinkhorn_transformer import AttentionConfig, SinkhornClassifier, SinkhornTransformerLM
from ..plotting import pyplot
from ..training import TrainConfig, train
from ..training.tasks import Classification, Translation
from .registry import markdown_table as registry_table

__all__ = ["short_label", "TokenLevel", "fit", "train_language_model", "train_classifier",
           "markdown_table", "bar_figure", "LN2"]

LN2 = math.log(2.0)
IGNORE = -100  # torch's cross-entropy ignore_index

#: Experiment configuration keys passed on to :class:`~sinkformer.training.TrainConfig`.
TRAIN_KEYS = ("epochs", "batch_size", "lr", "warmup_steps", "grad_clip", "max_train_batches", "max_eval_batches")


def short_label(attention: AttentionConfig) -> str:
    """The classification tables' names: ``"Sinkhorn (8)"``, ``"SortCut (2x8)"``, ``"Transformer"``."""
    return attention.label.replace("Sinkhorn Transformer", "Sinkhorn").replace("SortCut Sinkhorn", "SortCut")


class TokenLevel(Translation):
    """Per-token cross-entropy and accuracy over non-padding targets (the trainer's translation
    task) without its BLEU decoding: for language models, and for sorting, scored by its own
    decoding. ``pad_id=None``: every target counts."""

    def __init__(self, pad_id: int | None = None) -> None:
        super().__init__(IGNORE if pad_id is None else pad_id)

    def evaluate(self, model, data, batches, ctx, config, *, with_bleu: bool = False) -> dict[str, float]:
        return Classification.evaluate(self, model, data, batches, ctx, config)


def fit(model: nn.Module, data: DataBundle, config: dict[str, Any], *, seed: int,
        sequence: bool = False) -> tuple[dict[str, Any], float]:
    """Train ``model`` on ``data`` with the experiment's ``config`` (see ``TRAIN_KEYS``).

    ``sequence=True``: a ``(B, T, V)`` model scored per token (:class:`TokenLevel`). Returns the
    trainer's final metrics row (``test_loss``, ``test_acc``, ...) and the training seconds.
    """
    options = {k: config[k] for k in TRAIN_KEYS if k in config}
    task = TokenLevel(data.info.get("pad_id")) if sequence else None
    start = time.perf_counter()
    torch.manual_seed(seed)
    result = train(model, data, TrainConfig(seed=seed, progress=False, **options), task=task)
    return result.final, time.perf_counter() - start


def _shape(cfg: dict[str, Any]) -> dict[str, Any]:
    return {"dim": cfg["dim"], "depth": cfg["depth"], "heads": cfg["heads"], "dropout": cfg.get("dropout", 0.0)}


def train_language_model(data: DataBundle, attention: AttentionConfig, cfg: dict[str, Any], *,
                         seed: int) -> tuple[SinkhornTransformerLM, dict[str, float]]:
    """A :class:`SinkhornTransformerLM` (``cfg``: dim, depth, heads, dropout + training keys),
    trained on ``data`` (kind ``lm``); returns it and its test ``nats``, ``bits`` and
    ``perplexity`` per token, ``accuracy`` (%) and ``train_seconds``."""
    torch.manual_seed(seed)
    model = SinkhornTransformerLM(data.info["vocab_size"], max_len=data.info["max_len"], attention=attention, **_shape(cfg))
    final, seconds = fit(model, data, cfg, seed=seed, sequence=True)
    nats = final["test_loss"]
    return model, {"nats": nats, "bits": nats / LN2, "perplexity": math.exp(min(nats, 50.0)),
                   "accuracy": 100 * final["test_acc"], "train_seconds": round(seconds, 1)}


def train_classifier(data: DataBundle, attention: AttentionConfig, cfg: dict[str, Any], *, seed: int) -> dict[str, float]:
    """A :class:`SinkhornClassifier` trained on ``data`` (kind ``tokens``): test ``accuracy`` (%), ``train_seconds``."""
    torch.manual_seed(seed)
    model = SinkhornClassifier(data.info["vocab_size"], data.info["n_classes"], max_len=data.info["max_len"],
                               attention=attention, pad_id=data.info["pad_id"], **_shape(cfg))
    final, seconds = fit(model, data, cfg, seed=seed)
    return {"accuracy": 100 * final["test_acc"], "train_seconds": round(seconds, 1)}


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """The registry's markdown table with floats at 4 decimals below 1, 3 below 10, else 2 (``None`` a dash)."""
    def cell(x: Any) -> Any:
        if isinstance(x, float) and not math.isnan(x):
            return f"{x:.4f}" if abs(x) < 1 else f"{x:.3f}" if abs(x) < 10 else f"{x:.2f}"
        return x

    return registry_table(header, [[cell(x) for x in row] for row in rows])


def bar_figure(labels: Sequence[str], panels: dict[str, Sequence[float]], title: str):
    """One horizontal bar chart per metric (``panels``: metric name -> one value per label)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 0.45 * len(labels) + 1.5), squeeze=False)
    for ax, (name, values) in zip(axes[0], panels.items()):
        ax.barh(range(len(labels)), values, color="tab:blue")
        ax.set_yticks(range(len(labels)), labels)
        ax.invert_yaxis()
        ax.set_xlabel(name)
        ax.grid(True, axis="x", alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    return fig
