"""Speed and memory of Sinkhorn attention against SoftMax attention and the paper's algorithm.

    python -m benchmarks attention [--quick] [--long] [--n N ..] [--iters I ..] [--rounds R] [--out benchmarks/results]
    python -m benchmarks attention --grid [--n N ..] [--processes P] [--out benchmarks/results]

Methods, all on ``(b, h, n, d) = (4, 8, n, 64)`` float32, forward and forward+backward:

* ``sdpa`` — ``torch.nn.functional.scaled_dot_product_attention`` (SoftMax, fused kernel);
* ``naive-softmax`` — SoftMax with the ``n × n`` matrix materialised, through autograd;
* ``paper-reference`` — the Sinkformers paper's implementation (Appendix B): log-domain
  iterations unrolled through autograd, every iterate stored;
* ``ours`` — ``sinkformer.attention`` (the tiled engine, custom ops);
* ``ours-chunked`` — ``sinkformer.attention(..., chunk_size=c)`` (the streamed engine, no ``n × n`` matrix;
  ``c`` the automatic choice: blocks of about 2^19 scores, at least 64 query rows);
* ``ours-softmax`` — ``sinkformer.attention(..., n_iters=1, backend="tiled")``: SoftMax through the
  tiled engine's passes (``n_iters=1`` alone would run SDPA), what those passes cost without any
  Sinkhorn iteration.

``--grid`` measures instead the sizes people run (:func:`run_grid`): n in {16, 64, 128, 256, 512,
1024, 4096, 16384}, n_iters in {1, 3, 5}, forward and forward+backward, as ratios to SDPA (causal
Sinkhorn to causal SDPA), every method of one n timed in turn in a fresh process, several rounds, in
``--processes`` such processes (default 3) whose medians it takes; it writes ``attention_grid.{json,md,png}``.

Each configuration runs in two fresh subprocesses. Memory: with ``MALLOC_MMAP_THRESHOLD_`` fixed so
that freed blocks return to the system at once, the peak resident set size during one
forward+backward minus the resident size just before it (inputs already allocated), read from
``/proc/self/status`` after resetting the high-water mark. Time (allocator defaults): medians over
repeats after a warm-up. ``--rounds R`` measures time in ``R`` interleaved rounds (each round runs
every configuration once, in a fresh process): a row's time is the median over rounds, and its ratio
to SDPA (same ``n``) the median of the per-round ratios, which a shared, noisy machine disturbs less
than absolute times. ``--long`` adds the chunked mode on one head with n = 8k ... 64k.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

METHODS = ["sdpa", "naive-softmax", "paper-reference", "ours", "ours-chunked", "ours-softmax"]
SOFTMAX_METHODS = {"sdpa", "naive-softmax", "ours-softmax"}  # independent of n_iters
B, H, D = 4, 8, 64
MEMORY_LIMIT_GIB = 12.0


# ----------------------------------------------------------------------------- the methods


def paper_reference(q, k, v, n_iters):
    """Sinkformers Appendix B, literally: log domain, g0 = 0, f/g alternate with log(1/n) marginals,
    K = n * exp(C + f + g), unrolled through autograd."""
    import torch

    C = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    n = C.shape[-1]
    log_marginal = -math.log(n)
    f = torch.zeros(C.shape[:-1], dtype=C.dtype, device=C.device)
    g = torch.zeros(C.shape[:-2] + (n,), dtype=C.dtype, device=C.device)
    for it in range(n_iters):
        if it % 2 == 0:
            f = log_marginal - torch.logsumexp(C + g.unsqueeze(-2), dim=-1)
        else:
            g = log_marginal - torch.logsumexp(C + f.unsqueeze(-1), dim=-2)
    K = n * torch.exp(C + f.unsqueeze(-1) + g.unsqueeze(-2))
    return K @ v


def make_fn(method: str, n_iters: int):
    import torch
    import torch.nn.functional as F

    import sinkformer

    if method == "sdpa":
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v)
    if method == "naive-softmax":
        return lambda q, k, v: torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1) @ v
    if method == "paper-reference":
        return lambda q, k, v: paper_reference(q, k, v, n_iters)
    if method == "ours":
        return lambda q, k, v: sinkformer.attention(q, k, v, n_iters=n_iters)
    if method == "ours-chunked":  # forced chunked mode, tiles of about 2^20 scores
        return lambda q, k, v: sinkformer.attention(q, k, v, n_iters=n_iters, chunk_size=_chunk(q, k))
    if method == "ours-softmax":  # one normalisation through the tiled engine's passes: what they cost alone
        return lambda q, k, v: sinkformer.attention(q, k, v, n_iters=1, backend="tiled")
    raise ValueError(f"unknown method {method!r}; valid: {METHODS}")


def _chunk(q, k) -> int:
    """The automatic choice of the streamed engine: blocks of query rows of one slice, about 2^19 scores,
    at least 64 rows."""
    from sinkformer.sinkhorn.sizes import stream_rows

    return stream_rows(q.shape[-2], k.shape[-2], None)


def estimated_gib(method: str, b: int, h: int, n: int, n_iters: int) -> float:
    """Rough peak memory, to skip configurations that cannot fit (the paper's keeps every iterate)."""
    matrix = b * h * n * n * 4 / 2**30
    if method == "ours-chunked":  # q, k, v, their gradients and a few (n, d) buffers; tiles of ~2^20 scores
        return 16 * b * h * n * D * 4 / 2**30
    return {"paper-reference": (n_iters + 4) * matrix, "naive-softmax": 4 * matrix}.get(method, 2 * matrix / (b * h))


# ----------------------------------------------------------------------------- one measurement (worker)


def _rss_mib() -> tuple[float, float]:
    status = Path("/proc/self/status").read_text()
    rss = int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) / 1024
    hwm = int(re.search(r"VmHWM:\s+(\d+)", status).group(1)) / 1024
    return rss, hwm


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def measure(method: str, b: int, h: int, n: int, d: int, n_iters: int, repeats: int, what: str,
            threads: int | None = None, clock: str = "wall") -> dict:
    """``what="memory"``: peak RSS rise of one forward+backward; ``what="time"``: median times;
    ``what="single"`` (long sequences): one forward+backward, its time and its peak, no warm-up.
    ``threads``: torch's intra-op threads (``None``: its default); ``clock``: ``"wall"`` or ``"cpu"``
    (the process's CPU time: on a loaded machine it counts the work, not the waits — meaningful
    with one thread)."""
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    now = time.process_time if clock == "cpu" else time.perf_counter
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, requires_grad=True) for _ in range(3))
    fn = make_fn(method, n_iters)
    if what == "single":
        _release_kept_memory()
        base, _ = _rss_mib()
        _reset_peak()
        start = now()
        fn(q, k, v).sum().backward()
        elapsed = now() - start
        return {"forward_backward_ms": 1e3 * elapsed, "peak_mib": _rss_mib()[1] - base}

    def forward():
        with torch.no_grad():
            fn(q, k, v)

    def forward_backward():
        for t in (q, k, v):
            t.grad = None
        fn(q, k, v).sum().backward()

    forward_backward()  # warm-up (and first allocations)
    if what == "memory":
        for t in (q, k, v):
            t.grad = None
        return {"peak_mib": peak_rise_mib(lambda: fn(q, k, v).sum().backward())}

    forward()
    return {"forward_ms": 1e3 * median_seconds(forward, repeats, now),
            "forward_backward_ms": 1e3 * median_seconds(forward_backward, repeats, now)}


def _release_kept_memory() -> None:
    """Free what sinkformer keeps between calls (the CPU tile buffers of
    :func:`sinkformer.sinkhorn.cpu_parallel.release_scratch`): a call's peak counts the memory it uses."""
    from sinkformer.sinkhorn import cpu_parallel

    cpu_parallel.release_scratch()


def peak_rise_mib(step) -> float:
    """Rise of the resident-set high-water mark during ``step()``, in MiB (the high-water mark reset
    first; meaningful with ``MALLOC_MMAP_THRESHOLD_`` set so that freed blocks leave at once). Memory
    the library keeps between calls is freed first, so that the call's own use counts."""
    _release_kept_memory()
    base, _ = _rss_mib()
    _reset_peak()
    step()
    return _rss_mib()[1] - base


def median_seconds(step, repeats: int, clock=time.perf_counter) -> float:
    """Median time of ``repeats`` calls of ``step()`` by ``clock`` (the upper median for even counts)."""
    times = []
    for _ in range(repeats):
        start = clock()
        step()
        times.append(clock() - start)
    return sorted(times)[len(times) // 2]


# ----------------------------------------------------------------------------- the grid of sizes people run

#: Sequence lengths and iteration counts of ``--grid``.
GRID_NS = (16, 64, 128, 256, 512, 1024, 4096, 16384)
GRID_ITERS = (1, 3, 5)
#: Causal Sinkhorn with more than 3 iterations costs one n^3 product per extra normalisation: up to this n.
GRID_CAUSAL_CUBIC_UP_TO = 512
#: ... and with 3 iterations it took 436 s for one forward+backward at n = 16384 (b=1, h=2, loaded machine): up to this n.
GRID_CAUSAL_UP_TO = 4096
#: Fresh processes per n (:func:`run_grid`). One process's ratios move with that process's luck, their median over
#: several less (5 iterations on the AMD EPYC, benchmarks/results/attention_grid_epyc_b033162: n = 64's three
#: processes 1.08, 1.29 and 1.31).
GRID_PROCESSES = 3


def grid_shape(n: int) -> dict:
    """Batch, heads, timing repeats and rounds of one ``n`` of the grid: (4, 8) up to 1024 tokens,
    fewer slices and repeats above, so that the grid runs in minutes (n = 16384: 2 heads, 1 repeat)."""
    if n <= 1024:
        return dict(b=B, h=H, repeats=10 if n <= 256 else 5 if n <= 512 else 3, rounds=5)
    if n <= 4096:
        return dict(b=1, h=H, repeats=1, rounds=3)
    return dict(b=1, h=2, repeats=1, rounds=3)


def grid_methods(n: int, iters=GRID_ITERS) -> list[dict]:
    """The grid's methods at ``n``: SDPA, ours (``backend="auto"``) at each n_iters, causal SDPA and causal
    Sinkhorn (engine ``"causal"``) at each n_iters > 1 up to :data:`GRID_CAUSAL_UP_TO` (those above 3 up to
    :data:`GRID_CAUSAL_CUBIC_UP_TO`).
    ``n_iters=1`` alone would run SDPA: there ``ours`` forces the Sinkhorn engine that ``auto`` picks for
    more iterations (tiled, or streamed above 2^24 scores per slice), so the row shows what its passes cost."""
    methods = [dict(method="sdpa", n_iters=1, causal=False)]
    methods += [dict(method="ours", n_iters=it, causal=False) for it in iters]
    if n > GRID_CAUSAL_UP_TO:
        return methods
    methods.append(dict(method="sdpa", n_iters=1, causal=True))
    methods += [dict(method="ours", n_iters=it, causal=True) for it in iters
                if it > 1 and (it <= 3 or n <= GRID_CAUSAL_CUBIC_UP_TO)]
    return methods


def grid_fn(method: str, n_iters: int, causal: bool, engine: str):
    """The call of one grid method (``engine``: the one :func:`measure_grid` found for it)."""
    import torch.nn.functional as F

    import sinkformer

    if method == "sdpa":
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    if causal:
        return lambda q, k, v: sinkformer.attention(q, k, v, n_iters=n_iters, is_causal=True)
    if n_iters == 1:
        return lambda q, k, v: sinkformer.attention(q, k, v, n_iters=1, backend=engine)
    return lambda q, k, v: sinkformer.attention(q, k, v, n_iters=n_iters)


def measure_grid(n: int, iters=GRID_ITERS) -> list[dict]:
    """Every method of the grid at ``n`` in this process, in ``rounds`` interleaved rounds: each round
    times each method's forward (no graph) and forward+backward (medians of ``repeats`` calls). A row's
    times are medians over rounds; its ratios the medians over rounds of the per-round ratio to SDPA
    (causal SDPA for causal rows)."""
    import torch

    import sinkformer

    shape = grid_shape(n)
    torch.manual_seed(0)
    q, k, v = (torch.randn(shape["b"], shape["h"], n, D, requires_grad=True) for _ in range(3))
    rows = [dict(m, n=n, b=shape["b"], h=shape["h"], d=D, fwd=[], fb=[]) for m in grid_methods(n, iters)]
    for r in rows:
        r["engine"] = "sdpa" if r["method"] == "sdpa" else sinkformer.attention.explain(
            q, k, v, n_iters=max(r["n_iters"], 3), is_causal=r["causal"]).engine
    fns = [grid_fn(r["method"], r["n_iters"], r["causal"], r["engine"]) for r in rows]

    def forward(fn):
        with torch.no_grad():
            fn(q, k, v)

    def forward_backward(fn):
        for t in (q, k, v):
            t.grad = None
        fn(q, k, v).sum().backward()

    for fn in fns:  # warm-up
        forward_backward(fn)
    for _ in range(shape["rounds"]):
        for r, fn in zip(rows, fns):
            r["fwd"].append(1e3 * median_seconds(lambda: forward(fn), shape["repeats"]))
            r["fb"].append(1e3 * median_seconds(lambda: forward_backward(fn), shape["repeats"]))
    out = []
    for r in rows:
        base = next(b for b in rows if b["method"] == "sdpa" and b["causal"] == r["causal"])
        out.append({key: r[key] for key in ("method", "n_iters", "causal", "engine", "n", "b", "h", "d")} | {
            "forward_ms": _median(r["fwd"]), "forward_backward_ms": _median(r["fb"]),
            "forward_ratio": _median([x / y for x, y in zip(r["fwd"], base["fwd"])]),
            "forward_backward_ratio": _median([x / y for x, y in zip(r["fb"], base["fb"])]),
            "rounds": shape["rounds"], "repeats": shape["repeats"]})
    return out


def run_grid(ns=GRID_NS, iters=GRID_ITERS, processes: int = GRID_PROCESSES) -> list[dict]:
    """:func:`measure_grid` for each ``n`` in ``processes`` fresh processes: the sizes in turn (largest last), then
    again, so that a slow stretch of the machine reaches one process of several sizes rather than every process
    of one; each size's rows merged by :func:`merge_processes`. A size whose process fails is reported with the
    error."""
    from tqdm import tqdm

    if processes < 1:
        raise ValueError(f"processes: at least one fresh process per size is needed, got {processes}")
    runs, errors = {n: [] for n in ns}, {}
    with tqdm(total=len(ns) * processes, desc="attention grid", unit="process") as bar:
        for _ in range(processes):
            for n in ns:
                bar.update()
                if n in errors:
                    continue
                cmd = [sys.executable, "-m", "benchmarks.attention", "--grid-worker",
                       json.dumps({"n": n, "iters": list(iters)})]
                proc = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent)
                if proc.returncode != 0:
                    errors[n] = (proc.stderr.strip().splitlines() or ["killed"])[-1]
                    tqdm.write(f"n={n}: {errors[n]}")
                    continue
                runs[n].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    rows = []
    for n in ns:
        if n in errors:
            rows += [dict(m, n=n, error=errors[n]) for m in grid_methods(n, iters)]
            continue
        rows += merge_processes(runs[n])
        for r in rows[-len(grid_methods(n, iters)):]:
            tqdm.write(f"n={n:<6} {_grid_label(r):<28} {r['engine']:>8}  fwd {r['forward_ratio']:5.2f}x  "
                       f"fwd+bwd {r['forward_backward_ratio']:5.2f}x  (processes: "
                       f"{', '.join(f'{x:.2f}' for x in r['process_ratios'])})")
    return rows


#: the figures of a grid row that :func:`merge_processes` takes the median of
_PROCESS_FIGURES = ("forward_ms", "forward_backward_ms", "forward_ratio", "forward_backward_ratio")


def merge_processes(runs: list[list[dict]]) -> list[dict]:
    """One size's rows from several processes' :func:`measure_grid` rows (a list per process, the same methods in
    the same order): times and ratios the medians over the processes, ``processes`` their count and
    ``process_ratios`` each one's forward+backward ratio."""
    merged = []
    for rows in zip(*runs, strict=True):
        if len({(r["method"], r["n_iters"], r["causal"]) for r in rows}) != 1:
            raise ValueError(f"runs: the processes measured different methods in one place: {rows}")
        merged.append(rows[0] | {key: _median([r[key] for r in rows]) for key in _PROCESS_FIGURES}
                      | {"processes": len(rows), "process_ratios": [r["forward_backward_ratio"] for r in rows]})
    return merged


def _grid_label(row: dict) -> str:
    if row["method"] == "sdpa":
        return "causal SDPA" if row["causal"] else "SDPA"
    return f"{'causal ' if row['causal'] else ''}Sinkhorn, n_iters={row['n_iters']}"


def _target_rows(rows: list[dict]) -> dict:
    """The rows of the issue's targets (5 iterations, forward+backward; causal: 3 iterations; the worst n from 64
    to 512), or None where the grid has none."""
    def ours(n, n_iters, causal=False):
        return next((r for r in rows if r["n"] == n and r["method"] == "ours" and r["n_iters"] == n_iters
                     and r["causal"] == causal and "error" not in r), None)

    small = [r for r in (ours(n, 5) for n in (64, 128, 256, 512)) if r is not None]
    return {"worst_64_512": max(small, key=lambda r: r["forward_backward_ratio"]) if small else None,
            "at_1024": ours(1024, 5), "at_4096": ours(4096, 5), "causal3_at_1024": ours(1024, 3, True),
            "causal3_at_4096": ours(4096, 3, True)}


def grid_summary(rows: list[dict]) -> dict:
    """The issue's targets read off the grid (5 iterations, forward+backward; causal: 3 iterations)."""
    return {key: None if r is None else r["forward_backward_ratio"] for key, r in _target_rows(rows).items()}


def grid_markdown(rows: list[dict], stamp: str) -> str:
    ns = sorted({r["n"] for r in rows})
    iters = sorted({r["n_iters"] for r in rows if r["method"] == "ours" and not r["causal"]})
    causal_iters = sorted({r["n_iters"] for r in rows if r["method"] == "ours" and r["causal"]})

    def cell(n, method, n_iters, causal):
        r = next((r for r in rows if r["n"] == n and r["method"] == method and r["n_iters"] == n_iters
                  and r["causal"] == causal), None)
        if r is None:
            return "–"
        if "error" in r:
            return r["error"]
        if method == "sdpa":
            return f"{r['forward_ms']:.3g} / {r['forward_backward_ms']:.3g}"
        return f"{r['forward_ratio']:.2f} / {r['forward_backward_ratio']:.2f}"

    shapes = ", ".join(sorted({f"(b, h) = ({r['b']}, {r['h']}) at n {'≤ 1024' if r['n'] <= 1024 else '= ' + str(r['n'])}"
                               for r in rows if "b" in r}))
    engines = sorted({(r["n"], r["engine"]) for r in rows if r.get("engine") not in (None, "sdpa") and not r["causal"]})
    streamed = [n for n, engine in engines if engine == "streamed"]
    processes = max((r.get("processes", 1) for r in rows), default=1)
    where = (f"the median over {processes} fresh processes of each one's median over interleaved rounds"
             if processes > 1 else "the median over interleaved rounds in one process")
    lines = [
        f"Measured {stamp} on {platform.machine()} ({cpu_model()}) with {os.cpu_count()} CPU cores, torch "
        f"{_torch_version()}, d = {D}, float32; {shapes}. Each cell: forward / forward+backward, as a multiple of "
        f"SDPA's time (causal columns: of causal SDPA's), {where}; SDPA columns: its times in ms."
        + (" Sinkhorn rows run `backend=\"auto\"` (n_iters = 1: the Sinkhorn engine it picks for more iterations, "
           f"forced; the streamed engine from n = {streamed[0]} on)." if streamed else ""),
        "",
        "| n | SDPA (ms) | " + " | ".join(f"n_iters={it}" for it in iters) + " | causal SDPA (ms) | "
        + " | ".join(f"causal, n_iters={it}" for it in causal_iters) + " |",
        "|---:|---:|" + "---:|" * len(iters) + "---:|" + "---:|" * len(causal_iters),
    ]
    for n in ns:
        cells = [cell(n, "sdpa", 1, False)] + [cell(n, "ours", it, False) for it in iters]
        cells += [cell(n, "sdpa", 1, True)] + [cell(n, "ours", it, True) for it in causal_iters]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines += ["", f"–: not run (causal Sinkhorn with more than 3 iterations costs one n³ product per further "
              f"normalisation: run up to n = {GRID_CAUSAL_CUBIC_UP_TO}; causal Sinkhorn up to n = {GRID_CAUSAL_UP_TO})."]
    targets = _target_rows(rows)
    names = {"worst_64_512": ("5 iterations, forward+backward, the worst n from 64 to 512", "≤ 1.5"),
             "at_1024": ("5 iterations, forward+backward, n = 1024", "≤ 1.25"),
             "at_4096": ("5 iterations, forward+backward, n = 4096", "≤ 1.5"),
             "causal3_at_1024": ("causal, 3 iterations, forward+backward, n = 1024 (× causal SDPA)", "≤ 3"),
             "causal3_at_4096": ("causal, 3 iterations, forward+backward, n = 4096 (× causal SDPA)", "≤ 3")}
    lines += ["", "Targets (issue 26):", ""]
    for key, (label, goal) in names.items():
        row = targets[key]
        if row is None:
            continue
        spread = row.get("process_ratios", [])
        each = f"; fresh processes {', '.join(f'{x:.2f}' for x in sorted(spread))}" if len(spread) > 1 else ""
        lines.append(f"- {label}: **{row['forward_backward_ratio']:.2f}** (target {goal}{each})")
    return "\n".join(lines) + "\n"


def plot_grid(rows: list[dict], path: Path):
    """Forward and forward+backward time as a multiple of SDPA's against n: one colour per n_iters,
    solid for Sinkhorn attention, dashed for causal Sinkhorn (against causal SDPA)."""
    from matplotlib.ticker import FuncFormatter

    from sinkformer.plotting import pyplot, save_png

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    ours = [r for r in rows if r["method"] == "ours" and "error" not in r]
    palette = {1: "#8da0cb", 3: "#fc8d62", 5: "#d62728"}
    for ax, key, title in zip(axes, ("forward_ratio", "forward_backward_ratio"), ("forward", "forward+backward")):
        for causal in (False, True):
            for it in sorted({r["n_iters"] for r in ours if r["causal"] == causal}):
                pts = sorted((r for r in ours if r["causal"] == causal and r["n_iters"] == it), key=lambda r: r["n"])
                ax.plot([r["n"] for r in pts], [r[key] for r in pts], color=palette.get(it, "0.3"),
                        linestyle="--" if causal else "-", marker="s" if causal else "o", markersize=4,
                        label=f"{'causal, ' if causal else ''}n_iters={it}")
        ax.axhline(1.0, color="0.4", linewidth=0.8)
        ax.axhline(1.5, color="0.6", linewidth=0.8, linestyle=":")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xticks(sorted({r["n"] for r in ours}))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
        ax.set_xlabel("sequence length n")
        ax.set_title(title)
        ax.grid(alpha=0.3, which="both", linewidth=0.5)
    axes[0].set_ylabel("time / SDPA's (causal: / causal SDPA's)")
    axes[1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    fig.suptitle(f"Sinkhorn attention against SDPA on the CPU, d={D}, float32 (dotted: 1.5x)", fontsize=10.5)
    fig.tight_layout()
    save_png(fig, path)
    return fig


def write_grid(rows: list[dict], out: Path, stamp: str) -> str:
    out.mkdir(parents=True, exist_ok=True)
    (out / "attention_grid.json").write_text(json.dumps(
        {"date": stamp, "cpu": cpu_model(), "torch": _torch_version(), "rows": rows, "targets": grid_summary(rows)},
        indent=2))
    text = grid_markdown(rows, stamp)
    (out / "attention_grid.md").write_text(text)
    plot_grid([r for r in rows if "error" not in r], out / "attention_grid.png")
    return text


# ----------------------------------------------------------------------------- the driver


def _run_worker(config: dict) -> dict:
    """Two fresh processes: memory with large blocks returned to the system at once (so the
    resident-set peak sees every allocation), time with the allocator's defaults."""
    result = {}
    malloc = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}
    modes = [("single", malloc)] if config.get("single") else [("memory", malloc), ("time", {})]
    for what, extra in modes:
        measured = _worker(config, what, extra)
        if "error" in measured:
            return measured
        result.update(measured)
    return result


def _worker(config: dict, what: str, env: dict) -> dict:
    """``measure(**config, what=what)`` in a fresh process with ``env`` added to the environment."""
    cmd = [sys.executable, "-m", "benchmarks.attention", "--worker", json.dumps({**config, "what": what})]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, **env),
                          cwd=Path(__file__).resolve().parent.parent)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["killed"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def grid(quick: bool, ns: list[int] | None = None, iters: list[int] | None = None) -> list[dict]:
    """The configurations: ``ns``/``iters`` default to the quick or the full grid."""
    ns = ns or ([256, 1024] if quick else [256, 1024, 4096])
    iters = iters or ([1, 5] if quick else [1, 3, 5, 21])
    configs = []
    for n in ns:
        for method in METHODS:
            for n_iters in ([1] if method in SOFTMAX_METHODS else iters):
                repeats = 5 if n <= 1024 else 3
                configs.append(dict(method=method, b=B, h=H, n=n, d=D, n_iters=n_iters, repeats=repeats))
    return configs


def long_grid() -> list[dict]:
    return [dict(method="ours-chunked", b=1, h=1, n=n, d=D, n_iters=5, repeats=1, single=True)
            for n in (8192, 16384, 32768, 65536)]


def run(configs: list[dict], rounds: int = 1) -> list[dict]:
    """Measure every configuration; with ``rounds > 1``, time in interleaved rounds (see the module
    docstring): ``forward_ms``/``forward_backward_ms`` the medians over rounds, ``*_rounds`` every
    round's figure and ``fb_over_sdpa`` the median over rounds of forward+backward / SDPA's (same n)."""
    from tqdm import tqdm

    rows = []
    for config in tqdm(configs, desc="attention benchmark", unit="config"):
        need = estimated_gib(config["method"], config["b"], config["h"], config["n"], config["n_iters"])
        if need > MEMORY_LIMIT_GIB:
            result = {"error": f"skipped: needs about {need:.0f} GiB"}
        else:
            result = _run_worker(config)
        rows.append({**config, **result})
        tqdm.write(_row_text(rows[-1]))
    if rounds > 1:
        _more_rounds(rows, rounds)
    return rows


def _more_rounds(rows: list[dict], rounds: int) -> None:
    """Rounds 2 .. ``rounds`` of the time measurement, each over every measured row in turn."""
    timed = [row for row in rows if "error" not in row and "forward_ms" in row]
    for row in timed:
        row["forward_ms_rounds"], row["forward_backward_ms_rounds"] = [row["forward_ms"]], [row["forward_backward_ms"]]
    for r in range(2, rounds + 1):
        for row in timed:
            config = {key: row[key] for key in ("method", "b", "h", "n", "d", "n_iters", "repeats", "threads", "clock")
                      if key in row}
            result = _worker(config, "time", {})
            if "error" in result:
                continue
            row["forward_ms_rounds"].append(result["forward_ms"])
            row["forward_backward_ms_rounds"].append(result["forward_backward_ms"])
        print(f"round {r}/{rounds} done", flush=True)
    for row in timed:
        row["forward_ms"] = _median(row["forward_ms_rounds"])
        row["forward_backward_ms"] = _median(row["forward_backward_ms_rounds"])
    for row in timed:
        sdpa = _find(rows, "sdpa", row["n"])
        if sdpa is not None and len(sdpa["forward_backward_ms_rounds"]) == len(row["forward_backward_ms_rounds"]):
            row["fb_over_sdpa"] = _median([a / b for a, b in zip(row["forward_backward_ms_rounds"],
                                                                 sdpa["forward_backward_ms_rounds"])])


def _median(values: list[float]) -> float:
    values = sorted(values)
    middle = len(values) // 2
    return values[middle] if len(values) % 2 else 0.5 * (values[middle - 1] + values[middle])


def _row_text(row: dict) -> str:
    head = f"{row['method']:>16} n={row['n']:<6} iters={row['n_iters']:<3}"
    if "error" in row:
        return f"{head} {row['error']}"
    forward = f"fwd {row['forward_ms']:9.1f} ms   " if "forward_ms" in row else ""
    return f"{head} {forward}fwd+bwd {row['forward_backward_ms']:9.1f} ms   peak {row['peak_mib']:8.1f} MiB"


def _find(rows, method, n, n_iters=1):
    for row in rows:
        if row["method"] == method and row["n"] == n and row["n_iters"] == n_iters and "error" not in row:
            return row
    return None


def _same_run(*rows: dict | None) -> bool:
    """Whether every row exists and all were timed in one run (same date and machine): a time ratio of
    rows merged from different runs (``--merge``) would compare machines, loads or code; none is formed."""
    return all(rows) and len({(r.get("date"), r.get("cpu")) for r in rows}) == 1


def _same_machine(*rows: dict | None) -> bool:
    """Whether every row exists and all were measured on one machine (for memory ratios, which a run's
    timing noise does not move)."""
    return all(rows) and len({r.get("cpu") for r in rows}) == 1


def machines(rows: list[dict]) -> str:
    """``"AMD EPYC"``, or ``"Intel Xeon (2026-11-22 ...); AMD EPYC (2026-11-27 ...)"`` for rows merged from
    several machines; rows without a machine of their own were measured on this one."""
    dates: dict[str, set] = {}
    for row in rows:
        dates.setdefault(row.get("cpu", cpu_model()), set()).add(row.get("date"))
    if len(dates) == 1:
        return next(iter(dates))
    return "; ".join(f"{cpu} ({' and '.join(sorted(d for d in found if d))})" for cpu, found in dates.items())


def summary(rows: list[dict]) -> dict:
    """The issues' targets at b=4, h=8, d=64, n_iters=5, forward+backward: n = 1024 (issues 3 and 15)
    and n = 4096 (issue 15: ours / SDPA, chunked / ours; issue 26: peak memory ours / SDPA). A time ratio is the median of the per-round
    ratios when the rows were timed in rounds."""
    sdpa, paper = _find(rows, "sdpa", 1024), _find(rows, "paper-reference", 1024, 5)
    ours5, ours21 = _find(rows, "ours", 1024, 5), _find(rows, "ours", 1024, 21)
    out = {}
    if _same_run(sdpa, ours5):
        out["time_ours_over_sdpa"] = _time_ratio(ours5, sdpa)
    if _same_machine(sdpa, ours5):
        out["memory_ours_over_sdpa"] = ours5["peak_mib"] / sdpa["peak_mib"]
    sdpa_4k, ours_4k, chunked_4k = (_find(rows, "sdpa", 4096), _find(rows, "ours", 4096, 5),
                                    _find(rows, "ours-chunked", 4096, 5))
    if _same_run(sdpa_4k, ours_4k):
        out["time_ours_over_sdpa_4096"] = _time_ratio(ours_4k, sdpa_4k)
    if _same_machine(sdpa_4k, ours_4k):
        out["memory_ours_over_sdpa_4096"] = ours_4k["peak_mib"] / sdpa_4k["peak_mib"]
    for n, key in ((1024, "time_ours_softmax_over_sdpa"), (4096, "time_ours_softmax_over_sdpa_4096")):
        softmax, base = _find(rows, "ours-softmax", n), _find(rows, "sdpa", n)
        if _same_run(softmax, base):
            out[key] = _time_ratio(softmax, base)
    if _same_run(ours_4k, chunked_4k):
        out["time_chunked_over_ours_4096"] = _time_ratio(chunked_4k, ours_4k)
    if _same_run(paper, ours5):
        out["speedup_over_paper"] = paper["forward_backward_ms"] / ours5["forward_backward_ms"]
    if _same_machine(paper, sdpa):
        out["memory_paper_over_sdpa"] = paper["peak_mib"] / sdpa["peak_mib"]
    if _same_run(paper, sdpa):
        out["time_paper_over_sdpa"] = paper["forward_backward_ms"] / sdpa["forward_backward_ms"]
    if _same_machine(ours5, ours21):
        out["memory_21_over_5"] = ours21["peak_mib"] / ours5["peak_mib"]
    return out


def _time_ratio(row: dict, base: dict) -> float:
    """forward+backward time of ``row`` over ``base``'s: the median of the per-round ratios when both
    were timed in the same rounds, else the ratio of their medians."""
    a, b = row.get("forward_backward_ms_rounds"), base.get("forward_backward_ms_rounds")
    if a and b and len(a) == len(b):
        return _median([x / y for x, y in zip(a, b)])
    return row["forward_backward_ms"] / base["forward_backward_ms"]


def cpu_model() -> str:
    from sinkformer.provenance import cpu_model

    return cpu_model()


def markdown(rows: list[dict], targets: dict, stamp: str) -> str:
    lines = [
        f"Measured {stamp} on {platform.machine()} ({machines(rows)}) with {os.cpu_count()} CPU cores, "
        f"torch {_torch_version()}, b={B}, h={H}, d={D}, float32; medians{_timing_note(rows)}. Targets are read "
        "only from rows of one run (time) or one machine (memory).",
        "",
        "| method | n | n_iters | forward (ms) | forward+backward (ms) | peak memory (MiB) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        if row["b"] != B:
            continue
        if "error" in row:
            lines.append(f"| {row['method']} | {row['n']} | {row['n_iters']} | – | – | {row['error']} |")
        else:
            lines.append(
                f"| {row['method']} | {row['n']} | {row['n_iters']} | {row['forward_ms']:.1f} | "
                f"{row['forward_backward_ms']:.1f} | {row['peak_mib']:.1f} |"
            )
    long_rows = [row for row in rows if row["b"] == 1]
    if long_rows:
        lines += ["", "Chunked mode, one head (b = h = 1), d = 64, 5 iterations, forward+backward:", "",
                  "| n | forward+backward (s) | peak memory (MiB) | MiB per 1k tokens |", "|---:|---:|---:|---:|"]
        for row in long_rows:
            if "error" in row:
                lines.append(f"| {row['n']} | – | {row['error']} | – |")
            else:
                lines.append(f"| {row['n']} | {row['forward_backward_ms'] / 1e3:.1f} | {row['peak_mib']:.1f} | "
                             f"{row['peak_mib'] / (row['n'] / 1024):.2f} |")
    if targets:
        lines += ["", "Targets (n = 1024 unless stated, n_iters = 5, forward+backward):", ""]
        names = {
            "time_ours_over_sdpa": ("time ours / SDPA", "≤ 1.25"),
            "time_ours_over_sdpa_4096": ("time ours / SDPA at n = 4096", "≤ 1.5"),
            "time_chunked_over_ours_4096": ("time ours-chunked / ours at n = 4096", "≤ 1.5"),
            "time_ours_softmax_over_sdpa": ("time ours-softmax / SDPA (the tiled engine's passes with one "
                                            "normalisation: their cost without Sinkhorn iterations)", "(context)"),
            "time_ours_softmax_over_sdpa_4096": ("time ours-softmax / SDPA at n = 4096", "(context)"),
            "speedup_over_paper": ("time paper / ours", "≥ 8"),
            "memory_ours_over_sdpa": ("peak memory ours / SDPA", "≤ 1.5"),
            "memory_ours_over_sdpa_4096": ("peak memory ours / SDPA at n = 4096", "≤ 1.5"),
            "memory_21_over_5": ("peak memory ours, 21 / 5 iterations", "≤ 1.1"),
            "time_paper_over_sdpa": ("time paper / SDPA", "(context)"),
            "memory_paper_over_sdpa": ("peak memory paper / SDPA", "(context)"),
        }
        for key, (label, target) in names.items():
            if targets.get(key) is not None:
                lines.append(f"- {label}: **{targets[key]:.2f}** (target {target})")
    return "\n".join(lines) + "\n"


#: The iteration counts drawn by default (those of the targets); attention.md lists every row.
DEFAULT_ITERS = (5, 21)
#: One line style and marker per number of Sinkhorn iterations; the SoftMax methods (no iterations) are solid.
ITER_STYLES = {1: (":", "v"), 3: ("-.", "^"), 5: ("--", "o"), 21: ((0, (6, 1.5, 1, 1.5, 1, 1.5)), "D")}
SOFTMAX_STYLE = ("-", "s")
_EXTRA_STYLES = [((0, (3, 1)), "P"), ((0, (1, 3)), "X"), ((0, (8, 2)), "*")]


def iter_style(n_iters: int) -> tuple:
    """(line style, marker) of a Sinkhorn method run with ``n_iters`` iterations."""
    if n_iters in ITER_STYLES:
        return ITER_STYLES[n_iters]
    return _EXTRA_STYLES[n_iters % len(_EXTRA_STYLES)]


def plot(rows: list[dict], path: Path, iters: list[int] | None = None):
    """Time and peak memory against n: colour = method, line style and marker = n_iters.

    ``iters``: the Sinkhorn iteration counts to draw (default: those of :data:`DEFAULT_ITERS` in
    ``rows``, else every one). Rows of the one-head long run (b != B) are left out. Returns the
    (closed) figure.
    """
    from matplotlib.lines import Line2D

    from sinkformer.plotting import method_color, pyplot, save_png

    plt = pyplot()
    # one colour per method, shared with the other figures (sinkformer.plotting.METHOD_COLORS): SoftMax in
    # blues (SDPA = the Transformer colour), ours = the Sinkformer colour, chunked red, the paper's code green
    colors = {m: method_color(m) for m in METHODS}
    rows = [r for r in rows if r["b"] == B]
    present = sorted({r["n_iters"] for r in rows if r["method"] not in SOFTMAX_METHODS})
    if iters is None:
        iters = [it for it in DEFAULT_ITERS if it in present] or present
    else:
        iters = [it for it in iters if it in present]
    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    for method in methods:
        for n_iters in [1] if method in SOFTMAX_METHODS else iters:
            pts = sorted((r for r in rows if r["method"] == method and r["n_iters"] == n_iters and "error" not in r),
                         key=lambda r: r["n"])
            if not pts:
                continue
            style, marker = SOFTMAX_STYLE if method in SOFTMAX_METHODS else iter_style(n_iters)
            label = method if method in SOFTMAX_METHODS else f"{method}, n_iters={n_iters}"
            kw = dict(color=colors.get(method, "0.3"), linestyle=style, marker=marker, markersize=5,
                      linewidth=1.6, label=label)
            ns = [r["n"] for r in pts]
            axes[0].plot(ns, [r["forward_backward_ms"] for r in pts], **kw)
            axes[1].plot(ns, [max(r["peak_mib"], 1e-1) for r in pts], **kw)
    for ax, title, unit in zip(axes, ["forward+backward time", "peak memory"], ["time (ms)", "peak memory (MiB)"]):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length n")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(alpha=0.3, which="both", linewidth=0.5)
    method_handles = [Line2D([], [], color=colors.get(m, "0.3"), linewidth=3) for m in methods]
    style_handles, style_labels = [], []
    if any(m in SOFTMAX_METHODS for m in methods):
        style_handles.append(Line2D([], [], color="0.2", linestyle=SOFTMAX_STYLE[0], marker=SOFTMAX_STYLE[1]))
        style_labels.append("SoftMax (no iterations)")
    for it in iters:
        style, marker = iter_style(it)
        style_handles.append(Line2D([], [], color="0.2", linestyle=style, marker=marker))
        style_labels.append(f"{it} iteration{'s' if it > 1 else ''}")
    legend = fig.legend(method_handles, methods, title="method (colour)", loc="upper left",
                        bbox_to_anchor=(1.0, 0.92), fontsize=8.5, title_fontsize=9, frameon=False)
    fig.legend(style_handles, style_labels, title="n_iters (line style)", loc="upper left",
               bbox_to_anchor=(1.0, 0.56), fontsize=8.5, title_fontsize=9, frameon=False, handlelength=3.2)
    fig.add_artist(legend)
    skipped = sorted({(r["method"], r["n"]) for r in rows if "error" in r and r["method"] in methods
                      and (r["method"] in SOFTMAX_METHODS or r["n_iters"] in iters)}, key=lambda t: (t[1], t[0]))
    note = ""
    if skipped:
        note = f"\nnot run (would need > {MEMORY_LIMIT_GIB:g} GiB): " + ", ".join(f"{m} at n={n}" for m, n in skipped)
    shown = ", ".join(str(it) for it in iters)
    fig.suptitle(f"Attention, b={B}, h={H}, d={D}, float32, CPU, medians; Sinkhorn methods at n_iters = {shown} "
                 "(every row: attention.md)"
                 f"{note}", fontsize=10.5)
    fig.tight_layout()
    save_png(fig, path)
    return fig


def _timing_note(rows: list[dict]) -> str:
    """How the rows were timed, when not by the defaults (wall clock, torch's threads, one round)."""
    notes = []
    rounds = {len(r["forward_backward_ms_rounds"]) for r in rows if r.get("forward_backward_ms_rounds")}
    if rounds:
        notes.append(f"over {'/'.join(map(str, sorted(rounds)))} interleaved rounds")
    threads = {r["threads"] for r in rows if r.get("threads")}
    if threads:
        notes.append(f"{'/'.join(map(str, sorted(threads)))} torch thread(s)")
    if any(r.get("clock") == "cpu" for r in rows):
        notes.append("time = the process's CPU time")
    return f" ({', '.join(notes)})" if notes else ""


def _key(row: dict) -> tuple:
    return row["method"], row["b"], row["h"], row["n"], row["n_iters"]


def _torch_version() -> str:
    import torch

    return torch.__version__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks attention", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="n in {256, 1024}, n_iters in {1, 5}")
    parser.add_argument("--long", action="store_true", help="also the chunked mode on one head, n = 8k .. 64k")
    parser.add_argument("--n", nargs="+", type=int, help="sequence lengths (default: those of the grid)")
    parser.add_argument("--iters", nargs="+", type=int, help="Sinkhorn iteration counts (default: the grid's)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="time in this many interleaved rounds (medians; ratios to SDPA per round)")
    parser.add_argument("--threads", type=int, help="torch threads in every measurement (default: torch's)")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="time by the wall clock (default) or by the process's CPU time (a loaded machine)")
    parser.add_argument("--out", default="benchmarks/results", help="folder for attention.{json,md,png}")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=METHODS, help="measure only these")
    parser.add_argument("--merge", action="store_true",
                        help="keep the rows of the existing attention.json that this run does not measure "
                             "(same method, n and n_iters; each row keeps its date)")
    parser.add_argument("--plot-only", action="store_true",
                        help="measure nothing: redraw OUT/attention.png from the existing OUT/attention.json")
    parser.add_argument("--grid", action="store_true",
                        help="the sizes people run instead: n in 16 .. 16384 (or --n), n_iters in {1, 3, 5} (or --iters), "
                             "ratios to SDPA; writes OUT/attention_grid.{json,md,png}")
    parser.add_argument("--processes", type=int, default=GRID_PROCESSES,
                        help=f"--grid: fresh processes per n, their median taken (default {GRID_PROCESSES})")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--grid-worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.grid_worker:
        config = json.loads(args.grid_worker)
        print(json.dumps(measure_grid(config["n"], tuple(config["iters"]))))
        return 0
    if args.grid:
        stamp = dt.datetime.now().strftime("%Y-%m-%d %H:%M")
        rows = run_grid(tuple(args.n or GRID_NS), tuple(args.iters or GRID_ITERS), args.processes)
        text = write_grid(rows, Path(args.out), stamp)
        print("\n" + text)
        print(f"written: {Path(args.out) / 'attention_grid.json'}, .md, .png")
        return 0
    if args.plot_only:
        out = Path(args.out)
        plot(json.loads((out / "attention.json").read_text())["rows"], out / "attention.png")
        print(f"written: {out / 'attention.png'}")
        return 0
    if args.worker:
        config = json.loads(args.worker)
        config.pop("single", None)
        print(json.dumps(measure(**config)))
        return 0
    configs = [c for c in grid(args.quick, args.n, args.iters) + (long_grid() if args.long else [])
               if c["method"] in args.methods]
    if args.threads is not None or args.clock != "wall":
        configs = [dict(c, threads=args.threads, clock=args.clock) for c in configs]
    stamp = dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    rows = [dict(row, date=stamp, cpu=cpu_model()) for row in run(configs, args.rounds)]
    out = Path(args.out)
    if args.merge and (out / "attention.json").exists():
        measured = {_key(row) for row in rows}
        earlier = json.loads((out / "attention.json").read_text())
        # a kept row keeps its own machine (rows of files written before rows carried it: the file's)
        kept = [dict({"cpu": earlier.get("cpu", "unknown CPU")}, **row) for row in earlier["rows"]
                if _key(row) not in measured]
        rows = sorted(kept + rows, key=lambda r: (r["b"] != B, r["n"], METHODS.index(r["method"]), r["n_iters"]))
        stamp = " and ".join(sorted({row.get("date", stamp) for row in rows}))
    targets = summary(rows)
    out.mkdir(parents=True, exist_ok=True)
    (out / "attention.json").write_text(json.dumps({"date": stamp, "cpu": cpu_model(), "rows": rows, "targets": targets},
                                                   indent=2))
    text = markdown(rows, targets, stamp)
    (out / "attention.md").write_text(text)
    plot(rows, out / "attention.png")
    print("\n" + text)
    print(f"written: {out / 'attention.json'}, {out / 'attention.md'}, {out / 'attention.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
