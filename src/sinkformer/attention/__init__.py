"""Attention as a function of ``(q, k, v)``.

``sinkformer.attention`` is this package *and* a callable: ``sinkformer.attention(q, k, v, ...)``
runs :func:`sinkformer.attention.functional.attention` (SoftMax, Sinkhorn, linear, sigmoid,
ReLU; dot or L2 cost), while submodules hold the variants (masks, fast Sinkhorn, sparse).
"""

import sys
import types

from .functional import COSTS, NORMALIZATIONS, attention
from .sparse import SparseSinkhornAttention, sparse_sinkhorn_attention  # Sparse Sinkhorn Attention (issue 7)

__all__ = ["attention", "NORMALIZATIONS", "COSTS", "SparseSinkhornAttention", "sparse_sinkhorn_attention"]


class _CallableModule(types.ModuleType):
    """Lets ``sinkformer.attention(q, k, v)`` call the function of the same name."""

    def __call__(self, *args, **kwargs):
        return attention(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
