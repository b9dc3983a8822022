"""The Sinkhorn core: one problem definition, three engines.

``sinkformer.sinkhorn`` is this package *and* a callable: ``sinkformer.sinkhorn(scores, ...)``
runs :func:`sinkformer.sinkhorn.dense.sinkhorn`, the log-domain reference.

* :mod:`.problem` — what every engine obeys: valid rows/columns, marginals, the meaning of
  ``n_iters`` and ``tol``, the stop rule, the double shift, tile sizes, :class:`SinkhornResult`.
* :mod:`.dense` — the whole matrix, autograd through the iterations (the reference).
* :mod:`.tiled` — scaling domain on cached tiles, exact or implicit custom backward (default).
* :mod:`.streamed` — never an ``n × m`` matrix (long sequences, point clouds, dynamics).
"""

import inspect
import sys
import types

from .dense import log_sinkhorn_loop, sinkhorn
from .problem import CONVERGED_TOL, SinkhornConvergenceWarning, SinkhornResult, double_shift

__all__ = [
    "sinkhorn",
    "SinkhornResult",
    "SinkhornConvergenceWarning",
    "log_sinkhorn_loop",
    "double_shift",
    "CONVERGED_TOL",
]


class _CallableModule(types.ModuleType):
    """Lets ``sinkformer.sinkhorn(scores)`` call the function of the same name."""

    def __call__(self, *args, **kwargs):
        return sinkhorn(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
sys.modules[__name__].__signature__ = inspect.signature(sinkhorn)
