"""The meter and the white-box audit through a fine-tuning method (``task.finetune``: full, head, top<k>, LoRA,
prefix, RGP), so that a slip in a method's own code meets the post-processing and noise checks.

The run is a user's run: :class:`~dp_adam_bench.audit.meter.finetune_task.FinetuneMeterTask` through
``trainer.prepare`` (the method from the finetune registry applied before the engine is built, the variant wrapped by
the method where it wraps it, RGP) and ``trainer.run`` with the config's variant, noise, sampler and schedule and
the run's own checks (the engine watch when asked, the noise check recorded, the post-processing check of
engine/post_processing.py: a run it stops is recorded and run again without it, so that the meter and the audit
measure what it prevented). What the meter cannot know in closed form it computes or replays:

* the per-example gradients of the method's trainable tensors (adapters, carriers, a prefix net: they depend on the
  tensors' values) come from autograd on each example alone at the state the run's engine saw (oracle.py), on a
  *twin*: the run prepared again by the same path on other private data (``data_seed``), its engine closed;
* every release is recorded with the clipped sum the engine handed the privatizer and every tensor the model held
  before it (recording.FinetuneRecorder).

What each check sees, for every method alike (the checks are the model path's, over the method's trainable tensors):

* ``sampling``: the batches against the sampler's documented structure and rate (the method plays no part);
* ``sensitivity`` (slope of the release on the oracle's clipped mean), ``noise_std`` (pooled and by trainable
  tensor: an adapter's B or a carrier noised less than stated fails its group), ``correlation``,
  ``noise_covariance`` and ``multiplier``: the release against the oracle's prediction, as on the model path;
* ``clipped_sum`` (exact, checks/clipped_sum.py): the engine's clipped sum equals the oracle's at every step;
* ``post_processing`` (exact, replay.replay_method): the twin's freshly built model equals the run's start, and its
  variant and method, fed the recorded releases alone (no clean gradient, no batch, none of the run's data), reproduce
  every tensor the run's model holds (trainable and frozen parameters and buffers: LoRA's A and B, RGP's carriers and
  residual weights, a prefix net, any statistic) before every step and at the end;
* ``run_checks``: whether a check of the run itself stopped it (the post-processing check), with its line.

What it cannot see: dropout (the meter's models have none; LoRA's dropout is set to 0: a mask the engine drew cannot
be redrawn by the oracle); the variant's state except through what it writes into the model at the next step (a
moment or a counter never used; the run's post-processing check compares it); a leak that happens to be the same for
the run's data and the twin's (a statistic of the whole data set that no batch changes); anything the method writes
outside the model and the variant (a file, a global); the real model families' layers (a GPT-2 of width 16 and the
blocks model stand for them: a method's code path that only a larger model takes is not taken).

The audit (:func:`audit_finetune`) is the white-box audit of the model path with canaries that own an input feature
(blocks) or a token (GPT-2): each in with probability 1/2, an excluded one a zero loss. The auditor sees every tensor
the model holds before every step and at the end. Its observation per canary is the canary's loss under the model at
each step (``theta``: the function the method's tensors compute, whatever they are; in the blocks family a + the
effective weight W[0, 1 + i] times a), scored as the model path scores a coordinate (descent, path, roughness,
eligible), and a ``state`` score: over every tensor with a canary axis (the blocks' input features: a weight's
column, LoRA's A, RGP's R and residual, a buffer over the input; GPT-2's vocabulary) and every step at which it
changed, the share of its change on the canary's slice, ||dT[.., i, ..]|| / ||dT||, summed. The release scores of the
model path need a canary coordinate in the release, which an adapter or a carrier does not have: not computed here,
so 5 scores x 3 fractions = 15 pre-registered tests.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import torch
from omegaconf import OmegaConf

from dp_adam_bench.audit.meter.checks.clipped_sum import clipped_sum_check
from dp_adam_bench.audit.meter.checks.row import row_checks
from dp_adam_bench.audit.meter.checks.stats import ALPHA
from dp_adam_bench.audit.meter.finetune_task import FinetuneMeterTask, family_for
from dp_adam_bench.audit.meter.oracle import load_state, per_example_grads, state_of
from dp_adam_bench.audit.meter.prediction import clipped_mean, releases
from dp_adam_bench.audit.meter.recording import FinetuneRecorder, watched
from dp_adam_bench.audit.meter.replay import replay_method
from dp_adam_bench.audit.meter.runners import (
    engine_config,
    metered_result,
    run_checks,
    stated_square_std,
    strategy_of,
)
from dp_adam_bench.errors import ConfigError

#: every fine-tuning method, as the meter and the audit run it (top1: the last of the blocks)
METHODS = ("full", "head", "top1", "lora", "prefix", "rgp")


def finetune_config(cfg, method: str, engine: str, self_check: bool, finetune_args=None):
    """:func:`~dp_adam_bench.audit.meter.runners.engine_config` ``cfg`` with ``task.finetune=method`` and its
    ``finetune_args``; LoRA's dropout 0 (the oracle cannot redraw the engine's masks). A one-line ConfigError for a
    bad method, a config without noise and a side-information variant (the meter's task holds no public set)."""
    from dp_adam_bench.finetune import SPELLINGS, parse
    from dp_adam_bench.optim.registry import VARIANTS
    from dp_adam_bench.privacy.noise_factory import NOISE

    if parse(method)[0] is None:
        raise ConfigError(
            f"the fine-tuning meter needs a method (task.finetune); valid: {', '.join(SPELLINGS)}"
        )
    out = engine_config(cfg, engine, self_check)
    if not NOISE.get(out.noise.kind).private:
        raise ConfigError(f"noise.kind={out.noise.kind!r} adds no noise: there is no mechanism to meter")
    if VARIANTS.get(out.optimizer.name).needs_side_info:
        raise ConfigError(
            f"optimizer.name={out.optimizer.name!r} reads public examples: the fine-tuning meter's task holds none"
        )
    args = dict(finetune_args or {})
    if method == "lora":
        dropout = args.get("dropout", 0.0)
        if dropout not in (0, 0.0):
            raise ConfigError(
                f"task.finetune_args.dropout={dropout!r}: the meter predicts each release from per-example gradients "
                "computed again after the run, which cannot redraw the engine's dropout masks; use 0"
            )
        args["dropout"] = 0.0
    OmegaConf.update(out, "task.finetune", method, force_add=True)
    OmegaConf.update(out, "task.finetune_args", args, force_add=True)
    return out


def _installed(control):
    return control.installed() if control is not None else contextlib.nullcontext()


def trained(cfg, task, control, positions, self_check: bool):
    """``cfg`` prepared on ``task`` (the control's method installed), recorded by a :class:`FinetuneRecorder` and
    trained with the control (``whitebox.run_controlled``); a run stopped by one of its own checks is recorded and
    run again with that check off (``whitebox.retried``). Returns (cfg as trained, run, summary, honest sampler,
    eligible steps of ``positions``, the stops)."""
    from dp_adam_bench.audit.whitebox import retried, run_controlled
    from dp_adam_bench.engine import trainer

    def attempt(cfg):
        with _installed(control):
            run = watched(trainer.prepare(cfg, task), self_check)
            if len(run.population) != task.dataset_size:
                run.backend.close()
                raise ConfigError("the fine-tuning meter's task holds no public examples out")
            record = lambda run: FinetuneRecorder(run.backend, control)  # noqa: E731
            return cfg, *run_controlled(cfg, run, control, record, positions, prefix="dp-adam-bench-meter-")

    (cfg, run, summary, sampler, eligible), stops = retried(cfg, attempt)
    return cfg, run, summary, sampler, eligible, stops


def twin_of(cfg, task: FinetuneMeterTask, control, run):
    """The run prepared again by the same path on other private data (``data_seed`` 1: another assignment of the
    examples' own features or tokens), without the engine self-check (``prepare``'s engine probe reads one of the
    twin's examples) and its engine closed: a model, a method and a variant that never saw the run's data. Its
    trainable tensors must be the run's, by name and shape."""
    from dp_adam_bench.engine import trainer

    other = FinetuneMeterTask(task.n, task.clip, task.family, task.shared, task.included, data_seed=1)
    quiet = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    OmegaConf.update(quiet, "train.self_check.enabled", False, force_add=True)
    with _installed(control):
        twin = trainer.prepare(quiet, other)
    twin.backend.close()
    if control is not None:
        twin = control.apply_to_run(twin, quiet)
    mine = [(n, tuple(p.shape)) for n, p in _trainable(run.backend.inner.model)]
    theirs = [(n, tuple(p.shape)) for n, p in _trainable(twin.backend.model)]
    if mine != theirs:
        raise ValueError(f"the twin's trainable tensors differ from the run's: {theirs[:3]} vs {mine[:3]}")
    return twin


def _trainable(model) -> list[tuple[str, torch.Tensor]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def tensor_groups(model) -> dict[str, np.ndarray]:
    """Trainable tensor name -> its coordinates in the flattened release (the noise std by tensor)."""
    named = _trainable(model)
    size = sum(p.numel() for _, p in named)
    out, at = {}, 0
    for name, p in named:
        mask = np.zeros(size, dtype=bool)
        mask[at : at + p.numel()] = True
        out[name] = mask
        at += p.numel()
    return out


def oracle_grads(task, twin, recorder) -> list[torch.Tensor]:
    """Per step, (examples, coordinates): the per-example gradients of the trainable tensors at the state the run's
    engine saw (autograd on the twin loaded with that state, the run's examples)."""
    model, params = twin.backend.model, twin.backend.params
    out = []
    for state, rec in zip(recorder.states, recorder.records, strict=True):
        load_state(model, state)
        out.append(per_example_grads(task, model, params, rec.idx))
    return out


def meter_finetune(
    cfg,
    method: str,
    *,
    engine: str = "bk",
    n: int = 240,
    control=None,
    control_name: str | None = None,
    alpha: float = ALPHA,
    self_check: bool = False,
    finetune_args=None,
    family: str | None = None,
):
    """Meter config ``cfg`` (validated) through the fine-tuning method ``method`` (a ``task.finetune`` spelling) on
    :class:`FinetuneMeterTask` of ``n`` examples (``family``: the method's default, :func:`family_for`) and the
    clipping engine ``engine``: every check of the model path, ``clipped_sum``, the method's ``post_processing``
    replay and ``run_checks`` (module docstring). ``control``: a :class:`~dp_adam_bench.audit.controls.Control`
    (its method, variant, privatizer, sampler or engine bug)."""
    cfg = finetune_config(cfg, method, engine, bool(self_check), finetune_args)
    clip = float(cfg.privacy.clip)
    task = FinetuneMeterTask(int(n), clip, family or family_for(method))
    cfg, run, summary, sampler, _, stopped = trained(cfg, task, control, np.arange(task.n), bool(self_check))
    recorder = run.backend
    final = state_of(recorder.inner.model)
    twin = twin_of(cfg, task, control, run)
    replayed = replay_method(
        twin, recorder.records, recorder.noisy, recorder.noisy_square, recorder.states, final
    )
    grads = oracle_grads(task, twin, recorder)
    batch = float(sampler.expected_batch_size)
    privatizer = recorder.privatizer
    found = releases(
        task,
        recorder.records,
        clip,
        batch,
        lambda: stated_square_std(privatizer, clip, batch),
        known=lambda t, rec: grads[t],
    )
    population = run.population.numpy()
    checks = row_checks(
        recorder.records,
        population,
        sampler,
        task.n,
        found,
        strategy_of(run.plan),
        tensor_groups(twin.backend.model),
        float(run.plan.account_sigma),
        alpha,
    )
    oracle_sums = []
    for g, rec in zip(grads, recorder.records, strict=True):
        s = rec.scale if rec.scale is not None else torch.ones(g.shape[1:], dtype=torch.float64)
        oracle_sums.append(clipped_mean(g * s, clip, 1.0))
    sizes = [len(rec.idx) for rec in recorder.records]
    checks.append(clipped_sum_check(recorder.clipped, oracle_sums, sizes, clip))
    checks.append(replayed)
    checks.append(run_checks(stopped))
    out = metered_result(run, cfg, sampler, 1, task.n, alpha, checks, control_name, engine)
    out.method = method
    return out


# --- the white-box audit through a method -------------------------------------------------------------------------
def canary_slices(task: FinetuneMeterTask, states: list[dict[str, torch.Tensor]]) -> np.ndarray:
    """The ``state`` score of each canary: over every tensor of the states with an axis of the task's canary-axis
    size and every step at which it changed, ||dT[.., i, ..]|| / ||dT|| on canary i's slice, summed."""
    size, index = task.canary_axis()
    score = np.zeros(task.n)
    for before, after in zip(states[:-1], states[1:], strict=True):
        for name, new in after.items():
            old = before.get(name)
            if old is None or old.shape != new.shape or size not in new.shape:
                continue
            d = (new.double() - old.double()).movedim(list(new.shape).index(size), 0)
            total = float(d.norm())
            if total > 0 and math.isfinite(total):
                score += (d[index].reshape(task.n, -1).norm(dim=1) / total).numpy()
    return score


def audit_finetune(
    cfg,
    method: str,
    *,
    engine: str = "bk",
    canaries: int = 200,
    seed: int = 0,
    control=None,
    control_name: str | None = None,
    confidence: float = 0.95,
    meter: bool = True,
    finetune_args=None,
    family: str | None = None,
):
    """The white-box one-run audit through the fine-tuning method ``method`` (module docstring): ``canaries``
    examples, each in with probability 1/2, every tensor of the model observed before every step and at the end;
    ``meter``: attach :func:`meter_finetune` of the same config and control (its own task, with the shared
    feature)."""
    from dp_adam_bench.audit.whitebox import AuditResult, Observed

    if isinstance(canaries, bool) or not isinstance(canaries, int) or canaries < 10:
        raise ConfigError(f"audit canaries={canaries!r} must be an integer >= 10")
    if not 0 < confidence < 1:
        raise ConfigError(f"audit confidence={confidence!r} must be in (0, 1)")
    raw = cfg
    cfg = finetune_config(cfg, method, engine, False, finetune_args)
    n = int(canaries)
    included = np.random.default_rng([int(seed), 12]).random(n) < 0.5
    fam = family or family_for(method)
    task = FinetuneMeterTask(n, float(cfg.privacy.clip), fam, shared=0.0, included=included)
    cfg, run, summary, _, eligible, stopped = trained(cfg, task, control, np.arange(n), False)
    recorder = run.backend
    model = recorder.inner.model
    states = [*recorder.states, state_of(model)]
    theta = []
    for state in states:
        load_state(model, state)
        theta.append(task.canary_losses(model).numpy())
    theta = np.stack(theta)
    observed = Observed(
        theta, included, eligible, strategy_of(run.plan), None, None, {"state": canary_slices(task, states)}
    )
    metered = None
    if meter:
        metered = meter_finetune(
            raw,
            method,
            engine=engine,
            n=n,
            control=control,
            control_name=control_name,
            finetune_args=finetune_args,
            family=fam,
        )
    summary = {**summary, "stopped_by": list(summary.get("stopped_by") or []) + stopped}
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
        auditor=f"white-box (fine-tuning {method}, {engine})",
    )
