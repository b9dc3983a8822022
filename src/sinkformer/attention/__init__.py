"""Attention as a function of ``(q, k, v)``: functions only (modules live in :mod:`sinkformer.nn`).

``sinkformer.attention`` is this package *and* a callable: ``sinkformer.attention(q, k, v, ...)``
runs :func:`sinkformer.attention.functional.attention` (SoftMax, Sinkhorn, linear, sigmoid,
ReLU; dot or L2 cost) on the engine chosen by :mod:`.backends`; :func:`explain` tells which.
Submodules: :mod:`.masks`, :mod:`.backends`, :mod:`.sparse` (functional Sparse Sinkhorn
Attention), :mod:`.sparse_baselines` (local and strided attention).
"""

import inspect
import sys
import types

from .backends import BACKENDS, ENGINES, Choice
from .functional import COSTS, NORMALIZATIONS, attention, explain
from .sparse import sparse_sinkhorn_attention

__all__ = [
    "attention",
    "explain",
    "Choice",
    "NORMALIZATIONS",
    "COSTS",
    "BACKENDS",
    "ENGINES",
    "sparse_sinkhorn_attention",
]


def __getattr__(name: str):
    """Old import paths: the modules moved to :mod:`sinkformer.nn`."""
    if name == "SparseSinkhornAttention":
        from ..nn.sparse import SparseSinkhornAttention

        return SparseSinkhornAttention
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _CallableModule(types.ModuleType):
    """Lets ``sinkformer.attention(q, k, v)`` call the function of the same name."""

    def __call__(self, *args, **kwargs):
        return attention(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
sys.modules[__name__].__signature__ = inspect.signature(attention)
