"""The experiment registry and the run folder every experiment writes into.

An experiment is a function ``run(ctx: Run) -> None`` registered with :func:`register`. It reads
its configuration from ``ctx.config`` (defaults, overridden by ``--full`` and ``--set``), logs
per-step/per-epoch rows with :meth:`Run.log`, saves figures with :meth:`Run.save_figure`, stores
its final numbers in ``ctx.results`` and writes its ``report.md`` with :meth:`Run.write_report`.

Modules of :mod:`sinkformer.experiments` are discovered automatically: adding a module that calls
:func:`register` at import time is all it takes to appear in ``sinkformer experiments``. Modules
must import heavy dependencies (matplotlib, datasets) inside functions, so that listing stays fast.

Each run writes ``runs/NAME/<timestamp>/``: ``config.yaml``, ``provenance.json``, ``metrics.csv``,
``results.json``, PNG figures, ``report.md`` and ``report.html`` (the same report, figures embedded).
:func:`markdown_table` formats a report's tables; :func:`render_html` turns a report into one
self-contained page.
"""

from __future__ import annotations

import csv
import importlib
import json
import math
import os
import pkgutil
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


from .._optional import require
from .._options import did_you_mean
from ..plotting import save_png
from ..provenance import provenance
from .report import atomic_write, new_run_dir, render_html

yaml = require("yaml", "run configurations")

__all__ = ["Experiment", "Run", "register", "registry", "get", "parse_overrides", "run_experiment", "on_log",
           "on_progress", "progress_beat", "on_device"]


@dataclass(frozen=True)
class Experiment:
    """A registered experiment.

    Attributes:
        name: command-line name (``sinkformer run NAME``).
        description: one line for ``sinkformer experiments``.
        paper: which figure/table of which paper it reproduces.
        quick_minutes: expected run time of the quick (embedded-data) configuration on 2 CPU cores.
        full_minutes: expected run time of ``--full`` (``None``: no separate full configuration).
        defaults: the quick configuration (every key a user may ``--set``).
        full: overrides applied by ``--full``.
        run: the function doing the work.
        cost: ``config -> [Workload]``, the models a configuration trains, for the GPU-hour
            estimate of :mod:`sinkformer.runs.cost` (``None``: runs on the CPU, no GPU needed).
    """

    name: str
    description: str
    paper: str
    quick_minutes: float
    full_minutes: float | None
    defaults: dict[str, Any]
    full: dict[str, Any]
    run: Callable[["Run"], None]
    cost: Callable[[dict], list] | None = None


_REGISTRY: dict[str, Experiment] = {}
_DISCOVERED = False


def register(
    name: str,
    *,
    description: str,
    paper: str,
    quick_minutes: float,
    full_minutes: float | None = None,
    defaults: dict[str, Any] | None = None,
    full: dict[str, Any] | None = None,
    cost: Callable[[dict], list] | None = None,
) -> Callable[[Callable[["Run"], None]], Callable[["Run"], None]]:
    """Decorator registering ``run(ctx)`` as experiment ``name``."""

    def decorate(fn: Callable[["Run"], None]) -> Callable[["Run"], None]:
        if name in _REGISTRY and _REGISTRY[name].run.__module__ != fn.__module__:
            raise ValueError(f"experiment {name!r} is registered twice ({_REGISTRY[name].run.__module__}, {fn.__module__})")
        defaults_ = dict(defaults or {})
        unknown = set(full or {}) - set(defaults_)
        if unknown:
            raise ValueError(f"experiment {name!r}: full overrides {sorted(unknown)} are not keys of its defaults")
        _REGISTRY[name] = Experiment(name, description, paper, quick_minutes, full_minutes, defaults_, dict(full or {}), fn,
                                     cost)
        return fn

    return decorate


#: The experiment groups, one package per paper family under :mod:`sinkformer.experiments`.
GROUPS = ("sinkformers", "sparse", "dynamics")


def _discover() -> None:
    """Import every experiment module (``sinkformer.experiments.GROUP.MODULE``, not ``_private``)."""
    global _DISCOVERED
    if _DISCOVERED:
        return
    for group in GROUPS:
        package = importlib.import_module(f"sinkformer.experiments.{group}")
        for info in pkgutil.iter_modules(package.__path__):
            if not info.name.startswith("_"):
                importlib.import_module(f"{package.__name__}.{info.name}")
    _DISCOVERED = True


def registry() -> dict[str, Experiment]:
    """All registered experiments, by name (imports the experiment modules on first call)."""
    _discover()
    return dict(sorted(_REGISTRY.items()))


def get(name: str) -> Experiment:
    experiments = registry()
    if name not in experiments:
        raise ValueError(f"unknown experiment {name!r}; {did_you_mean(name, experiments)}"
                         f"valid names: {', '.join(experiments)}")
    return experiments[name]


def parse_overrides(pairs: Iterable[str], defaults: dict[str, Any]) -> dict[str, Any]:
    """``["lr=1e-3", "n_iters=[1,3]", "train.epochs=5"]`` -> dict, values parsed as YAML, keys checked
    against ``defaults``. ``KEY.SUB=value`` sets one entry of a mapping option (kept as the dotted
    key; :func:`run_experiment` merges it into the mapping)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise ValueError(f"--set expects key=value, got {pair!r}")
        key, raw = pair.split("=", 1)
        key = key.strip()
        top, dot, sub = key.partition(".")
        if top not in defaults:
            raise ValueError(f"--set {key}: unknown option; {did_you_mean(top, defaults)}valid keys: "
                             f"{', '.join(sorted(defaults))}")
        if dot and not (sub and isinstance(defaults[top], dict)):
            raise ValueError(f"--set {key}: {top} is not a mapping option; use --set {top}=VALUE")
        out[key] = yaml.safe_load(raw)
    return out


def _apply_overrides(config: dict[str, Any], overrides: dict[str, Any]) -> None:
    """``config.update(overrides)``, where a dotted key ``"train.epochs"`` updates one mapping entry."""
    for key, value in overrides.items():
        top, dot, sub = key.partition(".")
        if dot:
            config[top] = {**config[top], sub: value}
        else:
            config[key] = value


#: Called as ``listener(run, row)`` after every :meth:`Run.log` (see :func:`on_log`).
_LOG_LISTENERS: list[Callable[["Run", dict[str, Any]], None]] = []


@contextmanager
def on_log(listener: Callable[["Run", dict[str, Any]], None]) -> Iterator[None]:
    """Call ``listener(run, row)`` after every row any :class:`Run` logs in the block (the suite counts
    them to show each running experiment's progress). A listener must not raise."""
    _LOG_LISTENERS.append(listener)
    try:
        yield
    finally:
        _LOG_LISTENERS.remove(listener)


#: Called as ``listener()`` at every sign of progress (see :func:`on_progress`).
_PROGRESS_LISTENERS: list[Callable[[], None]] = []


@contextmanager
def on_progress(listener: Callable[[], None]) -> Iterator[None]:
    """Call ``listener()`` at every sign of progress in the block: each row a :class:`Run` logs and each
    optimisation step of :func:`~sinkformer.runs.training.fit` (the suite's stall detector listens). A
    listener must be cheap and must not raise."""
    _PROGRESS_LISTENERS.append(listener)
    try:
        yield
    finally:
        _PROGRESS_LISTENERS.remove(listener)


#: The device of the experiment being run (``sinkformer run --device``); ``"auto"``: CUDA when present.
_DEVICE: ContextVar[str] = ContextVar("device", default="auto")


@contextmanager
def on_device(device: str):
    """Every :func:`~.training.fit` in the block trains on ``device`` (unless its options name one)."""
    token = _DEVICE.set(device)
    try:
        yield
    finally:
        _DEVICE.reset(token)


def progress_beat() -> None:
    """Tell the :func:`on_progress` listeners that the running experiment moved on (a step, a row)."""
    for listener in list(_PROGRESS_LISTENERS):
        listener()


@dataclass
class Run:
    """The context an experiment runs in: configuration, output folder, logging helpers."""

    name: str
    config: dict[str, Any]
    out_dir: Path
    quick: bool = True
    data: Path | None = None
    seeds: int = 1
    results: dict[str, Any] = field(default_factory=dict)
    figures: list[Path] = field(default_factory=list)
    _rows: list[dict[str, Any]] = field(default_factory=list)

    def log(self, **row: Any) -> None:
        """Append one row (an epoch, a point of a sweep) to ``metrics.csv``, rewritten each time."""
        self._rows.append(row)
        keys: list[str] = []
        for r in self._rows:
            keys += [k for k in r if k not in keys]
        tmp = self.out_dir / "metrics.csv.tmp"
        with tmp.open("w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=keys)
            writer.writeheader()
            writer.writerows(self._rows)
        tmp.replace(self.out_dir / "metrics.csv")
        progress_beat()
        for listener in list(_LOG_LISTENERS):
            listener(self, row)

    @property
    def rows(self) -> list[dict[str, Any]]:
        return list(self._rows)

    def save_figure(self, fig, name: str) -> Path:
        """Save a matplotlib figure as ``NAME.png`` in the run folder (atomically) and close it."""
        path = save_png(fig, self.out_dir / f"{name}.png")
        self.figures.append(path)
        return path

    def write_report(self, markdown: str) -> Path:
        """Write ``report.md`` and ``report.html``; figures are referenced by relative path (``![..](name.png)``)."""
        title = next((line.lstrip("# ") for line in markdown.splitlines() if line.startswith("# ")), self.name)
        atomic_write(self.out_dir / "report.html", render_html(markdown, self.out_dir, title))
        return atomic_write(self.out_dir / "report.md", markdown)


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if hasattr(x, "item") and callable(x.item) and getattr(x, "ndim", 1) == 0:
        return x.item()
    if hasattr(x, "tolist"):
        return x.tolist()
    if isinstance(x, Path):
        return str(x)
    return x


def run_experiment(
    name: str,
    *,
    full: bool = False,
    data: str | os.PathLike | None = None,
    seeds: int | None = None,
    overrides: dict[str, Any] | None = None,
    runs_dir: str | os.PathLike = "runs",
    command: str | None = None,
    device: str = "auto",
) -> Run:
    """Run experiment ``name`` and write its folder; returns the finished :class:`Run`.

    The folder gets ``config.yaml``, ``provenance.json`` (code version, libraries, machine, threads,
    device and ``command`` — by default this process's command line), ``metrics.csv``,
    ``results.json``, figures and ``report.md``/``report.html``. ``device``: where every model trains
    (``"auto"``: CUDA when present, else the CPU)."""
    exp = get(name)
    config = dict(exp.defaults)
    if full:
        config.update(exp.full)
    _apply_overrides(config, overrides or {})
    if seeds is not None:
        if seeds < 1:
            raise ValueError(f"--seeds must be >= 1, got {seeds}")
        config["seeds"] = seeds
    if data is not None:
        data = Path(data)
        if not data.exists():
            raise FileNotFoundError(f"--data {data}: no such file or folder")
    out_dir = new_run_dir(Path(runs_dir) / name)
    ctx = Run(name, config, out_dir, quick=not full, data=data, seeds=int(config.get("seeds", 1)))
    meta = {"experiment": name, "mode": "full" if full else "quick", "data": str(data) if data else "embedded",
            "device": device}
    atomic_write(out_dir / "config.yaml", yaml.safe_dump({**meta, **_jsonable(config)}, sort_keys=False))
    atomic_write(out_dir / "provenance.json", json.dumps(provenance(command), indent=2))
    start = time.perf_counter()
    with on_device(device):
        exp.run(ctx)
    ctx.results.setdefault("wall_seconds", round(time.perf_counter() - start, 2))
    atomic_write(out_dir / "results.json", json.dumps(_jsonable(ctx.results), indent=2))
    if not (out_dir / "metrics.csv").exists():
        ctx.log(**{k: v for k, v in _jsonable(ctx.results).items() if not isinstance(v, (dict, list))})
    if not (out_dir / "report.md").exists():
        raise RuntimeError(f"experiment {name!r} finished without writing report.md")
    return ctx
