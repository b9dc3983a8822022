import pytest

from sinkformer.data import DATASETS, KINDS, dataset_options, load_dataset
from sinkformer.models import MODELS


def test_unknown_dataset_lists_the_valid_ones():
    with pytest.raises(ValueError, match="unknown dataset 'cifar'; valid datasets: digits, shapes3d"):
        load_dataset("cifar")


def test_loader_options_are_checked():
    with pytest.raises(ValueError, match="dataset 'shapes3d': unknown option.*npoints.*valid options: n_points=256"):
        load_dataset("shapes3d", npoints=10)
    with pytest.raises(TypeError, match="option n_points must be int"):
        load_dataset("shapes3d", n_points="many")
    assert "path" not in dataset_options("imdb") and dataset_options("imdb")["max_len"] == 512


def test_every_kind_has_an_embedded_dataset_and_a_model():
    for kind in KINDS:
        assert any(spec.embedded and spec.kind == kind for spec in DATASETS.values()), kind
        assert any(cls.input_kind == kind for cls in MODELS.values()), kind
