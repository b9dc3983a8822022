"""How many torch threads a CPU training process should use when other processes share the cores.

PyTorch's CPU kernels split each operation over a pool of threads that wait for one another at
its end. When other processes keep some of the cores busy, one of those threads is often off its
core, and every operation waits for it: on a 2-core machine with one busy process beside it, a
2-thread training epoch of a small model takes several times as long as alone, a 1-thread epoch
about as long as alone (``python -m benchmarks sharing``; benchmarks/results/sharing.md). So the ``sinkformer`` commands give torch one thread per core that is *not*
busy with other processes (:func:`free_cores`: the kernel's CPU counters over a fraction of a
second, this process's own time taken out) and, while ``sinkformer train`` runs, follow the other
processes' load (:class:`FollowFreeCores`). ``--threads N`` fixes the count instead.

The library never changes the thread count by itself (that is process-wide state): only the
commands call :func:`torch.set_num_threads`, through these helpers. Where the counters cannot be
read (no Linux ``/proc/stat``) nothing is measured and torch's own setting is kept.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .loop import Callback

__all__ = ["CpuTimes", "cpu_times", "usable_cpus", "busy_elsewhere", "free_cores", "FollowFreeCores"]

logger = logging.getLogger(__name__)

_STAT = Path("/proc/stat")


@dataclass(frozen=True)
class CpuTimes:
    """Seconds of CPU time so far: ``busy`` on the CPUs this process may use (every process's), and
    ``own`` (this process's, all its threads), at ``wall`` (``time.monotonic``)."""

    busy: float
    own: float
    wall: float


def usable_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity; every CPU where that is unknown)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def cpu_times(stat: str | None = None, cpus: list[int] | None = None) -> CpuTimes | None:
    """The :class:`CpuTimes` now, from ``/proc/stat`` (or the text ``stat``, for tests): busy time is
    user + nice + system + irq + softirq + steal of the ``cpuN`` lines of ``cpus`` (default:
    :func:`usable_cpus`). ``None`` where ``/proc/stat`` cannot be read."""
    if stat is None:
        try:
            stat = _STAT.read_text()
        except OSError:
            return None
    wanted = {f"cpu{i}" for i in (usable_cpus() if cpus is None else cpus)}
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    busy = 0
    for line in stat.splitlines():
        fields = line.split()
        if fields and fields[0] in wanted:
            user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in (fields[1:9] + ["0"] * 8)[:8])
            busy += user + nice + system + irq + softirq + steal
    own = os.times()
    return CpuTimes(busy / ticks, own.user + own.system, time.monotonic())


def busy_elsewhere(before: CpuTimes, after: CpuTimes) -> float:
    """How many cores other processes kept busy between two :func:`cpu_times` (0 when no time passed)."""
    seconds = after.wall - before.wall
    if seconds <= 0:
        return 0.0
    return max(0.0, ((after.busy - before.busy) - (after.own - before.own)) / seconds)


def _threads_for(busy: float, cpus: int) -> int:
    """One thread per core not busy elsewhere (at least one)."""
    return max(1, min(cpus, round(cpus - busy)))


def free_cores(sample: float = 0.3) -> tuple[int, float] | None:
    """``(threads, busy)``: the cores of this process's CPUs that other processes left free over the
    next ``sample`` seconds (at least 1), and how many cores they kept busy; ``None`` where the
    counters cannot be read. This process should be idle meanwhile (its own time is taken out anyway)."""
    before = cpu_times()
    if before is None:
        return None
    time.sleep(sample)
    after = cpu_times()
    busy = busy_elsewhere(before, after)
    return _threads_for(busy, len(usable_cpus())), busy


class FollowFreeCores(Callback):
    """Sets torch's thread count to the free cores (see :func:`free_cores`) every ``every`` seconds of
    training, measured over that time with this process's own CPU time taken out, and logs each change.
    For the commands (``sinkformer train``): it changes the process-wide thread count on purpose."""

    def __init__(self, every: float = 10.0, measure=cpu_times) -> None:
        self.every, self.measure = every, measure
        self.cpus = len(usable_cpus())
        self.mark = measure()

    def on_step_end(self, epoch: int, step: int, loss: float) -> None:
        if self.mark is None:
            return
        now = self.measure()
        if now is None or now.wall - self.mark.wall < self.every:
            return
        busy, self.mark = busy_elsewhere(self.mark, now), now
        threads = _threads_for(busy, self.cpus)
        if threads != torch.get_num_threads():
            logger.info("threads: %d -> %d (other processes kept %.1f of %d cores busy)", torch.get_num_threads(),
                        threads, busy, self.cpus)
            torch.set_num_threads(threads)
