"""Independent groups of (batch·head) slices on the CPU's cores, one Python thread per core.

The tiled engine visits each group's tile in cache blocks, and each block costs a few small
operations. With PyTorch's intra-op threads, every one of them is split across the cores (a
barrier per operation, and a block written by one core's product read by the other core's next
one). :func:`map_groups` instead gives each core whole groups: ``W = torch.get_num_threads()``
Python threads, each computing single-threaded, take the groups in turn. A block then stays in
its core's cache from product to product, and one thread's Python time overlaps the other's
products (PyTorch releases the GIL inside its operations); ``docs/speed.md`` says what it gained.

A worker makes *its own* operations single-threaded through the OpenMP runtime's per-thread
setting (``omp_set_num_threads`` from the worker), never through ``torch.set_num_threads``: that
one also sets the count PyTorch gives every thread that starts meanwhile, so threads the user
started during a call would stay single-threaded for life. Where the per-thread setting cannot
be reached or verified (a PyTorch built without OpenMP, a runtime not found), groups run on the
calling thread with PyTorch's intra-op threads: slower, never wrong.

Groups must be independent (each writes its own rows of preallocated outputs); results come back
in order, and an exception raised by any group is raised again in the caller. Each worker has its
own ``scratch`` dict (for example a tile buffer allocated once per worker). On the CPU the scratch
dicts outlive the call, up to :data:`SCRATCH_KEPT_BYTES` in all, and serve the next call
(:func:`release_scratch` frees them): a tile above the C library's mmap threshold (32 MiB in glibc) is
otherwise new pages on every call, each one faulted in and zeroed by the kernel.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import os
import queue
import threading
from typing import Callable, TypeVar

import torch

__all__ = ["map_groups", "PARALLEL_ABOVE", "NATIVE_PARALLEL_ABOVE", "SCRATCH_KEPT_BYTES", "scratch_buffer",
           "part_scratches", "release_scratch", "single_threaded_here", "single_threaded_while", "Crew"]

T = TypeVar("T")

#: Fewest scores in a call (over all its groups) for :func:`map_groups` to use threads. Below it the
#: groups run on PyTorch's intra-op threads, which were faster in every round from 2^21 to 2^23
#: scores, while the Python threads were at 4 x 8, n = 1024 and 1 x 8, n = 4096 (2^25 and 2^27;
#: ``python -m benchmarks parallel``, benchmarks/results/parallel.md). The likely cause: after each parallel region the OpenMP
#: runtime's idle threads spin (GNU OpenMP's default wait policy), keeping a core from the Python
#: workers, which costs most in calls of tens of milliseconds. The conformance suite sets 0 to test
#: the threads.
PARALLEL_ABOVE = 1 << 24

#: Fewest scores in a call whose native groups cannot occupy every thread (fewer slices than threads, e.g. one slice
#: at n = 1024; any group where the library has no OpenMP) for :func:`map_groups` to use threads: intra-op threads
#: leave cores idle during those C calls; in small calls the threads' start and the GIL cost more than that.
#: Groups of at least as many slices as threads split them over PyTorch's OpenMP threads in C, and take
#: :data:`PARALLEL_ABOVE` (:func:`~.scaling.parallel_above`). ``python -m benchmarks parallel`` times both modes at each size.
NATIVE_PARALLEL_ABOVE = 1 << 23

#: Bytes of CPU scratch memory (the workers' tile buffers) kept between calls for the next one: a fresh
#: 64 MiB tile (one 4096 x 4096 float32 slice) is page faults on every call, which made a 5-iteration
#: forward+backward of 1 x 2 such slices about 9 % slower (docs/speed.md, ab_issue26_scratch). A call's
#: scratch is kept only if the kept total stays within this budget.
SCRATCH_KEPT_BYTES = 256 << 20

_kept: list[dict] = []  # scratch dicts of finished calls, for the next ones
_kept_lock = threading.Lock()


def _scratch_bytes(scratch: dict) -> int:
    """Bytes of the tensors in a scratch dict, and in the dicts listed in it (:func:`part_scratches`)."""
    total = 0
    for value in scratch.values():
        if isinstance(value, torch.Tensor):
            total += value.untyped_storage().nbytes()
        elif isinstance(value, list):
            total += sum(_scratch_bytes(inner) for inner in value)
    return total


def _take_scratch(device: torch.device) -> dict:
    """A scratch dict for one worker: a kept one on the CPU, else a new one."""
    if device.type == "cpu":
        with _kept_lock:
            if _kept:
                return _kept.pop()
    return {}


def _keep_scratch(scratch: dict, device: torch.device) -> None:
    """Keep a worker's scratch for a later call, within :data:`SCRATCH_KEPT_BYTES` (CPU only: on GPUs
    PyTorch's caching allocator already reuses memory)."""
    if device.type != "cpu" or not scratch:
        return
    size = _scratch_bytes(scratch)
    with _kept_lock:
        if sum(_scratch_bytes(s) for s in _kept) + size <= SCRATCH_KEPT_BYTES:
            _kept.append(scratch)


def scratch_buffer(scratch: dict, name: str, size: int, like: torch.Tensor) -> torch.Tensor:
    """``size`` elements of uninitialised memory (1-D, the dtype and device of ``like``) from a worker's
    ``scratch`` dict, under ``name``: the buffer held there when it is large enough and of the same dtype
    and device, else a new one, held for the next call (on the CPU the dicts outlive calls: memory used
    again is not faulted in and zeroed by the kernel again)."""
    held = scratch.get(name)
    if held is None or held.numel() < size or held.dtype != like.dtype or held.device != like.device:
        held = scratch[name] = like.new_empty(size)
    return held[:size]


def part_scratches(scratch: dict, parts: int) -> list[dict]:
    """One scratch dict for each of ``parts`` workers that share one group (:meth:`Crew.run`):
    ``scratch`` itself for the first, dicts kept in it (under ``"parts"``) for the others, so that they live and are
    kept as long as it."""
    if parts <= 1:
        return [scratch]
    extra = scratch.setdefault("parts", [])
    extra.extend({} for _ in range(parts - 1 - len(extra)))
    return [scratch] + extra[:parts - 1]


def release_scratch() -> None:
    """Free the scratch memory kept between calls (it is allocated again by the next large call)."""
    with _kept_lock:
        _kept.clear()


@functools.lru_cache(maxsize=None)
def _runtime() -> tuple[Callable[[int], int], Callable[[int], int] | None, Callable[[], int] | None] | None:
    """The per-thread setters of the libraries PyTorch loaded: ``(omp_set_num_threads,
    MKL_Set_Num_Threads_Local or None, MKL_Get_Max_Threads or None)`` (MKL's C interface, arguments
    by value), or ``None`` when PyTorch does not use OpenMP or its runtime is not found."""
    if "OpenMP" not in torch.__config__.parallel_info():
        return None
    names = ("libgomp.so.1", "libiomp5.so", "libomp.so", "libomp.dylib", "libiomp5md.dll", "libtorch_cpu.so",
             "libtorch_cpu.dylib")
    libraries = [None] + [os.path.join(os.path.dirname(torch.__file__), "lib", name) for name in names]
    found: dict = {}
    for path in libraries:
        try:
            library = ctypes.CDLL(path)
        except (OSError, TypeError):  # not there (or CDLL(None) on Windows)
            continue
        for symbol in ("omp_set_num_threads", "MKL_Set_Num_Threads_Local", "MKL_Get_Max_Threads"):
            if symbol not in found and hasattr(library, symbol):
                found[symbol] = getattr(library, symbol)
    if "omp_set_num_threads" not in found:
        return None
    return found["omp_set_num_threads"], found.get("MKL_Set_Num_Threads_Local"), found.get("MKL_Get_Max_Threads")


def single_threaded_here() -> bool:
    """Make the calling thread's PyTorch operations single-threaded (OpenMP and MKL), leaving every
    other thread, and the count PyTorch gives new threads, as they were. ``True`` when verified
    (PyTorch and MKL both report one thread here), ``False`` when not possible.

    Meant for a worker thread that the caller starts and ends: the setting lives as long as it."""
    runtime = _runtime()
    if runtime is None:
        return False
    omp_threads, mkl_threads, mkl_max = runtime
    torch.get_num_threads()  # PyTorch's per-thread initialisation first: it would undo the settings below
    omp_threads(1)
    if mkl_threads is not None:
        mkl_threads(1)
    return torch.get_num_threads() == 1 and (mkl_max is None or mkl_max() == 1)


@contextlib.contextmanager
def single_threaded_while():
    """Within the block, the calling thread's PyTorch operations single-threaded (OpenMP and MKL, this thread only),
    restored afterwards; nothing where the per-thread setting cannot be reached (:func:`single_threaded_here`).

    For a thread that works beside single-threaded workers (:class:`Crew`): with its intra-op threads, its
    operations would take the workers' cores, and the OpenMP pool's threads spin after each one (GNU OpenMP's
    default wait policy)."""
    runtime = _runtime()
    if runtime is None:
        yield
        return
    omp_threads, mkl_threads, _ = runtime
    before = torch.get_num_threads()
    omp_threads(1)
    mkl_before = mkl_threads(1) if mkl_threads is not None else None
    try:
        yield
    finally:
        omp_threads(before)
        if mkl_threads is not None:
            mkl_threads(mkl_before)


class Crew:
    """The calling thread and ``workers - 1`` Python threads that run the parts of one pass after another
    (:meth:`run`): started once (for a call), each worker single-threaded (:func:`single_threaded_here`), so a
    pass costs a hand-off, not a thread's start (and the first products of a new thread in the BLAS). Use as a
    context manager; within it the calling thread is single-threaded too (:func:`single_threaded_while`). Where a
    worker cannot be made single-threaded, every part runs on the calling thread."""

    def __init__(self, workers: int):
        self.workers = max(1, workers)
        self._jobs = [queue.SimpleQueue() for _ in range(self.workers - 1)]
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._alone = False
        self._grad_mode = torch.is_grad_enabled()
        self._single = single_threaded_while()

    def __enter__(self) -> "Crew":
        self._single.__enter__()
        for i, jobs in enumerate(self._jobs):
            thread = threading.Thread(target=self._work, args=(jobs,), name=f"sinkformer-part-{i + 1}", daemon=True)
            thread.start()
            self._threads.append(thread)
        started = [self._done.get() for _ in self._threads]
        self._alone = not all(started)
        return self

    def __exit__(self, *exc) -> None:
        for jobs in self._jobs:
            jobs.put(None)
        for thread in self._threads:
            thread.join()
        self._single.__exit__(*exc)

    def _work(self, jobs: queue.SimpleQueue) -> None:
        if not single_threaded_here():
            self._done.put(False)
            return
        self._done.put(True)
        with torch.set_grad_enabled(self._grad_mode):
            while (job := jobs.get()) is not None:
                self._done.put(_take_parts(*job))

    def run(self, part: Callable[[int, dict], None], parts: int, scratches: list[dict]) -> None:
        """``part(p, scratch)`` for ``p < parts``, each member of the crew taking the next part when it is free
        (a member that shares its core with another process takes fewer) with its own ``scratch``
        (``scratches[i]`` for member ``i``, the calling thread being member 0; at least :attr:`workers`). A part's
        work must not depend on which member runs it. Returns when every part has ended, raising the first error."""
        if len(scratches) < self.workers:
            raise ValueError(f"scratches: one per member of a crew of {self.workers} was expected, "
                             f"got {len(scratches)}")
        members = 1 if self._alone else min(self.workers, parts)
        taken = itertools.count()  # next() on a count is atomic under the GIL: each part runs once
        for i in range(1, members):
            self._jobs[i - 1].put((part, parts, taken, scratches[i]))
        errors = [_take_parts(part, parts, taken, scratches[0])]
        errors += [self._done.get() for _ in range(1, members)]
        errors = [error for error in errors if error is not None]
        if errors:
            raise errors[0]


def _take_parts(part: Callable[[int, dict], None], parts: int, taken, scratch: dict) -> BaseException | None:
    """``part(p, scratch)`` for the parts ``p = next(taken)`` while ``p < parts``: a member's share of
    :meth:`Crew.run`. Returns the error that stopped it, if any."""
    try:
        while (p := next(taken)) < parts:
            part(p, scratch)
    except BaseException as error:  # noqa: BLE001 - raised again in the caller
        return error
    return None


def map_groups(starts: list[int], work: Callable[[int, dict], T], device: torch.device, scores: int,
               above: int | None = None) -> list[T]:
    """``[work(start, scratch) for start in starts]``, on the CPU in parallel when worthwhile.

    ``scores``: the call's total number of scores (``B·n·m``). Threads are used on the CPU when
    there are at least two groups, at least two intra-op threads, ``scores >= above`` (default
    :data:`PARALLEL_ABOVE`; :func:`~.scaling.parallel_above` chooses for the engines), and the workers
    can be made single-threaded without touching other threads (:func:`single_threaded_here`); otherwise
    the groups run in order on the calling thread.
    """
    workers = min(len(starts), torch.get_num_threads()) if device.type == "cpu" else 1
    if workers <= 1 or scores < (PARALLEL_ABOVE if above is None else above) or _runtime() is None:
        scratch = _take_scratch(device)
        results = [work(start, scratch) for start in starts]
        _keep_scratch(scratch, device)
        return results
    results: list = [None] * len(starts)
    errors: list[BaseException] = []
    fallback = threading.Event()  # a worker could not be made single-threaded: the caller runs the rest
    taken = itertools.count()  # next() on a count is atomic under the GIL: each group runs once
    grad_mode = torch.is_grad_enabled()

    def take(scratch: dict) -> None:
        while not errors:
            i = next(taken)
            if i >= len(starts):
                _keep_scratch(scratch, device)
                return
            results[i] = work(starts[i], scratch)

    def worker() -> None:
        if not single_threaded_here():
            fallback.set()
            return
        try:
            with torch.set_grad_enabled(grad_mode):
                take(_take_scratch(device))
        except BaseException as error:  # noqa: BLE001 - raised again in the caller
            errors.append(error)

    threads = [threading.Thread(target=worker, name=f"sinkformer-group-{i}", daemon=True) for i in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if fallback.is_set() and not errors:
        take(_take_scratch(device))
    if errors:
        raise errors[0]
    return results
