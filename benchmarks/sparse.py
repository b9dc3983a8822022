"""Sparse Sinkhorn Attention layers against SDPA and lucidrains/sinkhorn-transformer: time and memory.

    python -m benchmarks sparse [--quick] [--lengths N ...] [--rounds R] [--threads T] [--clock wall|cpu]
                                [--out benchmarks/results]

Every layer is a multi-head self-attention layer (projections included) of width 256, 4 heads, in
training mode (Gumbel noise on, no dropout), batch 1; one step is the forward pass and the
backward pass of the sum of its output (with respect to the input and the weights):

* ``plain``, ``sortcut``, ``causal``, ``mixture``: :class:`sinkformer.nn.SparseSinkhornAttention`
  with blocks of 64, 5 Sinkhorn iterations, temperature 0.75; ``sortcut`` keeps 2 sorted blocks,
  ``mixture`` adds vanilla attention (§3.2.3). Values are sorted as values (the paper's algorithm).
* ``sdpa``, ``sdpa-causal``: dense SoftMax attention, PyTorch's fused
  ``scaled_dot_product_attention`` called directly (``is_causal=True`` for the causal one), with one
  ``(d, 3d)`` input projection and the output projection.
* ``lucidrains-plain``, ``lucidrains-sortcut``, ``lucidrains-causal``: ``SinkhornSelfAttention``
  of the ``sinkhorn-transformer`` package when it is installed (it is never a dependency),
  set up to match: ``bucket_size=64``, ``heads=4``, ``non_permutative=False`` (Gumbel-Sinkhorn
  sorting rather than its default top-1 relaxation), ``sinkhorn_iter=5``, ``temperature=0.75``,
  ``n_sortcut=2`` for SortCut, ``causal=True`` for causal (its causal layer sorts with a masked
  top-1 relaxation, not Sinkhorn). Differences that remain: its non-SortCut layer attends with the
  sorted *keys* in place of the sorted values (so it skips the values' sorting backward), its sort
  net scores blocks by mean-pooled query-key products (ours: a linear map of summed blocks), and its
  projections have no bias.

Time: one process, every layer built and warmed up, then ``--rounds`` interleaved rounds (each
layer once per round, the order rotated from round to round); the best round is reported, by wall
clock, or with ``--clock cpu`` by the process's CPU time (with ``--threads 1``, what a step takes on
an idle core: the figure to use when other processes load the machine). Memory:
one child process, started with ``MALLOC_MMAP_THRESHOLD_`` fixed so that freed blocks return to the
system at once (layers measured one after the other then do not reuse each other's pages); per
layer and length, after a warm-up step at a short length, the peak resident-set rise during one step
over the resident set just before it (``VmHWM`` reset through ``/proc/self/clear_refs``), and the
exact size of the storages autograd keeps for the backward pass. The machine is shared: the load
average before and after the run is recorded with the figures.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

OURS = ("plain", "sortcut", "causal", "mixture")
SDPA = ("sdpa", "sdpa-causal")
LUCIDRAINS = ("lucidrains-plain", "lucidrains-sortcut", "lucidrains-causal")
LAYERS = OURS + SDPA + LUCIDRAINS
DIM, HEADS, BLOCK, BUDGET, SORT_ITERS, TEMPERATURE = 256, 4, 64, 2, 5, 0.75
LENGTHS = (1024, 4096, 16384)
QUICK_LENGTHS = (256, 512)
RESULTS = Path(__file__).resolve().parent / "results"
#: (ours, lucidrains, SDPA) compared in the targets
PAIRS = {"plain": ("lucidrains-plain", "sdpa"), "sortcut": ("lucidrains-sortcut", "sdpa"),
         "causal": ("lucidrains-causal", "sdpa-causal"), "mixture": (None, "sdpa")}


def lucidrains_version() -> str | None:
    """The installed ``sinkhorn-transformer`` version, or ``None`` when it cannot be imported."""
    try:
        import sinkhorn_transformer  # noqa: F401
    except Exception:  # not installed, or a dependency missing or broken
        return None
    from importlib.metadata import version

    return version("sinkhorn-transformer")


def make_layer(name: str, length: int):
    """The layer ``name`` for sequences of ``length`` tokens, in training mode."""
    from sinkformer.nn import SparseSinkhornAttention

    if name in OURS:
        options = {"sortcut": {"sortcut_budget": BUDGET}, "causal": {"causal": True}, "mixture": {"mixture": True}}
        layer = SparseSinkhornAttention(DIM, HEADS, block_size=BLOCK, max_len=length, sort_iters=SORT_ITERS,
                                        temperature=TEMPERATURE, **options.get(name, {}))
    elif name in SDPA:
        layer = SDPASelfAttention(DIM, HEADS, causal=name == "sdpa-causal")
    else:
        from sinkhorn_transformer import SinkhornSelfAttention

        options = {"lucidrains-sortcut": {"n_sortcut": BUDGET}, "lucidrains-causal": {"causal": True}}
        layer = SinkhornSelfAttention(DIM, BLOCK, length, heads=HEADS, non_permutative=False, sinkhorn_iter=SORT_ITERS,
                                      temperature=TEMPERATURE, **options.get(name, {}))
    return layer.train()


def SDPASelfAttention(dim: int, heads: int, causal: bool):
    """Multi-head SoftMax self-attention through ``torch.nn.functional.scaled_dot_product_attention``."""
    import torch.nn.functional as F
    from torch import nn

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv_proj, self.out_proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

        def forward(self, x):
            q, k, v = self.qkv_proj(x).unflatten(-1, (3, heads, -1)).permute(2, 0, 3, 1, 4)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            return self.out_proj(out.transpose(1, 2).flatten(-2))

    return Layer()


def _step(layer, x) -> None:
    """One forward + backward of the sum of the layer's output."""
    layer(x).sum().backward()


# ----------------------------------------------------------------------------- time (this process)


def time_layers(layers: list[str], lengths: list[int], rounds: int, threads: int, clock: str = "wall") -> list[dict]:
    """Best-of-``rounds`` time of one step for every (layer, length), the layers interleaved.

    ``clock="cpu"``: the process's CPU time instead of wall time (with one thread, the time the
    step would take on an idle core; robust when other processes share the cores).
    """
    import torch

    now = time.process_time if clock == "cpu" else time.perf_counter

    torch.set_num_threads(threads)
    rows = []
    for n in lengths:
        torch.manual_seed(0)
        built = {name: make_layer(name, n) for name in layers}
        x = torch.randn(1, n, DIM, requires_grad=True)
        for layer in built.values():
            _step(layer, x)  # warm-up
        times: dict[str, list[float]] = {name: [] for name in layers}
        for r in range(rounds):
            order = layers[r % len(layers):] + layers[: r % len(layers)]
            for name in order:
                start = now()
                _step(built[name], x)
                times[name].append(now() - start)
        for name in layers:
            rows.append({"layer": name, "n": n, "ms": 1e3 * min(times[name]), "rounds": rounds,
                         "median_ms": 1e3 * sorted(times[name])[len(times[name]) // 2]})
            print(f"{name:>20} {n:>6}: {rows[-1]['ms']:9.1f} ms (best of {rounds})", flush=True)
        del built
    return rows


# ----------------------------------------------------------------------------- memory (child process)


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def memory_worker(layers: list[str], lengths: list[int], threads: int) -> list[dict]:
    """Peak RSS rise and saved-for-backward bytes of one step, for every (layer, length)."""
    import torch

    torch.set_num_threads(threads)
    rows = []
    for n in lengths:
        for name in layers:
            torch.manual_seed(0)
            short = min(n, 512)
            _step(make_layer(name, short), torch.randn(1, short, DIM, requires_grad=True))  # warm-up
            layer = make_layer(name, n)
            x = torch.randn(1, n, DIM, requires_grad=True)
            storages: dict[int, int] = {}

            def pack(t):
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                return t

            Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark
            base = _status_kib("VmRSS")
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = layer(x)
            out.sum().backward()
            peak = _status_kib("VmHWM") - base
            rows.append({"layer": name, "n": n, "peak_mib": peak / 1024, "saved_mib": sum(storages.values()) / 2**20})
            del layer, x, out
    return rows


def measure_memory(layers: list[str], lengths: list[int], threads: int) -> list[dict]:
    """:func:`memory_worker` in a child process with a fixed mmap threshold (see the module docstring)."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072")
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "benchmarks.sparse", "--memory-worker", "--layers", *layers,
           "--lengths", *map(str, lengths), "--threads", str(threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=root)
    if proc.returncode != 0:
        raise RuntimeError(f"the memory worker failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- results


def targets(rows: list[dict]) -> list[dict]:
    """The issue's targets, each with its measured ratio and ``met`` (``None``: not measured)."""
    cell = {(r["layer"], r["n"]): r for r in rows}
    lengths = sorted({r["n"] for r in rows})
    longest = lengths[-1]

    def ratio(a, b, n, key="ms"):
        ra, rb = cell.get((a, n)), cell.get((b, n))
        if ra is None or rb is None or ra.get(key) is None or rb.get(key) is None:
            return None
        return ra[key] / rb[key]

    out = []

    def add(text, value, limit, strict=False):
        met = None if value is None else (value < limit if strict else value <= limit)
        out.append({"target": text, "ratio": value, "limit": limit, "met": met})

    for n in lengths:
        add(f"plain ≤ 1.0× lucidrains-plain time, n = {n}", ratio("plain", "lucidrains-plain", n), 1.0)
    for n in lengths:
        add(f"sortcut < 1.0× lucidrains-sortcut time, n = {n}", ratio("sortcut", "lucidrains-sortcut", n), 1.0, True)
    for n in [m for m in lengths if m >= 4096]:  # the three variants (the mixture contains SDPA's attention)
        for ours in ("plain", "sortcut", "causal"):
            sdpa = PAIRS[ours][1]
            add(f"{ours} < 1.0× {sdpa} time, n = {n}", ratio(ours, sdpa, n), 1.0, True)
    add(f"causal ≤ 1.5× plain time, n = {longest}", ratio("causal", "plain", longest), 1.5)
    add(f"causal ≤ 1.3× plain memory (peak rise), n = {longest}", ratio("causal", "plain", longest, "peak_mib"), 1.3)
    return out


def _cpu_model() -> str:
    from sinkformer.provenance import cpu_model

    return cpu_model()


def markdown(payload: dict) -> str:
    rows, cfg = payload["rows"], payload["config"]
    lengths = sorted({r["n"] for r in rows})
    layers = [name for name in LAYERS if any(r["layer"] == name for r in rows)]
    cell = {(r["layer"], r["n"]): r for r in rows}
    machine = payload["machine"]
    luc = payload["lucidrains"]
    lines = [
        f"Measured {payload['date']} on {machine['platform']} ({machine['cpu']}, {machine['cpus']} cores, "
        f"{cfg['threads']} torch threads), torch {machine['torch']}; load average {machine['load_before']:.2f} before, "
        f"{machine['load_after']:.2f} after. One layer of width {DIM}, {HEADS} heads, blocks of {BLOCK}, batch 1, "
        f"training mode; one step = forward + backward of the output's sum. Time: best of {cfg['rounds']} interleaved "
        f"rounds (ms, {'process CPU time' if cfg.get('clock') == 'cpu' else 'wall clock'}); memory: peak resident-set "
        "rise during one step (MiB). "
        + (f"lucidrains: `sinkhorn-transformer` {luc} (`non_permutative=False`, `sinkhorn_iter={SORT_ITERS}`)."
           if luc else "lucidrains: `sinkhorn-transformer` is not installed, its columns are left out."),
        "",
        "| layer | " + " | ".join(f"n = {n}: time (ms)" for n in lengths) + " | "
        + " | ".join(f"n = {n}: memory (MiB)" for n in lengths) + " |",
        "|---|" + "---:|" * (2 * len(lengths)),
    ]
    for name in layers:
        times = [f"{cell[(name, n)]['ms']:.1f}" if cell.get((name, n), {}).get("ms") is not None else "—" for n in lengths]
        mems = [f"{cell[(name, n)]['peak_mib']:.0f}" if cell.get((name, n), {}).get("peak_mib") is not None else "—"
                for n in lengths]
        lines.append(f"| {name} | " + " | ".join(times + mems) + " |")
    lines += ["", "| target | measured | |", "|---|---:|---|"]
    for t in payload["targets"]:
        verdict = "not measured" if t["met"] is None else ("met" if t["met"] else "**missed**")
        value = "—" if t["ratio"] is None else f"{t['ratio']:.2f}×"
        lines.append(f"| {t['target']} | {value} | {verdict} |")
    return "\n".join(lines) + "\n"


#: Colour per variant; line style: ours solid, lucidrains dashed, SDPA dotted.
COLORS = {"plain": "tab:orange", "sortcut": "tab:green", "causal": "tab:red", "mixture": "tab:purple",
          "sdpa": "tab:blue", "sdpa-causal": "tab:red"}


def _look(name: str) -> dict:
    if name.startswith("lucidrains-"):
        return dict(color=COLORS[name.removeprefix("lucidrains-")], linestyle="--", marker="s", markerfacecolor="white")
    if name in SDPA:
        return dict(color=COLORS[name], linestyle=":", marker="o", markerfacecolor="white")
    return dict(color=COLORS[name], linestyle="-", marker="^")


def plot(rows: list[dict], path: Path):
    """Time and peak memory against length (log-log), one line per layer; returns the closed figure."""
    from matplotlib.ticker import FuncFormatter

    from sinkformer.plotting import pyplot, save_png

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4))
    for name in LAYERS:
        for ax, key in zip(axes, ("ms", "peak_mib")):
            pts = sorted((r for r in rows if r["layer"] == name and r.get(key) is not None), key=lambda r: r["n"])
            if pts:
                ax.plot([p["n"] for p in pts], [max(p[key], 1e-3) for p in pts], label=name, linewidth=1.5,
                        markersize=5, **_look(name))
    for ax, title in zip(axes, ("time of one forward + backward (ms)", "peak memory rise (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda n, _pos: f"{n / 1024:g}k" if n >= 1024 else f"{n:g}"))
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel(title)
        ax.grid(True, which="both", alpha=0.3, linewidth=0.5)
    fig.legend(*axes[0].get_legend_handles_labels(), title="layer", loc="upper left", bbox_to_anchor=(1.0, 0.9),
               frameon=False, fontsize=9)
    fig.suptitle(f"Sparse Sinkhorn Attention layers (width {DIM}, {HEADS} heads, blocks of {BLOCK}), CPU: ours (solid), "
                 "lucidrains (dashed), SDPA (dotted)", fontsize=10)
    fig.tight_layout()
    save_png(fig, path)
    return fig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks sparse", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"lengths {QUICK_LENGTHS}, 2 rounds (seconds)")
    parser.add_argument("--lengths", nargs="+", type=int, help=f"default {LENGTHS}")
    parser.add_argument("--layers", nargs="+", choices=LAYERS, default=list(LAYERS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="time a step by wall clock (default) or by the process's CPU time (with --threads 1: "
                             "robust when other processes load the machine)")
    parser.add_argument("--no-memory", action="store_true", help="time only")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for sparse.{json,md,png}")
    parser.add_argument("--render-only", action="store_true",
                        help="measure nothing: rewrite OUT/sparse.md, OUT/sparse.png and the targets from OUT/sparse.json")
    parser.add_argument("--memory-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.render_only:
        payload = json.loads((args.out / "sparse.json").read_text())
        return write_results(payload, args.out)
    lengths = args.lengths or list(QUICK_LENGTHS if args.quick else LENGTHS)
    rounds = 2 if args.quick else args.rounds
    if args.memory_worker:
        print(json.dumps(memory_worker(args.layers, lengths, args.threads)))
        return 0
    luc = lucidrains_version()
    layers = [name for name in args.layers if luc or name not in LUCIDRAINS]
    if luc is None and any(name in LUCIDRAINS for name in args.layers):
        print("sinkhorn-transformer is not importable: the lucidrains layers are left out", flush=True)
    import torch

    load_before = os.getloadavg()[0]
    rows = time_layers(layers, lengths, rounds, args.threads, args.clock)
    if not args.no_memory:
        memory = {(r["layer"], r["n"]): r for r in measure_memory(layers, lengths, args.threads)}
        for row in rows:
            row.update({k: v for k, v in memory[(row["layer"], row["n"])].items() if k.endswith("_mib")})
    payload = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": {"platform": platform.machine(), "cpu": _cpu_model(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "load_before": load_before, "load_after": os.getloadavg()[0]},
        "config": {"dim": DIM, "heads": HEADS, "block_size": BLOCK, "sortcut_budget": BUDGET, "sort_iters": SORT_ITERS,
                   "temperature": TEMPERATURE, "batch": 1, "rounds": rounds, "threads": args.threads,
                   "clock": args.clock},
        "lucidrains": luc,
        "rows": rows,
    }
    return write_results(payload, args.out)


def write_results(payload: dict, out: Path) -> int:
    """Judge the targets, then write ``sparse.json``, ``sparse.md`` and ``sparse.png`` to ``out``."""
    payload["targets"] = targets(payload["rows"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "sparse.json").write_text(json.dumps(payload, indent=2))
    text = markdown(payload)
    (out / "sparse.md").write_text(text)
    plot(payload["rows"], out / "sparse.png")
    print("\n" + text)
    print(f"written: {out / 'sparse.json'}, {out / 'sparse.md'}, {out / 'sparse.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
