r"""Figure 2 of the Sinkformers paper: column sums of a Transformer's attention during training.

SoftMax attention is row-stochastic, :math:`\sum_j K_{ij} = 1`; the paper observes that, as a
Transformer trains, the column sums :math:`\sum_i K_{ij}` of its attention matrices concentrate
near 1 too — the matrices drift towards doubly stochastic ones — which motivates Sinkformers.

Each panel trains a Transformer (SoftMax) with the trainer's attention diagnostics on
(``record_attention``: the column sums of every attention matrix on the first batch of each
epoch, i.e. after 0, 1, 2, ... epochs of training) and records the same batch once more after
the last epoch. Column sums are divided by their mean :math:`n_q / n_k` (1 for square
matrices), so that 1 is the doubly stochastic value. As a reference, the column sums the same
trained matrices would have with the entries of each row shuffled (same rows, no column
structure) show how far from 1 row-stochasticity alone leaves the columns.

The quick form trains a small ViT on the embedded digits and a Set Transformer on the embedded
3-D shapes; ``--full`` trains Figure 2's three models: the one-layer attention-only ViT on MNIST
with the authors' recipe (patch 7, batch 10, lr 2e-3, 30 epochs), the IWSLT'14 Transformer, and
PCT on ModelNet40 (``--data``: a folder holding ``MNIST/`` (the four IDX files), ``iwslt14/`` and
``modelnet40_ply_hdf5_2048/``).
"""

from __future__ import annotations

import torch

from ..._optional import require
from ...plotting import pyplot
from ...runs import Run, fit, markdown_table, register
from ...runs.cost import Workload, images, points, translation
from ...training import AttentionRecorder, TrainConfig
from ._common import build, finding, load_data, mode_line
from .modelnet import PCT_FULL_MODEL, PCT_FULL_TRAIN

__all__ = ["run", "ShuffledRowsRecorder", "spread"]

SHUFFLED = " (rows shuffled)"
#: A column "sums to about 1" when its relative sum is within this distance of 1.
NEAR = 0.2


class ShuffledRowsRecorder(AttentionRecorder):
    """An :class:`~sinkformer.training.AttentionRecorder` that also records, for each matrix, the
    column sums it would have with each row's entries randomly permuted (key ``name + SHUFFLED``)."""

    def _record(self, name, module, args, output) -> None:
        super()._record(name, module, args, output)
        weights = output[1]
        if weights is not None:
            shuffled = weights.gather(-1, torch.rand_like(weights).argsort(-1))
            super()._record(name + SHUFFLED, module, args, (None, shuffled))


def relative(column_sums: dict[str, torch.Tensor]) -> torch.Tensor:
    """All column sums, each module's divided by its mean (``n_q / n_k``: 1 = doubly stochastic)."""
    return torch.cat([s / s.mean() for s in column_sums.values()])


def spread(values: torch.Tensor) -> dict[str, float]:
    """Standard deviation of relative column sums and the share of columns within ``NEAR`` of 1."""
    return {"std": float(values.std()), "near_one": float(((values - 1).abs() <= NEAR).double().mean())}


def _train_panel(ctx: Run, index: int, panel: dict, seed: int):
    """Train one Transformer with the diagnostics on; relative column sums after 0..E epochs + baseline."""
    data = load_data(ctx, panel["dataset"], panel.get("data_options", {}), panel.get("subpath"))
    model = build(panel["model"], data, 1, seed, panel.get("model_options", {}))
    config = TrainConfig.from_dict(panel["train"])
    train_options = {**panel["train"], "record_attention": True, "checkpoint_every": config.epochs}
    folder = ctx.out_dir / "training" / f"panel{index + 1}-{panel['model']}-{panel['dataset']}"
    result = fit(model, data, train_options, seed=seed, ctx=ctx, label=panel["title"], out_dir=folder,
                 panel=panel["title"], model=panel["model"])
    load_file = require("safetensors.torch", "reading recorded attention").load_file
    sums = [relative(load_file(str(folder / "attention" / f"epoch_{e + 1:04d}.safetensors")))
            for e in range(len(result.history))]  # recorded on the first batch of epoch e + 1 = after e epochs
    inputs, _ = data.collate([data.train[i] for i in range(min(config.batch_size, len(data.train)))])
    device = next(model.parameters()).device
    model.eval()
    with torch.no_grad(), ShuffledRowsRecorder(model) as recorder:
        model(**{k: v.to(device) for k, v in inputs.items()})
    recorded = recorder.column_sums()
    sums.append(relative({k: v for k, v in recorded.items() if not k.endswith(SHUFFLED)}))
    shuffled = relative({k: v for k, v in recorded.items() if k.endswith(SHUFFLED)})
    return sums, shuffled, result.final.get("test_acc")


def _figure(panels: list[dict], outcomes: list[tuple]):
    plt = pyplot()
    fig, axes = plt.subplots(2, len(panels), figsize=(6.2 * len(panels), 7.6), squeeze=False,
                             gridspec_kw={"height_ratios": [1.5, 1]})
    cmap = plt.get_cmap("viridis")
    for col, (panel, (sums, shuffled, _)) in enumerate(zip(panels, outcomes)):
        hist_ax, std_ax = axes[0, col], axes[1, col]
        last = len(sums) - 1
        shown = sorted({round(k * last / 4) for k in range(5)})
        bins = torch.linspace(0, 3, 61).tolist()
        for e in shown:
            values = sums[e].clamp(0, 3).tolist()
            color = cmap(0.85 * e / max(last, 1))  # viridis up to 0.85: its last yellows are unreadable on white
            hist_ax.hist(values, bins=bins, density=True, histtype="step", lw=2, color=color,
                         label=f"after {e} epoch{'s' if e != 1 else ''}")
        hist_ax.hist(shuffled.clamp(0, 3).tolist(), bins=bins, density=True, histtype="step", lw=1.5, ls="--",
                     color="k", label=f"after {last}, rows shuffled")
        hist_ax.axvline(1.0, color="0.4", lw=0.8)
        hist_ax.set_xlabel("column sum / (n_q / n_k)   (1 = doubly stochastic; clipped at 3)")
        hist_ax.set_ylabel("density")
        hist_ax.set_title(panel["title"])
        hist_ax.legend(fontsize=8)
        stds = [spread(s)["std"] for s in sums]
        std_ax.plot(range(len(stds)), stds, marker="o", ms=3, lw=2, color="tab:blue", label="trained attention")
        std_ax.axhline(spread(shuffled)["std"], color="k", ls="--", lw=1.5, label="rows shuffled (after training)")
        std_ax.set_xlabel("epochs of training")
        std_ax.set_ylabel("std of relative column sums")
        std_ax.set_ylim(bottom=0)
        std_ax.grid(True, alpha=0.3)
        std_ax.legend(fontsize=8)
    fig.suptitle("Column sums of a Transformer's SoftMax attention during training")
    fig.tight_layout()
    return fig


_PANEL_SHAPES = {  # model -> (info, inputs, training examples) of the full panels' datasets
    "vit_attention_only": ({"n_classes": 10, "image_size": 28, "channels": 1}, images(1, 28), 60_000),
    "seq2seq": ({"vocab_size": 10000, "max_len": 128}, translation(10000, 28, 28), 160_000),
    "point_cloud_transformer": ({"n_classes": 40, "in_features": 3}, points(1024), 9843),
}


def _full_cost(cfg: dict) -> list:
    """One Transformer per panel (its full dataset's size and shapes)."""
    work = []
    for panel in cfg["panels"]:
        info, inputs, examples = _PANEL_SHAPES[panel["model"]]
        batch = panel["train"]["batch_size"]
        work.append(Workload(panel["title"], panel["model"], info,
                             {**panel.get("model_options", {}), "attention": "softmax", "n_iters": 1},
                             inputs, batch, panel["train"]["epochs"] * examples // batch))
    return work

@register(
    "column-sums",
    cost=_full_cost,
    description="column sums of a Transformer's attention matrices at several epochs of training",
    paper="Sinkformers, Figure 2",
    quick_minutes=0.2,
    full_minutes=120.0,
    defaults={
        "seed": 0,
        "panels": [
            {"title": "ViT on digits", "model": "vit", "dataset": "digits",
             "model_options": {"patch_size": 2, "dim": 32, "depth": 2, "num_heads": 4, "dim_feedforward": 64},
             "train": {"epochs": 10, "batch_size": 64, "lr": 2e-3}},
            {"title": "Set Transformer on shapes3d", "model": "set_transformer", "dataset": "shapes3d",
             "data_options": {"n_points": 64},
             "model_options": {"dim": 64, "num_heads": 4, "num_inducing": 8, "dropout": 0.0},
             "train": {"epochs": 8, "batch_size": 64, "lr": 3e-3}},
        ],
    },
    full={  # Figure 2's three panels; --data: a folder holding MNIST/, iwslt14/ and modelnet40_ply_hdf5_2048/
        "panels": [
            {"title": "attention-only ViT on MNIST", "model": "vit_attention_only", "dataset": "mnist",
             "subpath": "MNIST", "model_options": {"patch_size": 7, "dim": 128},
             "train": {"epochs": 30, "batch_size": 10, "lr": 2e-3}},  # the authors' Figure 2 recipe
            {"title": "Transformer on IWSLT'14", "model": "seq2seq", "dataset": "iwslt14", "subpath": "iwslt14",
             "data_options": {"vocab_size": 10000, "max_len": 128},
             "model_options": {"dim": 512, "encoder_layers": 6, "decoder_layers": 6, "num_heads": 4,
                               "dim_feedforward": 1024, "dropout": 0.3},
             "train": {"epochs": 30, "batch_size": 128, "optimizer": "adam", "betas": [0.9, 0.98], "lr": 5e-4,
                       "weight_decay": 1e-4, "schedule": "inverse_sqrt", "warmup_steps": 4000,
                       "label_smoothing": 0.1, "bleu_every": 1000}},
            {"title": "PCT on ModelNet40", "model": "point_cloud_transformer", "dataset": "modelnet40",
             "subpath": "modelnet40_ply_hdf5_2048", "data_options": {"n_points": 1024},
             "model_options": PCT_FULL_MODEL, "train": PCT_FULL_TRAIN},  # modelnet --full's PCT, 300 epochs
        ],
    },
)
def run(ctx: Run) -> None:
    panels, seed = ctx.config["panels"], ctx.config["seed"]
    outcomes = [_train_panel(ctx, i, panel, seed) for i, panel in enumerate(panels)]
    ctx.save_figure(_figure(panels, outcomes), "column_sums")

    rows, summary = [], {}
    for panel, (sums, shuffled, accuracy) in zip(panels, outcomes):
        start, end, base = spread(sums[0]), spread(sums[-1]), spread(shuffled)
        summary[panel["title"]] = {"start": start, "end": end, "rows_shuffled": base, "test_acc": accuracy,
                                   "std_by_epoch": [spread(s)["std"] for s in sums]}
        rows.append([panel["title"], len(sums) - 1, f"{100 * accuracy:.1f}", f"{start['std']:.3f}",
                     f"{end['std']:.3f}", f"{base['std']:.3f}", f"{100 * start['near_one']:.0f}",
                     f"{100 * end['near_one']:.0f}", f"{100 * base['near_one']:.0f}"])
    ctx.results["panels"] = summary
    table = markdown_table(
        ["model", "epochs", "test acc. %", "std at init", "std trained", "std rows shuffled",
         f"% within {NEAR:g} of 1 at init", "% trained", "% rows shuffled"], rows)
    tighter = [t for t, s in summary.items() if s["end"]["std"] < s["start"]["std"]]
    balanced = [t for t, s in summary.items() if s["end"]["std"] < s["rows_shuffled"]["std"]]
    majority = [t for t, s in summary.items() if s["end"]["near_one"] > 0.5]
    this_run = (
        f"Column sums concentrate towards 1 during training (std falls from initialisation) in {len(tighter)} of "
        f"{len(summary)} models{': ' + ', '.join(tighter) if tighter else ''}: at initialisation SoftMax attention "
        f"is nearly uniform, so columns start near 1 and spread as attention sharpens. After training, a majority "
        f"of columns lies within {NEAR:g} of 1 in {len(majority)} of {len(summary)} models, and the column sums are "
        f"closer to 1 than with shuffled rows in {len(balanced)} of {len(summary)}."
    )
    ctx.write_report(
        f"""# Column sums of attention matrices during training (Sinkformers, Figure 2)

{mode_line(ctx, ", ".join(p["dataset"] for p in panels), 1)}

Transformers (SoftMax attention) trained with the trainer's attention diagnostics; every attention matrix of
the first training batch is recorded after 0, 1, 2, ... epochs. Column sums are divided by n_q / n_k, so 1 is the
doubly stochastic value. *Rows shuffled*: the trained matrices with each row's entries permuted at random — the
column sums that row-stochasticity alone would give.

![column sums during training](column_sums.png)

{table}

{finding(ctx, paper="ViT on MNIST, fairseq Transformer on IWSLT'14, PCT on ModelNet40: the learning process makes "
         "the (row-stochastic) attention matrices more and more doubly stochastic; the majority of columns "
         "sums closely to 1.",
         this_run=this_run)}"""
    )
