"""Which launch of the flash kernels runs fastest on this GPU: rows, columns, warps and stages per kernel.

    PYTHONPATH=src:. python -m benchmarks flash-tune --out DIR [--budget 420] [--dtypes bfloat16,float32]
    python -m benchmarks flash-tune --smoke --out /tmp/x   # CPU, Triton's interpreter, tiny sizes

:data:`sinkformer.sinkhorn.flash.GPU_CONFIGS` holds one launch per kernel, dtype and head dim. For each
dtype tuned, at d = 64, every candidate of :data:`CANDIDATES` replaces one kernel's launch (``sweep``:
the forward and the backward's matrix-vector and dV sweeps; ``dscore``: the dq and dk sweeps):

1. ``compile`` — every candidate's kernels in worker processes side by side (Triton's cache on disk
   then serves the later parts); a candidate that does not compile (shared memory, registers) is
   reported and never timed;
2. ``accuracy`` — forward and gradients against the dense engine in float64 on an edge shape (n = 1000,
   a multiple of no block), within the GPU check's tolerances; a candidate that fails is not timed;
3. ``sweep`` then ``dscore`` — forward+backward at b·h = 32, n = 4096, 5 iterations, in interleaved
   rounds: each round times the current launch and every candidate (the median of a few CUDA-event
   timings each), so each candidate's ratio to the current launch comes with its range over rounds.
   The ``dscore`` candidates run with the fastest ``sweep``;
4. ``sizes`` — the fastest of each kernel together against the current launch at every n and
   iteration count of :data:`SIZES`, interleaved the same way.

A candidate is "faster" only where every round's ratio is below 1. Nothing is changed in the library:
the report says which launch to write into ``GPU_CONFIGS``. Writes ``flash_tune.{json,md}``. On an
H200 (Triton 3.6), compiling took about 100 s for the 18 bfloat16 candidates and 145 s for the 16
float32 ones on 12 workers; the timing parts take about a minute per dtype.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

from benchmarks.gpu_check import TOLERANCE, Budget, accuracy_case, environment, make_inputs, workers

#: (block_r, block_c, num_warps, num_stages) per (dtype, kernel); the library's current launch is left out
#: where it is listed (the launches before the H200's tune are listed: another GPU may prefer them)
CANDIDATES = {
    ("bfloat16", "sweep"): [(128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3),
                            (64, 64, 4, 2), (64, 128, 4, 3), (128, 64, 4, 2), (128, 64, 4, 4), (256, 64, 8, 3)],
    ("bfloat16", "dscore"): [(64, 64, 4, 3), (128, 64, 8, 2), (128, 64, 4, 2), (64, 128, 4, 2), (128, 128, 8, 2),
                             (64, 32, 4, 2), (32, 64, 4, 2), (128, 32, 4, 2), (64, 64, 4, 2)],
    ("float32", "sweep"): [(64, 64, 4, 2), (128, 32, 4, 2), (128, 64, 8, 2), (64, 32, 8, 2), (64, 64, 8, 2),
                           (128, 32, 8, 2), (32, 32, 4, 2), (64, 32, 4, 3), (128, 128, 8, 1), (64, 32, 4, 2)],
    ("float32", "dscore"): [(64, 64, 4, 2), (128, 32, 8, 2), (64, 32, 8, 2), (32, 32, 4, 2), (32, 64, 4, 2),
                            (128, 64, 8, 1), (64, 64, 8, 2), (64, 32, 4, 2)],
}
#: the interpreter's candidates (the smoke run): blocks only, warps and stages mean nothing there
SMOKE_CANDIDATES = {("float32", "sweep"): [(16, 32, 4, 2)], ("float32", "dscore"): [(16, 16, 4, 2)]}
#: (n, n_iters) of the last part, per dtype (float32 at n = 16384 takes seconds a call)
SIZES = {"bfloat16": [(1024, 3), (1024, 5), (4096, 3), (4096, 5), (16384, 5)],
         "float32": [(1024, 5), (4096, 3), (4096, 5)]}
FULL = dict(b=4, h=8, d=64, n=4096, n_iters=5, edge_n=1000, rounds=3, repeats=5, sizes=SIZES, h_edge=2)
SMOKE = dict(b=1, h=2, d=16, n=40, n_iters=3, edge_n=37, rounds=2, repeats=1,
             sizes={"float32": [(40, 3)]}, h_edge=1)
KERNELS = ("sweep", "dscore")


@contextlib.contextmanager
def launches(dtype_name: str, d: int, interpreted: bool, **configs: tuple):
    """Run with ``GPU_CONFIGS[(dtype, d)]`` (the interpreter's table when ``interpreted``) changed for
    the kernels named, e.g. ``sweep=(128, 64, 8, 3)``; the table is put back on exit."""
    import torch

    from sinkformer.sinkhorn import flash

    table = flash.launch_config(getattr(torch, dtype_name), d, d, interpreted)
    saved = dict(table)
    try:
        table.update({kernel: flash.LaunchConfig(*cfg) for kernel, cfg in configs.items()})
        yield table
    finally:
        table.clear()
        table.update(saved)


def current(dtype_name: str, d: int, interpreted: bool) -> dict[str, tuple]:
    """The library's launch of each tuned kernel, as ``(block_r, block_c, num_warps, num_stages)``."""
    import dataclasses

    import torch

    from sinkformer.sinkhorn import flash

    table = flash.launch_config(getattr(torch, dtype_name), d, d, interpreted)
    return {kernel: dataclasses.astuple(table[kernel]) for kernel in KERNELS}


def candidates(cfg: dict, dtypes: list[str], smoke: bool) -> list[tuple[str, str, tuple]]:
    """``(dtype, kernel, launch)`` of every candidate, the current launches left out."""
    table = SMOKE_CANDIDATES if smoke else CANDIDATES
    out = []
    for dtype_name in dtypes:
        now = current(dtype_name, cfg["d"], smoke)
        out += [(dtype_name, kernel, launch) for kernel in KERNELS
                for launch in table.get((dtype_name, kernel), []) if launch != now[kernel]]
    return out


# ----------------------------------------------------------------------------- one candidate


def _inputs(cfg: dict, device: str, dtype_name: str, n: int):
    import torch

    gen = torch.Generator(device=device).manual_seed(0)
    shape = (cfg["b"], cfg["h"], n, cfg["d"])
    dtype = getattr(torch, dtype_name)
    q, k, v = (torch.randn(shape, generator=gen, device=device, dtype=dtype).requires_grad_() for _ in range(3))
    return q, k, v, torch.randn(shape, generator=gen, device=device, dtype=dtype)


def _step(q, k, v, grad, n_iters: int) -> None:
    """One forward+backward of the flash engine."""
    import torch

    import sinkformer

    out = sinkformer.attention(q, k, v, n_iters=n_iters, backend="flash")
    torch.autograd.grad(out, (q, k, v), grad)


def _check(cfg: dict, device: str, dtype_name: str) -> dict:
    """Forward and gradients of the flash engine against the dense engine in float64 (edge shape)."""
    q, k, v, kw = make_inputs(dict(cfg, h=cfg["h_edge"]), device, n=cfg["edge_n"], padding=True)
    return accuracy_case("edge", dtype_name, q, k, v, kw, cfg["n_iters"], device)


def _compile_candidate(task: tuple) -> tuple[int, str | None]:
    """In a worker process: every kernel one candidate compiles (edge check, timing shapes and
    iteration counts), so that its later parts load them from Triton's cache; ``(index, error)``."""
    cfg, device, index, (dtype_name, kernel, launch) = task
    import torch

    try:
        with launches(dtype_name, cfg["d"], device == "cpu", **{kernel: launch}):
            _check(cfg, device, dtype_name)
            for n, n_iters in sorted(set(cfg["sizes"][dtype_name])):
                q, k, v, grad = _inputs(dict(cfg, b=1, h=1), device, dtype_name, n)
                _step(q, k, v, grad, n_iters)
            if device == "cuda":
                torch.cuda.synchronize()
        return index, None
    except Exception as err:  # noqa: BLE001 — recorded: the candidate is reported, not timed
        return index, f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}"


def compile_all(cfg: dict, device: str, tasks: list[tuple], budget: Budget) -> dict[int, str]:
    """:func:`_compile_candidate` for every task in worker processes; ``{index: error}`` of those that
    failed or were not reached within the budget."""
    import multiprocessing
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    errors, index_of = {}, {}
    pool = ProcessPoolExecutor(workers(device), mp_context=multiprocessing.get_context("spawn"))
    try:
        index_of = {pool.submit(_compile_candidate, (cfg, device, i, t)): i for i, t in enumerate(tasks)}
        pending = set(index_of)
        while pending:
            done, pending = wait(pending, timeout=max(0.0, budget.deadline - time.perf_counter()),
                                 return_when=FIRST_COMPLETED)
            if not done:
                break
            for future in done:
                try:
                    error = future.result()[1]
                except Exception as err:  # noqa: BLE001 — a worker died (a crash, the out-of-memory killer)
                    error = f"its worker died: {type(err).__name__}"
                if error is not None:
                    errors[index_of[future]] = error
        for future in pending:
            errors[index_of[future]] = "not compiled within the budget"
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        for child in multiprocessing.active_children():  # the workers still compiling
            child.kill()
        pool.shutdown(wait=True)
    return errors


# ----------------------------------------------------------------------------- timing


def _median_ms(step, repeats: int, device: str) -> float:
    """Median of ``repeats`` timings of ``step`` (CUDA events on a GPU) after one warm-up call."""
    from benchmarks.attention_cuda import Clock

    clock = Clock(device)
    step()
    return statistics.median(clock(step) for _ in range(repeats))


def interleaved(cfg: dict, device: str, dtype_name: str, n: int, n_iters: int, variants: dict[str, dict],
                budget: Budget) -> dict[str, dict]:
    """Forward+backward ms of each variant (``name -> launches``) in ``cfg["rounds"]`` interleaved
    rounds; each variant's ratio to the first one, per round. Rounds stop at the budget (at least one)."""
    q, k, v, grad = _inputs(cfg, device, dtype_name, n)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(cfg["rounds"]):
        if r and budget.over():
            break
        for name, configs in variants.items():
            with launches(dtype_name, cfg["d"], device == "cpu", **configs):
                times[name].append(_median_ms(lambda: _step(q, k, v, grad, n_iters), cfg["repeats"], device))
    base = times[next(iter(variants))]
    return {name: dict(ms=statistics.median(t), ratios=[x / b for x, b in zip(t, base)]) for name, t in times.items()}


def _label(launch: tuple) -> str:
    return "{}x{}, {} warps, {} stages".format(*launch)


def tune_kernel(cfg: dict, device: str, dtype_name: str, kernel: str, fixed: dict, options: list[tuple],
                budget: Budget) -> list[dict]:
    """Rows of one kernel's candidates (``options``, the current launch first) with the other kernel at
    ``fixed``: ratio to the current launch over interleaved rounds."""
    variants = {_label(o): dict(fixed, **{kernel: o}) for o in options}
    timed = interleaved(cfg, device, dtype_name, cfg["n"], cfg["n_iters"], variants, budget)
    rows = []
    for launch in options:
        t = timed[_label(launch)]
        rows.append(dict(dtype=dtype_name, kernel=kernel, launch=list(launch), ms=t["ms"], ratios=t["ratios"],
                         ratio=statistics.median(t["ratios"]), faster=all(x < 1 for x in t["ratios"])))
    return rows


def fastest(rows: list[dict], now: tuple) -> tuple:
    """The launch faster than the current one in every round with the lowest median ratio, else the current."""
    better = [r for r in rows if r["faster"] and tuple(r["launch"]) != now]
    return tuple(min(better, key=lambda r: r["ratio"])["launch"]) if better else now


# ----------------------------------------------------------------------------- the run


#: share of the budget of each part: the compilation, then per dtype each kernel's rounds and the sizes
SHARES = dict(compile=0.6, sweep=0.1, dscore=0.1, sizes=0.05)


def run(cfg: dict, device: str, dtypes: list[str], budget_s: float, smoke: bool, command: str = "") -> dict:
    from benchmarks.gpu_check import ROOT
    from sinkformer.provenance import git_commit

    budget = Budget(budget_s)
    plan = ["compile"] + [part for _ in dtypes for part in ("sweep", "dscore", "sizes")]

    def begin_next() -> None:  # the next part of the plan gets its share of what is left
        share = SHARES[plan.pop(0)]
        budget.begin(share, share + sum(SHARES[p] for p in plan))

    report = dict(smoke=smoke, command=command, commit=git_commit(ROOT), environment=environment(device),
                  current={}, best={}, candidates=[], kernels=[],
                  sizes=[], parts={}, shape={key: cfg[key] for key in ("b", "h", "d", "n", "n_iters")})
    tasks = candidates(cfg, dtypes, smoke)
    start = time.perf_counter()
    begin_next()
    errors = compile_all(cfg, device, tasks, budget)
    report["parts"]["compile"] = dict(seconds=round(time.perf_counter() - start, 1), tasks=len(tasks),
                                      errors=len(errors))
    print(f"compiled {len(tasks)} candidates in {report['parts']['compile']['seconds']} s, {len(errors)} failed",
          flush=True)
    for i, (dtype_name, kernel, launch) in enumerate(tasks):
        row = dict(dtype=dtype_name, kernel=kernel, launch=list(launch))
        if i in errors:
            row["status"] = f"does not run: {errors[i]}"
        else:
            try:
                with launches(dtype_name, cfg["d"], smoke, **{kernel: launch}):
                    check = _check(cfg, device, dtype_name)
                row.update({key: check.get(key) for key in ("forward", "dq", "dk", "dv")}, status=check["status"])
            except Exception as err:  # noqa: BLE001 — compiled in a worker, but does not launch here
                row["status"] = f"does not run: {type(err).__name__}: {str(err)[:300]}"
        report["candidates"].append(row)
        print(f"  {dtype_name:>8} {kernel:<6} {_label(launch):<28} {row['status'][:90]}", flush=True)
    ok = {(r["dtype"], r["kernel"], tuple(r["launch"])) for r in report["candidates"] if r["status"] == "pass"}
    for dtype_name in dtypes:
        now = current(dtype_name, cfg["d"], smoke)
        report["current"][dtype_name] = {kernel: list(launch) for kernel, launch in now.items()}
        best = dict(now)
        for kernel in KERNELS:
            begin_next()
            options = [now[kernel]] + [t[2] for t in tasks if t[:2] == (dtype_name, kernel) and t in ok]
            rows = tune_kernel(cfg, device, dtype_name, kernel, {x: best[x] for x in KERNELS if x != kernel},
                               options, budget)
            report["kernels"] += rows
            best[kernel] = fastest(rows, now[kernel])
            for r in rows:
                print(f"  {dtype_name:>8} {kernel:<6} {_label(tuple(r['launch'])):<28} {r['ms']:9.3f} ms  "
                      f"x{r['ratio']:.3f} ({min(r['ratios']):.3f}-{max(r['ratios']):.3f})", flush=True)
        report["best"][dtype_name] = {x: list(best[x]) for x in KERNELS}
        begin_next()
        if best == now:
            continue
        for n, n_iters in cfg["sizes"][dtype_name]:
            if budget.over():
                report["sizes"].append(dict(dtype=dtype_name, n=n, n_iters=n_iters, status="over the budget"))
                continue
            timed = interleaved(cfg, device, dtype_name, n, n_iters, dict(current=now, best=best), budget)
            report["sizes"].append(dict(dtype=dtype_name, n=n, n_iters=n_iters, status="ok",
                                        current_ms=timed["current"]["ms"], best_ms=timed["best"]["ms"],
                                        ratios=timed["best"]["ratios"]))
            print(f"  {dtype_name:>8} n={n:>5} iters={n_iters}: current {timed['current']['ms']:.3f} ms, "
                  f"best {timed['best']['ms']:.3f} ms, x{statistics.median(timed['best']['ratios']):.3f}", flush=True)
    report["parts"]["total_s"] = round(time.perf_counter() - start, 1)
    return report


def markdown(report: dict) -> str:
    env = report["environment"]
    s = report["shape"]
    lines = [f"# Flash launches on {env.get('gpu')}", "",
             f"{env.get('date')} · torch {env.get('torch')} · Triton {env.get('triton')}. Timed: forward+backward, "
             f"b={s['b']}, h={s['h']}, n={s['n']}, d={s['d']}, {s['n_iters']} iterations; ratio to the current "
             "launch, the median over interleaved rounds (range); 'faster' only where every round is below 1.", "",
             f"Written by `{report['command']}` at commit {report['commit']}.", ""]
    lines += ["## Candidates checked", "", "| dtype | kernel | launch | forward | dq | dk | dv | status |",
              "|---|---|---|---:|---:|---:|---:|---|"]
    for r in report["candidates"]:
        errs = [f"{r[k]:.1e}" if isinstance(r.get(k), float) else "" for k in ("forward", "dq", "dk", "dv")]
        lines.append(f"| {r['dtype']} | {r['kernel']} | {_label(tuple(r['launch']))} | {' | '.join(errs)} | "
                     f"{r['status']} |")
    lines += ["", "## Time per kernel's launch", "", "| dtype | kernel | launch | ms | ratio | range | faster |",
              "|---|---|---|---:|---:|---|---|"]
    for r in report["kernels"]:
        now = tuple(report["current"][r["dtype"]][r["kernel"]]) == tuple(r["launch"])
        lines.append(f"| {r['dtype']} | {r['kernel']} | {_label(tuple(r['launch']))}{' (current)' if now else ''} | "
                     f"{r['ms']:.3f} | {r['ratio']:.3f} | {min(r['ratios']):.3f}–{max(r['ratios']):.3f} | "
                     f"{'yes' if r['faster'] else ''} |")
    lines += ["", "## The fastest launches together, at every size", ""]
    for dtype_name, best in report["best"].items():
        now = report["current"][dtype_name]
        same = best == now
        lines.append(f"- {dtype_name}: " + ("the current launches (no candidate faster in every round)" if same else
                     ", ".join(f"{k} {_label(tuple(best[k]))} (now {_label(tuple(now[k]))})" for k in KERNELS)))
    rows = report["sizes"]
    if rows:
        lines += ["", "| dtype | n | n_iters | current ms | best ms | ratio | range |",
                  "|---|---:|---:|---:|---:|---:|---|"]
        for r in rows:
            if r["status"] != "ok":
                lines.append(f"| {r['dtype']} | {r['n']} | {r['n_iters']} | {r['status']} | | | |")
                continue
            lines.append(f"| {r['dtype']} | {r['n']} | {r['n_iters']} | {r['current_ms']:.3f} | {r['best_ms']:.3f} | "
                         f"{statistics.median(r['ratios']):.3f} | {min(r['ratios']):.3f}–{max(r['ratios']):.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks flash-tune", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmark-results", help="folder for flash_tune.{json,md}")
    parser.add_argument("--budget", type=float, default=420.0, help="seconds for all parts (default 420)")
    parser.add_argument("--dtypes", default="bfloat16,float32", help="comma-separated dtypes to tune")
    parser.add_argument("--smoke", action="store_true", help="the same code path on the CPU (Triton's interpreter)")
    args = parser.parse_args(argv)
    import os

    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("flash-tune needs a CUDA GPU (or --smoke for the CPU code path)")
    dtypes = ["float32"] if args.smoke else [d for d in args.dtypes.split(",") if d]
    bad = [d for d in dtypes if d not in TOLERANCE or (not args.smoke and d not in SIZES)]
    if bad:
        parser.error(f"--dtypes takes names among {', '.join(SIZES)}; got {', '.join(bad)}")
    given = sys.argv[1:] if argv is None else argv
    command = shlex.join(["python", "-m", "benchmarks", "flash-tune", *given])
    report = run(SMOKE if args.smoke else FULL, device, dtypes, args.budget, args.smoke, command)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "flash_tune.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "flash_tune.md").write_text(markdown(report))
    print(markdown(report))
    print(f"wrote {out / 'flash_tune.json'} and {out / 'flash_tune.md'}")
    return 0
