"""Paired comparisons over seeds: the interval, the rule, the counts."""

import math

import pytest
from scipy import stats

from sinkformer.runs.verdicts import INCONCLUSIVE, OPPOSITE, SAME, Comparison, count_verdicts, paired


def test_interval_is_the_student_t_interval_of_the_paired_differences():
    base, var = [80.0, 81.0, 79.5, 82.0, 80.5], [81.0, 83.0, 80.0, 82.5, 82.0]
    c = paired(base, var, metric="acc", higher_is_better=True, paper_better=True, paper="+1")
    diffs = [v - b for b, v in zip(base, var)]
    low, high = stats.t.interval(0.95, len(diffs) - 1, loc=sum(diffs) / 5, scale=stats.sem(diffs))
    assert c.differences == tuple(diffs) and c.mean == pytest.approx(1.1)
    assert (c.low, c.high) == pytest.approx((low, high)) and c.seeds == 5
    assert c.verdict == SAME and c.interval() == f"+1.10 [{low:+.2f}, {high:+.2f}]"


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
    c = paired([0.0] * len(diffs), diffs, metric="m", higher_is_better=higher, paper_better=paper_better, paper="")
    assert c.verdict == verdict
    if len(diffs) == 1:
        assert math.isnan(c.low) and "one seed" in c.interval()


def test_round_trip_through_json_and_counts():
    c = paired([1.0, 2.0], [2.0, 2.5], metric="m", higher_is_better=True, paper_better=True, paper="p")
    one = paired([1.0], [2.0], metric="m", higher_is_better=True, paper_better=True, paper="p")
    as_json = {**one.to_dict(), "low": "nan", "high": "nan", "mean": "1.0"}  # what results.json holds
    assert Comparison.from_dict(c.to_dict()) == c and Comparison.from_dict(as_json).verdict == INCONCLUSIVE
    assert count_verdicts([c, one.to_dict()]) == {SAME: 0, OPPOSITE: 0, INCONCLUSIVE: 2}
    with pytest.raises(ValueError, match="one value per seed"):
        paired([1.0], [1.0, 2.0], metric="m", higher_is_better=True, paper_better=True, paper="")
