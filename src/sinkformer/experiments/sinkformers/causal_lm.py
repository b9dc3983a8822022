r"""Causal language modelling: Transformer vs causal Sinkformer (issue 16), in bits per character.

Decoder-only character (byte) language models that differ only by the normalisation of their
causal self-attention (:class:`sinkformer.nn.MultiheadAttention` with ``is_causal=True``):

* ``n_iters = 1`` — causal SoftMax, the Transformer;
* ``n_iters = 3, 5`` — the causal Sinkformer: row :math:`t` of the attention matrix is row
  :math:`t` of Sinkhorn's algorithm run on the prefix :math:`0..t` alone, with the column
  marginals of uniform causal attention (:mod:`sinkformer.sinkhorn.prefix`), so nothing after
  :math:`t` reaches it.

For each seed every model starts from the same weights and sees the same batches; the paired
per-seed differences of held-out bits per character give a 95 % interval and a verdict
(:mod:`sinkformer.runs.verdicts`). The report also gives the training time per epoch and three
statistics of the trained models' attention matrices on held-out windows
(:func:`attention_statistics`): the mean row entropy, how far the column sums are from those of
uniform causal attention, and the mean diagonal mass — which shows whether the matrices collapse
towards the identity, the only doubly stochastic lower-triangular matrix.

Data: the quick form uses the Python standard library's sources (embedded,
:mod:`sinkformer.data.text_lm`; the last 10 % held out) with windows of 64 bytes; ``--full``
reads WikiText-103 (raw) from ``--data`` (:func:`load_wikitext103`), windows of 512 bytes.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import torch
from torch import Tensor

from ...data.base import DataBundle
from ...data.text_lm import BYTE_VOCAB, read_text_corpus
from ...data.wikitext import WIKITEXT103_TRAIN_BYTES, byte_windows, load_wikitext103
from ...models.causal_lm import build_lm
from ...plotting import SINKFORMER_COLOR, TRANSFORMER_COLOR, pyplot
from ...runs import Run, fit, markdown_table, register
from ...runs.verdicts import EXTENSION, paired
from .._seeds import over_seeds, subset_line
from ._common import finding, mode_line, training_line

__all__ = ["label", "uniform_causal", "attention_statistics", "run"]

LN2 = math.log(2.0)
TRANSFORMER = "Transformer"
def label(n_iters: int) -> str:
    """A model's name: ``"Transformer"`` (1 normalisation = causal SoftMax) or ``"Sinkformer (3 it.)"``."""
    return TRANSFORMER if n_iters == 1 else f"Sinkformer ({n_iters} it.)"


# --------------------------------------------------------------------------------------------
# Statistics of causal attention matrices


def uniform_causal(n: int, dtype: torch.dtype = torch.float64) -> Tensor:
    r"""Uniform causal attention ``(n, n)``: :math:`U_{ij} = 1/(i+1)` for :math:`j \le i`, else 0."""
    rows = torch.arange(1, n + 1, dtype=dtype).unsqueeze(-1)
    return torch.ones(n, n, dtype=dtype).tril() / rows


def attention_statistics(weights: Tensor) -> dict[str, float]:
    r"""Statistics of causal attention matrices ``weights (..., n, n)`` (rows sum to 1, zero above the diagonal).

    * ``entropy``: the mean over matrices and rows of :math:`-\sum_j P_{ij}\log P_{ij}` (nats,
      :math:`0\log 0 = 0`); uniform causal attention has :math:`\frac1n\sum_i \log(i+1)`, the identity 0;
    * ``column_distance``: the mean over matrices of :math:`\frac1{2n}\sum_j |c_j - u_j|`, with
      :math:`c_j = \sum_i P_{ij}` the column sums and :math:`u_j = \sum_{i=j}^{n-1} 1/(i+1)` those of
      uniform causal attention (both sum to :math:`n`): the fraction of the attention mass that sits
      in other columns than under uniform causal attention — 0 for the same column sums, at most 1;
    * ``diagonal``: the mean over matrices and rows of :math:`P_{ii}`, the mass a token gives itself
      (uniform causal attention: :math:`H_n/n`; the identity: 1).
    """
    if weights.dim() < 2 or weights.shape[-1] != weights.shape[-2]:
        raise ValueError(f"weights must be square matrices (..., n, n), got shape {tuple(weights.shape)}")
    p = weights.detach().to(torch.float64)
    entropy = -(p * p.clamp_min(torch.finfo(p.dtype).tiny).log()).sum(-1)
    n = p.shape[-1]
    uniform_columns = uniform_causal(n).to(p.device).sum(-2)
    distance = (p.sum(-2) - uniform_columns).abs().sum(-1) / (2 * n)
    return {"entropy": entropy.mean().item(), "column_distance": distance.mean().item(),
            "diagonal": p.diagonal(dim1=-2, dim2=-1).mean().item()}


def _references(n: int) -> dict[str, dict[str, float]]:
    """The statistics of uniform causal attention and of the identity (the degenerate limit) at length ``n``."""
    return {"uniform causal attention": attention_statistics(uniform_causal(n)),
            "identity (the degenerate limit)": attention_statistics(torch.eye(n, dtype=torch.float64))}


# --------------------------------------------------------------------------------------------
# Data


def _load(ctx: Run) -> tuple[DataBundle, float, str]:
    """The run's data, the held-out bytes per character and the data's name in words."""
    cfg = ctx.config
    if cfg["dataset"] == "wikitext-103":
        try:
            data, ratio = load_wikitext103(ctx.data, seq_len=cfg["seq_len"], max_chars=cfg["max_chars"],
                                           eval_split=cfg["eval_split"])
        except FileNotFoundError as err:
            if ctx.data is not None:
                raise
            raise FileNotFoundError(f"`sinkformer run {ctx.name}` needs --data PATH here: {err}") from None
        return data, ratio, f"WikiText-103 (raw) from {ctx.data}, held out: wiki.{cfg['eval_split']}.raw"
    if cfg["dataset"] != "stdlib":
        raise ValueError(f"dataset must be 'stdlib' (embedded) or 'wikitext-103', got {cfg['dataset']!r}")
    if ctx.data is not None:
        raise ValueError(f"--data {ctx.data} is for WikiText-103, but this run uses the embedded text: add --full "
                         "(or --set dataset=wikitext-103)")
    train_text, test_text = read_text_corpus(None, max_chars=cfg["max_chars"])
    data, ratio = byte_windows(train_text, test_text, cfg["seq_len"])
    return data, ratio, "the Python standard library's sources (embedded), the last 10 % held out"


# --------------------------------------------------------------------------------------------
# The experiment


def _check_iterations(n_iters: list) -> list[int]:
    if not (isinstance(n_iters, list) and n_iters and all(isinstance(n, int) and n >= 1 for n in n_iters)):
        raise ValueError(f"n_iters must be a list of positive integers, got {n_iters!r}")
    if n_iters[0] != 1 or len(set(n_iters)) != len(n_iters):
        raise ValueError(f"n_iters must start with 1 (the Transformer, the baseline) and not repeat, got {n_iters}")
    return n_iters


def _figure(bpc: dict[str, list[float]], stats: dict[str, list[dict]], uniform: dict[str, float], colors):
    """Bits per character per seed (a grey line per seed across models), and per layer the attention's
    mean row entropy and diagonal mass next to uniform causal attention's (dashed)."""
    plt = pyplot()
    names = list(bpc)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    ax = axes[0]
    for seed_values in zip(*bpc.values()):
        ax.plot(range(len(names)), seed_values, color="0.6", lw=0.8, zorder=1)
    for i, name in enumerate(names):
        ax.scatter([i] * len(bpc[name]), bpc[name], color=colors[name], s=22, zorder=2)
        ax.plot([i - 0.2, i + 0.2], [statistics.fmean(bpc[name])] * 2, color=colors[name], lw=2.5, zorder=3)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("held-out bits per character, lower is better")
    ax.set_title("bits per character: seeds (grey lines) and mean")
    layers = len(stats[names[0]])
    width = 0.8 / len(names)
    for ax, key, title in ((axes[1], "entropy", "mean row entropy (nats; identity: 0)"),
                           (axes[2], "diagonal", "mean diagonal mass (identity: 1)")):
        for i, name in enumerate(names):
            ax.bar([layer + (i - (len(names) - 1) / 2) * width for layer in range(layers)],
                   [s[key] for s in stats[name]], width, color=colors[name], label=name)
        ax.axhline(uniform[key], color="k", ls="--", lw=1, label="uniform causal attention")
        ax.set_xticks(range(layers), [f"layer {layer + 1}" for layer in range(layers)])
        ax.set_title(title)
    for ax in axes:
        ax.grid(True, axis="y", alpha=0.3)
    handles, labels = axes[1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), frameon=False)
    fig.suptitle("Causal language modelling: Transformer vs causal Sinkformer")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig


def _training(train: dict[str, Any]) -> str:
    """:func:`training_line` with the warm-up steps, if any."""
    warmup = train.get("warmup_steps", 0)
    return training_line(train) + (f", {warmup} warm-up steps" if warmup else "")


def _colors(names: list[str]) -> dict[str, str]:
    sinkformer_shades = [SINKFORMER_COLOR, "tab:red", "tab:brown", "tab:purple", "tab:olive"]
    out, k = {}, 0
    for name in names:
        if name == TRANSFORMER:
            out[name] = TRANSFORMER_COLOR
        else:
            out[name] = sinkformer_shades[k % len(sinkformer_shades)]
            k += 1
    return out


def _mean_stats(per_seed: list[list[dict[str, float]]]) -> list[dict[str, float]]:
    """Per layer, each statistic averaged over seeds."""
    return [{key: statistics.fmean(seed[layer][key] for seed in per_seed) for key in per_seed[0][layer]}
            for layer in range(len(per_seed[0]))]


def _full_cost(cfg: dict) -> list:
    """Every model of a seed on WikiText-103: ``epochs`` passes over ``max_chars`` (0: all) training bytes."""
    from ...runs.cost import Workload, tokens

    chars = min(cfg["max_chars"] or WIKITEXT103_TRAIN_BYTES, WIKITEXT103_TRAIN_BYTES)
    steps = cfg["train"]["epochs"] * (chars // cfg["seq_len"]) // cfg["train"]["batch_size"]
    return [Workload(label(n), build_lm, {"vocab_size": BYTE_VOCAB, "max_len": cfg["seq_len"]},
                     {**cfg["model_options"], "n_iters": n}, tokens(BYTE_VOCAB, cfg["seq_len"]),
                     cfg["train"]["batch_size"], steps, cfg["seeds"]) for n in cfg["n_iters"]]


PAPER = ("No causal language model in the Sinkformers paper; its §6 finds Sinkformers match or improve on "
         "Transformers, read here as: lower held-out bits per character.")


@register(
    "causal-lm",
    cost=_full_cost,
    description="character LM, Transformer vs causal Sinkformer (3, 5 it.): bits per character, attention entropy",
    paper="Sinkformers (causal extension, issue 16)",
    quick_minutes=0.75,
    full_minutes=1000.0,
    defaults={
        "dataset": "stdlib", "max_chars": 200_000, "seq_len": 64, "eval_split": "test",
        "n_iters": [1, 3, 5], "seeds": 6, "train_fraction": 0.8, "stats_windows": 16,
        "model_options": {"dim": 32, "depth": 2, "heads": 2, "ff_mult": 4, "dropout": 0.0},
        "train": {"epochs": 1, "batch_size": 16, "lr": 4e-3, "warmup_steps": 20, "grad_clip": 1.0,
                  "max_eval_batches": 0},
    },
    full={  # WikiText-103 raw, one pass over its ~540M training bytes in windows of 512 (about 33k steps)
        "dataset": "wikitext-103", "max_chars": 0, "seq_len": 512, "train_fraction": 1.0,
        "model_options": {"dim": 512, "depth": 6, "heads": 8, "ff_mult": 4, "dropout": 0.1},
        "train": {"epochs": 1, "batch_size": 32, "lr": 5e-4, "warmup_steps": 2000, "grad_clip": 1.0,
                  "max_eval_batches": 0},
    },
)
def run(ctx: Run) -> None:
    cfg = ctx.config
    n_iters = _check_iterations(cfg["n_iters"])
    data, bytes_per_char, source = _load(ctx)
    names = [label(n) for n in n_iters]
    probe = torch.stack([data.test[i][:-1] for i in range(min(cfg["stats_windows"], len(data.test)))])

    def train(name: str, n: int, subset, seed: int) -> dict:
        torch.manual_seed(seed)
        model = build_lm(data.info, **cfg["model_options"], n_iters=n)
        result = fit(model, subset, cfg["train"], seed=seed, ctx=ctx, label=name, model=name, n_iters=n)
        weights = model.attention_weights(probe.to(next(model.parameters()).device))
        return {"bpc": result.final["test_loss"] / LN2 * bytes_per_char, "accuracy": 100 * result.final["test_acc"],
                "seconds": [row["epoch_seconds"] for row in result.history],
                "stats": [attention_statistics(w) for w in weights],
                "parameters": sum(p.numel() for p in model.parameters())}

    runs = over_seeds(data, range(cfg["seeds"]), cfg["train_fraction"], dict(zip(names, n_iters)), train)
    bpc = {name: [r["bpc"] for r in runs[name]] for name in names}
    accuracy = {name: [r["accuracy"] for r in runs[name]] for name in names}
    seconds = {name: [s for r in runs[name] for s in r["seconds"]] for name in names}
    stats = {name: [r["stats"] for r in runs[name]] for name in names}
    n_params = runs[names[-1]][-1]["parameters"]

    mean_stats = {name: _mean_stats(stats[name]) for name in names}
    references = _references(cfg["seq_len"])
    epoch_seconds = {name: statistics.fmean(seconds[name]) for name in names}
    comparisons = [paired(bpc[TRANSFORMER], bpc[name], metric="held-out bits per character", higher_is_better=False,
                          paper_better=True, paper="not in the paper (§6: Sinkformer ≥ Transformer)", kind=EXTENSION,
                          baseline_name=TRANSFORMER, variant_name=name) for name in names[1:]]
    ctx.results.update({
        "bits_per_character": bpc, "mean_bits_per_character": {n: statistics.fmean(v) for n, v in bpc.items()},
        "accuracy": accuracy, "epoch_seconds": epoch_seconds, "attention": mean_stats, "references": references,
        "bytes_per_character": bytes_per_char, "parameters": n_params,
    })
    ctx.save_figure(_figure(bpc, mean_stats, references["uniform causal attention"], _colors(names)),
                    "causal_lm")

    rows = [[name, f"{statistics.fmean(bpc[name]):.3f}", " ".join(f"{v:.3f}" for v in bpc[name]),
             f"{statistics.fmean(accuracy[name]):.1f}", f"{epoch_seconds[name]:.2f}",
             f"{epoch_seconds[name] / epoch_seconds[TRANSFORMER]:.2f}×"] for name in names]
    table = markdown_table(["model", "bits per character ↓ (mean)", "per seed", "next-byte accuracy %",
                            "s / epoch", "× Transformer"], rows)
    stat_rows = [[name, layer + 1, f"{s['entropy']:.3f}", f"{s['column_distance']:.3f}", f"{s['diagonal']:.3f}"]
                 for name in names for layer, s in enumerate(mean_stats[name])]
    stat_rows += [[ref, "—", f"{s['entropy']:.3f}", f"{s['column_distance']:.3f}", f"{s['diagonal']:.3f}"]
                  for ref, s in references.items()]
    stat_table = markdown_table(["attention", "layer", "mean row entropy (nats)",
                                 "column sums: distance to uniform causal's", "mean diagonal mass"], stat_rows)
    this_run = "; ".join(f"{c.variant} − Transformer: {c.interval(3)} bpc" for c in comparisons) + (
        "; time per epoch " + ", ".join(f"{name} {epoch_seconds[name]:.2f} s" for name in names) + ".")
    ctx.write_report(f"""# Causal language modelling: Transformer vs causal Sinkformer

{mode_line(ctx, cfg["dataset"], cfg["seeds"])}

Data: {source}; bytes as tokens, windows of {cfg["seq_len"]}, {len(data.train)} training and {len(data.test)} held-out
windows ({bytes_per_char:.3f} bytes per character on the held-out text; bits per character = bits per byte × that).
Decoder-only models ({n_params / 1e3:.0f}k parameters: dim {cfg["model_options"]["dim"]}, {cfg["model_options"]["depth"]}
layers, {cfg["model_options"]["heads"]} heads, pre-LayerNorm, sinusoidal positions, tied output), {_training(cfg["train"])};
for each seed every model starts from the same weights and sees the same batches.
{subset_line(cfg["train_fraction"], len(data.train))} The Transformer's causal
self-attention is SoftMax; the causal Sinkformer's is Sinkhorn with {", ".join(str(n) for n in n_iters[1:])} normalisations on
every prefix 0..t (row t of the prefix's balanced matrix; nothing after t reaches it), with the column marginals of
uniform causal attention (`sinkformer.attention(..., is_causal=True, n_iters=N)`).

## Held-out bits per character and training time

{table}

![bits per character per seed and attention statistics](causal_lm.png)

## The attention matrices

Trained models on the first {len(probe)} held-out windows; means over heads, windows and seeds. The column sums
`c_j = Σ_i P_ij` are compared with those of uniform causal attention, `u_j = Σ_(i≥j) 1/(i+1)`, by
`Σ_j |c_j − u_j| / 2n`: the fraction of the attention mass that sits in other columns (0: the same column sums).
The identity is the only lower-triangular matrix with unit row and column sums — where uniform column marginals
would drive causal Sinkhorn; the diagonal mass and the entropy show how far the trained matrices are from it.

{stat_table}

{finding(ctx, paper=PAPER, this_run=this_run, comparisons=comparisons)}""")
