"""map_groups: the tiled engine's groups of slices on one Python thread per core."""

import threading
import time

import pytest
import torch

from sinkformer.sinkhorn import cpu_parallel
from sinkformer.sinkhorn.cpu_parallel import map_groups

CPU = torch.device("cpu")


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_results_in_order_each_group_once_on_single_threaded_workers(two_threads):
    seen = []

    def work(start, scratch):
        scratch.setdefault("calls", 0)
        scratch["calls"] += 1
        seen.append((start, threading.current_thread().name, torch.get_num_threads()))
        return start * 10

    starts = list(range(0, 40, 4))
    assert map_groups(starts, work, CPU, scores=cpu_parallel.PARALLEL_ABOVE) == [s * 10 for s in starts]
    assert sorted(s for s, _, _ in seen) == starts
    assert {name for _, name, _ in seen} <= {"sinkformer-group-0", "sinkformer-group-1"}
    assert {threads for _, _, threads in seen} == {1}
    assert torch.get_num_threads() == 2  # the caller keeps its intra-op threads


def test_small_calls_and_single_groups_stay_on_the_calling_thread(two_threads):
    def name(start, scratch):
        return threading.current_thread().name

    main = threading.current_thread().name
    assert map_groups([0, 1, 2], name, CPU, scores=cpu_parallel.PARALLEL_ABOVE - 1) == [main] * 3
    assert map_groups([0], name, CPU, scores=1 << 40) == [main]
    torch.set_num_threads(1)
    assert map_groups([0, 1, 2], name, CPU, scores=1 << 40) == [main] * 3


def test_an_error_in_a_group_is_raised_in_the_caller(two_threads):
    def work(start, scratch):
        if start == 3:
            raise ValueError(f"group {start} failed")
        return start

    with pytest.raises(ValueError, match="group 3 failed"):
        map_groups(list(range(8)), work, CPU, scores=1 << 40)
    assert torch.get_num_threads() == 2


def test_grad_mode_of_the_caller_reaches_the_workers(two_threads):
    def mode(start, scratch):
        return torch.is_grad_enabled()

    with torch.no_grad():
        assert map_groups([0, 1], mode, CPU, scores=1 << 40) == [False, False]
    assert map_groups([0, 1], mode, CPU, scores=1 << 40) == [True, True]


def test_workers_leave_other_threads_threading_as_the_user_set_it(two_threads):
    """Threads started while the workers run get the user's thread count, for life (a worker that set
    its own count with torch.set_num_threads(1) made it every new thread's default meanwhile)."""
    if cpu_parallel._runtime() is None:
        pytest.skip("no per-thread OpenMP setting in this PyTorch build: groups run on the calling thread")
    probes, stop = [], threading.Event()

    def probe():
        first = torch.get_num_threads()  # a new thread's first ATen call fixes its count
        torch.ones(8).sum()
        probes.append((first, torch.get_num_threads()))

    def start_probes():
        while not stop.is_set():
            thread = threading.Thread(target=probe)
            thread.start()
            thread.join()

    def work(start, scratch):
        time.sleep(0.02)
        return threading.current_thread().name, torch.get_num_threads()

    spawner = threading.Thread(target=start_probes)
    spawner.start()
    try:
        inside = map_groups(list(range(8)), work, CPU, scores=1 << 40)
    finally:
        stop.set()
        spawner.join()
    assert {threads for _, threads in inside} == {1}  # the workers themselves are single-threaded
    assert {name for name, _ in inside} <= {"sinkformer-group-0", "sinkformer-group-1"}
    assert len(probes) >= 10
    assert set(probes) == {(2, 2)}, f"{sum(p != (2, 2) for p in probes)} of {len(probes)} probes not at 2 threads"
    assert torch.get_num_threads() == 2


def test_a_worker_that_cannot_be_made_single_threaded_leaves_the_groups_to_the_caller(two_threads, monkeypatch):
    monkeypatch.setattr(cpu_parallel, "single_threaded_here", lambda: False)
    main = threading.current_thread().name
    out = map_groups(list(range(6)), lambda start, scratch: (start, threading.current_thread().name), CPU,
                     scores=1 << 40)
    assert out == [(s, main) for s in range(6)]
