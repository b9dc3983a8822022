"""Distributed data parallel through ``torch.distributed`` (gloo on CPU, NCCL on GPU).

Launch with PyTorch's own launcher, which sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and the
rendezvous address::

    torchrun --nproc_per_node=2 -m sinkformer.cli train --model vit --dataset digits

:func:`setup_distributed` reads that environment and joins the process group (nothing happens
in a plain single-process run). Every process computes its slice of each global batch
(:mod:`sinkformer.training.batches`); ``DistributedDataParallel`` averages the gradients, and
the loss is scaled so that the average is the mean over the *global* batch — the update is the
one a single process would make on the whole batch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Distributed", "setup_distributed", "mps_available", "all_reduce_sum", "all_gather_objects", "broadcast_object", "barrier"]


@dataclass(frozen=True)
class Distributed:
    """Where this process stands: its rank, the number of processes, and its device."""

    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def mps_available() -> bool:
    """Whether Apple's Metal (MPS) device can be used by this torch build on this machine."""
    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


def _pick_device(device: str, local_rank: int, world_size: int = 1) -> torch.device:
    """``auto``: CUDA (this process's GPU), else MPS (single process only: no process group runs
    on it), else the CPU. ``cuda`` is this process's GPU; anything else is taken as given."""
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device(f"cuda:{local_rank}")
        if world_size == 1 and mps_available():
            return torch.device("mps")
        return torch.device("cpu")
    if device == "cuda":
        return torch.device(f"cuda:{local_rank}")
    return torch.device(device)


def setup_distributed(device: str = "auto") -> Distributed:
    """Join the process group described by torchrun's environment (if any); pick this process's device.

    Raises ``ValueError`` when the requested device is not available (``device='mps' but MPS is
    not available``), or for MPS with several processes.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    chosen = _pick_device(device, local_rank, world_size)
    if chosen.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"train option device={device!r} but CUDA is not available")
        torch.cuda.set_device(chosen)
    if chosen.type == "mps":
        if not mps_available():
            raise ValueError(f"train option device={device!r} but MPS is not available "
                             "(it needs Apple silicon, macOS 12.3+ and a torch build with MPS); use device='cpu'")
        if world_size > 1:
            raise ValueError(f"train option device={device!r} runs a single process; torch.distributed has no MPS "
                             f"backend (WORLD_SIZE={world_size})")
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if chosen.type == "cuda" else "gloo")
    return Distributed(rank, world_size, chosen)


def all_reduce_sum(values: torch.Tensor, ctx: Distributed) -> torch.Tensor:
    """Sum ``values`` over all processes (identity in a single process)."""
    if ctx.enabled:
        values = values.clone()
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def all_gather_objects(obj: Any, ctx: Distributed) -> list[Any]:
    """Every process's ``obj``, in rank order."""
    if not ctx.enabled:
        return [obj]
    gathered: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(gathered, obj)
    return gathered


def broadcast_object(obj: Any, ctx: Distributed) -> Any:
    """Rank 0's ``obj`` on every process."""
    if not ctx.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(ctx: Distributed) -> None:
    if ctx.enabled:
        dist.barrier()
