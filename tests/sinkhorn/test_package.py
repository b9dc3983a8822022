"""``sinkformer.sinkhorn`` is a function that carries its package's submodules as attributes."""

import importlib
import pkgutil

import sinkformer


def test_every_public_submodule_is_an_attribute_of_the_function():
    package = importlib.import_module("sinkformer.sinkhorn")  # the package; the parent's attribute is the function
    names = [m.name for m in pkgutil.iter_modules(package.__path__) if not m.name.startswith("_")]
    assert "flash" in names and "tiled" in names
    missing = [name for name in names if not hasattr(sinkformer.sinkhorn, name)]
    assert missing == [], f"submodules not reachable as sinkformer.sinkhorn.<name>: {missing}"
