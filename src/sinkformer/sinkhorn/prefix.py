r"""Prefix Sinkhorn: every prefix of a causal problem balanced on its own, all at once.

Causal attention may not let query :math:`t` depend on anything after :math:`t`, but a column
normalisation sums over *all* queries. The leakage-free definition balances, for each
:math:`t`, the prefix problem alone — rows and columns :math:`0..t` of the causally masked
matrix :math:`K_{ij} = e^{S_{ij}}`, :math:`j \le i` — and keeps its row :math:`t`:

.. math::

    P_{t\cdot} \;=\; \big(\mathcal S^{(t)}_{n\_iters}(S_{0..t,\,0..t})\big)_{t\cdot},

so nothing after :math:`t` can influence row :math:`t` (zero gradient from the future, by
construction). :math:`\mathcal S^{(t)}` is the log-domain Sinkhorn of :mod:`.dense`
(``n_iters`` normalisations, rows first from :math:`g = 0`, or columns first with
``start="columns"``) with row marginals 1 and the prefix's column marginals :math:`b^{(t)}`.

**Cost.** Write :math:`F[t, i]`, :math:`G[t, j]` for the potentials of prefix :math:`t`. A
potential that does not depend on :math:`t` (the first update, made from zeros) turns the next
update into a *cumulative* sum over rows: :math:`G[t, j] = \log b^{(t)}_j -
\log\sum_{i \le t} e^{S_{ij} + f_i}` is one ``logcumsumexp``. The last update is needed on the
diagonal only (row :math:`t` of prefix :math:`t`): a SoftMax with the key bias
:math:`G[t,\cdot]`. So two normalisations plus the last one cost :math:`O(n^2)` — exactly
:math:`n\_iters \le 3` when rows come first, like SoftMax attention; for 2 and 3 iterations
these run without logarithms (a row SoftMax, its cumulative column sums and a few elementwise
passes: :func:`_rows_first_in_scaling_domain`), rows whose sums underflow in the log domain. Every further
normalisation is a *matrix product* over all prefixes at once, in the scaling domain
(:func:`_scaling_domain`: :math:`U = 1 \oslash (V K^\top)`, :math:`K = e^{S}`, :math:`U = e^{F}`,
:math:`V = e^{G}`): :math:`O(n^3)` multiply-adds at matrix-multiply speed with :math:`O(n^2)` memory.
Rows whose scalings are not trusted take the log domain: log-sum-exp matrix products
:math:`F[t,i] = -\log\sum_j e^{G[t,j] + S_{ij}}` (:func:`log_matmul`, a max-shifted ``matmul``; entries
that would lose precision to underflow are recomputed one by one with exact log-sum-exps). The brute
force — one Sinkhorn per prefix — costs :math:`O(n^3)` *exponentials* per normalisation and
:math:`O(n^3)` memory.

Column marginals (``marginals=``):

* ``"causal"`` — the column sums of *uniform* causal attention on the prefix,
  :math:`b^{(t)}_j = \sum_{i=j}^{t} 1/|\{j' \le i \text{ kept}\}|` (:math:`\sum_{i=j}^t
  1/(i+1)` without padding). Uniform column marginals make the causal problem degenerate (the
  only lower-triangular matrix with unit row and column sums is the identity, so iterating
  drives every token to attend to itself); these are the marginals that attention with constant
  scores already has, so :math:`S = \text{const}` is a fixed point and SoftMax-like entropy
  survives. This is the causal Sinkformer's choice (``docs/theory.md``).
* ``"uniform"`` — the dense engine's default on each prefix: rows 1, valid columns
  ``n_valid_rows / n_valid_columns`` (Sparse Sinkhorn Attention's causal block sorting, where
  both counts are equal).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from .._capture import capturing, exact_path, patched
from .._validation import _skip_data_checks, broadcastable, check_positive_int, check_tensor, compute_dtype
from .problem import log_marginal, trusted_scalings

__all__ = ["MARGINALS", "prefix_sinkhorn", "prefix_column_marginals", "log_matmul", "log_cumsum_exp", "cumsum_rows",
           "cumsum_rows_", "running_sums", "scaled_rows", "safe_sums", "scaled_by_sums", "row_totals",
           "small_sums_below", "inverse_count_sums"]

MARGINALS = ("causal", "uniform")
#: Fewest rows for which the scaling domain divides by :class:`_Quotient`, whose memory matters for long
#: sequences: below, its own operations cost more than the memory it saves is worth. Interleaved runs of the
#: causal block sorting (5 rounds, informal), with quotients at every size: 1.22x as long at 8 blocks, 1.07x
#: at 16, 1.00x at 32, 1.04x at 96 (32 x 4 slices), 1.03x at 256 (4 slices); from 32 rows on: 1.10x at 32,
#: 1.15x at 96, 1.02x at 256. benchmarks/results/ab_issue26_sort_quotient.md has this threshold.
QUOTIENT_MIN_N = 128
_EXACT_CHUNK = 1 << 22  # terms per chunk of the exact log-sum-exp fallback


def prefix_sinkhorn(
    scores: Tensor,
    n_iters: int,
    *,
    mask: Tensor | None = None,
    marginals: str = "causal",
    start: str = "rows",
) -> Tensor:
    r"""Row :math:`t` of the balanced prefix problem :math:`0..t`, for every :math:`t`: ``(..., n, n)``.

    Args:
        scores: ``(..., n, n)`` floating scores :math:`S` (row = query, column = key); entries
            above the diagonal are ignored (the causal mask :math:`j \le i` is always applied);
            ``-inf`` entries are masked.
        n_iters: normalisations per prefix (>= 1); with ``start="rows"`` 1 is causal SoftMax.
        mask: bool, broadcastable to ``scores``, True = keep (``(..., 1, n)`` for key padding);
            rows and columns of a prefix with no kept entry are excluded (zero), as in
            :mod:`.dense`.
        marginals: ``"causal"`` or ``"uniform"`` column marginals (module docstring).
        start: ``"rows"`` (the Sinkformer order) or ``"columns"`` (the first normalisation
            over the rows of each column, as the block sorting of Sparse Sinkhorn Attention).

    Returns:
        ``P`` lower triangular, in the compute dtype of ``scores`` (float32 at least):
        row :math:`t` equals row :math:`t` of :func:`sinkformer.sinkhorn` applied to
        ``scores[..., :t+1, :t+1]`` under the causal mask, with the same ``n_iters`` and
        marginals. Differentiable (autograd, :math:`O(n^2\,n\_iters)` memory).
    """
    check_tensor(scores, "scores", min_dim=2, floating=True)
    n = scores.shape[-1]
    if scores.shape[-2] != n:
        raise ValueError(f"scores must be square (..., n, n) for prefix Sinkhorn, got shape {tuple(scores.shape)}")
    check_positive_int(n_iters, "n_iters")
    if marginals not in MARGINALS:
        raise ValueError(f"marginals must be one of {MARGINALS}, got {marginals!r}")
    if start not in ("rows", "columns"):
        raise ValueError(f"start must be 'rows' or 'columns', got {start!r}")
    if mask is not None:
        check_tensor(mask, "mask", dtype_bool=True)
        if not broadcastable(mask.shape, scores.shape):
            raise ValueError(f"mask must broadcast to the scores shape {tuple(scores.shape)}, got shape {tuple(mask.shape)}")
    problem = _Prefix.build(scores, mask, marginals, start)
    if start == "rows" and n_iters in (2, 3):
        weights, inexact = _rows_first_in_scaling_domain(problem, n_iters)
    elif n_iters > 1 and problem.x.numel():
        weights, inexact = _scaling_domain(problem, n_iters, start)
    else:
        return _log_domain(problem, n_iters, start)
    if capturing():  # no data-dependent shapes: every prefix in the log domain where one row needs it
        return patched(weights, inexact.unsqueeze(-1), _log_domain_of, *problem.tensors(), n_iters=n_iters,
                       start=start)
    return _patch_tail(weights, inexact, problem, n_iters, start)


def _patch_tail(weights: Tensor, inexact: Tensor, problem: "_Prefix", n_iters: int, start: str) -> Tensor:
    r"""``weights (..., n, n)`` with the ``inexact (..., n)`` rows taken from the log domain, computed
    for the prefixes from the first inexact row of any slice on only: row :math:`t` reads prefix
    :math:`t`'s potentials alone, so rows :math:`t \ge t_0` cost :math:`O((n - t_0)\,n)` per
    potential instead of :math:`O(n^2)`. Untrusted rows tend to come last: longer prefixes spread their
    scalings further (the causal block sorting of 16k tokens, 256 blocks: rows 174 to 255 of one slice)."""
    rows = inexact.reshape(-1, inexact.shape[-1]).any(0)
    if not bool(rows.any()):
        return weights
    first = int(rows.to(torch.uint8).argmax())
    tail = torch.where(inexact[..., first:].unsqueeze(-1), _log_domain(problem, n_iters, start, first),
                       weights[..., first:, :])
    return tail if first == 0 else torch.cat([weights[..., :first, :], tail], dim=-2)


@exact_path
def _log_domain_of(*tensors: Tensor, n_iters: int, start: str) -> Tensor:
    """:func:`_log_domain` of the problem ``_Prefix(*tensors)`` (an exact path of :func:`patched`)."""
    return _log_domain(_Prefix(*tensors), n_iters, start)


def _log_domain(problem: "_Prefix", n_iters: int, start: str, first: int = 0) -> Tensor:
    """The weights of :func:`prefix_sinkhorn` from log-domain potentials (any ``n_iters``, any range):
    its rows ``first..n-1``, ``(..., n - first, n)``, from the potentials of those prefixes only."""
    last_is_row = ((n_iters - 1) % 2 == 0) == (start == "rows")
    f = g = None  # potentials: None (zero), a vector (..., n) shared by every prefix, or a matrix [t - first, j]
    for step in range(n_iters - 1 if last_is_row else n_iters):
        if (step % 2 == 0) == (start == "rows"):
            f = problem.row_update(g, first)
        else:
            g = problem.column_update(f, first)
    if last_is_row:  # row t of prefix t with the key bias G[t, :]: a SoftMax, O(n^2)
        x_rows = problem.x_rows[..., first:, :]
        weights = torch.softmax(x_rows if g is None else x_rows + g, dim=-1)
        return torch.where(problem.row_valid[..., first:].unsqueeze(-1), weights, 0.0)
    own = f  # row t's potential in prefix t: F[t, t], the diagonal of the matrix [t - first, i] from `first` on
    if f is not None:
        own = f.diagonal(first, dim1=-2, dim2=-1) if f.dim() == problem.x.dim() else f[..., first:]
    logits = problem.x[..., first:, :] if g is None else problem.x[..., first:, :] + g
    return torch.exp(logits if own is None else logits + own.unsqueeze(-1))  # masked entries: exp(-inf) = 0


def _scaling_domain(problem: "_Prefix", n_iters: int, start: str) -> tuple[Tensor, Tensor]:
    r"""The weights of :func:`prefix_sinkhorn` in the scaling domain (any ``n_iters``, either start), and the
    ``(..., n)`` bool of the rows to take from the log domain instead.

    With :math:`K = e^{x}` (``x`` clamped at half the dtype's exponent range, so every sum is finite), the
    potentials of prefix :math:`t` become scalings :math:`U[t, i] = e^{F[t, i]}`, :math:`V[t, j] = e^{G[t, j]}`:
    a row update is :math:`U = 1 \oslash (V K^\top)` on the prefix's rows, a column update
    :math:`V = b \oslash (U K)` on its valid columns: one matrix product each, where the log domain takes a
    log-sum-exp product (:func:`log_matmul`); the first update from zero potentials is a row sum or a
    cumulative column sum. Row :math:`t` of prefix :math:`t` reads rows :math:`\le t` only
    (:math:`U[t, i > t] = 0` and :math:`K` finite: exact zeros). Row :math:`t` is exact unless prefix
    :math:`t`'s scalings are not trusted (:func:`~.problem.trusted_scalings`), one of its sums with mass fell
    below ``tiny ** (1/4)`` (dividing by at least that keeps every value and derivative finite) or one of its
    rows was clamped; each verdict reads rows :math:`\le t` only."""
    x = problem.x
    info = torch.finfo(x.dtype)
    ceiling, floor = math.log(info.max) / 2, info.tiny ** 0.25
    K = torch.exp(x.clamp(max=ceiling))  # masked entries: 0
    bad = None  # (..., n): prefix t has a sum with mass below the floor
    u_max = v_max = None  # (..., n): prefix t's largest scalings

    def divide(marginal: Tensor, sums: Tensor, mass: Tensor, constant: bool = True,
               inverse: Tensor | None = None) -> Tensor:
        """``marginal / sums.clamp_min(floor)`` (no mass: 0); by :class:`_Quotient`, which saves less for the
        backward, for a ``constant`` marginal (``inverse``: its inverse, 0 where it is 0; ``None``: the
        marginal's entries are 0 or 1)."""
        nonlocal bad
        low = torch.where(mass, sums.detach(), 1.0).amin(-1) < floor
        bad = low if bad is None else bad | low
        if not (constant and quotients):
            return marginal / sums.clamp_min(floor)
        return _Quotient.apply(marginal, sums, floor, inverse)

    def largest(running: Tensor | None, scalings: Tensor) -> Tensor:
        new = scalings.detach().amax(-1)
        return new if running is None else torch.maximum(running, new)

    rows, b = problem.prefix_rows.to(x.dtype), torch.where(problem.col_valid, problem.log_b.exp(), 0.0)
    quotients = x.shape[-1] >= QUOTIENT_MIN_N
    inverse_b = torch.where(problem.col_valid, b.reciprocal(), 0.0) if quotients else None
    last_is_row = ((n_iters - 1) % 2 == 0) == (start == "rows")
    U = V = shared = None  # None: zero potentials; shared: U's rows when the same in every prefix
    for step in range(n_iters - 1 if last_is_row else n_iters):
        if (step % 2 == 0) == (start == "rows"):
            if V is None:  # from zero potentials: row i's sum, the same in every prefix
                row_sums = K.sum(-1)
                U = divide(rows, row_sums.unsqueeze(-2).expand(rows.shape), problem.prefix_rows)
                shared = 1 / row_sums.clamp_min(floor)
            else:
                U, shared = divide(rows, V @ K.mT, problem.prefix_rows), None  # [t, i]
            u_max = largest(u_max, U)
        else:  # [t, j]: rows <= t only
            sums = cumsum_rows(K) if U is None else cumsum_rows(K * shared.unsqueeze(-1)) if shared is not None \
                else U @ K
            V = divide(b, sums, problem.col_valid, inverse=inverse_b)
            v_max = largest(v_max, V)
    if last_is_row:  # row t of prefix t: K[t, j] V[t, j], normalised
        A = K if V is None else K * V
        weights = divide(A, A.sum(-1, keepdim=True), problem.row_valid.unsqueeze(-1), constant=False)
    else:  # U[t, t] K[t, j] V[t, j]
        weights = K * V if U is None else U.diagonal(dim1=-2, dim2=-1).unsqueeze(-1) * K * V
    one = torch.ones_like(bad, dtype=x.dtype)
    untrusted = bad | ~trusted_scalings(one if u_max is None else u_max, one if v_max is None else v_max)
    if start == "columns":  # rows may exceed the ceiling (rows first: x <= 0)
        untrusted |= (x.detach() > ceiling).any(-1).to(torch.int32).cumsum(-1) > 0
    return weights, untrusted


class _Quotient(torch.autograd.Function):
    r""":math:`U = m / \max(s, \text{floor})` for a marginal :math:`m` without gradient, given its inverse
    (0 where :math:`m = 0`; ``None``: :math:`m` holds 0s and 1s, its own inverse). The backward reads
    :math:`U` (which the next matrix product keeps anyway), the inverse (one for every step) and where
    :math:`s` was clamped: :math:`ds = -dU\,U^2 / m`, 0 where
    clamped or :math:`m = 0` (:math:`U = 0`). Autograd's division would keep :math:`s` and the clamped
    sums, two more ``(..., n, n)`` arrays per normalisation. Twice differentiable (through :math:`U`)."""

    @staticmethod
    def forward(marginal: Tensor, sums: Tensor, floor: float, inverse: Tensor | None) -> Tensor:
        return marginal / sums.clamp_min(floor)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        marginal, sums, floor, inverse = inputs
        if ctx.needs_input_grad[1]:  # (one tensor is never two inputs: torch.compile refuses that)
            ctx.save_for_backward(output, marginal if inverse is None else inverse, sums.detach() < floor)

    @staticmethod
    def backward(ctx, dU: Tensor):
        U, inverse, clamped = ctx.saved_tensors
        return None, torch.where(clamped, 0.0, -(dU * U) * U * inverse), None, None


def _rows_first_in_scaling_domain(problem: "_Prefix", n_iters: int) -> tuple[Tensor, Tensor]:
    r"""``n_iters`` 2 or 3 from rows without logarithms: the weights and the rows where they are inexact.

    With :math:`R` the causal row SoftMax of the scores (the first update, the same in every
    prefix) and :math:`C_{tj} = \sum_{i \le t} R_{ij}` its cumulative column sums, the column
    update of prefix :math:`t` scales column :math:`j` by :math:`b^{(t)}_j / C_{tj}`, so row
    :math:`t` of prefix :math:`t` is :math:`A_{tj} = R_{tj}\,b^{(t)}_j / C_{tj}` (2 iterations) and
    :math:`A_{tj} / \sum_{j'} A_{tj'}` (3 iterations): a SoftMax, a cumulative sum and a few
    elementwise passes, differentiated by autograd. Row :math:`t` is exact where each of its needed
    :math:`C_{tj}` is at least ``n * tiny / eps`` (a term lost to underflow then weighs less than
    ``eps / n`` of its sum); the ``(..., n)`` bool marks the other rows, finite but to be replaced by
    the log domain's. Each row's verdict reads rows ``<= t`` only, so the result stays causal to the
    last bit."""
    R = torch.softmax(problem.x_rows, dim=-1)
    if _skip_data_checks(R) or not bool(problem.row_valid.all()):
        R = torch.where(problem.row_valid.unsqueeze(-1), R, 0.0)
    weights, _, _, _, inexact_rows = scaled_rows(R, cumsum_rows(R), problem.col_valid, problem.log_b.exp(),
                                              n_iters == 3, R.shape[-1])
    return weights, inexact_rows


def scaled_rows(R: Tensor, C: Tensor, needed: Tensor | None, b: Tensor, normalise: bool, terms: int,
                ) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
    r""":math:`A = b \odot R / C`, and :math:`A / A\mathbf 1` when ``normalise``: causal Sinkhorn's rows
    after 2 (3) iterations from the row SoftMax ``R`` and its cumulative column sums ``C``.

    ``needed``: bool, the entries with mass (causal and kept), broadcastable to ``C``, which is exactly 0
    off them (``R`` is 0 there). Returns the weights, the ``C`` used (:func:`safe_sums`), the ratio
    ``R / C``, the row totals (:func:`row_totals`; ``None`` without ``normalise``) and the ``(..., rows)``
    bool of rows with an inexact entry (``None`` when ``needed`` is: not flagged)."""
    safe_C, inexact_rows = safe_sums(C, needed, terms)
    A, ratio = scaled_by_sums(R, safe_C, b)
    if not normalise:
        return A, safe_C, ratio, None, inexact_rows
    total = row_totals(A)
    return A / total, safe_C, ratio, total, inexact_rows


def small_sums_below(dtype: torch.dtype, terms: int) -> float:
    """The column sum below which an entry of :func:`scaled_rows` is inexact: ``terms * tiny / eps``
    (terms lost to underflow could then exceed its rounding)."""
    info = torch.finfo(dtype)
    return terms * info.tiny / info.eps


def safe_sums(C: Tensor, needed: Tensor | None, terms: int, inplace: bool = False) -> tuple[Tensor, Tensor | None]:
    """The cumulative column sums ``C`` with 1 added where they are below :func:`small_sums_below`: off
    ``needed``, where they are 0, and on inexact entries, whose row is replaced (every ratio of
    :func:`scaled_by_sums` then finite); and the ``(..., rows)`` bool of rows with an inexact entry
    (``None`` when ``needed`` is). ``inplace``: added in ``C`` itself."""
    small = C.detach() < small_sums_below(C.dtype, terms)  # every entry off `needed` (C = 0 there), and the inexact
    inexact_rows = None if needed is None else (needed & small).any(-1)
    return (C.add_(small) if inplace else C + small), inexact_rows


def scaled_by_sums(R: Tensor, safe_C: Tensor, b: Tensor, ratio_in_R: bool = False,
                   out: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor | None]:
    r""":math:`A = b \odot (R / C)` from ``safe_C`` (no zero entry, :func:`safe_sums`): the weights and the
    ratio ``R / C``. ``ratio_in_R`` (no autograd): the ratio and then the weights are formed in ``R``'s
    buffer, and the ratio is not returned; ``out`` (no autograd): the buffers of the ratio and the weights.
    ``b (R / C)``, not ``R (b / C)``: ``R_tj <= C_tj``, so a backward's ``(R / C) / C`` stays finite where
    ``b / C^2`` would not."""
    if ratio_in_R:
        return R.div_(safe_C).mul_(b), None
    if out is not None:
        ratio = torch.div(R, safe_C, out=out[0])
        return torch.mul(ratio, b, out=out[1]), ratio
    ratio = R / safe_C
    return b * ratio, ratio


def row_totals(A: Tensor) -> Tensor:
    """The row sums ``(..., rows, 1)`` of the weights ``A`` ``(..., rows, m)`` by which the third normalisation
    divides them: 1 where a row has no mass."""
    total = A.sum(-1, keepdim=True)
    return torch.where(total > 0, total, 1.0)


#: Rows per triangular product of cumsum_rows: fewer rows, fewer products by zero. Informal timings, one
#: thread, milliseconds for blocks of 64 / 16 rows: 3.31 / 1.56 at (32, 64, 768), 31.6 / 22.9 at (8, 1024, 1024), 67.4 / 47.1 at
#: (1, 4096, 4096) (torch.cumsum: 1.98, 113, 275); 8 rows: within 5 % of 16.
_CUMSUM_BLOCK = 16


def cumsum_rows(x: Tensor, reverse: bool = False) -> Tensor:
    r""":math:`C_{t\cdot} = \sum_{i \le t} x_{i\cdot}` (``reverse``: :math:`\sum_{i \ge t}`): ``torch.cumsum(x, -2)``,
    differentiable, faster on CPUs.

    On the CPU, ``torch.cumsum`` over a dimension other than the last runs element by element
    (about 4x slower than this at 1024 x 1024): here each block of :data:`_CUMSUM_BLOCK` rows is one
    product with a lower-triangular matrix of ones, plus the running total of the rows before it.
    Row :math:`t` reads rows :math:`> t` only through exact zeros, so it is causal to the last bit;
    sums are float32 products (relative error a few ulps). Other devices use ``torch.cumsum``.
    """
    if x.shape[-2] <= 1:
        return x.clone()
    if x.device.type != "cpu":
        return torch.cumsum(x.flip(-2), -2).flip(-2) if reverse else torch.cumsum(x, -2)
    return _CumsumRows.apply(x, reverse)


class _CumsumRows(torch.autograd.Function):
    """Blocked cumulative sum over rows (``reverse``: over rows ``>= t``); the gradient of one
    direction is the other, itself differentiable."""

    @staticmethod
    def forward(x: Tensor, reverse: bool) -> Tensor:
        return _blocked_cumsum(x, reverse)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.reverse = inputs[1]

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _CumsumRows.apply(grad, not ctx.reverse), None


def cumsum_rows_(x: Tensor, reverse: bool = False) -> Tensor:
    """:func:`cumsum_rows` in ``x``'s own buffer (no autograd), with the same sums: each block's product
    reads rows not yet overwritten."""
    if x.shape[-2] <= 1:
        return x
    if x.device.type != "cpu":
        return x.copy_(cumsum_rows(x, reverse))
    return _blocked_cumsum(x, reverse, out=x)


#: Entries per row from which :func:`running_sums` adds row by row on the CPU (one in-place addition per row,
#: every entry read and written once) rather than by one triangular product. Informal timings, one thread,
#: this Xeon, milliseconds row by row / by one product / by :func:`cumsum_rows` and an addition, for (slices,
#: rows, entries per row): 0.68 / 0.60 / 0.78 at (8, 64, 1024), 1.01 / 0.76 / 0.92 at (32, 64, 256);
#: 1.08 / 1.28 / 1.58 at (8, 64, 2048), 1.02 / 1.19 / 1.78 at (32, 64, 512), 2.14 / 3.08 / 3.59 at
#: (8, 64, 4096).
ROW_BY_ROW_FROM = 1 << 14
#: Most rows that :func:`running_sums` sums by one product with a triangle of ones (``rows² · m`` multiply-adds);
#: more rows take :func:`cumsum_rows`.
TRIANGLE_ROWS = 64


def running_sums(x: Tensor, initial: Tensor, *, reverse: bool = False, inplace: bool = False,
                 out: Tensor | None = None) -> Tensor:
    r""":math:`\text{initial} + \sum_{i \le t} x_{i\cdot}` (``reverse``: :math:`\sum_{i \ge t}`) for every row
    :math:`t`: ``(..., n, m)`` and ``(..., m)`` → ``(..., n, m)``, the cumulative sums of :func:`cumsum_rows`
    plus a running total carried in (no autograd; ``inplace``: ``x``'s buffer may hold the result; ``out``, the
    shape of ``x``, contiguous: may hold it, eagerly).

    From :data:`ROW_BY_ROW_FROM` entries per row (CPU, eager) the rows are added one by one onto the total
    carried in; below, up to :data:`TRIANGLE_ROWS` rows are one product with a triangle of ones, and more
    rows :func:`cumsum_rows` and one addition of the total. Row :math:`t` reads rows :math:`\le t` only
    (``reverse``: :math:`\ge t`; the triangle's zeros are exact) in every case."""
    n = x.shape[-2]
    eager = not capturing()
    if x.device.type == "cpu" and n > 1 and x.numel() // n >= ROW_BY_ROW_FROM and eager:
        sums = x if inplace else torch.empty_like(x) if out is None else out
        first, step = (n - 1, 1) if reverse else (0, -1)
        torch.add(x[..., first, :], initial, out=sums[..., first, :])
        for i in range(n - 2, -1, -1) if reverse else range(1, n):
            torch.add(sums[..., i + step, :], x[..., i, :], out=sums[..., i, :])
        return sums
    if n <= TRIANGLE_ROWS:
        ones = torch.ones(n, n, dtype=x.dtype, device=x.device)
        triangle = ones.triu_() if reverse else ones.tril_()
        sums = torch.matmul(triangle, x) if out is None or not eager else torch.matmul(triangle, x, out=out)
        return sums.add_(initial.unsqueeze(-2))
    sums = cumsum_rows_(x, reverse) if inplace else cumsum_rows(x, reverse)
    return sums.add_(initial.unsqueeze(-2))


def _blocked_cumsum(x: Tensor, reverse: bool, out: Tensor | None = None) -> Tensor:
    """Sums over rows ``<= t`` (``reverse``: ``>= t``) by triangular products of ``_CUMSUM_BLOCK`` rows, in
    ``out`` (a new tensor by default; ``x`` itself works)."""
    n = x.shape[-2]
    size = min(_CUMSUM_BLOCK, n)
    ones = torch.ones(size, size, dtype=x.dtype, device=x.device)
    triangle = ones.triu() if reverse else ones.tril()
    out = torch.empty_like(x) if out is None else out
    carry = None
    starts = range(0, n, size)
    for start in reversed(starts) if reverse else starts:
        rows = slice(start, min(n, start + size))
        k = rows.stop - rows.start
        block = out[..., rows, :]  # (a copy, not matmul(out=...), which torch.export refuses under autograd)
        block.copy_(torch.matmul(triangle[:k, :k] if k < size else triangle, x[..., rows, :]))
        if carry is not None:
            block.add_(carry)
        carry = block[..., :1, :] if reverse else block[..., -1:, :]
    return out


@dataclass
class _Prefix:
    """The causal problem of every prefix at once: masked scores, validity, marginals."""

    x: Tensor  # (..., n, n) scores in compute precision, -inf where masked (and above the diagonal)
    x_rows: Tensor  # x with rows that keep nothing set to 0 (finite row log-sum-exps)
    row_valid: Tensor  # (..., n) row i keeps a key (in every prefix that contains it)
    col_valid: Tensor  # (..., n, n) [t, j]: column j keeps an entry in rows j..t
    log_b: Tensor  # (..., n, n) [t, j]: log column marginal of prefix t (0 where invalid)
    prefix_rows: Tensor  # (..., n, n) [t, i]: row i is a valid row of prefix t (i <= t)

    @classmethod
    def build(cls, scores: Tensor, mask: Tensor | None, marginals: str, start: str) -> "_Prefix":
        n = scores.shape[-1]
        in_prefix = torch.ones(n, n, dtype=torch.bool, device=scores.device).tril()
        keep = in_prefix if mask is None else in_prefix & mask
        neg_inf = scores == float("-inf")
        # -inf scores are masked entries, as in the dense engine (without a data check: always applied)
        masked_scores = _skip_data_checks(scores) or bool(neg_inf.any())
        if masked_scores:
            keep = keep & ~neg_inf
        x = scores.to(compute_dtype(scores.dtype)).masked_fill(~keep, float("-inf"))
        # Shifts absorbed by the first update, taken where no later row enters: for rows first, each row's
        # maximum (into f_i); for columns first, each column's first kept entry (into g_j).
        if start == "rows":
            x = x - _finite_max(x)
        else:
            first = keep.expand(x.shape).to(torch.uint8).argmax(-2, keepdim=True)  # first kept row of each column
            x = x - _finite_or_zero(x.detach().gather(-2, first))
        if mask is not None and mask.dim() == 1:
            mask = mask.unsqueeze(0)
        if not masked_scores and (mask is None or mask.shape[-2] == 1):
            # the causal mask and a mask on keys only: the marginals in closed form
            keys = in_prefix.new_ones(1, n) if mask is None else mask.reshape(mask.shape[:-2] + (1, n))
            log_b, col_valid = prefix_column_marginals(keys, marginals)
        else:
            log_b, col_valid = prefix_column_marginals(keep.expand(x.shape), marginals, x.dtype)
        row_valid = keep.any(-1).expand(x.shape[:-1])
        all_rows = not _skip_data_checks(x) and bool(row_valid.all())
        x_rows = x if all_rows else x.masked_fill(~row_valid.unsqueeze(-1), 0.0)
        prefix_rows = in_prefix & row_valid.unsqueeze(-2)
        return cls(x, x_rows, row_valid, col_valid, log_b.to(x.dtype), prefix_rows)

    def tensors(self) -> tuple[Tensor, ...]:
        """The fields in order: ``_Prefix(*problem.tensors())`` is the same problem."""
        return tuple(getattr(self, field.name) for field in fields(self))

    def row_update(self, g: Tensor | None, first: int = 0) -> Tensor:
        r""":math:`F[t, i] = -\log\sum_j e^{S_{ij} + G[t, j]}` (row marginals 1): a vector when ``g``
        is zero (the same in every prefix), else the matrix ``[t, i]`` (a log-sum-exp matrix product)
        of the prefixes ``t >= first`` (``g``'s rows)."""
        if g is None:  # O(n^2): a SoftMax normaliser per row
            return torch.where(self.row_valid, -self.x_rows.logsumexp(-1), 0.0)
        # b = the score rows i, each shifted by its own maximum (row i is in every prefix t >= i that needs it)
        prefix_rows = self.prefix_rows[..., first:, :]
        lse = log_matmul(g, self.x, needed=prefix_rows, shift_b=True)
        return torch.where(prefix_rows, -lse, 0.0)

    def column_update(self, f: Tensor | None, first: int = 0) -> Tensor:
        r""":math:`G[t, j] = \log b^{(t)}_j - \log\sum_{i \le t} e^{S_{ij} + F[t, i]}` for the prefixes
        ``t >= first``: a cumulative sum over rows when ``f`` is the same in every prefix, else a
        log-sum-exp matrix product (``f``'s rows are those prefixes')."""
        col_valid, log_b = self.col_valid[..., first:, :], self.log_b[..., first:, :]
        if f is None or f.dim() == self.x.dim() - 1:
            y = self.x if f is None else self.x + f.unsqueeze(-1)
            lse = log_cumsum_exp(y, needed=self.col_valid)[..., first:, :]
        else:
            f_prefix = torch.where(self.prefix_rows[..., first:, :], f, float("-inf"))  # the rows of prefix t only
            # the rows' maxima r_i move from the scores into f (the rows of b are columns: no shift of its own)
            r = _finite_max(self.x)
            lse = log_matmul(f_prefix + r.transpose(-1, -2), (self.x - r).transpose(-1, -2), needed=col_valid)
        return torch.where(col_valid, log_b - lse, 0.0)


def prefix_column_marginals(keep: Tensor, marginals: str, dtype: torch.dtype = torch.float64) -> tuple[Tensor, Tensor]:
    r"""Log column marginals ``[t, j]`` of every prefix and their validity, both ``(..., n, n)``.

    ``keep``: ``(..., n, n)`` bool, already causal, or ``(..., 1, n)`` for a mask on keys only
    (meaning the causal mask and these keys: an :math:`O(n)` closed form). Column :math:`j` is
    valid in prefix :math:`t` when some row :math:`j \le i \le t` keeps it; invalid entries get
    log-marginal 0.
    """
    n = keep.shape[-1]
    if keep.shape[-2] == 1:  # keep[i, j] = (j <= i) & key_j: every sum is a cumulative sum of vectors
        key = keep.squeeze(-2)
        count = key.to(dtype).cumsum(-1)  # keys kept by row i
        col_valid = key.unsqueeze(-2) & torch.ones(n, n, dtype=torch.bool, device=keep.device).tril()
        rows_upto = (count > 0).to(dtype).cumsum(-1)  # valid rows in prefix t
        if marginals == "causal":  # b[t, j] = key_j * sum_{i=j..t} 1/count_i
            inv, inv_before = inverse_count_sums(count)
            b = inv.unsqueeze(-1) - inv_before.unsqueeze(-2)
        else:
            b = (rows_upto / (key.to(dtype).cumsum(-1)).clamp_min(1)).unsqueeze(-1).expand(col_valid.shape)
    else:
        col_valid = keep.to(torch.int32).cumsum(-2) > 0
        if marginals == "causal":  # column sums of uniform causal attention on the prefix
            b = (keep.to(dtype) / keep.sum(-1, keepdim=True).clamp_min(1).to(dtype)).cumsum(-2)
        else:
            rows_upto = keep.any(-1).to(dtype).cumsum(-1)
            b = (rows_upto / col_valid.to(dtype).sum(-1).clamp_min(1)).unsqueeze(-1).expand(col_valid.shape)
    return log_marginal(b, col_valid), col_valid


def inverse_count_sums(count: Tensor) -> tuple[Tensor, Tensor]:
    r""":math:`H_t = \sum_{i \le t} 1/\mathrm{count}_i` (rows without a key add 0) and :math:`H_{t-1}`
    ``(..., n)``, from ``count`` ``(..., n)`` the keys kept by each row: the causal marginals of keys
    masked by ``key`` are :math:`b^{(t)}_j = \mathrm{key}_j (H_t - H_{j-1})`."""
    inv = torch.where(count > 0, 1.0 / count.clamp_min(1), torch.zeros_like(count)).cumsum(-1)
    return inv, torch.nn.functional.pad(inv, (1, 0))[..., :-1]


def log_cumsum_exp(y: Tensor, *, needed: Tensor | None = None) -> Tensor:
    r""":math:`\log\sum_{i \le t} e^{y_{ij}}` for all :math:`(t, j)`: ``(..., n, m)`` → ``(..., n, m)``.

    A ``cumsum`` of exponentials, unshifted: entry :math:`(t, j)` depends on rows :math:`\le t`
    only, to the last bit (a shift by a column maximum would bring in later rows' rounding).
    The callers' entries are scores shifted to at most 0 per row, or to 0 at each column's first
    entry (later rows may exceed it). Where a ``needed`` entry over- or underflows, or sums an
    exponent above half the dtype's range (clamped there, so that no exponential is infinite and
    the gradient through the unused sums stays finite), ``torch.logcumsumexp`` recomputes it
    (exact for any range, slower on CPUs).
    """
    ceiling = math.log(torch.finfo(y.dtype).max) / 2
    sums = cumsum_rows(torch.exp(y.clamp(max=ceiling)))
    over = y.detach() > ceiling
    if _skip_data_checks(y) or bool(over.any()):  # entries (t, j) that summed a clamped term: recomputed
        sums = torch.where(cumsum_rows(over.to(y.dtype)) > 0, float("inf"), sums)
    return _checked_log(sums, y.shape[-2], needed, _exact_log_cumsum_exp, y)


@exact_path
def _exact_log_cumsum_exp(bad: Tensor, y: Tensor) -> Tensor:
    """:func:`log_cumsum_exp` by ``torch.logcumsumexp`` (every entry; ``bad`` unused)."""
    return torch.logcumsumexp(_finite(y, -2), dim=-2)


def log_matmul(a: Tensor, b: Tensor, *, needed: Tensor | None = None, shift_b: bool = False) -> Tensor:
    r""":math:`\log\sum_j e^{a_{tj} + b_{ij}}` for all :math:`(t, i)`: ``(..., T, n)`` and ``(..., I, n)``
    → ``(..., T, I)``.

    One ``matmul`` of exponentials, :math:`e^{m_t + r_i}\,(e^{a - m}\,e^{(b - r)^\top})`, :math:`m_t`
    the maximum of row :math:`t` of ``a`` and :math:`r_i` that of row :math:`i` of ``b`` when
    ``shift_b`` (else 0: a caller whose ``b`` rows span all prefixes passes them at most 0, so that
    no entry reads a later row through a shift, to the last bit). Where a ``needed`` entry (bool,
    broadcastable to the result; ``None``: all) over- or underflows — non-finite, or below
    :math:`n\cdot` ``tiny/eps`` — that entry alone is recomputed by an exact log-sum-exp
    (:math:`O(n)` time and memory per entry).
    """
    shift = _finite_max(a)
    shift_rows = _finite_max(b) if shift_b else torch.zeros_like(b[..., :1])
    product = torch.exp(a - shift) @ torch.exp(b - shift_rows).transpose(-1, -2)
    shifts = shift + shift_rows.transpose(-1, -2)
    return _checked_log(product, a.shape[-1], needed, _shifted_exact_log_matmul, a, b, shifts) + shifts


def _checked_log(sums: Tensor, terms: int, needed: Tensor | None, exact: Callable[..., Tensor],
                 *operands: Tensor) -> Tensor:
    """``log(sums)`` where it is accurate, ``exact(bad, *operands)`` (the same log-sum-exps computed
    exactly, at least at the ``bad`` entries) where a needed entry is not finite or fell below
    ``terms * tiny / eps`` — where the terms lost to underflow (each below ``tiny``) could exceed its
    rounding. Unneeded entries give log(1) (no NaN gradient)."""
    info = torch.finfo(sums.dtype)
    bad = ~torch.isfinite(sums.detach()) | (sums.detach() < terms * info.tiny / info.eps)
    if needed is not None:
        bad &= needed
    unused = bad if needed is None else bad | ~needed
    return patched(torch.where(unused, 1.0, sums).log(), bad, exact, bad, *operands)


def _finite(y: Tensor, dim: int) -> Tensor:
    """``y`` with each ``-inf`` replaced by (the smallest finite entry along ``dim``) - 1000.

    A log-sum-exp over ``dim`` is unchanged wherever it had a finite entry (each replaced term is
    below :math:`e^{-1000}` of it: exactly 0 in float64 and float32), and finite where it had
    none, so masked reductions give no NaN gradient; callers discard those with their validity.
    """
    finite = torch.isfinite(y)
    low = torch.where(finite, y.detach(), torch.full_like(y.detach(), float("inf"))).amin(dim, keepdim=True)
    low = torch.where(torch.isfinite(low), low - 1000.0, torch.zeros_like(low))
    return torch.where(finite, y, low)


def _finite_max(x: Tensor) -> Tensor:
    return _finite_or_zero(x.detach().amax(-1, keepdim=True))


def _finite_or_zero(m: Tensor) -> Tensor:
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


@exact_path
def _shifted_exact_log_matmul(bad: Tensor, a: Tensor, b: Tensor, shifts: Tensor) -> Tensor:
    """:func:`log_matmul`'s sums before its shifts are added back, exact at the ``bad`` entries."""
    return _exact_log_matmul(a, b, bad) - shifts


def _exact_log_matmul(a: Tensor, b: Tensor, where: Tensor) -> Tensor:
    r""":math:`\log\sum_j e^{a_{tj} + b_{ij}}` exactly at the True entries of ``where`` ``(..., T, I)``
    (0 elsewhere): one log-sum-exp of length :math:`n` per entry, in chunks of ``_EXACT_CHUNK`` terms.
    Under graph capture (no data-dependent shapes) every entry, in blocks of rows :math:`t`."""
    batch = where.shape[:-2]
    if capturing():
        step = max(1, _EXACT_CHUNK // max(1, b.shape[-2] * a.shape[-1] * max(1, math.prod(batch))))
        rows = [_finite(a[..., t:t + step, None, :] + b[..., None, :, :], -1).logsumexp(-1)
                for t in range(0, a.shape[-2], step)]
        return torch.where(where, torch.cat(rows, -2), 0.0)
    a = a.expand(batch + a.shape[-2:])
    b = b.expand(batch + b.shape[-2:])
    *index, t, i = where.nonzero(as_tuple=True)
    step = max(1, _EXACT_CHUNK // max(1, a.shape[-1]))
    values = [
        _finite(a[(*(x[k:k + step] for x in index), t[k:k + step])] + b[(*(x[k:k + step] for x in index), i[k:k + step])],
                -1).logsumexp(-1)
        for k in range(0, t.numel(), step)
    ]
    out = torch.zeros(where.shape, dtype=a.dtype, device=a.device)
    return out.index_put(where.nonzero(as_tuple=True), torch.cat(values))
