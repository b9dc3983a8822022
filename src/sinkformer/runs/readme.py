"""The README's and the docs' measured figures, rendered from committed files — a claim is a test.

A quick run of the whole suite (``sinkformer run``) writes ``runs/summary/<time>/summary.json``.
:func:`digest` keeps what the docs need (every paired comparison with its interval and verdict,
the findings in words, the run times, the machine) in ``sinkformer/runs/measured/quick-run.json``,
which is committed (and shipped: ``sinkformer experiments`` reads its times). :func:`render_docs`
turns it into the results section of ``docs/experiments.md`` and the summary paragraph of the
README, each between two markers, and copies committed benchmark tables into the pages that cite
them (``<!-- begin: include PATH -->`` ... ``<!-- end: include PATH -->``, PATH from the repository
root). A test checks that every page holds exactly what :func:`render_docs` makes of those files::

    python -m sinkformer.runs.readme digest runs/summary/<time>   # write runs/measured/quick-run.json
    python -m sinkformer.runs.readme render                        # rewrite the marked sections
    python -m sinkformer.runs.readme check                         # exit 1 if a page differs
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from .report import markdown_table
from .verdicts import RULE, VERDICTS, Comparison, count_verdicts

__all__ = ["digest", "render", "render_summary", "render_docs", "update", "load_quick_run", "DIGEST", "README",
           "DOCS", "BEGIN", "END", "SUMMARY_BEGIN", "SUMMARY_END"]

DIGEST = Path(__file__).resolve().parent / "measured" / "quick-run.json"
ROOT = Path(__file__).resolve().parents[3]  # the repository (the docs are not in the wheel)
README = ROOT / "README.md"
DOCS = ROOT / "docs"
EXPERIMENTS_PAGE = DOCS / "experiments.md"
_SOURCE = "from src/sinkformer/runs/measured/quick-run.json"
BEGIN = f"<!-- begin: quick-run results, rendered by `python -m sinkformer.runs.readme render` {_SOURCE} -->"
END = "<!-- end: quick-run results -->"
SUMMARY_BEGIN = f"<!-- begin: quick-run summary, rendered by `python -m sinkformer.runs.readme render` {_SOURCE} -->"
SUMMARY_END = "<!-- end: quick-run summary -->"
INCLUDE = re.compile(r"<!-- begin: include (?P<path>[^ ]+) -->\n.*?<!-- end: include (?P=path) -->", re.S)


def digest(summary_dir: str | Path) -> dict[str, Any]:
    """What the README shows of the suite run in ``summary_dir`` (its ``summary.json``)."""
    summary = json.loads((Path(summary_dir) / "summary.json").read_text())
    experiments = []
    for entry in summary["entries"]:
        results = entry.get("results", {})
        experiments.append({
            "name": entry["name"], "paper": entry["paper"], "ok": entry["ok"], "seconds": round(entry["seconds"]),
            "comparisons": results.get("comparisons", []), "finding": results.get("finding"),
        })
    return {"provenance": summary["provenance"], "seconds": round(summary["seconds"]), "jobs": summary["jobs"],
            "started": summary["started"], "experiments": experiments}


def render(data: dict[str, Any]) -> str:
    """The README's results section (markdown) from a :func:`digest`."""
    facts = data["provenance"]
    comparisons = [(e["name"], c) for e in data["experiments"] for c in e["comparisons"]]
    counts = count_verdicts([c for _, c in comparisons])
    failed = [e["name"] for e in data["experiments"] if not e["ok"]]
    lines = [
        f"*The committed quick run: `sinkformer run` on {data['started'][:16].replace('T', ' ')}, "
        f"{len(data['experiments'])} experiments in {data['seconds'] // 60} min {data['seconds'] % 60} s on "
        f"{data['jobs']} worker processes, {facts['cpu']} ({facts['cpu_count']} cores), torch {facts['torch']}, "
        f"sinkformer {facts['sinkformer']} at {facts['git_commit'][:12]}"
        + (f"; failed: {', '.join(failed)}" if failed else "") + ".*",
        "",
        f"**{len(comparisons)} paired comparisons** of a Sinkformer (or a Sparse Sinkhorn model) with its Transformer: "
        + ", ".join(f"**{n} {v}**" for v, n in counts.items()) + f". {RULE}",
        "",
        markdown_table(
            ["experiment", "metric", "difference", "the paper", "this run: mean [95 % interval]", "seeds", "verdict"],
            [[name, c["metric"], f"{c['variant']} − {c['baseline']}", c["paper"], Comparison.from_dict(c).interval(),
              c["seeds"], c["verdict"]] for name, c in comparisons],
        ),
        "",
        markdown_table(
            ["experiment", "paper", "verdicts (" + " / ".join(v.split(" ")[0] for v in VERDICTS) + ")", "time"],
            [[e["name"], e["paper"], _counts(e["comparisons"]), f"{e['seconds']} s"] for e in data["experiments"]],
        ),
    ]
    return "\n".join(lines)


def render_summary(data: dict[str, Any]) -> str:
    """The README's one-paragraph summary of the committed quick run."""
    comparisons = [c for e in data["experiments"] for c in e["comparisons"]]
    counts = count_verdicts(comparisons)
    minutes, seconds = divmod(data["seconds"], 60)
    seeds = sorted({c["seeds"] for c in comparisons})
    seeds_text = f"{seeds[0]} seeds each" if len(seeds) == 1 else f"{seeds[0]}–{seeds[-1]} seeds each"
    return (
        f"The committed quick run ({data['started'][:10]}, {data['provenance']['cpu_count']} CPU cores, "
        f"{data['jobs']} worker processes) ran all {len(data['experiments'])} experiments in {minutes} min "
        f"{seconds} s. Of its **{len(comparisons)} paired comparisons** of a Sinkformer (or a Sparse Sinkhorn "
        f"model) with its Transformer, {seeds_text}: "
        + ", ".join(f"**{n} {v}**" for v, n in counts.items())
        + ". The quick forms train small models for minutes on embedded data: they test the direction of "
        "each finding with its uncertainty, not the papers' numbers. Every comparison, its interval and the "
        "findings: [docs/experiments.md](docs/experiments.md#what-the-quick-runs-found)."
    )


def _counts(comparisons: list[dict]) -> str:
    if not comparisons:
        return "— (a measurement, no paired comparison)"
    counts = count_verdicts(comparisons)
    return " / ".join(str(counts[v]) for v in VERDICTS)


def load_quick_run() -> dict[str, int]:
    """Seconds per experiment in the committed quick run (empty when there is none)."""
    if not DIGEST.is_file():
        return {}
    return {e["name"]: e["seconds"] for e in json.loads(DIGEST.read_text())["experiments"] if e["ok"]}


def update(text: str, section: str, begin: str = BEGIN, end: str = END) -> str:
    """``text`` with the part between the markers ``begin`` and ``end`` replaced by ``section``."""
    if begin not in text or end not in text:
        raise ValueError(f"no results markers ({begin!r} ... {end!r}) in the page")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{section}\n{end}{tail}"


def _include(match: re.Match) -> str:
    path = match.group("path")
    body = (ROOT / path).read_text().strip()
    return f"<!-- begin: include {path} -->\n{body}\n<!-- end: include {path} -->"


def render_docs(data: dict[str, Any] | None = None) -> dict[Path, str]:
    """Every page (the README, ``docs/*.md``) as it should read: ``{path: text}``."""
    data = json.loads(DIGEST.read_text()) if data is None else data
    pages = {}
    for page in [README, *sorted(DOCS.glob("*.md"))]:
        text = page.read_text()
        new = INCLUDE.sub(_include, text)
        if page == README:
            new = update(new, render_summary(data), SUMMARY_BEGIN, SUMMARY_END)
        if page == EXPERIMENTS_PAGE:
            new = update(new, render(data))
        pages[page] = new
    return pages


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sinkformer.runs.readme", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("digest", help="write runs/measured/quick-run.json from a suite run's summary folder")
    make.add_argument("summary_dir")
    sub.add_parser("render", help="rewrite the marked sections of the README and docs/")
    sub.add_parser("check", help="exit 1 when a page is not what render gives")
    args = parser.parse_args(argv)
    if args.command == "digest":
        DIGEST.parent.mkdir(parents=True, exist_ok=True)
        DIGEST.write_text(json.dumps(digest(args.summary_dir), indent=1, ensure_ascii=False) + "\n")
        print(f"wrote {DIGEST}")
        return 0
    stale = {page: text for page, text in render_docs().items() if page.read_text() != text}
    if args.command == "check":
        for page in stale:
            print(f"{page.relative_to(ROOT)} differs from `python -m sinkformer.runs.readme render`", file=sys.stderr)
        return 1 if stale else 0
    for page, text in stale.items():
        page.write_text(text)
        print(f"rendered {page.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
