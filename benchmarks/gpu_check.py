"""The GPU check of the flash engine: one command, run unchanged by whoever has an NVIDIA GPU.

    PYTHONPATH=src:. python -m benchmarks gpu-check --out DIR      # about 7 minutes on an H100
    PYTHONPATH=src:. python -m benchmarks gpu-check --smoke --out DIR   # the same code path on the CPU

Needs only PyTorch (CUDA build), Triton, numpy, einops and pytest; installs nothing. Its parts run in
order of importance, each within its share of the time budget (``--budget``, seconds; a part
checks the clock before each item and records what it left out), each guarded so that a failure is
recorded and the next part still runs:

1. ``environment`` — GPU name, driver, CUDA, torch and Triton versions, multiprocessors, memory;
2. ``compile`` — the flash calls of every accuracy case, in worker processes side by side: Triton
   compiles each kernel specialisation once per machine (its cache on disk, a second or two each, on
   the host's cores), so the parts after this one find their kernels compiled;
3. ``accuracy-target`` — forward and gradients of every dtype (bf16, fp16, fp32; fp64 where flash
   serves it) against the dense engine in float64 on the GPU at the target shape (n = 4096, d = 64);
4. ``benchmark-targets`` — the rows the targets read: bf16 at n = 1024/4096/16384 (SDPA-flash,
   flash with n_iters 3 and 5, the paper's official algorithm at n = 1024);
5. ``cuda-tests`` — ``pytest -k cuda`` on the flash tests (compiled kernels, CUDA-only cells);
6. ``accuracy-edges`` — n not a multiple of the block, n_q != n_k, key and query padding, fully
   masked rows, d in {32, 64, 80, 128, 256}, a non-contiguous input, a tensor on a non-current device
   (with two GPUs);
7. ``graph`` — forward+backward captured in a CUDA graph: replays equal eager calls, time per call;
8. ``benchmark`` — the rest of the grid of :mod:`benchmarks.attention_cuda` (bf16 and fp32; n in
   {1024, 4096, 16384}; n_iters 1, 3, 5, 21; SDPA-flash, the official algorithm, every engine that
   serves CUDA), with peak memory;
9. ``offset-probe`` — last, in a subprocess: a full boolean mask with n·m > 2^31 entries gives the
   same output and gradients as the same mask broadcast (offsets past 2^31 would read elsewhere).

``--parts`` runs some parts only (the report lists the others as not run). Writes
``attention_cuda.json`` and ``attention_cuda.md`` to ``--out`` (commit them as
``benchmarks/results/attention_cuda.{json,md}``: ``docs/speed.md`` includes the markdown) and prints a
summary last. Exit status 1 when a part failed or raised, else 0 (parts left out by the budget say so).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import math
import multiprocessing
import os
import platform
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: (part, share of the budget) in the order they run. Each part gets its share of what is left when it starts, so
#: what a part leaves goes to those after it. The H200 check at 5a15873 (benchmarks/results/attention_cuda.json):
#: the CUDA tests stopped half-way at 78 s (the float32 launches of b787ea1 compile longer; alone they ran in
#: 122 s), while the graph and the offset probe, last, used 0.1 of 25 s and 9.5 of 42 s
PARTS = [("environment", 0.01), ("compile", 0.15), ("accuracy-target", 0.08), ("benchmark-targets", 0.08),
         ("cuda-tests", 0.24), ("accuracy-edges", 0.12), ("graph", 0.02), ("benchmark", 0.25), ("offset-probe", 0.05)]
#: forward and gradient tolerance, relative (Frobenius), by dtype: the issue's targets for bf16 and fp32
TOLERANCE = {"bfloat16": (1e-2, 5e-2), "float16": (5e-3, 2e-2), "float32": (1e-5, 1e-4), "float64": (1e-10, 1e-8)}
DTYPES = ["bfloat16", "float16", "float32", "float64"]

FULL = dict(b=4, h=8, d=64, n=4096, edge_n=1000, edge_m=777, heads_edge=2, probe_n=46400, graph_n=1024, repeats=10,
            seconds=0.5, ns=[1024, 4096, 16384], iters=[1, 3, 5, 21], dims=[32, 64, 80, 128, 256], dtypes=DTYPES,
            target_iters=(3, 5), dims_dtypes=("bfloat16", "float32"))
#: the same parts on the CPU under Triton's interpreter: tiny sizes, fewer cells (bfloat16 only where
#: the target is; the interpreter's half-precision products are checked by the flash tests instead)
SMOKE = dict(b=1, h=2, d=16, n=40, edge_n=37, edge_m=29, heads_edge=1, probe_n=40, graph_n=40, repeats=1,
             seconds=0.0, ns=[40], iters=[3], dims=[24], dtypes=["bfloat16", "float32", "float64"], target_iters=(3,),
             dims_dtypes=("float32",))


class Budget:
    """The check's clock: each part gets its share of what is left when it starts."""

    def __init__(self, seconds: float):
        self.start, self.total = time.perf_counter(), seconds
        self.deadline = self.start

    def begin(self, share: float, shares_left: float) -> float:
        left = self.total - (time.perf_counter() - self.start)
        self.deadline = time.perf_counter() + max(0.0, left) * share / shares_left
        return self.deadline - time.perf_counter()

    def over(self) -> bool:
        return time.perf_counter() > self.deadline


# ----------------------------------------------------------------------------- parts


def environment(device: str) -> dict:
    import torch

    env = dict(torch=torch.__version__, cuda=torch.version.cuda, python=platform.python_version(),
               host=platform.node(), date=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = "not installed"
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, capability=f"{props.major}.{props.minor}", multiprocessors=props.multi_processor_count,
                   memory_gib=round(props.total_memory / 2**30, 1), devices=torch.cuda.device_count())
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30)
            env["driver"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 else "nvidia-smi failed"
        except (OSError, subprocess.TimeoutExpired, IndexError):
            env["driver"] = "unknown (no nvidia-smi)"
    else:
        env.update(gpu="none (smoke run: CPU, Triton's interpreter)", driver="none", devices=0)
    from sinkformer.sinkhorn import flash

    env["flash"] = {dtype: flash.unavailable(device, getattr(torch, dtype), 64, 64) or "served" for dtype in DTYPES}
    return env


def relative_error(got, want) -> float:
    """``||got - want|| / ||want||`` (Frobenius, float64); inf where ``got`` is not finite."""
    import torch

    got, want = got.double(), want.double()
    if not bool(torch.isfinite(got).all()):
        return math.inf
    return ((got - want).norm() / want.norm().clamp_min(1e-300)).item()


def make_inputs(cfg: dict, device: str, *, n: int, m: int | None = None, d: int | None = None, heads: int | None = None,
                padding: bool = False, masked_rows: bool = False, noncontiguous: bool = False, seed: int = 0):
    """float64 ``q, k, v`` ``(b, h, n, d)`` and mask keywords of one accuracy case."""
    import torch

    m, d = n if m is None else m, cfg["d"] if d is None else d
    b, h = 1, cfg["h"] if heads is None else heads
    gen = torch.Generator(device=device).manual_seed(seed)
    draw = lambda *shape: torch.randn(*shape, generator=gen, device=device, dtype=torch.float64)  # noqa: E731
    if noncontiguous:  # (b, n, h, d) viewed as (b, h, n, d), as after a head split without a copy
        q, k, v = (draw(b, s, h, d).transpose(1, 2) for s in (n, m, m))
    else:
        q, k, v = draw(b, h, n, d), draw(b, h, m, d), draw(b, h, m, d)
    kw = {}
    if padding:
        kpad = torch.zeros(b, m, dtype=torch.bool, device=device)
        kpad[:, -max(1, m // 9):] = True
        qpad = torch.zeros(b, n, dtype=torch.bool, device=device)
        qpad[:, : max(1, n // 13)] = True
        kw.update(key_padding_mask=kpad, query_padding_mask=qpad)
    if masked_rows:
        keep = torch.rand(b, h, n, m, generator=gen, device=device) > 0.3
        keep[..., 1, :] = False  # a fully masked row
        keep[..., :, 2] = False  # and a fully masked column
        kw["attn_mask"] = keep
    return q, k, v, kw


def accuracy_case(name: str, dtype_name: str, q, k, v, kw: dict, n_iters: int, device: str) -> dict:
    """Forward and gradients of ``backend="flash"`` in ``dtype`` against the dense engine in float64
    (on the same device); a dtype flash refuses records the refusal and what ``auto`` runs instead."""
    import torch

    import sinkformer

    from sinkformer.sinkhorn.flash import unavailable

    dtype = getattr(torch, dtype_name)
    row = dict(case=name, dtype=dtype_name, n_iters=n_iters, n=q.shape[-2], m=k.shape[-2], d=q.shape[-1],
               device=str(q.device))
    mine = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    choice = sinkformer.attention.explain(*mine, n_iters=n_iters, **kw)
    row["auto"] = f"{choice.engine}: {choice.reason}"
    why = unavailable(q.device.type, dtype, q.shape[-1], v.shape[-1])
    if why is not None:  # refused by name: auto must have gone elsewhere
        row["status"] = f"refused by flash ({why})" if choice.engine != "flash" else f"FAIL: auto picks flash ({why})"
        return row
    ref_in = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    want = sinkformer.attention(*ref_in, n_iters=n_iters, backend="dense", **kw)
    gen = torch.Generator(device=q.device).manual_seed(1)
    grad = torch.randn(want.shape, generator=gen, device=q.device, dtype=torch.float64)
    ref_grads = torch.autograd.grad(want, ref_in, grad)
    out = sinkformer.attention(*mine, n_iters=n_iters, backend="flash", **kw)
    grads = torch.autograd.grad(out, mine, grad.to(dtype))
    row["forward"] = relative_error(out, want)
    for name_, got, ref in zip(("dq", "dk", "dv"), grads, ref_grads):
        row[name_] = relative_error(got, ref)
    fwd_tol, grad_tol = TOLERANCE[dtype_name]
    ok = row["forward"] <= fwd_tol and all(row[g] <= grad_tol for g in ("dq", "dk", "dv"))
    row["status"] = "pass" if ok else "FAIL"
    return row


def accuracy(cfg: dict, device: str, budget: Budget, cases: list[tuple]) -> list[dict]:
    rows = []
    for name, dtype_name, n_iters, shape in cases:
        if budget.over():
            rows.append(dict(case=name, dtype=dtype_name, n_iters=n_iters, status="skipped: over the time budget"))
            continue
        try:
            inputs = make_inputs(cfg, shape.pop("device", device), **shape)
            rows.append(accuracy_case(name, dtype_name, *inputs, n_iters, device))
        except Exception as err:
            rows.append(dict(case=name, dtype=dtype_name, n_iters=n_iters, status=f"ERROR: {_short(err)}"))
        print("  " + _accuracy_text(rows[-1]), flush=True)
    return rows


def target_cases(cfg: dict) -> list[tuple]:
    return [("target", dtype, n_iters, dict(n=cfg["n"])) for dtype in cfg["dtypes"] for n_iters in cfg["target_iters"]]


def edge_cases(cfg: dict, device: str) -> list[tuple]:
    import torch

    n, m = cfg["edge_n"], cfg["edge_m"]
    heads = cfg["heads_edge"]
    out = []
    for dtype in cfg["dtypes"]:
        out += [("n not a multiple of the block", dtype, 5, dict(n=n, heads=heads)),
                ("n_q != n_k, padding", dtype, 4, dict(n=n, m=m, heads=heads, padding=True)),
                ("fully masked rows and columns", dtype, 3, dict(n=n, heads=heads, masked_rows=True))]
    for dtype in cfg["dims_dtypes"]:
        out += [(f"d = {d}", dtype, 5, dict(n=n, d=d, heads=heads)) for d in cfg["dims"]]
        out.append(("non-contiguous q, k, v", dtype, 5, dict(n=n, heads=heads, noncontiguous=True)))
    if device == "cuda" and torch.cuda.device_count() > 1:
        out.append(("tensors on cuda:1 (current device cuda:0)", "bfloat16", 5, dict(n=n, heads=heads,
                                                                                     device="cuda:1")))
    return out


def workers(device: str) -> int:
    """Processes that compile or test side by side: the cores this process may use less two, at most 12
    (two on the CPU)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 4
    return 2 if device != "cuda" else max(1, min(12, cores - 2))


def _compile_case(task: tuple) -> tuple[int, str | None, float]:
    """One accuracy case's flash call, forward and backward, in a worker process (:func:`compile_ahead`):
    ``(index, error or None, seconds)``."""
    cfg, device, index = task
    import torch

    import sinkformer
    from sinkformer.sinkhorn.flash import unavailable

    start = time.perf_counter()
    name, dtype_name, n_iters, shape = (target_cases(cfg) + edge_cases(cfg, device))[index]
    try:
        q, k, v, kw = make_inputs(cfg, shape.pop("device", device), **shape)
        dtype = getattr(torch, dtype_name)
        if unavailable(q.device.type, dtype, q.shape[-1], v.shape[-1]) is None:
            mine = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
            out = sinkformer.attention(*mine, n_iters=n_iters, backend="flash", **kw)
            torch.autograd.grad(out, mine, torch.ones_like(out))
            if q.is_cuda:
                torch.cuda.synchronize(q.device)
        return index, None, time.perf_counter() - start
    except Exception as err:  # recorded here; the accuracy parts run the case again and record their own
        return index, _short(err), time.perf_counter() - start


def compile_ahead(cfg: dict, device: str, budget: Budget, work=_compile_case) -> dict:
    """The flash calls of every accuracy case in :func:`workers` processes side by side, within the
    part's budget: they fill Triton's cache on disk, from which the later parts load their kernels
    (the same shapes, dtypes and masks: the same specialisations). Nothing here is a result: errors
    are recorded and the accuracy parts run each case again. A worker that dies (a crash, the
    out-of-memory killer) ends the part, saying so; at the deadline the workers are killed. ``work``:
    what a worker runs per case (a module-level function of the task ``(cfg, device, index)``)."""
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
    from concurrent.futures.process import BrokenProcessPool

    tasks = [(cfg, device, i) for i in range(len(target_cases(cfg) + edge_cases(cfg, device)))]
    count = workers(device)
    start, done, errors, stop = time.perf_counter(), 0, [], None
    pool = ProcessPoolExecutor(count, mp_context=multiprocessing.get_context("spawn"))  # CUDA cannot be forked
    try:
        pending = {pool.submit(work, task) for task in tasks}
        while pending and stop is None:
            finished, pending = wait(pending, timeout=max(0.0, budget.deadline - time.perf_counter()),
                                     return_when=FIRST_COMPLETED)
            if not finished:
                stop = f"stopped at its budget: {done} of {len(tasks)} cases"
            for future in finished:
                try:
                    index, error, _ = future.result()
                except BrokenProcessPool:
                    stop = f"a worker died: {done} of {len(tasks)} cases"
                    break
                done += 1
                if error is not None:
                    errors.append(f"case {index}: {error}")
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        for child in multiprocessing.active_children():  # the workers still running (this program has no others)
            child.kill()
        pool.shutdown(wait=True)
    status = (stop or f"ok ({done} cases)") + (f", {len(errors)} raised" if errors else "")
    return dict(status=status, cases=len(tasks), done=done, workers=count,
                seconds=round(time.perf_counter() - start, 1), errors=errors)


#: a test's line in pytest's verbose output (plain, or under pytest-xdist), and its outcome
_OUTCOME = r"\b(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b"
_TEST_LINE = re.compile(rf"::.*{_OUTCOME}|{_OUTCOME}.*::")
#: where pytest's short summary starts: its lines repeat the outcomes of the verbose ones
_SUMMARY_START = "short test summary info"


def pytest_outcomes(lines: list[str]) -> list[tuple[str, str]]:
    """``(line, outcome)`` of each test line of pytest's verbose output, before its short summary."""
    end = next((i for i, line in enumerate(lines) if _SUMMARY_START in line), len(lines))
    found = ((line, _TEST_LINE.search(line)) for line in lines[:end])
    return [(line, next(g for g in m.groups() if g)) for line, m in found if m]


def cuda_tests(device: str, budget: Budget) -> dict:
    """``pytest -k cuda`` on the flash tests, in a subprocess (its own output, its own failures), in
    pytest-xdist workers where that is installed; stopped at the part's budget, with the tests run
    so far counted. The subprocess runs in its own process group, ended whenever this part ends."""
    import importlib.util

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    if device != "cuda":
        env.pop("TRITON_INTERPRET", None)  # (smoke run: collected and skipped, as on a machine without CUDA)
    cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-k", "cuda",
           str(ROOT / "tests" / "sinkhorn" / "test_flash_engine.py")]
    if device == "cuda" and importlib.util.find_spec("xdist") is not None:
        cmd[4:4] = ["-n", str(workers(device))]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env,
                            start_new_session=True)  # its own process group: a stop ends its workers too
    try:
        output, stopped = proc.communicate(timeout=max(1.0, budget.deadline - time.perf_counter()))[0], False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, stopped = proc.communicate()[0], True
    finally:  # an interrupt of the check (Ctrl-C, a kill of its group) does not reach this group: end it here
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    lines = output.strip().splitlines()
    tests = pytest_outcomes(lines)
    outcomes = [outcome for _, outcome in tests]
    counts = {word.lower(): outcomes.count(word) for word in ("PASSED", "FAILED", "ERROR", "SKIPPED")
              if word in outcomes}
    summary = next((line for line in reversed(lines) if re.search(r"\d+ (passed|failed|skipped|error)", line)), "")
    ran = ", ".join(f"{n} {word}" for word, n in counts.items()) or "none finished"
    if stopped:
        summary = f"stopped at its budget after {time.perf_counter() - start:.0f} s: {ran}"
    failed = bool(counts.get("failed", 0) + counts.get("error", 0)) or (not stopped and proc.returncode not in (0, 5))
    status = ("FAIL" if failed else "incomplete" if stopped else
              "pass" if proc.returncode == 0 or device != "cuda" and proc.returncode == 5 else "FAIL")
    failures = [line for line, outcome in tests if outcome in ("FAILED", "ERROR")]
    return dict(command=" ".join(cmd[1:]), returncode=proc.returncode, summary=summary.strip("= "), counts=counts,
                seconds=round(time.perf_counter() - start, 1), failures=failures[:20], tail=lines[-40:],
                status=status)


def graph_capture(cfg: dict, device: str) -> dict:
    """Forward+backward of flash (bf16, 5 iterations) captured once in a CUDA graph: replays give the
    eager results; times per call, eager and replayed, next to the official algorithm's."""
    import torch

    import sinkformer
    from benchmarks.attention_cuda import official_sinkformers

    if device != "cuda":
        return dict(status="skipped: CUDA graphs need a GPU (smoke run)")
    n, b, h, d = cfg["graph_n"], cfg["b"], cfg["h"], cfg["d"]
    gen = torch.Generator(device=device).manual_seed(3)
    q, k, v = (torch.randn(b, h, n, d, generator=gen, device=device, dtype=torch.bfloat16).requires_grad_()
               for _ in range(3))
    grad = torch.randn(b, h, n, d, generator=gen, device=device, dtype=torch.bfloat16)

    def step():
        out = sinkformer.attention(q, k, v, n_iters=5, backend="flash")
        return (out,) + torch.autograd.grad(out, (q, k, v), grad)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    eager = step()
    torch.cuda.synchronize()
    diffs = [relative_error(a, bb) for a, bb in zip(captured, eager)]
    row = dict(n=n, b=b, h=h, d=d, dtype="bfloat16", n_iters=5, replay_vs_eager=max(diffs))
    row["eager_ms"] = _median_ms(step, cfg)
    row["replay_ms"] = _median_ms(graph.replay, cfg)

    def official():
        out = official_sinkformers(q, k, v, 5)
        return torch.autograd.grad(out, (q, k, v), grad)

    row["official_ms"] = _median_ms(official, cfg)
    row["official_over_replay"] = row["official_ms"] / row["replay_ms"]
    row["status"] = "pass" if row["replay_vs_eager"] <= 1e-6 else "FAIL"
    return row


def _median_ms(fn, cfg: dict) -> float:
    import torch

    fn()
    times = []
    for _ in range(max(3, cfg["repeats"])):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(begin.elapsed_time(end))
    return statistics.median(times)


def benchmark(cfg: dict, device: str, budget: Budget, grid: list[tuple], rows: list[dict]) -> None:
    """Rows of :func:`benchmarks.attention_cuda.measure` for ``grid``, ``(method, n, n_iters, dtype)``,
    appended to ``rows`` (a row left out by the budget says so)."""
    from benchmarks.attention_cuda import _row_text, measure

    bench_cfg = dict(b=cfg["b"], h=cfg["h"], d=cfg["d"], repeats=cfg["repeats"], seconds=cfg["seconds"])
    done = {(r["method"], r["n"], r["n_iters"], r["dtype"]) for r in rows}
    for method, n, n_iters, dtype in grid:
        if (method, n, n_iters, dtype) in done:
            continue
        if budget.over():
            rows.append(dict(method=method, n=n, n_iters=n_iters, dtype=dtype, b=cfg["b"], h=cfg["h"], d=cfg["d"],
                             status="skipped: over the time budget"))
        else:
            try:
                rows.append(measure(method, n, n_iters, dtype, bench_cfg, device))
            except Exception as err:
                rows.append(dict(method=method, n=n, n_iters=n_iters, dtype=dtype, b=cfg["b"], h=cfg["h"], d=cfg["d"],
                                 status=f"error: {_short(err)}"))
        print("  " + _row_text(rows[-1]), flush=True)


def target_grid(cfg: dict) -> list[tuple]:
    ns = cfg["ns"]
    small, mid, large = ns[0], ns[min(1, len(ns) - 1)], ns[-1]
    grid = [("sdpa-flash", mid, 1, "bfloat16"), ("flash", mid, 3, "bfloat16"), ("flash", mid, 5, "bfloat16"),
            ("sdpa-flash", small, 1, "bfloat16"), ("flash", small, 5, "bfloat16"), ("official", small, 5, "bfloat16"),
            ("sdpa-flash", large, 1, "bfloat16"), ("flash", large, 5, "bfloat16")]
    return grid


def full_grid(cfg: dict, methods: list[str]) -> list[tuple]:
    """The grid of :mod:`benchmarks.attention_cuda`, minus what cannot fit: the materialising methods
    (official, dense) up to n = 4096, the streamed engine (a Python loop over row blocks) at n = 1024."""
    grid = []
    for dtype in ("bfloat16", "float32"):
        for n in cfg["ns"]:
            for method in methods:
                if method in ("official", "dense", "tiled") and n > 4096 or method == "streamed" and n > 1024:
                    continue
                for n_iters in ([1] if method == "sdpa-flash" else cfg["iters"]):
                    grid.append((method, n, n_iters, dtype))
    return grid


PROBE = """
import os, sys, json, time
import torch, sinkformer
n, device = int(sys.argv[1]), sys.argv[2]
m, B, d = n, 1, 64
dtype = torch.bfloat16 if device == "cuda" else torch.float64
gen = torch.Generator(device=device).manual_seed(0)
q, k, v = (torch.randn(B, s, d, generator=gen, device=device, dtype=dtype) for s in (n, m, m))
pad = torch.zeros(B, m, dtype=torch.bool, device=device)
pad[:, -7:] = True
keep_row = ~pad[:, None, :]                                          # (B, 1, m): row stride 0
if device == "cuda":                                                 # the same mask written out, n x m bytes
    full = keep_row.expand(B, n, m).contiguous()
else:  # a strided view whose rows sit 2^31 bytes apart in a buffer the OS never backs (the interpreter)
    stride = (2**31) // (n - 8) + 1
    store = torch.empty(stride * (n - 1) + m, dtype=torch.uint8)
    full = store.as_strided((B, n, m), (0, stride, 1))
    full.copy_(keep_row.expand(B, n, m))
    full = full.view(torch.bool)
last = full.storage_offset() + (n - 1) * full.stride(1) + (m - 1)
grad = torch.randn(B, n, d, generator=gen, device=device, dtype=dtype)
results = {}
for name, mask in (("full", full), ("broadcast", keep_row)):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = sinkformer.attention(*leaves, attn_mask=mask, n_iters=3, backend="flash")
    results[name] = (out,) + torch.autograd.grad(out, leaves, grad)
diff = max(((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()
           for a, b in zip(results["full"], results["broadcast"]))
finite = all(bool(torch.isfinite(t).all()) for t in results["full"])
print(json.dumps(dict(n=n, m=m, largest_mask_offset=int(last), past_2_31=last >= 2**31, max_relative_difference=diff,
                      finite=finite)))
"""


def offset_probe(cfg: dict, device: str) -> dict:
    """:data:`PROBE` in a subprocess (an out-of-bounds read may kill it): equal results from a full
    mask whose offsets pass 2^31 and from the same mask broadcast."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    if device != "cuda":
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run([sys.executable, "-c", PROBE, str(cfg["probe_n"]), device], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=1800)  # a hang guard
    if done.returncode != 0:
        return dict(status=f"FAIL: the probe exited with {done.returncode}", stderr=done.stderr[-2000:])
    row = json.loads(done.stdout.strip().splitlines()[-1])
    ok = row["finite"] and row["max_relative_difference"] <= 1e-6 and row["past_2_31"]
    row["status"] = "pass" if ok else "FAIL"
    return row


# ----------------------------------------------------------------------------- report


def _short(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300] if str(err).strip() else ''}"


def _accuracy_text(r: dict) -> str:
    if "forward" not in r:
        return f"{r.get('dtype', ''):>8} {r['case']:<40} {r['status']}"
    return (f"{r['dtype']:>8} {r['case']:<40} n_iters={r['n_iters']:<2} forward {r['forward']:.2e} dq {r['dq']:.2e} "
            f"dk {r['dk']:.2e} dv {r['dv']:.2e} {r['status']}")


def markdown(report: dict) -> str:
    from benchmarks.attention_cuda import markdown as bench_markdown

    env = report["environment"]
    lines = [f"# The flash engine on {env.get('gpu', 'an unknown GPU')}", "",
             f"{env.get('date', '')} · driver {env.get('driver', '?')} · CUDA {env.get('cuda', '?')} · torch "
             f"{env.get('torch', '?')} · Triton {env.get('triton', '?')}"
             f"{' · **smoke run** (CPU, tiny sizes: not a measurement)' if report['smoke'] else ''}.", "",
             f"Written by `{report.get('command', 'python -m benchmarks gpu-check')}` at commit "
             f"{report.get('commit', 'unrecorded')}. Parts:", "", "| part | status | seconds |", "|---|---|---:|"]
    for name, part in report["parts"].items():
        lines.append(f"| {name} | {part['status']} | {part['seconds']:.1f} |")
    lines += ["", "## Accuracy against float64 (the dense engine, on the same device)", "",
              "Relative error ‖x − ref‖ / ‖ref‖; tolerances (forward, gradients): "
              + ", ".join(f"{k} {v[0]:g}/{v[1]:g}" for k, v in TOLERANCE.items()) + ".", "",
              "| case | dtype | n_iters | n × m, d | forward | dq | dk | dv | status |",
              "|---|---|---:|---|---:|---:|---:|---:|---|"]
    for r in report["accuracy"]:
        if "forward" in r:
            lines.append(f"| {r['case']} | {r['dtype']} | {r['n_iters']} | {r['n']} × {r['m']}, {r['d']} | "
                         f"{r['forward']:.1e} | {r['dq']:.1e} | {r['dk']:.1e} | {r['dv']:.1e} | {r['status']} |")
        else:
            lines.append(f"| {r['case']} | {r['dtype']} | {r['n_iters']} | | | | | | {r['status']}"
                         f"{' (' + r['auto'] + ')' if 'auto' in r else ''} |")
    graph = report.get("graph", {})
    lines += ["", "## CUDA graph", ""]
    if "replay_ms" in graph:
        lines.append(f"bf16, b·h = {graph['b'] * graph['h']}, n = {graph['n']}, d = {graph['d']}, 5 iterations, "
                     f"forward+backward: eager {graph['eager_ms']:.3f} ms, replayed {graph['replay_ms']:.3f} ms "
                     f"(replay vs eager {graph['replay_vs_eager']:.1e}); the official algorithm {graph['official_ms']:.3f} "
                     f"ms, {graph['official_over_replay']:.1f}× the replay. {graph['status']}.")
    else:
        lines.append(graph.get("status", "not run"))
    probe = report.get("offset_probe", {})
    lines += ["", "## Offsets past 2^31", ""]
    if "largest_mask_offset" in probe:
        lines.append(f"n = m = {probe['n']}, a full boolean mask (largest offset {probe['largest_mask_offset']:,}) vs the "
                     f"same mask broadcast: largest relative difference {probe['max_relative_difference']:.1e}, finite: "
                     f"{probe['finite']}. {probe['status']}.")
    else:
        lines.append(probe.get("status", "not run"))
    tests = report.get("cuda_tests", {})
    result = tests.get("summary", tests.get("status", "not run"))
    lines += ["", "## CUDA tests", "", f"`{tests['command']}`: {result}" if "command" in tests else result]
    lines += [f"- {line}" for line in tests.get("failures", [])]
    meta = dict(report["bench_meta"], gpu=env.get("gpu", "?"), torch=env.get("torch"), triton=env.get("triton"),
                date=env.get("date"), smoke=report["smoke"], graph=report.get("graph"))
    bench = bench_markdown(report["rows"], meta).split("\n", 2)[2]  # without its title
    lines += ["", "## Time and memory (forward+backward unless said)", "", bench]
    return "\n".join(lines) + "\n"


def summary(report: dict) -> str:
    lines = ["", "gpu-check summary:"]
    for name, part in report["parts"].items():
        lines.append(f"  {name:<18} {part['status']:<40} {part['seconds']:7.1f} s")
    failed = [r for r in report["accuracy"] if r["status"] != "pass" and not r["status"].startswith("refused")]
    lines.append(f"  accuracy: {sum(r['status'] == 'pass' for r in report['accuracy'])} pass, {len(failed)} not")
    for t in report.get("targets", []):
        verdict = "not measured" if t["met"] is None else "met" if t["met"] else "not met"
        value = "" if t["value"] is None else f"{t['value']:.2f} "  # a yes/no target has no value
        lines.append(f"  target: {t['target']}: {value}({verdict})")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- entry point


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks gpu-check", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmark-results", help="folder for attention_cuda.{json,md}")
    parser.add_argument("--budget", type=float, default=420.0, help="seconds for all parts (default 420)")
    parser.add_argument("--smoke", action="store_true",
                        help="the same code path on the CPU (Triton's interpreter, tiny sizes): checks the script")
    parser.add_argument("--parts", default=",".join(name for name, _ in PARTS),
                        help="comma-separated parts to run, in their fixed order (default: all): "
                             + ", ".join(name for name, _ in PARTS))
    args = parser.parse_args(argv)
    chosen = [part.strip() for part in args.parts.split(",") if part.strip()]
    unknown = [part for part in chosen if part not in dict(PARTS)]
    if unknown or not chosen:
        parser.error(f"--parts takes names among {', '.join(name for name, _ in PARTS)}; got {args.parts!r}")
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the flash kernels are first imported
    import torch

    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("gpu-check: no CUDA device (torch.cuda.is_available() is False); run it on a machine with an NVIDIA "
              "GPU, or pass --smoke to check the script on the CPU.", file=sys.stderr)
        return 2
    cfg = SMOKE if args.smoke else FULL
    from benchmarks.attention_cuda import METHODS, targets

    budget = Budget(args.budget)
    from sinkformer.provenance import git_commit

    given = sys.argv[1:] if argv is None else argv
    report = dict(smoke=args.smoke, command=shlex.join(["python", "-m", "benchmarks", "gpu-check", *given]),
                  commit=git_commit(ROOT), parts={}, accuracy=[], rows=[], environment={},
                  bench_meta=dict(b=cfg["b"], h=cfg["h"], d=cfg["d"], repeats=cfg["repeats"],
                                  clock="CUDA-event" if device == "cuda" else "perf_counter",
                                  dtypes=["bfloat16", "float32"]))
    methods = METHODS
    work = {
        "environment": lambda: report.__setitem__("environment", environment(device)),
        "compile": lambda: report.__setitem__("compile", compile_ahead(cfg, device, budget)),
        "accuracy-target": lambda: report["accuracy"].extend(accuracy(cfg, device, budget, target_cases(cfg))),
        "benchmark-targets": lambda: benchmark(cfg, device, budget, target_grid(cfg), report["rows"]),
        "cuda-tests": lambda: report.__setitem__("cuda_tests", cuda_tests(device, budget)),
        "accuracy-edges": lambda: report["accuracy"].extend(accuracy(cfg, device, budget, edge_cases(cfg, device))),
        "graph": lambda: report.__setitem__("graph", graph_capture(cfg, device)),
        "benchmark": lambda: benchmark(cfg, device, budget, full_grid(cfg, methods), report["rows"]),
        "offset-probe": lambda: report.__setitem__("offset_probe", offset_probe(cfg, device)),
    }
    shares_left = sum(share for name, share in PARTS if name in chosen)
    for name, share in PARTS:
        if name not in chosen:
            report["parts"][name] = dict(status="not run (left out by --parts)", seconds=0.0)
            continue
        seconds = budget.begin(share, shares_left)
        shares_left -= share
        print(f"[{time.perf_counter() - budget.start:6.1f} s] {name} (budget {seconds:.0f} s)", flush=True)
        start = time.perf_counter()
        try:
            work[name]()
            status = _part_status(name, report)
        except Exception as err:
            traceback.print_exc()
            status = f"ERROR: {_short(err)}"
        report["parts"][name] = dict(status=status, seconds=time.perf_counter() - start)
        print(f"  -> {status}", flush=True)
    report["bench_meta"]["ns"] = sorted({r["n"] for r in report["rows"]})
    report["bench_meta"]["methods"] = [m for m in methods if any(r["method"] == m for r in report["rows"])]
    report["bench_meta"]["iters"] = cfg["iters"]
    report["targets"] = targets(report["rows"], report.get("graph"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "attention_cuda.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "attention_cuda.md").write_text(markdown(report))
    print(summary(report))
    print(f"wrote {out / 'attention_cuda.json'} and {out / 'attention_cuda.md'}")
    bad = [p for p in report["parts"].values() if p["status"].startswith(("FAIL", "ERROR"))]
    return 1 if bad else 0


def _part_status(name: str, report: dict) -> str:
    if name in ("accuracy-target", "accuracy-edges"):
        rows = [r for r in report["accuracy"] if r["status"] not in ("pass",)]
        bad = [r for r in rows if r["status"].startswith(("FAIL", "ERROR"))]
        skipped = [r for r in rows if r["status"].startswith("skipped")]
        return "FAIL" if bad else (f"ok ({len(skipped)} skipped)" if skipped else "pass")
    if name in ("benchmark-targets", "benchmark"):
        errors = [r for r in report["rows"] if str(r.get("status", "")).startswith("error")]
        return "FAIL" if errors else "ok"
    part = {"compile": "compile", "cuda-tests": "cuda_tests", "graph": "graph",
            "offset-probe": "offset_probe"}.get(name)
    if part is not None:
        status = report.get(part, {}).get("status", "ok")
        return status
    return "ok"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
