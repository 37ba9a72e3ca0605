"""The cut of long functions into named steps (issue 47) changed nothing a run produces: the privacy plan of many
configs (refusals included), the calibration searches, the participation reconciliation, and small training runs
through the real path (``train``: run id, summary, metrics rows, final parameters, checkpoint tensors, a resume from
a checkpoint) equal golden values computed by the code before the cut (commit 382cf8b).

The golden values live in ``tests/data/refactor_identity.json``. To recompute them (only for a deliberate behaviour
change, never to make this test pass), run ``python tests/test_refactor_identity.py OUT.json`` with the code whose
behaviour is the reference first on ``PYTHONPATH``.

Every run is pinned to the CPU (``train.device=cpu``) so the values do not depend on a GPU. What the privacy plan
fixes (sigma, q, steps, epsilons, notes) is compared to 1e-8; what training computes (losses, parameters, measured
noise) to 1e-4 relative, numbers inside strings included, so that a CPU with other vector units, whose float sums
differ in the last bits, still passes while any change of a step, a seed or an update fails.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import re
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helpers import ON_CPU, compose_cfg, tiny_poisson

GOLDEN = Path(__file__).parent / "data" / "refactor_identity.json"
#: relative tolerances: what the plan fixes, and what training computes (see the module docstring)
EXACT, TRAINED = 1e-8, 1e-4
#: absolute tolerance of trained values (engine self-check errors are ~1e-8 and vary with the machine)
TRAINED_ABS = 1e-6
#: keys whose values are timings, versions or hashes of the source: they differ from one launch to the next
VOLATILE = {
    "seconds",
    "spent",
    "trained",
    "share_of_training_time",
    "wall_time_s",
    "train_time_s",
    "provenance",
    "git_commit",
    "fp32_math",
    "final_params_sha1",
}
#: keys whose values are the argmax of rounding errors (the engine self-check's parameter with the largest ~1e-7
#: relative error): another CPU's vector width or BLAS sums in another order and picks another parameter, so neither
#: the golden file nor the comparison holds them (their keys are dropped from the key orders too)
MACHINE_DEPENDENT = {"worst_param"}

# --- plans ----------------------------------------------------------------------------------------------------------
TINY = tiny_poisson("ri", 8, "train.log_every=1", ON_CPU, "train.engine_watch.every=0")
CYCLIC = ["noise=bandmf", "noise.bands=2", "train.sampler=cyclic_poisson", "train.batch_size=8"]
SINGLE_PASS_MF = [
    "noise=bandmf",
    "noise.bands=2",
    "train.sampler=single_pass",
    "train.batch_size=16",
    "train.epochs=2",
    "train.steps=null",
]
TOY = [
    "task=logistic_1d",
    "task.n_train=60",
    "task.n_test=200",
    "task.trials=2",
    "train.log_every=10",
    "logger.wandb.mode=disabled",
    "experiment_name=ri",
]

PLANS = {
    "poisson": TINY,
    "poisson_budget": [*TINY, "privacy.epsilon_budget=5.5"],
    "poisson_calibrated": [*TINY, "privacy.sigma=null", "privacy.target_epsilon=4"],
    "poisson_until_target": [*TINY, "train.steps=null", "privacy.sigma=1.5", "privacy.target_epsilon=3"],
    "poisson_target_below_one_step": [*TINY, "train.steps=null", "privacy.target_epsilon=0.01"],
    "cyclic_bandmf": [*TINY, *CYCLIC],
    "cyclic_bandmf_calibrated": [*TINY, *CYCLIC, "privacy.sigma=null", "privacy.target_epsilon=8"],
    "cyclic_bandmf_budget": [*TINY, *CYCLIC, "privacy.epsilon_budget=4"],
    "cyclic_bandmf_budget_below_one_step": [*TINY, *CYCLIC, "privacy.epsilon_budget=0.01"],
    "cyclic_independent": [*TINY, "train.sampler=cyclic_poisson", "train.cycle_length=2"],
    "cyclic_blt_conservative": [*TINY, *CYCLIC[2:], "noise=blt", "noise.buffers=2", "train.cycle_length=4"],
    "cyclic_bandmf_wider_than_cycle": [*TINY, *CYCLIC, "noise.bands=4", "train.cycle_length=2"],
    "cyclic_q_above_one": [*TINY, *CYCLIC, "noise.bands=8", "train.batch_size=16"],
    "single_pass_bandmf": [*TINY, *SINGLE_PASS_MF],
    "single_pass_bandmf_budget": [*TINY, *SINGLE_PASS_MF, "privacy.epsilon_budget=50"],
    "single_pass_bandmf_over_budget": [*TINY, *SINGLE_PASS_MF, "privacy.epsilon_budget=0.5"],
    "single_pass_bandmf_calibrated": [
        *TINY,
        *SINGLE_PASS_MF,
        "privacy.sigma=null",
        "privacy.target_epsilon=5",
    ],
    "single_pass_bands_over_steps": [*TINY, *SINGLE_PASS_MF, "noise.bands=16"],
    "balls_in_bins_bandmf": [*TINY, *SINGLE_PASS_MF, "train.sampler=balls_in_bins"],
    "balls_in_bins_calibrated": [
        *TINY,
        *SINGLE_PASS_MF,
        "train.sampler=balls_in_bins",
        "privacy.sigma=null",
        "privacy.target_epsilon=6",
    ],
    "shuffle": [*TINY, "train.sampler=shuffle", "train.steps=null", "train.epochs=2"],
    "large_delta": [*TINY, "privacy.delta=0.05"],
    "ime_single_pass": [*TINY, "optimizer=ime", "train.sampler=single_pass", "train.steps=null"],
    "ime_poisson_refused": [*TINY, "optimizer=ime"],
    "noiseless_precond": [*TINY, "optimizer=noiseless_precond"],
    "nonprivate": [*TINY, "noise=none"],
    "batch_too_large": [*TINY, "train.batch_size=100"],
    "secure_rng_with_checkpoints": [*TINY, "privacy.secure_rng=true", "train.checkpoint_every=2"],
    "gdp_clt_budget": [*TINY, "privacy.epsilon_budget=5", "privacy.accountant=gdp_clt"],
    "memory_over_limit": [
        *TINY,
        "noise=dpmf_sqrt",
        "train.sampler=single_pass",
        "train.steps=null",
        "noise.max_memory_gb=1e-9",
    ],
    "toy_dpmf": [*TOY, "optimizer=adagrad_ime", "noise=dpmf_sqrt", "privacy.sigma=0.1"],
}


def _round_trip(value):
    """JSON's view of a value (tuples become lists, keys strings), as the golden file holds it."""
    return json.loads(json.dumps(value, default=str))


def _refusal(err: Exception) -> dict:
    return {"refused": type(err).__name__, "message": str(err)}


def _describe_plan(plan) -> dict:
    ledger = plan.ledger_after()
    sampler = plan.sampler
    return {
        **_before_added_plan_fields(plan.describe()),
        "noisy": plan.noisy,
        "private": plan.private,
        "target": plan.target,
        "column_norm": plan.column_norm,
        "amplified": plan.amplified,
        "bound_accountant": plan.bound_accountant,
        "strategy": type(plan.strategy).__name__ if plan.strategy is not None else None,
        "sampler": {"kind": sampler.kind, "steps": sampler.steps, "q": getattr(sampler, "q", None)},
        "rounds_after_3": plan.rounds_after(3),
        "ledger": ledger.to_dict(),
        "guarantee": plan.guarantee(ledger),
        "notes": plan.notes,
        "warnings": plan.warnings,
        "caveats": plan.caveats,
    }


@functools.cache
def _composed(overrides: tuple[str, ...]):
    return compose_cfg(list(overrides))  # Hydra's compose is most of a plan's cost: once per config


def _plan_of(overrides: list[str], n: int = 64):
    from omegaconf import OmegaConf

    from dp_adam_bench.config import validate
    from dp_adam_bench.engine.plan import build_plan
    from dp_adam_bench.optim.registry import VARIANTS

    cfg = OmegaConf.create(OmegaConf.to_container(_composed(tuple(overrides))))
    validate(cfg)
    opt = {k: v for k, v in cfg.optimizer.items() if k != "name"}
    return build_plan(cfg, n, VARIANTS.get(cfg.optimizer.name)(**opt), numel=10, sampler_seed=0)


def observe_plans() -> dict:
    """Each of :data:`PLANS` through ``validate`` and ``build_plan``: the plan, or the refusal's message."""
    out = {}
    for name, overrides in PLANS.items():
        try:
            out[name] = _describe_plan(_plan_of(overrides))
        except (ValueError, KeyError) as err:  # ConfigError is a ValueError
            out[name] = _refusal(err)
    return _round_trip(out)


# --- calibration ----------------------------------------------------------------------------------------------------
def _attempt(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except (ValueError, RuntimeError) as err:
        return _refusal(err)


def observe_calibration() -> dict:
    """The searches for sigma and steps on each accountant, and the sigma search on synthetic epsilon curves that
    reach each of its branches (a flat piece, infinities, zeros, an unreachable target)."""
    from dp_adam_bench.privacy.accounting import calibrate_sigma, steps_to_epsilon
    from dp_adam_bench.privacy.accounting.amplified_mf import (
        amplified_steps_to_epsilon,
        calibrate_amplified_sigma,
        calibrate_gaussian_sigma,
    )
    from dp_adam_bench.privacy.accounting.calibration import _solve_sigma

    out = {}
    out["sigma_rdp"] = _attempt(calibrate_sigma, 3.0, 1e-5, 0.01, 1000, "rdp")
    out["steps_rdp"] = _attempt(steps_to_epsilon, 2.0, 1.1, 0.02, 1e-5, "rdp")
    for acc in ("rdp", "pld", "prv"):  # pld and prv: a coarse search, then the reported accountant's
        out[f"sigma_{acc}_small_target"] = _attempt(calibrate_sigma, 0.5, 1e-5, 0.1, 10, acc)
    out["sigma_gdp_clt_refused"] = _attempt(calibrate_sigma, 3.0, 1e-5, 0.01, 1000, "gdp_clt")
    out["sigma_tol"] = _attempt(calibrate_sigma, 8.0, 1e-6, 0.25, 40, "rdp", tol=0.5)
    out["sigma_unreachable"] = _attempt(calibrate_sigma, 1e-6, 1e-5, 1.0, 10**6, "rdp")
    out["sigma_huge_target"] = _attempt(calibrate_sigma, 1e4, 1e-5, 1.0, 1, "rdp")
    out["amplified"] = _attempt(calibrate_amplified_sigma, 8.0, 1e-5, 0.25, 24, 4, "rdp", 1.3)
    out["amplified_steps"] = _attempt(amplified_steps_to_epsilon, 8.0, 1.2, 0.25, 4, 1e-5, "rdp", 1.3)
    out["gaussian"] = _attempt(calibrate_gaussian_sigma, 5.0, 1e-5, 1.7)

    curves = {
        "power": lambda s: 10.0 / s**2,
        "flat_piece": lambda s: 3.0 if 1.0 < s < 2.0 else 6.0 / s,
        "inf_below_one": lambda s: math.inf if s < 1.0 else 4.0 / s,
        "zero_above_ten": lambda s: 0.0 if s > 10.0 else 50.0 / s**3,
        "steep": lambda s: math.exp(8.0 / s) - 1.0,
        "jumps_over_the_target": lambda s: 2.5 if s < 3.0 else 1.5,
        "never_below": lambda s: 5.0,
        "never_above": lambda s: 1e-9,
    }
    for name, fn in curves.items():
        for sigma0 in (0.05, 1.0, 40.0):
            out[f"solve_{name}_from_{sigma0:g}"] = _attempt(_solve_sigma, fn, 2.0, 0.01, sigma0)
    out["solve_given_eps0"] = _attempt(_solve_sigma, curves["power"], 2.0, 0.01, 2.2, eps0=2.0, slope=-1.5)
    return _round_trip(out)


# --- reconciliation -------------------------------------------------------------------------------------------------
def _honest(plan, steps: int):
    """The privacy and participation ledgers of ``steps`` honest steps of the plan's sampler."""
    from dp_adam_bench.engine.participation import ParticipationLedger

    ledger = plan.new_ledger()
    part = ParticipationLedger(plan.sampler.n, [torch.Generator().manual_seed(1)])
    batches = plan.sampler.iter_from(0)
    for t in range(1, steps + 1):
        part.observe(next(batches))
        plan.record_step(ledger, t)
    part.observe_releases([SimpleNamespace(step=steps)])
    part.observe_generators([torch.Generator().manual_seed(2)])
    return ledger, part


def observe_reconcile() -> dict:
    """``reconcile`` on honest ledgers of each accounting and on ledgers with each kind of fault planted."""
    from dp_adam_bench.engine.participation import ParticipationLedger, reconcile

    out = {}
    noise_ok = SimpleNamespace(total_n=800, pooled=1.0, mismatch=None, steps=8)
    noise_low = SimpleNamespace(total_n=800, pooled=0.5, mismatch="step 3: multiplier 0.5", steps=8)
    for name in ("poisson", "cyclic_bandmf", "single_pass_bandmf", "balls_in_bins_bandmf", "shuffle"):
        plan = _plan_of(PLANS[name])
        steps = plan.steps
        ledger, part = _honest(plan, steps)
        out[name] = reconcile(part, plan, ledger, 1, steps, noise_ok)
        out[f"{name}_measured_low"] = reconcile(part, plan, ledger, 1, steps, noise_low)
        out[f"{name}_wrong_streams"] = reconcile(part, plan, ledger, 2, steps - 1)
    plan = _plan_of(PLANS["poisson"])
    ledger, part = _honest(plan, 8)
    ledger.record_poisson_step(plan.account_sigma, 0.5, 1)  # a round at another rate, and one too many
    part.observe(torch.tensor([3, 3, 70, -1]))
    part.stream_now = [part.stream_starts[0]]  # the stream back in its starting state
    out["poisson_faults"] = reconcile(part, plan, ledger, 1, 9)
    unseen = ParticipationLedger(plan.sampler.n)
    unseen.mark_unobserved(4)
    out["poisson_unobserved"] = reconcile(unseen, plan, plan.ledger_after(4), 0, 4)
    plan = _plan_of(PLANS["cyclic_bandmf"])
    ledger, part = _honest(plan, 4)
    part.observe(part.last.argmax().reshape(1))  # the last step's example again, one step later
    out["cyclic_too_close"] = reconcile(part, plan, plan.ledger_after(5), 1, 5)
    plan = _plan_of(PLANS["single_pass_bandmf"])
    ledger, part = _honest(plan, plan.steps)
    part.observe(torch.arange(16))  # a third participation, which the sensitivity did not count
    out["single_pass_extra_participation"] = reconcile(part, plan, ledger, 1, plan.steps + 1)
    out["no_rate_events"] = reconcile(part, _plan_of(PLANS["nonprivate"]), ledger, 0, plan.steps + 1)
    out = {name: _before_added_checks(report) for name, report in out.items()}
    out["key_order"] = {name: _key_paths(report) for name, report in out.items()}
    return _round_trip(out)


# --- training runs --------------------------------------------------------------------------------------------------
#: runs through ``train``; the model runs check the engine at the start and at checkpoints only (``TINY``: no periodic
#: check, whose schedule follows the measured step time)
RUNS = {
    "dpadam_poisson": [
        *TINY,
        "train.eval_every=4",
        "train.eval_at_start=true",
        "train.checkpoint_every=4",
        "diagnostics.every=4",
    ],
    "dpsgd_poisson_budget": [
        *TINY,
        "optimizer=sgd",
        "optimizer.lr=0.1",
        "privacy.epsilon_budget=5.5",
        "train.lr_schedule=linear",
        "train.lr_warmup_steps=2",
        "train.checkpoint_every=5",
    ],
    "bandmf_cyclic_calibrated": [
        *TINY,
        *CYCLIC,
        "privacy.sigma=null",
        "privacy.target_epsilon=8",
        "train.checkpoint_every=8",
    ],
    "bandmf_single_pass_budget": [
        *TINY,
        *SINGLE_PASS_MF,
        "privacy.epsilon_budget=50",
        "train.checkpoint_every=8",
    ],
    "dpadam_poisson_calibrated": [
        *TINY,
        "train.steps=6",
        "privacy.sigma=null",
        "privacy.target_epsilon=4",
        "train.checkpoint_every=3",
    ],
    "toy_ime_dpmf": [
        *TOY,
        "optimizer=adagrad_ime",
        "noise=dpmf_sqrt",
        "privacy.sigma=0.1",
        "train.checkpoint_every=30",
    ],
    "toy_balls_in_bins_calibrated": [
        *TOY,
        "optimizer=sgd",
        "noise=blt",
        "noise.buffers=2",
        "train.sampler=balls_in_bins",
        "train.batch_size=10",
        "train.epochs=2",
        "privacy.sigma=null",
        "privacy.target_epsilon=6",
        "train.checkpoint_every=6",
    ],
    "toy_nonprivate": [*TOY, "optimizer=adagrad_pp", "noise=none", "train.checkpoint_every=60"],
}
RESUMED = [*TINY, "optimizer=adam", "train.checkpoint_every=2", "experiment_name=ri_resume"]


def _tensor(t: torch.Tensor):
    """A float tensor's values (rounded in comparison); any other tensor's exact bytes, as a digest."""
    t = t.detach().cpu()
    if t.is_floating_point():
        return {"shape": list(t.shape), "values": t.double().reshape(-1).tolist()}
    return {
        "shape": list(t.shape),
        "dtype": str(t.dtype),
        "sha1": hashlib.sha1(t.numpy().tobytes()).hexdigest(),
    }


def _plain(value):
    """Nested containers with their tensors described by :func:`_tensor` and the :data:`VOLATILE` keys left out."""
    if isinstance(value, dict):
        return {
            str(k): _plain(v) for k, v in value.items() if k not in VOLATILE and k not in MACHINE_DEPENDENT
        }
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, torch.Tensor):
        return _tensor(value)
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):  # numpy scalars and arrays
        return _plain(value.tolist())
    return value


def _checkpoint(folder: Path) -> dict | None:
    """The checkpoint's payload, described by :func:`_plain` (None without one)."""
    f = folder / "checkpoint.pt"
    if not f.exists():
        return None
    payload = torch.load(f, weights_only=False)
    check = payload.get("self_check")
    if isinstance(check, dict):  # its key names the source's hash and the library versions
        payload["self_check"] = {k: v for k, v in check.items() if k != "key"}
    return _plain(payload)


def _key_paths(value, where: str = "") -> list[str]:
    """Every key of nested dicts, in their order (the golden file sorts its keys; the files a run writes do not)."""
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in [f"{where}.{k}", *_key_paths(v, f"{where}.{k}")]]
    if isinstance(value, (list, tuple)):
        return [p for i, v in enumerate(value) for p in _key_paths(v, f"{where}[{i}]")]
    return []


def _folder_record(folder: Path) -> dict:
    """What a run folder holds: its files, its config, its metric rows, its checkpoint, and the order of their
    keys."""

    def rows(name: str) -> list:
        f = folder / name
        return [json.loads(line) for line in f.read_text().splitlines()] if f.exists() else []

    summary = json.loads((folder / "summary.json").read_text()) if (folder / "summary.json").exists() else {}
    summary = _before_added_checks({k: v for k, v in summary.items() if k not in ADDED_SUMMARY})
    if "privacy_plan" in summary:
        summary["privacy_plan"] = _before_added_plan_fields(summary["privacy_plan"])
    checkpoint = _checkpoint(folder)
    if checkpoint is not None:
        checkpoint = _before_added_checks({k: v for k, v in checkpoint.items() if k not in ADDED_CHECKPOINT})
        if "plan" in checkpoint:
            checkpoint["plan"] = _before_added_plan_fields(checkpoint["plan"])
    return {
        "run_id": folder.name,
        "files": sorted(p.name for p in folder.iterdir() if p.name != ".lock"),
        "config_sha1": _config_sha1(folder),
        "metrics": rows("metrics.jsonl"),
        "private_diagnostics": rows("private_diagnostics.jsonl"),
        "checkpoint": checkpoint,
        "key_order": {
            "summary": _key_paths(_plain(summary)),
            "metrics": _key_paths(rows("metrics.jsonl") + rows("private_diagnostics.jsonl")),
            "checkpoint": list(checkpoint or {}),  # its entries below the top: the session's state_dict
        },
    }


#: summary keys fixed by the plan (compared to :data:`EXACT`); the others come from training
PLANNED = (
    "steps",
    "planned_steps",
    "private",
    "sampler",
    "epsilon",
    "epsilon_errors",
    "guarantee",
    "sigma",
    "delta",
    "privacy_plan",
    "rng",
    "ledger",
    "privacy_notes",
    "stopped_by_budget",
    "status",
    "seed",
)


#: what runs record since the goldens (issue 45: which parameters trained, and that each moved), left out: the
#: summary's and the checkpoint's new entries, and the config's new lines at the values that compute what the
#: goldens' runs computed
ADDED_SUMMARY = ("finetune", "moved_check", "post_processing_check")
ADDED_CHECKPOINT = ("moved_check", "post_processing_check")
#: the participation ledger's batch-repeat checks (issue 56): their checks, their entry in its report, and its
#: per-step record in its state, left out in the same way
ADDED_CHECKS = ("repeated_batch", "near_repeat")
ADDED_PARTICIPATION = ("repeat_test", "recorded_from", "digests", "sizes", "gap_lags", "gap_counts")


def _before_added_checks(record: dict) -> dict:
    """A participation report or state (or a summary or checkpoint holding one as ``participation``) without what
    :data:`ADDED_CHECKS` and :data:`ADDED_PARTICIPATION` added."""
    if isinstance(record.get("participation"), dict):
        return {**record, "participation": _before_added_checks(record["participation"])}
    out = {k: v for k, v in record.items() if k not in ADDED_PARTICIPATION}
    if isinstance(out.get("checks"), list):
        out["checks"] = [c for c in out["checks"] if c.get("check") not in ADDED_CHECKS]
    return out


ADDED_CONFIG_LINES = (
    "  moved_check: 3\n",
    "  post_processing_check:\n    enabled: true\n    every: auto\n    budget: 0.02\n",  # issue 56
)

#: what the privacy plan records since the goldens (issue 56: N, q, B and the sampler, which a resume compares), left
#: out of the plan, the summary's privacy_plan and the checkpoint's plan
ADDED_PLAN_FIELDS = ("population", "sampling_rate", "expected_batch_size", "sampler")


def _before_added_plan_fields(plan):
    return {k: v for k, v in plan.items() if k not in ADDED_PLAN_FIELDS} if isinstance(plan, dict) else plan


def _config_sha1(folder: Path) -> str:
    """The sha1 of the run's config.yaml without :data:`ADDED_CONFIG_LINES` (the toy task has no finetune field)."""
    text = (folder / "config.yaml").read_text()
    for line in ADDED_CONFIG_LINES:
        text = text.replace(line, "", 1)
    return hashlib.sha1(text.encode()).hexdigest()


def _run_record(summary: dict, folder: Path) -> dict:
    planned = {k: summary.get(k) for k in PLANNED}
    planned["privacy_plan"] = _before_added_plan_fields(planned["privacy_plan"])
    trained = {
        k: v for k, v in _before_added_checks(summary).items() if k not in PLANNED and k not in ADDED_SUMMARY
    }
    return _round_trip(
        {"planned": _plain(planned), "trained": {"summary": _plain(trained), **_folder_record(folder)}}
    )


def _only_folder(root: Path, experiment: str) -> Path:
    (folder,) = [p for p in (root / experiment).iterdir() if p.is_dir()]
    return folder


def observe_runs(root: Path) -> dict:
    """Each of :data:`RUNS` through ``train``, and a run killed after step 5 then resumed from its checkpoint of
    step 4, each in its own experiment under the run store ``root``."""
    from dp_adam_bench.train import train

    out = {}
    for name, overrides in RUNS.items():
        experiment = f"ri_{name}"
        summary = train(compose_cfg([*overrides, f"experiment_name={experiment}"]))
        out[name] = _run_record(summary, _only_folder(root, experiment))
    with pytest.raises(KeyboardInterrupt):
        train(compose_cfg([*RESUMED, "train.stop_after=5"]))
    folder = _only_folder(root, "ri_resume")
    killed = _round_trip(_folder_record(folder))
    summary = train(compose_cfg(RESUMED))
    out["resumed"] = {**_run_record(summary, folder), "killed": killed}
    return out


# --- comparison -----------------------------------------------------------------------------------------------------
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def _same_number(got, want, rel: float, abs_tol: float) -> bool:
    if isinstance(got, bool) or isinstance(want, bool) or isinstance(got, int) and isinstance(want, int):
        return got == want
    if math.isnan(got) or math.isnan(want):
        return math.isnan(got) and math.isnan(want)
    return math.isclose(got, want, rel_tol=rel, abs_tol=abs_tol)


def _same_text(got: str, want: str, rel: float) -> bool:
    """Equal strings, or (for trained values) equal but for numbers within ``rel`` of each other."""
    if got == want or rel <= EXACT:
        return got == want
    got_n, want_n = _NUMBER.findall(got), _NUMBER.findall(want)
    if _NUMBER.sub("#", got) != _NUMBER.sub("#", want) or len(got_n) != len(want_n):
        return False
    return all(
        math.isclose(float(a), float(b), rel_tol=rel, abs_tol=TRAINED_ABS)
        for a, b in zip(got_n, want_n, strict=True)
    )


def differences(got, want, rel: float, where: str = "", abs_tol: float = 0.0) -> list[str]:
    """Where ``got`` and ``want`` differ: keys, lengths, strings, and numbers beyond ``rel`` (and ``abs_tol``)."""
    if isinstance(want, dict) and isinstance(got, dict):
        if set(got) != set(want):
            return [f"{where}: keys {sorted(set(got) ^ set(want))} in one only"]
        return [d for k in want for d in differences(got[k], want[k], rel, f"{where}.{k}", abs_tol)]
    if isinstance(want, list) and isinstance(got, list):
        if len(got) != len(want):
            return [f"{where}: {len(got)} items, golden {len(want)}"]
        return [
            d
            for i, (g, w) in enumerate(zip(got, want, strict=True))
            for d in differences(g, w, rel, f"{where}[{i}]", abs_tol)
        ]
    numbers = (int, float)
    if isinstance(want, numbers) and isinstance(got, numbers):
        return [] if _same_number(got, want, rel, abs_tol) else [f"{where}: {got!r}, golden {want!r}"]
    if isinstance(want, str) and isinstance(got, str):
        return [] if _same_text(got, want, rel) else [f"{where}: {got!r}, golden {want!r}"]
    return [] if got == want else [f"{where}: {got!r}, golden {want!r}"]


def without_machine_dependent(value):
    """``value`` without the :data:`MACHINE_DEPENDENT` keys and the key paths that end in one (what stripped the
    golden file of them: ``python -c "import sys; sys.path.insert(0, 'tests'); import test_refactor_identity as t;
    t.strip_golden()"``)."""
    if isinstance(value, dict):
        return {k: without_machine_dependent(v) for k, v in value.items() if k not in MACHINE_DEPENDENT}
    if isinstance(value, list):
        return [
            without_machine_dependent(v)
            for v in value
            if not (isinstance(v, str) and v.rsplit(".", 1)[-1] in MACHINE_DEPENDENT)
        ]
    return value


def strip_golden() -> None:
    """Rewrite the golden file without its :data:`MACHINE_DEPENDENT` keys, every other value as it was."""
    GOLDEN.write_text(_dumped(without_machine_dependent(json.loads(GOLDEN.read_text()))) + "\n")


def _golden(section: str):
    return json.loads(GOLDEN.read_text())[section]


def _assert_same(got, want, rel: float, abs_tol: float = 0.0, where: str = "") -> None:
    diff = differences(got, want, rel, where, abs_tol)
    assert not diff, f"{len(diff)} difference(s) from the golden values:\n" + "\n".join(diff[:30])


@pytest.fixture
def tiny_task(monkeypatch):
    from dp_adam_bench.tasks import registry

    monkeypatch.setitem(registry.TASKS, "tiny", "tiny_task:TinyTask")


def test_plans_are_unchanged(tiny_task):
    _assert_same(observe_plans(), _golden("plans"), EXACT)


def test_calibration_is_unchanged():
    _assert_same(observe_calibration(), _golden("calibration"), EXACT)


def test_reconciliation_is_unchanged(tiny_task):
    _assert_same(observe_reconcile(), _golden("reconcile"), EXACT)


def test_runs_are_unchanged(tiny_task, isolated_dirs):
    got, want = observe_runs(isolated_dirs / "runs"), _golden("runs")
    assert set(got) == set(want)
    for name in want:
        assert got[name]["trained"]["run_id"] == want[name]["trained"]["run_id"], name
        _assert_same(got[name]["planned"], want[name]["planned"], EXACT, where=f"{name}.planned")
        _assert_same(got[name]["trained"], want[name]["trained"], TRAINED, TRAINED_ABS, f"{name}.trained")


def observe() -> dict:
    """Every section, as the golden file holds it (run store in a temporary folder)."""
    from dp_adam_bench.tasks import registry

    registry.TASKS["tiny"] = "tiny_task:TinyTask"
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["DP_ADAM_BENCH_RUNS"] = str(Path(tmp) / "runs")
        os.environ["DP_ADAM_BENCH_RESULTS"] = str(Path(tmp) / "results")
        return {
            "plans": observe_plans(),
            "calibration": observe_calibration(),
            "reconcile": observe_reconcile(),
            "runs": observe_runs(Path(tmp) / "runs"),
        }


def _rounded(value):
    """Floats to 12 significant digits, finer than any comparison here: a shorter golden file."""
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    if isinstance(value, float) and math.isfinite(value):
        return float(f"{value:.12g}")
    return value


def _dumped(value, indent: str = "") -> str:
    """JSON with one line per key, and lists of plain values on one line: a golden file a diff can read."""
    inner = indent + " "
    if isinstance(value, dict) and value:
        items = [f"{inner}{json.dumps(k)}: {_dumped(value[k], inner)}" for k in sorted(value)]
        return "{\n" + ",\n".join(items) + f"\n{indent}}}"
    if isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):
        return "[\n" + ",\n".join(inner + _dumped(v, inner) for v in value) + f"\n{indent}]"
    return json.dumps(value)


if __name__ == "__main__":
    import dp_adam_bench

    print(f"dp_adam_bench from {dp_adam_bench.__file__}", file=sys.stderr)
    os.environ.setdefault("WANDB_MODE", "offline")
    Path(sys.argv[1]).write_text(_dumped(_rounded(observe())) + "\n")
