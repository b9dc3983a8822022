"""CacheBlocks: the views of every cache block of a tile, made by splits, equal plain indexing."""

import pytest
import torch

from sinkformer.sinkhorn.sizes import cache_blocks


@pytest.mark.parametrize("c, n, m, budget", [(3, 9, 9, 7), (3, 9, 9, 30), (5, 4, 6, 100), (2, 10, 3, 1),
                                             (4, 1024, 1024, 1 << 18), (1, 4096, 4096, 1 << 18), (2, 0, 5, 7)])
def test_views_cover_the_tile_in_block_order(c, n, m, budget):
    blocks = cache_blocks(c, n, m, budget)
    K = torch.arange(c * n * m, dtype=torch.float32).view(c, n, m)
    col = torch.arange(c * m, dtype=torch.float32).view(c, m)
    index = blocks.index
    rows, slices = blocks.rows_of(K), blocks.slices_of(col)
    assert len(rows) == len(slices) == len(index) or (n == 0 and len(index) == len(slices))
    covered = torch.zeros(c, n, m, dtype=torch.int64)
    for (s, r), view, column in zip(index, rows, slices):
        assert torch.equal(view, K[s, r]) and view.data_ptr() == K[s, r].data_ptr()  # views, not copies
        assert torch.equal(column, col[s])
        assert view.numel() <= max(budget, m) or r == slice(0, n)
        covered[s, r] += 1
    assert bool((covered == 1).all())
    assert blocks.largest(m) == max([view.numel() for view in rows], default=0) or n == 0  # the scratch a block needs


def test_small_slices_are_whole_blocks_large_ones_row_ranges():
    assert cache_blocks(32, 1024, 1024, 1 << 19).rows is None  # 2 budgets: one block per slice
    assert cache_blocks(32, 128, 128, 1 << 19).step == 32  # the 32 slices in one block
    plan = cache_blocks(1, 4096, 4096, 1 << 19)
    assert plan.rows == 128 and len(plan.index) == 32


@pytest.mark.parametrize("budget", [1 << 19, 7])  # whole slices per block; rows of one slice
@pytest.mark.parametrize("masked", [False, True])
def test_the_stored_tile_after_the_first_sweep_is_the_recomputed_one_bit_for_bit(budget, masked):
    from sinkformer.sinkhorn.problem import Problem
    from sinkformer.sinkhorn.scaling import Options, Tile

    g = torch.Generator().manual_seed(0)
    c, n, m = 3, 6, 5
    q, k = torch.randn(c, n, 4, generator=g), torch.randn(c, m, 4, generator=g)
    keep = torch.rand(c, n, m, generator=g) > 0.3 if masked else None
    if masked:
        keep[0, :, 2] = False  # a column without a valid entry
        keep[1, 3] = False  # a row without one
    options = Options("unrolled", 0.0, "scaling", c, block=budget)
    problem = Problem(q, k, None, keep, None, (c,), 0.5, 5)
    stored = Tile(problem, options, Tile.memory(problem, options, {}))
    a = torch.ones(c, n)
    stored.first_sweep(a, torch.zeros(c, n))
    tiles = torch.cat([K.reshape(-1) for _, K in stored.visit(0, {})])
    shifts = (stored.row_shift, stored.col_shift)
    fresh = Tile(problem, options, Tile.memory(problem, options, {}), shifts=shifts)
    assert torch.equal(tiles, torch.cat([K.reshape(-1).clone() for _, K in fresh.visit(0, {})]))
