"""The reproductions of the engines issue, each a test: the n_iters/tol contract, validation, the
streamed engine's float32 underflow, causal safety through every public entry point, the backend table."""

import math
import warnings

import pytest
import torch
from conftest import future_gradient

import sinkformer
from sinkformer import SinkhornConvergenceWarning, attention, sinkhorn
from sinkformer.attention import backends
from sinkformer.sinkhorn import sizes


def qkv(n=12, d=6, batch=(2, 3), dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*batch, n, d, generator=g, dtype=dtype) for _ in range(3))


# ---- the n_iters / tol contract ------------------------------------------------------------


@pytest.mark.parametrize("engine", ["dense", "tiled", "streamed"])
@pytest.mark.parametrize("tol, exc, words", [
    (-1.0, ValueError, "tol must be a finite number > 0"),
    (0.0, ValueError, "tol must be a finite number > 0"),
    (float("nan"), ValueError, "tol must be a finite number > 0"),
    (float("inf"), ValueError, "tol must be a finite number > 0"),
    ("a", TypeError, "tol must be a finite number > 0"),
    (True, TypeError, "tol must be a finite number > 0"),
])
def test_tol_must_be_a_finite_positive_number(engine, tol, exc, words):
    q, k, v = qkv()
    with pytest.raises(exc, match=words):
        attention(q, k, v, n_iters=None, tol=tol, backend=engine)


@pytest.mark.parametrize("kwargs", [{}, {"return_weights": True}, {"backend": "streamed"}, {"backend": "tiled"}])
def test_n_iters_and_tol_are_exclusive_on_every_path(kwargs):
    q, k, v = qkv()
    with pytest.raises(ValueError, match="n_iters and tol are exclusive: pass n_iters=None"):
        attention(q, k, v, n_iters=5, tol=1e-6, **kwargs)
    with pytest.raises(ValueError, match="n_iters and tol are exclusive"):
        sinkhorn(torch.randn(3, 3), 5, tol=1e-6)


def test_unreachable_tolerance_warns_and_says_the_error():
    """The README's tol example, asked for more than float32 reaches in 20 normalisations."""
    q, k, v = torch.randn(3, 4, 8, 128, 64, generator=torch.Generator().manual_seed(1))
    with pytest.warns(SinkhornConvergenceWarning, match=r"did not reach tol=1e-07 within max_iters=20 .*column error"):
        attention(q, k, v, n_iters=None, tol=1e-7, max_iters=20)
    assert issubclass(SinkhornConvergenceWarning, UserWarning)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, W = attention(q, k, v, n_iters=None, tol=1e-5, return_weights=True)  # reachable: silent
    assert (W.sum(-2) - 1).abs().max() <= 1e-5


def test_implicit_backward_warns_when_not_balanced():
    q, k, v = (t.double() for t in qkv(seed=2))
    with pytest.warns(SinkhornConvergenceWarning, match="backward='implicit' .* column error"):
        attention(q, k, v, n_iters=3, backward="implicit")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        attention(q, k, v, n_iters=None, tol=1e-10, backward="implicit")


def test_each_matrix_stops_on_its_own():
    """In tolerance mode a matrix's result does not depend on the rest of its batch."""
    q, k, v = qkv(batch=(4,), dtype=torch.float64, seed=3)
    q[1] *= 2  # a harder matrix: more normalisations
    for engine in ("dense", "tiled", "streamed"):
        together = attention(q, k, v, n_iters=None, tol=1e-9, backend=engine)
        alone = attention(q[:1], k[:1], v[:1], n_iters=None, tol=1e-9, backend=engine)
        torch.testing.assert_close(together[:1], alone, atol=1e-12, rtol=0)
    res = sinkhorn(q @ k.transpose(-1, -2) / 6**0.5, None, tol=1e-9, return_result=True)
    assert res.iterations[1] > res.iterations[0] and res.n_iters == int(res.iterations.max())


@pytest.mark.parametrize("scale, exc", [("a", TypeError), (float("nan"), ValueError), (float("inf"), ValueError),
                                        (True, TypeError)])
def test_scale_is_validated(scale, exc):
    q, k, v = qkv()
    with pytest.raises(exc, match="scale must be a finite float"):
        attention(q, k, v, scale=scale)


def test_warm_start_is_validated():
    S = torch.randn(4, 5)
    with pytest.raises(ValueError, match="warm_start contains NaN"):
        sinkhorn(S, 3, warm_start=torch.full((5,), float("nan")))
    res = sinkhorn(S, None, tol=1e-8, return_result=True)
    again = sinkhorn(S, None, tol=1e-8, warm_start=res.g, return_result=True)
    assert again.n_iters == 1 and torch.isfinite(again.matrix).all()


def test_empty_problems_of_the_core():
    for shape in [(0, 4), (3, 0), (2, 0, 0)]:
        S = torch.randn(*shape, requires_grad=True)
        P = sinkhorn(S, 5)
        assert P.shape == S.shape
        P.sum().backward()


# ---- the streamed engine's float32 underflow -------------------------------------------------


def test_streamed_column_that_underflows_stays_finite():
    """A key whose scores sit > 88 below every row maximum: its column sum underflows in float32."""
    q = torch.tensor([[10.0, 0.0], [0.0, 10.0]])
    k = torch.tensor([[10.0, 0.0], [0.0, 10.0], [0.0, 0.0]])
    v = torch.randn(3, 4)
    for chunk in (1, 2):
        out = attention(q, k, v, scale=1.0, n_iters=2, chunk_size=chunk)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, attention(q, k, v, scale=1.0, n_iters=2, backend="dense"), atol=1e-5, rtol=0)
    q12 = 1.2 * q  # scores of 144: exp(-144) is 0 in float32
    k12 = 1.2 * k
    for n_iters in (2, 3, 6):
        out = attention(q12, k12, v, scale=1.0, n_iters=n_iters, chunk_size=1)
        ref = attention(q12.double(), k12.double(), v.double(), scale=1.0, n_iters=n_iters, backend="dense")
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)


def test_long_sequence_with_an_unreachable_key_stays_finite():
    """n = 4097 (auto-streamed: n^2 > 2^24), |q| = |k| = 12 and one zero key: no NaN anywhere."""
    n = 4097
    g = torch.Generator().manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(1, n, 2, generator=g), dim=-1) * 12
    k = q.clone()
    k[:, 0] = 0.0
    v = torch.randn(1, n, 3, generator=g)
    assert attention.explain(q, k, v, scale=1.0).engine == "streamed"
    out = attention(q, k, v, scale=1.0, n_iters=5)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, attention(q, k, v, scale=1.0, n_iters=5, backend="tiled"), atol=1e-4, rtol=0)


# ---- causal safety through every public entry point ------------------------------------------


def test_causal_sinkhorn_does_not_leak_and_other_causal_forms_are_refused():
    """``is_causal=True`` is causal Sinkhorn (each prefix balanced on its own): no gradient from the
    future. A causal ``attn_mask`` would balance the whole matrix, and ``tol`` has no per-prefix
    meaning: both refused, with the way out in the message."""
    q, k, v = qkv(n=8, batch=(2,))
    for n_iters in (1, 2, 3, 5):
        assert future_gradient(lambda x: attention(x, x, x, is_causal=True, n_iters=n_iters), q) == 0.0
    assert future_gradient(lambda x: attention(x, x, x, is_causal=True, normalization="softmax"), q) == 0.0
    with pytest.raises(ValueError, match="needs a fixed n_iters"):
        attention(q, k, v, is_causal=True, n_iters=None, tol=1e-5)
    causal_mask = torch.nn.Transformer.generate_square_subsequent_mask(8)  # float, -inf above the diagonal
    with pytest.raises(ValueError, match="leak from the future.*Pass is_causal=True instead"):
        attention(q, k, v, attn_mask=causal_mask, n_iters=3)
    with pytest.raises(ValueError, match="needs self-attention"):
        attention(q, k[:, :5], v[:, :5], is_causal=True, n_iters=3)


def test_multihead_attention_serves_causal_sinkhorn():
    """``is_causal=True`` (with or without the causal ``attn_mask``) is causal Sinkhorn: no gradient from
    the future, the rows of ``attention(..., is_causal=True)``. A causal mask alone, or causal
    cross-attention, is refused with the way out in the message."""
    torch.manual_seed(0)
    mha = sinkformer.nn.MultiheadAttention(12, 3, batch_first=True, n_iters=5)
    x = torch.randn(2, 7, 12)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(7)
    for n_iters in (1, 2, 3, 5):
        mha.n_iters = n_iters
        assert future_gradient(lambda y: mha(y, y, y, attn_mask=mask, is_causal=True, need_weights=False)[0], x) == 0.0
        assert future_gradient(lambda y: mha(y, y, y, is_causal=True, need_weights=False)[0], x) == 0.0
    q, k, v = (t.unflatten(-1, (3, 4)).transpose(1, 2) for t in mha._project(x, x, x))
    expected = mha.out_proj(attention(q, k, v, is_causal=True, n_iters=5).transpose(1, 2).flatten(-2))
    out, weights = mha(x, x, x, attn_mask=mask, is_causal=True)
    torch.testing.assert_close(out, expected)
    assert weights.triu(1).abs().max() == 0  # lower triangular
    with pytest.raises(ValueError, match="leak from the future.*Pass is_causal=True instead"):
        mha(x, x, x, attn_mask=mask)
    with pytest.raises(ValueError, match="needs self-attention"):
        mha(x, x[:, :5], x[:, :5], is_causal=True)


def decoder_model():
    torch.manual_seed(0)
    return torch.nn.Transformer(d_model=16, nhead=2, num_encoder_layers=1, num_decoder_layers=2, dim_feedforward=32,
                                dropout=0.0, batch_first=True).eval()


def test_convert_keeps_decoder_attention_on_softmax_unless_causal():
    model = decoder_model()
    with pytest.warns(UserWarning, match="kept 4 decoder attention module.*Pass causal=True"):
        _, count = sinkformer.convert(model, n_iters=5, verbose=False, return_count=True)
    assert count == 1  # the encoder's self-attention
    for layer in model.decoder.layers:
        assert not isinstance(layer.self_attn, sinkformer.nn.MultiheadAttention)
        assert not isinstance(layer.multihead_attn, sinkformer.nn.MultiheadAttention)
    src = torch.randn(2, 6, 16)
    mask = model.generate_square_subsequent_mask(5)
    assert future_gradient(lambda tgt: model(src, tgt, tgt_mask=mask, tgt_is_causal=True), torch.randn(2, 5, 16)) == 0.0


def test_convert_causal_makes_decoder_self_attention_causal_sinkhorn_without_leak():
    model = decoder_model()
    src, tgt = torch.randn(2, 6, 16), torch.randn(2, 5, 16)
    mask = model.generate_square_subsequent_mask(5)
    with torch.no_grad():
        softmax = model(src, tgt, tgt_mask=mask)
    with pytest.warns(UserWarning, match="kept 2 decoder cross-attention module.*would depend on future tokens"):
        _, count = sinkformer.convert(model, n_iters=5, causal=True, verbose=False, return_count=True)
    assert count == 3  # the encoder's self-attention and both decoder self-attentions
    for layer in model.decoder.layers:
        assert isinstance(layer.self_attn, sinkformer.nn.MultiheadAttention) and layer.self_attn.n_iters == 5
        assert not isinstance(layer.multihead_attn, sinkformer.nn.MultiheadAttention)
    # nn.Transformer passes tgt_is_causal=True itself when tgt_mask is the causal mask
    for kwargs in ({"tgt_mask": mask, "tgt_is_causal": True}, {"tgt_mask": mask}, {"tgt_is_causal": True}):
        assert future_gradient(lambda t: model(src, t, **kwargs), tgt) == 0.0
    with torch.no_grad():
        assert (model(src, tgt, tgt_mask=mask) - softmax).abs().max() > 1e-3  # Sinkhorn now runs
    with pytest.raises(ValueError, match="leak from the future"):  # a causal mask declared non-causal
        model(src, tgt, tgt_mask=mask, tgt_is_causal=False)


def test_sinkformer_decoder_self_attention_is_causal_and_cross_attention_is_refused():
    """Column normalisation in cross-attention sums over all target positions: a leak, so refused;
    causal Sinkhorn self-attention does not leak."""
    q, k, v = qkv(n=6, batch=(1,))
    assert future_gradient(lambda x: attention(x, k[:, :5], v[:, :5], n_iters=5), q) > 1e-3
    with pytest.raises(ValueError, match="cross_normalization='sinkhorn' with n_iters=3 in a causal decoder"):
        sinkformer.nn.TransformerDecoder(16, 2, 1, dim_feedforward=32, cross_normalization="sinkhorn", n_iters=3)
    memory = torch.randn(2, 4, 16)
    for self_normalization in ("softmax", "sinkhorn"):
        torch.manual_seed(0)
        decoder = sinkformer.nn.TransformerDecoder(16, 2, 2, dim_feedforward=32, dropout=0.0, n_iters=3,
                                                   self_normalization=self_normalization)
        assert decoder.layers[0].self_attn.normalization == self_normalization
        assert future_gradient(lambda tgt: decoder(tgt, memory), torch.randn(2, 5, 16)) == 0.0
        pad = torch.tensor([[False] * 5, [False, False, False, True, True]])
        assert future_gradient(lambda tgt: decoder(tgt, memory, tgt_padding_mask=pad), torch.randn(2, 5, 16)) == 0.0


# ---- the backend table ------------------------------------------------------------------------


def test_explain_names_the_engine_and_the_reason():
    q, k, v = qkv()
    assert str(attention.explain(q, k, v)) == "tiled: Sinkhorn on cached tiles, O(n) saved per slice"
    assert attention.explain(q, k, v, n_iters=1).engine == "sdpa"
    assert attention.explain(q, k, v, normalization="softmax").engine == "sdpa"
    choice = attention.explain(q, k, v, return_weights=True)
    assert choice.engine == "dense" and "return_weights=True" in choice.reason and "memory" in choice.reason
    bias = torch.zeros(12, 12, requires_grad=True)
    assert "requires grad" in attention.explain(q, k, v, attn_mask=bias).reason
    assert "key_weights" in attention.explain(q, k, v, key_weights=torch.ones(2, 12)).reason
    assert attention.explain(q, k, v, normalization="relu").engine == "dense"
    assert attention.explain(q, k, v, chunk_size=4).engine == "streamed"
    assert attention.explain(q, k, v, backend="streamed").reason == "forced by backend="


def test_auto_streams_above_the_threshold(monkeypatch):
    q, k, v = qkv()
    monkeypatch.setattr(sizes, "STREAM_ABOVE", 12 * 12 - 1)
    assert attention.explain(q, k, v).engine == "streamed"
    assert "2^24" in attention.explain(q, k, v).reason


@pytest.mark.parametrize("backend, kwargs, words", [
    ("sdpa", {}, "engine 'sdpa' computes SoftMax only .* n_iters=5"),
    ("tiled", {"return_weights": True}, "return_weights=True .* engine 'tiled'"),
    ("streamed", {"dropout_p": 0.1}, "dropout_p=0.1 is not served by engine 'streamed'"),
    ("dense", {"backward": "implicit"}, "backward='implicit' is not served by engine 'dense'; engines 'flash' and 'tiled' serve it"),
    ("causal", {}, "engine 'causal' serves is_causal=True only"),
    ("tiled", {"is_causal": True}, "is_causal=True with Sinkhorn attention .* not served by engine 'tiled'; engine 'causal' serves it"),
    ("tiled", {"normalization": "relu"}, "engine 'tiled' computes Sinkhorn attention, got normalization='relu'"),
    ("dense", {"chunk_size": 4}, "chunk_size=4 is not served by engine 'dense'; engine 'streamed' serves it"),
    ("fast", {}, "backend must be one of"),
])
def test_a_forced_engine_that_cannot_serve_raises_with_the_reason(backend, kwargs, words):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=words):
        attention(q, k, v, backend=backend, **kwargs)


def test_engine_names_are_one_per_concept():
    # in "auto"'s priority order
    assert backends.ENGINES == ("sdpa", "causal", "flash", "streamed", "tiled", "dense")
    assert backends.BACKENDS == ("auto",) + backends.ENGINES
    assert math.isfinite(sizes.STREAM_ABOVE)


# ---- issue 23: every spelling of a causal mask, large negative masks, compile, overflow, explain ---------


def causal_spellings(n=8, heads=3):
    """The ways people write a causal mask (True/0 = take part), each broadcastable to (2, heads, n, n)."""
    future = torch.ones(n, n, dtype=torch.bool).triu(1)

    def additive(value, dtype=torch.float32):
        return torch.zeros(n, n, dtype=dtype).masked_fill(future, value)

    left_padded = ~future.expand(2, 1, n, n).clone()
    left_padded[0, ..., :2] = False  # Hugging Face: causal and left padding, (B, 1, n, n)
    one_head = torch.ones(1, heads, n, n, dtype=torch.bool)
    one_head[0, 1] = ~future  # only head 1 is causal: its outputs would still leak
    return {
        "generate_square_subsequent_mask": torch.nn.Transformer.generate_square_subsequent_mask(n),
        "-1e9 (official Sinkformers code)": additive(-1e9),
        "-1e4 (BERT)": additive(-1e4),
        "finfo(float32).min": additive(torch.finfo(torch.float32).min),
        "finfo(float16).min in float16": additive(torch.finfo(torch.float16).min, torch.float16),
        "bool tril": ~future,
        "bool per head (heads, n, n)": (~future).expand(heads, n, n),
        "HF 4-D finfo.min with left padding": torch.zeros(2, 1, n, n).masked_fill(~left_padded,
                                                                                   torch.finfo(torch.float32).min),
        "bool causal in one head only": one_head,
    }


@pytest.mark.parametrize("spelling", list(causal_spellings()))
def test_every_spelling_of_a_causal_mask_is_refused_with_sinkhorn(spelling):
    """Issue 23.1: with -1e9 or finfo.min the mask ran and leaked (future gradient 0.13); any causal
    spelling is now refused, pointing to is_causal=True, which serves it without a leak."""
    mask = causal_spellings()[spelling]
    x = torch.randn(2, 3, 8, 4)
    with pytest.raises(ValueError, match="leak from the future.*Pass is_causal=True instead"):
        attention(x, x, x, attn_mask=mask, n_iters=5)
    with pytest.raises(ValueError, match="leak from the future"):
        attention(x, x, x, attn_mask=mask, n_iters=2, backend="dense")

    def heads(y):  # (2, 8, 12) -> 3 heads of (2, 3, 8, 4), causal Sinkhorn with the mask -> (2, 8, 12)
        y = y.unflatten(-1, (3, 4)).transpose(1, 2)
        return attention(y, y, y, attn_mask=mask, is_causal=True, n_iters=5).transpose(1, 2).flatten(-2)

    assert future_gradient(heads, torch.randn(2, 8, 12)) == 0.0


def test_large_negative_additive_masks_are_masking_for_sinkhorn():
    """A key masked with -1e9 (or finfo.min, or -1e4) is masked: Sinkhorn's column normalisation used to
    undo the finite bias and give the masked key its full column mass."""
    q, k, v = qkv(n=6, batch=(2,))
    keys = torch.tensor([True, True, True, True, False, False])
    want = attention(q, k, v, attn_mask=keys, n_iters=5, backend="dense")
    for value in (-1e4, -1e9, torch.finfo(torch.float32).min):
        additive = torch.zeros(6).masked_fill(~keys, value)
        for backend in ("dense", "tiled", "streamed"):
            torch.testing.assert_close(attention(q, k, v, attn_mask=additive, n_iters=5, backend=backend), want)
    # above the threshold an entry is a bias; one iteration (SoftMax) keeps SDPA's additive reading
    bias = torch.zeros(6).masked_fill(~keys, -50.0)
    assert (attention(q, k, v, attn_mask=bias, n_iters=5) - want).abs().max() > 1e-3
    softmax_bias = torch.zeros(6).masked_fill(~keys, -1e9)
    torch.testing.assert_close(attention(q, k, v, attn_mask=softmax_bias, n_iters=1),
                               torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=softmax_bias))


def test_multihead_attention_and_convert_refuse_large_negative_causal_masks():
    """Through nn.MultiheadAttention (0.028 of future gradient before) and convert()ed nn.Transformer
    (which only recognises -inf masks as causal): refused; with is_causal=True no leak."""
    torch.manual_seed(0)
    mha = sinkformer.nn.MultiheadAttention(12, 3, batch_first=True, n_iters=5)
    x = torch.randn(2, 7, 12)
    mask = torch.zeros(7, 7).masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), -1e9)
    with pytest.raises(ValueError, match="leak from the future"):
        mha(x, x, x, attn_mask=mask)
    assert future_gradient(lambda y: mha(y, y, y, attn_mask=mask, is_causal=True, need_weights=False)[0], x) == 0.0
    # a float key padding mask with -1e9 is padding, as a bool one (its queries leave the column sums too)
    pad = torch.tensor([[False] * 7, [False] * 5 + [True] * 2])
    torch.testing.assert_close(mha(x, x, x, key_padding_mask=torch.zeros(2, 7).masked_fill(pad, -1e9))[0],
                               mha(x, x, x, key_padding_mask=pad)[0])
    model = decoder_model()
    with pytest.warns(UserWarning, match="kept 2 decoder cross-attention"):
        sinkformer.convert(model, n_iters=5, causal=True)
    src, tgt = torch.randn(2, 6, 16), torch.randn(2, 5, 16)
    mask = torch.zeros(5, 5).masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), torch.finfo(torch.float32).min)
    with pytest.raises(ValueError, match="leak from the future"):
        model(src, tgt, tgt_mask=mask)
    assert future_gradient(lambda t: model(src, t, tgt_mask=mask, tgt_is_causal=True), tgt) == 0.0


def test_a_list_is_refused_naming_the_argument():
    q, k, v = qkv()
    for name, args in (("q", (q.tolist(), k, v)), ("k", (q, k.tolist(), v)), ("v", (q, k, v.tolist()))):
        with pytest.raises(TypeError, match=f"{name} must be a torch.Tensor, got list"):
            attention(*args)
        with pytest.raises(TypeError, match=f"{name} must be a torch.Tensor, got list"):
            attention.explain(*args)


@pytest.mark.parametrize("backend, kwargs", [("auto", {}), ("dense", {}), ("tiled", {}), ("streamed", {}),
                                             ("sdpa", {"n_iters": 1}), ("auto", {"is_causal": True, "n_iters": 3}),
                                             ("auto", {"is_causal": True, "n_iters": 5}),
                                             ("dense", {"normalization": "relu"}), ("auto", {"cost": "l2"})])
def test_scores_that_overflow_raise_naming_the_cause(backend, kwargs):
    """Issue 23.5: finite q and k whose scores overflow float32 gave NaN on every engine but dense."""
    q, k, v = qkv(n=6, batch=(2,))
    with pytest.raises(ValueError, match=r"scores overflow torch.float32: .* reaches inf .*scale the queries"):
        attention(q * 1e20, k * 1e20, v, backend=backend, **kwargs)
    with pytest.raises(ValueError, match=r"scores overflow .*scale=1e\+38"):
        attention(q, k, v, backend=backend, scale=1e38, **kwargs)
    with pytest.raises(ValueError, match=r"scale \* q.k \+ attn_mask"):  # a bias counts too
        attention(q, k, v, backend=backend, attn_mask=torch.full((6, 6), 3e38), **kwargs)


@pytest.mark.parametrize("backend, kwargs", [("dense", {}), ("tiled", {}), ("streamed", {}), ("sdpa", {"n_iters": 1}),
                                             ("auto", {"is_causal": True, "n_iters": 3}),
                                             ("auto", {"is_causal": True, "n_iters": 5})])
def test_scores_near_the_limit_are_served(backend, kwargs):
    """scale=1e38 on unit vectors whose products stay below 1/2: the bound scale |q| |k| = 1e38 is above
    finfo.max / 4 = 8.5e37, the true maximum 5e37 is not, so the call runs: the float64 answer, and
    gradients without NaN (those of causal Sinkhorn reach 3e38 in float64: inf in float32 is their value)."""
    g = torch.Generator().manual_seed(4)
    q = torch.nn.functional.normalize(torch.randn(2, 6, 2, generator=g), dim=-1)
    q = torch.cat([q, torch.zeros(2, 6, 2)], -1)  # in span(e1, e2)
    k = torch.cat([0.5 * torch.nn.functional.normalize(torch.randn(2, 6, 2, generator=g), dim=-1),
                   0.75**0.5 * torch.nn.functional.normalize(torch.randn(2, 6, 2, generator=g), dim=-1)], -1)
    v = torch.randn(2, 6, 3, generator=g)
    assert (q @ k.transpose(-1, -2)).abs().max() <= 0.5
    q, k = q.requires_grad_(), k.requires_grad_()
    out = attention(q, k, v, backend=backend, scale=1e38, **kwargs)
    out.square().sum().backward()
    assert not (q.grad.isnan().any() or k.grad.isnan().any())
    want = attention(q.detach().double(), k.detach().double(), v.double(), scale=1e38,
                     **dict(kwargs, backend="dense" if backend in ("tiled", "streamed") else backend))
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=0)


def test_explain_states_the_cubic_cost_of_causal_sinkhorn_and_a_call_warns_once(monkeypatch):
    """Issue 23.11: n_iters >= 4 is O(n^3) (53 s and 6 GB at n = 4096 against 0.3 GB at n_iters = 3)."""
    from sinkformer.attention import engines

    x = torch.randn(2, 40, 4)
    three, five = (attention.explain(x, x, x, is_causal=True, n_iters=n) for n in (3, 5))
    assert "O(n^2)" in three.reason and "O(n^3)" not in three.reason
    assert "n_iters=5 >= 4 costs O(n^3) time" in five.reason and "n_iters <= 3 is O(n^2)" in five.reason
    assert "O(n^3)" in attention.explain(x, x, x, is_causal=True, n_iters=4, backend="causal").reason
    monkeypatch.setattr(engines, "CUBIC_WARN_FROM", 2 * 40**3 * 2)  # "where it matters", scaled down
    monkeypatch.setattr(engines, "_cubic_warned", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        attention(x, x, x, is_causal=True, n_iters=4)  # 2 * 40^3 * 1 multiply-adds: not yet
        attention(x, x, x, is_causal=True, n_iters=3)
    with pytest.warns(UserWarning, match=r"n_iters=5 at n=40 \(2 slice\(s\)\) takes the O\(n\^3\) path.*n_iters=3"):
        attention(x, x, x, is_causal=True, n_iters=5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        attention(x, x, x, is_causal=True, n_iters=7)  # once per process


@pytest.mark.parametrize("shapes", [[(4, 8), (4, 8), (4, 8)], [(4, 1), (1, 8), (8,)], [(), (2, 3)], [(0, 3), (1, 3)],
                                    [(4, 8), (3, 8)], [(2,), (2, 1), (3, 1, 1)]])
def test_broadcast_shapes_is_torchs(shapes):
    """The validation's broadcast of batch shapes (at once for equal shapes) gives torch's result, as a
    torch.Size, and raises torch's error where the shapes do not broadcast."""
    from sinkformer._validation import broadcast_shapes

    try:
        expected = torch.broadcast_shapes(*shapes)
    except RuntimeError:
        with pytest.raises(RuntimeError):
            broadcast_shapes(*shapes)
        return
    got = broadcast_shapes(*(torch.Size(s) for s in shapes))
    assert isinstance(got, torch.Size) and got == expected


def test_batch_dimensions_that_do_not_broadcast_are_refused():
    q = torch.randn(4, 8, 5, 3)
    with pytest.raises(ValueError, match="batch dimensions must broadcast"):
        attention(q, torch.randn(3, 8, 5, 3), torch.randn(3, 8, 5, 3))


@pytest.mark.parametrize("name", ["q", "k", "v"])
@pytest.mark.parametrize("bad, word", [(float("nan"), "NaN"), (float("inf"), "inf"), (-float("inf"), "inf")])
@pytest.mark.parametrize("kwargs", [{}, {"cost": "l2"}, {"normalization": "relu", "backend": "dense"}])
@pytest.mark.parametrize("contiguous", [True, False])
def test_a_non_finite_input_is_named(name, bad, word, kwargs, contiguous):
    """The values of q, k and v are checked in one read with the scores' bound (the squared norms of q and k
    are not finite where q or k is not: a dot product where contiguous, else a norm); a doubt runs the checks
    that name the tensor."""
    q, k, v = qkv(n=6, batch=(2,))
    args = {name: t.clone() if contiguous else t.mT.contiguous().mT for name, t in dict(q=q, k=k, v=v).items()}
    assert all(t.is_contiguous() == contiguous for t in args.values())
    args[name][1, 3, 2] = bad
    with pytest.raises(ValueError, match=f"{name} contains {word}"):
        attention(**args, **kwargs)


def test_finite_inputs_whose_norms_overflow_are_refused_for_their_scores_not_as_non_finite():
    q, k, v = qkv(n=6, batch=(2,))
    big = torch.zeros_like(q)
    big[..., :2] = 3e38  # finite entries; each row norm overflows float32
    with pytest.raises(ValueError, match="scores overflow torch.float32"):
        attention(big, k, v)
    huge_v = v.clone()
    huge_v[..., :3, :] = 3e38  # finite values whose sum overflows: accepted (no score involves v)
    assert attention(q, k, huge_v, n_iters=3).isfinite().sum() > 0


def test_scores_within_the_row_norm_bound_pass_where_the_whole_norms_do_not(monkeypatch):
    """The one-read check bounds the scores by the norms of all of q and k; where that bound exceeds the limit
    but the row norms' does not, the exact checks run and accept the call: the same output as with the limit
    of the one-read check never reached."""
    from sinkformer import _validation

    q, k, v = qkv(n=6, batch=(2,), dtype=torch.float64)
    row_bound = (torch.linalg.vector_norm(q, dim=-1).amax() * torch.linalg.vector_norm(k, dim=-1).amax()).item()
    whole_bound = (torch.linalg.vector_norm(q) * torch.linalg.vector_norm(k)).item()
    assert whole_bound > 2 * row_bound
    expected = attention(q, k, v, n_iters=3)
    calls = []
    exact = _validation.check_scores_fit
    monkeypatch.setattr(_validation, "check_scores_fit", lambda *a, **kw: calls.append(1) or exact(*a, **kw))
    # a limit between the two bounds (scale 1/sqrt(d) <= 1: the bounds as computed by the checks)
    monkeypatch.setattr(_validation, "SCORE_HEADROOM", torch.finfo(torch.float64).max / (1.5 * row_bound))
    assert torch.equal(attention(q, k, v, n_iters=3), expected)
    assert calls, "the exact checks did not run"
    largest = (q @ k.transpose(-1, -2)).abs().amax().item() / math.sqrt(q.shape[-1])
    monkeypatch.setattr(_validation, "SCORE_HEADROOM", torch.finfo(torch.float64).max / (0.5 * largest))
    with pytest.raises(ValueError, match="scores overflow torch.float64"):
        attention(q, k, v, n_iters=3)
