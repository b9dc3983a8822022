"""benchmarks/parallel.py: its verdicts from measured rows, and one real measurement of a tiny call."""

from benchmarks import parallel

META = {"when": "now", "torch": "x", "machine": "m", "cores": 2, "threads": 2, "rounds": 3, "threshold": 1000}


def row(n: int, ratios: list[float], picked: str) -> dict:
    return {"batch": 1, "heads": 1, "n": n, "scores": n * n, "threads_ms": 1.0, "intra_op_ms": 1.0,
            "ratio": sorted(ratios)[len(ratios) // 2], "ratio_min": min(ratios), "ratio_max": max(ratios),
            "picked": picked}


def test_a_mode_is_faster_only_when_every_round_says_so():
    assert parallel.faster(row(8, [0.8, 0.9, 0.95], "threads")) == "threads"
    assert parallel.faster(row(8, [1.1, 1.3, 1.2], "intra-op")) == "intra-op"
    assert parallel.faster(row(8, [0.8, 1.1, 0.9], "threads")) is None


def test_the_table_names_the_sizes_where_the_threshold_picks_the_slower_mode():
    rows = [row(16, [1.4, 1.5, 1.6], "threads"), row(64, [0.7, 0.8, 0.9], "threads"),
            row(32, [0.9, 1.1, 1.0], "intra-op")]
    text = parallel.render(rows, META)
    assert "| 1 × 1 | 16 | 0.0M | 1.0 | 1.0 | 1.50 (1.40–1.60) | intra-op | threads |" in text
    assert "slower in every round: b × h = 1 × 1, n = 16." in text
    assert "slower in every round: none." in parallel.render(rows[1:], META)


def test_a_measurement_restores_the_threshold(monkeypatch):
    """The modes are forced by replacing scaling.parallel_above while timing (restored after); the threads mode does
    run the groups on Python threads (map_groups asked with a threshold of 0)."""
    from sinkformer.sinkhorn import cpu_parallel, scaling

    before = scaling.parallel_above
    asked = []
    map_groups = scaling.map_groups
    monkeypatch.setattr(scaling, "map_groups", lambda *args: asked.append(args[4]) or map_groups(*args))
    rows = parallel.measure([(1, 2, 8)], rounds=2, progress=lambda s: None)
    assert scaling.parallel_above is before and set(asked) == set(parallel.MODES.values())
    assert cpu_parallel.PARALLEL_ABOVE == 1 << 24
    assert rows[0]["threads_ms"] > 0 and rows[0]["intra_op_ms"] > 0 and rows[0]["picked"] == "intra-op"


def test_the_table_says_which_calls_run_the_native_passes_and_their_threshold():
    rows = [dict(row(16, [1.4, 1.5, 1.6], "intra-op"), native=True), dict(row(64, [0.9, 1.1, 1.0], "threads"),
                                                                          native=False)]
    text = parallel.render(rows, {**META, "native_threshold": 500})
    assert "`NATIVE_PARALLEL_ABOVE` = 500 for the calls that run the native passes" in text
    assert "| b × h | native | n |" in text and "| threshold picks |" in text
    assert "| 1 × 1 | yes | 16 | 0.0M | 1.0 | 1.0 | 1.50 (1.40–1.60) | intra-op | intra-op |" in text
    assert "| 1 × 1 | no | 64 |" in text and "Sizes where the thresholds pick the mode" in text


def test_the_docs_paragraph_reads_the_committed_run():
    """docs/speed.md's reading of benchmarks/results/parallel.json: the native calls up to 2^21 scores slower on
    threads in every round (the medians' range), n = 512 neither (and intra-op in every round in the run at 6cf3108,
    which set the rule), groups of one slice and row blocks threads in every round."""
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    results = root / "benchmarks" / "results"
    rows, before = ({(r["batch"], r["heads"], r["n"]): r for r in json.loads((results / name).read_text())["rows"]}
                    for name in ("parallel.json", "parallel_6cf3108.json"))
    text = " ".join((root / "docs" / "speed.md").read_text().split())
    small = [rows[(4, 8, n)] for n in (64, 128, 256)]
    assert all(r["native"] and parallel.faster(r) == "intra-op" for r in small)
    low, high = min(r["ratio"] for r in small), max(r["ratio"] for r in small)
    assert f"by a median of {low:.1f}× to {high:.1f}×" in text
    assert parallel.faster(rows[(4, 8, 512)]) is None and rows[(4, 8, 512)]["picked"] == "intra-op"
    assert f"neither mode won every round here ({rows[(4, 8, 512)]['ratio']:.2f})" in text
    assert parallel.faster(before[(4, 8, 512)]) == "intra-op" and before[(4, 8, 512)]["picked"] == "threads"
    assert f"the intra-op mode was faster in every round ({before[(4, 8, 512)]['ratio']:.2f})" in text
    assert all(parallel.faster(rows[key]) == "threads" for key in ((2, 8, 1024), (4, 8, 1024), (1, 8, 2048),
                                                                    (1, 8, 4096)))
    assert parallel.faster(rows[(1, 8, 1024)]) is None


def test_sizes_whose_slices_the_engine_splits_are_measured_in_both_modes_and_picked_as_split(monkeypatch):
    """Slices of at least SPLIT_TILE_SCORES scores take neither mode in the engine: the benchmark times both all the
    same (splitting held off while it measures, and restored), says 'split', and never counts them as a wrong pick."""
    import pytest
    import torch

    import sinkformer
    from sinkformer.sinkhorn import sizes

    if torch.get_num_threads() < 2:
        pytest.skip("one torch thread: the engine splits nothing")
    monkeypatch.setattr(sizes, "SPLIT_TILE_SCORES", 64)
    seen = []
    run = sinkformer.attention

    def recording(*args, **kwargs):
        seen.append(sizes.SPLIT_TILE_SCORES)
        return run(*args, **kwargs)

    monkeypatch.setattr(sinkformer, "attention", recording)
    rows = parallel.measure([(1, 2, 8)], rounds=2, progress=lambda s: None)
    assert seen and set(seen) == {1 << 62} and sizes.SPLIT_TILE_SCORES == 64
    assert rows[0]["picked"] == "split"
    rows = [row(8, [1.4, 1.5, 1.6], "split")]
    assert "slower in every round: none." in parallel.render(rows, META)
