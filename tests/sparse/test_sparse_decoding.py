"""Decoding with causal Sparse Sinkhorn Attention: :meth:`SparseSinkhornAttention.step` against the full forward."""

import itertools

import pytest
import torch

from sinkformer.nn import SparseSinkhornAttention, SparseSinkhornCache


def layer(**kw):
    torch.manual_seed(0)
    options = dict(block_size=3, max_len=16, causal=True)
    options.update(kw)
    return SparseSinkhornAttention(16, 2, **options).double().eval()


@pytest.mark.parametrize("block_size, mixture, share_kv, sort_iters",
                         list(itertools.product([1, 2, 3], [False, True], [False, True], [0, 2, 5])))
def test_token_by_token_equals_the_full_forward(block_size, mixture, share_kv, sort_iters):
    """Every row of the full forward, at every length (blocks begun, blocks half full), float64; without
    balancing (sort_iters=0: sorted keys up to e^30 times the keys) to relative rounding."""
    attn = layer(block_size=block_size, mixture=mixture, share_kv=share_kv, sort_iters=sort_iters)
    x = torch.randn(3, 11, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(block_size))
    with torch.no_grad():
        full = attn(x)
        cache = SparseSinkhornCache()
        steps = torch.cat([attn.step(x[:, t : t + 1], cache) for t in range(11)], 1)
    assert len(cache) == 11
    torch.testing.assert_close(steps, full, rtol=0, atol=1e-12 * max(1.0, full.abs().max().item()))


def test_several_tokens_per_step_and_the_prompt_at_once():
    attn = layer(block_size=4)
    x = torch.randn(2, 13, 16, dtype=torch.float64)
    with torch.no_grad():
        cache = SparseSinkhornCache()
        steps = torch.cat([attn.step(x[:, :6], cache), attn.step(x[:, 6:7], cache), attn.step(x[:, 7:], cache)], 1)
        torch.testing.assert_close(steps, attn(x), rtol=0, atol=1e-12)


def test_a_step_reads_no_later_token_and_its_sorting_column_is_computed_once_per_block(monkeypatch):
    """The outputs so far do not change when later tokens are stepped; sort_matrix runs when a block begins."""
    import sinkformer.nn.sparse as module

    calls = []
    original = module.sort_matrix
    monkeypatch.setattr(module, "sort_matrix", lambda *a, **k: calls.append(1) or original(*a, **k))
    attn = layer(block_size=3)
    x = torch.randn(1, 10, 16, dtype=torch.float64)
    with torch.no_grad():
        cache = SparseSinkhornCache()
        first = attn.step(x[:, :5], cache)
        attn.step(x[:, 5:], cache)
        again = attn.step(torch.randn(1, 2, 16, dtype=torch.float64), SparseSinkhornCache())
    assert len(calls) == 4 + 1  # blocks 0-3 of the 10 tokens, block 0 of the fresh cache
    torch.testing.assert_close(first, attn(x[:, :5]), rtol=0, atol=1e-12)
    assert again.shape == (1, 2, 16)


def test_refusals_are_named():
    with pytest.raises(ValueError, match="causal=False"):
        layer(causal=False).step(torch.randn(1, 1, 16, dtype=torch.float64), SparseSinkhornCache())
    with pytest.raises(RuntimeError, match="eval mode"):
        layer().train().step(torch.randn(1, 1, 16, dtype=torch.float64), SparseSinkhornCache())
    attn, cache = layer(max_len=4), SparseSinkhornCache()
    with torch.no_grad():
        attn.step(torch.randn(1, 3, 16, dtype=torch.float64), cache)
        with pytest.raises(ValueError, match=r"3 \+ m <= max_len=4"):
            attn.step(torch.randn(1, 2, 16, dtype=torch.float64), cache)
        with pytest.raises(ValueError, match="embed_dim=16"):
            attn.step(torch.randn(1, 1, 8, dtype=torch.float64), cache)
