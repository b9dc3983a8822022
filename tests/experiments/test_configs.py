"""Every configuration shipped in sinkformer/configs is its experiment's configuration, key for key."""

import pytest

from sinkformer.configs import names
from sinkformer.experiments.sinkformers.modelnet import AUTHORS_SINKFORMER
from sinkformer.runs.registry import get
from sinkformer.training import TrainConfig
from sinkformer.training.runner import check_config, read_config_file


def config(name: str, full: bool) -> dict:
    exp = get(name)
    return {**exp.defaults, **exp.full} if full else dict(exp.defaults)


def sinkformer(model: str, n_iters: int, options: dict) -> dict:
    return {"name": model, "attention": "sinkhorn", "n_iters": n_iters, **options}


def modelnet_set():
    cfg = config("modelnet", full=True)
    assert 21 in cfg["set_n_iters"]  # Table 1's Set Sinkformer, as the authors' code builds it
    return (sinkformer("set_transformer", 21, {**cfg["set_model"], **AUTHORS_SINKFORMER}),
            {"name": cfg["dataset"], **cfg["set_data"]}, cfg["set_train"])


def modelnet_pct():
    cfg = config("modelnet", full=True)
    return (sinkformer("point_cloud_transformer", cfg["pct_n_iters"], cfg["pct_model"]),
            {"name": cfg["pct_dataset"], **cfg["pct_data"]}, cfg["pct_train"])


def quick_set():
    cfg = config("modelnet", full=False)
    return (sinkformer("set_transformer", max(cfg["set_n_iters"]), cfg["set_model"]),
            {"name": cfg["dataset"], **cfg["set_data"]}, cfg["set_train"])


def paired_model(name: str, model: str, full: bool):
    cfg = config(name, full)
    return sinkformer(model, cfg["n_iters"], cfg["model_options"]), {"name": cfg["dataset"], **cfg["data_options"]}, cfg["train"]


def patch_size():
    cfg = config("patch-size", full=True)
    model = sinkformer("vit_attention_only", cfg["n_iters"], {"patch_size": 7, **cfg["model_options"]})
    assert 7 in cfg["patch_sizes"]
    return model, {"name": cfg["dataset"], **cfg["data_options"]}, {**cfg["train"], "lr": cfg["sinkformer_lr"]}


EXPECTED = {
    "set_transformer_modelnet40": modelnet_set,
    "pct_modelnet40": modelnet_pct,
    "quick_set_transformer_shapes3d": quick_set,
    "text_classifier_imdb": lambda: paired_model("sentiment", "text_classifier", full=True),
    "vit_cats_dogs": lambda: paired_model("vit", "vit", full=True),
    "quick_vit_digits": lambda: paired_model("vit", "vit", full=False),
    "seq2seq_iwslt14": lambda: paired_model("translation", "seq2seq", full=True),
    "vit_attention_only_mnist": patch_size,
}


def test_every_shipped_configuration_is_held_to_an_experiment():
    assert sorted(EXPECTED) == names()


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_shipped_configuration_equals_its_experiments(name):
    shipped = read_config_file(name)
    model, data, train = EXPECTED[name]()
    assert shipped["model"] == model
    assert {k: v for k, v in shipped["data"].items() if k != "path"} == data  # the path is where the user keeps it
    assert TrainConfig.from_dict(shipped["train"]) == TrainConfig.from_dict(train)
    check_config(shipped)  # and `sinkformer train --config NAME` accepts every option
