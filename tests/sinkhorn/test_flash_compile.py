"""The flash kernels compiled for an H100 (sm_90) without a GPU, as a launch compiles them.

``python -m benchmarks flash-compile`` runs the engine's own launcher on ``meta`` tensors with every
kernel compiled instead of launched: the binder types each argument from the real tensors and ints
(so a mask stride past 2^31 is ``i64`` there, and only there), and the report gives each kernel's
shared memory, registers and spills. Slow (minutes of compiling: the target configuration and one
each of float32 and float64; every configuration with ``SINKFORMER_COMPILE_ALL=1``), so marked; the Triton versions of
other machines run with ``SINKFORMER_TRITON_PYTHONS`` naming their interpreters (os.pathsep-separated,
e.g. a venv with ``pip install triton==3.6.0`` whose torch is this one's).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="compiling the flash kernels needs triton")

from sinkformer.sinkhorn import flash  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OTHER_PYTHONS = [p for p in os.environ.get("SINKFORMER_TRITON_PYTHONS", "").split(os.pathsep) if p]


def compile_report(python: str, out: Path, quick: bool = True) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
    cmd = [python, "-m", "benchmarks.flash_compile", "--out", str(out)] + (["--quick"] if quick else [])
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=3 * 3600)
    assert (out / "flash_compile.json").exists(), done.stderr[-3000:]
    return json.loads((out / "flash_compile.json").read_text())


def check(report: dict) -> None:
    """Every kernel compiles and fits an H100, but float64 where this Triton is refused for it."""
    version = tuple(int(x) for x in report["meta"]["triton"].split(".")[:2])
    kernels = report["kernels"]
    assert {k["kernel"] for k in kernels} == {"sweep", "dscore", "rowdot", "fold"}
    assert {k["scenario"] for k in kernels} >= {"odd", "masked-even", "tolerance", "implicit"}
    for k in kernels:
        if k["dtype"] == "float64" and version < flash.MIN_TRITON_FLOAT64:
            continue  # refused by flash.unavailable on this Triton
        assert k["fits"], k
    if version < flash.MIN_TRITON_FLOAT64:  # the refusal is needed: some float64 kernel does not compile
        assert any("error" in k for k in kernels if k["dtype"] == "float64")
    huge = [k for k in kernels if k["scenario"].startswith("mask batch stride")]
    assert huge and all("s_kb" in k["int_types"] for k in huge)  # typed i64 by the binder, as at launch
    assert all(k["int_types"] == "all i32" for k in kernels if k["scenario"] == "odd")


@pytest.mark.slow
def test_kernels_compile_for_sm90(tmp_path):
    check(compile_report(sys.executable, tmp_path))


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("SINKFORMER_COMPILE_ALL"), reason="every configuration: about an hour on "
                    "2 cores; set SINKFORMER_COMPILE_ALL=1")
def test_every_configuration_compiles_for_sm90(tmp_path):
    """Every dtype and head dim of GPU_CONFIGS (d = 80 and 128 for the 128 bucket)."""
    report = compile_report(sys.executable, tmp_path, quick=False)
    check(report)
    served = {(str(dtype).removeprefix("torch."), d) for dtype, d in flash.GPU_CONFIGS if d >= 64}
    compiled = {(k["dtype"], 1 << (max(k["d"], 16) - 1).bit_length()) for k in report["kernels"]}
    assert served <= compiled


@pytest.mark.slow
@pytest.mark.skipif(not OTHER_PYTHONS, reason="set SINKFORMER_TRITON_PYTHONS to interpreters with other Tritons")
@pytest.mark.parametrize("python", OTHER_PYTHONS)
def test_kernels_compile_on_other_tritons(python, tmp_path):
    check(compile_report(python, tmp_path))
