"""Baselines of the Sparse Sinkhorn experiments: local attention and the Sparse Transformer fixed pattern."""

import pytest
import torch

from sinkformer.attention import attention
from sinkformer.attention.sparse_baselines import (
    BaselineSelfAttention,
    fixed_pattern_mask,
    local_attention,
    sparse_transformer_attention,
)


def qkv(n=20, dtype=torch.float64):
    return tuple(torch.randn(2, 2, n, 8, dtype=dtype) for _ in range(3))


@pytest.mark.parametrize("causal", [False, True])
def test_local_attention_is_dense_attention_with_a_block_diagonal_mask(causal):
    q, k, v = qkv(n=22)  # blocks of 4: the last one has 2 tokens
    block = torch.arange(22) // 4
    mask = block[:, None] == block[None, :]
    if causal:
        mask &= torch.ones(22, 22, dtype=torch.bool).tril()
    expected = attention(q, k, v, normalization="softmax", attn_mask=mask)
    torch.testing.assert_close(local_attention(q, k, v, block_size=4, causal=causal), expected)


def test_local_attention_respects_key_padding():
    q, k, v = qkv(n=8)
    pad = torch.tensor([[False] * 6 + [True] * 2, [False] * 8])
    out = local_attention(q, k, v, block_size=4, key_padding_mask=pad)
    block = torch.arange(8) // 4
    expected = attention(q, k, v, normalization="softmax", attn_mask=block[:, None] == block[None, :], key_padding_mask=pad)
    torch.testing.assert_close(out, expected)


def test_fixed_pattern_is_child_et_al_local_plus_summary_columns():
    mask = fixed_pattern_mask(8, block_size=4, stride=1)
    expected = torch.tensor(
        [
            [1, 1, 1, 1, 0, 0, 0, 1],
            [1, 1, 1, 1, 0, 0, 0, 1],
            [1, 1, 1, 1, 0, 0, 0, 1],
            [1, 1, 1, 1, 0, 0, 0, 1],
            [0, 0, 0, 1, 1, 1, 1, 1],
            [0, 0, 0, 1, 1, 1, 1, 1],
            [0, 0, 0, 1, 1, 1, 1, 1],
            [0, 0, 0, 1, 1, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)
    assert torch.equal(fixed_pattern_mask(8, block_size=4, stride=1, causal=True), expected.tril())
    assert torch.equal(fixed_pattern_mask(8, block_size=4, stride=2)[0], torch.tensor([1, 1, 1, 1, 0, 0, 1, 1], dtype=torch.bool))


def test_sparse_transformer_attention_uses_the_fixed_mask():
    q, k, v = qkv(n=16)
    mask = fixed_pattern_mask(16, block_size=8, stride=2, causal=True)
    torch.testing.assert_close(
        sparse_transformer_attention(q, k, v, block_size=8, stride=2, causal=True),
        attention(q, k, v, normalization="softmax", attn_mask=mask),
    )


@pytest.mark.parametrize("pattern", ["full", "local", "fixed"])
def test_causal_baselines_do_not_leak(pattern):
    m = BaselineSelfAttention(8, 2, pattern=pattern, block_size=4, stride=2, causal=True).double()
    x = torch.randn(1, 13, 8, dtype=torch.float64, requires_grad=True)
    for t in (0, 5, 11):
        (grad,) = torch.autograd.grad(m(x)[:, t].sum(), x)
        assert torch.all(grad[:, t + 1 :] == 0)


def test_baseline_errors():
    with pytest.raises(ValueError, match="pattern must be one of"):
        BaselineSelfAttention(8, 2, pattern="strided")
    with pytest.raises(ValueError, match="stride .* must be <= block_size=4, got 5"):
        fixed_pattern_mask(8, block_size=4, stride=5)
