r"""Native CPU passes of the scaling domain: a group of whole slices without masks in one C call per direction, and
the per-block operators of larger slices.

The tiled engine's scaling domain (:mod:`.scaling`) composes PyTorch operations: a few dozen per group and
direction, each a pass over the group's tile. Where a group is whole slices that the engine takes as cache blocks
(:func:`~.sizes.cache_blocks`) and has no mask, no dropout, a fixed ``n_iters`` and a stored tile, this module
runs the same arithmetic with the matrix products still PyTorch's and everything between them in C
(``native_scaling.c``), every slice visited while it sits in a core's cache:

* **forward**: :math:`S = \mathrm{scale}\,QK^\top` (``baddbmm``), then in C the double shift
  (:func:`~.problem.double_shift`), :math:`\tilde K = e^{S - r_i - c_j}` in place and the ``n_iters``
  normalisations :math:`u \leftarrow a \oslash \tilde K\tilde v`, :math:`\tilde v \leftarrow b \oslash
  \tilde K^\top u` from :math:`\tilde v = e^{c}` (a row normalisation and the next column sums in one pass);
  then :math:`\mathrm{out} = u \odot \tilde K(\tilde v \odot V)` (``bmm``). It returns the shifts and the
  iterates in :class:`~.scaling.GroupState`'s layout, so either backward can follow it.
* **backward**: :math:`dV = \tilde v \odot \tilde K^\top(u \odot dO)` and :math:`G = \mathrm{diag}(u)\,dO\,V^\top
  \mathrm{diag}(\tilde v)` (``bmm``), then in C the reverse recursion through the scalings and
  :math:`dS = \mathrm{scale}\,\tilde K \odot (G + XY^\top)` in ``G``'s memory (the formula of
  :func:`~.scaling.scaling_backward`); then :math:`dQ = dS\,K`, :math:`dK = dS^\top Q` (``bmm``).

**Row blocks** (slices larger than the engine takes whole, and the streamed engine's blocks): the composed
passes keep their loops over the blocks and their products, and without a mask each block's operations are one
C call on the block in cache (:func:`native_row_blocks <.scaling.native_row_blocks>`): :func:`rows_first` (the
first sweep with its online column shift), :func:`rows_rescale` (its ``E`` made :math:`\tilde K`),
:func:`rows_sweep` (a row normalisation and the next column sums), :func:`rows_kernel` (:math:`\tilde K`
recomputed) and :func:`rows_step` (a row step of the backward's recursion). Their marginals are the problem's.

Marginals of the whole-slice passes: every row ``a = 1``, every column ``b = n/m`` (no mask). The float32
exponential is a polynomial (Cephes' ``expf``, within 2 ulp; 0 below :math:`e^{-87.3}`), float64 uses the C
library's ``exp``.

Each C call splits its group's slices over the calling thread's PyTorch threads where the library is built
with OpenMP, which it is only where PyTorch's OpenMP runtime is GNU's (``libgomp.so.1``, already loaded: the
library binds to that copy, so both share one pool of threads); elsewhere it runs the slices in order. Slices
are independent: the results do not depend on the thread count.

The C source is compiled at first use with the machine's C compiler (``$CC``, else ``cc`` or ``gcc``;
``-O3 -march=native``, and ``-fopenmp`` as above) into ``$SINKFORMER_CACHE`` (default
``~/.cache/sinkformer``), once per source, compiler and CPU. Without a compiler (a ``RuntimeWarning`` says so
once), or with ``SINKFORMER_NATIVE=0`` in the environment, the engine composes PyTorch operations as before (the
same results to rounding, slower at short sequences); :func:`status` says which and why.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch
from torch import Tensor

from .._capture import when_dynamo_loads
from ..provenance import cpu_model
from . import sizes

__all__ = ["ENABLED", "FLAGS", "OPENMP", "status", "library", "available", "threaded", "forward", "recompute",
           "backward", "forward_work", "backward_work", "tiles", "rows_first", "rows_rescale", "rows_sweep",
           "rows_step", "rows_kernel"]

SOURCE = Path(__file__).with_name("native_scaling.c")
#: compiler flags: optimised for this CPU; the loops vectorise through ``omp simd``
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-ffp-contract=fast", "-shared", "-fPIC")
#: ... plus this where PyTorch's OpenMP runtime is GNU's (:func:`_shares_pytorchs_openmp`): the passes then split a
#: group's slices over the calling thread's OpenMP threads, in PyTorch's own pool
OPENMP = "-fopenmp"
#: whether the engine may use the native passes (``SINKFORMER_NATIVE=0``: never; tests switch it)
ENABLED = os.environ.get("SINKFORMER_NATIVE", "1") != "0"

_lock = threading.Lock()
_DTYPES = {torch.float32: ("f32", ctypes.c_float), torch.float64: ("f64", ctypes.c_double)}


def status() -> str:
    """One line: whether the native passes are in use here, and if not, why."""
    if not ENABLED:
        return "native passes off (SINKFORMER_NATIVE=0)"
    lib, reason = library()
    if lib is None:
        return f"native passes unavailable: {reason}"
    how = "slices split over PyTorch's OpenMP threads" if lib.sinkhorn_threaded() else "one thread per call"
    return f"native passes on ({how}): {lib._name}"


@functools.lru_cache(maxsize=None)
def library() -> tuple[ctypes.CDLL | None, str]:
    """The compiled passes (built on first call, then cached on disk) and ``""``; or ``None`` and the reason, which
    a ``RuntimeWarning`` also gives once (``SINKFORMER_NATIVE=0`` never asks, so never warns)."""
    lib, reason = _build()
    if lib is None:
        warnings.warn(f"sinkformer: the native CPU passes are unavailable ({reason}); Sinkhorn attention on the CPU "
                      "runs composed PyTorch operations instead: the same results, slower at short sequences. Install "
                      "a C compiler, or set SINKFORMER_NATIVE=0 to choose the composed passes", RuntimeWarning,
                      stacklevel=2)
    return lib, reason


def _build() -> tuple[ctypes.CDLL | None, str]:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        return None, "no C compiler found (set CC, or install gcc)"
    try:
        source = SOURCE.read_bytes()
    except OSError as error:
        return None, f"the C source is missing ({error})"
    candidates = _flag_sets()
    key = hashlib.sha256(b"\0".join([source, repr(candidates).encode(), compiler.encode(), cpu_model().encode(),
                                     platform.machine().encode(), _cpu_flags()])).hexdigest()[:16]
    folder = Path(os.environ.get("SINKFORMER_CACHE") or Path.home() / ".cache" / "sinkformer") / "native"
    path = folder / f"sinkhorn-{key}.so"
    with _lock:
        if not path.exists():
            try:
                folder.mkdir(parents=True, exist_ok=True)
                with tempfile.TemporaryDirectory(dir=folder) as tmp:
                    built = Path(tmp) / path.name
                    for flags in candidates:
                        run = subprocess.run([compiler, *flags, str(SOURCE), "-o", str(built), "-lm"],
                                             capture_output=True, text=True)
                        if run.returncode == 0:
                            break
                    else:
                        return None, f"{compiler} failed: {run.stderr.strip()[-300:]}"
                    os.replace(built, path)  # atomic: a concurrent process loads one whole library or builds its own
            except OSError as error:
                return None, f"could not build in {folder}: {error}"
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as error:
            return None, f"could not load {path}: {error}"
    P, I64, INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    for suffix, real in _DTYPES.values():
        getattr(lib, f"sinkhorn_forward_{suffix}").argtypes = [P, I64, I64, I64, I64, INT, real, real, P, P, P, P, P,
                                                               INT]
        getattr(lib, f"sinkhorn_backward_{suffix}").argtypes = [P, P, I64, I64, I64, I64, I64, INT, real, real, P, P,
                                                                real, P, INT]
        getattr(lib, f"sinkhorn_kernel_{suffix}").argtypes = [P, I64, I64, I64, I64, P, P, INT]
        getattr(lib, f"rows_first_{suffix}").argtypes = [P, I64, I64, P, P, P, P, P, P, P]
        getattr(lib, f"rows_rescale_{suffix}").argtypes = [P, I64, I64, P, P, P]
        getattr(lib, f"rows_sweep_{suffix}").argtypes = [P, I64, I64, P, P, P, P]
        getattr(lib, f"rows_step_{suffix}").argtypes = [P, I64, I64, P, P, P, P, P, P]
    return lib, ""


def _flag_sets() -> tuple[tuple[str, ...], ...]:
    """The flags to try, in order: with OpenMP where it shares PyTorch's runtime, then without; each with
    ``-march=native``, then without (some compilers refuse it, e.g. older Apple clang)."""
    generic = tuple(f for f in FLAGS if f != "-march=native")
    plain = (FLAGS, generic)
    return tuple((*flags, OPENMP) for flags in plain) + plain if _shares_pytorchs_openmp() else plain


def _shares_pytorchs_openmp() -> bool:
    """Whether a library built with ``-fopenmp`` (GCC: ``libgomp.so.1``) would use PyTorch's own OpenMP runtime:
    PyTorch parallelises with OpenMP and ``libgomp.so.1`` is already loaded (the loader then binds the library to
    that copy: one pool of threads, no second runtime spinning beside PyTorch's)."""
    if "OpenMP" not in torch.__config__.parallel_info() or not hasattr(os, "RTLD_NOLOAD"):
        return False
    try:
        ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD)
    except OSError:
        return False
    return True


def available() -> bool:
    """Whether the passes are compiled and loaded here: to ``torch.compile``, a constant of the traced program
    (``assume_constant_result``, registered when Dynamo loads; the engine asks it outside its custom ops, where
    Dynamo would otherwise trace the build's file checks)."""
    return library()[0] is not None


when_dynamo_loads(lambda dynamo: dynamo.assume_constant_result(available))


def threaded() -> bool:
    """Whether the loaded passes split a group's slices over OpenMP threads (else one thread runs them in order)."""
    lib = library()[0]
    return lib is not None and bool(lib.sinkhorn_threaded())


def _cpu_flags() -> bytes:
    """The instruction sets this CPU reports (Linux: the ``flags`` line of ``/proc/cpuinfo``; else empty): part of
    the library's key, so that machines of one model name whose virtual CPUs offer other instructions (a shared
    cache folder) never load code built with ``-march=native`` for another."""
    try:
        with open("/proc/cpuinfo", "rb") as info:
            return next((line for line in info if line.startswith(b"flags")), b"")
    except OSError:
        return b""


def _function(direction: str, tile: Tensor, family: str = "sinkhorn"):
    """The C function ``{family}_{direction}`` for ``tile``'s dtype. The row-block operators index ``tile`` as a
    contiguous array (else ``ValueError``); the whole slices' passes (``family="sinkhorn"``) take its rows
    :func:`_rows` apart."""
    if family == "rows" and not tile.is_contiguous():
        raise ValueError(f"the native passes need a contiguous tile, got strides {tile.stride()} for shape "
                         f"{tuple(tile.shape)}")
    return getattr(library()[0], f"{family}_{direction}_{_DTYPES[tile.dtype][0]}")


def tiles(memory: Tensor, c: int, n: int, m: int) -> Tensor:
    """``c`` tiles ``(c, n, m)`` in ``memory`` (1-D with at least ``c n ld`` elements, or ``(c, n, ld)``), their
    rows :func:`~.sizes.tile_row_stride` ``ld`` elements apart: a view."""
    ld = sizes.tile_row_stride(m, memory.element_size())
    if memory.dim() != 3:
        memory = (memory if memory.numel() == c * n * ld else memory[:c * n * ld]).view(c, n, ld)
    return memory if ld == m else memory[..., :m]


def _rows(tile: Tensor) -> tuple[object, int]:
    """The data pointer of ``tile (c, n, m)`` and the elements between its rows, ``ld``: rows contiguous, ``ld >=
    m`` apart, slices ``n ld`` apart (the C code's layout: :func:`tiles`, or a contiguous tile), else
    ``ValueError``."""
    c, n, m = tile.shape
    ld = tile.stride(1) if n > 1 else tile.stride(0) if c > 1 else m  # one row a slice: the slices' own stride
    if tile.stride(2) != 1 and m > 1 or ld < m or c > 1 and tile.stride(0) != n * ld:
        raise ValueError(f"the native passes need a tile whose rows are contiguous and whose slices follow one "
                         f"another, got strides {tile.stride()} for shape {tuple(tile.shape)}")
    return tile.data_ptr(), ld


def _threads(c: int) -> int:
    """Threads for a call over ``c`` slices: the calling thread's PyTorch thread count (one in
    :func:`~.cpu_parallel.map_groups`' workers), at most ``c``; 1 where the library runs without OpenMP."""
    return max(1, min(c, torch.get_num_threads())) if threaded() else 1


def _outer(tile: Tensor, a: Tensor, b: Tensor, alpha: float, work: Tensor, at: int = 0) -> None:
    """``tile (c, n, m) = alpha a b^T`` for ``a (c, n, p)``, ``b (c, m, p)``: one batched product. Where the tile's
    rows are padded (:func:`tiles`), over its whole rows, ``b`` copied into ``work`` (from element ``at``, ``c ld
    p`` elements) with ``ld - m`` rows of zeros: a product into a view whose rows are not contiguous would run
    slice by slice."""
    c, n, m = tile.shape
    ld = _rows(tile)[1]
    if ld == m:
        tile.baddbmm_(a, b.transpose(1, 2), beta=0.0, alpha=alpha)
        return
    padded = work[at:at + c * ld * b.shape[-1]].view(c, ld, b.shape[-1])
    padded[:, :m].copy_(b)
    padded[:, m:].zero_()
    tile.as_strided((c, n, ld), tile.stride()).baddbmm_(a, padded.transpose(1, 2), beta=0.0, alpha=alpha)


def forward_work(c: int, m: int, d: int, e: int, dtype: torch.dtype) -> int:
    """Elements of :func:`forward`'s ``work`` for a group of ``c`` slices ``m`` wide, keys of width ``d`` and values
    of width ``e`` (:func:`_outer`'s keys; :math:`\\tilde v \\odot V`)."""
    return c * max(sizes.tile_row_stride(m, dtype.itemsize) * d, m * e)


def forward(tile: Tensor, q: Tensor, k: Tensor, v: Tensor, scale: float, n_iters: int, out: Tensor,
            work: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The forward of one group: ``tile (c, n, m)`` (rows as :func:`_rows` reads them) ends holding
    :math:`\\tilde K`; writes ``out (c, n, e)``; returns the shifts ``(c, n)``, ``(c, m)`` and the iterates ``us
    (c, n, Lu)`` ``[u1, u3, ..]``, ``vs (c, m, Lv)`` ``[v0, v2, ..]`` (``q (c, n, d)``, ``k (c, m, d)``, ``v (c, m,
    e)``; ``n_iters >= 2``). ``work``: at least :func:`forward_work` elements."""
    c, n, m = tile.shape
    _outer(tile, q, k, scale, work)
    us, vs = tile.new_empty(c, n, (n_iters + 1) // 2), tile.new_empty(c, m, n_iters // 2 + 1)
    threads = _threads(c)
    row_shift, col_shift, sums = tile.new_empty(c, n), tile.new_empty(c, m), tile.new_empty(threads * 2 * m)
    pointer, ld = _rows(tile)
    _function("forward", tile)(pointer, c, n, m, ld, n_iters, 1.0, n / m, us.data_ptr(), vs.data_ptr(),
                               row_shift.data_ptr(), col_shift.data_ptr(), sums.data_ptr(), threads)
    vV = torch.mul(v, vs[..., -1:], out=work[:v.numel()].view(v.shape))
    torch.bmm(tile, vV, out=out).mul_(us[..., -1:])
    return row_shift, col_shift, us, vs


def recompute(tile: Tensor, q: Tensor, k: Tensor, scale: float, row_shift: Tensor, col_shift: Tensor,
              work: Tensor) -> Tensor:
    """:math:`\\tilde K = e^{S - r_i - c_j}` of one group into ``tile (c, n, m)`` (returned) from the forward's
    shifts ``(c, n)``, ``(c, m)``: the forward's values, bit for bit (the same product and operations). ``work``:
    at least :func:`forward_work` elements."""
    c, n, m = tile.shape
    _outer(tile, q, k, scale, work)
    row_shift, col_shift = row_shift.contiguous(), col_shift.contiguous()  # named: their memory must outlive the call
    pointer, ld = _rows(tile)
    _function("kernel", tile)(pointer, c, n, m, ld, row_shift.data_ptr(), col_shift.data_ptr(), _threads(c))
    return tile


def backward_work(c: int, n: int, m: int, e: int, dtype: torch.dtype) -> int:
    """Elements of :func:`backward`'s ``work`` for a group of ``c`` slices ``n x m`` with values of width ``e``
    (``G`` in :func:`tiles`' layout, :math:`u \\odot dO`, :math:`\\tilde v \\odot V` and :func:`_outer`'s copy of
    it)."""
    ld = sizes.tile_row_stride(m, dtype.itemsize)
    return c * (n * ld + (n + m + ld) * e)


def backward(tile: Tensor, q: Tensor, k: Tensor, v: Tensor, us: Tensor, vs: Tensor, dO: Tensor, scale: float,
             n_iters: int, grads: tuple[Tensor, Tensor, Tensor], work: Tensor) -> None:
    """Gradients of one group written into ``grads = (dq, dk, dv)``, from the forward's :math:`\\tilde K`
    (``tile (c, n, m)``), iterates and ``dO (c, n, e)``; ``work``: at least :func:`backward_work` elements
    (``G``, then ``dS``; :math:`u \\odot dO`; :math:`\\tilde v \\odot V`)."""
    c, n, m = tile.shape
    dq, dk, dv = grads
    u, vt = us[..., -1:], vs[..., -1:]
    G, uO_at = tiles(work, c, n, m), c * n * sizes.tile_row_stride(m, work.element_size())
    vV_at = uO_at + dO.numel()
    uO, vV = work[uO_at:vV_at].view(dO.shape), work[vV_at:vV_at + v.numel()].view(v.shape)
    torch.mul(dO, u, out=uO)
    torch.bmm(tile.transpose(1, 2), uO, out=dv).mul_(vt)
    _outer(G, uO, torch.mul(v, vt, out=vV), 1.0, work, vV_at + v.numel())
    threads = _threads(c)
    scratch = tile.new_empty(threads * (n_iters + 1) * (n + m))
    us, vs = us.contiguous(), vs.contiguous()  # named: their memory must outlive the call
    (pointer, ldk), (g, ldg) = _rows(tile), _rows(G)
    _function("backward", tile)(pointer, g, c, n, m, ldk, ldg, n_iters, 1.0, n / m, us.data_ptr(), vs.data_ptr(),
                                scale, scratch.data_ptr(), threads)
    torch.bmm(G, k, out=dq)
    torch.bmm(G.transpose(1, 2), q, out=dk)


# ------------------------------------------------------------------------------------------------
# the composed passes' operators on one row block of one slice (slices larger than a cache block)


def _block(x: Tensor) -> tuple[int, int]:
    """``(R, m)`` of a row block ``x (1, R, m)`` of one slice (the C code reads ``R m`` contiguous elements)."""
    if x.dim() != 3 or x.shape[0] != 1:
        raise ValueError(f"a row block of one slice (1, R, m) was expected, got shape {tuple(x.shape)}")
    return x.shape[1], x.shape[2]


def _pointers(like: Tensor, *operands: tuple[Tensor | None, int]) -> list[int | None]:
    """The data pointers of ``(tensor, elements)`` operands (``None`` for ``None``): each contiguous, of ``like``'s
    dtype and at least that many elements (the C code reads and writes that many), else ``ValueError``."""
    for t, size in operands:
        if t is not None and (not t.is_contiguous() or t.dtype != like.dtype or t.numel() < size):
            raise ValueError(f"the native passes need contiguous {like.dtype} operands of at least {size} elements, "
                             f"got {t.dtype} of shape {tuple(t.shape)} and strides {t.stride()}")
    return [None if t is None else t.data_ptr() for t, _ in operands]


def rows_first(x: Tensor, a: Tensor, row_shift: Tensor, t: Tensor, u: Tensor, col: Tensor | None, top: Tensor,
               work: Tensor) -> None:
    r"""The forward's first sweep over a block ``x (1, R, m)`` of scores, in place (:meth:`~.scaling.Tile.first_sweep`):
    ``x`` ends as :math:`E = e^{x - r_i - t_j}`; writes the row shifts ``row_shift (R)``, the block's column maxima
    ``t (m)`` of :math:`x - r_i` and :math:`u = a \oslash (E e^{t} + [a = 0])` (``a``, ``u``: ``R``); given ``col
    (m)``, adds the block's :math:`e^{t - top'}\odot E^\top u` to it after rescaling it by :math:`e^{top - top'}`,
    with :math:`top' = \max(top, t)` written into ``top (m)``. ``work``: ``2 m`` elements."""
    R, m = _block(x)
    _function("first", x, "rows")(x.data_ptr(), R, m, *_pointers(x, (a, R), (row_shift, R), (t, m), (u, R), (col, m),
                                                                  (top, m), (work, 2 * m)))


def rows_rescale(E: Tensor, t: Tensor, col_shift: Tensor, work: Tensor) -> Tensor:
    r"""The first sweep's block ``E (1, R, m)`` made :math:`\tilde K = E\odot e^{t - c}` in place (returned), from its
    column maxima ``t (m)`` and the column shift ``col_shift (m)``, with the exponential of every other
    :math:`\tilde K` here. ``work``: ``m`` elements."""
    R, m = _block(E)
    _function("rescale", E, "rows")(E.data_ptr(), R, m, *_pointers(E, (t, m), (col_shift, m), (work, m)))
    return E


def rows_sweep(K: Tensor, v: Tensor, a: Tensor, u: Tensor, col: Tensor | None) -> None:
    r"""A forward sweep over a block ``K (1, R, m)`` of :math:`\tilde K`: :math:`u = a \oslash (\tilde K v +
    [a = 0])` and, given ``col (m)``, :math:`col \mathrel{+}= \tilde K^\top u`."""
    R, m = _block(K)
    _function("sweep", K, "rows")(K.data_ptr(), R, m, *_pointers(K, (v, m), (a, R), (u, R), (col, m)))


def rows_step(K: Tensor, ds: Tensor, du: Tensor, factor: Tensor, total: Tensor, dr: Tensor,
              col: Tensor | None) -> None:
    r"""A row step of the reverse recursion over a block ``K (1, R, m)`` of :math:`\tilde K`: ``total = du + K̃ ds``,
    ``dr = total ⊙ factor`` (``R``) and, given ``col (m)``, :math:`col \mathrel{+}= \tilde K^\top dr`."""
    R, m = _block(K)
    _function("step", K, "rows")(K.data_ptr(), R, m, *_pointers(K, (ds, m), (du, R), (factor, R), (total, R), (dr, R),
                                                                (col, m)))


def rows_kernel(x: Tensor, row_shift: Tensor, col_shift: Tensor) -> Tensor:
    r""":math:`\tilde K = e^{x - r_i - c_j}` of a block ``x (1, R, m)`` of scores in place (returned), from the
    shifts ``row_shift (R)``, ``col_shift (m)``: every recomputation of a block gives the same values."""
    R, m = _block(x)
    pointer, ld = _rows(x)
    _function("kernel", x)(pointer, 1, R, m, ld, *_pointers(x, (row_shift, R), (col_shift, m)), 1)
    return x
