"""benchmarks/overhead.py: its floor computes what the library does, and its table from measured rows."""

import torch

import sinkformer
from benchmarks import overhead


def test_the_floor_is_sinkhorn_attention_with_its_exact_gradient():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, n, 5, generator=g, dtype=torch.float64, requires_grad=True) for n in (7, 9, 9))
    grad_out = torch.randn(2, 3, 7, 5, generator=g, dtype=torch.float64)
    ours = sinkformer.attention(q, k, v, n_iters=overhead.N_ITERS)
    floor = overhead.floor_attention(q, k, v)
    torch.testing.assert_close(floor, ours, rtol=0, atol=1e-12)
    for a, b in zip(torch.autograd.grad(floor, (q, k, v), grad_out), torch.autograd.grad(ours, (q, k, v), grad_out)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_the_floor_against_finite_differences():
    g = torch.Generator().manual_seed(1)
    inputs = [torch.randn(2, n, 3, generator=g, dtype=torch.float64, requires_grad=True) for n in (4, 6, 6)]
    assert torch.autograd.gradcheck(lambda q, k, v: overhead.Floor.apply(q, k, v, 0.7)[0], inputs)


def test_the_table_gives_the_fixed_cost_and_the_ratios():
    row = {"n": 16, "batch": 4, "heads": 8, "rounds": 1, "sdpa forward": 0.05, "sdpa forward+backward": 0.25,
           "ours forward": 0.6, "ours forward+backward": 1.5, "floor forward": 0.15, "floor forward+backward": 0.5,
           "prepare forward": 0.12}
    text = overhead.render([row], {"rounds": 1, "when": "now", "machine": "m", "torch": "x"})
    assert "| 16 | 0.050 / 0.250 | 0.600 / 1.500 | 0.150 / 0.500 | 0.120 | 1.000 | 6.00 | 2.00 |" in text


def test_a_measurement_runs_and_restores_the_threads():
    threads = torch.get_num_threads()
    rows = overhead.measure(ns=(8,), rounds=1, progress=lambda s: None)
    assert torch.get_num_threads() == threads
    assert all(rows[0][key] > 0 for key in rows[0] if key.endswith("forward") or key.endswith("backward"))


def test_the_docs_paragraph_quotes_the_committed_run():
    """docs/speed.md's reading of the committed overhead run (42c88dd, native passes): ours / SDPA at n = 64 and
    128, a call below the floor there, and the cost around the arithmetic at n = 16 against the call's."""
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    rows = {r["n"]: r for r in json.loads((root / "benchmarks" / "results" / "overhead.json").read_text())["rows"]}
    text = " ".join((root / "docs" / "speed.md").read_text().split())
    ratio = {n: r["ours forward+backward"] / r["sdpa forward+backward"] for n, r in rows.items()}
    beyond = {n: r["ours forward+backward"] - r["floor forward+backward"] for n, r in rows.items()}
    assert f"ours / SDPA reads {ratio[64]:.2f} and {ratio[128]:.2f} on one thread" in text
    assert beyond[64] < 0 and beyond[128] < 0 and "(`ours − floor` negative)" in text
    assert (f"At n = 16 the cost around the arithmetic reads {beyond[16]:.2f} ms of a "
            f"{rows[16]['ours forward+backward']:.2f} ms call") in text
