r"""The tiled engine: Sinkhorn attention at SoftMax-like cost, O(n) saved per slice.

For a group of (batch·head) slices at a time (:func:`~.problem.group_size`: 2^20 scores or one
slice on the CPU, a memory budget on a GPU) the forward builds :math:`S = \mathrm{scale}\,QK^\top +
\mathrm{bias}`, doubly shifts it (:func:`~.problem.double_shift`: every row and column of
:math:`x = S - m_i - c_j` has maximum 0) and runs the iterations of :mod:`.problem` on that
cached tile in one of two domains:

* **scaling** (CPU default): :math:`\tilde K = e^{x}`, :math:`P^{(t)} = \mathrm{diag}(u)\tilde K
  \mathrm{diag}(\tilde v)` from :math:`\tilde v^{(0)} = e^{c}`; each normalisation is one
  matrix-vector product (:math:`u \leftarrow a \oslash \tilde K\tilde v`, :math:`\tilde v
  \leftarrow b \oslash \tilde K^\top u`), no exponential, and the output
  :math:`u \odot \tilde K(\tilde v \odot V)` is one matrix product.
* **log** (GPUs, and any CPU group whose scalings leave :math:`\max u\cdot\max\tilde v < e^{60}`,
  e.g. score ranges of 1e4): :math:`f \leftarrow \log a - \mathrm{LSE}_j(x + g)`,
  :math:`g \leftarrow \log b - \mathrm{LSE}_i(x + f)` on the cached tile. Never wrong, one
  exponential of the tile per normalisation, and no data-dependent branch — so on a GPU the
  engine never synchronises with the host (fixed ``n_iters``).

Only the shifts and the scalings (or potentials) of every iteration are saved. The backward
recomputes the tile once and returns the **exact** gradient of the ``n_iters`` map by reverse
mode through the vector recursion: in the scaling domain every iteration adds a rank-one term,

.. math::

    \frac{\partial\ell}{\partial S} = \tilde K \odot\big(\mathrm{diag}(u)\,dP\,\mathrm{diag}(\tilde v) + XY^\top\big),
    \qquad dP = dO\,V^\top,

(:math:`X, Y` of rank ``n_iters``: the seven matrix products of SoftMax attention); in the log
domain each iteration's plan is recomputed.

**Passes in cache blocks** (scaling domain). The tile is visited in blocks of about
:data:`~.problem.CACHE_BLOCK_ELEMENTS` scores (rows of one slice, or whole slices), and every
product that needs a block runs while the block is in the L2 cache, so the tile travels to and
from memory once per pass rather than once per product: the forward's first pass writes the
scores and their row shift; each further pass exponentiates (first pass only), computes
:math:`u = a\oslash\tilde K\tilde v` on the block's rows — final for those rows — and adds
:math:`\tilde K^\top u` of the block to the column sums, so a row and a column normalisation
share one pass, and the last one writes the output block. ``n_iters`` normalisations take
:math:`1 + \lceil n\_iters/2\rceil` passes (plus one when ``n_iters`` is even). The backward
recomputes :math:`\tilde K` block by block with :math:`D = \tilde K^\top(u\odot dO)` (pass 1),
runs one column step and the following row step of the reverse recursion per pass, and forms
:math:`\partial\ell/\partial S` block by block in its last pass (with the recursion's last two
steps), contracted at once into :math:`dQ` and :math:`dK`; ``5`` iterations take 3 passes. The
sums run in a different order than over the whole tile: results agree to rounding. ``backward="implicit"`` differentiates the balanced
fixed point instead (implicit function theorem): :math:`\partial\ell/\partial S = P\odot(dP -
\alpha\oplus\beta)` where :math:`[\mathrm{diag}(a)\ P;\ P^\top\ \mathrm{diag}(b)][\alpha;\beta] =
[(P\odot dP)\mathbf 1;\ (P\odot dP)^\top\mathbf 1]` is solved by conjugate gradients.

The forward and backward are ``torch.library`` custom ops (``sinkformer::tiled_forward``,
``sinkformer::tiled_backward``) with fake implementations, so ``torch.compile(fullgraph=True)``
and ``torch.export`` see one opaque node each. Second derivatives (``create_graph=True``)
recompute the weights with the dense engine and differentiate them by autograd: exact, at the
dense engine's memory.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import problem
from .cpu_parallel import map_groups
from .problem import (
    Masks,
    _finite_or_zero,
    cache_blocks,
    implicit_duals,
    compute_in_float32_under_autocast,
    column_error,
    Tolerance,
    converged_tol,
    double_shift,
    group_size,
    marginals,
    valid_rows_cols,
    warn_if_unconverged,
    warn_unbalanced,
)

__all__ = ["tiled_attention"]

ENGINE = "tiled"
#: Iteration domain: ``"auto"`` (scaling on the CPU, log on GPUs), ``"scaling"`` or ``"log"``. The
#: conformance suite sets ``"log"`` to hold the GPUs' domain to the reference on the CPU.
DOMAIN = "auto"
#: Largest log(max u) + log(max v) the scaling domain is trusted with (lost entries < e^{60-87}).
_LOG_SCALING_LIMIT = 60.0


def tiled_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    batch: tuple[int, ...],
    scale: float,
    n_iters: int | None,
    tol: float | None = None,
    max_iters: int = 1000,
    keep: Tensor | None = None,
    bias: Tensor | None = None,
    backward: str = "unrolled",
    dropout_p: float = 0.0,
    domain: str | None = None,
) -> Tensor:
    """Sinkhorn attention ``(B, n, d) x (B, m, d) x (B, m, e) -> (B, n, e)``.

    ``q, k, v`` are flat over ``batch`` (``B = prod(batch)``) and in compute precision; ``keep``
    (bool) and ``bias`` (float, no gradient) broadcast to ``batch + (n, m)``. Arguments were
    validated by :func:`sinkformer.attention`. ``dropout_p`` drops weights after normalisation
    (the mask of each group is drawn from a seed taken from the global generator, and drawn
    again in the backward). ``domain``: :data:`DOMAIN` by default.
    """
    domain = DOMAIN if domain is None else domain
    seed = torch.randint(0, 2**62, (1,)) if dropout_p > 0 else None
    group = group_size(q.shape[0], q.shape[1], k.shape[1], q.device)
    options = _Options(scale, n_iters, tol, max_iters, backward, dropout_p, domain, group,
                       problem.CACHE_BLOCK_ELEMENTS)
    return torch.ops.sinkformer.tiled_forward(q, k, v, keep, bias, list(batch), seed, *options.args())[0]


class _Options:
    """The non-tensor arguments of both ops, in schema order (``block``: scores per cache block,
    :func:`~.problem.cache_blocks`; forward and backward use the same blocks, hence the same tile)."""

    def __init__(self, scale, n_iters, tol, max_iters, backward, dropout_p, domain, group, block):
        self.scale, self.n_iters, self.tol, self.max_iters = scale, n_iters, tol, max_iters
        self.backward, self.dropout_p, self.domain, self.group = backward, dropout_p, domain, group
        self.block = block

    def args(self) -> tuple:
        return (self.scale, self.n_iters, self.tol, self.max_iters, self.backward, self.dropout_p, self.domain,
                self.group, self.block)

    def history_length(self) -> tuple[int, int] | None:
        """Saved (u or f, v or g) iterates per slice; ``None`` when data-dependent (``tol``)."""
        if self.backward == "implicit":
            return 1, 1
        if self.tol is not None:
            return None
        return (self.n_iters + 1) // 2, self.n_iters // 2 + 1


@torch.library.custom_op("sinkformer::tiled_forward", mutates_args=())
def _forward_op(
    q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None, bias: Tensor | None, batch: list[int], seed: Tensor | None,
    scale: float, n_iters: int | None, tol: float | None, max_iters: int, backward: str, dropout_p: float, domain: str,
    group: int, block: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns ``out (B, n, e)``, the shifts ``(B, n)``, ``(B, m)``, the iterates ``(B, n, Lu)``,
    ``(B, m, Lv)``, the normalisations run ``(B,)`` and the domain of each slice ``(B,)`` (True: log).
    ``group``: slices per group (the backward and the dropout masks use the same groups)."""
    options = _Options(scale, n_iters, tol, max_iters, backward, dropout_p, domain, group, block)
    B, n = q.shape[0], q.shape[1]
    masks = Masks(keep, bias, tuple(batch))
    out = q.new_empty(B, n, v.shape[-1])
    shifts_r, shifts_c, us, vs, counts, logs = [], [], [], [], [], []
    stops, col_errors = [], []
    scaling = _starts_in_scaling(options, q.device)

    def run(start: int, scratch: dict) -> _GroupState:
        end = min(B, start + group)
        if scaling and "memory" not in scratch:
            scratch["memory"] = _Tile.memory(q, k, group)
        sl = slice(start, end)
        return _forward_group(q[sl], k[sl], v[sl], masks, start, end, options, seed, out[sl], scratch.get("memory"))

    starts = list(range(0, B, group))
    for start, state in zip(starts, map_groups(starts, run, q.device, B * n * k.shape[1])):
        end = min(B, start + group)
        shifts_r.append(state.row_shift)
        shifts_c.append(state.col_shift)
        us.append(state.us)
        vs.append(state.vs)
        counts.append(state.counts)
        logs.append(torch.full((end - start,), state.log_domain, dtype=torch.bool, device=q.device))
        stops += [state.stop] if state.stop is not None else []
        col_errors += [state.col_error] if state.col_error is not None else []
    implicit = backward == "implicit"
    warn_if_unconverged(stops, implicit=implicit)
    if implicit and tol is None and col_errors:
        warn_unbalanced(torch.cat(col_errors), n_iters, converged_tol(q.dtype), ENGINE)
    if B == 0:
        m, lu, lv = k.shape[1], *(options.history_length() or (0, 0))
        return (out, q.new_zeros(0, n), q.new_zeros(0, m), q.new_zeros(0, n, lu), q.new_zeros(0, m, lv),
                torch.zeros(0, dtype=torch.int64, device=q.device), torch.zeros(0, dtype=torch.bool, device=q.device))
    return (out, torch.cat(shifts_r), torch.cat(shifts_c), _pad_cat(us), _pad_cat(vs), torch.cat(counts),
            torch.cat(logs))


@_forward_op.register_fake
def _(q, k, v, keep, bias, batch, seed, scale, n_iters, tol, max_iters, backward, dropout_p, domain, group, block):
    B, n, m = q.shape[0], q.shape[1], k.shape[1]
    lengths = _Options(scale, n_iters, tol, max_iters, backward, dropout_p, domain, group, block).history_length()
    if lengths is None:
        length = torch.library.get_ctx().new_dynamic_size()
        lengths = (length, length)
    return (q.new_empty(B, n, v.shape[-1]), q.new_empty(B, n), q.new_empty(B, m), q.new_empty(B, n, lengths[0]),
            q.new_empty(B, m, lengths[1]), q.new_empty(B, dtype=torch.int64), q.new_empty(B, dtype=torch.bool))


def _pad_cat(parts: list[Tensor]) -> Tensor:
    """Concatenate ``(c, n, L_i)`` iterate stacks along slices, repeating each one's last iterate
    up to the longest ``L`` (a matrix that stopped early keeps its values: frozen)."""
    longest = max(p.shape[-1] for p in parts)
    return torch.cat([p if p.shape[-1] == longest else torch.cat(
        [p, p[..., -1:].expand(p.shape[:-1] + (longest - p.shape[-1],))], -1) for p in parts])


class _GroupState:
    def __init__(self, row_shift, col_shift, us, vs, counts, log_domain, stop, col_error):
        self.row_shift, self.col_shift, self.us, self.vs = row_shift, col_shift, us, vs
        self.counts, self.log_domain, self.stop, self.col_error = counts, log_domain, stop, col_error


def _forward_group(q, k, v, masks: Masks, start: int, end: int, options: _Options, seed, out: Tensor,
                   memory: Tensor) -> _GroupState:
    """Forward of slices ``[start, end)``; writes ``out`` and returns what the backward needs
    (``memory``: :meth:`_Tile.memory`)."""
    keep, bias = masks.keep_of(start, end), masks.bias_of(start, end)
    shape = (q.shape[0], q.shape[1], k.shape[1])
    keep_all = options.backward != "implicit"
    if _starts_in_scaling(options, q.device):
        tile = _Tile(q, k, masks, start, options, memory)
        row_shift, col_shift = tile.shift_rows()
        a, b = marginals(*valid_rows_cols(keep, shape), shape, tile.K)
        drop = _dropout_mask(tile.K, options.dropout_p, seed, start)
        us, vs, counts, stop, col_error = _scaling_iterate(tile, a, b, col_shift, v, drop, out, options)
        if _trustworthy(us, vs):
            if not keep_all:
                us, vs = us[-1:], vs[-1:]
            return _GroupState(row_shift, col_shift, torch.stack(us, -1), torch.stack(vs, -1), counts, False, stop,
                               col_error)
        del tile  # extreme scores: the log domain for this group
        x = _shifted_scores(q, k, options.scale, keep, bias, row_shift, col_shift)
    else:
        x, row_shift, col_shift = double_shift(_scores(q, k, options.scale, keep, bias), inplace=True)
    a, b = marginals(*valid_rows_cols(keep, shape), shape, x)
    drop = _dropout_mask(x, options.dropout_p, seed, start)
    fs, gs, counts, stop = _log_iterate(x, a, b, col_shift, options)
    P = x.add_(fs[-1].unsqueeze(-1)).add_(gs[-1].unsqueeze(-2)).exp_()
    col_error = column_error(P.sum(-2), b) if options.backward == "implicit" and options.tol is None else None
    torch.bmm(P if drop is None else P.mul_(drop), v, out=out)
    if not keep_all:
        fs, gs = fs[-1:], gs[-1:]
    return _GroupState(row_shift, col_shift, torch.stack(fs, -1), torch.stack(gs, -1), counts, True, stop, col_error)


class _Tile:
    """The ``(c, n, m)`` tile of one group, visited in cache blocks (:class:`~.problem.CacheBlocks`).

    ``K`` holds the scores, then (after :meth:`shift_rows` and the first sweep) :math:`\\tilde K =
    e^{S - m_i - c_j}`. Every pass reads each block once from memory and runs all its products on
    it while it is in cache; the row-local results of a block (``u``, ``du``) are final before its
    column sums are accumulated, so a row and a column normalisation share one pass. The views of
    every block are made once per pass (``blocks.rows_of``, ``blocks.slices_of``), so a pass costs
    a few operations per block."""

    def __init__(self, q: Tensor, k: Tensor, masks: Masks, start: int, options: _Options, memory: Tensor):
        self.q, self.k, self.masks, self.start, self.scale = q, k, masks, start, options.scale
        c, n, m = q.shape[0], q.shape[1], k.shape[1]
        self.K = memory[:c * n * m].view(c, n, m)
        self.blocks = cache_blocks(c, n, m, options.block)
        self.Kb = self.blocks.rows_of(self.K)
        self._qb, self._kTb = self.blocks.rows_of(q), self.blocks.slices_of(k.transpose(1, 2))
        self._index = self.blocks.index if masks.keep is not None or masks.bias is not None else None

    @staticmethod
    def memory(q: Tensor, k: Tensor, group: int) -> Tensor:
        """Storage for the tiles of every group of one call: allocated (and paged in) once, not
        once per group (a fresh 64 MiB tile costs ~10 % of its forward in page faults)."""
        return q.new_empty(min(group, q.shape[0]) * q.shape[1] * k.shape[1])

    def scores(self, i: int) -> Tensor:
        """``scale q k^T + bias`` (-inf where masked) written into block ``i`` (the operations of
        :func:`_scores`)."""
        x = self.Kb[i]
        x.baddbmm_(self._qb[i], self._kTb[i], beta=0.0, alpha=self.scale)
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

    def shift_rows(self) -> tuple[Tensor, Tensor]:
        """Scores minus their row maxima into ``K``; returns the shifts of :func:`~.problem.double_shift`
        ``(c, n)``, ``(c, m)`` (the column shift is applied by the first sweep, with the exponential)."""
        c, n, m = self.K.shape
        row_shift = self.K.new_zeros(c, n, 1)
        col_top = self.K.new_full((c, 1, m), float("-inf"))
        if m:
            tops = self.blocks.slices_of(col_top)
            for i, shift in enumerate(self.blocks.rows_of(row_shift)):
                x = self.scores(i)
                torch.amax(x, -1, keepdim=True, out=shift)
                x.sub_(shift.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0))
                torch.maximum(tops[i], x.amax(-2, keepdim=True), out=tops[i])
        return row_shift.squeeze(-1), _finite_or_zero(col_top.squeeze(1))

    def recompute(self, row_shift: Tensor, col_shift: Tensor):
        """Yield ``(i, K̃ of block i)`` from the saved shifts (the forward's operations and values)."""
        rows, cols = self.blocks.rows_of(row_shift.unsqueeze(-1)), self.blocks.slices_of(col_shift.unsqueeze(1))
        for i in range(len(self.Kb)):
            yield i, self.scores(i).sub_(rows[i]).sub_(cols[i]).exp_()

    def sweep(self, v: Tensor, a: Tensor, empty: Tensor, col_shift: Tensor | None = None,
              frozen: tuple | None = None, columns: bool = True, output: tuple | None = None):
        """One pass: :math:`u = a \\oslash \\tilde K v` and (``columns``) :math:`\\tilde K^\\top u`.

        ``empty (c, n)``: 1 where ``a == 0`` (those rows get ``u = 0/(Kv + 1) = 0``), else 0.
        ``col_shift``: first pass, turn the row-shifted scores into :math:`\\tilde K` on the way.
        ``frozen = (active (c,), u_old)``: matrices no longer active keep ``u_old``.
        ``output = (vt, V, drop, out, implicit)``: this is the last normalisation; writes
        ``out = u ⊙ (K ⊙ drop)(vt ⊙ V)`` (``K^T u`` still accumulated when ``implicit``, before the
        dropout). Returns ``u (c, n)`` and the column sums ``(c, m)`` (or ``None``)."""
        blocks = self.blocks
        c, n, m = self.K.shape
        u = self.K.new_empty(c, n, 1)
        ub, ab, eb = blocks.rows_of(u), blocks.rows_of(a.unsqueeze(-1)), blocks.rows_of(empty.unsqueeze(-1))
        vb = blocks.slices_of(v.unsqueeze(-1))
        col = self.K.new_zeros(c, 1, m) if columns else None
        colb = blocks.slices_of(col) if columns else None
        shiftb = blocks.slices_of(col_shift.unsqueeze(1)) if col_shift is not None else None
        if frozen is not None:
            activeb, oldb = blocks.slices_of(frozen[0].view(c, 1, 1)), blocks.rows_of(frozen[1].unsqueeze(-1))
        if output is not None:
            vt, V, drop, out, implicit = output
            vVb, outb = blocks.slices_of(vt.unsqueeze(-1) * V), blocks.rows_of(out)
            dropb = blocks.rows_of(drop) if drop is not None else None
        for i, Kb in enumerate(self.Kb):
            if shiftb is not None:
                Kb.sub_(shiftb[i]).exp_()
            torch.baddbmm(eb[i], Kb, vb[i], out=ub[i])
            torch.div(ab[i], ub[i], out=ub[i])
            if frozen is not None:
                torch.where(activeb[i], ub[i], oldb[i], out=ub[i])
            if columns:
                colb[i].baddbmm_(ub[i].transpose(1, 2), Kb)
            if output is not None:
                if dropb is not None:
                    Kb.mul_(dropb[i])
                torch.bmm(Kb, vVb[i], out=outb[i]).mul_(ub[i])
        return u.squeeze(-1), (col.squeeze(1) if columns else None)

    def output(self, u: Tensor, vt: Tensor, V: Tensor, drop: Tensor | None, out: Tensor) -> None:
        """``out = u ⊙ (K ⊙ drop)(vt ⊙ V)`` block by block (the plan after the last normalisation)."""
        blocks = self.blocks
        vVb, ub, outb = blocks.slices_of(vt.unsqueeze(-1) * V), blocks.rows_of(u.unsqueeze(-1)), blocks.rows_of(out)
        dropb = blocks.rows_of(drop) if drop is not None else None
        for i, Kb in enumerate(self.Kb):
            torch.bmm(Kb if dropb is None else Kb * dropb[i], vVb[i], out=outb[i]).mul_(ub[i])


def _scores(q: Tensor, k: Tensor, scale: float, keep: Tensor | None, bias: Tensor | None) -> Tensor:
    """``scale * q k^T + bias`` with masked entries at -inf, shape ``(c, n, m)``."""
    S = torch.baddbmm(q.new_empty(()), q, k.transpose(1, 2), beta=0.0, alpha=scale)
    if bias is not None:
        S.add_(bias)
    if keep is not None:
        S.masked_fill_(~keep, float("-inf"))
    return S


def _shifted_scores(q, k, scale, keep, bias, row_shift, col_shift) -> Tensor:
    """The forward's shifted tile again, from the saved shifts (same operations, same values)."""
    return _scores(q, k, scale, keep, bias).sub_(row_shift.unsqueeze(-1)).sub_(col_shift.unsqueeze(-2))


def _ratio(num: Tensor, den: Tensor) -> Tensor:
    """``num / den`` with 0 where ``num == 0`` (masked rows/columns carry no mass)."""
    return torch.where(num > 0, num / den, torch.zeros_like(num))


def _mv(K: Tensor, x: Tensor) -> Tensor:
    return torch.bmm(K, x.unsqueeze(-1)).squeeze(-1)


def _mtv(K: Tensor, x: Tensor) -> Tensor:
    """``K^T x`` as a row-vector product (much faster than a transposed batched GEMV)."""
    return torch.bmm(x.unsqueeze(1), K).squeeze(1)


def _scaling_iterate(tile: _Tile, a: Tensor, b: Tensor, col_shift: Tensor, v: Tensor, drop: Tensor | None,
                     out: Tensor, options: _Options):
    """The scaling-domain recursion on the row-shifted tile, from :math:`\\tilde v^{(0)} = e^{c}`.

    One pass per row normalisation: it computes ``u`` block by block and, on the same blocks,
    the column sums ``K^T u`` of the following column normalisation; the last pass also writes
    ``out``. Returns ``us = [u1, u3, ..]``, ``vs = [v0, v2, ..]``, the ``(c,)`` normalisations
    run, the :class:`~.problem.Tolerance` (``None`` for a fixed count) and, for the implicit
    backward after a fixed count, the column error of the final plan."""
    us, vs = [], [col_shift.exp()]
    c = a.shape[0]
    implicit = options.backward == "implicit"
    empty = (a == 0).to(a.dtype)
    shift = col_shift  # the first pass exponentiates
    if options.tol is None:
        n_iters, col_error = options.n_iters, None
        for t in range(1, n_iters + 1, 2):
            last = t == n_iters
            output = (vs[-1], v, drop, out, implicit) if last else None
            u, col = tile.sweep(vs[-1], a, empty, shift, columns=not last or implicit, output=output)
            shift = None
            us.append(u)
            if not last:
                vs.append(_ratio(b, col))
            elif implicit:
                col_error = column_error(vs[-1] * col, b)
        if n_iters % 2 == 0:  # ends on a column normalisation: one more pass for the output
            if implicit:
                col_error = column_error(vs[-1] * col, b)
            tile.output(us[-1], vs[-1], v, drop, out)
        return us, vs, torch.full((c,), n_iters, dtype=torch.int64, device=a.device), None, col_error
    stop = Tolerance(options.tol, options.max_iters, (c,), a.device, ENGINE)
    done = 0
    while True:
        frozen = (stop.active, us[-1]) if us else None
        u, col = tile.sweep(vs[-1], a, empty, shift, frozen=frozen)
        shift = None
        us.append(u)
        done += 1
        if stop.check(column_error(vs[-1] * col, b), done):
            tile.output(us[-1], vs[-1], v, drop, out)
            return us, vs, stop.counts, stop, None
        vs.append(torch.where(stop.active.unsqueeze(-1), _ratio(b, col), vs[-1]))
        done += 1


def _log_iterate(x: Tensor, a: Tensor, b: Tensor, g0: Tensor, options: _Options):
    """The log-domain recursion on the shifted tile ``x``: ``fs = [f1, f3, ..]``, ``gs = [g0, g2, ..]``."""
    log_a = torch.where(a > 0, a.clamp_min(1e-38).log(), torch.zeros_like(a))
    log_b = torch.where(b > 0, b.clamp_min(1e-38).log(), torch.zeros_like(b))

    def rows(g: Tensor) -> Tensor:
        return torch.where(a > 0, log_a - torch.logsumexp(x + g.unsqueeze(-2), -1), torch.zeros_like(a))

    def col_lse(f: Tensor) -> Tensor:
        return torch.logsumexp(x + f.unsqueeze(-1), -2)

    fs, gs = [], [g0]
    c = x.shape[0]
    if options.tol is None:
        for t in range(1, options.n_iters + 1):
            if t % 2:
                fs.append(rows(gs[-1]))
            else:
                gs.append(torch.where(b > 0, log_b - col_lse(fs[-1]), torch.zeros_like(b)))
        return fs, gs, torch.full((c,), options.n_iters, dtype=torch.int64, device=x.device), None
    stop = Tolerance(options.tol, options.max_iters, (c,), x.device, ENGINE)
    done = 0
    while True:
        f = rows(gs[-1])
        fs.append(f if not fs else torch.where(stop.active.unsqueeze(-1), f, fs[-1]))
        done += 1
        lse = col_lse(fs[-1])
        if stop.check(column_error(torch.exp(gs[-1] + lse), b), done):
            return fs, gs, stop.counts, stop
        g = torch.where(b > 0, log_b - lse, torch.zeros_like(b))
        gs.append(torch.where(stop.active.unsqueeze(-1), g, gs[-1]))
        done += 1


def _trustworthy(us: list[Tensor], vs: list[Tensor]) -> bool:
    """Scalings finite and moderate: entries lost to underflow in K weigh < e^{60-87}."""
    if us[0].numel() == 0 or vs[0].numel() == 0:
        return True
    u_max = torch.stack([u.amax() for u in us]).amax()
    v_max = torch.stack([x.amax() for x in vs]).amax()
    if not (torch.isfinite(u_max) and torch.isfinite(v_max)):
        return False
    if u_max <= 0 or v_max <= 0:
        return True
    return bool(torch.log(u_max) + torch.log(v_max) < _LOG_SCALING_LIMIT)


# ------------------------------------------------------------------------------------------------
# backward


@torch.library.custom_op("sinkformer::tiled_backward", mutates_args=())
def _backward_op(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, keep: Tensor | None, bias: Tensor | None,
    batch: list[int], seed: Tensor | None, row_shift: Tensor, col_shift: Tensor, us: Tensor, vs: Tensor,
    counts: Tensor, log_domain: Tensor, scale: float, n_iters: int | None, tol: float | None, max_iters: int,
    backward: str, dropout_p: float, domain: str, group: int, block: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients ``(dq, dk, dv)`` of the forward op (its saved state: shifts, iterates, counts)."""
    options = _Options(scale, n_iters, tol, max_iters, backward, dropout_p, domain, group, block)
    B, n, m = q.shape[0], q.shape[1], k.shape[1]
    masks = Masks(keep, bias, tuple(batch))
    grad_out = grad_out.contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def run(start: int, scratch: dict) -> None:
        sl = slice(start, min(B, start + group))
        kp = masks.keep_of(sl.start, sl.stop)
        shape = (sl.stop - sl.start, n, m)
        if not _in_log_domain(options, q.device, log_domain, sl.start):
            if "memory" not in scratch:
                scratch["memory"] = _Tile.memory(q, k, group)
            tile = _Tile(q[sl], k[sl], masks, start, options, scratch["memory"])
            a, b = marginals(*valid_rows_cols(kp, shape), shape, tile.K)
            drop = _dropout_mask(tile.K, dropout_p, seed, start)
            _scaling_backward(tile, a, b, row_shift[sl], col_shift[sl], us[sl], vs[sl], counts[sl], grad_out[sl],
                              v[sl], out[sl], drop, options, (dq[sl], dk[sl], dv[sl]))
            return
        x = _shifted_scores(q[sl], k[sl], scale, kp, masks.bias_of(sl.start, sl.stop), row_shift[sl], col_shift[sl])
        a, b = marginals(*valid_rows_cols(kp, shape), shape, x)
        drop = _dropout_mask(x, dropout_p, seed, start)
        dS, dv[sl] = _log_backward(x, a, b, us[sl], vs[sl], counts[sl], grad_out[sl], v[sl], out[sl], drop, options)
        torch.bmm(dS, k[sl], out=dq[sl]).mul_(scale)
        torch.bmm(dS.transpose(1, 2), q[sl], out=dk[sl]).mul_(scale)

    map_groups(list(range(0, B, group)), run, q.device, B * n * m)
    return dq, dk, dv


def _in_log_domain(options: _Options, device: torch.device, log_domain: Tensor, start: int) -> bool:
    """The domain the forward used for the group at ``start`` (read from the flags only where the
    choice depended on the data: the CPU's scaling domain with its fallback)."""
    if not _starts_in_scaling(options, device):
        return True
    return bool(log_domain[start])


def _starts_in_scaling(options: _Options, device: torch.device) -> bool:
    """Whether a group starts in the scaling domain (``domain="auto"``: on the CPU)."""
    return options.domain == "scaling" or (options.domain == "auto" and device.type == "cpu")


@_backward_op.register_fake
def _(grad_out, q, k, v, out, keep, bias, batch, seed, *rest):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _scaling_backward(tile: _Tile, a, b, row_shift, col_shift, us, vs, counts, dO, V, out, drop, options, grads):
    """Gradients of one group in the scaling domain, written into ``grads = (dq, dk, dv)`` (views).

    With :math:`\\partial\\ell/\\partial S = \\tilde K \\odot (\\mathrm{diag}(u)\\,dP\\,\\mathrm{diag}(\\tilde v)
    + XY^\\top)`, :math:`dP = dO\\,V^\\top` (times the dropout mask), in passes over the tile:

    1. recompute :math:`\\tilde K` block by block (kept in the tile) and accumulate
       :math:`D = (\\tilde K\\odot\\mathrm{drop})^\\top(u\\odot dO)`, so :math:`dV = \\tilde v\\odot D`
       (and the column product of the last row step of the reverse recursion, if any);
    2. each further pass runs a column step and the following row step of the reverse recursion
       (:class:`_Reverse`): ``X``, ``Y`` of rank ``L``, one column per normalisation;
    3. the last pass runs the last two steps, forms ``dS`` block by block in cache (one product
       ``[u ⊙ dO, X] [vt ⊙ V, Y]^T`` with inner size ``e + L``) and contracts it into
       :math:`dQ = \\mathrm{scale}\\,dS\\,K`, :math:`dK = \\mathrm{scale}\\,dS^\\top Q`.

    ``backward="implicit"`` replaces step 2 by the dual solve of :func:`_implicit_duals` (rank 2)."""
    blocks = tile.blocks
    K = tile.K
    c, n, m = K.shape
    e = V.shape[-1]
    u, vt = us[..., -1], vs[..., -1]
    rev = None if options.backward == "implicit" else _Reverse(a, b, us, vs, counts)
    L = 2 if rev is None else rev.L
    left = K.new_empty(c, n, e + L)  # [u ⊙ dO, X]: X column j is the step t = L - j
    uO, X = torch.mul(u.unsqueeze(-1), dO, out=left[..., :e]), left[..., e:]
    Y = K.new_empty(c, m, L)
    du = torch.where(u > 0, (dO * out).sum(-1) / u, torch.zeros_like(u))  # sum_j K_ij v_j dP_ij
    first = rev.row_coef(L, du) if rev is not None and L % 2 else None  # the last step is a row step
    first_col = K.new_zeros(c, 1, m) if first is not None and L > 1 else None
    D = K.new_zeros(c, m, e)
    uOb, Db = blocks.rows_of(uO), blocks.slices_of(D)
    dropb = blocks.rows_of(drop) if drop is not None else None
    if first_col is not None:
        firstb, first_colb = blocks.rows_of(first.unsqueeze(-1)), blocks.slices_of(first_col)
    for i, Kb in tile.recompute(row_shift, col_shift):
        Db[i].baddbmm_((Kb if dropb is None else Kb * dropb[i]).transpose(1, 2), uOb[i])
        if first_col is not None:
            first_colb[i].baddbmm_(firstb[i].transpose(1, 2), Kb)
    dvt = (V * D).sum(-1)  # sum_i u_i K_ij dP_ij
    grads[2].copy_(D.mul_(vt.unsqueeze(-1)))
    if rev is None:  # dS = P * (dP - alpha ⊕ beta)
        alpha, beta = _implicit_duals(K, u, vt, du * u, dvt * vt)
        X[..., 0], X[..., 1], Y[..., 0], Y[..., 1] = -u * alpha, -u, vt, vt * beta
        _gradient_pass(tile, left, vt, V, Y, drop, grads, options.scale)
        return
    rev.row_ys(Y)
    t = L
    if first is not None:
        du = rev.row_step(L, first, du, X)
        if first_col is not None:
            dvt = dvt + first_col.squeeze(1)
        t = L - 1
    while t > 2:  # column step t and row step t - 1 in one pass
        ds, dvt = rev.col_step(t, dvt, X, Y)
        du, next_col = _row_step_pass(tile, rev, t - 1, du, ds, X)
        dvt = dvt + next_col
        t -= 2
    last = (rev, du, rev.col_step(2, dvt, X, Y)[0]) if t == 2 else None  # steps 2 and 1 in the last pass
    _gradient_pass(tile, left, vt, V, Y, drop, grads, options.scale, last)


def _row_step_pass(tile: _Tile, rev: _Reverse, t: int, du: Tensor, ds: Tensor, X: Tensor) -> tuple[Tensor, Tensor]:
    """Row step ``t`` of the reverse recursion after a column step (``ds``), block by block:
    :math:`du \\mathrel{+}= \\tilde K ds`, :math:`dr = du \\odot` :meth:`_Reverse.row_factor`, recorded
    in ``X``; returns ``du`` after the step and the column product :math:`\\tilde K^\\top dr` ``(c, m)``."""
    blocks = tile.blocks
    c, n, m = tile.K.shape
    total, dr = torch.empty_like(du).unsqueeze(-1), torch.empty_like(du).unsqueeze(-1)
    col = tile.K.new_zeros(c, 1, m)
    dub, dsb, factorb = blocks.rows_of(du.unsqueeze(-1)), blocks.slices_of(ds.unsqueeze(-1)), blocks.rows_of(
        rev.row_factor(t).unsqueeze(-1))
    totalb, drb, colb = blocks.rows_of(total), blocks.rows_of(dr), blocks.slices_of(col)
    for i, Kb in enumerate(tile.Kb):
        torch.baddbmm(dub[i], Kb, dsb[i], out=totalb[i])
        torch.mul(totalb[i], factorb[i], out=drb[i])
        colb[i].baddbmm_(drb[i].transpose(1, 2), Kb)
    return rev.row_step(t, dr.squeeze(-1), total.squeeze(-1), X), col.squeeze(1)


class _Reverse:
    """Reverse mode through the scaling recursion, one step at a time (``t = L, .., 1``).

    ``us (c, n, Lu)``, ``vs (c, m, Lv)``: the iterates (``L = Lu + Lv - 1`` normalisations); steps
    ``t > counts`` of a matrix were frozen (identity: the gradient passes through). A row step
    :math:`u_t = a \\oslash \\tilde K v_{t-1}` turns the gradient ``du`` into the row coefficient
    :math:`dr = -du\\, u_t^2 / a` (then :math:`d\\tilde v \\mathrel{+}= \\tilde K^\\top dr`), a column
    step the column coefficient :math:`ds = -d\\tilde v\\, \\tilde v_t^2 / b` (then :math:`du
    \\mathrel{+}= \\tilde K ds`); each adds the rank-one term :math:`dr\\,v_{t-1}^\\top` or
    :math:`u_{t-1}\\,ds^\\top` to :math:`\\partial\\ell/\\partial\\tilde K`, stored as column ``L - t``
    of ``X (c, n, L)``, ``Y (c, m, L)``."""

    def __init__(self, a: Tensor, b: Tensor, us: Tensor, vs: Tensor, counts: Tensor):
        self.us, self.vs, self.counts = us, vs, counts
        self.inv_a, self.inv_b = _ratio(a, a.square()), _ratio(b, b.square())
        self.L = us.shape[-1] + vs.shape[-1] - 1

    def _active(self, t: int) -> Tensor:
        return (self.counts >= t).unsqueeze(-1)

    def row_factor(self, t: int) -> Tensor:
        """:math:`-u_t^2/a` where step ``t`` ran, else 0 ``(c, n)``: ``dr = du ⊙ row_factor``."""
        u_t = self.us[..., (t - 1) // 2]
        return torch.where(self._active(t), -self.inv_a * u_t.square(), torch.zeros_like(u_t))

    def row_coef(self, t: int, du: Tensor) -> Tensor:
        return du * self.row_factor(t)

    def row_ys(self, Y: Tensor) -> None:
        """The ``Y`` columns of every row step: :math:`v_{t-1}`, known before the reverse pass."""
        for t in range(1, self.L + 1, 2):
            Y[..., self.L - t] = self.vs[..., (t - 1) // 2]

    def row_step(self, t: int, dr: Tensor, du: Tensor, X: Tensor) -> Tensor:
        """Record the row step's coefficient ``dr`` in ``X``; returns ``du`` after it (0 where it ran)."""
        X[..., self.L - t] = dr
        return torch.where(self._active(t), torch.zeros_like(du), du)

    def col_step(self, t: int, dvt: Tensor, X: Tensor, Y: Tensor) -> tuple[Tensor, Tensor]:
        """Column coefficient ``ds`` of step ``t`` (its term recorded) and ``dvt`` after it."""
        v_t = self.vs[..., t // 2]
        act = self._active(t)
        ds = torch.where(act, -self.inv_b * dvt * v_t.square(), torch.zeros_like(dvt))
        X[..., self.L - t] = self.us[..., t // 2 - 1]
        Y[..., self.L - t] = ds
        return ds, torch.where(act, torch.zeros_like(dvt), dvt)


def _gradient_pass(tile: _Tile, left, vt, V, Y, drop, grads, scale, last_steps=None) -> None:
    """The last pass: :math:`dS = \\tilde K\\odot(\\mathrm{diag}(u)\\,dP\\,\\mathrm{diag}(\\tilde v)
    + XY^\\top)` block by block, contracted into ``dq`` (rows of the block) and ``dk`` (summed).

    ``left = [u ⊙ dO, X] (c, n, e + L)``. ``last_steps = (reverse, du, ds2)``: the column step 2 ran
    (``ds2``); :math:`du + \\tilde K ds_2` and the row step 1 (the last column of ``X``, the
    block's rows of ``left``) run here, block by block, before the block's ``dS``."""
    dq, dk, _ = grads
    blocks = tile.blocks
    e, L = V.shape[-1], Y.shape[-1]
    dk.zero_()
    vV = vt.unsqueeze(-1) * V
    dqb, dkb, qb, kb = blocks.rows_of(dq), blocks.slices_of(dk), blocks.rows_of(tile.q), blocks.slices_of(tile.k)
    leftb = blocks.rows_of(left)
    if drop is None:
        rightb = blocks.slices_of(torch.cat([vV, Y], -1).transpose(1, 2))  # (c, e + L, m)
    else:
        dropb, vVb, Yb = blocks.rows_of(drop), blocks.slices_of(vV.transpose(1, 2)), blocks.slices_of(Y.transpose(1, 2))
    if last_steps is not None:
        rev, du, ds = last_steps
        total = torch.empty_like(du).unsqueeze(-1)
        dub, dsb, totalb = blocks.rows_of(du.unsqueeze(-1)), blocks.slices_of(ds.unsqueeze(-1)), blocks.rows_of(total)
        factorb = blocks.rows_of(rev.row_factor(1).unsqueeze(-1))
        lastb = blocks.rows_of(left[..., e + L - 1:])  # X[..., L - 1]: the row step 1
    for i, Kb in enumerate(tile.Kb):
        if last_steps is not None:
            torch.baddbmm(dub[i], Kb, dsb[i], out=totalb[i])
            torch.mul(totalb[i], factorb[i], out=lastb[i])
        if drop is None:
            dP = torch.bmm(leftb[i], rightb[i])
        else:
            dP = torch.bmm(leftb[i][..., :e], vVb[i]).mul_(dropb[i])
            dP.baddbmm_(leftb[i][..., e:], Yb[i])
        dS = dP.mul_(Kb)
        dqb[i].baddbmm_(dS, kb[i], beta=0.0, alpha=scale)
        dkb[i].baddbmm_(dS.transpose(1, 2), qb[i], alpha=scale)


def _log_backward(x, a, b, fs, gs, counts, dO, V, out, drop, options):
    """``(dS, dV)`` of one group in the log domain (every iteration's plan recomputed)."""
    P = torch.exp(x + fs[..., -1].unsqueeze(-1) + gs[..., -1].unsqueeze(-2))
    dP = torch.bmm(dO, V.transpose(1, 2))
    if drop is not None:
        dP.mul_(drop)
    dV = torch.bmm((P if drop is None else P * drop).transpose(1, 2), dO)
    if options.backward == "implicit":
        dF, dG = (P * dP).sum(-1), (P * dP).sum(-2)
        alpha, beta = _implicit_duals(P, torch.ones_like(a), torch.ones_like(b), dF, dG)
        return dP.sub_(alpha.unsqueeze(-1)).sub_(beta.unsqueeze(-2)).mul_(P), dV
    dS = dP.mul_(P)
    dF, dG = dS.sum(-1), dS.sum(-2)
    del P
    inv_a, inv_b = _ratio(a, a.square()), _ratio(b, b.square())  # 1/a, 0 where a = 0
    for t in range(fs.shape[-1] + gs.shape[-1] - 1, 0, -1):
        act = (counts >= t).unsqueeze(-1)
        if t % 2:  # f_t = log a - LSE_j(x + g_{t-1}); R = exp(x + f_t ⊕ g_{t-1}) has rows a
            i = (t - 1) // 2
            R = torch.exp(x + fs[..., i].unsqueeze(-1) + gs[..., i].unsqueeze(-2))
            coef = torch.where(act, dF * inv_a, torch.zeros_like(dF))
            dS.sub_(R.mul_(coef.unsqueeze(-1)))
            dG = dG - R.sum(-2)
            dF = torch.where(act, torch.zeros_like(dF), dF)
        else:  # g_t = log b - LSE_i(x + f_{t-1}); C = exp(x + f_{t-1} ⊕ g_t) has columns b
            i = t // 2
            C = torch.exp(x + fs[..., i - 1].unsqueeze(-1) + gs[..., i].unsqueeze(-2))
            coef = torch.where(act, dG * inv_b, torch.zeros_like(dG))
            dS.sub_(C.mul_(coef.unsqueeze(-2)))
            dF = dF - C.sum(-1)
            dG = torch.where(act, torch.zeros_like(dG), dG)
    return dS, dV


def _implicit_duals(K, u, vt, r, c, max_iters=1000):
    """:func:`~.problem.implicit_duals` for ``P = diag(u) K diag(vt)`` (products on the cached tile)."""
    tol = 1e-10 if K.dtype == torch.float64 else 1e-6
    return implicit_duals(lambda y: u * _mv(K, vt * y), lambda x: vt * _mtv(K, u * x), r, c, tol=tol,
                          max_iters=max_iters)


def _dropout_mask(like: Tensor, p: float, seed: Tensor | None, start: int) -> Tensor | None:
    """The scaled Bernoulli keep-mask ``(c, n, m)`` of the group starting at ``start`` (or None)."""
    if not p:
        return None
    generator = torch.Generator(device=like.device).manual_seed(int(seed.item()) + start)
    return torch.empty_like(like).bernoulli_(1.0 - p, generator=generator).div_(1.0 - p)


# ------------------------------------------------------------------------------------------------
# autograd


def _setup_context(ctx, inputs, output):
    q, k, v, keep, bias, batch, seed, *options = inputs
    out, row_shift, col_shift, us, vs, counts, log_domain = output
    ctx.save_for_backward(q, k, v, out, keep, bias, seed, row_shift, col_shift, us, vs, counts, log_domain)
    ctx.batch, ctx.options = batch, options


def _backward(ctx, grad_out, *unused):
    q, k, v, out, keep, bias, seed, row_shift, col_shift, us, vs, counts, log_domain = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph=True: second derivatives through the dense engine
        dq, dk, dv = _dense_grads(grad_out, q, k, v, keep, bias, ctx.batch, seed, _Options(*ctx.options))
    else:
        dq, dk, dv = torch.ops.sinkformer.tiled_backward(
            grad_out, q, k, v, out, keep, bias, ctx.batch, seed, row_shift, col_shift, us, vs, counts, log_domain,
            *ctx.options,
        )
    return (dq, dk, dv) + (None,) * 13


torch.library.register_autograd("sinkformer::tiled_forward", _backward, setup_context=_setup_context)
compute_in_float32_under_autocast("sinkformer::tiled_forward", "sinkformer::tiled_backward")


def _dense_grads(grad_out, q, k, v, keep, bias, batch, seed, options: _Options):
    """First derivatives with a graph (for second derivatives): the dense engine's weights with
    the same dropout masks, differentiated by autograd."""
    from .dense import attention_grads_with_graph

    if options.backward == "implicit":
        raise NotImplementedError(
            "second derivatives of backward='implicit' are not implemented (engine 'tiled'); "
            "use backward='unrolled' for double backward (e.g. gradient penalties)"
        )
    B, n, m = q.shape[0], q.shape[1], k.shape[1]
    drop = None
    if options.dropout_p:
        like, group = q.new_empty(B, n, m), options.group
        drop = torch.cat([_dropout_mask(like[s:s + group], options.dropout_p, seed, s) for s in range(0, B, group)])
    return attention_grads_with_graph(grad_out, q, k, v, Masks(keep, bias, tuple(batch)), scale=options.scale,
                                      n_iters=options.n_iters, tol=options.tol, max_iters=options.max_iters, drop=drop)
