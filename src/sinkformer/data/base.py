"""What every dataset loader returns, and the pieces they share.

A loader returns a :class:`DataBundle`: a train and a test ``torch.utils.data.Dataset``, an
``info`` dict describing the data (its ``kind`` and the sizes a model needs: ``n_classes``,
``image_size``, ``vocab_size``, ...), and the ``collate`` function that turns a list of items
into ``(inputs, targets)`` where ``inputs`` is a dict of keyword arguments of the model's
``forward``.

Items and batches per kind:

=============== =========================== ==================================================
kind            item                        batch inputs
=============== =========================== ==================================================
``images``      ``(image (C, H, W), label)`` ``{"images": (B, C, H, W)}``
``points``      ``(points (n, 3), label)``    ``{"points": (B, n, 3)}``
``tokens``      ``(ids (L,), label)``         ``{"tokens": (B, L), "padding_mask": (B, L)}``
``translation`` ``(src ids, tgt ids)``        ``{"src", "tgt", "src_padding_mask", "tgt_padding_mask"}``
=============== =========================== ==================================================

For ``translation`` the target ids are ``<bos> y <eos>``; the batch feeds ``<bos> y`` to the
decoder and the targets are ``y <eos>`` (padding = ``pad_id``, ignored by the loss).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset

__all__ = [
    "DataBundle",
    "KINDS",
    "require_path",
    "split_indices",
    "item_seed",
    "FixedCollate",
    "TokenCollate",
    "TranslationCollate",
]

KINDS = ("images", "points", "tokens", "translation", "lm")


@dataclass
class DataBundle:
    """A dataset ready for training: splits, description and batching.

    Attributes:
        train, test: map-style datasets (``len`` and integer indexing).
        info: ``kind`` (one of :data:`KINDS`) plus sizes (``n_classes``, ``image_size``,
            ``channels``, ``n_points``, ``vocab_size``, ``pad_id``, ``bos_id``, ``eos_id``,
            ``max_len``, ``class_names``) — model constructors take their arguments from here.
        collate: ``list of items -> (inputs: dict, targets: Tensor)``.
        tokenizer: the ``tokenizers.Tokenizer`` of text data (``None`` otherwise).
    """

    train: Dataset
    test: Dataset
    info: dict[str, Any]
    collate: Callable[[list], tuple[dict[str, Tensor], Tensor]]
    tokenizer: Any = None

    @property
    def kind(self) -> str:
        return self.info["kind"]


def require_path(path: str | Path | None, dataset: str, instructions: str) -> Path:
    """``path`` as an existing :class:`Path`, or ``FileNotFoundError`` saying what to download."""
    if path is None:
        raise FileNotFoundError(f"dataset {dataset!r} needs a path (--data PATH, or data.path). {instructions}")
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"dataset {dataset!r}: {path} does not exist. {instructions}")
    return path


def split_indices(n: int, test_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """A seeded random split of ``range(n)`` into train and test index lists."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    n_test = max(1, round(n * test_fraction))
    return sorted(order[n_test:]), sorted(order[:n_test])


def item_seed(seed: int, epoch: int, index: int) -> int:
    """A seed for the random augmentation of one item in one epoch (same on every run)."""
    return (seed * 1_000_003 + epoch) * 1_000_033 + index


class FixedCollate:
    """Stack fixed-size items ``(x, label)`` into ``({name: (B, ...)}, labels (B,))``."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, items: Sequence[tuple[Tensor, int]]) -> tuple[dict[str, Tensor], Tensor]:
        xs, ys = zip(*items)
        return {self.name: torch.stack(xs)}, torch.as_tensor(ys, dtype=torch.long)


def _pad(seqs: Sequence[Tensor], pad_id: int) -> tuple[Tensor, Tensor]:
    """Right-pad 1-D id tensors to ``(B, L_max)``; also return the padding mask (True = pad)."""
    padded = torch.nn.utils.rnn.pad_sequence(list(seqs), batch_first=True, padding_value=pad_id)
    lengths = torch.tensor([len(s) for s in seqs])
    return padded, torch.arange(padded.shape[1]).unsqueeze(0) >= lengths.unsqueeze(1)


class TokenCollate:
    """Pad ``(ids, label)`` items into ``({"tokens", "padding_mask"}, labels)``."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, items: Sequence[tuple[Tensor, int]]) -> tuple[dict[str, Tensor], Tensor]:
        ids, ys = zip(*items)
        tokens, mask = _pad(ids, self.pad_id)
        return {"tokens": tokens, "padding_mask": mask}, torch.as_tensor(ys, dtype=torch.long)


class TranslationCollate:
    """Pad ``(src, <bos> y <eos>)`` pairs; decoder input ``<bos> y``, targets ``y <eos>``."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, items: Sequence[tuple[Tensor, Tensor]]) -> tuple[dict[str, Tensor], Tensor]:
        src, tgt = zip(*items)
        src, src_mask = _pad(src, self.pad_id)
        tgt_in, tgt_mask = _pad([t[:-1] for t in tgt], self.pad_id)
        tgt_out, _ = _pad([t[1:] for t in tgt], self.pad_id)
        inputs = {"src": src, "tgt": tgt_in, "src_padding_mask": src_mask, "tgt_padding_mask": tgt_mask}
        return inputs, tgt_out
