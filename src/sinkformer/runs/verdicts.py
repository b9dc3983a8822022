r"""Verdicts that carry their uncertainty: paired comparisons over seeds, what each one tests, and
the correction for testing many.

**Paired comparisons.** Every comparison of a Sinkformer (or a Sparse Sinkhorn variant) with its
Transformer is paired: for each seed :math:`s` both models start from the same initial weights and
see the same data (the same training subset and batch order), so the per-seed difference
:math:`\delta_s = m_s(\text{variant}) - m_s(\text{baseline})` of a metric removes most of the
seed-to-seed variation. With :math:`n` seeds,

.. math::

    \bar\delta \pm t_{n-1,\,0.975}\,\frac{s_\delta}{\sqrt n}

is the 95 % confidence interval of the mean difference (Student's t; :math:`s_\delta` the sample
standard deviation). **The rule**: an interval entirely above 0 says the variant's metric is
higher, entirely below 0 lower; one that contains 0 (or fewer than 2 seeds) is *inconclusive*.
The verdict compares that sign, oriented by whether higher is better, with the direction the
paper reports: *same direction as the paper*, *opposite*, or *inconclusive*.

**Two tests beside the interval.** :attr:`Comparison.p_value` is the two-sided paired t-test
(below 0.05 exactly when the interval excludes 0); :attr:`Comparison.p_sign_flip` is the exact
sign-flip permutation test of the mean difference, which assumes no normality (the
:math:`2^n` sign patterns of the differences; its smallest two-sided value is :math:`2/2^n`:
0.031 with 6 seeds, 0.0625 with 5, so at least 6 seeds are needed for it to reach 0.05).

**What a comparison tests** (:data:`KINDS`, declared by each experiment, :func:`paper_kind`):
a claim of the paper at the paper's setting, a setting the paper itself reports as *worse*, a gap
the paper reports *within noise*, or *no paper claim* (our own extensions). Only the first kind
makes the headline; the others are listed apart.

**Many tests at once.** A run makes many comparisons; :func:`holm` adjusts their t-test p-values
by Holm's step-down method (family-wise error 5 % over all the comparisons of the run), and
:func:`family_section` reports each verdict before and after that correction.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields

from .._optional import require

__all__ = ["SAME", "OPPOSITE", "INCONCLUSIVE", "VERDICTS", "RULE", "TESTS", "CLAIM", "WORSE", "NOISE", "EXTENSION",
           "UNCLASSIFIED", "KINDS", "KIND_MEANING", "NOISE_FRACTION", "MIN_SEEDS", "Comparison", "paired",
           "paper_kind", "count_verdicts", "holm", "after_holm", "tally", "sign_flip_p", "comparison_table",
           "family_section", "record"]

SAME, OPPOSITE, INCONCLUSIVE = "same direction as the paper", "opposite", "inconclusive"
VERDICTS = (SAME, OPPOSITE, INCONCLUSIVE)
CONFIDENCE = 0.95
#: Seeds behind every paired comparison of the quick forms (the sign-flip test needs 6 to reach p < 0.05).
MIN_SEEDS = 6

CLAIM, WORSE, NOISE, EXTENSION = "paper claim", "paper reports worse", "within the paper's noise", "no paper claim"
#: A comparison read from a digest written before comparisons declared their kind.
UNCLASSIFIED = "unclassified"
KINDS = (CLAIM, WORSE, NOISE, EXTENSION)
#: A gap of the paper under this fraction of the baseline's value counts as within noise.
NOISE_FRACTION = 0.01
KIND_MEANING = {
    CLAIM: "a claim of the paper at the paper's setting: its table shows the variant better by at least "
           f"{NOISE_FRACTION:.0%} of the baseline's value, or its figure or text says it is better",
    WORSE: f"a setting the paper itself reports as worse (by at least {NOISE_FRACTION:.0%})",
    NOISE: f"a gap the paper reports within noise: under {NOISE_FRACTION:.0%} of the baseline's value, within the "
           "spread of the paper's own runs, or called similar by the paper",
    EXTENSION: "no claim of the paper: our own extension, or a model the paper did not measure",
    UNCLASSIFIED: "not classified (a digest written before comparisons declared their kind)",
}


def paper_kind(variant: float, baseline: float, *, higher_is_better: bool, similar: bool = False) -> tuple[str, bool]:
    """``(kind, paper_better)`` of a comparison from the paper's two numbers.

    ``similar``: the paper's own runs or words put the two within noise (their best–worst ranges
    overlap, or it calls them similar). Otherwise a gap under :data:`NOISE_FRACTION` of
    ``|baseline|`` is :data:`NOISE`, a larger one :data:`CLAIM` when it favours the variant and
    :data:`WORSE` when it does not. ``paper_better``: the sign of the paper's gap, oriented.

    >>> paper_kind(49.24, 45.69, higher_is_better=True)
    ('paper claim', True)
    >>> paper_kind(1.295, 1.283, higher_is_better=False) == (NOISE, False)  # 0.012 is 0.9 % of 1.283
    True
    """
    better = (variant > baseline) == higher_is_better
    if similar or abs(variant - baseline) < NOISE_FRACTION * abs(baseline):
        return NOISE, better
    return (CLAIM if better else WORSE), better


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
        kind: what the comparison tests, one of :data:`KINDS` (:data:`UNCLASSIFIED` when read
            from an older digest).
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
    kind: str = UNCLASSIFIED

    @property
    def seeds(self) -> int:
        return len(self.differences)

    @property
    def p_value(self) -> float:
        """Two-sided paired t-test of a zero mean difference (``nan`` with one seed)."""
        return _t_test_p(self.differences)

    @property
    def p_sign_flip(self) -> float:
        """Two-sided exact sign-flip permutation test of a zero mean difference (:func:`sign_flip_p`)."""
        return sign_flip_p(self.differences)

    def interval(self, digits: int = 2) -> str:
        """``"+1.23 [−0.40, +2.86]"`` (mean and 95 % interval of the difference)."""
        if not math.isfinite(self.low):
            return f"{self.mean:+.{digits}f} (one seed: no interval)"
        return f"{self.mean:+.{digits}f} [{self.low:+.{digits}f}, {self.high:+.{digits}f}]"

    def to_dict(self) -> dict:
        """The fields, ``seeds`` and both p-values (JSON-ready; :meth:`from_dict` reads it back)."""
        return {**asdict(self), "differences": list(self.differences), "seeds": self.seeds,
                "p_value": self.p_value, "p_sign_flip": self.p_sign_flip}

    @classmethod
    def from_dict(cls, data: dict) -> "Comparison":
        """The comparison that :meth:`to_dict` wrote (e.g. read back from ``results.json``); derived
        entries (``seeds``, the p-values) are recomputed, a missing ``kind`` is :data:`UNCLASSIFIED`."""
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in names}
        numbers = {k: float(values[k]) for k in ("mean", "low", "high")}  # JSON writes nan as "nan"
        return cls(**{**values, **numbers, "differences": tuple(float(d) for d in values["differences"])})


def paired(
    baseline: Sequence[float],
    variant: Sequence[float],
    *,
    metric: str,
    higher_is_better: bool,
    paper_better: bool,
    paper: str,
    kind: str,
    baseline_name: str = "Transformer",
    variant_name: str = "Sinkformer",
) -> Comparison:
    """The paired comparison of ``variant`` with ``baseline`` (one value per seed, same seeds, same order).

    ``kind``: what it tests, one of :data:`KINDS` (see :func:`paper_kind`)."""
    if len(baseline) != len(variant):
        raise ValueError(f"baseline and variant must have one value per seed each, got {len(baseline)} and {len(variant)}")
    if not baseline:
        raise ValueError("a paired comparison needs at least one seed, got none")
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(map(repr, KINDS))}, got {kind!r}")
    diffs = tuple(float(v) - float(b) for b, v in zip(baseline, variant))
    mean = statistics.fmean(diffs)
    low = high = float("nan")
    if len(diffs) >= 2:
        half = _t_quantile(len(diffs) - 1) * statistics.stdev(diffs) / math.sqrt(len(diffs))
        low, high = mean - half, mean + half
    return Comparison(metric, baseline_name, variant_name, diffs, mean, low, high, higher_is_better, paper_better,
                      paper, _verdict(low, high, higher_is_better, paper_better), kind)


def _verdict(low: float, high: float, higher_is_better: bool, paper_better: bool) -> str:
    if not (math.isfinite(low) and math.isfinite(high)) or low <= 0 <= high:
        return INCONCLUSIVE
    variant_better = (low > 0) == higher_is_better
    return SAME if variant_better == paper_better else OPPOSITE


def _t_quantile(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom."""
    t = require("scipy.stats", "confidence intervals of verdicts").t
    return float(t.ppf(0.5 + CONFIDENCE / 2, df))


def _t_test_p(differences: Sequence[float]) -> float:
    """Two-sided p-value of the one-sample t-test of ``differences`` against 0; with no spread, 1 for
    a zero mean and 0 otherwise (the interval is then a point), ``nan`` with fewer than 2 values."""
    n = len(differences)
    if n < 2:
        return float("nan")
    mean, sd = statistics.fmean(differences), statistics.stdev(differences)
    if sd == 0:
        return 1.0 if mean == 0 else 0.0
    t = require("scipy.stats", "p-values of verdicts").t
    return float(2 * t.sf(abs(mean) / (sd / math.sqrt(n)), n - 1))


#: Up to this many differences the sign-flip test enumerates every pattern (2^16 = 65,536).
EXACT_SIGN_FLIPS = 16


def sign_flip_p(differences: Sequence[float]) -> float:
    r"""Two-sided sign-flip permutation p-value of a zero mean difference: the share of the
    :math:`2^n` sign patterns :math:`\epsilon` with :math:`|\sum_s \epsilon_s\delta_s| \ge |\sum_s \delta_s|`
    (the observed pattern counts, so the smallest value is :math:`2/2^n`; ``nan`` with no value).

    Exact up to :data:`EXACT_SIGN_FLIPS` differences; beyond, 2^16 patterns drawn with a fixed seed.

    >>> sign_flip_p([1.0, 2.0, 0.5, 1.5, 1.0, 3.0])  # all six the same sign: 2 / 64
    0.03125
    """
    np = require("numpy", "the sign-flip test")
    d = np.asarray(differences, dtype=np.float64)
    if d.size == 0:
        return float("nan")
    if d.size <= EXACT_SIGN_FLIPS:
        signs = np.array(list(itertools.product((1.0, -1.0), repeat=d.size)))
    else:
        signs = np.random.default_rng(0).choice((1.0, -1.0), size=(2**EXACT_SIGN_FLIPS, d.size))
        signs[0] = 1.0  # the observed pattern
    sums = np.abs(signs @ d)
    tolerance = 1e-9 * np.abs(d).sum()  # patterns whose sum equals the observed one, up to rounding, count
    return float(np.mean(sums >= abs(d.sum()) - tolerance))


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjustment of ``p_values`` (family-wise error over all of them).

    The ``k``-th smallest of the ``m`` finite p-values becomes ``max_{j<=k} min(1, (m - j + 1) p_(j))``;
    ``nan`` entries (comparisons with one seed) stay ``nan`` and do not count in ``m``.

    >>> holm([0.01, 0.04, 0.03])
    [0.03, 0.06, 0.06]
    """
    finite = sorted((p, i) for i, p in enumerate(p_values) if math.isfinite(p))
    adjusted = [float("nan")] * len(p_values)
    running, m = 0.0, len(finite)
    for rank, (p, i) in enumerate(finite):
        running = max(running, min(1.0, (m - rank) * p))
        adjusted[i] = running
    return adjusted


def _as_comparison(c: Comparison | dict) -> Comparison:
    return c if isinstance(c, Comparison) else Comparison.from_dict(c)


def count_verdicts(comparisons: Sequence[Comparison | dict], kind: str | None = None) -> dict[str, int]:
    """``{verdict: count}`` over ``comparisons`` (every verdict present, possibly 0), or over those
    of one ``kind``."""
    counts = dict.fromkeys(VERDICTS, 0)
    for c in map(_as_comparison, comparisons):
        if kind is None or c.kind == kind:
            counts[c.verdict] += 1
    return counts


RULE = (
    "Verdict rule: for each seed both models start from the same weights and train on the same data; the 95 % "
    "Student-t interval of the mean per-seed difference (variant − baseline) decides — entirely on the side the "
    "paper found: *same direction as the paper*; entirely on the other side: *opposite*; containing 0: "
    "*inconclusive*."
)
TESTS = (
    "Beside each interval: the paired t-test's p-value, the exact sign-flip permutation test's (no normality "
    "assumed; with n seeds its smallest two-sided value is 2/2^n, 0.031 for 6 seeds) and, over a whole run, "
    "Holm's adjustment of the t-test p-values for the number of comparisons (family-wise error 5 %); a verdict "
    "*after Holm* stands only when its adjusted p-value is below 0.05."
)


def _p(p: float) -> str:
    return "—" if not math.isfinite(p) else (f"{p:.3f}" if p >= 0.001 else f"{p:.1e}")


def comparison_table(comparisons: Sequence[Comparison]) -> str:
    """A markdown table: metric, models, what it tests, the paper's numbers, this run's interval, the
    two p-values, seeds, verdict."""
    from .report import markdown_table

    rows = [[c.metric, f"{c.variant} − {c.baseline}", c.kind, c.paper, c.interval(), _p(c.p_value),
             _p(c.p_sign_flip), c.seeds, f"**{c.verdict}**"] for c in comparisons]
    return markdown_table(["metric", "difference", "tests", "the paper", "this run: mean [95 % interval]", "p (t)",
                           "p (sign flip)", "seeds", "verdict"], rows)


def after_holm(comparisons: Sequence[Comparison | dict]) -> list[str]:
    """Each comparison's verdict after Holm's correction over all of ``comparisons``: its verdict when its
    adjusted t-test p-value is below 0.05, else *inconclusive*."""
    items = [_as_comparison(c) for c in comparisons]
    return [c.verdict if math.isfinite(p) and p < 1 - CONFIDENCE else INCONCLUSIVE
            for c, p in zip(items, holm([c.p_value for c in items]))]


def tally(comparisons: Sequence[Comparison | dict]) -> dict:
    """What a run's headline says: ``comparisons`` (their number), ``by_kind`` (``{kind: number}``, every kind
    present), ``claims`` (``{verdict: number}`` of the paper claims, by the raw interval), ``claims_after_holm``
    (the same after Holm's correction over all the comparisons) and ``seeds`` (the sorted seed counts)."""
    items = [_as_comparison(c) for c in comparisons]
    held = dict.fromkeys(VERDICTS, 0)
    for c, verdict in zip(items, after_holm(items)):
        if c.kind == CLAIM:
            held[verdict] += 1
    by_kind = {kind: sum(c.kind == kind for c in items) for kind in (*KINDS, UNCLASSIFIED)}
    return {"comparisons": len(items), "by_kind": by_kind, "claims": count_verdicts(items, CLAIM),
            "claims_after_holm": held, "seeds": sorted({c.seeds for c in items})}


def _counts_text(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {v}" for v, n in counts.items())


def family_section(named: Sequence[tuple[str, Comparison | dict]], heading: str = "###") -> str:
    """Markdown for every paired comparison of a run, ``named`` ``(experiment, comparison)``: the
    headline (the paper claims at the papers' settings, before and after Holm's correction over all
    the comparisons), the other kinds counted apart, then one table per kind with each comparison's
    interval, p-values (raw, Holm-adjusted, sign-flip) and verdicts."""
    from .report import markdown_table

    items = [(name, _as_comparison(c)) for name, c in named]
    if not items:
        return "No paired comparison in this run (measurements only, no verdict)."
    comparisons = [c for _, c in items]
    counts, adjusted, after = tally(comparisons), holm([c.p_value for c in comparisons]), after_holm(comparisons)
    seeds = counts["seeds"]
    seeds_text = (f"{seeds[0]} seeds each" if len(seeds) == 1 else f"{seeds[0]}–{seeds[-1]} seeds each") if seeds else ""
    others = [f"{counts['by_kind'][kind]} {kind} ({_counts_text(count_verdicts(comparisons, kind))})"
              for kind in (*KINDS[1:], UNCLASSIFIED) if counts["by_kind"][kind]]
    lines = [
        f"**{counts['by_kind'][CLAIM]} paper claims at the papers' settings** (of {len(items)} paired comparisons, "
        f"{seeds_text}): by the raw 95 % interval " + ", ".join(f"**{n} {v}**" for v, n in counts["claims"].items())
        + "; after Holm's correction over "
        f"all {len(items)} comparisons, {_counts_text(counts['claims_after_holm'])}."
        + (f" Listed apart: {'; '.join(others)}." if others else ""),
        "",
        f"{RULE} {TESTS}",
    ]
    for kind in (*KINDS, UNCLASSIFIED):
        rows = [[name, c.metric, f"{c.variant} − {c.baseline}", c.paper, c.interval(), _p(c.p_value), _p(p),
                 _p(c.p_sign_flip), c.seeds, c.verdict, held]
                for (name, c), p, held in zip(items, adjusted, after) if c.kind == kind]
        if rows:
            lines += ["", f"{heading} {kind[0].upper()}{kind[1:]}: {KIND_MEANING[kind]}", "", markdown_table(
                ["experiment", "metric", "difference", "the paper", "this run: mean [95 % interval]", "p (t)",
                 "p (Holm)", "p (sign flip)", "seeds", "verdict", "after Holm"], rows)]
    return "\n".join(lines)


def record(results: dict, comparisons: Sequence[Comparison], *, paper: str, this_run: str) -> str:
    """Store ``comparisons`` and the finding in ``results`` (for the summary); return the report's
    closing section: the paper and this run side by side, the comparisons and the rule."""
    results["comparisons"] = [c.to_dict() for c in comparisons]
    results["finding"] = {"paper": paper, "this_run": this_run, "verdicts": count_verdicts(comparisons)}
    counts = ", ".join(f"{n} {v}" for v, n in results["finding"]["verdicts"].items() if n)
    kinds = "; ".join(f"*{kind}*: {KIND_MEANING[kind]}" for kind in KINDS if any(c.kind == kind for c in comparisons))
    return (
        "## Paper vs this run\n\n"
        "| the paper found | this run found |\n|---|---|\n"
        f"| {paper} | {this_run} |\n\n"
        f"{comparison_table(comparisons)}\n\n"
        f"**Verdicts:** {counts or 'no comparison'}. {RULE} What each comparison tests — {kinds}. "
        "p (t): the paired t-test; p (sign flip): the exact sign-flip permutation test (smallest value 2/2^n with n "
        "seeds). The summary of a whole run adjusts the p-values for the number of comparisons (Holm).\n"
    )
