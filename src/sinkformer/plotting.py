"""Small shared plotting helpers (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path

from ._optional import require

__all__ = ["pyplot", "save_png", "method_color", "METHOD_COLORS", "TRANSFORMER_COLOR", "SINKFORMER_COLOR"]


def pyplot():
    """``matplotlib.pyplot`` on the non-interactive Agg backend (imported lazily)."""
    matplotlib = require("matplotlib", "plotting")
    matplotlib.use("Agg")
    return require("matplotlib.pyplot", "plotting")


def save_png(fig, path: str | Path, dpi: int = 120) -> Path:
    """Write ``fig`` to ``path`` atomically (temp file + rename) and close it."""
    plt = pyplot()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.savefig(tmp, dpi=dpi, bbox_inches="tight")
    plt.close(fig)
    tmp.replace(path)
    return path


# ----------------------------------------------------------------------------- shared style

#: The two models the Sinkformers paper compares: one colour each, in every figure.
TRANSFORMER_COLOR = "tab:blue"
SINKFORMER_COLOR = "tab:orange"

#: Colours of methods that appear in several figures (experiments and benchmarks). SoftMax
#: attention is blue (dark: the Transformer / fused SDPA, light: materialised scores), Sinkhorn
#: attention orange (our engine), its streamed form red, the Sinkformers paper's code green.
METHOD_COLORS = {
    "transformer": TRANSFORMER_COLOR,
    "sinkformer": SINKFORMER_COLOR,
    "softmax": TRANSFORMER_COLOR,
    "sinkhorn": SINKFORMER_COLOR,
    "sdpa": TRANSFORMER_COLOR,
    "vanilla": TRANSFORMER_COLOR,
    "naive-softmax": "#6baed6",
    "vanilla-sdpa": "#6baed6",
    "ours": SINKFORMER_COLOR,
    "ours-chunked": "tab:red",
    "ours-softmax": "#fdae6b",
    "paper-reference": "tab:green",
    "local": "tab:purple",
    "sortcut": "tab:brown",
    "mixture": "tab:pink",
}


#: Words that name a variant inside a longer label ("Sinkhorn Mixture (16)", "SortCut Sinkhorn"):
#: they decide the colour before the label's first word does.
_VARIANT_WORDS = ("mixture", "sortcut", "local", "ours-chunked")


def method_color(name: str, default: str = "0.45") -> str:
    """The colour of a method or model name (case-insensitive), else ``default``.

    A longer label takes the colour of a variant word it holds (``"Sinkhorn Mixture (16)"``:
    mixture), else of its first word (``"Sinkformer (5 it.)"``: sinkformer)."""
    key = name.strip().lower()
    if key in METHOD_COLORS:
        return METHOD_COLORS[key]
    words = key.replace("(", " ").replace(",", " ").split()
    for word in _VARIANT_WORDS:
        if word in words:
            return METHOD_COLORS[word]
    return METHOD_COLORS.get(words[0], default) if words else default
