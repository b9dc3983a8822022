"""``python -m benchmarks [NAME] [options]`` — run one benchmark suite (default: attention).

Each suite writes JSON, a markdown table and a plot to ``benchmarks/results/``.
"""

from __future__ import annotations

import importlib
import sys

SUITES = {
    "attention": ("benchmarks.attention", "Sinkhorn vs SoftMax attention: time and memory (issue 3)"),
    "sparse-memory": ("benchmarks.sparse_memory", "Sparse Sinkhorn / SortCut memory vs length (issue 7)"),
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
    return module.main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
