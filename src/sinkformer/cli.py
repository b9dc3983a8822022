"""The ``sinkformer`` command.

Each subcommand is a small function ``_cmd_<name>(args)`` registered in :func:`build_parser`;
the work itself lives in the library modules.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _cmd_demo(args: argparse.Namespace) -> int:
    from .experiments import normalizations

    result = normalizations.compute(n_points=args.points, seed=args.seed)
    print("Figure 1 of the Sinkformers paper: K0 = exp(C), K1 = SoftMax(C), Kinf = Sinkhorn(C)")
    print(f"two clouds of {args.points} points, C_ij = <W_Q x_i, W_K x_j>; Sinkhorn ran {result.sinkhorn_iters} normalisations\n")
    print(normalizations.format_table(result))
    path = normalizations.plot(result, Path(args.out))
    print(f"\nfigure written to {path.resolve()}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sinkformer",
        description="Doubly stochastic attention: Sinkformers, Sparse Sinkhorn Attention, Transformers as particles.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    demo = sub.add_parser(
        "demo",
        help="K0, K1 (SoftMax) and Kinf (Sinkhorn) on two point clouds (paper Figure 1)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    demo.add_argument("--points", type=int, default=10, help="points per cloud")
    demo.add_argument("--seed", type=int, default=0, help="random seed")
    demo.add_argument("--out", default="runs/demo/normalizations.png", help="where to write the PNG")
    demo.set_defaults(func=_cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 0
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
