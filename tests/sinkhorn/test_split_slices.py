"""The tiled engine's large slices split into parts over the cores (scaling.crew_size, cpu_parallel.Crew): the
values of one part (the same sums in another order), the dense engine's, and one tile in memory instead of one per
core."""

import threading
import time

import pytest
import torch

import sinkformer
from sinkformer.sinkhorn import cpu_parallel, native, scaling, sizes, tiled
from sinkformer.sinkhorn.problem import Problem
from sinkformer.sinkhorn.scaling import Options, Tile, crew_size


def _inputs(b, h, n, m, dtype, d=16, e=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, length, width, generator=g, dtype=dtype).requires_grad_()
            for length, width in ((n, d), (m, d), (m, e))]


def _run(q, k, v, backend="tiled", **kwargs):
    torch.manual_seed(3)  # the dropout masks
    out = sinkformer.attention(q, k, v, backend=backend, **kwargs)
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(out.dtype)
    return (out, *torch.autograd.grad((out * cotangent).sum(), (q, k, v)))


class Passes(list):
    """``(parts, [(part, thread name, thread count)])`` of every pass; ``slow``: a thread that takes longer."""

    slow: str | None = None


@pytest.fixture
def parts_seen(monkeypatch, two_threads):
    """Small row blocks (40 x 33 slices: blocks of 7 rows), every slice split; records the threads of every part.
    The engine's log domain is refused: it would take a group whose scalings went wrong and hide the error."""
    monkeypatch.setattr(sizes, "CACHE_BLOCK_ELEMENTS", 256)
    monkeypatch.setattr(sizes, "SPLIT_TILE_SCORES", 0)

    def refused(*args, **kwargs):
        raise AssertionError("the scaling domain gave up on a group")

    monkeypatch.setattr(tiled, "_log_forward", refused)
    seen = Passes()
    run = cpu_parallel.Crew.run

    def recording(self, part, parts, scratches):
        ran = []

        def recorded(p, scratch):
            ran.append((p, threading.current_thread().name, torch.get_num_threads()))
            # (so that the worker takes parts too: tiny blocks would all go to the first thread)
            time.sleep(0.01 if threading.current_thread().name == seen.slow else 0.001)
            part(p, scratch)

        run(self, recorded, parts, scratches)
        assert sorted(p for p, _, _ in ran) == list(range(parts))  # every part once
        seen.append((parts, ran))

    monkeypatch.setattr(cpu_parallel.Crew, "run", recording)
    return seen


def _assert_parts_on_two_threads(seen):
    parts = 2 * sizes.SPLIT_PARTS_PER_CORE  # SPLIT_PARTS_PER_CORE a core, at most one a block (6 blocks a slice)
    assert seen and {parts for parts, _ in seen} <= {min(6, parts), parts}
    ran = [r for _, pass_ in seen for r in pass_]
    if cpu_parallel._runtime() is not None:  # (else every part runs on the calling thread, in order)
        assert {name for _, name, _ in ran} == {threading.current_thread().name, "sinkformer-part-1"}
        assert {threads for _, _, threads in ran} == {1}


def _unsplit(monkeypatch, q, k, v, **kwargs):
    with monkeypatch.context() as m:
        m.setattr(sizes, "SPLIT_TILE_SCORES", 1 << 60)
        return _run(q, k, v, **kwargs)


KEEP_LAST = torch.ones(40, 33, dtype=torch.bool)
KEEP_LAST[:20, -5:] = False  # the first part's rows see none of the last 5 keys
KEEP_LAST[:, 3] = False  # and no row sees key 3


@pytest.mark.parametrize("passes", ["native", "composed"])
@pytest.mark.parametrize("kwargs", [{"n_iters": 5}, {"n_iters": 2}, {"n_iters": 21},
                                    {"n_iters": None, "tol": 1e-6, "max_iters": 200},
                                    {"n_iters": 5, "attn_mask": KEEP_LAST}])
@pytest.mark.parametrize("slices", [1, 3])  # per group: each slice's 6 blocks split 3 + 3; 3 slices split 9 + 9
def test_split_slices_equal_the_dense_engine_in_float64(kwargs, passes, slices, parts_seen, monkeypatch):
    monkeypatch.setattr(native, "ENABLED", passes == "native")
    monkeypatch.setattr(sizes, "TILE_ELEMENTS", slices * 40 * 33)
    q, k, v = _inputs(2, 3, 40, 33, torch.float64)
    got, want = _run(q, k, v, **kwargs), _run(q, k, v, backend="dense", **kwargs)
    _assert_parts_on_two_threads(parts_seen)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kwargs", [{"n_iters": 5}, {"n_iters": 5, "dropout_p": 0.2},
                                    {"n_iters": 40, "backward": "implicit"}])
def test_split_slices_equal_one_part(kwargs, dtype, parts_seen, monkeypatch):
    """Dropout and the implicit backward (which the dense engine does not serve) against the same engine unsplit."""
    monkeypatch.setattr(sizes, "TILE_ELEMENTS", 40 * 33)  # groups of one slice, split 3 + 3 blocks
    q, k, v = _inputs(1, 3, 40, 33, dtype)
    got = _run(q, k, v, **kwargs)
    _assert_parts_on_two_threads(parts_seen)
    want = _unsplit(monkeypatch, q, k, v, **kwargs)
    tol = {torch.float32: (2e-5, 1e-6), torch.float64: (1e-12, 1e-14)}[dtype]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=tol[0], atol=tol[1])


def test_crew_size_is_every_thread_for_large_stored_tiles_of_row_blocks_on_the_cpu(two_threads, monkeypatch):
    monkeypatch.setattr(sizes, "CACHE_BLOCK_ELEMENTS", 256)
    q, k, v = (t.detach() for t in _inputs(1, 2, 40, 33, torch.float32))

    def members(q, k, v, **options):
        problem = Problem(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), None, None, [2], 0.25, 5, None, 100)
        return crew_size(problem, Options("unrolled", 0.0, "auto", 1, **{"block": 256, **options}))

    monkeypatch.setattr(sizes, "SPLIT_TILE_SCORES", 40 * 33)
    assert members(q, k, v) == 2
    assert members(q, k, v, rows=7, stored=False) == 1  # the streamed engine: one block of memory per core already
    assert members(q, k, v, block=1 << 20) == 1  # whole slices: each core its own slices
    monkeypatch.setattr(sizes, "SPLIT_TILE_SCORES", 40 * 33 + 1)
    assert members(q, k, v) == 1  # smaller slices keep a tile per core
    monkeypatch.setattr(sizes, "SPLIT_TILE_SCORES", 0)
    torch.set_num_threads(1)
    assert members(q, k, v) == 1


def test_a_crew_needs_row_blocks_of_a_stored_tile(two_threads):
    q, k, v = (t.detach().flatten(0, 1) for t in _inputs(1, 2, 6, 6, torch.float32))
    problem = Problem(q, k, v, None, None, [2], 0.25, 5, None, 100)
    with cpu_parallel.Crew(2) as crew, pytest.raises(ValueError, match="crew: .*row blocks of a stored tile.*whole"):
        Tile(problem, Options("unrolled", 0.0, "auto", 2, block=1 << 20), q.new_empty(72), crew=crew)


def _tiles_kept(size: int) -> int:
    """Tile-sized buffers in the scratch kept between calls."""
    return sum(1 for scratch in cpu_parallel._kept for name, t in scratch.items()
               if name == "memory" and t.numel() >= size)


def test_split_slices_hold_one_tile_instead_of_one_per_core(monkeypatch, two_threads):
    """The point of splitting: a call of 8 slices keeps one tile of scores, not one per core (n = 4096: 64 MiB
    each)."""
    if cpu_parallel._runtime() is None:
        pytest.skip("no per-thread OpenMP setting: the groups run on the calling thread either way")
    monkeypatch.setattr(sizes, "CACHE_BLOCK_ELEMENTS", 256)
    monkeypatch.setattr(sizes, "SAVED_TILE_SCORES", 0)
    monkeypatch.setattr(sizes, "TILE_ELEMENTS", 40 * 33)  # groups of one slice
    monkeypatch.setattr(cpu_parallel, "PARALLEL_ABOVE", 0)  # unsplit: the groups on the cores
    forward = scaling.scaling_forward

    def slow_forward(*args, **kwargs):  # so that both cores take slices (tiny groups: one could take them all)
        time.sleep(0.02)
        return forward(*args, **kwargs)

    monkeypatch.setattr(scaling, "scaling_forward", slow_forward)
    q, k, v = _inputs(2, 4, 40, 33, torch.float32)
    counts = {}
    for split, threshold in (("split", 0), ("unsplit", 1 << 60)):
        monkeypatch.setattr(sizes, "SPLIT_TILE_SCORES", threshold)
        cpu_parallel.release_scratch()
        _run(q, k, v, n_iters=5)
        counts[split] = _tiles_kept(40 * 33)
    cpu_parallel.release_scratch()
    assert counts == {"split": 1, "unsplit": 2}


def test_split_slices_give_the_same_values_whichever_core_takes_which_part(parts_seen, monkeypatch):
    """The parts go to whichever thread is free, and each sums into its own buffer: a call whose calling thread is
    slow (the worker takes most parts) and one whose worker is slow (the caller does) give the same values, bit for
    bit."""
    if cpu_parallel._runtime() is None:
        pytest.skip("no per-thread OpenMP setting: every part runs on the calling thread")
    monkeypatch.setattr(sizes, "TILE_ELEMENTS", 40 * 33)
    q, k, v = _inputs(1, 2, 40, 33, torch.float32)
    results, shares = [], []
    for slow in (threading.current_thread().name, "sinkformer-part-1"):
        parts_seen.clear()
        parts_seen.slow = slow
        results.append(_run(q, k, v, n_iters=5))
        ran = [name for _, pass_ in parts_seen for _, name, _ in pass_]
        shares.append(ran.count("sinkformer-part-1") / len(ran))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    assert shares[0] > 0.5 > shares[1]


def test_split_slices_compile_to_the_eager_values(parts_seen, monkeypatch):
    """Under torch.compile (fullgraph) the engine's ops run the split passes as in eager mode: the crew starts
    inside the custom ops, and the values are the eager ones bit for bit."""
    monkeypatch.setattr(sizes, "TILE_ELEMENTS", 40 * 33)
    q, k, v = _inputs(1, 2, 40, 33, torch.float32)
    fn = lambda q, k, v: sinkformer.attention(q, k, v, n_iters=5, backend="tiled")  # noqa: E731
    results = []
    for f in (fn, torch.compile(fn, fullgraph=True, backend="aot_eager")):
        torch._dynamo.reset()
        out = f(q, k, v)
        results.append((out, *torch.autograd.grad(out.square().sum(), (q, k, v))))
        assert parts_seen
        parts_seen.clear()
    for a, b in zip(*results):
        assert torch.equal(a, b)
