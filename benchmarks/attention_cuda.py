"""Sinkhorn attention on a CUDA GPU: SDPA, the official Sinkformers algorithm and each of our engines.

    python -m benchmarks.attention_cuda [--quick] [--methods flash,sdpa-flash] [--out DIR]
    python -m benchmarks.attention_cuda --smoke --out /tmp/x   # CPU, tiny sizes, Triton's interpreter

Grid: ``b·h = 32`` (b = 4, h = 8), ``d = 64``, ``n`` in {1024, 4096, 16384}, bfloat16 and
float32, ``n_iters`` in {1, 3, 5, 21}. Methods:

* ``sdpa-flash`` — ``scaled_dot_product_attention`` with the FlashAttention backend (SoftMax; it
  serves half precision only, so float32 rows use the memory-efficient backend: ``sdpa_backend``);
* ``official`` — the Sinkformers paper's algorithm as Appendix B writes it: log domain, ``g0 = 0``,
  alternating ``f``/``g`` updates with ``log(1/n)`` marginals, unrolled through autograd, in the
  input dtype;
* ``flash``, ``tiled``, ``streamed``, ``dense`` — ``sinkformer.attention(..., backend=...)``.

Time: medians of CUDA-event timings after warm-up, forward (under ``no_grad``) and forward+backward
(``repeats`` timings, at least 3, fewer where they would take over ``seconds``).
Memory: ``torch.cuda.max_memory_allocated`` during one forward+backward minus the memory allocated
before it (q, k, v and the upstream gradient), so it includes the three input gradients. A method
whose estimated memory exceeds the GPU's is skipped; one that runs out of memory is marked ``oom``.
Results: ``attention_cuda.{json,md,png}`` with the GPU's name and the date. :mod:`benchmarks.gpu_check`
runs this grid inside the whole GPU check and writes the committed results.

Entry point for ``python -m benchmarks``: :func:`main` (``argv`` without the suite name).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import time
from pathlib import Path

SOFTMAX = "sdpa-flash"
METHODS = [SOFTMAX, "official", "flash", "tiled", "streamed", "dense"]
FULL = dict(b=4, h=8, d=64, ns=[1024, 4096, 16384], dtypes=["bfloat16", "float32"], iters=[1, 3, 5, 21], repeats=10)
QUICK = dict(b=4, h=8, d=64, ns=[1024, 4096], dtypes=["bfloat16"], iters=[1, 5], repeats=5)
SMOKE = dict(b=1, h=2, d=16, ns=[40], dtypes=["float32"], iters=[3], repeats=1)


# ----------------------------------------------------------------------------- the methods


def official_sinkformers(q, k, v, n_iters: int):
    """Sinkformers Appendix B, literally (the CPU benchmark's :func:`benchmarks.attention.paper_reference`)."""
    from benchmarks.attention import paper_reference

    return paper_reference(q, k, v, n_iters)


def make_fn(method: str, n_iters: int, device: str, dtype):
    """``fn(q, k, v) -> out`` for one method; and the SDPA backend used (or None)."""
    import torch
    import torch.nn.functional as F

    from sinkformer import attention

    if method == SOFTMAX:
        if device != "cuda":
            return (lambda q, k, v: F.scaled_dot_product_attention(q, k, v)), "default (CPU)"
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = SDPBackend.FLASH_ATTENTION if dtype in (torch.float16, torch.bfloat16) else SDPBackend.EFFICIENT_ATTENTION

        def sdpa(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v)

        return sdpa, backend.name.lower()
    if method == "official":
        return (lambda q, k, v: official_sinkformers(q, k, v, n_iters)), None
    return (lambda q, k, v: attention(q, k, v, n_iters=n_iters, backend=method)), None


def estimated_gib(method: str, bh: int, n: int, d: int, n_iters: int, itemsize: int) -> float:
    """Rough peak memory: methods that keep n x n matrices for autograd keep about n_iters + 3 of them."""
    square = bh * n * n
    if method in ("official", "dense"):
        return (n_iters + 3) * square * max(itemsize, 4 if method == "dense" else itemsize) / 2**30
    if method == "tiled":  # one group of slices at a time, a few tiles of 2^27 float32 scores
        return 4 * min(square, 1 << 27) * 4 / 2**30
    return 16 * bh * n * d * 4 / 2**30


# ----------------------------------------------------------------------------- measuring


class Clock:
    """Elapsed milliseconds of a step: CUDA events on a GPU, ``perf_counter`` on the CPU."""

    def __init__(self, device: str):
        self.device = device

    def __call__(self, step) -> float:
        import torch

        if self.device != "cuda":
            start = time.perf_counter()
            step()
            return 1e3 * (time.perf_counter() - start)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        step()
        end.record()
        torch.cuda.synchronize()
        return begin.elapsed_time(end)


def measure(method: str, n: int, n_iters: int, dtype_name: str, cfg: dict, device: str) -> dict:
    """Forward and forward+backward medians (ms) and the peak memory of one configuration."""
    import torch

    dtype = getattr(torch, dtype_name)
    b, h, d = cfg["b"], cfg["h"], cfg["d"]
    row = dict(method=method, n=n, n_iters=n_iters, dtype=dtype_name, b=b, h=h, d=d)
    if device == "cuda":
        need = estimated_gib(method, b * h, n, d, n_iters, torch.finfo(dtype).bits // 8)
        total = torch.cuda.get_device_properties(0).total_memory / 2**30
        if need > 0.9 * total:
            return dict(row, status=f"skipped: needs about {need:.0f} GiB of {total:.0f}")
    fn, sdpa_backend = make_fn(method, n_iters, device, dtype)
    if sdpa_backend:
        row["sdpa_backend"] = sdpa_backend
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, generator=gen, device=device, dtype=dtype).requires_grad_() for _ in range(3))
    grad = torch.randn(b, h, n, d, generator=gen, device=device, dtype=dtype)
    clock = Clock(device)

    def forward():
        with torch.no_grad():
            fn(q, k, v)

    def forward_backward():
        for t in (q, k, v):
            t.grad = None
        fn(q, k, v).backward(grad)

    try:
        forward_backward()  # warm-up (compiles the kernels)
        forward()
        row["forward_ms"] = statistics.median(clock(forward) for _ in range(_repeats(clock(forward), cfg)))
        row["forward_backward_ms"] = statistics.median(
            clock(forward_backward) for _ in range(_repeats(clock(forward_backward), cfg)))
        if device == "cuda":
            for t in (q, k, v):
                t.grad = None
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            forward_backward()
            torch.cuda.synchronize()
            row["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
            row["inputs_and_grads_mib"] = 6 * q.numel() * q.element_size() / 2**20
        row["status"] = "ok"
    except torch.cuda.OutOfMemoryError:
        row["status"] = "oom"
    finally:
        if device == "cuda":
            torch.cuda.empty_cache()
    return row


def _repeats(first_ms: float, cfg: dict) -> int:
    """``cfg["repeats"]`` timings, fewer (at least 3) where they would take over ``cfg["seconds"]``."""
    seconds = cfg.get("seconds")
    if not seconds:
        return cfg["repeats"]
    return max(min(3, cfg["repeats"]), min(cfg["repeats"], int(1e3 * seconds / max(first_ms, 1e-3))))


def run(cfg: dict, methods: list[str], device: str) -> list[dict]:
    rows = []
    for dtype_name in cfg["dtypes"]:
        for n in cfg["ns"]:
            for method in methods:
                for n_iters in ([cfg["iters"][0]] if method == SOFTMAX else cfg["iters"]):
                    row = measure(method, n, n_iters, dtype_name, cfg, device)
                    rows.append(row)
                    print(_row_text(row), flush=True)
    return rows


def _row_text(row: dict) -> str:
    if row["status"] != "ok":
        return f"{row['dtype']:>8} n={row['n']:>5} iters={row['n_iters']:>2} {row['method']:<10} {row['status']}"
    peak = f" peak {row['peak_mib']:9.1f} MiB" if "peak_mib" in row else ""
    return (f"{row['dtype']:>8} n={row['n']:>5} iters={row['n_iters']:>2} {row['method']:<10} "
            f"fwd {row['forward_ms']:9.3f} ms  fwd+bwd {row['forward_backward_ms']:9.3f} ms{peak}")


# ----------------------------------------------------------------------------- reporting


def _find(rows, method, n, dtype, n_iters=None):
    for r in rows:
        if (r["method"] == method and r["n"] == n and r["dtype"] == dtype and r["status"] == "ok"
                and (n_iters is None or method == SOFTMAX or r["n_iters"] == n_iters)):
            return r
    return None


def targets(rows: list[dict], graph: dict | None = None) -> list[dict]:
    """The GPU targets of the flash engine, measured, met or missed (None: not in this run); ``graph``:
    the GPU check's CUDA-graph part (the official algorithm against flash replayed from a graph)."""
    out = []
    sdpa = _find(rows, SOFTMAX, 4096, "bfloat16")
    for n_iters, limit in ((3, 1.5), (5, 2.0)):
        ours = _find(rows, "flash", 4096, "bfloat16", n_iters)
        ratio = ours["forward_backward_ms"] / sdpa["forward_backward_ms"] if sdpa and ours else None
        out.append(dict(target=f"bf16, n=4096, {n_iters} iters, fwd+bwd: flash <= {limit}x SDPA-flash",
                        value=ratio, met=None if ratio is None else ratio <= limit, limit=limit, n_iters=n_iters))
    ours = _find(rows, "flash", 4096, "bfloat16", 5)
    mem = (ours["peak_mib"] / sdpa["peak_mib"] if sdpa and ours and "peak_mib" in ours and sdpa["peak_mib"] > 0
           else None)
    out.append(dict(target="bf16, n=4096, 5 iters: peak memory <= 1.2x SDPA's", value=mem,
                    met=None if mem is None else mem <= 1.2))
    off, ours1 = _find(rows, "official", 1024, "bfloat16", 5), _find(rows, "flash", 1024, "bfloat16", 5)
    speedup = off["forward_backward_ms"] / ours1["forward_backward_ms"] if off and ours1 else None
    out.append(dict(target="bf16, n=1024, 5 iters, fwd+bwd: flash >= 20x faster than the official algorithm",
                    value=speedup, met=None if speedup is None else speedup >= 20))
    replayed = (graph or {}).get("official_over_replay")
    out.append(dict(target="same, flash replayed from a CUDA graph: >= 20x faster than the official algorithm",
                    value=replayed, met=None if replayed is None else replayed >= 20))
    long = [r for r in rows if r["method"] == "flash" and r["n"] == 16384]
    ran = any(r["status"] == "ok" for r in long) if long else None
    out.append(dict(target="n=16384 runs (flash)", value=None, met=ran))
    return out


def gpu_name(device: str) -> str:
    import torch

    if device == "cuda":
        return torch.cuda.get_device_name(0)
    import platform

    return f"CPU ({platform.processor() or platform.machine()}, smoke run under Triton's interpreter)"


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"# Sinkhorn attention on {meta['gpu']}", "",
             f"{meta['date']} · torch {meta['torch']} · triton {meta['triton']} · b={meta['b']}, h={meta['h']}, "
             f"d={meta['d']} · medians of {meta['repeats']} {meta['clock']} timings"
             f"{' (smoke run: tiny sizes, not a measurement)' if meta['smoke'] else ''}.", "",
             "Peak memory: `max_memory_allocated` during one forward+backward minus what was allocated before "
             "(includes the gradients of q, k, v).", ""]
    for dtype in meta["dtypes"]:
        lines += [f"## {dtype}", "", "| n | n_iters | method | forward ms | fwd+bwd ms | fwd+bwd / SDPA | peak MiB |",
                  "|---:|---:|---|---:|---:|---:|---:|"]
        for r in rows:
            if r["dtype"] != dtype:
                continue
            if r["status"] != "ok":
                lines.append(f"| {r['n']} | {r['n_iters']} | {r['method']} | {r['status']} | | | |")
                continue
            sdpa = _find(rows, SOFTMAX, r["n"], dtype)
            ratio = f"{r['forward_backward_ms'] / sdpa['forward_backward_ms']:.2f}" if sdpa else ""
            peak = f"{r['peak_mib']:.0f}" if "peak_mib" in r else ""
            name = r["method"] + (f" ({r['sdpa_backend']})" if r.get("sdpa_backend") else "")
            lines.append(f"| {r['n']} | {r['n_iters']} | {name} | {r['forward_ms']:.3f} | "
                         f"{r['forward_backward_ms']:.3f} | {ratio} | {peak} |")
        lines.append("")
    lines += ["## Targets", "", "| target | measured | met |", "|---|---:|---|"]
    for t in targets(rows, meta.get("graph")):
        value = "" if t["value"] is None else f"{t['value']:.2f}"
        met = "not measured" if t["met"] is None else ("yes" if t["met"] else "**no**")
        lines.append(f"| {t['target']} | {value} | {met} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], meta: dict, path: Path) -> bool:
    """Forward+backward time against n, one panel per dtype, at 5 iterations (or the grid's largest)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no figure (pip install 'sinkformer[experiments]')", file=sys.stderr)
        return False
    iters = 5 if 5 in meta["iters"] else max(meta["iters"])
    fig, axes = plt.subplots(1, len(meta["dtypes"]), figsize=(6 * len(meta["dtypes"]), 4.2), squeeze=False)
    for ax, dtype in zip(axes[0], meta["dtypes"]):
        for method in meta["methods"]:
            pts = [(n, r["forward_backward_ms"]) for n in meta["ns"]
                   if (r := _find(rows, method, n, dtype, iters)) is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=method)
        ax.set(xscale="log", yscale="log", xlabel="n", ylabel="forward+backward ms",
               title=f"{dtype}, n_iters={iters} (SDPA: SoftMax)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{meta['gpu']} · b·h={meta['b'] * meta['h']}, d={meta['d']} · {meta['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ----------------------------------------------------------------------------- entry point


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.attention_cuda", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="n in {1024, 4096}, bfloat16, n_iters in {1, 5}")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU, tiny sizes, Triton's interpreter: checks the script end to end (no measurement)")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {METHODS}")
    parser.add_argument("--out", default="benchmark-results",
                        help="folder for attention_cuda.{json,md,png} (default: ./benchmark-results; the committed "
                             "results are benchmarks/results, written by python -m benchmarks gpu-check)")
    args = parser.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = set(methods) - set(METHODS)
    if unknown:
        parser.error(f"--methods: unknown {sorted(unknown)}; valid: {METHODS}")
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the flash kernels are first imported
    import torch

    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("attention_cuda: no CUDA device (torch.cuda.is_available() is False). This benchmark measures "
              "GPU kernels; run it on a machine with an NVIDIA GPU, or pass --smoke to check the script on the CPU.",
              file=sys.stderr)
        return 2
    cfg = SMOKE if args.smoke else (QUICK if args.quick else FULL)
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
        if "flash" in methods:
            print("triton is not installed: the flash engine is skipped (pip install 'sinkformer[gpu]')",
                  file=sys.stderr)
            methods = [m for m in methods if m != "flash"]
    rows = run(cfg, methods, device)
    meta = dict(gpu=gpu_name(device), date=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                torch=torch.__version__, triton=triton_version, smoke=args.smoke, methods=methods,
                clock="CUDA-event" if device == "cuda" else "perf_counter", **cfg)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "attention_cuda.json").write_text(json.dumps(dict(meta=meta, rows=rows, targets=targets(rows)), indent=1))
    (out / "attention_cuda.md").write_text(markdown(rows, meta))
    plot(rows, meta, out / "attention_cuda.png")
    print(f"wrote {out / 'attention_cuda.json'}, .md, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
