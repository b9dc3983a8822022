r"""Sinkhorn in the scaling domain on a group's tile, visited in cache blocks: the passes that the
tiled engine (:mod:`.tiled`, the tile stored) and the streamed engine (:mod:`.streamed`, every block
recomputed from ``q`` and ``k`` when a pass visits it, memory linear in ``n``) share.

**The tile.** For a group of ``c`` (batch·head) slices, :class:`Tile` covers the ``(c, n, m)`` scores
:math:`S = \mathrm{scale}\,QK^\top + \mathrm{bias}` with cache blocks (:class:`~.sizes.CacheBlocks`:
rows of one slice, or whole slices). The forward's first pass (:meth:`Tile.first_sweep`) computes the
double shift of :func:`~.problem.double_shift` (every row and column of :math:`x = S - m_i - c_j` has
maximum 0) together with the first row normalisation; every later pass visits :math:`\tilde K = e^{x}`
block by block (:meth:`Tile.visit`), from the stored tile or recomputed by the same operations (so
every recomputation gives the same values, bit for bit). Calls of at most
:data:`~.sizes.SAVED_TILE_SCORES` scores keep the stored tiles for the backward.

**Forward** (:func:`scaling_forward`). From :math:`\tilde v^{(0)} = e^{c}`, each normalisation is
one matrix-vector product: :math:`u \leftarrow a \oslash \tilde K\tilde v`,
:math:`\tilde v \leftarrow b \oslash \tilde K^\top u`. One pass per row normalisation computes ``u``
block by block (final for the block's rows) and, on the same blocks, the column sums of the
following column normalisation; the last one writes :math:`u\odot\tilde K(\tilde v\odot V)`.
``n_iters`` normalisations take :math:`\lceil n\_iters/2\rceil` passes (one more when even).
Scalings whose product reaches :math:`e^{60}` (score ranges of ~1e4) are not trusted: the engine
then runs that group in the log domain (its own fallback).

**Backward** (:func:`scaling_backward`), the exact gradient of the ``n_iters`` map by reverse mode
through the vector recursion, every iteration a rank-one term:

.. math::

    \frac{\partial\ell}{\partial S} = \tilde K \odot\big(\mathrm{diag}(u)\,dP\,\mathrm{diag}(\tilde v) + XY^\top\big),
    \qquad dP = dO\,V^\top .

Pass 1 accumulates :math:`D = \tilde K^\top(u\odot dO)` (so :math:`dV = \tilde v\odot D`) and the
column product of the last row step; each further pass runs a column step and the following row
step; the last one runs the recursion's last two steps and forms ``dS`` block by block (one product
``[u ⊙ dO, X] [ṽ ⊙ V, Y]^T`` of inner size ``e + n_iters``), contracted at once into
:math:`dQ = \mathrm{scale}\,dS\,K` and :math:`dK = \mathrm{scale}\,dS^\top Q`. ``5`` iterations take
3 passes. ``backward="implicit"`` (stored tiles) replaces the recursion by the dual solve of
:func:`~.implicit.implicit_duals` (rank 2).

:func:`run_forward` and :func:`run_backward` run the groups of a call on the CPU's cores
(:func:`~.cpu_parallel.map_groups`) and collect what the custom ops return and save.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from . import cpu_parallel, native, sizes
from .cpu_parallel import Crew, map_groups, part_scratches, scratch_buffer
from .problem import (
    Problem,
    scalings_trusted,
    Tolerance,
    _finite_or_zero,
    column_error,
    converged_tol,
    warn_if_unconverged,
    warn_unbalanced,
)
from .implicit import implicit_duals
from .loop import sinkhorn_loop
from .sizes import CacheBlocks, cache_blocks

__all__ = ["Options", "Tile", "GroupState", "run_forward", "run_backward", "scaling_forward", "scaling_backward",
           "dropout_mask", "implicit_duals_of", "uses_native", "native_row_blocks",
           "parallel_above", "crew_size"]

@dataclass(frozen=True)
class Options:
    """An engine's own arguments, beside the :class:`~.problem.Problem`. ``group``: slices per group;
    ``block``: scores per cache block (:func:`~.sizes.cache_blocks`), or ``rows``: query rows per block
    (the streamed engine); ``stored``: whether the tile is kept (tiled) or recomputed on every visit
    (streamed). Forward and backward use the same groups and blocks, hence the same tile values."""

    backward: str
    dropout_p: float
    domain: str
    group: int
    block: int | None = None
    rows: int | None = None
    stored: bool = True
    engine: str = "tiled"

    def blocks(self, c: int, n: int, m: int) -> CacheBlocks:
        if self.rows is not None:
            return CacheBlocks(c, n, 1, None) if self.rows >= n else CacheBlocks(c, n, 1, self.rows)
        return cache_blocks(c, n, m, self.block)

    def saves_tile(self, problem: Problem) -> bool:
        """Whether the forward keeps the call's tiles :math:`\\tilde K` for the backward (which then
        recomputes nothing): stored tiles on the CPU, a call of at most
        :data:`~.sizes.SAVED_TILE_SCORES` scores, a fixed ``n_iters >= 2`` and no dropout (the tile
        then ends the forward as :math:`\\tilde K`)."""
        p = problem
        return (self.stored and self.starts_in_scaling(p.q.device) and p.B * p.n * p.m <= sizes.SAVED_TILE_SCORES
                and p.tol is None and p.n_iters >= 2 and not self.dropout_p)

    def kept_tiles(self, problem: Problem) -> Tensor:
        """Memory for the tiles the forward keeps for the backward (:meth:`saves_tile`), ``(B, n, ld)`` with
        :func:`~.sizes.tile_row_stride`'s ``ld`` (the native passes' tiles are its ``[..., :m]``, the composed
        passes' each group's first ``c n m`` elements); else an empty tensor."""
        q, B, n, m = problem.q, problem.B, problem.n, problem.m
        return q.new_empty(B, n, sizes.tile_row_stride(m, q.element_size())) if self.saves_tile(problem) \
            else q.new_empty(0)

    def starts_in_scaling(self, device: torch.device) -> bool:
        """Whether a group starts in the scaling domain (``domain="auto"``: on the CPU; GPUs use the
        log domain, which has no data-dependent branch)."""
        return self.domain == "scaling" or (self.domain == "auto" and device.type == "cpu")


@dataclass
class GroupState:
    """What the forward of one group returns: shifts ``(c, n)``, ``(c, m)``; iterates ``(c, n, Lu)``,
    ``(c, m, Lv)`` (scalings, or potentials when ``log_domain``); normalisations run ``(c,)``; the
    :class:`~.problem.Tolerance` (``tol`` mode) and the implicit backward's column error, if any."""

    row_shift: Tensor
    col_shift: Tensor
    us: Tensor
    vs: Tensor
    counts: Tensor
    log_domain: bool
    stop: Tolerance | None = None
    col_error: Tensor | None = None


# ------------------------------------------------------------------------------------------------
# running the groups of a call

#: ``log_forward(group, options, seed, out, row_shift, col_shift) -> GroupState``: an engine's log domain
#: for one group (a :meth:`~.problem.Problem.group`; ``row_shift``/``col_shift``: those of the scaling
#: attempt, or None)
LogForward = Callable[..., GroupState]
#: ``log_backward(grad_out, group, out, options, seed, row_shift, col_shift, fs, gs, counts, grads)``:
#: writes the gradients of one group computed in the log domain into ``grads``
LogBackward = Callable[..., None]


def run_forward(problem: Problem, seed: Tensor | None, options: Options, log_forward: LogForward) -> tuple[Tensor, ...]:
    """The forward of every group; returns ``out (B, n, e)``, the shifts ``(B, n)``, ``(B, m)``, the
    iterates ``(B, n, Lu)``, ``(B, m, Lv)``, the normalisations run ``(B,)``, the domain of each
    slice ``(B,)`` (True: log) and the tiles kept for the backward (:meth:`Options.kept_tiles`, ``(B, n, ld)``;
    else an empty tensor)."""
    q, B, n, m = problem.q, problem.B, problem.n, problem.m
    out = q.new_empty(B, n, problem.v.shape[-1])
    tiles = options.kept_tiles(problem)
    if B == 0:
        lu, lv = problem.history_length(options.backward == "implicit") or (0, 0)
        return (out, q.new_zeros(0, n), q.new_zeros(0, m), q.new_zeros(0, n, lu), q.new_zeros(0, m, lv),
                torch.zeros(0, dtype=torch.int64, device=q.device), torch.zeros(0, dtype=torch.bool, device=q.device),
                tiles)
    scaling = options.starts_in_scaling(q.device)
    native_passes = uses_native(problem, options)
    members = crew_size(problem, options)

    def run(start: int, scratch: dict) -> GroupState:
        sl = slice(start, min(B, start + options.group))
        group = problem.group(sl.start, sl.stop)
        c = sl.stop - sl.start
        if native_passes:
            work = scratch_buffer(scratch, "products", native.forward_work(c, m, q.shape[-1], problem.v.shape[-1],
                                                                           q.dtype), q)
            row_shift, col_shift, us, vs = native.forward(_native_tile(tiles, sl, scratch, n, m, q), group.q, group.k,
                                                          group.v, group.scale, group.n_iters, out[sl], work)
            if _trustworthy(us, vs):
                counts = torch.full((c,), group.n_iters, dtype=torch.int64, device=q.device)
                return GroupState(row_shift, col_shift, us, vs, counts, False)
        if scaling:  # (and a native group whose scalings are not to be trusted: the passes below, then the log domain)
            memory = tiles[sl].view(-1) if tiles.numel() else Tile.memory(problem, options, scratch)
            tile = Tile(group, options, memory, scratch=scratch, crew=crew)
            state = scaling_forward(tile, seed, out[sl], options)
            if state is not None:
                if native_passes and tiles.numel():  # the native backward reads K̃ in its own layout
                    native.tiles(memory, c, n, m).copy_(memory[:c * n * m].view(c, n, m).clone())
                return state
            return log_forward(group, options, seed, out[sl], tile.row_shift, tile.col_shift)
        return log_forward(group, options, seed, out[sl], None, None)

    with _crew(members) as crew:
        states = map_groups(list(range(0, B, options.group)), run, q.device, B * n * m,
                            parallel_above(native_passes, options.group, members))
    implicit = options.backward == "implicit"
    warn_if_unconverged([s.stop for s in states if s.stop is not None], implicit=implicit)
    col_errors = [s.col_error for s in states if s.col_error is not None]
    if implicit and problem.tol is None and col_errors:
        warn_unbalanced(torch.cat(col_errors), problem.n_iters, converged_tol(q.dtype), options.engine)
    logs = [torch.full((s.counts.shape[0],), s.log_domain, dtype=torch.bool, device=q.device) for s in states]
    return (out, _cat([s.row_shift for s in states]), _cat([s.col_shift for s in states]),
            _pad_cat([s.us for s in states]), _pad_cat([s.vs for s in states]), _cat([s.counts for s in states]),
            _cat(logs), tiles)


def run_backward(grad_out: Tensor, problem: Problem, out: Tensor, seed: Tensor | None, row_shift: Tensor,
                 col_shift: Tensor, us: Tensor, vs: Tensor, counts: Tensor, log_domain: Tensor, tiles: Tensor,
                 options: Options, log_backward: LogBackward) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients ``(dq, dk, dv)`` of :func:`run_forward`'s call from what it saved, group by group in
    the domain the forward used (from the kept tiles, if any)."""
    q, k, v, B, n, m = problem.q, problem.k, problem.v, problem.B, problem.n, problem.m
    grad_out = grad_out.contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    logs = log_domain.tolist()
    native_passes = uses_native(problem, options)
    members = crew_size(problem, options)

    def run(start: int, scratch: dict) -> None:
        sl = slice(start, min(B, start + options.group))
        group = problem.group(sl.start, sl.stop)
        grads = (dq[sl], dk[sl], dv[sl])
        if logs[start]:
            log_backward(grad_out[sl], group, out[sl], options, seed, row_shift[sl], col_shift[sl], us[sl], vs[sl],
                         counts[sl], grads)
            return
        if native_passes:  # a kept tile holds K̃, whichever passes the forward ran; else K̃ again from the shifts
            c = sl.stop - sl.start
            tile = _native_tile(tiles, sl, scratch, n, m, q)
            if not tiles.numel():
                native.recompute(tile, group.q, group.k, group.scale, row_shift[sl], col_shift[sl], scratch_buffer(
                    scratch, "products", native.forward_work(c, m, q.shape[-1], v.shape[-1], q.dtype), q))
            work = scratch_buffer(scratch, "dS", native.backward_work(c, n, m, v.shape[-1], q.dtype), dq)
            native.backward(tile, group.q, group.k, group.v, us[sl], vs[sl], grad_out[sl], group.scale, group.n_iters,
                            grads, work)
            return
        kept = tiles.numel() > 0
        memory = tiles[sl].view(-1) if kept else Tile.memory(problem, options, scratch)
        tile = Tile(group, options, memory, shifts=(row_shift[sl], col_shift[sl]), ready=kept, scratch=scratch,
                    crew=crew)
        scaling_backward(tile, seed, us[sl], vs[sl], counts[sl], grad_out[sl], out[sl], options, grads, scratch)

    with _crew(members) as crew:
        map_groups(list(range(0, B, options.group)), run, q.device, B * n * m,
                   parallel_above(native_passes, options.group, members))
    return dq, dk, dv


def _native_tile(tiles: Tensor, sl: slice, scratch: dict, n: int, m: int, like: Tensor) -> Tensor:
    """The tile ``(c, n, m)`` of the native group ``sl`` in :func:`.native.tiles`' layout: its slices of the kept
    ``tiles``, else the worker's scratch memory."""
    c = sl.stop - sl.start
    ld = sizes.tile_row_stride(m, like.element_size())
    return native.tiles(tiles[sl] if tiles.numel() else scratch_buffer(scratch, "memory", c * n * ld, like), c, n, m)


def uses_native(problem: Problem, options: Options) -> bool:
    """Whether the call's scaling-domain groups run :mod:`.native`'s passes: the tiled engine on the CPU, float32
    or float64, no mask, a fixed ``n_iters >= 2``, no dropout, ``backward="unrolled"``, cache blocks of whole
    slices (:func:`~.sizes.cache_blocks`: slices of at most :data:`~.sizes.WHOLE_SLICE_BUDGETS` times
    :data:`~.sizes.CACHE_BLOCK_ELEMENTS` scores, n <= 1024 when square), and the passes compiled here
    (:func:`.native.status`)."""
    p = problem
    return (native.ENABLED and options.stored and options.starts_in_scaling(p.q.device) and p.q.device.type == "cpu"
            and p.q.dtype in (torch.float32, torch.float64) and not p.masked and p.tol is None and p.n_iters >= 2
            and not options.dropout_p and options.backward == "unrolled"
            and options.blocks(p.B, p.n, p.m).rows is None and native.available())


def parallel_above(native_passes: bool, group: int, crew: int = 1) -> int:
    """Fewest scores in a call for :func:`~.cpu_parallel.map_groups` to run its groups on Python threads:
    :data:`~.cpu_parallel.PARALLEL_ABOVE` for the composed passes; never (``sys.maxsize``) for native groups of at
    least as many slices as PyTorch has threads, which each C call splits over all of them (at b x h = 4 x 8,
    n = 512, groups of 4 slices on 2 threads, the intra-op mode was faster in every round:
    ``benchmarks/results/parallel_6cf3108.md``; at n = 1024, groups of 2 slices, ``docs/speed.md``); else
    :data:`~.cpu_parallel.NATIVE_PARALLEL_ABOVE` (native groups too small to occupy every thread: one slice under
    graph capture, or a library without OpenMP). Groups whose passes a ``crew`` of more than one member splits
    (:func:`crew_size`) run one at a time: never."""
    if crew > 1:
        return sys.maxsize
    if not native_passes:
        return cpu_parallel.PARALLEL_ABOVE
    splits = native.threaded() and group >= torch.get_num_threads()
    return sys.maxsize if splits else cpu_parallel.NATIVE_PARALLEL_ABOVE


def _crew(members: int) -> contextlib.AbstractContextManager[Crew | None]:
    """A :class:`~.cpu_parallel.Crew` of ``members`` for a call whose passes are split over the cores, else nothing."""
    return Crew(members) if members > 1 else contextlib.nullcontext()


def crew_size(problem: Problem, options: Options) -> int:
    """How many threads split each group's passes (a :class:`~.cpu_parallel.Crew`, one member per core): every
    PyTorch thread for stored tiles of row blocks on the CPU whose slices have at least
    :data:`~.sizes.SPLIT_TILE_SCORES` scores (n = 4096 when square); else 1 (no crew). The groups then run one at a
    time, so one tile is in memory rather than one per core; the passes are the same, in
    :data:`~.sizes.SPLIT_PARTS_PER_CORE` parts per member that the members take in turn, and what a pass sums over
    rows each part sums on its own, the shares added in part order (:meth:`Tile.part_sums`)."""
    p = problem
    if not (options.stored and p.q.device.type == "cpu" and p.n * p.m >= sizes.SPLIT_TILE_SCORES):
        return 1
    return torch.get_num_threads() if options.blocks(min(options.group, p.B), p.n, p.m).rows is not None else 1


def native_row_blocks(problem: Problem, blocks: CacheBlocks) -> bool:
    """Whether a tile's passes run their per-block operations in :mod:`.native`'s C (``rows_*``): row blocks (slices
    larger than the engine takes whole; smaller ones take :func:`uses_native`'s whole-slice passes where those
    serve), no mask, CPU, float32 or float64, and the passes compiled here. The passes and their loops are the
    same; each block's several PyTorch operations become one C call over the block in cache."""
    p = problem
    return (native.ENABLED and blocks.rows is not None and not p.masked and p.q.device.type == "cpu"
            and p.q.dtype in (torch.float32, torch.float64) and native.available())


def _cat(parts: list[Tensor]) -> Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _pad_cat(parts: list[Tensor]) -> Tensor:
    """Concatenate ``(c, n, L_i)`` iterate stacks along slices, repeating each one's last iterate
    up to the longest ``L`` (a matrix that stopped early keeps its values: frozen)."""
    longest = max(p.shape[-1] for p in parts)
    return _cat([p if p.shape[-1] == longest else torch.cat(
        [p, p[..., -1:].expand(p.shape[:-1] + (longest - p.shape[-1],))], -1) for p in parts])


def dropout_mask(shape: tuple[int, int, int], like: Tensor, p: float, seed: Tensor | None,
                 start: int) -> Tensor | None:
    """The scaled Bernoulli keep-mask ``(c, n, m)`` of the group starting at ``start`` (or None): entry
    :math:`[U \\ge p] / (1 - p)` of uniforms :math:`U` drawn in at least float32 (in ``like``'s dtype and device).
    ``torch.rand`` and an in-place comparison, not ``bernoulli_``, PyTorch's slow path on CPUs (whole calls
    with dropout before and after: ``benchmarks/results/ab_issue26_dropout.md``)."""
    if not p:
        return None
    generator = torch.Generator(device=like.device).manual_seed(int(seed.item()) + start)
    draw = torch.rand(shape, generator=generator, dtype=torch.promote_types(like.dtype, torch.float32),
                      device=like.device)
    return draw.ge_(p).to(like.dtype).div_(1.0 - p)


# ------------------------------------------------------------------------------------------------
# the tile


class Tile:
    """The ``(c, n, m)`` scores of one group (a :meth:`~.problem.Problem.group`), visited in cache blocks;
    kept (``options.stored``) or recomputed on every visit into one block of scratch memory.

    :meth:`first_sweep` (the forward's pass 1) computes the double shift; :meth:`visit` yields
    :math:`\\tilde K = e^{S - m_i - c_j}` block by block. A stored tile holds the first sweep's blocks
    (scaled to :math:`\\tilde K` on their next visit), then :math:`\\tilde K`; a recomputed block goes
    through the same operations (scores, minus the row shift, minus the column shift, exponential), so
    every recomputation gives the same values. ``shifts``: the saved shifts (the backward), instead of
    pass 1; ``ready``: ``memory`` already holds the tile's :math:`\\tilde K` (kept by the forward).

    **Parts.** Every pass visits the blocks in :attr:`parts` (:meth:`over_parts`): one range of all blocks, or,
    given a ``crew`` (:func:`crew_size`), a stored tile's row blocks in :data:`~.sizes.SPLIT_PARTS_PER_CORE` ranges
    per member, which the members take in turn, each with its own ``scratch`` dict (the worker's for the calling
    thread, dicts kept in it for the others: :func:`~.cpu_parallel.part_scratches`)."""

    def __init__(self, problem: Problem, options: Options, memory: Tensor,
                 shifts: tuple[Tensor, Tensor] | None = None, ready: bool = False, scratch: dict | None = None,
                 crew: Crew | None = None):
        q, k = problem.q, problem.k
        self.problem, self.q, self.k = problem, q, k
        self.masks, self.start, self.scale = problem.masks, problem.first, problem.scale
        c, n, m = q.shape[0], q.shape[1], k.shape[1]
        self.shape = (c, n, m)
        self.blocks = options.blocks(c, n, m)
        self.stored = options.stored
        self._memory = memory
        self.K = memory[:c * n * m].view(c, n, m) if self.stored else None
        self._qb = self.blocks.rows_of(q)
        self._kTb = self.blocks.slices_of(k.transpose(1, 2))
        self.count = len(self._qb)
        self.Kb = self.blocks.rows_of(self.K) if self.stored else None
        self.masked = problem.masked
        self.native_rows = native_row_blocks(problem, self.blocks)
        if crew is not None and not (self.stored and self.blocks.rows is not None):
            raise ValueError(f"crew: a tile's blocks split into parts must be row blocks of a stored tile, got "
                             f"{'stored' if self.stored else 'recomputed'} blocks of "
                             f"{'rows' if self.blocks.rows is not None else 'whole slices'}")
        self._crew = crew
        self.parts = _block_parts(self.count, 1 if crew is None else crew.workers * sizes.SPLIT_PARTS_PER_CORE)
        self._scratches = part_scratches({} if scratch is None else scratch, 1 if crew is None else crew.workers)
        self._index = self.blocks.index if self.masked else None
        self._ready = ready and self.stored  # a stored tile holds K̃
        self._scaled = False  # a stored tile holds the first sweep's E
        self.row_shift = self.col_shift = None
        if shifts is not None:
            self._set_shifts(*shifts)

    @staticmethod
    def memory(problem: Problem, options: Options, scratch: dict) -> Tensor:
        """Storage for the tiles of every group of one call (stored: one tile; recomputed: one block):
        the worker's ``scratch`` buffer (:func:`~.cpu_parallel.map_groups`: kept between calls on the
        CPU), allocated and paged in again only when it is too small or of another dtype or device."""
        c, n, m = min(options.group, problem.B), problem.n, problem.m
        if options.stored:
            size = c * n * m
        else:
            size = options.blocks(c, n, m).largest(m)
        return scratch_buffer(scratch, "memory", size, problem.q)

    def _block(self, i: int) -> Tensor:
        if self.stored:
            return self.Kb[i]
        rows = self._qb[i]
        return self._memory[:rows.shape[0] * rows.shape[1] * self.shape[2]].view(rows.shape[0], rows.shape[1],
                                                                                 self.shape[2])

    def scores(self, i: int) -> Tensor:
        """``scale q k^T + bias`` (-inf where masked) written into block ``i``'s storage."""
        x = self._block(i).baddbmm_(self._qb[i], self._kTb[i], beta=0.0, alpha=self.scale)
        if self._index is not None:  # masks: sliced to the block
            s, r = self._index[i]
            start = self.start
            bias = self.masks.bias_of(start + s.start, start + s.stop, r.start, r.stop)
            if bias is not None:
                x.add_(bias)
            keep = self.masks.keep_of(start + s.start, start + s.stop, r.start, r.stop)
            if keep is not None:
                x.masked_fill_(~keep, float("-inf"))
        return x

    def first_sweep(self, a: Tensor, empty: Tensor, col_init: Tensor | None = None,
                    output: tuple | None = None) -> tuple[Tensor, Tensor | None]:
        """Pass 1 of the forward, with its first row normalisation: the scores, the double shift, and
        :math:`u = a \\oslash \\tilde K\\tilde v^{(0)}` with :math:`\\tilde v^{(0)} = e^{c}`, all block by
        block in cache. A block's :math:`E = e^{S - m_i - t_j}`, with :math:`t_j` the block's own column
        maxima of :math:`S - m_i`, gives :math:`\\tilde K\\tilde v^{(0)} = E e^{t}`; :math:`c_j` is the
        running maximum of :math:`t_j` over blocks, and the column sums :math:`\\tilde K^\\top u = \\sum
        e^{t_j - c_j} E^\\top u` are rescaled whenever it rises (the online shift of a streamed SoftMax),
        so no block is visited twice. Sets the shifts; a stored tile keeps ``E``, scaled to
        :math:`\\tilde K` on its next visit (blocks of whole slices: ``E`` is :math:`\\tilde K`).
        Arguments and returns as for :meth:`sweep`."""
        blocks = self.blocks
        c, n, m = self.shape
        if n * m == 0:
            self._set_shifts(self.q.new_zeros(c, n), self.q.new_zeros(c, m))
            return self.sweep(self.col_shift.exp(), a, empty, col_init, output=output)
        row_shift, top = self.q.new_empty(c, n, 1), self.q.new_full((c, 1, m), float("-inf"))
        u = a.new_empty(c, n, 1)
        rowb, ub = blocks.rows_of(row_shift), blocks.rows_of(u)
        ab, eb = blocks.rows_of(a.unsqueeze(-1)), blocks.rows_of(empty.unsqueeze(-1))
        col = None if col_init is None else a.new_zeros(c, 1, m)
        # each part's running column maxima, and its column sums relative to them (merged below)
        tops = [top] + [torch.full_like(top, float("-inf")) for _ in self.parts[1:]]
        cols = None if col is None else self.part_sums(col)
        outputb = None  # the last normalisation: (V, dropout, out) per block
        if output is not None:
            V, drop, out = output
            outputb = (blocks.slices_of(V), blocks.rows_of(drop) if drop is not None else None, blocks.rows_of(out))
        self._tops = [None] * self.count

        def part(p: int, scratch: dict) -> None:
            topb, colb = blocks.slices_of(tops[p]), None if cols is None else blocks.slices_of(cols[p])
            work = scratch_buffer(scratch, "first", 2 * m, self.q) if self.native_rows else None
            for i in self.parts[p]:
                self._first_block(i, ab, eb, rowb, ub, topb, colb, work, outputb)

        self.over_parts(part)
        if len(tops) > 1:
            _merge_parts(tops, cols, self.masked)
        col_shift = top.squeeze(1)
        self._set_shifts(row_shift.squeeze(-1), _finite_or_zero(col_shift) if self.masked else col_shift)
        # whole slices: t is the column shift, so a stored E is K̃ itself (the same operations, bit for bit)
        self._scaled = self.stored and blocks.rows is not None
        self._ready = self.stored and blocks.rows is None
        return u.squeeze(-1), (None if col is None else col.squeeze(1).add_(col_init))

    def _first_block(self, i: int, ab, eb, rowb, ub, topb, colb, work: Tensor | None, output) -> None:
        """The first sweep on block ``i`` (:meth:`first_sweep`; the ``...b`` arguments are per-block views, ``output``
        ``(Vb, dropb, outb)`` or None)."""
        blocks, m = self.blocks, self.shape[2]
        if output is not None:
            Vb, dropb, outb = output
        x = self.scores(i)
        if self.native_rows:  # what the operations below compute for a row block, in one C call
            t = x.new_empty(1, 1, m)
            native.rows_first(x, ab[i], rowb[i], t, ub[i], None if colb is None else colb[i], topb[i], work)
            if output is not None:
                torch.bmm(x if dropb is None else x.mul_(dropb[i]), t.exp().transpose(1, 2) * Vb[i],
                          out=outb[i]).mul_(ub[i])
            if self.stored:
                self._tops[i] = t
            return
        torch.amax(x, -1, keepdim=True, out=rowb[i])
        if self.masked:  # a row without a valid entry: shift 0
            rowb[i].nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        t = x.sub_(rowb[i]).amax(-2, keepdim=True)  # (s, 1, m), -inf on columns without a valid entry here
        t_safe = t.nan_to_num(neginf=0.0) if self.masked else t
        E = x.sub_(t_safe).exp_()
        w = t_safe.exp().transpose(1, 2)  # (s, m, 1): K̃ v0 = E e^t
        add_rows_times(eb[i], E, w, out=ub[i])
        torch.div(ab[i], ub[i], out=ub[i])
        if blocks.rows is None:  # whole slices: t is the column shift itself
            topb[i].copy_(t)
            if colb is not None:
                torch.bmm(ub[i].transpose(1, 2), E, out=colb[i])
        else:
            new_top = torch.maximum(topb[i], t)
            if colb is not None:
                safe = new_top.nan_to_num(neginf=0.0) if self.masked else new_top
                colb[i].mul_((topb[i] - safe).exp_()).add_(
                    torch.bmm(ub[i].transpose(1, 2), E).mul_((t - safe).exp_()))
            topb[i].copy_(new_top)
        if output is not None:
            torch.bmm(E if dropb is None else E.mul_(dropb[i]), w * Vb[i], out=outb[i]).mul_(ub[i])
        if self.stored and blocks.rows is not None:
            self._tops[i] = t

    def _set_shifts(self, row_shift: Tensor, col_shift: Tensor) -> None:
        self.row_shift, self.col_shift = row_shift, col_shift
        self._rowb = self.blocks.rows_of(row_shift.unsqueeze(-1))
        self._colb = self.blocks.slices_of(col_shift.unsqueeze(1))
        self._scaled = False

    def over_parts(self, part: Callable[[int, dict], None]) -> None:
        """``part(p, scratch)`` for every part ``p`` of the blocks (:attr:`parts`), with the scratch dict of the thread
        that runs it: on this thread, or taken in turn by the members of the crew (:meth:`~.cpu_parallel.Crew.run`).
        Parts visit disjoint rows; a sum over rows is summed by each part into its own buffer (:meth:`part_sums`), so
        the results do not depend on which member ran which part."""
        if self._crew is None:
            part(0, self._scratches[0])
            return
        self._crew.run(part, len(self.parts), self._scratches)

    def visit_parts(self, part: Callable[[int, dict], None]) -> None:
        """:meth:`over_parts` for a pass over :math:`\\tilde K` (each part's blocks from :meth:`visit`); a stored
        tile then holds :math:`\\tilde K`."""
        self.over_parts(part)
        self._ready = self.stored

    def part_sums(self, total: Tensor) -> list[Tensor]:
        """A buffer for each part's share of a sum over rows: ``total`` itself for the first part, zeros like it for
        the others (:func:`_add_parts` adds them into ``total``)."""
        return [total] + [torch.zeros_like(total) for _ in self.parts[1:]]

    def visit(self, p: int, scratch: dict):
        """Yield ``(i, K̃ of block i)`` for every block ``i`` of part ``p`` (a recomputed block's storage is reused by
        the next; ``scratch``: that of the thread running the part). Within :meth:`visit_parts`."""
        rescale = self._scaled and self.native_rows and not self._ready
        work = scratch_buffer(scratch, "rescale", self.shape[2], self.q) if rescale else None
        for i in self.parts[p]:
            if self._ready:
                yield i, self.Kb[i]
            elif rescale:
                yield i, native.rows_rescale(self.Kb[i], self._tops[i], self._colb[i], work)
            elif self._scaled:  # E of the first sweep: K̃ = E e^{t - c}
                yield i, self.Kb[i].mul_((self._tops[i] - self._colb[i]).exp_())
            elif self.native_rows:
                yield i, native.rows_kernel(self.scores(i), self._rowb[i], self._colb[i])
            else:
                yield i, self.scores(i).sub_(self._rowb[i]).sub_(self._colb[i]).exp_()

    def sweep(self, vt: Tensor, a: Tensor, empty: Tensor, col_init: Tensor | None = None,
              output: tuple | None = None) -> tuple[Tensor, Tensor | None]:
        """One pass: :math:`u = a \\oslash (\\tilde K \\tilde v + [a = 0])` (rows without mass get 0)
        and, given ``col_init (c, m)``, the column sums ``col_init + K̃^T u``.

        ``output = (V, drop, out)``: this is the last normalisation; writes ``out = u ⊙ (K̃ ⊙ drop)(ṽ ⊙ V)``.
        Returns ``u (c, n)`` and the column sums ``(c, m)`` (or ``None``)."""
        blocks = self.blocks
        c, n, m = self.shape
        u = a.new_empty(c, n, 1)
        ub, ab, eb = blocks.rows_of(u), blocks.rows_of(a.unsqueeze(-1)), blocks.rows_of(empty.unsqueeze(-1))
        vb = blocks.slices_of(vt.unsqueeze(-1))
        # blocks of whole slices: each column sum is written once, from col_init (no copy, no accumulation)
        whole = blocks.rows is None
        col = None if col_init is None else col_init.new_empty(c, 1, m) if whole else col_init.unsqueeze(1).clone()
        cols = None if col is None else self.part_sums(col)
        initb = blocks.slices_of(col_init.unsqueeze(1)) if whole and col is not None else None
        if output is not None:
            V, drop, out = output
            vVb, outb = blocks.slices_of(vt.unsqueeze(-1) * V), blocks.rows_of(out)
            dropb = blocks.rows_of(drop) if drop is not None else None

        def part(p: int, scratch: dict) -> None:
            colb = None if cols is None else blocks.slices_of(cols[p])
            for i, Kb in self.visit(p, scratch):
                if self.native_rows:  # row blocks: the row normalisation and the column sums in one C call
                    native.rows_sweep(Kb, vb[i], ab[i], ub[i], None if colb is None else colb[i])
                else:
                    add_rows_times(eb[i], Kb, vb[i], out=ub[i])
                    torch.div(ab[i], ub[i], out=ub[i])
                    if initb is not None:
                        torch.baddbmm(initb[i], ub[i].transpose(1, 2), Kb, out=colb[i])
                    elif colb is not None:
                        colb[i].baddbmm_(ub[i].transpose(1, 2), Kb)
                if output is not None:
                    torch.bmm(Kb if dropb is None else Kb.mul_(dropb[i]), vVb[i], out=outb[i]).mul_(ub[i])

        self.visit_parts(part)
        return u.squeeze(-1), (None if col is None else _add_parts(cols).squeeze(1))

    def output(self, u: Tensor, vt: Tensor, V: Tensor, drop: Tensor | None, out: Tensor) -> None:
        """``out = u ⊙ (K̃ ⊙ drop)(ṽ ⊙ V)`` block by block (the plan after the last normalisation)."""
        blocks = self.blocks
        vVb, ub, outb = blocks.slices_of(vt.unsqueeze(-1) * V), blocks.rows_of(u.unsqueeze(-1)), blocks.rows_of(out)
        dropb = blocks.rows_of(drop) if drop is not None else None

        def part(p: int, scratch: dict) -> None:
            for i, Kb in self.visit(p, scratch):
                torch.bmm(Kb if dropb is None else Kb * dropb[i], vVb[i], out=outb[i]).mul_(ub[i])

        self.visit_parts(part)


def _block_parts(count: int, parts: int) -> list[range]:
    """``range(count)`` in ``parts`` contiguous ranges as equal as can be (fewer when there are fewer blocks; one
    empty range when there are none)."""
    parts = max(1, min(parts, count))
    bounds = [count * p // parts for p in range(parts + 1)]
    return [range(bounds[p], bounds[p + 1]) for p in range(parts)]


def _add_parts(sums: list[Tensor]) -> Tensor:
    """``sums[0]`` plus the other parts' shares of a sum (:meth:`Tile.part_sums`), in part order, in place."""
    for share in sums[1:]:
        sums[0].add_(share)
    return sums[0]


def _merge_parts(tops: list[Tensor], cols: list[Tensor] | None, masked: bool) -> None:
    """The first sweep's parts merged into the first part's buffers: the column maxima :math:`c = \\max_p t_p`, and the
    column sums :math:`\\sum_p e^{t_p - c}\\,s_p` of the parts' sums :math:`s_p`, each relative to its own maxima
    :math:`t_p` (-inf on a column without a valid entry in the part, whose sum is 0)."""
    top = torch.stack(tops).amax(0)
    safe = top.nan_to_num(neginf=0.0) if masked else top
    if cols is not None:
        for col, part_top in zip(cols, tops):
            col.mul_((part_top - safe).exp_())
        _add_parts(cols)
    tops[0].copy_(top)


def row_product(K: Tensor) -> str:
    """How :func:`add_rows_times` multiplies ``K (c, r, m)`` by a vector per slice: ``"batched"`` (one
    ``bmm``; every GPU), or on the CPU ``"row-vector"`` (``x^T K^T``) where :data:`~.sizes.ROW_VECTOR_PRODUCTS`
    says that is faster, else ``"per-slice"`` (one ``addmv`` each) for blocks of 2 to
    :data:`~.sizes.MATVEC_LOOP_SLICES` slices (one slice: the batched product, the same sums, was faster).
    ``python -m benchmarks matvec`` times each on this CPU."""
    if K.device.type != "cpu":
        return "batched"
    if sizes.ROW_VECTOR_PRODUCTS:
        return "row-vector"
    return "per-slice" if 1 < K.shape[0] <= sizes.MATVEC_LOOP_SLICES else "batched"


def add_rows_times(add: Tensor, K: Tensor, x: Tensor, out: Tensor) -> Tensor:
    """``out = add + K x`` for ``K (c, r, m)``, ``x (c, m, 1)``, ``add``/``out`` ``(c, r, 1)`` (distinct from
    the operands), multiplied as :func:`row_product` says."""
    how = row_product(K)
    if how == "row-vector":
        torch.baddbmm(add.transpose(1, 2), x.transpose(1, 2), K.transpose(1, 2), out=out.transpose(1, 2))
        return out
    if how == "per-slice":
        for K_s, x_s, add_s, out_s in zip(K, x.squeeze(-1), add.squeeze(-1), out.squeeze(-1)):
            torch.addmv(add_s, K_s, x_s, out=out_s)
        return out
    return torch.bmm(K, x, out=out).add_(add)


# ------------------------------------------------------------------------------------------------
# forward


def scaling_forward(tile: Tile, seed: Tensor | None, out: Tensor, options: Options) -> GroupState | None:
    """The forward of one group in the scaling domain (writes ``out``), or ``None`` when its scalings
    are not to be trusted (then ``out`` is garbage and the engine's log domain takes the group)."""
    v = tile.problem.v
    a, b = tile.problem.marginals(v)
    drop = dropout_mask(tile.shape, v, options.dropout_p, seed, tile.start)
    us, vs, counts, stop, col_error = _iterate(tile, a, b, v, drop, out, options)
    us, vs = _stack_last(us), _stack_last(vs)
    if not _trustworthy(us, vs):
        return None
    if options.backward == "implicit":
        us, vs = us[..., -1:], vs[..., -1:]
    return GroupState(tile.row_shift, tile.col_shift, us, vs, counts, False, stop, col_error)


def _iterate(tile: Tile, a: Tensor, b: Tensor, v: Tensor, drop: Tensor | None, out: Tensor, options: Options):
    """:func:`~.loop.sinkhorn_loop` on the scalings :math:`u = e^f`, :math:`\\tilde v = e^g`, from
    :math:`\\tilde v^{(0)} = e^{c}` (the column shift the first pass finds): one pass per row
    normalisation, with the column sums of the following column normalisation; the last pass of an
    odd fixed count writes ``out``. Returns ``us = [u1, u3, ..]``, ``vs = [v0, v2, ..]``, the ``(c,)``
    normalisations run, the :class:`~.problem.Tolerance` (``None`` for a fixed count) and, for the
    implicit backward after a fixed count, the column error of the final plan."""
    problem = tile.problem
    implicit, fixed = options.backward == "implicit", problem.tol is None
    empty_a, empty_b = (a == 0).to(a.dtype), (b == 0).to(b.dtype)  # rows/columns without mass: u = v = 0
    sums = {}  # the column sums K̃^T u of the last pass (+1 on columns without mass: b / sums = 0 there)

    def row_update(vt: Tensor | None, last: bool) -> Tensor:
        cols, output = (None if last and not implicit else empty_b), ((v, drop, out) if last else None)
        if vt is None:
            u, sums["col"] = tile.first_sweep(a, empty_a, cols, output=output)
        else:
            u, sums["col"] = tile.sweep(vt, a, empty_a, cols, output=output)
        return u

    def col_update(u: Tensor, vt: Tensor) -> tuple[Tensor, Tensor | None]:
        return b / sums["col"], (None if fixed else column_error(vt * sums["col"], b))

    run = sinkhorn_loop(row_update, col_update, lambda: tile.col_shift.exp(), n_iters=problem.n_iters,
                        tol=problem.tol, max_iters=problem.max_iters, engine=options.engine)
    col_error = column_error(run.gs[-1] * sums["col"], b) if fixed and implicit else None
    if not (fixed and problem.n_iters % 2):  # ends on a column normalisation, or tol: one more pass
        tile.output(run.fs[-1], run.gs[-1], v, drop, out)
    return run.fs, run.gs, run.counts, run.stop, col_error


def _stack_last(iterates: list[Tensor]) -> Tensor:
    """``torch.stack(iterates, -1)`` ``(c, n, L)`` of ``L`` iterates ``(c, n)``: stacked along a new first
    dimension, then transposed in one copy, which PyTorch's CPU kernels run faster than a stack along the
    last dimension (with the backward's columns in step order: 0.935x a forward+backward at n = 64 and 21
    iterations, ``benchmarks/results/ab_issue26_iterate_layout21.md``)."""
    return torch.stack(iterates).permute(1, 2, 0).contiguous()


def _trustworthy(us: Tensor, vs: Tensor) -> bool:
    """Scalings finite and moderate (:func:`~.problem.scalings_trusted`) over the whole group."""
    if us.numel() == 0 or vs.numel() == 0:
        return True
    return scalings_trusted(float(us.amax()), float(vs.amax()), us.dtype)


# ------------------------------------------------------------------------------------------------
# backward


def scaling_backward(tile: Tile, seed: Tensor | None, us: Tensor, vs: Tensor, counts: Tensor, dO: Tensor,
                     out: Tensor, options: Options, grads: tuple[Tensor, Tensor, Tensor], scratch: dict) -> None:
    """Gradients of one group in the scaling domain, written into ``grads = (dq, dk, dv)`` (views);
    the passes of the module docstring. Its two ``(c, ·, e + L)`` work buffers come from the worker's
    ``scratch`` (:func:`~.cpu_parallel.scratch_buffer`)."""
    c, n, m = tile.shape
    V = tile.problem.v
    e = V.shape[-1]
    a, b = tile.problem.marginals(V)
    drop = dropout_mask(tile.shape, V, options.dropout_p, seed, tile.start)
    u, vt = us[..., -1], vs[..., -1]
    rev = None if options.backward == "implicit" else _Reverse(a, b, us, vs, counts, tile.problem.tol is not None)
    L = 2 if rev is None else rev.L
    # [u ⊙ dO, X] and [ṽ ⊙ V, Y] (column j of X and Y: the step t = j + 1), in the worker's scratch
    left = scratch_buffer(scratch, "left", c * n * (e + L), dO).view(c, n, e + L)
    right = scratch_buffer(scratch, "right", c * m * (e + L), dO).view(c, m, e + L)
    X, Y = left[..., e:], right[..., e:]
    # the two dot products below take their elementwise products in left's and right's first e columns
    # (written again before they are read): no (c, n, e) or (c, m, e) temporary
    du = torch.mul(dO, out, out=left[..., :e]).sum(-1)  # sum_j K_ij v_j dP_ij, times u_i
    du.div_(u + (a == 0).to(a.dtype))  # (0 where u = 0)
    torch.mul(u.unsqueeze(-1), dO, out=left[..., :e])
    first = rev.row_coef(L, du) if rev is not None and L % 2 else None  # the last step is a row step
    D, first_col = _first_pass(tile, left[..., :e], drop, first if L > 1 else None, into=grads[2])
    dvt = torch.mul(V, D, out=right[..., :e]).sum(-1)  # sum_i u_i K_ij dP_ij
    D.mul_(vt.unsqueeze(-1))  # dV = ṽ ⊙ D, in place (D is dv)
    if rev is None:  # dS = P * (dP - alpha ⊕ beta)
        alpha, beta = implicit_duals_of(tile.K, u, vt, du * u, dvt * vt)
        X[..., 0], X[..., 1], Y[..., 0], Y[..., 1] = -u * alpha, -u, vt, vt * beta
        _gradient_pass(tile, left, right, vt, V, drop, grads)
        return
    rev.row_ys(Y)
    t = L
    if first is not None:
        du = rev.row_step(L, first, du, X)
        if first_col is not None:
            dvt = dvt + first_col
        t = L - 1
    while t > 2:  # column step t and row step t - 1 in one pass
        ds, dvt = rev.col_step(t, dvt, X, Y)
        du, next_col = _row_step_pass(tile, rev, t - 1, du, ds, X)
        dvt = dvt + next_col
        t -= 2
    last = (rev, du, rev.col_step(2, dvt, X, Y)[0]) if t == 2 else None  # steps 2 and 1 in the last pass
    _gradient_pass(tile, left, right, vt, V, drop, grads, last)


def _first_pass(tile: Tile, uO: Tensor, drop: Tensor | None, first: Tensor | None,
                into: Tensor) -> tuple[Tensor, Tensor | None]:
    """Pass 1: :math:`D = (\\tilde K\\odot\\mathrm{drop})^\\top(u\\odot dO)` ``(c, m, e)``, written into ``into``
    (returned), and, given the last row step's coefficient ``first (c, n)``, its column product
    :math:`\\tilde K^\\top first` ``(c, m)``."""
    blocks = tile.blocks
    c, n, m = tile.shape
    beta, new = _accumulation(blocks, uO)
    D = into.zero_() if beta else into
    Ds, uOb = tile.part_sums(D), blocks.rows_of(uO)
    dropb = blocks.rows_of(drop) if drop is not None else None
    col = new(c, 1, m) if first is not None else None
    cols = None if col is None else tile.part_sums(col)
    firstb = None if col is None else blocks.rows_of(first.unsqueeze(-1))

    def part(p: int, scratch: dict) -> None:
        Db, colb = blocks.slices_of(Ds[p]), None if cols is None else blocks.slices_of(cols[p])
        for i, Kb in tile.visit(p, scratch):
            Db[i].baddbmm_((Kb if dropb is None else Kb * dropb[i]).transpose(1, 2), uOb[i], beta=beta)
            if colb is not None:
                colb[i].baddbmm_(firstb[i].transpose(1, 2), Kb, beta=beta)

    tile.visit_parts(part)
    return _add_parts(Ds), (None if col is None else _add_parts(cols).squeeze(1))


def _accumulation(blocks: CacheBlocks, like: Tensor) -> tuple[float, Callable[..., Tensor]]:
    """How a pass collects a per-slice sum over its blocks: ``(beta, new)`` for ``baddbmm_``. Blocks of
    whole slices visit each slice once: ``beta = 0`` writes the uninitialised buffer (``new = new_empty``);
    row blocks accumulate into zeros (``beta = 1``, ``new = new_zeros``)."""
    return (0.0, like.new_empty) if blocks.rows is None else (1.0, like.new_zeros)


def _row_step_pass(tile: Tile, rev: _Reverse, t: int, du: Tensor, ds: Tensor, X: Tensor) -> tuple[Tensor, Tensor]:
    """Row step ``t`` of the reverse recursion after a column step (``ds``), block by block:
    :math:`du \\mathrel{+}= \\tilde K ds`, :math:`dr = du \\odot` :meth:`_Reverse.row_factor`, recorded
    in ``X``; returns ``du`` after the step and the column product :math:`\\tilde K^\\top dr` ``(c, m)``."""
    blocks = tile.blocks
    c, n, m = tile.shape
    total, dr = torch.empty_like(du).unsqueeze(-1), torch.empty_like(du).unsqueeze(-1)
    beta, new = _accumulation(blocks, du)
    cols = tile.part_sums(new(c, 1, m))
    dub, dsb, factorb = (blocks.rows_of(du.unsqueeze(-1)), blocks.slices_of(ds.contiguous().unsqueeze(-1)),
                         blocks.rows_of(rev.row_factor(t).contiguous().unsqueeze(-1)))
    totalb, drb = blocks.rows_of(total), blocks.rows_of(dr)

    def part(p: int, scratch: dict) -> None:
        colb = blocks.slices_of(cols[p])
        for i, Kb in tile.visit(p, scratch):
            if tile.native_rows:  # the three operations below in one C call
                native.rows_step(Kb, dsb[i], dub[i], factorb[i], totalb[i], drb[i], colb[i])
                continue
            add_rows_times(dub[i], Kb, dsb[i], out=totalb[i])
            torch.mul(totalb[i], factorb[i], out=drb[i])
            colb[i].baddbmm_(drb[i].transpose(1, 2), Kb, beta=beta)

    tile.visit_parts(part)
    return rev.row_step(t, dr.squeeze(-1), total.squeeze(-1), X), _add_parts(cols).squeeze(1)


def _gradient_pass(tile: Tile, left: Tensor, right: Tensor, vt: Tensor, V: Tensor, drop: Tensor | None, grads,
                   last_steps=None) -> None:
    """The last pass: :math:`dS = \\tilde K\\odot(\\mathrm{diag}(u)\\,dP\\,\\mathrm{diag}(\\tilde v)
    + XY^\\top)` block by block, contracted into ``dq`` (rows of the block) and ``dk`` (summed).

    ``left = [u ⊙ dO, X] (c, n, e + L)``; ``right = [·, Y] (c, m, e + L)``, whose first ``e`` columns
    this pass fills with :math:`\\tilde v\\odot V`. ``last_steps = (reverse, du, ds2)``: the column step 2 ran
    (``ds2``); :math:`du + \\tilde K ds_2` and the row step 1 (the last column of ``X``, the
    block's rows of ``left``) run here, block by block, before the block's ``dS``, which is formed in the
    part's scratch (memory used again on the next call, not faulted in again)."""
    dq, dk, _ = grads
    blocks, scale = tile.blocks, tile.scale
    e = V.shape[-1]
    beta, _ = _accumulation(blocks, dk)
    if beta:
        dk.zero_()
    vV = torch.mul(vt.unsqueeze(-1), V, out=right[..., :e])
    dks, dqb, qb, kb = tile.part_sums(dk), blocks.rows_of(dq), blocks.rows_of(tile.q), blocks.slices_of(tile.k)
    leftb = blocks.rows_of(left)
    if drop is None:
        rightb = blocks.slices_of(right.transpose(1, 2))  # (c, e + L, m)
    else:
        dropb, vVb = blocks.rows_of(drop), blocks.slices_of(vV.transpose(1, 2))
        Yb = blocks.slices_of(right[..., e:].transpose(1, 2))
    if last_steps is not None:
        rev, du, ds = last_steps
        total, dr = torch.empty_like(du).unsqueeze(-1), torch.empty_like(du).unsqueeze(-1)
        dub, dsb, totalb = (blocks.rows_of(du.unsqueeze(-1)), blocks.slices_of(ds.contiguous().unsqueeze(-1)),
                            blocks.rows_of(total))
        factorb, drb = blocks.rows_of(rev.row_factor(1).contiguous().unsqueeze(-1)), blocks.rows_of(dr)
        lastb = blocks.rows_of(left[..., e:e + 1])  # X[..., 0]: the row step 1

    def part(p: int, scratch: dict) -> None:
        work, dkb = scratch_buffer(scratch, "dS", blocks.largest(tile.shape[2]), dq), blocks.slices_of(dks[p])
        for i, Kb in tile.visit(p, scratch):
            if last_steps is not None and tile.native_rows:
                native.rows_step(Kb, dsb[i], dub[i], factorb[i], totalb[i], drb[i], None)
                lastb[i].copy_(drb[i])
            elif last_steps is not None:
                add_rows_times(dub[i], Kb, dsb[i], out=totalb[i])
                torch.mul(totalb[i], factorb[i], out=lastb[i])
            dP = work[:Kb.numel()].view(Kb.shape)
            if drop is None:
                torch.bmm(leftb[i], rightb[i], out=dP)
            else:
                torch.bmm(leftb[i][..., :e], vVb[i], out=dP).mul_(dropb[i])
                dP.baddbmm_(leftb[i][..., e:], Yb[i])
            dS = dP.mul_(Kb)
            dqb[i].baddbmm_(dS, kb[i], beta=0.0, alpha=scale)
            dkb[i].baddbmm_(dS.transpose(1, 2), qb[i], beta=beta, alpha=scale)

    tile.visit_parts(part)
    _add_parts(dks)


class _Reverse:
    """Reverse mode through the scaling recursion, one step at a time (``t = L, .., 1``).

    ``us (c, n, Lu)``, ``vs (c, m, Lv)``: the iterates (``L = Lu + Lv - 1`` normalisations); steps
    ``t > counts`` of a matrix were frozen (identity: the gradient passes through). A row step
    :math:`u_t = a \\oslash \\tilde K v_{t-1}` turns the gradient ``du`` into the row coefficient
    :math:`dr = -du\\, u_t^2 / a` (then :math:`d\\tilde v \\mathrel{+}= \\tilde K^\\top dr`), a column
    step the column coefficient :math:`ds = -d\\tilde v\\, \\tilde v_t^2 / b` (then :math:`du
    \\mathrel{+}= \\tilde K ds`); each adds the rank-one term :math:`dr\\,v_{t-1}^\\top` or
    :math:`u_{t-1}\\,ds^\\top` to :math:`\\partial\\ell/\\partial\\tilde K`, stored as column ``t - 1``
    of ``X (c, n, L)``, ``Y (c, m, L)``."""

    def __init__(self, a: Tensor, b: Tensor, us: Tensor, vs: Tensor, counts: Tensor, frozen: bool):
        self.us, self.vs, self.counts = us, vs, counts
        self.L = us.shape[-1] + vs.shape[-1] - 1
        self.frozen = frozen  # tol mode: matrices may have stopped early
        # the factors of every step at once: -u_t^2 / a and -v_t^2 / b (0 where a or b is 0)
        self.row_factors = us.square().mul_(_neg_inverse(a).unsqueeze(-1))
        self.col_factors = vs.square().mul_(_neg_inverse(b).unsqueeze(-1))

    def _active(self, t: int) -> Tensor:
        return (self.counts >= t).unsqueeze(-1)

    def row_factor(self, t: int) -> Tensor:
        """:math:`-u_t^2/a` where step ``t`` ran, else 0 ``(c, n)``: ``dr = du ⊙ row_factor``."""
        factor = self.row_factors[..., (t - 1) // 2]
        return torch.where(self._active(t), factor, 0.0) if self.frozen else factor

    def row_coef(self, t: int, du: Tensor) -> Tensor:
        return du * self.row_factor(t)

    def row_ys(self, Y: Tensor) -> None:
        """The ``Y`` columns of every row step: :math:`v_{t-1}`, known before the reverse pass."""
        Y[..., ::2] = self.vs[..., :(self.L + 1) // 2]  # row steps t = 1, 3, ..: columns t - 1

    def row_step(self, t: int, dr: Tensor, du: Tensor, X: Tensor) -> Tensor:
        """Record the row step's coefficient ``dr`` in ``X``; returns ``du`` after it (0 where it ran)."""
        X[..., t - 1] = dr
        return torch.where(self._active(t), 0.0, du) if self.frozen else torch.zeros_like(du)

    def col_step(self, t: int, dvt: Tensor, X: Tensor, Y: Tensor) -> tuple[Tensor, Tensor]:
        """Column coefficient ``ds`` of step ``t`` (its term recorded) and ``dvt`` after it."""
        factor = self.col_factors[..., t // 2]
        if self.frozen:
            factor = torch.where(self._active(t), factor, 0.0)
        ds = torch.mul(dvt, factor, out=Y[..., t - 1])
        X[..., t - 1] = self.us[..., t // 2 - 1]
        after = torch.where(self._active(t), 0.0, dvt) if self.frozen else torch.zeros_like(dvt)
        return ds, after


def _neg_inverse(x: Tensor) -> Tensor:
    """``-1/x`` with 0 where ``x == 0`` (masked rows/columns carry no mass)."""
    return torch.where(x > 0, -1 / x, 0.0)


def implicit_duals_of(K, u, vt, r, c, max_iters=1000):
    """:func:`~.implicit.implicit_duals` for ``P = diag(u) K diag(vt)`` (products on a stored tile)."""
    tol = 1e-10 if K.dtype == torch.float64 else 1e-6
    return implicit_duals(lambda y: u * _mv(K, vt * y), lambda x: vt * _mtv(K, u * x), r, c, tol=tol,
                          max_iters=max_iters)


def _mv(K: Tensor, x: Tensor) -> Tensor:
    """``K x`` for ``K (c, n, m)``, ``x (c, m)`` (a row-vector product where :data:`~.sizes.ROW_VECTOR_PRODUCTS`)."""
    if row_product(K) == "row-vector":
        return torch.bmm(x.unsqueeze(1), K.transpose(1, 2)).squeeze(1)
    return torch.bmm(K, x.unsqueeze(-1)).squeeze(-1)


def _mtv(K: Tensor, x: Tensor) -> Tensor:
    """``K^T x`` as a row-vector product (much faster than a transposed batched GEMV)."""
    return torch.bmm(x.unsqueeze(1), K).squeeze(1)
