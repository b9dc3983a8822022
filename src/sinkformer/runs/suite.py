"""The summary suite: the quick form of every registered experiment, and one report about them all.

``sinkformer run`` (no experiment name) calls :func:`run_suite`: each registered experiment runs
in its quick configuration on embedded data (one after the other, with its progress shown), and
``runs/summary/<timestamp>/`` receives

* ``summary.json`` — the same as data (entries, comparisons, provenance; see :mod:`.readme`);
* ``report.md`` — an overview table (status, run time, whether the run goes in the direction of
  the paper's finding, a link to the experiment's own folder), the "paper found / this run found"
  findings side by side, the errors of failed experiments, then every experiment's report
  (figures linked by relative path);
* ``report.html`` — the same page with the figures embedded, to open in a browser.

An experiment that fails is recorded with its error and the suite goes on with the next one. Being
slow is not a failure: an experiment is stopped only when it *stalls* — no logged row and no
training step for ``stall_minutes`` (:data:`STALL_MINUTES`) — or, opt-in, when it runs longer than
``time_limit`` minutes (``sinkformer run --time-limit MIN``); both are reported as failed, with why.

The announced time is calibrated on the machine it runs on: a short measurement at the start
(:func:`calibration`, a fraction of a second of training steps of a small Sinkformer layer) is
compared with the same measurement of the committed quick run (``sinkformer/runs/measured/quick-run.json``),
and the committed times are scaled by the ratio. Ctrl-C stops the suite with one line saying which
run folders were kept; no summary is written then.

With ``jobs > 1`` the experiments run in that many worker processes at once (longest expected first;
each worker keeps the parent's torch thread count, so quick runs use one thread per core), and the
report lists them in registry order as always. The announced time is the expected wall time of that
schedule (:func:`expected_wall_minutes`).

Progress: every row an experiment logs (:meth:`~.registry.Run.log`: an epoch of a training run, a
point of a sweep) is counted, in the workers too (sent to the parent on a ``multiprocessing``
manager queue). On a terminal, with ``jobs > 1``, one bar shows experiments done, elapsed time and
what is running with its count (``running: nli (12 epochs, 1:20), sort (0:40)``; the workers' own
bars would overwrite each other, so they are switched off); with ``jobs == 1`` each training run
shows its own bar. When stdout is not a terminal (a log file) the suite writes plain timestamped
lines instead: when an experiment starts and ends, and at most one line per experiment every
``PROGRESS_INTERVAL`` seconds while it runs (``[17:06:40] nli: 30 epochs done, 1 min 28 s so far``).
"""

from __future__ import annotations

import datetime as _dt
import heapq
import json
import logging
import multiprocessing
import os
import queue as _queue
import re
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..plotting import pyplot
from ..provenance import WHAT_CHANGES_RESULTS, provenance
from .._optional import require
from .._options import did_you_mean
from .registry import on_log, on_progress, registry, run_experiment
from .report import atomic_write, markdown_table, new_run_dir, render_html
from .verdicts import VERDICTS, count_verdicts, family_section

__all__ = ["SuiteEntry", "ExperimentStopped", "ExperimentStalled", "ExperimentTimeout", "run_suite", "summary_markdown",
           "expected_wall_minutes", "committed_seconds", "calibration", "STALL_MINUTES"]

logger = logging.getLogger(__name__)

#: Plain (log file) output: at most one progress line per running experiment this often, in seconds ...
PROGRESS_INTERVAL = 30.0
#: ... and a "still running" line after this long without a logged row.
HEARTBEAT_INTERVAL = 120.0
#: An experiment with no sign of progress (no logged row, no training step) for this many minutes has stalled.
STALL_MINUTES = 20.0


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
    time_limit: float | None = None,
    stall_minutes: float | None = STALL_MINUTES,
    jobs: int = 1,
    echo=print,
    plain: bool | None = None,
) -> Path:
    """Run the quick form of the experiments ``names`` (default: all registered) and write the summary.

    Args:
        runs_dir: where run folders go (``runs_dir/NAME/<timestamp>/``, ``runs_dir/summary/<timestamp>/``).
        seeds: number of seeds for every experiment (default: each experiment's own).
        overrides: per experiment name, configuration overrides (as ``run_experiment(overrides=)``).
        time_limit: minutes after which an experiment is stopped and reported as failed (``None``, the
            default: no limit — a slow experiment is never a failure).
        stall_minutes: an experiment with no sign of progress (no logged row, no training step) for
            this many minutes is stopped and reported as stalled (``None``: never).
        jobs: experiments run at once, each in its own process (1: one after the other, in this
            process; experiments registered at run time, as in tests, exist only here).
        echo: where progress lines go.
        plain: timestamped progress lines instead of a redrawn progress bar (for a log file); default:
            when stdout is not a terminal.

    Returns the path of the summary ``report.md``. Ctrl-C (``KeyboardInterrupt``) stops the running
    experiments and is raised again with a message saying which run folders were kept (no summary
    is written).
    """
    experiments = registry()
    names = list(experiments) if names is None else names
    unknown = [n for n in names if n not in experiments]
    if unknown:
        hints = "".join(did_you_mean(n, experiments) for n in unknown)
        raise ValueError(f"unknown experiment(s) {', '.join(unknown)}; {hints}valid names: {', '.join(experiments)}")
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    for option, value in (("time_limit", time_limit), ("stall_minutes", stall_minutes)):
        if value is not None and not value > 0:
            raise ValueError(f"{option} must be a positive number of minutes (or None for no limit), got {value}")
    if plain is None:
        plain = not _isatty(sys.stdout)
    started, clock = _dt.datetime.now(), time.perf_counter()
    measured = calibration()
    echo(_announcement(names, jobs, measured))
    commit = provenance("sinkformer run")["git_commit"]
    if commit.endswith("-dirty"):
        logger.warning("the source tree has uncommitted changes (%s): this run can be read, but not committed as the "
                       "quick-run digest (commit first, then run again)", commit)

    def task(name: str) -> tuple:
        return name, seeds, (overrides or {}).get(name), runs_dir, stall_minutes, time_limit

    done: dict[str, SuiteEntry] = {}
    try:
        if jobs == 1:
            _run_sequential(names, task, clock, echo, plain, done)
        else:
            _run_parallel(names, task, jobs, clock, echo, plain, done)
    except KeyboardInterrupt:
        raise KeyboardInterrupt(_what_was_kept(names, done, Path(runs_dir), started, time.perf_counter() - clock)) from None
    entries = [done[n] for n in names]
    seconds = time.perf_counter() - clock
    summary_dir = new_run_dir(Path(runs_dir) / "summary")  # made at the end: an interrupted suite leaves none
    markdown = summary_markdown(entries, summary_dir, started, seconds, jobs=jobs)
    atomic_write(summary_dir / "summary.json",
                 json.dumps(_summary_json(entries, started, seconds, jobs, measured), indent=1))
    atomic_write(summary_dir / "report.html", render_html(markdown, summary_dir, "sinkformer: summary of the experiments"))
    path = atomic_write(summary_dir / "report.md", markdown)
    failed = [e.name for e in entries if not e.ok]
    echo(f"\n{len(entries) - len(failed)} of {len(entries)} experiments done in {_minutes(time.perf_counter() - clock)}"
         + (f"; failed: {', '.join(failed)}" if failed else ""))
    return path


def committed_seconds(names: Iterable[str]) -> dict[str, float]:
    """Each experiment's time in the committed quick run (``quick-run.json``), or its registered
    ``quick_minutes`` when that run does not have it."""
    from .readme import load_quick_run

    experiments, measured = registry(), load_quick_run()
    return {n: float(measured.get(n, 60 * experiments[n].quick_minutes)) for n in names}


#: Names the calibration's workload: a reference measured with another workload is not comparable.
CALIBRATION_WORKLOAD = "torch-encoder-layer-1"


def calibration(budget: float = 0.4) -> dict[str, Any]:
    """This machine's speed now, for scaling the committed times: ``{"step_ms", "threads", "workload"}``,
    the mean wall time of a training step (forward, backward, Adam) of PyTorch's own
    ``nn.TransformerEncoderLayer`` (width 32, 4 heads, 16 sequences of 32 tokens), over about ``budget``
    seconds after one warm-up step, with torch's current thread count. PyTorch's layer, not this
    library's (a Sinkformer layer until 2026-11-27): the calibration measures the machine, where a step
    of our own engine would also measure the commit, and a reference measured with another workload
    (``"workload"``) is not used. A mean, not a minimum: other processes competing for the cores slow
    it as they slow the experiments. The global random state is left as it was."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        layer = torch.nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True)
        optimizer = torch.optim.Adam(layer.parameters(), lr=1e-3)
        x = torch.randn(16, 32, 32)

        def step() -> None:
            optimizer.zero_grad()
            layer(x).square().mean().backward()
            optimizer.step()

        step()
        steps, start = 0, time.perf_counter()
        while steps < 3 or time.perf_counter() - start < budget:
            step()
            steps += 1
        seconds = time.perf_counter() - start
    return {"step_ms": round(1000 * seconds / steps, 3), "threads": torch.get_num_threads(),
            "workload": CALIBRATION_WORKLOAD}


def _committed_calibration() -> dict[str, Any] | None:
    """The calibration of the committed quick run (``None`` when it has none)."""
    from .readme import DIGEST

    try:
        return json.loads(DIGEST.read_text()).get("calibration")
    except (OSError, ValueError):
        return None


def _announcement(names: list[str], jobs: int, measured: dict[str, Any]) -> str:
    """The first line: how many experiments, and the expected wall time here (committed times scaled
    by this machine's calibration against the committed run's)."""
    seconds = committed_seconds(names)
    reference = _committed_calibration()
    comparable = reference and reference.get("step_ms") and all(
        reference.get(key) == measured.get(key) for key in ("threads", "workload"))
    if comparable:
        factor = measured["step_ms"] / reference["step_ms"]
        scaled = (f"the committed times x {factor:.2g}: a calibration step took {measured['step_ms']:.3g} ms here, "
                  f"{reference['step_ms']:.3g} ms for the committed run")
    else:
        factor, scaled = 1.0, "the committed times, not calibrated: the committed run has no calibration with " \
                              f"{measured['threads']} thread(s) and this workload"
    minutes = [factor * seconds[n] / 60 for n in names]
    wall = expected_wall_minutes(minutes, jobs)
    work = f" with {jobs} processes, {sum(minutes):.1f} min of work" if jobs > 1 else ""
    return (f"sinkformer run: {len(names)} experiments, quick form on embedded data (expected about {wall:.1f} min"
            f"{work}; {scaled})")


def expected_wall_minutes(minutes: Iterable[float], jobs: int) -> float:
    """The expected wall time of running jobs of ``minutes`` on ``jobs`` workers the way the suite does:
    longest first, each to the first worker that is free (the makespan of that schedule).

    >>> expected_wall_minutes([5, 4, 3, 3, 3], jobs=2)  # 5+3, 4+3+3
    10.0
    """
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    loads = [0.0] * jobs
    for m in sorted(minutes, reverse=True):
        heapq.heappush(loads, heapq.heappop(loads) + m)
    return max(loads)


def _run_one(name: str, seeds: int | None, overrides: dict | None, runs_dir, stall_minutes: float | None,
             time_limit: float | None, progress=None) -> SuiteEntry:
    """Run one experiment, watched by the stall detector (and the opt-in time limit); a failure becomes
    an entry with the error.

    ``progress``: where ``(name, rows, epochs)`` go (``progress.put``) as the experiment logs rows."""
    exp = registry()[name]
    start = time.perf_counter()
    counter = _RowCounter(name, progress)
    watchdog = _Watchdog(None if stall_minutes is None else 60 * stall_minutes,
                         None if time_limit is None else 60 * time_limit)
    try:
        with watchdog, on_progress(watchdog.beat), on_log(counter):
            ctx = run_experiment(name, seeds=seeds, overrides=overrides, runs_dir=runs_dir)
    except Exception as err:  # one failing experiment must not stop the others
        return SuiteEntry(name, exp.paper, exp.quick_minutes, time.perf_counter() - start,
                          error=f"{type(err).__name__}: {err}\n\n{traceback.format_exc(limit=-6)}")
    finally:
        counter.flush()
        _close_figures()
    return SuiteEntry(name, exp.paper, exp.quick_minutes, time.perf_counter() - start, ctx.out_dir, results=ctx.results)


def _outcome(entry: SuiteEntry, detail: str = "") -> str:
    detail = f" ({detail})" if detail else ""
    if entry.ok:
        return f"{entry.name}: done in {entry.seconds:.0f} s{detail} -> {entry.out_dir / 'report.md'}"
    return f"{entry.name}: FAILED after {entry.seconds:.0f} s{detail}: {entry.error.splitlines()[0]}"


class _RowCounter:
    """Counts the rows experiment ``name`` logs (and those of them that are epochs, with an ``epoch``
    key); sends ``(name, rows, epochs)`` to ``sink.put`` at most every ``every`` seconds and on
    :meth:`flush`. A sink that fails (the parent went away) is dropped: the experiment goes on.

    By default every row is sent: rows come in bursts (a training run logs its epochs when it ends),
    so a throttle would hold back the end of each burst, and a put costs far less than the row's
    own :meth:`~.registry.Run.log`, which rewrites ``metrics.csv``."""

    def __init__(self, name: str, sink, every: float = 0.0) -> None:
        self.name, self.sink, self.every = name, sink, every
        self.rows = self.epochs = 0
        self.sent, self.sent_at = (0, 0), -float("inf")

    def __call__(self, run, row: dict[str, Any]) -> None:
        self.rows += 1
        self.epochs += "epoch" in row
        if time.perf_counter() - self.sent_at >= self.every:
            self.flush()

    def flush(self) -> None:
        if self.sink is None or (self.rows, self.epochs) == self.sent:
            return
        self.sent, self.sent_at = (self.rows, self.epochs), time.perf_counter()
        try:
            with _alarm_deferred():  # the watchdog's exception must not land inside the queue's protocol
                self.sink.put((self.name, self.rows, self.epochs))
        except ExperimentStopped:
            raise
        except Exception:
            self.sink = None


@contextmanager
def _alarm_deferred() -> Iterator[None]:
    """Hold SIGALRM (the watchdog's) for the block; a pending one is delivered after it."""
    if not hasattr(signal, "pthread_sigmask") or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@dataclass
class _Running:
    start: float
    said_at: float
    rows: int = 0
    epochs: int = 0
    said: tuple[int, int] = (0, 0)

    def counted(self) -> str:
        if self.epochs:
            return f"{self.epochs} epoch{'s' if self.epochs != 1 else ''}"
        return f"{self.rows} row{'s' if self.rows != 1 else ''}" if self.rows else ""


class _Progress:
    """The suite's view of its running experiments, from their logged rows (:class:`_RowCounter`).

    ``plain``: lines go to ``echo`` with a timestamp, and :meth:`update` / :meth:`tick` write a line
    for a running experiment at most every ``PROGRESS_INTERVAL`` s when it logged rows since its last
    line, or after ``HEARTBEAT_INTERVAL`` s when it did not. Otherwise :meth:`postfix` is the text for
    a progress bar."""

    def __init__(self, total: int, echo, plain: bool, clock=time.perf_counter) -> None:
        self.total, self.echo, self.plain, self.clock = total, echo, plain, clock
        self.running: dict[str, _Running] = {}
        self.done = 0

    def say(self, line: str) -> None:
        self.echo(f"[{_dt.datetime.now():%H:%M:%S}] {line}" if self.plain else line)

    def start(self, name: str, line: str) -> None:
        now = self.clock()
        self.running[name] = _Running(now, now)
        self.say(line)

    def put(self, event: tuple[str, int, int]) -> None:
        """``(name, rows, epochs)`` from a :class:`_RowCounter`."""
        self.update(*event)

    def update(self, name: str, rows: int, epochs: int) -> None:
        state = self.running.get(name)
        if state is not None:
            state.rows, state.epochs = rows, epochs
            self._maybe_say(name, state)

    def tick(self) -> None:
        for name, state in list(self.running.items()):
            self._maybe_say(name, state)

    def _maybe_say(self, name: str, state: _Running) -> None:
        if not self.plain:
            return
        now = self.clock()
        since, changed = now - state.said_at, (state.rows, state.epochs) != state.said
        if changed and since >= PROGRESS_INTERVAL:
            done = f"{state.counted()} done" if state.epochs else f"{state.counted()} logged"
            self.say(f"{name}: {done}, {_minutes(now - state.start)} so far")
        elif since >= HEARTBEAT_INTERVAL:
            counted = f" ({state.counted()} done)" if state.counted() else ""
            self.say(f"{name}: still running{counted}, {_minutes(now - state.start)} so far")
        else:
            return
        state.said_at, state.said = now, (state.rows, state.epochs)

    def finish(self, entry: SuiteEntry, suite_clock: float) -> None:
        state = self.running.pop(entry.name, None)
        self.done += 1
        self.say(f"{_outcome(entry, state.counted() if state else '')}  "
                 f"({self.done}/{self.total} done, suite elapsed {_minutes(time.perf_counter() - suite_clock)})")

    def postfix(self) -> str:
        now = self.clock()

        def shown(name: str, state: _Running) -> str:
            seconds = int(now - state.start)
            return f"{name} ({', '.join(filter(None, [state.counted(), f'{seconds // 60}:{seconds % 60:02d}']))})"

        return "running: " + ", ".join(shown(n, s) for n, s in sorted(self.running.items()))


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def _run_sequential(names: list[str], task, clock: float, echo, plain: bool, done: dict[str, SuiteEntry]) -> None:
    """Run ``names`` one after the other in this process, each entry into ``done`` as it ends. On a
    terminal each training run shows its own bar; ``plain``: timestamped start, progress and end lines."""
    experiments = registry()
    progress = _Progress(len(names), echo, plain)
    for i, name in enumerate(names, 1):
        exp = experiments[name]
        about = f"{exp.paper}: {exp.description} (expected {exp.quick_minutes:g} min)"
        if plain:
            progress.start(name, f"started {name} ({i}/{len(names)}) — {about}")
            done[name] = _run_one(*task(name), progress)
            progress.finish(done[name], clock)
        else:
            echo(f"\n[{i}/{len(names)}] {name} — {about}")
            done[name] = _run_one(*task(name))
            echo(f"[{i}/{len(names)}] {_outcome(done[name])}")
            echo(f"    elapsed {_minutes(time.perf_counter() - clock)} of the suite")


def _init_worker(threads: int) -> None:
    """A worker process: the parent's torch thread count and malloc settings
    (:func:`~sinkformer.training.allocator.keep_freed_memory`). Ctrl-C is the parent's to handle, so the
    worker's own copy of the signal is ignored (no traceback from every worker); the parent stops a
    worker with SIGTERM, which ends its experiment with ``SystemExit`` (so that the worker exits the
    normal way, its resources released)."""
    import torch

    from ..training.allocator import keep_freed_memory

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_worker)
    torch.set_num_threads(threads)
    keep_freed_memory()


def _exit_worker(signum, frame) -> None:
    raise SystemExit("stopped by the suite")


def _stop_workers(pool: ProcessPoolExecutor, patience: float = 30.0) -> None:
    """Stop ``pool``: no new experiment starts, the running ones end (SIGTERM; killed when one has not
    ended after ``patience`` seconds), the workers exit."""
    processes = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(patience)
        if process.is_alive():
            process.kill()
            process.join()


def _run_parallel(names: list[str], task, jobs: int, clock: float, echo, plain: bool,
                  done: dict[str, SuiteEntry]) -> None:
    """Run ``names`` on ``jobs`` spawned processes, longest expected first, each entry into ``done`` as it ends.

    The workers send their experiments' row counts on a manager queue, read here every second. On a
    terminal one bar shows them (lines go above it, ``tqdm.write``, when ``echo`` is ``print``, else to
    ``echo``); ``plain``: timestamped lines to ``echo``, no bar. Ctrl-C here ends the workers."""
    import torch
    tqdm = require("tqdm", "the suite's progress bar").tqdm

    expected = committed_seconds(names)
    pending = sorted(names, key=lambda n: -expected[n])
    context = multiprocessing.get_context("spawn")  # no fork of a process that has started torch's threads
    bar = None if plain else tqdm(total=len(names), desc="experiments", unit="exp", dynamic_ncols=True)
    progress = _Progress(len(names), bar.write if bar is not None and echo is print else echo, plain)
    try:
        with context.Manager() as manager, _environment(TQDM_DISABLE="1"), ProcessPoolExecutor(
            jobs, mp_context=context, initializer=_init_worker, initargs=(torch.get_num_threads(),)
        ) as pool:
            try:
                _schedule(pool, pending, task, jobs, manager.Queue(), progress, bar, clock, done)
            except KeyboardInterrupt:
                _stop_workers(pool)
                raise
    finally:
        if bar is not None:
            bar.close()


def _schedule(pool, pending: list[str], task, jobs: int, events, progress: "_Progress", bar, clock: float,
              done: dict[str, SuiteEntry]) -> None:
    """Keep ``jobs`` experiments of ``pending`` running on ``pool`` until all are in ``done``."""
    experiments = registry()
    running = {}
    while pending or running:
        while pending and len(running) < jobs:
            name = pending.pop(0)
            running[pool.submit(_run_one, *task(name), events)] = name, time.perf_counter()
            exp = experiments[name]
            progress.start(name, f"started {name} — {exp.paper} (expected {exp.quick_minutes:g} min)")
        finished, _ = wait(running, timeout=1.0, return_when=FIRST_COMPLETED)
        _drain(events, progress)
        for future in finished:
            name, start = running.pop(future)
            try:
                entry = future.result()
            except Exception as err:  # the task never ran to an entry: worker killed, unpicklable task, ...
                exp = experiments[name]
                entry = SuiteEntry(name, exp.paper, exp.quick_minutes, time.perf_counter() - start,
                                   error=f"the worker process could not run it: {type(err).__name__}: {err}")
            done[name] = entry
            progress.finish(entry, clock)
            if bar is not None:
                bar.set_postfix_str(progress.postfix() if running else "", refresh=False)
                bar.update(1)
        progress.tick()
        if bar is not None:
            bar.set_postfix_str(progress.postfix() if running else "", refresh=False)
            bar.refresh()


def _what_was_kept(names: list[str], done: dict[str, SuiteEntry], runs_dir: Path, started: _dt.datetime,
                   seconds: float) -> str:
    """The one line an interrupted suite ends with: what it kept (finished experiments' folders, the
    partial folders of those it interrupted), and that it wrote no summary."""
    finished = [e.name for e in done.values() if e.ok and e.out_dir is not None]
    partial = [str(folder) for name in names if name not in finished
               for folder in _folders_since(runs_dir / name, started)]
    kept = [f"the folders of {len(finished)} finished experiment(s) under {runs_dir}/ ({', '.join(finished)})"
            if finished else "no finished experiment"]
    if partial:
        kept.append(f"partial folders of unfinished ones: {', '.join(partial)}")
    return f"interrupted after {_minutes(seconds)}, no summary written; kept {'; '.join(kept)}"


def _folders_since(parent: Path, started: _dt.datetime) -> list[Path]:
    """The run folders in ``parent`` made since ``started`` (their names are timestamps)."""
    if not parent.is_dir():
        return []
    stamp = started.strftime("%Y%m%d-%H%M%S")
    return sorted(p for p in parent.iterdir() if p.is_dir() and p.name >= stamp)


def _drain(events, progress: _Progress) -> None:
    """Pass every ``(name, rows, epochs)`` waiting on ``events`` to ``progress``."""
    while True:
        try:
            event = events.get_nowait()
        except _queue.Empty:
            return
        except (OSError, EOFError):  # the manager is gone: no more progress, the results still come
            return
        progress.update(*event)


@contextmanager
def _environment(**values: str) -> Iterator[None]:
    """Set environment variables for the block (inherited by processes started in it)."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def summary_markdown(entries: list[SuiteEntry], summary_dir: Path, started: _dt.datetime, seconds: float,
                     jobs: int = 1) -> str:
    """The summary report: verdicts counted by kind, overview, every paired comparison with its
    interval next to the paper's number, provenance, failures, then each experiment's report."""
    comparisons = [(e.name, c) for e in entries for c in e.results.get("comparisons", [])]
    overview = markdown_table(
        ["experiment", "paper", "verdicts (same / opposite / inconclusive)", "time", "expected", "status"],
        [[f"[{e.name}]({_rel(e.out_dir / 'report.md', summary_dir)})" if e.ok else e.name, e.paper,
          _verdict_counts(e.results.get("comparisons", [])), f"{e.seconds:.0f} s", f"{60 * e.expected_minutes:.0f} s",
          "ok" if e.ok else "**failed**"]
         for e in entries],
    )
    facts = provenance("sinkformer run")
    parts = [
        "# sinkformer: the papers' experiments, quick form",
        f"*Produced by `sinkformer run` on {started:%Y-%m-%d %H:%M}: {len(entries)} experiments in "
        f"{_minutes(seconds)} on {facts['cpu']} ({facts['cpu_count']} CPU core(s)), torch {facts['torch']} with "
        f"{facts['torch_threads']} thread(s){f' in each of {jobs} processes' if jobs > 1 else ''}, sinkformer "
        f"{facts['sinkformer']} at {facts['git_commit']}. Quick configurations on embedded data: small models, few "
        f"epochs — they test the direction of each finding, not the papers' numbers "
        f"(`sinkformer run NAME --full --data PATH` runs a paper's configuration).*",
        "## Verdicts (every comparison, by what it tests)",
        family_section(comparisons, heading="###"),  # the paper claims first, before and after Holm's correction
        "## Overview",
        overview,
    ]
    found = [e for e in entries if "finding" in e.results]
    if found:
        parts += ["## Paper vs these runs, in words", markdown_table(
            ["experiment", "the paper found", "this run found"],
            [[e.name, e.results["finding"]["paper"], e.results["finding"]["this_run"]] for e in found])]
    parts += ["## Reproducibility", WHAT_CHANGES_RESULTS, "```json\n" + json.dumps(facts, indent=2) + "\n```"]
    failed = [e for e in entries if not e.ok]
    if failed:
        parts.append("## Failures")
        parts += [f"### {e.name}\n\n```\n{e.error.strip()}\n```" for e in failed]
    for e in entries:
        if e.ok and (e.out_dir / "report.md").exists():
            parts.append(_embedded_report(e.out_dir, summary_dir))
    return "\n\n".join(parts) + "\n"


def _summary_json(entries: list[SuiteEntry], started: _dt.datetime, seconds: float, jobs: int,
                  calibration: dict[str, Any] | None = None) -> dict:
    """Everything the summary shows, as data (read by :mod:`sinkformer.runs.readme`); ``calibration``:
    this machine's :func:`calibration` at the start, which later runs compare theirs with."""
    return {
        "started": started.isoformat(timespec="seconds"), "seconds": round(seconds, 1), "jobs": jobs,
        "calibration": calibration,
        "provenance": provenance("sinkformer run"),
        "entries": [{"name": e.name, "paper": e.paper, "ok": e.ok, "seconds": round(e.seconds, 1),
                     "out_dir": str(e.out_dir) if e.out_dir else None, "error": e.error,
                     "results": {k: e.results[k] for k in ("comparisons", "finding") if k in e.results}}
                    for e in entries],
    }


def _verdict_counts(comparisons: list[dict]) -> str:
    if not comparisons:
        return "—"
    counts = count_verdicts(comparisons)
    return " / ".join(str(counts[v]) for v in VERDICTS)


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


class ExperimentStopped(Exception):
    """An experiment of the suite was stopped by the suite: it stalled, or ran past the opt-in time limit."""


class ExperimentStalled(ExperimentStopped):
    """An experiment showed no progress (no logged row, no training step) for the stall time."""


class ExperimentTimeout(ExperimentStopped):
    """An experiment ran past the time limit the user asked for (``--time-limit``)."""


class _Watchdog:
    """Stops the experiment running in its block when it stalls — no :meth:`beat` for ``stall`` seconds
    (:class:`ExperimentStalled`) — or, when ``limit`` is given, after ``limit`` seconds in all
    (:class:`ExperimentTimeout`); ``None`` turns either off.

    A beat only stores the time. A SIGALRM timer, armed for the earliest moment either could be due,
    checks and re-arms itself, and its handler raises in the main thread, where the experiment runs.
    Elsewhere (not Unix, not the main thread) the watchdog stops nothing."""

    def __init__(self, stall: float | None, limit: float | None, clock=time.monotonic) -> None:
        self.stall, self.limit, self.clock = stall, limit, clock
        self.start = self.last = clock()
        self.active = False

    def beat(self) -> None:
        self.last = self.clock()

    def _due_in(self) -> float | None:
        now, due = self.clock(), []
        if self.stall is not None:
            due.append(self.last + self.stall)
        if self.limit is not None:
            due.append(self.start + self.limit)
        return max(min(due) - now, 0.01) if due else None

    def _check(self, signum=None, frame=None) -> None:
        now = self.clock()
        if self.limit is not None and now - self.start >= self.limit:
            raise ExperimentTimeout(f"stopped after {_minutes(now - self.start)}: past the time limit of "
                                    f"{_minutes(self.limit)} asked for (--time-limit)")
        if self.stall is not None and now - self.last >= self.stall:
            raise ExperimentStalled(f"stopped after {_minutes(now - self.start)}: no progress (no logged row, no "
                                    f"training step) for {_minutes(now - self.last)}; it looks stuck")
        signal.setitimer(signal.ITIMER_REAL, self._due_in())

    def __enter__(self) -> "_Watchdog":
        self.start = self.last = self.clock()
        due = self._due_in()
        self.active = (due is not None and hasattr(signal, "setitimer")
                       and threading.current_thread() is threading.main_thread())
        if self.active:
            self._previous = signal.signal(signal.SIGALRM, self._check)
            signal.setitimer(signal.ITIMER_REAL, due)
        return self

    def __exit__(self, *exc) -> None:
        if self.active:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self._previous)
            self.active = False


def _rel(path: Path, start: Path) -> str:
    return Path(os.path.relpath(path, start)).as_posix()


def _minutes(seconds: float) -> str:
    """``"16 min 05 s"``: whole seconds, rounded once (never ``"16 min 60 s"``)."""
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest:02d} s"


def _close_figures() -> None:
    """Close figures an experiment left open (after a failure), so they do not pile up."""
    pyplot().close("all")
