"""``sinkhorn(domain="scaling")`` answers to the log-domain reference: plans, gradients, masks,
marginals, the matrices it hands back to the log domain, its refusals, and under compile."""

import pytest
import torch

from sinkformer import sinkhorn


def _grad(P, S, w):
    return torch.autograd.grad((P * w).sum(), S)[0]


@pytest.mark.parametrize("n_iters", [1, 2, 3, 4, 5, 10])
@pytest.mark.parametrize("shape", [(3, 5, 7), (2, 4, 9, 9), (1, 1, 1)])
def test_plan_and_gradient_equal_the_log_domain(shape, n_iters):
    torch.manual_seed(n_iters)
    S = (3 * torch.randn(shape, dtype=torch.float64)).requires_grad_()
    w = torch.randn(shape, dtype=torch.float64)
    ref, new = sinkhorn(S, n_iters), sinkhorn(S, n_iters, domain="scaling")
    torch.testing.assert_close(new, ref, atol=1e-13, rtol=0)
    torch.testing.assert_close(_grad(new, S, w), _grad(ref, S, w), atol=1e-12, rtol=0)


def test_masks_and_marginals_equal_the_log_domain():
    torch.manual_seed(0)
    S = torch.randn(4, 6, 8, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(4, 6, 8) > 0.35
    mask[0, 2] = False  # a row without keys
    mask[1, :, 3] = False  # a column without queries
    a = torch.rand(4, 6, dtype=torch.float64) + 0.2
    kwargs = dict(mask=mask, row_marginals=a * mask.any(-1))
    w = torch.randn(4, 6, 8, dtype=torch.float64)
    for n_iters in (2, 5):
        ref, new = sinkhorn(S, n_iters, **kwargs), sinkhorn(S, n_iters, domain="scaling", **kwargs)
        torch.testing.assert_close(new, ref, atol=1e-13, rtol=0)
        assert (new[~mask] == 0).all() and (new[0, 2] == 0).all()
        torch.testing.assert_close(_grad(new, S, w), _grad(ref, S, w), atol=1e-12, rtol=0)


def test_first_and_second_derivatives_by_gradcheck_marginals_included():
    """The backward's own reverse recursion (first derivatives) and the recorded loop (second)."""
    S = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda s: sinkhorn(s, 4, domain="scaling"), (S,))
    a = (torch.rand(2, 3, dtype=torch.float64) + 0.5).requires_grad_()
    b = torch.rand(2, 4, dtype=torch.float64) + 0.5
    b = (b / b.sum(-1, keepdim=True) * a.detach().sum(-1, keepdim=True)).requires_grad_()
    for n_iters in (1, 4, 5):
        def f(s, a, b):
            return sinkhorn(s, n_iters, row_marginals=a, col_marginals=b, domain="scaling")
        assert torch.autograd.gradcheck(f, (S, a, b))
        assert torch.autograd.gradgradcheck(f, (S, a, b))


def _one_untrusted_matrix():
    """Three matrices; the first gives a row a mass of 1e-35 and is that column's only row, so the
    column's sums fall to 1e-35 and its scaling to ~1e35: not trusted."""
    torch.manual_seed(0)
    S = torch.randn(3, 3, 3)
    mask = torch.ones(3, 3, 3, dtype=torch.bool)
    mask[0, 1:, 0] = False
    a = torch.ones(3, 3)
    a[0, 0] = 1e-35
    return S, dict(mask=mask, row_marginals=a)


def test_untrusted_matrices_take_the_log_domain_and_keep_finite_gradients():
    """That matrix equals the log domain's bit for bit, the others stay within rounding, no gradient
    is NaN; score ranges of 1e4 (integer scores) stay trusted and within rounding."""
    S, kwargs = _one_untrusted_matrix()
    S.requires_grad_()
    w = torch.randn(3, 3, 3)
    ref, new = sinkhorn(S, 6, **kwargs), sinkhorn(S, 6, domain="scaling", **kwargs)
    assert torch.equal(new[0], ref[0])
    torch.testing.assert_close(new[1:], ref[1:], atol=1e-6, rtol=0)
    g_ref, g_new = _grad(ref, S, w), _grad(new, S, w)
    assert torch.isfinite(g_new).all()
    assert torch.equal(g_new[0], g_ref[0])
    torch.testing.assert_close(g_new[1:], g_ref[1:], atol=1e-6, rtol=0)

    q, k = (torch.randn(4, 10, 4).mul(60).round() for _ in range(2))
    S = q @ k.mT
    assert S.max() - S.min() > 5e3
    torch.testing.assert_close(sinkhorn(S, 5, domain="scaling"), sinkhorn(S, 5), atol=1e-6, rtol=0)


def test_a_trusted_moderate_range_stays_in_the_scaling_domain(monkeypatch):
    """The log domain runs only when a matrix needs it."""
    import sinkformer.sinkhorn.dense as dense

    def refuse(*args, **kwargs):
        raise AssertionError("the log domain ran")

    monkeypatch.setattr(dense, "_log_domain_plan", dense.exact_path(refuse))
    S = 8 * torch.randn(5, 16, 16)
    torch.testing.assert_close(sinkhorn(S, 10, domain="scaling"), torch.as_tensor(
        dense.sinkhorn(S, 10)), atol=1e-5, rtol=0)


def test_empty_and_half_precision_inputs():
    assert sinkhorn(torch.randn(2, 0, 3), 3, domain="scaling").shape == (2, 0, 3)
    S = torch.randn(2, 5, 5, dtype=torch.bfloat16)
    P = sinkhorn(S, 3, domain="scaling")
    assert P.dtype == torch.bfloat16
    torch.testing.assert_close(P.float(), sinkhorn(S, 3).float(), atol=1e-2, rtol=0)


@pytest.mark.parametrize("kwargs, words", [
    (dict(domain="exp"), "domain must be one of"),
    (dict(n_iters=None, tol=1e-6, domain="scaling"), "tol=1e-06"),
    (dict(warm_start=torch.zeros(4), domain="scaling"), "warm_start=given"),
    (dict(return_result=True, domain="scaling"), "return_result=True"),
])
def test_refusals_are_named(kwargs, words):
    kwargs = {"n_iters": 3, **kwargs}
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        sinkhorn(torch.randn(2, 4, 4), **kwargs)


@pytest.mark.slow  # the default suite stays under 15 minutes on 2 cores
def test_compiled_fullgraph_equals_eager_with_and_without_the_log_domain():
    S, kwargs = _one_untrusted_matrix()  # the first matrix takes the log domain, the others do not

    def fn(s, mask, a):
        return sinkhorn(s, 5, mask=mask, row_marginals=a, domain="scaling")

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    for rows in (slice(None), slice(1, None)):
        scores = S[rows].clone().requires_grad_()
        args = (kwargs["mask"][rows], kwargs["row_marginals"][rows])
        eager, graph = fn(scores, *args), compiled(scores, *args)
        torch.testing.assert_close(graph, eager, atol=1e-6, rtol=0)
        w = torch.randn_like(eager)
        torch.testing.assert_close(_grad(graph, scores, w), _grad(eager, scores, w), atol=1e-5, rtol=0)
