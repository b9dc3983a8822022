"""Pieces shared by the Sparse Sinkhorn Attention experiments (sort, charlm, pixels, sortcut, nli, ablations).

* :func:`train` — train a model with the one :func:`sinkformer.runs.fit`, on the experiment's
  training keys; sequence models (language models, sorting) with the per-token task :class:`TokenLevel`;
* :func:`train_language_model`, :func:`train_classifier` — one model of a comparison, trained
  and scored (bits / perplexity per token, or accuracy);
* :func:`versus_vanilla` — every Sparse Sinkhorn model's paired comparison (over seeds) with the
  vanilla Transformer, its verdict oriented by the paper's table (:func:`paper_row`);
* :func:`bar_figure` — the report's figure (tables: :func:`sinkformer.runs.markdown_table`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ...data.base import DataBundle
from ...models.sinkhorn_transformer import (
    AttentionConfig,
    SinkhornClassifier,
    SinkhornTransformerLM,
)
from ...plotting import method_color, pyplot
from ...runs import fit, training_seconds
from ...runs.verdicts import Comparison, paired
from ...training.tasks import TokenLevel

__all__ = ["short_label", "TokenLevel", "train", "train_language_model", "train_classifier", "bar_figure", "LN2",
           "SINKHORN_KINDS", "paper_row", "versus_vanilla"]

LN2 = math.log(2.0)

#: Experiment configuration keys passed on to :class:`~sinkformer.training.TrainConfig`.
TRAIN_KEYS = ("epochs", "batch_size", "lr", "warmup_steps", "grad_clip", "max_train_batches", "max_eval_batches")


def short_label(attention: AttentionConfig) -> str:
    """The classification tables' names: ``"Sinkhorn (8)"``, ``"SortCut (2x8)"``, ``"Transformer"``."""
    return attention.label.replace("Sinkhorn Transformer", "Sinkhorn").replace("SortCut Sinkhorn", "SortCut")


def train(model: nn.Module, data: DataBundle, config: dict[str, Any], *, seed: int,
          sequence: bool = False) -> tuple[dict[str, Any], float]:
    """Train ``model`` on ``data`` with the experiment's ``config`` (its ``TRAIN_KEYS``).

    ``sequence=True``: a ``(B, T, V)`` model scored per token (:class:`TokenLevel`). Returns the
    trainer's final metrics row (``test_loss``, ``test_acc``, ...) and the training seconds.
    """
    options = {k: config[k] for k in TRAIN_KEYS if k in config}
    task = TokenLevel(data.info.get("pad_id")) if sequence else None
    result = fit(model, data, options, seed=seed, task=task, label=type(model).__name__)
    return result.final, training_seconds(result)


def _shape(cfg: dict[str, Any]) -> dict[str, Any]:
    return {"dim": cfg["dim"], "depth": cfg["depth"], "heads": cfg["heads"], "dropout": cfg.get("dropout", 0.0)}


def train_language_model(data: DataBundle, attention: AttentionConfig, cfg: dict[str, Any], *,
                         seed: int) -> tuple[SinkhornTransformerLM, dict[str, float]]:
    """A :class:`SinkhornTransformerLM` (``cfg``: dim, depth, heads, dropout + training keys),
    trained on ``data`` (kind ``lm``); returns it and its test ``nats``, ``bits`` and
    ``perplexity`` per token, ``accuracy`` (%) and ``train_seconds``."""
    torch.manual_seed(seed)
    model = SinkhornTransformerLM(data.info["vocab_size"], max_len=data.info["max_len"], attention=attention, **_shape(cfg))
    final, seconds = train(model, data, cfg, seed=seed, sequence=True)
    nats = final["test_loss"]
    return model, {"nats": nats, "bits": nats / LN2, "perplexity": math.exp(min(nats, 50.0)),
                   "accuracy": 100 * final["test_acc"], "train_seconds": round(seconds, 1)}


def train_classifier(data: DataBundle, attention: AttentionConfig, cfg: dict[str, Any], *, seed: int) -> dict[str, float]:
    """A :class:`SinkhornClassifier` trained on ``data`` (kind ``tokens``): test ``accuracy`` (%), ``train_seconds``."""
    torch.manual_seed(seed)
    model = SinkhornClassifier(data.info["vocab_size"], data.info["n_classes"], max_len=data.info["max_len"],
                               attention=attention, pad_id=data.info["pad_id"], **_shape(cfg))
    final, seconds = train(model, data, cfg, seed=seed)
    return {"accuracy": 100 * final["test_acc"], "train_seconds": round(seconds, 1)}


def _axis_label(name: str) -> str:
    """``"accuracy (%) ↑"`` -> ``"accuracy (%), higher is better"`` (an arrow alone is easy to miss)."""
    for arrow, words in (("↓", "lower is better"), ("↑", "higher is better")):
        if name.rstrip().endswith(arrow):
            return f"{name.rstrip()[:-1].rstrip()}, {words}"
    return name


def bar_figure(labels: Sequence[str], panels: dict[str, Sequence[float]], title: str):
    """One horizontal bar chart per metric (``panels``: metric name -> one value per label).

    Bars take the shared method colours (:func:`sinkformer.plotting.method_color`: the vanilla
    Transformer blue, Sinkhorn models orange, ...) and carry their values."""
    plt = pyplot()
    width = max(5.0, 3.2 + 0.075 * max((len(label) for label in labels), default=0))
    fig, axes = plt.subplots(1, len(panels), figsize=(width * len(panels), 0.45 * len(labels) + 1.6), squeeze=False)
    colors = [method_color(label) for label in labels]
    for ax, (name, values) in zip(axes[0], panels.items()):
        finite = [math.isfinite(v) for v in values]
        bars = ax.barh(range(len(labels)), [v if ok else 0.0 for v, ok in zip(values, finite)], color=colors)
        ax.bar_label(bars, labels=[f"{v:.4g}" if ok else "n/a" for v, ok in zip(values, finite)], padding=3,
                     fontsize=8.5)
        ax.set_yticks(range(len(labels)), labels)
        ax.invert_yaxis()
        ax.margins(x=0.15)  # room for the value labels
        ax.set_xlabel(_axis_label(name))
        ax.grid(True, axis="x", alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


#: Attention kinds of the Sparse Sinkhorn family (compared with the vanilla Transformer, with verdicts);
#: local and fixed attention are the paper's other baselines.
SINKHORN_KINDS = ("sinkhorn", "sortcut", "mixture")


def paper_row(paper: dict[str, Any], attention: AttentionConfig) -> str | None:
    """The paper's row for ``attention``: its label (long or short) if the table has it, else the
    first row of the same kind (``"Sinkhorn Transformer (256)"`` for a quick ``sinkhorn:8``)."""
    for name in (attention.label, short_label(attention)):
        if name in paper:
            return name
    kinds = {attention.label.split(" (")[0], short_label(attention).split(" (")[0]}
    return next((row for row in paper if row.split(" (")[0] in kinds), None)


def versus_vanilla(per_seed: dict[str, list[float]], attentions: dict[str, AttentionConfig], paper: dict[str, float],
                   *, metric: str, higher_is_better: bool, baseline: str = "Transformer") -> list[Comparison]:
    """The paired comparison (same seeds) of every Sparse Sinkhorn model with the vanilla Transformer.

    ``per_seed``/``attentions`` are keyed by the models' labels; ``paper`` maps the paper's rows to the
    value of the metric the quick run stands for (its direction decides the verdict)."""
    comparisons = []
    for label, attention in attentions.items():
        row = paper_row(paper, attention)
        if attention.kind not in SINKHORN_KINDS or row is None or baseline not in per_seed:
            continue
        better = (paper[row] > paper[baseline]) == higher_is_better
        comparisons.append(paired(
            per_seed[baseline], per_seed[label], metric=metric, higher_is_better=higher_is_better, paper_better=better,
            paper=f"{row}: {paper[row]:g} vs {paper[baseline]:g}", baseline_name=baseline, variant_name=label,
        ))
    return comparisons


def workloads(cfg: dict[str, Any], model: str, info: dict[str, Any], inputs, *, specs: Sequence[str],
              steps: int, batch_size: int | None = None) -> list:
    """The GPU-cost workloads (:class:`sinkformer.runs.cost.Workload`) of one model per attention spec."""
    from ...runs.cost import Workload

    shape = {**_shape(cfg), "attention": None}
    return [Workload(AttentionConfig.parse(spec).label, model, info,
                     {**shape, "attention": AttentionConfig.parse(spec, sort_iters=cfg["sort_iters"],
                                                              temperature=cfg["temperature"],
                                                              stride=cfg.get("fixed_stride", 8))},
                     inputs, batch_size or cfg["batch_size"], steps, cfg["seeds"]) for spec in specs]
