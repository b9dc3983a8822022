r"""Figure 4 and §6.2 of the Sinkformers paper: sentiment analysis, Transformer vs Sinkformer.

A text classifier (token embedding, sinusoidal positions, Transformer encoder, max-pooling) is
trained from scratch as a Transformer and as a Sinkformer (3 Sinkhorn iterations, with which the
paper reports Sinkhorn converges to doubly stochastic matrices), from the same initial weights.
The paper (IMDb) shows learning curves with a gain in accuracy for the Sinkformer and a training
time per epoch of 4 min 02 s vs 4 min 22 s.

The quick form uses the embedded generated reviews (labels hinge on negation, intensifiers and
"but"), 6 seeds, each with its own random 80 % of the training reviews; ``--full`` is Appendix C.2
on IMDb (``--data``: the ``aclImdb/`` folder), 6 seeds.
"""

from __future__ import annotations

from ...plotting import pyplot
from ...runs import Run, fit, markdown_table, register
from ...runs.cost import Workload, tokens
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
    median_curve,
    mode_line,
    seed_summary,
    training_line,
    variant,
)

__all__ = ["run"]


def _figure(histories: dict[str, list[list[dict]]], seconds: dict[str, float], dataset: str):
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4), gridspec_kw={"width_ratios": [1, 1, 0.6]})
    for name, runs in histories.items():
        for ax, key, scale in ((axes[0], "train_loss", 1.0), (axes[1], "test_acc", 100.0)):
            epochs, median, low, high = median_curve(runs, key)
            ax.plot(epochs, [scale * v for v in median], color=COLORS[name], lw=2, marker="o", ms=3, label=name)
            if len(runs) > 1:
                ax.fill_between(epochs, [scale * v for v in low], [scale * v for v in high], color=COLORS[name],
                                alpha=0.15)
    axes[0].set_ylabel("training loss")
    axes[1].set_ylabel("test accuracy (%)")
    for ax in axes[:2]:
        ax.set_xlabel("epoch")
        ax.grid(True, alpha=0.3)
        ax.legend()
    names = list(seconds)
    bars = axes[2].bar(names, [seconds[n] for n in names], color=[COLORS[n] for n in names])
    axes[2].bar_label(bars, fmt="%.2f s")
    axes[2].set_ylabel("training time per epoch (s)")
    axes[2].margins(y=0.15)
    seeds = len(histories[TRANSFORMER])
    fig.suptitle(f"Sentiment analysis (dataset: {dataset}), Transformer vs Sinkformer: median over {seeds} seed(s), "
                 "bands: min–max")
    fig.tight_layout()
    return fig


def _full_cost(cfg: dict) -> list:
    """Two models per seed on IMDb (25,000 training reviews)."""
    length, vocab = cfg["data_options"].get("max_len", 512), cfg["data_options"].get("vocab_size", 16000)
    steps = cfg["train"]["epochs"] * 25_000 // cfg["train"]["batch_size"]
    return [Workload(name, "text_classifier", {"vocab_size": vocab, "n_classes": 2, "max_len": length},
                     {**cfg["model_options"], "attention": variant(n)[0], "n_iters": variant(n)[1]},
                     tokens(vocab, length), cfg["train"]["batch_size"], steps, cfg["seeds"])
            for name, n in ((TRANSFORMER, 1), (SINKFORMER, cfg["n_iters"]))]

@register(
    "sentiment",
    cost=_full_cost,
    description="text classifier Transformer vs Sinkformer: learning curves and training time per epoch",
    paper="Sinkformers, Figure 4 and §6.2",
    quick_minutes=1.1,
    full_minutes=300.0,
    defaults={
        "dataset": "sentiment", "data_options": {}, "n_iters": 3, "seeds": 6, "train_fraction": 0.8,
        "model_options": {"dim": 32, "depth": 2, "num_heads": 4, "dim_feedforward": 64, "dropout": 0.0},
        "train": {"epochs": 10, "batch_size": 32, "lr": 2e-3, "milestones": [8]},
    },
    full={
        "dataset": "imdb", "data_options": {"vocab_size": 16000, "max_len": 512}, "train_fraction": 1.0,
        "model_options": {"dim": 256, "depth": 6, "num_heads": 8, "dim_feedforward": 1024, "dropout": 0.1},
        "train": {"epochs": 15, "batch_size": 32, "lr": 1e-4, "milestones": [12]},
    },
)
def run(ctx: Run) -> None:
    cfg = ctx.config
    data = load_data(ctx, cfg["dataset"], cfg["data_options"])

    def train(name: str, n_iters: int, subset, seed: int) -> list[dict]:
        model = build("text_classifier", subset, n_iters, seed, cfg["model_options"])
        return fit(model, subset, cfg["train"], seed=seed, ctx=ctx, label=name, model=name, n_iters=n_iters).history

    histories = over_seeds(data, range(cfg["seeds"]), cfg["train_fraction"],
                           {TRANSFORMER: 1, SINKFORMER: cfg["n_iters"]}, train)

    final = {n: seed_summary([h[-1]["test_acc"] for h in runs]) for n, runs in histories.items()}
    peak = {n: seed_summary([max(r["test_acc"] for r in h) for h in runs]) for n, runs in histories.items()}
    seconds = {n: sum(r["epoch_seconds"] for h in runs for r in h) / sum(len(h) for h in runs)
               for n, runs in histories.items()}
    ctx.save_figure(_figure(histories, seconds, cfg["dataset"]), "sentiment_curves")
    ctx.results.update({"final_test_acc": final, "best_epoch_test_acc": peak, "epoch_seconds": seconds})
    rows = [[f"{n} ({it} it.)" if n == SINKFORMER else n, f"{100 * final[n]['median']:.1f}",
             f"{100 * peak[n]['median']:.1f}", f"{seconds[n]:.2f}"]
            for n, it in ((TRANSFORMER, 1), (SINKFORMER, cfg["n_iters"]))]
    table = markdown_table(["model", "final test acc. % (median)", "best epoch's test acc. %", "s / epoch"], rows)
    per_seed = {n: [100 * h[-1]["test_acc"] for h in runs] for n, runs in histories.items()}
    paper = "IMDb: gain for the Sinkformer (learning curve ends higher)"
    comparison = compare(per_seed, SINKFORMER, metric="final test accuracy (%)", paper=paper, kind=CLAIM)
    overhead = 100 * (seconds[SINKFORMER] / seconds[TRANSFORMER] - 1)
    this_run = (
        f"Final test accuracy {100 * final[TRANSFORMER]['median']:.1f} % (Transformer) vs "
        f"{100 * final[SINKFORMER]['median']:.1f} % (Sinkformer), medians over {cfg['seeds']} seeds; paired "
        f"difference {comparison.interval(1)} points; training time per epoch "
        f"{seconds[TRANSFORMER]:.2f} s vs {seconds[SINKFORMER]:.2f} s ({overhead:+.0f} %)."
    )
    ctx.write_report(
        f"""# Sentiment analysis (Sinkformers, Figure 4 and §6.2)

{mode_line(ctx, cfg["dataset"], cfg["seeds"])}

Text classifier (encoder with max-pooling; {describe(cfg["model_options"])}), trained from the same initial weights,
{training_line(cfg["train"])}; the Sinkformer runs {cfg["n_iters"]} Sinkhorn iterations.
{subset_line(cfg["train_fraction"], len(data.train))}

![learning curves and time per epoch](sentiment_curves.png)

{table}

{finding(ctx, paper="IMDb: the Sinkformer's learning curve ends higher (a gain in test accuracy); training time per "
         "epoch 4 min 02 s (Transformer) vs 4 min 22 s (Sinkformer), +8 %.",
         this_run=this_run, comparisons=[comparison])}"""
    )
