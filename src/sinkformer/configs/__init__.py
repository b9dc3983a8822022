"""The configurations shipped with the package, found by name: ``sinkformer train --config pct_modelnet40``.

Each file has three sections, ``model``, ``data`` and ``train`` (see :mod:`sinkformer.training.runner`).
Copy one to start your own: ``sinkformer train --config ./my_config.yaml`` takes a path as well.
"""

from __future__ import annotations

import difflib
from pathlib import Path

__all__ = ["CONFIG_DIR", "names", "find_config"]

CONFIG_DIR = Path(__file__).parent
_SUFFIXES = (".yaml", ".yml", ".toml")


def names() -> list[str]:
    """The shipped configurations' names (file stems), sorted."""
    return sorted(p.stem for p in CONFIG_DIR.iterdir() if p.suffix in _SUFFIXES)


def find_config(config: str | Path) -> Path:
    """The file ``config`` names: an existing path, or the name of a shipped configuration
    (``"pct_modelnet40"``, with or without its suffix). Raises ``FileNotFoundError`` listing the
    shipped names, with the closest one first."""
    path = Path(config).expanduser()
    if path.is_file():
        return path
    stem = path.name
    for suffix in _SUFFIXES:
        stem = stem.removesuffix(suffix)
    if path.parent == Path(".") or path.parent == Path("configs"):
        for suffix in _SUFFIXES:
            shipped = CONFIG_DIR / f"{stem}{suffix}"
            if shipped.is_file():
                return shipped
    close = difflib.get_close_matches(stem, names(), n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise FileNotFoundError(
        f"config {str(config)!r} is neither a file nor a shipped configuration; {hint}"
        f"shipped: {', '.join(names())}"
    )
