"""The meter's runners: a config run through the real trainer and privatizer on a meter task, every release
recorded, and every check of the row judged from the records. :func:`meter_config` meters the vector task
(:class:`~dp_adam_bench.audit.meter.task.MeterTask`), :func:`meter_model` a model task through a real clipping engine,
and :func:`audit_model` is the white-box one-run audit through that model task (with the meter attached); the same
through a fine-tuning method are in finetune_runners.py."""

from __future__ import annotations

import importlib

import numpy as np
import torch
from omegaconf import OmegaConf

from dp_adam_bench.audit.meter.checks.row import row_checks
from dp_adam_bench.audit.meter.checks.stats import ALPHA
from dp_adam_bench.audit.meter.model_task import ModelMeterTask
from dp_adam_bench.audit.meter.prediction import releases
from dp_adam_bench.audit.meter.recording import MeterBackend, recorder, watched
from dp_adam_bench.audit.meter.replay import replay_lists, replay_vector
from dp_adam_bench.audit.meter.result import MeterCheck, MeterResult
from dp_adam_bench.audit.meter.task import TRIALS, MeterTask
from dp_adam_bench.errors import ConfigError


def meter_config(
    cfg,
    *,
    n: int = 1200,
    trials: int = TRIALS,
    control=None,
    control_name: str | None = None,
    alpha: float = ALPHA,
) -> MeterResult:
    """Meter the mechanism of config ``cfg`` (validated) on a :class:`MeterTask` of ``n`` examples; ``control``: a
    :class:`~dp_adam_bench.audit.controls.Control` (its broken privatizer, sampler or variant replace the run's)."""
    from dp_adam_bench.audit.whitebox import retried
    from dp_adam_bench.engine import trainer

    cfg = vector_config(cfg, n)
    clip = float(cfg.privacy.clip)
    task = MeterTask(n, clip, trials)

    def attempt(cfg):
        run = trainer.prepare(cfg, task)
        run.backend.close()
        backend = MeterBackend(task, control)
        # the sampling check's reference is the meter's own (sampling_reference), not run_controlled's eligible
        # steps: those replay the sampler under test
        return cfg, backend, *metered_run(cfg, run, control, lambda run: backend)

    (cfg, backend, run, population, sampler), stops = retried(cfg, attempt)
    # g^2's stated std at the privatizer's own C and B
    square_at = (backend.privatizer.clip, backend.privatizer.B)
    checks = statistical_checks(task, run, population, sampler, clip, task.group_masks(), alpha, square_at)
    final = backend.params[0].detach().clone()
    checks.append(replay_vector(run, backend.records, backend.params_before, final))
    if stops:
        checks.append(run_checks(stops))
    return metered_result(run, cfg, sampler, trials, n, alpha, checks, control_name)


def meter_model(
    cfg,
    engine: str,
    *,
    n: int = 1200,
    control=None,
    control_name: str | None = None,
    alpha: float = ALPHA,
    self_check: bool = False,
) -> MeterResult:
    """Meter config ``cfg`` on :class:`ModelMeterTask` through the clipping engine ``engine`` (bk, ghost, hooks,
    functorch, loop), on the CPU: the sensitivity, noise and post-processing checks of :func:`meter_config` over
    the model's flattened parameters (its bias among them), and the sampling checks. One trial (a model), so the
    stated power is the run's own. ``self_check``: keep the trainer's start-up comparison of the engine with the
    size-one loop (``train.self_check``; off by default, so that the meter measures the engine on its own). A control
    whose bug is in a fine-tuning method runs through that method (:func:`~dp_adam_bench.audit.meter.
    finetune_runners.meter_finetune`)."""
    from dp_adam_bench.engine import trainer

    if control is not None and getattr(control, "finetune", None) is not None:
        # at call time, by name: finetune_runners builds on this module (no import cycle)
        meter_finetune = importlib.import_module("dp_adam_bench.audit.meter.finetune_runners").meter_finetune

        return meter_finetune(
            cfg,
            control.finetune,
            engine=engine,
            n=n,
            control=control,
            control_name=control_name,
            alpha=alpha,
            self_check=self_check,
        )

    from dp_adam_bench.audit.whitebox import retried

    cfg = engine_config(cfg, engine, self_check=bool(self_check))
    clip = float(cfg.privacy.clip)
    task = ModelMeterTask(n, clip, norms=True)

    def attempt(cfg):
        run = watched(trainer.prepare(cfg, task), self_check)
        # as meter_config: the sampling check has its own reference (sampling_reference), not run_controlled's
        return cfg, *metered_run(cfg, run, control, lambda run: recorder(run, control))

    (cfg, run, population, sampler), stops = retried(cfg, attempt)
    backend = run.backend
    square_at = (clip, float(sampler.expected_batch_size))  # g^2's stated std at the meter's C and B
    checks = statistical_checks(task, run, population, sampler, clip, task.groups(), alpha, square_at)
    final = [p.detach().clone() for p in backend.inner.params]
    before = backend.params_before
    checks.append(replay_lists(cfg, run.schedule, backend.records, before, final, run.variant.decay_mask))
    if stops:
        checks.append(run_checks(stops))
    return metered_result(run, cfg, sampler, 1, n, alpha, checks, control_name, engine)


def run_checks(stopped: list[str]) -> MeterCheck:
    """``run_checks``: whether a check of the run itself stopped it mid-run (``whitebox.RUN_STOPS``; the row was
    then measured on the run again with that check off)."""
    detail = "; ".join(stopped) if stopped else "no check of the run stopped it"
    return MeterCheck("run_checks", "", float(len(stopped)), 0.0, None, not stopped, None, detail)


def statistical_checks(
    task, run, population, sampler, clip: float, groups, alpha: float, square_at: tuple[float, float]
) -> list[MeterCheck]:
    """Every check of a metered ``run``'s row but post-processing: the records of its backend beside the meter's
    predictions from ``task`` (prediction.py), judged by :func:`~dp_adam_bench.audit.meter.checks.row.row_checks`
    (the noise std by coordinate ``groups``; g^2's stated std read from the run's privatizer at ``square_at``,
    (C, B))."""
    records, privatizer = run.backend.records, run.backend.privatizer
    batch = float(sampler.expected_batch_size)
    found = releases(task, records, clip, batch, lambda: stated_square_std(privatizer, *square_at))
    strategy, account_sigma = strategy_of(run.plan), float(run.plan.account_sigma)
    return row_checks(records, population, sampler, task.n, found, strategy, groups, account_sigma, alpha)


def audited(cfg, fixed: dict | None = None):
    """A resolved copy of ``cfg`` with the audit's overrides (``whitebox.AUDIT_OVERRIDES``), then ``fixed``."""
    from dp_adam_bench.audit.whitebox import AUDIT_OVERRIDES

    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    for key, value in {**AUDIT_OVERRIDES, **(fixed or {})}.items():
        OmegaConf.update(cfg, key, value, force_add=True)
    return cfg


def vector_config(cfg, n: int):
    """:func:`audited` ``cfg`` for the vector task of ``n`` examples: refused without noise; a side-information
    variant gets a public share held out of the private set, as the audit's."""
    from dp_adam_bench.optim.registry import VARIANTS
    from dp_adam_bench.privacy.noise_factory import NOISE

    cfg = audited(cfg)
    if not NOISE.get(cfg.noise.kind).private:
        raise ConfigError(f"noise.kind={cfg.noise.kind!r} adds no noise: there is no mechanism to meter")
    if VARIANTS.get(cfg.optimizer.name).needs_side_info:
        public = max(1, n // 12)
        OmegaConf.update(cfg, "train.side_info.public_examples", public, force_add=True)
        batch = min(int(cfg.train.side_info.get("batch_size", 256)), public)
        OmegaConf.update(cfg, "train.side_info.batch_size", batch, force_add=True)
    return cfg


def engine_config(cfg, engine: str, self_check: bool):
    """:func:`audited` ``cfg`` through clipping engine ``engine`` on the CPU, the start-up engine check on or off."""
    return audited(
        cfg, {"train.clipping": engine, "train.device": "cpu", "train.self_check.enabled": self_check}
    )


def metered_run(cfg, run, control, make_backend):
    """``run`` (prepared) trained with the recording backend ``make_backend(run)`` and the control, if any (as
    ``whitebox.run_controlled``): (the run as trained, the dataset index of each of the sampler's positions, the
    honest sampler)."""
    from dp_adam_bench.audit.whitebox import run_controlled

    population = run.population.numpy()
    run, _, sampler, _ = run_controlled(
        cfg, run, control, make_backend, np.arange(len(population)), prefix="dp-adam-bench-meter-"
    )
    return run, population, sampler


def strategy_of(plan) -> np.ndarray | None:
    """The plan's strategy matrix C (None: independent noise)."""
    return plan.strategy.matrix() if plan.strategy is not None else None


def stated_square_std(privatizer, clip: float, batch: float) -> float:
    """The noise std the privatizer states for the g^2 release: k sigma S2(C, B)."""
    rel = privatizer.releases
    return rel.noise_scale * privatizer.sigma * rel.square_sensitivity(clip, batch)


def metered_result(
    run, cfg, sampler, trials: int, n: int, alpha: float, checks, control_name, engine=None
) -> MeterResult:
    """The row of a metered ``run``."""
    return MeterResult(
        variant=run.variant.name,
        noise=str(cfg.noise.kind),
        sampler=sampler.kind,
        sigma=float(run.plan.sigma),
        account_sigma=float(run.plan.account_sigma),
        steps=len(run.backend.records),
        trials=trials,
        dataset_size=n,
        batch_size=float(sampler.expected_batch_size),
        alpha=alpha,
        checks=checks,
        control=control_name,
        engine=engine,
    )


def audit_model(
    cfg,
    engine: str,
    *,
    canaries: int = 1000,
    seed: int = 0,
    control=None,
    control_name: str | None = None,
    confidence: float = 0.95,
    meter: bool = True,
):
    """The white-box one-run audit (:mod:`~dp_adam_bench.audit.whitebox`'s scores, both bounds) through a model
    task and the real clipping engine ``engine``: :class:`ModelMeterTask` with every example a canary that owns its
    weight W[0, 1 + i] outright (no shared weight; the bias b[0] is shared), in with probability 1/2 (excluded: a
    zero loss, so a zero gradient), trajectories and releases read from the recorded steps. ``meter``: attach
    :func:`meter_model` of the same config (its own task, with the shared coordinate) to the result. A control whose
    bug is in a fine-tuning method is audited through that method (:func:`~dp_adam_bench.audit.meter.
    finetune_runners.audit_finetune`)."""
    from dp_adam_bench.audit.whitebox import AuditResult, Observed, retried, run_controlled
    from dp_adam_bench.engine import trainer

    if control is not None and getattr(control, "finetune", None) is not None:
        # at call time, by name: finetune_runners builds on this module (no import cycle)
        audit_finetune = importlib.import_module("dp_adam_bench.audit.meter.finetune_runners").audit_finetune

        return audit_finetune(
            cfg,
            control.finetune,
            engine=engine,
            canaries=canaries,
            seed=seed,
            control=control,
            control_name=control_name,
            confidence=confidence,
            meter=meter,
        )

    raw = cfg
    cfg = engine_config(cfg, engine, self_check=False)
    n = int(canaries)
    included = np.random.default_rng([int(seed), 12]).random(n) < 0.5
    task = ModelMeterTask(n, float(cfg.privacy.clip), shared=0.0, included=included)

    def attempt(cfg):
        run = watched(trainer.prepare(cfg, task), False)
        population = run.population.numpy()
        if len(population) != n:
            run.backend.close()
            raise ConfigError("the model-path audit holds no public examples out (side-information variants)")
        positions = np.empty(n, dtype=np.int64)
        positions[population] = np.arange(n)  # canary i (dataset index i) at this position of the sampler
        # eligible: the audit's matched filter (whitebox.eligible_steps, the sampler's own seed-determined order).
        # It is a detection statistic, not a check of the sampler: following the sampler's order keeps its power
        # and never depends on which canaries are in. Whether that order is the documented one is the meter's
        # sampling check (sampling_reference), attached below unless meter=False.
        return run_controlled(cfg, run, control, lambda run: recorder(run, control), positions)

    (run, summary, _, eligible), stops = retried(cfg, attempt)
    summary = {**summary, "stopped_by": [*(summary.get("stopped_by") or []), *stops]}
    backend, plan = run.backend, run.plan
    weights = [b[0][0, 1:].double() for b in backend.params_before]
    weights.append(backend.inner.params[0][0, 1:].detach().double())
    theta = torch.stack(weights).numpy()
    released = torch.stack([r.ctx.noisy[0][0, 1:].detach().double() for r in backend.records]).numpy()
    f = task.features
    scaled = np.stack(
        [(r.noisy[1:f] * (r.scale[1:f] if r.scale is not None else 1.0)).numpy() for r in backend.records]
    )
    metered = meter_model(raw, engine, n=n, control=control, control_name=control_name) if meter else None
    observed = Observed(theta, included, eligible, strategy_of(plan), released, scaled)
    return AuditResult.judged(
        run,
        summary,
        observed,
        confidence,
        seed,
        meter=metered,
        canaries=n,
        dataset_size=n,
        control=control_name,
        auditor=f"white-box (model task, {engine})",
    )
