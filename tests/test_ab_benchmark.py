"""benchmarks/ab.py: a change before and after, in interleaved rounds."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from benchmarks import ab

ROOT = Path(__file__).resolve().parents[1]


def _saved(folder: Path, n: int, *tensors: torch.Tensor) -> str:
    path = str(folder / f"{n}.pt")
    torch.save(list(tensors), path)
    return path


def test_rounds_alternate_the_trees_and_ratios_are_per_round(monkeypatch):
    calls = []

    def fake(tree, ns, n_iters, causal, threads, what="time", heads=None, workload="attention", folder=None,
             clock="wall", dropout=0.0):
        if what == "ops":
            return {n: n + (1 if tree.name == "after" else 0) for n in ns}
        if what == "results":  # the trees agree at n = 16 and differ by 1e-3 at n = 64
            return {n: _saved(folder, n, torch.ones(3) + (1e-3 if tree.name == "after" and n == 64 else 0.0))
                    for n in ns}
        calls.append(tree.name)
        slow = 2.0 if tree.name == "after" else 1.0
        return {n: slow * n * (1 + len(calls) / 100) for n in ns}  # the machine slows down round by round

    monkeypatch.setattr(ab, "measure", fake)
    rows = ab.compare(Path("/x/before"), Path("/x/after"), [16, 64], 5, False, rounds=4, progress=lambda s: None)
    assert calls == ["before", "after", "after", "before"] * 2
    assert [r["n"] for r in rows] == [16, 64]
    # per-round ratios: the drift shared by both trees of a round nearly cancels
    assert all(1.95 < r["ratio_min"] <= r["ratio"] <= r["ratio_max"] < 2.05 for r in rows)
    assert [(r["before_ops"], r["after_ops"]) for r in rows] == [(16, 17), (64, 65)]
    assert rows[0]["max_difference"] == 0.0 and rows[1]["max_difference"] == pytest.approx(1e-3, rel=1e-3)
    text = ab.table(rows, 5, False)
    assert "| 16 | 4 × 8 |" in text and "medians over 4 interleaved rounds" in text
    assert "| 16 → 17 | identical |" in text
    assert "| 64 → 65 | differ (max \\|Δ\\| 0.001) |" in text


def test_heads_replace_the_tables_and_scale_the_repeats(monkeypatch):
    assert ab.shapes([4096, 64]) == {4096: ab.SHAPES[4096], 64: ab.SHAPES[64]}
    assert ab.shapes([4096, 64], heads=2) == {4096: (1, 2, 4), 64: (4, 2, 120)}
    monkeypatch.setattr(ab, "measure", lambda tree, ns, *a, what="time", heads=None, workload="attention", folder=None,
                        clock="wall", dropout=0.0: {n: _saved(folder, n, torch.zeros(1)) if what == "results" else 1.0 for n in ns})
    rows = ab.compare(Path("/x/before"), Path("/x/after"), [4096], 5, False, rounds=2, progress=lambda s: None, heads=2)
    assert "| 4096 | 1 × 2 |" in ab.table(rows, 5, False)
    with pytest.raises(SystemExit):
        ab.main(["--before", str(ROOT), "--heads", "0"])


def test_cpu_clock_reaches_the_workers_and_the_table_and_needs_one_thread(monkeypatch):
    clocks = []

    def fake(tree, ns, n_iters, causal, threads, what="time", heads=None, workload="attention", folder=None,
             clock="wall", dropout=0.0):
        if what == "results":
            return {n: _saved(folder, n, torch.zeros(1)) for n in ns}
        clocks.append((what, clock))
        return {n: 1.0 for n in ns}

    monkeypatch.setattr(ab, "measure", fake)
    rows = ab.compare(Path("/x/before"), Path("/x/after"), [16], 5, False, rounds=2, threads=1,
                      progress=lambda s: None, clock="cpu")
    assert [c for w, c in clocks if w == "time"] == ["cpu"] * 4
    assert "lower decile of its repeats' CPU times, one thread" in ab.table(rows, 5, False)
    assert "CPU times" not in ab.table([dict(r, clock="wall") for r in rows], 5, False)
    with pytest.raises(SystemExit):
        ab.main(["--before", str(ROOT), "--clock", "cpu"])  # CPU time of one thread: --threads 1 only


def test_dropout_reaches_the_workers_and_the_table_and_the_attention_calls(monkeypatch):
    """``--dropout P``: every measurement of both trees runs ``dropout_p = P`` (a real worker too: its
    forward+backward with dropout makes more aten calls than without), the table says so, and a value outside
    [0, 1) or with the sort workload is refused."""
    seen = []

    def fake(tree, ns, n_iters, causal, threads, what="time", heads=None, workload="attention", folder=None,
             clock="wall", dropout=0.0):
        seen.append((what, dropout))
        return {n: _saved(folder, n, torch.zeros(1)) if what == "results" else 1.0 for n in ns}

    monkeypatch.setattr(ab, "measure", fake)
    rows = ab.compare(Path("/x/before"), Path("/x/after"), [16], 5, False, rounds=2, progress=lambda s: None,
                      dropout=0.1)
    assert {d for _, d in seen} == {0.1} and {w for w, _ in seen} == {"time", "ops", "results"}
    assert "Sinkhorn, n_iters=5, dropout_p=0.1, forward+backward" in ab.table(rows, 5, False)
    assert "dropout_p" not in ab.table([dict(r, dropout=0.0) for r in rows], 5, False)
    monkeypatch.undo()
    plain, dropped = (ab.measure(ROOT, [16], 3, False, threads=1, what="ops", dropout=p)[16] for p in (0.0, 0.1))
    assert dropped > plain
    for bad in (["--dropout", "1.0"], ["--dropout", "0.1", "--workload", "sort"]):
        with pytest.raises(SystemExit):
            ab.main(["--before", str(ROOT), *bad])


def test_one_measurement_runs_the_tree_it_is_given():
    got = ab.measure(ROOT, [16], 3, False, threads=1, clock="cpu")  # (the sort workload's test: the wall clock)
    assert set(got) == {16} and 0 < got[16] < 10_000
    ops = ab.measure(ROOT, [16], 3, False, threads=1, what="ops")
    assert set(ops) == {16} and isinstance(ops[16], int) and ops[16] > 10  # a forward+backward is many aten calls


def test_a_server_times_calls_of_its_tree_on_request_until_closed():
    """``--paired``: one worker per tree, a timed forward+backward per request, each n on its own tensors."""
    with ab.Server(ROOT, [16, 64], 3, False, threads=1, clock="cpu") as server:
        small, large, again = server.time(16), server.time(64), server.time(16)
        assert 0 < small < 10_000 and 0 < again < 10_000 and 0 < large < 10_000
        process = server.process
    assert process.poll() == 0  # closing stdin ends the worker


def _binomial_below(N: int, j: int) -> float:
    """P(Binomial(N, 1/2) < j), exactly."""
    return sum(math.comb(N, i) for i in range(j)) / 2**N


@pytest.mark.parametrize("N", [5, 6, 7, 9, 20, 51, 200])
def test_the_median_interval_is_the_order_statistics_of_the_binomial_rule(N):
    values = [float(i) for i in range(N, 0, -1)]  # N, ..., 1 (sorted inside)
    low, high = ab.median_interval(values)
    j = int(low)  # values are 1..N: x_(j) = j
    assert high == N + 1 - j
    if _binomial_below(N, 1) > 0.025:  # too few for 95 %: the whole range
        assert (low, high) == (1.0, float(N))
    else:  # the largest j whose two tails hold at most 2.5 % each
        assert _binomial_below(N, j) <= 0.025 < _binomial_below(N, j + 1)


def test_pairs_alternate_the_trees_call_by_call_and_ratios_are_per_pair(monkeypatch):
    calls, clock = [], [0]

    class FakeServer:
        def __init__(self, tree, *args, **kwargs):
            self.name = tree.name

        def time(self, n):
            clock[0] += 1
            calls.append(self.name)
            slow = 2.0 if self.name == "after" else 1.0
            return slow * n * (1 + clock[0] / 100)  # the machine slows down call by call

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

    def fake_rest(before, after, ns, *args):
        return [{"n": n, "batch_heads": (4, 8), "before_ops": 1, "after_ops": 1, "max_difference": 0.0,
                 "clock": "wall", "dropout": 0.0} for n in ns]

    monkeypatch.setattr(ab, "Server", FakeServer)
    monkeypatch.setattr(ab, "_calls_and_results", fake_rest)
    started = []
    original = FakeServer.__init__

    def start(self, tree, *args, **kwargs):
        started.append(tree.name)
        original(self, tree, *args, **kwargs)

    monkeypatch.setattr(FakeServer, "__init__", start)
    rows = ab.compare_paired(Path("/x/before"), Path("/x/after"), [16, 64], 5, False, pairs=9, rounds=3,
                             progress=lambda s: None, warmup=1)
    assert started == ["before", "after", "after", "before", "before", "after"]  # fresh processes each round
    per_n = 2 * (1 + 9)
    assert calls[:per_n][2:] == ["before", "after", "after", "before"] * 4 + ["before", "after"]
    assert len(calls) == 3 * 2 * per_n
    for row in rows:  # each pair's drift nearly cancels: every ratio within 2 % of the true 2
        assert 1.98 < row["ratio_low"] <= row["ratio"] <= row["ratio_high"] < 2.02
        assert row["pairs"] == 9 and row["rounds"] == 3 and len(row["round_ratios"]) == 3
    text = ab.table(rows, 5, False)
    assert "3 rounds of fresh processes, each the median of 9 pairs of calls" in text
    assert "median of the rounds (95 % interval)" in text
    for bad in (["--paired", "0"], ["--paired", "5", "--rounds", "0"]):
        with pytest.raises(SystemExit):
            ab.main(["--before", str(ROOT), *bad])


@pytest.mark.slow  # the default suite stays under 15 minutes on 2 cores
def test_the_sort_workload_times_the_block_sorting_of_its_tree():
    """``--workload sort``: sort_matrix forward+backward at N_B blocks (its own table of sizes)."""
    assert ab.shapes([8, 96], workload="sort") == {8: ab.SORT_SHAPES[8], 96: ab.SORT_SHAPES[96]}
    for causal in (False, True):
        got = ab.measure(ROOT, [8], 5, causal, threads=1, workload="sort")
        assert set(got) == {8} and 0 < got[8] < 10_000
    ops = ab.measure(ROOT, [8], 5, True, threads=1, what="ops", workload="sort")
    assert ops[8] > 10
    assert "block sorting (sort_matrix), sort_iters=5" in ab.table(
        [{"n": 8, "batch_heads": (32, 4), "before_ms": 1.0, "after_ms": 0.5, "ratio": 0.5, "ratio_min": 0.4,
          "ratio_max": 0.6, "rounds": 3}], 5, False, workload="sort")
    with pytest.raises(SystemExit):
        ab.main(["--before", str(ROOT), "--workload", "sort", "--n", "64"])


def test_a_folder_without_the_package_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        ab.main(["--before", str(tmp_path), "--after", str(ROOT)])


def test_the_source_of_a_tree_is_its_commit(tmp_path):
    assert ab.source(tmp_path) == "unknown"
    if (ROOT / ".git").exists():  # a checkout (not an unpacked archive): its commit, 12 hex digits
        assert len(ab.source(ROOT).split("+")[0]) == 12


@pytest.mark.slow  # the default suite stays under 15 minutes on 2 cores
def test_results_of_two_trees_are_compared_entry_by_entry(tmp_path):
    """The results column: the output and gradients of one seeded forward+backward, saved by each tree's
    worker; a tree against itself is identical (the worker is deterministic), and differences are the
    largest absolute one, NaNs in the same places counting as equal and in other places as inf."""
    for name in ("one", "two"):
        (tmp_path / name).mkdir()
    one = ab.measure(ROOT, [16], 3, False, threads=1, what="results", folder=tmp_path / "one")
    two = ab.measure(ROOT, [16], 3, False, threads=1, what="results", folder=tmp_path / "two")
    saved = torch.load(one[16])
    assert [t.shape for t in saved] == [(4, 8, 16, 64)] * 4  # the output, then the gradients of q, k and v
    assert ab.difference(one[16], two[16]) == 0.0
    nan = float("nan")
    base = _saved(tmp_path, 1, torch.tensor([1.0, nan, 3.0]), torch.zeros(2))
    assert ab.difference(base, _saved(tmp_path, 2, torch.tensor([1.0, nan, 3.0]), torch.zeros(2))) == 0.0
    assert ab.difference(base, _saved(tmp_path, 3, torch.tensor([1.0, nan, 3.5]), torch.zeros(2))) == 0.5
    assert ab.difference(base, _saved(tmp_path, 4, torch.tensor([nan, 1.0, 3.0]), torch.zeros(2))) == float("inf")
    assert ab.difference(base, _saved(tmp_path, 5, torch.tensor([1.0, nan]), torch.zeros(2))) == float("inf")


def test_the_iterate_layout_paragraph_is_the_committed_runs():
    """docs/speed.md's figures for the iterates' layout are those of the two committed ab runs, each a
    comparison of two commits of the history (before: the parent of after)."""
    results = ROOT / "benchmarks" / "results"
    text = " ".join((ROOT / "docs" / "speed.md").read_text().split())
    many, five = (json.loads((results / f"ab_issue26_iterate_layout{k}.json").read_text()) for k in (21, 5))
    small, large = ({row["n"]: row for row in many["rows"]}[n] for n in (64, 256))
    assert f"0.935× at n = 64 (rounds {small['ratio_min']:.3f}–{small['ratio_max']:.3f})" in text
    assert f"{small['ratio']:.3f}" == "0.935" and f"{large['ratio']:.3f}× at 256 ({large['ratio_min']:.3f}–" \
           f"{large['ratio_max']:.3f})" in text
    ratios = [row["ratio"] for row in five["rows"]]
    assert [row["n"] for row in five["rows"]] == [16, 64, 256, 1024]
    assert f"medians {min(ratios):.2f}–{max(ratios):.2f}" in text
    assert all(row["ratio_min"] < 1 < row["ratio_max"] for row in five["rows"])  # "rounds on both sides of 1"
    largest = max(row["max_difference"] for row in many["rows"] + five["rows"])
    assert f"differences up to {largest:.0e}".replace("e-07", "e-7") in text
    assert all(row["clock"] == "cpu" and row["rounds"] == 7 for row in many["rows"] + five["rows"])
    for run in (many, five):
        assert run["before"][:12] == "8eee9c40c2b5" and run["after"][:12] == "d7b2d3839c53"


def test_the_sorting_without_bool_tiles_paragraph_is_the_committed_run():
    """docs/speed.md's figures for the sorting without bool tiles are those of the committed ab run, two
    commits of the history (before: the parent of after)."""
    run = json.loads((ROOT / "benchmarks" / "results" / "ab_issue26_sort_tiles.json").read_text())
    text = " ".join((ROOT / "docs" / "speed.md").read_text().split())
    rows = {row["n"]: row for row in run["rows"]}
    assert run["workload"] == "sort" and run["before"][:12] == "87b9852e433b" and run["after"][:12] == "5465e103b6e8"
    assert all(row["clock"] == "cpu" and row["rounds"] == 11 for row in run["rows"])
    assert "11 interleaved rounds on a noisy day (rounds on both sides of 1 at every size)" in text
    assert all(row["ratio_min"] < 1 < row["ratio_max"] for row in run["rows"])
    assert f"96 blocks the median is {rows[96]['ratio']:.3f}×" in text
    largest = max(row["max_difference"] for row in run["rows"])
    assert f"differences up to {largest:.1e}".replace("e-07", "e-7") in text


def test_the_dropout_masks_paragraph_is_the_committed_run():
    """docs/speed.md's figures for the dropout masks are those of the committed ab run (before: the parent of
    after), timed with dropout."""
    run = json.loads((ROOT / "benchmarks" / "results" / "ab_issue26_dropout.json").read_text())
    text = " ".join((ROOT / "docs" / "speed.md").read_text().split())
    rows = {row["n"]: row for row in run["rows"]}
    assert run["before"][:12] == "3bb3b7781e56" and run["after"][:12] == "b83e30d3d451"
    assert all(row["clock"] == "cpu" and row["rounds"] == 7 and row["dropout"] == 0.1 for row in run["rows"])
    assert "`python -m benchmarks ab --dropout 0.1`, one thread, CPU time, 7 interleaved rounds" in text
    assert (f"The median ratio is {rows[256]['ratio']:.3f}× at n = 256 (every round below 1) and "
            f"{rows[64]['ratio']:.3f}× and {rows[1024]['ratio']:.3f}× at n = 64 and 1024 (rounds on both sides of 1)"
            ) in text
    assert rows[256]["ratio_max"] < 1 and all(rows[n]["ratio_min"] < 1 < rows[n]["ratio_max"] for n in (64, 1024))


def test_the_causal_row_blocks_paragraph_is_the_committed_run():
    """docs/speed.md's figures for the causal row blocks' fewer passes are those of the committed ab run
    (b752213 -> 09a2867, the four commits of the change), causal, 3 iterations, every round below 1."""
    run = json.loads((ROOT / "benchmarks" / "results" / "ab_issue26_causal_blocks.json").read_text())
    text = " ".join((ROOT / "docs" / "speed.md").read_text().split())
    rows = {row["n"]: row for row in run["rows"]}
    assert run["before"][:12] == "b752213319bc" and run["after"][:12] == "09a286791553"
    assert all(row["clock"] == "cpu" and row["rounds"] == 7 for row in run["rows"])
    assert "`python -m benchmarks ab --causal --iters 3`, one thread, CPU time, 7 interleaved rounds" in text
    assert all(row["ratio_max"] < 1 for row in run["rows"])
    assert (f"Every round was faster at every size: the median ratio is {rows[64]['ratio']:.3f}× at n = 64, "
            f"{rows[256]['ratio']:.3f}× at 256, {rows[1024]['ratio']:.3f}× at 1024 and {rows[4096]['ratio']:.3f}× "
            "at 4096") in text
    worst = max(row["max_difference"] for row in run["rows"])
    assert f"at most {worst:.1e} here" in text


def test_the_causal_buffers_paragraph_is_the_committed_run():
    """docs/speed.md's figures for the causal row blocks' buffers: the committed ab run (09a2867 -> e3d8b78,
    identical results) and the causal table's peak memory at n = 4096."""
    run = json.loads((ROOT / "benchmarks" / "results" / "ab_issue26_causal_scratch.json").read_text())
    causal = json.loads((ROOT / "benchmarks" / "results" / "causal.json").read_text())
    text = " ".join((ROOT / "docs" / "speed.md").read_text().split())
    rows = {row["n"]: row for row in run["rows"]}
    assert run["before"][:12] == "09a286791553" and run["after"][:12] == "e3d8b784bea3"
    assert all(row["clock"] == "cpu" and row["rounds"] == 7 and row["max_difference"] == 0 for row in run["rows"])
    assert rows[256]["ratio_max"] < 1 and rows[4096]["ratio_max"] < 1
    assert all(rows[n]["ratio_min"] < 1 < rows[n]["ratio_max"] for n in (64, 1024))
    assert (f"The median ratio is {rows[256]['ratio']:.3f}× at n = 256 and {rows[4096]['ratio']:.3f}× at 4096 "
            f"(every round below 1), {rows[1024]['ratio']:.3f}× at 1024 and {rows[64]['ratio']:.3f}× at 64 (rounds "
            "on both sides of 1)") in text
    peak = next(r["peak_mib"] for r in causal["rows"] if r["method"] == "causal" and r["n"] == 4096 and r["n_iters"] == 3)
    assert f"fell from 148 to {peak:.0f} MiB at n = 4096" in text


def test_the_paired_runs_paragraph_is_the_committed_runs():
    """docs/speed.md's figures for ``--paired``: the null run (4c788b8 against itself) and the run of the
    whole-norm check (4c788b8 -> 2a1a214), 7 rounds of 21 pairs, CPU time; every interval contains 1."""
    null = json.loads((ROOT / "benchmarks" / "results" / "ab_issue26_paired_null.json").read_text())
    check = json.loads((ROOT / "benchmarks" / "results" / "ab_issue26_validation.json").read_text())
    text = " ".join((ROOT / "docs" / "speed.md").read_text().split())
    assert null["before"] == null["after"] == check["before"] == "4c788b85e506" and check["after"] == "2a1a2148a0eb"
    for run in (null, check):
        for row in run["rows"]:
            assert row["clock"] == "cpu" and row["rounds"] == 7 and row["pairs"] == 21 and row["max_difference"] == 0
            assert row["ratio_low"] == min(row["round_ratios"]) and row["ratio_high"] == max(row["round_ratios"])
            assert row["ratio_low"] < 1 < row["ratio_high"]  # "every interval contains 1"
    rows = {row["n"]: row for row in null["rows"]}
    spans = [f"from {rows[n]['ratio_low']:.3f} to {rows[n]['ratio_high']:.3f} at {'n = ' if n == 256 else ''}{n}"
             for n in (256, 1024, 64)]
    assert f"They run {spans[0]}, {spans[1]} and {spans[2]}," in text
    assert all(row["before_ops"] - row["after_ops"] == 6 for row in check["rows"])
    assert "Six fewer aten calls and identical results; no change in time is resolved at any n" in text


def _rounds_run(name: str, before: str, after: str) -> dict:
    """A committed ab run's rows by n (checked: its trees)."""
    run = json.loads((ROOT / "benchmarks" / "results" / name).read_text())
    assert run["before"] == before and run["after"] == after
    return {row["n"]: row for row in run["rows"]}


def _paired_run(name: str, before: str, after: str, rounds: int, pairs: int, clock: str = "cpu") -> tuple[dict, str]:
    """A committed paired ab run's rows by n (checked: its trees, its clock, rounds and pairs) and docs/speed.md's
    text (whitespace collapsed)."""
    run = json.loads((ROOT / "benchmarks" / "results" / name).read_text())
    assert run["before"] == before and run["after"] == after
    rows = {row["n"]: row for row in run["rows"]}
    for row in rows.values():
        assert row["clock"] == clock and row["rounds"] == rounds and row["pairs"] == pairs
    return rows, " ".join((ROOT / "docs" / "speed.md").read_text().split())


def test_the_native_passes_paragraph_is_their_committed_run():
    """docs/speed.md's figures for the native passes: the paired run 8d35569 -> b0b46e8 (7 rounds of 21 pairs, CPU
    time): every interval below 1 from n = 16 to 512, the quoted medians, a third of the aten calls or fewer; at
    n = 1024 (the composed passes) identical results and an interval containing 1."""
    rows, text = _paired_run("ab_issue26_native.json", "8d35569a3b57", "b0b46e85d153", rounds=7, pairs=21)
    for n in (16, 64, 128, 256, 512):
        assert rows[n]["ratio_high"] < 1 and 3 * rows[n]["after_ops"] <= rows[n]["before_ops"]
    assert rows[1024]["max_difference"] == 0 and rows[1024]["ratio_low"] < 1 < rows[1024]["ratio_high"]
    ratio = {n: f"{rows[n]['ratio']:.2f}" for n in rows}
    assert (f"a forward+backward takes {ratio[16]}× its time before at n = 16, {ratio[64]}× at 64, {ratio[128]}× at "
            f"128, {ratio[256]}× at 256 and {ratio[512]}× at 512, with a third of the aten calls or fewer") in text


def test_the_row_blocks_paragraph_is_their_committed_run():
    """docs/speed.md's figures for the row blocks' C operators: the paired run c204efd -> a4fd24e (5 rounds of 11
    pairs, CPU time, one thread): at n = 4096 an interval below 1, its median and the share of aten calls saved; at
    n = 2048 an interval that reaches 1."""
    rows, text = _paired_run("ab_issue26_rows.json", "c204efdbc05c", "a4fd24e69934", rounds=5, pairs=11)
    big, small = rows[4096], rows[2048]
    saved = round(100 * (1 - big["after_ops"] / big["before_ops"]))
    assert big["ratio_high"] < 1 and (f"a forward+backward takes {big['ratio']:.2f}× its time before, with {saved} % "
                                      "fewer aten calls") in text
    assert small["ratio_low"] < 1 < small["ratio_high"]
    assert (f"At n = 2048 the median reads {small['ratio']:.2f}× but the interval reaches {small['ratio_high']:.3f}"
            in text)


def test_the_transposed_products_paragraph_quotes_its_paired_run():
    """docs/speed.md's figures for the native backward's transposed products: the paired run 7d975a8 -> bbc6187 (5
    rounds of 11 pairs, CPU time, one thread): at n = 1024 an interval below 1 and identical results; at n = 512 an
    interval that reaches 1; n = 256 and 2048 unchanged controls."""
    rows, text = _paired_run("ab_issue26_transposed.json", "7d975a8e6fa4", "bbc61874d7dd", rounds=5, pairs=11)
    assert rows[1024]["ratio_high"] < 1 and rows[1024]["max_difference"] == 0.0
    assert f"a forward+backward takes {rows[1024]['ratio']:.2f}× its time before, the results identical" in text
    assert rows[512]["ratio_low"] < 1 < rows[512]["ratio_high"]
    assert (f"At n = 512 the median reads {rows[512]['ratio']:.2f}× but the interval reaches "
            f"{rows[512]['ratio_high']:.3f}: not resolved") in text
    assert all(rows[n]["ratio_low"] < 1 < rows[n]["ratio_high"] for n in (256, 2048))
    assert f"unchanged controls: {rows[256]['ratio']:.2f}× and {rows[2048]['ratio']:.2f}×" in text


def test_the_reverted_transposed_row_blocks_are_quoted_from_their_paired_run():
    """docs/speed.md's figures for the transposed sums of the row blocks (23e3840, reverted): the paired run 8dd459f
    -> 23e3840, no interval below 1 (n = 4096's above it), quoted with its intervals."""
    rows, text = _paired_run("ab_issue26_transposed_rows.json", "8dd459fe95c4", "23e3840f1313", rounds=5, pairs=11)
    assert all(rows[n]["ratio_high"] >= 1 for n in (1024, 2048, 4096)) and rows[4096]["ratio_low"] > 1
    two, four = rows[2048], rows[4096]
    assert (f"n = 2048 read {two['ratio']:.2f}× ({two['ratio_low']:.3f}–{two['ratio_high']:.3f}) and n = 4096 "
            f"{four['ratio']:.3f}× ({four['ratio_low']:.3f}–{four['ratio_high']:.3f})") in text
    assert f"unchanged) {rows[1024]['ratio']:.2f}×; it was reverted (a2969b1)" in text


def test_the_split_tiles_paragraph_is_their_committed_runs():
    """docs/speed.md's figures for slices split over the cores (321fc23 -> 6db06b6, 5 rounds of 7 pairs, wall clock
    on 2 threads): n = 4096 (split) and n = 2048 (not split, the same aten calls), the runs at 02083d1 and at
    a21d1cc, the change to 02083d1 in CPU time on one thread, and the null run of one tree against itself in the
    same mode, each quoted with its interval."""
    def quoted(row):
        return f"{row['ratio']:.3f}× ({row['ratio_low']:.3f}–{row['ratio_high']:.3f}"

    split, text = _paired_run("ab_issue26_split_rows.json", "321fc234b93e", "6db06b670332", 5, 7, clock="wall")
    fixed, _ = _paired_run("ab_issue26_split_rows_02083d1.json", "321fc234b93e", "02083d1895c1", 5, 7, clock="wall")
    first, _ = _paired_run("ab_issue26_split_rows_a21d1cc.json", "321fc234b93e", "a21d1cc300bb", 5, 7, clock="wall")
    cpu, _ = _paired_run("ab_issue26_split_rows_cpu.json", "321fc234b93e", "02083d1895c1", 5, 7)
    null, _ = _paired_run("ab_issue26_paired_null_wall.json", "321fc234b93e", "321fc234b93e", 5, 7, clock="wall")
    assert split[2048]["before_ops"] == split[2048]["after_ops"] and split[2048]["max_difference"] == 0
    assert cpu[2048]["ratio_low"] <= 1 <= cpu[2048]["ratio_high"]
    assert null[2048]["max_difference"] == 0 and null[2048]["ratio_low"] <= 1 <= null[2048]["ratio_high"]
    assert f"took {quoted(split[4096])}) its time before at n = 4096" in text
    assert (f"it read {quoted(split[2048])}), and {quoted(fixed[2048])}) and {quoted(first[2048])}) in the runs "
            "at 02083d1 and at a21d1cc") in text
    assert f"one tree against itself in the same mode reads {quoted(null[2048])})" in text
    assert f"in CPU time on one thread {quoted(cpu[2048])})" in text


def test_the_small_calls_paragraph_is_its_committed_runs():
    """docs/speed.md's figures for less fresh memory and fewer operations a call (19e20c2 -> 25870a0): the rounds run
    (9 rounds, wall clock: n = 64 and 128 below 1 in every round, n >= 256 on both sides of 1, identical results),
    the CPU-time run on one thread, and the two paired runs, each quoted with its range or interval."""
    def run(name: str) -> dict:
        return _rounds_run(name, "19e20c2daf72", "25870a0c8ddb")

    text = " ".join((ROOT / "docs" / "speed.md").read_text().split())
    rounds, cpu = run("ab_issue26_small_calls.json"), run("ab_issue26_small_calls_cpu.json")
    assert all(r["clock"] == "wall" and r["rounds"] == 9 and r["max_difference"] == 0 for r in rounds.values())
    assert rounds[64]["ratio_max"] < 1 and rounds[128]["ratio_max"] < 1
    assert (f"(ranges {rounds[64]['ratio_min']:.3f}–{rounds[64]['ratio_max']:.3f} and "
            f"{rounds[128]['ratio_min']:.3f}–{rounds[128]['ratio_max']:.3f})") in text
    large = [rounds[n] for n in (256, 512, 1024)]
    assert all(r["ratio_min"] < 1 < r["ratio_max"] for r in large)
    assert (f"the medians read {min(r['ratio'] for r in large):.2f}× to {max(r['ratio'] for r in large):.2f}×, "
            "rounds on both sides of 1") in text
    assert all(r["after_ops"] > r["before_ops"] for r in large)
    assert all(r["clock"] == "cpu" and r["rounds"] == 7 for r in cpu.values()) and cpu[16]["ratio_max"] < 1
    assert f"n = 16 read {cpu[16]['ratio']:.3f}× (every round below 1) and n = 64 {cpu[64]['ratio']:.3f}×" in text
    paired, _ = _paired_run("ab_issue26_small_calls_paired.json", "19e20c2daf72", "25870a0c8ddb", 5, 7, clock="wall")
    again, _ = _paired_run("ab_issue26_small_calls_paired15.json", "19e20c2daf72", "25870a0c8ddb", 7, 15, clock="wall")
    assert paired[64]["ratio_low"] < 1 < paired[64]["ratio_high"] and again[64]["ratio_low"] < 1 < again[64]["ratio_high"]
    assert f"(n = 64: {paired[64]['ratio']:.3f}× and {again[64]['ratio']:.3f}×)" in text
    first, second = paired[512], again[512]
    assert min(first["round_ratios"]) > 1 and sum(r > 1 for r in second["round_ratios"]) == 6
    assert (f"n = 512 read {first['ratio']:.3f}× ({first['ratio_low']:.3f}–{first['ratio_high']:.3f}, every round "
            f"above 1) and then {second['ratio']:.3f}× ({second['ratio_low']:.3f}–{second['ratio_high']:.3f}, six "
            "rounds of seven above 1)") in text
    # all five rounds of one size of six above 1 by chance: 1 - (1 - 2^-5)^6, about one time in six
    assert round(1 / (1 - (1 - 2**-5) ** 6)) == 6 and "about one time in six" in text
    third, _ = _paired_run("ab_issue26_small_calls_paired512.json", "19e20c2daf72", "25870a0c8ddb", 11, 15,
                           clock="wall")
    assert third[512]["ratio_low"] < 1 < third[512]["ratio_high"]
    assert (f"read {third[512]['ratio']:.3f}× ({third[512]['ratio_low']:.3f}–{third[512]['ratio_high']:.3f}): no change "
            "resolved") in text


def test_the_native_groups_paragraph_is_its_committed_runs():
    """docs/speed.md's figures for native groups of a slice per thread (3ef7994 -> f12d177): the rounds run at n = 256,
    512 and 1024 (n = 1024 below 1 in every round, identical results), the run with 4 x 2 slices, and the paired run
    whose interval at n = 1024 contains 1, each quoted with its range or interval."""
    def run(name: str) -> dict:
        return _rounds_run(name, "3ef79941d889", "f12d177ae141")

    text = " ".join((ROOT / "docs" / "speed.md").read_text().split())
    rounds, few = run("ab_issue26_native_groups.json"), run("ab_issue26_native_groups_h2.json")
    big = rounds[1024]
    assert big["rounds"] == 7 and big["clock"] == "wall" and big["ratio_max"] < 1 and big["max_difference"] == 0
    assert f"At n = 1024 every round took less time ({big['ratio_min']:.3f}–{big['ratio_max']:.3f})" in text
    assert all(rounds[n]["before_ops"] == rounds[n]["after_ops"] for n in (256, 512, 1024))
    small = few[1024]
    assert small["batch_heads"] == [4, 2] and small["ratio_max"] < 1
    assert (f"the call took {small['ratio']:.3f}× its time before ({small['ratio_min']:.3f}–{small['ratio_max']:.3f}, "
            "every round below 1)") in text
    paired, _ = _paired_run("ab_issue26_native_groups_paired.json", "3ef79941d889", "f12d177ae141", 7, 7, clock="wall")
    one = paired[1024]
    assert one["ratio_low"] < 1 < one["ratio_high"]
    assert f"n = 1024 read {one['ratio']:.3f}× ({one['ratio_low']:.3f}–{one['ratio_high']:.3f}): no change resolved" in text


def test_the_padded_rows_paragraph_is_its_committed_runs():
    """docs/speed.md's figures for padded tile rows (b033162 -> 52875d3, wall clock, rounds of fresh processes):
    n = 1024 below 1.001 in every round of the 15-round run, n = 256 and 512 on both sides of 1, n = 64 and 128
    (no row padded) with the same aten calls; results identical everywhere."""
    rows = _rounds_run("ab_issue26_padded_rows.json", "b03316235fab", "52875d38ce7c")
    small = _rounds_run("ab_issue26_padded_rows_small.json", "b03316235fab", "52875d38ce7c")
    text = " ".join((ROOT / "docs" / "speed.md").read_text().split())
    assert all(r["clock"] == "wall" and r["max_difference"] == 0 for r in [*rows.values(), *small.values()])
    assert {r["rounds"] for r in rows.values()} == {15} and {r["rounds"] for r in small.values()} == {9}
    assert rows[1024]["ratio_max"] < 1.001 and all(rows[n]["ratio_min"] < 1 < rows[n]["ratio_max"] for n in (256, 512))
    assert (f"n = 1024 reads {rows[1024]['ratio']:.3f}× (rounds from {rows[1024]['ratio_min']:.3f} to "
            f"{rows[1024]['ratio_max']:.3f}, none above 1.001)") in text
    assert f"read {rows[512]['ratio']:.3f}× and {rows[256]['ratio']:.3f}× (no change resolved)" in text
    assert all(small[n]["before_ops"] == small[n]["after_ops"] for n in (64, 128))
    assert all(small[n]["ratio_min"] < 1 < small[n]["ratio_max"] for n in (64, 128))
    assert f"read {small[64]['ratio']:.3f}× and {small[128]['ratio']:.3f}×, with rounds on both sides of 1" in text
    assert (f"n = 1024 {small[1024]['ratio']:.3f}× ({small[1024]['ratio_min']:.3f}–"
            f"{small[1024]['ratio_max']:.3f})") in text
