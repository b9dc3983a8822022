"""Paired comparisons over seeds: the interval, the rule, the kinds, the two tests, Holm's correction."""

import doctest
import itertools
import math

import pytest
from scipy import stats

from sinkformer.runs import verdicts
from sinkformer.runs.verdicts import (
    CLAIM,
    EXTENSION,
    INCONCLUSIVE,
    NOISE,
    OPPOSITE,
    SAME,
    UNCLASSIFIED,
    WORSE,
    Comparison,
    count_verdicts,
    family_section,
    holm,
    paired,
    paper_kind,
    sign_flip_p,
)


def comparison(diffs, *, kind=CLAIM, higher=True, paper_better=True, name="m"):
    return paired([0.0] * len(diffs), diffs, metric=name, higher_is_better=higher, paper_better=paper_better,
                  paper="", kind=kind)


def test_interval_is_the_student_t_interval_of_the_paired_differences():
    base, var = [80.0, 81.0, 79.5, 82.0, 80.5, 80.0], [81.0, 83.0, 80.0, 82.5, 82.0, 81.1]
    c = paired(base, var, metric="acc", higher_is_better=True, paper_better=True, paper="+1", kind=CLAIM)
    diffs = [v - b for b, v in zip(base, var)]
    low, high = stats.t.interval(0.95, len(diffs) - 1, loc=sum(diffs) / 6, scale=stats.sem(diffs))
    assert c.differences == tuple(diffs) and c.mean == pytest.approx(1.1)
    assert (c.low, c.high) == pytest.approx((low, high)) and c.seeds == 6
    assert c.verdict == SAME and c.interval() == f"+1.10 [{low:+.2f}, {high:+.2f}]"
    assert c.p_value == pytest.approx(stats.ttest_1samp(diffs, 0).pvalue)


@pytest.mark.parametrize("diffs, higher, paper_better, verdict", [
    ([1.0, 1.2, 0.9], True, True, SAME),           # clearly higher, higher is better, paper: better
    ([1.0, 1.2, 0.9], True, False, OPPOSITE),      # the paper found it worse
    ([1.0, 1.2, 0.9], False, False, SAME),          # lower is better (bits): higher = worse, as the paper
    ([-1.0, -1.2, -0.9], False, True, SAME),        # lower bits = better, as the paper
    ([1.0, -1.0, 0.5], True, True, INCONCLUSIVE),   # the interval contains 0
    ([2.0], True, True, INCONCLUSIVE),              # one seed: no interval
    ([0.0, 0.0, 0.0], True, True, INCONCLUSIVE),    # no difference at all
])
def test_the_rule(diffs, higher, paper_better, verdict):
    c = comparison(diffs, higher=higher, paper_better=paper_better)
    assert c.verdict == verdict
    if len(diffs) == 1:
        assert math.isnan(c.low) and "one seed" in c.interval() and math.isnan(c.p_value)


@pytest.mark.parametrize("diffs", [[1.0, 1.2, 0.9, 1.4], [1.0, -1.0, 0.5, 0.2, 0.1], [0.3, 0.1, -0.05, 0.2, 0.25, 0.4],
                                   [2.0, 2.0, 2.0], [0.0, 0.0]])
def test_the_t_test_rejects_exactly_when_the_interval_excludes_zero(diffs):
    c = comparison(diffs)
    assert (c.p_value < 0.05) == (c.verdict != INCONCLUSIVE)


def test_sign_flip_p_counts_the_sign_patterns_at_least_as_extreme():
    diffs = [0.5, -0.2, 1.0, 0.3, 0.8, 0.1]
    extreme = sum(abs(sum(s * d for s, d in zip(signs, diffs))) >= abs(sum(diffs)) - 1e-12
                  for signs in itertools.product((1, -1), repeat=6))
    assert sign_flip_p(diffs) == extreme / 64 == comparison(diffs).p_sign_flip
    # every difference of one sign: the smallest two-sided value, 2/2^n: 6 seeds reach 0.05, 5 cannot
    assert sign_flip_p([1.0, 2.0, 0.5, 1.5, 1.0, 3.0]) == 2 / 64 < 0.05
    assert sign_flip_p([1.0, 2.0, 0.5, 1.5, 1.0]) == 2 / 32 > 0.05
    assert sign_flip_p([0.0, 0.0, 0.0]) == 1.0 and math.isnan(sign_flip_p([]))
    many = [1.0] * 20  # beyond the exact enumeration: sampled patterns, still about 2 / 2^20
    assert sign_flip_p(many) < 1e-3


def test_holm_is_the_step_down_adjustment():
    p = [0.01, 0.04, 0.03, 0.005, float("nan")]
    adjusted = holm(p)
    # sorted: 0.005*4, 0.01*3, 0.03*2, 0.04*1 -> 0.02, 0.03, 0.06, max(0.06, 0.04)
    assert adjusted[:4] == pytest.approx([0.03, 0.06, 0.06, 0.02]) and math.isnan(adjusted[4])
    assert holm([0.5, 0.9]) == pytest.approx([1.0, 1.0]) and holm([]) == []
    assert all(a >= b for a, b in zip(adjusted, p) if math.isfinite(b))


@pytest.mark.parametrize("variant, baseline, higher, similar, kind, better", [
    (49.24, 45.69, True, False, CLAIM, True),     # sort, Sinkhorn (32): +7.8 %
    (43.65, 45.69, True, False, WORSE, False),    # sort, Sinkhorn (8): -4.5 %
    (3.197, 3.198, False, False, NOISE, True),    # pixels: a thousandth of a bit
    (1.295, 1.283, False, False, NOISE, False),   # charlm: 0.9 %
    (40.79, 41.57, False, False, CLAIM, True),    # wordlm (64): -1.9 % perplexity
    (92.8, 92.5, True, True, NOISE, True),        # PCT: the paper's best-worst ranges overlap
])
def test_paper_kind(variant, baseline, higher, similar, kind, better):
    assert paper_kind(variant, baseline, higher_is_better=higher, similar=similar) == (kind, better)


def test_kind_is_required_and_checked():
    with pytest.raises(ValueError, match="kind must be one of 'paper claim'.*got 'claim'"):
        paired([1.0, 2.0], [1.0, 2.0], metric="m", higher_is_better=True, paper_better=True, paper="", kind="claim")
    with pytest.raises(TypeError, match="kind"):
        paired([1.0], [1.0], metric="m", higher_is_better=True, paper_better=True, paper="")


def test_round_trip_through_json_and_counts():
    c = comparison([1.0, 0.5], kind=NOISE)
    one = comparison([1.0])
    as_json = {**one.to_dict(), "low": "nan", "high": "nan", "mean": "1.0"}  # what results.json holds
    assert Comparison.from_dict(c.to_dict()) == c and Comparison.from_dict(as_json).verdict == INCONCLUSIVE
    assert c.to_dict()["p_value"] == c.p_value and c.to_dict()["p_sign_flip"] == 0.5
    old = {k: v for k, v in c.to_dict().items() if k not in ("kind", "p_value", "p_sign_flip")}  # an older digest
    assert Comparison.from_dict(old).kind == UNCLASSIFIED
    assert count_verdicts([c, one.to_dict()]) == {SAME: 0, OPPOSITE: 0, INCONCLUSIVE: 2}
    assert count_verdicts([c, one], kind=CLAIM) == {SAME: 0, OPPOSITE: 0, INCONCLUSIVE: 1}
    with pytest.raises(ValueError, match="one value per seed"):
        paired([1.0], [1.0, 2.0], metric="m", higher_is_better=True, paper_better=True, paper="", kind=CLAIM)


def test_family_section_heads_with_the_paper_claims_and_corrects_for_all_comparisons():
    strong = [1.0, 1.1, 0.9, 1.2, 1.0, 1.05]          # p ~ 1e-6: survives Holm over 4 tests
    weak = [0.3, 0.1, -0.05, 0.2, 0.25, 0.4]           # p ~ 0.03: does not
    named = [("a", comparison(strong)), ("a", comparison(weak)),
             ("b", comparison(strong, kind=EXTENSION)), ("c", comparison([0.1, -0.1, 0.0, 0.2, -0.2, 0.05], kind=NOISE).to_dict())]
    assert comparison(weak).p_value < 0.05 < 4 * comparison(weak).p_value
    text = family_section(named)
    assert text.startswith("**2 paper claims at the papers' settings** (of 4 paired comparisons, 6 seeds each)")
    assert f"by the raw 95 % interval **2 {SAME}**, **0 {OPPOSITE}**, **0 {INCONCLUSIVE}**" in text
    assert f"after Holm's correction over all 4 comparisons, 1 {SAME}, 0 {OPPOSITE}, 1 {INCONCLUSIVE}." in text
    assert f"1 {EXTENSION} (1 {SAME}" in text and f"1 {NOISE} (0 {SAME}, 0 {OPPOSITE}, 1 {INCONCLUSIVE})" in text
    assert text.index("Paper claim:") < text.index("Within the paper's noise:") and "p (Holm)" in text
    claims = text.split("Paper claim:")[1].split("###")[0]
    assert claims.count(f"| {SAME} | {SAME} |") == 1 and claims.count(f"| {SAME} | {INCONCLUSIVE} |") == 1


def test_doctests():
    assert doctest.testmod(verdicts).failed == 0
