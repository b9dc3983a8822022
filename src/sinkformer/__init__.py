"""sinkformer: doubly stochastic attention for PyTorch.

* :func:`sinkformer.sinkhorn` — the log-domain Sinkhorn core.
* :func:`sinkformer.attention` — attention shaped like ``scaled_dot_product_attention`` with
  ``normalization="sinkhorn" | "softmax" | "linear" | "sigmoid" | "relu"``.
* :class:`sinkformer.nn.MultiheadAttention` and :func:`sinkformer.convert` — drop-in modules.
"""

import sys as _sys

from .attention import attention
from .sinkhorn import SinkhornConvergenceWarning, SinkhornResult, sinkhorn
from . import nn
from .nn.convert import convert
from .load import LoadedRun, load_run, predict

# Old paths of the modules that moved to nn/, set here, above both packages (attention/ imports nothing
# from nn/). ``sinkformer.attention`` is the function; the package module is sys.modules' entry.
for _old in (attention, _sys.modules[f"{__name__}.attention"], attention.sparse):
    _old.SparseSinkhornAttention = nn.SparseSinkhornAttention
attention.sparse.SortNet = nn.SortNet
attention.sparse_baselines.BaselineSelfAttention = nn.BaselineSelfAttention

__version__ = "0.1.0"

__all__ = ["sinkhorn", "SinkhornResult", "SinkhornConvergenceWarning", "attention", "nn", "convert",
           "load_run", "predict", "LoadedRun", "__version__"]
