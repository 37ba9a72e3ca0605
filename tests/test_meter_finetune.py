"""The mechanism meter and the white-box audit through every fine-tuning method (issue 56): a run of the user's path
(trainer.prepare applies the method before the engine is built) on the meter's fine-tuning task; honest methods pass
every check, a slip in a method's own code (planted in audit/controls.py) fails the post-processing replay and the
canary bound, and the new exact checks catch engine bugs they were not written around."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dp_adam_bench.audit import meter
from dp_adam_bench.audit.controls import CONTROLS
from dp_adam_bench.audit.meter import FinetuneMeterTask, audit_finetune, meter_finetune
from dp_adam_bench.audit.meter.finetune_runners import canary_slices
from dp_adam_bench.audit.whitebox import compose_config
from dp_adam_bench.errors import ConfigError
from dp_adam_bench.report import privacy_audit

pytest.importorskip("peft")

#: the checks every fine-tuning row has, in order
ROW = [
    "sampling",
    "multiplier",
    "sensitivity",
    "noise_std",
    "correlation",
    "noise_covariance",
    "clipped_sum",
    "post_processing",
    "run_checks",
]


def _cfg(variant: str = "adam", n: int = 120, *extra: str):
    return compose_config([*privacy_audit.overrides(variant, "independent", "poisson", n), *extra])


def _honest(r, method):
    assert r.passed, r.describe()
    assert r.method == method and [c.name for c in r.checks] == ROW
    assert r.check("post_processing").estimate == 0.0  # every tensor replayed bit for bit
    assert r.check("clipped_sum", "g").estimate <= 1.0


# --- fast: the two methods that reparametrize, their planted slips, the audit -------------------------------------
def test_honest_rgp_passes_every_check_and_its_noise_is_checked_per_carrier():
    r = meter_finetune(_cfg(n=120), "rgp", n=120)
    _honest(r, "rgp")
    groups = r.check("noise_std", "g").detail
    assert "blocks.0.q_proj.carrier_R.weight" in groups and "blocks.1.v_proj.carrier_L.weight" in groups
    assert (
        "classifier.weight" in groups
    )  # the head trains by DP-SGD beside the carriers (RGP's authors' choice)


@pytest.mark.parametrize("control", ["rgp_clean_carriers", "lora_input_stats"])
def test_a_methods_own_slip_fails_the_replay_and_nothing_it_did_not_break(control):
    """Through meter_model (the report's path for a model-only control): the planted method is what the run
    prepares; the noise, clipping and sampling stay honest, so only the checks of what leaves the step fail."""
    c = CONTROLS.get(control)
    assert c.model_only and c.planted and c.finetune in ("rgp", "lora")
    r = meter.meter_model(_cfg(c.variant), "bk", n=120, control=c, control_name=control)
    assert r.method == c.finetune and r.control == control
    failed = {x.name for x in r.failed}
    assert "post_processing" in failed and failed <= {"post_processing", "run_checks"}, r.describe()


def _top_keeping_its_last_gradient(model, args):
    """A slip neither planted kind is: top<k> whose classifier keeps the mean output gradient of the last backward
    pass (the private batch's) as a plain tensor attribute, registered nowhere, saved with the model object."""
    from dp_adam_bench.finetune.blocks import top

    out = top(model, args)

    def keep(module, grad_input, grad_output):
        module.last_grad = grad_output[0].detach().mean(0).clone()

    out.model.classifier.register_full_backward_hook(keep)
    return out


def test_a_statistic_kept_outside_the_state_dict_fails_the_replay_too():
    from dp_adam_bench.audit.controls import Control

    c = Control(
        "adam",
        "independent",
        "poisson",
        None,
        "test",
        finetune="top1",
        method_bug=_top_keeping_its_last_gradient,
    )
    r = meter_finetune(_cfg("adam", 120, "train.steps=30"), "top1", n=120, control=c, control_name="test")
    assert not r.check("post_processing").passed and "last_grad" in r.check("post_processing").detail, (
        r.describe()
    )
    honest = meter_finetune(_cfg("adam", 120, "train.steps=30"), "top1", n=120)
    assert honest.check("post_processing").passed and honest.check("clipped_sum", "g").passed, (
        honest.describe()
    )


def test_the_audit_through_rgp_bounds_clean_carriers_above_the_claim_and_not_the_honest_method():
    cfg = _cfg(n=200)
    honest = audit_finetune(cfg, "rgp", canaries=200, meter=False)
    assert honest.verdict == "consistent", honest.describe()
    assert honest.auditor == "white-box (fine-tuning rgp, bk)"
    assert len(honest.tests) == 15 and {t.score for t in honest.tests} >= {"descent", "eligible", "state"}
    c = CONTROLS.get("rgp_clean_carriers")
    bad = audit_finetune(cfg, "rgp", canaries=200, control=c, control_name="rgp_clean_carriers", meter=False)
    assert bad.audit_epsilon_lower > bad.claimed_epsilon, bad.describe()
    assert bad.best.score == "state" and "audit (Steinke)" in bad.caught_by


def test_state_score_is_each_canarys_share_of_every_change_brute_force():
    task = FinetuneMeterTask(12, 1.0, "blocks", shared=0.0)
    size, index = task.canary_axis()
    g = torch.Generator().manual_seed(0)
    states = [
        {
            "w": torch.randn(2, size, generator=g),
            "buf": torch.randn(size, generator=g),
            "b": torch.randn(2, generator=g),  # no canary axis: ignored
        }
        for _ in range(4)
    ]
    states[2]["w"] = states[1]["w"].clone()  # no change at that step: no share
    want = np.zeros(task.n)
    for t in range(3):
        for name in ("w", "buf"):
            d = states[t + 1][name].double() - states[t][name].double()
            total = math.sqrt(float((d**2).sum()))
            if total == 0:
                continue
            for i in range(task.n):
                col = d[..., int(index[i])]
                want[i] += math.sqrt(float((col**2).sum())) / total
    np.testing.assert_allclose(canary_slices(task, states), want, rtol=1e-12)


def test_an_excluded_canary_is_absent_from_the_inputs_too():
    """Zero-out adjacency for what a method computes from its inputs, not only for the gradient: an excluded canary
    is the null example (a zero input, a zero loss), while the audit's view of it is its real input."""
    included = np.array([True, False] * 6)
    task = FinetuneMeterTask(12, 1.0, "blocks", shared=0.0, included=included)
    batch = task.get_batch(torch.arange(12))
    assert (batch["x"][~torch.as_tensor(included)] == 0).all() and (batch["keep"][1::2] == 0).all()
    assert (batch["x"][torch.as_tensor(included)].abs().sum(1) > 0).all()
    model = task.build_model()
    losses = task.canary_losses(model)
    assert len(set(np.round(losses.numpy(), 6))) == 12  # every canary's own input, in or out


def test_recorders_pass_the_post_processing_checks_replays_through_unrecorded():
    """engine/post_processing.py replays a checked step behind the real release with the privatizer pinned to it:
    the recorders keep the real release only (the vector audit saw 102 steps of 100 before)."""
    from dp_adam_bench.audit.meter.recording import ModelRecorder, pinned

    class Inner:
        params = [torch.zeros(2)]
        engine = None
        calls = 0

        def release(self, idx, privatizer, scale):
            Inner.calls += 1
            return "replayed"

    class Pinned:
        _pinned = object()

    rec = ModelRecorder(Inner())
    assert pinned(Pinned()) and not pinned(object())
    assert rec.release(torch.tensor([0]), Pinned(), None) == "replayed"
    assert Inner.calls == 1 and rec.records == [] and rec.params_before == []


@pytest.mark.parametrize(
    "method, variant, fargs, match",
    [
        ("bogus", "adam", None, r"task.finetune='bogus' is not a known fine-tuning method"),
        ("top0", "adam", None, r"top<k> needs k >= 1"),
        ("lora", "adam", {"dropout": 0.1}, r"task.finetune_args.dropout=0.1: .* use 0"),
        ("rgp", "side_info", None, r"reads public examples: the fine-tuning meter's task holds none"),
    ],
)
def test_bad_inputs_are_refused_in_one_line(method, variant, fargs, match):
    with pytest.raises(ConfigError, match=match):
        meter_finetune(_cfg(variant), method, n=120, finetune_args=fargs)


def test_a_config_without_noise_has_no_mechanism_to_meter():
    with pytest.raises(ConfigError, match="adds no noise"):
        meter_finetune(_cfg("adam", 120, "noise=none"), "full", n=120)


# --- slow: every method, both families, the audit with the meter, the CLI ------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize(
    "method, family",
    [
        ("full", "blocks"),
        ("head", "blocks"),
        ("top1", "blocks"),
        ("lora", "blocks"),
        ("prefix", "gpt2"),
        ("rgp", "gpt2"),
        ("lora", "gpt2"),
        ("top1", "gpt2"),
    ],
)
def test_every_method_passes_every_check_through_the_users_path(method, family):
    n = 240 if family == "blocks" else 120
    _honest(meter_finetune(_cfg(n=n), method, n=n, family=family), method)


@pytest.mark.slow
@pytest.mark.parametrize("control", ["rgp_clean_carriers", "lora_input_stats"])
def test_the_audit_catches_each_planted_method_and_passes_its_honest_method(control):
    c = CONTROLS.get(control)
    cfg = _cfg(c.variant, 200)
    honest = audit_finetune(cfg, c.finetune, canaries=200)
    assert honest.verdict == "consistent" and honest.meter.passed, honest.describe()
    bad = meter.audit_model(cfg, "bk", canaries=200, control=c, control_name=control)
    assert bad.verdict == "caught" and bad.audit_epsilon_lower > bad.claimed_epsilon, bad.describe()
    assert not bad.meter.check("post_processing").passed


@pytest.mark.slow
def test_an_engine_wrong_once_trained_fails_the_clipped_sum_check_it_was_not_written_for():
    c = CONTROLS.get("wrong_when_trained")
    r = meter_finetune(_cfg(n=120), "full", n=120, control=c, control_name="wrong_when_trained")
    assert not r.check("clipped_sum", "g").passed, r.describe()
    assert r.check("post_processing").passed  # what leaves the step is still the release's


@pytest.mark.slow
def test_audit_command_runs_a_fine_tuning_method_and_its_planted_control(capsys):
    from dp_adam_bench.cli import main

    args = ["audit", "optimizer=adam", "noise=independent", "train.sampler=poisson", "train.batch_size=10"]
    args += ["train.steps=40", "privacy.sigma=3", "--canaries", "100", "--finetune", "lora", "--meter"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "white-box (fine-tuning lora, bk)" in out and "-> consistent" in out and "-> pass" in out
    assert main(["audit", "--canaries", "100", "--control", "lora_input_stats"]) == 0
    assert "caught by" in capsys.readouterr().out
