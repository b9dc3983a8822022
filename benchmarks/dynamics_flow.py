"""Sinkformer particle flow: streamed, warm-started Sinkhorn (ours) vs POT's ``ot.sinkhorn`` from scratch.

The flow is :math:`\\dot x_i = \\Gamma^{\\rm Sk}_{\\mu_t}(x_i)` for ``N`` particles in d = 2, integrated with ``steps``
explicit Euler steps. Each step needs the bistochastic Sinkhorn coupling of the current cloud:

* ``ours``: :class:`sinkformer.dynamics.ParticleField` — float32, Sinkhorn potentials by the streamed sweeps of
  :mod:`sinkformer.sinkhorn.streamed` (memory ``O(N * chunk)``, never an ``N x N`` matrix), warm-started from
  the previous step, the averaged symmetric update when ``A`` is symmetric PSD;
* ``pot``: each step from scratch, ``ot.sinkhorn(a, a, M=-C, reg=1, method="sinkhorn_log")`` on the dense
  float64 cost matrix (``K_inf = N * plan``, ``docs/theory.md`` §6.4), then the field ``N * plan @ (x V^T)``.

Equal accuracy: both stop at the same marginal tolerance — ours at a relative column error
:math:`\\max_j|\\sum_i \\pi_{ij}/w_j - 1| \\le` ``tol``, POT at :math:`\\|\\pi^\\top 1 - 1/N\\|_2 \\le` ``tol/sqrt(N)``
(the same per-column bound in POT's norm); the two fields are compared on the same clouds.

Two cases: ``diffusion`` (Assumption 1 with :math:`A = I/\\varepsilon \\succ 0`, :math:`V = -I`, the heat-flow
Sinkformer) and ``generic`` (random non-symmetric :math:`Q, K, V`). POT is far too slow to run all steps at
N = 10,000: it runs the first ``--baseline-steps`` steps of the same trajectory and its total is the mean
step time times ``steps`` (stated as extrapolated in the results). Each (method, case) runs in a fresh
process; peak memory is the rise of the resident-set high-water mark (``VmHWM``).

    python -m benchmarks dynamics --cases diffusion                    # N = 10,000: dynamics_flow.{json,md}
    python -m benchmarks dynamics --cases generic --n 2000 --tag generic  # dynamics_flow_generic.{json,md}
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
CASES = ("diffusion", "generic")


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _problem(case: str, n: int, seed: int):
    """Initial cloud (float64) and ``(params, eps)`` of a case."""
    import torch

    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(n, 2, dtype=torch.float64, generator=g)
    eye = torch.eye(2, dtype=torch.float64)
    if case == "diffusion":
        return x0, (eye, eye, -eye), 0.1
    params = tuple(0.7 * torch.randn(2, 2, dtype=torch.float64, generator=g) for _ in range(3))
    return x0, params, 1.0


def run_ours(case: str, args: argparse.Namespace, store: Path) -> dict:
    import numpy as np

    from sinkformer.dynamics import ParticleField

    x0, params, eps = _problem(case, args.n, args.seed)
    field = ParticleField(tuple(p.float() for p in params), "sinkhorn", eps=eps, tol=args.tol, max_iters=100_000)
    x = x0.float()
    field(0.0, x[:256])  # warm-up (kernels, imports) on a small cloud
    field.potential, field.sinkhorn_iters = None, 0
    Path("/proc/self/clear_refs").write_text("5")
    base = _status_kib("VmRSS")
    clouds, fields = [], []
    start = time.perf_counter()
    for step in range(args.steps):
        v = field(step * args.h, x)
        if step < args.baseline_steps:
            clouds.append(x.double().numpy())
            fields.append(v.double().numpy())
        x = x + args.h * v
    seconds = time.perf_counter() - start
    np.save(store / f"{case}_clouds.npy", np.stack(clouds))
    np.save(store / f"{case}_fields.npy", np.stack(fields))
    return {"method": "ours", "case": case, "seconds": seconds, "per_step": seconds / args.steps,
            "sinkhorn_normalisations": field.sinkhorn_iters, "peak_mib": (_status_kib("VmHWM") - base) / 1024,
            "steps_run": args.steps}


def run_pot(case: str, args: argparse.Namespace, store: Path) -> dict:
    import numpy as np
    import ot

    _, params, eps = _problem(case, args.n, args.seed)
    Q, K, V = (p.numpy() for p in params)
    clouds = np.load(store / f"{case}_clouds.npy")
    ours = np.load(store / f"{case}_fields.npy")
    n = args.n
    a = np.full(n, 1.0 / n)
    Path("/proc/self/clear_refs").write_text("5")
    base = _status_kib("VmRSS")
    times, diffs, iters = [], [], []
    for x, reference in zip(clouds, ours):
        start = time.perf_counter()
        C = (x @ Q.T) @ (x @ K.T).T / eps
        plan, log = ot.sinkhorn(a, a, -C, reg=1.0, method="sinkhorn_log", stopThr=args.tol / math.sqrt(n),
                                numItermax=100_000, log=True)
        v = n * plan @ (x @ V.T)
        times.append(time.perf_counter() - start)
        iters.append(int(log.get("niter", -1)))
        diffs.append(float(np.abs(v - reference).max() / np.abs(v).max()))
        del C, plan
    per_step = float(np.mean(times))
    return {"method": "pot", "case": case, "seconds": per_step * args.steps, "per_step": per_step,
            "extrapolated_from_steps": len(times), "pot_iterations": iters, "field_difference_vs_ours": diffs,
            "peak_mib": (_status_kib("VmHWM") - base) / 1024}


def _flags(args: argparse.Namespace) -> list[str]:
    return [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in ("n", "steps", "h", "tol", "baseline_steps", "seed", "threads")]


def run_all(args: argparse.Namespace) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases:
            for method in ("ours", "pot"):
                cmd = [sys.executable, __file__, "--worker", method, case, tmp] + _flags(args)
                proc = subprocess.run(cmd, capture_output=True, text=True)
                if proc.returncode != 0:
                    raise RuntimeError(f"{method}/{case} failed:\n{proc.stderr}")
                row = json.loads(proc.stdout.strip().splitlines()[-1])
                rows.append(row)
                print(f"{case:>9} {method:>4}: {row['seconds']:9.1f} s ({row['per_step']:.3f} s/step), "
                      f"peak +{row['peak_mib']:.0f} MiB", flush=True)
    return rows


def write_results(rows: list[dict], args: argparse.Namespace, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    by = {(r["case"], r["method"]): r for r in rows}
    speedups = {c: by[(c, "pot")]["seconds"] / by[(c, "ours")]["seconds"] for c in args.cases}
    config = {k: getattr(args, k) for k in ("n", "steps", "h", "tol", "baseline_steps", "seed", "threads")}
    payload = {"config": config, "rows": rows, "speedup": speedups, "target_speedup": 10,
               "machine": {"cpus": os.cpu_count(), "torch_threads": args.threads,
                           "load_average_at_start": args.load}}
    name = "dynamics_flow" + (f"_{args.tag}" if args.tag else "")
    (out / f"{name}.json").write_text(json.dumps(payload, indent=2))
    lines = [
        f"Sinkformer particle flow, N = {args.n}, d = 2, {args.steps} Euler steps (h = {args.h}), marginal tolerance "
        f"{args.tol:g}; {os.cpu_count()} CPU cores, {args.threads} torch thread(s), load average {args.load:.2f} at start. "
        f"POT: first {args.baseline_steps} steps timed, total extrapolated.",
        "",
        "| case | ours: time (s) | ours: peak memory (MiB) | ours: Sinkhorn normalisations | POT: time (s) | POT: peak memory (MiB) | POT iterations per step | speed-up | field difference (max rel.) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in args.cases:
        o, p = by[(c, "ours")], by[(c, "pot")]
        lines.append(
            f"| {c} | {o['seconds']:.1f} | {o['peak_mib']:.0f} | {o['sinkhorn_normalisations']} | "
            f"{p['seconds']:.1f} (extrapolated) | {p['peak_mib']:.0f} | {p['pot_iterations']} | "
            f"{speedups[c]:.1f}x | {max(p['field_difference_vs_ours']):.1e} |"
        )
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print((out / f"{name}.md").read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", nargs=3, metavar=("METHOD", "CASE", "STORE"), help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, default=10_000)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--h", type=float, default=0.01)
    parser.add_argument("--tol", type=float, default=1e-4)
    parser.add_argument("--baseline-steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--tag", default="", help="suffix of the result files (dynamics_flow_TAG.json)")
    args = parser.parse_args(argv)
    if args.worker:
        import torch

        torch.set_num_threads(args.threads)
        method, case, store = args.worker
        row = (run_ours if method == "ours" else run_pot)(case, args, Path(store))
        print(json.dumps(row))
        return 0
    args.load = os.getloadavg()[0]
    write_results(run_all(args), args, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
