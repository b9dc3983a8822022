"""``python -m benchmarks flash-tune``: the launch candidates, their interleaved ratios, the choice of
the fastest, and the library's launches held to the committed results of the H200 runs."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
pytest.importorskip("triton", reason="the flash engine needs triton (pip install 'sinkformer[gpu]')")

from benchmarks import flash_tune  # noqa: E402
from sinkformer.sinkhorn import flash  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
TUNED = {"bfloat16": "flash_tune_bf16.json", "float32": "flash_tune_fp32.json"}


def test_launches_change_one_kernel_and_are_put_back():
    """The table a call reads is changed for the kernels named only, and restored on exit, also after an error."""
    before = {key: dict(table) for key, table in flash.GPU_CONFIGS.items()}
    with flash_tune.launches("float32", 64, False, dscore=(32, 32, 4, 1)) as table:
        assert flash.launch_config(torch.float32, 64, 64, False) is table
        assert table["dscore"] == flash.LaunchConfig(32, 32, 4, 1)
        assert table["sweep"] == before[(torch.float32, 64)]["sweep"]
        assert flash.GPU_CONFIGS[(torch.bfloat16, 64)] == before[(torch.bfloat16, 64)]
    with pytest.raises(RuntimeError), flash_tune.launches("bfloat16", 64, False, sweep=(16, 16, 4, 1)):
        raise RuntimeError("a candidate that fails")
    assert {key: dict(table) for key, table in flash.GPU_CONFIGS.items()} == before
    with flash_tune.launches("float32", 16, True, sweep=(16, 16, 4, 2)):  # the interpreter's table
        assert flash.INTERPRETER_CONFIG["sweep"] == flash.LaunchConfig(16, 16, 4, 2)
    assert flash.INTERPRETER_CONFIG["sweep"] == flash.LaunchConfig(32, 32)


def test_candidates_leave_out_the_current_launch():
    tasks = flash_tune.candidates(flash_tune.FULL, ["bfloat16", "float32"], smoke=False)
    for dtype_name in ("bfloat16", "float32"):
        now = flash_tune.current(dtype_name, 64, False)
        for kernel in flash_tune.KERNELS:
            mine = [t[2] for t in tasks if t[:2] == (dtype_name, kernel)]
            assert mine and now[kernel] not in mine
            assert set(mine) == set(flash_tune.CANDIDATES[(dtype_name, kernel)]) - {now[kernel]}


def test_the_fastest_is_faster_in_every_round():
    """A candidate replaces the current launch only when every round's ratio is below 1; among those,
    the lowest median wins."""
    now = (64, 64, 4, 2)
    rows = [dict(launch=list(now), ratio=1.0, faster=False),
            dict(launch=[64, 32, 4, 2], ratio=0.90, faster=False),  # a lower median, but one round above 1
            dict(launch=[128, 64, 8, 2], ratio=0.95, faster=True),
            dict(launch=[32, 64, 4, 2], ratio=0.97, faster=True)]
    assert flash_tune.fastest(rows, now) == (128, 64, 8, 2)
    assert flash_tune.fastest([dict(r, faster=False) for r in rows], now) == now


@pytest.mark.parametrize("dtype_name", sorted(TUNED))
def test_the_library_runs_the_launches_the_gpu_found_fastest(dtype_name):
    """GPU_CONFIGS at d = 64 holds the launches the committed H200 run found fastest (every round below
    1 at n = 4096), each of which passed the accuracy check there, and that run's report is its JSON
    rendered; its sizes part found the new launches no slower at any size (the median ratio)."""
    report = json.loads((RESULTS / TUNED[dtype_name]).read_text())
    assert report["environment"]["gpu"].startswith("NVIDIA") and not report["smoke"]
    assert (RESULTS / TUNED[dtype_name].replace(".json", ".md")).read_text() == flash_tune.markdown(report)
    best = {kernel: tuple(launch) for kernel, launch in report["best"][dtype_name].items()}
    table = flash.GPU_CONFIGS[(getattr(torch, dtype_name), 64)]
    assert {kernel: dataclasses.astuple(table[kernel]) for kernel in flash_tune.KERNELS} == best
    passed = {(r["kernel"], tuple(r["launch"])) for r in report["candidates"] if r["status"] == "pass"}
    now = {kernel: tuple(launch) for kernel, launch in report["current"][dtype_name].items()}
    for kernel, launch in best.items():
        assert launch == now[kernel] or (kernel, launch) in passed
        row = next(r for r in report["kernels"] if r["kernel"] == kernel and tuple(r["launch"]) == launch)
        assert launch == now[kernel] or (row["faster"] and max(row["ratios"]) < 1)
    sizes = [r for r in report["sizes"] if r["dtype"] == dtype_name]
    assert sizes and all(r["status"] == "ok" and sorted(r["ratios"])[len(r["ratios"]) // 2] < 1 for r in sizes)


@pytest.mark.slow
def test_flash_tune_smoke_run(tmp_path, monkeypatch):
    """Every part on the CPU under Triton's interpreter: the candidates compile in worker processes,
    pass the accuracy check, are timed in interleaved rounds, and the fastest (here forced, as the
    interpreter's timings say nothing of a GPU's) is timed against the current launch at the sizes."""
    monkeypatch.setattr(flash_tune, "fastest", lambda rows, now: tuple(rows[-1]["launch"]))
    assert flash_tune.main(["--smoke", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "flash_tune.json").read_text())
    assert report["parts"]["compile"] == dict(report["parts"]["compile"], tasks=2, errors=0)
    assert [r["status"] for r in report["candidates"]] == ["pass", "pass"]
    assert {(r["kernel"], len(r["ratios"])) for r in report["kernels"]} == {("sweep", 2), ("dscore", 2)}
    assert report["best"]["float32"] == {kernel: list(launch) for (_, kernel), (launch,) in
                                         flash_tune.SMOKE_CANDIDATES.items()}
    assert [(r["n"], r["status"], len(r["ratios"])) for r in report["sizes"]] == [(40, "ok", 2)]
    assert flash.INTERPRETER_CONFIG["sweep"] == flash.LaunchConfig(32, 32)  # put back
    text = (tmp_path / "flash_tune.md").read_text()
    assert text == flash_tune.markdown(report) and "at commit" in text and "| float32 | 40 | 3 |" in text


def test_the_tune_in_the_docs_is_the_committed_results():
    """The figures docs/speed.md quotes from the two H200 runs of flash-tune are those of their JSON."""
    text = " ".join((ROOT / "docs" / "speed.md").read_text().split())
    bf16, fp32 = (json.loads((RESULTS / TUNED[d]).read_text()) for d in ("bfloat16", "float32"))
    assert f"at {bf16['commit'][:7]}, after" in text and fp32["commit"] == bf16["commit"]

    def size(report, n, n_iters):
        r = next(r for r in report["sizes"] if (r["n"], r["n_iters"]) == (n, n_iters))
        return sorted(r["ratios"])[1], r

    dscore = next(r for r in bf16["kernels"] if r["kernel"] == "dscore" and r["launch"] == [64, 32, 4, 2])
    assert f"`dscore` 64 × 32 ({dscore['ratio']:.3f}× per kernel)" in text
    assert f"together {size(bf16, 4096, 5)[0]:.3f}× the old launches at n = 4096" in text
    assert f"{size(bf16, 16384, 5)[0]:.3f}× at n = 16384" in text
    low, high = min(size(bf16, 1024, 5)[1]["ratios"]), max(size(bf16, 1024, 5)[1]["ratios"])
    assert f"{size(bf16, 1024, 5)[0]:.3f}× with rounds on both sides of 1" in text and low < 1 < high
    ratio, row = size(fp32, 4096, 5)
    assert f"{row['current_ms']:.1f} → {row['best_ms']:.1f} ms at n = 4096 and 5 iterations ({ratio:.3f}×)" in text
    assert f"{size(fp32, 4096, 3)[0]:.3f}× at 3 iterations, {size(fp32, 1024, 5)[0]:.3f}× at n = 1024" in text
    check = json.loads((RESULTS / "attention_cuda_h200_d7b142e.json").read_text())  # the check before the tune
    tiled = next(r for r in check["rows"] if (r["method"], r["dtype"], r["n"], r.get("n_iters"))
                 == ("tiled", "float32", 4096, 5))
    assert f"cuBLAS products did in the check ({tiled['forward_backward_ms']:.1f} ms)" in text
    assert abs(row["best_ms"] / tiled["forward_backward_ms"] - 1) < 0.1  # "about as fast"
    flash32 = next(r for r in check["rows"] if (r["method"], r["dtype"], r["n"], r.get("n_iters"))
                   == ("flash", "float32", 4096, 5))
    assert round(tiled["peak_mib"] / flash32["peak_mib"]) == 15 and "at a fifteenth of its memory" in text


def _dies(task):
    import os

    os._exit(3)  # as a crash or the out-of-memory killer ends a worker


def test_a_worker_that_dies_is_reported_not_raised(monkeypatch):
    """A candidate whose compiling worker dies is reported as such; the run goes on without it."""
    from benchmarks.gpu_check import Budget

    monkeypatch.setattr(flash_tune, "_compile_candidate", _dies)
    budget = Budget(120.0)
    budget.begin(1.0, 1.0)
    tasks = [("float32", "sweep", (16, 32, 4, 2))]
    errors = flash_tune.compile_all(flash_tune.SMOKE, "cpu", tasks, budget)
    assert errors == {0: "its worker died: BrokenProcessPool"}
