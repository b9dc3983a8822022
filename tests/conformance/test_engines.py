"""The conformance suite: one grid, every attention engine, held to the dense reference.

Each cell runs one engine (``backend=``) on one case and either matches the dense engine in
float64 — forward, first and second derivatives — to the tolerance of its dtype, or raises a
``ValueError``/``NotImplementedError`` naming the argument it cannot serve and the engine. Which
cells must raise is read off the engine registry's capabilities, once (``UNSERVED``); an engine that
raises elsewhere, or returns a NaN or a different answer anywhere, fails. A new engine joins by being
listed in ``ENGINES``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch

import sinkformer
from sinkformer import SinkhornConvergenceWarning, attention
from sinkformer.attention import backends
from sinkformer.sinkhorn import flash, native, tiled, sizes

#: engine name -> keyword arguments of ``attention`` that select it. "tiled-log" is the tiled
#: engine in the log domain that GPUs use, run here on the CPU; "tiled-composed" the tiled engine's scaling
#: domain of PyTorch operations only (no native passes: what a machine without a C compiler runs).
ENGINES = {
    "auto": {},
    "sdpa": {"backend": "sdpa"},
    "dense": {"backend": "dense"},
    "tiled": {"backend": "tiled"},
    "tiled-log": {"backend": "tiled"},
    "tiled-composed": {"backend": "tiled"},
    "streamed": {"backend": "streamed", "chunk_size": 4},
    "flash": {"backend": "flash"},
    "causal": {"backend": "causal"},
}
#: feature of a case -> whether an engine serves it, read off its capabilities in the registry
SERVES = {
    "iterations": lambda e: e.iterations,
    "return_weights": lambda e: e.return_weights,
    "measure": lambda e: e.measure_weights,
    "bias_grad": lambda e: e.learned_bias,
    "implicit": lambda e: e.implicit_backward,
    "noncausal": lambda e: e.causal != "prefix",
}
#: engine -> the features it does not serve (it must raise, naming the argument and the engine): the
#: registry's capabilities, which the grid holds the engines to (a capability claimed but not served fails)
UNSERVED = {name: {f for f, serves in SERVES.items() if not serves(backends.engine(kw.get("backend", "tiled")))}
            for name, kw in ENGINES.items() if name != "auto"} | {"auto": set()}
#: what the registry says, written out once more: a capability that changes must change here too
assert UNSERVED == {
    "auto": set(),
    "sdpa": {"iterations", "return_weights", "measure", "implicit"},
    "dense": {"implicit"},
    "tiled": {"return_weights", "measure", "bias_grad"},
    "tiled-log": {"return_weights", "measure", "bias_grad"},
    "tiled-composed": {"return_weights", "measure", "bias_grad"},
    "streamed": {"return_weights", "measure", "bias_grad", "implicit"},
    "flash": {"return_weights", "measure", "bias_grad"},
    "causal": {"noncausal", "measure", "implicit"},
}, UNSERVED
#: the argument an error must name for each feature
ARGUMENT = {"iterations": "n_iters", "return_weights": "return_weights", "measure": "key_weights",
            "bias_grad": "attn_mask", "implicit": "backward", "noncausal": "is_causal"}
#: (forward, gradient) tolerance relative to the reference's largest magnitude
TOLERANCE = {
    torch.float64: (1e-9, 1e-7),
    torch.float32: (2e-5, 2e-4),
    torch.float16: (4e-3, 3e-2),
    torch.bfloat16: (2e-2, 1e-1),
}


@pytest.fixture(params=list(ENGINES))
def engine(request, monkeypatch):
    if request.param == "tiled-log":
        monkeypatch.setattr(tiled, "DOMAIN", "log")
    if request.param == "tiled-composed":
        monkeypatch.setattr(native, "ENABLED", False)
    if request.param == "flash" and flash.unavailable("cpu") is not None:
        pytest.skip(f"flash engine on CPU tensors: {flash.unavailable('cpu')}")
    return request.param


@dataclass
class Case:
    """Inputs and keyword arguments of one call; ``features`` the engine capabilities it needs."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    kwargs: dict = field(default_factory=dict)
    features: set = field(default_factory=set)

    def to(self, dtype):
        moved = {n: (t.to(dtype) if torch.is_tensor(t) and t.is_floating_point() else t) for n, t in self.kwargs.items()}
        return Case(self.q.to(dtype), self.k.to(dtype), self.v.to(dtype), moved, self.features)


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def make_case(name: str, batch=(2, 3), n=9, m=None, d=5, e=4) -> Case:
    """The cases of the grid, in float64."""
    m = n if m is None else m
    g = _gen(1)
    q = torch.randn(*batch, n, d, generator=g, dtype=torch.float64)
    k = torch.randn(*batch, m, d, generator=g, dtype=torch.float64)
    v = torch.randn(*batch, m, e, generator=g, dtype=torch.float64)
    if name == "plain":
        return Case(q, k, v)
    if name == "cross":  # n_q != n_k: columns sum to n_q / n_k
        return make_case("plain", batch, 7, 11, d, e)
    if name == "key_padding":
        pad = torch.zeros(batch[0], m, dtype=torch.bool)
        pad[0, -3:] = True
        return Case(q, k, v, {"key_padding_mask": pad})
    if name == "query_and_key_padding":
        pad = torch.zeros(batch[0], n, dtype=torch.bool)
        pad[1, -4:] = True
        pad[0, :2] = True
        return Case(q, k, v, {"key_padding_mask": pad, "query_padding_mask": pad})
    if name == "bool_mask":  # with a fully masked row and a fully masked column
        keep = torch.rand(*batch, n, m, generator=_gen(2)) > 0.3
        keep[..., 0, :] = False
        keep[..., :, 1] = False
        return Case(q, k, v, {"attn_mask": keep})
    if name == "float_mask":  # an additive bias with -inf entries, without gradient
        bias = torch.randn(n, m, generator=_gen(3), dtype=torch.float64)
        bias[2, :4] = float("-inf")
        return Case(q, k, v, {"attn_mask": bias})
    if name == "learned_bias":
        bias = torch.randn(n, m, generator=_gen(4), dtype=torch.float64).requires_grad_()
        return Case(q, k, v, {"attn_mask": bias}, {"bias_grad"})
    if name == "measure_weights":
        w = torch.rand(batch[0], m, generator=_gen(5), dtype=torch.float64) + 0.1
        return Case(q, k, v, {"key_weights": w}, {"measure"})
    if name == "return_weights":
        return Case(q, k, v, {"return_weights": True}, {"return_weights"})
    if name == "all_keys_padded":
        pad = torch.zeros(batch[0], m, dtype=torch.bool)
        pad[1] = True
        return Case(q, k, v, {"key_padding_mask": pad})
    if name == "extreme":  # integer scores spanning ~1e4: exact in every dtype path
        q, k = (t.mul(60).round() for t in (q, k))
        return Case(q, k, v, {"scale": 1.0})
    raise KeyError(name)


CASES = ["plain", "cross", "key_padding", "query_and_key_padding", "bool_mask", "float_mask", "learned_bias",
         "measure_weights", "return_weights", "all_keys_padded"]


def features_of(case: Case, n_iters, tol, backward="unrolled") -> set:
    feats = set(case.features) | {"noncausal"}  # the grid's calls are not causal (test_causal_sinkhorn is)
    if tol is not None or n_iters > 1:
        feats.add("iterations")
    if backward == "implicit":
        feats.add("implicit")
    return feats


def run(engine: str, case: Case, **kw):
    """``attention`` on ``engine``; returns the output (the weights dropped)."""
    out = attention(case.q, case.k, case.v, **case.kwargs, **ENGINES[engine], **kw)
    return out[0] if isinstance(out, tuple) else out


def reference(case: Case, **kw):
    return run("dense", case.to(torch.float64), **kw)


def leaves(case: Case) -> Case:
    """A copy whose q, k, v (and a learned bias) require grad."""
    kwargs = dict(case.kwargs)
    if "bias_grad" in case.features:
        kwargs["attn_mask"] = case.kwargs["attn_mask"].detach().clone().requires_grad_()
    return Case(*(t.detach().clone().requires_grad_() for t in (case.q, case.k, case.v)), kwargs, case.features)


def inputs_with_grad(case: Case) -> list[torch.Tensor]:
    extra = [case.kwargs["attn_mask"]] if "bias_grad" in case.features else []
    return [case.q, case.k, case.v] + extra


def expect(engine: str, feats: set):
    """A context: the call must raise naming the argument and the engine where it is unserved."""
    missing = feats & UNSERVED[engine]
    if not missing:
        return None
    return missing


def assert_raises_naming(engine, missing, fn):
    with pytest.raises((ValueError, NotImplementedError)) as info:
        fn()
    message = str(info.value)
    assert any(ARGUMENT[f] in message for f in missing), message
    assert ENGINES[engine].get("backend", "tiled").split("-")[0] in message, message


def assert_close(got, want, rel, what, floor=1e-12):
    """``max |got - want| <= rel * max(max |want|, floor)``, and no NaN/inf."""
    got, want = got.double(), want.double()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    scale = want.abs().max().item() if want.numel() else 0.0
    err = (got - want).abs().max().item() if want.numel() else 0.0
    assert err <= rel * max(scale, floor), f"{what}: error {err:.3g} vs magnitude {scale:.3g}"


def check_cell(engine, case: Case, dtype, n_iters=None, tol=None, backward="unrolled", grads=True, max_iters=1000,
               tolerance=None, floor=1e-12):
    """One cell: the engine's forward and gradients against the reference, or the error it must raise."""
    kw = dict(n_iters=n_iters, tol=tol, backward=backward, max_iters=max_iters)
    missing = expect(engine, features_of(case, n_iters, tol, backward))
    case = case.to(dtype)
    if missing:
        assert_raises_naming(engine, missing, lambda: run(engine, case, **kw))
        return
    rtol_out, rtol_grad = tolerance or TOLERANCE[dtype]
    mine, ref = leaves(case), leaves(case.to(torch.float64))
    out = run(engine, mine, **kw)
    want = reference(ref, **kw)
    assert out.dtype == dtype
    assert_close(out, want, rtol_out, f"{engine} forward", floor)
    if not grads:
        return
    grad_out = torch.randn(want.shape, generator=_gen(7), dtype=torch.float64)
    got = torch.autograd.grad(out, inputs_with_grad(mine), grad_out.to(dtype))
    ref_grads = torch.autograd.grad(want, inputs_with_grad(ref), grad_out)
    for name, a, b in zip("qkvb", got, ref_grads):
        assert a.dtype == (dtype if name != "b" else a.dtype)
        assert_close(a, b, rtol_grad, f"{engine} d{name}", floor)


# --------------------------------------------------------------------------------------------
# the grid


@pytest.mark.parametrize("n_iters", [1, 2, 3, 5, 21])
@pytest.mark.parametrize("case_name", CASES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_forward_and_gradients(engine, case_name, n_iters, dtype):
    check_cell(engine, make_case(case_name), dtype, n_iters=n_iters)


@pytest.mark.parametrize("n_iters", [2, 5])
@pytest.mark.parametrize("case_name", ["plain", "key_padding", "cross"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_half_precision(engine, case_name, n_iters, dtype):
    """Half inputs: computed in float32, output and gradients in the input dtype."""
    check_cell(engine, make_case(case_name, n=16, d=8), dtype, n_iters=n_iters)


@pytest.mark.parametrize("backward_inside", [False, True], ids=["backward-after", "backward-inside"])
@pytest.mark.parametrize("n_iters", [1, 5])
@pytest.mark.parametrize("case_name", ["plain", "key_padding"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_autocast(engine, case_name, n_iters, dtype, backward_inside):
    """Under ``torch.autocast`` float32 inputs behave as with SDPA: q, k, v are cast to the autocast
    dtype, the output is in it, and forward and gradients equal the explicit half-precision call. A
    backward run inside the autocast region (which PyTorch advises against) recasts the backward's own
    products on the dense and SDPA paths: there the gradients agree to half precision."""
    case = make_case(case_name, n=16, d=8).to(torch.float32)
    missing = expect(engine, features_of(case, n_iters, None))
    if missing:
        with torch.autocast("cpu", dtype=dtype):
            assert_raises_naming(engine, missing, lambda: run(engine, case, n_iters=n_iters))
        return
    explicit, mixed = leaves(case.to(dtype)), leaves(case)
    want = run(engine, explicit, n_iters=n_iters)
    grad_out = torch.randn(want.shape, generator=_gen(7), dtype=dtype)
    want_grads = torch.autograd.grad(want, inputs_with_grad(explicit), grad_out)
    with torch.autocast("cpu", dtype=dtype):
        out = run(engine, mixed, n_iters=n_iters)
        if backward_inside:
            grads = torch.autograd.grad(out, inputs_with_grad(mixed), grad_out)
    if not backward_inside:
        grads = torch.autograd.grad(out, inputs_with_grad(mixed), grad_out)
    assert out.dtype == dtype and torch.equal(out, want)
    for name, got, expected in zip("qkv", grads, want_grads):
        assert got.dtype == torch.float32  # the leaves' dtype, as autocast gives
        if backward_inside:
            assert_close(got, expected, TOLERANCE[dtype][1], f"{engine} d{name}")
        else:
            assert torch.equal(got, expected.float())


@pytest.mark.parametrize("case_name", ["plain", "float_mask", "query_and_key_padding", "cross"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_tolerance_mode(engine, case_name, dtype):
    """``tol``: every matrix stops on its own when its column error is <= tol (same rule everywhere)."""
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    check_cell(engine, make_case(case_name), dtype, tol=tol, max_iters=10_000)


@pytest.mark.parametrize("n_iters", [2, 5, 21])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_extreme_score_ranges(engine, n_iters, dtype):
    """Scores spanning 1e4: no NaN/inf, and the reference's values to the conditioning of the problem.

    A score of 1e4 is known to one ulp (1e-3 in float32), and a change of the scores by ``δ``
    changes the weights by a factor up to :math:`e^{2δ}`: the tolerance is ``eps * max|S|``. The
    gradients are ~0 up to rounding of 1e4-sized terms (floor: ``eps * max|S|`` absolute)."""
    case = make_case("extreme", batch=(2,), n=10, d=4)
    top = (case.q @ case.k.transpose(-1, -2)).abs().max().item()
    assert top > 5e3
    rel = 4 * torch.finfo(dtype).eps * top
    check_cell(engine, case, dtype, n_iters=n_iters, grads=dtype == torch.float64, tolerance=(rel, rel), floor=1.0)
    if dtype == torch.float32 and not expect(engine, features_of(case, n_iters, None)):
        mine = leaves(case.to(dtype))
        run(engine, mine, n_iters=n_iters).sum().backward()
        assert all(torch.isfinite(t.grad).all() for t in (mine.q, mine.k, mine.v))


@pytest.mark.parametrize("n_iters", [2, 5, 21])
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "key_padding"])
@pytest.mark.parametrize("spread", [19, 60], ids=["scores-4e3", "scores-4e4"])
def test_extreme_score_ranges_float32_gradients(engine, spread, padded, n_iters):
    """float32 forward and gradients at score ranges of ~4e3 and ~4e4, to the grid's float32 tolerance
    (absolute where the true value is ~0). The scores are integers, exact in float32, so only an
    engine's own arithmetic can err: the tiled engine's errors stay below 1e-4, the streamed engine's
    reached 7e-3 (issue 23.4: its potentials of size max|S| added to the scores in every sweep)."""
    base = make_case("plain", batch=(2,), n=10, d=4)
    case = Case(*(t.mul(spread).round() for t in (base.q, base.k)), base.v, {"scale": 1.0})
    if padded:
        pad = torch.zeros(2, 10, dtype=torch.bool)
        pad[0, -3:] = True
        case.kwargs["key_padding_mask"] = pad
    assert (case.q @ case.k.transpose(-1, -2)).abs().max() > 10 * spread ** 2
    check_cell(engine, case, torch.float32, n_iters=n_iters, floor=1.0)


@pytest.mark.parametrize("n_iters", [1, 2, 5])
@pytest.mark.parametrize("case_name", ["plain", "bool_mask", "cross"])
def test_second_derivatives(engine, case_name, n_iters):
    """A gradient penalty: d/dθ |d out·w / dq|² equals the reference's (double backward)."""
    case = make_case(case_name, batch=(2,), n=6, d=3)
    missing = expect(engine, features_of(case, n_iters, None))
    if missing:
        return  # the first-derivative grid covers the error
    w = torch.randn(case.q.shape[:-1] + (case.v.shape[-1],), generator=_gen(9), dtype=torch.float64)

    def penalty_grads(eng):
        c = leaves(case)
        out = run(eng, c, n_iters=n_iters)
        (gq,) = torch.autograd.grad((out * w).sum(), c.q, create_graph=True)
        return torch.autograd.grad(gq.square().sum(), (c.q, c.k, c.v))

    for name, a, b in zip("qkv", penalty_grads(engine), penalty_grads("dense")):
        assert_close(a, b, 1e-7, f"{engine} second derivative d{name}")


@pytest.mark.parametrize("shape", ["n_q=0", "n_k=0", "d=0", "d_v=0", "batch=0"])
def test_empty_shapes(engine, shape):
    """Empty shapes give the right empty (or zero) output and zero gradients, never an internal error."""
    n_q, n_k, d, e, batch = 5, 6, 3, 4, 2
    n_q, n_k, d, e, batch = (0 if shape == f"{name}=0" else size
                             for name, size in zip(("n_q", "n_k", "d", "d_v", "batch"), (n_q, n_k, d, e, batch)))
    causal = engine == "causal"
    if causal:  # causal Sinkhorn is self-attention
        n_q = n_k = min(n_q, n_k)
    q = torch.randn(batch, n_q, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(batch, n_k, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(batch, n_k, e, dtype=torch.float64, requires_grad=True)
    case = Case(q, k, v, {"is_causal": True} if causal else {})
    n_iters = 1 if engine == "sdpa" else 5
    out = run(engine, case, n_iters=n_iters)
    assert out.shape == (batch, n_q, e)
    if causal:  # all scores 0 when d=0: uniform causal attention is the fixed point, row t the mean of v[:t+1]
        want = causal_reference(case, n_iters) if min(n_q, e, batch) else out.detach() * 0
        assert_close(out, want, 1e-9, f"causal {shape}")
        if shape == "d=0":
            means = v.cumsum(-2) / torch.arange(1, n_q + 1, dtype=v.dtype).unsqueeze(-1)
            assert_close(out, means, 1e-12, "d=0 gives the prefix means")
        if out.numel():
            assert all(g is None or torch.isfinite(g).all()
                       for g in torch.autograd.grad(out.sum(), (q, k, v), allow_unused=True))
        return
    want = run("dense", case, n_iters=n_iters)
    assert_close(out, want, 1e-9, f"{engine} {shape}")
    if shape == "n_k=0":
        assert not out.any()  # a query without keys returns zeros
    if shape == "d=0":  # all scores 0: uniform doubly stochastic weights, the mean of the values
        assert_close(out, v.mean(-2, keepdim=True).expand_as(out), 1e-12, "d=0 gives the mean value")
    if out.numel():
        grads = torch.autograd.grad(out.sum(), (q, k, v), allow_unused=True)
        assert all(g is None or torch.isfinite(g).all() for g in grads)


def test_nan_inputs_raise(engine):
    case = make_case("plain")
    q = case.q.clone()
    q[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="q contains NaN"):
        run(engine, Case(q, case.k, case.v), n_iters=1 if engine == "sdpa" else 5)


CAUSAL_CASES = ["plain", "key_padding", "query_and_key_padding", "all_keys_padded", "extreme"]


def causal_reference(case: Case, n_iters: int) -> torch.Tensor:
    """The definition, by brute force in float64: row t of the dense Sinkhorn of the prefix 0..t alone,
    column marginals those of uniform causal attention on that prefix."""
    q, k, v = (t.double() for t in (case.q, case.k, case.v))
    scale = case.kwargs.get("scale", 1 / math.sqrt(q.shape[-1]) if q.shape[-1] else 1.0)
    scores = scale * q @ k.transpose(-1, -2)
    n = scores.shape[-1]
    keep = torch.ones(n, n, dtype=torch.bool).tril().expand(scores.shape).clone()
    if "key_padding_mask" in case.kwargs:
        keep &= ~case.kwargs["key_padding_mask"][:, None, None, :]
    if "query_padding_mask" in case.kwargs:
        keep &= ~case.kwargs["query_padding_mask"][:, None, :, None]
    rows = []
    for t in range(n):
        sub_keep = keep[..., : t + 1, : t + 1]
        uniform = sub_keep.double() / sub_keep.sum(-1, keepdim=True).clamp_min(1)
        P = sinkformer.sinkhorn(scores[..., : t + 1, : t + 1], n_iters, mask=sub_keep, col_marginals=uniform.sum(-2))
        rows.append((P[..., t : t + 1, :] @ v[..., : t + 1, :]).squeeze(-2))
    return torch.stack(rows, dim=-2)


@pytest.mark.parametrize("n_iters", [2, 3, 4, 5])
@pytest.mark.parametrize("case_name", CAUSAL_CASES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_causal_sinkhorn(engine, case_name, n_iters, dtype):
    """``is_causal=True``: the causal engine (chosen by auto) equals the per-prefix definition, forward
    and gradients; every other engine refuses, naming ``is_causal`` and itself."""
    case = make_case(case_name).to(dtype)
    if engine not in ("auto", "causal"):
        with pytest.raises(ValueError, match="is_causal") as info:
            run(engine, case, n_iters=n_iters, is_causal=True)
        assert ENGINES[engine]["backend"].split("-")[0] in str(info.value)
        return
    mine, ref = leaves(case), leaves(case.to(torch.float64))
    out = run(engine, mine, n_iters=n_iters, is_causal=True)
    want = causal_reference(ref, n_iters)
    assert out.dtype == dtype
    rtol_out, rtol_grad = TOLERANCE[dtype]
    floor = 1e-12
    if case_name == "extreme":  # scores ~1e4: rounding of 1e4-sized terms, as in test_extreme_score_ranges;
        # a score error of eps * max|S| moves dq = scale * sum_j dS_tj k_j by up to that times max|k|
        top = (case.q.double() @ case.k.double().transpose(-1, -2)).abs().max().item()
        rtol_out = 4 * torch.finfo(dtype).eps * top
        rtol_grad = rtol_out * max(case.q.abs().max().item(), case.k.abs().max().item(), 1.0)
        floor = 1.0
    assert_close(out, want, rtol_out, f"{engine} causal forward", floor)
    grad_out = torch.randn(want.shape, generator=_gen(9), dtype=torch.float64)
    got = torch.autograd.grad(out, (mine.q, mine.k, mine.v), grad_out.to(dtype))
    ref_grads = torch.autograd.grad(want, (ref.q, ref.k, ref.v), grad_out)
    for name, a, b in zip("qkv", got, ref_grads):
        assert_close(a, b, rtol_grad, f"{engine} causal d{name}", floor)


def test_causal_sinkhorn_refuses_tol(engine):
    if engine in ("auto", "causal"):
        with pytest.raises(ValueError, match="is_causal=True with Sinkhorn attention needs a fixed n_iters"):
            run(engine, make_case("plain"), n_iters=None, tol=1e-6, is_causal=True)


def test_causal_sinkhorn_second_derivatives(engine):
    if engine not in ("auto", "causal"):
        return
    case = leaves(make_case("key_padding", batch=(1, 2), n=6, d=3, e=2))
    inputs = (case.q, case.k, case.v)
    assert torch.autograd.gradgradcheck(
        lambda q, k, v: run(engine, Case(q, k, v, case.kwargs), n_iters=5, is_causal=True), inputs)


def test_causal_masks_other_than_is_causal_are_refused(engine):
    """A causal ``attn_mask`` with Sinkhorn would balance the whole matrix (a leak): refused, pointing to
    ``is_causal=True``; ``n_iters=1`` is causal SoftMax on every engine."""
    case = make_case("plain")
    if engine != "sdpa":
        with pytest.raises(ValueError, match="leak from the future.*is_causal=True"):
            run(engine, case, n_iters=5, attn_mask=torch.ones(9, 9, dtype=torch.bool).tril())
    if engine == "causal":
        with pytest.raises(ValueError, match="engine 'causal' computes causal Sinkhorn"):
            run(engine, case, n_iters=1, is_causal=True)
        return
    out = run(engine, leaves(case), n_iters=1, is_causal=True)
    assert_close(out, run("sdpa", case, n_iters=1, is_causal=True), 1e-9, "n_iters=1 is causal SoftMax")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_implicit_backward(engine, dtype):
    """``backward="implicit"``: the gradient of the balanced fixed point (tiled engine only)."""
    case = make_case("key_padding")
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    missing = expect(engine, features_of(case, None, tol, "implicit"))
    if engine == "auto":
        missing = None  # auto routes implicit to the tiled engine
    c = leaves(case.to(dtype))
    if missing:
        assert_raises_naming(engine, missing, lambda: run(engine, c, n_iters=None, tol=tol, backward="implicit"))
        return
    out = run(engine, c, n_iters=None, tol=tol, max_iters=10_000, backward="implicit")
    ref = leaves(case)
    want = reference(ref, n_iters=401)  # the unrolled map at convergence
    grad_out = torch.randn(want.shape, generator=_gen(8), dtype=torch.float64)
    got = torch.autograd.grad(out, (c.q, c.k, c.v), grad_out.to(dtype))
    ref_grads = torch.autograd.grad(want, (ref.q, ref.k, ref.v), grad_out)
    for name, a, b in zip("qkv", got, ref_grads):
        assert_close(a, b, 1e-7 if dtype == torch.float64 else 2e-5, f"{engine} implicit d{name}")


def test_unreached_tolerance_warns_with_the_error(engine):
    """A tolerance not reached within max_iters: one SinkhornConvergenceWarning with the error reached."""
    if {"iterations", "noncausal"} & UNSERVED[engine]:
        return  # sdpa: no iterations; causal: needs a fixed n_iters (test_causal_sinkhorn_refuses_tol)
    case = make_case("plain").to(torch.float32)
    with pytest.warns(SinkhornConvergenceWarning, match=r"did not reach tol=1e-09 within max_iters=7 .*column error"):
        out = run(engine, case, n_iters=None, tol=1e-9, max_iters=7)
    # it returns the state after max_iters normalisations (here 7), identical on every engine
    assert_close(out, reference(case, n_iters=7), 2e-5, f"{engine} unconverged tol mode")


@pytest.mark.parametrize("block", [7, 30])
@pytest.mark.parametrize("n_iters", [1, 2, 5])
@pytest.mark.parametrize("case_name", ["plain", "cross", "key_padding", "bool_mask"])
def test_tiled_engine_in_small_cache_blocks(monkeypatch, block, n_iters, case_name):
    """The tiled engine visits each tile in cache blocks (rows of one slice, or whole slices); the grid's
    tiles are too small to be split, so here blocks of 7 and 30 scores split every tile."""

    monkeypatch.setattr(sizes, "CACHE_BLOCK_ELEMENTS", block)
    monkeypatch.setattr(sizes, "WHOLE_SLICE_BUDGETS", 1)
    check_cell("tiled", make_case(case_name), torch.float64, n_iters=n_iters)
    check_cell("tiled", make_case(case_name), torch.float32, n_iters=n_iters, grads=False)


@pytest.mark.parametrize("n_iters", [2, 5, 21])
@pytest.mark.parametrize("case_name", ["plain", "cross", "key_padding", "query_and_key_padding", "bool_mask",
                                       "float_mask", "all_keys_padded"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_tiled_engine_recomputing_its_tiles(monkeypatch, case_name, n_iters, dtype):
    """Calls of up to ``SAVED_TILE_SCORES`` scores (every call of the grid) keep the tiles of the forward for
    the backward; larger ones recompute them there. Here every call recomputes."""

    monkeypatch.setattr(sizes, "SAVED_TILE_SCORES", 0)
    check_cell("tiled", make_case(case_name), dtype, n_iters=n_iters)


@pytest.mark.parametrize("n_iters", [1, 4, 5, None])
@pytest.mark.parametrize("case_name", ["plain", "cross", "query_and_key_padding", "float_mask", "extreme"])
def test_tiled_engine_groups_on_threads(monkeypatch, n_iters, case_name):
    """On the CPU the tiled engine's groups of slices run on one Python thread per core
    (:mod:`sinkformer.sinkhorn.cpu_parallel`); the grid's calls are too small for it, so here every
    slice is its own group, threads are used at any size, and tiles are split in 7-score blocks
    (``n_iters=None``: tol mode, each matrix stopping on its own)."""
    from sinkformer.sinkhorn import cpu_parallel

    monkeypatch.setattr(sizes, "TILE_ELEMENTS", 1)
    monkeypatch.setattr(sizes, "CACHE_BLOCK_ELEMENTS", 7)
    monkeypatch.setattr(sizes, "WHOLE_SLICE_BUDGETS", 1)
    monkeypatch.setattr(cpu_parallel, "PARALLEL_ABOVE", 0)
    tol = 1e-10 if n_iters is None else None
    if tol is not None and case_name == "extreme":  # not balanceable: both engines stop at max_iters and say so
        with pytest.warns(SinkhornConvergenceWarning, match="did not reach tol"):
            check_cell("tiled", make_case(case_name), torch.float64, tol=tol, max_iters=101)
    else:
        check_cell("tiled", make_case(case_name), torch.float64, n_iters=n_iters, tol=tol)
    if n_iters == 5:  # and the implicit backward, against the unrolled map at convergence
        test_implicit_backward("tiled", torch.float64)


def test_every_engine_is_in_the_grid():
    from sinkformer.attention.backends import ENGINES as LIBRARY_ENGINES

    listed = {name.split("-")[0] for name in ENGINES} - {"auto"}
    assert listed == set(LIBRARY_ENGINES)
    assert math.isfinite(sum(TOLERANCE[torch.float64]))


# --------------------------------------------------------------------------------------------
# issue 23: large negative masks are masking, causal masks are refused, overflowing scores raise


@pytest.mark.parametrize("excluded", [float("-inf"), -1e4, -1e9, torch.finfo(torch.float32).min])
def test_additive_masks_at_or_below_minus_1e4_are_masking(engine, excluded):
    """Sinkhorn's column normalisation undoes a finite bias shared by a column, so an additive entry at or
    below -1e4 masks (BERT's -1e4, the official Sinkformers' -1e9, Hugging Face's finfo.min), exactly as
    the bool mask does: here a fully masked row, a fully masked column and scattered entries."""
    case = make_case("bool_mask")
    keep = case.kwargs["attn_mask"]
    additive = torch.zeros(keep.shape, dtype=torch.float64).masked_fill(~keep, excluded)
    check_cell(engine, Case(case.q, case.k, case.v, {"attn_mask": additive}), torch.float64, n_iters=5)
    if engine not in ("auto", "causal") and "iterations" not in UNSERVED[engine]:
        got = run(engine, Case(case.q, case.k, case.v, {"attn_mask": additive}), n_iters=5)
        assert_close(got, run(engine, case, n_iters=5), 1e-12, f"{engine}: {excluded} masks as False does")


@pytest.mark.parametrize("spelling", ["-inf", "-1e9", "finfo.min", "bool", "hf-4d-padded", "one-head"])
def test_causal_masks_of_every_spelling_are_refused(engine, spelling):
    """Issue 23.1: any attn_mask that excludes every key after its query, in some slice, balanced as a
    whole would leak from the future: every Sinkhorn engine refuses it, pointing to is_causal=True."""
    if engine == "sdpa":
        return  # SoftMax: a causal mask is causal
    future = torch.ones(9, 9, dtype=torch.bool).triu(1)
    value = {"-inf": float("-inf"), "-1e9": -1e9, "finfo.min": torch.finfo(torch.float64).min}
    if spelling in value:
        mask = torch.zeros(9, 9, dtype=torch.float64).masked_fill(future, value[spelling])
    elif spelling == "bool":
        mask = ~future
    elif spelling == "hf-4d-padded":  # (B, 1, n, n), left padding in the first sequence
        keep = (~future).expand(2, 1, 9, 9).clone()
        keep[0, ..., :3] = False
        mask = torch.zeros(2, 1, 9, 9, dtype=torch.float64).masked_fill(~keep, torch.finfo(torch.float64).min)
    else:  # causal in one head of three only
        mask = torch.ones(1, 3, 9, 9, dtype=torch.bool)
        mask[0, 2] = ~future
    with pytest.raises(ValueError, match="leak from the future.*is_causal=True"):
        run(engine, make_case("plain"), n_iters=5, attn_mask=mask)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_overflowing_scores_raise(engine, dtype):
    """Issue 23.5: finite q and k whose scores overflow gave NaN on every engine but dense: each raises,
    naming the cause; a scale of 1e38 is refused where it overflows."""
    case = make_case("plain").to(dtype)
    kwargs = {"n_iters": 1 if engine == "sdpa" else 3, "is_causal": engine == "causal"}
    big = torch.finfo(dtype).max ** 0.5
    with pytest.raises(ValueError, match=f"attention scores overflow {dtype}"):
        run(engine, Case(case.q * big, case.k * big, case.v), **kwargs)
    with pytest.raises(ValueError, match=f"attention scores overflow {dtype}"):
        run(engine, Case(case.q, case.k, case.v, {"scale": torch.finfo(dtype).max / 2}), **kwargs)
