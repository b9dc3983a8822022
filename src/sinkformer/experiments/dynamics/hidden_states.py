r"""Trained models as particle systems: hidden states layer by layer, SoftMax vs Sinkhorn attention.

A Transformer's hidden states :math:`h^{(0)},\dots,h^{(L)}` are a trajectory of the tokens — layer
:math:`\ell` is time :math:`\ell` (``sinkformer.dynamics.clustering.hidden_trajectory``) — and the clustering
diagnostics of the particle systems apply to them unchanged: the histogram of pairwise cosine
similarities per layer (the picture of Geshkovski et al.'s ``albert.ipynb``), the mean cosine, the
number of clusters and the span dimension (``docs/theory.md`` §16.4).

Two comparisons of the same architecture with SoftMax and with Sinkhorn attention:

* **Hugging Face, same weights.** A BERT encoder built from its config (``output_hidden_states=True``) runs
  once with its own SoftMax attention and once with the weights unchanged and Sinkhorn attention
  (:func:`sinkformer.integrations.huggingface.register`, as in §6.3 of the Sinkformers paper). With
  ``hf_checkpoint`` any local checkpoint replaces the config.
* **Trained side by side.** The Sinkformers paper's text classifier trained on the embedded sentiment
  data as a Transformer and as a Sinkformer from the same initial weights; the hidden states of the
  test sentences are read by forward hooks on the encoder's layers (padding left out).
"""

from __future__ import annotations

import torch

from ...dynamics.clustering import cosines, diagnostics, hidden_trajectory
from ...plotting import SINKFORMER_COLOR, TRANSFORMER_COLOR, pyplot
from ...runs import Run, fit, register
from .._seeds import training_subset
from ..sinkformers._common import SINKFORMER, TRANSFORMER, build, load_data

__all__ = ["layer_statistics", "hugging_face_trajectories", "trained_trajectories", "figure", "run"]

COLORS = {TRANSFORMER: TRANSFORMER_COLOR, SINKFORMER: SINKFORMER_COLOR}


def layer_statistics(trajectory: torch.Tensor, mask: torch.Tensor, bins: int, radius: float) -> dict:
    """Per-layer diagnostics of ``trajectory (L + 1, batch, n, d)`` over the real tokens ``mask (batch, n)``."""
    layers = trajectory.shape[0]
    m = mask.expand((layers,) + tuple(mask.shape))
    out = diagnostics(trajectory.double(), radius=radius, bins=bins, mask=m,
                      which=("n_clusters", "span_dimension", "histogram"))
    pairs = (m.unsqueeze(-1) & m.unsqueeze(-2)) & ~torch.eye(m.shape[-1], dtype=torch.bool)
    c = cosines(trajectory.double())
    mean_cos = (c * pairs).sum((-1, -2)) / pairs.sum((-1, -2)).clamp_min(1)  # (L + 1, batch)
    counts = pairs.sum((-1, -2)).double()  # weight each sentence's histogram by its number of pairs
    hist = (out["histogram"] * counts.unsqueeze(-1)).sum(1) / counts.sum(1, keepdim=True)
    return {"histogram": hist, "mean_cosine": mean_cos.mean(1), "n_clusters": out["n_clusters"].double().mean(1),
            "span_dimension": out["span_dimension"].double().mean(1)}


def hugging_face_trajectories(cfg: dict) -> tuple[dict, torch.Tensor]:
    """Hidden-state trajectories of one BERT (config or checkpoint) with SoftMax and with Sinkhorn attention."""
    from ...integrations.huggingface import register as register_backend
    from ..._optional import require

    transformers = require("transformers", "the Hugging Face comparison")
    name = register_backend(cfg["hf_n_iters"], "sinkhorn_particles")
    options = cfg["hf_config"]
    torch.manual_seed(cfg["seed"])
    if cfg["hf_checkpoint"]:
        softmax = transformers.AutoModel.from_pretrained(cfg["hf_checkpoint"], attn_implementation="eager")
        sinkhorn = transformers.AutoModel.from_pretrained(cfg["hf_checkpoint"], attn_implementation=name)
    else:
        # one config object each: from_config records the attention implementation on the config it is given
        softmax = transformers.AutoModel.from_config(transformers.BertConfig(**options), attn_implementation="eager")
        sinkhorn = transformers.AutoModel.from_config(transformers.BertConfig(**options), attn_implementation=name)
        sinkhorn.load_state_dict(softmax.state_dict())
    if softmax.config._attn_implementation == sinkhorn.config._attn_implementation:
        raise RuntimeError("the SoftMax and Sinkhorn models share their attention implementation")
    vocab = softmax.config.vocab_size
    gen = torch.Generator().manual_seed(cfg["seed"])
    ids = torch.randint(0, vocab, (cfg["hf_sequences"], cfg["hf_tokens"]), generator=gen)
    mask = torch.ones_like(ids, dtype=torch.bool)
    out = {}
    for label, model in ((TRANSFORMER, softmax), (SINKFORMER, sinkhorn)):
        with torch.no_grad():
            hidden = model.eval()(input_ids=ids, attention_mask=mask.long(), output_hidden_states=True).hidden_states
        out[label] = hidden_trajectory(hidden)
    return out, mask


def _encoder_trajectory(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    """The text classifier's embeddings and the output of each encoder layer, ``(L + 1, batch, n, d)``."""
    states = []
    hooks = [model.encoder.layers[0].register_forward_pre_hook(lambda m, args: states.append(args[0].detach()))]
    hooks += [layer.register_forward_hook(lambda m, args, out: states.append(out.detach()))
              for layer in model.encoder.layers]
    try:
        with torch.no_grad():
            model.eval()(**inputs)
    finally:
        for hook in hooks:
            hook.remove()
    return hidden_trajectory(states)


def trained_trajectories(ctx: Run, cfg: dict) -> tuple[dict, torch.Tensor, dict]:
    """Train the text classifier as a Transformer and a Sinkformer; their trajectories on the test sentences."""
    data = training_subset(load_data(ctx, cfg["dataset"], {}), cfg["seed"], cfg["train_fraction"])
    inputs, _ = data.collate([data.test[i] for i in range(min(cfg["test_sentences"], len(data.test)))])
    out, accuracy = {}, {}
    for label, n_iters in ((TRANSFORMER, 1), (SINKFORMER, cfg["n_iters"])):
        model = build("text_classifier", data, n_iters, cfg["seed"], cfg["model_options"])
        result = fit(model, data, cfg["train"], seed=cfg["seed"], ctx=ctx, label=label, model=label, n_iters=n_iters)
        accuracy[label] = result.history[-1]["test_acc"]
        out[label] = _encoder_trajectory(model, inputs)
    return out, ~inputs["padding_mask"], accuracy


def figure(stats: dict, cfg: dict):
    plt = pyplot()
    rows = list(stats)
    fig, axes = plt.subplots(len(rows), 3, figsize=(16, 4.2 * len(rows)), squeeze=False)
    for r, row in enumerate(rows):
        for c, label in enumerate((TRANSFORMER, SINKFORMER)):
            s = stats[row][label]
            ax = axes[r, c]
            image = ax.imshow(s["histogram"].numpy().T, origin="lower", aspect="auto", cmap="magma",
                              extent=(-0.5, s["histogram"].shape[0] - 0.5, -1, 1))
            ax.set(xlabel="layer (0 = embeddings)", ylabel="cos(h_i, h_j)",
                   title=f"{row}: {label} ({'SoftMax' if label == TRANSFORMER else 'Sinkhorn'} attention)")
            fig.colorbar(image, ax=ax, label="fraction of pairs")
        ax = axes[r, 2]
        for label in (TRANSFORMER, SINKFORMER):
            s = stats[row][label]
            layers = range(len(s["mean_cosine"]))
            ax.plot(layers, s["mean_cosine"].numpy(), "o-", color=COLORS[label], label=f"{label}: mean cosine")
        ax.set(xlabel="layer", ylabel="mean pairwise cosine", title=f"{row}: mean cosine per layer")
        ax.legend(fontsize=8)
    fig.suptitle("Hidden states as particles: pairwise cosine similarities per layer")
    fig.tight_layout()
    return fig


@register(
    "hidden-states",
    description="Hidden states of a Hugging Face BERT and of trained text classifiers as particles: SoftMax vs Sinkhorn",
    paper="Geshkovski et al., A mathematical perspective on Transformers (albert.ipynb); Sinkformers §6.3",
    quick_minutes=0.4,
    full_minutes=5.0,
    defaults={
        "hf_config": {"vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 12, "num_attention_heads": 4,
                      "intermediate_size": 128, "initializer_range": 0.1},
        "hf_checkpoint": None, "hf_n_iters": 5, "hf_sequences": 8, "hf_tokens": 32,
        "dataset": "sentiment", "train_fraction": 1.0, "n_iters": 3, "test_sentences": 256, "seed": 0,
        "model_options": {"dim": 32, "depth": 4, "num_heads": 4, "dim_feedforward": 64, "dropout": 0.0},
        "train": {"epochs": 8, "batch_size": 32, "lr": 2e-3, "milestones": [6]},
        "bins": 40, "radius": 0.1,
    },
    full={"hf_sequences": 64, "test_sentences": 1000, "train": {"epochs": 20, "batch_size": 32, "lr": 2e-3,
                                                                 "milestones": [15]}},
)
def run(ctx: Run) -> None:
    cfg = ctx.config
    hf, hf_mask = hugging_face_trajectories(cfg)
    trained, trained_mask, accuracy = trained_trajectories(ctx, cfg)
    hf_name = "BERT (config)" if not cfg["hf_checkpoint"] else f"BERT ({cfg['hf_checkpoint']})"
    stats = {
        hf_name: {k: layer_statistics(v, hf_mask, cfg["bins"], cfg["radius"]) for k, v in hf.items()},
        "trained text classifiers": {k: layer_statistics(v, trained_mask, cfg["bins"], cfg["radius"])
                                     for k, v in trained.items()},
    }
    ctx.save_figure(figure(stats, cfg), "hidden_states")
    summary = {row: {label: {k: v.tolist() for k, v in s.items() if k != "histogram"} for label, s in by.items()}
               for row, by in stats.items()}
    summary["test_accuracy"] = accuracy
    ctx.results.update(summary)
    lines = []
    for row, by in stats.items():
        for label, s in by.items():
            lines.append(f"| {row} | {label} | {float(s['mean_cosine'][0]):.3f} | {float(s['mean_cosine'][-1]):.3f} | "
                         f"{float(s['n_clusters'][-1]):.1f} | {float(s['span_dimension'][-1]):.1f} |")
    table = "\n".join(lines)
    ctx.write_report(f"""# Hidden states as particles: SoftMax vs Sinkhorn attention

![hidden states](hidden_states.png)

| model | attention | mean pairwise cosine, embeddings | mean pairwise cosine, last layer | clusters at the last layer (radius {cfg['radius']:g}) | span dimension at the last layer |
|---|---|---|---|---|---|
{table}

Test accuracy of the trained classifiers: Transformer {100 * accuracy[TRANSFORMER]:.1f} %, Sinkformer
({cfg['n_iters']} iterations) {100 * accuracy[SINKFORMER]:.1f} % (one seed).

**Paper.** Geshkovski et al. read a trained ALBERT as a particle system: the histogram of pairwise cosine
similarities of its hidden states moves towards 1 with depth, the clustering their theory predicts.
Nobody has compared a Transformer with its Sinkformer this way.

**This run.** Top row: a {cfg['hf_config']['num_hidden_layers']}-layer BERT built from its config
(random weights of standard deviation {cfg['hf_config'].get('initializer_range', 0.02):g}, seed {cfg['seed']}: with
BERT's default 0.02 the layers barely move the residual stream) on {cfg['hf_sequences']} random sequences of {cfg['hf_tokens']}
tokens, with SoftMax and, weights unchanged, Sinkhorn attention ({cfg['hf_n_iters']} iterations) —
pass `--set hf_checkpoint=PATH` to read a trained checkpoint instead. Bottom row: the text classifier
(depth {cfg['model_options']['depth']}, width {cfg['model_options']['dim']}) trained for
{cfg['train']['epochs']} epochs on the embedded sentiment data as a Transformer and as a Sinkformer from the same
initial weights, on {cfg['test_sentences']} test sentences (padding left out). The table and the right
panels give the mean pairwise cosine per layer; histograms are pooled over sentences, weighted by
their number of pairs. One seed, small models: a description of these models, not a measurement of
Transformers in general.
""")
