"""The one statistical rule of the reports (dp_adam_bench/report/stats.py) against scipy's Welch test and a brute
force search for the seeds that would decide a gap."""

import math

import numpy as np
import pytest
from scipy import stats as scipy_stats

from dp_adam_bench.report import stats


@pytest.mark.parametrize("n_a,n_b", [(2, 2), (2, 3), (3, 5), (10, 4)])
def test_welch_matches_scipy_on_random_seeds(n_a, n_b):
    rng = np.random.default_rng(n_a * 10 + n_b)
    for _ in range(20):
        a, b = rng.normal(0.3, 1.0, n_a), rng.normal(0.0, rng.uniform(0.2, 3.0), n_b)
        g = stats.compare(a, b)
        ref = scipy_stats.ttest_ind(a, b, equal_var=False)
        assert g.t == pytest.approx(ref.statistic, rel=1e-10)
        assert g.df == pytest.approx(ref.df, rel=1e-10)
        assert g.p == pytest.approx(ref.pvalue, rel=1e-8)
        assert g.decided == (ref.pvalue < 0.05)
        assert g.diff == pytest.approx(a.mean() - b.mean())


def test_the_std_convention_is_the_sample_std():
    vals = [1.0, 2.5, 4.0, 4.5]
    assert stats.sample_std(vals) == pytest.approx(np.std(vals, ddof=1))
    assert stats.sample_std([3.0]) is None  # one seed has no spread
    pop = float(np.std(vals))
    assert stats.sample_from_population_std(pop, len(vals)) == pytest.approx(np.std(vals, ddof=1))


def _brute_force_seeds(diff, sd_a, sd_b, start):
    for n in range(start + 1, 100_000):
        p = scipy_stats.ttest_ind_from_stats(diff, sd_a, n, 0.0, sd_b, n, equal_var=False).pvalue
        if p < stats.LEVEL:
            return n
    return None


@pytest.mark.parametrize(
    "diff,sd_a,sd_b,start",
    [(0.3, 0.71, 0.71, 2), (2.0, 1.0, 1.0, 2), (0.05, 1.0, 2.0, 3), (1.0, 0.1, 3.0, 5)],
)
def test_seeds_to_decide_is_the_first_count_at_which_welch_decides(diff, sd_a, sd_b, start):
    assert stats.seeds_to_decide(diff, sd_a, sd_b, start=start) == _brute_force_seeds(diff, sd_a, sd_b, start)


def test_a_gap_two_seeds_do_not_decide_never_calls_two_seeds_enough():
    # 2 SE with 2 seeds a cell: the old rule's "beyond seed noise"; Welch says p = 0.18 on 2 degrees of freedom
    g = stats.welch(2.0, 1.0, 2, 0.0, 1.0, 2)
    assert g.p == pytest.approx(scipy_stats.ttest_ind_from_stats(2, 1, 2, 0, 1, 2, equal_var=False).pvalue)
    assert not g.decided and g.seeds > 2
    assert g.flag().startswith("WITHIN SEED NOISE (p = 0.18 >= 0.05 by Welch's t; ~4 seeds a cell")


def test_what_cannot_be_tested_says_why():
    one = stats.welch(1.0, None, 1, 0.0, 0.5, 3)
    assert one.p is None and not one.decided
    assert one.test() == "no test: 1 / 3 seeds"
    assert one.flag() == "WITHIN SEED NOISE (no test: fewer than 2 seeds a cell)"
    diverged = stats.compare([1.0, math.nan], [0.0, 0.1])
    assert diverged.p is None and diverged.flag() == "WITHIN SEED NOISE (no test: a value not finite)"
    same = stats.compare([1.0, 1.0], [1.0, 1.0])
    assert same.p == 1.0 and "no gap to decide" in same.flag()
    exact = stats.compare([2.0, 2.0], [1.0, 1.0])  # no spread, a gap: exact
    assert exact.decided and exact.flag() == ""
    with pytest.raises(ValueError, match="values on both sides, got 0 and 2"):
        stats.compare([], [1.0, 2.0])
