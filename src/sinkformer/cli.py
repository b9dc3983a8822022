"""The ``sinkformer`` command (also ``python -m sinkformer``).

Each subcommand is a small function ``_cmd_<name>(args)`` registered in :func:`build_parser`;
the work itself lives in the library modules.

``--data`` means one thing in every subcommand: the folder (or file) of a real dataset. Which
dataset ``train`` reads is ``--dataset NAME``. The old ``train`` spellings still work, with a
warning: ``--data NAME`` (when NAME is a registered dataset and no such file exists) and
``--data-path PATH``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import sys
from pathlib import Path

from . import __version__
from .configs import names as config_names
from ._optional import MissingExtra, require_extra
from ._options import did_you_mean


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
    print(f"\nquick: measured in the committed quick run (sinkformer/runs/measured/quick-run.json; ~ = expected); --full: GPU-hours "
          f"on {GPU_NAME}, from training steps timed on this project's CPU and the paper's step counts "
          f"(sinkformer/runs/measured/full-cost.json, `python -m sinkformer.runs.cost`), or CPU minutes for CPU-only experiments.")
    return 0


def _threads(given: int | None, default: int | None = None) -> int | None:
    """The torch thread count a command runs with: ``--threads`` when given, else ``default``, else one
    per core that other processes leave free (:func:`~sinkformer.training.threads.free_cores`);
    ``None``: keep torch's own (the cores' use cannot be read here)."""
    if given is not None:
        if given < 1:
            raise ValueError(f"--threads must be >= 1, got {given}")
        return given
    if default is not None:
        return default
    from .training.threads import free_cores

    free = free_cores()
    if free is None:
        return None
    if os.environ.get("RANK", "0") == "0":
        logging.getLogger("sinkformer").info(
            "%d torch thread(s): other processes keep %.1f of this machine's cores busy (--threads N to choose)", *free)
    return free[0]


@contextlib.contextmanager
def _torch_threads(threads: int | None):
    """Run the block with ``threads`` torch threads (``None``: as set), then restore the setting."""
    import torch

    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _cmd_run(args: argparse.Namespace) -> int:
    from .runs.registry import get, parse_overrides, run_experiment
    from .runs.suite import run_suite
    from .training.allocator import keep_freed_memory

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
        if args.time_limit is not None and not args.time_limit > 0:
            raise ValueError(f"--time-limit must be a positive number of minutes, got {args.time_limit:g}")
    else:
        for flag, value in (("--jobs", args.jobs), ("--time-limit", args.time_limit)):
            if value is not None:
                raise ValueError(f"{flag} only applies to the suite (sinkformer run without NAME)")
        overrides = parse_overrides(args.set or [], get(args.name).defaults)
    keep_freed_memory()  # the workers of the suite set it too
    # quick runs: one thread (small models gain little from more, and lose most when the cores are shared)
    with _torch_threads(_threads(args.threads, None if args.full else 1)):
        if args.name is None:
            jobs = args.jobs or min(2, os.cpu_count() or 1)
            path = run_suite(args.runs_dir, seeds=args.seeds, jobs=jobs, time_limit=args.time_limit)
            print(f"summary report: {path.resolve()}\n                {path.with_suffix('.html').resolve()}")
            return 0
        try:
            ctx = run_experiment(
                args.name, full=args.full, data=args.data, seeds=args.seeds, overrides=overrides,
                runs_dir=args.runs_dir, device=args.device,
            )
        except KeyboardInterrupt:
            raise KeyboardInterrupt(_kept_of_experiment(args)) from None
    print(f"report: {(ctx.out_dir / 'report.md').resolve()}")
    return 0


def _kept_of_experiment(args: argparse.Namespace) -> str:
    """What an interrupted ``sinkformer run NAME`` kept: its newest run folder, without a report."""
    parent = Path(args.runs_dir) / args.name
    folders = sorted(p for p in parent.iterdir() if p.is_dir()) if parent.is_dir() else []
    if not folders or (folders[-1] / "report.md").exists():
        return "interrupted: nothing kept"
    kept = ", ".join(sorted(p.name for p in folders[-1].iterdir())) or "nothing in it"
    return f"interrupted: kept the unfinished run folder {folders[-1]} ({kept}; no report)"


def _cmd_train(args: argparse.Namespace) -> int:
    from .training.allocator import keep_freed_memory
    from .training.runner import check_config, resolve_config, run_training

    dataset, data = _train_data(args)
    config_file = args.config
    if args.resume:
        if args.out is None:
            raise ValueError("--resume needs --out DIR (the run folder to continue)")
        saved = Path(args.out) / "config.yaml"
        if config_file is None and saved.exists():
            config_file = saved
    attention = args.attention
    if args.normalization is not None:
        if attention is not None:
            raise ValueError("--normalization is the old name of --attention: give one of them")
        _warn("train", f"--normalization is the old name of --attention; read as --attention {args.normalization}")
        attention = args.normalization
    config = resolve_config(
        config_file, model=args.model, data=dataset, data_path=data,
        attention=attention, n_iters=args.n_iters, sets=args.set or [],
    )
    try:
        check_config(config)
    except TypeError as err:  # an option of the wrong type is a user mistake too
        raise ValueError(str(err)) from None
    more = {"overwrite": True} if args.overwrite else {}
    if args.allow_schedule_changes:
        if not args.resume:
            raise ValueError("--allow-schedule-changes only applies with --resume")
        more["allow_schedule_changes"] = True
    callbacks = []
    if args.threads is None:  # follow the other processes' load while training
        from .training.threads import FollowFreeCores

        callbacks.append(FollowFreeCores())
    keep_freed_memory()
    with _torch_threads(_threads(args.threads)):
        result = run_training(config, out_dir=args.out, resume=args.resume, callbacks=callbacks, **more)
    if os.environ.get("RANK", "0") == "0":
        final = ", ".join(f"{k} {v:.4g}" for k, v in result.final.items() if k.startswith("test_"))
        print(f"done: {final}; metrics, checkpoints and weights in {result.out_dir}")
    return 0


def _cmd_predict(args: argparse.Namespace) -> int:
    from .load import load_run, predict

    run = load_run(args.run_dir, epoch=args.epoch)
    kind = run.info.get("kind")
    if kind not in ("tokens", "translation") or run.tokenizer is None:
        raise ValueError(f"{args.run_dir} is a {kind!r} run: `sinkformer predict` reads text (text classifiers and "
                         "translation); for images, point clouds and token ids use sinkformer.load_run and "
                         "sinkformer.predict from Python")
    inputs = [tuple(text.split(args.pair_separator, 1)) for text in args.inputs] if args.pair_separator else args.inputs
    for text, output in zip(args.inputs, predict(run, inputs)):
        print(f"{text}\t{output}")
    return 0


def _train_data(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """``(dataset name, data path)`` of ``sinkformer train``, from ``--dataset``/``--data`` or the old
    spellings ``--data NAME`` and ``--data-path PATH`` (accepted with a warning)."""
    dataset, data = args.dataset, args.data
    if data is not None and dataset is None and _names_a_dataset(data):
        _warn("train", f"--data {data}: a dataset name is given with --dataset now (--data is the dataset's "
                       f"folder); read as --dataset {data}")
        dataset, data = data, None
    if args.data_path is not None:
        if data is not None:
            raise ValueError("--data-path is the old name of --data (the dataset's folder): give one of them")
        _warn("train", f"--data-path is the old name of --data; read as --data {args.data_path}")
        data = args.data_path
    return dataset, data


def _names_a_dataset(value: str) -> bool:
    from .data import DATASETS

    return value in DATASETS and not Path(value).exists()


def _warn(command: str, message: str) -> None:
    if os.environ.get("RANK", "0") == "0":  # once under torchrun
        print(f"sinkformer {command}: warning: {message}", file=sys.stderr)


class _TrainHelp(argparse.Action):
    """``sinkformer train --help``: the flags, then every model, dataset and train option (imported lazily)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from .training.runner import describe_options

        parser.print_help()
        print("\n" + describe_options())
        parser.exit()


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every option's default shown once: ``(default: X)`` is added to a help text unless the text
    already speaks of its default, or there is nothing to show (``None``, a flag's ``False``).
    Descriptions and epilogs are printed as written (examples keep their lines)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or any(action.default is nothing for nothing in (None, False, argparse.SUPPRESS)):
            return text
        return f"{text} (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """argparse's parser whose "invalid choice" errors (a mistyped command) suggest the closest names."""

    def error(self, message: str):
        match = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if match:
            hint = did_you_mean(match.group(1), re.findall(r"'([^']*)'", match.group(2)))
            if hint:
                message = f"{message}; {hint.strip()}"
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="sinkformer",
        description="Doubly stochastic attention: Sinkformers, Sparse Sinkhorn Attention,\n"
                    "Transformers as particles. The papers' experiments and a trainer.",
        epilog="`sinkformer COMMAND --help` shows the options of a command.",
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"sinkformer {__version__}")
    sub = parser.add_subparsers(title="commands", dest="command", metavar="COMMAND")

    demo = sub.add_parser(
        "demo",
        help="K0, K1 (SoftMax) and Kinf (Sinkhorn) on two point clouds (paper Figure 1)",
        description="Figure 1 of the Sinkformers paper: the attention matrices K0 = exp(C),\n"
                    "K1 = SoftMax(C) and Kinf = Sinkhorn(C) of two random point clouds, as a table\n"
                    "and a PNG figure.",
        formatter_class=_HelpFormatter,
    )
    demo.add_argument("--points", type=int, default=10, metavar="N", help="points per cloud")
    demo.add_argument("--seed", type=int, default=0, metavar="N", help="random seed")
    demo.add_argument("--out", default="runs/demo/normalizations.png", metavar="PNG", help="where to write the figure")
    demo.set_defaults(func=_cmd_demo)

    listing = sub.add_parser(
        "experiments",
        help="list the experiments with their expected run time",
        description="The experiments of `sinkformer run NAME`: the expected time of the quick form\n"
                    "here, the GPU-hours of the paper's configuration (--full), what each reproduces.",
        formatter_class=_HelpFormatter,
    )
    listing.set_defaults(func=_cmd_experiments)

    run = sub.add_parser(
        "run",
        help="run one experiment (runs/NAME/<timestamp>/: config, metrics, results, figures, report), "
             "or with no NAME the quick form of all of them and a summary report (runs/summary/<timestamp>/)",
        description="Run one experiment of the papers into runs/NAME/<timestamp>/: config, metrics,\n"
                    "results, figures, report.md and report.html. Without --full it runs the quick\n"
                    "form: small models on embedded data, minutes on a CPU. Without NAME: the quick\n"
                    "form of every experiment, and a summary report in runs/summary/<timestamp>/.",
        epilog="examples:\n"
               "  sinkformer run                      every experiment, quick form, and a summary\n"
               "  sinkformer run vit                  one experiment, quick form\n"
               "  sinkformer run vit --set n_iters=5  the same, with a setting changed\n"
               "  sinkformer run vit --full --data ~/data/cats_dogs --device cuda\n"
               "                                      the paper's configuration on the real data",
        formatter_class=_HelpFormatter,
    )
    run.add_argument("name", nargs="?", default=None, metavar="NAME",
                     help="experiment name (see `sinkformer experiments`); without it: every experiment, quick form")
    run.add_argument("--full", action="store_true",
                     help="the paper's configuration (usually with --data); without it: the quick form")
    run.add_argument("--data", default=None, metavar="PATH",
                     help="folder (or file) of the real dataset, for --full (default: the embedded data)")
    run.add_argument("--seeds", type=int, default=None, metavar="N", help="number of seeds (default: the experiment's)")
    run.add_argument("--set", action="append", metavar="KEY=VALUE",
                     help="override a configuration key (a YAML value; repeatable), e.g. --set n_iters=5 "
                          "or --set train.lr=1e-3")
    run.add_argument("--runs-dir", default="runs", metavar="DIR", help="where run folders go")
    run.add_argument("--threads", type=int, default=None, metavar="N",
                     help="torch CPU threads (default: 1 for quick runs, whose small models gain little from "
                          "more threads and slow down sharply when other processes share the cores; for --full, "
                          "one per core that other processes leave free)")
    run.add_argument("--jobs", type=int, default=None, metavar="N",
                     help="without NAME: experiments run at once, one process each (default: min(2, CPU cores))")
    run.add_argument("--time-limit", type=float, default=None, metavar="MIN",
                     help="without NAME: stop an experiment that runs longer than MIN minutes and report it as "
                          "failed (default: no limit; an experiment that shows no progress for "
                          "20 minutes is stopped as stalled)")
    run.add_argument("--device", default="auto",
                     help="where the models train: auto (CUDA when present, else the CPU), cpu, cuda, cuda:1, ...")
    run.set_defaults(func=_cmd_run)

    train = sub.add_parser(
        "train",
        help="train a model on a dataset (embedded or real); also under torchrun for several processes",
        description="Train a model on a dataset into a run folder (config, metrics, checkpoints,\n"
                    "weights). Options come from a config file (a path, or the name of a shipped one),\n"
                    "then the flags, then --set "
                    "(later wins); every model and dataset, with its options, is listed below.",
        epilog="examples:\n"
               "  sinkformer train --model vit --dataset digits --attention softmax\n"
               "  sinkformer train --model sinkhorn_classifier --dataset sentiment --attention sparse:8\n"
               "  sinkformer train --config vit_cats_dogs --data ~/data/cats_dogs\n"
               "  torchrun --standalone --nproc_per_node=2 -m sinkformer train --model vit --dataset digits",
        formatter_class=_HelpFormatter,
        add_help=False,
    )
    train.add_argument("-h", "--help", action=_TrainHelp, help="show this help with every option and its default")
    train.add_argument("--model", default=None, metavar="NAME", help="model name (model.name; listed below)")
    train.add_argument("--dataset", default=None, metavar="NAME", help="dataset name (data.name; listed below)")
    train.add_argument("--data", default=None, metavar="PATH",
                       help="folder (or file) of a real dataset (data.path); embedded datasets take none")
    train.add_argument("--data-path", default=None, help=argparse.SUPPRESS)  # the old name of --data
    train.add_argument("--attention", default=None, metavar="SPEC",
                       help="model.attention: softmax (Transformer) or sinkhorn (Sinkformer), and for the Sparse "
                            "Sinkhorn models local:B, fixed:B, sparse:B, sortcut:KxB, mixture:B (default: the model's)")
    train.add_argument("--normalization", default=None, help=argparse.SUPPRESS)  # the old name of --attention
    train.add_argument("--n-iters", type=int, default=None, metavar="N",
                       help="model.n_iters: Sinkhorn normalisations of sinkhorn attention (default: the model's, 5)")
    train.add_argument("--config", default=None, metavar="FILE",
                       help="YAML or TOML file with model, data and train sections, or the name of a shipped one: "
                            + ", ".join(config_names()))
    train.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE",
                       help="override one option, e.g. train.lr=1e-4 or model.dim=64 (a YAML value; repeatable)")
    train.add_argument("--out", default=None, metavar="DIR",
                       help="run folder (default: runs/train/<model>-<attention>-<dataset>-<time>)")
    train.add_argument("--resume", action="store_true",
                       help="continue from the newest checkpoint in --out, with the run's own options (other model, "
                            "data or optimisation options are refused)")
    train.add_argument("--allow-schedule-changes", action="store_true",
                       help="with --resume: allow options that only change how the run goes on (more epochs, "
                            "evaluation and checkpoint intervals, the device; recorded in resumes.jsonl)")
    train.add_argument("--threads", type=int, default=None, metavar="N",
                       help="torch CPU threads (default: one per core that other processes leave free, "
                            "followed while training)")
    train.add_argument("--overwrite", action="store_true",
                       help="replace the run already in --out (deletes only the files a run writes)")
    train.set_defaults(func=_cmd_train)

    predicting = sub.add_parser(
        "predict",
        help="predict with a trained run folder: classify or translate sentences",
        description="Load a run folder written by `sinkformer train` (weights, configuration,\n"
                    "tokenizer) and print one prediction per input: the class of a sentence\n"
                    "(text classifiers) or its translation (translation models). Images and point\n"
                    "clouds: use sinkformer.load_run and sinkformer.predict from Python.",
        epilog="examples:\n"
               "  sinkformer train --model text_classifier --dataset sentiment --set train.epochs=3 --out runs/sentiment\n"
               "  sinkformer predict runs/sentiment \"a superb film\" \"the cast was dull\"",
        formatter_class=_HelpFormatter,
    )
    predicting.add_argument("run_dir", metavar="RUN_DIR", help="a run folder of `sinkformer train`")
    predicting.add_argument("inputs", nargs="+", metavar="TEXT", help="sentences to classify or translate")
    predicting.add_argument("--epoch", type=int, default=None, metavar="N",
                            help="use the checkpoint of epoch N (default: the final weights)")
    predicting.add_argument("--pair-separator", default=None, metavar="SEP",
                            help="split each input into a (premise, hypothesis) pair at SEP (NLI runs: "
                                 "\"premise ||| hypothesis\" --pair-separator \" ||| \")")
    predicting.set_defaults(func=_cmd_predict)
    parser.commands = sub.choices  # name -> subparser, for the suggestions of main()
    return parser


def _unrecognized(parser: argparse.ArgumentParser, args: argparse.Namespace, extra: list[str]) -> str:
    """argparse's "unrecognized arguments" message, with the closest options of the command."""
    command = parser.commands.get(getattr(args, "command", None) or "", parser)
    options = [o for action in command._actions for o in action.option_strings
               if o.startswith("--") and action.help is not argparse.SUPPRESS]
    hints = []
    for arg in extra:
        flag = arg.split("=", 1)[0]
        if flag == "--quick" and command is not parser and command.prog.endswith(" run"):
            hints.append("--quick is gone: the quick form is what runs without --full")
        elif flag.startswith("--") and (hint := did_you_mean(flag, options)):
            hints.append(f"{flag}: {hint.strip()}")
    return f"unrecognized arguments: {' '.join(extra)}" + (f" ({'; '.join(hints)})" if hints else "")


#: the extra each command needs (its packages are checked before it starts)
EXTRA_OF = {"demo": "experiments", "experiments": "experiments", "run": "experiments", "train": "train",
            "predict": "train"}


class _AboveBars(logging.StreamHandler):
    """Writes log lines to stderr above any tqdm progress bar (``tqdm.write``), so a bar is not torn."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm
        except ImportError:  # no bars without tqdm either
            return super().emit(record)
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # as logging.StreamHandler does
            self.handleError(record)


def _show_library_logs() -> None:
    """The library logs quietly (``logging``, no handler); the command shows its INFO messages."""
    logger = logging.getLogger("sinkformer")
    if not logger.handlers:
        handler = _AboveBars(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def _run(argv: list[str] | None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        command = parser.commands.get(getattr(args, "command", None) or "", parser)
        command.error(_unrecognized(parser, args, extra))
    if not hasattr(args, "func"):
        parser.print_help()
        return 0
    _show_library_logs()
    try:
        require_extra(EXTRA_OF[args.command], f"sinkformer {args.command}")
        return args.func(args)
    except (ValueError, FileNotFoundError, MissingExtra) as err:  # user mistakes: one clear line, no traceback
        print(f"sinkformer {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:  # Ctrl-C: one line, what was kept (the work says it), no traceback
        if os.environ.get("RANK", "0") == "0":
            print(f"\nsinkformer {args.command}: {err or 'interrupted'}", file=sys.stderr)
        return 130


def main(argv: list[str] | None = None) -> int:
    """The ``sinkformer`` command: parse ``argv`` (default: ``sys.argv[1:]``), run it; the exit code."""
    try:
        return _run(argv)
    except KeyboardInterrupt:  # Ctrl-C before a command started (while importing, parsing)
        print("\nsinkformer: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (``sinkformer train --help | head``): quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 1


if __name__ == "__main__":
    sys.exit(main())
