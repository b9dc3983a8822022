"""Sharing the machine: ``sinkformer train``'s epoch time alone and beside busy processes (issue 26.4).

Runs ``sinkformer train --model vit --dataset digits`` (the first example of docs/training.md) in
a fresh process for each setting: alone and beside ``--busy`` processes that spin on a core each,
with the default thread choice (one thread per core other processes leave free) and with
``--threads`` fixed at the number of cores (what torch does by itself). Each setting runs
``--rounds`` times, interleaved; the figure is the median over rounds of the median epoch time
(``epoch_seconds`` of ``metrics.csv``, the first epoch left out as warm-up). Target: with one busy
process, the default ≤ 1.5x its time alone.

    python -m benchmarks sharing --out benchmarks/results
"""

from __future__ import annotations

import argparse
import csv
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _spin() -> None:
    while True:
        pass


def epoch_seconds(threads: int | None, epochs: int) -> float:
    """The median epoch time (s) of one ``sinkformer train`` run in a fresh process, first epoch left out."""
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "-m", "sinkformer", "train", "--model", "vit", "--dataset", "digits",
                   "--set", f"train.epochs={epochs}", "--out", str(Path(tmp) / "run")]
        if threads is not None:
            command += ["--threads", str(threads)]
        subprocess.run(command, check=True, capture_output=True, text=True)
        with open(Path(tmp) / "run" / "metrics.csv") as f:
            times = [float(row["epoch_seconds"]) for row in csv.DictReader(f)]
    return statistics.median(times[1:] if len(times) > 1 else times)


def measure(busy: int, rounds: int, epochs: int) -> list[dict]:
    """Rows: setting, busy processes, threads, median epoch seconds, per-round figures."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    settings = [(n_busy, threads) for n_busy in (0, busy) for threads in (None, cores)]
    runs: dict[tuple[int, int | None], list[float]] = {s: [] for s in settings}
    for _ in range(rounds):
        for n_busy, threads in settings:
            spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(n_busy)]
            for p in spinners:
                p.start()
            time.sleep(0.5 if spinners else 0.0)
            try:
                runs[(n_busy, threads)].append(epoch_seconds(threads, epochs))
            finally:
                for p in spinners:
                    p.terminate()
                    p.join()
    return [{"busy": n_busy, "threads": "default (free cores)" if threads is None else str(threads),
             "epoch_s": statistics.median(times), "rounds": times}
            for (n_busy, threads), times in runs.items()]


def render(rows: list[dict], meta: dict) -> str:
    alone = {r["threads"]: r["epoch_s"] for r in rows if r["busy"] == 0}
    lines = [f"`sinkformer train --model vit --dataset digits`, {meta['epochs']} epochs, measured {meta['when']} on "
             f"{meta['cores']} CPU cores, torch {meta['torch']}; median over {meta['rounds']} interleaved rounds of "
             "the median epoch time (first epoch left out); busy processes spin on a core each.", "",
             "| busy processes | torch threads | epoch (s) | × alone |", "|---:|---|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['busy']} | {r['threads']} | {r['epoch_s']:.2f} | {r['epoch_s'] / alone[r['threads']]:.2f} |")
    default = next(r for r in rows if r["busy"] > 0 and r["threads"].startswith("default"))
    ratio = default["epoch_s"] / alone[default["threads"]]
    lines += ["", f"Target (issue 26): the default beside {default['busy']} busy process(es) ≤ 1.5× alone: "
              f"**{ratio:.2f}** ({'met' if ratio <= 1.5 else 'missed'})."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks sharing", description=__doc__.split("\n\n")[0])
    parser.add_argument("--busy", type=int, default=1, help="busy processes beside the training (default 1)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--out", default="benchmark-results")
    args = parser.parse_args(argv)
    import torch

    rows = measure(args.busy, args.rounds, args.epochs)
    meta = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
            "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "rounds": args.rounds, "epochs": args.epochs, "busy": args.busy}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sharing.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    text = render(rows, meta)
    (out / "sharing.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
