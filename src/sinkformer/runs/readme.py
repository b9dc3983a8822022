"""The README's results, rendered from a committed run — a claim is a test.

A quick run of the whole suite (``sinkformer run``) writes ``runs/summary/<time>/summary.json``.
:func:`digest` keeps what the README needs (every paired comparison with its interval and verdict,
the findings in words, the run times, the machine) in ``docs/results/quick-run.json``, which is
committed; :func:`render` turns that file into the README's results section, between two markers.
A test checks that the README holds exactly what :func:`render` makes of the committed file::

    python -m sinkformer.runs.readme digest runs/summary/<time>   # write docs/results/quick-run.json
    python -m sinkformer.runs.readme render                        # rewrite the README's section
    python -m sinkformer.runs.readme check                         # exit 1 if the README differs
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from .report import markdown_table
from .verdicts import RULE, VERDICTS, Comparison, count_verdicts

__all__ = ["digest", "render", "update", "load_quick_run", "DIGEST", "README", "BEGIN", "END"]

ROOT = Path(__file__).resolve().parents[3]
DIGEST = ROOT / "docs" / "results" / "quick-run.json"
README = ROOT / "README.md"
BEGIN = "<!-- begin: quick-run results, rendered by `python -m sinkformer.runs.readme render` from docs/results/quick-run.json -->"
END = "<!-- end: quick-run results -->"


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


def update(text: str, section: str) -> str:
    """``text`` with the part between :data:`BEGIN` and :data:`END` replaced by ``section``."""
    if BEGIN not in text or END not in text:
        raise ValueError(f"the README has no results markers ({BEGIN!r} ... {END!r})")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{section}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sinkformer.runs.readme", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("digest", help="write docs/results/quick-run.json from a suite run's summary folder")
    make.add_argument("summary_dir")
    sub.add_parser("render", help="rewrite the README's results section from docs/results/quick-run.json")
    sub.add_parser("check", help="exit 1 when the README's results section is not what render gives")
    args = parser.parse_args(argv)
    if args.command == "digest":
        DIGEST.parent.mkdir(parents=True, exist_ok=True)
        DIGEST.write_text(json.dumps(digest(args.summary_dir), indent=1, ensure_ascii=False) + "\n")
        print(f"wrote {DIGEST}")
        return 0
    text = README.read_text()
    new = update(text, render(json.loads(DIGEST.read_text())))
    if args.command == "check":
        if new != text:
            print("README.md's results differ from `python -m sinkformer.runs.readme render`", file=sys.stderr)
            return 1
        return 0
    README.write_text(new)
    print(f"rendered {DIGEST.name} into {README}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
