"""Datasets: embedded ones that need no download, and loaders for the papers' real datasets.

:func:`load_dataset` returns a :class:`DataBundle` (train/test datasets, ``info``, ``collate``).

================== =========== ======== ====================================================
name               kind        embedded what
================== =========== ======== ====================================================
``digits``         images      yes      scikit-learn's 8×8 handwritten digits
``shapes3d``       points      yes      12 classes of generated 3-D shapes
``sentiment``      tokens      yes      generated reviews; labels depend on negation/contrast
``translation``    translation yes      generated SVO -> SOV toy translation
``mnist``          images      no       MNIST IDX files
``image_folder``   images      no       one folder per class (cats vs dogs)
``modelnet40``     points      no       ``modelnet40_ply_hdf5_2048`` HDF5 release
``modelnet40_off`` points      no       ModelNet40 ``.off`` meshes, surface-sampled
``imdb``           tokens      no       ``aclImdb`` review folders
``iwslt14``        translation no       parallel text files ``{train,valid,test}.{de,en}``
================== =========== ======== ====================================================
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._options import check_options, did_you_mean, signature_options
from .base import KINDS, DataBundle
from .digits import load_digits
from .image_folder import load_image_folder
from .imdb import load_imdb
from .mnist import load_mnist
from .modelnet import load_modelnet40, load_modelnet40_off
from .nli import load_generated_nli, load_nli  # Sparse Sinkhorn Attention (issue 7)
from .parallel_text import bleu, load_parallel_text
from .sentiment import load_sentiment
from .shapes3d import load_shapes3d
from .text_lm import load_text_corpus, load_text_lm
from .translation import load_translation

__all__ = ["DataBundle", "KINDS", "DatasetSpec", "DATASETS", "get_dataset", "dataset_options", "load_dataset", "bleu"]


@dataclass(frozen=True)
class DatasetSpec:
    """A registered dataset: its loader, the kind of data, and whether it ships with the package."""

    name: str
    kind: str
    load: Callable[..., DataBundle]
    embedded: bool
    description: str


DATASETS: dict[str, DatasetSpec] = {
    spec.name: spec
    for spec in [
        DatasetSpec("digits", "images", load_digits, True, "scikit-learn's 8x8 handwritten digits"),
        DatasetSpec("shapes3d", "points", load_shapes3d, True, "generated 3-D shapes, 12 classes"),
        DatasetSpec("sentiment", "tokens", load_sentiment, True, "generated context-dependent sentiment"),
        DatasetSpec("translation", "translation", load_translation, True, "generated toy translation"),
        DatasetSpec("mnist", "images", load_mnist, False, "MNIST IDX files"),
        DatasetSpec("image_folder", "images", load_image_folder, False, "one image folder per class (cats vs dogs)"),
        DatasetSpec("modelnet40", "points", load_modelnet40, False, "ModelNet40 HDF5 point clouds"),
        DatasetSpec("modelnet40_off", "points", load_modelnet40_off, False, "ModelNet40 .off meshes"),
        DatasetSpec("imdb", "tokens", load_imdb, False, "IMDb aclImdb folder"),
        DatasetSpec("iwslt14", "translation", load_parallel_text, False, "IWSLT'14 De-En parallel text"),
        DatasetSpec("nli_generated", "tokens", load_generated_nli, True, "generated entailment, premise <eos> hypothesis"),
        DatasetSpec("nli", "tokens", load_nli, False, "SNLI / MultiNLI JSONL release"),
        DatasetSpec("stdlib_text", "lm", load_text_lm, True, "Python's standard library source, a text corpus"),
        DatasetSpec("text_corpus", "lm", load_text_corpus, False, "LM1B folder, WikiText raw files or one text file"),
    ]
}


def get_dataset(name: str) -> DatasetSpec:
    """The dataset registered as ``name``; an unknown name suggests the closest and lists the valid ones."""
    if name not in DATASETS:
        raise ValueError(
            f"unknown dataset {name!r}; {did_you_mean(name, DATASETS)}valid datasets: {', '.join(DATASETS)}"
        )
    return DATASETS[name]


def dataset_options(name: str) -> dict[str, Any]:
    """Loader options of dataset ``name`` (besides ``path``) with their defaults."""
    return {k: v for k, v in signature_options(get_dataset(name).load).items() if k != "path"}


def load_dataset(name: str, path: str | Path | None = None, **options: Any) -> DataBundle:
    """Load dataset ``name`` (from ``path`` for the real ones) with loader ``options``."""
    spec = get_dataset(name)
    options = check_options(f"dataset {name!r}", options, dataset_options(name))
    if spec.embedded:
        if path is not None:
            raise ValueError(f"dataset {name!r} is embedded and takes no path, got {path}")
        return spec.load(**options)
    return spec.load(path, **options)
