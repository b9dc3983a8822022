"""``python -m benchmarks gpu-check`` (its smoke run: the same code path on the CPU), the performance
model rendered into docs/speed.md, and the ``python -m benchmarks`` entry point."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("triton", reason="the flash engine needs triton (pip install 'sinkformer[gpu]')")


@pytest.mark.slow
def test_gpu_check_smoke_run(tmp_path):
    """Every part runs on the CPU (Triton's interpreter, tiny sizes) from a folder outside the clone,
    writes its JSON and markdown, and passes: accuracy in every dtype, the CUDA tests (skipped
    there), the benchmark rows, the 2^31 probe; the CUDA graph part says why it did not run."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    command = ["gpu-check", "--smoke", "--out", "out", "--budget", "3600"]  # a budget no slow machine reaches
    done = subprocess.run([sys.executable, "-m", "benchmarks", *command],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "attention_cuda.json").read_text())
    parts = report["parts"]
    assert list(parts) == ["environment", "compile", "accuracy-target", "benchmark-targets", "cuda-tests",
                           "accuracy-edges", "graph", "benchmark", "offset-probe"]
    compiled = report["compile"]
    assert compiled["done"] == compiled["cases"] == len(report["accuracy"]) and not compiled["errors"]
    assert parts["graph"]["status"].startswith("skipped: CUDA graphs need a GPU")
    assert all(p["status"].split(" ")[0] in ("ok", "pass") for name, p in parts.items() if name != "graph"), parts
    assert {r["dtype"] for r in report["accuracy"]} == {"bfloat16", "float32", "float64"}
    assert all(r["status"] == "pass" for r in report["accuracy"])
    assert {"sdpa-flash", "official", "flash", "tiled", "streamed", "dense"} <= {r["method"] for r in report["rows"]}
    assert report["offset_probe"]["past_2_31"] and report["environment"]["triton"]
    text = (tmp_path / "out" / "attention_cuda.md").read_text()
    assert text.startswith("# The flash engine on") and "smoke run" in text and "## Targets" in text
    assert "gpu-check summary" in done.stdout


def test_gpu_check_parts_and_its_command(tmp_path, capsys):
    """``--parts`` runs the parts named, lists the others as not run, and the report records its
    command and commit; an unknown part is refused naming the valid ones."""
    from benchmarks import gpu_check

    assert gpu_check.main(["--smoke", "--parts", "environment", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "attention_cuda.json").read_text())
    assert list(report["parts"]) == [name for name, _ in gpu_check.PARTS]
    assert report["parts"]["environment"]["status"] == "ok"
    left_out = [p["status"] for name, p in report["parts"].items() if name != "environment"]
    assert set(left_out) == {"not run (left out by --parts)"}
    assert report["command"] == f"python -m benchmarks gpu-check --smoke --parts environment --out {tmp_path}"
    assert report["commit"] and f"at commit {report['commit']}" in (tmp_path / "attention_cuda.md").read_text()
    with pytest.raises(SystemExit):
        gpu_check.main(["--smoke", "--parts", "environment,speed"])
    assert "--parts takes names among environment, compile" in capsys.readouterr().err


def test_gpu_check_parts_stop_at_their_budget():
    """The CUDA tests and the compilation ahead stop when their share of the budget is spent (a
    check that overran its lease once, on an H200, lost every part after the tests): the tests run
    so far are counted, the subprocess group is ended, and the part says it stopped."""
    from benchmarks import gpu_check

    spent = gpu_check.Budget(0.0)
    tests = gpu_check.cuda_tests("cpu", spent)
    assert tests["status"] == "incomplete" and tests["summary"].startswith("stopped at its budget after"), tests
    assert tests["seconds"] < 30 and tests["returncode"] == -9
    compiled = gpu_check.compile_ahead(gpu_check.SMOKE, "cpu", spent)
    assert compiled["status"].startswith("stopped at its budget: ") and compiled["done"] < compiled["cases"]
    ample = gpu_check.Budget(600.0)
    ample.begin(1.0, 1.0)  # the whole budget for this part
    died = gpu_check.compile_ahead(gpu_check.SMOKE, "cpu", ample, work=_die)
    assert died["status"].startswith("a worker died: ") and died["done"] == 0 and died["seconds"] < 120, died


def _die(task):
    """A compile worker that dies (as under the out-of-memory killer)."""
    os._exit(9)


def test_gpu_check_counts_the_outcomes_of_verbose_pytest_lines():
    """One outcome per test line, plain or under pytest-xdist; the short summary's repeats are not counted."""
    from benchmarks.gpu_check import pytest_outcomes

    lines = ["collected 4 items", "tests/x.py::test_a[1] PASSED                  [ 25%]",
             "[gw1] [ 50%] FAILED tests/x.py::test_b", "tests/x.py::test_c SKIPPED (no GPU)           [ 75%]",
             "[gw0] [100%] XFAIL tests/x.py::test_d", "=========== short test summary info ============",
             "FAILED tests/x.py::test_b - AssertionError", "XFAIL tests/x.py::test_d", "== 1 failed, 1 passed =="]
    assert [outcome for _, outcome in pytest_outcomes(lines)] == ["PASSED", "FAILED", "SKIPPED", "XFAIL"]
    assert pytest_outcomes(lines)[1][0] == "[gw1] [ 50%] FAILED tests/x.py::test_b"


def test_the_gpu_findings_in_the_docs_are_the_committed_check():
    """The figures docs/speed.md quotes from the first GPU check are those of the committed report
    (benchmarks/results/attention_cuda_h200_e91278b.json) and the log of its first call."""
    import re

    from benchmarks import gpu_check

    results = ROOT / "benchmarks" / "results"
    data = json.loads((results / "attention_cuda_h200_e91278b.json").read_text())
    text = " ".join((ROOT / "docs" / "speed.md").read_text().split())
    graph = data["graph"]
    assert f"{graph['eager_ms']:.3f} ms called eagerly and {graph['replay_ms']:.3f} ms replayed" in text
    assert 0.85 <= 1 - graph["replay_ms"] / graph["eager_ms"] <= 0.95  # "about nine tenths"
    row = {(r["method"], r["dtype"]): r for r in data["rows"] if r["n"] == 4096 and r.get("n_iters") == 5}
    flash32, tiled32 = row[("flash", "float32")], row[("tiled", "float32")]
    assert f"({flash32['forward_backward_ms']:.0f} against {tiled32['forward_backward_ms']:.0f} ms" in text
    assert round(tiled32["peak_mib"] / flash32["peak_mib"]) == 15  # "a fifteenth of its memory"
    first_call = (results / "gpu_check_h200_run1.log").read_text()
    target_rows = re.findall(r"^\s*\w+ target\s+n_iters=\d+\s+forward .* (\w+)$", first_call, re.M)
    ran = [r for r in data["accuracy"] if "forward" in r]
    assert all(r["status"] == "pass" for r in ran) and set(target_rows) == {"pass"}
    total = len(data["accuracy"]) + len(gpu_check.target_cases(gpu_check.FULL))
    assert f"only {len(ran) + len(target_rows)} of the {total} ran" in text


def test_the_second_gpu_check_in_the_docs_is_the_committed_report():
    """The figures docs/speed.md quotes from the second GPU check are those of its committed report
    (benchmarks/results/attention_cuda_h200_d7b142e.json), its log and the first check's report."""
    import re

    results = ROOT / "benchmarks" / "results"
    data = json.loads((results / "attention_cuda_h200_d7b142e.json").read_text())
    first = json.loads((results / "attention_cuda_h200_e91278b.json").read_text())
    text = " ".join((ROOT / "docs" / "speed.md").read_text().split())
    commit = data["commit"][:7]
    log = (results / f"gpu_check_h200_{commit}.log").read_text()
    assert f"at {commit}, one call" in text and "--budget 400" in data["command"]
    last = re.findall(r"^\[\s*([\d.]+) s\] offset-probe", log, re.M)
    assert f"its last part began at {last[0]} s and took {data['parts']['offset-probe']['seconds']:.1f} s" in text
    assert all(p["status"].split(" ")[0] in ("ok", "pass") for p in data["parts"].values())
    compiled = data["compile"]
    assert f"{compiled['cases']} accuracy cases' kernels compiled in {compiled['seconds']:.1f} s on " \
           f"{compiled['workers']} workers" in text
    passed = [r for r in data["accuracy"] if r["status"] == "pass"]
    refused = [r for r in data["accuracy"] if r["status"] != "pass"]
    assert {r["dtype"] for r in refused} == {"float64"} and all(r["status"].startswith("refused") for r in refused)
    assert f"all {len(passed)} cases" in text and f"the {len(refused)} in float64 were refused" in text
    counts = data["cuda_tests"]["counts"]
    assert f"{counts['passed']} passed, {counts['skipped']} skipped" in text
    ratios = {t["target"][:26]: t["value"] for t in data["targets"]}
    old = {t["target"][:26]: t["value"] for t in first["targets"]}
    key3, key5 = "bf16, n=4096, 3 iters, fwd", "bf16, n=4096, 5 iters, fwd"
    assert f"second read {ratios[key3]:.2f}× and {ratios[key5]:.2f}× SDPA-flash" in text
    assert f"({old[key3]:.2f}× and {old[key5]:.2f}× in the first)" in text
    graph, first_graph = data["graph"], first["graph"]
    assert f"took {graph['eager_ms']:.3f} ms ({first_graph['eager_ms']:.3f} ms in the first)" in text
    assert f"CUDA graph {graph['replay_ms']:.3f} ms ({first_graph['replay_ms']:.3f})" in text
    assert round(7 * (1 - graph["replay_ms"] / graph["eager_ms"])) == 6  # "about six sevenths"


def test_the_third_gpu_check_in_the_docs_is_the_committed_report():
    """The figures docs/speed.md quotes from the third GPU check (the first with the tuned launches) are those of
    the committed report (benchmarks/results/attention_cuda.json, which the tables read), the second check's, the
    log of the CUDA tests run alone and the report of the grouped run that was reverted."""
    import re

    from benchmarks import gpu_check

    results = ROOT / "benchmarks" / "results"
    data = json.loads((results / "attention_cuda.json").read_text())
    second = json.loads((results / "attention_cuda_h200_d7b142e.json").read_text())
    text = " ".join((ROOT / "docs" / "speed.md").read_text().split())
    commit = data["commit"][:7]
    assert (results / f"gpu_check_h200_{commit}.log").exists() and "--budget 400" in data["command"]
    assert f"at {commit}, one call with `--budget 400`, the first with the tuned launches" in text
    ratios = {t["target"][:26]: t["value"] for t in data["targets"]}
    old = {t["target"][:26]: t["value"] for t in second["targets"]}
    key3, key5 = "bf16, n=4096, 3 iters, fwd", "bf16, n=4096, 5 iters, fwd"
    assert f"flash took {ratios[key3]:.2f}× and {ratios[key5]:.2f}× SDPA-flash at 3 and 5 iterations " \
           f"({old[key3]:.2f}× and {old[key5]:.2f}× in the second check)" in text
    row = {(r["method"], r["dtype"]): r for r in data["rows"] if r["n"] == 4096 and r.get("n_iters") == 5}
    assert f"in float32, {row[('flash', 'float32')]['forward_backward_ms']:.1f} ms at 5 iterations against the " \
           f"tiled engine's {row[('tiled', 'float32')]['forward_backward_ms']:.1f} ms" in text
    passed = [r for r in data["accuracy"] if r["status"] == "pass"]
    assert len(passed) + 5 == len(data["accuracy"]) and f"All {len(passed)} accuracy cases" in text
    tests = data["cuda_tests"]
    assert tests["status"] == "incomplete" and f"in {tests['seconds']:.0f} s, {tests['counts']['passed']} passed, " \
           f"{tests['counts']['skipped']} skipped, the rest not run" in text
    rerun = (results / f"cuda_tests_h200_{commit}_rerun.log").read_text()
    summary = re.search(r"(\d+) passed, (\d+) skipped in ([\d.]+)s", rerun)
    assert f"{summary[1]} passed, {summary[2]} skipped, in {summary[3]} s" in text
    grouped = json.loads((results / "cuda_tests_grouped_h200_cb7a294.json").read_text())["cuda_tests"]
    assert "--dist loadgroup" in grouped["command"] and grouped["status"] == "incomplete"
    assert f"{grouped['counts']['passed']} passed, {grouped['counts']['skipped']} skipped in " \
           f"{grouped['seconds']:.1f} s" in text
    parts = data["parts"]
    assert f"the graph used {parts['graph']['seconds']:.1f} s of its share and the offset probe " \
           f"{parts['offset-probe']['seconds']:.1f} s" in text
    shares = dict(gpu_check.PARTS)
    assert shares["cuda-tests"] > 0.16 and abs(sum(shares.values()) - 1) < 1e-9
    eager = [d["graph"]["eager_ms"] for d in (data, second, json.loads(
        (results / "attention_cuda_h200_e91278b.json").read_text()))]
    assert f"eager forward+backward took {eager[0]:.3f} ms and the replay {data['graph']['replay_ms']:.3f} ms" in text
    assert f"the eager call read {min(eager):.1f} to {max(eager):.1f} ms" in text
    replays = [d["graph"]["replay_ms"] for d in (data, second, json.loads(
        (results / "attention_cuda_h200_e91278b.json").read_text()))]
    assert f"the replay stayed between {min(replays):.2f} and {max(replays):.2f} ms" in text


def test_performance_model_in_the_docs_is_rendered():
    """docs/speed.md includes benchmarks/results/flash_model.md, which is what the model gives now
    (counted from the launcher: a change of the kernels' passes changes it)."""
    from benchmarks import flash_model

    data = flash_model.model()
    assert (ROOT / "benchmarks" / "results" / "flash_model.md").read_text() == flash_model.markdown(data), (
        "re-render: python -m benchmarks flash-model --out benchmarks/results && python -m sinkformer.runs.readme render")
    five = next(r for r in data["rows"] if r["engine"] == "flash" and r["n_iters"] == 5)
    assert (five["forward_passes"], five["backward_passes"], five["exps_per_score"]) == (5, 6, 11)
    sdpa = data["rows"][0]
    assert sdpa["exps_per_score"] == 2 and five["floor_over_sdpa"] > 1
    fused = next(r for r in data["fused_dq"] if r["n_iters"] == 5)  # dq in the dk pass: one pass, one exp fewer
    assert (fused["forward_passes"], fused["backward_passes"], fused["exps_per_score"]) == (5, 5, 10)
    assert fused["atomic_bytes"] == 4 * 32 * 4096 * 64 * (4096 // 64)  # a dq row per key block of 64
    assert fused["floor_ms"] < five["floor_ms"] and fused["break_even_tb_per_s"] > 0
    assert "include benchmarks/results/flash_model.md" in (ROOT / "docs" / "speed.md").read_text()


def test_benchmarks_entry_point(monkeypatch, capsys):
    """Plain help text, and results outside the committed benchmarks/results unless --out says so."""
    import importlib

    from benchmarks import __main__ as entry

    assert entry.main(["--help"]) == 0
    text = capsys.readouterr().out
    assert "``" not in text and "issue" not in text.lower() and "gpu-check" in text
    seen = []
    fake = type("Suite", (), {"main": staticmethod(lambda argv: seen.append(argv) or 0)})
    monkeypatch.setattr(importlib, "import_module", lambda name: fake)
    entry.main(["causal", "--quick"])
    entry.main(["gpu-check", "--out", "benchmarks/results"])
    entry.main(["attention", "--device", "cuda", "--quick"])
    assert seen == [["--quick", "--out", "benchmark-results"], ["--out", "benchmarks/results"],
                    ["--quick", "--out", "benchmark-results"]]


def test_benchmarks_run_from_another_folder(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks"), "--help"], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=300)
    assert done.returncode == 0 and "gpu-check" in done.stdout, done.stderr


def test_gpu_check_summary_says_what_each_target_measured():
    """The summary prints a ratio target's value and verdict, a yes/no target's verdict alone (the
    H200 run at d7b142e printed 'n=16384 runs (flash): not measured (met)' for a run it had timed), and
    'not measured' only where nothing was measured."""
    from benchmarks import gpu_check

    targets = [dict(target="ratio", value=2.08, met=False), dict(target="runs", value=None, met=True),
               dict(target="absent", value=None, met=None)]
    report = dict(parts={}, accuracy=[], targets=targets)
    lines = gpu_check.summary(report).splitlines()
    assert "  target: ratio: 2.08 (not met)" in lines
    assert "  target: runs: (met)" in lines
    assert "  target: absent: (not measured)" in lines
