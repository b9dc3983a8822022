"""Which cells of the conformance grid run only with ``pytest -m slow``.

On a machine without a GPU the flash engine's kernels run in Triton's interpreter, each program
instance in Python: a float64 cell with 21 iterations or a tolerance took 4-14 s there (the
default suite's slowest tests, 2026-11-27). The default suite keeps, for the flash engine, every
float32 cell and the float64 cells of the plain case, which run the same kernels and the same
loop; the float64 cells of the other cases with 21 iterations or a tolerance run under ``-m slow``
(as does every cell on a GPU, where nothing is interpreted).
"""

from __future__ import annotations

import pytest
import torch

#: (test, what makes the cell long) of the flash cells the default suite leaves to ``-m slow``
INTERPRETED_SLOW = {
    "test_forward_and_gradients": lambda params: params.get("n_iters") == 21,
    "test_tolerance_mode": lambda params: True,
}


def interpreted_and_slow(name: str, params: dict) -> bool:
    """Whether a cell is a flash float64 cell of another case than ``plain`` that :data:`INTERPRETED_SLOW`
    calls long, on a machine where the flash engine is interpreted (no GPU)."""
    long = INTERPRETED_SLOW.get(name.split("[")[0])
    return (long is not None and not torch.cuda.is_available() and params.get("engine") == "flash"
            and params.get("dtype") == torch.float64 and params.get("case_name") != "plain" and long(params))


def pytest_collection_modifyitems(config, items):
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and interpreted_and_slow(item.name, callspec.params):
            item.add_marker(pytest.mark.slow)
