"""Amplified BandMF and the conservative bounds, each checked against an independent computation: first-principles
numerical integration of the mechanism's output densities, dp-accounting's PLD and RDP called directly (not
through our accountants), dense-matrix RMSEs and pattern enumeration."""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from scipy import stats
from scipy.stats import norm

from dp_adam_bench.privacy.accounting.amplified_mf import (
    amplified_bandmf_epsilon,
    amplified_steps_to_epsilon,
    amplifies,
    calibrate_amplified_sigma,
    calibrate_gaussian_sigma,
    check_amplifiable,
    conservative_epsilon,
    equivalent_dpsgd_sigma,
    rounds,
    separated_sensitivity,
    strategy_bands,
)
from dp_adam_bench.privacy.bandmf import BandedToeplitzStrategy
from dp_adam_bench.privacy.blt import optimize_blt
from dp_adam_bench.privacy.sensitivity import brute_force_sensitivity
from dp_adam_bench.privacy.strategies import DenseStrategy, IdentityStrategy, sqrt_prefix_strategy

ADD_REMOVE = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE


def direct_pld_epsilon(sigma: float, q: float, count: int, delta: float) -> float:
    """dp-accounting's PLD of ``count`` Poisson-subsampled Gaussian steps, called directly."""
    one = pld_lib.from_gaussian_mechanism(
        standard_deviation=sigma,
        sensitivity=1.0,
        sampling_prob=q,
        value_discretization_interval=1e-4,
        neighboring_relation=ADD_REMOVE,
    )
    return float(one.self_compose(count).get_epsilon_for_delta(delta))


def direct_rdp_epsilon(sigma: float, q: float, count: int, delta: float) -> float:
    """dp-accounting's RDP accountant (not Opacus') on the same event."""
    acc = dp_accounting.rdp.RdpAccountant()
    event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))
    acc.compose(dp_accounting.SelfComposedDpEvent(event, count))
    return float(acc.get_epsilon(delta))


def brute_force_delta(c: np.ndarray, group: list[int], q: float, sigma: float, eps: float) -> float:
    """delta(eps) of the released C x + sigma z for one example of ``group`` (Poisson-sampled with rate q at
    each of its steps, clipped contribution 1), add-or-remove, by numerical integration.

    The output's law depends on the example only through its projections on the columns C e_t, t in group;
    those columns must be orthonormal here (checked), so the projections are independent N(s_t, sigma^2) with
    s_t ~ Bernoulli(q): integrate the exact mixture density against N(0, sigma^2 I) on a grid.
    """
    cols = c[:, group]
    gram = cols.T @ cols
    assert np.allclose(gram, np.eye(len(group)), atol=1e-12), gram
    grid = np.linspace(-9 * sigma, 1 + 9 * sigma, 2001)
    h = grid[1] - grid[0]
    q0 = norm.pdf(grid, 0, sigma)
    p0 = (1 - q) * q0 + q * norm.pdf(grid, 1, sigma)
    p, qq = p0, q0
    for _ in group[1:]:
        p, qq = np.multiply.outer(p, p0), np.multiply.outer(qq, q0)
    cell = h ** len(group)
    remove = float(np.sum(np.maximum(p - math.exp(eps) * qq, 0)) * cell)
    add = float(np.sum(np.maximum(qq - math.exp(eps) * p, 0)) * cell)
    return max(remove, add)


def test_amplified_bandmf_is_the_poisson_subsampled_gaussian_by_brute_force():
    # n = 6 steps, 2-banded C, cycle b = 3: the example of group 0 can join at steps 0 and 3 (2 rounds)
    strat = BandedToeplitzStrategy.from_coefficients(np.array([0.8, 0.6]), 6)
    c = strat.matrix()
    sigma, q, delta = 0.9, 0.3, 1e-3
    assert amplifies(strat, 3) and rounds(6, 3) == 2
    ours = amplified_bandmf_epsilon(sigma, q, 6, 3, delta, "pld")
    # delta at our epsilon by first principles: at most the target (ours is a pessimistic upper bound) ...
    assert brute_force_delta(c, [0, 3], q, sigma, ours) <= delta * 1.001
    # ... and tight: 1 % less epsilon already exceeds it
    assert brute_force_delta(c, [0, 3], q, sigma, 0.99 * ours) > delta
    # the other groups have fewer opportunities (group 1: steps 1, 4; group 2: 2, 5) - not more private
    # than group 0 but no less: same count here; 7 steps would give group 0 three
    assert rounds(7, 3) == 3


def test_amplified_epsilon_matches_dp_accounting_called_directly():
    for sigma, q, steps, b in [(1.0, 0.2, 40, 4), (0.7, 0.05, 300, 16), (2.0, 0.5, 9, 3)]:
        k = math.ceil(steps / b)
        assert amplified_bandmf_epsilon(sigma, q, steps, b, 1e-6, "pld") == pytest.approx(
            direct_pld_epsilon(sigma, q, k, 1e-6), rel=1e-9
        )
        # Opacus RDP (ours) against dp-accounting RDP (independent code, finer orders): both upper bounds
        ours_rdp = amplified_bandmf_epsilon(sigma, q, steps, b, 1e-6, "rdp")
        assert ours_rdp == pytest.approx(direct_rdp_epsilon(sigma, q, k, 1e-6), rel=0.03)
    # a column norm other than 1 scales the noise multiplier
    assert amplified_bandmf_epsilon(2.0, 0.2, 10, 2, 1e-5, "pld", column_norm=2.0) == pytest.approx(
        direct_pld_epsilon(1.0, 0.2, 5, 1e-5), rel=1e-9
    )


def dense_prefix_rmse(c: np.ndarray) -> float:
    """sqrt(mean_t ||(A C^{-1})_t||^2) with dense matrices and a generic inverse."""
    n = c.shape[0]
    err = np.tril(np.ones((n, n))) @ np.linalg.inv(c)
    return float(np.sqrt(np.mean(np.sum(err**2, axis=1))))


def test_amplified_bandmf_equivalent_dpsgd_sigma_at_epsilon_8():
    """The number the mf_amplified table reports, at its CPU setting: N = 768, B = 32, n = 48, b = 8."""
    n_data, batch, steps, bands, delta, target = 768, 32, 48, 8, 1e-7, 8.0
    strat = BandedToeplitzStrategy(steps, bands)
    q = bands * batch / n_data
    sigma = calibrate_amplified_sigma(target, delta, q, steps, bands, "pld")
    # independent: dp-accounting's PLD of ceil(48 / 8) = 6 rounds at q = 1/3 gives epsilon 8 at this sigma ...
    eps = direct_pld_epsilon(sigma, q, 6, delta)
    assert target - 0.02 <= eps <= target + 1e-9
    assert direct_pld_epsilon(sigma * 0.99, q, 6, delta) > target
    # ... and the RMSE ratio from dense matrices
    equiv = equivalent_dpsgd_sigma(strat, sigma)
    want = sigma * dense_prefix_rmse(strat.matrix()) / dense_prefix_rmse(np.eye(steps))
    assert equiv == pytest.approx(want, rel=1e-9)
    # the comparison the table makes: DP-SGD with Poisson sampling at q = B / N over 48 steps, same epsilon
    from dp_adam_bench.privacy.accounting import calibrate_sigma

    sigma_dpsgd = calibrate_sigma(target, delta, batch / n_data, steps, "pld")
    assert target - 0.02 <= direct_pld_epsilon(sigma_dpsgd, batch / n_data, steps, delta) <= target + 1e-9
    print(f"amplified BandMF at eps 8: sigma {sigma:.4f}, equivalent DP-SGD sigma {equiv:.4f}")
    print(f"DP-SGD (Poisson) at eps 8: sigma {sigma_dpsgd:.4f}")
    assert 0 < equiv < sigma  # the correlation lowers the error at a given sigma


def test_amplified_steps_to_epsilon_is_the_largest_within_budget():
    sigma, q, b, delta, budget = 1.1, 0.25, 4, 1e-5, 3.0
    t = amplified_steps_to_epsilon(budget, sigma, q, b, delta, "pld")
    assert t % b == 0 and t > 0
    assert amplified_bandmf_epsilon(sigma, q, t, b, delta, "pld") <= budget
    assert direct_pld_epsilon(sigma, q, t // b + 1, delta) > budget  # step t + 1 opens one more round


def test_strategy_bands_and_amplifiability():
    assert strategy_bands(IdentityStrategy(10)) == 1
    assert strategy_bands(BandedToeplitzStrategy(20, 5)) == 5
    banded = np.tril(np.ones((6, 6))) - np.tril(np.ones((6, 6)), -3)  # 3 bands
    assert strategy_bands(DenseStrategy(banded)) == 3
    assert strategy_bands(sqrt_prefix_strategy(12)) == 12
    assert strategy_bands(optimize_blt(12, 2)) == 12
    assert amplifies(BandedToeplitzStrategy(20, 5), 5) and not amplifies(BandedToeplitzStrategy(20, 5), 4)
    with pytest.raises(ValueError, match="2306.08153"):
        check_amplifiable(BandedToeplitzStrategy(20, 5), 4)


@pytest.mark.parametrize(
    "make", [lambda n: optimize_blt(n, 2), sqrt_prefix_strategy, lambda n: IdentityStrategy(n)]
)
def test_conservative_sensitivity_against_pattern_enumeration(make):
    # 12 steps, cycle 4: at most 3 participations at least 4 apart; C^T C >= 0 here, so enumeration is exact
    strat = make(12)
    assert separated_sensitivity(strat, 12, 4) == pytest.approx(
        brute_force_sensitivity(strat.matrix(), 3, 4), rel=1e-9
    )


def test_conservative_bound_is_the_gaussian_mechanism_and_calibrates_exactly():
    strat = BandedToeplitzStrategy(24, 6)
    sens = separated_sensitivity(strat, 24, 6)
    assert sens == pytest.approx(2.0, rel=1e-12)  # 4 participations, disjoint columns: sqrt(4)
    sigma = calibrate_gaussian_sigma(5.0, 1e-5, sens)
    # independent: Balle & Wang's delta(eps) of the Gaussian mechanism written out with scipy
    mu = sens / sigma
    delta = norm.cdf(-5.0 / mu + mu / 2) - math.exp(5.0) * norm.cdf(-5.0 / mu - mu / 2)
    assert delta == pytest.approx(1e-5, rel=1e-6)
    assert conservative_epsilon(sigma, strat, 24, 6, 1e-5) == pytest.approx(5.0, rel=1e-9)


# --- the mf_amplified report on fake runs ------------------------------------------------------------------
def _write_run(root, name, cfg, summary=None):
    import json

    import yaml

    folder = root / "mf_amplified_cpu" / name
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(cfg))
    (folder / "metrics.jsonl").write_text("")
    if summary is not None:
        (folder / "summary.json").write_text(json.dumps({"status": "complete", **summary}))


def test_mf_amplified_report_cells_winners_and_mechanisms(isolated_dirs, monkeypatch):
    import pandas as pd

    from dp_adam_bench.report import expected, mf_amplified
    from dp_adam_bench.report.context import ReportContext

    monkeypatch.setattr(expected, "missing_runs", lambda spec, complete: [])
    root = isolated_dirs / "runs"
    losses = {  # column -> loss; amplified BandMF best for adam, within the spread for sgd
        "dpsgd_poisson": {"adam": 7.6, "sgd": 7.70, "bc": 7.5, "stp": 7.4},
        "bandmf_cyclic": {"adam": 7.5, "sgd": 7.69, "bc": 7.45, "stp": 7.35},
        "bandmf_amplified": {"adam": 7.3, "sgd": 7.685, "bc": 7.4, "stp": 7.3},
        "blt": {"adam": 7.45, "sgd": 7.71, "bc": 7.42, "stp": 7.32},
    }
    for col, per_opt in losses.items():
        noise, sampler = mf_amplified.COLUMNS[col]
        for opt, loss in per_opt.items():
            for seed in (0, 1):
                cfg = {
                    "task": {"name": "arxiv_mlm"},
                    "optimizer": {"name": opt, "lr": 0.3 if opt == "sgd" else 1e-3},
                    "noise": {"kind": noise},
                    "privacy": {"sigma": None, "accountant": "pld", "delta": 1e-7},
                    "train": {"sampler": sampler, "batch_size": 32},
                    "seed": seed,
                }
                summary = {
                    "metrics": {"test_loss": loss + 0.02 * seed},
                    "epsilon": {"pld": 7.99, "rdp": 8.5},
                    "sigma": 0.99,
                    "steps": 48,
                }
                _write_run(root, f"{opt}-{col}-s{seed}", cfg, summary)
    _write_run(root, "adam-crashed", cfg)  # no summary: incomplete
    mf_amplified.build(ReportContext())
    df = pd.read_csv(isolated_dirs / "results" / "mf_amplified.csv")
    cell = df[(df.row == "postprocessing") & (df.column == "bandmf_amplified")].iloc[0]
    # the sample std over the seeds (ddof = 1), in a column that says so
    assert cell.test_loss == pytest.approx(7.31) and cell.n == 2
    assert cell["test_loss_sample_std"] == pytest.approx(np.std([7.3, 7.32], ddof=1))
    assert cell.epsilon == pytest.approx(7.99)
    assert len(df) == 16
    md = (isolated_dirs / "results" / "mf_amplified.md").read_text()
    assert "DP-Adam (post-processing): amplified DP-BandMF beats DP-SGD with Poisson sampling" in md
    assert "| DP-Adam (post-processing) | DP-BandMF, cyclic Poisson (amplified) |" in md
    assert "| DP-SGD (momentum) | DP-BandMF, cyclic Poisson (amplified) |" in md
    # sgd: amplified BandMF 7.695 vs cyclic BandMF 7.70, each over 2 seeds 0.02 apart: Welch's t (scipy's, the
    # oracle) does not decide the lead, and the seeds a cell that would are the first n at which it does
    lead = stats.ttest_ind([7.69, 7.71], [7.685, 7.705], equal_var=False)
    sd = np.std([7.69, 7.71], ddof=1)
    need = next(
        n
        for n in range(3, 1000)
        if stats.ttest_ind_from_stats(7.70, sd, n, 7.695, sd, n, False).pvalue < 0.05
    )
    assert (
        "| DP-SGD (momentum) | DP-BandMF, cyclic Poisson (amplified) | DP-BandMF, cyclic batches (no amplification) "
        f"| 0.0050 | 0.0141 | {lead.statistic:.4f} | {lead.df:.4f} | {lead.pvalue:.4f} | no | {need} |"
    ) in md
    assert f"its lead not decided by the seeds: t = {lead.statistic:+.2f} (Welch, df {lead.df:.1f})" in md
    amp_pp = stats.ttest_ind([7.6, 7.62], [7.3, 7.32], equal_var=False)  # t > 0: the paper's order
    assert (
        amp_pp.pvalue < 0.05
        and (
            "DP-Adam (post-processing): amplified DP-BandMF beats DP-SGD with Poisson sampling at the same epsilon: "
            f"**holds** (7.3100 vs 7.6100, margin +0.3000; t = {amp_pp.statistic:+.2f} (Welch, df {amp_pp.df:.1f}), "
            f"p = {amp_pp.pvalue:.2g} over 2 / 2 seeds; best mechanism: DP-BandMF, cyclic Poisson (amplified))"
        )
        in md
    )
    assert "Incomplete runs left out: adam-crashed" in md
    # the mechanism section: exact numbers at the cpu setting, equal to the direct computation
    mech = mf_amplified.mechanisms_at_epsilon(mf_amplified.profile_setting("cpu"))
    assert mech["bandmf_amplified"]["epsilon"] == pytest.approx(8.0, abs=0.02)
    assert mech["bandmf_cyclic"]["epsilon"] == pytest.approx(8.0, rel=1e-9)
    strat = BandedToeplitzStrategy(48, 8)
    assert mech["bandmf_amplified"]["equivalent_dpsgd_sigma"] == pytest.approx(
        mech["bandmf_amplified"]["sigma"] * dense_prefix_rmse(strat.matrix()) / dense_prefix_rmse(np.eye(48))
    )
    assert f"{mech['bandmf_amplified']['equivalent_dpsgd_sigma']:.5g}" in md
