"""Tables 2–4 of Sparse Sinkhorn Attention: language modelling, bits per byte or subword perplexity.

Causal language models (:class:`~sinkformer.models.sinkhorn_transformer.SinkhornTransformerLM`)
that differ only by their self-attention — vanilla, local, Sparse Transformer (fixed pattern),
Sparse Sinkhorn (causal balancing) and the Sinkhorn mixture — trained with the one trainer on
windows of ``seq_len`` tokens and scored on held-out text: bits per byte at ``level=char`` (the
tokens are UTF-8 bytes; the paper's Table 4 reports "bytes per char", bits per character of
LM1B's mostly-ASCII text), perplexity per subword token at ``level=word`` (Tables 2–3).

Embedded text: the Python standard library's own sources (:mod:`sinkformer.data.text_lm`);
``--data`` takes a text file, a folder of ``.txt`` files or the LM1B release. ``models`` are the
paper's rows (its block sizes); the quick forms train them on windows of 128 tokens with the
paper's numbers of blocks (``charlm``: 1024 characters in blocks of 128 -> blocks of 16;
``wordlm``: 256 subwords in blocks of 32 or 64 -> 16 or 32), models of width 64, 6 seeds each
with its own random 80 % of the training windows; the report ends with a sample drawn from the
Sinkhorn model. Two experiments run this code: ``charlm`` (Table 4) and ``wordlm`` (Tables 2–3,
32k subwords); their full forms train for the paper's 300k steps.
"""

from __future__ import annotations

import statistics

import torch

from ...data.text_lm import BYTE_OFFSET, load_text_lm
from ...runs import Run, markdown_table, register
from ...runs.verdicts import record
from .._seeds import over_seeds, subset_line
from ._common import bar_figure, blocks_line, table_models, train_language_model, versus_vanilla, workloads

__all__ = ["PAPER_CHAR", "PAPER_WORD", "PAPER_LENGTH", "run", "decode_sample"]

#: The paper's window lengths: 1024 characters (Table 4), 256 subword tokens (Tables 2-3).
PAPER_LENGTH = {"char": 1024, "word": 256}
#: Table 4 (LM1B, 1024 characters): model -> (Base, Big) bits per character (the paper's "bytes per char").
PAPER_CHAR = {
    "Local Attention": (2.559, 1.825),
    "Transformer": (1.283, 1.121),
    "Sparse Transformer": (1.300, 1.134),
    "Sinkhorn Transformer": (1.295, 1.132),
    "Sinkhorn Mixture": (1.270, 1.119),
}
#: Table 2 (LM1B word pieces): model -> (Base, Big) perplexity.
PAPER_WORD = {
    "Transformer": (41.57, 27.59),
    "Local Attention (16)": (44.62, 30.14),
    "Local Attention (32)": (44.23, 29.32),
    "Local Attention (64)": (44.23, 28.97),
    "Sparse Transformer (64)": (41.89, 28.77),
    "Sinkhorn Transformer (16)": (42.64, 29.42),
    "Sinkhorn Transformer (32)": (41.29, 28.48),
    "Sinkhorn Transformer (64)": (40.79, 28.39),
    "Sinkhorn Mixture": (40.11, 27.34),
}


def decode_sample(data, ids: list[int]) -> str:
    """Token ids back to text (bytes at char level, the BPE tokenizer at word level)."""
    if data.tokenizer is not None:
        return data.tokenizer.decode(ids)
    return bytes(max(0, min(255, i - BYTE_OFFSET)) for i in ids).decode("utf-8", errors="replace")


#: LM1B shards read under --full (about 400M characters); 12.2k steps of 32 x 1024 per epoch.
LM1B_CHARS = 400_000_000


def _language_modelling(name: str, level: str, description: str, paper: str, quick: dict, full: dict):
    """Register one language-modelling experiment (char or word level) with its quick and full forms."""
    base = {  # "models": the paper's rows (its block sizes), trained with its numbers of blocks at "seq_len"
        "level": level, "seq_len": 128, "max_chars": 300_000, "vocab_size": 2000, "max_files": 1,
        "models": ["softmax", "sparse:128", "mixture:128"], "scale_blocks": True, "train_fraction": 0.8,
        "fixed_stride": 2, "sort_iters": 5, "temperature": 0.75,
        "dim": 64, "depth": 2, "heads": 4, "dropout": 0.0,
        "epochs": 1, "batch_size": 16, "lr": 2e-3, "grad_clip": 1.0, "max_eval_batches": 20, "seed": 0, "seeds": 6,
        "sample_chars": 200,
    }
    return register(name, description=description, paper=paper, quick_minutes=quick.pop("quick_minutes"),
                    full_minutes=full.pop("full_minutes"), defaults={**base, **quick}, full=full, cost=_full_cost)(run)


def _full_cost(cfg: dict) -> list:
    """Every model on LM1B: ``max_chars`` characters per epoch (about 4 per subword token at word level)."""
    from ...data.text_lm import BYTE_VOCAB
    from ...runs.cost import tokens

    vocab = BYTE_VOCAB if cfg["level"] == "char" else cfg["vocab_size"]
    chars_per_token = 1 if cfg["level"] == "char" else 4
    steps = cfg["epochs"] * (cfg["max_chars"] // chars_per_token) // (cfg["batch_size"] * cfg["seq_len"])
    return workloads(cfg, "sinkhorn_lm", {"vocab_size": vocab, "max_len": cfg["seq_len"]},
                     tokens(vocab, cfg["seq_len"]), specs=cfg["models"], steps=steps)


def run(ctx: Run) -> None:
    cfg = ctx.config
    data = load_text_lm(ctx.data, level=cfg["level"], seq_len=cfg["seq_len"], vocab_size=cfg["vocab_size"],
                        max_chars=cfg["max_chars"], max_files=cfg["max_files"])
    char = cfg["level"] == "char"
    metric = "bits" if char else "perplexity"
    paper_length = PAPER_LENGTH[cfg["level"]]
    models = table_models(cfg["models"], cfg["seq_len"] / paper_length if cfg["scale_blocks"] else 1.0,
                          sort_iters=cfg["sort_iters"], temperature=cfg["temperature"], stride=cfg["fixed_stride"])
    labels = {m.spec: m.label for m in models}
    sinkhorn_model, n_params = None, 0

    def train(spec: str, m, subset, seed: int) -> dict:
        nonlocal sinkhorn_model, n_params
        model, scores = train_language_model(subset, m.attention, cfg, seed=seed)
        n_params = sum(p.numel() for p in model.parameters())
        if m.attention.kind == "sparse" and sinkhorn_model is None:
            sinkhorn_model = model
        ctx.log(model=m.label, spec=spec, block_size=m.attention.block_size, seed=seed, **scores)
        return scores

    results = over_seeds(data, range(cfg["seed"], cfg["seed"] + cfg["seeds"]), cfg["train_fraction"],
                         {m.spec: m for m in models}, train)

    mean = lambda spec, key: statistics.mean(r[key] for r in results[spec])  # noqa: E731
    unit = "bits per byte" if char else "perplexity per subword token"
    rows = [[labels[s], mean(s, metric), mean(s, "accuracy"), round(mean(s, "train_seconds"))] for s in cfg["models"]]
    ctx.results["unit"] = unit
    ctx.results["models"] = {labels[s]: mean(s, metric) for s in cfg["models"]}
    ctx.save_figure(bar_figure([r[0] for r in rows], {f"{unit} ↓": [r[1] for r in rows]},
                               f"Language modelling ({cfg['level']} level, windows of {cfg['seq_len']})"), "charlm")

    sample = ""
    if sinkhorn_model is not None:
        prompt_ids = data.test[0][:32].tolist()
        device = next(sinkhorn_model.parameters()).device
        generated = sinkhorn_model.generate(torch.tensor([prompt_ids], device=device), cfg["sample_chars"],
                                            temperature=0.8, top_k=20,
                                            generator=torch.Generator(device=device).manual_seed(cfg["seed"]))
        generated = generated[0].tolist()
        sample = (f"\n## A sample from the Sinkhorn Transformer\n\nPrompt (from the test text), then "
                  f"{cfg['sample_chars']} sampled tokens (temperature 0.8, top-20):\n\n```\n"
                  f"{decode_sample(data, prompt_ids)}⟨|⟩{decode_sample(data, generated[len(prompt_ids):])}\n```\n")
    paper = PAPER_CHAR if char else PAPER_WORD
    per_seed = {labels[s]: [r[metric] for r in results[s]] for s in cfg["models"]}
    comparisons = versus_vanilla(per_seed, models, {k: v[0] for k, v in paper.items()}, metric=unit,
                                 higher_is_better=False)
    claim = ("LM1B characters (Base): Sinkhorn Transformer 1.295 vs Transformer 1.283 bits per character, Sinkhorn "
             "Mixture 1.270 (Table 4)" if char else "LM1B words (Base): Sinkhorn Transformer (32) 41.29, (64) 40.79 "
             "and the mixture 40.11 below the Transformer's perplexity 41.57, (16) above it at 42.64 (Table 2)")
    source = f"`{ctx.data}`" if ctx.data else "the Python standard library's sources (embedded)"
    paper_unit = "bits per character, the paper's \"bytes per char\"" if char else "perplexity"
    ctx.write_report(f"""# Language modelling (Sparse Sinkhorn Attention, Table {'4' if char else '2'})

Data: {source}, {cfg['level']} level, {len(data.train)} training windows of {cfg['seq_len']} tokens
({data.info['chars_per_token']:.2f} characters per token on the test split). Causal LMs of width
{cfg['dim']}, {cfg['depth']} layers, {cfg['heads']} heads; {cfg['epochs']} epoch(s), batch {cfg['batch_size']},
lr {cfg['lr']}; {cfg['seeds']} seed(s), means. Test on {'the first ' + str(cfg['max_eval_batches']) + ' batches of ' if cfg['max_eval_batches'] else ''}the held-out split.
{subset_line(cfg['train_fraction'], len(data.train))}
{blocks_line(models, cfg['seq_len'], paper_length, 'window length')}

## Measured ({unit}, lower is better)

{markdown_table(["model", unit + " ↓", "next-token accuracy (%)", "train seconds"], rows)}

![language modelling](charlm.png)

## Paper (LM1B; Base / Big models, 300k steps on TPUs; {paper_unit})

{markdown_table(["model", "Base", "Big"], [[k, *v] for k, v in paper.items()])}

The paper's numbers are on LM1B with 50M–430M-parameter models; this run trains
{n_params / 1e3:.0f}k-parameter models for {cfg['epochs']} epoch(s) on different text, so compare the models with each
other, not the values.
{sample}
{record(ctx.results, comparisons, paper=claim, this_run="; ".join(
    f"{c.variant} − Transformer: {c.interval(3)} {unit}" for c in comparisons) + ".")}""")


_language_modelling(
    "charlm", "char",
    description="character-level language modelling in bits per byte, incl. the Sinkhorn mixture",
    paper="Sparse Sinkhorn Attention, Table 4",
    quick={"quick_minutes": 1.0, "max_chars": 250_000},
    full={  # LM1B, 1024 characters, blocks of 128; 25 epochs of 12.2k steps = the paper's 300k steps; 6 seeds
        "full_minutes": 120000.0, "seeds": 6, "scale_blocks": False, "train_fraction": 1.0, "seq_len": 1024,
        "max_chars": LM1B_CHARS, "max_files": 100,
        "models": ["softmax", "local:128", "fixed:128", "sparse:128", "mixture:128"], "fixed_stride": 16,
        "dim": 512, "depth": 6, "heads": 8, "dropout": 0.1, "epochs": 25, "batch_size": 32, "lr": 5e-4,
        "max_eval_batches": 0,
    },
)
_language_modelling(
    "wordlm", "word",
    description="word-level (32k subword) language modelling in perplexity: vanilla, local, Sparse Transformer, Sinkhorn",
    paper="Sparse Sinkhorn Attention, Tables 2-3",
    quick={"quick_minutes": 0.55, "models": ["softmax", "sparse:32", "sparse:64", "mixture:32"],
           "max_chars": 150_000, "vocab_size": 1000},
    full={  # LM1B, 32k word pieces, lmx_base; blocks of 32 (tuned in {16, 32, 64}); 98 epochs of ~3k steps = 300k
        "full_minutes": 120000.0, "seeds": 6, "scale_blocks": False, "train_fraction": 1.0, "seq_len": 256,
        "max_chars": LM1B_CHARS, "max_files": 100, "vocab_size": 32000,
        "models": ["softmax", "local:32", "fixed:64", "sparse:32", "sparse:64", "mixture:32"], "fixed_stride": 8,
        "dim": 512, "depth": 6, "heads": 8, "dropout": 0.1, "epochs": 98, "batch_size": 128, "lr": 5e-4,
        "max_eval_batches": 0,
    },
)
