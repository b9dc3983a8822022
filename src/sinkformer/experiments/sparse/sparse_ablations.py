"""Table 8 and Figures 3–4 of Sparse Sinkhorn Attention: what the sorting network needs.

One causal Sinkhorn language model, varied one choice at a time around the default (linear
SortNet, :math:`\\tau = 0.75`, 5 Sinkhorn iterations, separate keys and values):

* the SortNet :math:`P(X)` — :math:`\\sigma(F_2(\\sigma(F_1 X)))`, :math:`F_2(\\sigma(F_1 X))`,
  :math:`\\sigma(F_1 X)`, :math:`F_1 X` (Table 8 rows 1–4);
* tied keys and values, :math:`K = V` (row 5); no Sinkhorn balancing, :math:`N_k = 0` (row 6);
* the Gumbel-Sinkhorn temperature :math:`\\tau \\in \\{0.25, 0.5, 0.75, 1\\}` (Figure 3);
* the number of sorting iterations (Figure 4).

The paper measured LM1B subword perplexity; the quick form uses the embedded text at character
level (bits per byte: the tokens are UTF-8 bytes; ``--set level=word`` for perplexity) and a small model.
"""

from __future__ import annotations

import statistics

from ...data.text_lm import load_text_lm
from ...models.sinkhorn_transformer import AttentionConfig
from ...plotting import SINKFORMER_COLOR, pyplot
from ...runs import Run, markdown_table, register
from ._common import train_language_model

__all__ = ["SORT_NET_ROWS", "PAPER", "variants", "run"]

#: Table 8 rows: SortNet kind -> the paper's notation.
SORT_NET_ROWS = {
    "relu_linear_relu_linear": "(1) P(X) = σ(F2(σ(F1(X))))",
    "linear_relu_linear": "(2) P(X) = F2(σ(F1(X)))",
    "relu_linear": "(3) P(X) = σ(F1(X))",
    "linear": "(4) P(X) = F1(X)",
}
#: Table 8 (LM1B perplexity, b = 32).
PAPER = {
    "(1) P(X) = σ(F2(σ(F1(X))))": 41.70,
    "(2) P(X) = F2(σ(F1(X)))": 41.38,
    "(3) P(X) = σ(F1(X))": 41.34,
    "(4) P(X) = F1(X)": 41.29,
    "(5) K = V": 42.26,
    "(6) N_k = 0 (no Sinkhorn)": 52.40,
}


def variants(cfg: dict) -> list[tuple[str, str, dict]]:
    """``(group, label, AttentionConfig options)`` of every run; identical options are trained once."""
    base = {"sort_net": "linear", "temperature": 0.75, "sort_iters": cfg["sort_iters"], "share_kv": False}
    out = [("sort_net", SORT_NET_ROWS[kind], {**base, "sort_net": kind}) for kind in SORT_NET_ROWS]
    out.append(("sort_net", "(5) K = V", {**base, "share_kv": True}))
    out.append(("sort_net", "(6) N_k = 0 (no Sinkhorn)", {**base, "sort_iters": 0}))
    out += [("temperature", f"τ = {tau:g}", {**base, "temperature": tau}) for tau in cfg["temperatures"]]
    out += [("iterations", f"N_k = {k}", {**base, "sort_iters": k}) for k in cfg["iterations"]]
    return out


def _full_cost(cfg: dict) -> list:
    """Every distinct variant, word level on LM1B (about 100M subword tokens per epoch)."""
    from ...runs.cost import Workload, tokens

    unique = {tuple(sorted(options.items())): (label, options) for _, label, options in variants(cfg)}
    steps = cfg["epochs"] * (cfg["max_chars"] // 4) // (cfg["batch_size"] * cfg["seq_len"])
    info = {"vocab_size": cfg["vocab_size"], "max_len": cfg["seq_len"]}
    shape = {"dim": cfg["dim"], "depth": cfg["depth"], "heads": cfg["heads"], "dropout": cfg["dropout"]}
    return [Workload(label, "sinkhorn_lm", info,
                     {**shape, "attention": AttentionConfig.parse(f"sparse:{cfg['block_size']}", **options)},
                     tokens(cfg["vocab_size"], cfg["seq_len"]), cfg["batch_size"], steps, cfg["seeds"])
            for label, options in unique.values()]


@register(
    "sparse-ablations",
    cost=_full_cost,
    description="SortNet variants, K = V, no Sinkhorn, Gumbel temperature and sorting iterations",
    paper="Sparse Sinkhorn Attention, Table 8 and Figures 3-4",
    quick_minutes=0.22,
    full_minutes=40000.0,
    defaults={
        "level": "char", "seq_len": 64, "max_chars": 150_000, "vocab_size": 2000, "block_size": 8,
        "sort_iters": 5, "temperatures": [0.25, 0.5, 0.75, 1.0], "iterations": [0, 2, 5, 10, 20],
        "dim": 32, "depth": 1, "heads": 2, "dropout": 0.0,
        "epochs": 1, "batch_size": 16, "lr": 2e-3, "grad_clip": 1.0, "max_eval_batches": 20, "seed": 0,
        "seeds": 1,  # variants of the Sinkhorn model compared with each other: no Transformer, no verdict
    },
    full={
        "level": "word", "seq_len": 256, "max_chars": 400_000_000, "vocab_size": 32000, "block_size": 32,
        "dim": 512, "depth": 6, "heads": 8, "dropout": 0.1, "epochs": 3, "batch_size": 32, "lr": 5e-4,
        "max_eval_batches": 0,
    },
)
def run(ctx: Run) -> None:
    cfg = ctx.config
    data = load_text_lm(ctx.data, level=cfg["level"], seq_len=cfg["seq_len"], vocab_size=cfg["vocab_size"],
                        max_chars=cfg["max_chars"])
    metric, unit = ("bits", "bits per byte") if cfg["level"] == "char" else ("perplexity", "perplexity")
    trained: dict[tuple, float] = {}
    rows: list[tuple[str, str, dict, float]] = []
    for group, label, options in variants(cfg):
        key = tuple(sorted(options.items()))
        if key not in trained:
            scores = []
            for seed in range(cfg["seed"], cfg["seed"] + cfg["seeds"]):
                attention = AttentionConfig.parse(f"sparse:{cfg['block_size']}", **options)
                _, score = train_language_model(data, attention, cfg, seed=seed)
                ctx.log(variant=label, group=group, seed=seed, **options, **score)
                scores.append(score[metric])
            trained[key] = statistics.mean(scores)
        rows.append((group, label, options, trained[key]))
    ctx.results["ablations"] = {f"{g}: {label}": value for g, label, _, value in rows}

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.0))
    for ax, group, key, xlabel, title in (
            (axes[0], "temperature", "temperature", "Gumbel-Sinkhorn temperature τ", "Figure 3: temperature"),
            (axes[1], "iterations", "sort_iters", "sorting iterations N_k", "Figure 4: sorting iterations")):
        pts = sorted((o[key], v) for g, _, o, v in rows if g == group)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=SINKFORMER_COLOR)
        ax.set_xticks([p[0] for p in pts])  # the values trained, not fractional iterations
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"test {unit} (lower is better)")
        ax.grid(True, alpha=0.3)
        if pts:  # the y axes are zoomed to the data: say how wide they are
            title += f"\n(max − min = {max(p[1] for p in pts) - min(p[1] for p in pts):.3g})"
        ax.set_title(title, fontsize=11)
    base_tau = next((o["temperature"] for g, _, o, _ in rows if g == "iterations"), float("nan"))
    fig.suptitle(f"Sparse Sinkhorn ablations, {cfg['level']}-level language model "
                 f"(left: N_k = {cfg['sort_iters']}; right: τ = {base_tau:g})", fontsize=11)
    fig.tight_layout()
    ctx.save_figure(fig, "sparse_ablations")

    table8 = [[label, value, PAPER.get(label)] for g, label, _, value in rows if g == "sort_net"]
    sweep = lambda group: [[label, value] for g, label, _, value in rows if g == group]  # noqa: E731
    best_tau = min(sweep("temperature"), key=lambda r: r[1])[0]
    best_iters = min(sweep("iterations"), key=lambda r: r[1])[0]
    ctx.write_report(f"""# Ablations of the sorting network (Sparse Sinkhorn Attention, Table 8, Figures 3–4)

Data: {f'`{ctx.data}`' if ctx.data else 'the Python standard library sources (embedded)'}, {cfg['level']} level, windows of
{cfg['seq_len']}; causal Sinkhorn LM with blocks of {cfg['block_size']}, width {cfg['dim']}, {cfg['depth']} layer(s),
{cfg['heads']} heads; {cfg['epochs']} epoch(s), batch {cfg['batch_size']}, lr {cfg['lr']}; {cfg["seeds"]} seed(s).
Default around which one choice varies: linear SortNet, τ = 0.75, N_k = {cfg['sort_iters']}, separate K and V.

## Table 8 — measured ({unit}, lower is better) next to the paper (LM1B perplexity, b = 32)

{markdown_table(["variant", f"measured {unit} ↓", "paper perplexity ↓"], table8)}

## Figures 3 and 4

![ablations](sparse_ablations.png)

{markdown_table(["temperature", f"{unit} ↓"], sweep("temperature"))}

{markdown_table(["iterations", f"{unit} ↓"], sweep("iterations"))}

Best here: {best_tau}; {best_iters}. The paper found τ = 0.75 best (softer sorting better than
hard), 5–10 iterations best with N_k = 0 much worse and > 20 slightly worse, and the linear
SortNet best with K = V hurting. At the quick size the differences between variants are of the
order of the run-to-run noise (use ``--seeds``), so only large effects are meaningful.
""")
