"""The tile-size policy of the engines: one set of constants and the functions that read them.

How many (batch·head) slices the tiled engine takes at once (:func:`group_size`), how it covers a
tile with cache blocks (:func:`cache_blocks`), how many query rows a streamed block has
(:func:`stream_rows`, :func:`row_block`), when ``backend="auto"`` streams (:data:`STREAM_ABOVE`), and how
a matrix-vector product is shaped on this CPU (:data:`ROW_VECTOR_PRODUCTS`).
The constants are read at call time (``sizes.X``), so tests can lower them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..provenance import cpu_vendor

__all__ = [
    "TILE_ELEMENTS", "GPU_TILE_ELEMENTS", "CACHE_BLOCK_ELEMENTS", "WHOLE_SLICE_BUDGETS", "BLOCK_ELEMENTS",
    "MIN_BLOCK_ROWS", "SAVED_TILE_SCORES", "SPLIT_TILE_SCORES", "SPLIT_PARTS_PER_CORE", "STREAM_ABOVE", "group_size", "CacheBlocks", "cache_blocks",
    "stream_rows", "row_block", "ROW_VECTOR_PRODUCTS", "MATVEC_LOOP_SLICES",
]

#: Scores per group of (batch·head) slices on the CPU: small enough to stay in cache.
TILE_ELEMENTS = 1 << 20
#: Scores per group on a GPU: a memory budget (512 MiB of float32 per tile), not a cache size.
GPU_TILE_ELEMENTS = 1 << 27
#: Scores per cache block of the tiled engine: each pass over a group's tile visits it in blocks of
#: about this many scores (2 MiB, a core's L2 on the 2-core EPYC the benchmarks run on), and runs
#: every product that needs a block while it is in cache. Against 2^18, one thread, CPU time,
#: forward+backward, 5 iterations, b=4, h=8: n=128 -9 % (one block instead of two), 256 +3 %,
#: 512 -1 %; b=1, n=4096 (128-row blocks instead of 64) -7 %.
CACHE_BLOCK_ELEMENTS = 1 << 19
#: ... but a slice of at most this many budgets is one block: splitting it costs more operations
#: than the cache saves (2-core Xeon, b=4, h=8, n=1024, 5 iterations, forward+backward: 225 ms in
#: whole slices, 246 ms in 256-row blocks; on the EPYC whole slices and 256- or 512-row blocks are
#: within 3 %).
WHOLE_SLICE_BUDGETS = 2
#: Scores per row block of the streamed log domain (blocks over all slices: GPUs, building blocks) ...
BLOCK_ELEMENTS = 1 << 20
#: ... but at least this many query rows per block: thinner blocks waste the matrix products
#: (b=4, h=8, n=2048: forward 2.0 s with 16 rows, 0.8 s with 64). Memory stays linear in ``m``.
MIN_BLOCK_ROWS = 64
#: Calls of at most this many scores (all slices) keep their tiles from the forward for the backward,
#: which then recomputes nothing (b=4, h=8: n <= 256; 8 MiB of float32).
SAVED_TILE_SCORES = 1 << 21
#: Bytes a tile's row is padded by where rows a power of two apart would fall into the same few sets of a cache
#: (:func:`tile_row_stride`): one cache line.
TILE_ROW_PAD_BYTES = 64


def tile_row_stride(m: int, itemsize: int) -> int:
    """Elements from one row of a native tile (:mod:`.native`: the kept tiles, the recomputed ones, ``G``) to the
    next, for slices ``m`` wide of ``itemsize``-byte elements: ``m``, and :data:`TILE_ROW_PAD_BYTES` more where a
    row is a multiple of 512 bytes from 1 KiB on. With rows that many bytes apart, a column of the tile falls into
    a few sets of a core's cache, and MKL's products that read a tile transposed (:math:`dV = \\tilde K^\\top
    (u \\odot dO)`, :math:`dK = dS^\\top Q`) took longer than those reading it as laid out; padded, as long
    (``benchmarks/results/ab_issue26_padded_rows.md``)."""
    row = m * itemsize
    return m + TILE_ROW_PAD_BYTES // itemsize if row >= 1024 and row % 512 == 0 else m


#: Fewest scores per slice for the tiled engine to split each slice's row blocks over the cores, one slice at a
#: time, rather than give each core its own slices (:func:`~.scaling.crew_size`): one stored tile in memory instead
#: of one per core. At n = 4096 (b x h = 4 x 8, 5 iterations, forward+backward, the 2-core AMD EPYC) a 64 MiB tile
#: per core made the peak 1.85x SDPA's, split 1.46x (benchmarks/results/attention.md), at 1.021x the time
#: (1 x 8 slices, ab_issue26_split_rows); n = 2048 split took 1.03-1.08x (informal), and its tiles are a fourth as
#: large: smaller slices keep a tile per core.
SPLIT_TILE_SCORES = 1 << 24
#: ... each pass then in this many parts per core, which the cores take in turn as they are free (a core shared
#: with another process takes fewer); every part sums into its own buffer, so the results do not depend on which
#: core took which part. Informal, n = 4096, 1 x 8 slices, 3 processes each, beside a busy process: 1 part a core
#: 1.57-1.60 s, 2 parts 1.49-1.54 s (idle both 0.87-0.90 s); each part's buffers for D and dK (1 MiB each at
#: n = 4096, d = 64) weigh on the peak: 4 parts a core made it 1.53x SDPA's at b x h = 4 x 8, 2 parts 1.47x.
SPLIT_PARTS_PER_CORE = 2
#: Above this many scores per slice, ``backend="auto"`` streams (never an ``n × m`` tile).
STREAM_ABOVE = 1 << 24
#: Whether the engines' matrix-vector products ``K x`` (``K (c, r, m)``, on the CPU) run as the row-vector
#: products ``x^T K^T``. MKL's batched matrix-vector product is several times slower than
#: the row-vector product on AMD CPUs (EPYC: 4 slices of 256 x 256, 277 us against 62 us, an earlier
#: session's measurement) and 1.1-2.3x faster than it on an Intel Xeon (every block the engine uses, 1 and 2
#: threads: ``benchmarks/results/matvec.md``): so where PyTorch's BLAS is MKL, row-vector products on every
#: CPU but Intel's. The two give the same sums in another order.
ROW_VECTOR_PRODUCTS = torch.backends.mkl.is_available() and cpu_vendor() != "GenuineIntel"
#: ... and, where they do not, blocks of 2 to this many slices multiply each slice on its own
#: (``torch.addmv``) rather than in one batched product, which ran slower there (Xeon: 2 slices of 512 x 512
#: on 2 threads, 82 us against 48; 8 of 256 x 256: faster per slice on 1 thread, slower on 2;
#: ``benchmarks/results/matvec.md`` has every block the engine uses).
MATVEC_LOOP_SLICES = 8


def group_size(slices: int, n: int, m: int, device: torch.device) -> int:
    """How many (batch·head) slices the tiled engine processes at once: a tile of
    :data:`TILE_ELEMENTS` scores on the CPU (cache), :data:`GPU_TILE_ELEMENTS` on a GPU (memory)."""
    budget = TILE_ELEMENTS if device.type == "cpu" else GPU_TILE_ELEMENTS
    return max(1, min(slices, budget // max(1, n * m)))


@dataclass(frozen=True)
class CacheBlocks:
    """How the tiled engine covers a ``(c, n, m)`` tile with cache blocks of about ``budget`` scores,
    each contiguous in memory: ``step`` whole slices per block when one slice fits the budget
    (``rows is None``), else ``rows`` rows of one slice per block (at least one row).

    :meth:`rows_of` and :meth:`slices_of` return the blocks' views of a per-row tensor ``(c, n, ...)``
    and of a per-slice tensor ``(c, ...)`` in block order, made by one ``split`` per call (or per
    slice) rather than one indexing per block: a pass over the tile then costs a handful of
    operations per block."""

    c: int
    n: int
    step: int
    rows: int | None

    def largest(self, m: int) -> int:
        """Scores in the largest block of a ``(c, n, m)`` tile."""
        return (min(self.step, self.c) * self.n if self.rows is None else min(self.rows, self.n)) * m

    @property
    def index(self) -> list[tuple[slice, slice]]:
        """``(slices, rows)`` of every block."""
        if self.rows is None:
            return [(slice(s, min(self.c, s + self.step)), slice(0, self.n)) for s in range(0, self.c, self.step)]
        return [(slice(s, s + 1), slice(r, min(self.n, r + self.rows)))
                for s in range(self.c) for r in range(0, self.n, self.rows)]

    def rows_of(self, t: Tensor) -> list[Tensor]:
        """Views ``t[slices, rows]`` of every block, ``t`` of shape ``(c, n, ...)``."""
        if self.rows is None:
            return [t] if self.step >= self.c else list(t.split(self.step, 0))
        return [b for s in range(self.c) for b in t[s:s + 1].split(self.rows, 1)]

    def slices_of(self, t: Tensor) -> list[Tensor]:
        """Views ``t[slices]`` of every block, ``t`` of shape ``(c, ...)`` (one view per block)."""
        if self.rows is None:
            return [t] if self.step >= self.c else list(t.split(self.step, 0))
        per_slice = -(-self.n // self.rows)
        return [view for s in range(self.c) for view in [t[s:s + 1]] * per_slice]


def cache_blocks(c: int, n: int, m: int, budget: int) -> CacheBlocks:
    """The :class:`CacheBlocks` of a ``(c, n, m)`` tile: whole slices when a slice has at most
    :data:`WHOLE_SLICE_BUDGETS` times ``budget`` scores, else row ranges of one slice.
    ``budget``: :data:`CACHE_BLOCK_ELEMENTS` by default."""
    per_slice = n * m
    if per_slice <= WHOLE_SLICE_BUDGETS * budget:
        return CacheBlocks(c, n, max(1, budget // max(1, per_slice)), None)
    return CacheBlocks(c, n, 1, max(1, budget // max(1, m)))


def stream_rows(n: int, m: int, chunk_size: int | None) -> int:
    """Query rows per block of the streamed engine on the CPU (one slice per block, ``chunk_size``
    if given): about :data:`CACHE_BLOCK_ELEMENTS` scores, at least :data:`MIN_BLOCK_ROWS` rows."""
    if chunk_size is not None:
        return max(1, min(chunk_size, n))
    return max(1, min(n, max(MIN_BLOCK_ROWS, CACHE_BLOCK_ELEMENTS // max(1, m))))


def row_block(slices: int, n: int, m: int, chunk_size: int | None) -> int:
    """Query rows per block of the streamed log domain, whose blocks span all ``slices`` (GPUs, the
    building blocks of :mod:`.streamed`; ``chunk_size`` if given)."""
    if chunk_size is not None:
        return max(1, min(chunk_size, n))
    return max(1, min(n, max(MIN_BLOCK_ROWS, BLOCK_ELEMENTS // max(1, slices * m))))
