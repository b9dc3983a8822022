"""Attention as a function of ``(q, k, v)``: functions only (modules live in :mod:`sinkformer.nn`).

``sinkformer.attention`` is the function :func:`sinkformer.attention.functional.attention`, which
also carries this package's names (``sinkformer.attention.explain``, ``sinkformer.attention.masks``);
``sinkformer.attention(q, k, v, ...)`` runs it (SoftMax, Sinkhorn, linear, sigmoid,
ReLU; dot or L2 cost) on the engine chosen by :mod:`.backends`; :func:`explain` tells which.
Submodules: :mod:`.masks`, :mod:`.backends` (the engine registry), :mod:`.engines` (the built-in engines), :mod:`.causal` (incremental decoding of causal
Sinkhorn attention), :mod:`.sparse` (functional Sparse Sinkhorn Attention), :mod:`.sparse_baselines`
(local and strided attention).
"""

from . import backends, causal, engines, functional, masks, sparse, sparse_baselines
from .backends import BACKENDS, ENGINES, Choice
from .causal import CausalSinkhornCache
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
    "CausalSinkhornCache",
]


# ``sinkformer.attention`` (the attribute of the parent package) is the function ``attention`` itself,
# so that ``sinkformer.attention(q, k, v)`` is a plain function call, which torch.compile traces (it
# cannot call a module object). The function carries this package's public names and submodules as
# attributes, so ``sinkformer.attention.explain`` and ``import sinkformer.attention.masks`` keep working.
for _module in (backends, causal, engines, functional, masks, sparse, sparse_baselines):
    setattr(attention, _module.__name__.rpartition(".")[2], _module)
for _name in __all__:
    setattr(attention, _name, globals()[_name])
