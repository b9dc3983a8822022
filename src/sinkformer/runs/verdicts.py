r"""Verdicts that carry their uncertainty: paired comparisons over seeds.

Every comparison of a Sinkformer (or a Sparse Sinkhorn variant) with its Transformer is paired:
for each seed :math:`s` both models start from the same initial weights and see the same data,
so the per-seed difference :math:`\delta_s = m_s(\text{variant}) - m_s(\text{baseline})` of a
metric removes most of the seed-to-seed variation. With :math:`n` seeds,

.. math::

    \bar\delta \pm t_{n-1,\,0.975}\,\frac{s_\delta}{\sqrt n}

is the 95 % confidence interval of the mean difference (Student's t; :math:`s_\delta` the sample
standard deviation). **The rule**: an interval entirely above 0 says the variant's metric is
higher, entirely below 0 lower; one that contains 0 (or fewer than 2 seeds) is *inconclusive*.
The verdict compares that sign, oriented by whether higher is better, with the direction the
paper reports: *same direction as the paper*, *opposite*, or *inconclusive*.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from .._optional import require

__all__ = ["SAME", "OPPOSITE", "INCONCLUSIVE", "VERDICTS", "RULE", "Comparison", "paired", "count_verdicts",
           "comparison_table", "record"]

SAME, OPPOSITE, INCONCLUSIVE = "same direction as the paper", "opposite", "inconclusive"
VERDICTS = (SAME, OPPOSITE, INCONCLUSIVE)
CONFIDENCE = 0.95


@dataclass(frozen=True)
class Comparison:
    """One paired comparison and its verdict.

    Attributes:
        metric: what is compared, with its unit (``"test accuracy (%)"``).
        baseline, variant: the two models (``"Transformer"``, ``"Sinkformer (3 it.)"``).
        differences: per seed, ``variant - baseline`` of the metric.
        mean, low, high: the mean difference and its 95 % interval (``nan`` with one seed).
        higher_is_better: orientation of the metric.
        paper_better: whether the paper found the variant *better* (True) or worse (False).
        paper: the paper's numbers in words (shown next to the interval).
        verdict: one of :data:`VERDICTS`.
    """

    metric: str
    baseline: str
    variant: str
    differences: tuple[float, ...]
    mean: float
    low: float
    high: float
    higher_is_better: bool
    paper_better: bool
    paper: str
    verdict: str

    @property
    def seeds(self) -> int:
        return len(self.differences)

    def interval(self, digits: int = 2) -> str:
        """``"+1.23 [−0.40, +2.86]"`` (mean and 95 % interval of the difference)."""
        if not math.isfinite(self.low):
            return f"{self.mean:+.{digits}f} (one seed: no interval)"
        return f"{self.mean:+.{digits}f} [{self.low:+.{digits}f}, {self.high:+.{digits}f}]"

    def to_dict(self) -> dict:
        return {**asdict(self), "differences": list(self.differences), "seeds": self.seeds}

    @classmethod
    def from_dict(cls, data: dict) -> "Comparison":
        """The comparison that :meth:`to_dict` wrote (e.g. read back from ``results.json``)."""
        fields = {k: v for k, v in data.items() if k != "seeds"}
        numbers = {k: float(fields[k]) for k in ("mean", "low", "high")}  # JSON writes nan as "nan"
        return cls(**{**fields, **numbers, "differences": tuple(float(d) for d in fields["differences"])})


def paired(
    baseline: Sequence[float],
    variant: Sequence[float],
    *,
    metric: str,
    higher_is_better: bool,
    paper_better: bool,
    paper: str,
    baseline_name: str = "Transformer",
    variant_name: str = "Sinkformer",
) -> Comparison:
    """The paired comparison of ``variant`` with ``baseline`` (one value per seed, same seeds, same order)."""
    if len(baseline) != len(variant):
        raise ValueError(f"baseline and variant must have one value per seed each, got {len(baseline)} and {len(variant)}")
    if not baseline:
        raise ValueError("a paired comparison needs at least one seed, got none")
    diffs = tuple(float(v) - float(b) for b, v in zip(baseline, variant))
    mean = statistics.fmean(diffs)
    low = high = float("nan")
    if len(diffs) >= 2:
        half = _t_quantile(len(diffs) - 1) * statistics.stdev(diffs) / math.sqrt(len(diffs))
        low, high = mean - half, mean + half
    return Comparison(metric, baseline_name, variant_name, diffs, mean, low, high, higher_is_better, paper_better,
                      paper, _verdict(low, high, higher_is_better, paper_better))


def _verdict(low: float, high: float, higher_is_better: bool, paper_better: bool) -> str:
    if not (math.isfinite(low) and math.isfinite(high)) or low <= 0 <= high:
        return INCONCLUSIVE
    variant_better = (low > 0) == higher_is_better
    return SAME if variant_better == paper_better else OPPOSITE


def _t_quantile(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom."""
    t = require("scipy.stats", "confidence intervals of verdicts").t
    return float(t.ppf(0.5 + CONFIDENCE / 2, df))


def count_verdicts(comparisons: Sequence[Comparison | dict]) -> dict[str, int]:
    """``{verdict: count}`` over ``comparisons`` (every verdict present, possibly 0)."""
    counts = dict.fromkeys(VERDICTS, 0)
    for c in comparisons:
        counts[c["verdict"] if isinstance(c, dict) else c.verdict] += 1
    return counts


RULE = (
    "Verdict rule: for each seed both models start from the same weights; the 95 % Student-t interval of "
    "the mean per-seed difference (variant − baseline) decides — entirely on the side the paper found: "
    "*same direction as the paper*; entirely on the other side: *opposite*; containing 0: *inconclusive*."
)


def comparison_table(comparisons: Sequence[Comparison]) -> str:
    """A markdown table: metric, models, the paper's numbers, this run's interval, seeds, verdict."""
    from .report import markdown_table

    rows = [[c.metric, f"{c.variant} − {c.baseline}", c.paper, c.interval(), c.seeds, f"**{c.verdict}**"]
            for c in comparisons]
    return markdown_table(["metric", "difference", "the paper", "this run: mean [95 % interval]", "seeds",
                           "verdict"], rows)


def record(results: dict, comparisons: Sequence[Comparison], *, paper: str, this_run: str) -> str:
    """Store ``comparisons`` and the finding in ``results`` (for the summary); return the report's
    closing section: the paper and this run side by side, the comparisons and the rule."""
    results["comparisons"] = [c.to_dict() for c in comparisons]
    results["finding"] = {"paper": paper, "this_run": this_run, "verdicts": count_verdicts(comparisons)}
    counts = ", ".join(f"{n} {v}" for v, n in results["finding"]["verdicts"].items() if n)
    return (
        "## Paper vs this run\n\n"
        "| the paper found | this run found |\n|---|---|\n"
        f"| {paper} | {this_run} |\n\n"
        f"{comparison_table(comparisons)}\n\n"
        f"**Verdicts:** {counts or 'no comparison'}. {RULE}\n"
    )
