"""How an engine's forward is dispatched (sinkhorn/ops.py): eagerly a plain autograd.Function around
the op's function, under autocast or graph capture the custom op; both give the same values and gradients."""

import pytest
import torch

from sinkformer.sinkhorn import ops, sizes, streamed, tiled


def _inputs(n=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(6, n, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3)]


def _tiled_op_args(q, k, v):
    group = sizes.group_size(q.shape[0], q.shape[1], k.shape[1], q.device)
    return (q, k, v, None, None, [2, 3], 0.5, 5, None, 1000, None, "unrolled", 0.0, "auto", group,
            sizes.CACHE_BLOCK_ELEMENTS)


@pytest.mark.parametrize("engine", ["tiled", "streamed"])
def test_the_eager_function_equals_the_custom_op(engine):
    q, k, v = _inputs()
    grad_out = torch.randn(6, 12, 8, dtype=torch.float64)
    if engine == "tiled":
        args = _tiled_op_args(q, k, v)
        eager, op = tiled._forward_autograd, torch.ops.sinkformer.tiled_forward
    else:
        args = (q, k, v, None, None, [2, 3], 0.5, 5, None, 1000, 5)
        eager, op = streamed._forward_autograd, torch.ops.sinkformer.streamed_forward
    out_eager, out_op = eager(*args)[0], op(*args)[0]
    assert f"{engine}_forward_eager" in type(out_eager.grad_fn).__name__
    assert "eager" not in type(out_op.grad_fn).__name__
    assert torch.equal(out_eager, out_op)
    grads_eager = torch.autograd.grad(out_eager, (q, k, v), grad_out)
    for a, b in zip(grads_eager, torch.autograd.grad(out_op, (q, k, v), grad_out)):
        assert torch.equal(a, b)


def test_without_gradients_the_function_is_called_directly():
    q, k, v = (t.detach() for t in _inputs())
    out = tiled._forward_autograd(*_tiled_op_args(q, k, v))[0]
    assert out.grad_fn is None
    assert torch.equal(out, torch.ops.sinkformer.tiled_forward(*_tiled_op_args(q, k, v))[0])


def test_autocast_and_capture_take_the_custom_op(monkeypatch):
    q, k, v = (t.detach().float().requires_grad_() for t in _inputs())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = tiled._forward_autograd(*_tiled_op_args(q, k, v))[0]
    assert out.dtype == torch.float32 and "eager" not in type(out.grad_fn).__name__
    monkeypatch.setattr(ops, "capturing", lambda: True)
    assert "eager" not in type(tiled._forward_autograd(*_tiled_op_args(q, k, v))[0].grad_fn).__name__


def test_second_derivatives_through_the_eager_function():
    q, k, v = _inputs(n=5)
    out = tiled._forward_autograd(*_tiled_op_args(q, k, v))[0]
    (dq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    (ddq,) = torch.autograd.grad(dq.sum(), q)
    out_op = torch.ops.sinkformer.tiled_forward(*_tiled_op_args(q, k, v))[0]
    (dq_op,) = torch.autograd.grad(out_op.square().sum(), q, create_graph=True)
    (ddq_op,) = torch.autograd.grad(dq_op.sum(), q)
    torch.testing.assert_close(ddq, ddq_op, rtol=0, atol=1e-12)
