"""The README's and the docs' measured figures, rendered from committed files — a claim is a test.

A quick run of the whole suite (``sinkformer run``) writes ``runs/summary/<time>/summary.json``.
:func:`digest` keeps what the docs need (every paired comparison with its interval and verdict,
the findings in words, the run times, the machine) in ``sinkformer/runs/measured/quick-run.json``,
which is committed (and shipped: ``sinkformer experiments`` reads its times). :func:`render_docs`
turns it into the headline and the results section of ``docs/experiments.md`` (the paper claims
counted apart from the other kinds of comparison, before and after Holm's correction) and the summary
paragraph of the README, each between two markers, copies committed benchmark tables into the pages that cite
them (``<!-- begin: include PATH -->`` ... ``<!-- end: include PATH -->``, PATH from the repository
root), and writes the attention engines' tables from the engine registry
(:func:`sinkformer.attention.backends.engine_table`) between :data:`ENGINES_BEGIN` and :data:`ENGINES_END`
on every page that has them. A test checks that every page holds exactly what :func:`render_docs` makes of those files::

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

from ..attention.backends import engine_table
from ..provenance import require_clean_source
from .report import markdown_table
from .verdicts import CLAIM, EXTENSION, KINDS, NOISE, UNCLASSIFIED, VERDICTS, WORSE, family_section, tally

__all__ = ["digest", "render", "render_summary", "render_headline", "render_docs", "update", "load_quick_run", "DIGEST",
           "README", "DOCS", "BEGIN", "END", "SUMMARY_BEGIN", "SUMMARY_END", "HEADLINE_BEGIN", "HEADLINE_END",
           "QUICK_FORMS", "SEEDS_VARY", "ENGINES_BEGIN", "ENGINES_END"]

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
HEADLINE_BEGIN = f"<!-- begin: quick-run headline, rendered by `python -m sinkformer.runs.readme render` {_SOURCE} -->"
HEADLINE_END = "<!-- end: quick-run headline -->"
ENGINES_BEGIN = ("<!-- begin: engine tables, rendered by `python -m sinkformer.runs.readme render` from the "
                 "engine registry (sinkformer.attention.backends) -->")
ENGINES_END = "<!-- end: engine tables -->"
#: What the quick forms are: the first words of the README's results and of docs/experiments.md.
QUICK_FORMS = (
    "The quick forms (`sinkformer run`) train small models for minutes on data that ships with the package: they "
    "test the direction of each of the papers' findings, with its uncertainty, not the papers' numbers."
)
#: Over what the intervals run.
SEEDS_VARY = (
    "Each interval runs over seeds: a seed draws the initial weights, the batch order, dropout and, where the "
    "dataset allows, the training subset (every model of a seed the same); the test sets are fixed."
)
#: Said instead of :data:`SEEDS_VARY` by a digest older than the comparisons' kinds.
STALE = ("This digest was written before comparisons declared their kind and before seeds drew the training "
         "subset: regenerate it (`sinkformer run`, then `python -m sinkformer.runs.readme digest`).")
_KIND_WORDS = {WORSE: "settings the papers themselves report as worse", NOISE: "gaps the papers report within noise",
               EXTENSION: "comparisons with no paper claim (our extensions)",
               UNCLASSIFIED: "comparisons recorded before comparisons declared their kind (regenerate the digest)"}
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
            "started": summary["started"], "calibration": summary.get("calibration"), "experiments": experiments}


def _named(data: dict[str, Any]) -> list[tuple[str, dict]]:
    return [(e["name"], c) for e in data["experiments"] for c in e["comparisons"]]


def render(data: dict[str, Any]) -> str:
    """The results section of docs/experiments.md from a :func:`digest`: the run, every comparison by kind
    (:func:`~sinkformer.runs.verdicts.family_section`) and the experiments' times."""
    facts = data["provenance"]
    failed = [e["name"] for e in data["experiments"] if not e["ok"]]
    lines = [
        f"*The committed quick run: `sinkformer run` on {data['started'][:16].replace('T', ' ')}, "
        f"{len(data['experiments'])} experiments in {data['seconds'] // 60} min {data['seconds'] % 60} s on "
        f"{data['jobs']} worker processes, {facts['cpu']} ({facts['cpu_count']} cores), torch {facts['torch']}, "
        f"sinkformer {facts['sinkformer']} at {facts['git_commit'][:12]}"
        + (f"; failed: {', '.join(failed)}" if failed else "") + ".*",
        "",
        family_section(_named(data), heading="###"),
        "",
        "### The experiments",
        "",
        markdown_table(
            ["experiment", "paper", "paper claims (" + " / ".join(v.split(" ")[0] for v in VERDICTS) + ")",
             "other comparisons", "time"],
            [[e["name"], e["paper"], *_counts(e["comparisons"]), f"{e['seconds']} s"] for e in data["experiments"]],
        ),
    ]
    return "\n".join(lines)


def _speed(calibration: dict[str, Any] | None) -> str:
    """The machine's speed during a run, beside its time: its calibration step (:func:`~.suite.calibration`,
    the measure ``sinkformer run`` scales its estimate by), which moves from run to run on a shared machine."""
    if not calibration or "step_ms" not in calibration:
        return ""
    return (f" (a training step of PyTorch's own encoder layer, the suite's calibration, took "
            f"{calibration['step_ms']:.2f} ms at its start: the machine's speed then)")


def render_headline(data: dict[str, Any], link: str = "#what-the-quick-runs-found") -> str:
    """What the quick forms are and what the committed run found, counted by kind: the first lines of
    docs/experiments.md and of the README's results (``link``: where every comparison is)."""
    counts = tally([c for _, c in _named(data)])
    claims, held = counts["claims"], counts["claims_after_holm"]
    minutes, seconds = divmod(data["seconds"], 60)
    others = "; ".join(f"{counts['by_kind'][kind]} {_KIND_WORDS[kind]}" for kind in (*KINDS[1:], UNCLASSIFIED)
                       if counts["by_kind"][kind])
    seeds = counts["seeds"]
    seeds_text = (f"{seeds[0]} seeds each" if len(seeds) == 1 else f"{seeds[0]}–{seeds[-1]} seeds each") if seeds else ""
    return (
        f"{QUICK_FORMS} The committed quick run ({data['started'][:10]}, {data['provenance']['cpu_count']} CPU cores, "
        f"{data['jobs']} worker processes) ran all {len(data['experiments'])} experiments in {minutes} min {seconds} s"
        f"{_speed(data.get('calibration'))}. "
        f"**{counts['by_kind'][CLAIM]} of its {counts['comparisons']} paired comparisons** ({seeds_text}) **test a "
        f"claim of the papers at the papers' settings**: by the 95 % interval "
        + ", ".join(f"**{n} {v}**" for v, n in claims.items())
        + "; after Holm's correction for all " + f"{counts['comparisons']} comparisons, "
        + ", ".join(f"{n} {v}" for v, n in held.items())
        + f". Listed apart: {others or 'none'}. {STALE if counts['by_kind'][UNCLASSIFIED] else SEEDS_VARY} Every "
        "comparison, its interval, p-values and the "
        f"findings: [{'docs/experiments.md' if link.startswith('docs/') else 'below'}]({link})."
    )


def render_summary(data: dict[str, Any]) -> str:
    """The README's summary of the committed quick run (:func:`render_headline`, linking docs/experiments.md)."""
    return render_headline(data, link="docs/experiments.md#what-the-quick-runs-found")


def _counts(comparisons: list[dict]) -> list[str]:
    """An experiment's paper claims by verdict, and its other comparisons by kind."""
    if not comparisons:
        return ["— (a measurement, no paired comparison)", "—"]
    counts = tally(comparisons)
    claims = " / ".join(str(counts["claims"][v]) for v in VERDICTS) if counts["by_kind"][CLAIM] else "—"
    others = ", ".join(f"{n} {kind}" for kind, n in counts["by_kind"].items() if n and kind != CLAIM)
    return [claims, others or "—"]


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
        if ENGINES_BEGIN in new:
            new = update(new, engine_table(), ENGINES_BEGIN, ENGINES_END)
        if page == EXPERIMENTS_PAGE:
            new = update(update(new, render(data)), render_headline(data), HEADLINE_BEGIN, HEADLINE_END)
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
        made = digest(args.summary_dir)
        try:  # the committed digest must name the one clean commit that made it
            require_clean_source(made["provenance"], f"the digest of {args.summary_dir}")
        except ValueError as err:
            parser.error(str(err))
        DIGEST.parent.mkdir(parents=True, exist_ok=True)
        DIGEST.write_text(json.dumps(made, indent=1, ensure_ascii=False) + "\n")
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
