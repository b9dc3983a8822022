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


@pytest.mark.skipif(COMPILER is None, reason="inductor needs a C++ compiler, none found")
@pytest.mark.parametrize("case", ["dense attention", "sinkhorn", "sinkhorn scaling domain", "sinkhorn no mask"])
def test_inductor_compiles_the_dense_engine_with_masks(case):
    """Masks reduced as bytes in eager mode (``any_along``) are plain bool reductions under capture: inductor's
    C++ code for the bytes viewed as bools did not compile on the CPU (torch 2.13)."""
    q, k, v, pad = qkv_and_padding()
    if case == "dense attention":
        fn = lambda q, k, v, pad: sinkformer.attention(q, k, v, key_padding_mask=pad, backend="dense")  # noqa: E731
        args = (q, k, v, pad)
    else:
        domain = "scaling" if "scaling" in case else "log"
        fn = lambda S, *keep: sinkformer.sinkhorn(S, 4, mask=keep[0] if keep else None, domain=domain)  # noqa: E731
        keep = torch.rand(2, 4, 16, 16, generator=torch.Generator().manual_seed(1)) > 0.3
        args = ((q @ k.transpose(-1, -2)).detach().requires_grad_(),) + (() if "no mask" in case else (keep,))
    (out, grads), (out_c, grads_c) = eager_and_compiled(fn, args, "inductor")
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


# ---- issue 23.2-3: causal Sinkhorn traces without graph breaks; the protective checks survive compile ------


@pytest.mark.parametrize("n_iters", [pytest.param(2, marks=pytest.mark.slow), 3, 5])
def test_causal_sinkhorn_compiles_fullgraph(n_iters):
    """2-3 iterations (row blocks), 5 (matrix products of scalings, log-sum-exps where they underflow): no
    data-dependent branch left."""
    assert_causal_compiled_equals_eager(n_iters, "aot_eager", out_atol=1e-6)


def assert_causal_compiled_equals_eager(n_iters, backend, *, out_atol):
    """Causal Sinkhorn with key padding compiled with ``fullgraph=True``: outputs and gradients of eager mode."""
    q, k, v, pad = qkv_and_padding()
    fn = lambda q, k, v, pad: sinkformer.attention(q, k, v, is_causal=True, n_iters=n_iters,  # noqa: E731
                                                   key_padding_mask=pad)
    (out, grads), (out_c, grads_c) = eager_and_compiled(fn, (q, k, v, pad), backend)
    torch.testing.assert_close(out_c, out, atol=out_atol, rtol=0)
    for a, b in zip(grads_c, grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize("n_iters", [3, 5])
def test_compiled_causal_sinkhorn_takes_the_exact_paths_where_sums_underflow(n_iters, monkeypatch):
    """Scores spanning ~1e3: rows whose sums underflow come from the log domain, log-sum-exp products
    that underflow are recomputed exactly; compiled, these are torch.cond branches, same results."""
    from sinkformer.sinkhorn import causal_blocks, prefix
    from sinkformer.sinkhorn.problem import Problem

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 12, 4, generator=g) for _ in range(3))
    q, k = 12 * q, 12 * k
    fn = lambda q, k, v: sinkformer.attention(q, k, v, is_causal=True, n_iters=n_iters)  # noqa: E731
    if n_iters == 3:  # some rows underflow (not all)
        flat = [t.flatten(0, 1) for t in (q, k, v)]
        inexact = causal_blocks.causal_block_attention(Problem(*flat, None, None, (2,), 0.5, 3))[1]
        assert inexact.any() and not inexact.all()
    else:  # some products underflow
        taken = []
        with monkeypatch.context() as patch:
            patch.setattr(prefix, "_exact_log_matmul", lambda *a, f=prefix._exact_log_matmul: taken.append(1) or f(*a))
            fn(q, k, v)
        assert taken
    (out, grads), (out_c, grads_c) = eager_and_compiled(fn, (q.requires_grad_(), k.requires_grad_(), v), "aot_eager")
    torch.testing.assert_close(out_c, out, atol=1e-6, rtol=0)
    for a, b in zip(grads_c, grads):
        torch.testing.assert_close(a, b, atol=1e-4 * max(1.0, b.abs().max().item()), rtol=0)


@pytest.mark.parametrize("n_iters", [pytest.param(3, marks=pytest.mark.slow), 5])
def test_causal_multihead_attention_compiles_and_exports(n_iters):
    torch.manual_seed(0)
    mha = MultiheadAttention(16, 2, batch_first=True, n_iters=n_iters).eval()
    x = torch.randn(2, 7, 16)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(7)

    class Decoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = mha

        def forward(self, x):
            return self.attn(x, x, x, attn_mask=mask, is_causal=True, need_weights=False)[0]

    model = Decoder()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), model(x), atol=1e-6, rtol=0)
    exported = torch.export.export(model, (x,))
    torch.testing.assert_close(exported.module()(x), model(x), atol=1e-6, rtol=0)


@pytest.mark.slow
def test_gpt2_with_causal_sinkhorn_compiles_fullgraph():
    transformers = pytest.importorskip("transformers")
    from sinkformer.integrations.huggingface import register

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=23, n_positions=32, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config).eval()
    model.set_attn_implementation(register(3, "sinkhorn_compile_gpt2", causal=True))
    ids = torch.randint(2, 23, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, :3] = 0  # left padding
    eager = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(input_ids=ids, attention_mask=mask, use_cache=False).logits, eager,
                               atol=1e-5, rtol=0)


def compiled_raises(fn, args, words):
    """``fn(*args)`` compiled with ``fullgraph=True`` raises, with ``words`` in the message (an assert in the
    graph: ``RuntimeError``)."""
    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match=words):
        torch.compile(fn, fullgraph=True, backend="aot_eager")(*args)


def test_leak_nan_and_overflow_checks_survive_compile():
    """Issue 23.2: compiled, a causal mask ran with a future gradient of 0.22 and NaN inputs gave NaN."""
    q, k, v, pad = qkv_and_padding()
    mask = torch.zeros(16, 16).masked_fill(torch.ones(16, 16, dtype=torch.bool).triu(1), -1e9)
    compiled_raises(lambda q, k, v: sinkformer.attention(q, k, v, attn_mask=mask, n_iters=5), (q, k, v),
                    "leak from the future")
    nan = q.detach().clone()
    nan[0, 0, 0, 0] = float("nan")
    for kwargs in ({"n_iters": 5}, {"is_causal": True, "n_iters": 3}):
        compiled_raises(lambda q, k, v: sinkformer.attention(q, k, v, **kwargs), (nan, k, v), "q contains NaN")
    compiled_raises(lambda q, k, v: sinkformer.attention(q * 1e20, k * 1e20, v), (q, k, v), "scores overflow")
    compiled_raises(lambda q, k, v: sinkformer.attention(q, k, v, key_weights=-torch.ones(2, 16)), (q, k, v),
                    "key_weights must be non-negative")
    # where no check fails, the compiled call runs (the asserts are in the graph, not graph breaks)
    fn = lambda q, k, v: sinkformer.attention(q, k, v, attn_mask=torch.zeros(16, 16), n_iters=5)  # noqa: E731
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(fn, fullgraph=True, backend="aot_eager")(q, k, v), fn(q, k, v))


def test_checks_survive_export():
    class Attention(torch.nn.Module):
        def forward(self, q, k, v, mask):
            return sinkformer.attention(q, k, v, attn_mask=mask, n_iters=5)

    q, k, v, _ = (t.detach() if t.is_floating_point() else t for t in qkv_and_padding())
    exported = torch.export.export(Attention(), (q, k, v, torch.zeros(16, 16))).module()
    torch.testing.assert_close(exported(q, k, v, torch.zeros(16, 16)), Attention()(q, k, v, torch.zeros(16, 16)))
    with pytest.raises(RuntimeError, match="leak from the future"):
        exported(q, k, v, torch.nn.Transformer.generate_square_subsequent_mask(16))
    nan = q.clone()
    nan[1, 2, 3, 0] = float("nan")
    with pytest.raises(RuntimeError, match="q contains NaN"):
        exported(nan, k, v, torch.zeros(16, 16))


@pytest.mark.slow
@pytest.mark.skipif(COMPILER is None, reason="inductor needs a C++ compiler, none found")
@pytest.mark.parametrize("n_iters", [3, 5])
def test_causal_sinkhorn_inductor_fullgraph(n_iters):
    assert_causal_compiled_equals_eager(n_iters, "inductor", out_atol=1e-5)


class _Recorder:
    """An object the caller writes to around the attention call, as transformers' output recording does."""

    def __init__(self):
        self.before, self.after = 0, 0


# causal-3 runs the same causal fallback's torch.cond as causal-2 (13 s here): under -m slow
@pytest.mark.parametrize("kwargs", [
    pytest.param({"n_iters": 3}, id="sinkhorn"),
    pytest.param({"n_iters": 3, "is_causal": True}, id="causal-3", marks=pytest.mark.slow),
    pytest.param({"n_iters": 2, "is_causal": True}, id="causal-2"),
])
def test_compiled_calls_keep_the_callers_python_side_effects(kwargs):
    """Dynamo (torch 2.13) drops the attribute writes that follow a ``torch.cond`` it traces, in the same
    compiled frame, to objects written before it: with the overflow check's and the causal fallback's
    ``torch.cond`` traced by Dynamo, a compiled BERT left ``transformers``' output recorder switched on and
    every later model returned no hidden states. The data-dependent branches are graph nodes
    (``sinkformer._capture.patched``) that keep them."""
    q, k, v, _ = qkv_and_padding()
    recorder = _Recorder()

    def fn(q, k, v):
        recorder.before = 1
        out = sinkformer.attention(q, k, v, **kwargs)
        recorder.after = 2
        return out

    for backend in ("eager", "aot_eager"):
        recorder.before = recorder.after = 0
        torch._dynamo.reset()
        out = torch.compile(fn, fullgraph=True, backend=backend)(q, k, v)
        assert (recorder.before, recorder.after) == (1, 2), backend
        torch.testing.assert_close(out, sinkformer.attention(q, k, v, **kwargs))


def test_compiled_overflow_check_takes_the_exact_maximum_when_the_bound_overflows():
    """|q| |k| overflows float32 but every q.k is 0 (q and k live in orthogonal coordinates): the bound sends
    the call to the exact maximum, which fits, so the compiled call runs and equals the eager one."""
    q, k, v, _ = (t.detach() if t.is_floating_point() else t for t in qkv_and_padding())
    q, k = q.clone(), k.clone()
    q[..., 4:], k[..., :4] = 0.0, 0.0
    q[..., 0, 0], k[..., 0, 4] = 1e30, 1e30
    fn = lambda q, k, v: sinkformer.attention(q, k, v, n_iters=3)  # noqa: E731
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(fn, fullgraph=True, backend="aot_eager")(q, k, v), fn(q, k, v))
    aligned = k.clone()
    aligned[..., 0, 0] = 1e30  # q_0 . k_0 = 1e60
    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match="scores overflow"):
        torch.compile(fn, fullgraph=True, backend="aot_eager")(q, aligned, v)


def test_importing_sinkformer_leaves_dynamo_unloaded_until_it_loads_then_allows_the_exact_paths():
    """``import sinkformer`` does not import ``torch._dynamo`` (seconds at every start: the command line, each
    experiment's worker); when Dynamo loads, the function holding the exact paths' ``torch.cond`` is put into
    graphs whole (``allow_in_graph``), as the side-effects test above needs."""
    import subprocess
    import sys

    code = ("import sys, sinkformer\n"
            "assert 'torch._dynamo' not in sys.modules, 'import sinkformer loaded torch._dynamo'\n"
            "import torch._dynamo\n"
            "from torch._dynamo import trace_rules, variables\n"
            "from sinkformer._capture import _patched_in_graph\n"
            "assert trace_rules.lookup_callable(_patched_in_graph) is variables.TorchInGraphFunctionVariable\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
