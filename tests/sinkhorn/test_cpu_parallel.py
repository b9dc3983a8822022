"""map_groups: the tiled engine's groups of slices on one Python thread per core."""

import threading

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
