"""glibc's malloc settings of the commands (sinkformer.training.allocator): fewer page faults, the
user's own settings left alone, and the commands (and the suite's workers) set them."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from sinkformer.training import allocator

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

_LOOP = """
import resource, sys, torch
from sinkformer.training.allocator import keep_freed_memory
torch.set_num_threads(1)
if sys.argv[1] == "keep":
    assert keep_freed_memory()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
optimizer = torch.optim.Adam(model.parameters())
x = torch.randn(64, 96, 64)  # buffers of 1.5 and 6 MiB, allocated and freed every step

def step():
    optimizer.zero_grad()
    model(x).square().mean().backward()
    optimizer.step()

step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _minor_faults(mode: str) -> int:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    done = subprocess.run([sys.executable, "-c", _LOOP, mode], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split()[-1])


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_a_training_loop_page_faults_far_less_with_freed_memory_kept():
    default, kept = _minor_faults("default"), _minor_faults("keep")
    # measured: about 65,000 against 1,200 (the buffers went back to the system and were faulted in again)
    assert kept * 10 < default, (default, kept)


@pytest.mark.parametrize("setting", [("MALLOC_TRIM_THRESHOLD_", "1000000"), ("MALLOC_MMAP_THRESHOLD_", "65536"),
                                     ("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=1000000")])
def test_the_users_own_malloc_settings_are_left_alone(monkeypatch, setting):
    calls = []
    monkeypatch.setattr(allocator.ctypes, "CDLL", lambda name: calls.append(name))
    monkeypatch.setenv(*setting)
    assert allocator.keep_freed_memory() is False and calls == []


def test_not_glibc_changes_nothing(monkeypatch):
    calls = []
    monkeypatch.setattr(allocator.ctypes, "CDLL", lambda name: calls.append(name))
    monkeypatch.setattr(allocator.platform, "libc_ver", lambda: ("", ""))
    assert allocator.keep_freed_memory() is False and calls == []


def test_the_commands_and_the_suites_workers_keep_freed_memory(monkeypatch, tmp_path):
    from sinkformer.cli import main
    from sinkformer.training import runner

    calls = []
    monkeypatch.setattr(allocator, "keep_freed_memory", lambda: calls.append("set") or True)
    monkeypatch.setattr(runner, "resolve_config", lambda file, **flags: {})
    monkeypatch.setattr(runner, "check_config", lambda config: None)

    def run_training(config, **options):
        calls.append("trained")
        raise ValueError("stopped by the test")

    monkeypatch.setattr(runner, "run_training", run_training)
    assert main(["train", "--out", str(tmp_path / "t"), "--threads", "1"]) == 2
    assert calls == ["set", "trained"]
    assert main(["run", "normalizations", "--runs-dir", str(tmp_path)]) == 0
    assert calls == ["set", "trained", "set"]
    worker = ("import sinkformer.training.allocator as a, sinkformer.runs.suite as s; calls = []; "
              "a.keep_freed_memory = lambda: calls.append(1) or True; s._init_worker(1); assert calls == [1]")
    done = subprocess.run([sys.executable, "-c", worker], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


def test_the_training_docs_state_the_settings():
    """docs/training.md's **Memory** paragraph quotes the two thresholds the code sets."""
    from pathlib import Path

    text = " ".join((Path(__file__).resolve().parents[2] / "docs" / "training.md").read_text().split())
    assert (f"blocks up to {allocator.MMAP_THRESHOLD >> 20} MiB from the heap, up to {allocator.TRIM_THRESHOLD >> 20} "
            "MiB of free heap kept") in text
