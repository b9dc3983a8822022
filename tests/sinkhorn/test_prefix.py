"""Prefix Sinkhorn (``sinkformer.sinkhorn.prefix``): every prefix of a causal problem balanced on its own.

The definition is checked by brute force — one dense Sinkhorn per prefix — in float64, for both
orders (rows first: causal Sinkformers; columns first: Sparse Sinkhorn Attention's block sorting),
both marginal choices, masks on keys and arbitrary masks; then zero leakage, the fast paths against
their exact fallbacks, and the non-degeneracy of the causal marginals.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import sinkformer
from sinkformer.sinkhorn import prefix
from sinkformer.sinkhorn.prefix import log_cumsum_exp, log_matmul, prefix_sinkhorn


def brute_force(scores, n_iters, mask=None, marginals="causal", start="rows"):
    """Row t of the dense Sinkhorn of the prefix 0..t alone, the marginals written out from their definition."""
    n = scores.shape[-1]
    keep = torch.ones(n, n, dtype=torch.bool).tril()
    if mask is not None:
        keep = keep & mask
    keep = keep.expand(scores.shape)
    out = torch.zeros_like(scores)
    for t in range(n):
        sub, k = scores[..., : t + 1, : t + 1], keep[..., : t + 1, : t + 1]
        col_valid = k.any(-2)
        if marginals == "causal":  # column sums of uniform causal attention on the prefix
            b = (k.double() / k.sum(-1, keepdim=True).clamp_min(1)).sum(-2)
        else:  # the dense engine's default: valid rows / valid columns
            b = col_valid * (k.any(-1).sum(-1, keepdim=True).double() / col_valid.sum(-1, keepdim=True).clamp_min(1))
        b = b.to(scores.dtype)
        if start == "rows":
            P = sinkformer.sinkhorn(sub, n_iters, mask=k, col_marginals=b)
        else:  # columns first = rows first on the transpose
            P = sinkformer.sinkhorn(sub.transpose(-1, -2), n_iters, mask=k.transpose(-1, -2),
                                    row_marginals=b).transpose(-1, -2)
        out[..., t, : t + 1] = P[..., t, :]
    return out


def key_mask(batch, n, seed):
    g = torch.Generator().manual_seed(seed)
    keys = torch.rand(batch, 1, n, generator=g) > 0.3
    keys[0, 0, 0] = False  # a first row with no key at all
    return keys


@pytest.mark.parametrize("n", [1, 7])
@pytest.mark.parametrize("n_iters", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("marginals", ["causal", "uniform"])
@pytest.mark.parametrize("start", ["rows", "columns"])
@pytest.mark.parametrize("mask", ["none", "keys", "any"])
def test_equals_the_per_prefix_definition(n, n_iters, marginals, start, mask):
    g = torch.Generator().manual_seed(n * 100 + n_iters)
    scores = 2 * torch.randn(3, n, n, generator=g, dtype=torch.float64)
    m = {"none": None, "keys": key_mask(3, n, 1),
         "any": torch.rand(3, n, n, generator=g) > 0.25}[mask]
    got = prefix_sinkhorn(scores, n_iters, mask=m, marginals=marginals, start=start)
    want = brute_force(scores, n_iters, m, marginals, start)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert got.dtype == torch.float64


def test_float32_and_the_shapes_of_a_batch_of_heads():
    scores = torch.randn(2, 3, 12, 12, dtype=torch.float64)
    want = brute_force(scores, 5)
    got = prefix_sinkhorn(scores.float(), 5)
    assert got.dtype == torch.float32 and got.shape == (2, 3, 12, 12)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n_iters", [1, 2, 3, 4, 5, 7])
@pytest.mark.parametrize("start", ["rows", "columns"])
def test_no_gradient_from_the_future(n_iters, start):
    """Row t is a function of scores[:t+1, :t+1] only: the gradient of rows <= t with respect to every
    later score row is exactly zero (and not with respect to earlier ones)."""
    n = 9
    scores = torch.randn(2, n, n, dtype=torch.float64, requires_grad=True)
    P = prefix_sinkhorn(scores, n_iters, mask=key_mask(2, n, 3), start=start)
    w = torch.randn(P.shape, dtype=torch.float64)
    for t in range(1, n - 1):
        (grad,) = torch.autograd.grad((P[:, : t + 1] * w[:, : t + 1]).sum(), scores, retain_graph=True)
        assert grad[:, t + 1 :].abs().max().item() == 0.0
        assert grad[:, : t + 1].abs().max().item() > 0.0


@pytest.mark.parametrize("start", ["rows", "columns"])
@pytest.mark.parametrize("spread", [1.0, 30.0, 300.0])
def test_past_rows_do_not_change_when_the_future_does(start, spread):
    """Bit for bit: no shift, maximum or fallback decision reads a later row (spread 300 takes the exact
    fallbacks in float32)."""
    n, cut = 12, 7
    g = torch.Generator().manual_seed(int(spread))
    scores = spread * torch.randn(2, n, n, generator=g)
    changed = scores.clone()
    changed[:, cut:] = spread * torch.randn(2, n - cut, n, generator=g)
    for n_iters in range(1, 7):
        a = prefix_sinkhorn(scores, n_iters, start=start, mask=key_mask(2, n, 6))
        b = prefix_sinkhorn(changed, n_iters, start=start, mask=key_mask(2, n, 6))
        assert torch.equal(a[:, :cut], b[:, :cut]), (n_iters, (a[:, :cut] - b[:, :cut]).abs().max().item())


def test_gradients_equal_finite_differences():
    scores = torch.randn(1, 6, 6, dtype=torch.float64, requires_grad=True)
    mask = key_mask(1, 6, 4)
    assert torch.autograd.gradcheck(lambda s: prefix_sinkhorn(s, 5, mask=mask), (scores,))
    assert torch.autograd.gradgradcheck(lambda s: prefix_sinkhorn(s, 4, mask=mask), (scores,))


def test_fast_products_equal_their_exact_fallbacks(monkeypatch):
    """The max-shifted matmul and cumsum against the exact log-sum-exps; and the whole result with the
    fast paths switched off."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, 5, 7, generator=g, dtype=torch.float64), torch.randn(2, 6, 7, generator=g, dtype=torch.float64)
    torch.testing.assert_close(log_matmul(a, b), (a.unsqueeze(-2) + b.unsqueeze(-3)).logsumexp(-1))
    y = torch.randn(2, 8, 5, generator=g, dtype=torch.float64)
    torch.testing.assert_close(log_cumsum_exp(y), torch.logcumsumexp(y, dim=-2))
    scores = 3 * torch.randn(2, 10, 10, generator=g, dtype=torch.float64)
    fast = prefix_sinkhorn(scores, 6, mask=key_mask(2, 10, 5))
    monkeypatch.setattr(prefix, "_checked_log",
                        lambda sums, terms, needed, exact, *operands: exact(torch.ones(sums.shape, dtype=torch.bool),
                                                                            *operands))
    exact = prefix_sinkhorn(scores, 6, mask=key_mask(2, 10, 5))
    torch.testing.assert_close(fast, exact, rtol=1e-12, atol=1e-14)


def test_extreme_score_ranges_take_the_exact_path_and_stay_finite():
    """Scores spanning ~1e3 underflow a float32 matmul of exponentials: the exact log-sum-exps take over."""
    scores = 300 * torch.randn(2, 9, 9, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    want = brute_force(scores, 6)
    got = prefix_sinkhorn(scores.float().requires_grad_(), 6)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-4)
    got.sum().backward()


@pytest.mark.parametrize("n_iters", [4, 5])
def test_columns_first_log_domain_gradient_is_finite_where_later_rows_exceed_the_first(n_iters):
    """Columns first shifts each column by its first entry, so later rows reach e^{+90} and more in float32:
    their cumulative sums are recomputed exactly, and the gradient through the unused fast sums is finite
    (it was NaN: 0 times the derivative of an infinite exponential)."""
    scores = (30 * torch.randn(2, 16, 16, generator=torch.Generator().manual_seed(12))).requires_grad_()
    problem = prefix._Prefix.build(scores, None, "uniform", "columns")
    assert problem.x.detach().amax() > 90
    out = prefix._log_domain(problem, n_iters, "columns")
    (grad,) = torch.autograd.grad((out * torch.randn(out.shape)).sum(), scores)
    assert torch.isfinite(out).all() and torch.isfinite(grad).all()
    torch.testing.assert_close(out.double(), brute_force(scores.detach().double(), n_iters, marginals="uniform",
                                                         start="columns"), rtol=0, atol=1e-5)


def test_causal_marginals_do_not_degenerate():
    """Uniform column marginals drive the causal problem to the identity; the marginals of uniform causal
    attention keep the entropy of SoftMax (here within 10 %) as n_iters grows."""
    scores = torch.randn(4, 48, 48, generator=torch.Generator().manual_seed(2), dtype=torch.float64)

    def entropy(P):
        return -(P * P.clamp_min(1e-300).log()).sum(-1).mean().item()

    softmax = entropy(prefix_sinkhorn(scores, 1))
    for n_iters in (3, 11, 101):
        causal = prefix_sinkhorn(scores, n_iters, marginals="causal")
        assert abs(entropy(causal) - softmax) < 0.1 * softmax
        assert causal.diagonal(dim1=-2, dim2=-1).mean() < 0.2
    degenerate = prefix_sinkhorn(scores, 101, marginals="uniform")
    assert degenerate.diagonal(dim1=-2, dim2=-1).mean() > 0.8
    assert entropy(degenerate) < 0.3 * softmax


def test_constant_scores_give_uniform_causal_attention_for_every_n_iters():
    n = 6
    uniform = torch.ones(n, n, dtype=torch.float64).tril() / torch.arange(1, n + 1, dtype=torch.float64)[:, None]
    for n_iters in (1, 2, 3, 6):
        torch.testing.assert_close(prefix_sinkhorn(torch.zeros(n, n, dtype=torch.float64), n_iters), uniform)


@pytest.mark.parametrize("kwargs, error", [
    (dict(scores=torch.zeros(3, 4)), "scores must be square"),
    (dict(n_iters=0), "n_iters must be an int >= 1"),
    (dict(marginals="harmonic"), "marginals must be one of"),
    (dict(start="diagonal"), "start must be 'rows' or 'columns'"),
    (dict(mask=torch.ones(5, 5, dtype=torch.bool)), "mask must broadcast"),
    (dict(mask=torch.ones(4, 4)), "mask must be a bool tensor"),
])
def test_errors_name_the_argument(kwargs, error):
    call = dict(scores=torch.zeros(4, 4), n_iters=3)
    call.update(kwargs)
    with pytest.raises((ValueError, TypeError), match=error):
        prefix_sinkhorn(call.pop("scores"), call.pop("n_iters"), **call)


def expected_products(n_iters: int, start: str) -> int:
    """Log-sum-exp matrix products of the module docstring: every normalisation after those that start
    from zero potentials (rows first: two; columns first: one), except a final row update (diagonal)."""
    first = 2 if start == "rows" else 1
    steps = range(first, n_iters)
    last_is_row = ((n_iters - 1) % 2 == 0) == (start == "rows")
    return sum(1 for s in steps if not (s == n_iters - 1 and last_is_row))


class _Products(TorchDispatchMode):
    """Counts the batched matrix products an operation runs."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in (torch.ops.aten.bmm.default, torch.ops.aten.mm.default)
        return func(*args, **(kwargs or {}))


def test_costs_of_the_module_docstring(monkeypatch):
    """Rows first with n_iters <= 3 never forms a matrix product (O(n^2), like SoftMax); each further
    normalisation but a final row update is one product, in the scaling domain and in the log domain
    (log-sum-exp products) alike. (Cumulative sums as torch.cumsum here: on CPUs they are products of
    16-row blocks.)"""
    calls = []
    original = prefix.log_matmul
    monkeypatch.setattr(prefix, "log_matmul", lambda *a, **k: calls.append(1) or original(*a, **k))
    monkeypatch.setattr(prefix, "cumsum_rows", lambda x, reverse=False: torch.cumsum(x, -2))
    scores = torch.randn(2, 16, 16, dtype=torch.float64)
    for n_iters, start in itertools.product(range(1, 8), ("rows", "columns")):
        calls.clear()
        with _Products() as products:
            prefix_sinkhorn(scores, n_iters, start=start)
        assert products.count == expected_products(n_iters, start) and not calls, (n_iters, start)
        prefix._log_domain(prefix._Prefix.build(scores, None, "causal", start), n_iters, start)
        assert len(calls) == expected_products(n_iters, start), (n_iters, start)
    assert [expected_products(k, "rows") for k in range(1, 8)] == [0, 0, 0, 2, 2, 4, 4]


@pytest.mark.parametrize("n_iters", [4, 5, 10])
@pytest.mark.parametrize("start", ["rows", "columns"])
@pytest.mark.parametrize("mask", ["none", "keys", "any"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_scaling_domain_equals_the_log_domain_and_hands_it_the_rows_it_cannot_serve(n_iters, start, mask, dtype):
    """Four or more iterations run in the scaling domain (one matrix product per normalisation); the
    second matrix's scores spread beyond the dtype's exponent range, so some of its rows (and only
    rows: each verdict reads rows <= t) take the log domain; the gradient stays finite."""
    g = torch.Generator().manual_seed(12)
    n, spread = 16, (300 if dtype == torch.float32 else 3000)
    scores = torch.stack([2 * torch.randn(n, n, generator=g), spread * torch.randn(n, n, generator=g)]).to(dtype)
    m = {"none": None, "keys": key_mask(2, n, 2), "any": torch.rand(2, n, n, generator=g) > 0.25}[mask]
    problem = prefix._Prefix.build(scores, m, "uniform", start)
    weights, untrusted = prefix._scaling_domain(problem, n_iters, start)
    assert not untrusted[0].any() and untrusted[1].any()
    log = prefix._log_domain(problem, n_iters, start)
    tol = dict(rtol=1e-12, atol=1e-14) if dtype == torch.float64 else dict(rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(weights[0], log[0], **tol)
    trusted = ~untrusted[1]
    torch.testing.assert_close(weights[1][trusted], log[1][trusted], **tol)
    leaf = scores.clone().requires_grad_()
    got = prefix_sinkhorn(leaf, n_iters, mask=m, marginals="uniform", start=start)
    assert torch.equal(got, torch.where(untrusted.unsqueeze(-1), log, weights))
    (grad,) = torch.autograd.grad((got * torch.randn(got.shape, generator=g, dtype=dtype)).sum(), leaf)
    assert torch.isfinite(grad).all()


@pytest.mark.parametrize("n_iters", [2, 3])
@pytest.mark.parametrize("mask", ["none", "keys", "any"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_two_and_three_iterations_without_logarithms_equal_the_log_domain(n_iters, mask, dtype):
    """Rows first with 2 or 3 iterations runs in the scaling domain (SoftMax, cumulative column sums);
    rows whose sums underflow (here: the second matrix, scores spread beyond the dtype's exponent range)
    fall back to the log domain one by one, and the gradient stays finite."""
    g = torch.Generator().manual_seed(11)
    n, spread = 16, (300 if dtype == torch.float32 else 3000)
    scores = torch.stack([2 * torch.randn(n, n, generator=g), spread * torch.randn(n, n, generator=g)]).to(dtype)
    m = {"none": None, "keys": key_mask(2, n, 2), "any": torch.rand(2, n, n, generator=g) > 0.25}[mask]
    problem = prefix._Prefix.build(scores, m, "causal", "rows")
    weights, inexact = prefix._rows_first_in_scaling_domain(problem, n_iters)
    assert not inexact[0].any() and inexact[1].any()  # moderate scores: every row exact
    log = prefix._log_domain(problem, n_iters, "rows")
    tol = dict(rtol=1e-12, atol=1e-14) if dtype == torch.float64 else dict(rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(weights[0], log[0], **tol)
    exact_rows = ~inexact[1]
    torch.testing.assert_close(weights[1][exact_rows], log[1][exact_rows], **tol)
    leaf = scores.clone().requires_grad_()
    got = prefix_sinkhorn(leaf, n_iters, mask=m)
    torch.testing.assert_close(got, torch.where(inexact.unsqueeze(-1), log, weights))
    (grad,) = torch.autograd.grad((got * torch.randn(got.shape, generator=g, dtype=dtype)).sum(), leaf)
    assert torch.isfinite(grad).all()


@pytest.mark.parametrize("start,marginals", [("columns", "uniform"), ("rows", "causal")])
@pytest.mark.parametrize("n_iters", [4, 5])
def test_scaling_domain_quotients_first_and_second_derivatives(n_iters, start, marginals, monkeypatch):
    """The scaling domain's normalisations divide by _Quotient (here from 1 row on): its own backward
    against finite differences, twice; the block sorting's problem (columns first, uniform marginals)
    and the Sinkformer's."""
    from sinkformer.sinkhorn import prefix

    monkeypatch.setattr(prefix, "QUOTIENT_MIN_N", 1)
    mask = key_mask(2, 6, 8)
    scores = torch.randn(2, 6, 6, dtype=torch.float64, requires_grad=True)
    fn = lambda s: prefix_sinkhorn(s, n_iters, mask=mask, marginals=marginals, start=start)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (scores,))
    assert torch.autograd.gradgradcheck(fn, (scores,))


def test_quotients_give_the_gradients_of_autograds_division(monkeypatch):
    from sinkformer.sinkhorn import prefix

    calls = []
    monkeypatch.setattr(prefix._Quotient, "apply", lambda *a, f=prefix._Quotient.apply: calls.append(1) or f(*a))
    g = torch.Generator().manual_seed(0)
    scores = (3 * torch.randn(2, 40, 40, dtype=torch.float64, generator=g)).requires_grad_()
    weights = torch.randn(2, 40, 40, dtype=torch.float64, generator=g)
    grads = []
    for least in (40, 41):  # 40 rows: quotients, then autograd's division
        monkeypatch.setattr(prefix, "QUOTIENT_MIN_N", least)
        out = prefix_sinkhorn(scores, 5, marginals="uniform", start="columns", mask=key_mask(2, 40, 9))
        grads.append((out, *torch.autograd.grad((out * weights).sum(), scores)))
        assert bool(calls) == (least == 40)
        calls.clear()
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("n_iters", [2, 3])
def test_two_and_three_iterations_first_and_second_derivatives(n_iters):
    """The scaling-domain path's own backward (_ScaledRows) against finite differences, twice."""
    mask = key_mask(2, 6, 8)
    scores = torch.randn(2, 6, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda s: prefix_sinkhorn(s, n_iters, mask=mask), (scores,))
    assert torch.autograd.gradgradcheck(lambda s: prefix_sinkhorn(s, n_iters, mask=mask), (scores,))
    any_mask = torch.rand(2, 6, 6, generator=torch.Generator().manual_seed(3)) > 0.3
    assert torch.autograd.gradcheck(lambda s: prefix_sinkhorn(s, n_iters, mask=any_mask), (scores,))


@pytest.mark.parametrize("shape", [(3, 1, 5), (2, 3, 7, 4), (1, 64, 9), (1, 130, 2), (2, 65, 2)])
def test_cumsum_rows_is_torch_cumsum_over_rows_with_two_derivatives(shape):
    """Triangular products of 64 rows plus carries: blocks of one row, exactly one block, a last
    partial block; first and second derivatives against finite differences."""
    from sinkformer.sinkhorn.prefix import cumsum_rows

    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(cumsum_rows(x), x.cumsum(-2))
    assert torch.autograd.gradcheck(cumsum_rows, (x,))
    assert torch.autograd.gradgradcheck(cumsum_rows, (x,))


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("shape", [(3, 1, 5), (2, 3, 7, 4), (1, 64, 9), (1, 130, 2), (2, 65, 2)])
def test_cumsum_rows_in_place_is_cumsum_rows_bit_for_bit(shape, reverse):
    """cumsum_rows_ writes into its input the very sums of cumsum_rows (each block's product reads rows
    not yet overwritten), forwards and in reverse."""
    from sinkformer.sinkhorn.prefix import cumsum_rows, cumsum_rows_

    x = torch.randn(*shape, dtype=torch.float64)
    want = cumsum_rows(x, reverse)
    torch.testing.assert_close(want, x.flip(-2).cumsum(-2).flip(-2) if reverse else x.cumsum(-2))
    got = cumsum_rows_(x, reverse)
    assert got.data_ptr() == x.data_ptr() and torch.equal(got, want)


@pytest.mark.parametrize("row_by_row", [False, True])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("shape", [(3, 1, 5), (2, 3, 7, 4), (1, 64, 9), (2, 65, 2)])
def test_running_sums_are_a_total_carried_in_plus_cumulative_sums(monkeypatch, shape, reverse, inplace, row_by_row):
    """running_sums, by one triangular product (<= 64 rows), cumsum_rows (65) or row by row: initial + the sums
    over rows <= t (reverse: >= t), in x's buffer when inplace row by row; row t unchanged bit for bit when
    rows on the other side change."""
    monkeypatch.setattr(prefix, "ROW_BY_ROW_FROM", 1 if row_by_row else 1 << 40)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(*shape, dtype=torch.float64, generator=g)
    initial = torch.randn(*shape[:-2], shape[-1], dtype=torch.float64, generator=g)
    want = initial.unsqueeze(-2) + (x.flip(-2).cumsum(-2).flip(-2) if reverse else x.cumsum(-2))
    y = x.clone()
    got = prefix.running_sums(y, initial, reverse=reverse, inplace=inplace)
    torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)
    assert inplace or (torch.equal(y, x) and got.data_ptr() != y.data_ptr())  # x overwritten only when allowed
    assert not (inplace and row_by_row and shape[-2] > 1) or got.data_ptr() == y.data_ptr()  # ... row by row it is
    buffer = torch.empty_like(x)
    into = prefix.running_sums(x.clone(), initial, reverse=reverse, inplace=inplace, out=buffer)
    assert torch.equal(into, got)  # an out= buffer: the same sums
    t = shape[-2] // 2
    other = x.clone()
    (other[..., :t, :] if reverse else other[..., t + 1:, :]).normal_(generator=g)  # the rows beyond t
    again = prefix.running_sums(other, initial, reverse=reverse)
    assert torch.equal(again[..., t, :], got[..., t, :])


@pytest.mark.parametrize("start", ["rows", "columns"])
@pytest.mark.parametrize("mask", ["none", "keys", "any"])
def test_the_log_domain_of_the_later_prefixes_equals_those_rows_of_every_prefix(start, mask):
    """``_log_domain(..., first)`` computes the potentials of prefixes ``first..n-1`` only: its rows
    equal those rows of the whole log domain (to rounding: other matrix shapes), gradients too."""
    g = torch.Generator().manual_seed(5)
    n = 12
    scores = (3 * torch.randn(2, n, n, generator=g, dtype=torch.float64)).requires_grad_()
    m = {"none": None, "keys": key_mask(2, n, 2), "any": torch.rand(2, n, n, generator=g) > 0.25}[mask]
    problem = prefix._Prefix.build(scores, m, "causal", start)
    for n_iters in range(1, 7):
        whole = prefix._log_domain(problem, n_iters, start)
        for first in (0, 1, 7, n - 1):
            tail = prefix._log_domain(problem, n_iters, start, first)
            assert tail.shape == whole[..., first:, :].shape
            torch.testing.assert_close(tail, whole[..., first:, :], rtol=1e-13, atol=1e-15)
            weight = torch.randn(tail.shape, generator=g, dtype=torch.float64)
            got = torch.autograd.grad((tail * weight).sum(), scores, retain_graph=True)[0]
            want = torch.autograd.grad((whole[..., first:, :] * weight).sum(), scores, retain_graph=True)[0]
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("start,n_iters", [("rows", 2), ("rows", 3), ("rows", 5), ("columns", 2), ("columns", 5)])
def test_untrusted_rows_are_recomputed_for_the_later_prefixes_only(start, n_iters, monkeypatch):
    """When only later prefixes are untrusted (here rows 9.. of one slice take scores beyond float64's
    exponent range), the log domain runs from the first untrusted row on, not over every prefix; the
    weights are those rows of the whole log domain where untrusted, the scaling domain's elsewhere."""
    g = torch.Generator().manual_seed(8)
    n = 16
    scores = 2 * torch.randn(2, n, n, generator=g, dtype=torch.float64)
    scores[1, 9:] *= 1500
    problem = prefix._Prefix.build(scores, None, "uniform", start)
    if start == "rows" and n_iters in (2, 3):  # SoftMax and cumulative column sums
        weights, untrusted = prefix._rows_first_in_scaling_domain(problem, n_iters)
    else:
        weights, untrusted = prefix._scaling_domain(problem, n_iters, start)
    first = int(untrusted.any(0).to(torch.uint8).argmax())
    assert untrusted.any() and first >= 9 and not untrusted[0].any()
    want = torch.where(untrusted.unsqueeze(-1), prefix._log_domain(problem, n_iters, start), weights)
    calls = []
    original = prefix._log_domain
    monkeypatch.setattr(prefix, "_log_domain", lambda *a: calls.append(a[3:]) or original(*a))
    leaf = scores.clone().requires_grad_()
    got = prefix_sinkhorn(leaf, n_iters, marginals="uniform", start=start)
    assert calls == [(first,)]
    torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-15)
    (grad,) = torch.autograd.grad((got * torch.randn(got.shape, generator=g, dtype=torch.float64)).sum(), leaf)
    assert torch.isfinite(grad).all()
