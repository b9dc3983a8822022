"""The tiled engine (the default Sinkhorn path): equal to the reference, exact gradients, implicit
gradients, O(n) saved memory, the log domain for extreme scores, dropout."""

import math

import pytest
import torch

from sinkformer import attention, sinkhorn
from sinkformer.sinkhorn import sizes


def sinkhorn_attention(q, k, v, *, keep=None, group_elements=None, **kw):
    """The tiled engine through the public API; ``group_elements``: the CPU tile size (scores)."""
    old = sizes.TILE_ELEMENTS
    sizes.TILE_ELEMENTS = group_elements or old
    try:
        return attention(q, k, v, attn_mask=keep, backend="tiled", **kw)
    finally:
        sizes.TILE_ELEMENTS = old


def saved_numels(fn):
    """Sizes of every tensor autograd keeps for the backward of ``fn()``."""
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sizes


def reference(q, k, v, n_iters, keep=None, bias=None, scale=None, tol=None):
    """Unrolled log-domain Sinkhorn (the foundation core) followed by P @ v, through autograd."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    S = scale * q @ k.transpose(-1, -2)
    if bias is not None:
        S = S + bias
    return sinkhorn(S, None if tol else n_iters, tol=tol, max_iters=100_000, mask=keep) @ v


def inputs(shape=(2, 3), n=9, m=None, d=5, dtype=torch.float64, spread=1.0):
    m = n if m is None else m
    g = torch.Generator().manual_seed(1)
    q = spread * torch.randn(*shape, n, d, generator=g, dtype=dtype)
    k = spread * torch.randn(*shape, m, d, generator=g, dtype=dtype)
    v = torch.randn(*shape, m, 4, generator=g, dtype=dtype)
    return q, k, v


def masks(shape=(2, 3), n=9, m=None):
    m = n if m is None else m
    keep = torch.rand(*shape, n, m, generator=torch.Generator().manual_seed(2)) > 0.3
    keep[..., 0, :] = False  # a query with no key
    keep[..., :, 1] = False  # a key nobody sees
    return keep


@pytest.mark.parametrize("n_iters", [2, 3, 5, 8, 21])
@pytest.mark.parametrize("masked", [False, True])
def test_forward_equals_reference_float32(n_iters, masked):
    q, k, v = (t.float() for t in inputs(n=12, m=10))
    keep = masks(n=12, m=10) if masked else None
    out = attention(q, k, v, n_iters=n_iters, attn_mask=keep)
    torch.testing.assert_close(out, reference(q, k, v, n_iters, keep), atol=1e-5, rtol=0)


@pytest.mark.parametrize("n_iters", [2, 3, 5, 8])
@pytest.mark.parametrize("masked", [False, True])
def test_gradient_is_exact_gradient_of_the_unrolled_map(n_iters, masked):
    q, k, v = inputs(n=8, m=11)
    keep = masks(n=8, m=11) if masked else None
    bias = torch.randn(8, 11, dtype=torch.float64)
    grad_out = torch.randn(2, 3, 8, 4, dtype=torch.float64)

    def grads(fn):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        return torch.autograd.grad(fn(*leaves), leaves, grad_out)

    fast = grads(lambda q, k, v: attention(q, k, v, n_iters=n_iters, attn_mask=keep if masked else bias))
    ref = grads(lambda q, k, v: reference(q, k, v, n_iters, keep if masked else None, None if masked else bias))
    for a, b in zip(fast, ref):
        assert (a - b).abs().max() <= 1e-6 * b.abs().max()


def test_gradcheck_fast_path():
    q, k, v = (t.requires_grad_() for t in inputs(shape=(2,), n=5, m=4, d=3))
    assert torch.autograd.gradcheck(lambda q, k, v: sinkhorn_attention(q, k, v, scale=0.7, n_iters=5), (q, k, v))
    keep = masks(shape=(2,), n=5, m=4)
    assert torch.autograd.gradcheck(
        lambda q, k, v: sinkhorn_attention(q, k, v, scale=0.7, n_iters=4, keep=keep), (q, k, v)
    )


def test_implicit_gradient_equals_autograd_through_converged_iterations():
    q, k, v = inputs(n=10, m=10)
    grad_out = torch.randn(2, 3, 10, 4, dtype=torch.float64)

    def grads(fn):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        return torch.autograd.grad(fn(*leaves), leaves, grad_out)

    implicit = grads(lambda q, k, v: attention(q, k, v, n_iters=None, tol=1e-13, backward="implicit"))
    unrolled = grads(lambda q, k, v: reference(q, k, v, 401))
    for a, b in zip(implicit, unrolled):
        torch.testing.assert_close(a, b, atol=1e-8 * b.abs().max().item(), rtol=0)
    # and it differs from the exact gradient of a short unrolled map
    short = grads(lambda q, k, v: attention(q, k, v, n_iters=3))
    assert (short[0] - implicit[0]).abs().max() > 1e-4


def test_implicit_gradient_with_padding():
    q, k, v = inputs(shape=(2,), n=7)
    pad = torch.tensor([[False] * 5 + [True] * 2, [False] * 7])
    grad_out = torch.randn(2, 7, 4, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attention(*leaves, n_iters=None, tol=1e-13, key_padding_mask=pad, query_padding_mask=pad, backward="implicit")
    got = torch.autograd.grad(out, leaves, grad_out)
    keep = ~pad[:, None, :] & ~pad[:, :, None]
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(reference(*leaves, 601, keep), leaves, grad_out)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-8 * b.abs().max().item(), rtol=0)


def test_tolerance_mode_matches_reference():
    q, k, v = (t.float() for t in inputs(n=16))
    out = attention(q, k, v, n_iters=None, tol=1e-6)
    torch.testing.assert_close(out, reference(q, k, v, None, tol=1e-6), atol=1e-5, rtol=0)


def test_group_boundaries_and_broadcast_masks():
    """Many small groups (one slice each) and a per-(batch, head) mask give the same result."""
    q, k, v = inputs(shape=(3, 2), n=6, m=7)
    keep = masks(shape=(3, 2), n=6, m=7)
    one = sinkhorn_attention(q, k, v, scale=0.5, n_iters=5, keep=keep, group_elements=1)
    many = sinkhorn_attention(q, k, v, scale=0.5, n_iters=5, keep=keep, group_elements=10**9)
    torch.testing.assert_close(one, many, atol=1e-12, rtol=0)
    torch.testing.assert_close(one, reference(q, k, v, 5, keep, scale=0.5), atol=1e-12, rtol=0)
    pad = torch.zeros(3, 7, dtype=torch.bool)
    pad[0, -3:] = True  # (B, m) padding broadcast over heads and queries
    out = attention(q, k, v, n_iters=5, key_padding_mask=pad)
    torch.testing.assert_close(out, reference(q, k, v, 5, ~pad[:, None, None, :]), atol=1e-12, rtol=0)


def test_l2_cost_gradients_flow_through_the_key_term():
    q, k, v = inputs(shape=(1,), n=6, d=3)
    grad_out = torch.randn(1, 6, 4, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    got = torch.autograd.grad(attention(*leaves, n_iters=3, cost="l2", scale=1.0), leaves, grad_out)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    S = -torch.cdist(leaves[0], leaves[1]).square() / 2
    want = torch.autograd.grad(sinkhorn(S, 3) @ leaves[2], leaves, grad_out)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)


def test_extreme_scores_fall_back_and_stay_exact():
    q, k, v = inputs(shape=(2,), n=10, d=4, spread=60.0)  # score range ~1e4
    q, k = q.round(), k.round()  # integer scores: computed exactly in float32 by every code path
    S = q @ k.transpose(-1, -2)
    assert S.max() - S.min() > 5e3
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    out = attention(*leaves, n_iters=5, scale=1.0)
    assert torch.isfinite(out).all()
    ref = reference(*(t.float() for t in (q, k, v)), 5, scale=1.0)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in leaves)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_computed_in_float32(dtype):
    q, k, v = (t.to(dtype).requires_grad_() for t in inputs(n=16, d=8, dtype=torch.float32))
    out = attention(q, k, v, n_iters=5)
    assert out.dtype == dtype and torch.isfinite(out).all()
    out.float().sum().backward()
    assert q.grad.dtype == dtype and torch.isfinite(q.grad).all()
    ref = reference(q.detach().float(), k.detach().float(), v.detach().float(), 5)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=0)


def test_forward_saves_no_quadratic_tensor(monkeypatch):
    """Above :data:`~sinkformer.sinkhorn.sizes.SAVED_TILE_SCORES` scores per call, everything kept for the
    backward is O(n) per slice beyond q, k, v and the output; below, also the tiles (one (B, n, m) tensor)."""
    B, n, d = 4, 64, 8
    q, k, v = (torch.randn(B, n, d, requires_grad=True) for _ in range(3))
    small = saved_numels(lambda: attention(q, k, v, n_iters=21))
    monkeypatch.setattr(sizes, "SAVED_TILE_SCORES", B * n * n - 1)
    saved = saved_numels(lambda: attention(q, k, v, n_iters=21))
    assert max(saved) <= B * n * max(d, 11)  # q, k, v, out, 11 scalings of each side; nothing of size n * n
    assert sum(saved) - 4 * B * n * d <= B * (n * (21 + 3) + 8)  # beyond q, k, v, out: O(n * n_iters) per slice
    assert sorted(x for x in small if x) == sorted([x for x in saved if x] + [B * n * n])  # and the tile


@pytest.mark.parametrize("n_iters", [2, 5])
@pytest.mark.parametrize("masked", [False, True])
def test_kept_tiles_give_the_gradient_of_recomputed_ones(monkeypatch, n_iters, masked):
    q, k, v = (t.float() for t in inputs(n=12, m=10))
    keep = masks(n=12, m=10) if masked else None
    grad_out = torch.randn(2, 3, 12, 4)

    def grads():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        return torch.autograd.grad(attention(*leaves, n_iters=n_iters, attn_mask=keep), leaves, grad_out)

    kept = grads()
    monkeypatch.setattr(sizes, "SAVED_TILE_SCORES", 0)
    for a, b in zip(kept, grads()):
        torch.testing.assert_close(a, b, atol=1e-6 * b.abs().max().item(), rtol=0)


def test_tiled_engine_is_the_default():
    q, k, v = inputs()
    assert attention.explain(q, k, v).engine == "tiled"
    out = attention(q.requires_grad_(), k, v)
    assert "tiled_forward" in type(out.grad_fn.next_functions[0][0]).__name__


def test_implicit_requires_the_tiled_engine():
    q, k, v = inputs()
    with pytest.raises(ValueError, match="(?s)no engine can serve this call.*tiled: return_weights=True.*"
                                         "dense: backward='implicit' is not served by engine 'dense'; engines 'flash' and 'tiled'"):
        attention(q, k, v, backward="implicit", return_weights=True)
    with pytest.raises(ValueError, match="backward must be one of"):
        attention(q, k, v, backward="adjoint")


def dropout_masks(seed, shape, group, p):
    """The masks the fast path draws: one per group of slices, from a seed of the global generator."""
    torch.manual_seed(seed)
    base = int(torch.randint(0, 2**62, (1,)).item())
    B = shape[0]
    masks = []
    for start in range(0, B, group):
        gen = torch.Generator().manual_seed(base + start)
        uniforms = torch.rand((min(B, start + group) - start,) + shape[1:], generator=gen, dtype=torch.float64)
        masks.append((uniforms >= p).double().div_(1 - p))
    return torch.cat(masks)


@pytest.mark.parametrize("backward", ["unrolled", "implicit"])
def test_dropout_in_the_fast_path_forward_and_gradient(backward):
    q, k, v = inputs(shape=(4,), n=7, m=6)
    grad_out = torch.randn(4, 7, 4, dtype=torch.float64)
    n_iters = 5 if backward == "unrolled" else None
    tol = None if backward == "unrolled" else 1e-13
    kw = dict(scale=0.5, n_iters=n_iters, tol=tol, backward=backward, dropout_p=0.3, group_elements=2 * 7 * 6,
              max_iters=10_000)
    torch.manual_seed(11)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = sinkhorn_attention(*leaves, **kw)
    got = torch.autograd.grad(out, leaves, grad_out)
    drop = dropout_masks(11, (4, 7, 6), group=2, p=0.3)
    assert 0.1 < (drop == 0).double().mean() < 0.5
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    S = 0.5 * leaves[0] @ leaves[1].transpose(-1, -2)
    P = sinkhorn(S, n_iters if n_iters else 401)
    ref = (P * drop) @ leaves[2]
    want = torch.autograd.grad(ref, leaves, grad_out)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-8 * b.abs().max().item(), rtol=0)


def test_dropout_is_unbiased_and_seeded():
    q, k, v = inputs(shape=(1,), n=6)
    torch.manual_seed(3)
    a = attention(q, k, v, dropout_p=0.4)
    torch.manual_seed(3)
    b = attention(q, k, v, dropout_p=0.4)
    assert torch.equal(a, b)
    mean = torch.stack([attention(q, k, v, dropout_p=0.4) for _ in range(2000)]).mean(0)
    assert (mean - attention(q, k, v)).abs().max() < 0.05


@pytest.mark.parametrize("product", ["batched", "per-slice", "row-vector"])
@pytest.mark.parametrize("block", [None, 7], ids=["whole-slices", "row-blocks"])
def test_every_shape_of_the_matrix_vector_products_gives_the_reference(monkeypatch, product, block):
    """``sizes.ROW_VECTOR_PRODUCTS`` (chosen by CPU vendor) and ``sizes.MATVEC_LOOP_SLICES`` change only how
    ``K x`` is multiplied: each way, with several slices per block or rows of one, masked or not, unrolled
    and implicit gradients equal the reference's."""
    monkeypatch.setattr(sizes, "ROW_VECTOR_PRODUCTS", product == "row-vector")
    monkeypatch.setattr(sizes, "MATVEC_LOOP_SLICES", 1 << 30 if product == "per-slice" else 0)
    if block is not None:
        monkeypatch.setattr(sizes, "CACHE_BLOCK_ELEMENTS", block)
    q, k, v = inputs(n=8, m=11)
    keep = masks(n=8, m=11)
    grad_out = torch.randn(2, 3, 8, 4, dtype=torch.float64)

    def grads(fn):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        return (out, *torch.autograd.grad(out, leaves, grad_out))

    for mask in (None, keep):
        got = grads(lambda q, k, v: attention(q, k, v, n_iters=5, attn_mask=mask, backend="tiled"))
        want = grads(lambda q, k, v: reference(q, k, v, 5, mask))
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=1e-9 * b.abs().max().item(), rtol=0)
    implicit = grads(lambda q, k, v: attention(q, k, v, n_iters=None, tol=1e-13, backward="implicit"))
    unrolled = grads(lambda q, k, v: reference(q, k, v, 401))
    for a, b in zip(implicit, unrolled):
        torch.testing.assert_close(a, b, atol=1e-8 * b.abs().max().item(), rtol=0)


def test_the_backward_fills_no_gradient_of_the_kept_tiles():
    """The forward keeps a small call's ``(B, n, m)`` tiles for the backward (an output of its op that gets
    no gradient): autograd must not materialise a zero gradient of that shape for them (a memset of the
    whole tile on every backward)."""
    q, k, v = (torch.randn(2, 3, 40, 8, requires_grad=True) for _ in range(3))
    out = attention(q, k, v, n_iters=5, backend="tiled")
    with torch.profiler.profile(record_shapes=True) as prof:
        out.sum().backward()
    tile_shaped = [e.name for e in prof.events() if [6, 40, 40] in [list(s) for s in e.input_shapes if s]]
    assert tile_shaped and not {"aten::fill_", "aten::zero_", "aten::zeros", "aten::zeros_like"} & set(tile_shaped)


def test_the_gradient_pass_forms_ds_in_scratch_memory_kept_for_the_next_call():
    """``dS`` of the backward's last pass is written into a worker's scratch buffer, which the next call
    uses again (memory not faulted in and zeroed by the kernel on every call), and the gradients do not
    depend on what that buffer, or any other the scratch holds (the native passes' ``u ⊙ dO`` and
    ``ṽ ⊙ V``), held."""
    from sinkformer.sinkhorn import cpu_parallel

    cpu_parallel.release_scratch()
    q, k, v = (torch.randn(2, 3, 40, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))

    def grads():
        return torch.autograd.grad(attention(q, k, v, n_iters=5, backend="tiled").square().sum(), (q, k, v))

    first = grads()
    held = [s["dS"] for s in cpu_parallel._kept if "dS" in s]
    assert len(held) == 1 and held[0].numel() >= 6 * 40 * 40
    for scratch in cpu_parallel._kept:  # what the last call left there
        for buffer in scratch.values():
            if isinstance(buffer, torch.Tensor):
                buffer.fill_(float("nan"))
    second = grads()
    assert [s["dS"].data_ptr() for s in cpu_parallel._kept if "dS" in s] == [held[0].data_ptr()]
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    cpu_parallel.release_scratch()


@pytest.mark.parametrize("backend", ["tiled", "streamed"])
def test_the_eager_backward_skips_the_backward_op_with_the_same_gradients(monkeypatch, backend):
    """Eagerly the engines' autograd calls their backward's function, not the custom op (whose Python
    dispatch costs tens of microseconds a call); the gradients are those of the op's path, bit for bit."""
    from sinkformer.sinkhorn import ops

    q, k, v = (torch.randn(2, 3, 40, 8, requires_grad=True) for _ in range(3))
    mask = torch.rand(40, 40) > 0.2

    def run():
        with torch.profiler.profile() as prof:
            grads = torch.autograd.grad(attention(q, k, v, n_iters=5, attn_mask=mask, backend=backend).square().sum(),
                                        (q, k, v))
        return grads, {e.name for e in prof.events()}

    eager, eager_ops = run()
    monkeypatch.setattr(ops, "runs_eagerly", lambda t: False)
    through_ops, op_names = run()
    assert f"sinkformer::{backend}_backward" in op_names and f"sinkformer::{backend}_forward" in op_names
    assert not {f"sinkformer::{backend}_backward", f"sinkformer::{backend}_forward"} & eager_ops
    for a, b in zip(eager, through_ops):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_the_dropout_mask_keeps_each_entry_with_probability_one_minus_p_and_is_seeded(dtype):
    """Entries are 0 or 1 / (1 - p) in the mask's dtype; the kept fraction of 2^20 entries is within 6 standard
    deviations of 1 - p (uniforms drawn in at least float32, so bfloat16 does not coarsen p); the same seed and
    group start give the same mask (the backward draws it again), another start another mask."""
    from sinkformer.sinkhorn.scaling import dropout_mask

    p, like, seed = 0.1, torch.empty(0, dtype=dtype), torch.tensor([12345])
    mask = dropout_mask((4, 512, 512), like, p, seed, start=8)
    assert mask.dtype == dtype and mask.shape == (4, 512, 512)
    scaled = torch.ones((), dtype=dtype).div_(1 - p)
    assert set(mask.unique().tolist()) == {0.0, scaled.item()}
    kept = (mask != 0).double().mean().item()
    assert abs(kept - (1 - p)) < 6 * (p * (1 - p) / mask.numel()) ** 0.5
    assert torch.equal(mask, dropout_mask((4, 512, 512), like, p, seed, start=8))
    assert not torch.equal(mask, dropout_mask((4, 512, 512), like, p, seed, start=12))
    assert dropout_mask((4, 512, 512), like, 0.0, seed, start=8) is None
