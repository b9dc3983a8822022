"""Pieces shared by the Sparse Sinkhorn Attention experiments (sort, charlm, pixels, sortcut, nli, ablations).

* :class:`Model`, :func:`table_models` — the paper's rows an experiment trains, each at this run's
  length with the **same number of blocks** as in the paper (one rule for every experiment: block
  ``b`` at the paper's length ``L_p`` becomes ``round(b * L / L_p)`` at length ``L``;
  :func:`scale_blocks`), labelled ``"Sinkhorn Transformer (32 → 4)"``;
* :func:`seeded` — a model with a seed's weights, every tensor it shares with the vanilla Transformer
  of that seed copied from it (:func:`~sinkformer.models.sinkhorn_transformer.share_weights`), so
  that the models of one comparison start from the same weights;
* :func:`train` — train a model with the one :func:`sinkformer.runs.fit`, on the experiment's
  training keys; sequence models (language models, sorting) with the per-token task :class:`TokenLevel`;
* :func:`train_language_model`, :func:`train_classifier` — one model of a comparison, trained
  and scored (bits / perplexity per token, or accuracy);
* :func:`versus_vanilla` — every Sparse Sinkhorn model's paired comparison (over seeds) with the
  vanilla Transformer, its verdict oriented and its kind (:func:`~sinkformer.runs.verdicts.paper_kind`)
  decided by the paper's row (:func:`paper_row`);
* :func:`bar_figure` — the report's figure (tables: :func:`sinkformer.runs.markdown_table`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from ...data.base import DataBundle
from ...models.sinkhorn_transformer import (
    AttentionConfig,
    SinkhornClassifier,
    SinkhornTransformerLM,
    share_weights,
)
from ...plotting import method_color, pyplot
from ...runs import fit, training_seconds
from ...runs.verdicts import Comparison, paired, paper_kind
from ...training import TrainConfig
from ...training.tasks import TokenLevel

__all__ = ["short_label", "TokenLevel", "Model", "scale_blocks", "table_models", "blocks_line", "seeded", "mean_length",
           "train", "train_language_model", "train_classifier", "bar_figure", "LN2", "SINKHORN_KINDS", "paper_row",
           "versus_vanilla"]

LN2 = math.log(2.0)

#: Experiment configuration keys passed on to :class:`~sinkformer.training.TrainConfig`.
TRAIN_KEYS = ("epochs", "batch_size", "lr", "warmup_steps", "grad_clip", "max_train_batches", "max_eval_batches",
              "eval_every")


def short_label(attention: AttentionConfig) -> str:
    """The classification tables' names: ``"Sinkhorn (8)"``, ``"SortCut (2x8)"``, ``"Transformer"``."""
    return attention.label.replace("Sinkhorn Transformer", "Sinkhorn").replace("SortCut Sinkhorn", "SortCut")


def _size(attention: AttentionConfig) -> str:
    return f"{attention.sortcut_budget}x{attention.block_size}" if attention.kind == "sortcut" else str(attention.block_size)


def scale_blocks(attention: AttentionConfig, scale: float) -> AttentionConfig:
    """``attention`` with the same number of blocks at a length ``scale`` times the paper's: block
    ``round(b * scale)`` (vanilla attention has no blocks; ``scale == 1``: unchanged).

    Raises ``ValueError`` when the block would hold less than one token."""
    if scale == 1 or attention.kind in ("softmax", "sinkhorn"):
        return attention
    block = round(attention.block_size * scale)
    if block < 1:
        raise ValueError(f"{attention.label}: blocks of {attention.block_size} at the paper's length scale to "
                         f"{attention.block_size * scale:.2f} tokens at this run's length (scale {scale:.3g}); "
                         "use longer sequences or a paper row with larger blocks")
    return replace(attention, block_size=block)


@dataclass(frozen=True)
class Model:
    """One row of a paper's table as this run trains it.

    Attributes:
        spec: the paper's row as a spec (``"sparse:32"``: the paper's block size).
        paper: its :class:`AttentionConfig` (the paper's blocks).
        attention: what is trained here: the same number of blocks at this run's length (:func:`scale_blocks`).
        label: ``"Sinkhorn Transformer (32 → 4)"`` (the paper's row, then the block trained), or the
            paper's label when the blocks are the paper's.
    """

    spec: str
    paper: AttentionConfig
    attention: AttentionConfig
    label: str


def table_models(specs: Sequence[str], scale: float, *, short: bool = False, **options: Any) -> list[Model]:
    """The paper's rows ``specs`` (``["softmax", "sparse:32", "sortcut:2x16"]``) trained at ``scale``
    times the paper's length; ``options``: :meth:`AttentionConfig.parse` options (``sort_iters``, ...);
    ``short``: the classification tables' names (:func:`short_label`)."""
    out = []
    for spec in specs:
        paper = AttentionConfig.parse(spec, **options)
        attention = scale_blocks(paper, scale)
        label = short_label(paper) if short else paper.label
        if attention != paper:
            label = label.replace(f"({_size(paper)})", f"({_size(paper)} → {_size(attention)})")
        out.append(Model(spec, paper, attention, label))
    return out


def blocks_line(models: Sequence[Model], length: float, paper_length: float, what: str = "length") -> str:
    """The block rule in words for a report: each row's blocks here and in the paper."""
    blocked = [m for m in models if m.attention.kind not in ("softmax", "sinkhorn")]
    if not blocked:
        return ""
    if all(m.attention == m.paper for m in blocked):
        return "Blocks: the paper's."
    rows = ", ".join(f"{m.label}: {paper_length / m.paper.block_size:.3g} blocks in the paper, "
                     f"{length / m.attention.block_size:.3g} here" for m in blocked)
    return (f"Blocks: each row of the paper's table keeps its number of blocks ({what} / block): block b at the "
            f"paper's {what} {paper_length:g} is trained here at {what} {length:.3g} as round(b × {length:.3g} / "
            f"{paper_length:g}) — {rows}.")


def mean_length(dataset) -> float:
    """Mean length of the inputs of a ``(tokens, label)`` dataset: the length that sets the number of
    blocks of variable-length classification inputs."""
    return statistics.fmean(len(dataset[i][0]) for i in range(len(dataset)))


def seeded(build: Callable[[AttentionConfig], nn.Module], attention: AttentionConfig, seed: int) -> nn.Module:
    """``build(attention)`` with ``seed``'s initial weights, except that every tensor it shares with the
    vanilla Transformer ``build(vanilla)`` of the same seed is that Transformer's
    (:func:`~sinkformer.models.sinkhorn_transformer.share_weights`): the models of one seed's comparison
    start from the same weights, whatever their attention creates besides."""
    torch.manual_seed(seed)
    model = build(attention)
    if attention.kind != "softmax":
        torch.manual_seed(seed)
        share_weights(model, build(AttentionConfig("softmax")))
    return model


def train(model: nn.Module, data: DataBundle, config: dict[str, Any], *, seed: int,
          sequence: bool = False) -> tuple[dict[str, Any], float]:
    """Train ``model`` on ``data`` with the experiment's ``config`` (its ``TRAIN_KEYS``).

    ``sequence=True``: a ``(B, T, V)`` model scored per token (:class:`TokenLevel`). Returns the
    trainer's final metrics row (``test_loss``, ``test_acc``, ...) and the training seconds. The test
    set is scored after the last epoch only, unless ``config`` sets ``eval_every`` (``--set
    eval_every=1`` to watch it every epoch): these experiments read the final row, and a test pass per
    epoch cost 6-9 % of a quick run's time (sortcut, nli; one seed, informal).
    """
    options = {k: config[k] for k in TRAIN_KEYS if k in config}
    options.setdefault("eval_every", options.get("epochs", TrainConfig.epochs))
    task = TokenLevel(data.info.get("pad_id")) if sequence else None
    result = fit(model, data, options, seed=seed, task=task, label=type(model).__name__)
    return result.final, training_seconds(result)


def _shape(cfg: dict[str, Any]) -> dict[str, Any]:
    return {"dim": cfg["dim"], "depth": cfg["depth"], "heads": cfg["heads"], "dropout": cfg.get("dropout", 0.0)}


def train_language_model(data: DataBundle, attention: AttentionConfig, cfg: dict[str, Any], *,
                         seed: int) -> tuple[SinkhornTransformerLM, dict[str, float]]:
    """A :class:`SinkhornTransformerLM` (``cfg``: dim, depth, heads, dropout + training keys), built by
    :func:`seeded` and trained on ``data`` (kind ``lm``); returns it and its test ``nats``, ``bits`` and
    ``perplexity`` per token, ``accuracy`` (%) and ``train_seconds``."""
    model = seeded(lambda a: SinkhornTransformerLM(data.info["vocab_size"], max_len=data.info["max_len"], attention=a,
                                                   **_shape(cfg)), attention, seed)
    final, seconds = train(model, data, cfg, seed=seed, sequence=True)
    nats = final["test_loss"]
    return model, {"nats": nats, "bits": nats / LN2, "perplexity": math.exp(min(nats, 50.0)),
                   "accuracy": 100 * final["test_acc"], "train_seconds": round(seconds, 1)}


def train_classifier(data: DataBundle, attention: AttentionConfig, cfg: dict[str, Any], *, seed: int) -> dict[str, float]:
    """A :class:`SinkhornClassifier` built by :func:`seeded` and trained on ``data`` (kind ``tokens``): test
    ``accuracy`` (%), ``train_seconds``."""
    model = seeded(lambda a: SinkhornClassifier(data.info["vocab_size"], data.info["n_classes"],
                                                max_len=data.info["max_len"], attention=a, pad_id=data.info["pad_id"],
                                                **_shape(cfg)), attention, seed)
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
SINKHORN_KINDS = ("sparse", "sortcut", "mixture")


def paper_row(paper: dict[str, Any], attention: AttentionConfig) -> str | None:
    """The paper's row for ``attention`` (the paper's blocks): its label (long or short), or, in a table
    with a single row of that kind and no block sizes (``"Sinkhorn Transformer"`` of Table 4), that row;
    ``None`` when the table has no such row."""
    for name in (attention.label, short_label(attention)):
        if name in paper:
            return name
    kinds = {attention.label.split(" (")[0], short_label(attention).split(" (")[0]}
    rows = [row for row in paper if row.split(" (")[0] in kinds]
    return rows[0] if len(rows) == 1 and "(" not in rows[0] else None


def versus_vanilla(per_seed: dict[str, list[float]], models: Sequence[Model], paper: dict[str, float],
                   *, metric: str, higher_is_better: bool, baseline: str = "Transformer") -> list[Comparison]:
    """The paired comparison (same seeds) of every Sparse Sinkhorn model with the vanilla Transformer.

    ``per_seed`` is keyed by the models' labels; ``paper`` maps the paper's rows to the value of the
    metric the run stands for: the row of each model (:func:`paper_row`, by the paper's block size)
    gives the direction of its verdict and its kind (:func:`~sinkformer.runs.verdicts.paper_kind`).
    Models without a row in the paper's table get no comparison."""
    comparisons = []
    for model in models:
        row = paper_row(paper, model.paper)
        if model.attention.kind not in SINKHORN_KINDS or row is None or baseline not in per_seed:
            continue
        kind, better = paper_kind(paper[row], paper[baseline], higher_is_better=higher_is_better)
        comparisons.append(paired(
            per_seed[baseline], per_seed[model.label], metric=metric, higher_is_better=higher_is_better,
            paper_better=better, paper=f"{row}: {paper[row]:g} vs {paper[baseline]:g}", kind=kind,
            baseline_name=baseline, variant_name=model.label,
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
