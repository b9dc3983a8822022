r"""The tiled engine: Sinkhorn attention at SoftMax-like cost, O(n) saved per slice.

For a group of (batch·head) slices at a time (:func:`~.sizes.group_size`: 2^20 scores or one
slice on the CPU, a memory budget on a GPU) the forward builds :math:`S = \mathrm{scale}\,QK^\top +
\mathrm{bias}`, doubly shifts it (:func:`~.problem.double_shift`: every row and column of
:math:`x = S - m_i - c_j` has maximum 0) and runs the iterations of :mod:`.problem` on that
cached tile in one of two domains:

* **scaling** (CPU default, :mod:`.scaling`): :math:`\tilde K = e^{x}`, :math:`P^{(t)} =
  \mathrm{diag}(u)\tilde K \mathrm{diag}(\tilde v)` from :math:`\tilde v^{(0)} = e^{c}`; each
  normalisation is one matrix-vector product (:math:`u \leftarrow a \oslash \tilde K\tilde v`,
  :math:`\tilde v \leftarrow b \oslash \tilde K^\top u`), no exponential, and the output
  :math:`u \odot \tilde K(\tilde v \odot V)` is one matrix product. The tile is visited in cache
  blocks of about :data:`~.sizes.CACHE_BLOCK_ELEMENTS` scores, every product that needs a block
  run while it is in cache, so a row and a column normalisation share one pass; the backward is
  the exact gradient of the ``n_iters`` map (a rank-``n_iters`` correction to SoftMax's), in 3
  passes for 5 iterations.
* **log** (GPUs, and any CPU group whose scalings leave :math:`\max u\cdot\max\tilde v < e^{60}`,
  e.g. score ranges of 1e4): :math:`f \leftarrow \log a - \mathrm{LSE}_j(x + g)`,
  :math:`g \leftarrow \log b - \mathrm{LSE}_i(x + f)` on the cached tile. Never wrong, one
  exponential of the tile per normalisation, and no data-dependent branch — so on a GPU the
  engine never synchronises with the host (fixed ``n_iters``). The backward recomputes every
  iteration's plan.

Only the shifts and the scalings (or potentials) of every iteration are saved. ``backward="implicit"``
differentiates the balanced fixed point instead (implicit function theorem): :math:`\partial\ell/\partial
S = P\odot(dP - \alpha\oplus\beta)` where :math:`[\mathrm{diag}(a)\ P;\ P^\top\ \mathrm{diag}(b)]
[\alpha;\beta] = [(P\odot dP)\mathbf 1;\ (P\odot dP)^\top\mathbf 1]` is solved by conjugate gradients.

The forward and backward are ``torch.library`` custom ops (``sinkformer::tiled_forward``,
``sinkformer::tiled_backward``) with fake implementations, so ``torch.compile(fullgraph=True)``
and ``torch.export`` see one opaque node each. Second derivatives (``create_graph=True``)
recompute the weights with the dense engine and differentiate them by autograd: exact, at the
dense engine's memory.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._capture import capturing
from . import cpu_parallel, native, sizes
from .problem import Problem, column_error, double_shift, log_marginal
from .ops import refuse_implicit_second_derivatives, register_engine_autograd
from .sizes import group_size
from .loop import reverse_schedule, sinkhorn_loop
from .scaling import GroupState, Options, dropout_mask, implicit_duals_of, run_backward, run_forward, uses_native

__all__ = ["tiled_attention", "call_group"]

ENGINE = "tiled"
#: Iteration domain: ``"auto"`` (scaling on the CPU, log on GPUs), ``"scaling"`` or ``"log"``. The
#: conformance suite sets ``"log"`` to hold the GPUs' domain to the reference on the CPU.
DOMAIN = "auto"


def tiled_attention(problem: Problem, *, backward: str = "unrolled", dropout_p: float = 0.0,
                    domain: str | None = None) -> Tensor:
    """Sinkhorn attention ``(B, n, d) x (B, m, d) x (B, m, e) -> (B, n, e)`` of a validated
    :class:`~.problem.Problem` (flat over its batch, in compute precision, ``bias`` without gradient).
    ``dropout_p`` drops weights after normalisation (the mask of each group is drawn from a seed taken
    from the global generator, and drawn again in the backward). ``domain``: :data:`DOMAIN` by default.
    """
    domain = DOMAIN if domain is None else domain
    seed = torch.randint(0, 2**62, (1,)) if dropout_p > 0 else None
    group = group_size(problem.B, problem.n, problem.m, problem.q.device)
    native_passes = (not capturing() and _group_may_change(problem.B, problem.n, problem.m, group)
                     and uses_native(problem, _options(backward, dropout_p, domain, group, sizes.CACHE_BLOCK_ELEMENTS)))
    group = call_group(problem.B, problem.n, problem.m, problem.q.device, native_passes)
    return _forward_autograd(*problem.fields(), seed, backward, dropout_p, domain, group,
                             sizes.CACHE_BLOCK_ELEMENTS)[0]


def call_group(B: int, n: int, m: int, device: torch.device, native_passes: bool) -> int:
    """Slices per group of a call of ``B`` slices ``n x m``: :func:`~.sizes.group_size`, except where the groups run
    the native passes:

    * their C calls split a group's slices over PyTorch's threads (:func:`.native.threaded`): at least one slice per
      thread, the groups then running in order, each C call and product on every thread
      (:func:`~.scaling.parallel_above`; at n = 1024 a slice per group on a Python thread per core took longer:
      ``docs/speed.md``);
    * else, in a call of at least :data:`~.cpu_parallel.NATIVE_PARALLEL_ABOVE` scores, at most a core's share of the
      slices, so that :func:`~.cpu_parallel.map_groups` gives each core its own groups.

    Under graph capture the thread count is not a constant of the trace: the groups stay
    :func:`~.sizes.group_size`'s (the same values; every slice is computed on its own)."""
    group = group_size(B, n, m, device)
    if not native_passes or capturing():
        return group
    threads = torch.get_num_threads()
    if native.threaded():
        return max(group, min(B, threads))
    if B * n * m >= cpu_parallel.NATIVE_PARALLEL_ABOVE:
        return min(group, -(-B // threads))
    return group


def _group_may_change(B: int, n: int, m: int, group: int) -> bool:
    """Whether :func:`call_group` may differ from ``group`` (:func:`~.sizes.group_size`'s) for a call of ``B`` slices:
    groups of fewer slices than threads, or a call of at least :data:`~.cpu_parallel.NATIVE_PARALLEL_ABOVE` scores
    (only then is it worth asking whether the native passes serve the call)."""
    return group < min(B, torch.get_num_threads()) or B * n * m >= cpu_parallel.NATIVE_PARALLEL_ABOVE


def _options(backward, dropout_p, domain, group, block) -> Options:
    """The ops' own arguments (schema order, after the problem's) as :class:`~.scaling.Options` of a stored tile."""
    return Options(backward, dropout_p, domain, group, block=block, engine=ENGINE)


def _forward_impl(
    q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None, bias: Tensor | None, batch: list[int], scale: float,
    n_iters: int | None, tol: float | None, max_iters: int, seed: Tensor | None, backward: str, dropout_p: float,
    domain: str, group: int, block: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The problem's fields (:meth:`~.problem.Problem.fields`), then the engine's own arguments. Returns
    ``out (B, n, e)``, the shifts ``(B, n)``, ``(B, m)``, the iterates ``(B, n, Lu)``, ``(B, m, Lv)``, the
    normalisations run ``(B,)``, the domain of each slice ``(B,)`` (True: log) and the tiles kept for the
    backward (small calls, :meth:`~.scaling.Options.saves_tile`; else empty). ``group``: slices per group
    (the backward and the dropout masks use the same groups)."""
    problem = Problem(q, k, v, keep, bias, batch, scale, n_iters, tol, max_iters)
    return run_forward(problem, seed, _options(backward, dropout_p, domain, group, block), _log_forward)


_forward_op = torch.library.custom_op("sinkformer::tiled_forward", _forward_impl, mutates_args=())


@_forward_op.register_fake
def _(q, k, v, keep, bias, batch, scale, n_iters, tol, max_iters, seed, backward, dropout_p, domain, group, block):
    problem = Problem(q, k, v, keep, bias, batch, scale, n_iters, tol, max_iters)
    B, n, m = problem.B, problem.n, problem.m
    options = _options(backward, dropout_p, domain, group, block)
    lengths = problem.history_length(backward == "implicit")
    if lengths is None:
        length = torch.library.get_ctx().new_dynamic_size()
        lengths = (length, length)
    tiles = options.kept_tiles(problem)
    return (q.new_empty(B, n, v.shape[-1]), q.new_empty(B, n), q.new_empty(B, m), q.new_empty(B, n, lengths[0]),
            q.new_empty(B, m, lengths[1]), q.new_empty(B, dtype=torch.int64), q.new_empty(B, dtype=torch.bool), tiles)


def _backward_impl(
    grad_out: Tensor, out: Tensor, q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None, bias: Tensor | None,
    batch: list[int], scale: float, n_iters: int | None, tol: float | None, max_iters: int, seed: Tensor | None,
    row_shift: Tensor, col_shift: Tensor, us: Tensor, vs: Tensor, counts: Tensor, log_domain: Tensor, tiles: Tensor,
    backward: str, dropout_p: float, domain: str, group: int, block: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients ``(dq, dk, dv)`` of the forward op: the output and its gradient, the problem's fields, the
    forward's saved state (shifts, iterates, counts, tiles), the engine's own arguments."""
    problem = Problem(q, k, v, keep, bias, batch, scale, n_iters, tol, max_iters)
    return run_backward(grad_out, problem, out, seed, row_shift, col_shift, us, vs, counts, log_domain, tiles,
                        _options(backward, dropout_p, domain, group, block), _log_backward)


_backward_op = torch.library.custom_op("sinkformer::tiled_backward", _backward_impl, mutates_args=())


@_backward_op.register_fake
def _(grad_out, out, q, k, v, *rest):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


# ------------------------------------------------------------------------------------------------
# the log domain on the whole tile of a group


def _log_forward(group: Problem, options: Options, seed, out: Tensor, row_shift: Tensor | None,
                 col_shift: Tensor | None) -> GroupState:
    """Forward of one group in the log domain (writes ``out``); ``row_shift``/``col_shift``: those of a
    scaling attempt that was not trusted, else computed here."""
    shape = (group.B, group.n, group.m)
    if row_shift is None:
        x, row_shift, col_shift = double_shift(group.scores(), inplace=True)
    else:
        x = _shifted_scores(group, row_shift, col_shift)
    a, b = group.marginals(x)
    drop = dropout_mask(shape, x, options.dropout_p, seed, group.first)
    fs, gs, counts, stop = _log_iterate(x, a, b, col_shift, group)
    P = x.add_(fs[-1].unsqueeze(-1)).add_(gs[-1].unsqueeze(-2)).exp_()
    col_error = column_error(P.sum(-2), b) if options.backward == "implicit" and group.tol is None else None
    torch.bmm(P if drop is None else P.mul_(drop), group.v, out=out)
    if options.backward == "implicit":
        fs, gs = fs[-1:], gs[-1:]
    return GroupState(row_shift, col_shift, torch.stack(fs, -1), torch.stack(gs, -1), counts, True, stop, col_error)


def _log_backward(grad_out, group: Problem, out, options: Options, seed, row_shift, col_shift, fs, gs, counts,
                  grads) -> None:
    """Gradients of one group computed in the log domain, written into ``grads``."""
    shape = (group.B, group.n, group.m)
    x = _shifted_scores(group, row_shift, col_shift)
    a, b = group.marginals(x)
    drop = dropout_mask(shape, x, options.dropout_p, seed, group.first)
    dq, dk, dv = grads
    dS, dv[...] = _log_gradients(x, a, b, fs, gs, counts, grad_out, group.v, drop, options)
    torch.bmm(dS, group.k, out=dq).mul_(group.scale)
    torch.bmm(dS.transpose(1, 2), group.q, out=dk).mul_(group.scale)


def _shifted_scores(group: Problem, row_shift: Tensor, col_shift: Tensor) -> Tensor:
    """The forward's shifted tile again, from the saved shifts (same operations, same values)."""
    return group.scores().sub_(row_shift.unsqueeze(-1)).sub_(col_shift.unsqueeze(-2))


def _ratio(num: Tensor, den: Tensor) -> Tensor:
    """``num / den`` with 0 where ``num == 0`` (masked rows/columns carry no mass)."""
    return torch.where(num > 0, num / den, torch.zeros_like(num))


def _log_iterate(x: Tensor, a: Tensor, b: Tensor, g0: Tensor, problem: Problem):
    """The log-domain loop (:func:`~.loop.sinkhorn_loop`) on the shifted tile ``x``: ``fs = [f1, f3, ..]``,
    ``gs = [g0, g2, ..]``, the counts and the stop rule."""
    log_a, log_b = log_marginal(a, a > 0), log_marginal(b, b > 0)

    def row_update(g: Tensor, last: bool) -> Tensor:
        return torch.where(a > 0, log_a - torch.logsumexp(x + g.unsqueeze(-2), -1), torch.zeros_like(a))

    def col_update(f: Tensor, g: Tensor) -> tuple[Tensor, Tensor | None]:
        lse = torch.logsumexp(x + f.unsqueeze(-1), -2)
        error = None if problem.tol is None else column_error(torch.exp(g + lse), b)
        return torch.where(b > 0, log_b - lse, torch.zeros_like(b)), error

    run = sinkhorn_loop(row_update, col_update, g0, n_iters=problem.n_iters, tol=problem.tol,
                        max_iters=problem.max_iters, engine=ENGINE)
    return run.fs, run.gs, run.counts, run.stop


def _log_gradients(x, a, b, fs, gs, counts, dO, V, drop, options):
    """``(dS, dV)`` of one group in the log domain (every iteration's plan recomputed)."""
    P = torch.exp(x + fs[..., -1].unsqueeze(-1) + gs[..., -1].unsqueeze(-2))
    dP = torch.bmm(dO, V.transpose(1, 2))
    if drop is not None:
        dP.mul_(drop)
    dV = torch.bmm((P if drop is None else P * drop).transpose(1, 2), dO)
    if options.backward == "implicit":
        dF, dG = (P * dP).sum(-1), (P * dP).sum(-2)
        alpha, beta = implicit_duals_of(P, torch.ones_like(a), torch.ones_like(b), dF, dG)
        return dP.sub_(alpha.unsqueeze(-1)).sub_(beta.unsqueeze(-2)).mul_(P), dV
    dS = dP.mul_(P)
    dF, dG = dS.sum(-1), dS.sum(-2)
    del P

    def row_step(t: int, gamma: Tensor, dG: Tensor) -> Tensor:  # R = exp(x + f_t ⊕ g_{t-1}), rows a
        R = torch.exp(x + fs[..., (t - 1) // 2].unsqueeze(-1) + gs[..., (t - 1) // 2].unsqueeze(-2))
        dS.sub_(R.mul_(gamma.unsqueeze(-1)))
        return dG - R.sum(-2)

    def col_step(t: int, delta: Tensor, dF: Tensor) -> Tensor:  # C = exp(x + f_{t-1} ⊕ g_t), columns b
        C = torch.exp(x + fs[..., t // 2 - 1].unsqueeze(-1) + gs[..., t // 2].unsqueeze(-2))
        dS.sub_(C.mul_(delta.unsqueeze(-2)))
        return dF - C.sum(-1)

    reverse_schedule(dF, dG, counts, fs.shape[-1] + gs.shape[-1] - 1, _ratio(a, a.square()), _ratio(b, b.square()),
                     row_step, col_step)
    return dS, dV


# ------------------------------------------------------------------------------------------------
# autograd


def _setup_context(ctx, inputs, output):
    q, k, v, keep, bias, batch, scale, n_iters, tol, max_iters, seed, *options = inputs
    out, row_shift, col_shift, us, vs, counts, log_domain, tiles = output
    ctx.save_for_backward(q, k, v, out, keep, bias, seed, row_shift, col_shift, us, vs, counts, log_domain, tiles)
    ctx.schedule, ctx.options = (batch, scale, n_iters, tol, max_iters), options


def _problem(ctx, q, k, v, keep, bias) -> Problem:
    """The forward's problem again, from the saved tensors and the schedule."""
    return Problem(q, k, v, keep, bias, *ctx.schedule)


def _first_derivatives(ctx, grad_out, backward):
    q, k, v, out, keep, bias, seed, row_shift, col_shift, us, vs, counts, log_domain, tiles = ctx.saved_tensors
    return backward(grad_out, out, *_problem(ctx, q, k, v, keep, bias).fields(), seed, row_shift, col_shift, us, vs,
                    counts, log_domain, tiles, *ctx.options)


def _second_derivatives(ctx, grad_out):
    q, k, v, out, keep, bias, seed, *_ = ctx.saved_tensors
    return _dense_grads(grad_out, _problem(ctx, q, k, v, keep, bias), seed, _options(*ctx.options))


_forward_autograd = register_engine_autograd(
    "sinkformer::tiled_forward", "sinkformer::tiled_backward", n_inputs=16, forward_impl=_forward_impl,
    backward_impl=_backward_impl,
    setup_context=_setup_context, first_derivatives=_first_derivatives, second_derivatives=_second_derivatives)


def _dense_grads(grad_out, problem: Problem, seed, options: Options):
    """First derivatives with a graph (for second derivatives): the dense engine's weights with
    the same dropout masks, differentiated by autograd."""
    from .dense import attention_grads_with_graph

    refuse_implicit_second_derivatives(options.backward, ENGINE)
    B, n, m = problem.B, problem.n, problem.m
    drop = None
    if options.dropout_p:
        group = options.group
        drop = torch.cat([dropout_mask((min(B, s + group) - s, n, m), problem.q, options.dropout_p, seed, s)
                          for s in range(0, B, group)])
    return attention_grads_with_graph(grad_out, problem, drop=drop)
