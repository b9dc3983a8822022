"""``python -m benchmarks causal``: the weight statistics it commits and the table it renders."""

from __future__ import annotations

import math

from benchmarks.causal import markdown, weight_statistics


def test_weight_statistics_show_the_degenerate_marginals():
    rows = {(r["marginals"], r["n_iters"]): r for r in weight_statistics(n=32, iters=(1, 51))}
    softmax = rows["causal", 1]["entropy"]
    one = {key: rows["causal", 1][key] for key in ("entropy", "diagonal")}
    assert one == {key: rows["uniform", 1][key] for key in ("entropy", "diagonal")}  # SoftMax: no marginals
    assert abs(rows["causal", 51]["entropy"] - softmax) < 0.1 * softmax
    assert rows["uniform", 51]["diagonal"] > 0.5 > rows["causal", 51]["diagonal"]


def test_markdown_lists_every_row_with_its_ratio_to_sdpa():
    rows = [{"method": "sdpa", "n": 8, "n_iters": 1, "forward_ms": 1.0, "forward_backward_ms": 2.0, "peak_mib": 1.0},
            {"method": "causal", "n": 8, "n_iters": 3, "forward_ms": 2.0, "forward_backward_ms": 5.0, "peak_mib": 3.0},
            {"method": "causal", "n": 8, "n_iters": 5, "error": "killed"}]
    text = markdown({"date": "2026-01-01", "machine": "m", "cores": 2, "torch": "t", "repeats": 3, "rows": rows,
                     "weights": weight_statistics(n=8, iters=(1,)), "uniform_entropy": math.log(2)})
    assert "| causal Sinkhorn, n_iters=3 | 8 | 2.0 | 5.0 | 2.5 | 3 |" in text
    assert "| causal Sinkhorn, n_iters=5 | 8 | — | — | — | killed |" in text
