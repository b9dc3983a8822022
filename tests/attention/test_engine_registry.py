"""The engine registry: capabilities as data, every reason, "auto" as a priority list, generated docs.

A new engine is one module (here, this file) and one registration line: the test engine below
computes Sinkhorn attention by plain alternate log-normalisations of the materialised scores, and
``attention(..., backend="reference")``, ``explain()``, the errors and the engine tables serve it
without any other file changing.
"""

from __future__ import annotations

import pytest
import torch

from sinkformer import attention
from sinkformer.attention import backends
from sinkformer.attention.backends import Call, Engine, Prepared, choose, engine_table, reasons, register
from sinkformer.runs import readme


def run_reference(p: Prepared) -> torch.Tensor:
    """Sinkhorn attention, ``n_iters`` alternate row/column log-normalisations (column ones with the
    ``n_q / n_k`` column marginal), on the materialised scores of ``(*batch, n, d)`` operands."""
    scores = p.scale * p.q @ p.k.transpose(-1, -2)
    keep = torch.ones_like(scores, dtype=torch.bool) if p.keep is None else p.keep.expand(scores.shape)
    scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min / 4)  # finite: no NaN in the gradients
    rows, cols = keep.any(-1, keepdim=True), keep.any(-2, keepdim=True)  # the valid ones
    n_valid, m_valid = (x.sum(d, keepdim=True).to(scores.dtype) for x, d in ((rows, -2), (cols, -1)))
    log_col = (n_valid / m_valid).log()  # the column marginal n_q / n_k, of the valid ones
    for i in range(p.call.n_iters):
        if i % 2 == 0:
            scores = torch.where(rows, scores - scores.logsumexp(-1, keepdim=True), scores)
        else:
            scores = torch.where(cols, scores - scores.logsumexp(-2, keepdim=True) + log_col, scores)
    return (scores.exp() @ p.v).to(p.out_dtype)


def small(call: Call) -> str | None:
    return "fewer than 100 scores: the reference loop" if call.scores < 100 else None


@pytest.fixture
def reference():
    """The test engine, registered before 'tiled' for the length of a test."""
    engine = register(Engine("reference", "alternate log-normalisations (a test engine)", "the weights",
                             run_reference, tol=False, prefers=small, module="tests.attention.test_engine_registry"),
                      before="tiled")
    yield engine
    backends.unregister("reference")


def qkv(n=8, m=None, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    m = n if m is None else m
    return (torch.randn(2, 3, n, 4, generator=g, dtype=dtype), torch.randn(2, 3, m, 4, generator=g, dtype=dtype),
            torch.randn(2, 3, m, 5, generator=g, dtype=dtype))


@pytest.mark.parametrize("n_iters", [1, 2, 5])
@pytest.mark.parametrize("n, m", [(8, 8), (7, 11)])
def test_a_registered_engine_serves_calls_equal_to_the_dense_reference(reference, n_iters, n, m):
    q, k, v = (t.requires_grad_() for t in qkv(n, m))
    pad = torch.zeros(2, m, dtype=torch.bool)
    pad[0, -2:] = True
    out = attention(q, k, v, n_iters=n_iters, key_padding_mask=pad, backend="reference")
    want = attention(q, k, v, n_iters=n_iters, key_padding_mask=pad, backend="dense")
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(want, (q, k, v), g)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_auto_takes_it_where_it_prefers_the_call_in_its_priority_place(reference):
    q, k, v = qkv(8)
    choice = attention.explain(q, k, v)
    assert str(choice) == "reference: fewer than 100 scores: the reference loop"
    assert attention.explain(*qkv(12)).engine == "tiled"  # 144 scores: it does not prefer the call
    assert attention.explain(q, k, v, normalization="softmax").engine == "sdpa"  # sdpa comes first
    # a call it cannot serve (dropout, tol) goes on down the list, the reasons kept
    dropped = attention.explain(q, k, v, dropout_p=0.1)
    assert dropped.engine == "tiled" and "dropout_p=0.1 is not served by engine 'reference'" in dropped.reason
    assert dropped.passed_over == {"reference": ("dropout_p=0.1 is not served by engine 'reference'; "
                                                 "engines 'dense' and 'tiled' serve it",)}
    assert attention.explain(q, k, v, n_iters=None, tol=1e-6).engine == "tiled"


def test_a_forced_engine_is_refused_with_every_reason(reference):
    q, k, v = qkv(8)
    with pytest.raises(ValueError) as info:
        attention(q, k, v, backend="reference", dropout_p=0.1, return_weights=True, n_iters=None, tol=1e-6)
    message = str(info.value)
    assert message.startswith("backend='reference' cannot serve this call: ")
    for words in ("tol=1e-06 is not served by engine 'reference'", "return_weights=True",
                  "dropout_p=0.1 is not served by engine 'reference'"):
        assert words in message, message
    assert len(reasons(reference, Call("sinkhorn", None, 1e-6, 8, 8, return_weights=True, dropout_p=0.1))) == 3
    assert reasons(reference, Call("sinkhorn", 5, None, 8, 8)) == ()


def test_the_engine_tables_list_it_and_the_error_for_unknown_names_too(reference):
    assert "| `reference` | alternate log-normalisations (a test engine) |" in engine_table()
    assert "reference" in backends.ENGINES and backends.BACKENDS[0] == "auto"
    with pytest.raises(ValueError, match="backend must be one of .*'reference'"):
        attention(*qkv(8), backend="referense")


def test_registration_refuses_a_taken_name_and_an_unknown_place():
    with pytest.raises(ValueError, match="engine name 'tiled' is already taken"):
        register(Engine("tiled", "", "", run_reference))
    with pytest.raises(ValueError, match="before must name a registered engine"):
        register(Engine("another", "", "", run_reference), before="fastest")
    assert "another" not in backends.ENGINES


def test_every_reason_names_its_argument():
    """Each capability an engine lacks gives a reason naming the argument, read off the data alone."""
    bare = Engine("bare", "", "", run_reference, iterations=False, tol=False)
    call = Call("sinkhorn", None, 0.1, 8, 8, return_weights=True, measure_weights=True, bias_requires_grad=True,
                dropout_p=0.1, backward="implicit", chunk_size=4, causal=True, device="meta")
    found = " | ".join(reasons(Engine("bare", "", "", run_reference, tol=False, devices=("cpu",)), call))
    for argument in ("is_causal=True", "tol=0.1", "backward='implicit'", "return_weights=True", "key_weights",
                     "dropout_p=0.1", "attn_mask", "chunk_size=4", "device 'meta'"):
        assert argument in found, (argument, found)
    assert "computes SoftMax only" in " ".join(reasons(bare, Call("sinkhorn", 5, None, 8, 8)))
    assert "got normalization='relu'" in " ".join(reasons(bare, Call("relu", 5, None, 8, 8)))


def test_a_call_no_engine_serves_lists_each_engines_reasons():
    q, k, v = qkv(8)
    with pytest.raises(ValueError, match="(?s)no engine can serve this call.*\n  tiled: .*return_weights=True.*"
                                         "\n  dense: backward='implicit'"):
        attention(q, k, v, backward="implicit", return_weights=True)
    with pytest.raises(ValueError, match="(?s)causal: key_weights/query_weights is not served by engine 'causal'; "
                                         "no registered engine serves it together with this call's other options"):
        attention(q, k, v, is_causal=True, n_iters=3, key_weights=torch.ones(2, 8, dtype=torch.float64))


def test_auto_reproduces_the_documented_rules():
    """The priority list gives the rules docs/api.md states, call by call."""
    big = 1 << 13
    cases = {
        Call("softmax", 5, None, 64, 64): "sdpa",
        Call("sinkhorn", 1, None, 64, 64, device="cuda"): "sdpa",
        Call("sinkhorn", 3, None, 64, 64, causal=True): "causal",
        Call("sinkhorn", 5, None, 64, 64): "tiled",
        Call("sinkhorn", 5, None, big, big): "streamed",
        Call("sinkhorn", 5, None, big, big, dropout_p=0.1): "tiled",
        Call("sinkhorn", 5, None, big, big, backward="implicit"): "tiled",
        Call("sinkhorn", 5, None, 64, 64, chunk_size=8): "streamed",
        Call("sinkhorn", 5, None, 64, 64, return_weights=True): "dense",
        Call("softmax", 5, None, 64, 64, return_weights=True): "dense",
        Call("sinkhorn", 5, None, 64, 64, bias_requires_grad=True): "dense",
        Call("relu", 5, None, 64, 64): "dense",
        Call("sinkhorn", 5, None, 64, 64, measure_weights=True): "dense",
    }
    for call, name in cases.items():
        assert choose(call).engine == name, (call, choose(call))


def test_the_docs_tables_are_the_registry():
    for page in (readme.DOCS / "api.md", readme.DOCS / "architecture.md"):
        text = page.read_text()
        assert f"{readme.ENGINES_BEGIN}\n{engine_table()}\n{readme.ENGINES_END}" in text, page.name
    for e in backends.engines():
        assert f"| `{e.name}` |" in engine_table()
