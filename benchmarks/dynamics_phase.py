"""A phase diagram on the sphere in one tensor program vs a loop of single simulations.

The workload of Geshkovski et al.'s phase diagrams: ``--systems`` systems of ``--tokens`` tokens uniform on
:math:`S^{d-1}` for each of ``--betas`` inverse temperatures (:math:`\\beta` from 0 to ``--beta-max``), SoftMax
self-attention with :math:`Q = K = V = I` on the sphere, explicit Euler with step ``--dt`` to ``--t1``, the
single-cluster indicator and the interaction energy recorded every ``--record-every`` steps.

* ``batched``: :func:`sinkformer.dynamics.phase.phase_diagram` — every system of every :math:`\\beta` is one
  batch of :func:`sinkformer.dynamics.simulate` (``betas x systems`` clouds, :math:`\\beta` folded into each
  cloud's :math:`Q`); the whole run is timed.
* ``loop``: one :func:`~sinkformer.dynamics.simulate` call per system (the same Euler steps and diagnostics),
  ``--loop-systems`` of them timed; the total for all systems is extrapolated from their mean (stated as such).

Each method runs in its own process with ``--threads`` torch threads. Target (issue 27): 1,024 systems x 32
tokens x 64 values of beta to t = 30 in under 2 minutes on a 2-core CPU.

    python -m benchmarks phase                       # the target workload: dynamics_phase.{json,md}
    python -m benchmarks phase --systems 64 --t1 3 --out /tmp/phase   # a quick look
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
TARGET_SECONDS = 120.0
CONFIG_KEYS = ("systems", "tokens", "betas", "beta_max", "d", "t1", "dt", "record_every", "loop_systems", "seed",
               "threads", "device")


def _betas(args: argparse.Namespace):
    import torch

    return torch.linspace(0.0, args.beta_max, args.betas, dtype=torch.float64)


def run_batched(args: argparse.Namespace) -> dict:
    import torch

    from sinkformer.dynamics.phase import phase_diagram

    kwargs = dict(n_tokens=args.tokens, d=args.d, t1=args.t1, dt=args.dt, record_every=args.record_every,
                  seed=args.seed, device=args.device)
    phase_diagram("softmax", [1.0], n_systems=4, **{**kwargs, "t1": 2 * args.dt})  # warm-up (imports, kernels)
    if args.device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = phase_diagram("softmax", _betas(args), n_systems=args.systems, **kwargs)
    if args.device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {"method": "batched", "seconds": seconds, "systems_run": args.systems * args.betas,
            "single_cluster_final": result.single_cluster[-1].tolist()}


def run_loop(args: argparse.Namespace) -> dict:
    import torch

    from sinkformer.dynamics import simulate
    from sinkformer.dynamics.clustering import diagnostics
    from sinkformer.dynamics.phase import uniform_on_sphere

    steps = max(1, round(args.t1 / args.dt))
    betas = _betas(args)
    eye = torch.eye(args.d, device=args.device)
    gen = torch.Generator(torch.device(args.device)).manual_seed(args.seed)

    def one(beta: float) -> None:
        x0 = uniform_on_sphere((args.tokens,), args.d, generator=gen, device=args.device)
        simulate(x0, (beta * eye, eye, eye), t1=steps * args.dt, steps=steps, geometry="sphere",
                 record_every=args.record_every, keep_positions=False,
                 observe=lambda x: diagnostics(x, beta=max(beta, 1e-6), which=("single_cluster", "energy")))

    one(1.0)  # warm-up
    start = time.perf_counter()
    for i in range(args.loop_systems):
        one(float(betas[i % len(betas)]))
    seconds = time.perf_counter() - start
    per_system = seconds / args.loop_systems
    total = args.systems * args.betas
    return {"method": "loop", "seconds": per_system * total, "per_system": per_system, "systems_run": args.loop_systems,
            "extrapolated_to": total}


def _flags(args: argparse.Namespace) -> list[str]:
    return [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in CONFIG_KEYS]


def run_all(args: argparse.Namespace) -> list[dict]:
    rows = []
    for method in ("batched", "loop"):
        cmd = [sys.executable, "-m", "benchmarks.dynamics_phase", "--worker", method] + _flags(args)
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
        if proc.returncode != 0:
            raise RuntimeError(f"{method} failed:\n{proc.stderr}")
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(f"{method:>8}: {row['seconds']:9.1f} s" + (" (extrapolated)" if method == "loop" else ""), flush=True)
    return rows


def markdown(payload: dict) -> str:
    """The result table of a run (``payload`` as written to ``dynamics_phase.json``)."""
    c, m = payload["config"], payload["machine"]
    by = {r["method"]: r for r in payload["rows"]}
    batched, loop = by["batched"], by["loop"]
    met = "met" if batched["seconds"] < TARGET_SECONDS else "**missed**"
    lines = [
        f"Measured {payload['date']} on {m['machine']} ({m['cores']} cores, {c['threads']} torch threads, device "
        f"{c['device']}), torch {m['torch']}; load average {m['load_before']:.2f} before, {m['load_after']:.2f} after. "
        f"SoftMax self-attention on the sphere, Q = K = V = I, {c['systems']} systems x {c['tokens']} tokens x "
        f"{c['betas']} values of beta in [0, {c['beta_max']:g}], d = {c['d']}, explicit Euler dt = {c['dt']:g} to "
        f"t = {c['t1']:g}, single-cluster indicator and interaction energy every {c['record_every']} steps.",
        "",
        "| method | systems timed | time (s) | per system (ms) |",
        "|---|---:|---:|---:|",
        f"| batched (`phase_diagram`, one tensor program) | {batched['systems_run']} | {batched['seconds']:.1f} | "
        f"{1000 * batched['seconds'] / batched['systems_run']:.2f} |",
        f"| loop of single `simulate` calls | {loop['systems_run']} | {loop['seconds']:.1f} (extrapolated to "
        f"{loop['extrapolated_to']}) | {1000 * loop['per_system']:.2f} |",
        "",
        "| target | measured | |",
        "|---|---:|---|",
        f"| batched < {TARGET_SECONDS:.0f} s | {batched['seconds']:.1f} s | {met} |",
        f"| speed-up of the batch over the loop | {loop['seconds'] / batched['seconds']:.0f}x | |",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", choices=("batched", "loop"), help=argparse.SUPPRESS)
    parser.add_argument("--systems", type=int, default=1024, help="systems per value of beta")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--betas", type=int, default=64, help="values of beta, evenly spaced in [0, --beta-max]")
    parser.add_argument("--beta-max", type=float, default=9.0)
    parser.add_argument("--d", type=int, default=3)
    parser.add_argument("--t1", type=float, default=30.0)
    parser.add_argument("--dt", type=float, default=0.1)
    parser.add_argument("--record-every", type=int, default=10)
    parser.add_argument("--loop-systems", type=int, default=8, help="single simulations timed by the loop")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.worker:
        import torch

        torch.set_num_threads(args.threads)
        row = (run_batched if args.worker == "batched" else run_loop)(args)
        print(json.dumps(row))
        return 0
    import torch

    load_before = os.getloadavg()[0]
    rows = run_all(args)
    payload = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "config": {k: getattr(args, k) for k in CONFIG_KEYS},
        "machine": {"machine": platform.machine(), "cores": os.cpu_count(), "torch": torch.__version__,
                    "load_before": load_before, "load_after": os.getloadavg()[0]},
        "rows": rows, "target_seconds": TARGET_SECONDS,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "dynamics_phase.json").write_text(json.dumps(payload, indent=2))
    text = markdown(payload)
    (args.out / "dynamics_phase.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
