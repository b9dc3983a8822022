r"""Algorithmic sorting as sequence transduction (Sparse Sinkhorn Attention §5.1, Table 1).

The input is a sequence of integers drawn uniformly (with repeats) from ``n_symbols`` values,
the target the same integers in increasing order — Tensor2Tensor's ``algorithmic_sort_problem``,
whose sequence lengths are drawn uniformly from 1 to the maximum length. Models are trained with
lengths up to :math:`\ell` and tested with lengths up to :math:`2\ell` (``test_length``), so that
memorising positions does not suffice. Metrics: exact
match (percentage of test sequences entirely right) and edit distance (summed Levenshtein
distances over summed target lengths; lower is better).

Ids follow :mod:`sinkformer.data.text`: 0–3 are ``<pad> <bos> <eos> <unk>``, symbol ``s`` is id
``4 + s``. Items are ``(src, <bos> sorted <eos>)`` — the ``translation`` kind of
:mod:`sinkformer.data.base`.

Real data: a folder with ``train.tsv`` and ``test.tsv`` (Tensor2Tensor's text-to-text TSV
layout), one example per line, ``source<TAB>target``, each a space-separated list of integers.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor
from torch.utils.data import Dataset

from .base import DataBundle, TranslationCollate, require_path
from .text import BOS_ID, EOS_ID, PAD_ID

__all__ = ["OFFSET", "SortingDataset", "generate_sort_examples", "load_sorting", "load_sorting_tsv",
           "edit_distance", "sequence_metrics"]

#: Id of symbol 0 (ids below are the special tokens).
OFFSET = 4

INSTRUCTIONS = (
    "Pass a folder holding train.tsv and test.tsv, one example per line: space-separated integers, "
    "a tab, and the same integers sorted (e.g. Tensor2Tensor's algorithmic_sort_problem written out as text)."
)


class SortingDataset(Dataset):
    """``(src ids, <bos> target ids <eos>)`` items from lists of integer symbols."""

    def __init__(self, sources: Sequence[Sequence[int]], targets: Sequence[Sequence[int]]) -> None:
        if len(sources) != len(targets):
            raise ValueError(f"got {len(sources)} sources but {len(targets)} targets")
        self.src = [torch.tensor([OFFSET + s for s in src], dtype=torch.long) for src in sources]
        self.tgt = [torch.tensor([BOS_ID] + [OFFSET + s for s in tgt] + [EOS_ID], dtype=torch.long) for tgt in targets]

    def __len__(self) -> int:
        return len(self.src)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        return self.src[index], self.tgt[index]


def generate_sort_examples(n: int, max_length: int, n_symbols: int, seed: int, *,
                           variable_length: bool = True) -> list[list[int]]:
    """``n`` sequences of integers in ``[0, n_symbols)``, of lengths uniform in ``[1, max_length]``
    (or all ``max_length`` with ``variable_length=False``), seeded."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_length + 1, (n,), generator=gen).tolist() if variable_length else [max_length] * n
    return [torch.randint(0, n_symbols, (k,), generator=gen).tolist() for k in lengths]


def _bundle(train: SortingDataset, test: SortingDataset, n_symbols: int, max_len: int) -> DataBundle:
    info = {"kind": "translation", "vocab_size": OFFSET + n_symbols, "pad_id": PAD_ID, "bos_id": BOS_ID,
            "eos_id": EOS_ID, "max_len": max_len, "n_symbols": n_symbols}
    return DataBundle(train, test, info, TranslationCollate(PAD_ID))


def load_sorting(*, length: int = 32, test_length: int | None = None, n_train: int = 5000, n_test: int = 200,
                 n_symbols: int = 16, variable_length: bool = True, seed: int = 0) -> DataBundle:
    """Generated sorting: train with lengths up to ``length``, test up to ``test_length`` (default ``2 * length``)."""
    test_length = test_length or 2 * length
    for name, value in (("length", length), ("test_length", test_length), ("n_train", n_train), ("n_test", n_test),
                        ("n_symbols", n_symbols)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    train = generate_sort_examples(n_train, length, n_symbols, seed, variable_length=variable_length)
    test = generate_sort_examples(n_test, test_length, n_symbols, seed + 1, variable_length=variable_length)
    return _bundle(SortingDataset(train, [sorted(s) for s in train]), SortingDataset(test, [sorted(s) for s in test]),
                   n_symbols, max(length, test_length) + 2)


def _read_tsv(file: Path) -> tuple[list[list[int]], list[list[int]]]:
    sources, targets = [], []
    for number, line in enumerate(file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split("\t")
        try:
            if len(parts) != 2:
                raise ValueError("expected exactly one tab")
            src, tgt = [int(t) for t in parts[0].split()], [int(t) for t in parts[1].split()]
        except ValueError as err:
            raise ValueError(f"{file}:{number}: expected 'integers<TAB>integers', got {line[:60]!r} ({err})") from None
        if min(src + tgt, default=0) < 0:
            raise ValueError(f"{file}:{number}: symbols must be non-negative integers")
        sources.append(src)
        targets.append(tgt)
    if not sources:
        raise ValueError(f"{file} holds no examples. {INSTRUCTIONS}")
    return sources, targets


def load_sorting_tsv(path: str | Path | None) -> DataBundle:
    """Sorting examples from ``path/train.tsv`` and ``path/test.tsv``."""
    root = require_path(path, "sorting", INSTRUCTIONS)
    splits = []
    for name in ("train", "test"):
        file = root / f"{name}.tsv"
        if not file.is_file():
            raise FileNotFoundError(f"dataset 'sorting': missing {file}. {INSTRUCTIONS}")
        splits.append(_read_tsv(file))
    n_symbols = 1 + max(max(s + t) for split in splits for s, t in zip(*split))
    max_len = 2 + max(len(x) for split in splits for seqs in split for x in seqs)
    return _bundle(SortingDataset(*splits[0]), SortingDataset(*splits[1]), n_symbols, max_len)


def edit_distance(a: Sequence, b: Sequence) -> int:
    """Levenshtein distance (insertions, deletions, substitutions of one element each cost 1)."""
    previous = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        current = [i]
        for j, y in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (x != y)))
        previous = current
    return previous[-1]


def sequence_metrics(predictions: Sequence[Sequence[int]], targets: Sequence[Sequence[int]]) -> dict[str, float]:
    """``exact_match`` (% of sequences entirely right) and ``edit_distance`` (summed Levenshtein
    distances over summed target lengths, Tensor2Tensor's sequence edit distance)."""
    if len(predictions) != len(targets) or not targets:
        raise ValueError(f"need as many predictions as targets (> 0), got {len(predictions)} and {len(targets)}")
    exact = sum(list(p) == list(t) for p, t in zip(predictions, targets))
    dist = sum(edit_distance(p, t) for p, t in zip(predictions, targets))
    return {"exact_match": 100.0 * exact / len(targets), "edit_distance": dist / max(sum(len(t) for t in targets), 1)}
