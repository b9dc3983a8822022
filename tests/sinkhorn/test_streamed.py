"""Chunked (streamed) Sinkhorn: equal to the reference, exact gradients, linear memory, building blocks."""

import math

import pytest
import torch

from sinkformer import attention, sinkhorn
from sinkformer.sinkhorn import sizes
from sinkformer.sinkhorn.streamed import streamed_potentials, streamed_softmax


def streamed_sinkhorn_attention(q, k, v, *, scale, n_iters, chunk_size=None):
    """The streamed engine through the public API."""
    return attention(q, k, v, scale=scale, n_iters=n_iters, chunk_size=chunk_size, backend="streamed")


def inputs(shape=(2, 3), n=13, m=11, d=4, dtype=torch.float64, spread=1.0):
    g = torch.Generator().manual_seed(3)
    q = spread * torch.randn(*shape, n, d, generator=g, dtype=dtype)
    k = spread * torch.randn(*shape, m, d, generator=g, dtype=dtype)
    v = torch.randn(*shape, m, 5, generator=g, dtype=dtype)
    return q, k, v


def reference(q, k, v, n_iters, scale, keep=None, tol=None):
    S = scale * q @ k.transpose(-1, -2)
    return sinkhorn(S, None if tol else n_iters, tol=tol, max_iters=100_000, mask=keep) @ v


def grads(fn, tensors, grad_out):
    leaves = [t.clone().requires_grad_() for t in tensors]
    return torch.autograd.grad(fn(*leaves), leaves, grad_out)


@pytest.mark.parametrize("n_iters", [1, 2, 3, 4, 5, 8, 21])
@pytest.mark.parametrize("chunk", [1, 4, 13])
def test_forward_and_exact_gradient(n_iters, chunk):
    q, k, v = inputs()
    grad_out = torch.randn(2, 3, 13, 5, dtype=torch.float64)
    fast = lambda q, k, v: streamed_sinkhorn_attention(q, k, v, scale=0.8, n_iters=n_iters, chunk_size=chunk)  # noqa: E731
    ref = lambda q, k, v: reference(q, k, v, n_iters, 0.8)  # noqa: E731
    torch.testing.assert_close(fast(q, k, v), ref(q, k, v), atol=1e-12, rtol=0)
    for a, b in zip(grads(fast, (q, k, v), grad_out), grads(ref, (q, k, v), grad_out)):
        assert (a - b).abs().max() <= 1e-6 * b.abs().max()


def test_masks_and_float32_agree_with_reference():
    q, k, v = inputs(dtype=torch.float32)
    keep = torch.rand(2, 3, 13, 11, generator=torch.Generator().manual_seed(4)) > 0.3
    keep[..., 2, :] = False
    keep[..., :, 0] = False
    out = attention(q, k, v, n_iters=5, attn_mask=keep, chunk_size=3)
    torch.testing.assert_close(out, reference(q, k, v, 5, 0.5, keep), atol=1e-5, rtol=0)
    pad = torch.zeros(2, 11, dtype=torch.bool)
    pad[1, -4:] = True
    out = attention(q, k, v, n_iters=6, key_padding_mask=pad, chunk_size=5)
    torch.testing.assert_close(out, reference(q, k, v, 6, 0.5, ~pad[:, None, None, :]), atol=1e-5, rtol=0)


def test_gradient_with_masks_float64():
    q, k, v = inputs(shape=(2,))
    keep = torch.rand(2, 13, 11, generator=torch.Generator().manual_seed(5)) > 0.25
    keep[:, 0] = False
    grad_out = torch.randn(2, 13, 5, dtype=torch.float64)
    fast = grads(lambda q, k, v: attention(q, k, v, n_iters=7, attn_mask=keep, chunk_size=4), (q, k, v), grad_out)
    ref = grads(lambda q, k, v: reference(q, k, v, 7, 0.5, keep), (q, k, v), grad_out)
    for a, b in zip(fast, ref):
        assert (a - b).abs().max() <= 1e-6 * b.abs().max()


def test_tolerance_mode():
    q, k, v = inputs(dtype=torch.float32)
    out = attention(q, k, v, n_iters=None, tol=1e-6, chunk_size=4)
    torch.testing.assert_close(out, reference(q, k, v, None, 0.5, tol=1e-6), atol=1e-5, rtol=0)


def test_extreme_scores_use_the_exact_per_term_backward():
    """Potentials moving by > 20 between updates (here in the log domain: scalings of such scores are not
    trusted): each term's plan is recomputed, the rank-L backward would lose entries below float32's range."""
    q, k, v = inputs(shape=(1,), n=8, m=8, d=3, spread=12.0)
    q, k = q.round(), k.round()
    S = q @ k.transpose(-1, -2)
    assert S.max() - S.min() > 500
    grad_out = torch.randn(1, 8, 5, dtype=torch.float64)
    fast = grads(lambda q, k, v: streamed_sinkhorn_attention(q, k, v, scale=1.0, n_iters=6, chunk_size=3),
                 (q, k, v), grad_out)
    ref = grads(lambda q, k, v: reference(q, k, v, 6, 1.0), (q, k, v), grad_out)
    for a, b in zip(fast, ref):
        assert torch.isfinite(a).all()
        assert (a - b).abs().max() <= 1e-6 * b.abs().max().clamp_min(1e-12)


def test_no_quadratic_tensor_is_saved():
    n, d = 256, 8
    q, k, v = (torch.randn(1, n, d, requires_grad=True) for _ in range(3))
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        streamed_sinkhorn_attention(q, k, v, scale=0.3, n_iters=5, chunk_size=16)
    assert max(sizes) <= n * d


def test_auto_selection_above_threshold(monkeypatch):
    monkeypatch.setattr(sizes, "STREAM_ABOVE", 50)
    q, k, v = inputs()
    assert attention.explain(q, k, v, n_iters=3).engine == "streamed"
    out = attention(q.requires_grad_(), k, v, n_iters=3)
    assert "streamed_forward" in type(out.grad_fn.next_functions[0][0]).__name__
    # what the streamed engine cannot serve stays on the tiled one
    assert attention.explain(q, k, v, n_iters=3, backward="implicit").engine == "tiled"
    assert attention.explain(q, k, v, n_iters=3, dropout_p=0.1).engine == "tiled"
    with pytest.raises(ValueError, match="dropout_p=0.1 is not served by engine 'streamed'"):
        attention(q, k, v, n_iters=3, dropout_p=0.1, chunk_size=4)
    with pytest.raises(ValueError, match="chunk_size must be an int >= 1, got 0"):
        attention(q, k, v, chunk_size=0)


def test_potentials_with_marginals_and_warm_start():
    q, k, _ = inputs(shape=(2,), n=9, m=7)
    a = torch.rand(2, 9, dtype=torch.float64) + 0.2
    b = torch.rand(2, 7, dtype=torch.float64) + 0.2
    b = b / b.sum(-1, keepdim=True) * a.sum(-1, keepdim=True)
    bias = torch.randn(2, 1, 7, dtype=torch.float64)
    f, g, done, converged = streamed_potentials(
        q, k, scale=0.6, tol=1e-12, max_iters=10_000, row_marginals=a, col_marginals=b, bias=bias, chunk_size=2
    )
    S = 0.6 * q @ k.transpose(-1, -2) + bias
    ref = sinkhorn(S, None, tol=1e-12, max_iters=10_000, row_marginals=a, col_marginals=b, return_result=True)
    assert converged and bool((done % 2 == 1).all())
    torch.testing.assert_close(torch.exp(S + f[..., None] + g[:, None]), ref.matrix, atol=1e-10, rtol=0)
    _, _, again, _ = streamed_potentials(
        q, k, scale=0.6, tol=1e-10, row_marginals=a, col_marginals=b, bias=bias, warm_start=g, chunk_size=2
    )
    assert bool((again == 1).all())
    # fixed counts follow the paper's convention, as the dense core
    f3, g3, _, _ = streamed_potentials(q, k, scale=0.6, n_iters=3, chunk_size=4)
    torch.testing.assert_close(torch.exp(0.6 * q @ k.transpose(-1, -2) + f3[..., None] + g3[:, None]),
                               sinkhorn(0.6 * q @ k.transpose(-1, -2), 3), atol=1e-12, rtol=0)


def test_streamed_softmax_with_key_bias():
    q, k, v = inputs(shape=(2,), n=10, m=6)
    bias = torch.randn(2, 1, 6, dtype=torch.float64)
    out = streamed_softmax(q, k, v, scale=0.9, bias=bias, chunk_size=3)
    ref = torch.softmax(0.9 * q @ k.transpose(-1, -2) + bias, -1) @ v
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)


@pytest.mark.slow
def test_long_sequence_runs_in_linear_memory():
    """n = 16,384 single head, 5 iterations, forward + backward, with the automatic chunking."""
    n, d = 16_384, 64
    q, k, v = (torch.randn(1, 1, n, d, requires_grad=True) for _ in range(3))
    out = attention(q, k, v, n_iters=5)
    out.square().mean().backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all() and torch.isfinite(v.grad).all()
    assert math.isfinite(out.sum().item())
