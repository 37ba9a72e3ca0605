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
    assert g.flag().startswith("not decided: p = 0.18 >= 0.05 by Welch's t; ~4 seeds a cell")
    assert stats.state(g) == stats.AGREES


def test_what_cannot_be_tested_says_why():
    one = stats.welch(1.0, None, 1, 0.0, 0.5, 3)
    assert one.p is None and not one.decided
    assert one.test() == "no test: 1 / 3 seeds"
    assert one.flag() == "" and one.untested() == "fewer than 2 seeds a cell"
    diverged = stats.compare([1.0, math.nan], [0.0, 0.1])
    assert diverged.p is None and diverged.untested() == "a value not finite"
    assert diverged.test() == "no test: 2 / 2 seeds, a value not finite"
    same = stats.compare([1.0, 1.0], [1.0, 1.0])
    assert same.p == 1.0 and "no gap to decide" in same.flag()
    exact = stats.compare([2.0, 2.0], [1.0, 1.0])  # no spread, a gap: exact
    assert exact.decided and exact.flag() == ""
    with pytest.raises(ValueError, match="values on both sides, got 0 and 2"):
        stats.compare([], [1.0, 2.0])


# --- the five states of a comparison, and the exact two (scipy's Welch test is the oracle) --------------------------


def _state(a, b, **kw):
    return stats.state(stats.compare(a, b), **kw)


@pytest.mark.parametrize(
    "a,b,want",
    [
        ([10.0, 10.2, 9.9], [5.0, 5.1, 4.8], stats.HOLDS),  # the paper's direction, decided
        ([5.3, 4.1, 6.0], [5.0, 5.5, 4.2], stats.AGREES),  # the paper's direction, p >= 0.05
        ([4.9, 4.1, 5.6], [5.0, 5.5, 4.9], stats.DISAGREES),  # the other direction, p >= 0.05
        ([5.0, 5.1, 4.8], [10.0, 10.2, 9.9], stats.CONTRADICTED),  # the other direction, decided
        ([10.0], [5.0, 5.1], stats.UNTESTED),  # one seed in a cell: no spread to test against
        ([10.0, 11.0], [5.0], stats.UNTESTED),
    ],
)
def test_each_state_from_constructed_cells(a, b, want):
    ref = scipy_stats.ttest_ind(a, b, equal_var=False) if min(len(a), len(b)) > 1 else None
    if ref is not None:  # the constructed cells sit where they are meant to, by scipy
        assert (ref.pvalue < 0.05) == (want in (stats.HOLDS, stats.CONTRADICTED))
        assert (ref.statistic > 0) == (want in (stats.HOLDS, stats.AGREES))
    assert _state(a, b) == want


def test_the_degrees_of_freedom_are_welch_satterthwaites_and_printed():
    a, b = [10.0, 10.2, 9.9, 10.4], [5.0, 5.1]
    g = stats.compare(a, b)
    va, vb = np.var(a, ddof=1) / len(a), np.var(b, ddof=1) / len(b)
    want = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    assert g.df == pytest.approx(want, rel=1e-12)
    assert g.df == pytest.approx(scipy_stats.ttest_ind(a, b, equal_var=False).df, rel=1e-12)
    assert f"(Welch, df {want:.1f})" in g.test()


def test_a_tie_is_the_papers_direction_only_where_the_claim_is_not_strict():
    tie = stats.compare([5.0, 5.0], [5.0, 5.0])  # identical seeds: p = 1
    assert tie.p == 1.0
    assert stats.state(tie) == stats.DISAGREES and stats.state(tie, strict=False) == stats.AGREES


def test_cells_chosen_on_the_seeds_they_are_tested_on_are_never_decided():
    decided_for, decided_against = (
        stats.compare([10.0, 10.1], [5.0, 5.1]),
        stats.compare([5.0, 5.1], [10.0, 10.1]),
    )
    assert decided_for.decided and decided_against.decided
    assert stats.state(decided_for, independent=False) == stats.AGREES
    assert stats.state(decided_against, independent=False) == stats.DISAGREES
    assert stats.state(stats.compare([1.0], [0.0, 0.1]), independent=False) == stats.UNTESTED


def test_a_claim_of_several_comparisons_holds_only_when_each_does():
    H, A, D, C, U = stats.HOLDS, stats.AGREES, stats.DISAGREES, stats.CONTRADICTED, stats.UNTESTED
    assert stats.combine([H, H]) == H
    assert stats.combine([H, A]) == A
    assert stats.combine([H, D]) == D and stats.combine([A, D]) == D
    assert stats.combine([H, U]) == U and stats.combine([D, U]) == U
    assert stats.combine([H, C, U]) == C  # one decided counter-example decides the whole
    with pytest.raises(ValueError, match="the states of comparisons"):
        stats.combine([H, stats.MATCHES])
    with pytest.raises(ValueError, match="at least one"):
        stats.combine([])


def test_a_cell_against_a_number_is_the_one_sample_t_test():
    vals = [1.02, 0.98, 1.05, 1.01]
    g = stats.against(np.mean(vals), np.std(vals, ddof=1), len(vals), 0.9)
    ref = scipy_stats.ttest_1samp(vals, 0.9)
    assert g.t == pytest.approx(ref.statistic, rel=1e-10) and g.p == pytest.approx(ref.pvalue, rel=1e-8)
    assert g.df == len(vals) - 1 and "over 4 seeds against 0.9" in g.test()
    near = stats.against(1.0, 0.5, 3, 0.9)  # undecided: the seeds that would decide it, by brute force
    n = next(k for k in range(4, 10_000) if scipy_stats.t.sf(0.1 / (0.5 / math.sqrt(k)), k - 1) * 2 < 0.05)
    assert not near.decided and near.seeds == n
    assert stats.against(1.0, None, 1, 0.9).p is None  # one seed: untested
    flipped = stats.flipped(g)
    assert flipped.diff == -g.diff and flipped.t == -g.t and flipped.p == g.p


def test_an_exact_claim_matches_or_differs_and_states_its_tolerance():
    from dp_adam_bench.report.common import Claim

    why = "deterministic accountant; tolerance 0.05, the paper's last digit"
    ok = Claim.exact("eps is 2.68", abs(2.678 - 2.68) <= 0.05, "ours 2.678", why)
    off = Claim.exact("eps is 1.73", abs(1.538 - 1.73) <= 0.05, "ours 1.538", why)
    assert ok.state == stats.MATCHES and off.state == stats.DIFFERS
    assert ok.line() == f"- eps is 2.68: **matches** (ours 2.678; exact: {why})"
    assert ok.decided and off.decided and not ok.from_runs
    with pytest.raises(ValueError, match="states why it is exact"):
        Claim.exact("eps", True, "ours", "")
    with pytest.raises(ValueError, match="a comparison's state is one of"):
        Claim.compared("a > b", stats.MATCHES)
    with pytest.raises(ValueError, match="claim state True is not one of"):
        Claim("a > b", True)  # the old rule's bool verdict is refused, not silently read
