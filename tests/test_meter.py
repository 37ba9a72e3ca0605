"""The mechanism meter (dp_adam_bench.audit.meter): honest mechanisms pass, every planted bug of the vector path
fails the check it breaks, and the stated power against a 10 % error is what simulation shows."""

from __future__ import annotations

import copy
import math
import re

import numpy as np
import pytest
import torch

from dp_adam_bench.audit import meter
from dp_adam_bench.audit.meter import (
    ALPHA,
    EFFECT,
    MeterTask,
    critical,
    joint_noise_check,
    multiplier_check,
    rate_check,
    release_checks,
    release_stats,
)
from dp_adam_bench.engine.sampling import ShuffleSampler, SinglePassSampler


def _meter(variant, noise, sampler, control=None, n=300, trials=8):
    from dp_adam_bench.audit.controls import CONTROLS
    from dp_adam_bench.audit.whitebox import compose_config
    from dp_adam_bench.report import privacy_audit

    cfg = compose_config(privacy_audit.overrides(variant, noise, sampler, n))
    c = CONTROLS.get(control) if control else None
    return meter.meter_config(cfg, n=n, trials=trials, control=c, control_name=control)


def test_meter_task_gradients_share_one_coordinate_and_own_another():
    import torch

    task = MeterTask(9, clip=2.0, trials=3, null=4)
    g = task.per_example_grads(None, torch.tensor([0, 5, 6, 7, 8]))[0]
    assert g.shape == (5, 3, 1 + 9 + 4)
    # NORMS[i % 8] C: far above, just above, just below, half of C, far above again
    norms = torch.tensor([1e6, 1.01, 0.99, 0.5, 1e6], dtype=torch.float64) * 2.0
    assert torch.allclose(g[:, :, 0], (norms * meter.SHARED)[:, None].expand(5, 3))
    assert all((g[k, :, 1 + i] > 0).all() for k, i in enumerate([0, 5, 6, 7, 8]))
    assert g[:, :, 10:].abs().sum() == 0  # null coordinates are never touched
    assert torch.allclose(g.norm(dim=-1), norms[:, None].expand(5, 3))
    masks = task.class_masks()
    assert list(masks) == list(meter.NORM_CLASSES.values())
    assert np.flatnonzero(masks["C / 2"].reshape(3, -1)[0]).tolist() == [1 + 7]  # example 7's own coordinate
    assert np.flatnonzero(masks["far above C"].reshape(3, -1)[2]).tolist() == [1, 2, 3, 4, 5, 9]


@pytest.mark.parametrize(
    "row",
    [
        ("adam", "independent", "poisson"),
        ("ime", "bandmf", "single_pass"),
        ("stp", "blt", "cyclic_poisson"),
        ("ime_free", "dpmf_sqrt", "single_pass"),
        ("side_info", "independent", "balls_in_bins"),
    ],
)
def test_honest_mechanisms_pass_every_check(row):
    r = _meter(*row)
    assert r.passed, r.describe()
    assert r.check("multiplier", "joint").estimate == pytest.approx(1.0, abs=0.06)
    assert r.check("sensitivity", "g").estimate == pytest.approx(1.0, abs=0.03)
    assert r.check("post_processing").estimate == 0.0


@pytest.mark.parametrize(
    "control, check",
    [
        ("half_noise", ("multiplier", "joint")),
        ("realized_batch", ("noise_std", "g")),
        ("bc_clean_v", ("post_processing", "")),
        ("double_rate", ("sampling", "")),
        ("reused_mf_draw", ("correlation", "g")),
        ("stp_prescale_norms", ("sensitivity", "g")),
        ("ime_free_inverted", ("multiplier", "joint")),
        ("ime_sq_understated", ("multiplier", "joint")),
        ("clean_square", ("noise_std", "g^2")),
        ("cycle_ignored", ("sampling", "")),
        ("noiseless_precond", ("post_processing", "")),
        ("same_seed_streams", ("noise_covariance", "joint")),
    ],
)
def test_planted_bugs_fail_the_check_they_break(control, check):
    from dp_adam_bench.audit.controls import CONTROLS

    c = CONTROLS.get(control)
    r = _meter(c.variant, c.noise, c.sampler, control, n=300 if control != "cycle_ignored" else 150, trials=4)
    assert not r.check(*check).passed, r.describe()


# --- the sampling check's reference: the documented structure, not the sampler under test ------------------------
class _ShiftedSinglePass(SinglePassSampler):
    """One batch ahead of its documented order: step t draws the batch of step t + 1. Every example still comes
    once per epoch, N // B steps apart, so its sensitivity and the participation ledger are as claimed; only the
    order is not the documented one (planted here, never in the code)."""

    def iter_from(self, step):
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed))
        for t in range(step, self.steps):
            i = (t + 1) % self.steps_per_epoch
            yield order[i * self.batch_size : (i + 1) * self.batch_size]


class _ReshuffledSinglePass(SinglePassSampler):
    """A fresh permutation every epoch (the shuffle sampler's batches) while it calls itself single pass: the
    min-separation that DP-MF's sensitivity assumes is gone."""

    def iter_from(self, step):
        return ShuffleSampler.iter_from(self, step)


def _structure_of(batches, n):
    out = np.zeros((len(batches), n), dtype=bool)
    for t, idx in enumerate(batches):
        out[t, idx.numpy()] = True
    return out


def test_sampling_reference_is_each_samplers_documented_structure_without_the_samplers_code():
    """The reference of every kind matches what the honest sampler draws (fixed kinds exactly; cyclic Poisson's
    draws inside their group's steps, every group the documented order[g::b]), computed with the sampler's batch
    code and derived structures taken away."""
    from dp_adam_bench.audit.meter import sampling_reference
    from dp_adam_bench.engine.sampling import BallsInBinsSampler, CyclicPoissonSampler, PoissonSampler

    samplers = [
        SinglePassSampler(103, 10, epochs=3, seed=5),  # N mod B = 3 examples never drawn
        SinglePassSampler(40, 8, epochs=2, seed=1, shuffle=False),
        BallsInBinsSampler(97, 6, epochs=3, seed=2),
        CyclicPoissonSampler(103, 5.0, steps=40, cycle_length=4, seed=3),
        PoissonSampler(50, 5.0, steps=7, seed=1),
    ]
    for s in samplers:
        drawn = _structure_of(list(s), s.n)
        blind = copy.copy(s)  # no batches, no derived structure: only the public parameters
        for name in ("groups", "members", "bins", "generator"):
            blind.__dict__.pop(name, None)
        blind.iter_from = None
        ref = sampling_reference(blind, s.steps)
        assert ref.shape == drawn.shape and not (drawn & ~ref).any(), s.kind
        if s.kind in ("single_pass", "balls_in_bins"):
            assert (drawn == ref).all(), s.kind
        if s.kind == "cyclic_poisson":
            assert all(np.flatnonzero(ref[g]).tolist() == sorted(s.groups[g].tolist()) for g in range(4))
        if s.kind == "poisson":
            assert ref.all()


def test_an_index_outside_the_samplers_population_is_drawn_outside_its_structure():
    """A batch index that is no private example (a held-out public example, or out of range) is outside every
    structure. A public one used to be counted as the last private position (index -1): one extra example in a
    Poisson batch, every example eligible, passed the rate check."""
    from types import SimpleNamespace

    from dp_adam_bench.audit.meter import _sampling_check
    from dp_adam_bench.engine.sampling import PoissonSampler

    s = PoissonSampler(60, 6.0, steps=20, seed=1)
    population = np.arange(60)  # the task has 80 examples, the last 20 public
    recs = [SimpleNamespace(idx=idx) for idx in s]
    assert _sampling_check(recs, population, s, 80, 4.0).passed
    for bad in (70, 80):
        extra = [*recs[:3], SimpleNamespace(idx=torch.cat([recs[3].idx, torch.tensor([bad])])), *recs[4:]]
        check = _sampling_check(extra, population, s, 80, 4.0)
        assert not check.passed and check.estimate == 1.0, check.describe()


@pytest.mark.parametrize("bug", [None, "shifted", "reshuffled"])
def test_a_sampler_that_leaves_its_documented_order_fails_the_sampling_check(monkeypatch, bug):
    """The meter's sampling reference used to be the sampler under test replayed (whitebox.eligible_steps), so a
    single-pass sampler out of its documented order agreed with itself; the meter now re-derives the order from
    the seed and fails it, and still passes the honest sampler."""
    from dp_adam_bench.audit.whitebox import eligible_steps
    from dp_adam_bench.engine import plan

    if bug is not None:
        broken = _ShiftedSinglePass if bug == "shifted" else _ReshuffledSinglePass
        monkeypatch.setattr(plan, "SinglePassSampler", broken)
        s = broken(300, 6, epochs=2, seed=3)
        replayed = eligible_steps(s, np.arange(300), s.steps)  # the old reference: the bug agrees with itself
        assert (replayed == _structure_of(list(s), 300)).all()
    r = _meter("adam", "independent", "single_pass", trials=2)
    sampling = r.check("sampling")
    if bug is None:
        assert sampling.passed and sampling.estimate == sampling.claimed == 600, r.describe()
        return
    assert not sampling.passed and "outside the sampler's public structure" in sampling.detail, r.describe()
    assert sampling.estimate >= (600 if bug == "shifted" else 1), sampling.detail  # shifted: every pair


def test_ime_free_inverted_is_only_an_accounting_bug():
    """The noise is what the code states; only the accountant's multiplier is wrong (by a factor 2)."""
    r = _meter("ime_free", "independent", "single_pass", "ime_free_inverted", trials=4)
    assert r.check("noise_std", "g").passed and r.check("noise_std", "g^2").passed
    assert r.check("multiplier", "joint").estimate == pytest.approx(0.5, rel=0.05)


# --- power, by simulation -----------------------------------------------------------------------------------------
def _simulated_row(rng, *, std_factor=1.0, slope=1.0, batch=24, sigma=4.0, steps=100, trials=16, null=64):
    """Releases of the meter task as the table's weakest row makes them (fixed batches of B = 24, sigma = 4,
    100 steps, 16 trials): the shared coordinate and ``null`` untouched ones per trial (the examples' own
    coordinates only add power, so they are left out); the release's mean scaled by ``slope``, its noise by
    ``std_factor``."""
    clip = 1.0
    stated = sigma * clip / batch
    x = np.zeros((steps, trials, 1 + null))
    x[:, :, 0] = meter.SHARED * clip  # B examples of weight SHARED, divided by B
    y = slope * x + std_factor * stated * rng.standard_normal(x.shape)
    return y.reshape(steps, -1), x.reshape(steps, -1), stated, clip / batch, sigma


def _detects(y, x, stated, delta, sigma, crit, crit1):
    s = release_stats(y, x, None)
    checks = release_checks("g", s, stated, crit)
    checks.append(multiplier_check([(delta, s.slope, s.slope_se, s.std, s.std_se)], sigma, crit1))
    return {c.name: not c.passed for c in checks}, {c.name: c.power for c in checks}


@pytest.mark.slow
def test_stated_power_against_a_ten_percent_error_holds_in_simulation():
    rng = np.random.default_rng(2025)
    tests = 6  # the checks of a one-release row
    crit, crit1 = critical(ALPHA, tests), critical(ALPHA, tests, two_sided=False)
    reps = 200
    planted = {
        "noise_std": [dict(std_factor=1 - EFFECT), dict(std_factor=1 + EFFECT)],
        "sensitivity": [dict(slope=1 - EFFECT), dict(slope=1 + EFFECT)],
        "multiplier": [dict(std_factor=1 - EFFECT)],  # 10 % less noise than accounted: the privacy direction
    }
    for check, cases in planted.items():
        for case in cases:
            hits, stated_power = 0, []
            for _ in range(reps):
                fail, power = _detects(*_simulated_row(rng, **case), crit, crit1)
                hits += fail[check]
                stated_power.append(power[check])
            assert min(stated_power) >= 0.99, (check, case, min(stated_power))
            assert hits / reps >= 0.99, (check, case, hits)
    # and a correct mechanism rarely fails any of them (each row's checks share the level ALPHA)
    false = 0
    for _ in range(reps):
        fail, _ = _detects(*_simulated_row(rng), crit, crit1)
        false += any(fail.values())
    assert false <= 3


def test_stated_power_of_the_rate_check_holds_in_simulation():
    """Poisson (q = 0.1) and cyclic Poisson (q = 0.5 at the steps of a group) at the table's sizes: a sampler 10 %
    off its q is caught in >= 99 % of runs, as stated."""
    rng = np.random.default_rng(7)
    crit = critical(ALPHA, 6)
    for eligible, q in ((120_000, 0.1), (4_800, 0.5)):
        for factor in (1 - EFFECT, 1 + EFFECT):
            draws = rng.binomial(eligible, factor * q, size=400)
            checks = [rate_check(int(d), eligible, q, crit) for d in draws]
            assert min(c.power for c in checks) >= 0.99
            assert np.mean([not c.passed for c in checks]) >= 0.99
        honest = [rate_check(int(d), eligible, q, crit) for d in rng.binomial(eligible, q, size=400)]
        assert sum(not c.passed for c in honest) <= 2


def test_whitening_by_the_strategy_makes_correlated_noise_white_and_a_reused_draw_is_not():
    from dp_adam_bench.privacy.strategies import SqrtPrefixStrategy

    rng = np.random.default_rng(3)
    steps, d = 60, 400
    c = SqrtPrefixStrategy(steps).matrix()
    cinv = np.linalg.inv(c)
    x = np.zeros((steps, d))
    honest = cinv @ rng.standard_normal((steps, d))
    reused = cinv @ np.repeat(rng.standard_normal((1, d)), steps, axis=0)
    crit = critical(ALPHA, 6)
    ok = {ch.name: ch.passed for ch in release_checks("g", release_stats(honest, x, c), 1.0, crit)}
    assert ok["correlation"] and ok["noise_std"]
    bad = {ch.name: ch.passed for ch in release_checks("g", release_stats(reused, x, c), 1.0, crit)}
    assert not bad["correlation"]
    # without whitening, honest correlated noise itself would look correlated
    assert not {ch.name: ch.passed for ch in release_checks("g", release_stats(honest, x, None), 1.0, crit)}[
        "correlation"
    ]


def test_multiplier_combines_releases_like_the_accountant():
    """Two releases each at noise multiplier sigma compose to sigma / sqrt 2 (IME for free's sigma factor)."""
    sigma = 3.0
    parts = [(1.0, 1.0, 1e-6, sigma, 1e-6), (5.0, 1.0, 1e-6, 5.0 * sigma, 1e-6)]
    c = multiplier_check(parts, sigma / math.sqrt(2), critical(ALPHA, 6, two_sided=False))
    assert c.estimate == pytest.approx(1.0) and c.passed
    c = multiplier_check(parts, sigma * math.sqrt(2), critical(ALPHA, 6, two_sided=False))
    assert c.estimate == pytest.approx(0.5) and not c.passed


# --- the joint-noise check: every release at every step together ------------------------------------------------
def _corr_at_power(check) -> float:
    return float(re.search(r"a correlation >= ([0-9.]+)", check.detail).group(1))


@pytest.mark.slow
def test_joint_noise_check_false_alarm_rate_and_stated_power_hold_in_simulation():
    """White rows (two releases of different stds) fail at most at the check's level (Bonferroni over the pairs
    and the steps: a little below it); one pair of rows correlated at the stated size is caught >= 99 % of the
    time."""
    rng = np.random.default_rng(11)
    steps, d, reps = 20, 400, 300

    def rows(stds=(1.0, 3.0)):
        return [(n, s * rng.standard_normal((steps, d))) for n, s in zip(("g", "g^2"), stds, strict=True)]

    false = sum(not joint_noise_check(rows(), 0.2).passed for _ in range(reps))
    assert 0.08 * reps <= false <= 0.22 * reps, false  # 1 - exp(-0.2) = 0.18 if the tests were independent
    level = ALPHA / 10
    rho = _corr_at_power(joint_noise_check(rows(), level))
    hits = 0
    for _ in range(200):
        (g_name, g), (s_name, sq) = rows()
        sq[7] = 3.0 * (rho * g[7] + math.sqrt(1 - rho**2) * sq[7] / 3.0)  # corr(g@8, g^2@8) = rho
        hits += not joint_noise_check([(g_name, g), (s_name, sq)], level).passed
    assert hits >= 194, hits  # 0.9925 in 400 runs


def test_joint_noise_check_sees_a_draw_reused_at_any_lag_and_a_step_without_its_noise():
    """Correlated noise (C^{-1} z, C = A^{1/2}) whitened by C passes. A draw reused 40 steps later, beyond the
    ``correlation`` check's lags, fails the joint check only, naming the two steps; so does a step with no noise
    or 1.5 times its noise (each step's share of the noise energy)."""
    from dp_adam_bench.privacy.strategies import SqrtPrefixStrategy

    rng = np.random.default_rng(5)
    steps, d = 60, 400
    c = SqrtPrefixStrategy(steps).matrix()
    cinv, zero = np.linalg.inv(c), np.zeros((steps, d))
    level, crit = ALPHA / 7, critical(ALPHA, 7)
    z = rng.standard_normal((steps, d))
    assert joint_noise_check([("g", release_stats(cinv @ z, zero, c).resid)], level).passed
    late = z.copy()
    late[45] = late[5]
    s = release_stats(cinv @ late, zero, c)
    assert {ch.name: ch.passed for ch in release_checks("g", s, 1.0, crit)}[
        "correlation"
    ]  # lags 1..10 miss it
    bad = joint_noise_check([("g", s.resid)], level)
    assert not bad.passed and bad.estimate == pytest.approx(1.0) and "g@6 ~ g@46" in bad.short, bad.describe()
    for factor in (0.0, 1.5):
        odd = z.copy()
        odd[30] *= factor
        bad = joint_noise_check([("g", release_stats(cinv @ odd, zero, c).resid)], level)
        assert not bad.passed and "noise energy of g@31" in bad.short, bad.describe()
    # a release without any noise has no covariance to test: left out, named, and the other release still tested
    only = joint_noise_check([("g", z), ("g^2", zero)], level)
    assert only.passed and "left out, noise-free: g^2" in only.detail


def test_ime_streams_from_one_seed_fail_only_the_joint_check(monkeypatch):
    """Issue 32's planted bug, in the honest configuration (planted here, never in the code): IME's g and g^2
    noise built with the same seed. Each release alone has exactly the noise it states, so every per-release
    check passes; the two releases of each step carry the same draw (correlation 1)."""
    from dp_adam_bench.privacy import noise_factory

    honest = noise_factory.noise_seed
    monkeypatch.setattr(noise_factory, "noise_seed", lambda seed, stream: honest(seed, 0))
    r = _meter("ime", "independent", "single_pass", trials=4)
    assert [(c.name, c.release) for c in r.failed] == [("noise_covariance", "joint")], r.describe()
    joint = r.check("noise_covariance", "joint")
    assert joint.estimate == pytest.approx(1.0) and re.search(r"g@(\d+) ~ g\^2@\1\)", joint.short), (
        joint.short
    )
    assert r.joint.startswith("FAIL: g+g^2, 200 rows")


def _reseeded_at(step: int):
    """An independent mechanism whose generator goes back to its first state at ``step`` (a resume that re-seeds
    the noise instead of restoring it): the draws of steps ``step``.. repeat those of 0.."""
    from dp_adam_bench.privacy.mechanisms import IndependentMechanism

    honest = IndependentMechanism.next

    def next_(self):
        if self.step == 0:
            self._first = self._gen.get_state()
        if self.step == step:
            self._gen.set_state(self._first)
        return honest(self)

    return next_


def _reused_once(step: int):
    """An independent mechanism that returns the previous step's draw again at ``step`` (0-based)."""
    from dp_adam_bench.privacy.mechanisms import IndependentMechanism

    honest = IndependentMechanism.next

    def next_(self):
        if self.step == step:
            self.step += 1
            return [z.clone() for z in self._last]
        self._last = honest(self)
        return self._last

    return next_


@pytest.mark.parametrize("bug", ["reseeded_at_50", "reused_once"])
def test_noise_reused_across_steps_beyond_the_lag_test_fails_the_joint_check(monkeypatch, bug):
    """Bugs the joint check was not built around: one stream's draws repeated 50 steps later, or one draw used on
    two consecutive steps once; the lag-1..10 ``correlation`` check misses both, the joint check does not."""
    from dp_adam_bench.privacy.mechanisms import IndependentMechanism

    monkeypatch.setattr(
        IndependentMechanism, "next", _reseeded_at(50) if bug == "reseeded_at_50" else _reused_once(30)
    )
    r = _meter("adam", "independent", "poisson", trials=4)
    assert [(c.name, c.release) for c in r.failed] == [("noise_covariance", "joint")], r.describe()
    first, second = map(
        int, re.search(r"g@(\d+) ~ g@(\d+)", r.check("noise_covariance", "joint").short).groups()
    )
    assert (second - first, first) == ((50, first) if bug == "reseeded_at_50" else (1, 30))


def test_a_clip_factor_wrong_below_c_is_caught_with_canaries_below_c(monkeypatch):
    """min(1, C / n) written as C / n (every gradient scaled to exactly C), a bug the canaries far above C cannot
    see: the meter's sensitivity fails, and its slope by norm class doubles for the canaries at C / 2; with only
    canaries far above C (the meter before issue 32) the same run passes."""
    from dp_adam_bench.engine import privatizer

    monkeypatch.setattr(privatizer, "clip_factors", lambda norms, clip: clip / norms)
    r = _meter("adam", "independent", "poisson", trials=4)
    sens = r.check("sensitivity", "g")
    assert not sens.passed and sens.estimate > 1.05, r.describe()
    assert float(re.search(r"C / 2 ([0-9.]+)", sens.detail).group(1)) > 1.5, sens.detail
    from dp_adam_bench.audit.meter import task as meter_task

    monkeypatch.setattr(meter_task, "NORMS", (meter.NORMS[0],))  # where the task reads it
    assert _meter("adam", "independent", "poisson", trials=4).passed


def test_audit_command_meters_the_mechanism_too(capsys):
    from dp_adam_bench.cli import main

    args = ["audit", "optimizer=sgd", "noise=independent", "train.sampler=poisson", "train.batch_size=12"]
    args += ["train.steps=20", "privacy.sigma=3", "--canaries", "50", "--background", "10", "--meter"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "meter: sgd x independent x poisson" in out and "-> pass" in out
    # a control is caught when the audit or the meter catches it (exit 0); here the meter does
    assert main([*args, "--control", "half_noise"]) == 0
    out = capsys.readouterr().out
    assert "caught by meter: multiplier" in out and "FAIL: multiplier [joint]" in out


# --- the real path: a model task through the clipping engines -----------------------------------------------------
def _meter_model(engine, variant, noise, sampler, control=None, n=240):
    from dp_adam_bench.audit.controls import CONTROLS
    from dp_adam_bench.audit.whitebox import compose_config
    from dp_adam_bench.report import privacy_audit

    cfg = compose_config(privacy_audit.overrides(variant, noise, sampler, n))
    c = CONTROLS.get(control) if control else None
    return meter.meter_model(cfg, engine, n=n, control=c, control_name=control)


def test_model_task_gradients_are_the_engines_per_example_gradients():
    import torch

    from dp_adam_bench.audit.meter import ModelMeterTask
    from dp_adam_bench.engine.engines import build_engine

    task = ModelMeterTask(6, clip=1.0)
    model = task.build_model()
    idx = torch.tensor([0, 3, 5])
    engine = build_engine("loop", model, task.loss_per_example)
    got = engine.per_example_grads(task.get_batch(idx))
    for g, want in zip(got, task.closed_form_grads(idx), strict=True):
        torch.testing.assert_close(g.double(), want, rtol=1e-6, atol=1e-3)
    norms = torch.cat([w.flatten(1) for w in task.closed_form_grads(idx)], 1).norm(dim=1)
    torch.testing.assert_close(norms, torch.full((3,), meter.MODEL_NORM, dtype=torch.float64))


@pytest.mark.parametrize(
    "engine, row",
    [
        ("bk", ("adam", "independent", "poisson")),
        ("ghost", ("sgd", "bandmf", "single_pass")),
        ("hooks", ("stp", "independent", "poisson")),
        ("functorch", ("stp", "blt", "cyclic_poisson")),
        ("hooks", ("ime", "bandmf", "single_pass")),
    ],
)
@pytest.mark.slow
def test_model_path_meter_passes_through_the_real_engines(engine, row):
    r = _meter_model(engine, *row)
    assert r.passed, r.describe()
    assert r.engine == engine and r.check("post_processing").estimate == 0.0
    releases = ["g", "g^2"] if row[0] == "ime" else ["g"]
    assert [c.release for c in r.checks if c.name == "noise_std"] == releases
    assert r.joint.startswith(f"pass: {'+'.join(releases)}, ")


def test_model_path_meter_sees_shared_ime_streams_and_a_clip_factor_wrong_below_c(monkeypatch):
    """Through a real clipping engine: IME's two streams from one seed (the control) fail the joint check, and
    the generic engines' clip factor written as C / n (every gradient scaled to exactly C; planted here by
    monkeypatching) fails the sensitivity check through the canaries below C."""
    r = _meter_model("hooks", "ime", "independent", "single_pass", "same_seed_streams")
    assert [(c.name, c.release) for c in r.failed] == [("noise_covariance", "joint")], r.describe()
    from dp_adam_bench.engine import grads

    honest = grads.clip_factors
    monkeypatch.setattr(grads, "clip_factors", lambda n, clip: honest(n, clip) if clip is None else clip / n)
    r = _meter_model("hooks", "adam", "independent", "poisson")
    assert not r.check("sensitivity", "g").passed and r.check("sensitivity", "g").estimate > 1.05, (
        r.describe()
    )


def test_bias_gradients_escaping_clipping_fail_the_model_path_meter():
    r = _meter_model("bk", "adam", "independent", "poisson", "bias_unclipped")
    assert not r.check("noise_std", "g").passed, r.describe()
    assert "bias" in r.check("noise_std", "g").detail


@pytest.mark.slow
def test_white_box_audit_through_a_model_task_and_a_real_engine():
    from dp_adam_bench.audit.whitebox import compose_config
    from dp_adam_bench.report import privacy_audit

    honest = meter.audit_model(
        compose_config(privacy_audit.overrides("adam", "independent", "poisson", 200)), "hooks", canaries=200
    )
    assert honest.verdict == "consistent", honest.describe()
    assert (
        honest.auditor == "white-box (model task, hooks)" and len(honest.tests) == 18 and honest.meter.passed
    )
    from dp_adam_bench.audit.controls import CONTROLS

    c = CONTROLS.get("reused_mf_draw")
    cfg = compose_config(privacy_audit.overrides(c.variant, c.noise, c.sampler, 200))
    bad = meter.audit_model(
        cfg, "functorch", canaries=200, control=c, control_name="reused_mf_draw", meter=False
    )
    assert bad.audit_epsilon_lower > bad.claimed_epsilon and "audit (GDP)" in bad.caught_by, bad.describe()


def test_joint_noise_check_fails_non_finite_noise_naming_its_release():
    rng = np.random.default_rng(3)
    g = rng.standard_normal((5, 50))
    g[3, 7] = np.nan
    check = joint_noise_check([("g", g), ("g^2", rng.standard_normal((5, 50)))], 1e-3)
    assert not check.passed and check.short == "non-finite noise in g"
