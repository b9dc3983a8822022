"""sinkformer: doubly stochastic attention for PyTorch.

* :func:`sinkformer.sinkhorn` — the log-domain Sinkhorn core.
* :func:`sinkformer.attention` — attention shaped like ``scaled_dot_product_attention`` with
  ``normalization="sinkhorn" | "softmax" | "linear" | "sigmoid" | "relu"``.
* :class:`sinkformer.nn.MultiheadAttention` and :func:`sinkformer.convert` — drop-in modules.
"""

from .attention import attention
from .sinkhorn import SinkhornConvergenceWarning, SinkhornResult, sinkhorn
from . import nn
from .nn.convert import convert
from .load import LoadedRun, load_run, predict

attention.SparseSinkhornAttention = nn.SparseSinkhornAttention  # old path: the module moved to nn/

__version__ = "0.1.0"

__all__ = ["sinkhorn", "SinkhornResult", "SinkhornConvergenceWarning", "attention", "nn", "convert",
           "load_run", "predict", "LoadedRun", "__version__"]
