"""Graph capture: whether it is on, and data-dependent branches that hold under it.

A check or a fallback that depends on the data (are any sums underflowing? could the scores
overflow?) is a Python ``if`` eagerly. Under ``torch.compile`` and ``torch.export`` it is a
``torch.cond`` placed in the graph by :func:`patched`, so that ``fullgraph=True`` traces it and the
compiled call computes what the eager one does.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable

import torch
from torch import Tensor
from torch.fx.experimental.proxy_tensor import get_proxy_mode

__all__ = ["capturing", "exact_path", "patched", "when_dynamo_loads"]


def capturing() -> bool:
    """Whether the code runs under graph capture (``torch.compile``, ``torch.export``, ``torch.jit.trace``,
    or ``make_fx``, which traces the branches of a ``torch.cond`` that is itself in a graph)."""
    return torch.jit.is_tracing() or torch.compiler.is_compiling() or get_proxy_mode() is not None


def patched(value: Tensor, bad: Tensor, exact: Callable[..., Tensor], *operands: Tensor, **constants) -> Tensor:
    """``torch.where(bad, exact(*operands, **constants), value)``, where ``exact`` runs only if some
    entry is ``bad``.

    ``exact`` is a module-level function marked :func:`exact_path`; it reads its tensor ``operands``
    only, and ``constants`` (numbers, strings). Eagerly a Python branch; under graph capture a
    ``torch.cond``, so that ``torch.compile(fullgraph=True)`` and ``torch.export`` trace it with the
    same results. Under capture the operands enter as contiguous copies with contiguous gradients:
    ``torch.cond`` refuses operands that alias each other and branches whose gradients differ in layout."""
    if not capturing():
        return torch.where(bad, exact(*operands, **constants), value) if bool(bad.any()) else value
    name = getattr(exact, "exact_path", None)
    if name is None:
        raise TypeError(f"patched: exact must be a function marked @exact_path, got {exact!r}")
    copies = tuple(x.clone(memory_format=torch.contiguous_format) for x in (value, bad) + operands)
    return _patched_in_graph(name, tuple(constants.items()), *copies)


_EXACT_PATHS: dict[str, Callable[..., Tensor]] = {}


def exact_path(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """Mark ``fn`` as an ``exact`` of :func:`patched` (a graph under capture names it by its name)."""
    name = f"{fn.__module__}.{fn.__qualname__}"
    _EXACT_PATHS[name] = fn
    fn.exact_path = name
    return fn


def _patched_in_graph(name: str, constants: tuple, value: Tensor, bad: Tensor, *operands: Tensor) -> Tensor:
    """:func:`patched` under capture: a ``torch.cond`` on whether any entry is ``bad``.

    Dynamo puts this function into the graph whole (``allow_in_graph``) and AOT autograd traces the
    ``torch.cond`` inside it: Dynamo's own tracing of a ``torch.cond`` (torch 2.13) drops the
    Python attribute writes that follow it in the compiled frame to objects written before it
    (``transformers``' output recording, a cache's bookkeeping); see
    ``tests/attention/test_compile.py::test_compiled_calls_keep_the_callers_python_side_effects``.
    Closures cannot enter a graph, hence the function's name and its constants."""
    exact, kwargs = _EXACT_PATHS[name], dict(constants)

    def replace(v: Tensor, b: Tensor, *xs: Tensor) -> Tensor:
        grads = (_ContiguousGrad.apply(x) if x.is_floating_point() else x for x in xs)
        return (torch.where(b, exact(*grads, **kwargs), v),)

    return torch.ops.higher_order.cond(bad.any(), replace, _unchanged, (value, bad) + operands)[0]


def _allow_in_graph(dynamo) -> None:
    """Put :func:`_patched_in_graph` into Dynamo's graphs whole (``allow_in_graph``)."""
    dynamo.allow_in_graph(_patched_in_graph)


#: what runs once ``torch._dynamo`` has loaded (:func:`when_dynamo_loads`)
_ON_LOAD: list[Callable] = [_allow_in_graph]


def when_dynamo_loads(register: Callable) -> None:
    """Run ``register(torch._dynamo)`` once Dynamo has loaded (now, if it has): a registration with Dynamo that
    must not import it (:class:`_WhenDynamoLoads`)."""
    if "torch._dynamo" in sys.modules:
        register(sys.modules["torch._dynamo"])
    else:
        _ON_LOAD.append(register)


class _WhenDynamoLoads(importlib.abc.MetaPathFinder):
    """Runs the registrations of :func:`when_dynamo_loads` (:func:`_allow_in_graph` first) once ``torch._dynamo``
    has loaded. Importing Dynamo takes seconds, which every
    process that imports sinkformer would pay (the command line, each experiment's worker), and only compiling and
    exporting need it: ``torch.compile`` and ``torch.export`` import it before they trace, so the registration
    precedes every trace."""

    def find_spec(self, name, path, target=None):
        if name != "torch._dynamo":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)  # from the other finders
        if spec is not None and spec.loader is not None:
            load = spec.loader.exec_module

            def exec_module(module) -> None:
                load(module)
                for register in _ON_LOAD:
                    register(module)

            spec.loader.exec_module = exec_module
        return spec


if "torch._dynamo" in sys.modules:
    _allow_in_graph(sys.modules["torch._dynamo"])
else:
    sys.meta_path.insert(0, _WhenDynamoLoads())


def _unchanged(value: Tensor, *others: Tensor) -> tuple[Tensor]:
    return (value.clone(),)


class _ContiguousGrad(torch.autograd.Function):
    """The identity, whose gradient is made contiguous (both branches of a ``torch.cond`` must agree)."""

    @staticmethod
    def forward(x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        pass

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad.contiguous()
