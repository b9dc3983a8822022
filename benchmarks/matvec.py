"""The engines' row sums ``K x`` on this CPU: each way :func:`~sinkformer.sinkhorn.scaling.add_rows_times`
can multiply, on the cache blocks the tiled engine uses, and which one the library picks here.

``add_rows_times(add, K, x, out)`` (``out = add + K x``, ``K (c, r, m)``) runs one of three products, chosen by
two constants of :mod:`sinkformer.sinkhorn.sizes`: the row-vector product ``x^T K^T`` where
``ROW_VECTOR_PRODUCTS`` (MKL on a CPU that is not Intel's), else one ``addmv`` per slice for blocks of at most
``MATVEC_LOOP_SLICES`` slices, else one batched ``bmm``. This benchmark forces each in turn (the library's own
function, the constants set) and times it beside the column sums ``u^T K`` of the same block, the other
product of every normalisation. Blocks: those of b x h = 4 x 8 at n = 64 to 1024 (whole slices) and a 128-row
block of n = 4096; on 1 and 2 threads; the median over interleaved rounds of each round's median, in us.

    python -m benchmarks matvec --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from sinkformer.provenance import cpu_model, cpu_vendor
from sinkformer.sinkhorn import scaling, sizes

#: (c, r, m) of the blocks timed: b x h = 4 x 8 at n = 64..1024 (cache blocks of whole slices), 128 rows of n = 4096
BLOCKS = ((32, 64, 64), (32, 128, 128), (8, 256, 256), (2, 512, 512), (1, 1024, 1024), (1, 128, 4096))
#: method -> (ROW_VECTOR_PRODUCTS, MATVEC_LOOP_SLICES) that make add_rows_times take it
METHODS = {"batched": (False, 0), "per-slice": (False, 1 << 30), "row-vector": (True, 0)}


def _takes(method: str, K: torch.Tensor) -> bool:
    """Whether ``add_rows_times`` can take ``method`` for the block ``K`` (one slice is never multiplied per slice)."""
    saved = (sizes.ROW_VECTOR_PRODUCTS, sizes.MATVEC_LOOP_SLICES)
    sizes.ROW_VECTOR_PRODUCTS, sizes.MATVEC_LOOP_SLICES = METHODS[method]
    try:
        return scaling.row_product(K) == method
    finally:
        sizes.ROW_VECTOR_PRODUCTS, sizes.MATVEC_LOOP_SLICES = saved


def _median_us(call, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def measure(blocks=BLOCKS, threads=(1, 2), rounds: int = 5, repeats: int = 50) -> list[dict]:
    """Per block and thread count: the median over ``rounds`` of each method's median time (us)."""
    saved, before = (sizes.ROW_VECTOR_PRODUCTS, sizes.MATVEC_LOOP_SLICES), torch.get_num_threads()
    rows = []
    try:
        for n_threads in threads:
            torch.set_num_threads(n_threads)
            for c, r, m in blocks:
                g = torch.Generator().manual_seed(0)
                K = torch.rand(c, r, m, generator=g)
                x, add, u = torch.rand(c, m, 1, generator=g), torch.rand(c, r, 1, generator=g), torch.rand(c, 1, r)
                out, col = torch.empty(c, r, 1), torch.empty(c, 1, m)

                def rows_by(method):
                    def call():
                        sizes.ROW_VECTOR_PRODUCTS, sizes.MATVEC_LOOP_SLICES = METHODS[method]
                        scaling.add_rows_times(add, K, x, out)
                    return call

                calls = {method: rows_by(method) for method in METHODS if _takes(method, K)}
                calls["column sums"] = lambda: torch.bmm(u, K, out=col)
                times: dict[str, list[float]] = {name: [] for name in calls}
                for round_ in range(rounds):
                    for name in (list(calls) if round_ % 2 == 0 else list(calls)[::-1]):
                        calls[name]()
                        times[name].append(_median_us(calls[name], repeats))
                sizes.ROW_VECTOR_PRODUCTS, sizes.MATVEC_LOOP_SLICES = saved
                row = {"threads": n_threads, "c": c, "r": r, "m": m, "rounds": rounds, **dict.fromkeys(METHODS),
                       **{name: statistics.median(values) for name, values in times.items()}}
                row["library"] = scaling.row_product(K)
                row["fastest"] = min((method for method in METHODS if row[method] is not None), key=row.get)
                rows.append(row)
    finally:
        sizes.ROW_VECTOR_PRODUCTS, sizes.MATVEC_LOOP_SLICES = saved
        torch.set_num_threads(before)
    return rows


def render(rows: list[dict], meta: dict) -> str:
    lines = [f"Row sums `K x` of one cache block, `add_rows_times` forced to each product, beside the column sums "
             f"`uᵀK` of the same block; median over {meta['rounds']} interleaved rounds of each round's median, in µs. "
             f"Measured {meta['when']} on {meta['cpu']} (vendor {meta['vendor'] or 'unknown'}, MKL: {meta['mkl']}), "
             f"torch {meta['torch']}. Here the library picks: row-vector products {meta['row_vector']}, one product "
             f"per slice for blocks of 2 to {meta['loop_slices']} slices. –: a product `add_rows_times` never takes for "
             "that block (one slice is not multiplied per slice).", "",
             "| threads | block (c × r × m) | batched | per-slice | row-vector | column sums | library's | fastest |",
             "|---:|---|---:|---:|---:|---:|---|---|"]

    def us(value):
        return "–" if value is None else f"{value:.1f}"

    for r in rows:
        lines.append(f"| {r['threads']} | {r['c']} × {r['r']} × {r['m']} | {us(r['batched'])} | {us(r['per-slice'])} | "
                     f"{us(r['row-vector'])} | {us(r['column sums'])} | {r['library']} | {r['fastest']} |")
    slower = [r for r in rows if r[r["library"]] > 1.1 * r[r["fastest"]]]
    lines += ["", "Blocks where the library's product took more than 1.1× the fastest's: "
              + (", ".join(f"{r['c']} × {r['r']} × {r['m']} on {r['threads']} thread(s) ({r[r['library']]:.1f} against "
                           f"{r[r['fastest']]:.1f} µs, {r['fastest']})" for r in slower) or "none") + "."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks matvec", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="benchmark-results")
    args = parser.parse_args(argv)
    rows = measure(BLOCKS, rounds=args.rounds)
    meta = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
            "cpu": cpu_model(), "vendor": cpu_vendor(), "mkl": torch.backends.mkl.is_available(),
            "row_vector": sizes.ROW_VECTOR_PRODUCTS, "loop_slices": sizes.MATVEC_LOOP_SLICES, "rounds": args.rounds}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "matvec.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    text = render(rows, meta)
    (out / "matvec.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
