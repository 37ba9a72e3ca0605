"""The ``post_processing`` check: the registered variant, replayed on the recorded releases alone (no clean
gradient), reproduces the run's parameters at every step (exact, to ``REPLAY_TOL``): the update is a function of the
releases, so it is post-processing of the mechanism the accountant reasons about."""

from __future__ import annotations

import dataclasses
import math

import torch

from dp_adam_bench.audit.meter.recording import StepRecord
from dp_adam_bench.audit.meter.result import MeterCheck

#: relative tolerance of the post-processing replay
REPLAY_TOL = 1e-12


def replay_vector(
    run, records: list[StepRecord], before: list[torch.Tensor], final: torch.Tensor
) -> MeterCheck:
    """The registered variant on the recorded releases alone reproduces the trajectory (the vector task: one
    parameter tensor, the parameters ``before`` each step and ``final``)."""
    contexts = (
        dataclasses.replace(
            rec.ctx,
            noisy=[rec.noisy.clone()],
            noisy_square=None if rec.noisy_square is None else [rec.noisy_square.clone()],
            clean=None,
        )
        for rec in records
    )
    return replay(
        run.cfg,
        run.schedule,
        run.variant.decay_mask,  # weight decay's mask: the model's structure, not data
        contexts,
        [[b] for b in before],
        [final],
        differs="the run's parameters differ from the replay from step {}",
        suffix=" (max rel. diff)",
    )


def replay_lists(
    cfg, schedule, records, before: list[list[torch.Tensor]], final: list[torch.Tensor], decay_mask=None
) -> MeterCheck:
    """:func:`replay_vector` for parameter lists (model tasks)."""
    contexts = (
        dataclasses.replace(rec.ctx, noisy=[g.detach().clone() for g in rec.ctx.noisy], clean=None)
        for rec in records
    )
    return replay(
        cfg, schedule, decay_mask, contexts, before, final, differs="differs from the replay from step {}"
    )


def replay(
    cfg,
    schedule,
    decay_mask,
    contexts,
    before: list[list[torch.Tensor]],
    final: list[torch.Tensor],
    *,
    differs: str,
    suffix: str = "",
) -> MeterCheck:
    """Config ``cfg``'s registered variant (with ``decay_mask``), from the parameters ``before`` the first step,
    updated with each step's release ``contexts`` (their clean gradient taken away) at ``schedule``'s learning
    rate, against the parameters before each next step and ``final``. ``differs``: the detail of a failure, given the
    first step that differs; ``suffix``: added to the detail."""
    from dp_adam_bench.optim.registry import build_variant

    variant = build_variant(cfg.optimizer.name, **{k: v for k, v in cfg.optimizer.items() if k != "name"})
    variant.decay_mask = decay_mask
    params = [p.clone() for p in before[0]]
    after = [*before[1:], final]
    try:
        worst, failed_at = _replayed(variant, schedule, params, contexts, after)
    except Exception as exc:  # e.g. a variant that needs the clean gradient
        why = f"the registered variant cannot run on the releases alone: {type(exc).__name__}: {exc}"
        return MeterCheck("post_processing", "", math.inf, REPLAY_TOL, None, False, None, why)
    detail = "replayed from the releases" if failed_at is None else differs.format(failed_at)
    return MeterCheck(
        "post_processing", "", worst, REPLAY_TOL, None, failed_at is None, None, detail + suffix
    )


def _replayed(variant, schedule, params, contexts, after) -> tuple[float, int | None]:
    """(the largest relative difference from ``after`` over the steps, the first step past REPLAY_TOL or None),
    updating ``params`` in place."""
    worst, failed_at = 0.0, None
    state = variant.init(params)
    base = variant.lr
    for t, (ctx, target) in enumerate(zip(contexts, after, strict=True), start=1):
        variant.lr = base * schedule.factor(t)
        with torch.no_grad():
            variant.update(params, state, ctx)
        scale = max(float(p.abs().max()) for p in target) or 1.0
        err = max(float((p - q).abs().max()) for p, q in zip(params, target, strict=True)) / scale
        worst = max(worst, err)
        if err > REPLAY_TOL and failed_at is None:
            failed_at = t
    return worst, failed_at


def replay_method(
    twin,
    records,
    noisy: list[list[torch.Tensor]],
    noisy_square: list[list[torch.Tensor] | None],
    states: list[dict[str, torch.Tensor]],
    final: dict[str, torch.Tensor],
) -> MeterCheck:
    """``post_processing`` for a fine-tuning method: everything the model holds is a function of the releases.

    ``twin`` is the run prepared again by the same path (``trainer.prepare``: the task's model, the method, the
    wrapped variant) on *other* private data (meter/finetune_runners.py); nothing private of the run reaches it but
    the recorded releases ``noisy`` (and ``noisy_square``). Its freshly built model must equal the run's before the
    first release (``states[0]``: the method's start is public); then, from that state, the twin's variant (the
    method's wrapper included) is updated with each step's release, no clean gradient and no batch, at the schedule's
    learning rate, and every tensor of the twin's model (trainable and frozen parameters, buffers: adapters, carriers,
    residual weights, statistics) must equal the run's before the next release (``states[t]``) and at the end
    (``final``). The variant's own state (moments, RGP's weights) is compared through what it writes into the model
    at the next step, not directly."""
    from dp_adam_bench.audit.meter.oracle import load_state, state_of

    model, variant = twin.backend.model, twin.variant
    start = state_of(model)
    worst, where = _state_diff(start, states[0])
    if worst > REPLAY_TOL:
        what = f"the method's starting state differs on other private data ({where}, rel. diff {worst:.3g})"
        return MeterCheck("post_processing", "", worst, REPLAY_TOL, None, False, None, what)
    load_state(model, states[0])
    params = twin.backend.params
    state = variant.init(params)
    base = variant.lr
    after = [*states[1:], final]
    worst, failed = 0.0, None
    try:
        for t, (rec, g, g2, target) in enumerate(
            zip(records, noisy, noisy_square, after, strict=True), start=1
        ):
            variant.scale(
                state
            )  # once per step before the release, as the session calls it (RGP restores there)
            ctx = dataclasses.replace(
                rec.ctx,
                noisy=[x.clone() for x in g],
                noisy_square=None if g2 is None else [x.clone() for x in g2],
                clean=None,
                side=None,
            )
            variant.lr = base * twin.schedule.factor(t)
            with torch.no_grad():
                variant.update(params, state, ctx)
            err, name = _state_diff(state_of(model), target)
            worst = max(worst, err)
            if err > REPLAY_TOL and failed is None:
                failed = (t, name)
    except Exception as exc:  # e.g. a method that reads the clean gradient
        why = f"the method cannot run on the releases alone: {type(exc).__name__}: {exc}"
        return MeterCheck("post_processing", "", math.inf, REPLAY_TOL, None, False, None, why)
    detail = (
        "every tensor of the model replayed from the releases alone"
        if failed is None
        else f"{failed[1]} differs from its replay from the releases at step {failed[0]}"
    )
    return MeterCheck("post_processing", "", worst, REPLAY_TOL, None, failed is None, None, detail)


def _state_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, str]:
    """(the largest relative difference of two model states, the first tensor where it exceeds REPLAY_TOL or else
    the worst); a tensor missing from one of them differs infinitely."""
    worst, name, first = 0.0, "", None
    for key in sorted(set(got) | set(want)):
        a, b = got.get(key), want.get(key)
        if a is None or b is None or a.shape != b.shape:
            err = math.inf
        else:
            a, b = a.double(), b.double()
            scale = float(b.abs().max()) if b.numel() else 0.0
            err = float((a - b).abs().max()) / (scale or 1.0) if b.numel() else 0.0
            if not math.isfinite(err):
                err = math.inf
        if err > worst:
            worst, name = err, key
        if err > REPLAY_TOL and first is None:
            first = key
    return worst, first or name
