"""One-run privacy auditing (Steinke, Nasr & Jagielski 2023, arXiv 2305.08846): the bound against exact and
independent computations, and small white-box audits through the real trainer (honest run consistent, every
control caught)."""

import itertools
import math

import numpy as np
import pytest

from dp_adam_bench.audit import bound
from dp_adam_bench.audit.bound import Guesses, count_correct, epsilon_lower_bound, max_epsilon, p_value

scipy_stats = pytest.importorskip("scipy.stats")


@pytest.mark.parametrize("r,p", [(1, 0.5), (10, 0.73), (200, 0.9), (1000, 0.997), (7, 0.0), (7, 1.0)])
def test_binomial_pmf_matches_scipy(r, p):
    np.testing.assert_allclose(
        bound.binomial_pmf(r, p), scipy_stats.binom.pmf(np.arange(r + 1), r, p), atol=1e-15
    )


def test_tail_matches_brute_force_enumeration():
    """P[W' >= v] by enumerating all 2^r outcomes of r independent guesses."""
    r, eps = 8, 0.7
    q = math.exp(eps) / (1 + math.exp(eps))
    for v in range(r + 1):
        brute = sum(
            math.prod(q if b else 1 - q for b in bits)
            for bits in itertools.product((0, 1), repeat=r)
            if sum(bits) >= v
        )
        assert p_value(r, r, v, eps, 0.0) == pytest.approx(brute, rel=1e-12)


def _scipy_p_value(m, r, v, eps, delta):
    """Theorem 3.1 written independently with scipy: beta + 2 m delta max_i (F(v - 1) - F(v - i - 1)) / i."""
    q = 1 / (1 + math.exp(-eps))
    beta = scipy_stats.binom.sf(v - 1, r, q)
    cdf = scipy_stats.binom.cdf
    alpha = max((cdf(v - 1, r, q) - cdf(v - i - 1, r, q)) / i for i in range(1, v + 1)) if v else 0
    return min(beta + 2 * m * delta * alpha, 1.0)


@pytest.mark.parametrize(
    "m,r,v,eps,delta",
    [
        (1000, 100, 90, 1.5, 1e-5),
        (1000, 900, 700, 1.0, 1e-5),
        (100, 20, 20, 2.0, 1e-3),
        (50, 10, 3, 0.2, 1e-2),
    ],
)
def test_p_value_matches_an_independent_scipy_version(m, r, v, eps, delta):
    assert p_value(m, r, v, eps, delta) == pytest.approx(
        _scipy_p_value(m, r, v, eps, delta), rel=1e-9, abs=1e-15
    )


@pytest.mark.parametrize("r", [5, 20, 100, 1000])
def test_all_correct_without_delta_has_a_closed_form(r):
    """v = r, delta = 0: P[W' = r] = q^r = beta, so eps = log(q / (1 - q)) with q = beta^(1/r)."""
    q = 0.05 ** (1 / r)
    assert max_epsilon(r, r, 0.0, 0.05) == pytest.approx(math.log(q / (1 - q)), rel=1e-9)


def test_coin_flips_show_nothing_and_more_correct_shows_more():
    assert epsilon_lower_bound(1000, 1000, 500, 1e-5) == 0.0
    assert epsilon_lower_bound(1000, 1000, 520, 1e-5) == 0.0  # within chance at 95 %
    bounds = [epsilon_lower_bound(1000, 200, v, 1e-5) for v in (120, 150, 180, 200)]
    assert bounds[0] > 0 and all(a < b for a, b in itertools.pairwise(bounds))
    # delta only weakens the bound
    assert epsilon_lower_bound(1000, 200, 180, 1e-3) < epsilon_lower_bound(1000, 200, 180, 0.0)


def test_randomized_response_is_bounded_by_its_epsilon_and_close_to_it():
    """Guesses that are right independently with probability e^eps0 / (1 + e^eps0) come from an eps0-DP
    mechanism (randomized response): the bound must stay below eps0 (in >= 95 % of seeds) and come near it."""
    eps0, m = 1.0, 1000
    rng = np.random.default_rng(0)
    got = []
    for _ in range(40):
        v = int((rng.random(m) < bound.accuracy_of(eps0)).sum())
        got.append(epsilon_lower_bound(m, m, v, 0.0))
    assert sum(g > eps0 for g in got) <= 2
    assert np.median(got) > 0.6 * eps0


def test_guesses_rank_scores_and_break_ties_by_the_key():
    s = np.array([0.0, 5.0, 0.0, -1.0, 3.0, 0.0])
    t = Guesses(2, 2).guess(s, tiebreak=np.array([5, 0, 4, 0, 0, 3]))
    assert t.tolist() == [0, 1, 0, -1, 1, -1]  # lowest: -1.0, then the 0.0 with the smallest key (index 5)
    assert count_correct(t, np.array([0, 1, 0, 0, 1, 1], dtype=bool)) == (4, 3)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: p_value(10, 5, 6, 1.0, 0.0), r"0 <= v \(correct\) <= r \(guesses\) <= m"),
        (lambda: p_value(10, 5, 3, float("nan"), 0.0), "epsilon must be a finite number"),
        (lambda: p_value(10, 5, 3, 1.0, 2.0), r"delta must be in \[0, 1\]"),
        (lambda: epsilon_lower_bound(10, 5, 3, 0.0, 0.0), r"significance must be in \(0, 1\)"),
        (lambda: Guesses(6, 5).guess(np.zeros(10)), "k\\+ \\+ k- <= m = 10"),
        (lambda: Guesses(1, 1).guess(np.array([0.0, np.nan])), "must be finite"),
    ],
)
def test_bad_inputs_name_the_value(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# --- white-box audits through the real trainer ------------------------------------------------------------------


def _audit(variant, noise, sampler, control=None, m=200):
    from dp_adam_bench.audit.controls import CONTROLS
    from dp_adam_bench.audit.whitebox import audit_config, compose_config
    from dp_adam_bench.report import privacy_audit

    cfg = compose_config(privacy_audit.overrides(variant, noise, sampler, m + m // 5))
    c = CONTROLS.get(control) if control else None
    return audit_config(cfg, canaries=m, background=m // 5, control=c, control_name=control)


def test_canaries_enter_before_clipping_and_only_when_included():
    import torch

    from dp_adam_bench.audit.whitebox import CANARY_NORM, CanaryTask

    task = CanaryTask(6, torch.tensor([1, 4]), np.array([True, False]), clip=2.0, background_dim=3)
    (g,) = task.per_example_grads(task.init_params(), torch.arange(6))
    assert g.shape == (6, 5)
    assert g[1].tolist() == [
        0,
        0,
        0,
        CANARY_NORM * 2.0,
        0,
    ]  # included: a Dirac of norm 1e6 C on its coordinate
    assert g[4].abs().sum() == 0  # excluded: a zero row
    assert (g[[0, 2, 3, 5], 3:] == 0).all()  # background gradients are zero on canary coordinates


def test_honest_audit_is_consistent():
    r = _audit("adam", "independent", "poisson")
    assert r.verdict == "consistent"
    assert 0 < r.claimed_epsilon < r.max_possible
    assert len(r.tests) == 18 and r.steps == 100  # 6 scores x 3 values of k


@pytest.mark.parametrize(
    "control",
    [
        "no_noise",
        "tenth_noise",
        "reused_noise",
        "noiseless_precond",
        "stp_noiseless_precond",
        "clean_square",
        "tenth_noise_mf",
        "noiseless_precond_mf",
        "cycle_ignored",
    ],
)
@pytest.mark.slow
def test_every_control_is_caught(control):
    from dp_adam_bench.audit.controls import CONTROLS

    c = CONTROLS.get(control)
    r = _audit(c.variant, c.noise, c.sampler, control, m=500)
    assert r.verdict == "caught", r.describe()
    if control == "no_noise":  # every guess right: the most the canaries allow
        assert r.audit_epsilon_lower == pytest.approx(r.max_possible)


def test_audit_command_prints_the_claim_and_the_bound(capsys):
    from dp_adam_bench.cli import main

    rc = main(
        [
            "audit",
            "optimizer=sgd",
            "noise=independent",
            "train.sampler=poisson",
            "train.batch_size=12",
            "train.steps=20",
            "privacy.sigma=3",
            "--canaries",
            "50",
            "--background",
            "10",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "claimed epsilon" in out and "audit lower bound" in out and "consistent" in out


def test_audit_command_refuses_a_non_private_config(capsys):
    from dp_adam_bench.cli import main

    assert main(["audit", "noise=none", "privacy.sigma=0"]) == 2
    assert "adds no noise: there is no claimed epsilon to audit" in capsys.readouterr().err


@pytest.mark.slow
def test_report_writes_its_table(tmp_path, monkeypatch):
    from dp_adam_bench.report import privacy_audit
    from dp_adam_bench.report.context import ReportContext

    monkeypatch.setattr(privacy_audit, "CANARIES", 100)
    monkeypatch.setattr(privacy_audit, "BACKGROUND", 20)
    monkeypatch.setattr(privacy_audit, "BLACKBOX", None)  # CIFAR-10 training: tested on a tiny task below
    monkeypatch.setattr(privacy_audit, "MODEL_ROWS", (("hooks", "adam", "independent", "poisson"),))
    monkeypatch.setattr(privacy_audit, "RESUMED_ROWS", (("adam", "independent", "poisson"),))
    monkeypatch.setattr(
        privacy_audit,
        "candidates",
        lambda: [
            ("sgd", "blt", "single_pass"),
            ("ime", "independent", "poisson"),
            ("sgd", "bandmf", "cyclic_poisson"),
            ("ime", "bandmf", "balls_in_bins"),
        ],
    )
    paths = privacy_audit.build(ReportContext(out=tmp_path))
    import pandas as pd

    df = pd.read_csv(paths[0])
    need = {"variant", "noise", "sampler", "sigma", "steps", "canaries", "claimed_epsilon", "accountant"}
    assert need | {"audit_epsilon_lower", "control", "verdict"} <= set(df.columns)
    both = {"gdp_mu_lower", "gdp_epsilon_lower", "claimed_mu", "meter", "meter_power", "caught_by"}
    both |= {"fdp_mu_lower", "fdp_epsilon_lower", "fdp_best_test"}
    assert both <= set(df.columns)
    white = df[df.auditor == "white-box"]  # the vector canaries
    assert (
        white.control.isna()
    ).sum() == 3  # ime x poisson and ime x balls_in_bins are refused by the engine; + the resumed row
    assert white.meter.notna().all() and white.gdp_mu_lower.notna().all() and white.fdp_mu_lower.notna().all()
    # on the same counts the f-DP bound is never below the Gaussian one (it uses the curve inside the bound)
    assert (df.fdp_mu_lower >= df.gdp_mu_lower - 1e-9).all(), df[["gdp_mu_lower", "fdp_mu_lower"]]
    # the joint-noise check's verdict on every row (the black-box rows, left out here, say they have no meter)
    joint = df.meter_joint.where(df.control != "no_noise", "")  # no noise: nothing to correlate
    assert joint.str.match(r"(pass|FAIL): g(\+g\^2)?, \d+ rows; |$").all(), df.meter_joint
    assert df[df.control == "no_noise"].meter_joint.str.startswith("n/a: no noise in g").all()
    assert df[df.control.isna()].meter_joint.str.startswith("pass").all()
    model = df[df.auditor.str.startswith("white-box (model task")]
    assert model.gdp_mu_lower.notna().all() and model.fdp_mu_lower.notna().all() and model.meter.notna().all()
    assert set(model.control.fillna("")) == {"", "bias_unclipped", "bias_norm_dropped", "wrong_when_trained"}
    caught = df[df.control.notna()]
    assert (caught.verdict == "caught").all() and caught.caught_by.notna().all(), caught[
        ["control", "caught_by"]
    ]
    # the participation ledger's verdict on every row; issue 32's two planted kinds are caught by it alone
    assert set(df[df.control.isna()].participation) == {"consistent"}
    for name, check in (("mf_one_participation", "sensitivity"), ("ledger_round_short", "rounds")):
        assert (df[df.control == name].caught_by == f"participation ledger: {check}").all(), df.caught_by
    assert set(white.sampler[white.control.isna()]) == {
        "single_pass",
        "cyclic_poisson",
        f"poisson (resumed at step {privacy_audit.RESUME_AT})",
    }
    md = paths[1].read_text()
    assert "Regenerate: `make reproduce-table TABLE=privacy_audit`" in md
    assert "ime x independent x poisson" in md


def test_black_box_input_canaries_on_a_tiny_model(monkeypatch):
    from dp_adam_bench.audit.blackbox import audit_model_task
    from dp_adam_bench.audit.whitebox import compose_config
    from dp_adam_bench.tasks import registry

    monkeypatch.setitem(registry.TASKS._entries, "tiny", "tiny_task:TinyTask")
    cfg = compose_config(
        [
            "task.name=tiny",
            "+task.n=200",
            "optimizer=adam",
            "optimizer.lr=0.01",
            "noise=independent",
            "privacy.sigma=1.0",
            "train.sampler=poisson",
            "train.batch_size=20",
            "train.steps=20",
            "train.clipping=hooks",
            "logger.wandb.mode=disabled",
            "train.log_every=1000",
        ]
    )
    base = registry.build_task(cfg.task, trials=1, seed=0)
    out = audit_model_task(cfg, base, canaries=40, num_classes=2)
    assert math.isfinite(out.claimed_epsilon) and out.claimed_epsilon > 0
    assert out.auditor.startswith("black-box") and out.verdict == "consistent"
    assert len(out.tests) == 3 and all(0 <= t.epsilon_lower <= out.max_possible for t in out.tests)


# --- the eligible-steps score (public sampler structure, matched filter) ----------------------------------------


def _sampler(kind):
    from dp_adam_bench.engine.sampling import BallsInBinsSampler, CyclicPoissonSampler, SinglePassSampler

    return {
        "cyclic_poisson": lambda: CyclicPoissonSampler(60, 3.0, steps=20, cycle_length=5, seed=3),
        "balls_in_bins": lambda: BallsInBinsSampler(60, cycle_length=6, epochs=3, seed=3),
        "single_pass": lambda: SinglePassSampler(60, 10, epochs=3, seed=3),
    }[kind]()


@pytest.mark.parametrize("kind", ["cyclic_poisson", "balls_in_bins", "single_pass"])
def test_eligible_steps_are_the_public_structure_of_the_sampler(kind):
    """Oracle: cyclic Poisson, the steps t = g mod b of the example's group; balls-in-bins, the steps of its bin;
    single pass, the batches that hold it (its slot); computed before any draw, from the seed alone."""
    from dp_adam_bench.audit.whitebox import eligible_steps

    sampler = _sampler(kind)
    positions = np.array([0, 7, 33, 59])
    got = eligible_steps(sampler, positions, sampler.steps)
    want = np.zeros_like(got)
    for j, p in enumerate(positions):
        for t in range(sampler.steps):
            if kind == "cyclic_poisson":
                want[t, j] = any(p in g.tolist() for g in [sampler.groups[t % 5]])
            elif kind == "balls_in_bins":
                want[t, j] = int(sampler.bins[p]) == t % 6
            else:
                want[t, j] = p in list(sampler.iter_from(0))[t].tolist()
    np.testing.assert_array_equal(got, want)
    if kind == "cyclic_poisson":  # every draw the run makes is within the eligible steps
        where = {int(p): j for j, p in enumerate(positions)}
        for t, batch in enumerate(sampler):
            for p in batch.tolist():
                if p in where:
                    assert got[t, where[p]]
    assert np.all(got.sum(0) >= 1)


def test_poisson_makes_every_step_eligible_and_the_score_equal_descent():
    from dp_adam_bench.audit.whitebox import eligible_steps, scores
    from dp_adam_bench.engine.sampling import PoissonSampler

    e = eligible_steps(PoissonSampler(50, 5.0, steps=7), np.arange(4), 7)
    assert e.all() and e.shape == (7, 4)
    theta = np.random.default_rng(0).normal(size=(8, 4)).cumsum(0)
    s = scores(theta, e)
    np.testing.assert_allclose(s["eligible"], s["descent"])


def test_eligible_score_is_the_matched_filter_of_the_strategy():
    """With updates d = -(x + C^{-1} z), C^T C (-d) restricted to the eligible steps equals an independent
    computation: the inner products of y = C(-d) = C x + z with the columns C e_s of the eligible steps s."""
    from dp_adam_bench.audit.whitebox import scores
    from dp_adam_bench.privacy.strategies import SqrtPrefixStrategy

    n, m = 12, 3
    c = SqrtPrefixStrategy(n).matrix()
    rng = np.random.default_rng(1)
    g = rng.normal(size=(n, m))
    theta = np.vstack([np.zeros((1, m)), -g.cumsum(0)])
    eligible = rng.random((n, m)) < 0.4
    y = c @ g
    want = np.array([sum(y[:, j] @ c[:, s] for s in range(n) if eligible[s, j]) for j in range(m)])
    np.testing.assert_allclose(scores(theta, eligible, c)["eligible"], want, rtol=1e-10)
    with pytest.raises(ValueError, match="eligible steps of shape"):
        scores(theta, eligible[:-1], c)


def test_honest_cyclic_poisson_is_consistent_and_its_eligible_score_has_power():
    """Amplified BandMF (Choquette-Choo et al. 2023, arXiv 2306.08153): the honest run is consistent, and the
    eligible-steps score sees more than the plain descent (which sums the noise of the steps a canary cannot be
    in): with the cycle ignored it is caught."""
    r = _audit("sgd", "independent", "cyclic_poisson", m=500)
    assert r.verdict == "consistent", r.describe()
    best = {t.score: max(u.epsilon_lower for u in r.tests if u.score == t.score) for t in r.tests}
    assert best["eligible"] > best["descent"], r.describe()


def test_cycle_ignored_needs_a_cyclic_sampler():
    from dp_adam_bench.audit.controls import CONTROLS
    from dp_adam_bench.engine.sampling import PoissonSampler

    with pytest.raises(ValueError, match="breaks a cyclic Poisson sampler, got 'poisson'"):
        CONTROLS.get("cycle_ignored").wrap_sampler(PoissonSampler(10, 2.0, steps=3))


def test_black_box_control_replaces_the_privatizer_once():
    from types import SimpleNamespace

    from dp_adam_bench.audit.blackbox import _break
    from dp_adam_bench.audit.controls import CONTROLS, NoNoisePrivatizer
    from dp_adam_bench.engine.privatizer import Privatizer

    honest = Privatizer(
        clip=1.0,
        sigma=0.0,  # no mechanism needed: only the privatizer's type and build arguments matter here
        expected_batch_size=4.0,
        mechanisms=[],
        releases=None,
        trial_dims=0,
        keep_clean=False,
    )
    backend = SimpleNamespace(release=lambda idx, p, scale: p)
    _break(backend, CONTROLS.get("no_noise"))
    first = backend.release(None, honest, None)
    assert isinstance(first, NoNoisePrivatizer) and first.noise_std == 0.0
    assert backend.release(None, honest, None) is first


# --- issue 44: the run's own checks catch what the start-up checks and the meter did not --------------------------
@pytest.mark.parametrize(
    "control,by",
    [
        ("ledger_sigma_doubled", "participation ledger: noise"),
        ("ledger_sigma_doubled_mf", "participation ledger: noise"),
        ("resume_redraws_noise", "resume check (restored generators)"),
    ],
)
def test_issue_44_controls_are_caught_by_the_runs_own_checks(control, by):
    """The halved column norm passes the meter (it compares with the plan's multiplier, which the slip changed
    too); the noise check measures the noise added. A resumed run whose noise generator is the fresh stream's is
    refused by the restored-generator check (and, with it bypassed, the meter sees the reused noise)."""
    from dp_adam_bench.audit.controls import CONTROLS

    c = CONTROLS.get(control)
    r = _audit(c.variant, c.noise, c.sampler, control, m=200)
    assert r.verdict == "caught" and by in r.caught_by, r.describe()


@pytest.mark.slow
def test_issue_44_engine_controls_are_caught_by_the_engine_checks():
    """bias_norm_dropped (a bias left out of bk's norms) by the start-up self-check's equalized norms;
    wrong_when_trained (norms 0.9 of the true ones once the weights moved) by the engine watch, mid-run; an honest
    micro-batched row stays consistent."""
    from dp_adam_bench.report import privacy_audit

    rows = privacy_audit.model_rows(
        rows=[("bk", "adam", "independent", "poisson", "train.physical_batch_size=16")],
        controls=["bias_norm_dropped", "wrong_when_trained"],
        n=200,
    )
    by = {r["control"] or "": r for r in rows}
    assert by[""]["verdict"] == "consistent" and "physical_batch_size=16" in by[""]["sampler"]
    assert by["bias_norm_dropped"]["caught_by"].startswith("engine self-check at the start")
    assert by["wrong_when_trained"]["caught_by"].startswith("engine watch")
