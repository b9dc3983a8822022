"""python -m benchmarks [NAME] [options]: run one benchmark suite (default: attention).

Each suite writes JSON, a markdown table and (most) a plot to the folder given by --out, by default
./benchmark-results in the current directory. The committed results in benchmarks/results, which
the docs include, are written only when asked for: --out benchmarks/results. "python -m benchmarks
NAME --help" lists a suite's own options. Runs from any directory: python path/to/benchmarks, or
python -m benchmarks with the clone on PYTHONPATH. "python -m benchmarks attention --device cuda"
runs the GPU attention benchmark.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path

#: name -> (module, one line of what it measures)
SUITES = {
    "attention": ("benchmarks.attention", "Sinkhorn vs SoftMax attention on the CPU: time and memory"),
    "sparse-memory": ("benchmarks.sparse_memory", "Sparse Sinkhorn / SortCut memory vs length"),
    "sparse": ("benchmarks.sparse", "Sparse Sinkhorn layers vs SDPA and lucidrains: time, memory"),
    "causal": ("benchmarks.causal", "Causal Sinkhorn vs causal SDPA: time, memory, weights"),
    "dynamics": ("benchmarks.dynamics_flow", "Sinkformer particle flow vs POT from scratch"),
    "phase": ("benchmarks.dynamics_phase", "Phase diagram on the sphere: one batch vs a loop of simulations"),
    "sharing": ("benchmarks.sharing", "sinkformer train alone and beside busy processes: epoch times"),
    "overhead": ("benchmarks.overhead", "Short sequences: the attention call against a bare floor of its arithmetic"),
    "parallel": ("benchmarks.parallel", "The tiled engine's groups: one Python thread per core vs intra-op threads"),
    "matvec": ("benchmarks.matvec", "The engines' row sums K x on this CPU: each product, and the one picked here"),
    "ab": ("benchmarks.ab", "A change before and after: the attention grid or block sorting of two trees, interleaved"),
    "gpu-check": ("benchmarks.gpu_check", "The flash engine on a GPU: tests, accuracy, speed, memory, graphs"),
    "flash-compile": ("benchmarks.flash_compile", "Flash kernels compiled for an H100 without a GPU: resources"),
    "flash-tune": ("benchmarks.flash_tune", "Flash kernels' launches on a GPU: each candidate checked and timed"),
    "flash-model": ("benchmarks.flash_model", "Performance model of the flash engine and SDPA-flash on an H100"),
}
#: where results go unless --out says otherwise (not the committed benchmarks/results)
DEFAULT_OUT = "benchmark-results"
ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__.strip() + "\n\nsuites:")
        for name, (_, text) in SUITES.items():
            print(f"  {name:<14} {text}")
        return 0
    name = argv[0] if argv and not argv[0].startswith("-") else "attention"
    rest = argv[1:] if argv and argv[0] == name else argv
    if name not in SUITES:
        print(f"unknown benchmark {name!r}; valid: {', '.join(SUITES)} (python -m benchmarks --help)", file=sys.stderr)
        return 2
    module_name = SUITES[name][0]
    if name == "attention" and _device(rest) == "cuda":  # the GPU suite: benchmarks/attention_cuda.py
        module_name, rest = "benchmarks.attention_cuda", _without_device(rest)
    if not any(arg == "--out" or arg.startswith("--out=") for arg in rest) and "-h" not in rest and "--help" not in rest:
        rest = rest + ["--out", DEFAULT_OUT]
    return importlib.import_module(module_name).main(rest)


def _device(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg == "--device" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--device="):
            return arg.split("=", 1)[1]
    return None


def _without_device(argv: list[str]) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--device":
            skip = True
        elif not arg.startswith("--device="):
            out.append(arg)
    return out


def _importable() -> None:
    """Make ``benchmarks`` (and, in a clone without an install, ``sinkformer``) importable from any
    directory: ``python path/to/benchmarks`` or ``python -m benchmarks`` with the clone on the path."""
    added = []
    if importlib.util.find_spec("benchmarks") is None:
        added.append(str(ROOT))
    if importlib.util.find_spec("sinkformer") is None and (ROOT / "src" / "sinkformer").is_dir():
        added.append(str(ROOT / "src"))
    sys.path[:0] = added
    if added:  # the suites' worker processes import them too
        os.environ["PYTHONPATH"] = os.pathsep.join(added + [p for p in [os.environ.get("PYTHONPATH")] if p])


if __name__ == "__main__":
    _importable()
    sys.exit(main(sys.argv[1:]))
