"""The summary suite: the quick form of every registered experiment, and one report about them all.

``sinkformer run`` (no experiment name) calls :func:`run_suite`: each registered experiment runs
in its quick configuration on embedded data (one after the other, with its progress shown), and
``runs/summary/<timestamp>/`` receives

* ``report.md`` — an overview table (status, run time, whether the run goes in the direction of
  the paper's finding, a link to the experiment's own folder), the "paper found / this run found"
  findings side by side, the errors of failed experiments, then every experiment's report
  (figures linked by relative path);
* ``report.html`` — the same page with the figures embedded, to open in a browser.

An experiment that fails is recorded with its error and the suite goes on with the next one; so
is one that runs past its time limit (``limit_factor`` × its expected quick run time, at least
``min_limit`` seconds), which keeps the suite's total bounded.
"""

from __future__ import annotations

import datetime as _dt
import os
import re
import signal
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..plotting import pyplot
from .registry import _atomic_write, _new_run_dir, markdown_table, registry, render_html, run_experiment

__all__ = ["SuiteEntry", "ExperimentTimeout", "run_suite", "summary_markdown"]


@dataclass
class SuiteEntry:
    """The outcome of one experiment of the suite."""

    name: str
    paper: str
    expected_minutes: float
    seconds: float
    out_dir: Path | None = None
    error: str | None = None
    results: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error is None


def run_suite(
    runs_dir: str | os.PathLike = "runs",
    *,
    names: list[str] | None = None,
    seeds: int | None = None,
    overrides: dict[str, dict[str, Any]] | None = None,
    limit_factor: float | None = 3.0,
    min_limit: float = 120.0,
    echo=print,
) -> Path:
    """Run the quick form of the experiments ``names`` (default: all registered) and write the summary.

    Args:
        runs_dir: where run folders go (``runs_dir/NAME/<timestamp>/``, ``runs_dir/summary/<timestamp>/``).
        seeds: number of seeds for every experiment (default: each experiment's own).
        overrides: per experiment name, configuration overrides (as ``run_experiment(overrides=)``).
        limit_factor, min_limit: an experiment is stopped (and reported as failed) after
            ``max(min_limit, limit_factor * 60 * quick_minutes)`` seconds; ``None``: no limit.
        echo: where progress lines go.

    Returns the path of the summary ``report.md``.
    """
    experiments = registry()
    names = list(experiments) if names is None else names
    unknown = [n for n in names if n not in experiments]
    if unknown:
        raise ValueError(f"unknown experiment(s) {', '.join(unknown)}; valid names: {', '.join(experiments)}")
    started, clock = _dt.datetime.now(), time.perf_counter()
    summary_dir = _new_run_dir(Path(runs_dir) / "summary")
    expected = sum(experiments[n].quick_minutes for n in names)
    echo(f"sinkformer run: {len(names)} experiments, quick form on embedded data (expected about {expected:.1f} min)")
    entries = []
    for i, name in enumerate(names, 1):
        exp = experiments[name]
        echo(f"\n[{i}/{len(names)}] {name} — {exp.paper}: {exp.description} (expected {exp.quick_minutes:g} min)")
        start = time.perf_counter()
        limit = None if limit_factor is None else max(min_limit, limit_factor * 60 * exp.quick_minutes)
        try:
            with _time_limit(limit):
                ctx = run_experiment(name, seeds=seeds, overrides=(overrides or {}).get(name), runs_dir=runs_dir)
        except Exception as err:  # one failing experiment must not stop the others
            entry = SuiteEntry(name, exp.paper, exp.quick_minutes, time.perf_counter() - start,
                               error=f"{type(err).__name__}: {err}\n\n{traceback.format_exc(limit=-6)}")
            echo(f"[{i}/{len(names)}] {name}: FAILED after {entry.seconds:.0f} s: {type(err).__name__}: {err}")
        else:
            entry = SuiteEntry(name, exp.paper, exp.quick_minutes, time.perf_counter() - start, ctx.out_dir,
                               results=ctx.results)
            echo(f"[{i}/{len(names)}] {name}: done in {entry.seconds:.0f} s -> {ctx.out_dir / 'report.md'}")
        finally:
            _close_figures()
        entries.append(entry)
        echo(f"    elapsed {_minutes(time.perf_counter() - clock)} of the suite")
    markdown = summary_markdown(entries, summary_dir, started, time.perf_counter() - clock)
    _atomic_write(summary_dir / "report.html", render_html(markdown, summary_dir, "sinkformer: summary of the experiments"))
    path = _atomic_write(summary_dir / "report.md", markdown)
    failed = [e.name for e in entries if not e.ok]
    echo(f"\n{len(entries) - len(failed)} of {len(entries)} experiments done in {_minutes(time.perf_counter() - clock)}"
         + (f"; failed: {', '.join(failed)}" if failed else ""))
    return path


def summary_markdown(entries: list[SuiteEntry], summary_dir: Path, started: _dt.datetime, seconds: float) -> str:
    """The summary report: overview, findings, failures, then each experiment's report."""
    import torch

    verdicts = {True: "yes", False: "no", None: "tie"}
    overview = markdown_table(
        ["experiment", "paper", "direction of the paper's finding reproduced", "time", "expected", "status"],
        [[f"[{e.name}]({_rel(e.out_dir / 'report.md', summary_dir)})" if e.ok else e.name, e.paper,
          verdicts[e.results["finding"]["reproduced"]] if "finding" in e.results else "—",
          f"{e.seconds:.0f} s", f"{60 * e.expected_minutes:.0f} s", "ok" if e.ok else "**failed**"]
         for e in entries],
    )
    parts = [
        "# sinkformer: the papers' experiments, quick form",
        f"*Produced by `sinkformer run` on {started:%Y-%m-%d %H:%M}: {len(entries)} experiments in "
        f"{_minutes(seconds)} on {os.cpu_count()} CPU core(s), torch {torch.__version__} with "
        f"{torch.get_num_threads()} thread(s). Quick configurations on embedded data: small models, few epochs — "
        f"they test the direction of each finding, not the papers' numbers (`sinkformer run NAME --full --data PATH` "
        f"runs a paper's configuration).*",
        "## Overview",
        overview,
    ]
    found = [e for e in entries if "finding" in e.results]
    if found:
        parts += ["## Paper vs these runs", markdown_table(
            ["experiment", "the paper found", "this run found", "reproduced"],
            [[e.name, e.results["finding"]["paper"], e.results["finding"]["this_run"],
              verdicts[e.results["finding"]["reproduced"]]] for e in found])]
    failed = [e for e in entries if not e.ok]
    if failed:
        parts.append("## Failures")
        parts += [f"### {e.name}\n\n```\n{e.error.strip()}\n```" for e in failed]
    for e in entries:
        if e.ok and (e.out_dir / "report.md").exists():
            parts.append(_embedded_report(e.out_dir, summary_dir))
    return "\n\n".join(parts) + "\n"


def _embedded_report(out_dir: Path, summary_dir: Path) -> str:
    """An experiment's ``report.md`` one heading level down, its figure links relative to ``summary_dir``."""
    lines, fenced = [], False
    for line in (out_dir / "report.md").read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif line.startswith("#") and not fenced:
            line = "#" + line
        lines.append(line)

    def relink(match: re.Match) -> str:
        target = match.group(2)
        if re.match(r"^[a-z]+:|^/", target):
            return match.group(0)
        return f"![{match.group(1)}]({_rel(out_dir / target, summary_dir)})"

    body = re.sub(r"!\[([^\]]*)\]\(([^)\s]+)\)", relink, "\n".join(lines))
    return f"{body}\n\n*Run folder: `{out_dir}`*"


class ExperimentTimeout(Exception):
    """An experiment of the suite ran past its time limit."""


@contextmanager
def _time_limit(seconds: float | None) -> Iterator[None]:
    """Raise :class:`ExperimentTimeout` in the block after ``seconds`` (Unix main thread; else no limit)."""
    if seconds is None or not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise ExperimentTimeout(f"stopped after {seconds:g} s, the suite's time limit for this experiment")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _rel(path: Path, start: Path) -> str:
    return Path(os.path.relpath(path, start)).as_posix()


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {seconds % 60:02.0f} s"


def _close_figures() -> None:
    """Close figures an experiment left open (after a failure), so they do not pile up."""
    pyplot().close("all")
