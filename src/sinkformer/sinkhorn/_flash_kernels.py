r"""Triton kernels of the flash engine (:mod:`.flash`); imported only when that engine runs.

Both kernels work in one *orientation*: rows ``R (B, n_r, d)`` against columns ``C (B, n_c, d)``,
scores :math:`s_{ij} = \mathrm{scale}\, r_i\cdot c_j + \mathrm{bias}_{ij}` (``-inf`` where ``keep``
is 0). The column sweeps of Sinkhorn are the same kernels in the transposed orientation (rows =
keys, columns = queries, the mask strides swapped), so no kernel needs atomics.

* :func:`sweep` — one program per block of rows, streaming over column blocks; by ``MODE``:

  - ``LSE`` (0): :math:`f_i = \log a_i - \mathrm{LSE}_j(s_{ij} + g_j)` (0 on rows with ``a_i = 0``);
  - ``LSE_OUT`` (1): the same, and :math:`o_i = \sum_j e^{s_{ij} + f_i + g_j} v_j` by FlashAttention's
    online rescaling (the column potential is a key bias);
  - ``FIXED_OUT`` (2): :math:`o_i = \sum_j e^{s_{ij} + f_i + g_j} v_j` with both potentials given;
  - ``MATVEC`` (3): :math:`y_i = \sum_j e^{s_{ij} + f_i + g_j} w_j`.

* :func:`dscore` — :math:`\mathrm{out}_i = \mathrm{scale}\sum_j \partial S_{ij}\, c_j` with
  :math:`\partial S_{ij} = e^{s_{ij}+F_i+G_j}\,(x_i\cdot y_j) - \sum_t e^{s_{ij}+\alpha_{ti}+\beta_{tj}}
  (\gamma_{ti} + \delta_{tj})`: the gradient w.r.t. the scores of the ``n_iters`` map, contracted
  with the columns (``dq`` in the query orientation, ``dk`` in the key orientation).

Accumulation is in the potentials' dtype (float32, or float64 for float64 inputs); half-precision
``R, C, V`` enter the matrix products in their own dtype (tensor cores), everything else is float32.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

#: Whether these kernels were compiled for Triton's interpreter (CPU tensors) at import.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

#: the sweep's modes, as the launcher passes them; the kernels read the constexpr copies below
LSE, LSE_OUT, FIXED_OUT, MATVEC = 0, 1, 2, 3
_LSE, _LSE_OUT, _FIXED_OUT, _MATVEC = tl.constexpr(LSE), tl.constexpr(LSE_OUT), tl.constexpr(FIXED_OUT), tl.constexpr(MATVEC)


@triton.jit
def _score_tile(r, C, KEEP, BIAS, rows, cols, n_r, n_c, d, scale, s_cn, s_cd, s_kr, s_kc, s_br, s_bc,
                HAS_KEEP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
                ACC: tl.constexpr):
    """``(BLOCK_R, BLOCK_C)`` scores (dtype ``ACC``) of the row tile ``r`` against the columns ``cols``;
    ``-inf`` where masked or out of range. ``C``, ``KEEP``, ``BIAS`` point at this slice."""
    dims = tl.arange(0, BLOCK_D)
    c = tl.load(C + cols[:, None] * s_cn + dims[None, :] * s_cd, mask=(cols[:, None] < n_c) & (dims[None, :] < d),
                other=0.0)
    s = tl.dot(r, tl.trans(c), input_precision=PRECISION, out_dtype=ACC) * scale
    inside = (rows[:, None] < n_r) & (cols[None, :] < n_c)
    if HAS_BIAS:
        s += tl.load(BIAS + rows[:, None] * s_br + cols[None, :] * s_bc, mask=inside, other=0.0).to(s.dtype)
    if HAS_KEEP:
        inside = inside & (tl.load(KEEP + rows[:, None] * s_kr + cols[None, :] * s_kc, mask=inside, other=0) != 0)
    return tl.where(inside, s, float("-inf"))


@triton.jit
def sweep(
    R, C, V, OUT, POT_R, POT_C, LOG_A, W, POT_OUT, KEEP, BIAS,
    n_r, n_c, d, e, scale,
    s_rb, s_rn, s_rd, s_cb, s_cn, s_cd, s_vb, s_vn, s_ve, s_ob, s_on, s_oe,
    s_pr, s_pc, s_kb, s_kr, s_kc, s_bb, s_br, s_bc,
    MODE: tl.constexpr, HAS_KEEP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr, PRECISION: tl.constexpr,
):
    """One block of rows of one slice; see the module docstring for ``MODE``. Potentials, ``LOG_A``,
    ``W`` and ``POT_OUT`` are ``(B, n)`` with batch strides ``s_pr`` (rows) / ``s_pc`` (columns)."""
    block, b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    rows = block * BLOCK_R + tl.arange(0, BLOCK_R)
    dims = tl.arange(0, BLOCK_D)
    R += b * s_rb
    C += b * s_cb
    KEEP += b * s_kb
    BIAS += b * s_bb
    acc_t = POT_C.dtype.element_ty
    r = tl.load(R + rows[:, None] * s_rn + dims[None, :] * s_rd, mask=(rows[:, None] < n_r) & (dims[None, :] < d),
                other=0.0)
    pot_r = tl.zeros([BLOCK_R], dtype=acc_t)
    if MODE >= _FIXED_OUT:
        pot_r = tl.load(POT_R + b * s_pr + rows, mask=rows < n_r, other=0.0)
    m_i = tl.full([BLOCK_R], float("-inf"), dtype=acc_t)
    l_i = tl.zeros([BLOCK_R], dtype=acc_t)
    y = tl.zeros([BLOCK_R], dtype=acc_t)
    vals = tl.arange(0, BLOCK_E)
    acc = tl.zeros([BLOCK_R, BLOCK_E], dtype=acc_t)
    for start in range(0, n_c, BLOCK_C):
        cols = start + tl.arange(0, BLOCK_C)
        s = _score_tile(r, C, KEEP, BIAS, rows, cols, n_r, n_c, d, scale, s_cn, s_cd, s_kr, s_kc, s_br, s_bc,
                        HAS_KEEP, HAS_BIAS, BLOCK_D, PRECISION, acc_t)
        s += tl.load(POT_C + b * s_pc + cols, mask=cols < n_c, other=0.0)[None, :]
        if MODE <= _LSE_OUT:  # online log-sum-exp (a row of -inf keeps m = -inf and l = 0)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            base = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - base)
            p = tl.exp(s - base[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
        else:
            alpha = tl.full([BLOCK_R], 1.0, dtype=acc_t)
            p = tl.exp(s + pot_r[:, None])
        if MODE == _MATVEC:
            w = tl.load(W + b * s_pc + cols, mask=cols < n_c, other=0.0)
            y += tl.sum(p * w[None, :], 1)
        if MODE == _LSE_OUT or MODE == _FIXED_OUT:
            v = tl.load(V + b * s_vb + cols[:, None] * s_vn + vals[None, :] * s_ve,
                        mask=(cols[:, None] < n_c) & (vals[None, :] < e), other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION, out_dtype=acc_t)
    if MODE <= _LSE_OUT:
        log_a = tl.load(LOG_A + b * s_pr + rows, mask=rows < n_r, other=float("-inf"))
        ok = (log_a > float("-inf")) & (l_i > 0)
        f = tl.where(ok, log_a, 0.0) - tl.where(ok, m_i, 0.0) - tl.log(tl.where(ok, l_i, 1.0))
        tl.store(POT_OUT + b * s_pr + rows, f, mask=rows < n_r)
        if MODE == _LSE_OUT:  # P_ij = a_i e^{s_ij + g_j - m_i} / l_i
            acc = acc * tl.where(ok, tl.exp(log_a) / tl.where(ok, l_i, 1.0), 0.0)[:, None]
    if MODE == _MATVEC:
        tl.store(POT_OUT + b * s_pr + rows, y, mask=rows < n_r)
    if MODE == _LSE_OUT or MODE == _FIXED_OUT:
        tl.store(OUT + b * s_ob + rows[:, None] * s_on + vals[None, :] * s_oe, acc.to(OUT.dtype.element_ty),
                 mask=(rows[:, None] < n_r) & (vals[None, :] < e))


@triton.jit
def dscore(
    R, C, X, Y, OUT, POT_R, POT_C, ALPHA, BETA, GAMMA, DELTA, KEEP, BIAS,
    n_r, n_c, d, e, n_terms, scale,
    s_rb, s_rn, s_rd, s_cb, s_cn, s_cd, s_xb, s_xn, s_xe, s_yb, s_yn, s_ye, s_ob, s_on, s_od,
    s_pr, s_pc, s_tr, s_tc, s_kb, s_kr, s_kc, s_bb, s_br, s_bc,
    HAS_KEEP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr, PRECISION: tl.constexpr,
):
    """``OUT[rows] = scale * dS[rows, :] @ C`` for one block of rows (module docstring).

    ``POT_R/POT_C`` are the final potentials ``(B, n)``; the correction terms ``ALPHA, GAMMA``
    ``(B, T, n_r)`` and ``BETA, DELTA`` ``(B, T, n_c)`` have batch strides ``s_tr``/``s_tc`` and
    term strides ``n_r``/``n_c`` (contiguous)."""
    block, b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    rows = block * BLOCK_R + tl.arange(0, BLOCK_R)
    dims = tl.arange(0, BLOCK_D)
    vals = tl.arange(0, BLOCK_E)
    R += b * s_rb
    C += b * s_cb
    KEEP += b * s_kb
    BIAS += b * s_bb
    acc_t = POT_C.dtype.element_ty
    row_in = rows < n_r
    r = tl.load(R + rows[:, None] * s_rn + dims[None, :] * s_rd, mask=row_in[:, None] & (dims[None, :] < d), other=0.0)
    x = tl.load(X + b * s_xb + rows[:, None] * s_xn + vals[None, :] * s_xe, mask=row_in[:, None] & (vals[None, :] < e),
                other=0.0)
    pot_r = tl.load(POT_R + b * s_pr + rows, mask=row_in, other=0.0)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=acc_t)
    for start in range(0, n_c, BLOCK_C):
        cols = start + tl.arange(0, BLOCK_C)
        col_in = cols < n_c
        s = _score_tile(r, C, KEEP, BIAS, rows, cols, n_r, n_c, d, scale, s_cn, s_cd, s_kr, s_kc, s_br, s_bc,
                        HAS_KEEP, HAS_BIAS, BLOCK_D, PRECISION, acc_t)
        y = tl.load(Y + b * s_yb + cols[:, None] * s_yn + vals[None, :] * s_ye,
                    mask=col_in[:, None] & (vals[None, :] < e), other=0.0)
        dp = tl.dot(x, tl.trans(y), input_precision=PRECISION, out_dtype=acc_t)
        p = tl.exp(s + pot_r[:, None] + tl.load(POT_C + b * s_pc + cols, mask=col_in, other=0.0)[None, :])
        ds = p * dp
        for t in range(0, n_terms):
            alpha = tl.load(ALPHA + b * s_tr + t * n_r + rows, mask=row_in, other=0.0)
            gamma = tl.load(GAMMA + b * s_tr + t * n_r + rows, mask=row_in, other=0.0)
            beta = tl.load(BETA + b * s_tc + t * n_c + cols, mask=col_in, other=0.0)
            delta = tl.load(DELTA + b * s_tc + t * n_c + cols, mask=col_in, other=0.0)
            ds -= tl.exp(s + alpha[:, None] + beta[None, :]) * (gamma[:, None] + delta[None, :])
        c = tl.load(C + cols[:, None] * s_cn + dims[None, :] * s_cd, mask=col_in[:, None] & (dims[None, :] < d),
                    other=0.0)
        acc += tl.dot(ds.to(c.dtype), c, input_precision=PRECISION, out_dtype=acc_t)
    tl.store(OUT + b * s_ob + rows[:, None] * s_on + dims[None, :] * s_od, (acc * scale).to(OUT.dtype.element_ty),
             mask=row_in[:, None] & (dims[None, :] < d))
