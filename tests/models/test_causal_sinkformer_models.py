"""Causal Sinkformers in the library's models: the ``sinkhorn`` attention kind of the language model
and decoders, its incremental generation, and the seq2seq decoder's causal Sinkhorn option."""

import pytest
import torch
from conftest import future_gradient

from sinkformer import attention
from sinkformer.models import Seq2SeqTransformer
from sinkformer.models.decoding import greedy_decode
from sinkformer.models.sinkhorn_transformer import (
    AttentionConfig,
    SinkhornSeq2Seq,
    SinkhornTransformerLayer,
    SinkhornTransformerLM,
    decoding_cache,
)
from sinkformer.nn import BaselineSelfAttention, DenseSinkhornSelfAttention, SparseSinkhornCache


def lm(kind="sinkhorn", n_iters=3, max_len=64, vocab=13, seed=0, **kw):
    torch.manual_seed(seed)
    config = AttentionConfig(kind, n_iters=n_iters, block_size=4, stride=2)
    return SinkhornTransformerLM(vocab, dim=16, depth=2, heads=2, max_len=max_len, attention=config, **kw).double()


def test_sinkhorn_kind_parses_builds_and_labels():
    config = AttentionConfig.parse("sinkhorn", n_iters=3)
    assert (config.kind, config.n_iters, config.label) == ("sinkhorn", 3, "Sinkformer (n_iters=3)")
    module = config.build(8, 2, max_len=16, causal=True)
    assert isinstance(module, DenseSinkhornSelfAttention) and module.causal and module.n_iters == 3
    assert AttentionConfig.parse("local:32").block_size == 32 and AttentionConfig.parse("local:32").n_iters == 5
    with pytest.raises(ValueError, match="n_iters must be an int >= 1, got 0"):
        AttentionConfig("sinkhorn", n_iters=0)
    with pytest.raises(ValueError, match="'sparse:32'"):
        AttentionConfig.parse("sinkhorn:x")


@pytest.mark.parametrize("causal", [False, True])
def test_dense_sinkhorn_self_attention_is_the_attention_function(causal):
    torch.manual_seed(0)
    module = DenseSinkhornSelfAttention(8, 2, n_iters=5, causal=causal).double()
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    q, k, v = module.qkv_proj(x).unflatten(-1, (3, 2, 4)).permute(2, 0, 3, 1, 4)
    expected = module.out_proj(attention(q, k, v, n_iters=5, is_causal=causal).transpose(1, 2).flatten(-2))
    torch.testing.assert_close(module(x), expected)
    # n_iters=1 is the vanilla layer with the same weights
    vanilla = BaselineSelfAttention(8, 2, causal=causal).double()
    vanilla.load_state_dict(module.state_dict())
    module.n_iters = 1
    torch.testing.assert_close(module(x), vanilla(x))


@pytest.mark.parametrize("n_iters", [2, 3, 5])
def test_causal_sinkformer_layer_and_lm_do_not_leak(n_iters):
    torch.manual_seed(0)
    layer = SinkhornTransformerLayer(8, 2, AttentionConfig("sinkhorn", n_iters=n_iters), max_len=16, causal=True)
    assert future_gradient(layer, torch.randn(2, 7, 8), t=3) == 0.0
    model = lm(n_iters=n_iters)
    tokens = torch.randint(0, 13, (2, 9))

    def logits_of(embedded):  # the whole model, differentiated through its embedding's output
        handle = model.body.embedding.register_forward_hook(lambda module, inputs, output: embedded)
        try:
            return model(tokens)
        finally:
            handle.remove()

    assert future_gradient(logits_of, model.body.embedding(tokens).detach(), t=3) == 0.0


@pytest.mark.parametrize("kind, n_iters", [("softmax", 1), ("sinkhorn", 1), ("sinkhorn", 3), ("sinkhorn", 5),
                                           ("sparse", 1), ("mixture", 1)])
def test_cached_generation_equals_the_full_forward(kind, n_iters):
    """Greedy, 50 new tokens, float64: each token and its logits are those of the full forward (causal Sparse
    Sinkhorn, blocks of 4: the prompt ends inside a block, and 50 tokens begin 13 more; in eval mode, without
    the Gumbel noise that training draws for each forward)."""
    model = lm(kind, n_iters=n_iters).eval()
    assert len(model.body.decoding_caches()) == 2
    prompt = torch.randint(0, 13, (3, 5))
    tokens, logits = model.generate(prompt, 50, temperature=0, return_logits=True)
    assert tokens.shape == (3, 55) and logits.shape == (3, 50, 13)
    with torch.no_grad():
        full = model(tokens[:, :-1])[:, 4:]  # row t of the full forward: the logits of token t + 1
    torch.testing.assert_close(logits, full, rtol=0, atol=1e-10)
    assert torch.equal(tokens[:, 5:], full.argmax(-1))
    uncached, uncached_logits = model.generate(prompt, 50, temperature=0, return_logits=True, use_cache=False)
    assert torch.equal(uncached, tokens)
    torch.testing.assert_close(uncached_logits, logits, rtol=0, atol=1e-10)


def test_cached_sampling_and_the_sliding_window_match_the_uncached_path():
    model = lm(n_iters=3, max_len=20)
    prompt = torch.randint(0, 13, (2, 4))
    kw = dict(temperature=0.8, top_k=5)
    a = model.generate(prompt, 30, generator=torch.Generator().manual_seed(1), **kw)  # beyond max_len at 21
    b = model.generate(prompt, 30, generator=torch.Generator().manual_seed(1), use_cache=False, **kw)
    assert a.shape == (2, 34) and torch.equal(a, b)
    _, empty = model.generate(prompt, 0, return_logits=True)
    assert empty.shape == (2, 0, 13)


def test_local_and_fixed_patterns_have_no_incremental_state():
    for kind in ("local", "fixed"):
        assert decoding_cache(AttentionConfig(kind, block_size=4).build(8, 2, max_len=16, causal=True)) is None
    assert lm("local").body.decoding_caches() is None  # generate() re-runs the model at each step
    assert decoding_cache(AttentionConfig("softmax").build(8, 2, max_len=16, causal=True)).n_iters == 1
    assert all(isinstance(c, SparseSinkhornCache) for c in lm("sparse").body.decoding_caches())


def test_sinkhorn_seq2seq_decoder_takes_causal_sinkformer_attention():
    torch.manual_seed(0)
    model = SinkhornSeq2Seq(10, dim=16, depth=2, heads=2, max_len=20, attention="sinkhorn", n_iters=3).eval()
    assert isinstance(model.decoder.layers[0].self_attn, DenseSinkhornSelfAttention)
    assert model.decoder.layers[0].self_attn.causal and not model.encoder.layers[0].self_attn.causal
    src, tgt = torch.randint(3, 10, (2, 8)), torch.randint(3, 10, (2, 9))
    changed = tgt.clone()
    changed[:, 5:] = torch.randint(3, 10, (2, 4))
    a, b = model(src, tgt), model(src, changed)
    # equal up to float32 rounding (the causal engine's max-shifts span all rows); the gradient tests show 0 exactly
    torch.testing.assert_close(a[:, :5], b[:, :5], rtol=0, atol=1e-5)
    assert not torch.allclose(a[:, 5:], b[:, 5:])


def test_seq2seq_transformer_decoder_option_is_causal_sinkhorn():
    kw = dict(dim=16, encoder_layers=1, decoder_layers=2, num_heads=2, dim_feedforward=32, dropout=0.0, n_iters=3)
    torch.manual_seed(0)
    sinkformer = Seq2SeqTransformer(11, decoder_attention="sinkhorn", **kw).eval()
    transformer = Seq2SeqTransformer(11, **kw).eval()
    transformer.load_state_dict(sinkformer.state_dict())
    layer = sinkformer.decoder.layers[0]
    assert (layer.self_attn.normalization, layer.multihead_attn.normalization) == ("sinkhorn", "softmax")
    assert transformer.decoder.layers[0].self_attn.normalization == "softmax"
    src, tgt = torch.randint(3, 11, (2, 7)), torch.randint(3, 11, (2, 6))
    changed = tgt.clone()
    changed[:, 4:] = torch.randint(3, 11, (2, 2))
    with torch.no_grad():
        a, b = sinkformer(src, tgt), sinkformer(src, changed)
        softmax = transformer(src, tgt)
    torch.testing.assert_close(a[:, :4], b[:, :4], rtol=0, atol=1e-5)  # float32 rounding, as above
    assert future_gradient(lambda t: sinkformer.decoder(t, sinkformer.encode(src)), torch.randn(2, 6, 16), t=3) == 0.0
    assert (a - softmax).abs().max() > 1e-3  # the decoder really runs Sinkhorn


@pytest.mark.parametrize("spec", ["softmax", {"kind": "sinkhorn", "n_iters": 1}, {"kind": "sinkhorn", "n_iters": 3},
                                  {"kind": "sinkhorn", "n_iters": 5}, {"kind": "sparse", "block_size": 3},
                                  {"kind": "mixture", "block_size": 2, "sort_iters": 2}])
def test_seq2seq_greedy_decoding_is_incremental_and_equals_re_running_the_decoder(spec, monkeypatch):
    torch.manual_seed(0)
    model = SinkhornSeq2Seq(12, dim=16, depth=2, heads=2, max_len=30, attention="softmax", decoder_attention=spec,
                            eos_id=2).double().eval()
    src = torch.randint(3, 12, (3, 9))
    src_pad = torch.zeros(3, 9, dtype=torch.bool)
    src_pad[1, 6:] = True
    memory = model.encode(src, src_pad)
    states = model.decoding_caches()
    tgt = torch.randint(3, 12, (3, 12))
    with torch.no_grad():
        steps = torch.cat([model.decode_step(tgt[:, :4], memory, src_pad, states)]
                          + [model.decode_step(tgt[:, t : t + 1], memory, src_pad, states) for t in range(4, 12)], 1)
        torch.testing.assert_close(steps, model.decode(tgt, memory, src_pad), rtol=0, atol=1e-10)
    cached = greedy_decode(model, src, src_pad)
    monkeypatch.setattr(model, "decoding_caches", lambda: None)  # greedy_decode re-runs the decoder
    assert greedy_decode(model, src, src_pad) == cached
    assert max(len(ids) for ids in cached) > 5  # a real decode, not an immediate <eos>
