"""The same command twice on one machine gives identical numbers; every run folder says where it came from
(sinkformer's own commit only when it runs from its source checkout); the committed digest names a clean
commit of this history."""

import json
import shutil
import subprocess

import pytest
import torch

from sinkformer.provenance import (
    NOT_A_CHECKOUT,
    WHAT_CHANGES_RESULTS,
    cpu_model,
    cpu_vendor,
    git_commit,
    library_commit,
    provenance,
    require_clean_source,
    source_checkout,
)
from sinkformer.runs.registry import run_experiment

TINY_SENTIMENT = {"seeds": 2, "data_options": {"n_train": 64, "n_test": 32},
                  "model_options": {"dim": 8, "depth": 1, "num_heads": 2, "dim_feedforward": 8, "dropout": 0.1},
                  "train": {"epochs": 2, "batch_size": 16}}


def without_timings(x):
    """``x`` with every ``*seconds*`` entry removed (wall-clock times differ between runs), and the
    finding's sentence (which quotes them)."""
    if isinstance(x, dict):
        return {k: without_timings(v) for k, v in x.items() if "seconds" not in k and k != "this_run"}
    if isinstance(x, list):
        return [without_timings(v) for v in x]
    return x


def test_two_runs_of_one_command_give_identical_numbers(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runs = [run_experiment("sentiment", overrides=TINY_SENTIMENT, runs_dir=tmp_path / str(i)) for i in (1, 2)]
    finally:
        torch.set_num_threads(threads)
    first, second = (json.loads((r.out_dir / "results.json").read_text()) for r in runs)
    assert without_timings(first) == without_timings(second)
    assert first["comparisons"][0]["differences"] == second["comparisons"][0]["differences"]
    rows = [[{k: v for k, v in row.items() if "second" not in k} for row in r.rows] for r in runs]
    assert rows[0] == rows[1] and len(rows[0]) == 2 * 2 * 2  # 2 seeds x 2 models x 2 epochs, every loss equal


def test_every_run_folder_records_its_provenance(tmp_path):
    ctx = run_experiment("normalizations", runs_dir=tmp_path, command="sinkformer run normalizations")
    facts = json.loads((ctx.out_dir / "provenance.json").read_text())
    assert facts["command"] == "sinkformer run normalizations" and facts["torch"] == torch.__version__
    for key in ("sinkformer", "git_commit", "numpy", "python", "cpu", "cpu_count", "torch_threads", "device", "date"):
        assert facts[key] not in (None, "")
    assert facts["cpu"] == cpu_model() and facts["device"].startswith(("cpu", "cuda"))
    assert git_commit("/") == "not a git checkout"
    assert provenance("x")["command"] == "x" and "BLAS" in WHAT_CHANGES_RESULTS


def test_cpu_vendor_is_read_from_cpuinfo_or_from_platform(monkeypatch, tmp_path):
    import sinkformer.provenance as provenance_module

    real_path = provenance_module.Path
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7B13\n")
    monkeypatch.setattr(provenance_module, "Path", lambda p: real_path(info) if p == "/proc/cpuinfo" else real_path(p))
    assert cpu_vendor() == "AuthenticAMD"
    monkeypatch.setattr(provenance_module, "Path", lambda p: real_path(tmp_path / "absent"))
    monkeypatch.setattr(provenance_module.platform, "processor",
                        lambda: "Intel64 Family 6 Model 85 Stepping 7, GenuineIntel")
    assert cpu_vendor() == "GenuineIntel"
    monkeypatch.setattr(provenance_module.platform, "processor", lambda: "arm")
    assert cpu_vendor() == ""


# --- which code made a run -------------------------------------------------------------------------------------------

def _git(folder, *args):
    return subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True, check=True).stdout.strip()


def _repo(folder, files):
    """A git repository at ``folder`` with ``files`` ({path: text}) committed."""
    folder.mkdir(parents=True)
    _git(folder, "init", "-q")
    for path, text in files.items():
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_text(text)
    _git(folder, "add", ".")
    _git(folder, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "x")
    return _git(folder, "rev-parse", "HEAD")


needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


@needs_git
def test_an_installed_package_inside_another_repository_records_no_commit(tmp_path):
    """Before: a wheel installed in a user's project (its .venv inside the project's git repository) recorded
    the project's commit as sinkformer's."""
    package = ".venv/lib/python3.11/site-packages/sinkformer/__init__.py"
    _repo(tmp_path / "project", {"main.py": "print()", package: "", "src/sinkformer/__init__.py": ""})
    assert library_commit(tmp_path / "project" / package.rsplit("/", 1)[0]) == NOT_A_CHECKOUT
    assert source_checkout(tmp_path / "project" / package.rsplit("/", 1)[0]) is None


@needs_git
def test_the_source_checkout_records_its_commit_and_whether_it_is_dirty(tmp_path):
    commit = _repo(tmp_path / "sinkformer", {"src/sinkformer/__init__.py": "", "README.md": "x"})
    package = tmp_path / "sinkformer" / "src" / "sinkformer"
    assert source_checkout(package) == (tmp_path / "sinkformer").resolve()
    assert library_commit(package) == commit
    (tmp_path / "sinkformer" / "README.md").write_text("changed")
    assert library_commit(package) == f"{commit}-dirty"
    # an untracked src/sinkformer (a copy dropped into someone's repository) is not a source checkout
    _repo(tmp_path / "other", {"README.md": "x"})
    (tmp_path / "other" / "src" / "sinkformer").mkdir(parents=True)
    (tmp_path / "other" / "src" / "sinkformer" / "__init__.py").write_text("")
    assert library_commit(tmp_path / "other" / "src" / "sinkformer") == NOT_A_CHECKOUT


def test_no_digest_from_a_dirty_tree(tmp_path, monkeypatch, capsys):
    from sinkformer.runs import readme

    monkeypatch.setattr(readme, "DIGEST", tmp_path / "quick-run.json")
    summary = {"provenance": {**provenance("sinkformer run"), "git_commit": "a" * 40 + "-dirty"}, "seconds": 1.0,
               "jobs": 1, "started": "2026-01-01T00:00:00", "calibration": {"step_ms": 1.0, "threads": 1},
               "entries": []}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(SystemExit) as exit_:
        readme.main(["digest", str(tmp_path)])
    assert exit_.value.code == 2 and not readme.DIGEST.exists()
    assert f"the digest of {tmp_path}: the run was made from a source tree with uncommitted changes" in \
        capsys.readouterr().err
    summary["provenance"]["git_commit"] = NOT_A_CHECKOUT
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(SystemExit):
        readme.main(["digest", str(tmp_path)])
    summary["provenance"]["git_commit"] = "a" * 40
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    assert readme.main(["digest", str(tmp_path)]) == 0
    assert json.loads(readme.DIGEST.read_text())["calibration"] == {"step_ms": 1.0, "threads": 1}


def test_the_committed_digest_comes_from_a_clean_commit_of_this_history():
    """The committed quick-run digest names the clean commit that made it, and that commit is an ancestor of HEAD."""
    from sinkformer.runs.readme import DIGEST

    root = source_checkout()
    if root is None:
        pytest.skip("not running from sinkformer's git checkout: no history to check the digest against")
    commit = json.loads(DIGEST.read_text())["provenance"]["git_commit"]
    require_clean_source({"git_commit": commit}, "the committed digest")  # raises with what to do
    if _git(root, "rev-parse", "--is-shallow-repository") == "true":
        pytest.skip("a shallow clone: the digest's commit may be outside the fetched history")
    ancestor = subprocess.run(["git", "-C", str(root), "merge-base", "--is-ancestor", commit, "HEAD"])
    assert ancestor.returncode == 0, f"the digest's commit {commit} is not an ancestor of HEAD"


#: What the quick forms' numbers depend on besides the library: the experiments and their shipped configs.
EXPERIMENT_CODE = ("src/sinkformer/experiments", "src/sinkformer/configs")


def test_no_experiment_changed_since_the_committed_digest():
    """The experiments and their configs are as they were at the digest's commit (else: regenerate it)."""
    from sinkformer.runs.readme import DIGEST

    root = source_checkout()
    if root is None or _git(root, "rev-parse", "--is-shallow-repository") == "true":
        pytest.skip("no full history of sinkformer's checkout to compare the digest's commit with")
    commit = json.loads(DIGEST.read_text())["provenance"]["git_commit"]
    changed = subprocess.run(["git", "-C", str(root), "diff", "--name-only", commit, "HEAD", "--", *EXPERIMENT_CODE],
                             capture_output=True, text=True, check=True).stdout.split()
    assert not changed, (f"experiment code changed since the committed digest's commit {commit[:12]}: {changed}; "
                         "commit, run `sinkformer run` from the clean tree and `python -m sinkformer.runs.readme "
                         "digest runs/summary/<time>`, then `python -m sinkformer.runs.readme render`")
