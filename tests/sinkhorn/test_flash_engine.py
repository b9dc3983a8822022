"""The flash engine (fused Triton kernels): forward and exact gradients equal the dense reference.

Without a GPU the kernels run on CPU tensors under Triton's interpreter, which must be switched on
before triton is first imported (tests/conftest.py does it). With CUDA present this process compiles them
for the GPU: the CPU cells skip and the CUDA cells run the real kernels (bfloat16 included — the
interpreter's bfloat16 matrix products are wrong in triton 3.9, so bfloat16 is checked on GPUs only).
Every test skips, saying why, when triton is not installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sinkformer import attention
from sinkformer.attention.backends import Call, choose
from sinkformer.sinkhorn import flash
from sinkformer.sinkhorn.problem import Problem

pytest.importorskip("triton", reason="the flash engine needs triton (pip install 'sinkformer[gpu]')")

ROOT = Path(__file__).resolve().parents[2]
CPU_REASON = flash.unavailable("cpu")
on_cpu = pytest.mark.skipif(CPU_REASON is not None, reason=f"flash kernels on CPU tensors: {CPU_REASON}")
on_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA tests need a GPU (none here)")


def make(case: str, batch=(2, 1), n=40, m=None, d=16, e=8, device="cpu", seed=0):
    """q, k, v (float64) and the mask keywords of one case; n = 40 spans two kernel blocks of 32."""
    m = n if m is None else m
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(*batch, n, d, generator=g, dtype=torch.float64), torch.randn(*batch, m, d, generator=g, dtype=torch.float64)
    v = torch.randn(*batch, m, e, generator=g, dtype=torch.float64)
    kw = {}
    if case == "padding":  # padded keys and queries, one sequence with every key padded
        kpad = torch.zeros(batch[0], m, dtype=torch.bool)
        kpad[0, -7:] = True
        kpad[1] = True
        qpad = torch.zeros(batch[0], n, dtype=torch.bool)
        qpad[0, :3] = True
        kw = dict(key_padding_mask=kpad, query_padding_mask=qpad)
    elif case == "bool_mask":  # a full (batch, n, m) mask with an empty row and an empty column
        keep = torch.rand(*batch, n, m, generator=g) > 0.4
        keep[..., 5, :] = False
        keep[..., :, 17] = False
        kw = dict(attn_mask=keep)
    elif case == "float_mask":  # a broadcast additive bias with -inf entries
        bias = torch.randn(n, m, generator=g, dtype=torch.float64)
        bias[3, :20] = float("-inf")
        kw = dict(attn_mask=bias)
    elif case != "plain":
        raise KeyError(case)
    to = lambda t: t.to(device)  # noqa: E731
    return to(q), to(k), to(v), {name: to(t) for name, t in kw.items()}


def compare(q, k, v, kw, dtype, rel_out, rel_grad, floor=1e-12, **options):
    """Forward and (q, k, v) gradients of ``backend="flash"`` in ``dtype`` against the dense engine
    in float64: ``max |error| <= rel * max(max |reference|, floor)``."""
    ref_in = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    mine_in = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    mine_kw = {n: (t.to(dtype) if t.is_floating_point() else t) for n, t in kw.items()}
    want = attention(*ref_in, **kw, backend="dense", **options)
    out = attention(*mine_in, **mine_kw, backend="flash", **options)
    assert out.dtype == dtype and out.shape == want.shape
    grad_out = torch.randn(want.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(want.device)
    got = torch.autograd.grad(out, mine_in, grad_out.to(dtype))
    ref = torch.autograd.grad(want, ref_in, grad_out)
    for name, a, b, rel in zip(("out", "dq", "dk", "dv"), (out,) + got, (want,) + ref, (rel_out,) + (rel_grad,) * 3):
        assert torch.isfinite(a).all(), name
        err, size = (a.double() - b).abs().max().item(), b.abs().max().item()
        assert err <= rel * max(size, floor), f"{name}: error {err:.3g} vs magnitude {size:.3g}"


# ------------------------------------------------------------------------------------------------
# CPU tensors, Triton's interpreter


@on_cpu
@pytest.mark.parametrize("n_iters", [1, 2, 3, 5])
@pytest.mark.parametrize("case", ["plain", "padding", "bool_mask", "float_mask"])
def test_matches_dense_float64(case, n_iters):
    """The same map and its exact gradient (float64: to rounding)."""
    q, k, v, kw = make(case)
    compare(q, k, v, kw, torch.float64, 1e-12, 1e-11, n_iters=n_iters)


@on_cpu
@pytest.mark.parametrize("n_iters", [2, 5])
@pytest.mark.parametrize("case", ["plain", "padding"])
def test_matches_dense_float32(case, n_iters):
    q, k, v, kw = make(case)
    compare(q, k, v, kw, torch.float32, 1e-5, 1e-5, n_iters=n_iters)


@on_cpu
@pytest.mark.parametrize("n_iters", [1, 2, 5])
def test_float32_at_large_score_ranges_across_blocks(n_iters):
    """Integer scores spanning ~4e4 (exact in float32) over several blocks each way (n = 40, m = 70,
    blocks of 32): the shifts found by the first sweeps' running maxima keep forward and gradients
    within float32's tolerance (absolute where the true gradient is ~0, as in the conformance grid)."""
    q, k, v, kw = make("padding", n=40, m=70, d=4, e=3)
    q, k = q.mul(60).round(), k.mul(60).round()
    assert (q @ k.transpose(-1, -2)).abs().max() > 2e4
    compare(q, k, v, kw, torch.float32, 2e-5, 2e-4, floor=1.0, n_iters=n_iters, scale=1.0)


@on_cpu
@pytest.mark.parametrize("n_iters", [1, 2, 3])
@pytest.mark.parametrize("n, m", [(23, 70), (70, 9)])
def test_cross_attention(n, m, n_iters):
    """n_q != n_k (columns sum to n_q / n_k), partial blocks on both sides, a value width of 3."""
    q, k, v, kw = make("plain", batch=(3,), n=n, m=m, d=5, e=3)
    compare(q, k, v, kw, torch.float64, 1e-12, 1e-11, n_iters=n_iters)


@on_cpu
def test_broadcast_batch_and_l2_cost():
    """Keys and values shared across heads (stride-0 batch), and the L2 cost (an extra dimension)."""
    q, k, v, kw = make("padding", batch=(2, 3), n=36, d=6)
    compare(q, k[:, :1], v[:, :1], kw, torch.float64, 1e-12, 1e-11, n_iters=3, cost="l2")


@on_cpu
def test_tolerance_mode():
    """``tol``: each slice stops on its own, as the dense engine decides."""
    q, k, v, kw = make("padding", n=36, d=4)
    compare(q, k, v, kw, torch.float64, 1e-9, 1e-7, n_iters=None, tol=1e-6, max_iters=500, scale=0.3)


@on_cpu
def test_compiles_fullgraph():
    """``torch.compile(fullgraph=True)`` sees one opaque op each way (fake implementations registered)."""
    q, k, v, kw = make("padding", n=20, d=8)
    q, k, v = (t.float().requires_grad_() for t in (q, k, v))
    fn = torch.compile(lambda q, k, v: attention(q, k, v, n_iters=3, backend="flash", **kw), fullgraph=True,
                       backend="aot_eager")
    out = fn(q, k, v)
    want = attention(q, k, v, n_iters=3, backend="dense", **kw)
    assert (out - want).abs().max() <= 1e-5 * want.abs().max()
    for got, ref in zip(torch.autograd.grad(out.sum(), (q, k, v)), torch.autograd.grad(want.sum(), (q, k, v))):
        assert (got - ref).abs().max() <= 1e-5 * max(ref.abs().max(), 1e-3)


@on_cpu
def test_implicit_backward():
    """``backward="implicit"``: the balanced fixed point's gradient, as the tiled engine computes it
    (the same dual solve, its products with P as matrix-vector sweeps)."""
    q, k, v, kw = make("padding", n=36, d=4)
    options = dict(n_iters=None, tol=1e-9, max_iters=2000, scale=0.3, backward="implicit", **kw)
    grads = {}
    for backend in ("flash", "tiled"):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = attention(*leaves, backend=backend, **options)
        grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=out.dtype)
        grads[backend] = (out,) + torch.autograd.grad(out, leaves, grad_out)
    for name, a, b in zip(("out", "dq", "dk", "dv"), grads["flash"], grads["tiled"]):
        assert (a - b).abs().max() <= 1e-8 * b.abs().max(), name


@on_cpu
def test_implicit_after_a_fixed_count_warns():
    from sinkformer import SinkhornConvergenceWarning

    q, k, v, _ = make("plain", batch=(1,), n=20)
    with pytest.warns(SinkhornConvergenceWarning, match="engine 'flash'"):
        attention(q, k, v, n_iters=3, backward="implicit", backend="flash")


@on_cpu
def test_half_precision_operands():
    """float16 q, k, v enter the kernels' products in float16 (as on GPUs), accumulation in float32
    (called on the op: on CPU tensors ``attention`` computes in float32)."""
    q, k, v, _ = make("plain", batch=(2,), n=32, d=16)
    qh, kh, vh = (t.half().requires_grad_() for t in (q, k, v))
    out = torch.ops.sinkformer.flash_forward(qh, kh, vh, None, None, [2], 0.25, 5, None, 1000, "unrolled")[0]
    ref_in = [t.half().double().requires_grad_() for t in (q, k, v)]
    want = attention(*ref_in, n_iters=5, scale=0.25, backend="dense")
    assert out.dtype == torch.float16  # as FlashAttention: the output in the operands' dtype
    assert (out.double() - want).abs().max() <= 4e-3 * want.abs().max()
    grads = torch.autograd.grad(out, (qh, kh, vh), torch.ones_like(out))
    refs = torch.autograd.grad(want, ref_in, torch.ones_like(want))
    for got, ref in zip(grads, refs):
        assert got.dtype == torch.float16
        assert (got.double() - ref).abs().max() <= 3e-2 * ref.abs().max()


@on_cpu
@pytest.mark.parametrize("shape", [(2, 0, 6, 3, 4), (2, 5, 0, 3, 4), (2, 5, 6, 0, 4), (0, 5, 6, 3, 4)])
def test_empty_shapes(shape):
    """(B, n_q, n_k, d, d_v) with one of them 0: the dense engine's answer, finite gradients."""
    B, n, m, d, e = shape
    q, k, v = (torch.randn(B, s, w, dtype=torch.float64, requires_grad=True) for s, w in ((n, d), (m, d), (m, e)))
    out = attention(q, k, v, n_iters=3, backend="flash")
    assert torch.allclose(out, attention(q, k, v, n_iters=3, backend="dense"), atol=1e-12)
    if out.numel():
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        assert all(torch.isfinite(g).all() for g in grads)


@on_cpu
@pytest.mark.parametrize("kwargs, argument", [
    (dict(dropout_p=0.1), "dropout_p"),
    (dict(return_weights=True), "return_weights"),
    (dict(normalization="softmax"), "normalization"),
    (dict(key_weights=torch.ones(2, 9)), "key_weights"),
])
def test_unserved_options_raise(kwargs, argument):
    q = k = v = torch.randn(2, 9, 4)
    with pytest.raises(ValueError, match=rf"backend='flash'.*{argument}|{argument}.*'flash'"):
        attention(q, k, v, backend="flash", **kwargs)


def test_causal_sinkhorn_is_refused():
    """Column normalisation under a causal mask mixes the future into the past: not this engine's."""
    q = k = v = torch.randn(2, 9, 4)
    with pytest.raises(ValueError, match="flash"):
        attention(q, k, v, n_iters=5, is_causal=True, backend="flash")


def test_choice_rules():
    """``auto`` picks flash for CUDA tensors it can serve; CPU tensors keep the CPU engines; a
    SoftMax call stays on SDPA; what flash cannot serve goes elsewhere."""
    cuda = Call("sinkhorn", 5, None, 1024, 1024, device="cuda")
    assert choose(cuda).engine == "flash"
    assert choose(Call("sinkhorn", 5, None, 1024, 1024, device="cpu")).engine != "flash"
    assert choose(Call("sinkhorn", 1, None, 1024, 1024, device="cuda")).engine == "sdpa"
    assert choose(Call("sinkhorn", 5, None, 64, 64, dropout_p=0.1, device="cuda")).engine == "tiled"
    assert choose(Call("sinkhorn", None, 1e-5, 64, 64, backward="implicit", device="cuda")).engine == "flash"


def test_missing_triton_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # find_spec now reports it missing
    why = flash.unavailable("cuda")
    assert "needs triton" in why and "pip install 'sinkformer[gpu]'" in why
    with pytest.raises(ValueError, match=r"backend='flash'.*needs triton"):
        choose(Call("sinkhorn", 5, None, 8, 8, device="cuda"), "flash")


def test_cpu_without_interpreter_is_refused():
    """CPU tensors without TRITON_INTERPRET: a ValueError naming backend and what is needed."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import torch, sinkformer\n"
            "try:\n    sinkformer.attention(*(torch.randn(1, 4, 2),) * 3, backend='flash')\n"
            "except ValueError as err:\n    print(err)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "backend='flash'" in done.stdout and "CUDA" in done.stdout and "TRITON_INTERPRET=1" in done.stdout


def test_triton_imported_before_the_interpreter_was_switched_on_is_refused():
    """The interpreter is chosen when triton is first imported: switched on later, the kernels would fail
    in triton's own helpers. flash refuses by name and says what to do; auto serves the call elsewhere."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import os, torch, triton, sinkformer\n"
            "from sinkformer.attention import explain\n"
            "os.environ['TRITON_INTERPRET'] = '1'\n"
            "q = torch.randn(1, 8, 4)\n"
            "print(explain(q, q, q, n_iters=3, backend='auto').engine)\n"
            "print(sinkformer.attention(q, q, q, n_iters=3).shape)\n"
            "try:\n    sinkformer.attention(q, q, q, n_iters=3, backend='flash')\n"
            "except ValueError as err:\n    print(err)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    engine, shape, error = done.stdout.strip().splitlines()
    assert engine != "flash" and shape == "torch.Size([1, 8, 4])"
    assert "backend='flash'" in error and "imported before TRITON_INTERPRET=1" in error


@on_cpu
def test_benchmark_smoke(tmp_path):
    """``benchmarks/attention_cuda.py --smoke`` runs end to end on CPU (tiny sizes, interpreter)."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "benchmarks.attention_cuda", "--smoke", "--out", str(tmp_path)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads((tmp_path / "attention_cuda.json").read_text())
    methods = {row["method"] for row in data["rows"]}
    assert {"sdpa-flash", "official", "flash", "tiled"} <= methods
    assert all(row["forward_ms"] > 0 for row in data["rows"] if row.get("status") == "ok")
    assert (tmp_path / "attention_cuda.md").read_text().startswith("# Sinkhorn attention on")


# ------------------------------------------------------------------------------------------------
# CUDA tensors, compiled kernels


@on_cuda
@pytest.mark.parametrize("n_iters", [1, 2, 3, 5, 21])
@pytest.mark.parametrize("case", ["plain", "padding", "bool_mask", "float_mask"])
def test_cuda_float32(case, n_iters):
    q, k, v, kw = make(case, n=200, m=150, d=64, e=64, device="cuda")
    compare(q, k, v, kw, torch.float32, 2e-5, 2e-4, n_iters=n_iters)


@on_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("n_iters", [2, 5])
@pytest.mark.parametrize("case", ["plain", "padding"])
def test_cuda_half(case, n_iters, dtype):
    """Half inputs on tensor cores, float32 accumulation: within the conformance grid's tolerance."""
    q, k, v, kw = make(case, n=256, d=64, e=64, device="cuda")
    rel = (2e-2, 1e-1) if dtype == torch.bfloat16 else (4e-3, 3e-2)
    compare(q, k, v, kw, dtype, *rel, n_iters=n_iters)


@on_cuda
def test_cuda_auto_picks_flash_and_memory_is_linear():
    """``auto`` runs flash on CUDA; the forward+backward never allocates an n x n matrix."""
    n = 4096
    q, k, v = (torch.randn(1, 2, n, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    from sinkformer.attention import explain

    assert explain(q, k, v, n_iters=5).engine == "flash"
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    attention(q, k, v, n_iters=5).sum().backward()
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base < 2 * n * n  # one bf16 n x n matrix of a slice = 2 n^2 bytes


@on_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_cuda_tensors_on_a_non_current_device():
    """Tensors on cuda:1 while cuda:0 is current: the launches go to cuda:1 (the device guard)."""
    q, k, v, kw = make("padding", n=100, d=32, e=32, device="cuda:1")
    with torch.cuda.device(0):
        compare(q, k, v, kw, torch.float32, 2e-5, 2e-4, n_iters=5)


# ------------------------------------------------------------------------------------------------
# guards: what flash cannot serve is refused by name, and auto goes elsewhere


def test_guards_name_what_cannot_be_served(monkeypatch):
    """A head dim past a block, an old Triton, float64 on a Triton that cannot compile it, a device:
    each refused with its reason; auto then picks another engine and explain() says why."""
    assert flash.unavailable("cuda", torch.bfloat16, 64, 64) is None
    why = flash.unavailable("cuda", torch.float32, 320, 64)
    assert "head dims up to 256" in why and "head_dim=320" in why
    why = flash.unavailable("cuda", torch.float32, 64, 512)
    assert "value_dim=512" in why
    assert "'mps'" in flash.unavailable("mps", torch.float32, 64, 64)
    call = Call("sinkhorn", 5, None, 1024, 1024, device="cuda", dtype=torch.float32, head_dim=320, value_dim=320)
    choice = choose(call)
    assert choice.engine == "tiled" and "not 'flash'" in choice.reason and "head_dim=320" in choice.reason
    with pytest.raises(ValueError, match="backend='flash'.*head_dim=320"):
        choose(call, "flash")
    monkeypatch.setattr(flash, "_triton_version", lambda: (3, 6))
    why = flash.unavailable("cuda", torch.float64, 64, 64)
    assert "float64" in why and "triton >= 3.9" in why
    assert flash.unavailable("cuda", torch.bfloat16, 64, 64) is None  # 3.6 compiles every other dtype
    big = Call("sinkhorn", 5, None, 8192, 8192, device="cuda", dtype=torch.float64, head_dim=64, value_dim=64)
    assert choose(big).engine == "streamed" and "float64" in choose(big).reason
    monkeypatch.setattr(flash, "_triton_version", lambda: (3, 2))
    assert "triton >= 3.6" in flash.unavailable("cuda", torch.bfloat16, 64, 64)


def test_the_extras_install_a_triton_the_engine_serves():
    """``pip install 'sinkformer[gpu]'`` (and ``[test]``) ask for the oldest Triton the engine accepts."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    floor = ".".join(map(str, flash.MIN_TRITON))
    for extra in ("gpu", "test"):
        pins = [req.split(";")[0].strip() for req in extras[extra] if req.startswith("triton")]
        assert pins == [f"triton>={floor}"], (extra, pins)


@on_cpu
def test_an_interpreter_that_cannot_run_the_kernels_is_refused(monkeypatch):
    """Triton 3.6's interpreter fails every kernel with numpy >= 2.4 (an InterpreterError from the loops'
    bounds, triton-lang/triton#9171): CPU tensors are then refused naming both versions and the fix;
    3.7 runs them, and so does 3.6 with numpy 2.3 (checked by hand: this module passes there)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(flash, "_triton_version", lambda: (3, 6))
    monkeypatch.setattr(flash, "_numpy_version", lambda: (2, 4))
    why = flash.unavailable("cpu")
    assert "numpy >= 2.4" in why and "triton 3.6" in why and "pip install -U triton" in why
    assert flash.unavailable("cuda", torch.bfloat16, 64, 64) is None  # compiled kernels are not concerned
    monkeypatch.setattr(flash, "_numpy_version", lambda: (2, 3))
    assert flash.unavailable("cpu") is None
    monkeypatch.setattr(flash, "_triton_version", lambda: (3, 7))
    monkeypatch.setattr(flash, "_numpy_version", lambda: (2, 4))
    assert flash.unavailable("cpu") is None


def test_every_served_configuration_has_a_launch():
    """Each (dtype, head dim <= 256) served on GPUs has a launch configuration, and nothing else is served."""
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for d in (1, 16, 33, 64, 80, 96, 128, 200, 256):
            assert flash.launch_config(dtype, d, d, interpreted=False) is not None, (dtype, d)
    assert flash.launch_config(torch.float64, 128, 128, interpreted=False) is not None
    assert flash.unavailable("cuda", torch.float64, 256, 256) is not None  # no float64 block fits at d = 256


@on_cpu
def test_attention_refuses_a_head_dim_past_a_block():
    q = k = v = torch.randn(1, 40, 300, dtype=torch.float64)
    with pytest.raises(ValueError, match="backend='flash'.*head dims up to 256"):
        attention(q, k, v, n_iters=3, backend="flash")


@on_cpu
def test_mask_offsets_past_2_31(tmp_path):
    """A boolean mask whose rows lie 2^31 bytes apart (a strided view of a buffer the OS never backs)
    gives the dense engine's answer: the kernels' mask offsets are 64-bit (32-bit ones wrap and read
    outside the buffer). Run as gpu-check's probe, in a subprocess: a wrapped read may kill it."""
    from benchmarks.gpu_check import SMOKE, offset_probe

    row = offset_probe(SMOKE, "cpu")
    assert row["status"] == "pass", row
    assert row["past_2_31"] and row["largest_mask_offset"] >= 2**31


# ------------------------------------------------------------------------------------------------
# the backward's shape: folded terms, fallback, few launches


@on_cpu
def test_folded_terms_fall_back_where_they_overflow():
    """The fold kernel: per term and slice, factors with the same largest exponent whose product is
    the term; a term whose exponents pass the limit is flagged (its slice then runs term by term)."""
    g = torch.Generator().manual_seed(3)
    B, n, m = 2, 37, 45
    fs, gs = torch.randn(B, 3, n, generator=g, dtype=torch.float64), torch.randn(B, 3, m, generator=g, dtype=torch.float64)
    fs[1, 0] += 1000.0  # slice 1, steps 1 and 2: alpha - F = 1000 + O(1) (base 2), past the float64 limit
    u, w = torch.rand(B, 5, n, generator=g, dtype=torch.float64), torch.rand(B, 5, m, generator=g, dtype=torch.float64)
    q = torch.zeros(B, n, 4, dtype=torch.float64)
    k = torch.zeros(B, m, 4, dtype=torch.float64)
    p = flash._Operands(Problem(q, k, torch.zeros_like(k), None, None, [B], 1.0, 5))
    terms = p.fold(fs, gs, u.clone(), w.clone(), implicit=False)
    assert terms.ok.tolist() == [[1] * 5, [0, 0, 1, 1, 1]]
    for t in range(5):  # step t + 1: alpha = f[t // 2], beta = g[(t + 1) // 2]
        a, b = fs[:, t // 2] - fs[:, -1], gs[:, (t + 1) // 2] - gs[:, -1]
        want = torch.exp2(a[:, :, None] + b[:, None, :]) * u[:, t, :, None] * w[:, t, None, :]
        got = terms.xa[:, t, :, None] * terms.ya[:, t, None, :]
        assert torch.allclose(got[0], want[0], rtol=1e-12)
        assert torch.allclose(terms.a[:, t, :, None] + terms.b[:, t, None, :], a[:, :, None] + b[:, None, :])
        assert torch.allclose(terms.a[:, t].amax(-1), terms.b[:, t].amax(-1))  # balanced


@on_cpu
@pytest.mark.parametrize("n_iters", [2, 5])
def test_term_by_term_variant_matches_dense(monkeypatch, n_iters):
    """With the fold refused everywhere (a limit below any exponent) the term-by-term dscore variant
    serves every slice, and still gives the exact gradient."""
    monkeypatch.setitem(flash.FOLD_LIMIT, torch.float64, -1e9)
    q, k, v, kw = make("padding")
    compare(q, k, v, kw, torch.float64, 1e-12, 1e-11, n_iters=n_iters)


def _count_ops(fn):
    """``(torch ops that launch work, Triton launches)`` while ``fn`` runs the flash op's bodies
    (views and allocations are not counted; each kernel launch runs with counting paused)."""
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

    free = ("slice", "select", "view", "expand", "unsqueeze", "squeeze", "as_strided", "alias", "lift_fresh",
            "detach", "empty", "transpose", "permute")
    counts = {"ops": 0, "launches": 0}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not any(name in str(func) for name in free):
                counts["ops"] += 1
            return func(*args, **(kwargs or {}))

    real = flash._kernels

    class Launch:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                counts["launches"] += 1
                with _disable_current_modes():
                    return self.kernel[grid](*args, **kwargs)
            return launch

    kernels = real()
    stand_ins = type("K", (), {name: getattr(kernels, name) for name in kernels.MODES})
    for name in kernels.KERNELS:
        setattr(stand_ins, name, Launch(getattr(kernels, name)))
    flash._kernels = lambda: stand_ins
    try:
        with Count():
            result = fn()
    finally:
        flash._kernels = real
    return counts["ops"], counts["launches"], result


@on_cpu
def test_a_call_is_a_handful_of_launches():
    """Forward and backward (5 iterations, no mask) are their kernel launches and a few small ops:
    5 sweeps and 5 ops forward (two of them for the shifts); backward 1 rowdot, the dV pass (fused with
    the last step), 3 matrix-vector sweeps, the fold, 2 x 2 dscore launches and 4 ops (it was ~22 + ~74
    ops before)."""
    q, k, v, _ = make("plain", batch=(4,), n=40, d=16)
    q, k, v = q.float(), k.float(), v.float()
    ops, launches, (out, fs, gs, counts, shift_q, shift_k) = _count_ops(
        lambda: flash._forward_op._init_fn(q, k, v, None, None, [4], 0.25, 5, None, 1000, "unrolled"))
    assert launches == 5 and ops <= 5
    grad = torch.randn_like(out)
    ops, launches, _ = _count_ops(lambda: flash._backward_op._init_fn(grad, out, q, k, v, None, None, [4], 0.25, 5,
                                                                      None, 1000, fs, gs, counts, shift_q, shift_k,
                                                                      "unrolled"))
    assert launches == 1 + 1 + 3 + 1 + 4 and ops <= 5
