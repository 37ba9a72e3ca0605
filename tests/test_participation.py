"""The participation ledger (dp_adam_bench.engine.participation): honest runs of every sampler are consistent, the
planted bugs of issue 32 it exists for are caught in an honest configuration (planted here by monkeypatching, never
in the code), and so are bugs it was not designed for; it survives a kill and resume; what a run says about its
privacy (the shuffle caveat, delta >= 1/N, delta >= 1/2 refused)."""

from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest
import torch

from dp_adam_bench.config import validate
from dp_adam_bench.engine import trainer
from dp_adam_bench.engine.participation import (
    Z_ALARM,
    Z_POWER,
    ParticipationLedger,
    rate_test,
)
from dp_adam_bench.errors import ConfigError, PrivacyMismatch

from helpers import compose_cfg

TOY = [
    "task=logistic_1d",
    "task.n_train=200",
    "task.n_test=50",
    "task.trials=2",
    "logger.wandb.mode=disabled",
]
SINGLE_PASS = ["noise=dpmf_sqrt", "train.sampler=single_pass", "train.batch_size=20", "train.epochs=2"]
POISSON = ["noise=independent", "train.sampler=poisson", "train.batch_size=20", "train.steps=30"]
CYCLIC = [
    "noise=bandmf",
    "noise.bands=4",
    "train.sampler=cyclic_poisson",
    "train.batch_size=10",
    "train.steps=30",
]
BINS = [
    "noise=blt",
    "noise.buffers=2",
    "train.sampler=balls_in_bins",
    "train.batch_size=20",
    "train.epochs=2",
]
SHUFFLE = ["noise=independent", "train.sampler=shuffle", "train.batch_size=20", "train.epochs=2"]


def cfg_of(*overrides: str):
    cfg = compose_cfg([*TOY, "optimizer=sgd", "privacy.sigma=2.0", *overrides])
    validate(cfg)
    return cfg


def run(tmp_path, *overrides: str) -> dict:
    tmp_path.mkdir(parents=True, exist_ok=True)
    return trainer.run(cfg_of(*overrides), tmp_path, lambda step, metrics: None)


def failed(summary: dict) -> list[str]:
    return [c["check"] for c in summary["participation"]["checks"] if not c["ok"]]


@pytest.mark.parametrize(
    "schedule, participations, separation",
    [(SINGLE_PASS, 2, 10), (POISSON, None, None), (CYCLIC, None, 4), (BINS, 2, 10), (SHUFFLE, 2, None)],
    ids=["single_pass", "poisson", "cyclic_poisson", "balls_in_bins", "shuffle"],
)
def test_honest_runs_are_consistent_and_record_what_their_sampler_did(
    tmp_path, schedule, participations, separation
):
    streams = 2 if schedule in (SINGLE_PASS, SHUFFLE) else 1  # IME (two noise streams): fixed-size batches
    s = run(tmp_path, *schedule, f"optimizer={'sgd' if streams == 1 else 'ime'}")
    p = s["participation"]
    assert p["verdict"] == "consistent", p["verdict"]
    assert p["steps"] == s["steps"] and p["releases_per_stream"] == [s["steps"]] * streams
    assert p["memory_bytes"] == 12 * 200
    if (
        participations is not None
    ):  # fixed schedules: the sampler's exact pattern (steps per epoch = 200 / 20)
        assert p["max_participations"] == participations and p["never_sampled"] == 0
    if separation is not None:
        assert p["min_separation"] >= separation
    if schedule in (POISSON, CYCLIC):
        assert abs(p["rate_test"]["z"]) < Z_ALARM and "rate" in [c["check"] for c in p["checks"]]


def test_checkable_at_any_step(tmp_path):
    from dp_adam_bench.engine.session import PrivateTraining

    session = PrivateTraining(trainer.build(cfg_of(*SINGLE_PASS)))
    for _ in range(3):
        assert session.check_participation()["steps"] == session.steps_done
        session.step()
    assert session.participation_report()["max_participations"] == 1


def test_planted_single_pass_sensitivity_for_one_participation_is_caught(tmp_path, monkeypatch):
    """Issue 32 (a): a single pass of 2 epochs whose DP-MF sensitivity is computed for 1 participation."""
    from dp_adam_bench.privacy.sensitivity import strategy_sensitivity
    from dp_adam_bench.privacy.strategies import Strategy

    honest = run(tmp_path / "honest", *SINGLE_PASS)
    assert honest["participation"]["verdict"] == "consistent"
    real = Strategy.sensitivity
    monkeypatch.setattr(
        Strategy, "sensitivity", lambda self, participations=1, min_separation=None: real(self, 1)
    )
    s = run(tmp_path / "bug", *SINGLE_PASS)
    assert failed(s) == ["sensitivity"], s["participation"]["verdict"]
    assert s["participation"]["verdict"].startswith(
        "MISMATCH: sensitivity: 2 participation(s) at least 10 steps"
    )
    # the oracle: two participations 10 steps apart need more than the one-participation sensitivity (1)
    assert s["privacy_plan"]["sensitivity"] == pytest.approx(1.0)
    monkeypatch.undo()
    strategy = trainer.build(cfg_of(*SINGLE_PASS)).plan.strategy
    assert strategy_sensitivity(strategy, 2, 10) > 1.2
    assert (
        s["epsilon"]["pld"] < honest["epsilon"]["pld"]
    )  # it claims less than the honest run of the same noise


def test_planted_ledger_one_round_short_is_caught(tmp_path, monkeypatch):
    """Issue 32 (b): the privacy ledger records one Poisson round fewer than the steps taken."""
    from dp_adam_bench.engine.plan import PrivacyPlan

    real = PrivacyPlan.rounds_after
    monkeypatch.setattr(PrivacyPlan, "rounds_after", lambda self, step: max(0, real(self, step) - 1))
    s = run(tmp_path, *POISSON)
    assert failed(s) == ["rounds"]
    assert (
        "holds 29 Poisson round(s); 30 step(s) of poisson accounting make 30" in s["participation"]["verdict"]
    )


@pytest.mark.parametrize(
    "control, schedule, check",
    [
        ("double_rate", POISSON, "rate"),  # a Poisson sampler at 2q while the ledger says q
        ("cycle_ignored", CYCLIC, "separation"),  # cyclic Poisson sampling every example at every step
        ("reused_noise", POISSON, "streams"),  # one draw replayed: the stream made one release
        ("mf_one_participation", SINGLE_PASS, "sensitivity"),
        ("ledger_round_short", POISSON, "rounds"),
    ],
)
def test_controls_are_caught_by_the_ledger(tmp_path, control, schedule, check):
    """Bugs it was not designed for (double_rate, cycle_ignored, reused_noise) and the two planted kinds as the
    audit's controls, applied the way the audit applies them (whitebox.run_controlled)."""
    from dp_adam_bench.audit.controls import CONTROLS
    from dp_adam_bench.audit.whitebox import run_controlled

    c = CONTROLS.get(control)
    cfg = cfg_of(*schedule, f"optimizer={c.variant}")
    prepared = trainer.prepare(cfg, _task(cfg))
    _, s, _, _ = run_controlled(cfg, prepared, c, lambda r: _Broken(r.backend, c), np.arange(3))
    assert check in failed(s), s["participation"]["verdict"]


class _Broken:
    """The backend with the control's privatizer in place of the trainer's (as the audit's AuditBackend)."""

    def __init__(self, inner, control):
        self.inner, self.control, self.broken = inner, control, None

    def release(self, idx, privatizer, scale):
        if self.broken is None:
            self.broken = self.control.wrap(privatizer)
        return self.inner.release(idx, self.broken, scale)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_same_seed_streams_share_a_generator_state(tmp_path, monkeypatch):
    """IME's two streams from one seed (issue 32's first kind; the meter's joint check is the main catch)."""
    from dp_adam_bench.engine import session

    real = session.build_mechanisms
    monkeypatch.setattr(
        session,
        "build_mechanisms",
        lambda strategy, shapes, streams, seed, *a: [
            real(strategy, shapes, 1, seed, *a)[0] for _ in range(streams)
        ],
    )
    s = run(tmp_path, *SHUFFLE, "optimizer=ime")
    assert failed(s) == ["streams"] and "share a generator state" in s["participation"]["verdict"]


def _task(cfg):
    from dp_adam_bench.tasks.registry import build_task

    return build_task(cfg.task, trials=int(cfg.task.trials), seed=int(cfg.seed))


def test_a_kill_and_resume_keeps_the_record(tmp_path):
    full = run(tmp_path / "full", *POISSON, "train.checkpoint_every=7")["participation"]
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "killed", *POISSON, "train.checkpoint_every=7", "train.stop_after=15")
    resumed = run(tmp_path / "killed", *POISSON, "train.checkpoint_every=7")["participation"]
    assert resumed == full and resumed["unobserved_steps"] == 0


def test_a_checkpoint_without_a_record_says_what_it_did_not_see(tmp_path):
    from dp_adam_bench.engine import checkpoint as ckpt

    with pytest.raises(KeyboardInterrupt):
        run(tmp_path, *POISSON, "train.checkpoint_every=7", "train.stop_after=15")
    path = tmp_path / ckpt.FILENAME
    payload = torch.load(path, weights_only=False)
    del payload["participation"]  # as written before the participation ledger existed
    torch.save(payload, path)
    p = run(tmp_path, *POISSON, "train.checkpoint_every=7")["participation"]
    assert p["verdict"] == "consistent" and p["unobserved_steps"] == 14
    assert "steps 1-14 ran before this participation ledger existed" in p["caveats"][0]


def test_a_mismatch_fails_the_command_line_run_after_writing_the_summary(isolated_dirs, monkeypatch, capsys):
    from dp_adam_bench.engine.plan import PrivacyPlan
    from dp_adam_bench.train import train

    real = PrivacyPlan.rounds_after
    monkeypatch.setattr(PrivacyPlan, "rounds_after", lambda self, step: max(0, real(self, step) - 1))
    with pytest.raises(PrivacyMismatch, match=r"participation ledger: MISMATCH: rounds: the privacy ledger"):
        train(compose_cfg([*TOY, "optimizer=sgd", "privacy.sigma=2.0", *POISSON, "experiment_name=pl"]))
    (summary,) = (isolated_dirs / "runs" / "pl").glob("*/summary.json")
    assert json.loads(summary.read_text())["participation"]["verdict"].startswith("MISMATCH: rounds")
    # not "complete": a relaunched sweep runs it again and the reports leave it out
    assert json.loads(summary.read_text())["status"] == "privacy_mismatch"


def test_an_example_twice_in_one_batch_counts_one_participation_and_one_repeat():
    """A repeat inside a batch is its own finding (``repeats``); counted as a second participation it would have
    no separation, and the amplified-BandMF check crashed on it instead of reporting."""
    from dp_adam_bench.engine.participation import ParticipationLedger

    part = ParticipationLedger(4)
    part.observe(torch.tensor([0, 0, 1]))
    part.observe(torch.tensor([0]))
    assert part.count.tolist() == [2, 1, 0, 0] and part.repeats == 1 and int(part.min_gap[0]) == 1


def test_the_rate_test_has_its_stated_false_alarm_and_power():
    """Binomial draws of the total count (what an honest or a broken Poisson sampler makes): no alarm in 20,000
    honest runs (the false alarm is 1e-6), and an error of r_99 in q caught in 99 % of them (at least 98.3 % of
    4,000: 3 standard errors)."""
    rng = np.random.default_rng(0)
    draws, q = 200 * 30, 0.1
    honest = [rate_test(int(t), draws, q) for t in rng.binomial(draws, q, 20_000)]
    assert not any(not r["ok"] for r in honest)
    r99 = honest[0]["r99"]
    assert r99 == pytest.approx((Z_ALARM + Z_POWER) / math.sqrt(draws * q / (1 - q)), rel=0.1)  # small-r form
    caught = [not rate_test(int(t), draws, q)["ok"] for t in rng.binomial(draws, q * (1 + r99), 4000)]
    assert np.mean(caught) >= 0.983
    assert np.mean([not rate_test(int(t), draws, q)["ok"] for t in rng.binomial(draws, q * 2, 100)]) == 1


def test_the_rate_check_says_what_excess_of_q_it_can_see():
    """The rate check's detail states r_99, the relative excess of q it detects with probability 0.99 at the run's
    size, and whether that is within 1 %: the toy run's 30 steps of N = 200 at q = 0.1 (6,000 Bernoulli trials)
    pass it while blind to anything under about 29 %; the verdict does not change. The honest run's record is made
    here from its plan and sampler (no training: nothing but the sampling is under test)."""
    from types import SimpleNamespace

    from dp_adam_bench.engine.participation import rate_visibility, reconcile

    plan = trainer.build(cfg_of(*POISSON)).plan
    part = ParticipationLedger(plan.sampler.n)
    for idx in plan.sampler:
        part.observe(idx)
    part.observe_releases([SimpleNamespace(step=plan.steps)])
    p = reconcile(part, plan, plan.ledger_after(), 1, plan.steps)
    (rate,) = [c for c in p["checks"] if c["check"] == "rate"]
    r99 = p["rate_test"]["r99"]
    assert p["verdict"] == "consistent" and rate["ok"] and 0.25 < r99 < 0.35, p["verdict"]
    assert rate["detail"].endswith(
        f"cannot see a 1 % excess at this run's size: it sees r99 = {100 * r99:.3g} % (the relative excess of q "
        "detected with probability 0.99)"
    ), rate["detail"]
    # r_99 ~ 7.218 / sqrt(M q / (1 - q)) crosses 1 % at M q / (1 - q) ~ 521,000: at q = 0.1, M ~ 4.7M trials
    big, small = rate_test(500_000, 5_000_000, 0.1), rate_test(47_000, 470_000, 0.1)
    assert big["ok"] and big["r99"] <= 0.01 < small["r99"]
    assert rate_visibility(big["r99"]).endswith("with probability 0.99: can see a 1 % excess")
    assert rate_visibility(small["r99"]).startswith(
        "cannot see a 1 % excess at this run's size: it sees r99 = 3."
    )
    assert rate_visibility(math.inf).startswith("cannot see a 1 % excess at this run's size: no excess of q")


def test_cost_for_a_large_dataset():
    """N = 1.7M: 12 bytes an example (20.4 MB); a step of B = 1,024 costs well under a millisecond (the sampler's
    own torch.rand(N) of a Poisson step is several)."""
    n = 1_700_000
    ledger = ParticipationLedger(n)
    assert ledger.nbytes == 12 * n == 20_400_000
    gen = torch.Generator().manual_seed(0)
    perm = torch.randperm(n, generator=gen)
    batches = [perm[i * 1024 : (i + 1) * 1024] for i in range(20)]
    t0 = time.perf_counter()
    for b in batches * 10:
        ledger.observe(b)
    per_step = (time.perf_counter() - t0) / 200
    assert per_step < 5e-3, f"{per_step * 1e3:.2f} ms per step"
    assert ledger.max_participations == 10 and ledger.min_separation == 20


def test_shuffle_says_its_epsilon_is_not_a_guarantee(tmp_path, capsys):
    from dp_adam_bench.train import guarantee_line

    s = run(tmp_path, *SHUFFLE)
    (caveat,) = s["guarantee"]["caveats"]
    assert "train.sampler=shuffle" in caveat and "not a guarantee" in caveat
    assert "CAVEAT: train.sampler=shuffle" in guarantee_line(s["guarantee"])
    assert caveat in trainer.build(cfg_of(*SHUFFLE)).plan.warnings  # printed as a warning at the start


def test_delta_at_or_above_one_over_n_is_named_and_a_half_is_refused(tmp_path):
    s = run(tmp_path, *POISSON, "privacy.delta=0.01")  # N = 200: 1/N = 0.005
    (caveat,) = s["guarantee"]["caveats"]
    assert (
        caveat.startswith("privacy.delta = 0.01 >= 1/N = 0.005 (N = 200")
        and "2 training example(s)" in caveat
    )
    assert not run(tmp_path / "b", *POISSON, "privacy.delta=0.004")["guarantee"].get("caveats")
    for delta in ("0.5", "0.9"):
        with pytest.raises(
            ConfigError, match=rf"privacy.delta={delta} >= 0.5 means nothing.*valid: 0 < privacy"
        ):
            cfg_of(*POISSON, f"privacy.delta={delta}")


def test_the_privacy_command_refuses_a_meaningless_delta(capsys):
    from dp_adam_bench.cli import main

    assert main(["privacy", "epsilon", "--sigma", "1", "--q", "0.1", "--steps", "10", "--delta", "0.5"]) == 2
    assert "--delta=0.5 >= 0.5 means nothing" in capsys.readouterr().err
