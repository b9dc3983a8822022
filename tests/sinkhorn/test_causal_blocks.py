"""Causal Sinkhorn with 2 or 3 iterations in row blocks (sinkhorn/causal_blocks.py): the weights of
prefix_sinkhorn without an n x n matrix, in blocks of a few rows, with key padding."""

import pytest
import torch

import sinkformer
from sinkformer.sinkhorn import causal_blocks, prefix
from sinkformer.sinkhorn.causal_blocks import causal_block_attention
from sinkformer.sinkhorn.problem import Problem
from sinkformer.sinkhorn.prefix import prefix_sinkhorn



def blocks(q, k, v, keep, scale, n_iters):
    """The engine on flat ``(B, n, d)`` operands and a ``(B, n)`` key mask (True = kept), or ``None``."""
    mask = None if keep is None else keep.unsqueeze(-2)
    return causal_block_attention(Problem(q, k, v, mask, None, (q.shape[0],), scale, n_iters))


def reference(q, k, v, keep, scale, n_iters):
    mask = None if keep is None else keep.unsqueeze(-2)
    return prefix_sinkhorn(scale * q @ k.transpose(1, 2), n_iters, mask=mask) @ v


def inputs(B=3, n=13, d=5, e=4, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, n, x, generator=g, dtype=dtype).requires_grad_() for x in (d, d, e))
    keep = torch.rand(B, n, generator=g) > 0.3
    keep[0, :3] = False  # the first rows of slice 0 keep no key: output 0
    return q, k, v, keep


@pytest.mark.parametrize("n_iters", [2, 3])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("block_scores", [1, 3 * 37 * 20, 1 << 22])  # 16 rows per block (the least), 20, all 37
@pytest.mark.parametrize("row_by_row", [False, True])  # the running sums by products, or added row by row
def test_equals_prefix_sinkhorn_forward_and_gradients(monkeypatch, n_iters, padded, block_scores, row_by_row):
    monkeypatch.setattr(causal_blocks, "BLOCK_SCORES", block_scores)
    monkeypatch.setattr(prefix, "ROW_BY_ROW_FROM", 1 if row_by_row else 1 << 40)
    q, k, v, keep = inputs(n=37)
    keep = keep if padded else None
    out, inexact = blocks(q, k, v, keep, 0.6, n_iters)
    want = reference(q, k, v, keep, 0.6, n_iters)
    assert not inexact.any()
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-13)
    w = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad((out * w).sum(), (q, k, v))
    ref = torch.autograd.grad((want * w).sum(), (q, k, v))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("n_iters", [2, 3])
def test_first_and_second_derivatives_equal_finite_differences(monkeypatch, n_iters):
    monkeypatch.setattr(causal_blocks, "BLOCK_SCORES", 1)
    q, k, v, keep = inputs(B=2, n=20, d=3, e=2)
    fn = lambda q, k, v: blocks(q, k, v, keep, 0.8, n_iters)[0]  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v))
    assert torch.autograd.gradgradcheck(fn, (q, k, v))


def test_attention_uses_it_and_past_rows_never_see_the_future():
    """attention(is_causal=True, n_iters<=3, key padding) runs the blocks (no n x n matrix), and row t
    of the output is the same bit for bit whatever the tokens after t are."""
    q, k, v, keep = (t.detach().float() if t.is_floating_point() else t for t in inputs(B=2, n=300, d=8, e=8))
    calls = []
    original = causal_blocks._CausalBlocks.apply
    causal_blocks._CausalBlocks.apply = lambda *a: calls.append(1) or original(*a)
    try:
        pad = ~keep
        a = sinkformer.attention(q, k, v, is_causal=True, n_iters=3, key_padding_mask=pad)
        changed = [t.clone() for t in (q, k, v)]
        for t in changed:
            t[:, 200:] = torch.randn(t[:, 200:].shape)
        b = sinkformer.attention(*changed, is_causal=True, n_iters=3, key_padding_mask=pad)
    finally:
        causal_blocks._CausalBlocks.apply = original
    assert len(calls) == 2
    assert torch.equal(a[:, :200], b[:, :200])


def test_rows_whose_sums_underflow_come_from_the_log_domain():
    """Scores spread over ~1e3: some rows' column sums underflow float32; attention replaces those rows
    by the log domain's, and the result equals the float64 reference."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 24, 4, generator=g) for _ in range(3))
    q = 40 * q
    _, inexact = blocks(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), None, 1.0, 3)
    assert inexact.any() and not inexact.all()
    got = sinkformer.attention(q, k, v, is_causal=True, n_iters=3, scale=1.0)
    want = sinkformer.attention(q.double(), k.double(), v.double(), is_causal=True, n_iters=3, scale=1.0)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


def test_what_the_row_blocks_cannot_serve_is_refused_by_name():
    q, k, v, keep = inputs(B=2, n=8)
    with pytest.raises(ValueError, match="n_iters 2 or 3, got n_iters=4"):
        blocks(q, k, v, None, 1.0, 4)
    with pytest.raises(ValueError, match="no bias"):
        causal_block_attention(Problem(q, k, v, None, torch.zeros(2, 8, 8, dtype=q.dtype), (2,), 1.0, 3))
    with pytest.raises(ValueError, match=r"key padding mask only \(keep of shape \(\.\.\., 1, n\)\), got keep of shape"):
        causal_block_attention(Problem(q, k, v, torch.ones(2, 8, 8, dtype=torch.bool), None, (2,), 1.0, 3))


@pytest.mark.parametrize("n_iters", [2, 3])
@pytest.mark.parametrize("spread", [1.0, 40.0])  # 40: some rows' sums underflow float32
def test_the_minimum_shortcut_is_the_bool_tiles_bit_for_bit(monkeypatch, n_iters, spread):
    """Without padding a block adds 1 to its future entries and reads one minimum, taking the bool tiles
    of prefix.safe_sums only when a sum is small: the output, the rows flagged and the gradients are those
    of the bool tiles everywhere (forced here by pretending to capture a graph), bit for bit."""
    monkeypatch.setattr(causal_blocks, "BLOCK_SCORES", 1)  # blocks of 32 rows
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(4, 90, 6, generator=g) for _ in range(3))
    q = spread * q

    def run():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, inexact = blocks(*leaves, None, 1.0, n_iters)
        return (out, inexact) + torch.autograd.grad(out.square().sum(), leaves)

    fast = run()
    monkeypatch.setattr(causal_blocks, "capturing", lambda: True)
    tiles = run()
    assert bool(fast[1].any()) == (spread > 1)
    for a, b in zip(fast, tiles):
        assert torch.equal(a, b)


def test_an_empty_batch_gives_empty_outputs():
    q, k, v = (torch.randn(0, 40, 4) for _ in range(3))
    out, inexact = blocks(q, k, v, None, 1.0, 3)
    assert out.shape == (0, 40, 4) and inexact.shape == (0, 40)
