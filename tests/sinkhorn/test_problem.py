"""The one attention problem every engine receives (sinkhorn/problem.py: Problem): its fields cross each
custom op in one order, and its valid rows and columns, marginals and scores equal the definitions."""

import inspect

import pytest
import torch

from sinkformer.sinkhorn import flash, problem as problem_module, streamed, tiled
from sinkformer.sinkhorn.problem import Problem, marginals

FIELDS = ["q", "k", "v", "keep", "bias", "batch", "scale", "n_iters", "tol", "max_iters"]


def make(batch=(2, 3), n=7, m=5, mask="general", seed=0):
    g = torch.Generator().manual_seed(seed)
    B = 6
    q, k, v = (torch.randn(B, x, 4, generator=g, dtype=torch.float64) for x in (n, m, m))
    keep = bias = None
    if mask == "general":  # broadcast over the first batch dimension
        keep = torch.rand(1, 3, n, m, generator=g) > 0.4
        keep[0, 1, 2] = False  # a row without a kept entry
        keep[0, 2, :, 3] = False  # a column without one
        bias = torch.randn(2, 1, n, m, generator=g, dtype=torch.float64)
    elif mask == "keys":
        keep = torch.rand(2, 3, 1, m, generator=g) > 0.3
        keep[1, 2] = False  # a slice without any key
    elif mask == "queries":
        keep = torch.rand(2, 1, n, 1, generator=g) > 0.3
    return Problem(q, k, v, keep, bias, batch, 0.7, 5)


def expanded_keep(p: Problem) -> torch.Tensor:
    return p.keep.expand(p.batch + (p.n, p.m)).reshape(-1, p.n, p.m)


@pytest.mark.parametrize("mask", ["general", "keys", "queries"])
@pytest.mark.parametrize("block", [1, 5, 1 << 22])  # one row per block, a few, all rows at once
def test_valid_rows_and_columns_and_marginals_of_every_group(mask, block, monkeypatch):
    monkeypatch.setattr(problem_module, "_VALID_BLOCK", block)
    p = make(mask=mask)
    keep = expanded_keep(p)
    for start, end in [(0, 6), (0, 1), (2, 5), (5, 6)]:
        group = p.group(start, end)
        rows, cols = group.valid()
        assert torch.equal(rows, keep[start:end].any(-1)) and torch.equal(cols, keep[start:end].any(-2))
        a, b = group.marginals(group.q)
        want_a, want_b = marginals(keep[start:end].any(-1), keep[start:end].any(-2), (end - start, p.n, p.m), group.q)
        assert torch.equal(a, want_a) and torch.equal(b, want_b)
        assert torch.allclose(a.sum(-1), b.sum(-1))  # equal totals: a balanced problem


def test_without_a_mask_every_row_and_column_is_valid():
    p = make(mask=None)
    assert p.valid() == (None, None) and not p.masked
    a, b = p.marginals(p.q)
    assert torch.equal(a, torch.ones(6, 7, dtype=torch.float64)) and torch.allclose(b, torch.full((6, 5), 7 / 5,
                                                                                                   dtype=torch.float64))


def test_scores_of_a_group_and_of_a_row_range():
    p = make()
    bias = p.bias.expand(p.batch + (p.n, p.m)).reshape(-1, p.n, p.m)
    want = (p.scale * p.q @ p.k.transpose(1, 2) + bias).masked_fill(~expanded_keep(p), float("-inf"))
    group = p.group(2, 5)
    torch.testing.assert_close(group.scores(), want[2:5], rtol=1e-15, atol=1e-15)
    out = torch.empty(3, 3, p.m, dtype=torch.float64)
    got = group.scores((1, 4), out=out)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(got, want[2:5, 1:4], rtol=1e-15, atol=1e-15)


def test_fields_rebuild_the_same_problem_and_the_schedule_sets_the_saved_iterates():
    p = make()
    again = Problem(*p.fields())
    assert [f for f in again.fields() if not isinstance(f, torch.Tensor)] == [[2, 3], 0.7, 5, None, 1000]
    assert all(a is b for a, b in zip(again.fields()[:5], p.fields()[:5]))
    assert p.history_length() == (3, 3) and p.history_length(implicit=True) == (1, 1)
    assert Problem(p.q, p.k, p.v, None, None, (6,), 1.0, 4).history_length() == (2, 3)
    assert Problem(p.q, p.k, p.v, None, None, (6,), 1.0, None, tol=1e-6).history_length() is None


@pytest.mark.parametrize("module", [tiled, streamed, flash])
def test_every_engine_op_takes_the_problem_first_then_its_own_arguments(module):
    """The forward op's inputs begin with the problem's fields, the backward op's after (grad_out, out)."""
    forward = list(inspect.signature(module._forward_op._init_fn).parameters)
    assert forward[:len(FIELDS)] == FIELDS
    backward = [a.name for a in module._backward_op._opoverload._schema.arguments]
    assert backward[:2] == ["grad_out", "out"] and backward[2:2 + len(FIELDS)] == FIELDS
