"""The fused block attention of Sparse Sinkhorn Attention (float32, PyTorch's fused kernel): outputs and
gradients equal the literal definition computed in float64, with padding, shared heads and no balancing."""

import math

import pytest
import torch

from sinkformer.attention.sparse import sort_matrix, sparse_sinkhorn_attention


def _literal(q, k, v, S, b, causal=False, valid=None):
    """Queries of block p attend, in one SoftMax, to sorted block p then block p (``valid``: True = real key)."""
    n, d = q.shape[-2], q.shape[-1]
    valid = torch.ones(n, dtype=torch.bool) if valid is None else valid
    k, v = k * valid[..., None], v * valid[..., None]
    blocks = range(n // b)
    out = []
    for p in blocks:
        sl = slice(p * b, (p + 1) * b)
        ks = sum(S[..., i, p, None, None] * k[..., i * b: (i + 1) * b, :] for i in blocks)
        vs = sum(S[..., i, p, None, None] * v[..., i * b: (i + 1) * b, :] for i in blocks)
        sorted_valid = sum(S[..., i, p, None] * valid[..., i * b: (i + 1) * b].to(S.dtype) for i in blocks) > 0
        keep = torch.cat([sorted_valid.unsqueeze(-2).expand(*S.shape[:-2], b, b),
                          valid[..., sl].unsqueeze(-2).expand(*S.shape[:-2], b, b)], -1)
        if causal:
            tri = torch.ones(b, b, dtype=torch.bool).tril()
            keep = keep & torch.cat([tri, tri], -1)
        scores = torch.cat([q[..., sl, :] @ ks.transpose(-1, -2), q[..., sl, :] @ k[..., sl, :].transpose(-1, -2)], -1)
        weights = torch.softmax((scores / math.sqrt(d)).masked_fill(~keep, float("-inf")), -1)
        weights = weights.nan_to_num()  # a query with no valid key reads nothing
        out.append(weights[..., :b] @ vs + weights[..., b:] @ v[..., sl, :])
    return torch.cat(out, -2)


def _grads(fn, tensors):
    tensors = [t.detach().requires_grad_() for t in tensors]
    out = fn(*tensors)
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)
    return (out, *torch.autograd.grad((out * weights).sum(), tensors))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shared_heads", [False, True])
def test_float32_outputs_and_gradients_equal_the_float64_definition(causal, shared_heads):
    gen = torch.Generator().manual_seed(0)
    kv_heads = 1 if shared_heads else 3
    q = torch.randn(2, 3, 32, 8, generator=gen)
    k, v = (torch.randn(2, kv_heads, 32, 8, generator=gen) for _ in range(2))
    R = torch.randn(2, 3, 4, 4, generator=gen)

    def ours(q, k, v, R):
        return sparse_sinkhorn_attention(q, k, v, R, block_size=8, causal=causal)

    def reference(q, k, v, R):
        return _literal(q, k, v, sort_matrix(R, causal=causal), 8, causal)

    got = _grads(ours, (q, k, v, R))
    expected = _grads(reference, [t.double() for t in (q, k, v, R)])
    for a, b in zip(got, expected):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a.double(), b, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("causal", [False, True])
def test_float32_padding_equals_the_float64_definition(causal):
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, 24, 8, generator=gen) for _ in range(3))
    R = torch.randn(2, 2, 6, 6, generator=gen)
    pad = torch.zeros(2, 24, dtype=torch.bool)
    pad[0, 5:9] = True  # a whole block of padding and a part of another
    pad[1, 20:] = True

    def ours(q, k, v, R):
        return sparse_sinkhorn_attention(q, k, v, R, block_size=4, causal=causal, key_padding_mask=pad)

    def reference(q, k, v, R):
        valid = ~pad[:, None, :]
        blocks = valid.unflatten(-1, (6, 4)).any(-1)
        return _literal(q, k, v, sort_matrix(R, causal=causal, block_mask=blocks), 4, causal, valid)

    got = _grads(ours, (q, k, v, R))
    expected = _grads(reference, [t.double() for t in (q, k, v, R)])
    for a, b in zip(got, expected):
        torch.testing.assert_close(a.double(), b, atol=2e-5, rtol=1e-4)


def test_no_balancing_with_huge_sorted_keys_keeps_finite_gradients():
    """``sort_iters=0``: S = e^{R/τ} (up to e^30) makes sorted keys ~1e11; the backward stays finite."""
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 32, 8, generator=gen, requires_grad=True) for _ in range(3))
    R = (40 * torch.randn(1, 2, 4, 4, generator=gen)).requires_grad_()
    for options in (dict(), dict(causal=True), dict(sortcut_budget=2)):
        out = sparse_sinkhorn_attention(q, k, v, R, block_size=8, sort_iters=0, **options)
        grads = torch.autograd.grad(out.sum(), (q, k, v, R))
        assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("blocks_batch", [(2, 3), (2, 1), ()])
def test_sorted_and_own_blocks_equal_the_product_and_concatenation(blocks_batch):
    """``[sum_i S_ip X_i, X_p]`` written in one buffer: values and gradients (gradcheck, broadcasting)."""
    from sinkformer.attention.sparse import _SortedAndOwn

    gen = torch.Generator().manual_seed(3)
    mix = torch.rand(2, 3, 4, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    blocks = torch.randn(*blocks_batch, 4, 2, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    out = _SortedAndOwn.apply(mix, blocks)
    sorted_blocks = torch.einsum("...pi,...ibd->...pbd", mix, blocks)
    torch.testing.assert_close(out, torch.cat([sorted_blocks, blocks.expand_as(sorted_blocks)], -2))
    assert torch.autograd.gradcheck(_SortedAndOwn.apply, (mix, blocks))
