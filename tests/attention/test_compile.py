"""torch.compile (fullgraph) and torch.export of Sinkhorn attention, and no host synchronisation on CUDA."""

import inspect
import shutil

import pytest
import torch

import sinkformer
from sinkformer.nn import MultiheadAttention, TransformerEncoderLayer

COMPILER = shutil.which("cc") or shutil.which("gcc")


def qkv_and_padding():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8, generator=g).requires_grad_() for _ in range(3))
    pad = torch.zeros(2, 16, dtype=torch.bool)
    pad[0, -3:] = True
    return q, k, v, pad


def eager_and_compiled(fn, args, backend):
    """Outputs and input gradients of ``fn(*args)`` in eager mode and compiled with ``fullgraph=True``."""
    results = []
    for f in (fn, torch.compile(fn, fullgraph=True, backend=backend)):
        torch._dynamo.reset()
        out = f(*args)
        grads = torch.autograd.grad(out.square().sum(), [a for a in args if a.requires_grad])
        results.append((out, grads))
    return results


@pytest.mark.parametrize("n_iters", [1, 3, 5])
def test_functional_fullgraph_forward_and_backward(n_iters):
    """The default engine (tiled) is one opaque custom op each way: no graph break."""
    q, k, v, pad = qkv_and_padding()
    fn = lambda q, k, v, pad: sinkformer.attention(q, k, v, n_iters=n_iters, key_padding_mask=pad)  # noqa: E731
    (out, grads), (out_c, grads_c) = eager_and_compiled(fn, (q, k, v, pad), "aot_eager")
    torch.testing.assert_close(out_c, out, atol=1e-6, rtol=0)
    for a, b in zip(grads_c, grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_compile_the_function_itself_and_the_streamed_engine():
    q, k, v, _ = qkv_and_padding()
    compiled = torch.compile(sinkformer.attention, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, k, v), sinkformer.attention(q, k, v), atol=1e-6, rtol=0)
    streamed = lambda q, k, v: sinkformer.attention(q, k, v, chunk_size=5)  # noqa: E731
    (out, grads), (out_c, grads_c) = eager_and_compiled(streamed, (q, k, v), "aot_eager")
    torch.testing.assert_close(out_c, out, atol=1e-6, rtol=0)
    torch.testing.assert_close(grads_c[0], grads[0], atol=1e-6, rtol=0)


@pytest.mark.parametrize("chunk_size", [None, 5])
def test_tolerance_mode_compiles_with_its_data_dependent_iteration_count(chunk_size):
    """With ``tol`` the saved iterates have a data-dependent length (an unbacked size in the graph)."""
    q, k, v, _ = (t.double() if t.is_floating_point() else t for t in qkv_and_padding())
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    fn = lambda q, k, v: sinkformer.attention(q, k, v, n_iters=None, tol=1e-8, chunk_size=chunk_size)  # noqa: E731
    (out, grads), (out_c, grads_c) = eager_and_compiled(fn, (q, k, v), "aot_eager")
    torch.testing.assert_close(out_c, out, atol=1e-12, rtol=0)
    for a, b in zip(grads_c, grads):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)


def test_modules_compile_fullgraph_and_export():
    """A model using sinkformer.nn.MultiheadAttention compiles without graph breaks and exports."""
    torch.manual_seed(0)
    layer = TransformerEncoderLayer(32, 4, dim_feedforward=64, batch_first=True, dropout=0.0, n_iters=5).eval()
    x = torch.randn(2, 16, 32)
    pad = torch.zeros(2, 16, dtype=torch.bool)
    pad[1, -5:] = True
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, src_key_padding_mask=pad), layer(x, src_key_padding_mask=pad),
                               atol=1e-6, rtol=0)

    class SelfAttention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = MultiheadAttention(32, 4, batch_first=True, n_iters=5)

        def forward(self, x, pad):
            return self.attn(x, x, x, key_padding_mask=pad, need_weights=False)[0]

    model = SelfAttention().eval()
    exported = torch.export.export(model, (x, pad))
    torch.testing.assert_close(exported.module()(x, pad), model(x, pad), atol=1e-6, rtol=0)
    assert any("sinkformer.tiled_forward" in str(node.target) for node in exported.graph.nodes)


def test_hugging_face_backend_compiles_fullgraph():
    transformers = pytest.importorskip("transformers")
    from sinkformer.integrations.huggingface import register

    config = transformers.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.BertModel(config).eval()
    model.set_attn_implementation(register(n_iters=5))
    ids = torch.randint(0, 50, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, -4:] = 0
    eager = model(input_ids=ids, attention_mask=mask).last_hidden_state
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(input_ids=ids, attention_mask=mask).last_hidden_state, eager,
                               atol=1e-5, rtol=0)


@pytest.mark.skipif(COMPILER is None, reason="inductor needs a C++ compiler, none found")
def test_inductor_fullgraph():
    q, k, v, pad = qkv_and_padding()
    fn = lambda q, k, v, pad: sinkformer.attention(q, k, v, key_padding_mask=pad)  # noqa: E731
    (out, grads), (out_c, grads_c) = eager_and_compiled(fn, (q, k, v, pad), "inductor")
    torch.testing.assert_close(out_c, out, atol=1e-5, rtol=0)
    for a, b in zip(grads_c, grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_signatures_are_the_real_ones():
    params = inspect.signature(sinkformer.attention).parameters
    assert list(params)[:3] == ["q", "k", "v"] and "backend" in params and "tol" in params
    assert "scores" in inspect.signature(sinkformer.sinkhorn).parameters
    # the functions still carry their packages' names
    assert sinkformer.attention.explain is sinkformer.attention.functional.explain
    assert sinkformer.sinkhorn.SinkhornResult is sinkformer.SinkhornResult


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n_iters", [1, 5])
def test_no_host_synchronisation_on_cuda(n_iters):
    """The default engine on CUDA tensors (log domain, batched slices) never syncs with the host."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(4, 8, 256, 64, device="cuda", generator=g).requires_grad_() for _ in range(3))
    pad = torch.zeros(4, 256, dtype=torch.bool, device="cuda")
    pad[0, -7:] = True
    sinkformer.attention(q, k, v, n_iters=n_iters, key_padding_mask=pad).sum().backward()  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = sinkformer.attention(q, k, v, n_iters=n_iters, key_padding_mask=pad)
        out.sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = sinkformer.attention(*(t.detach().double() for t in (q, k, v)), n_iters=n_iters, key_padding_mask=pad,
                               backend="dense")
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=0)
