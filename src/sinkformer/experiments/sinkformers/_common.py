"""Pieces shared by the Sinkformers-paper experiments (column-sums, modelnet, sentiment, translation,
vit, patch-size).

Every experiment compares a Transformer with its Sinkformer, everything else equal:

* :func:`variant` — ``n_iters = 1`` is the Transformer (``attention="softmax"``, PyTorch's
  fused kernel; one Sinkhorn normalisation *is* SoftMax), ``n_iters > 1`` the Sinkformer;
* :func:`build` — the model, seeded, so both variants of one seed start from identical weights;
* :func:`load_data` — the experiment's dataset: embedded by default, the real one under
  ``--full`` (path from ``--data``); each seed then trains on its own random subset of the
  training split where the configuration's ``train_fraction`` is below 1
  (:func:`sinkformer.experiments._seeds.training_subset`), the same for every model of that seed;
* :func:`seed_summary`, :func:`median_curve` — statistics over seeds (best/median/mean/worst,
  median curve with its min–max band);
* :func:`compare`, :func:`finding` — the paired comparisons over seeds (interval and verdict,
  :mod:`sinkformer.runs.verdicts`) and the "paper found / this run found" section every report ends
  with; it also stores ``results["finding"]`` and ``results["comparisons"]`` for the summary report; :func:`mode_line`, :func:`describe`,
  :func:`training_line` — how a run was made, in words.
"""

from __future__ import annotations

import datetime as _dt
import statistics
from collections.abc import Sequence
from typing import Any

import torch

from ...data import DataBundle, get_dataset, load_dataset
from ...models import build_model
from ...plotting import SINKFORMER_COLOR, TRANSFORMER_COLOR
from ...runs import Run
from ...runs.verdicts import Comparison, paired, record
from ...training import TrainConfig

__all__ = [
    "TRANSFORMER", "SINKFORMER", "COLORS", "variant", "load_data", "build", "seed_summary",
    "median_curve", "finding", "compare", "mode_line", "describe", "training_line",
]

TRANSFORMER, SINKFORMER = "Transformer", "Sinkformer"
COLORS = {TRANSFORMER: TRANSFORMER_COLOR, SINKFORMER: SINKFORMER_COLOR}  # the same in every figure


def variant(n_iters: int) -> tuple[str, int]:
    """``(attention, n_iters)`` of a model: SoftMax for ``n_iters == 1``, else Sinkhorn."""
    if n_iters < 1:
        raise ValueError(f"n_iters must be >= 1, got {n_iters}")
    return ("softmax", 1) if n_iters == 1 else ("sinkhorn", n_iters)


def load_data(ctx: Run, dataset: str, options: dict[str, Any] | None = None, subpath: str | None = None) -> DataBundle:
    """Dataset ``dataset`` with loader ``options``; a real dataset reads ``--data`` (``ctx.data``),
    or ``--data``/``subpath`` when an experiment reads two datasets from one folder.

    A real dataset without ``--data`` raises the loader's ``FileNotFoundError``, which says
    what to download and where to put it.
    """
    spec = get_dataset(dataset)
    if spec.embedded and ctx.data is not None:
        raise ValueError(
            f"--data {ctx.data} is for a real dataset, but this run uses the embedded {dataset!r}: "
            f"add --full (the paper's configuration) or --set dataset=NAME"
        )
    try:
        path = None if spec.embedded else (ctx.data / subpath if subpath and ctx.data is not None else ctx.data)
        return load_dataset(dataset, path, **(options or {}))
    except FileNotFoundError as err:
        if ctx.data is not None:
            raise
        raise FileNotFoundError(f"`sinkformer run {ctx.name}` needs --data PATH here: {err}") from None


def build(model: str, data: DataBundle, n_iters: int, seed: int, options: dict[str, Any]) -> torch.nn.Module:
    """Model ``model`` for ``data``, Transformer or Sinkformer by ``n_iters``, weights drawn from ``seed``.

    The two variants have the same parameters, so for one seed they start from identical weights.
    """
    spec, n_iters = variant(n_iters)
    torch.manual_seed(seed)
    return build_model(model, data.info, attention=spec, n_iters=n_iters, **options)


def seed_summary(values: Sequence[float]) -> dict[str, float]:
    """Best, median, mean and worst of one metric over seeds (higher is better)."""
    values = [float(v) for v in values]
    return {"best": max(values), "median": statistics.median(values), "mean": statistics.fmean(values),
            "worst": min(values), "runs": len(values)}


def median_curve(histories: Sequence[Sequence[dict[str, Any]]], key: str):
    """``(epochs, median, low, high)`` of ``key`` over several runs' histories (per epoch)."""
    epochs = [row["epoch"] for row in histories[0] if key in row]
    values = torch.tensor([[row[key] for row in history if key in row] for history in histories], dtype=torch.float64)
    return epochs, values.median(0).values.tolist(), values.min(0).values.tolist(), values.max(0).values.tolist()


def mode_line(ctx: Run, dataset: str, seeds: int) -> str:
    """One line saying how this run was made (mode, data, seeds, date)."""
    mode = "full (the paper's configuration)" if not ctx.quick else "quick"
    data = f"`{dataset}` from {ctx.data}" if ctx.data else f"embedded `{dataset}`"
    date = _dt.date.today().isoformat()
    return f"*{mode} run on {data}, {seeds} seed(s), {date}; produced by `sinkformer run {ctx.name}`.*"


def describe(options: dict[str, Any]) -> str:
    """``{"dim": 32, "depth": 2}`` -> ``"dim 32, depth 2"`` (a model's options, for reports)."""
    return ", ".join(f"{k} {v}" for k, v in options.items()) or "defaults"


def training_line(train_options: dict[str, Any]) -> str:
    """The optimisation of a run in words, e.g. ``"10 epochs, batch 32, adam lr 0.002, ×0.1 after epoch(s) 8"``."""
    c = TrainConfig.from_dict(train_options)
    line = f"{c.epochs} epochs, batch {c.batch_size}, {c.optimizer} lr {c.lr:g}"
    if c.schedule == "inverse_sqrt":
        return f"{line}, inverse square-root schedule ({c.warmup_steps} warm-up steps)"
    return f"{line}, ×{c.gamma:g} after epoch(s) {', '.join(map(str, c.milestones))}" if c.milestones else line


def finding(ctx: Run, *, paper: str, this_run: str, comparisons: Sequence[Comparison] = ()) -> str:
    """The report's closing section, paper and this run side by side, stored in ``results["finding"]``.

    With ``comparisons`` (the paired Transformer-vs-Sinkformer comparisons over seeds) it also
    gives each one's interval and verdict (:func:`sinkformer.runs.verdicts.record`); without, the
    experiment describes rather than compares (no verdict).
    """
    if comparisons:
        return record(ctx.results, comparisons, paper=paper, this_run=this_run)
    ctx.results["finding"] = {"paper": paper, "this_run": this_run}
    return (
        "## Paper vs this run\n\n"
        "| the paper found | this run found |\n|---|---|\n"
        f"| {paper} | {this_run} |\n\n"
        "*(A measurement, not a paired comparison of two models: no verdict.)*\n"
    )


def compare(per_seed: dict[str, Sequence[float]], variant: str, *, metric: str, paper: str, kind: str,
            higher_is_better: bool = True, paper_better: bool = True, baseline: str = TRANSFORMER) -> Comparison:
    """The paired comparison of ``per_seed[variant]`` with ``per_seed[baseline]`` (same seeds, in order);
    ``kind``: what it tests (:data:`sinkformer.runs.verdicts.KINDS`, e.g. from
    :func:`~sinkformer.runs.verdicts.paper_kind`)."""
    return paired(per_seed[baseline], per_seed[variant], metric=metric, higher_is_better=higher_is_better,
                  paper_better=paper_better, paper=paper, kind=kind, baseline_name=baseline, variant_name=variant)
