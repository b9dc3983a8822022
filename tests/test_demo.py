"""The main job for now: `sinkformer demo` (paper Figure 1)."""

import subprocess
import sys

import torch

from sinkformer.cli import main
from sinkformer.experiments.sinkformers import normalizations


def test_figure1_matrices_behave_as_the_paper_says():
    res = normalizations.compute(n_points=10, seed=0)
    K0, K1, Kinf = (res.matrices[k] for k in ("K0", "K1", "Kinf"))
    # K0: one interaction dominates
    top2 = K0.flatten().topk(2).values
    assert top2[0] > 2 * top2[1]
    # K1: row-stochastic, one key cluster (the last 5 keys) gets no link >= 1e-12
    torch.testing.assert_close(K1.sum(1), torch.ones(10, dtype=torch.float64))
    assert K1[:, 5:].max() < normalizations.LINK_THRESHOLD
    # Kinf: doubly stochastic, every key takes part
    torch.testing.assert_close(Kinf.sum(0), torch.ones(10, dtype=torch.float64), atol=1e-10, rtol=0)
    torch.testing.assert_close(Kinf.sum(1), torch.ones(10, dtype=torch.float64), atol=1e-10, rtol=0)
    assert (Kinf >= normalizations.LINK_THRESHOLD).any(0).all()
    ent = {row["matrix"]: row["entropy"] for row in res.summary()}
    assert ent["Kinf"] > ent["K1"]


def test_demo_command_prints_table_and_writes_png(tmp_path, capsys):
    out = tmp_path / "fig.png"
    assert main(["demo", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "Kinf" in text and "column sums" in text and str(out.resolve()) in text
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_console_script_help():
    proc = subprocess.run([sys.executable, "-m", "sinkformer.cli", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "demo" in proc.stdout
