"""sinkformer.nn.MultiheadAttention as a drop-in, and convert() on trained Transformers."""

import pytest
import torch

import sinkformer
from sinkformer.nn import MultiheadAttention


def twin(**kwargs):
    """A torch MHA and a sinkformer MHA (SoftMax) with the same weights."""
    ref = torch.nn.MultiheadAttention(**kwargs)
    ours = MultiheadAttention(**kwargs, normalization="softmax")
    ours.load_state_dict(ref.state_dict())
    return ref.eval(), ours.eval()


CONFIGS = [
    dict(embed_dim=16, num_heads=4),
    dict(embed_dim=16, num_heads=2, batch_first=True),
    dict(embed_dim=16, num_heads=4, kdim=6, vdim=10),
    dict(embed_dim=16, num_heads=4, add_bias_kv=True, add_zero_attn=True),
    dict(embed_dim=16, num_heads=1, bias=False),
]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("average", [True, False])
def test_softmax_equals_torch(config, average):
    ref, ours = twin(**config)
    bf = config.get("batch_first", False)
    L, S, N = 5, 7, 3
    shape = (lambda n_tok, dim: (N, n_tok, dim)) if bf else (lambda n_tok, dim: (n_tok, N, dim))
    query = torch.randn(shape(L, 16))
    key = torch.randn(shape(S, config.get("kdim") or 16))
    value = torch.randn(shape(S, config.get("vdim") or 16))
    kpm = torch.zeros(N, S, dtype=torch.bool)
    kpm[0, -2:] = True
    masks = [
        dict(),
        dict(key_padding_mask=kpm),
        dict(attn_mask=torch.rand(L, S) > 0.8),
        dict(attn_mask=torch.randn(N * config["num_heads"], L, S), key_padding_mask=kpm),
        dict(key_padding_mask=torch.zeros(N, S).masked_fill(kpm, float("-inf"))),
    ]
    for kw in masks:
        out_ref, w_ref = ref(query, key, value, average_attn_weights=average, **kw)
        out, w = ours(query, key, value, average_attn_weights=average, **kw)
        torch.testing.assert_close(out, out_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=1e-5)
        out_nw, w_nw = ours(query, key, value, need_weights=False, **kw)
        assert w_nw is None
        torch.testing.assert_close(out_nw, out_ref, atol=1e-5, rtol=1e-5)


def test_unbatched_input_equals_torch():
    ref, ours = twin(embed_dim=8, num_heads=2)
    x = torch.randn(5, 8)
    for a, b in zip(ref(x, x, x), ours(x, x, x)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_state_dict_keys_and_parameters_are_torchs():
    for config in CONFIGS:
        ref = torch.nn.MultiheadAttention(**config)
        ours = MultiheadAttention(**config)
        assert list(ref.state_dict()) == list(ours.state_dict())
        assert [p.shape for p in ref.parameters()] == [p.shape for p in ours.parameters()]
        assert isinstance(ours, torch.nn.MultiheadAttention)


def test_sinkhorn_self_attention_with_padding_is_doubly_stochastic_on_valid_block():
    mha = MultiheadAttention(12, 3, batch_first=True, n_iters=41).double().eval()
    x = torch.randn(2, 6, 12, dtype=torch.float64)
    pad = torch.tensor([[False] * 4 + [True] * 2, [False] * 6])
    out, w = mha(x, x, x, key_padding_mask=pad, average_attn_weights=False)
    valid = w[0, :, :4, :4]
    torch.testing.assert_close(valid.sum(-1), torch.ones(3, 4, dtype=torch.float64), atol=1e-5, rtol=0)
    torch.testing.assert_close(valid.sum(-2), torch.ones(3, 4, dtype=torch.float64), atol=1e-5, rtol=0)
    assert torch.all(w[0, :, 4:] == 0) and torch.all(w[0, :, :, 4:] == 0)
    torch.testing.assert_close(w[1].sum(-2), torch.ones(3, 6, dtype=torch.float64), atol=1e-5, rtol=0)
    assert torch.isfinite(out).all()


def test_constructor_validates_new_arguments():
    with pytest.raises(ValueError, match="normalization must be one of"):
        MultiheadAttention(8, 2, normalization="entmax")
    with pytest.raises(ValueError, match="n_iters must be an int >= 1, got 0"):
        MultiheadAttention(8, 2, n_iters=0)


def trained_encoder(batch_first=True):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.0, batch_first=batch_first)
    encoder = torch.nn.TransformerEncoder(layer, num_layers=3, enable_nested_tensor=True)
    # a few optimisation steps so that the weights are no longer at initialisation
    opt = torch.optim.Adam(encoder.parameters(), lr=1e-2)
    x = torch.randn(8, 10, 16)
    target = torch.randn(8, 10, 16)
    for _ in range(5):
        opt.zero_grad()
        torch.nn.functional.mse_loss(encoder(x if batch_first else x.transpose(0, 1)), target if batch_first else target.transpose(0, 1)).backward()
        opt.step()
    return encoder.eval()


@pytest.mark.parametrize("grad", [True, False])
def test_convert_with_one_iteration_keeps_outputs(grad):
    encoder = trained_encoder()
    x = torch.randn(4, 10, 16)
    pad = torch.zeros(4, 10, dtype=torch.bool)
    pad[1, 7:] = True
    with torch.set_grad_enabled(grad):  # no grad + eval + padding: torch's fused/nested fast paths
        before = encoder(x)
        before_pad = encoder(x, src_key_padding_mask=pad)
        model, count = sinkformer.convert(encoder, n_iters=1, return_count=True, verbose=False)
        assert model is encoder and count == 3
        assert all(isinstance(layer.self_attn, MultiheadAttention) for layer in encoder.layers)
        torch.testing.assert_close(encoder(x), before, atol=1e-5, rtol=1e-5)
        after_pad = encoder(x, src_key_padding_mask=pad)
        valid = ~pad
        torch.testing.assert_close(after_pad[valid], before_pad[valid], atol=1e-5, rtol=1e-5)
        # and the converted modules really run (torch's fused encoder path would silently use SoftMax)
        sinkformer.convert(encoder, n_iters=9, verbose=False)
        assert (encoder(x) - before).abs().max() > 1e-3
        assert (encoder(x, src_key_padding_mask=pad)[valid] - before_pad[valid]).abs().max() > 1e-3


def test_convert_with_iterations_makes_attention_doubly_stochastic(caplog):
    encoder = trained_encoder(batch_first=False)
    with caplog.at_level("INFO", logger="sinkformer"):
        sinkformer.convert(encoder, n_iters=31, verbose=True)
    assert "3 attention module(s)" in caplog.text
    captured = []
    for layer in encoder.layers:
        attn = layer.self_attn
        attn.register_forward_hook(
            lambda m, args, kwargs, out: captured.append(m.forward(args[0], args[1], args[2], need_weights=True,
                                                           average_attn_weights=False)[1]),
            with_kwargs=True,
        )
    x = torch.randn(9, 2, 16)
    with torch.no_grad():
        encoder(x)
    assert len(captured) == 3
    for W in captured:
        torch.testing.assert_close(W.sum(-1), torch.ones_like(W.sum(-1)), atol=1e-5, rtol=0)
        torch.testing.assert_close(W.sum(-2), torch.ones_like(W.sum(-2)), atol=1e-3, rtol=0)
    # SoftMax attention of the original model is not doubly stochastic
    sinkformer.convert(encoder, n_iters=1, verbose=False)
    captured.clear()
    with torch.no_grad():
        encoder(x)
    assert max((W.sum(-2) - 1).abs().max().item() for W in captured) > 0.1


def test_convert_selects_with_where_and_warns_when_nothing_found():
    model = torch.nn.Transformer(16, 2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=16)
    _, count = sinkformer.convert(model, 3, where=lambda name, m: name.startswith("encoder"), return_count=True,
                                  verbose=False)
    assert count == 1
    assert isinstance(model.encoder.layers[0].self_attn, MultiheadAttention)
    assert type(model.decoder.layers[0].self_attn) is torch.nn.MultiheadAttention
    with pytest.warns(UserWarning, match="found no torch.nn.MultiheadAttention"):
        sinkformer.convert(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        sinkformer.convert("not a model")


def manual_attention(attn, query, key, **options):
    """``attn`` (a torch/sinkformer MHA, batch first, packed projections) computed by hand with
    :func:`sinkformer.attention` and ``options``."""
    heads = attn.num_heads
    w_q, w_k, w_v = attn.in_proj_weight.chunk(3)
    b_q, b_k, b_v = attn.in_proj_bias.chunk(3)
    q, k, v = ((x @ w.T + b).unflatten(-1, (heads, -1)).transpose(1, 2)
               for x, w, b in ((query, w_q, b_q), (key, w_k, b_k), (key, w_v, b_v)))
    return attn.out_proj(sinkformer.attention(q, k, v, **options).transpose(1, 2).flatten(-2))


def manual_decoder(decoder, tgt, memory, n_iters):
    """torch's post-norm decoder (ReLU, no dropout) with causal Sinkhorn self-attention and SoftMax
    cross-attention, written out."""
    x = tgt
    for layer in decoder.layers:
        x = layer.norm1(x + manual_attention(layer.self_attn, x, x, is_causal=True, n_iters=n_iters))
        x = layer.norm2(x + manual_attention(layer.multihead_attn, x, memory, normalization="softmax"))
        x = layer.norm3(x + layer.linear2(torch.relu(layer.linear1(x))))
    return decoder.norm(x)


@pytest.mark.parametrize("n_iters", [1, 3, 5])
def test_convert_causal_decoder_equals_the_manual_causal_sinkformer(n_iters):
    torch.manual_seed(0)
    model = torch.nn.Transformer(d_model=16, nhead=2, num_encoder_layers=1, num_decoder_layers=2, dim_feedforward=32,
                                 dropout=0.0, batch_first=True, dtype=torch.float64).eval()
    src, tgt = torch.randn(2, 6, 16, dtype=torch.float64), torch.randn(2, 5, 16, dtype=torch.float64)
    mask = model.generate_square_subsequent_mask(5, dtype=torch.float64)
    with torch.no_grad():
        softmax = manual_decoder(model.decoder, tgt, model.encoder(src), n_iters=1)
        torch.testing.assert_close(model(src, tgt, tgt_mask=mask), softmax)  # the manual model is torch's
    with pytest.warns(UserWarning, match="kept 2 decoder cross-attention"):
        sinkformer.convert(model, n_iters=n_iters, causal=True, where=lambda name, m: name.startswith("decoder"))
    with torch.no_grad():
        expected = manual_decoder(model.decoder, tgt, model.encoder(src), n_iters=n_iters)
        torch.testing.assert_close(model(src, tgt, tgt_mask=mask), expected, rtol=0, atol=1e-12)
        torch.testing.assert_close(model(src, tgt, tgt_is_causal=True), expected, rtol=0, atol=1e-12)
    if n_iters > 1:
        assert (expected - softmax).abs().max() > 1e-3
