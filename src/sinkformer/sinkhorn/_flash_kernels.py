r"""Triton kernels of the flash engine (:mod:`.flash`); imported only when that engine runs.

Every kernel works in one *orientation*: rows ``R (B, n_r, d)`` against columns ``C (B, n_c, d)``,
on the *doubly shifted* scores

.. math::

    x_{ij} = (\mathrm{scale}\; r_i\cdot c_j + \mathrm{bias}_{ij}) - \rho_i - \kappa_j

(``-inf`` where ``keep`` is 0), the shifts :math:`\rho` (rows) and :math:`\kappa` (columns) found by
the first two sweeps (``FIND_SHIFT``: a row's largest score, then a column's largest row-shifted
score; as :func:`~.problem.double_shift`). Every potential is relative to them and stays of the size
of :math:`\log n`, so the exponent :math:`s_{ij} = \log_2 e\; x_{ij} + f_i + g_j` of an entry that
matters is computed from numbers of that size: potentials of the unshifted scores are as large as the
scores (:math:`10^4` in float32 loses 1e-3 of every weight). Potentials are in base 2, so that every
exponential is one ``exp2``. The column sweeps of Sinkhorn are the same kernels in the transposed
orientation (rows = keys, columns = queries, the mask strides and the shifts swapped), so no kernel
needs atomics.

* :func:`sweep` — one program per block of rows, streaming over column blocks; by ``MODE``:

  - ``LSE`` (0): :math:`f_i = \log_2 a_i - \mathrm{LSE2}_j(s_{ij} + g_j)` (0 on rows with ``a_i = 0``);
  - ``LSE_OUT`` (1): the same, and :math:`o_i = \sum_j 2^{s_{ij} + f_i + g_j} v_j` by FlashAttention's
    online rescaling (the column potential is a key bias);
  - ``FIXED_OUT`` (2): :math:`o_i = \sum_j 2^{s_{ij} + f_i + g_j} v_j` with both potentials given;
  - ``MATVEC`` (3): :math:`z_i = (\mathrm{dual}_i - \sum_j 2^{s_{ij} + f_i + g_j} w_j)\,\mathrm{inv}_i`
    (one step of the backward's reverse recursion; ``inv = -1`` gives the plain product);
  - ``DV`` (4): ``FIXED_OUT`` with ``v = dO`` (so :math:`dV = P^\top dO` in the key orientation) and
    :math:`z_i = (x_i\cdot o_i - \sum_j P_{ij} w_j)\,\mathrm{inv}_i` from the accumulator still in
    registers (``x = v``): the dV pass fused with the first reverse step.

* :func:`dscore` — :math:`\mathrm{out}_i = \mathrm{scale}\sum_j \partial S_{ij}\, c_j` with
  :math:`\partial S_{ij} = P_{ij}\,\big(x_i\cdot y_j - \sum_t X_{ti} Y_{tj}\big)`: the gradient of the
  ``n_iters`` map w.r.t. the scores with its correction terms folded into the ``dP`` product
  (``FOLDED``: one exponential per score), or, for slices whose terms do not fit the float range,
  :math:`\sum_t 2^{s_{ij} + F_i + G_j + A_{ti} + B_{tj}}\,U_{ti} W_{tj}` term by term. A per-slice flag
  chooses: both variants are launched and each returns at once on the other's slices.
* :func:`rowdot` — :math:`z_i = (x_i\cdot y_i)\,\mathrm{inv}_i`, the start of the reverse recursion.
* :func:`fold` — the terms of :func:`dscore` from the saved potentials and the coefficients, one
  program per term and slice: exponents :math:`A_{ti} = \alpha_{ti} - F_i - c_t`,
  :math:`B_{tj} = \beta_{tj} - G_j + c_t` (:math:`c_t` gives both factors the same largest exponent),
  the folded factors :math:`X = 2^A U`, :math:`Y = 2^B W` and the flag "both within the limit".

Interior column blocks are loaded and scored without bounds masks (the last, partial block with
them). Accumulation is in the potentials' dtype (float32, or float64 for float64 inputs); half
precision ``R, C, V`` enter the matrix products in their own dtype (tensor cores). Offsets inside a
slice are 64-bit (a mask's ``rows * row_stride`` passes 2^31 at n·m ≥ 2^31).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

#: Whether these kernels were compiled for Triton's interpreter (CPU tensors) at import.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

#: the sweep's modes, as the launcher passes them; the kernels read the constexpr copies below
LSE, LSE_OUT, FIXED_OUT, MATVEC, DV = 0, 1, 2, 3, 4
_LSE, _LSE_OUT, _FIXED_OUT, _MATVEC, _DV = (tl.constexpr(m) for m in (LSE, LSE_OUT, FIXED_OUT, MATVEC, DV))
LOG2E = 1.4426950408889634
_LOG2E = tl.constexpr(LOG2E)
#: the kernels' names and the mode constants (what a stand-in for this module must provide)
KERNELS = ("sweep", "dscore", "rowdot", "fold")
MODES = ("LSE", "LSE_OUT", "FIXED_OUT", "MATVEC", "DV")


@triton.jit
def _load_tile(ptr, idx, n, s_n, s_d, BLOCK_D: tl.constexpr, D: tl.constexpr, IDX_MASK: tl.constexpr):
    """Rows ``idx`` of an ``(n, D)`` matrix as a ``(len(idx), BLOCK_D)`` tile, zeros outside; bounds
    masks only where needed (``IDX_MASK``: ``idx`` may pass ``n``; ``D < BLOCK_D``: padded width)."""
    dims = tl.arange(0, BLOCK_D)
    ptrs = ptr + idx.to(tl.int64)[:, None] * s_n + dims[None, :] * s_d
    if IDX_MASK:
        if D == BLOCK_D:
            x = tl.load(ptrs, mask=idx[:, None] < n, other=0.0)
        else:
            x = tl.load(ptrs, mask=(idx[:, None] < n) & (dims[None, :] < D), other=0.0)
    else:
        if D == BLOCK_D:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=dims[None, :] < D, other=0.0)
    return x


@triton.jit
def _load_vec(ptr, idx, n, MASK: tl.constexpr, other):
    if MASK:
        x = tl.load(ptr + idx, mask=idx < n, other=other)
    else:
        x = tl.load(ptr + idx)
    return x


@triton.jit
def _scores(r, C, KEEP, BIAS, SHIFT_C, shift_r, rows, cols, n_r, n_c, scale, s_cn, s_cd, s_kr, s_kc, s_br, s_bc,
            HAS_KEEP: tl.constexpr, HAS_BIAS: tl.constexpr, COL_MASK: tl.constexpr, BLOCK_D: tl.constexpr,
            D: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr):
    """``(x, c)``: the doubly shifted scores ``x = (scale r.c + bias) - shift_r - shift_c`` (natural
    units, ``(BLOCK_R, BLOCK_C)``, dtype ``ACC``; ``-inf`` where masked or out of range) of the row
    tile ``r`` against the columns ``cols``, and the column tile ``c``. The shifts are subtracted one
    after the other from the score, so an entry near its row's and column's maxima keeps the precision
    of the score itself (adding ``shift_r + shift_c`` at once would round at their size)."""
    c = _load_tile(C, cols, n_c, s_cn, s_cd, BLOCK_D, D, COL_MASK)
    x = tl.dot(r, tl.trans(c), input_precision=PRECISION, out_dtype=ACC) * scale
    if HAS_BIAS or HAS_KEEP:
        inside = (rows[:, None] < n_r) & (cols[None, :] < n_c)
        off_r, off_c = rows.to(tl.int64)[:, None], cols.to(tl.int64)[None, :]
        if HAS_BIAS:
            x += tl.load(BIAS + off_r * s_br + off_c * s_bc, mask=inside, other=0.0).to(ACC)
    x = x - shift_r[:, None] - _load_vec(SHIFT_C, cols, n_c, COL_MASK, 0.0)[None, :]
    if HAS_KEEP or HAS_BIAS:
        if HAS_KEEP:
            inside = inside & (tl.load(KEEP + off_r * s_kr + off_c * s_kc, mask=inside, other=0) != 0)
        x = tl.where(inside, x, float("-inf"))
    elif COL_MASK:
        x = tl.where(cols[None, :] < n_c, x, float("-inf"))
    return x, c


@triton.jit
def _sweep_block(r, C, V, POT_C, SHIFT_C, W, KEEP, BIAS, m_i, l_i, acc, y, pot_r, shift_r, rows, start, n_r, n_c,
                 scale, s_cn, s_cd, s_vn, s_ve, s_kr, s_kc, s_br, s_bc,
                 MODE: tl.constexpr, FIND_SHIFT: tl.constexpr, HAS_KEEP: tl.constexpr, HAS_BIAS: tl.constexpr,
                 HAS_W: tl.constexpr, COL_MASK: tl.constexpr, BLOCK_C: tl.constexpr, D: tl.constexpr,
                 BLOCK_D: tl.constexpr, E: tl.constexpr, BLOCK_E: tl.constexpr, PRECISION: tl.constexpr):
    """One column block of :func:`sweep`: the updated ``(m_i, l_i, acc, y)``."""
    acc_t = POT_C.dtype.element_ty
    cols = start + tl.arange(0, BLOCK_C)
    x, c = _scores(r, C, KEEP, BIAS, SHIFT_C, shift_r, rows, cols, n_r, n_c, scale, s_cn, s_cd, s_kr, s_kc, s_br,
                   s_bc, HAS_KEEP, HAS_BIAS, COL_MASK, BLOCK_D, D, PRECISION, acc_t)
    pot_c = _load_vec(POT_C, cols, n_c, COL_MASK, 0.0)[None, :]
    if FIND_SHIFT:  # the running maximum m_i of x (natural units) is the row's shift
        m_new = tl.maximum(m_i, tl.max(x, 1))
        base = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2((m_i - base) * _LOG2E)
        p = tl.exp2((x - base[:, None]) * _LOG2E + pot_c)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    elif MODE <= _LSE_OUT:  # online log-sum-exp (a row of -inf keeps m = -inf and l = 0)
        s = x * _LOG2E + pot_c
        m_new = tl.maximum(m_i, tl.max(s, 1))
        base = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - base)
        p = tl.exp2(s - base[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    else:
        alpha = tl.full([1], 1.0, dtype=acc_t)
        p = tl.exp2(x * _LOG2E + pot_c + pot_r[:, None])
    if MODE == _MATVEC or HAS_W:
        y += tl.sum(p * _load_vec(W, cols, n_c, COL_MASK, 0.0)[None, :], 1)
    if MODE == _LSE_OUT or MODE == _FIXED_OUT or MODE == _DV:
        v = _load_tile(V, cols, n_c, s_vn, s_ve, BLOCK_E, E, COL_MASK)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION, out_dtype=acc_t)
    return m_i, l_i, acc, y


@triton.jit
def sweep(
    R, C, V, OUT, POT_R, POT_C, SHIFT_R, SHIFT_C, LOG_A, W, DUAL, XROW, INV, POT_OUT, KEEP, BIAS,
    n_r, n_c, scale, log_a0, inv0,
    s_rb, s_rn, s_rd, s_cb, s_cn, s_cd, s_vb, s_vn, s_ve, s_ob, s_on, s_oe, s_xb, s_xn, s_xe,
    s_pr, s_pc, s_sr, s_sc, s_la, s_w, s_du, s_inv, s_po, s_kb, s_kr, s_kc, s_bb, s_br, s_bc,
    MODE: tl.constexpr, FIND_SHIFT: tl.constexpr, HAS_KEEP: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_LOG_A: tl.constexpr, HAS_W: tl.constexpr, HAS_DUAL: tl.constexpr, HAS_INV: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, E: tl.constexpr,
    BLOCK_E: tl.constexpr, PRECISION: tl.constexpr,
):
    """One block of rows of one slice; see the module docstring for ``MODE``. Vectors
    (potentials, shifts, ``LOG_A``, ``W``, ``DUAL``, ``INV``, ``POT_OUT``) are ``(B, n)`` views with
    their own batch strides ``s_pr .. s_po``; ``log_a0``/``inv0`` stand for ``LOG_A``/``INV`` when
    absent. ``FIND_SHIFT`` (``LSE`` modes, with column potentials of at most a few units): the rows'
    shifts are not read but found, the maximum of each row's scores written to ``SHIFT_R``, and the
    potential written is relative to it."""
    block, b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    rows = block * BLOCK_R + tl.arange(0, BLOCK_R)
    row_in = rows < n_r
    R += b * s_rb
    C += b * s_cb
    V += b * s_vb
    POT_C += b * s_pc
    SHIFT_C += b * s_sc
    W += b * s_w
    KEEP += b * s_kb
    BIAS += b * s_bb
    acc_t = POT_C.dtype.element_ty
    r = _load_tile(R, rows, n_r, s_rn, s_rd, BLOCK_D, D, True)
    pot_r = tl.zeros([BLOCK_R], dtype=acc_t)
    if MODE >= _FIXED_OUT:  # (-inf past the last row: no overflow in rows that are never stored)
        pot_r = tl.load(POT_R + b * s_pr + rows, mask=row_in, other=float("-inf"))
    shift_r = tl.zeros([BLOCK_R], dtype=acc_t)
    if not FIND_SHIFT:
        shift_r = tl.load(SHIFT_R + b * s_sr + rows, mask=row_in, other=0.0)
    m_i = tl.full([BLOCK_R], float("-inf"), dtype=acc_t)
    l_i = tl.zeros([BLOCK_R], dtype=acc_t)
    y = tl.zeros([BLOCK_R], dtype=acc_t)
    acc = tl.zeros([BLOCK_R, BLOCK_E], dtype=acc_t)
    interior = (n_c // BLOCK_C) * BLOCK_C
    for start in range(0, interior, BLOCK_C):
        m_i, l_i, acc, y = _sweep_block(r, C, V, POT_C, SHIFT_C, W, KEEP, BIAS, m_i, l_i, acc, y, pot_r, shift_r, rows,
                                        start, n_r, n_c, scale, s_cn, s_cd, s_vn, s_ve, s_kr, s_kc, s_br, s_bc, MODE,
                                        FIND_SHIFT, HAS_KEEP, HAS_BIAS, HAS_W, False, BLOCK_C, D, BLOCK_D, E, BLOCK_E,
                                        PRECISION)
    if interior < n_c:
        m_i, l_i, acc, y = _sweep_block(r, C, V, POT_C, SHIFT_C, W, KEEP, BIAS, m_i, l_i, acc, y, pot_r, shift_r, rows,
                                        interior, n_r, n_c, scale, s_cn, s_cd, s_vn, s_ve, s_kr, s_kc, s_br, s_bc, MODE,
                                        FIND_SHIFT, HAS_KEEP, HAS_BIAS, HAS_W, True, BLOCK_C, D, BLOCK_D, E, BLOCK_E,
                                        PRECISION)
    if MODE <= _LSE_OUT:
        if HAS_LOG_A:
            log_a = tl.load(LOG_A + b * s_la + rows, mask=row_in, other=float("-inf"))
        else:
            log_a = tl.full([BLOCK_R], log_a0, dtype=acc_t)
        ok = (log_a > float("-inf")) & (l_i > 0)
        if FIND_SHIFT:  # l_i = sum_j 2^{(x_ij - m_i) log2 e + g_j}: relative to the shift m_i
            tl.store(SHIFT_R + b * s_sr + rows, tl.where(l_i > 0, m_i, 0.0), mask=row_in)
            f = tl.where(ok, log_a, 0.0) - tl.log2(tl.where(ok, l_i, 1.0))
        else:
            f = tl.where(ok, log_a, 0.0) - tl.where(ok, m_i, 0.0) - tl.log2(tl.where(ok, l_i, 1.0))
        tl.store(POT_OUT + b * s_po + rows, f, mask=row_in)
        if MODE == _LSE_OUT:  # P_ij = a_i 2^{s_ij + g_j - m_i} / l_i
            acc = acc * tl.where(ok, tl.exp2(log_a) / tl.where(ok, l_i, 1.0), 0.0)[:, None]
    if MODE == _MATVEC or MODE == _DV:
        z = -y
        if MODE == _DV:  # x_j . dV_j from the accumulator, before rounding
            z += tl.sum(_load_tile(XROW + b * s_xb, rows, n_r, s_xn, s_xe, BLOCK_E, E, True).to(acc_t) * acc, 1)
        if HAS_DUAL:
            z += tl.load(DUAL + b * s_du + rows, mask=row_in, other=0.0)
        if HAS_INV:
            z *= tl.load(INV + b * s_inv + rows, mask=row_in, other=0.0)
        else:
            z *= inv0
        tl.store(POT_OUT + b * s_po + rows, z, mask=row_in)
    if MODE == _LSE_OUT or MODE == _FIXED_OUT or MODE == _DV:
        vals = tl.arange(0, BLOCK_E)
        out = OUT + b * s_ob + rows.to(tl.int64)[:, None] * s_on + vals[None, :] * s_oe
        tl.store(out, acc.to(OUT.dtype.element_ty), mask=row_in[:, None] & (vals[None, :] < E))


@triton.jit
def _dscore_block(r, x, xa, pot_r, shift_r, C, Y, YA, POT_C, SHIFT_C, A, BT, U, WT, KEEP, BIAS, acc, rows, start, n_r,
                  n_c, n_terms, scale, s_cn, s_cd, s_yn, s_ye, s_kr, s_kc, s_br, s_bc,
                  FOLDED: tl.constexpr, HAS_KEEP: tl.constexpr, HAS_BIAS: tl.constexpr, COL_MASK: tl.constexpr,
                  BLOCK_C: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, E: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr, PRECISION: tl.constexpr,
                  TERM_PRECISION: tl.constexpr):
    """One column block of :func:`dscore`: ``acc + dS[rows, cols] @ C[cols]``."""
    acc_t = POT_C.dtype.element_ty
    cols = start + tl.arange(0, BLOCK_C)
    z, c = _scores(r, C, KEEP, BIAS, SHIFT_C, shift_r, rows, cols, n_r, n_c, scale, s_cn, s_cd, s_kr, s_kc, s_br,
                   s_bc, HAS_KEEP, HAS_BIAS, COL_MASK, BLOCK_D, D, PRECISION, acc_t)
    s = z * _LOG2E + (pot_r[:, None] + _load_vec(POT_C, cols, n_c, COL_MASK, 0.0)[None, :])
    p = tl.exp2(s)
    y = _load_tile(Y, cols, n_c, s_yn, s_ye, BLOCK_E, E, COL_MASK)
    dp = tl.dot(x, tl.trans(y), input_precision=PRECISION, out_dtype=acc_t)
    if FOLDED:  # the correction terms as one more product: dS = P (dO V^T - X'^T Y')
        terms = tl.arange(0, BLOCK_T)
        ya = tl.load(YA + terms[None, :] * n_c + cols[:, None], mask=(terms[None, :] < n_terms) & (cols[:, None] < n_c),
                     other=0.0)
        dp -= tl.dot(xa, tl.trans(ya), input_precision=TERM_PRECISION, out_dtype=acc_t)
        ds = p * dp
    else:  # one exponential per term (slices whose terms do not fit the float range)
        ds = p * dp
        col_in = cols < n_c
        for t in range(0, n_terms):
            a = tl.load(A + t * n_r + rows, mask=rows < n_r, other=0.0)
            u = tl.load(U + t * n_r + rows, mask=rows < n_r, other=0.0)
            bt = tl.load(BT + t * n_c + cols, mask=col_in, other=0.0)
            w = tl.load(WT + t * n_c + cols, mask=col_in, other=0.0)
            ds -= tl.exp2(s + a[:, None] + bt[None, :]) * (u[:, None] * w[None, :])
    return acc + tl.dot(ds.to(c.dtype), c, input_precision=PRECISION, out_dtype=acc_t)


@triton.jit
def dscore(
    R, C, X, Y, OUT, POT_R, POT_C, SHIFT_R, SHIFT_C, OK, XA, YA, A, BT, U, WT, KEEP, BIAS,
    n_r, n_c, n_terms, scale,
    s_rb, s_rn, s_rd, s_cb, s_cn, s_cd, s_xb, s_xn, s_xe, s_yb, s_yn, s_ye, s_ob, s_on, s_od,
    s_pr, s_pc, s_sr, s_sc, s_tr, s_tc, s_kb, s_kr, s_kc, s_bb, s_br, s_bc,
    FOLDED: tl.constexpr, HAS_KEEP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, E: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_T: tl.constexpr, PRECISION: tl.constexpr, TERM_PRECISION: tl.constexpr,
):
    """``OUT[rows] = scale * dS[rows, :] @ C`` for one block of rows (module docstring), on the
    slices whose flags ``OK[b, :]`` (one per term, ``(B, T)``) all fold (``FOLDED`` 1) or not all (0).

    ``POT_R/POT_C`` are the final potentials, ``SHIFT_R/SHIFT_C`` the shifts; the terms
    ``XA, A, U (B, T, n_r)`` and ``YA, BT, WT (B, T, n_c)`` are contiguous per slice with batch
    strides ``s_tr``/``s_tc``."""
    block, b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    terms = tl.arange(0, BLOCK_T)
    if tl.min(tl.load(OK + b * n_terms + terms, mask=terms < n_terms, other=1), 0) != FOLDED:
        return
    rows = block * BLOCK_R + tl.arange(0, BLOCK_R)
    row_in = rows < n_r
    R += b * s_rb
    C += b * s_cb
    Y += b * s_yb
    POT_C += b * s_pc
    SHIFT_C += b * s_sc
    KEEP += b * s_kb
    BIAS += b * s_bb
    YA += b * s_tc
    A += b * s_tr
    U += b * s_tr
    BT += b * s_tc
    WT += b * s_tc
    acc_t = POT_C.dtype.element_ty
    r = _load_tile(R, rows, n_r, s_rn, s_rd, BLOCK_D, D, True)
    x = _load_tile(X + b * s_xb, rows, n_r, s_xn, s_xe, BLOCK_E, E, True)
    pot_r = tl.load(POT_R + b * s_pr + rows, mask=row_in, other=float("-inf"))  # (P = 0 past the last row)
    shift_r = tl.load(SHIFT_R + b * s_sr + rows, mask=row_in, other=0.0)
    xa = tl.zeros([BLOCK_R, BLOCK_T], dtype=acc_t)
    if FOLDED:
        xa = tl.load(XA + b * s_tr + terms[None, :] * n_r + rows[:, None],
                     mask=(terms[None, :] < n_terms) & row_in[:, None], other=0.0)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=acc_t)
    interior = (n_c // BLOCK_C) * BLOCK_C
    for start in range(0, interior, BLOCK_C):
        acc = _dscore_block(r, x, xa, pot_r, shift_r, C, Y, YA, POT_C, SHIFT_C, A, BT, U, WT, KEEP, BIAS, acc, rows,
                            start, n_r, n_c, n_terms, scale, s_cn, s_cd, s_yn, s_ye, s_kr, s_kc, s_br, s_bc, FOLDED,
                            HAS_KEEP, HAS_BIAS, False, BLOCK_C, D, BLOCK_D, E, BLOCK_E, BLOCK_T, PRECISION,
                            TERM_PRECISION)
    if interior < n_c:
        acc = _dscore_block(r, x, xa, pot_r, shift_r, C, Y, YA, POT_C, SHIFT_C, A, BT, U, WT, KEEP, BIAS, acc, rows,
                            interior, n_r, n_c, n_terms, scale, s_cn, s_cd, s_yn, s_ye, s_kr, s_kc, s_br, s_bc, FOLDED,
                            HAS_KEEP, HAS_BIAS, True, BLOCK_C, D, BLOCK_D, E, BLOCK_E, BLOCK_T, PRECISION,
                            TERM_PRECISION)
    dims = tl.arange(0, BLOCK_D)
    out = OUT + b * s_ob + rows.to(tl.int64)[:, None] * s_on + dims[None, :] * s_od
    tl.store(out, (acc * scale).to(OUT.dtype.element_ty), mask=row_in[:, None] & (dims[None, :] < D))


@triton.jit
def rowdot(X, Y, INV, OUT, n, inv0, s_xb, s_xn, s_xe, s_yb, s_yn, s_ye, s_inv, s_o,
           HAS_INV: tl.constexpr, BLOCK_R: tl.constexpr, E: tl.constexpr, BLOCK_E: tl.constexpr):
    """``OUT[b, i] = (X[b, i] . Y[b, i]) * INV[b, i]`` (or ``* inv0``), in ``OUT``'s dtype."""
    block, b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    rows = block * BLOCK_R + tl.arange(0, BLOCK_R)
    acc_t = OUT.dtype.element_ty
    x = _load_tile(X + b * s_xb, rows, n, s_xn, s_xe, BLOCK_E, E, True).to(acc_t)
    y = _load_tile(Y + b * s_yb, rows, n, s_yn, s_ye, BLOCK_E, E, True).to(acc_t)
    z = tl.sum(x * y, 1)
    if HAS_INV:
        z *= tl.load(INV + b * s_inv + rows, mask=rows < n, other=0.0)
    else:
        z *= inv0
    tl.store(OUT + b * s_o + rows, z, mask=rows < n)


@triton.jit
def _fold_side(P, LAST, U, OUT_X, OUT_E, n, shift, BLOCK: tl.constexpr):
    """``OUT_E = P - LAST + shift`` and ``OUT_X = 2^OUT_E * U`` over ``n`` entries."""
    for start in range(0, n, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        inside = idx < n
        e = tl.load(P + idx, mask=inside, other=0.0) - tl.load(LAST + idx, mask=inside, other=0.0) + shift
        tl.store(OUT_E + idx, e, mask=inside)
        tl.store(OUT_X + idx, tl.exp2(e) * tl.load(U + idx, mask=inside, other=0.0), mask=inside)


@triton.jit
def _largest_gap(P, LAST, n, BLOCK: tl.constexpr):
    """``max_i (P_i - LAST_i)`` over ``n`` entries."""
    hi = tl.full([BLOCK], float("-inf"), dtype=LAST.dtype.element_ty)
    for start in range(0, n, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        inside = idx < n
        gap = tl.load(P + idx, mask=inside, other=0.0) - tl.load(LAST + idx, mask=inside, other=0.0)
        hi = tl.maximum(hi, tl.where(inside, gap, float("-inf")))
    return tl.max(hi, 0)


@triton.jit
def fold(FS, GS, U, W, XA, YA, A, BT, OK, n, m, n_terms, limit, s_fb, s_fl, s_gb, s_gl, last_f, last_g,
         IMPLICIT: tl.constexpr, BLOCK: tl.constexpr):
    """Term ``t`` (step ``t + 1``) of slice ``b``: its potentials are ``f[(t) // 2]`` and
    ``g[(t + 1) // 2]`` of ``FS (B, Lf, n)``, ``GS (B, Lg, m)`` (``IMPLICIT``: the last ones), the final
    ones ``f[last_f]``, ``g[last_g]``; ``U, W, XA, YA, A, BT`` are ``(B, T, n|m)`` contiguous, ``OK (B, T)``."""
    t, b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    if IMPLICIT:
        ia, ib = last_f, last_g
    else:
        ia, ib = t // 2, (t + 1) // 2
    F, G = FS + b * s_fb + last_f * s_fl, GS + b * s_gb + last_g * s_gl
    alpha, beta = FS + b * s_fb + ia * s_fl, GS + b * s_gb + ib * s_gl
    hi_a, hi_b = _largest_gap(alpha, F, n, BLOCK), _largest_gap(beta, G, m, BLOCK)
    tl.store(OK + b * n_terms + t, (hi_a + hi_b <= 2 * limit).to(tl.int32))
    shift = (hi_a - hi_b) / 2
    rows, cols = (b * n_terms + t) * n, (b * n_terms + t) * m
    _fold_side(alpha, F, U + rows, XA + rows, A + rows, n, -shift, BLOCK)
    _fold_side(beta, G, W + cols, YA + cols, BT + cols, m, shift, BLOCK)
