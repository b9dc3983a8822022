import dataclasses

import pytest
import torch
from torch.utils.data import Subset

from sinkformer.data import load_dataset
from sinkformer.models import MODELS, build_model, get_model_class, model_options
from sinkformer.training import train

# Tiny configurations of every model on its embedded dataset (dropout off: the loss must fall).
TINY = {
    "set_transformer": ("shapes3d", dict(dim=16, num_heads=2, num_inducing=4, dropout=0.0)),
    "point_cloud_transformer": (
        "shapes3d", dict(dim=8, n_samples=(16, 8), k_neighbors=4, n_attention_layers=2, dropout=0.0)
    ),
    "text_classifier": ("sentiment", dict(dim=16, depth=1, num_heads=2, dim_feedforward=32, dropout=0.0)),
    "vit": ("digits", dict(patch_size=4, dim=16, depth=1, num_heads=2, dim_feedforward=32)),
    "vit_attention_only": ("digits", dict(patch_size=4, dim=16)),
    "seq2seq": (
        "translation",
        dict(dim=16, encoder_layers=1, decoder_layers=1, num_heads=2, dim_feedforward=32, dropout=0.0),
    ),
    # Sparse Sinkhorn Attention's models, switched by attention=
    "sinkhorn_classifier": ("sentiment", dict(dim=16, depth=1, heads=2, attention="sparse:4")),
    "sinkhorn_seq2seq": ("translation", dict(dim=16, depth=1, heads=2, attention="sparse:4", max_len=64)),
    "sinkhorn_lm": ("stdlib_text", dict(dim=16, depth=1, heads=2, attention="sparse:8")),
}
DATA_OPTIONS = {
    "shapes3d": dict(n_points=32, n_train=2, n_test=1, augment=False),
    "sentiment": dict(n_train=64, n_test=8, vocab_size=64),
    "digits": {},
    "translation": dict(n_train=64, n_test=8, vocab_size=96),
    "stdlib_text": dict(seq_len=32, max_chars=20_000),
}


@pytest.fixture(scope="module")
def datasets():
    return {name: load_dataset(name, **opts) for name, opts in DATA_OPTIONS.items()}


def test_every_model_is_covered():
    assert set(TINY) == set(MODELS)


def test_every_model_is_switched_by_attention_and_n_iters():
    """One vocabulary: no model lists the old option names."""
    for name in MODELS:
        options = model_options(name)
        assert "attention" in options and "n_iters" in options and "normalization" not in options, name


@pytest.mark.parametrize("name", sorted(MODELS))
def test_transformer_and_sinkformer_have_identical_parameters(name, datasets):
    data_name, options = TINY[name]
    models = []
    for attention in ("softmax", "sinkhorn"):
        torch.manual_seed(0)
        models.append(build_model(name, datasets[data_name].info, **{**options, "attention": attention, "n_iters": 3}))
    softmax, sinkhorn = (dict(m.state_dict()) for m in models)
    assert list(softmax) == list(sinkhorn)
    for key in softmax:
        assert torch.equal(softmax[key], sinkhorn[key]), key


@pytest.mark.parametrize("name", sorted(MODELS))
def test_each_model_trains_on_its_embedded_data(name, datasets):
    """A few steps on 16 embedded examples (one batch per epoch): the training loss falls."""
    data_name, options = TINY[name]
    data = datasets[data_name]
    data = dataclasses.replace(data, train=Subset(data.train, range(16)), test=Subset(data.test, range(4)))
    if data_name == "translation":
        data.test.references = data.test.dataset.references
    torch.manual_seed(0)
    switch = {} if "attention" in options else dict(attention="sinkhorn", n_iters=3)
    model = build_model(name, data.info, **switch, **options)
    lr = 2e-2 if name == "vit_attention_only" else 5e-3  # its position embeddings dominate at first
    result = train(model, data, dict(epochs=8, batch_size=16, lr=lr, progress=False))
    losses = [row["train_loss"] for row in result.history]
    assert losses[-1] < 0.9 * losses[0], losses


def test_build_model_reports_mistakes(datasets):
    with pytest.raises(ValueError, match="valid models: set_transformer"):
        build_model("resnet")
    with pytest.raises(ValueError, match="reads images but the dataset gives points"):
        build_model("vit", datasets["shapes3d"].info)
    with pytest.raises(ValueError, match="unknown option.*dimension.*valid options"):
        build_model("vit", datasets["digits"].info, dimension=3)
    with pytest.raises(TypeError, match="option depth must be int"):
        build_model("vit", datasets["digits"].info, depth=1.5)
    with pytest.raises(ValueError, match="needs image_size"):
        build_model("vit", {"n_classes": 3})
    with pytest.raises(ValueError, match="patch_size must divide image_size=8"):
        build_model("vit", datasets["digits"].info, patch_size=3)
    with pytest.raises(ValueError, match="n_samples\\[0\\]"):
        build_model("point_cloud_transformer", datasets["shapes3d"].info, n_samples=(64, 8), k_neighbors=4)(
            torch.randn(1, 32, 3)
        )
    assert get_model_class("vit").input_kind == "images"


def test_set_transformer_is_permutation_invariant(datasets):
    torch.manual_seed(0)
    model = build_model("set_transformer", datasets["shapes3d"].info, **TINY["set_transformer"][1]).eval()
    x = torch.randn(2, 20, 3)
    torch.testing.assert_close(model(x), model(x[:, torch.randperm(20)]), atol=1e-5, rtol=1e-5)


def test_text_classifier_ignores_padding(datasets):
    torch.manual_seed(0)
    model = build_model("text_classifier", datasets["sentiment"].info, **TINY["text_classifier"][1]).eval()
    tokens = torch.tensor([[5, 9, 7, 12]])
    padded = torch.tensor([[5, 9, 7, 12, 0, 0]])
    mask = padded == 0
    torch.testing.assert_close(model(padded, mask), model(tokens), atol=1e-5, rtol=1e-5)


def test_seq2seq_is_causal_and_ignores_source_padding(datasets):
    torch.manual_seed(0)
    model = build_model("seq2seq", datasets["translation"].info, **TINY["seq2seq"][1]).eval()
    src, tgt = torch.tensor([[7, 8, 9, 2]]), torch.tensor([[1, 10, 11, 12, 13]])
    logits = model(src, tgt)
    other = tgt.clone()
    other[0, 3:] = torch.tensor([20, 21])
    torch.testing.assert_close(model(src, other)[:, :3], logits[:, :3])
    padded_src = torch.tensor([[7, 8, 9, 2, 0, 0]])
    torch.testing.assert_close(model(padded_src, tgt, padded_src == 0), logits, atol=1e-5, rtol=1e-5)


def test_seq2seq_uses_sinkhorn_in_the_encoder_only(datasets):
    model = build_model("seq2seq", datasets["translation"].info, **TINY["seq2seq"][1])
    assert all(layer.self_attn.normalization == "sinkhorn" for layer in model.encoder.layers)
    for layer in model.decoder.layers:
        assert layer.self_attn.normalization == "softmax" and layer.multihead_attn.normalization == "softmax"
