"""Compile every flash kernel a launch compiles, for a GPU target, without a GPU; report its resources.

    python -m benchmarks flash-compile [--out DIR] [--arch 90] [--quick]

The flash engine's own launcher (:mod:`sinkformer.sinkhorn.flash`) runs its forward and backward on
``meta`` tensors of real sizes (no memory, no data) with each kernel replaced by a compile-only
stand-in: Triton's binder types every argument from the real tensors and ints (``i32`` vs ``i64``,
alignment, ``stride == 1``), exactly as a launch does, and the kernel is compiled for ``sm_<arch>``
with the launch's warps and stages. Every configuration of :data:`~sinkformer.sinkhorn.flash.GPU_CONFIGS`
(each dtype and head dim served) runs two scenarios: no mask and 5 iterations (the fused odd-count
backward), and a boolean mask and a bias with 4 iterations (the even-count path); bfloat16 at d = 64
also the tolerance backward, the implicit backward, a cross-attention shape whose sizes are not
multiples of 16, and a full mask whose batch stride passes 2^31.

Reported per compiled kernel: shared memory (bytes, dynamic + static), registers per thread, local
memory (spills) and whether it fits an H100 (227 KiB of shared memory, no spills). Writes
``flash_compile.{json,md}``; exits 1 when a kernel fails to compile or does not fit.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHARED_LIMIT = 227 * 1024  # bytes of shared memory one block may use on sm_90
SCENARIOS = ("odd", "masked-even", "tolerance", "implicit")


class _FakeDriver:
    """What Triton's launcher asks of the active driver, for a GPU target without a GPU."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


class _CompileOnly:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **kw)`` compiles what that
    launch would compile (Triton's own binder and cache) and records it, running nothing."""

    def __init__(self, fn, name: str, seen: dict, context: dict, log: Path):
        self.fn, self.name, self.seen, self.context, self.log = fn, name, seen, context, log

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            try:
                with _stderr_to(self.log):
                    kernel = self.fn.warmup(*args, grid=grid, **kwargs)
                signature = dict(kernel.src.signature)
                key = (self.name, json.dumps(signature, sort_keys=True), json.dumps(
                    {k: v for k, v in kwargs.items()}, sort_keys=True, default=str))
                if key not in self.seen:
                    self.seen[key] = dict(self.context, kernel=self.name, **_variant(kwargs), **_resources(kernel),
                                          int_types=_int_types(signature))
            except Exception as err:  # a kernel that does not compile is the finding: record it, go on
                key = (self.name, repr(sorted(kwargs.items())), "error")
                self.seen.setdefault(key, dict(self.context, kernel=self.name, **_variant(kwargs),
                                               error=_first_error(err, self.log.read_text())))
        return launch


def _variant(kwargs: dict) -> dict:
    keep = ("MODE", "FIND_SHIFT", "FOLDED", "HAS_KEEP", "HAS_BIAS", "HAS_W", "HAS_DUAL", "HAS_INV", "HAS_LOG_A", "BLOCK_R",
            "BLOCK_C", "D", "E", "BLOCK_T", "num_warps", "num_stages")
    return {k: kwargs[k] for k in keep if k in kwargs}


def _int_types(signature: dict) -> str:
    """The integer arguments typed ``i64`` by the binder (the rest are ``i32`` or specialised)."""
    wide = [name for name, ty in signature.items() if ty == "i64"]
    return ",".join(wide) if wide else "all i32"


@contextlib.contextmanager
def _stderr_to(path: Path):
    """The process's stderr (file descriptor 2: the compiler's own diagnostics) into ``path``."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "w") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def _first_error(err: Exception, diagnostics: str = "") -> str:
    """The line that says why a compile failed (the compiler's diagnostics first, then the exception)."""
    text = diagnostics + "\n" + str(err)
    for line in text.splitlines():
        if "Currently" in line or "out of resource" in line.lower():
            return line.strip()[:300]
    for line in text.splitlines():
        if "error" in line.lower():
            return line.strip()[:300]
    return (text.strip().splitlines() or [type(err).__name__])[0][:300]


def _resources(kernel) -> dict:
    """Shared memory (Triton's figure), registers and local memory (from the cubin, by cuobjdump)."""
    import triton

    row = {"shared": int(kernel.metadata.shared)}
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        text = subprocess.run([str(tool), "-res-usage", str(cubin)], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", text)
    if found:
        regs, stack, static, local = map(int, found.groups())
        row.update(registers=regs, stack=stack, shared=row["shared"] + static, local=local)
    return row


@contextlib.contextmanager
def stand_in_kernels(flash, make):
    """The flash launcher with each Triton kernel replaced by ``make(kernel, name)`` (an object that
    takes ``[grid](*args, **kwargs)`` as the kernel does) and the implicit backward's dual solve by one
    product each way (its kernels, without iterating on data that is not there)."""
    from sinkformer.sinkhorn import _flash_kernels

    stand_ins = type("Kernels", (), {})()
    for name in _flash_kernels.MODES:
        setattr(stand_ins, name, getattr(_flash_kernels, name))
    for name in _flash_kernels.KERNELS:
        setattr(stand_ins, name, make(getattr(_flash_kernels, name), name))
    real_kernels, real_duals = flash._kernels, flash.implicit_duals
    flash._kernels = lambda: stand_ins
    flash.implicit_duals = lambda Pv, Ptv, r, c, **kw: (Pv(c), Ptv(r))
    try:
        yield stand_ins
    finally:
        flash._kernels, flash.implicit_duals = real_kernels, real_duals


def cases(quick: bool) -> list[tuple]:
    """``(dtype name, head dim, value dim, scenarios)``: every configuration served, at the largest head
    dim of its bucket and at d = 80 (padded to 128); ``quick``: the target (bfloat16, d = 64) in every
    scenario, float32 and float64 at d = 64 in one each."""
    import torch

    from sinkformer.sinkhorn.flash import GPU_CONFIGS

    if quick:
        return [("bfloat16", 64, 64, SCENARIOS), ("float32", 64, 64, ("odd",)), ("float64", 64, 64, ("masked-even",))]
    names = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32", torch.float64: "float64"}
    out = []
    for dtype, bucket in GPU_CONFIGS:
        if bucket < 64:  # shares the d = 64 configuration with smaller tiles
            continue
        scenarios = SCENARIOS if (dtype, bucket) == (torch.bfloat16, 64) else ("odd", "masked-even")
        out += [(names[dtype], d, d, scenarios) for d in ((80, 128) if bucket == 128 else (bucket,))]
    return out


def run_scenario(flash, dtype, d: int, e: int, scenario: str, n: int = 4096, m: int | None = None, B: int = 32,
                 huge_mask: bool = False) -> None:
    """The launcher's forward and backward of one scenario on meta tensors (kernels compile-only)."""
    import torch

    from sinkformer.sinkhorn.problem import Problem

    m = n if m is None else m
    meta = dict(device="meta")
    q, k = torch.empty(B, n, d, dtype=dtype, **meta), torch.empty(B, m, d, dtype=dtype, **meta)
    v = torch.empty(B, m, e, dtype=dtype, **meta)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    keep = bias = None
    if scenario != "odd" and scenario != "implicit":
        keep = torch.empty(B if huge_mask else 1, n, m, dtype=torch.bool, **meta)
        bias = None if huge_mask else torch.empty(1, n, m, dtype=acc, **meta)
    n_iters = 5 if scenario in ("odd", "implicit") else 4
    p = flash._Operands(Problem(q, k, v, keep, bias, [B], 0.125, n_iters), interpreted=False)
    backward = "implicit" if scenario == "implicit" else "unrolled"
    out, fs, gs, counts, *_ = flash._forward(p, v, n_iters, None, 1000, "unrolled")
    if backward == "implicit":
        fs, gs = fs[:, -1:], gs[:, -1:]
    flash._backward(p, torch.empty_like(out), v, out, fs, gs, counts, backward, fixed=scenario != "tolerance")


def compile_all(arch: int, quick: bool) -> list[dict]:
    import torch
    import triton
    from triton.runtime import driver

    from sinkformer.sinkhorn import flash

    seen: dict = {}
    context: dict = {}
    log = Path(tempfile.mkdtemp()) / "compiler-stderr.txt"
    driver.set_active(_FakeDriver(arch))
    try:
        with stand_in_kernels(flash, lambda fn, name: _CompileOnly(fn, name, seen, context, log)):
            for dtype_name, d, e, scenarios in cases(quick):
                dtype = getattr(torch, dtype_name)
                for scenario in scenarios:
                    start = time.perf_counter()
                    context.clear()
                    context.update(dtype=dtype_name, d=d, e=e, scenario=scenario)
                    cross = scenario == "masked-even" and (dtype_name, d) == ("bfloat16", 64)  # n, m % 16 != 0
                    shapes = [dict(n=4096)] + ([dict(n=1000, m=777, B=3)] if cross else [])
                    for shape in shapes:
                        run_scenario(flash, dtype, d, e, scenario, **shape)
                    print(f"{dtype_name:>8} d={d:<3} e={e:<3} {scenario:<12} {time.perf_counter() - start:6.1f} s, "
                          f"{len(seen)} kernels so far", flush=True)
            context.clear()
            context.update(dtype="bfloat16", d=64, e=64, scenario="mask batch stride >= 2^31")
            run_scenario(flash, torch.bfloat16, 64, 64, "masked-even", n=46341, B=2, huge_mask=True)
    finally:
        try:
            driver.reset_active()
        except RuntimeError:  # no GPU driver to go back to
            pass
    rows = list(seen.values())
    for row in rows:
        row["fits"] = "error" not in row and row["shared"] <= SHARED_LIMIT and row.get("local", 0) == 0
    print(f"triton {triton.__version__}: {len(rows)} kernels compiled for sm_{arch}")
    return rows


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"# Flash kernels compiled for sm_{meta['arch']} (Triton {meta['triton']})", "",
             f"{meta['date']} · torch {meta['torch']} · {len(rows)} kernels, each as a launch compiles it "
             "(argument types from real tensors); fits = shared memory <= 227 KiB and no local memory (spills).", "",
             "| dtype | d | e | scenario | kernel | variant | warps/stages | shared KiB | registers | local B | "
             "64-bit ints | fits |", "|---|---:|---:|---|---|---|---|---:|---:|---:|---|---|"]
    for r in rows:
        variant = " ".join(f"{k}={v}" for k, v in r.items() if k in ("MODE", "FOLDED", "BLOCK_R", "BLOCK_C", "BLOCK_T")
                           or (k.startswith("HAS_") and v))
        if "error" in r:
            lines.append(f"| {r['dtype']} | {r['d']} | {r['e']} | {r['scenario']} | {r['kernel']} | {variant} | "
                         f"{r.get('num_warps')}/{r.get('num_stages')} | | | | | **does not compile**: {r['error']} |")
            continue
        lines.append(f"| {r['dtype']} | {r['d']} | {r['e']} | {r['scenario']} | {r['kernel']} | {variant} | "
                     f"{r.get('num_warps')}/{r.get('num_stages')} | {r['shared'] / 1024:.1f} | {r.get('registers', '')} | "
                     f"{r.get('local', '')} | {r['int_types']} | {'yes' if r['fits'] else '**no**'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks flash-compile", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmark-results", help="folder for flash_compile.{json,md}")
    parser.add_argument("--arch", type=int, default=90, help="compute capability to compile for (default 90: H100)")
    parser.add_argument("--quick", action="store_true",
                        help="bfloat16 at d = 64 in every scenario, float32 and float64 at d = 64 in one")
    args = parser.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)  # compile, never interpret
    import torch
    import triton

    rows = compile_all(args.arch, args.quick)
    meta = dict(arch=args.arch, triton=triton.__version__, torch=torch.__version__,
                date=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "flash_compile.json").write_text(json.dumps(dict(meta=meta, kernels=rows), indent=1))
    (out / "flash_compile.md").write_text(markdown(rows, meta))
    bad = [r for r in rows if not r["fits"]]
    for r in bad:
        print(f"does not fit: {r}", file=sys.stderr)
    print(f"wrote {out / 'flash_compile.json'} and .md; {len(bad)} of {len(rows)} kernels do not fit")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
