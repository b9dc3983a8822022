"""Causal block sorting (Sparse Sinkhorn Attention §3.3) through the prefix Sinkhorn core, against the
definition by brute force: column p of the Sinkhorn balancing of the prefix (blocks and positions 0..p)."""

from __future__ import annotations

import pytest
import torch

from sinkformer.attention.sparse import sort_matrix
from sinkformer.sinkhorn import sinkhorn


def brute_force(logits, sort_iters, temperature, block_mask=None):
    """Every prefix balanced on its own, in one batched dense call (the O(N_B^3) definition)."""
    n = logits.shape[-1]
    x = logits / temperature
    keep = torch.ones(n, n, dtype=torch.bool).triu()
    if block_mask is not None:
        keep = keep & block_mask.unsqueeze(-1) & block_mask.unsqueeze(-2)
    idx = torch.arange(n)
    in_prefix = (idx[None, :] <= idx[:, None]).unsqueeze(-2)
    prefixes = sinkhorn(x.unsqueeze(-3).expand(*x.shape[:-2], n, n, n), 2 * sort_iters, mask=keep.unsqueeze(-3) & in_prefix)
    return prefixes.diagonal(dim1=-3, dim2=-1)


@pytest.mark.parametrize("sort_iters", [1, 2, 5])
@pytest.mark.parametrize("padded", [False, True])
def test_causal_sort_matrix_equals_the_prefix_definition(sort_iters, padded):
    g = torch.Generator().manual_seed(sort_iters)
    logits = torch.randn(2, 4, 11, 11, generator=g, dtype=torch.float64)
    block_mask = None
    if padded:
        block_mask = torch.ones(2, 4, 11, dtype=torch.bool)
        block_mask[1, :, -3:] = False  # the last blocks are padding
    got = sort_matrix(logits, sort_iters=sort_iters, temperature=0.75, causal=True, block_mask=block_mask)
    want = brute_force(logits, sort_iters, 0.75, block_mask)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert torch.equal(got.tril(-1), torch.zeros_like(got))  # block i only moves to positions p >= i


def test_causal_sort_matrix_has_no_gradient_from_later_positions():
    logits = torch.randn(1, 10, 10, dtype=torch.float64, requires_grad=True)
    S = sort_matrix(logits, sort_iters=5, causal=True)
    for p in range(9):  # column p (sorted block p) depends on SortNet rows (blocks) 0..p only
        (grad,) = torch.autograd.grad(S[..., p].sum(), logits, retain_graph=True)
        assert grad[:, p + 1 :].abs().max().item() == 0.0
