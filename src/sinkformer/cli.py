"""The ``sinkformer`` command.

Each subcommand is a small function ``_cmd_<name>(args)`` registered in :func:`build_parser`;
the work itself lives in the library modules.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def _cmd_demo(args: argparse.Namespace) -> int:
    from .experiments.sinkformers import normalizations

    result = normalizations.compute(n_points=args.points, seed=args.seed)
    print("Figure 1 of the Sinkformers paper: K0 = exp(C), K1 = SoftMax(C), Kinf = Sinkhorn(C)")
    print(f"two clouds of {args.points} points, C_ij = <W_Q x_i, W_K x_j>; Sinkhorn ran {result.sinkhorn_iters} normalisations\n")
    print(normalizations.format_table(result))
    path = normalizations.plot(result, Path(args.out))
    print(f"\nfigure written to {path.resolve()}")
    return 0


def _cmd_experiments(args: argparse.Namespace) -> int:
    from .runs.cost import GPU_NAME, load_costs
    from .runs.readme import load_quick_run
    from .runs.registry import registry

    experiments, costs, quick = registry(), load_costs(), load_quick_run()
    width = max(len(name) for name in experiments)
    print(f"{'name':<{width}}  {'quick here':>10}  {'--full':>14}  description")
    for exp in experiments.values():
        measured = quick.get(exp.name)
        here = f"{measured // 60}:{measured % 60:02d} min" if measured is not None else f"~{exp.quick_minutes:g} min"
        if exp.name in costs:
            hours = costs[exp.name]["gpu_hours"]
            full = f"{hours:,.1f} GPU-h" if hours < 10 else f"{hours:,.0f} GPU-h"
        elif exp.cost is None:
            full = f"{exp.full_minutes or exp.quick_minutes:g} CPU-min"
        else:
            full = "not measured"
        print(f"{exp.name:<{width}}  {here:>10}  {full:>14}  {exp.description} ({exp.paper})")
    print(f"\nquick: measured in the committed quick run (docs/results/quick-run.json; ~ = expected); --full: GPU-hours "
          f"on {GPU_NAME}, from training steps timed on this project's CPU and the paper's step counts "
          f"(docs/results/full-cost.json, `python -m sinkformer.runs.cost`), or CPU minutes for CPU-only experiments.")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    import torch

    from .runs.registry import get, parse_overrides, run_experiment
    from .runs.suite import run_suite

    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    if args.name is None:  # the summary suite: every experiment, quick form
        given = [flag for flag, value in (("--full", args.full), ("--data", args.data), ("--set", args.set)) if value]
        if given:
            raise ValueError(f"{', '.join(given)} only apply to a single experiment: sinkformer run NAME {' '.join(given)} ...")
        if args.jobs is not None and args.jobs < 1:
            raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
        if args.device != "auto":
            raise ValueError("--device applies to a single experiment: sinkformer run NAME --full --device cuda")
    else:
        if args.jobs is not None:
            raise ValueError("--jobs only applies to the suite (sinkformer run without NAME)")
        overrides = parse_overrides(args.set or [], get(args.name).defaults)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads or (threads if args.full else 1))
    try:
        if args.name is None:
            jobs = args.jobs or min(2, os.cpu_count() or 1)
            path = run_suite(args.runs_dir, seeds=args.seeds, jobs=jobs)
            print(f"summary report: {path.resolve()}\n                {path.with_suffix('.html').resolve()}")
            return 0
        ctx = run_experiment(
            args.name, full=args.full, data=args.data, seeds=args.seeds, overrides=overrides, runs_dir=args.runs_dir,
            device=args.device,
        )
    finally:
        torch.set_num_threads(threads)
    print(f"report: {(ctx.out_dir / 'report.md').resolve()}")
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    import os

    from .training.runner import check_config, resolve_config, run_training

    config_file = args.config
    if args.resume:
        if args.out is None:
            raise ValueError("--resume needs --out DIR (the run folder to continue)")
        saved = Path(args.out) / "config.yaml"
        if config_file is None and saved.exists():
            config_file = saved
    config = resolve_config(
        config_file, model=args.model, data=args.data, data_path=args.data_path,
        normalization=args.normalization, n_iters=args.n_iters, sets=args.set or [],
    )
    try:
        check_config(config)
    except TypeError as err:  # an option of the wrong type is a user mistake too
        raise ValueError(str(err)) from None
    result = run_training(config, out_dir=args.out, resume=args.resume)
    if os.environ.get("RANK", "0") == "0":
        final = ", ".join(f"{k} {v:.4g}" for k, v in result.final.items() if k.startswith("test_"))
        print(f"done: {final}; metrics, checkpoints and weights in {result.out_dir}")
    return 0


class _TrainHelp(argparse.Action):
    """``sinkformer train --help``: the flags, then every model, dataset and train option (imported lazily)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from .training.runner import describe_options

        parser.print_help()
        print("\n" + describe_options())
        parser.exit()


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

    listing = sub.add_parser("experiments", help="list the experiments with their expected run time")
    listing.set_defaults(func=_cmd_experiments)

    run = sub.add_parser(
        "run",
        help="run one experiment (runs/NAME/<timestamp>/: config, metrics, results, figures, report), "
             "or with no NAME the quick form of all of them and a summary report (runs/summary/<timestamp>/)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    run.add_argument("name", nargs="?", default=None,
                     help="experiment name (see `sinkformer experiments`); none = every experiment, quick form")
    mode = run.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", default=True, help="small configuration on embedded data")
    mode.add_argument("--full", action="store_true", default=False, help="the paper's configuration")
    run.add_argument("--data", default=None, help="path to the real dataset (default: embedded data)")
    run.add_argument("--seeds", type=int, default=None, help="number of seeds (default: the experiment's)")
    run.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a configuration key (YAML value)")
    run.add_argument("--runs-dir", default="runs", help="where run folders go")
    run.add_argument("--threads", type=int, default=None,
                     help="torch CPU threads; None = 1 for quick runs (their small models gain little from more "
                          "threads and slow down sharply when other processes share the cores), torch's default "
                          "for --full")
    run.add_argument("--jobs", type=int, default=None,
                     help="without NAME: experiments run at once, one process each (default: min(2, CPU cores))")
    run.add_argument("--device", default="auto",
                     help="where the models train: auto (CUDA when present, else the CPU), cpu, cuda, cuda:1, ...")
    run.set_defaults(func=_cmd_run)

    train = sub.add_parser(
        "train",
        help="train a model on a dataset (embedded or real); also under torchrun for several processes",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        add_help=False,
    )
    train.add_argument("-h", "--help", action=_TrainHelp, help="show this help with every option and its default")
    train.add_argument("--model", default=None, help="model name (model.name)")
    train.add_argument("--data", default=None, help="dataset name (data.name)")
    train.add_argument("--data-path", default=None, help="folder of a real dataset (data.path)")
    train.add_argument("--normalization", default=None,
                       help="attention: softmax (Transformer) or sinkhorn (Sinkformer); None = the model's default, sinkhorn")
    train.add_argument("--n-iters", type=int, default=None, help="Sinkhorn iterations; None = the model's default, 5")
    train.add_argument("--config", default=None, help="YAML or TOML file with model/data/train sections (see configs/)")
    train.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE",
                       help="override one option, e.g. train.lr=1e-4 or model.dim=64 (YAML value)")
    train.add_argument("--out", default=None, help="run folder; None = runs/train/<model>-<norm>-<data>-<time>")
    train.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    train.set_defaults(func=_cmd_train)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as err:  # user mistakes: one clear line, no traceback
        print(f"sinkformer {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
