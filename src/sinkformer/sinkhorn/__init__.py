"""The Sinkhorn core: one problem definition, several engines (``sinkformer.attention.ENGINES`` lists them).

``sinkformer.sinkhorn`` is the function :func:`sinkformer.sinkhorn.dense.sinkhorn` (the log-domain
reference), which also carries this package's names and submodules as attributes.

* :mod:`.problem` — what every engine obeys: :class:`~.problem.Problem` (the attention problem
  every engine receives), valid rows/columns, marginals, the meaning of ``n_iters`` and ``tol``, the
  stop rule, the double shift, :class:`SinkhornResult`.
* :mod:`.loop` — the Sinkhorn loop and its reverse schedule, written once against the operators an
  engine supplies (dense, tiled in the log domain, flash with ``tol``).
* :mod:`.sizes` — the tile and block sizes (one set of constants); :mod:`.implicit` — the linear
  solve of ``backward="implicit"``; :mod:`.ops` — the custom-op setup the engines share.
* :mod:`.dense` — the whole matrix, autograd through the iterations (the reference).
* :mod:`.tiled` — scaling domain on cached tiles, exact or implicit custom backward (default).
* :mod:`.scaling` — the scaling-domain passes over a tile in cache blocks (tiled and streamed engines);
  :mod:`.native` — the same passes in C for a group of whole slices without masks.
* :mod:`.streamed` — never an ``n × m`` matrix (long sequences, point clouds, dynamics).
* :mod:`.flash` — fused Triton kernels for CUDA tensors, never an ``n × m`` matrix.
* :mod:`.prefix` — every prefix of a causal problem balanced on its own (causal Sinkformers, causal
  block sorting of Sparse Sinkhorn Attention); :mod:`.causal_blocks` — its 2- and 3-iteration form in
  row blocks, never an ``n × n`` matrix.
* :mod:`.cpu_parallel` — whole groups of slices on one Python thread per core (the tiled engine).
"""

from . import (causal_blocks, cpu_parallel, dense, flash, implicit, loop, native, ops, prefix, problem, scaling, sizes,
               streamed, tiled)
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


# ``sinkformer.sinkhorn`` (the attribute of the parent package) is the function ``sinkhorn`` itself, a
# plain function call for torch.compile; it carries this package's names and submodules as attributes.
for _module in (problem, loop, sizes, implicit, ops, dense, scaling, native, tiled, streamed, flash, prefix,
                causal_blocks, cpu_parallel):
    setattr(sinkhorn, _module.__name__.rpartition(".")[2], _module)
for _name in __all__:
    setattr(sinkhorn, _name, globals()[_name])
