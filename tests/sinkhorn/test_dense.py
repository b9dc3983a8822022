"""The Sinkhorn core: the mathematics (marginals, limits, invariances, gradients) and its edges."""

import re
import warnings

import numpy as np
import ot
import pytest
import torch
from conftest import nr_nc_reference
from hypothesis import given, settings
from hypothesis import strategies as st

from sinkformer import SinkhornConvergenceWarning, SinkhornResult, sinkhorn


def converged(scores, **kw):
    return sinkhorn(scores, None, tol=1e-10, max_iters=20_000, **kw)


# ----------------------------------------------------------------------------- iteration semantics


def test_one_iteration_is_softmax():
    S = torch.randn(3, 4, 7, 9)
    torch.testing.assert_close(sinkhorn(S, 1), torch.softmax(S, -1), atol=1e-6, rtol=0)


@pytest.mark.parametrize("n_iters", [1, 2, 3, 4, 5, 8, 21])
def test_iterates_follow_paper_eq3(n_iters):
    S = 2 * torch.randn(2, 6, 6, dtype=torch.float64)
    torch.testing.assert_close(sinkhorn(S, n_iters), nr_nc_reference(S, n_iters), atol=1e-12, rtol=1e-10)


def test_odd_counts_end_row_stochastic_even_counts_column_stochastic():
    S = 3 * torch.randn(5, 8, 8)
    for n in (3, 5, 7):
        torch.testing.assert_close(sinkhorn(S, n).sum(-1), torch.ones(5, 8), atol=1e-5, rtol=0)
    for n in (2, 4, 6):
        torch.testing.assert_close(sinkhorn(S, n).sum(-2), torch.ones(5, 8), atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------- converged marginals


def test_converged_square_is_doubly_stochastic():
    P = converged(torch.randn(4, 10, 10, dtype=torch.float64))
    torch.testing.assert_close(P.sum(-1), torch.ones(4, 10, dtype=torch.float64), atol=1e-9, rtol=0)
    torch.testing.assert_close(P.sum(-2), torch.ones(4, 10, dtype=torch.float64), atol=1e-9, rtol=0)


def test_converged_rectangular_columns_sum_to_n_over_m():
    P = converged(torch.randn(2, 6, 15, dtype=torch.float64))
    torch.testing.assert_close(P.sum(-1), torch.ones(2, 6, dtype=torch.float64), atol=1e-9, rtol=0)
    torch.testing.assert_close(P.sum(-2), torch.full((2, 15), 6 / 15, dtype=torch.float64), atol=1e-9, rtol=0)


def test_weighted_marginals_are_honoured():
    a = torch.rand(3, 7, dtype=torch.float64) + 0.1
    b = torch.rand(3, 5, dtype=torch.float64) + 0.1
    b = b / b.sum(-1, keepdim=True) * a.sum(-1, keepdim=True)
    P = converged(torch.randn(3, 7, 5, dtype=torch.float64), row_marginals=a, col_marginals=b)
    torch.testing.assert_close(P.sum(-1), a, atol=1e-9, rtol=0)
    torch.testing.assert_close(P.sum(-2), b, atol=1e-9, rtol=0)


def test_one_marginal_given_other_defaults_to_uniform_with_same_total():
    a = torch.rand(6, dtype=torch.float64) + 0.5
    P = converged(torch.randn(6, 4, dtype=torch.float64), row_marginals=a)
    torch.testing.assert_close(P.sum(-2), torch.full((4,), a.sum().item() / 4, dtype=torch.float64), atol=1e-9, rtol=0)


@settings(max_examples=25, deadline=None)
@given(
    batch=st.integers(1, 3),
    n=st.integers(1, 12),
    m=st.integers(1, 12),
    spread=st.floats(0.1, 5.0),
    seed=st.integers(0, 2**31 - 1),
)
def test_converged_marginals_property(batch, n, m, spread, seed):
    """Rows exact; columns within tol, or a warning: a nearly diagonal matrix (e.g. 2 x 2 at spread 4,
    seed 0) contracts so slowly that 20000 normalisations do not reach 1e-10, and must say so."""
    g = torch.Generator().manual_seed(seed)
    S = spread * torch.randn(batch, n, m, generator=g, dtype=torch.float64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        P = converged(S)
    assert torch.all(P >= 0)
    torch.testing.assert_close(P.sum(-1), torch.ones(batch, n, dtype=torch.float64), atol=1e-8, rtol=0)
    error = (P.sum(-2) - n / m).abs().amax().item()
    warned = [w for w in caught if issubclass(w.category, SinkhornConvergenceWarning)]
    assert error <= 1e-8 or (warned and "did not reach tol=1e-10" in str(warned[0].message))


# ----------------------------------------------------------------------------- independent solver


@pytest.mark.parametrize("shape", [(12, 12), (9, 14)])
def test_agrees_with_pot(shape):
    n, m = shape
    S = torch.randn(n, m, dtype=torch.float64)
    a, b = np.full(n, 1 / n), np.full(m, 1 / m)
    ref = ot.sinkhorn(a, b, M=-S.numpy(), reg=1, method="sinkhorn_log", stopThr=1e-13, numItermax=100_000)
    np.testing.assert_allclose(converged(S).numpy(), n * ref, atol=1e-5, rtol=0)


def test_agrees_with_pot_weighted():
    S = torch.randn(8, 11, dtype=torch.float64)
    a = np.random.default_rng(0).random(8) + 0.2
    b = np.random.default_rng(1).random(11) + 0.2
    a, b = a / a.sum(), b / b.sum()
    ref = ot.sinkhorn(a, b, M=-S.numpy(), reg=1, method="sinkhorn_log", stopThr=1e-13, numItermax=100_000)
    P = converged(S, row_marginals=torch.from_numpy(a), col_marginals=torch.from_numpy(b))
    np.testing.assert_allclose(P.numpy(), ref, atol=1e-8, rtol=0)


# ----------------------------------------------------------------------------- Proposition 1


def test_proposition1_invariance_at_convergence():
    S = torch.randn(3, 9, 9, dtype=torch.float64)
    f, g = 5 * torch.randn(3, 9, 1, dtype=torch.float64), 5 * torch.randn(3, 1, 9, dtype=torch.float64)
    torch.testing.assert_close(converged(S + f + g), converged(S), atol=1e-8, rtol=0)


def test_row_terms_cancel_at_every_iteration_column_terms_only_in_the_limit():
    S = torch.randn(9, 9, dtype=torch.float64)
    f, g = 3 * torch.randn(9, 1, dtype=torch.float64), 3 * torch.randn(1, 9, dtype=torch.float64)
    for n in (1, 2, 3, 6):
        torch.testing.assert_close(sinkhorn(S + f, n), sinkhorn(S, n), atol=1e-12, rtol=0)
    assert (sinkhorn(S + g, 3) - sinkhorn(S, 3)).abs().max() > 1e-3


# ----------------------------------------------------------------------------- masks


def padded_problem(n_valid=5, m_valid=7, n=8, m=10):
    S = torch.randn(n, m, dtype=torch.float64)
    rows = torch.arange(n) < n_valid
    cols = torch.arange(m) < m_valid
    return S, rows, cols, rows[:, None] & cols[None, :]


def test_mask_equals_solving_the_valid_submatrix():
    S, rows, cols, mask = padded_problem()
    P = converged(S, mask=mask)
    sub = converged(S[:5, :7])
    torch.testing.assert_close(P[:5, :7], sub, atol=1e-9, rtol=0)
    assert torch.all(P[5:] == 0) and torch.all(P[:, 7:] == 0)
    torch.testing.assert_close(P[:5].sum(-1), torch.ones(5, dtype=torch.float64), atol=1e-9, rtol=0)
    torch.testing.assert_close(P[:, :7].sum(-2), torch.full((7,), 5 / 7, dtype=torch.float64), atol=1e-9, rtol=0)


def test_masked_fill_trick_gives_wrong_columns_ours_does_not():
    # Self-attention with 3 padding tokens out of 8: padded keys are masked the usual way, but the
    # padded *queries* still take part in the column normalisation and steal mass.
    S = torch.randn(8, 8, dtype=torch.float64)
    valid = torch.arange(8) < 5
    naive = converged(S.masked_fill(~valid[None, :], -1e9))
    ours = converged(S, mask=valid[:, None] & valid[None, :])
    target = torch.ones(5, dtype=torch.float64)
    torch.testing.assert_close(ours[:5, :5].sum(-2), target, atol=1e-9, rtol=0)
    assert (naive[:5, :5].sum(-2) - target).abs().max() > 0.1


def test_query_with_no_valid_key_gives_zero_row_and_finite_gradient():
    S = torch.randn(2, 6, 6, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(2, 6, 6, dtype=torch.bool)
    mask[0, 2, :] = False  # query 2 of batch 0 sees nothing
    mask[1] = False  # batch 1: nothing at all
    P = sinkhorn(S, 7, mask=mask)
    assert torch.isfinite(P).all()
    assert torch.all(P[0, 2] == 0) and torch.all(P[1] == 0)
    (P * torch.randn_like(P)).sum().backward()
    assert torch.isfinite(S.grad).all()
    assert torch.all(S.grad[1] == 0)


def test_neg_inf_scores_are_masked():
    S = torch.randn(5, 5, dtype=torch.float64)
    mask = torch.rand(5, 5) > 0.3
    mask.fill_diagonal_(True)
    torch.testing.assert_close(converged(S.masked_fill(~mask, float("-inf"))), converged(S, mask=mask))


def test_broadcast_mask():
    S = torch.randn(3, 4, 6, 6)
    key_valid = torch.tensor([True] * 4 + [False] * 2)
    P = sinkhorn(S, 5, mask=key_valid)  # (m,) broadcasts over rows and batch
    assert P.shape == S.shape and torch.all(P[..., 4:] == 0)


# ----------------------------------------------------------------------------- tolerance mode and results


def test_result_object():
    S = torch.randn(2, 7, 7, dtype=torch.float64)
    res = sinkhorn(S, None, tol=1e-9, return_result=True)
    assert isinstance(res, SinkhornResult)
    assert res.converged and res.n_iters % 2 == 1
    assert res.row_error.shape == (2,) and res.col_error.max() <= 1e-9
    torch.testing.assert_close(torch.exp(S + res.f[..., :, None] + res.g[..., None, :]), res.matrix)


def test_max_iters_caps_and_reports_not_converged():
    S = 10 * torch.randn(20, 20, dtype=torch.float64)
    with pytest.warns(SinkhornConvergenceWarning, match=r"did not reach tol=1e-12 within max_iters=3 .*column error"):
        res = sinkhorn(S, None, tol=1e-12, max_iters=3, return_result=True)
    assert res.n_iters <= 3 and not res.converged
    assert res.col_error.item() > 1e-12


def test_fixed_count_converged_flag():
    S = torch.randn(6, 6)
    assert sinkhorn(S, 51, return_result=True).converged
    assert not sinkhorn(10 * S, 1, return_result=True).converged


def test_warm_start_from_converged_potential_needs_one_iteration():
    S = torch.randn(8, 8, dtype=torch.float64)
    first = sinkhorn(S, None, tol=1e-11, return_result=True)
    again = sinkhorn(S, None, tol=1e-10, warm_start=first.g, return_result=True)
    assert again.n_iters == 1
    torch.testing.assert_close(again.matrix, first.matrix, atol=1e-10, rtol=0)


# ----------------------------------------------------------------------------- numerics and gradients


def test_gradcheck_unmasked():
    S = torch.randn(2, 4, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda s: sinkhorn(s, 4), (S,))


def test_gradcheck_masked_with_empty_row_and_marginals():
    S = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(5, 4) > 0.25
    mask[0] = True
    mask[3] = False
    a = torch.tensor([0.2, 0.3, 0.1, 0.0, 0.4], dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda s: sinkhorn(s, 5, mask=mask, row_marginals=a), (S,))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs(dtype):
    S = (4 * torch.randn(2, 16, 16)).to(dtype)
    P = sinkhorn(S, 5)
    assert P.dtype == dtype and torch.isfinite(P).all()
    torch.testing.assert_close(P.float(), sinkhorn(S.float(), 5), atol=1e-2, rtol=0)


def test_score_range_1e4_is_finite_and_balanced():
    S = 1e4 * torch.randn(3, 12, 12)
    P = sinkhorn(S, 9)
    assert torch.isfinite(P).all()
    torch.testing.assert_close(P.sum(-1), torch.ones(3, 12), atol=1e-4, rtol=0)
    Ph = sinkhorn(S.half().clamp(-6e4, 6e4), 9)
    assert torch.isfinite(Ph).all()


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "call, exc, words",
    [
        (lambda: sinkhorn(torch.randn(5), 3), ValueError, "scores must have at least 2 dimensions"),
        (lambda: sinkhorn([[1.0]], 3), TypeError, "scores must be a torch.Tensor"),
        (lambda: sinkhorn(torch.ones(3, 3, dtype=torch.long), 3), TypeError, "scores must have a floating dtype"),
        (lambda: sinkhorn(torch.randn(3, 3), 0), ValueError, "n_iters must be an int >= 1, got 0"),
        (lambda: sinkhorn(torch.randn(3, 3), 2.5), TypeError, "n_iters must be an int"),
        (lambda: sinkhorn(torch.randn(3, 3), None), ValueError, "n_iters must be an int >= 1 when tol is None"),
        (lambda: sinkhorn(torch.randn(3, 3), 3, tol=1e-3), ValueError, "n_iters and tol are exclusive"),
        (lambda: sinkhorn(torch.randn(3, 3), None, tol=-1.0), ValueError, "tol must be a finite number > 0"),
        (lambda: sinkhorn(torch.full((3, 3), float("nan")), 3), ValueError, "scores contains NaN"),
        (lambda: sinkhorn(torch.full((3, 3), float("inf")), 3), ValueError, "scores contains +inf"),
        (
            lambda: sinkhorn(torch.randn(3, 3), 3, mask=torch.ones(2, 3, dtype=torch.bool)),
            ValueError,
            "mask must broadcast to the scores shape (3, 3)",
        ),
        (lambda: sinkhorn(torch.randn(3, 3), 3, mask=torch.ones(3, 3)), TypeError, "mask must be a bool tensor"),
        (
            lambda: sinkhorn(torch.randn(3, 3), 3, row_marginals=torch.tensor([1.0, -1.0, 3.0])),
            ValueError,
            "row_marginals must be non-negative",
        ),
        (
            lambda: sinkhorn(torch.randn(3, 3), 3, row_marginals=torch.ones(3), col_marginals=torch.full((3,), 2.0)),
            ValueError,
            "must have equal totals",
        ),
        (
            lambda: sinkhorn(torch.randn(3, 3), 3, col_marginals=torch.ones(4)),
            ValueError,
            "col_marginals must broadcast to (3,)",
        ),
        (
            lambda: sinkhorn(
                torch.randn(3, 3), 3, mask=torch.tensor([True, True, False])[:, None].expand(3, 3),
                row_marginals=torch.ones(3),
            ),
            ValueError,
            "row_marginals puts mass on a row whose entries are all masked",
        ),
        (
            lambda: sinkhorn(torch.randn(3, 3), 3, warm_start=torch.zeros(4)),
            ValueError,
            "warm_start must broadcast to (3,)",
        ),
    ],
)
def test_bad_input_is_named(call, exc, words):
    with pytest.raises(exc) as info:
        call()
    assert words in str(info.value)


@pytest.mark.parametrize("kwargs, words", [
    ({"row_marginals": torch.tensor([1.0, -1.0, 3.0])}, "row_marginals must be non-negative"),
    ({"row_marginals": torch.ones(3), "col_marginals": torch.full((3,), 2.0)}, "must have equal totals"),
    ({"mask": torch.tensor([True, True, False])[:, None].expand(3, 3), "row_marginals": torch.ones(3)},
     "row_marginals puts mass on a row whose entries are all masked"),
    ({"warm_start": torch.tensor([0.0, float("nan"), 0.0])}, "warm_start contains NaN"),
])
def test_input_checks_survive_compile(kwargs, words):
    """Issue 23.2: under torch.compile the checks are asserts in the graph (RuntimeError, same words)."""
    torch._dynamo.reset()
    compiled = torch.compile(lambda S: sinkhorn(S, 3, **kwargs), fullgraph=True, backend="aot_eager")
    with pytest.raises(RuntimeError, match=re.escape(words)):
        compiled(torch.randn(3, 3))
    nan = torch.randn(3, 3)
    nan[1, 1] = float("nan")
    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match="scores contains NaN"):
        torch.compile(lambda S: sinkhorn(S, 3), fullgraph=True, backend="aot_eager")(nan)


def _scores_with(*entries: float) -> torch.Tensor:
    """Random (2, 5, 6) scores with ``entries`` written at scattered places (one each)."""
    S = torch.randn(2, 5, 6)
    for i, value in enumerate(entries):
        S[i % 2, (2 * i + 1) % 5, (3 * i + 2) % 6] = value
    return S


@pytest.mark.parametrize("domain", ["log", "scaling"])
@pytest.mark.parametrize("entries, words", [
    ((float("nan"),), "scores contains NaN"),
    ((float("-inf"), float("nan")), "scores contains NaN"),  # -inf beside a NaN: the NaN is named
    ((float("inf"),), "scores contains +inf"),
    ((float("-inf"), float("inf")), "scores contains +inf"),
    ((float("nan"), float("inf")), "scores contains NaN"),
])
def test_one_bad_score_among_finite_and_masked_ones_is_named(domain, entries, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        sinkhorn(_scores_with(*entries), 3, domain=domain)


@pytest.mark.parametrize("domain", ["log", "scaling"])
def test_a_minus_inf_score_masks_its_entry_as_the_mask_does(domain):
    """Scores told unmasked by their minimum and scores with a -inf entry take the same plan as an explicit mask."""
    S = torch.randn(3, 5, 6, dtype=torch.float64)
    masked = S.clone()
    masked[1, 2, 3] = float("-inf")
    mask = masked > float("-inf")
    torch.testing.assert_close(sinkhorn(masked, 5, domain=domain), sinkhorn(S, 5, mask=mask, domain=domain),
                               rtol=0, atol=1e-14)
    P = sinkhorn(masked, 5, domain=domain)
    assert P[1, 2, 3] == 0 and torch.isfinite(P).all()
