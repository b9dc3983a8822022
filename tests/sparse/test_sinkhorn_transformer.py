"""Sinkhorn Transformer models and baselines: every attention kind, causality, padding, sampling."""

import pytest
import torch

from sinkformer.attention import SparseSinkhornAttention
from sinkformer.attention.sparse_baselines import BaselineSelfAttention
from sinkformer.models.attention_spec import SPARSE_MODEL_KINDS
from sinkformer.models.sinkhorn_transformer import (
    AttentionConfig,
    SinkhornClassifier,
    SinkhornSeq2Seq,
    SinkhornTransformerLM,
)

CAUSAL_KINDS = [k for k in SPARSE_MODEL_KINDS if k != "sortcut"]


def small(kind, **kw):
    return dict(dim=16, depth=2, heads=2, max_len=40, attention=AttentionConfig(kind, block_size=4, stride=2), **kw)


def test_attention_config_parses_specs_dicts_and_configs():
    sortcut = AttentionConfig.parse("sortcut:2x8", temperature=0.5)
    assert (sortcut.kind, sortcut.sortcut_budget, sortcut.block_size, sortcut.temperature) == ("sortcut", 2, 8, 0.5)
    assert AttentionConfig.parse("local:32").label == "Local Attention (32)"
    assert AttentionConfig.parse({"kind": "fixed", "stride": 4}) == AttentionConfig("fixed", stride=4)
    assert AttentionConfig.parse(sortcut, block_size=4).block_size == 4 and AttentionConfig.parse(None) == AttentionConfig()
    with pytest.raises(ValueError, match="attention must be one of 'softmax', 'sinkhorn'"):
        AttentionConfig.parse("sparse:big")
    with pytest.raises(TypeError, match="attention must be"):
        AttentionConfig.parse(16)


def test_attention_config_builds_the_right_module_and_labels():
    assert isinstance(AttentionConfig("local").build(8, 2, max_len=16, causal=False), BaselineSelfAttention)
    m = AttentionConfig("sortcut", block_size=8, sortcut_budget=2).build(8, 2, max_len=16, causal=False)
    assert isinstance(m, SparseSinkhornAttention) and m.sortcut_budget == 2
    assert AttentionConfig("mixture").build(8, 2, max_len=16, causal=True).mixture
    assert AttentionConfig("sortcut", block_size=8).label == "SortCut Sinkhorn (2x8)"
    assert AttentionConfig("fixed", block_size=32).label == "Sparse Transformer (32)"
    with pytest.raises(ValueError, match="encoder-only"):
        AttentionConfig("sortcut").build(8, 2, max_len=16, causal=True)
    with pytest.raises(ValueError, match="attention kind must be one of"):
        AttentionConfig("reformer")


@pytest.mark.parametrize("kind", CAUSAL_KINDS)
def test_language_model_is_causal(kind):
    torch.manual_seed(0)
    lm = SinkhornTransformerLM(11, **small(kind)).eval()
    tokens = torch.randint(0, 11, (2, 27))
    changed = tokens.clone()
    changed[:, 14:] = torch.randint(0, 11, (2, 13))
    a, b = lm(tokens), lm(changed)
    assert a.shape == (2, 27, 11)
    torch.testing.assert_close(a[:, :14], b[:, :14], atol=0, rtol=0)
    assert not torch.allclose(a[:, 14:], b[:, 14:])


def test_generation_samples_reproducibly_and_greedy_is_argmax():
    torch.manual_seed(0)
    lm = SinkhornTransformerLM(7, **small("sparse"))
    prompt = torch.randint(0, 7, (2, 5))
    a = lm.generate(prompt, 8, generator=torch.Generator().manual_seed(1), top_k=3)
    b = lm.generate(prompt, 8, generator=torch.Generator().manual_seed(1), top_k=3)
    assert a.shape == (2, 13) and torch.equal(a, b) and torch.equal(a[:, :5], prompt)
    assert lm.training  # mode restored
    greedy = lm.generate(prompt, 3, temperature=0)
    lm.eval()
    step = prompt
    for _ in range(3):
        step = torch.cat([step, lm(step)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(greedy, step)
    long = lm.generate(torch.randint(0, 7, (2, 38)), 4, temperature=0.7)  # beyond max_len: a sliding window
    assert long.shape == (2, 42)


@pytest.mark.parametrize("kind", SPARSE_MODEL_KINDS)
def test_classifier_ignores_padding(kind):
    torch.manual_seed(0)
    model = SinkhornClassifier(13, 3, **small(kind)).eval()
    tokens = torch.randint(1, 13, (1, 9))
    padded = torch.cat([tokens, torch.zeros(1, 10, dtype=torch.long)], 1)
    pad = padded == 0
    torch.testing.assert_close(model(padded, pad), model(tokens), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["sparse", "mixture"])
def test_seq2seq_gradients_reach_every_parameter(kind):
    torch.manual_seed(0)
    model = SinkhornSeq2Seq(10, **small(kind))
    src, tgt = torch.randint(3, 10, (4, 14)), torch.randint(3, 10, (4, 11))
    logits = model(src, tgt, src_padding_mask=torch.zeros(4, 14, dtype=torch.bool))
    assert logits.shape == (4, 11, 10)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), src[:, :11].flatten()).backward()
    for name, p in model.named_parameters():
        if name.startswith("encoder.embedding") or "sort_net.weights" in name or "proj" in name:
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_sortcut_encoder_needs_a_causal_decoder_attention():
    with pytest.raises(ValueError, match="encoder-only"):
        SinkhornSeq2Seq(10, **small("sortcut"))
    model = SinkhornSeq2Seq(10, **small("sortcut"), decoder_attention=AttentionConfig("sparse", block_size=4))
    assert model(torch.randint(3, 10, (2, 12)), torch.randint(3, 10, (2, 12))).shape == (2, 12, 10)
