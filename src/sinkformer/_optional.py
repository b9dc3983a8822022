"""Optional dependencies: imported where they are used, with an error that names the extra to install.

The core of the package (``sinkformer.sinkhorn``, ``sinkformer.attention``, ``sinkformer.nn``)
needs torch, numpy and einops only. Training, datasets, experiments, the dynamics toolkit's
distances and the Hugging Face integration need more; :func:`require` imports such a module and,
when it is missing, raises an ``ImportError`` saying which extra brings it::

    pip install 'sinkformer[train]'        # trainer, datasets, checkpoints, `sinkformer train`
    pip install 'sinkformer[experiments]'  # + dynamics, hf, figures, reports, statistics: `sinkformer run`
    pip install 'sinkformer[dynamics]'     # OT distances and figures of the dynamics toolkit
    pip install 'sinkformer[hf]'           # the Hugging Face backend
    pip install 'sinkformer[all]'          # everything
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

__all__ = ["require", "require_extra", "missing", "MissingExtra", "EXTRAS", "EXTRA_MODULES"]

#: module -> (distribution to install, the extra that brings it)
EXTRAS = {
    "tqdm": ("tqdm", "train"),
    "yaml": ("PyYAML", "train"),
    "safetensors": ("safetensors", "train"),
    "tokenizers": ("tokenizers", "train"),
    "sacrebleu": ("sacrebleu", "train"),
    "sklearn": ("scikit-learn", "train"),
    "h5py": ("h5py", "train"),
    "PIL": ("Pillow", "train"),
    "tomli": ("tomli", "train"),
    "matplotlib": ("matplotlib", "experiments"),
    "markdown": ("Markdown", "experiments"),
    "scipy": ("SciPy", "experiments"),
    "ot": ("POT", "dynamics"),
    "transformers": ("transformers", "hf"),
    "tensorboard": ("tensorboard", "tensorboard"),
}


#: extra -> the modules it brings (an extra that includes another lists its modules too)
EXTRA_MODULES = {
    "train": ["tqdm", "yaml", "safetensors", "tokenizers", "sacrebleu", "sklearn", "h5py", "PIL"],
    "dynamics": ["ot", "matplotlib"],
    "hf": ["transformers"],
    "tensorboard": ["tensorboard"],
}
EXTRA_MODULES["experiments"] = EXTRA_MODULES["train"] + EXTRA_MODULES["dynamics"] + EXTRA_MODULES["hf"] + ["scipy", "markdown"]


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message names the extra that brings it."""


def missing(extra: str) -> list[str]:
    """The distributions of ``extra`` that are not installed (empty when all are)."""
    return [EXTRAS[m][0] for m in EXTRA_MODULES[extra] if importlib.util.find_spec(m) is None]


def require_extra(extra: str, purpose: str) -> None:
    """Raise :class:`MissingExtra` unless every package of ``extra`` is installed."""
    absent = missing(extra)
    if absent:
        raise MissingExtra(
            f"{purpose} needs the '{extra}' extra ({', '.join(absent)} not installed): "
            f"pip install 'sinkformer[{extra}]' (or 'sinkformer[all]')"
        )


def require(name: str, purpose: str | None = None) -> ModuleType:
    """Import module ``name`` (e.g. ``"matplotlib.pyplot"``); if its package is missing, raise an
    ``ImportError`` naming the extra that installs it, and ``purpose`` (what needs it)."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        top = name.split(".")[0]
        if err.name is None or err.name.split(".")[0] != top or top not in EXTRAS:
            raise
        distribution, extra = EXTRAS[top]
        needs = f"{purpose} needs" if purpose else "this needs"
        raise MissingExtra(
            f"{needs} {distribution}, which the core of sinkformer does not install: "
            f"pip install 'sinkformer[{extra}]' (or 'sinkformer[all]')"
        ) from err
