r"""Causal Sinkhorn attention with 2 or 3 iterations in row blocks: never an n × n matrix.

For rows first and the causal marginals (:mod:`.prefix`), row :math:`t` of prefix :math:`t` is
:math:`A_{tj} = b^{(t)}_j R_{tj} / C_{tj}` after 2 normalisations and :math:`P_{tj} = A_{tj}/s_t`,
:math:`s_t = \sum_{j'}A_{tj'}`, after 3, with :math:`R` the causal row SoftMax and
:math:`C_{tj} = \sum_{i\le t} R_{ij}` (the division by :math:`s` is applied to the block's rows of
``A v`` and of ``dO``, never to a block of weights). Row :math:`t` needs only the rows :math:`\le t`:
the forward visits blocks of query rows in order, carrying the column sums of the rows before the
block, and writes ``out = P v`` block by block. It saves its inputs, ``out`` and the carried sums at
each block start (``O(n^2 / rows)`` per slice). The backward visits the blocks in reverse order,
carrying the column sums of :math:`dC` of the rows
after the block (:math:`\partial C_{tj}/\partial R_{ij} = 1` for :math:`i \le t`), and recomputes
each block's scores:

.. math::

    dA = \big(dP - (dP\odot P)\mathbf 1\big)/s = (dO/s)\,V^\top - (dO\odot\mathrm{out})\mathbf 1/s
    \ \ (3\text{ iterations}),\quad
    dR = b\,dA/C + \sum_{t\ge i} dC_{t\cdot},\quad dC = -b\,dA\,(R/C)/C,\quad
    dS = R\odot\big(dR - (dR\odot R)\mathbf 1\big).

Key padding only (:func:`key_mask`); rows whose sums underflow (``C`` below
``n · tiny/eps``) are flagged, and the caller replaces them by the log domain of :mod:`.prefix`.
Second derivatives recompute the weights with :func:`~.prefix.prefix_sinkhorn` and differentiate
them by autograd.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._capture import capturing
from .cpu_parallel import scratch_buffer
from .prefix import inverse_count_sums, row_totals, running_sums, safe_sums, scaled_by_sums, small_sums_below
from .problem import Problem

__all__ = ["causal_block_attention", "key_mask", "BLOCK_SCORES", "BLOCK_ROWS"]

#: Scores per row block (all slices together), within :data:`BLOCK_ROWS` rows. What counts is the rows of
#: a block, the row count of each of its matrix products. Informal timings (forward+backward, 3 iterations,
#: 2 threads, 2-core EPYC): b x h = 32 at n = 1024 took 543 ms in blocks of 16 rows, 385-397 ms in 32 or
#: 64, 482 ms in 128; b x h = 8 at n = 4096, 1899 ms in 16 rows, 1456 ms in 64, 1662 ms in 256. The change
#: from 2^19 scores (16 rows at b x h = 32, n = 1024) is in benchmarks/results/ab_issue26_causal.md.
BLOCK_SCORES = 1 << 21
#: Fewest and most rows per block (the most also bounds the block's memory, ``b x h x 64 x n`` scores).
BLOCK_ROWS = (32, 64)


def causal_block_attention(problem: Problem) -> tuple[Tensor, Tensor]:
    """Causal Sinkhorn attention of ``problem`` (``(B, n, d) x (B, n, d) x (B, n, e) -> (B, n, e)``, the
    causal mask implied) and the ``(B, n)`` rows to replace. ``n_iters``: 2 or 3; the mask: key padding at
    most (:func:`key_mask`); no bias."""
    if problem.n_iters not in (2, 3):
        raise ValueError(f"causal row blocks serve n_iters 2 or 3, got n_iters={problem.n_iters}")
    if problem.bias is not None:
        raise ValueError("causal row blocks serve no bias (an additive mask), got one")
    B, n = problem.B, problem.n
    rows = min(n, max(BLOCK_ROWS[0], min(BLOCK_ROWS[1], BLOCK_SCORES // max(1, B * n))))
    out, inexact, _ = _CausalBlocks.apply(problem.q, problem.k, problem.v, key_mask(problem), problem.scale,
                                          problem.n_iters, rows)
    return out, inexact


def key_mask(problem: Problem) -> Tensor | None:
    """The kept keys ``(B, n)`` of a problem masked by key padding only (``None``: no mask)."""
    keep = problem.keep_of()
    if keep is None:
        return None
    if keep.shape[-2] != 1:
        raise ValueError("causal row blocks serve a key padding mask only (keep of shape (..., 1, n)), got keep "
                         f"of shape {tuple(problem.keep.shape)}")
    return keep.expand(problem.B, 1, problem.n).reshape(problem.B, problem.n)


class _RowBlocks:
    """The row blocks of ``B`` causal problems: their key masks and causal marginals, and one block's
    quantities.

    Without padding (``keep`` None) the mask and the marginals are the same for every slice: they are
    computed once per block, ``(1, rows, end)``, and every row is valid."""

    def __init__(self, q: Tensor, k: Tensor, keep: Tensor | None, scale: float, n_iters: int, rows: int):
        n = q.shape[1]
        self.q, self.k, self.scale, self.n_iters, self.rows, self.keys = q, k, scale, n_iters, rows, keep
        # b[t, j] = sum_{i=j..t} 1/count_i (count_i: keys kept by row i) = H[t] - H[j-1], in float64
        # (prefix.prefix_column_marginals, read block by block instead of as an (n, n) table)
        count = (torch.arange(1, n + 1, dtype=torch.float64, device=q.device).unsqueeze(0) if keep is None
                 else keep.to(torch.float64).cumsum(-1))
        self.row_valid = None if keep is None else count > 0  # row t keeps a key j <= t
        self.H, self.H_before = inverse_count_sums(count)  # (B or 1, n)
        self.buffers: dict[str, Tensor] | None = None if capturing() else {}

    def tile(self, name: str, rows: int, end: int) -> Tensor | None:
        """A ``(B, rows, end)`` view of the call's flat buffer ``name``, for an ``out=`` (``None`` under graph
        capture, which refuses ``out=``). Every block reuses the buffers, sized for the largest: a block's
        new arrays of a few MiB would each page-fault on some virtual machines (the change's before and after:
        ``benchmarks/results/ab_issue26_causal_scratch.md``)."""
        if self.buffers is None:
            return None
        B, n = self.q.shape[0], self.q.shape[1]
        return scratch_buffer(self.buffers, name, B * self.rows * n, self.q)[:B * rows * end].view(B, rows, end)

    def blocks(self):
        n = self.q.shape[1]
        return [(start, min(n, start + self.rows)) for start in range(0, n, self.rows)]

    def block(self, start: int, end: int, carry: Tensor, flags: bool = True) -> dict:
        """Rows ``[start, end)`` against keys ``[0, end)``: ``R``, the last row of ``C`` (with ``carry``, the
        column sums of the rows before: the next block's carry), ``b`` and what :func:`~.prefix.scaled_rows`
        makes of them, in place of ``C``: the weights ``A`` after 2 normalisations, and for 3 their row totals
        ``total`` (the weights are ``A / total``, a division the callers apply to the block's ``(B, r, e)``
        rows of ``out`` or ``dO`` rather than to ``A``). ``flags`` (the forward): with the rows to replace,
        and ``A`` formed in ``R``'s buffer (``R`` and ``ratio`` are then ``None``); the backward needs all
        but the flags."""
        q, k = self.q[:, start:end], self.k[:, :end]
        r = end - start
        S = torch.baddbmm(q.new_empty(()), q, k.transpose(1, 2), beta=0.0, alpha=self.scale,
                          **_into(self.tile("S", r, end)))
        t = torch.arange(start, end, device=q.device).unsqueeze(-1)
        allowed = (torch.arange(end, device=q.device) <= t).unsqueeze(0)  # (1, r, end)
        if self.keys is not None:
            allowed = allowed & self.keys[:, :end].unsqueeze(-2)  # (B, r, end)
            S.masked_fill_(~allowed, float("-inf"))
        else:  # only the keys [start, end) of the block's own rows can be in a row's future
            S[..., start:].masked_fill_(~allowed[..., start:], float("-inf"))
        R = torch.softmax(S, dim=-1, **_into(self.tile("R", r, end)))
        if self.row_valid is not None:  # a row without a kept key: NaN from the softmax, no mass
            R = torch.where(self.row_valid[:, start:end].unsqueeze(-1), R, 0.0)
        C = running_sums(R, carry[:, :end], out=self.tile("C", r, end))
        last = C[:, -1].clone() if flags else None  # the forward's next carry, before 1 is added to small sums
        b = (self.H[:, start:end].unsqueeze(-1) - self.H_before[:, :end].unsqueeze(-2)).to(R.dtype)
        safe_C, inexact = self._safe_sums(C, start, allowed if flags else None)
        # the forward needs the weights only: the ratio R / C and then the weights in R's buffer
        into = None if flags or self.buffers is None else (self.tile("S", r, end), self.tile("A", r, end))
        A, ratio = scaled_by_sums(R, safe_C, b, ratio_in_R=flags, out=into)  # (S is spent: the ratio)
        total = row_totals(A) if self.n_iters == 3 else None
        return dict(R=None if flags else R, last=last, safe_C=safe_C, ratio=ratio, b=b, A=A, total=total,
                    inexact=inexact)

    def _safe_sums(self, C: Tensor, start: int, needed: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """:func:`~.prefix.safe_sums` of a block's sums ``C`` ``(B, r, end)`` in place, and its inexact rows
        (``None`` with ``needed`` None, or when none is).

        Without padding, the entries off ``needed`` are the block's future keys ``j > t``, inside its own
        columns ``[start, end)``: 1 is added there, after which one minimum tells whether any sum is small,
        which is rare. Bool tiles of the block's size (a comparison, its reduction and the bool's
        conversion) cost several times that minimum on the CPU."""
        if self.keys is not None or capturing():  # (no data-dependent branch in a graph)
            return safe_sums(C, needed, self.q.shape[1], inplace=True)
        rows = C.shape[-2]
        if not C.numel():
            return C, None
        C[..., start:].add_(torch.ones(rows, rows, dtype=C.dtype, device=C.device).triu_(1))
        if bool(C.amin() >= small_sums_below(C.dtype, self.q.shape[1])):  # NaN: the general path
            return C, None
        return safe_sums(C, needed, self.q.shape[1], inplace=True)


class _CausalBlocks(torch.autograd.Function):
    @staticmethod
    def forward(q, k, v, keep, scale, n_iters, rows):
        problem = _RowBlocks(q, k, keep, scale, n_iters, rows)
        B, n = q.shape[0], q.shape[1]
        out = v.new_empty(B, n, v.shape[-1])
        inexact = torch.zeros(B, n, dtype=torch.bool, device=q.device)
        carry = q.new_zeros(B, n)
        carries = []
        for start, end in problem.blocks():
            carries.append(carry.clone())
            blk = problem.block(start, end, carry)
            rows_out = torch.bmm(blk["A"], v[:, :end])  # (not out=: torch.export refuses it)
            out[:, start:end] = rows_out if blk["total"] is None else rows_out.div_(blk["total"])
            if blk["inexact"] is not None:
                inexact[:, start:end] = blk["inexact"]
            carry[:, :end] = blk["last"]
        return out, inexact, torch.stack(carries) if carries else q.new_zeros(0, B, n)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, keep, scale, n_iters, rows = inputs
        ctx.save_for_backward(q, k, v, keep, output[2], output[0])
        ctx.args = (scale, n_iters, rows)
        ctx.mark_non_differentiable(output[1], output[2])

    @staticmethod
    def backward(ctx, d_out: Tensor, *unused):
        q, k, v, keep, carries, out = ctx.saved_tensors
        scale, n_iters, rows = ctx.args
        if torch.is_grad_enabled():  # create_graph=True: second derivatives through the weights
            return _grads_with_graph(d_out, q, k, v, keep, scale, n_iters) + (None,) * 4
        problem = _RowBlocks(q, k, keep, scale, n_iters, rows)
        # a gradient broadcast from a sum (stride 0) would send every product of a block to a loop over slices
        d_out = d_out.contiguous()
        dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        later = q.new_zeros(q.shape[0], q.shape[1])  # column sums of -dC over the rows after the block
        for index, (start, end) in reversed(list(enumerate(problem.blocks()))):
            blk = problem.block(start, end, carries[index], flags=False)
            dO, total, vT = d_out[:, start:end], blk["total"], v[:, :end].transpose(1, 2)
            into = _into(problem.tile("dA", end - start, end))
            if total is None:  # 2 normalisations: P = A
                dv[:, :end].baddbmm_(blk["A"].transpose(1, 2), dO)
                dA = torch.bmm(dO, vT, **into)
            else:  # P = A / s: dA = (dP - (dP ⊙ P) 1) / s = (dO / s) vᵀ - (dO ⊙ out) 1 / s, one product
                dO_s = dO / total
                dv[:, :end].baddbmm_(blk["A"].transpose(1, 2), dO_s)
                D = (dO * out[:, start:end]).sum(-1, keepdim=True).div_(total).neg_()
                dA = torch.baddbmm(D, dO_s, vT, **into)
            dR = dA.mul_(blk["b"]).div_(blk["safe_C"])
            minus_dC = blk["ratio"].mul_(dR)  # dC = -b dA (R / C) / C, in the ratio's buffer
            # ... and its sums over the rows >= t, in place, with the rows after the block: the next carry
            suffix = running_sums(minus_dC, later[:, :end], reverse=True, inplace=True)
            later[:, :end] = suffix[:, 0]
            R = blk["R"]
            dS = dR.sub_(suffix).mul_(R)  # dS = R ⊙ dR - R (R ⊙ dR) 1, in dR's buffer
            dS.addcmul_(R, dS.sum(-1, keepdim=True), value=-1.0)
            dq[:, start:end] = torch.bmm(dS, k[:, :end]).mul_(scale)
            dk[:, :end].baddbmm_(dS.transpose(1, 2), q[:, start:end], alpha=scale)
        return dq, dk, dv, None, None, None, None


def _into(buffer: Tensor | None) -> dict:
    """``out=buffer`` for an operation, or nothing."""
    return {} if buffer is None else {"out": buffer}


def _grads_with_graph(d_out, q, k, v, keep, scale, n_iters):
    """First derivatives with a graph: the weights of :func:`~.prefix.prefix_sinkhorn`, by autograd."""
    from .prefix import prefix_sinkhorn

    with torch.enable_grad():
        inputs = [t if t.requires_grad else t.detach().requires_grad_() for t in (q, k, v)]
        mask = None if keep is None else keep.unsqueeze(-2)
        weights = prefix_sinkhorn(scale * inputs[0] @ inputs[1].transpose(1, 2), n_iters, mask=mask)
        out = weights @ inputs[2]
        return torch.autograd.grad(out, inputs, d_out, create_graph=True)
