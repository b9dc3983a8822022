"""The attention benchmark's grid over the sizes people run (``python -m benchmarks attention --grid``)."""

import json

import pytest

from benchmarks import attention as bench


def test_grid_methods_leave_out_what_cannot_run():
    names = lambda n: {(m["method"], m["n_iters"], m["causal"]) for m in bench.grid_methods(n)}  # noqa: E731
    assert names(512) == {("sdpa", 1, False), ("ours", 1, False), ("ours", 3, False), ("ours", 5, False),
                          ("sdpa", 1, True), ("ours", 3, True), ("ours", 5, True)}
    assert ("ours", 5, True) not in names(1024) and ("ours", 3, True) in names(4096)  # causal: cubic above 3
    assert names(16384) == {("sdpa", 1, False), ("ours", 1, False), ("ours", 3, False), ("ours", 5, False)}
    shapes = [bench.grid_shape(n) for n in bench.GRID_NS]
    assert all(s["rounds"] >= 3 for s in shapes) and bench.grid_shape(16384)["h"] < bench.H


def test_measure_grid_times_every_method_against_its_sdpa(monkeypatch):
    monkeypatch.setattr(bench, "grid_shape", lambda n: dict(b=1, h=2, repeats=1, rounds=2))
    rows = bench.measure_grid(16, iters=(1, 3))
    assert [(r["method"], r["n_iters"], r["causal"], r["engine"]) for r in rows] == [
        ("sdpa", 1, False, "sdpa"), ("ours", 1, False, "tiled"), ("ours", 3, False, "tiled"),
        ("sdpa", 1, True, "sdpa"), ("ours", 3, True, "causal")]
    for r in rows:
        assert r["forward_ms"] > 0 and r["forward_backward_ms"] > 0 and r["rounds"] == 2
        if r["method"] == "sdpa":
            assert r["forward_ratio"] == r["forward_backward_ratio"] == 1.0
        else:
            assert r["forward_backward_ratio"] > 0


def _rows():
    rows = []
    for n in (64, 1024, 4096):
        for m in bench.grid_methods(n):
            ratio = 1.0 if m["method"] == "sdpa" else 1.2 + m["n_iters"] / 10 + (0.5 if m["causal"] else 0)
            rows.append(dict(m, n=n, b=4, h=8, d=64, engine="tiled", forward_ms=2.0, forward_backward_ms=5.0,
                             forward_ratio=ratio, forward_backward_ratio=ratio, rounds=3, repeats=1))
    return rows


def test_grid_table_plot_and_targets(tmp_path):
    text = bench.write_grid(_rows(), tmp_path, "2026-01-01 00:00")
    assert (tmp_path / "attention_grid.png").read_bytes()[:4] == b"\x89PNG"
    saved = json.loads((tmp_path / "attention_grid.json").read_text())
    assert saved["targets"] == {"worst_64_512": pytest.approx(1.7), "at_1024": pytest.approx(1.7),
                                "at_4096": pytest.approx(1.7), "causal3_at_1024": pytest.approx(2.0),
                                "causal3_at_4096": pytest.approx(2.0)}
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| n | SDPA (ms) | n_iters=1 | n_iters=3 | n_iters=5 | causal SDPA (ms) |")
    assert table[1:] == ["| 64 | 2 / 5 | 1.30 / 1.30 | 1.50 / 1.50 | 1.70 / 1.70 | 2 / 5 | 2.00 / 2.00 | 2.20 / 2.20 |",
                         "| 1024 | 2 / 5 | 1.30 / 1.30 | 1.50 / 1.50 | 1.70 / 1.70 | 2 / 5 | 2.00 / 2.00 | – |",
                         "| 4096 | 2 / 5 | 1.30 / 1.30 | 1.50 / 1.50 | 1.70 / 1.70 | 2 / 5 | 2.00 / 2.00 | – |"]
    assert "- 5 iterations, forward+backward, n = 4096: **1.70** (target ≤ 1.5)" in text


def test_grid_command_writes_its_three_files(tmp_path):
    assert bench.main(["--grid", "--n", "16", "--iters", "3", "--processes", "2", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "attention_grid.json").read_text())["rows"]
    assert {(r["method"], r["causal"]) for r in rows} == {("sdpa", False), ("ours", False), ("sdpa", True),
                                                         ("ours", True)}
    assert all(r["processes"] == 2 and len(r["process_ratios"]) == 2 for r in rows)
    text = (tmp_path / "attention_grid.md").read_text()
    assert text.count("\n| 16 |") == 1 and "the median over 2 fresh processes of each one's median" in text


def _process_rows(ratio: float, ms: float) -> list[dict]:
    return [dict(method=method, n_iters=n_iters, causal=False, n=1024, b=4, h=8, d=64, engine="tiled",
                 forward_ms=ms, forward_backward_ms=2 * ms, forward_ratio=1.0 if method == "sdpa" else ratio,
                 forward_backward_ratio=1.0 if method == "sdpa" else ratio, rounds=5, repeats=3)
            for method, n_iters in (("sdpa", 1), ("ours", 5))]


def test_the_grid_takes_the_median_over_fresh_processes(tmp_path):
    runs = [_process_rows(1.41, 10.0), _process_rows(1.18, 30.0), _process_rows(1.20, 20.0)]
    sdpa, ours = bench.merge_processes(runs)
    assert ours["forward_backward_ratio"] == ours["forward_ratio"] == 1.20 and ours["forward_ms"] == 20.0
    assert ours["forward_backward_ms"] == 40.0 and sdpa["forward_backward_ratio"] == 1.0
    assert ours["processes"] == 3 and ours["process_ratios"] == [1.41, 1.18, 1.20]
    assert ours["rounds"] == 5 and ours["engine"] == "tiled"
    text = bench.grid_markdown([sdpa, ours], "2026-01-01 00:00")
    assert "the median over 3 fresh processes of each one's median over interleaved rounds" in text
    assert ("- 5 iterations, forward+backward, n = 1024: **1.20** (target ≤ 1.25; fresh processes 1.18, 1.20, "
            "1.41)") in text
    one = bench.grid_markdown(runs[0], "2026-01-01 00:00")  # rows of one process: as the committed grids say
    assert "the median over interleaved rounds in one process" in one and "fresh processes" not in one
    with pytest.raises(ValueError, match="runs: the processes measured different methods"):
        bench.merge_processes([runs[0], runs[1][::-1]])
    with pytest.raises(ValueError, match="processes: at least one"):
        bench.run_grid((16,), (3,), processes=0)


def test_memory_counts_the_tile_buffers_the_library_keeps_between_calls(tmp_path):
    """After a warm-up the library keeps its tile buffer (sinkhorn/cpu_parallel.py); the benchmark's
    peak frees it first, so a call's peak still counts its 16 MiB tile (one 2048 x 2048 slice)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    script = (
        "import torch, sinkformer\n"
        "from benchmarks import attention as bench\n"
        "from sinkformer.sinkhorn import cpu_parallel\n"
        "torch.set_num_threads(1)\n"
        "q, k, v = (torch.randn(1, 1, 2048, 8, requires_grad=True) for _ in range(3))\n"
        "step = lambda: sinkformer.attention(q, k, v, n_iters=None, tol=1e-2).sum().backward()\n"
        "step()\n"
        "assert cpu_parallel._kept\n"
        "print(bench.peak_rise_mib(step))\n")
    env = dict(os.environ, PYTHONPATH=f"{root / 'src'}{os.pathsep}{root}", MALLOC_MMAP_THRESHOLD_="65536",
               MALLOC_TRIM_THRESHOLD_="65536")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert float(done.stdout.strip().splitlines()[-1]) >= 15.0


def _row(method, n, n_iters, ms, mib, date, cpu):
    return dict(method=method, b=4, h=8, n=n, d=64, n_iters=n_iters, repeats=1, forward_ms=ms / 3,
                forward_backward_ms=ms, peak_mib=mib, date=date, cpu=cpu)


def test_merged_rows_keep_their_machine_and_targets_pair_rows_of_one_run(tmp_path, monkeypatch):
    """``--merge`` keeps earlier rows with the machine they were measured on (a file written before rows
    carried one: the file's), the header names every machine, and a time ratio is formed only from rows
    of one run (memory ratios: one machine), never across a merge."""
    earlier = [_row("sdpa", 1024, 1, 100.0, 40.0, "old", None), _row("ours", 1024, 5, 150.0, 60.0, "old", None),
               _row("ours", 1024, 21, 200.0, 63.0, "older", None), _row("ours", 4096, 5, 4000.0, 300.0, "old", None),
               _row("ours-chunked", 4096, 5, 8000.0, 200.0, "old", None)]
    for row in earlier:
        del row["cpu"]
    (tmp_path / "attention.json").write_text(json.dumps({"date": "old", "cpu": "Old Xeon", "rows": earlier}))
    fresh = [_row("sdpa", 4096, 1, 2000.0, 160.0, "new", None), _row("ours", 4096, 5, 3000.0, 300.0, "new", None)]
    for row in fresh:
        del row["date"], row["cpu"]
    monkeypatch.setattr(bench, "run", lambda configs, rounds: [dict(r) for r in fresh])
    monkeypatch.setattr(bench, "cpu_model", lambda: "New EPYC")
    monkeypatch.setattr(bench, "plot", lambda rows, path: None)
    assert bench.main(["--n", "4096", "--iters", "5", "--methods", "sdpa", "ours", "--merge",
                       "--out", str(tmp_path)]) == 0
    saved = json.loads((tmp_path / "attention.json").read_text())
    machine = {(r["method"], r["n"], r["n_iters"]): r["cpu"] for r in saved["rows"]}
    assert machine[("ours", 4096, 5)] == machine[("sdpa", 4096, 1)] == "New EPYC"
    assert machine[("ours", 1024, 5)] == machine[("ours-chunked", 4096, 5)] == "Old Xeon"
    targets = saved["targets"]
    assert targets["time_ours_over_sdpa_4096"] == 1.5  # both rows of the new run
    assert targets["time_ours_over_sdpa"] == 1.5  # both rows of one earlier run
    assert "time_chunked_over_ours_4096" not in targets  # an old chunked row against a new ours row
    assert targets["memory_21_over_5"] == 63.0 / 60.0  # two earlier runs on one machine
    assert targets["memory_ours_over_sdpa_4096"] == 300.0 / 160.0  # the new run's rows, on one machine
    header = (tmp_path / "attention.md").read_text().splitlines()[0]
    assert "Old Xeon (old and older); New EPYC (20" in header


def _committed_grid(name: str):
    """A committed grid's JSON, its forward+backward ratios of ours by (n, n_iters, causal), the 5-iteration ones
    at n = 64..4096 as docs/speed.md writes them, and that page's text (whitespace collapsed)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    grid = json.loads((root / "benchmarks" / "results" / name).read_text())
    ratio = {(r["n"], r["n_iters"], r["causal"]): r["forward_backward_ratio"] for r in grid["rows"]
             if r["method"] == "ours"}
    five = [f"{ratio[(n, 5, False)]:.2f}×" for n in (64, 128, 256, 512, 1024, 4096)]
    return grid, ratio, five, " ".join((root / "docs" / "speed.md").read_text().split())


def test_the_xeon_paragraphs_quote_the_committed_grid():
    """docs/speed.md's paragraph on the Intel Xeon and the causal engine's quote the committed grid's ratios
    (5 iterations, forward+backward, n = 64..4096; causal, 3 iterations, at n = 1024 and 4096)."""
    grid, ratio, five, text = _committed_grid("attention_grid.json")
    assert (f"(5 iterations, forward+backward: {five[0]} at n = 64, {five[1]} at 128, {five[2]} at 256, {five[3]} "
            f"at 512, {five[4]} at 1024, {five[5]} at 4096,") in text
    causal = [f"{ratio[(n, 3, True)]:.2f}×" for n in (1024, 4096)]
    assert f"where causal Sinkhorn reads {causal[0]} and {causal[1]}" in text
    assert f"{grid['targets']['causal3_at_4096']:.2f}" == causal[1][:-1]


def test_the_quick_grids_paragraph_quotes_its_run_and_the_one_before():
    """The quick grid's paragraph in docs/speed.md: the committed run's '2x' and '8x' figures, after the run
    before it."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    quick = json.loads((root / "benchmarks" / "results" / "quick" / "attention.json").read_text())["targets"]
    text = " ".join((root / "docs" / "speed.md").read_text().split())
    assert (f"where this one reads {quick['time_ours_over_sdpa']:.2f}× and {quick['speedup_over_paper']:.2f}×"
            in text)


def test_the_grid_before_the_native_passes_is_quoted_from_its_committed_run():
    """docs/speed.md quotes the grid at 8d35569 (the commit before the native passes, same machine) beside the
    committed one: its 5-iteration ratios at n = 64..4096 and its causal 3-iteration ratios."""
    _, ratio, five, text = _committed_grid("attention_grid_8d35569.json")
    assert (f"at 8d35569 on the same machine (`benchmarks/results/attention_grid_8d35569.md`), read "
            f"{', '.join(five[:5])} and {five[5]}:") in text
    assert f"the run at 8d35569, with the same causal engine, {ratio[(1024, 3, True)]:.2f}× and {ratio[(4096, 3, True)]:.2f}×" in text


def test_the_grid_of_the_first_native_passes_is_quoted_from_its_committed_run():
    """docs/speed.md quotes the grid at b0b46e8 (the first native passes) beside the committed one: its 5-iteration
    ratios at n = 64..4096, its causal 3-iteration ratios, and both runs' causal SDPA time at n = 4096."""
    _, ratio, five, text = _committed_grid("attention_grid_b0b46e8.json")
    assert (f"`benchmarks/results/attention_grid_b0b46e8.md`), read {', '.join(five[:5])} and {five[5]}:") in text
    assert f"the grid at b0b46e8 {ratio[(1024, 3, True)]:.2f}× and {ratio[(4096, 3, True)]:.2f}×" in text
    sdpa = []
    for name in ("attention_grid_b0b46e8.json", "attention_grid.json"):  # the run quoted, and the one committed
        grid = _committed_grid(name)[0]
        sdpa += [row["forward_backward_ms"] for row in grid["rows"]
                 if row["method"] == "sdpa" and row["causal"] and row["n"] == 4096]
    assert (f"causal SDPA itself took {sdpa[0]:.0f} ms forward+backward at n = 4096 in b0b46e8's run, {sdpa[1]:.0f} "
            "ms in this one") in text


def test_the_grid_run_before_the_committed_one_is_quoted_from_its_committed_run():
    """docs/speed.md quotes the grid at e49fa22 beside the committed one: its 5-iteration ratios at n = 64..4096, its
    causal ratios, and n = 1024's reading in both runs against its 1.25 target."""
    _, earlier, five, text = _committed_grid("attention_grid_e49fa22.json")
    _, now, _, _ = _committed_grid("attention_grid.json")
    assert "(`benchmarks/results/attention_grid_e49fa22.md`; the same code" in text
    assert f"ran on the Python threads there) read {', '.join(five[:5])} and {five[5]}:" in text
    assert f"the grid at e49fa22 {earlier[(1024, 3, True)]:.2f}× and {earlier[(4096, 3, True)]:.2f}×" in text
    pair = sorted([earlier[(1024, 5, False)], now[(1024, 5, False)]])
    assert pair[0] <= 1.25 < pair[1] and "1.25× target is met in one run of two" in text
    assert f"in both, {earlier[(1024, 5, False)]:.2f}× and {now[(1024, 5, False)]:.2f}×," in text
    assert max(earlier[(4096, 5, False)], now[(4096, 5, False)]) <= 1.5 and "n = 4096's 1.5× is met in both" in text


def test_the_epyc_paragraph_quotes_its_committed_grid():
    """docs/speed.md's paragraph on the AMD EPYC quotes its grid at 0eec9a0: the 5-iteration ratios at n = 64..4096,
    the causal 3-iteration ratios, which targets it meets, and SDPA's time at n = 1024 beside the Xeon's."""
    grid, ratio, five, text = _committed_grid("attention_grid_epyc_0eec9a0.json")
    assert grid["cpu"] == "AMD EPYC"
    assert (f"the ratios read {five[0]} at n = 64, {five[1]} at 128, {five[2]} at 256, {five[3]} at 512, {five[4]} at "
            f"1024 and {five[5]} at 4096 (5 iterations, forward+backward), and causal Sinkhorn "
            f"{ratio[(1024, 3, True)]:.2f}× and {ratio[(4096, 3, True)]:.2f}× at n = 1024 and 4096") in text
    met = {key: value <= target for key, (value, target) in {
        "64-512": (max(ratio[(n, 5, False)] for n in (64, 128, 256, 512)), 1.5), "1024": (ratio[(1024, 5, False)], 1.25),
        "4096": (ratio[(4096, 5, False)], 1.5), "causal": (max(ratio[(n, 3, True)] for n in (1024, 4096)), 3.0)}.items()}
    assert met == {"64-512": True, "1024": False, "4096": True, "causal": True}
    assert "every target of the grid met on that CPU but n = 1024's 1.25×" in text
    sdpa = [next(r["forward_backward_ms"] for r in _committed_grid(name)[0]["rows"]
                 if r["method"] == "sdpa" and not r["causal"] and r["n"] == 1024)
            for name in ("attention_grid_epyc_0eec9a0.json", "attention_grid.json")]
    assert sdpa[0] < sdpa[1]
    assert f"SDPA is faster there too ({sdpa[0]:.0f} ms forward+backward at n = 1024, {sdpa[1]:.0f} ms on the Xeon)" in text


def test_the_targets_and_streamed_paragraphs_quote_the_full_and_quick_tables():
    """docs/speed.md's 'What the targets say' and its streamed engine's paragraph quote the committed full table
    (attention.json) and the quick grid: the '2x' and '8x' targets in each, the streamed engine's time over the
    tiled one's at n = 4096 and both engines' peak memory there over SDPA's."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    results = root / "benchmarks" / "results"
    full = json.loads((results / "attention.json").read_text())
    quick = json.loads((results / "quick" / "attention.json").read_text())["targets"]
    t = full["targets"]
    text = " ".join((root / "docs" / "speed.md").read_text().split())
    assert f"met in both grids ({t['time_ours_over_sdpa']:.2f}× and {quick['time_ours_over_sdpa']:.2f}×;" in text
    assert t["speedup_over_paper"] >= 8 > quick["speedup_over_paper"]
    rows = {(r["method"], r["n_iters"]): r for r in full["rows"] if r["n"] == 1024}
    assert (f"EPYC at 7bb20d5, after the padded tile rows ({t['speedup_over_paper']:.2f}×, the reference at "
            f"{t['time_paper_over_sdpa']:.1f}× SDPA there: {rows[('paper-reference', 5)]['forward_backward_ms']:.0f} ms "
            f"forward+backward, ours {rows[('ours', 5)]['forward_backward_ms']:.0f} ms; 8.10× at 070ce91") in text
    assert (f"in the quick grid's, measured on the Xeon ({quick['speedup_over_paper']:.2f}×, the reference at "
            f"{quick['time_paper_over_sdpa']:.1f}× SDPA)") in text
    assert t["time_ours_over_sdpa"] <= 1.25
    assert f"Ours / SDPA at n = 1024 reads {t['time_ours_over_sdpa']:.2f}× in that run (1.16× at 070ce91" in text
    assert t["time_chunked_over_ours_4096"] <= 1.5
    assert f"`ours-chunked / ours` measures: {t['time_chunked_over_ours_4096']:.2f}× at n = 4096" in text
    peak = {r["method"]: r["peak_mib"] for r in full["rows"] if r["n"] == 4096 and r["n_iters"] in (1, 5)
            and r["method"] in ("sdpa", "ours", "ours-chunked") and (r["method"] == "sdpa") == (r["n_iters"] == 1)}
    assert (f"its peak at n = 4096 is {peak['ours-chunked'] / peak['sdpa']:.2f}× SDPA's there, the tiled engine's "
            f"{peak['ours'] / peak['sdpa']:.2f}×") in text
    small = {r["method"]: r for r in full["rows"] if r["n"] == 256 and (r["method"], r["n_iters"]) in
             (("sdpa", 1), ("ours", 5))}
    assert small["ours"]["cpu"] == small["sdpa"]["cpu"] and small["ours"]["peak_mib"] > 1.5 * small["sdpa"]["peak_mib"]
    assert (f"at n = 256 the full table's 5-iteration peak is {small['ours']['peak_mib']:.1f} MiB against SDPA's "
            f"{small['sdpa']['peak_mib']:.1f} MiB ({small['ours']['peak_mib'] / small['sdpa']['peak_mib']:.2f}×, "
            "measured on the Xeon)") in text
    assert t["memory_ours_over_sdpa_4096"] <= 1.5 and t["time_ours_over_sdpa_4096"] <= 1.5
    assert f"Peak memory at n = 4096 is {t['memory_ours_over_sdpa_4096']:.2f}× SDPA's in the full table" in text
    assert f"the tiled engine now at {t['time_ours_over_sdpa_4096']:.2f}×" in text


def test_the_epyc_grid_after_the_transposed_products_is_quoted_beside_the_one_before():
    """docs/speed.md quotes the EPYC's grid at 7930b6b beside the one at 0eec9a0: its 5-iteration ratios at n = 64..4096,
    its causal ratios, n = 1024 and n = 64 before and after (the 1.25 target met in the later run), and SDPA's own
    time at n = 64 in both runs."""
    grid, after, five, text = _committed_grid("attention_grid_epyc_7930b6b.json")
    earlier, before, _, _ = _committed_grid("attention_grid_epyc_0eec9a0.json")
    assert grid["cpu"] == "AMD EPYC"
    assert (f"transposed products, bbc6187, the one change since to what it measures) read {', '.join(five[:5])} and "
            f"{five[5]}, and causal {after[(1024, 3, True)]:.2f}× and {after[(4096, 3, True)]:.2f}×:") in text
    assert before[(1024, 5, False)] > 1.25 >= after[(1024, 5, False)]
    assert f"n = 1024 from {before[(1024, 5, False)]:.2f}× to {after[(1024, 5, False)]:.2f}×" in text
    assert f"n = 64, whose calls the change does not reach, from {before[(64, 5, False)]:.2f}× to {after[(64, 5, False)]:.2f}×" in text
    sdpa = [next(r["forward_backward_ms"] for r in g["rows"] if r["method"] == "sdpa" and not r["causal"] and r["n"] == 64)
            for g in (earlier, grid)]
    assert f"(SDPA's own time {sdpa[0]:.3f} ms there, {sdpa[1]:.3f} ms here)" in text


def test_the_epyc_grid_after_the_split_slices_is_quoted():
    """docs/speed.md quotes the EPYC's grid at 6db06b6 (after large slices were split over the cores): its
    5-iteration ratios at n = 64..4096 and its causal ones, and n = 4096 beside the run before."""
    grid, after, five, text = _committed_grid("attention_grid_epyc_6db06b6.json")
    _, before, _, _ = _committed_grid("attention_grid_epyc_7930b6b.json")
    assert grid["cpu"] == "AMD EPYC"
    assert (f"which reaches only n = 4096) read {', '.join(five[:5])} and {five[5]}, and causal "
            f"{after[(1024, 3, True)]:.2f}× and {after[(4096, 3, True)]:.2f}×:") in text
    assert f"n = 4096 from {before[(4096, 5, False)]:.2f}× to {after[(4096, 5, False)]:.2f}×" in text
    assert after[(4096, 5, False)] <= 1.5 and after[(1024, 5, False)] <= 1.25
    assert max(after[(n, 5, False)] for n in (64, 128, 256, 512)) <= 1.5


def test_the_epyc_grids_after_the_small_calls_change_are_quoted():
    """docs/speed.md quotes both EPYC grids at 25870a0 in the order they ran: their 5-iteration ratios at n = 64..4096,
    their causal ones, SDPA's own time at n = 64 in each and in 6db06b6's, and n = 1024 above the 1.25 target in
    both."""
    first, one, five_1, text = _committed_grid("attention_grid_epyc_25870a0_1214.json")
    second, two, five_2, _ = _committed_grid("attention_grid_epyc_25870a0.json")
    before, earlier, _, _ = _committed_grid("attention_grid_epyc_6db06b6.json")
    assert first["cpu"] == second["cpu"] == "AMD EPYC" and first["date"] < second["date"]
    assert (f"read {', '.join(five_1[:5])} and {five_1[5]}, then {', '.join(five_2[:5])} and {five_2[5]}; causal "
            f"{one[(1024, 3, True)]:.2f}× and {one[(4096, 3, True)]:.2f}×, then {two[(1024, 3, True)]:.2f}× and "
            f"{two[(4096, 3, True)]:.2f}×.") in text
    sdpa = [next(r["forward_backward_ms"] for r in g["rows"] if r["method"] == "sdpa" and not r["causal"] and r["n"] == 64)
            for g in (first, second, before)]
    assert (f"SDPA itself took {sdpa[0]:.3f} ms forward+backward at n = 64 in the first run and {sdpa[1]:.3f} ms in the "
            f"second ({sdpa[2]:.3f} ms at 6db06b6)") in text
    assert f"n = 64 read {earlier[(64, 5, False)]:.2f}× at 6db06b6" in text
    assert one[(1024, 5, False)] > 1.25 and two[(1024, 5, False)] > 1.25
    assert (f"read {one[(1024, 5, False)]:.2f}× ({one[(1024, 5, False)]:.3f}) and {two[(1024, 5, False)]:.2f}×, above "
            "the 1.25× target in both") in text
    assert max(g[(n, 5, False)] for g in (one, two) for n in (64, 128, 256, 512)) <= 1.5
    assert all(g[(4096, 5, False)] <= 1.5 and max(g[(n, 3, True)] for n in (1024, 4096)) <= 3 for g in (one, two))


def test_the_epyc_grids_after_the_native_groups_are_quoted():
    """docs/speed.md quotes both EPYC grids at e3a0c79 in the order they ran: their 5-iteration ratios at n = 64..4096,
    their causal ones, n = 1024 in both, the range of n = 1024 over this session's four runs and the moves of sizes
    that no change reached (n = 4096 and causal n = 4096, lowest and highest of the four)."""
    first, one, five_1, text = _committed_grid("attention_grid_epyc_e3a0c79.json")
    second, two, five_2, _ = _committed_grid("attention_grid_epyc_e3a0c79_1311.json")
    earlier = [_committed_grid(name)[1] for name in ("attention_grid_epyc_25870a0_1214.json",
                                                      "attention_grid_epyc_25870a0.json")]
    assert first["cpu"] == second["cpu"] == "AMD EPYC" and first["date"] < second["date"]
    assert (f"read {', '.join(five_1[:5])} and {five_1[5]}, then {', '.join(five_2[:5])} and {five_2[5]}; causal "
            f"{one[(1024, 3, True)]:.2f}× and {one[(4096, 3, True)]:.2f}×, then {two[(1024, 3, True)]:.2f}× and "
            f"{two[(4096, 3, True)]:.2f}×.") in text
    assert f"n = 1024 read {one[(1024, 5, False)]:.2f}× and {two[(1024, 5, False)]:.2f}×, where the rounds run" in text
    four = earlier + [one, two]
    low, high = min(g[(1024, 5, False)] for g in four), max(g[(1024, 5, False)] for g in four)
    assert f"four runs of the grid n = 1024 read {low:.2f}× to {high:.2f}×" in text
    for key, words in (((4096, 5, False), "n = 4096"), ((4096, 3, True), "causal at n = 4096")):
        values = [g[key] for g in four]
        assert f"{words} from {min(values):.2f}× to {max(values):.2f}×" in text
    assert max(g[(n, 5, False)] for g in (one, two) for n in (64, 128, 256, 512)) <= 1.5
    assert all(g[(4096, 5, False)] <= 1.5 and max(g[(n, 3, True)] for n in (1024, 4096)) <= 3 for g in (one, two))


def test_the_epyc_grids_in_fresh_processes_are_quoted():
    """docs/speed.md quotes the EPYC's grids of three fresh processes per n, before (b033162) and after (52875d3) the
    padded tile rows: their 5-iteration ratios at n = 64..4096, their causal ones, each process's figure at
    n = 1024 (and at n = 64 before), the moves of sizes the change does not reach, SDPA's own time at n = 64; n =
    1024 within the 1.25 target in both, and in every process of it after the change."""
    before, was, five_0, text = _committed_grid("attention_grid_epyc_b033162.json")
    after, now, five_1, _ = _committed_grid("attention_grid_epyc_52875d3.json")
    assert before["cpu"] == after["cpu"] == "AMD EPYC" and before["date"] < after["date"]
    assert all(r["processes"] == 3 and len(r["process_ratios"]) == 3 for g in (before, after) for r in g["rows"])

    def ours(grid, n):
        return next(r for r in grid["rows"] if (r["n"], r["method"], r["n_iters"], r["causal"]) == (n, "ours", 5, False))

    def each(grid, n):
        values = [f"{x:.2f}" for x in sorted(ours(grid, n)["process_ratios"])]
        return f"{values[0]}, {values[1]} and {values[2]}×"

    for ratio, five, commit in ((was, five_0, "b033162"), (now, five_1, "52875d3")):
        assert (f"at {commit} (`attention_grid_epyc_{commit}.md`) read {', '.join(five[:5])} and {five[5]}, causal "
                f"{ratio[(1024, 3, True)]:.2f}× and {ratio[(4096, 3, True)]:.2f}×;") in text
        assert ratio[(1024, 5, False)] <= 1.25 and ratio[(4096, 5, False)] <= 1.5
        assert max(ratio[(n, 5, False)] for n in (64, 128, 256, 512)) <= 1.5
        assert max(ratio[(n, 3, True)] for n in (1024, 4096)) <= 3
    assert f"n = 1024's three processes {each(before, 1024)} ({max(ours(before, 1024)['process_ratios']):.3f})" in text
    assert f"n = 64's {each(before, 64)}" in text
    assert f"n = 1024's three processes {each(after, 1024)}: the 1.25× target met by the median and by every" in text
    low, high = min(ours(after, 1024)["process_ratios"]), max(ours(after, 1024)["process_ratios"])
    assert (f"at 52875d3 reads {now[(1024, 5, False)]:.2f}× at n = 1024 (its processes {low:.2f}× to {high:.2f}×), the "
            f"worst n from 64 to 512 {after['targets']['worst_64_512']:.2f}× and n = 4096 "
            f"{after['targets']['at_4096']:.2f}×") in text
    assert max(ours(after, 1024)["process_ratios"]) <= 1.25 < max(ours(before, 1024)["process_ratios"])
    assert f"n = 4096 from {was[(4096, 5, False)]:.2f}× to {now[(4096, 5, False)]:.2f}×" in text
    assert f"n = 64, whose rows are not padded, from {was[(64, 5, False)]:.2f}× to {now[(64, 5, False)]:.2f}×" in text
    sdpa = [next(r["forward_backward_ms"] for r in g["rows"] if r["method"] == "sdpa" and not r["causal"] and r["n"] == 64)
            for g in (after, before)]
    assert f"SDPA's own time there {sdpa[0]:.3f} ms against {sdpa[1]:.3f} ms in the run before" in text
    session = [_committed_grid(f"attention_grid_epyc_{name}.json")[1][(1024, 5, False)]
               for name in ("25870a0_1214", "25870a0", "e3a0c79", "e3a0c79_1311")]
    earlier = {f"{_committed_grid(f'attention_grid_epyc_{name}.json')[1][(1024, 5, False)]:.2f}"
               for name in ("6db06b6", "7930b6b")}
    assert (f"n = 1024 on the AMD EPYC read {min(session):.2f}× to {max(session):.2f}× in four one-process grids of "
            f"one session, {earlier.pop()}× in the two before") in text and not earlier
