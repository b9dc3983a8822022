"""Independent groups of (batch·head) slices on the CPU's cores, one Python thread per core.

The tiled engine visits each group's tile in cache blocks, and each block costs a few small
operations. With PyTorch's intra-op threads, every one of them is split across the cores (a
barrier per operation, and a block written by one core's product read by the other core's next
one). :func:`map_groups` instead gives each core whole groups: ``W = torch.get_num_threads()``
Python threads, each computing single-threaded, take the groups in turn. A block then stays in
its core's cache from product to product, and one thread's Python time overlaps the other's
products (PyTorch releases the GIL inside its operations); ``docs/speed.md`` says what it gained.

Groups must be independent (each writes its own rows of preallocated outputs); results come back
in order, and an exception raised by any group is raised again in the caller. Each worker has its
own ``scratch`` dict (for example a tile buffer allocated once per worker).
"""

from __future__ import annotations

import itertools
import threading
from typing import Callable, TypeVar

import torch

__all__ = ["map_groups", "PARALLEL_ABOVE"]

T = TypeVar("T")

#: Fewest scores in a call (over all its groups) for :func:`map_groups` to use threads: below it,
#: starting threads costs more than it saves. The conformance suite sets 0 to test the threads.
PARALLEL_ABOVE = 1 << 21


def map_groups(starts: list[int], work: Callable[[int, dict], T], device: torch.device, scores: int) -> list[T]:
    """``[work(start, scratch) for start in starts]``, on the CPU in parallel when worthwhile.

    ``scores``: the call's total number of scores (``B·n·m``). Threads are used on the CPU when
    there are at least two groups, at least two intra-op threads, and ``scores >= PARALLEL_ABOVE``;
    each worker sets its intra-op threads to 1 and restores the caller's count when it ends
    (PyTorch also keeps that count as the default of threads not yet started: one that first
    touches ATen during the call starts single-threaded).
    """
    workers = min(len(starts), torch.get_num_threads()) if device.type == "cpu" else 1
    if workers <= 1 or scores < PARALLEL_ABOVE:
        scratch: dict = {}
        return [work(start, scratch) for start in starts]
    results: list = [None] * len(starts)
    errors: list[BaseException] = []
    taken = itertools.count()  # next() on a count is atomic under the GIL: each group runs once
    threads_before = torch.get_num_threads()
    grad_mode = torch.is_grad_enabled()

    def worker() -> None:
        torch.set_num_threads(1)
        scratch: dict = {}
        try:
            with torch.set_grad_enabled(grad_mode):
                while not errors:
                    i = next(taken)
                    if i >= len(starts):
                        break
                    results[i] = work(starts[i], scratch)
        except BaseException as error:  # noqa: BLE001 - raised again in the caller
            errors.append(error)
        finally:
            torch.set_num_threads(threads_before)

    threads = [threading.Thread(target=worker, name=f"sinkformer-group-{i}", daemon=True) for i in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results
