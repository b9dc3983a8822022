"""``python -m benchmarks [NAME] [options]`` — run one benchmark suite (default: attention).

Each suite writes JSON, a markdown table and a plot to ``benchmarks/results/``.
``python -m benchmarks attention --device cuda`` runs the GPU suite (``benchmarks/attention_cuda.py``).
"""

from __future__ import annotations

import importlib
import sys

SUITES = {
    "attention": ("benchmarks.attention", "Sinkhorn vs SoftMax attention: time and memory (issue 3)"),
    "sparse-memory": ("benchmarks.sparse_memory", "Sparse Sinkhorn / SortCut memory vs length (issue 7)"),
    "sparse": ("benchmarks.sparse", "Sparse Sinkhorn layers vs SDPA and lucidrains: time, memory (issue 17)"),
    "causal": ("benchmarks.causal", "Causal Sinkhorn vs causal SDPA: time, memory, weights (issue 16)"),
    "dynamics": ("benchmarks.dynamics_flow", "Sinkformer particle flow vs POT from scratch (issue 4)"),
}


def main(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        for name, (_, text) in SUITES.items():
            print(f"  {name:<14} {text}")
        return 0
    name = argv[0] if argv and not argv[0].startswith("-") else "attention"
    rest = argv[1:] if argv and argv[0] == name else argv
    if name not in SUITES:
        print(f"unknown benchmark {name!r}; valid: {', '.join(SUITES)}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUITES[name][0])
    if name == "attention" and _device(rest) == "cuda":  # the GPU suite: benchmarks/attention_cuda.py
        module = importlib.import_module("benchmarks.attention_cuda")
        rest = _without_device(rest)
    return module.main(rest)


def _device(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg == "--device" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--device="):
            return arg.split("=", 1)[1]
    return None


def _without_device(argv: list[str]) -> list[str]:
    out, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
        elif arg == "--device":
            skip = True
        elif not arg.startswith("--device="):
            out.append(arg)
    return out


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
