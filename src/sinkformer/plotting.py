"""Small shared plotting helpers (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["pyplot", "save_png"]


def pyplot():
    """``matplotlib.pyplot`` on the non-interactive Agg backend (imported lazily)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


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
