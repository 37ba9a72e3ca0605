"""Cyclic Poisson and balls-in-bins samplers: participation pattern, inclusion probability, exact resume, and the
engine accepting them (plan, trainer, ledger, resume); the Poisson-type samplers' inclusion probability exact below
float32's resolution."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dp_adam_bench.engine.sampling import BallsInBinsSampler, CyclicPoissonSampler, PoissonSampler
from dp_adam_bench.errors import ConfigError

from helpers import ON_CPU, compose_cfg, tiny_poisson


def _participations(batches, n):
    """{example: [0-based steps it appears at]}"""
    steps = {i: [] for i in range(n)}
    for t, idx in enumerate(batches):
        assert len(set(idx.tolist())) == len(idx), "an example twice in one batch"
        for i in idx.tolist():
            steps[i].append(t)
    return steps


# --- cyclic Poisson --------------------------------------------------------------------------------------------------
def test_cyclic_poisson_groups_partition_the_examples_and_steps_stay_in_their_group():
    s = CyclicPoissonSampler(103, 5.0, steps=60, cycle_length=4, seed=3)
    members = torch.cat(s.groups).sort().values
    assert torch.equal(members, torch.arange(103))
    sizes = [len(g) for g in s.groups]
    assert max(sizes) - min(sizes) <= 1
    group_of = {int(i): g for g, grp in enumerate(s.groups) for i in grp}
    for i, ts in _participations(list(s), 103).items():
        assert all(t % 4 == group_of[i] for t in ts)  # only at its group's steps: b-min-separated
        assert all(b - a >= 4 for a, b in zip(ts, ts[1:], strict=False))


def test_cyclic_poisson_inclusion_probability_is_b_times_B_over_N():
    # q = 4 * 10 / 200 = 0.2; each example has 2000 / 4 = 500 opportunities: 100,000 Bernoulli(0.2) draws in all
    s = CyclicPoissonSampler(200, 10.0, steps=2000, cycle_length=4, seed=0)
    assert s.q == pytest.approx(0.2) and s.expected_batch_size == pytest.approx(10.0)
    counts = np.zeros(200)
    sizes = []
    for idx in s:
        counts[idx.numpy()] += 1
        sizes.append(len(idx))
    rate = counts / 500
    se = math.sqrt(0.2 * 0.8 / 500)
    assert abs(rate.mean() - 0.2) < 5 * se / math.sqrt(200)
    assert np.all(np.abs(rate - 0.2) < 6 * se)  # every example, not only on average
    # the batch size of a group of 50 is Binomial(50, 0.2): mean 10, variance 8
    assert np.mean(sizes) == pytest.approx(10.0, abs=0.3)
    assert np.var(sizes) == pytest.approx(8.0, rel=0.15)
    # independence within a step: pairs of the same group co-occur with probability q^2
    s2 = CyclicPoissonSampler(200, 10.0, steps=2000, cycle_length=4, seed=1)
    a, b = (int(x) for x in s2.groups[0][:2])
    both = sum(1 for idx in s2 if a in idx.tolist() and b in idx.tolist())
    assert both / 500 == pytest.approx(0.04, abs=5 * math.sqrt(0.04 * 0.96 / 500))


def test_cyclic_poisson_resumes_exactly_from_its_state():
    full = list(CyclicPoissonSampler(50, 4.0, steps=20, cycle_length=3, seed=7))
    s = CyclicPoissonSampler(50, 4.0, steps=20, cycle_length=3, seed=7)
    it = s.iter_from(0)
    first = [next(it) for _ in range(8)]
    state = s.state_dict()
    assert s.position == 8
    fresh = CyclicPoissonSampler(50, 4.0, steps=20, cycle_length=3, seed=7)
    fresh.load_state_dict(state)
    rest = list(fresh.iter_from(8))
    assert len(first) + len(rest) == 20
    assert all(torch.equal(x, y) for x, y in zip(first + rest, full, strict=True))
    assert fresh.position == 20


@pytest.mark.parametrize(
    "args, match",
    [
        ((10, 4.0, 5, 3), "must be in \\(0, 1\\]"),  # q = 3 * 4 / 10 > 1
        ((10, 1.0, 5, 0), "cycle length must be an integer >= 1"),
        ((10, 1.0, 5, 11), "larger than the dataset"),
        ((10, 1.0, 0, 2), "steps must be >= 1"),
    ],
)
def test_cyclic_poisson_refuses_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        CyclicPoissonSampler(*args)


# --- balls in bins ---------------------------------------------------------------------------------------------------
def test_balls_in_bins_each_example_appears_exactly_at_its_bin_every_cycle():
    s = BallsInBinsSampler(97, 6, epochs=3, seed=2)
    assert s.steps == 18 and s.min_separation == 6
    for i, ts in _participations(list(s), 97).items():
        j = int(s.bins[i])
        assert ts == [j, j + 6, j + 12]  # once per cycle, exactly 6 steps apart, at its bin only


def test_balls_in_bins_bin_is_uniform_and_independent_of_the_example():
    # over 400 seeds, example 0 lands in each of 5 bins ~80 times; within a seed, bins are ~N / 5
    hits = np.bincount([int(BallsInBinsSampler(30, 5, seed=s).bins[0]) for s in range(400)], minlength=5)
    chi2 = float(np.sum((hits - 80.0) ** 2 / 80.0))
    assert chi2 < 18.5  # chi^2 with 4 dof, p = 0.001
    s = BallsInBinsSampler(5000, 5, seed=0)
    assert s.expected_batch_size == 1000.0
    sizes = np.array([len(m) for m in s.members])
    assert sizes.sum() == 5000 and np.all(np.abs(sizes - 1000) < 5 * math.sqrt(5000 * 0.2 * 0.8))


def test_balls_in_bins_resumes_exactly():
    full = list(BallsInBinsSampler(40, 4, epochs=2, seed=5))
    s = BallsInBinsSampler(40, 4, epochs=2, seed=5)
    s.load_state_dict(s.state_dict())
    assert all(torch.equal(x, y) for x, y in zip(list(s.iter_from(3)), full[3:], strict=True))


# --- exact inclusion probability (Poisson, cyclic Poisson) ------------------------------------------------------------
def _poisson_type(kind: str, n: int, q: float, steps: int, seed: int = 0):
    """A Poisson sampler, or a cyclic Poisson one with a single group (b = 1: every example at every step), at q."""
    if kind == "poisson":
        return PoissonSampler(n, q * n, steps=steps, seed=seed)
    return CyclicPoissonSampler(n, q * n, steps=steps, cycle_length=1, seed=seed)


@pytest.mark.parametrize("kind", ["poisson", "cyclic_poisson"])
def test_inclusion_probability_is_q_below_float32_resolution(kind):
    """q = 2^-40, 1/65536 of float32's step 2^-24: 2^27 Bernoulli(q) draws hold about 1.2e-4 examples. With float32
    uniforms (multiples of 2^-24; the samplers before issue 44) every uniform that is 0 is below q, a realised rate
    of 2^-24 and about 8 draws: the exact binomial test below fails that with probability 1 - 9 e^-8 = 0.997 and an
    exact sampler with probability 7e-9. (At q = 1.5 / 2^24, where float32 is +33 %, a count test with that power
    needs about 5e9 draws, a minute; the rule itself is pinned at that q by the next test.)"""
    from scipy import stats

    n, steps, q = 2**22, 32, 2.0**-40
    drawn = sum(len(idx) for idx in _poisson_type(kind, n, q, steps))
    draws = n * steps
    # two-sided exact binomial test, false alarm 1e-6
    p = 2 * min(stats.binom.sf(drawn - 1, draws, q), stats.binom.cdf(drawn, draws, q))
    assert p > 1e-6, f"{drawn} examples drawn in {draws} Bernoulli({q:.3g}) trials (expected {draws * q:.2g})"


@pytest.mark.parametrize("q", [0.3, 1.5 * 2.0**-24])
@pytest.mark.parametrize("kind", ["poisson", "cyclic_poisson"])
def test_an_example_joins_when_a_float64_uniform_of_the_generator_is_below_q(kind, q):
    """The inclusion rule, replayed on a generator seeded as the sampler's: u < q with u float64 (53 random bits, a
    probability exact to 2^-53). Float32 uniforms fail it twice: other batches at q = 0.3 (another stream), and at
    q = 1.5 / 2^24, where both rules draw nobody here, a generator that advanced 32 bits a draw instead of 64."""
    n, steps, seed = 1000, 6, 4
    s = _poisson_type(kind, n, q, steps, seed)
    ref = torch.Generator().manual_seed(seed if kind == "poisson" else seed * 1_000_003 + 1)
    members = torch.arange(n) if kind == "poisson" else s.groups[0]
    for idx in s:
        u = torch.rand(n, generator=ref, dtype=torch.float64)
        assert torch.equal(idx, members[u < q])
    assert torch.equal(s.generator.get_state(), ref.get_state())


# --- the engine ------------------------------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def _tiny_task(monkeypatch):
    from dp_adam_bench.tasks import registry

    monkeypatch.setitem(registry.TASKS, "tiny", "tiny_task:TinyTask")


def _plan(overrides, n=64):
    from omegaconf import OmegaConf

    from dp_adam_bench.config import validate
    from dp_adam_bench.engine.plan import build_plan
    from dp_adam_bench.optim.registry import VARIANTS

    cfg = OmegaConf.create(compose_cfg(overrides))
    validate(cfg)
    opt = {k: v for k, v in cfg.optimizer.items() if k != "name"}
    return build_plan(cfg, n, VARIANTS.get(cfg.optimizer.name)(**opt), numel=10, sampler_seed=0)


CYCLIC = ["train.sampler=cyclic_poisson", "train.batch_size=4", "train.steps=24"]


def test_plan_builds_the_new_samplers():
    plan = _plan(tiny_poisson("x", 24, "noise=bandmf", "noise.bands=4", *CYCLIC))
    assert plan.sampler.kind == "cyclic_poisson" and plan.sampler.cycle_length == 4  # derived from the bands
    assert plan.accounting == "amplified_mf" and plan.sampler.q == pytest.approx(4 * 4 / 64)
    plan = _plan(tiny_poisson("x", 24, "noise=independent", *CYCLIC))
    assert plan.sampler.cycle_length == 1 and plan.accounting == "amplified_mf"
    plan = _plan(
        tiny_poisson(
            "x", 24, "noise=bandmf", "noise.bands=4", "train.sampler=balls_in_bins", "train.steps=null"
        )
    )
    assert plan.sampler.kind == "balls_in_bins" and plan.sampler.cycle_length == 64 // 16
    assert plan.accounting == "gaussian"


def test_amplified_ledger_records_one_round_per_cycle_and_resume_keeps_it():
    from dp_adam_bench.privacy.accounting import PrivacyLedger

    plan = _plan(tiny_poisson("x", 24, "noise=bandmf", "noise.bands=4", "train.cycle_length=5", *CYCLIC[:2]))
    ledger = plan.new_ledger()
    counts = []
    it = plan.sampler.iter_from(0)
    for t in range(1, 12):
        next(it)
        plan.record_step(ledger, t)
        counts.append(ledger.num_poisson_steps)
    assert counts == [math.ceil(t / 5) for t in range(1, 12)]
    # a fresh plan continuing from a checkpoint at step 11 ends where the uninterrupted one does
    saved = (plan.sampler.state_dict(), ledger.to_dict())
    for t, _ in enumerate(it, start=12):
        plan.record_step(ledger, t)
    again = _plan(tiny_poisson("x", 24, "noise=bandmf", "noise.bands=4", "train.cycle_length=5", *CYCLIC[:2]))
    again.sampler.load_state_dict(saved[0])
    resumed = PrivacyLedger.from_dict(saved[1])
    for t, _ in enumerate(again.sampler.iter_from(11), start=12):
        again.record_step(resumed, t)
    assert resumed == ledger and ledger.num_poisson_steps == math.ceil(24 / 5)
    (event,) = ledger.events
    assert event.q == pytest.approx(5 * 4 / 64) and event.sigma == pytest.approx(plan.account_sigma)


def test_bandmf_wider_than_the_cycle_is_refused_naming_the_paper():
    with pytest.raises(ConfigError, match=r"bands <= the cycle length.*cycle_length >= 8|2306.08153"):
        _plan(tiny_poisson("x", 24, "noise=bandmf", "noise.bands=8", "train.cycle_length=4", *CYCLIC[:2]))


def test_cycle_too_long_for_the_batch_is_refused():
    with pytest.raises(ConfigError, match=r"b B / N = 1.25 exceeds 1"):
        _plan(tiny_poisson("x", 24, "noise=bandmf", "noise.bands=20", *CYCLIC))


def test_blt_with_cyclic_poisson_gets_the_conservative_bound_and_says_so():
    from dp_adam_bench.privacy.accounting.amplified_mf import separated_sensitivity

    plan = _plan(tiny_poisson("x", 24, "noise=blt", "noise.buffers=2", "train.cycle_length=4", *CYCLIC[:2]))
    assert plan.accounting == "gaussian" and not plan.amplified
    assert plan.sensitivity == pytest.approx(separated_sensitivity(plan.strategy, 24, 4))
    assert any("conservative bound" in n and "2310.15526" in n for n in plan.notes)
    (event,) = plan.new_ledger().events
    assert event.mu == pytest.approx(plan.sensitivity / plan.account_sigma)


def test_blt_with_cyclic_poisson_needs_a_cycle_length():
    with pytest.raises(ConfigError, match="train.cycle_length=null .* noise=blt"):
        _plan(tiny_poisson("x", 24, "noise=blt", *CYCLIC))


def test_cycle_length_with_another_sampler_is_refused():
    from dp_adam_bench.config import validate

    with pytest.raises(
        ConfigError, match="train.cycle_length=4 is only used by train.sampler=cyclic_poisson"
    ):
        validate(compose_cfg(tiny_poisson("x", 24, "train.cycle_length=4")))


def test_ime_with_variable_batches_is_refused():
    with pytest.raises(ConfigError, match="cyclic Poisson batches are unbounded"):
        _plan(tiny_poisson("x", 24, "optimizer=ime", "noise=independent", *CYCLIC))


def test_poisson_with_the_default_correlated_noise_offers_both_fixes():
    # was: "use train.sampler=single_pass ..." with no word that dpmf_sqrt came from the root default
    from dp_adam_bench.config import validate

    overrides = [o for o in tiny_poisson("x", 24) if not o.startswith("noise=")]
    with pytest.raises(ConfigError) as err:
        validate(compose_cfg(overrides))
    text = str(err.value)
    assert "root config's default" in text
    assert "noise=independent" in text and "train.sampler=cyclic_poisson" in text


def test_trainer_runs_and_resumes_amplified_bandmf_bit_identically(isolated_dirs):
    from dp_adam_bench.train import train

    base = tiny_poisson(
        "cyc",
        12,
        "noise=bandmf",
        "noise.bands=3",
        "train.sampler=cyclic_poisson",
        "train.checkpoint_every=4",
        ON_CPU,
    )  # bit-identical resume is a CPU promise
    full = train(compose_cfg([*base, "experiment_name=cyc_full"]))
    assert full["sampler"] == "cyclic_poisson" and full["steps"] == 12
    assert full["ledger"]["events"] == [
        {"kind": "poisson_gaussian", "sigma": 1.0, "q": 3 * 16 / 64, "count": 4}
    ]
    with pytest.raises(KeyboardInterrupt):
        train(compose_cfg([*base, "experiment_name=cyc_killed", "train.stop_after=6"]))
    resumed = train(compose_cfg([*base, "experiment_name=cyc_killed"]))
    assert resumed["final_params_sha1"] == full["final_params_sha1"]
    assert resumed["ledger"] == full["ledger"] and resumed["epsilon"] == full["epsilon"]


def test_trainer_calibrates_sigma_for_amplified_bandmf_and_balls_in_bins(isolated_dirs):
    from dp_adam_bench.privacy.accounting.amplified_mf import amplified_bandmf_epsilon
    from dp_adam_bench.train import train

    s = train(
        compose_cfg(
            tiny_poisson(
                "cal",
                12,
                "noise=bandmf",
                "noise.bands=3",
                "train.sampler=cyclic_poisson",
                "privacy.sigma=null",
                "privacy.target_epsilon=4.0",
                "privacy.accountant=pld",
            )
        )
    )
    eps = amplified_bandmf_epsilon(s["sigma"], 3 * 16 / 64, 12, 3, 1e-5, "pld")
    assert 3.9 <= eps <= 4.0 and s["epsilon"]["pld"] == pytest.approx(eps)
    s = train(
        compose_cfg(
            tiny_poisson(
                "bib",
                8,
                "noise=bandmf",
                "noise.bands=3",
                "train.sampler=balls_in_bins",
                "train.steps=null",
                "train.epochs=2",
                "privacy.sigma=null",
                "privacy.target_epsilon=4.0",
            )
        )
    )
    assert s["sampler"] == "balls_in_bins" and s["steps"] == 8  # 64 // 16 = 4 bins, 2 epochs
    assert s["epsilon"]["pld"] == pytest.approx(4.0, abs=1e-6)


def test_epsilon_budget_stops_amplified_bandmf_at_a_cycle_boundary():
    from dp_adam_bench.privacy.accounting.amplified_mf import amplified_bandmf_epsilon

    plan = _plan(
        tiny_poisson(
            "x",
            40,
            "noise=bandmf",
            "noise.bands=4",
            "train.sampler=cyclic_poisson",
            "train.batch_size=4",
            "privacy.epsilon_budget=4.0",
            "privacy.accountant=pld",
        )
    )
    q = 4 * 4 / 64
    assert plan.steps < 40 and plan.steps % 4 == 0
    assert amplified_bandmf_epsilon(1.0, q, plan.steps, 4, 1e-5, "pld") <= 4.0
    assert amplified_bandmf_epsilon(1.0, q, plan.steps + 1, 4, 1e-5, "pld") > 4.0


@pytest.mark.parametrize(
    "extra",
    [
        ("train.steps=11",),
        ("train.steps=11", "noise=bandmf", "noise.bands=3", "train.sampler=cyclic_poisson"),
        ("train.steps=null", "noise=bandmf", "noise.bands=2", "train.sampler=single_pass", "train.epochs=2"),
    ],
)
def test_the_plans_final_ledger_is_the_ledger_a_run_ends_with(isolated_dirs, extra):
    """PrivacyPlan.ledger_after() (what `sweep --plan` reports) against the ledger the trainer records step by step,
    including a run that stops mid-cycle (11 steps, cycles of 3)."""
    from dp_adam_bench.engine.trainer import build
    from dp_adam_bench.train import run_config, train

    cfg = compose_cfg(tiny_poisson("ledger_after", 11, *extra))
    summary = train(cfg)
    planned = build(compose_cfg(tiny_poisson("ledger_after", 11, *extra)))
    planned.backend.close()
    assert planned.plan.ledger_after().to_dict() == summary["ledger"]
    assert run_config(cfg)["train"]["sampler"] == summary["sampler"]
