"""Peak memory and time of one forward + backward pass of self-attention vs sequence length.

Sparse Sinkhorn Attention (Tay et al. 2020, §4) claims memory :math:`O(\\ell b + N_B^2)` for
block-sorted attention (that of local attention) and :math:`O(\\ell)` for SortCut, against
:math:`O(\\ell^2)` for vanilla attention. This measures it on the CPU:

* ``vanilla``: :math:`\\mathrm{softmax}(QK^\\top/\\sqrt d)V` with the score matrix materialised
  (the Transformer the paper compares with);
* ``vanilla-sdpa``: PyTorch's fused ``scaled_dot_product_attention`` (never stores the scores:
  shown for honesty, it is not what the paper measured against);
* ``local``: block-local attention (:func:`sinkformer.attention.sparse_baselines.local_attention`);
* ``sinkhorn``: Sparse Sinkhorn Attention (sort logits as a parameter, 5 Sinkhorn iterations);
* ``sortcut``: SortCut with a budget of 2 blocks.

Each (method, length) runs in a fresh subprocess. Two memory figures: the *peak* is the rise of
the process's resident-set high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs``)
over the resident set after the inputs exist (includes allocator slack, a few MiB of noise); the
*saved* memory is the exact size of the distinct storages autograd keeps for the backward pass
(counted with ``torch.autograd.graph.saved_tensors_hooks``), the part that grows with the
attention pattern. Time is the median of ``--repeats`` passes. Lengths go
from 1k up to 32k while the extrapolated peak stays under ``--limit-gib`` (and the free memory).

    python benchmarks/sparse_memory.py            # writes benchmarks/results/sparse_memory.{json,md,png}
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

METHODS = ("vanilla", "vanilla-sdpa", "local", "sinkhorn", "sortcut")
RESULTS = Path(__file__).resolve().parent / "results"


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _forward(method: str, q, k, v, logits, block_size: int, budget: int):
    import torch
    import torch.nn.functional as F

    from sinkformer.attention.sparse import sparse_sinkhorn_attention
    from sinkformer.attention.sparse_baselines import local_attention

    if method == "vanilla":
        return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1) @ v
    if method == "vanilla-sdpa":
        return F.scaled_dot_product_attention(q, k, v)
    if method == "local":
        return local_attention(q, k, v, block_size=block_size)
    return sparse_sinkhorn_attention(q, k, v, logits, block_size=block_size,
                                     sortcut_budget=budget if method == "sortcut" else None)


def _pass(method: str, inputs, args: argparse.Namespace) -> int:
    """One forward + backward; returns the bytes of the distinct storages autograd kept for backward."""
    import torch

    storages: dict[int, int] = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = _forward(method, *inputs, args.block_size, args.budget)
    out.sum().backward()
    return sum(storages.values())


def _inputs(length: int, args: argparse.Namespace):
    import torch

    q, k, v = (torch.randn(args.batch, args.heads, length, args.head_dim, requires_grad=True) for _ in range(3))
    nb = -(-length // args.block_size)
    return q, k, v, torch.randn(args.batch, args.heads, nb, nb, requires_grad=True)


def worker(method: str, length: int, args: argparse.Namespace) -> dict:
    """One measurement in this (fresh) process, after a small warm-up pass (imports, kernels)."""
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    _pass(method, _inputs(min(length, 1024), args), args)
    inputs = _inputs(length, args)
    times, peak, saved = [], 0, 0
    for _ in range(args.repeats):
        for t in inputs:
            t.grad = None
        Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark
        base = _status_kib("VmRSS")
        start = time.perf_counter()
        saved = _pass(method, inputs, args)
        times.append(time.perf_counter() - start)
        peak = max(peak, _status_kib("VmHWM") - base)
    return {"method": method, "length": length, "peak_mib": peak / 1024, "saved_mib": saved / 2**20,
            "seconds": statistics.median(times)}


def _available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return float("inf")


def _predict(points: list[dict]) -> float:
    """Next (doubled) length's peak in MiB, from the growth between the last two points (peaks below 1 MiB,
    the resident set's resolution here, count as 1 MiB: a peak of 0 would predict an infinite growth)."""
    if len(points) < 2:
        return points[-1]["peak_mib"] * 4 if points else 0.0
    a, b = (max(p["peak_mib"], 1.0) for p in points[-2:])
    return b * max(b / a, 2.0)


def slope(points: list[dict], key: str) -> float:
    """Log-log slope of ``key`` against length over the last three points (1 = linear, 2 = quadratic)."""
    import numpy as np

    pts = [p for p in points if p[key] > 0][-3:]
    if len(pts) < 2:
        return float("nan")
    x = np.log([p["length"] for p in pts])
    y = np.log([p[key] for p in pts])
    return float(np.polyfit(x, y, 1)[0])


def run_all(args: argparse.Namespace) -> list[dict]:
    lengths = [1024 * 2**i for i in range(int(math.log2(args.max_length // 1024)) + 1)]
    rows: list[dict] = []
    for method in args.methods:
        done: list[dict] = []
        for length in lengths:
            predicted_gib = _predict(done) / 1024
            if done and predicted_gib > min(args.limit_gib, 0.85 * _available_gib()):
                print(f"{method:>13} {length:>6}: skipped (predicted {predicted_gib:.1f} GiB)", flush=True)
                rows.append({"method": method, "length": length, "skipped": f"predicted {predicted_gib:.1f} GiB"})
                continue
            cmd = [sys.executable, __file__, "--worker", method, str(length)] + _shared_flags(args)
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                print(f"{method:>13} {length:>6}: failed ({proc.stderr.strip().splitlines()[-1:]})", flush=True)
                rows.append({"method": method, "length": length, "skipped": "failed (out of memory?)"})
                continue
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            done.append(row)
            rows.append(row)
            print(f"{method:>13} {length:>6}: {row['peak_mib']:10.1f} MiB {row['seconds']:8.3f} s", flush=True)
    return rows


def _shared_flags(args: argparse.Namespace) -> list[str]:
    return [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in ("batch", "heads", "head_dim", "block_size", "budget", "repeats", "threads")]


def write_results(rows: list[dict], args: argparse.Namespace, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    measured = [r for r in rows if "peak_mib" in r]
    slopes = {m: {key: slope([r for r in measured if r["method"] == m], field)
                  for key, field in (("memory", "peak_mib"), ("saved", "saved_mib"), ("time", "seconds"))}
              for m in args.methods}
    config = {k: getattr(args, k) for k in ("batch", "heads", "head_dim", "block_size", "budget", "repeats", "threads")}
    payload = {"config": config, "rows": rows, "loglog_slopes_last3": slopes,
               "machine": {"cpus": os.cpu_count(), "torch_threads": args.threads}}
    (out / "sparse_memory.json").write_text(json.dumps(payload, indent=2))

    lengths = sorted({r["length"] for r in rows})
    cell = {(r["method"], r["length"]): r for r in rows}
    head = ("| method | " + " | ".join(f"{n // 1024}k" for n in lengths)
            + " | slope: peak | slope: saved | slope: time |")
    lines = [
        f"Peak memory rise (MiB) / memory kept for backward (MiB) / time (s) of one forward + backward pass; "
        f"batch {args.batch}, {args.heads} head(s) of dimension {args.head_dim}, blocks of {args.block_size}, SortCut "
        f"budget {args.budget} blocks, {args.threads} CPU thread(s). Slopes: log-log fit over the last three measured "
        "lengths (1 = linear, 2 = quadratic).",
        "",
        head,
        "|" + "---|" * (len(lengths) + 4),
    ]
    for m in args.methods:
        cells = []
        for n in lengths:
            r = cell.get((m, n))
            ok = r is not None and "peak_mib" in r
            cells.append(f"{r['peak_mib']:.0f} / {r['saved_mib']:.0f} / {r['seconds']:.2f}" if ok else "—")
        fits = slopes[m]
        lines.append(f"| {m} | " + " | ".join(cells) + f" | {fits['memory']:.2f} | {fits['saved']:.2f} | {fits['time']:.2f} |")
    (out / "sparse_memory.md").write_text("\n".join(lines) + "\n")

    plot(rows, out / "sparse_memory.png", methods=args.methods, config=config)
    print((out / "sparse_memory.md").read_text())


#: Colour, marker and line style per method; colours shared with the other figures
#: (``sinkformer.plotting.METHOD_COLORS``: vanilla = the Transformer colour, sinkhorn = the
#: Sinkformer colour). vanilla-sdpa is dashed with open markers, drawn on top: its saved memory
#: equals local's and would otherwise hide under it.
STYLES = {
    "vanilla": dict(marker="o", linestyle="-"),
    "vanilla-sdpa": dict(marker="o", linestyle="--", markerfacecolor="white", zorder=3),
    "local": dict(marker="s", linestyle="-"),
    "sinkhorn": dict(marker="^", linestyle="-"),
    "sortcut": dict(marker="D", linestyle="-"),
}


def _length_label(n: float, _pos=None) -> str:
    return f"{n / 1024:g}k" if n >= 1024 else f"{n:g}"


def _value_label(y: float, _pos=None) -> str:
    return f"{y:g}"


def plot(rows: list[dict], path: Path, methods=None, config: dict | None = None):
    """Peak memory, saved memory and time against length, one colour and marker per method.

    Returns the (closed) figure.
    """
    from matplotlib.ticker import FuncFormatter, LogLocator

    from sinkformer.plotting import method_color, pyplot, save_png

    plt = pyplot()
    measured = [r for r in rows if "peak_mib" in r]
    methods = [m for m in (methods or METHODS) if any(r["method"] == m for r in measured)]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    for m in methods:
        pts = sorted((r for r in measured if r["method"] == m), key=lambda r: r["length"])
        for ax, key in zip(axes, ("peak_mib", "saved_mib", "seconds")):
            ax.plot([p["length"] for p in pts], [max(p[key], 1e-3) for p in pts], label=m, markersize=5,
                    linewidth=1.6, color=method_color(m), **STYLES.get(m, {}))
    titles = ("peak memory rise", "memory kept for the backward pass", "time of one forward + backward")
    units = ("peak memory rise (MiB)", "saved memory (MiB)", "time (s)")
    for ax, title, unit in zip(axes, titles, units):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(_length_label))
        ax.yaxis.set_major_locator(LogLocator(base=10))
        ax.yaxis.set_major_formatter(FuncFormatter(_value_label))
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3, linewidth=0.5)
    fig.legend(*axes[0].get_legend_handles_labels(), title="method", loc="upper left", bbox_to_anchor=(1.0, 0.9),
               frameon=False, fontsize=9)
    detail = ""
    if config:
        detail = (f": batch {config.get('batch')}, {config.get('heads')} head(s) of dimension {config.get('head_dim')}, "
                  f"blocks of {config.get('block_size')}, SortCut budget {config.get('budget')} blocks")
    fig.suptitle(f"Self-attention, one forward + backward pass vs sequence length, CPU{detail} (log-log)", fontsize=11)
    fig.tight_layout()
    save_png(fig, path)
    return fig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", nargs=2, metavar=("METHOD", "LENGTH"), help=argparse.SUPPRESS)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--max-length", type=int, default=32768)
    parser.add_argument("--limit-gib", type=float, default=24.0)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=1)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--budget", type=int, default=2, help="SortCut budget in blocks")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--plot-only", action="store_true",
                        help="measure nothing: redraw OUT/sparse_memory.png from the existing OUT/sparse_memory.json")
    args = parser.parse_args(argv)
    if args.plot_only:
        payload = json.loads((args.out / "sparse_memory.json").read_text())
        plot(payload["rows"], args.out / "sparse_memory.png", config=payload.get("config"))
        print(f"written: {args.out / 'sparse_memory.png'}")
        return 0
    if args.worker:
        print(json.dumps(worker(args.worker[0], int(args.worker[1]), args)))
        return 0
    write_results(run_all(args), args, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
