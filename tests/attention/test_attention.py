"""sinkformer.attention: agreement with SDPA, Proposition 1, masks, weights, variants, errors."""

import math

import pytest
import torch
import torch.nn.functional as F

import sinkformer
from sinkformer import attention, sinkhorn


def qkv(b=2, h=3, n=6, m=None, d=8, dtype=torch.float32, requires_grad=False):
    m = n if m is None else m
    q = torch.randn(b, h, n, d, dtype=dtype, requires_grad=requires_grad)
    k = torch.randn(b, h, m, d, dtype=dtype, requires_grad=requires_grad)
    v = torch.randn(b, h, m, d, dtype=dtype, requires_grad=requires_grad)
    return q, k, v


def test_package_attribute_is_callable_and_a_package():
    q, k, v = qkv()
    assert torch.equal(sinkformer.attention(q, k, v), sinkformer.attention.attention(q, k, v))


@pytest.mark.parametrize("normalization, n_iters", [("sinkhorn", 1), ("softmax", 5)])
def test_one_iteration_and_softmax_equal_sdpa(normalization, n_iters):
    q, k, v = qkv()
    ref = F.scaled_dot_product_attention(q, k, v)
    out = attention(q, k, v, normalization=normalization, n_iters=n_iters)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)


@pytest.mark.parametrize("normalization", ["softmax", "sinkhorn"])
def test_masks_match_sdpa_with_one_iteration(normalization):
    q, k, v = qkv(n=5, m=7)
    bool_mask = torch.rand(5, 7) > 0.3
    bool_mask[:, 0] = True
    float_mask = torch.randn(2, 1, 5, 7)
    for mask in (bool_mask, float_mask):
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out = attention(q, k, v, normalization=normalization, n_iters=1, attn_mask=mask)
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(attention(q, k, v, normalization=normalization, n_iters=1, is_causal=True), ref)


def test_weights_are_doubly_stochastic_with_many_iterations():
    q, k, v = qkv(dtype=torch.float64)
    out, W = attention(q, k, v, n_iters=None, tol=1e-10, return_weights=True)
    torch.testing.assert_close(W.sum(-1), torch.ones(2, 3, 6, dtype=torch.float64), atol=1e-9, rtol=0)
    torch.testing.assert_close(W.sum(-2), torch.ones(2, 3, 6, dtype=torch.float64), atol=1e-9, rtol=0)
    torch.testing.assert_close(out, W @ v)


def test_cross_attention_columns_sum_to_nq_over_nk():
    q, k, v = qkv(n=4, m=10, dtype=torch.float64)
    out, W = attention(q, k, v, n_iters=None, tol=1e-10, return_weights=True)
    assert out.shape == (2, 3, 4, 8) and W.shape == (2, 3, 4, 10)
    torch.testing.assert_close(W.sum(-2), torch.full((2, 3, 10), 0.4, dtype=torch.float64), atol=1e-9, rtol=0)


def test_l2_cost_equals_dot_cost_for_sinkhorn_proposition1():
    q, k, v = qkv(dtype=torch.float64)
    kw = dict(n_iters=None, tol=1e-11)
    torch.testing.assert_close(attention(q, k, v, cost="l2", **kw), attention(q, k, v, cost="dot", **kw), atol=1e-9, rtol=0)
    # but not for SoftMax: the key norm term survives a row normalisation
    diff = attention(q, k, v, normalization="softmax", cost="l2") - attention(q, k, v, normalization="softmax")
    assert diff.abs().max() > 1e-2


def test_l2_cost_definition():
    q, k, v = qkv(b=1, h=1, n=4, d=3, dtype=torch.float64)
    _, W = attention(q, k, v, normalization="softmax", cost="l2", scale=0.7, return_weights=True)
    S = -0.7 * torch.cdist(q, k).square() / 2
    torch.testing.assert_close(W, torch.softmax(S, -1))
    out = attention(q, k, v, normalization="softmax", cost="l2", scale=0.7)  # SDPA route
    torch.testing.assert_close(out, torch.softmax(S, -1) @ v)


def test_padding_masks_exclude_queries_and_keys_from_both_normalisations():
    q, k, v = qkv(b=2, h=2, n=7, dtype=torch.float64)
    pad = torch.tensor([[False] * 5 + [True] * 2, [False] * 7])
    out, W = attention(
        q, k, v, n_iters=None, tol=1e-10, key_padding_mask=pad, query_padding_mask=pad, return_weights=True
    )
    sub_out, sub_W = attention(q[:1, :, :5], k[:1, :, :5], v[:1, :, :5], n_iters=None, tol=1e-10, return_weights=True)
    torch.testing.assert_close(W[:1, :, :5, :5], sub_W, atol=1e-9, rtol=0)
    torch.testing.assert_close(out[:1, :, :5], sub_out, atol=1e-9, rtol=0)
    assert torch.all(out[0, :, 5:] == 0) and torch.all(W[0, :, :, 5:] == 0)
    torch.testing.assert_close(W[1].sum(-2), torch.ones(2, 7, dtype=torch.float64), atol=1e-9, rtol=0)


def test_fully_masked_query_gives_zeros_not_nan():
    q, k, v = qkv(n=4, m=6)
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[1] = False
    for normalization in ("softmax", "sinkhorn", "linear", "sigmoid", "relu"):
        out = attention(q, k, v, normalization=normalization, attn_mask=mask)
        assert torch.isfinite(out).all() and torch.all(out[..., 1, :] == 0), normalization
    float_mask = torch.zeros(4, 6).masked_fill(~mask, float("-inf"))
    out = attention(q, k, v, attn_mask=float_mask)
    assert torch.isfinite(out).all() and torch.all(out[..., 1, :] == 0)


def test_bool_and_float_masks_agree():
    q, k, v = qkv()
    mask = torch.rand(6, 6) > 0.4
    mask.fill_diagonal_(True)
    float_mask = torch.zeros(6, 6).masked_fill(~mask, float("-inf"))
    torch.testing.assert_close(attention(q, k, v, attn_mask=mask), attention(q, k, v, attn_mask=float_mask))


@pytest.mark.parametrize("name, sigma", [("linear", lambda s: s), ("sigmoid", torch.sigmoid), ("relu", torch.relu)])
def test_unnormalised_variants_integrate_against_the_key_measure(name, sigma):
    q, k, v = qkv(b=1, h=1, n=5, m=4, dtype=torch.float64)
    out, W = attention(q, k, v, normalization=name, scale=1.0, return_weights=True)
    torch.testing.assert_close(W, sigma(q @ k.transpose(-1, -2)) / 4)
    torch.testing.assert_close(out, W @ v)
    pad = torch.tensor([[False, False, True, False]])
    _, Wp = attention(q, k, v, normalization=name, scale=1.0, key_padding_mask=pad, return_weights=True)
    expected = sigma(q @ k.transpose(-1, -2)) / 3
    expected[..., 2] = 0
    torch.testing.assert_close(Wp, expected)


@pytest.mark.parametrize("normalization", ["softmax", "sinkhorn", "linear", "relu"])
def test_key_weight_two_equals_duplicating_the_point(normalization):
    """A measure with weight 2/(n+1) on x_0 is the empirical measure of (x_0, x_0, x_1, ...)."""
    x = torch.randn(1, 5, 3, dtype=torch.float64)
    dup = torch.cat([x[:, :1], x], dim=1)
    w = torch.tensor([[2.0, 1, 1, 1, 1]], dtype=torch.float64)
    kw = dict(normalization=normalization, scale=1.0)
    if normalization == "sinkhorn":
        kw.update(n_iters=None, tol=1e-12)
    out_w = attention(x, x, x, key_weights=w, query_weights=w, **kw)
    out_dup = attention(dup, dup, dup, **kw)
    torch.testing.assert_close(out_w, out_dup[:, 1:], atol=1e-9, rtol=0)


def test_weighted_sinkhorn_is_bistochastic_wrt_the_measure():
    x = torch.randn(2, 7, 3, dtype=torch.float64)
    w = torch.rand(2, 7, dtype=torch.float64) + 0.1
    w = w / w.sum(-1, keepdim=True)
    _, W = attention(x, x, x, key_weights=w, query_weights=w, n_iters=None, tol=1e-12, return_weights=True)
    torch.testing.assert_close(W.sum(-1), torch.ones(2, 7, dtype=torch.float64), atol=1e-9, rtol=0)
    torch.testing.assert_close((w.unsqueeze(-1) * W).sum(-2), w, atol=1e-9, rtol=0)
    _, W1 = attention(x, x, x, key_weights=w, n_iters=1, return_weights=True)
    torch.testing.assert_close(W1, torch.softmax(x @ x.transpose(-1, -2) / math.sqrt(3) + w.log().unsqueeze(-2), -1))


def test_dropout_applies_to_weights_and_follows_the_seed():
    q, k, v = qkv()
    base = attention(q, k, v)
    torch.manual_seed(1)
    a = attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(1)
    b = attention(q, k, v, dropout_p=0.5)
    assert torch.equal(a, b) and not torch.allclose(a, base)
    _, W = attention(q, k, v, dropout_p=0.5, return_weights=True)
    torch.testing.assert_close(W, attention(q, k, v, return_weights=True)[1])  # weights before dropout
    # E[dropout(W)] = W: the mean over many draws approaches the undropped output
    mean = torch.stack([attention(q, k, v, dropout_p=0.3) for _ in range(400)]).mean(0)
    assert (mean - base).abs().max() < 0.25


def test_gradcheck_sinkhorn_attention():
    q, k, v = qkv(b=1, h=2, n=4, m=5, d=3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, k, v: attention(q, k, v, n_iters=4), (q, k, v))
    pad = torch.tensor([[False, False, False, True, False]])
    assert torch.autograd.gradcheck(lambda q, k, v: attention(q, k, v, n_iters=3, key_padding_mask=pad), (q, k, v))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("normalization", ["sinkhorn", "softmax"])
def test_half_precision(dtype, normalization):
    q, k, v = (t.to(dtype) for t in qkv(n=16, d=16))
    out = attention(q, k, v, normalization=normalization)
    assert out.dtype == dtype and torch.isfinite(out).all()
    ref = attention(q.float(), k.float(), v.float(), normalization=normalization)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=0)


def test_score_range_1e4_finite():
    q, k, v = qkv(n=12, d=4)
    out, W = attention(100 * q, 100 * k, v, scale=1.0, return_weights=True)
    assert torch.isfinite(out).all() and torch.isfinite(W).all()
    torch.testing.assert_close(W.sum(-1), torch.ones_like(W.sum(-1)), atol=1e-4, rtol=0)


def test_broadcast_batch_dims():
    q = torch.randn(2, 3, 5, 4)
    k = torch.randn(1, 3, 6, 4)
    v = torch.randn(3, 6, 2)
    out = attention(q, k, v)
    torch.testing.assert_close(out, attention(q, k.expand(2, 3, 6, 4), v.expand(2, 3, 6, 2)))


@pytest.mark.parametrize(
    "kwargs, exc, words",
    [
        (dict(q=torch.randn(4)), ValueError, "q must have at least 2 dimensions"),
        (dict(k=torch.randn(2, 3, 6, 5)), ValueError, "q and k must have the same last dimension"),
        (dict(v=torch.randn(2, 3, 5, 8)), ValueError, "k and v must have the same length n_k"),
        (dict(q=torch.ones(2, 3, 6, 8, dtype=torch.long)), TypeError, "q must have a floating dtype"),
        (dict(q=torch.randn(2, 3, 6, 8).double()), TypeError, "q, k and v must have the same dtype"),
        (dict(normalization="sparsemax"), ValueError, "normalization must be one of"),
        (dict(cost="cosine"), ValueError, "cost must be one of"),
        (dict(n_iters=0), ValueError, "n_iters must be an int >= 1, got 0"),
        (dict(dropout_p=1.5), ValueError, "dropout_p must be a float in [0, 1)"),
        (dict(attn_mask=torch.ones(5, 5, dtype=torch.bool)), ValueError, "attn_mask must broadcast to the score shape"),
        (dict(key_padding_mask=torch.zeros(2, 5, dtype=torch.bool)), ValueError, "key_padding_mask must have shape"),
        (dict(key_padding_mask=torch.zeros(2, 6)), TypeError, "key_padding_mask must be a bool tensor"),
        (dict(q=torch.full((2, 3, 6, 8), float("nan"))), ValueError, "q contains NaN"),
        (dict(key_weights=-torch.ones(2, 6)), ValueError, "key_weights must be non-negative"),
        (dict(attn_mask=torch.ones(6, 6, dtype=torch.long)), TypeError, "attn_mask must be a bool or floating tensor"),
    ],
)
def test_bad_input_is_named(kwargs, exc, words):
    q, k, v = qkv()
    args = dict(q=q, k=k, v=v)
    for name in ("q", "k", "v"):
        if name in kwargs:
            args[name] = kwargs.pop(name)
    with pytest.raises(exc) as info:
        attention(args["q"], args["k"], args["v"], **kwargs)
    assert words in str(info.value)


def test_sinkhorn_weights_match_core_directly():
    q, k, v = qkv(dtype=torch.float64)
    _, W = attention(q, k, v, n_iters=7, return_weights=True)
    torch.testing.assert_close(W, sinkhorn(q @ k.transpose(-1, -2) / math.sqrt(8), 7))
