"""The custom-op setup the engines share (tiled, streamed, flash: ``torch.library`` ops)."""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["compute_in_float32_under_autocast", "register_engine_autograd", "refuse_implicit_second_derivatives"]


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


def register_engine_autograd(forward_op: str, backward_op: str, *, n_inputs: int, setup_context: Callable,
                             first_derivatives: Callable, second_derivatives: Callable) -> None:
    """Autograd and autocast of an engine's pair of custom ops (``sinkformer::<engine>_forward`` and
    ``_backward``), the one setup the tiled, streamed and flash engines share.

    ``first_derivatives(ctx, grad_out) -> (dq, dk, dv)`` runs the engine's backward op; under
    ``create_graph=True`` (second derivatives, e.g. gradient penalties) ``second_derivatives(ctx,
    grad_out)`` runs instead and must return differentiable gradients (the engines recompute the weights
    with the dense engine, :func:`~.dense.attention_grads_with_graph`). The ``n_inputs - 3`` inputs
    after ``q, k, v`` get no gradient. Both ops compute in float32 under autocast."""

    def backward(ctx, grad_out, *unused):
        grads = (second_derivatives if torch.is_grad_enabled() else first_derivatives)(ctx, grad_out)
        return tuple(grads) + (None,) * (n_inputs - 3)

    torch.library.register_autograd(forward_op, backward, setup_context=setup_context)
    compute_in_float32_under_autocast(forward_op, backward_op)


def refuse_implicit_second_derivatives(backward: str, engine: str) -> None:
    """``NotImplementedError`` for second derivatives of ``backward="implicit"`` (not implemented)."""
    if backward == "implicit":
        raise NotImplementedError(
            f"second derivatives of backward='implicit' are not implemented (engine {engine!r}); "
            "use backward='unrolled' for double backward (e.g. gradient penalties)"
        )
