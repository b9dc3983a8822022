"""Every Python block of the README and of docs/ marked ``<!-- runnable -->`` runs as written.

Each block runs in a fresh interpreter in an empty folder (what a user who copies it gets), so a
block cannot lean on an earlier one or on files of the repository.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUNNABLE = re.compile(r"<!-- runnable -->\n```python\n(.*?)```", re.S)


def runnable_blocks() -> list[tuple[str, str]]:
    blocks = []
    for page in PAGES:
        for i, code in enumerate(RUNNABLE.findall(page.read_text())):
            blocks.append((f"{page.relative_to(ROOT)}#{i + 1}", code))
    return blocks


BLOCKS = runnable_blocks()


def test_the_readme_and_docs_have_runnable_blocks():
    pages = {name.split("#")[0] for name, _ in BLOCKS}
    assert sum(name.startswith("README.md") for name, _ in BLOCKS) == 4  # the four snippets
    assert {"docs/dynamics.md", "docs/sparse.md", "docs/training.md"} <= pages
    # a marker must sit right above a python block, or the block would silently not run
    for page in PAGES:
        text = page.read_text()
        assert text.count("<!-- runnable -->") == len(RUNNABLE.findall(text)), page.name


@pytest.mark.parametrize("name, code", BLOCKS, ids=[name for name, _ in BLOCKS])
def test_block_runs_as_written(name, code, tmp_path):
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{name} failed:\n{done.stderr[-3000:]}"


LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_relative_links_of_the_readme_and_docs_point_to_files():
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken


# --- every example of docs/training.md and of the commands' --help runs as written ---------------------------------

SHELL_BLOCK = re.compile(r"```bash\n(.*?)```", re.S)
PYTHON_BLOCK = re.compile(r"(<!-- runnable -->\n)?```python\n(.*?)```", re.S)
INLINE_COMMAND = re.compile(r"`((?:sinkformer|torchrun) [^`]*--[^`]*)`")
#: Examples that need what a test machine does not have: a real dataset under ~/data (the test's HOME is empty, so
#: each must fail with one error line naming the missing path, before writing anything) ...
NEEDS_DATA = re.compile(r"--data ~/")
#: ... or minutes: several processes, the experiments, longer trainings than the first example's (slow-marked).
SLOW = re.compile(r"^(torchrun |sinkformer run( |$)|sinkformer train --config quick_|.* --n-iters |.* --out runs/digits)")


def _shell_lines(text: str) -> list[str]:
    """The commands of a shell block or an epilog: continuation lines joined, comments dropped."""
    commands, current = [], ""
    for line in text.splitlines():
        line = line.strip()
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        line = re.sub(r"\s+#.*$", "", current + line).strip()  # a trailing comment (an example's explanation)
        current = ""
        if line.startswith(("sinkformer ", "torchrun ")):
            commands.append(line)
    return commands


def _epilog_commands(epilog: str) -> list[str]:
    """The example commands of a help epilog (``examples:`` lines: the command, then two or more spaces and what it does)."""
    return [re.split(r"\s{2,}", line.strip())[0] for line in epilog.splitlines()
            if line.strip().startswith(("sinkformer ", "torchrun "))]


def _examples() -> list[tuple[str, str, str]]:
    """``(source, kind, example)`` in the order of each source: shell commands and, for docs/training.md, the
    Python blocks not marked runnable (those run on their own, above), which may use what the commands made."""
    from sinkformer.cli import build_parser

    found = []
    text = (ROOT / "docs" / "training.md").read_text()
    spans = [(m.start(), "shell", c) for m in SHELL_BLOCK.finditer(text) for c in _shell_lines(m.group(1))]
    spans += [(m.start(), "shell", m.group(1)) for m in INLINE_COMMAND.finditer(text)]
    spans += [(m.start(), "python", m.group(2)) for m in PYTHON_BLOCK.finditer(text) if not m.group(1)]
    found += [("docs/training.md", kind, example) for _, kind, example in sorted(spans, key=lambda s: s[0])]
    for name, command in build_parser().commands.items():
        found += [(f"sinkformer {name} --help", "shell", c) for c in _epilog_commands(command.epilog or "")]
    return found


ALL_EXAMPLES = _examples()
_seen: set[str] = set()  # an example given twice runs once, where it first appears (after what it may need)
EXAMPLES = [e for e in ALL_EXAMPLES if not (e[2] in _seen or _seen.add(e[2]))]


def _marks(kind: str, example: str):
    return [pytest.mark.slow] if kind == "shell" and SLOW.match(example) and not NEEDS_DATA.search(example) else []


@pytest.fixture(scope="module")
def example_folders(tmp_path_factory):
    """One working folder per source (its examples run in order there) and an empty HOME."""
    home = tmp_path_factory.mktemp("home")
    return home, {}


def test_the_examples_are_found():
    sources = {source for source, _, _ in ALL_EXAMPLES}
    assert {"docs/training.md", "sinkformer train --help", "sinkformer run --help",
            "sinkformer predict --help"} <= sources
    shell = [e for _, kind, e in EXAMPLES if kind == "shell"]
    assert "sinkformer train --model vit --dataset digits --attention softmax" in shell  # the first one
    assert any(NEEDS_DATA.search(e) for e in shell) and sum(not SLOW.match(e) for e in shell) >= 8


def _run_in_process(example: str, capsys) -> tuple[int, str]:
    """A ``sinkformer ...`` example through :func:`sinkformer.cli.main` in this process (as the shell would
    split it, ``~`` expanded): its exit code and stderr. Saves a Python start per example."""
    import shlex

    from sinkformer.cli import main

    argv = [os.path.expanduser(arg) for arg in shlex.split(example)[1:]]
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as exit_:  # --help
        code = exit_.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize("source, kind, example", [pytest.param(*e, marks=_marks(e[1], e[2])) for e in EXAMPLES],
                         ids=[f"{s}: {e.splitlines()[0][:60]}" for s, _, e in EXAMPLES])
def test_every_example_runs_as_written(source, kind, example, example_folders, monkeypatch, capsys):
    """Python blocks and torchrun run in a fresh process; ``sinkformer`` commands (plain words and quotes,
    nothing else of the shell) in this one; each source's examples in order, in one folder of their own."""
    home, folders = example_folders
    folder = folders.setdefault(source, home.parent / re.sub(r"\W+", "_", source))
    folder.mkdir(exist_ok=True)
    monkeypatch.chdir(folder)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    before = sorted(p.relative_to(folder) for p in folder.rglob("*"))
    if kind == "shell" and example.startswith("sinkformer ") and not re.search(r"[|&;<>$`*]", example):
        code, stderr = _run_in_process(example, capsys)
    else:
        argv = [sys.executable, "-c", example] if kind == "python" else ["bash", "-c", example]
        done = subprocess.run(argv, cwd=folder, capture_output=True, text=True, timeout=1200)
        code, stderr = done.returncode, done.stderr
    if kind == "shell" and NEEDS_DATA.search(example):
        # no dataset here: one error line naming the missing folder, no traceback, and nothing left behind
        errors = [line for line in stderr.splitlines() if ": error: " in line]
        assert code == 2 and len(errors) == 1 and str(home / "data") in errors[0], stderr[-3000:]
        assert "Traceback" not in stderr
        assert sorted(p.relative_to(folder) for p in folder.rglob("*")) == before
        return
    assert code == 0, f"{source}: {example}\n{stderr[-3000:]}"
