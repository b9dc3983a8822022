"""Threads on a shared CPU: the cores other processes keep busy, read from the kernel's counters, decide how many
threads the commands give torch; the library itself never sets them."""

import os

import pytest
import torch

from sinkformer.training import threads
from sinkformer.training.threads import CpuTimes, FollowFreeCores, busy_elsewhere, cpu_times

STAT = """cpu  100 0 50 1000 0 0 0 0 0 0
cpu0 60 0 30 500 5 1 2 3 0 0
cpu1 40 0 20 500 0 0 0 0 0 0
cpu2 999 0 999 0 0 0 0 0 0 0
intr 1 2 3
"""


def test_cpu_times_sum_the_busy_ticks_of_the_usable_cpus():
    ticks = os.sysconf("SC_CLK_TCK")
    both = cpu_times(STAT, cpus=[0, 1])
    assert both.busy == pytest.approx((60 + 30 + 1 + 2 + 3 + 40 + 20) / ticks)  # idle and iowait are not busy
    assert cpu_times(STAT, cpus=[1]).busy == pytest.approx(60 / ticks)  # cpu2 (not ours) never counts
    own = os.times()
    assert both.own == pytest.approx(own.user + own.system, abs=0.5)


def test_busy_elsewhere_takes_this_process_out():
    before, after = CpuTimes(10.0, 2.0, 100.0), CpuTimes(13.0, 3.0, 102.0)
    assert busy_elsewhere(before, after) == pytest.approx(1.0)  # 3 core-seconds in 2 s, 1 of them ours
    assert busy_elsewhere(before, before) == 0.0
    assert [threads._threads_for(busy, 2) for busy in (0.0, 0.4, 0.6, 1.0, 1.9, 5.0)] == [2, 2, 1, 1, 1, 1]


def test_the_real_counters_are_read_here():
    if cpu_times() is None:
        pytest.skip("no /proc/stat on this system")
    chosen, busy = threads.free_cores(sample=0.05)
    assert 1 <= chosen <= len(threads.usable_cpus()) and busy >= 0


def test_follow_free_cores_sets_the_thread_count_as_the_load_changes(monkeypatch, caplog):
    readings = iter([CpuTimes(0, 0, 0), CpuTimes(1, 1, 5),      # 5 s: not yet time to look
                     CpuTimes(20, 2, 10),                        # 10 s: 18 of 20 busy core-s elsewhere -> 1 thread
                     CpuTimes(22, 4, 20)])                       # then idle elsewhere -> every core
    monkeypatch.setattr(threads, "usable_cpus", lambda: [0, 1])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        follow = FollowFreeCores(every=10.0, measure=lambda: next(readings))
        follow.on_step_end(0, 0, 1.0)
        assert torch.get_num_threads() == 2
        with caplog.at_level("INFO", logger="sinkformer"):
            follow.on_step_end(0, 1, 1.0)
            assert torch.get_num_threads() == 1
            follow.on_step_end(0, 2, 1.0)
            assert torch.get_num_threads() == 2
        assert [r.getMessage() for r in caplog.records] == [
            "threads: 2 -> 1 (other processes kept 1.8 of 2 cores busy)",
            "threads: 1 -> 2 (other processes kept 0.0 of 2 cores busy)"]
    finally:
        torch.set_num_threads(before)


def test_without_counters_nothing_is_measured_or_changed(monkeypatch):
    monkeypatch.setattr(threads, "_STAT", threads.Path("/no/such/proc/stat"))
    assert cpu_times() is None and threads.free_cores(sample=0.0) is None
    follow = FollowFreeCores()
    before = torch.get_num_threads()
    follow.on_step_end(0, 0, 1.0)
    assert torch.get_num_threads() == before
