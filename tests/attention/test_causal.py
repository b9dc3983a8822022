"""Causal Sinkhorn attention: ``attention(..., is_causal=True)`` and its decoding state.

The engine itself is held to the per-prefix definition by the conformance grid
(``tests/conformance/test_engines.py::test_causal_sinkhorn``) and ``tests/sinkhorn/test_prefix.py``;
here: decoding token by token equals the full forward, SoftMax at one iteration, the errors.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sinkformer import attention
from sinkformer.attention import CausalSinkhornCache


def inputs(b=2, h=3, n=50, d=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=g, dtype=dtype) for _ in range(3))
    pad = torch.zeros(b, n, dtype=torch.bool)
    pad[1, :4] = True  # left padding, as batched generation uses
    pad[0, n // 3] = True  # and a padded key in the middle
    return q, k, v, pad


@pytest.mark.parametrize("n_iters", [1, 2, 3, 4, 5])
def test_decoding_50_tokens_equals_the_full_forward(n_iters):
    q, k, v, pad = inputs()
    full = attention(q, k, v, is_causal=True, n_iters=n_iters, key_padding_mask=pad)
    cache = CausalSinkhornCache(n_iters)
    kpm = pad[:, None, :].expand(q.shape[:-1])
    steps = [cache.step(q[..., t : t + 1, :], k[..., t : t + 1, :], v[..., t : t + 1, :], key_padding_mask=kpm[..., t : t + 1])
             for t in range(q.shape[-2])]
    torch.testing.assert_close(torch.cat(steps, dim=-2), full, rtol=1e-10, atol=1e-12)
    assert len(cache) == 50
    assert (cache.scores is not None) == (n_iters >= 4)  # O(t) state up to 3 iterations


def test_a_prompt_then_tokens_in_float32():
    q, k, v, _ = inputs(dtype=torch.float32, n=20)
    full = attention(q, k, v, is_causal=True, n_iters=3)
    cache = CausalSinkhornCache(3)
    prompt = cache.step(q[..., :12, :], k[..., :12, :], v[..., :12, :])
    rest = [cache.step(q[..., t : t + 1, :], k[..., t : t + 1, :], v[..., t : t + 1, :]) for t in range(12, 20)]
    out = torch.cat([prompt] + rest, dim=-2)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-6)


def test_one_iteration_is_causal_softmax():
    q, k, v, _ = inputs(n=16)
    torch.testing.assert_close(attention(q, k, v, is_causal=True, n_iters=1, backend="dense"),
                               F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_scale_is_applied_like_the_full_forward():
    q, k, v, _ = inputs(n=9)
    full = attention(q, k, v, is_causal=True, n_iters=3, scale=0.3)
    cache = CausalSinkhornCache(3, scale=0.3)
    torch.testing.assert_close(cache.step(q, k, v), full)


def test_cache_errors_name_the_argument():
    with pytest.raises(ValueError, match="n_iters must be an int >= 1"):
        CausalSinkhornCache(0)
    cache = CausalSinkhornCache(3)
    q = torch.randn(1, 2, 4)
    with pytest.raises(ValueError, match="q, k and v must hold the same new tokens"):
        cache.step(q, q[:, :1], q)


def nan_at(x):
    x = x.clone()
    x.view(-1)[0] = float("nan")
    return x


@pytest.mark.parametrize("make, step, exc, words", [
    (lambda: CausalSinkhornCache(3, scale=float("nan")), None, ValueError, "scale must be a finite float, got nan"),
    (lambda: CausalSinkhornCache(3, scale=float("inf")), None, ValueError, "scale must be a finite float, got inf"),
    (lambda: CausalSinkhornCache(3, scale="0.5"), None, TypeError, "scale must be a finite float, got str"),
    (None, lambda q: (nan_at(q), q, q), ValueError, "q contains NaN"),
    (None, lambda q: (q, q, nan_at(q)), ValueError, "v contains NaN"),
    (None, lambda q: ([[0.0]], q, q), TypeError, "q must be a torch.Tensor, got list"),
    (None, lambda q: (q, q.double(), q), TypeError, "q, k and v must have the same dtype"),
    (None, lambda q: (q, q, q, torch.zeros(2, 3, 1)), TypeError, "key_padding_mask must be a bool tensor"),
    (None, lambda q: (q, q, q, torch.zeros(2, 3, 2, dtype=torch.bool)), ValueError,
     r"key_padding_mask must broadcast to \(\*batch, m\) = \(2, 3, 1\)"),
    (None, lambda q: (q * 1e20, q * 1e20, q), ValueError, "attention scores overflow"),
])
def test_cache_validates_like_attention(make, step, exc, words):
    """Issue 23.8: NaN inputs and a NaN scale gave silent NaN, a string scale or a float padding mask raw
    torch errors, a padding mask of the wrong length was accepted."""
    q = torch.randn(2, 3, 1, 4)
    with pytest.raises(exc, match=words):
        cache = make() if make is not None else CausalSinkhornCache(3)
        cache.step(*step(q))
    cache = CausalSinkhornCache(3)
    if step is not None:
        with pytest.raises(exc):
            cache.step(*step(q))
        assert len(cache) == 0  # refused before any change of the state


def test_cache_refuses_a_step_that_does_not_continue_its_sequences():
    cache = CausalSinkhornCache(3)
    q = torch.randn(2, 3, 1, 4)
    first = cache.step(q, q, q)
    for bad, what in ((torch.randn(1, 3, 1, 4), r"\(1, 3\), 4, 4"), (torch.randn(2, 3, 1, 5), r"\(2, 3\), 5, 5"),
                      (q.double(), "float64")):
        with pytest.raises(ValueError, match=f"each step must continue the same sequences.*got .*{what}"):
            cache.step(bad, bad, bad)
    assert len(cache) == 1
    torch.testing.assert_close(torch.cat([first, cache.step(q, q, q)], -2),
                               attention(torch.cat([q, q], -2), torch.cat([q, q], -2), torch.cat([q, q], -2),
                                         is_causal=True, n_iters=3))
