"""Causal Sinkhorn attention next to causal SoftMax (SDPA): time, memory, and what the weights look like.

``python -m benchmarks causal`` measures, for b = 1, h = 8, d = 64, float32 (CPU):

* forward and forward+backward medians of ``F.scaled_dot_product_attention(is_causal=True)`` and
  of ``sinkformer.attention(is_causal=True, n_iters=N)`` (engine ``"causal"``) for
  n in {1024, 4096} (``--quick``: {256, 512}); each configuration in fresh processes (time;
  peak resident-memory rise of one forward+backward, as ``benchmarks/attention.py`` measures it);
* the weights of random scores (n = 256, 8 heads, q·k/√d with standard normal q, k, d = 64):
  mean row entropy and mean diagonal mass as ``n_iters`` grows, with the causal marginals (those
  of uniform causal attention) and with uniform marginals — the degenerate choice.

Results: ``benchmarks/results/causal.{json,md}``; ``docs/speed.md`` and ``docs/theory.md`` include
the tables.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
ITERS = (2, 3, 5)
CUBIC_UP_TO = 1024  # n_iters >= 4 costs O(n^3) (one matrix product per extra normalisation): not run above


def measure(method: str, n: int, n_iters: int, what: str, repeats: int) -> dict:
    """One configuration in this process: ``what="memory"`` the peak RSS rise of one forward+backward,
    ``what="time"`` median forward and forward+backward times (ms)."""
    import torch
    import torch.nn.functional as F

    from benchmarks.attention import median_seconds, peak_rise_mib
    from sinkformer import attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8, n, 64, requires_grad=True) for _ in range(3))

    def fn(q, k, v):
        if method == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return attention(q, k, v, is_causal=True, n_iters=n_iters)

    def forward_backward():
        for t in (q, k, v):
            t.grad = None
        fn(q, k, v).sum().backward()

    forward_backward()  # warm-up
    if what == "memory":
        for t in (q, k, v):
            t.grad = None
        return {"peak_mib": peak_rise_mib(lambda: fn(q, k, v).sum().backward())}

    def forward():
        with torch.no_grad():
            fn(q, k, v)

    return {"forward_ms": 1e3 * median_seconds(forward, repeats),
            "forward_backward_ms": 1e3 * median_seconds(forward_backward, repeats)}


def _worker(config: dict) -> dict:
    result = {}
    malloc = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}
    for what, env in (("memory", malloc), ("time", {})):
        cmd = [sys.executable, "-m", "benchmarks.causal", "--worker", json.dumps({**config, "what": what})]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, **env),
                              cwd=Path(__file__).resolve().parent.parent)
        if proc.returncode != 0:
            return {"error": (proc.stderr.strip().splitlines() or ["killed"])[-1]}
        result.update(json.loads(proc.stdout.strip().splitlines()[-1]))
    return result


def weight_statistics(n: int = 256, iters=(1, 3, 5, 11, 51)) -> list[dict]:
    """Mean row entropy (nats) and mean diagonal mass of causal Sinkhorn weights of random scores (odd
    ``n_iters`` only: they end on a row normalisation, so every row is a distribution)."""
    import torch

    from sinkformer.sinkhorn.prefix import prefix_sinkhorn

    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(8, n, 64, generator=g, dtype=torch.float64) for _ in range(2))
    scores = q @ k.transpose(-1, -2) / 8.0
    rows = []
    for marginals in ("causal", "uniform"):
        for n_iters in iters:
            P = prefix_sinkhorn(scores, n_iters, marginals=marginals)
            entropy = -(P * P.clamp_min(1e-300).log()).sum(-1).mean().item()
            rows.append({"marginals": marginals, "n_iters": n_iters, "entropy": entropy,
                         "diagonal": P.diagonal(dim1=-2, dim2=-1).mean().item()})
    return rows


def markdown(result: dict) -> str:
    lines = [f"Measured {result['date']} on {result['machine']} with {result['cores']} CPU cores, torch "
             f"{result['torch']}; b = 1, h = 8, d = 64, float32, medians of {result['repeats']} rounds.", "",
             "| attention | n | forward (ms) | forward+backward (ms) | × causal SDPA | peak memory (MiB) |",
             "|---|---:|---:|---:|---:|---:|"]
    sdpa = {r["n"]: r for r in result["rows"] if r["method"] == "sdpa"}
    for r in result["rows"]:
        name = "causal SDPA (SoftMax)" if r["method"] == "sdpa" else f"causal Sinkhorn, n_iters={r['n_iters']}"
        if "error" in r:
            lines.append(f"| {name} | {r['n']} | — | — | — | {r['error']} |")
            continue
        ratio = r["forward_backward_ms"] / sdpa[r["n"]]["forward_backward_ms"]
        lines.append(f"| {name} | {r['n']} | {r['forward_ms']:.1f} | {r['forward_backward_ms']:.1f} | {ratio:.1f} | "
                     f"{r['peak_mib']:.0f} |")
    lines += ["", f"n_iters ≥ 4 costs one n³ matrix product per normalisation after the third (but a final "
              f"row update); it is measured up to n = {CUBIC_UP_TO}.", "", "Weights of random scores (n = 256, 8 heads; entropy of uniform causal attention: "
              f"{result['uniform_entropy']:.3f} nats):", "",
              "| column marginals | n_iters | mean row entropy (nats) | mean diagonal mass |", "|---|---:|---:|---:|"]
    for r in result["weights"]:
        lines.append(f"| {r['marginals']} | {r['n_iters']} | {r['entropy']:.3f} | {r['diagonal']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks causal", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="n in {256, 512}, results not written")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for causal.{json,md}")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        config = json.loads(args.worker)
        print(json.dumps(measure(config["method"], config["n"], config["n_iters"], config["what"], config["repeats"])))
        return 0
    import torch

    from benchmarks.attention import cpu_model

    sizes = (256, 512) if args.quick else (1024, 4096)
    rows = []
    for n in sizes:
        for method, n_iters in [("sdpa", 1)] + [("causal", k) for k in ITERS if k <= 3 or n <= CUBIC_UP_TO]:
            row = {"method": method, "n": n, "n_iters": n_iters}
            row.update(_worker({**row, "repeats": args.repeats if n < 4096 else 3}))
            print(json.dumps(row), flush=True)
            rows.append(row)
    n_w = 256
    result = {"date": datetime.date.today().isoformat(), "machine": f"{platform.machine()} ({cpu_model()})",
              "cores": os.cpu_count(), "torch": torch.__version__, "repeats": args.repeats, "rows": rows,
              "weights": weight_statistics(n_w),
              "uniform_entropy": sum(math.log(i) for i in range(1, n_w + 1)) / n_w}
    text = markdown(result)
    print(text)
    if not args.quick:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "causal.json").write_text(json.dumps(result, indent=1) + "\n")
        (args.out / "causal.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
