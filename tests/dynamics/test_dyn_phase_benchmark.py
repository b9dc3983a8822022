"""``python -m benchmarks phase``: both methods run the same workload, and the table states the target."""

from __future__ import annotations

import argparse

from benchmarks.dynamics_phase import TARGET_SECONDS, markdown, run_batched, run_loop

TINY = dict(systems=3, tokens=5, betas=2, beta_max=4.0, d=3, t1=0.4, dt=0.2, record_every=1, loop_systems=2, seed=0,
            threads=1, device="cpu")


def test_batched_and_loop_run_the_workload_and_report_their_sizes():
    args = argparse.Namespace(**TINY)
    batched, loop = run_batched(args), run_loop(args)
    assert batched["systems_run"] == 6 and len(batched["single_cluster_final"]) == 2
    assert loop["systems_run"] == 2 and loop["extrapolated_to"] == 6
    assert loop["seconds"] > 0 and batched["seconds"] > 0


def test_markdown_states_the_target_and_the_speed_up():
    payload = {"date": "2026-01-01 00:00 UTC", "config": {**TINY, "systems": 1024, "betas": 64, "tokens": 32, "t1": 30.0},
               "machine": {"machine": "x86_64", "cores": 2, "torch": "2.13", "load_before": 0.1, "load_after": 0.2},
               "rows": [{"method": "batched", "seconds": 90.0, "systems_run": 65536},
                        {"method": "loop", "seconds": 9000.0, "per_system": 0.137, "systems_run": 8,
                         "extrapolated_to": 65536}]}
    text = markdown(payload)
    assert f"| batched < {TARGET_SECONDS:.0f} s | 90.0 s | met |" in text
    assert "| speed-up of the batch over the loop | 100x | |" in text
    assert "9000.0 (extrapolated to 65536)" in text
    payload["rows"][0]["seconds"] = 150.0
    assert "| batched < 120 s | 150.0 s | **missed** |" in markdown(payload)
