"""Where the tiled engine's groups should go on threads: one Python thread per core or PyTorch's own.

``cpu_parallel.map_groups`` runs the groups of slices of a call either on one Python thread per
core, each computing single-threaded (``threads``), or in order on the calling thread, each PyTorch
operation (and each native C call of several slices) split over the cores by PyTorch's intra-op threads
(``intra-op``). A threshold of scores per call chooses (``scaling.parallel_above``): none for native groups of a
slice per thread or more, whose C calls split their slices over the threads (they never take the Python threads;
``tiled.call_group`` gives native groups that many slices), ``NATIVE_PARALLEL_ABOVE`` for native groups too small to
occupy every thread (a library without OpenMP, graph capture), ``PARALLEL_ABOVE`` for the others. This benchmark times
both modes for calls of several sizes (forward+backward, 5 iterations, ``backend="tiled"``, float32, d = 64), in
one process, the two modes alternating round by round, and prints per size the median over rounds of the
per-round ratio threads / intra-op with its range, and the mode that the thresholds pick for that size.

    python -m benchmarks parallel --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

#: (batch, heads, n) of the calls measured: b = 4, h = 8 as in the attention grid, and calls of the
#: same size with fewer slices
CALLS = [(4, 8, 64), (4, 8, 128), (4, 8, 256), (4, 8, 512), (1, 8, 1024), (2, 8, 1024), (4, 8, 1024),
         (1, 8, 2048), (1, 8, 4096)]
#: the two modes: the threshold of scores that forces each (``scaling.parallel_above`` replaced while timing)
MODES = {"threads": 0, "intra-op": 1 << 62}


def measure(calls: list[tuple[int, int, int]], rounds: int, progress=print) -> list[dict]:
    """Per call: the median forward+backward time of each mode (ms) and the per-round ratios threads / intra-op."""
    import torch

    import sinkformer
    from sinkformer.sinkhorn import native, scaling, sizes
    from sinkformer.sinkhorn.scaling import parallel_above
    from sinkformer.sinkhorn.tiled import call_group

    split = sizes.SPLIT_TILE_SCORES
    sizes.SPLIT_TILE_SCORES = 1 << 62  # the groups' two modes, also where the engine splits slices instead
    rows = []
    try:
        for b, h, n in calls:
            q, k, v = (torch.randn(b, h, n, 64, requires_grad=True) for _ in range(3))

            def step():
                sinkformer.attention(q, k, v, n_iters=5, backend="tiled").sum().backward()

            repeats = max(1, min(30, int(2e8 // (b * h * n * n))))
            times: dict[str, list[float]] = {mode: [] for mode in MODES}
            for r in range(rounds):
                for mode in (list(MODES) if r % 2 == 0 else list(MODES)[::-1]):
                    scaling.parallel_above = lambda *args, _above=MODES[mode]: _above
                    step()  # warm-up: the first call of a mode pays its allocations
                    runs = []
                    for _ in range(repeats):
                        start = time.perf_counter()
                        step()
                        runs.append(time.perf_counter() - start)
                    times[mode].append(statistics.median(runs) * 1e3)
            ratios = [t / i for t, i in zip(times["threads"], times["intra-op"])]
            scores = b * h * n * n
            natively = (native.ENABLED and sizes.cache_blocks(1, n, n, sizes.CACHE_BLOCK_ELEMENTS).rows is None
                        and native.library()[0] is not None)
            rows.append({"batch": b, "heads": h, "n": n, "scores": scores,
                         "threads_ms": statistics.median(times["threads"]),
                         "intra_op_ms": statistics.median(times["intra-op"]), "ratio": statistics.median(ratios),
                         "ratio_min": min(ratios), "ratio_max": max(ratios),
                         "native": natively, "group": call_group(b * h, n, n, torch.device("cpu"), natively)})
            progress(f"b={b} h={h} n={n}: threads / intra-op {rows[-1]['ratio']:.2f}")
    finally:
        scaling.parallel_above = parallel_above
        sizes.SPLIT_TILE_SCORES = split
    for row in rows:  # what the engine picks, by its thresholds (restored above; the group too depends on them)
        row["group"] = call_group(row["batch"] * row["heads"], row["n"], row["n"], torch.device("cpu"), row["native"])
        row["picked"] = "intra-op" if row["scores"] < parallel_above(row["native"], row["group"]) else "threads"
        if row["n"] * row["n"] >= sizes.SPLIT_TILE_SCORES and torch.get_num_threads() > 1:
            row["picked"] = "split"  # neither: each slice's passes in parts over the cores (scaling.crew_size)
    return rows


def faster(row: dict) -> str | None:
    """The mode faster in every round (``None`` when the range of ratios spans 1)."""
    if row["ratio_max"] < 1:
        return "threads"
    if row["ratio_min"] > 1:
        return "intra-op"
    return None


def render(rows: list[dict], meta: dict) -> str:
    lines = [f"The tiled engine's groups on one Python thread per core (`threads`) or on PyTorch's intra-op threads, "
             f"forward+backward, 5 iterations, float32, d = 64; measured {meta['when']} on {meta['machine']} with "
             f"{meta['cores']} CPU cores ({meta['threads']} torch threads), torch {meta['torch']}; medians over "
             f"{meta['rounds']} rounds alternating the modes in one process (slices of at least "
             f"`SPLIT_TILE_SCORES` scores, which the engine splits over the cores instead, `split`, measured in both "
             f"modes all the same). `PARALLEL_ABOVE` = {meta['threshold']} scores"
             + (f"; `NATIVE_PARALLEL_ABOVE` = {meta['native_threshold']} for the calls that run the native passes (native: yes)"
                if "native_threshold" in meta else "") + ".", "",
             "| b × h | n | scores | threads (ms) | intra-op (ms) | threads / intra-op (range) | faster in every round "
             "| PARALLEL_ABOVE picks |", "|---:|---:|---:|---:|---:|---:|---|---|"]
    natives = "native_threshold" in meta
    if natives:
        lines[-2] = lines[-2].replace("| b × h |", "| b × h | native |").replace("PARALLEL_ABOVE picks", "threshold picks")
        lines[-1] = "|---|" + lines[-1][1:]
    for r in rows:
        lines.append(f"| {r['batch']} × {r['heads']} | " + (f"{'yes' if r['native'] else 'no'} | " if natives else "")
                     + f"{r['n']} | {r['scores'] / 1e6:.1f}M | {r['threads_ms']:.1f} | "
                     f"{r['intra_op_ms']:.1f} | {r['ratio']:.2f} ({r['ratio_min']:.2f}–{r['ratio_max']:.2f}) | "
                     f"{faster(r) or '—'} | {r['picked']} |")
    wrong = [r for r in rows if faster(r) not in (None, r["picked"]) and r["picked"] != "split"]
    picker = "the thresholds pick" if natives else "`PARALLEL_ABOVE` picks"
    lines += ["", f"Sizes where {picker} the mode that was slower in every round: "
              + (", ".join(f"b × h = {r['batch']} × {r['heads']}, n = {r['n']}" for r in wrong) if wrong else "none")
              + "."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks parallel", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="benchmark-results")
    args = parser.parse_args(argv)
    import torch

    from sinkformer.sinkhorn import cpu_parallel

    rows = measure(CALLS, args.rounds)
    meta = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
            "machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
            "rounds": args.rounds, "threshold": cpu_parallel.PARALLEL_ABOVE,
            "native_threshold": cpu_parallel.NATIVE_PARALLEL_ABOVE,
            "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "parallel.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    text = render(rows, meta)
    (out / "parallel.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
