"""Sparse Sinkhorn Attention's options, written and checked once (SparseOptions) for the function, the module and
the models."""

import inspect

import pytest
import torch

from sinkformer.attention.sparse import SparseOptions, sort_matrix, sparse_sinkhorn_attention
from sinkformer.models.sinkhorn_transformer import AttentionConfig
from sinkformer.nn import SparseSinkhornAttention


@pytest.mark.parametrize("options, error", [
    (dict(block_size=0), "block_size must be an int >= 1, got 0"),
    (dict(block_size=4, sort_iters=-1), "sort_iters must be an int >= 0, got -1"),
    (dict(block_size=4, temperature=0.0), "temperature must be a positive float, got 0.0"),
    (dict(block_size=4, sortcut_budget=0), "sortcut_budget must be an int >= 1, got 0"),
    (dict(block_size=4, sortcut_budget=2, causal=True), "SortCut is an encoder-only scheme"),
])
def test_each_entry_point_refuses_an_option_with_the_same_error(options, error):
    with pytest.raises(ValueError, match=error):
        SparseOptions(**options)
    with pytest.raises(ValueError, match=error):
        SparseSinkhornAttention(8, 2, max_len=16, **options)
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match=error):
        sparse_sinkhorn_attention(q, q, q, torch.randn(1, 2, 2, 2), **options)


def test_the_defaults_are_written_once():
    defaults = {name: field.default for name, field in SparseOptions.__dataclass_fields__.items()
                if name != "block_size"}
    for function in (sparse_sinkhorn_attention, SparseSinkhornAttention.__init__):
        params = inspect.signature(function).parameters
        assert {name: params[name].default for name in defaults} == defaults, function
    params = inspect.signature(sort_matrix).parameters
    assert (params["sort_iters"].default, params["temperature"].default) == (defaults["sort_iters"],
                                                                           defaults["temperature"])
    config = AttentionConfig()
    assert (config.sort_iters, config.temperature) == (defaults["sort_iters"], defaults["temperature"])


def test_the_module_reads_and_passes_its_options():
    module = SparseSinkhornAttention(8, 2, block_size=4, max_len=16, sort_iters=3, temperature=0.5, mixture=True)
    assert module.options == SparseOptions(4, 3, 0.5, False, None, True)
    assert (module.block_size, module.sort_iters, module.temperature, module.mixture) == (4, 3, 0.5, True)
    assert "sort_iters=3" in repr(module) and "mixture" in repr(module)
    torch.manual_seed(0)
    x = torch.randn(2, 12, 8)
    module.eval()
    out, S = module(x, return_sort=True)
    assert out.shape == x.shape and S.shape == (2, 2, 3, 3)
    # 3 iterations end on a column normalisation: every position (column) of S sums to 1
    torch.testing.assert_close(S.sum(-2), torch.ones(2, 2, 3), atol=1e-5, rtol=0)
