"""Deterministic data order: which examples form each batch, on each process.

Epoch ``e`` uses the permutation drawn from a generator seeded by ``(seed, e)``, cut into global
batches of ``batch_size``; with ``W`` processes, process ``r`` takes the ``r``-th of ``W``
near-equal contiguous slices of every global batch. The order depends only on
``(seed, epoch)``, so a resumed run and a run on more processes see the same global batches.
"""

from __future__ import annotations

import torch

__all__ = ["epoch_batches", "shard"]


def epoch_batches(n: int, batch_size: int, *, seed: int, epoch: int, shuffle: bool = True) -> list[list[int]]:
    """Global batches (lists of indices into a dataset of size ``n``) for one epoch."""
    if shuffle:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).tolist()
    else:
        order = list(range(n))
    return [order[i : i + batch_size] for i in range(0, n, batch_size)]


def shard(batch: list[int], rank: int, world_size: int) -> list[int]:
    """The part of a global ``batch`` that process ``rank`` of ``world_size`` computes."""
    per, extra = divmod(len(batch), world_size)
    start = rank * per + min(rank, extra)
    return batch[start : start + per + (rank < extra)]
