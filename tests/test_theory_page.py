"""docs/theory.md is the one formula sheet: nothing cites the old private sheet, and every section
number cited as ``docs/theory.md §N`` (or ``§N.M``) exists as a heading of the page."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
THEORY = ROOT / "docs" / "theory.md"
# the old sheet's name, assembled so that this file does not contain it
OLD_SHEET = ("FORM" + "ULAS").encode()
SKIP_DIRS = {"build", "__pycache__", ".pytest_cache", ".ruff_cache", ".mypy_cache"}
CITING_SUFFIXES = {".py", ".md", ".toml", ".yaml", ".yml", ".txt", ".rst"}

# "docs/theory.md §5, §6.7", "``docs/theory.md`` §7–9", "theory.md#anchor) §12 and §13"
_SECTION = r"§\s?\d+(?:\.\d+)*(?:\s*[–-]\s*§?\d+(?:\.\d+)*)?"
CITATION = re.compile(rf"theory\.md(?:#[\w.-]*)?[`\])]*\s*((?:{_SECTION})(?:\s*(?:,|and|&)\s*(?:{_SECTION}))*)")
HEADING = re.compile(r"^#{1,6}\s+(\d+(?:\.\d+)*)\.?\s", re.MULTILINE)


def _skipped(path: Path) -> bool:
    rel = path.relative_to(ROOT).parts
    return any(part in SKIP_DIRS or part.endswith(".egg-info") for part in rel)


def _files(*tops: str):
    for top in tops:
        base = ROOT / top
        if base.is_file():
            yield base
            continue
        if not base.is_dir():
            continue
        for path in sorted(base.rglob("*")):
            if path.is_file() and not _skipped(path):
                yield path


def _expand(item: str) -> list[str]:
    """``"§7–9"`` -> ``["7", "8", "9"]``; ``"§7.1–7.5"`` -> ``["7.1", "7.5"]``; ``"§6.4"`` -> ``["6.4"]``."""
    parts = [p.strip().lstrip("§").strip() for p in re.split(r"[–-]", item)]
    if len(parts) == 1:
        return parts
    lo, hi = parts
    if "." not in lo and "." not in hi:
        return [str(i) for i in range(int(lo), int(hi) + 1)]
    if "." not in hi:  # "§7.1–5": same section
        hi = lo.rsplit(".", 1)[0] + "." + hi
    return [lo, hi]


def cited_sections(text: str) -> list[str]:
    """Section numbers cited as ``theory.md §...`` in ``text``."""
    found = []
    for match in CITATION.finditer(text):
        for item in re.findall(_SECTION, match.group(1)):
            found.extend(_expand(item))
    return found


def heading_numbers() -> list[str]:
    return HEADING.findall(THEORY.read_text(encoding="utf-8"))


def test_the_citation_parser():
    text = ("(``docs/theory.md`` §5, §6.7). See docs/theory.md §7–9 and `docs/theory.md` §7.1–7.5; "
            "[theory](theory.md#6-velocity) §12 and §13. Castin et al. §2 (``docs/theory.md``).")
    assert cited_sections(text) == ["5", "6.7", "7", "8", "9", "7.1", "7.5", "12", "13"]


def test_nothing_cites_the_old_formula_sheet():
    offenders = []
    for path in _files("src", "tests", "benchmarks", "docs", "README.md"):
        data = path.read_bytes()
        if OLD_SHEET in data:
            lines = [i + 1 for i, line in enumerate(data.splitlines()) if OLD_SHEET in line]
            offenders.append(f"{path.relative_to(ROOT)}: lines {lines}")
    assert not offenders, "cite docs/theory.md instead of the old sheet:\n" + "\n".join(offenders)


def test_theory_headings_are_unique_and_sections_consecutive():
    numbers = heading_numbers()
    assert len(numbers) == len(set(numbers)), [n for n in numbers if numbers.count(n) > 1]
    top = [int(n) for n in numbers if "." not in n]
    assert top == list(range(1, len(top) + 1))
    for n in numbers:
        if "." in n:
            assert n.rsplit(".", 1)[0] in numbers, f"§{n} has no parent section"


def test_every_cited_section_exists():
    numbers = set(heading_numbers())
    cited = {}
    for path in _files("src", "tests", "benchmarks", "docs", "README.md"):
        if path.suffix not in CITING_SUFFIXES or path == THEORY:
            continue
        for section in cited_sections(path.read_text(encoding="utf-8", errors="replace")):
            cited.setdefault(section, []).append(str(path.relative_to(ROOT)))
    assert cited, "expected the code to cite docs/theory.md sections"
    missing = {f"§{s}": sorted(set(where)) for s, where in cited.items() if s not in numbers}
    assert not missing, f"cited sections missing from docs/theory.md: {missing}"

