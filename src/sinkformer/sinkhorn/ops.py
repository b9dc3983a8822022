"""The custom-op setup the engines share (tiled, streamed, flash: ``torch.library`` ops)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .._capture import capturing

__all__ = ["autocast_dtype", "compute_in_float32_under_autocast", "register_engine_autograd", "runs_eagerly",
           "refuse_implicit_second_derivatives"]


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast casts matrix products to on ``device_type``, or ``None`` when it is off."""
    try:
        if not torch.is_autocast_enabled(device_type):
            return None
        return torch.get_autocast_dtype(device_type)
    except TypeError:  # torch < 2.4: per-device functions
        if device_type == "cpu":
            return torch.get_autocast_cpu_dtype() if torch.is_autocast_cpu_enabled() else None
        return torch.get_autocast_gpu_dtype() if torch.is_autocast_enabled() else None


def compute_in_float32_under_autocast(*op_names: str) -> None:
    """Make autocast leave the engine ops ``op_names`` alone: their float32 inputs stay float32 and
    autocast is off inside them (the engines compute in float32 on purpose; autocast would turn their
    products into half-precision ones). float64 inputs are never touched. :func:`sinkformer.attention`
    casts q, k, v to the autocast dtype first, so its output dtype is SDPA's."""
    register = getattr(torch.library, "register_autocast", None)
    if register is None:  # torch < 2.5: attention() switches autocast off around the engines itself
        return
    for name in op_names:
        for device_type in ("cpu", "cuda"):
            register(name, device_type, torch.float32)


def register_engine_autograd(forward_op: str, backward_op: str, *, n_inputs: int, forward_impl: Callable,
                             backward_impl: Callable, setup_context: Callable, first_derivatives: Callable,
                             second_derivatives: Callable) -> Callable[..., tuple[Tensor, ...]]:
    """Autograd and autocast of an engine's pair of custom ops (``sinkformer::<engine>_forward`` and
    ``_backward``), the one setup the tiled, streamed and flash engines share; returns the engine's
    forward with autograd, ``forward(*inputs) -> outputs`` (the first output is differentiable).

    ``forward_impl`` and ``backward_impl`` are the ops' functions. Eagerly (:func:`runs_eagerly`: plain
    tensors, no graph capture, no autocast), ``forward`` runs ``forward_impl`` inside a
    ``torch.autograd.Function`` with the same ``setup_context`` (or, when no gradient is wanted, calls it
    directly), and that function's backward calls ``backward_impl``: this skips the custom ops' Python
    dispatch and generated autograd wrapper (tens of microseconds a call each, a cost that weighs at short
    sequences: ``benchmarks/results/ab_issue26_call_overhead.md``). Under graph capture
    (``torch.compile``, ``torch.export``), on tensor subclasses and under autocast, it calls the custom
    ops, which a graph sees as one opaque node each.

    ``first_derivatives(ctx, grad_out, backward) -> (dq, dk, dv)`` calls ``backward`` (the backward op, or
    ``backward_impl`` eagerly) with the engine's saved state; under ``create_graph=True`` (second
    derivatives, e.g. gradient penalties) ``second_derivatives(ctx, grad_out)`` runs instead and must return
    differentiable gradients (the engines recompute the weights with the dense engine,
    :func:`~.dense.attention_grads_with_graph`). The ``n_inputs - 3`` inputs after ``q, k, v`` get no
    gradient. Both ops compute in float32 under autocast."""
    namespace, name = forward_op.split("::")
    op = getattr(getattr(torch.ops, namespace), name)
    backward_call = getattr(getattr(torch.ops, namespace), backward_op.split("::")[1])

    def gradients(ctx, grad_out, eager: bool):
        if grad_out is None:  # not materialised (eagerly): an undefined gradient, e.g. gradcheck's check of it
            return (None,) * n_inputs
        if torch.is_grad_enabled():
            grads = second_derivatives(ctx, grad_out)
        else:
            grads = first_derivatives(ctx, grad_out, backward_impl if eager else backward_call)
        return tuple(grads) + (None,) * (n_inputs - 3)

    def backward(ctx, grad_out, *unused):  # the forward op's: the backward op, a node in any graph
        return gradients(ctx, grad_out, eager=False)

    def eager_backward(ctx, grad_out, *unused):
        return gradients(ctx, grad_out, eager=grad_out is not None and runs_eagerly(grad_out))

    torch.library.register_autograd(forward_op, backward, setup_context=setup_context)
    compute_in_float32_under_autocast(forward_op, backward_op)

    def eager_setup_context(ctx, inputs, output):
        # the other outputs get no gradient; unmaterialised, autograd passes None for them, not zeros of
        # their shapes (the tiles kept for the backward: an n x m memset per slice, 1.9 ms of a 5-iteration
        # forward+backward of 4 x 8 x 256 tokens).
        ctx.mark_non_differentiable(*output[1:])
        ctx.set_materialize_grads(False)
        setup_context(ctx, inputs, output)

    # named after the op, so that autograd's node reads "<engine>_forward_eagerBackward"
    Eager = type(f"{name}_eager", (torch.autograd.Function,), {
        "forward": staticmethod(lambda *inputs: forward_impl(*inputs)),
        "setup_context": staticmethod(eager_setup_context), "backward": staticmethod(eager_backward)})

    def forward(*inputs):
        q, k, v = inputs[:3]
        if not runs_eagerly(q):
            return op(*inputs)
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            return _apply(Eager, inputs)
        return forward_impl(*inputs)

    return forward


def _apply(function: type[torch.autograd.Function], inputs: tuple) -> Any:
    """``function.apply(*inputs)``; outside functorch's transforms without ``Function.apply``'s binding of the
    arguments to ``forward``'s signature (for those transforms; ``inspect.signature``, two thirds of the 14 µs an
    apply took here), which ``function``'s ``forward(*inputs)`` without defaults does not need."""
    if torch._C._are_functorch_transforms_active():
        return function.apply(*inputs)
    return super(torch.autograd.Function, function).apply(*inputs)


def runs_eagerly(t: Tensor) -> bool:
    """Whether an engine call on ``t`` may skip its custom ops (:func:`register_engine_autograd`): a plain
    tensor, no graph capture, autocast off on its device."""
    return type(t) in (Tensor, torch.nn.Parameter) and not capturing() and autocast_dtype(t.device.type) is None


def refuse_implicit_second_derivatives(backward: str, engine: str) -> None:
    """``NotImplementedError`` for second derivatives of ``backward="implicit"`` (not implemented)."""
    if backward == "implicit":
        raise NotImplementedError(
            f"second derivatives of backward='implicit' are not implemented (engine {engine!r}); "
            "use backward='unrolled' for double backward (e.g. gradient penalties)"
        )
