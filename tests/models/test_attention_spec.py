"""The models' one attention vocabulary: one parser, every model switched by ``attention=`` / ``n_iters=``,
the old spellings accepted with a FutureWarning that gives the new one, errors naming the argument."""

import warnings

import pytest
import torch

from sinkformer.models import MODELS, build_model, model_options
from sinkformer.models.attention_spec import (
    ATTENTION_KINDS,
    DENSE_KINDS,
    SPARSE_MODEL_KINDS,
    AttentionConfig,
    renamed_options,
)
from sinkformer.models.seq2seq import Seq2SeqTransformer
from sinkformer.models.set_transformer import SetTransformerClassifier
from sinkformer.models.sinkhorn_transformer import SinkhornClassifier, SinkhornTransformerLM
from sinkformer.models.vit import ViT
from sinkformer.nn import DenseSinkhornSelfAttention, SparseSinkhornAttention
from sinkformer.training.runner import check_config

VIT = dict(n_classes=3, image_size=8, channels=1, patch_size=4, dim=8, depth=1, num_heads=2, dim_feedforward=8)
LM = dict(vocab_size=11, dim=8, depth=1, heads=2, max_len=16)


@pytest.mark.parametrize("spec, kind, fields", [
    ("softmax", "softmax", {}),
    ("sinkhorn", "sinkhorn", {}),
    ("relu", "relu", {}),
    ("local:32", "local", {"block_size": 32}),
    ("fixed:8", "fixed", {"block_size": 8}),
    ("sparse:32", "sparse", {"block_size": 32}),
    ("sparse", "sparse", {"block_size": 16}),
    ("sortcut:2x8", "sortcut", {"block_size": 8, "sortcut_budget": 2}),
    ("mixture:4", "mixture", {"block_size": 4}),
])
def test_every_spec_parses_without_warning_and_round_trips(spec, kind, fields):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = AttentionConfig.parse(spec)
    assert config.kind == kind and all(getattr(config, k) == v for k, v in fields.items())
    assert AttentionConfig.parse(config.spec) == config
    assert set(ATTENTION_KINDS) == set(DENSE_KINDS) | set(SPARSE_MODEL_KINDS)


@pytest.mark.parametrize("old, new, options", [
    ("vanilla", "softmax", {}),
    ("sinkformer", "sinkhorn", {}),
    ("sinkformer:3", "sinkhorn", {"n_iters": 3}),
    ("sinkhorn:32", "sparse:32", {}),
])
def test_old_spellings_warn_with_the_new_one_and_mean_the_same(old, new, options):
    with pytest.warns(FutureWarning, match=f"write '{new}'"):
        config = AttentionConfig.parse(old)
    assert config == AttentionConfig.parse(new, **options)
    with pytest.warns(FutureWarning, match="'softmax'"):
        assert AttentionConfig("vanilla") == AttentionConfig("softmax")


@pytest.mark.parametrize("bad", ["softmax:3", "sparse:", "sparse:x", "sortcut:ax8", "reformer", "sinkhorn:big",
                                 "vanilla:3"])
def test_malformed_specs_name_the_forms(bad):
    with pytest.raises(ValueError, match="attention must be one of 'softmax', 'sinkhorn', 'local:32'"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            AttentionConfig.parse(bad)


def test_every_model_takes_the_vocabulary_and_no_old_option():
    for name in MODELS:
        options = model_options(name)
        assert {"attention", "n_iters"} <= set(options) and not {"normalization", "pool_normalization",
                                                                  "decoder_normalization"} & set(options), name


def test_the_old_model_options_build_the_same_model_with_a_warning():
    for old, new in (({"normalization": "softmax"}, {"attention": "softmax"}),
                     ({"normalization": "sinkhorn", "n_iters": 3}, {"attention": "sinkhorn", "n_iters": 3})):
        torch.manual_seed(0)
        with pytest.warns(FutureWarning, match="normalization=.* is an old spelling, write attention="):
            a = ViT(**VIT, **old)
        torch.manual_seed(0)
        b = ViT(**VIT, **new)
        x = torch.randn(2, 1, 8, 8)
        torch.testing.assert_close(a(x), b(x), rtol=0, atol=0)
    with pytest.warns(FutureWarning, match="option normalization is an old spelling, write attention"):
        model = build_model("vit", {"n_classes": 3, "image_size": 8, "channels": 1}, patch_size=4, dim=8,
                            num_heads=2, normalization="softmax")
    assert model.encoder.layers[0].self_attn.normalization == "softmax"
    with pytest.warns(FutureWarning, match="pool_attention='softmax'"):
        pooled = SetTransformerClassifier(3, dim=8, num_heads=2, num_inducing=2, pool_normalization="softmax")
    assert pooled.pool.mab.attn.normalization == "softmax"
    with pytest.warns(FutureWarning, match="decoder_attention='sinkhorn'"):
        seq = Seq2SeqTransformer(11, dim=8, encoder_layers=1, decoder_layers=1, num_heads=2, dim_feedforward=8,
                                 decoder_normalization="sinkhorn")
    assert seq.decoder.layers[0].self_attn.normalization == "sinkhorn"


def test_an_old_config_file_gives_the_same_plan_with_a_warning():
    new = {"model": {"name": "vit", "attention": "softmax", "dim": 16}, "data": {"name": "digits"}, "train": {}}
    old = {"model": {"name": "vit", "normalization": "softmax", "dim": 16}, "data": {"name": "digits"}, "train": {}}
    with pytest.warns(FutureWarning, match="model 'vit': option normalization"):
        assert check_config(old) == check_config(new)
    with pytest.raises(ValueError, match="give attention only .* got both attention='sinkhorn' and normalization"):
        renamed_options({"attention": "sinkhorn", "normalization": "softmax"}, "model 'vit'")


def test_a_kind_a_model_cannot_build_is_refused_naming_the_argument():
    with pytest.raises(ValueError, match=r"attention must be one of \['softmax', 'sinkhorn'.* the sparse kinds"):
        ViT(**VIT, attention="sparse:4")
    with pytest.raises(ValueError, match="decoder_attention must be one of"):
        Seq2SeqTransformer(11, dim=8, encoder_layers=1, decoder_layers=1, num_heads=2, decoder_attention="local:4")
    with pytest.raises(ValueError, match="'relu' is not served by the Sparse Sinkhorn models"):
        SinkhornClassifier(11, **{k: v for k, v in LM.items() if k != "vocab_size"}, attention="relu")


def test_the_sparse_models_read_n_iters_unless_their_attention_says():
    assert SinkhornTransformerLM(**LM).body.layers[0].self_attn.__class__ is SparseSinkhornAttention  # default
    layer = SinkhornTransformerLM(**LM, attention="sinkhorn", n_iters=3).body.layers[0].self_attn
    assert isinstance(layer, DenseSinkhornSelfAttention) and layer.causal and layer.n_iters == 3
    assert SinkhornTransformerLM(**LM, attention={"kind": "sinkhorn"}, n_iters=2).body.layers[0].self_attn.n_iters == 2
    given = AttentionConfig("sinkhorn", n_iters=4)
    assert SinkhornTransformerLM(**LM, attention=given, n_iters=2).body.layers[0].self_attn.n_iters == 4
