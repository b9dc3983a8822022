"""Every Python block of the README and of docs/ marked ``<!-- runnable -->`` runs as written.

Each block runs in a fresh interpreter in an empty folder (what a user who copies it gets), so a
block cannot lean on an earlier one or on files of the repository.
"""

from __future__ import annotations

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
