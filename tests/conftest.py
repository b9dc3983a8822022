import contextlib
import os

import pytest
import torch

# Triton's interpreter (the flash engine's kernels on CPU tensors) is chosen when triton is first
# imported: its own jitted helpers are then built for it or for a GPU, for the whole process. Any test
# module may import triton first (directly, through the flash engine, or through torch.compile's
# checks for it), so it is switched on here, before every test module, wherever no GPU could compile
# the kernels. With CUDA present the kernels compile for the GPU and the CPU-interpreted tests skip.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


#: Cells of the conformance grid (tests/conformance/test_engines.py) that run only with ``pytest -m slow``
#: where the flash engine's kernels run in Triton's interpreter (no GPU), each program instance in
#: Python: its cells with 21 iterations, a tolerance or the implicit backward took 4-14 s each there,
#: the default suite's slowest tests (2026-11-27), and its 5-iteration autocast cells 2-3 s each. The
#: default suite keeps these cells for the plain case in every dtype (the same kernels and the same loop,
#: without a mask), the implicit backward in float32, and every mask at 1 to 5 iterations; on a GPU every
#: cell runs.
INTERPRETED_SLOW = {
    "test_forward_and_gradients": lambda params: params.get("n_iters") == 21,
    "test_tolerance_mode": lambda params: True,
    "test_implicit_backward": lambda params: params.get("dtype") == torch.float64,
    "test_autocast": lambda params: params.get("n_iters") == 5,
}


def interpreted_and_slow(name: str, params: dict) -> bool:
    """Whether a conformance cell is a flash cell of another case than ``plain`` that :data:`INTERPRETED_SLOW`
    calls long, on a machine where the flash engine is interpreted."""
    long = INTERPRETED_SLOW.get(name.split("[")[0])
    return (long is not None and not torch.cuda.is_available() and params.get("engine") == "flash"
            and params.get("case_name") != "plain" and long(params))


def pytest_collection_modifyitems(config, items):
    for item in items:
        callspec = getattr(item, "callspec", None)
        if (callspec is not None and item.path.name == "test_engines.py" and item.path.parent.name == "conformance"
                and interpreted_and_slow(item.name, callspec.params)):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@contextlib.contextmanager
def torch_threads(count: int):
    """``count`` torch intra-op threads within the block, the count before restored after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def two_threads():
    """Two torch intra-op threads for the test (the engine's Python threads and crews use one per thread)."""
    with torch_threads(2):
        yield


def nr_nc_reference(scores: torch.Tensor, n_iters: int) -> torch.Tensor:
    """Eq. (3) of the Sinkformers paper, literally: alternate NR and NC on K0 = exp(C) (float64)."""
    K = torch.exp(scores.double())
    for it in range(n_iters):
        K = K / K.sum(-1, keepdim=True) if it % 2 == 0 else K / K.sum(-2, keepdim=True)
    return K


def future_gradient(fn, x: torch.Tensor, t: int = 2) -> float:
    """max |d (out[:, :t+1] . w) / d x[:, t+1:]| for ``fn(x) -> (batch, n, ...)`` (``w`` random: a plain
    sum of layer-normalised outputs is constant), after checking that the past's gradient does not
    vanish. Zero means no leak from the future."""
    x = x.clone().requires_grad_()
    out = fn(x)
    w = torch.randn(out[:, : t + 1].shape, generator=torch.Generator().manual_seed(5), dtype=out.dtype)
    (grad,) = torch.autograd.grad((out[:, : t + 1] * w).sum(), x)
    assert grad[:, : t + 1].abs().max() > 1e-4
    return grad[:, t + 1 :].abs().max().item()
