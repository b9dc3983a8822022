"""Sparse Sinkhorn Attention: balancing, sorting, causal leakage, SortCut, mixture, padding, errors."""

import math

import pytest
import torch
from scipy.optimize import linear_sum_assignment

import sinkformer
from sinkformer import sinkhorn
from sinkformer.attention import attention
from sinkformer.attention.sparse import (
    SORT_NETS,
    SortNet,
    SparseSinkhornAttention,
    block_pool,
    gumbel_noise,
    sort_matrix,
    sparse_sinkhorn_attention,
)


def qkv(b=2, h=2, n=32, d=8, dtype=torch.float64, requires_grad=False):
    return tuple(torch.randn(b, h, n, d, dtype=dtype, requires_grad=requires_grad) for _ in range(3))


# --- balancing -----------------------------------------------------------------------------


def test_module_lives_in_nn_and_old_paths_resolve():
    from sinkformer.attention import SparseSinkhornAttention as old
    from sinkformer.attention.sparse import SortNet
    from sinkformer.attention.sparse_baselines import BaselineSelfAttention

    assert sinkformer.nn.SparseSinkhornAttention is SparseSinkhornAttention is old
    assert sinkformer.attention.SparseSinkhornAttention is SparseSinkhornAttention
    assert SortNet is sinkformer.nn.SortNet and BaselineSelfAttention is sinkformer.nn.BaselineSelfAttention
    assert sinkformer.attention.sparse_sinkhorn_attention is sparse_sinkhorn_attention


def test_sort_iterations_are_the_papers_fc_of_fr_in_exp_domain():
    R = torch.randn(3, 6, 6, dtype=torch.float64)
    S = torch.exp(R / 0.5)
    for _ in range(4):  # S^k = F_c(F_r(S^{k-1}))
        S = S / S.sum(-1, keepdim=True)
        S = S / S.sum(-2, keepdim=True)
    torch.testing.assert_close(sort_matrix(R, sort_iters=4, temperature=0.5), S)
    torch.testing.assert_close(sort_matrix(R, sort_iters=0, temperature=0.5), torch.exp(R / 0.5))
    assert torch.isfinite(sort_matrix(1e4 * R.float(), sort_iters=0)).all()  # no overflow without balancing


def test_balanced_block_matrix_is_doubly_stochastic():
    R = 3 * torch.randn(4, 8, 8, dtype=torch.float64)
    S = sort_matrix(R, sort_iters=5)
    torch.testing.assert_close(S.sum(-2), torch.ones(4, 8, dtype=torch.float64))  # columns exact
    S = sort_matrix(R, sort_iters=200)
    assert (S >= 0).all()
    torch.testing.assert_close(S.sum(-1), torch.ones(4, 8, dtype=torch.float64), atol=1e-8, rtol=0)
    torch.testing.assert_close(S.sum(-2), torch.ones(4, 8, dtype=torch.float64), atol=1e-12, rtol=0)


def test_padding_blocks_leave_the_balancing():
    R = torch.randn(2, 5, 5, dtype=torch.float64)
    mask = torch.tensor([[True] * 5, [True, True, True, False, False]])
    S = sort_matrix(R, sort_iters=100, block_mask=mask)
    assert torch.all(S[1, 3:] == 0) and torch.all(S[1, :, 3:] == 0)
    torch.testing.assert_close(S[1, :3, :3], sort_matrix(R[1, :3, :3], sort_iters=100))
    torch.testing.assert_close(S[1, :3, :3].sum(-1), torch.ones(3, dtype=torch.float64), atol=1e-8, rtol=0)


def test_low_temperature_and_many_iterations_approach_the_optimal_permutation():
    gen = torch.Generator().manual_seed(3)
    hidden = torch.eye(6, dtype=torch.float64)[torch.randperm(6, generator=gen)]
    R = hidden + 0.3 * torch.randn(6, 6, generator=gen, dtype=torch.float64)  # a clear best assignment
    rows, cols = linear_sum_assignment(R.numpy(), maximize=True)
    P = torch.zeros(6, 6, dtype=torch.float64)
    P[rows, cols] = 1.0
    distances = [(sort_matrix(R, sort_iters=2000, temperature=tau) - P).abs().max().item() for tau in (1.0, 0.3, 0.1, 0.03)]
    assert all(a > b for a, b in zip(distances, distances[1:])), distances
    assert distances[-1] < 5e-3
    assert distances[0] > 0.3  # at tau = 1 the matrix is far from any permutation


def test_gumbel_noise_is_standard_gumbel_and_seeded():
    g = gumbel_noise((200_000,), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert abs(g.mean().item() - 0.5772156649) < 0.01  # Euler-Mascheroni
    assert abs(g.var().item() - math.pi**2 / 6) < 0.03
    a = gumbel_noise((5,), generator=torch.Generator().manual_seed(1))
    b = gumbel_noise((5,), generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b)
    u = torch.rand(5, generator=torch.Generator().manual_seed(1)).clamp(torch.finfo().tiny, 1 - 1e-7)
    assert torch.equal(a, -torch.log(-torch.log(u)))  # -log(-log U) of the same draws, to the last bit


def test_gumbel_noise_in_training_only():
    m = SparseSinkhornAttention(16, 2, block_size=4, max_len=16)
    x = torch.randn(1, 16, 16)
    m.train()
    assert not torch.equal(m(x), m(x))
    m.eval()
    torch.testing.assert_close(m(x), m(x), atol=0, rtol=0)


# --- causal ----------------------------------------------------------------------------------


def test_causal_sort_matrix_masks_earlier_positions_and_balances_each_prefix():
    R = torch.randn(2, 6, 6, dtype=torch.float64)
    S = sort_matrix(R, sort_iters=3, temperature=0.7, causal=True)
    assert torch.all(S.tril(-1) == 0)  # block i is never moved to a position p < i (eq. 6)
    torch.testing.assert_close(S.sum(-2), torch.ones(2, 6, dtype=torch.float64))
    for p in range(6):
        prefix = sinkhorn(R[:, : p + 1, : p + 1] / 0.7, 6, mask=torch.ones(p + 1, p + 1, dtype=torch.bool).triu())
        torch.testing.assert_close(S[:, : p + 1, p], prefix[:, :, p])


def test_balancing_the_whole_masked_matrix_would_leak_the_future():
    """Why the prefixes: with the literal masked balancing, position 1 depends on block 3's scores."""
    R = torch.randn(5, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, dtype=torch.float64)
    whole = sinkhorn(R, 6, mask=torch.ones(5, 5, dtype=torch.bool).triu())
    (grad,) = torch.autograd.grad((whole[:, 1] * w).sum(), R)
    assert grad[2:].abs().max() > 1e-4
    (grad,) = torch.autograd.grad((sort_matrix(R, sort_iters=3, temperature=1.0, causal=True)[:, 1] * w).sum(), R)
    assert torch.all(grad[2:] == 0)


@pytest.mark.parametrize(
    "options",
    [dict(), dict(mixture=True), dict(sort_net="relu_linear_relu_linear", sort_iters=10), dict(sort_iters=0)],
)
def test_causal_leakage_is_exactly_zero(options):
    torch.manual_seed(0)
    m = SparseSinkhornAttention(12, 2, block_size=4, max_len=32, causal=True, **options).double().train()
    n = 23  # not a multiple of the block size
    x = torch.randn(2, n, 12, dtype=torch.float64, requires_grad=True)
    for t in range(n):
        torch.manual_seed(1)  # the same Gumbel noise for each pass
        (grad,) = torch.autograd.grad(m(x)[:, t].sum(), x)
        assert torch.all(grad[:, t + 1 :] == 0), f"output {t} depends on a later input"
        assert grad[:, t].abs().sum() > 0


# --- the attention itself ----------------------------------------------------------------------


def _reference(q, k, v, S, b, causal=False):
    """Literal loop: queries of block p attend, in one SoftMax, to sorted block p then block p."""
    n, d = q.shape[-2], q.shape[-1]
    out = torch.zeros_like(q)
    for p in range(n // b):
        sl = slice(p * b, (p + 1) * b)
        ks = sum(S[..., i, p, None, None] * k[..., i * b : (i + 1) * b, :] for i in range(n // b))
        vs = sum(S[..., i, p, None, None] * v[..., i * b : (i + 1) * b, :] for i in range(n // b))
        scores = torch.cat([q[..., sl, :] @ ks.transpose(-1, -2), q[..., sl, :] @ k[..., sl, :].transpose(-1, -2)], -1)
        if causal:
            tri = torch.ones(b, b, dtype=torch.bool).tril()
            scores = scores.masked_fill(~torch.cat([tri, tri], -1), float("-inf"))
        out[..., sl, :] = torch.softmax(scores / math.sqrt(d), -1) @ torch.cat([vs, v[..., sl, :]], -2)
    return out


@pytest.mark.parametrize("causal", [False, True])
def test_attention_matches_the_literal_definition(causal):
    q, k, v = qkv(n=24)
    R = torch.randn(2, 2, 6, 6, dtype=torch.float64)
    out, S = sparse_sinkhorn_attention(q, k, v, R, block_size=4, causal=causal, return_sort=True)
    torch.testing.assert_close(S, sort_matrix(R, causal=causal))
    torch.testing.assert_close(out, _reference(q, k, v, S, 4, causal))


def test_a_hard_permutation_makes_queries_attend_to_the_chosen_block():
    """With S a permutation and values equal per block, block p reads its own block and block σ(p)."""
    q, k, v = qkv(b=1, h=1, n=16)
    k = torch.zeros_like(k)  # uniform attention over the 2b keys
    v = torch.arange(4, dtype=torch.float64).repeat_interleave(4)[None, None, :, None].expand(1, 1, 16, 8)
    perm = [2, 0, 3, 1]  # position p receives block perm[p]
    R = torch.full((1, 1, 4, 4), -1e4, dtype=torch.float64)
    for p, i in enumerate(perm):
        R[0, 0, i, p] = 0.0
    out = sparse_sinkhorn_attention(q, k, v, R, block_size=4, temperature=1.0)
    expected = torch.tensor([(p + i) / 2 for p, i in enumerate(perm)], dtype=torch.float64).repeat_interleave(4)
    torch.testing.assert_close(out[0, 0, :, 0], expected)


def test_sortcut_attends_to_the_first_sorted_blocks_only():
    q, k, v = qkv(n=32)
    R = torch.randn(2, 2, 8, 8, dtype=torch.float64)
    out = sparse_sinkhorn_attention(q, k, v, R, block_size=4, sortcut_budget=2)
    S = sort_matrix(R)
    kb, vb = k.unflatten(-2, (8, 4)), v.unflatten(-2, (8, 4))
    ks = torch.einsum("...ip,...isd->...psd", S[..., :2], kb).flatten(-3, -2)
    vs = torch.einsum("...ip,...isd->...psd", S[..., :2], vb).flatten(-3, -2)
    torch.testing.assert_close(out, torch.softmax(q @ ks.transpose(-1, -2) / math.sqrt(8), -1) @ vs)
    everything = sparse_sinkhorn_attention(q, k, v, R, block_size=4, sortcut_budget=100)
    assert everything.shape == out.shape and torch.isfinite(everything).all()


def _saved_bytes(fn):
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total


def test_sortcut_memory_grows_linearly_and_vanilla_quadratically():
    """Bytes kept for the backward pass when the length doubles (512 -> 1024, blocks of 32)."""
    ratios = {}
    for name in ("sortcut", "sinkhorn", "vanilla"):
        sizes = []
        for n in (512, 1024):
            q, k, v = qkv(b=1, h=1, n=n, d=16, dtype=torch.float32, requires_grad=True)
            R = torch.randn(1, 1, n // 32, n // 32, requires_grad=True)
            fn = {
                "sortcut": lambda: sparse_sinkhorn_attention(q, k, v, R, block_size=32, sortcut_budget=2),
                "sinkhorn": lambda: sparse_sinkhorn_attention(q, k, v, R, block_size=32),
                "vanilla": lambda: attention(q, k, v, normalization="softmax", return_weights=True),
            }[name]
            sizes.append(_saved_bytes(fn))
        ratios[name] = sizes[1] / sizes[0]
    assert ratios["sortcut"] < 2.3 and ratios["sinkhorn"] < 2.3, ratios
    assert ratios["vanilla"] > 3.5, ratios


def test_mixture_adds_vanilla_attention():
    q, k, v = qkv()
    R = torch.randn(2, 2, 4, 4, dtype=torch.float64)
    for causal in (False, True):
        sparse = sparse_sinkhorn_attention(q, k, v, R, block_size=8, causal=causal)
        mixed = sparse_sinkhorn_attention(q, k, v, R, block_size=8, causal=causal, mixture=True)
        torch.testing.assert_close(mixed - sparse, attention(q, k, v, normalization="softmax", is_causal=causal))


# --- padding -----------------------------------------------------------------------------------


@pytest.mark.parametrize("options", [dict(), dict(causal=True), dict(sortcut_budget=2), dict(mixture=True)])
def test_length_not_divisible_equals_explicit_padding(options):
    q, k, v = qkv(n=21)
    R = torch.randn(2, 2, 6, 6, dtype=torch.float64)
    out = sparse_sinkhorn_attention(q, k, v, R, block_size=4, **options)
    garbage = [torch.cat([t, 100 * torch.randn(2, 2, 3, 8, dtype=torch.float64)], -2) for t in (q, k, v)]
    pad = torch.tensor([False] * 21 + [True] * 3).expand(2, 24)
    padded = sparse_sinkhorn_attention(*garbage, R, block_size=4, key_padding_mask=pad, **options)
    assert out.shape == (2, 2, 21, 8)
    torch.testing.assert_close(out, padded[..., :21, :])


def test_padded_tokens_have_no_influence_and_padded_blocks_no_nan():
    m = SparseSinkhornAttention(8, 2, block_size=4, max_len=32).double().eval()
    x = torch.randn(2, 30, 8, dtype=torch.float64, requires_grad=True)
    pad = torch.zeros(2, 30, dtype=torch.bool)
    pad[1, 9:] = True  # sequence 1: 9 tokens, 5 blocks of pure padding
    out, S = m(x, pad, return_sort=True)
    assert torch.isfinite(out).all()
    assert torch.all(S[1, :, 3:] == 0) and torch.all(S[1, :, :, 3:] == 0)
    (grad,) = torch.autograd.grad(out[1, :9].sum(), x)
    assert torch.all(grad[1, 9:] == 0) and torch.all(grad[0] == 0)


# --- sort nets, options, dtypes, errors ------------------------------------------------------------


@pytest.mark.parametrize("kind", SORT_NETS)
def test_sort_net_variants(kind):
    net = SortNet(6, max_blocks=5, heads=3, kind=kind, hidden=4)
    assert len(net.weights) == kind.count("linear")
    pooled = torch.randn(2, 4, 6)
    logits = net(pooled)
    assert logits.shape == (2, 3, 4, 5)
    if kind.startswith("relu"):
        assert (logits >= 0).all()
    if kind == "linear":
        torch.testing.assert_close(logits, pooled.unsqueeze(1) @ net.weights[0] + net.biases[0])
    with torch.no_grad():  # one network per head: changing head 0 leaves head 1 alone
        net.weights[-1][0].add_(1.0)
    torch.testing.assert_close(net(pooled)[:, 1:], logits[:, 1:])
    assert not torch.allclose(net(pooled)[:, 0], logits[:, 0])


@pytest.mark.parametrize("kind", SORT_NETS)
def test_sort_net_equals_its_layers_per_head_and_leading_columns(kind):
    """Each head's network applied to every block as written (broadcast products, float64), and
    ``columns`` the leading columns of the whole output, gradients included."""
    net = SortNet(6, max_blocks=5, heads=3, kind=kind, hidden=4).double()
    pooled = torch.randn(2, 4, 6, dtype=torch.float64, requires_grad=True)
    x, layer = pooled.unsqueeze(-3), 0
    for op in reversed(kind.split("_")):
        x = torch.relu(x) if op == "relu" else x @ net.weights[layer] + net.biases[layer]
        layer += op == "linear"
    torch.testing.assert_close(net(pooled), x, rtol=1e-13, atol=1e-13)
    for columns in (4, 5, 1, 0):
        got = net(pooled, columns=columns)
        torch.testing.assert_close(got, x[..., :columns], rtol=1e-13, atol=1e-13)
        w = torch.randn(got.shape, dtype=torch.float64)
        grads = torch.autograd.grad((got * w).sum(), [pooled, *net.parameters()], allow_unused=True)
        want = torch.autograd.grad((x[..., :columns] * w).sum(), [pooled, *net.parameters()], retain_graph=True,
                                   allow_unused=True)
        for g, h in zip(grads, want):
            torch.testing.assert_close(g, h, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=r"columns must be in \[0, max_blocks=5\], got 6"):
        net(pooled, columns=6)


def test_block_pooling_sums_and_causal_cumulative_sums():
    x = torch.arange(10.0).reshape(1, 10, 1)
    torch.testing.assert_close(block_pool(x, 4)[0, :, 0], torch.tensor([6.0, 22.0, 17.0]))
    torch.testing.assert_close(block_pool(x, 4, causal=True)[0, :, 0], torch.tensor([0.0, 10.0, 36.0]))
    # the causal pooling keeps its N_B rows only, not the (n, d) cumulative sum that the sort net's
    # first product would otherwise save for the backward (16 MiB of a 16k-token layer)
    for n in (64, 61):  # a whole number of blocks, and a last block with padding
        wide = torch.randn(2, n, 8, dtype=torch.float64, requires_grad=True)
        pooled = block_pool(wide, 16, causal=True)
        assert pooled.untyped_storage().nbytes() == pooled.numel() * pooled.element_size()
        torch.testing.assert_close(pooled, wide.cumsum(1)[:, ::16], rtol=1e-14, atol=1e-14)
        w = torch.randn(pooled.shape, dtype=torch.float64)
        (got,) = torch.autograd.grad((pooled * w).sum(), wide)
        (want,) = torch.autograd.grad((wide.cumsum(1)[:, ::16] * w).sum(), wide)
        torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-14)


def test_shared_keys_and_values():
    m = SparseSinkhornAttention(8, 2, block_size=4, max_len=16, share_kv=True)
    assert m.v_proj is None and "v_proj" not in dict(m.named_parameters())
    assert m(torch.randn(1, 16, 8)).shape == (1, 16, 8)


def test_shorter_inputs_use_the_leading_sort_logits():
    m = SparseSinkhornAttention(8, 2, block_size=4, max_len=64).eval()
    x = torch.randn(1, 10, 8)
    _, S = m(x, return_sort=True)
    logits = m.sort_net(block_pool(x, 4))[..., :3]
    torch.testing.assert_close(S, sort_matrix(logits, temperature=0.75))


def test_bfloat16_gives_finite_bfloat16_output():
    q, k, v = qkv(dtype=torch.bfloat16)
    out = sparse_sinkhorn_attention(q, k, v, torch.randn(2, 2, 4, 4, dtype=torch.bfloat16), block_size=8)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


def test_errors_name_the_argument():
    q, k, v = qkv(n=16)
    R = torch.randn(2, 2, 4, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="sort_logits must have shape"):
        sparse_sinkhorn_attention(q, k, v, R[..., :3, :3], block_size=4)
    with pytest.raises(ValueError, match="SortCut is an encoder-only"):
        sparse_sinkhorn_attention(q, k, v, R, block_size=4, causal=True, sortcut_budget=2)
    with pytest.raises(ValueError, match="block_size must be an int >= 1, got 0"):
        sparse_sinkhorn_attention(q, k, v, R, block_size=0)
    with pytest.raises(ValueError, match="temperature must be a positive float"):
        sort_matrix(R, temperature=0.0)
    with pytest.raises(ValueError, match="sort_net must be one of"):
        SparseSinkhornAttention(8, 2, block_size=4, max_len=16, sort_net="mlp")
    m = SparseSinkhornAttention(8, 2, block_size=4, max_len=16)
    with pytest.raises(ValueError, match="max_len=16"):
        m(torch.randn(1, 17, 8))
    with pytest.raises(ValueError, match="key_padding_mask must have shape"):
        m(torch.randn(1, 8, 8), torch.zeros(1, 9, dtype=torch.bool))


@pytest.mark.parametrize("causal,sortcut_budget", [(True, None), (False, None), (False, 2)])
def test_sorting_weights_below_the_normal_range_are_mixed_as_zeros(causal, sortcut_budget, monkeypatch):
    """Sorting weights cast to float32 can fall below its normal range (spread logits here: the causal
    sorting, the plain one, and the SortCut positions); they enter the key and value mixing as zeros
    (subnormal products run in microcode on many x86 CPUs: hundreds of times slower), which changes
    the output and the gradients, the logits' included, by less than float32's rounding, and the
    sorted blocks' validity not at all."""
    from sinkformer.attention import sparse

    g = torch.Generator().manual_seed(0)
    nb, b = 6, 4
    q, k, v = (torch.randn(1, 2, nb * b, 8, generator=g, requires_grad=True) for _ in range(3))
    logits = (60 * torch.randn(1, 2, nb, nb, generator=g)).requires_grad_()
    pad = torch.zeros(1, nb * b, dtype=torch.bool)
    pad[0, -3:] = True
    S = sort_matrix(logits.detach(), sort_iters=3, temperature=1.0, causal=causal)
    used = (S if sortcut_budget is None else S[..., :sortcut_budget]).float()  # the weights that are mixed
    subnormal = lambda t: (t != 0) & (t.abs() < torch.finfo(torch.float32).tiny)  # noqa: E731
    assert subnormal(used).sum() >= 2  # the case this test is about
    mixed = []
    flush = sparse.without_subnormals
    monkeypatch.setattr(sparse, "without_subnormals", lambda t: mixed.append(flush(t)) or mixed[-1])
    weights = torch.randn(1, 2, nb * b, 8, generator=g)

    def run():
        out = sparse_sinkhorn_attention(q, k, v, logits, block_size=b, sort_iters=3, causal=causal,
                                        sortcut_budget=sortcut_budget, key_padding_mask=pad)
        return (out,) + torch.autograd.grad((out * weights).sum(), (q, k, v, logits))

    got = run()
    assert len(mixed) == 1 and mixed[0].shape[-2:] == used.transpose(-1, -2).shape[-2:]
    assert not subnormal(mixed[0]).any()
    monkeypatch.setattr(sparse, "without_subnormals", lambda t: t)  # the subnormal weights kept
    want = run()
    for a, w in zip(got, want):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, w, rtol=1e-6, atol=1e-30)


def test_without_subnormals_keeps_half_precision_weights():
    """Half-precision weights keep their own subnormals (their products run in float32, where those
    are normal); float32 and float64 lose only what lies below float32's, or their own, normal range."""
    from sinkformer.attention.sparse import without_subnormals

    half = torch.tensor([1e-6, 1e-3, 0.5], dtype=torch.float16)  # 1e-6 is subnormal in float16
    assert torch.equal(without_subnormals(half), half)
    single = torch.tensor([1e-39, 1e-30, 0.5], dtype=torch.float32)
    assert without_subnormals(single).tolist() == [0.0, single[1].item(), 0.5]
    double = torch.tensor([1e-310, 1e-39, 0.5], dtype=torch.float64)
    assert without_subnormals(double).tolist() == [0.0, 1e-39, 0.5]
