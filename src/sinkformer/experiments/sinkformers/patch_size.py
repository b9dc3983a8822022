r"""Figure 6 of the Sinkformers paper: accuracy of one attention layer as a function of the patch size.

A one-layer, one-head self-attention module with no feed-forward network and no non-linearity
(:class:`~sinkformer.models.AttentionOnlyViT`) classifies images cut into ``p × p`` patches,
once with SoftMax (Transformer) and once with Sinkhorn (Sinkformer). The paper (MNIST, median
over 5 runs) finds the Sinkformer better for small patches and the two equal for one 28 × 28
patch, where the attention matrix has size 1.

The quick form uses scikit-learn's 8 × 8 digits and patch sizes 1, 2, 4, 8, 6 seeds, each with its
own random 80 % of the training images; ``--full`` is Appendix C.4 on MNIST (``--data``: the folder
of the four IDX files), with the paper's learning rates (1e-3 Transformer, 2e-3 Sinkformer), 6
seeds. The quick form gives both the same learning rate.
"""

from __future__ import annotations

from ...plotting import pyplot
from ...runs import Run, fit, markdown_table, register
from ...runs.cost import Workload, images
from ...runs.verdicts import CLAIM
from .._seeds import over_seeds, subset_line
from ._common import (
    COLORS,
    SINKFORMER,
    TRANSFORMER,
    build,
    compare,
    describe,
    finding,
    load_data,
    mode_line,
    seed_summary,
    training_line,
    variant,
)

__all__ = ["run"]


def _figure(image_size: int, patch_sizes, accuracy: dict[str, dict[int, list[float]]], seeds: int):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for shift, (name, by_patch) in zip((0.97, 1.03), accuracy.items()):  # side by side, bars visible
        stats = [seed_summary(by_patch[p]) for p in patch_sizes]
        median = [100 * s["median"] for s in stats]
        low = [100 * (s["median"] - s["worst"]) for s in stats]
        high = [100 * (s["best"] - s["median"]) for s in stats]
        ax.errorbar([p * shift for p in patch_sizes], median, yerr=[low, high], marker="o", capsize=4, color=COLORS[name], label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(patch_sizes, [str(p) for p in patch_sizes])
    ax.set_xlabel(f"patch size (image {image_size} × {image_size})")
    ax.set_ylabel("final test accuracy (%)")
    ax.set_title(f"One attention layer, one head, no feed-forward\nmedian over {seeds} seed(s), bars: best/worst")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def _full_cost(cfg: dict) -> list:
    """Two models per patch size and seed on MNIST (60,000 training images)."""
    steps = cfg["train"]["epochs"] * 60_000 // cfg["train"]["batch_size"]
    return [Workload(f"{name}, patch {p}", "vit_attention_only", {"n_classes": 10, "image_size": 28, "channels": 1},
                     {**cfg["model_options"], "patch_size": p, "attention": variant(n)[0], "n_iters": variant(n)[1]},
                     images(1, 28), cfg["train"]["batch_size"], steps, cfg["seeds"])
            for p in cfg["patch_sizes"] for name, n in ((TRANSFORMER, 1), (SINKFORMER, cfg["n_iters"]))]

@register(
    "patch-size",
    cost=_full_cost,
    description="one-layer one-head attention-only ViT, Transformer vs Sinkformer accuracy vs patch size",
    paper="Sinkformers, Figure 6",
    quick_minutes=0.55,
    full_minutes=600.0,
    defaults={
        "dataset": "digits", "data_options": {}, "patch_sizes": [1, 2, 4, 8], "n_iters": 5, "seeds": 6,
        "train_fraction": 0.8,
        "model_options": {"dim": 32},
        "train": {"epochs": 12, "batch_size": 100, "milestones": [10], "eval_every": 12},
        "transformer_lr": 2e-3, "sinkformer_lr": 2e-3,
    },
    full={  # the authors' script: 5 Sinkhorn iterations
        "dataset": "mnist", "patch_sizes": [1, 2, 4, 7, 14, 28], "seeds": 6, "train_fraction": 1.0,
        "model_options": {"dim": 128},
        "train": {"epochs": 45, "batch_size": 100, "milestones": [35, 41], "eval_every": 45},
        "transformer_lr": 1e-3, "sinkformer_lr": 2e-3,
    },
)
def run(ctx: Run) -> None:
    cfg = ctx.config
    data = load_data(ctx, cfg["dataset"], cfg["data_options"])
    image_size, seeds = data.info["image_size"], range(cfg["seeds"])
    lrs = {TRANSFORMER: cfg["transformer_lr"], SINKFORMER: cfg["sinkformer_lr"]}
    accuracy: dict[str, dict[int, list[float]]] = {TRANSFORMER: {}, SINKFORMER: {}}
    seconds: dict[str, list[float]] = {TRANSFORMER: [], SINKFORMER: []}
    for patch in cfg["patch_sizes"]:
        def train(name: str, n_iters: int, subset, seed: int):
            model = build("vit_attention_only", subset, n_iters, seed, {**cfg["model_options"], "patch_size": patch})
            return fit(model, subset, {**cfg["train"], "lr": lrs[name]}, seed=seed, ctx=ctx,
                       label=f"patch {patch}, {name}", model=name, n_iters=n_iters, patch_size=patch)

        runs = over_seeds(data, seeds, cfg["train_fraction"], {TRANSFORMER: 1, SINKFORMER: cfg["n_iters"]}, train)
        for name, results in runs.items():
            accuracy[name][patch] = [result.final["test_acc"] for result in results]
            seconds[name] += [row["epoch_seconds"] for result in results for row in result.history]
    ctx.save_figure(_figure(image_size, cfg["patch_sizes"], accuracy, len(seeds)), "patch_size")

    patches = cfg["patch_sizes"]
    stats = {name: {p: seed_summary(accuracy[name][p]) for p in patches} for name in accuracy}
    ctx.results.update({
        "accuracy": accuracy, "median_accuracy": {n: {p: s["median"] for p, s in st.items()} for n, st in stats.items()},
        "epoch_seconds": {n: sum(v) / len(v) for n, v in seconds.items()},
    })
    rows = [
        [p, (image_size // p) ** 2 + 1]
        + [f"{100 * stats[n][p]['median']:.1f} ({100 * stats[n][p]['worst']:.1f}–{100 * stats[n][p]['best']:.1f})"
           for n in (TRANSFORMER, SINKFORMER)]
        + [f"{100 * (stats[SINKFORMER][p]['median'] - stats[TRANSFORMER][p]['median']):+.1f}"]
        for p in patches
    ]
    table = markdown_table(
        ["patch size", "tokens (patches + class token)", "Transformer acc. % median (worst–best)",
         f"Sinkformer ({cfg['n_iters']} it.) acc. %", "difference (points)"], rows)
    small = [p for p in patches if p < image_size]
    per_seed = {p: {n: [100 * a for a in accuracy[n][p]] for n in accuracy} for p in small}
    comparisons = [compare(per_seed[p], SINKFORMER, metric=f"test accuracy (%), patch {p}", kind=CLAIM,
                           paper="MNIST: Sinkformer better for small patches (median of 5 runs)") for p in small]
    largest = max(patches)
    this_run = (
        "Paired differences (Sinkformer − Transformer, points) by patch size: "
        + "; ".join(f"{p}: {c.interval(1)}" for p, c in zip(small, comparisons))
        + f". At patch size {largest}: {100 * stats[SINKFORMER][largest]['median']:.1f} % vs "
        f"{100 * stats[TRANSFORMER][largest]['median']:.1f} %. With one patch the model still sees 2 tokens (patch + "
        "class token), so the two models are not identical there, unlike the paper's 1 × 1 attention matrix."
    )
    lr_note = ("the same for both models" if lrs[TRANSFORMER] == lrs[SINKFORMER]
               else f"lr {lrs[SINKFORMER]:g} for the Sinkformer, as in the paper")
    ctx.write_report(
        f"""# Accuracy vs patch size (Sinkformers, Figure 6)

{mode_line(ctx, cfg["dataset"], len(seeds))}

One self-attention layer with one head, no feed-forward network, no non-linearity ({describe(cfg["model_options"])});
images of {image_size} × {image_size} cut into patches; {training_line({**cfg["train"], "lr": lrs[TRANSFORMER]})}
({lr_note}); final test accuracy, median over seeds.
{subset_line(cfg["train_fraction"], len(data.train))}

![accuracy vs patch size](patch_size.png)

{table}

Mean training time per epoch: Transformer {ctx.results["epoch_seconds"][TRANSFORMER]:.2f} s, Sinkformer
{ctx.results["epoch_seconds"][SINKFORMER]:.2f} s.

{finding(ctx, paper="On MNIST (28 × 28, median over 5 runs) the Sinkformer outperforms the Transformer when the "
         "patches are small; with one 28 × 28 patch both models are equivalent.",
         this_run=this_run, comparisons=comparisons)}"""
    )
