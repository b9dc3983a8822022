"""map_groups: the tiled engine's groups of slices on one Python thread per core."""

import threading
import time

import pytest
import torch

from sinkformer.sinkhorn import cpu_parallel
from sinkformer.sinkhorn.cpu_parallel import map_groups

CPU = torch.device("cpu")


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


@pytest.fixture
def no_kept_scratch():
    cpu_parallel.release_scratch()
    yield
    cpu_parallel.release_scratch()


@pytest.mark.parametrize("scores", [1, cpu_parallel.PARALLEL_ABOVE])  # on the caller, on the workers
def test_scratch_outlives_the_call_and_serves_the_next_one(two_threads, no_kept_scratch, scores):
    def work(start, scratch):
        buffer = scratch.setdefault("memory", torch.empty(1000))
        return buffer.data_ptr()

    first = set(map_groups([0, 1, 2, 3], work, CPU, scores=scores))
    again = set(map_groups([0, 1, 2, 3], work, CPU, scores=scores))
    # the same buffers again (on the workers, a worker that took no group of the first call has a new one)
    assert again == first if scores == 1 else again & first
    cpu_parallel.release_scratch()
    assert not cpu_parallel._kept


def test_scratch_is_kept_within_the_byte_budget_and_never_shared(no_kept_scratch, monkeypatch):
    monkeypatch.setattr(cpu_parallel, "SCRATCH_KEPT_BYTES", 6000)
    big = lambda start, scratch: scratch.setdefault("memory", torch.empty(2000)).data_ptr()  # noqa: E731 (8000 bytes)
    map_groups([0], big, CPU, scores=1)
    assert not cpu_parallel._kept  # over the budget: freed with the call
    small = lambda start, scratch: scratch.setdefault("memory", torch.empty(1000)).data_ptr()  # noqa: E731
    map_groups([0], small, CPU, scores=1)
    assert len(cpu_parallel._kept) == 1
    held = cpu_parallel._take_scratch(CPU)  # a call in progress holds it ...
    assert map_groups([0], small, CPU, scores=1) != held["memory"].data_ptr()  # ... so another call gets its own


def test_attention_with_kept_tiles_equals_fresh_ones_and_a_gpu_keeps_nothing(no_kept_scratch, monkeypatch):
    import sinkformer
    from sinkformer.sinkhorn import sizes

    monkeypatch.setattr(sizes, "SAVED_TILE_SCORES", 0)  # the backward recomputes its tile in scratch too

    g = torch.Generator().manual_seed(0)
    big, small = ((torch.randn(1, 2, n, 8, generator=g, requires_grad=True) for _ in range(3)) for n in (300, 40))
    big, small = list(big), list(small)

    def run(q, k, v):
        out = sinkformer.attention(q, k, v, n_iters=5, backend="tiled")
        return (out, *torch.autograd.grad(out.square().sum(), (q, k, v)))

    fresh = run(*big)
    assert cpu_parallel._kept  # kept for the next call
    run(*small)  # the kept tile serves a smaller call, with other values in it
    for a, b in zip(fresh, run(*big)):
        assert torch.equal(a, b)
    cpu_parallel._keep_scratch({"memory": torch.empty(10, device="meta")}, torch.device("meta"))
    assert all(t.device.type == "cpu" for s in cpu_parallel._kept for t in s.values())


# ----------------------------------------------------------------------------- Crew: the parts of one pass


def test_a_crew_runs_every_part_once_on_the_caller_and_its_single_threaded_workers(two_threads):
    if cpu_parallel._runtime() is None:
        pytest.skip("no per-thread OpenMP setting in this PyTorch build: every part runs on the calling thread")
    seen = []

    def part(p, scratch):
        scratch["calls"] = scratch.get("calls", 0) + 1
        seen.append((p, threading.current_thread().name, torch.get_num_threads(), torch.is_grad_enabled()))
        time.sleep(0.005)

    scratches = [{}, {}]
    with torch.no_grad(), cpu_parallel.Crew(2) as crew:
        assert torch.get_num_threads() == 1  # the caller works beside the workers, single-threaded
        for _ in range(3):
            crew.run(part, 8, scratches)
    assert torch.get_num_threads() == 2  # ... and gets its threads back
    assert sorted(p for p, _, _, _ in seen) == sorted(list(range(8)) * 3)
    assert {name for _, name, _, _ in seen} == {threading.current_thread().name, "sinkformer-part-1"}
    assert {(threads, grad) for _, _, threads, grad in seen} == {(1, False)}
    assert scratches[0]["calls"] + scratches[1]["calls"] == 24 and min(s["calls"] for s in scratches) >= 3
    assert not any(t.name.startswith("sinkformer-part") for t in threading.enumerate())  # ended with the block


def test_a_busy_member_takes_fewer_parts(two_threads):
    """Parts go to whichever member is free: a member slowed down (a core shared with another process) takes
    fewer, instead of holding up the pass with a fixed share."""
    if cpu_parallel._runtime() is None:
        pytest.skip("no per-thread OpenMP setting in this PyTorch build: every part runs on the calling thread")
    main, taken = threading.current_thread().name, []

    def part(p, scratch):
        taken.append(threading.current_thread().name)
        time.sleep(0.04 if threading.current_thread().name == main else 0.005)

    with cpu_parallel.Crew(2) as crew:
        crew.run(part, 12, [{}, {}])
    assert len(taken) == 12 and taken.count(main) <= 3


@pytest.mark.parametrize("failing", [0, 5])
def test_an_error_in_a_part_is_raised_in_the_caller_once_every_member_has_stopped(two_threads, failing):
    ran = []

    def part(p, scratch):
        if p == failing:
            raise ValueError(f"part {p} failed")
        time.sleep(0.005)
        ran.append(p)

    with cpu_parallel.Crew(2) as crew:
        with pytest.raises(ValueError, match=f"part {failing} failed"):
            crew.run(part, 8, [{}, {}])
        count = len(ran)
        time.sleep(0.05)
        assert len(ran) == count  # nothing still running after run() returned
        crew.run(lambda p, scratch: ran.append(-1), 4, [{}, {}])  # the crew still works
    assert ran.count(-1) == 4 and failing not in ran
    assert torch.get_num_threads() == 2


def test_a_crew_whose_workers_cannot_be_made_single_threaded_runs_every_part_on_the_caller(two_threads, monkeypatch):
    monkeypatch.setattr(cpu_parallel, "single_threaded_here", lambda: False)
    seen = []
    with cpu_parallel.Crew(2) as crew:
        crew.run(lambda p, scratch: seen.append((p, threading.current_thread().name)), 4, [{}, {}])
    main = threading.current_thread().name
    assert seen == [(p, main) for p in range(4)]


def test_a_crew_needs_a_scratch_per_member_and_part_scratches_live_in_the_workers_scratch():
    with cpu_parallel.Crew(2) as crew, pytest.raises(ValueError, match="scratches: one per member of a crew of 2.*got 1"):
        crew.run(lambda p, scratch: None, 4, [{}])
    scratch = {"memory": torch.empty(10)}
    assert cpu_parallel.part_scratches(scratch, 1) == [scratch] and "parts" not in scratch
    first = cpu_parallel.part_scratches(scratch, 3)
    assert first[0] is scratch and len(first) == 3
    first[2]["dS"] = torch.empty(5)
    assert cpu_parallel.part_scratches(scratch, 3)[2] is first[2]  # the same dicts on the next call
    assert cpu_parallel._scratch_bytes(scratch) == 15 * 4  # the kept budget counts the parts' buffers
