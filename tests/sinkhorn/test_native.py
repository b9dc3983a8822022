"""The native CPU passes of the scaling domain (sinkformer.sinkhorn.native): when the tiled engine takes them,
that they compute what the composed PyTorch passes and the dense reference compute (forward, gradients,
kept and recomputed tiles, scalings not to be trusted, threads), and what happens without a compiler."""

from __future__ import annotations

import os
import sys

import pytest
import torch

import sinkformer
from sinkformer.sinkhorn import cpu_parallel, native, scaling, sizes

pytestmark = pytest.mark.skipif(native.library()[0] is None, reason=native.status())  # says why: no compiler, ...


def _inputs(b, h, n, m, dtype, d=16, e=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, length, width, generator=g, dtype=dtype).requires_grad_()
            for length, width in ((n, d), (m, d), (m, e))]


def _run(q, k, v, n_iters, backend="tiled", **kwargs):
    out = sinkformer.attention(q, k, v, n_iters=n_iters, backend=backend, **kwargs)
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(out.dtype)
    return (out, *torch.autograd.grad((out * cotangent).sum(), (q, k, v)))


def _assert_equals_dense_in_float64():
    """A small float64 call of the tiled engine (native passes or not) equals the dense engine's, gradients too."""
    q, k, v = _inputs(1, 2, 6, 6, torch.float64)
    got, want = _run(q, k, v, 5), _run(q, k, v, 5, backend="dense")
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def _count_calls(monkeypatch, names: tuple[str, ...]) -> dict[str, int]:
    """Counts the calls of these functions of the native module, from now on."""
    counted = dict.fromkeys(names, 0)
    for name in counted:
        original = getattr(native, name)

        def wrapper(*args, _name=name, _original=original, **kwargs):
            counted[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(native, name, wrapper)
    return counted


@pytest.fixture
def calls(monkeypatch):
    """Counts the native forward and backward calls of the groups."""
    return _count_calls(monkeypatch, ("forward", "backward"))


@pytest.mark.parametrize("n_iters", [2, 3, 4, 5, 21])
@pytest.mark.parametrize("shape", [(2, 3, 7, 7), (1, 4, 6, 9), (3, 2, 40, 33), (1, 2, 1, 5), (2, 1, 5, 1)])
def test_native_passes_equal_the_dense_reference_in_float64(shape, n_iters, calls):
    q, k, v = _inputs(*shape, torch.float64)
    got, want = _run(q, k, v, n_iters), _run(q, k, v, n_iters, backend="dense")
    assert calls == {"forward": 1, "backward": 1}
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_tile_rows_are_padded_where_they_would_be_a_multiple_of_512_bytes():
    """One cache line (64 bytes) more from 1 KiB rows on, where a row is a multiple of 512 bytes; else none."""
    assert [sizes.tile_row_stride(m, 4) for m in (64, 128, 255, 256, 384, 512, 1000, 1024)] == [
        64, 128, 255, 272, 400, 528, 1000, 1040]
    assert [sizes.tile_row_stride(m, 8) for m in (64, 128, 129, 1024)] == [64, 136, 129, 1032]


@pytest.mark.parametrize("shape", [(3, 2, 40, 33), (2, 4, 1, 9)])  # one query row a slice: the slice stride
@pytest.mark.parametrize("kept", [True, False])
@pytest.mark.parametrize("pad", [3, 16])
def test_padded_tile_rows_equal_the_dense_reference(pad, kept, shape, calls, monkeypatch):
    """Tiles (kept, or recomputed in the backward) and G with rows ``m + pad`` apart: the dense engine's values and
    gradients, and those of unpadded rows to rounding."""
    q, k, v = _inputs(*shape, torch.float64)
    plain = _run(q, k, v, 5)
    if not kept:
        monkeypatch.setattr(sizes, "SAVED_TILE_SCORES", 0)
    monkeypatch.setattr(sizes, "tile_row_stride", lambda m, itemsize: m + pad)
    got, want = _run(q, k, v, 5), _run(q, k, v, 5, backend="dense")
    assert calls == {"forward": 2, "backward": 2}
    for a, b, c in zip(got, want, plain):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(a, c, rtol=1e-13, atol=1e-15)


def test_a_kept_tile_the_composed_passes_wrote_is_laid_out_for_the_native_backward(calls, monkeypatch):
    """A group whose native scalings fail the trust test but whose composed passes keep the scaling domain: the
    kept tile the composed forward wrote is laid out again for the native backward (padded rows)."""
    verdicts = iter([False])
    monkeypatch.setattr(scaling, "_trustworthy", lambda us, vs: next(verdicts, True))
    monkeypatch.setattr(sizes, "tile_row_stride", lambda m, itemsize: m + 5)
    q, k, v = _inputs(1, 2, 8, 8, torch.float64, d=4)
    got, want = _run(q, k, v, 5), _run(q, k, v, 5, backend="dense")
    assert calls == {"forward": 1, "backward": 1}
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(4, 8, 64, 64), (4, 8, 300, 260)])  # tiles kept; recomputed (> SAVED_TILE_SCORES)
def test_native_passes_equal_the_composed_passes(shape, dtype, monkeypatch, calls):
    q, k, v = _inputs(*shape, dtype)
    got = _run(q, k, v, 5)
    assert calls["forward"] >= 1 and calls["backward"] >= 1
    monkeypatch.setattr(native, "ENABLED", False)
    want = _run(q, k, v, 5)
    tol = {torch.float32: (2e-5, 1e-6), torch.float64: (1e-12, 1e-14)}[dtype]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=tol[0], atol=tol[1])


def test_gradients_through_the_native_passes_are_finite_differences():
    q, k, v = (t.detach()[:, :, :5].requires_grad_() for t in _inputs(1, 2, 6, 6, torch.float64))
    assert torch.autograd.gradcheck(lambda q, k, v: sinkformer.attention(q, k, v, n_iters=5, backend="tiled"),
                                    (q, k, v))


def test_float32_tiles_match_pytorchs_exponential():
    """The polynomial e^x of the float32 passes: K̃ as torch.exp gives it, to 2 ulp, and 0 where e^x underflows."""
    g = torch.Generator().manual_seed(0)
    S = torch.randn(3, 21, 30, generator=g) * 30
    tile = S.clone()
    us, vs, rs, cs, work = (S.new_empty(3, 21, 1), S.new_empty(3, 30, 2), S.new_empty(3, 21), S.new_empty(3, 30),
                            S.new_empty(60))
    native._function("forward", tile)(tile.data_ptr(), 3, 21, 30, 30, 2, 1.0, 21 / 30, us.data_ptr(),
                                      vs.data_ptr(), rs.data_ptr(), cs.data_ptr(), work.data_ptr(), 1)
    torch.testing.assert_close(rs, S.amax(-1))
    want = torch.exp(S - rs[..., None] - cs[:, None, :])
    torch.testing.assert_close(tile, want, rtol=2.5e-7, atol=torch.finfo(torch.float32).tiny)
    underflow = want < torch.finfo(torch.float32).tiny
    assert underflow.sum() > 100 and (tile[underflow] == 0).all() and (tile[~underflow] > 0).all()


def test_scalings_not_to_be_trusted_fall_back_to_the_log_domain(calls, monkeypatch):
    """A group whose scalings fail the trust test (:func:`~sinkformer.sinkhorn.scaling._trustworthy`, here made to
    fail: without masks the double shift keeps them moderate) runs the composed passes, then the log domain:
    exactly what the call gives without the native passes."""
    monkeypatch.setattr(scaling, "_trustworthy", lambda us, vs: False)
    q, k, v = _inputs(2, 2, 8, 8, torch.float32, d=4)
    got = _run(q, k, v, 5)
    assert calls == {"forward": 1, "backward": 0}
    monkeypatch.setattr(native, "ENABLED", False)
    want = _run(q, k, v, 5)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    reference = _run(*(t.detach().double().requires_grad_() for t in (q, k, v)), 5, backend="dense")
    for a, b in zip(got, reference):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kwargs", [
    {"key_padding_mask": torch.tensor([[False] * 5 + [True]])},
    {"dropout_p": 0.1},
    {"n_iters": None, "tol": 1e-4},
    {"backward": "implicit", "n_iters": 30},
])
def test_calls_the_native_passes_do_not_serve_take_the_composed_passes(kwargs, calls):
    q, k, v = _inputs(1, 2, 6, 6, torch.float32)
    kwargs = {"n_iters": 5, **kwargs}
    sinkformer.attention(q, k, v, backend="tiled", **kwargs).sum().backward()
    assert calls == {"forward": 0, "backward": 0}


def test_slices_as_large_as_a_whole_slice_block_take_the_native_passes(monkeypatch, calls):
    """The largest slice the engine's cache blocks take whole (WHOLE_SLICE_BUDGETS x CACHE_BLOCK_ELEMENTS
    scores, here lowered) runs natively and equals the composed passes; one score more is a block of rows,
    which the composed passes take."""
    monkeypatch.setattr(sizes, "CACHE_BLOCK_ELEMENTS", 512)
    whole = sizes.WHOLE_SLICE_BUDGETS * 512
    q, k, v = _inputs(2, 1, 32, whole // 32, torch.float64)
    got = _run(q, k, v, 5)
    assert calls == {"forward": 1, "backward": 1}
    monkeypatch.setattr(native, "ENABLED", False)
    want = _run(q, k, v, 5)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    monkeypatch.setattr(native, "ENABLED", True)
    q, k, v = _inputs(2, 1, 32, whole // 32 + 1, torch.float64)
    _run(q, k, v, 5)
    assert calls == {"forward": 1, "backward": 1}


def test_groups_on_threads_give_the_same_results(monkeypatch, calls):
    if torch.get_num_threads() < 2:
        pytest.skip("one intra-op thread: map_groups runs the groups in order")
    q, k, v = _inputs(4, 2, 40, 40, torch.float32)
    alone = _run(q, k, v, 5)
    monkeypatch.setattr(cpu_parallel, "NATIVE_PARALLEL_ABOVE", 0)
    # C calls of one thread each (a library without OpenMP): the groups, a core's share of the slices each, go to
    # a Python thread per core (where the C calls split their slices over the threads, the groups run in order)
    monkeypatch.setattr(native, "threaded", lambda: False)
    threaded = _run(q, k, v, 5)
    assert calls["forward"] >= 3  # one group, then one per core
    for a, b in zip(threaded, alone):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=1e-6)


def test_without_a_compiler_the_engine_says_why_and_composes(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("SINKFORMER_CACHE", str(tmp_path))
    native.library.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="native CPU passes are unavailable.*no-such-compiler"):
            assert native.library()[0] is None
        assert "native passes unavailable" in native.status() and "no-such-compiler" in native.status()
        _assert_equals_dense_in_float64()
    finally:
        monkeypatch.undo()
        native.library.cache_clear()
    assert native.library()[0] is not None


def test_the_library_is_built_once_per_source_and_cpu(monkeypatch, tmp_path):
    monkeypatch.setenv("SINKFORMER_CACHE", str(tmp_path))
    native.library.cache_clear()
    try:
        lib, reason = native.library()
        assert lib is not None and reason == ""
        built = list((tmp_path / "native").glob("sinkhorn-*.so"))
        assert len(built) == 1 and os.path.samefile(lib._name, built[0])
        assert not [p for p in (tmp_path / "native").iterdir() if p.is_dir()]  # no build folder left behind
        assert native.status().startswith("native passes on")
    finally:
        monkeypatch.undo()
        native.library.cache_clear()


def test_uses_native_reads_the_switch(monkeypatch):
    q, k, v = (t.detach().flatten(0, 1) for t in _inputs(1, 2, 6, 6, torch.float32))
    from sinkformer.sinkhorn.problem import Problem
    problem = Problem(q, k, v, None, None, (2,), 0.25, 5)
    options = scaling.Options("unrolled", 0.0, "auto", 2, block=1 << 19)
    assert scaling.uses_native(problem, options)
    monkeypatch.setattr(native, "ENABLED", False)
    assert not scaling.uses_native(problem, options)


def test_tiles_the_c_code_would_misread_are_refused():
    """A whole slices' tile needs contiguous rows and slices that follow one another; a row block a contiguous
    array: ValueError before any C code runs."""
    q, k, v = torch.randn(2, 5, 4), torch.randn(2, 6, 4), torch.randn(2, 6, 3)
    for tile in (torch.zeros(2, 6, 5).transpose(1, 2), torch.zeros(4, 5, 6)[::2], torch.zeros(2, 5, 12)[..., ::2]):
        with pytest.raises(ValueError, match="rows are contiguous and whose slices follow one another"):
            native.forward(tile, q, k, v, 0.5, 3, torch.empty(2, 5, 3), torch.empty(36))
    with pytest.raises(ValueError, match="contiguous tile"):
        native._function("sweep", torch.zeros(1, 6, 5).transpose(1, 2), "rows")
    out = torch.empty(2, 5, 3)  # rows 9 apart, K copied with 3 rows of zeros into work: 2 x 9 x 4 elements
    native.forward(torch.full((2, 5, 9), float("nan"))[..., :6], q, k, v, 0.5, 3, out, torch.full((72,), float("nan")))
    torch.testing.assert_close(out, sinkformer.attention(q, k, v, n_iters=3, scale=0.5, backend="dense"))


@pytest.mark.parametrize("flag", ["-march=native", native.OPENMP])
def test_a_compiler_that_refuses_a_flag_builds_without_it(flag, monkeypatch, tmp_path):
    """Some compilers refuse ``-march=native`` (older Apple clang) or ``-fopenmp`` (Apple clang): the build is tried
    again without it."""
    import shutil

    real = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    script = tmp_path / "cc"
    script.write_text(f'#!/bin/sh\nfor a in "$@"; do [ "$a" = "{flag}" ] && exit 1; done\nexec {real} "$@"\n')
    script.chmod(0o755)
    monkeypatch.setenv("CC", str(script))
    monkeypatch.setenv("SINKFORMER_CACHE", str(tmp_path))
    native.library.cache_clear()
    try:
        assert native.library()[0] is not None
        if flag == native.OPENMP:
            assert not native.threaded() and "one thread per call" in native.status()
        _assert_equals_dense_in_float64()
    finally:
        monkeypatch.undo()
        native.library.cache_clear()


def _needs_threads():
    if not native.threaded():
        pytest.skip(f"the native passes run without OpenMP here ({native.status()})")
    if torch.get_num_threads() < 2:
        pytest.skip("one intra-op thread")


def test_the_passes_give_the_same_values_on_any_number_of_threads():
    """Slices are independent: the forward, the recomputed tile and the backward of a group split over the
    threads equal, bit for bit, those of one thread (5 slices: an uneven split)."""
    _needs_threads()
    q, k, v = (t.detach().flatten(0, 1) for t in _inputs(5, 1, 24, 19, torch.float32))
    dO = torch.randn(5, 24, v.shape[-1], generator=torch.Generator().manual_seed(2))

    def passes():
        tile, out = torch.empty(5, 24, 19), torch.empty(5, 24, v.shape[-1])
        work = torch.empty(native.forward_work(5, 19, q.shape[-1], v.shape[-1], q.dtype))
        shifts_and_iterates = native.forward(tile, q, k, v, 0.25, 5, out, work)
        again = native.recompute(torch.empty(5, 24, 19), q, k, 0.25, *shifts_and_iterates[:2], work)
        grads = tuple(torch.empty_like(t) for t in (q, k, v))
        native.backward(tile, q, k, v, *shifts_and_iterates[2:], dO, 0.25, 5, grads,
                        torch.empty(native.backward_work(*tile.shape, v.shape[-1], tile.dtype)))
        return (tile, out, again, *shifts_and_iterates, *grads)

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = passes()
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(passes(), alone):
        assert torch.equal(a, b)


def test_the_threads_are_pytorchs_own_openmp_runtime():
    """Built with OpenMP, the library binds to the GNU OpenMP runtime PyTorch loaded (a second runtime's threads
    would spin beside PyTorch's): the thread count ``torch.set_num_threads`` sets is the one its runtime reports."""
    _needs_threads()
    lib, threads = native.library()[0], torch.get_num_threads()
    try:
        for count in (1, threads):
            torch.set_num_threads(count)
            assert lib.sinkhorn_max_threads() == count
    finally:
        torch.set_num_threads(threads)


# ------------------------------------------------------------------------------------------------
# row blocks: slices larger than the engine takes whole run the composed passes' loops with C operators


@pytest.fixture
def row_calls(monkeypatch):
    """Counts the C operators on row blocks."""
    return _count_calls(monkeypatch, ("rows_first", "rows_rescale", "rows_sweep", "rows_step", "rows_kernel"))


@pytest.mark.parametrize("backend", ["tiled", "streamed"])
@pytest.mark.parametrize("kwargs", [{"n_iters": 5}, {"n_iters": 2}, {"n_iters": 1}, {"n_iters": 21},
                                    {"n_iters": None, "tol": 1e-6, "max_iters": 200}])
def test_row_blocks_with_native_operators_equal_the_dense_reference_in_float64(backend, kwargs, monkeypatch,
                                                                               row_calls):
    monkeypatch.setattr(sizes, "CACHE_BLOCK_ELEMENTS", 256)  # 40 x 33 slices: blocks of 7 rows
    q, k, v = _inputs(2, 2, 40, 33, torch.float64)
    kwargs = dict(kwargs)
    n_iters = kwargs.pop("n_iters")
    rows = {"chunk_size": 7} if backend == "streamed" else {}
    got, want = _run(q, k, v, n_iters, backend, **rows, **kwargs), _run(q, k, v, n_iters, "dense", **kwargs)
    assert row_calls["rows_first"] == 4 * 6  # 4 slices of 6 blocks, one first sweep each
    assert row_calls["rows_sweep"] > 0 or n_iters in (1, 2)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kwargs", [{"backend": "tiled"}, {"backend": "streamed", "chunk_size": 23},
                                    {"dropout_p": 0.2}, {"backward": "implicit", "n_iters": 60}])
def test_row_blocks_with_native_operators_equal_the_composed_passes(dtype, kwargs, monkeypatch, row_calls):
    """Against the same loops with PyTorch operators (native off): the same sums in another order."""
    monkeypatch.setattr(sizes, "CACHE_BLOCK_ELEMENTS", 2048)
    q, k, v = _inputs(1, 3, 100, 90, dtype, d=32, e=16)

    def run():
        torch.manual_seed(3)  # the dropout masks
        options = {"backend": "tiled", "n_iters": 5, **kwargs}
        return _run(q, k, v, options.pop("n_iters"), **options)

    got = run()
    assert row_calls["rows_first"] and row_calls["rows_sweep"]
    assert bool(row_calls["rows_step"]) == (kwargs.get("backward") != "implicit")  # the implicit backward: no steps
    monkeypatch.setattr(native, "ENABLED", False)
    want = run()
    tol = {torch.float32: (2e-5, 1e-6), torch.float64: (1e-12, 1e-14)}[dtype]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=tol[0], atol=tol[1])


def test_row_blocks_with_a_mask_take_the_composed_operators(monkeypatch, row_calls):
    monkeypatch.setattr(sizes, "CACHE_BLOCK_ELEMENTS", 256)
    q, k, v = _inputs(1, 2, 40, 33, torch.float64)
    keep = torch.ones(1, 33, dtype=torch.bool)
    keep[:, -3:] = False
    _run(q, k, v, 5, key_padding_mask=~keep)
    assert sum(row_calls.values()) == 0


def test_row_operators_refuse_operands_the_c_code_would_misread():
    """Strided, too short or of another dtype (the C code reads and writes R or m contiguous elements of the block's
    dtype), and a block of more than one slice: ValueError before any C code runs."""
    K, a, u, col = torch.rand(1, 4, 6), torch.ones(4), torch.empty(4), torch.zeros(6)
    for v in (torch.rand(6, 2)[:, 0], torch.rand(5), torch.rand(6, dtype=torch.float64)):
        with pytest.raises(ValueError, match="contiguous torch.float32 operands of at least 6 elements"):
            native.rows_sweep(K, v, a, u, col)
    with pytest.raises(ValueError, match=r"a row block of one slice \(1, R, m\)"):
        native.rows_sweep(torch.rand(2, 4, 6), torch.rand(6), a, u, col)
    v = torch.rand(6)
    native.rows_sweep(K, v, a, u, col)  # well-formed operands: u = a / (K v), col = K^T u
    torch.testing.assert_close(u, a / (K[0] @ v))
    torch.testing.assert_close(col, K[0].T @ u)


def test_groups_whose_c_calls_split_their_slices_stay_off_python_threads(monkeypatch):
    """map_groups' threshold: native groups of at least as many slices as threads on a library with OpenMP (the C call
    splits them over every thread) never take the Python threads; composed groups use PARALLEL_ABOVE; native groups
    too small for every thread (one slice, or 4 slices on 16 threads) or without OpenMP use NATIVE_PARALLEL_ABOVE."""
    monkeypatch.setattr(cpu_parallel, "NATIVE_PARALLEL_ABOVE", 11)
    monkeypatch.setattr(cpu_parallel, "PARALLEL_ABOVE", 22)
    monkeypatch.setattr(native, "threaded", lambda: True)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert scaling.parallel_above(False, 1) == scaling.parallel_above(False, 4) == 22
    assert scaling.parallel_above(True, 1) == 11 and scaling.parallel_above(True, 4) == sys.maxsize
    monkeypatch.setattr(torch, "get_num_threads", lambda: 16)
    assert scaling.parallel_above(True, 4) == 11 and scaling.parallel_above(True, 16) == sys.maxsize
    monkeypatch.setattr(native, "threaded", lambda: False)
    assert scaling.parallel_above(True, 16) == 11


@pytest.mark.parametrize("threaded, threads, B, n, want", [
    (True, 2, 32, 1024, 2),  # a slice fills the cache budget: one per thread, the C calls split them
    (True, 2, 1, 1024, 1),  # one slice in all
    (True, 2, 32, 512, 4),  # the budget's 4 slices, already one per thread
    (True, 16, 32, 512, 16),
    (True, 16, 5, 1024, 5),
    (False, 2, 32, 1024, 1),  # no OpenMP in the C calls: a core's share, on Python threads (the budget's one slice)
    (False, 2, 32, 512, 4),
    (False, 16, 32, 512, 2),  # a core's share of a call of at least NATIVE_PARALLEL_ABOVE scores
    (False, 16, 4, 256, 4),  # below NATIVE_PARALLEL_ABOVE: the budget's
])
def test_native_groups_hold_a_slice_per_thread_where_their_c_calls_split_them(monkeypatch, threaded, threads, B, n,
                                                                             want):
    """tiled.call_group: native groups of at least one slice per thread where the C calls split their slices over
    the threads (so the call runs in order, every call on every thread), else a core's share where the call is large;
    the composed passes and graph capture keep sizes.group_size's."""
    from sinkformer.sinkhorn import tiled
    from sinkformer.sinkhorn.sizes import group_size

    monkeypatch.setattr(native, "threaded", lambda: threaded)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    monkeypatch.setattr(cpu_parallel, "NATIVE_PARALLEL_ABOVE", 1 << 23)
    cpu = torch.device("cpu")
    assert tiled.call_group(B, n, n, cpu, True) == want
    assert tiled.call_group(B, n, n, cpu, False) == group_size(B, n, n, cpu)


def test_compiled_calls_ask_whether_the_passes_are_available_without_a_graph_break(monkeypatch):
    """The engine asks whether the passes are loaded outside its custom ops (a large call's group per core):
    under torch.compile(fullgraph=True) that is a constant of the trace, not the build's file checks."""
    monkeypatch.setattr(cpu_parallel, "NATIVE_PARALLEL_ABOVE", 0)  # every call asks
    q, k, v = (t.detach() for t in _inputs(2, 2, 8, 8, torch.float32))
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: sinkformer.attention(q, k, v, n_iters=5, backend="tiled"),
                             fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(q, k, v), sinkformer.attention(q, k, v, n_iters=5, backend="tiled"))
