"""What a seed varies in the papers' experiments, besides the initial weights, batch order and dropout:
the training subset; and the one loop that trains every variant of an experiment on every seed.

:func:`training_subset` draws, for seed ``s``, a random subset of the training split (the same one for
every model of that seed, so comparisons stay paired); the test split never changes. The intervals
of the paired comparisons then run over initial weights, batch order, dropout *and* training data,
not over the test set, which is fixed. ``fraction = 1`` keeps the whole split (the ``--full`` forms).

:func:`over_seeds` is the paired experiments' loop (variants × seeds): each seed's subset, then every
variant on it, the results collected per variant in seed order, ready for
:func:`sinkformer.runs.verdicts.paired`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import TypeVar

import torch
from torch.utils.data import Dataset

from ..data.base import DataBundle

__all__ = ["TrainingSubset", "training_subset", "subset_line", "over_seeds"]

K, V, R = TypeVar("K"), TypeVar("V"), TypeVar("R")


class TrainingSubset(Dataset):
    """Items ``indices`` of ``dataset``; ``set_epoch`` (augmented datasets) is passed on."""

    def __init__(self, dataset: Dataset, indices: list[int]) -> None:
        self.dataset, self.indices = dataset, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int):
        return self.dataset[self.indices[i]]

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)


def training_subset(data: DataBundle, seed: int, fraction: float) -> DataBundle:
    """``data`` with its training split replaced by ``round(fraction * len(train))`` items drawn without
    replacement by ``seed`` (kept in their original order); ``fraction == 1``: ``data`` itself.

    Raises ``ValueError`` for a fraction outside (0, 1] or one that leaves no item."""
    if not 0 < fraction <= 1:
        raise ValueError(f"train_fraction must be in (0, 1], got {fraction}")
    if fraction == 1:
        return data
    n = len(data.train)
    size = round(fraction * n)
    if size < 1:
        raise ValueError(f"train_fraction={fraction} of {n} training items leaves none")
    chosen = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:size].sort().values
    return replace(data, train=TrainingSubset(data.train, chosen.tolist()))


def subset_line(fraction: float, n_train: int) -> str:
    """What the seeds vary, in words, for a report."""
    if fraction == 1:
        return (f"Seeds vary the initial weights, the batch order and dropout; every seed trains on all {n_train} "
                "training examples and is tested on the same test set.")
    return (f"Seeds vary the initial weights, the batch order, dropout and the training data: each seed trains on its "
            f"own random {fraction:.0%} of the {n_train} training examples (every model of a seed on the same ones); "
            "the test set is the same for all.")


def over_seeds(data: DataBundle, seeds: Iterable[int], fraction: float, variants: Mapping[K, V],
               train: Callable[[K, V, DataBundle, int], R]) -> dict[K, list[R]]:
    """Train every variant on every seed, paired: for each seed in order, its training subset
    (:func:`training_subset` of ``fraction``, the same for every variant), then ``train(name, variant,
    subset, seed)`` for each of ``variants`` in order. Returns ``{name: [result of each seed]}``, the
    seeds in the same order for every name."""
    results: dict[K, list[R]] = {name: [] for name in variants}
    for seed in seeds:
        subset = training_subset(data, seed, fraction)
        for name, variant in variants.items():
            results[name].append(train(name, variant, subset, seed))
    return results
