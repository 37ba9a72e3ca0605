"""The meter's recording backends: every release of a run (:class:`StepRecord`) and the parameters before it, kept
by the vector backend (:class:`MeterBackend`) or by a wrapper around a model task's backend (:class:`ModelRecorder`;
for a fine-tuning method also every tensor the model holds and the clipped sum the engine made,
:class:`FinetuneRecorder`); with a control, its broken privatizer (or engine) makes the releases instead of the
trainer's. A release the run's post-processing check replays behind the real one (engine/post_processing.py: the
privatizer pinned to the step's release) is not a release: it is passed through, unrecorded."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from dp_adam_bench.audit.meter.task import MeterTask
from dp_adam_bench.engine.backends import VectorBackend

#: the engine watch's period in the meter's checked runs (``self_check=True``): every this many steps
WATCH_EVERY = 10


@dataclass
class StepRecord:
    idx: torch.Tensor
    scale: torch.Tensor | None
    noisy: torch.Tensor
    noisy_square: torch.Tensor | None
    noise_std: float
    ctx: object  # the step's StepContext (side information is set on it after the release)


def pinned(privatizer) -> bool:
    """The privatizer is pinned to a release already made (the post-processing check replaying a step with another
    private batch, engine/post_processing.py): what goes through it now is no new release."""
    return getattr(privatizer, "_pinned", None) is not None


class Recording:
    """What both recorders keep: the records, the parameters before each release, the privatizer that made them,
    and a control's broken privatizer (built once, from the trainer's, at the first release)."""

    def start_recording(self, control) -> None:
        self.control = control
        self._broken = None  # whitebox.run_resumed clears it to build it again around a resumed attempt's
        self.privatizer = None
        self.records: list[StepRecord] = []
        self.params_before: list = []

    def adopt(self, idx, out) -> None:
        """A pinned release (:func:`pinned`) of the step's own batch is the post-processing check's real world: the
        variant consumes its context (side information is set on it), so the record keeps that one."""
        if self.records and torch.equal(torch.as_tensor(idx).cpu(), self.records[-1].idx.cpu()):
            self.records[-1].ctx = out.ctx

    def releasing(self, privatizer):
        """The privatizer that makes this release: the control's broken one, else the trainer's ``privatizer``."""
        if self.control is not None:
            if self._broken is None:
                self._broken = self.control.wrap(privatizer)
            privatizer = self._broken
        self.privatizer = privatizer
        return privatizer


class MeterBackend(Recording, VectorBackend):
    """The vector backend, recording every release and the parameters before it; with a control, its broken
    privatizer (built once from the trainer's) makes the releases."""

    def __init__(self, task: MeterTask, control=None):
        super().__init__(task)
        self.start_recording(control)

    def release(self, idx, privatizer, scale):
        if pinned(privatizer):
            out = super().release(idx, privatizer, scale)
            self.adopt(idx, out)
            return out
        privatizer = self.releasing(privatizer)
        self.params_before.append(self.params[0].detach().clone())
        out = super().release(idx, privatizer, scale)
        ctx = out.ctx
        self.records.append(
            StepRecord(
                idx=torch.as_tensor(idx).clone(),
                scale=None if scale is None else scale[0].detach().clone(),
                noisy=ctx.noisy[0].detach().clone(),
                noisy_square=None if ctx.noisy_square is None else ctx.noisy_square[0].detach().clone(),
                noise_std=float(ctx.noise_std),
                ctx=ctx,
            )
        )
        return out

    def public_grad(self, pick: torch.Tensor) -> list[torch.Tensor]:
        return [g.mean(0) for g in self.task.per_example_grads(self.params, pick)]


def _flat(tensors) -> torch.Tensor:
    """A list of tensors as one float64 vector."""
    return torch.cat([t.detach().double().reshape(-1) for t in tensors])


class ModelRecorder(Recording):
    """Wraps the trainer's :class:`~dp_adam_bench.engine.backends.ModelBackend`: records every release (through its
    public ``release``) and the parameters before it; a control's broken engine (at the engine interface,
    ``clipped_sum``) or privatizer replaces the real one."""

    def __init__(self, inner, control=None):
        self.inner = inner
        self.start_recording(control)
        if control is not None:
            inner.engine = control.wrap_engine(inner.engine, inner.model)

    def release(self, idx, privatizer, scale):
        if pinned(privatizer):
            out = self.inner.release(idx, privatizer, scale)
            self.adopt(idx, out)
            return out
        privatizer = self.releasing(privatizer)
        self.params_before.append([p.detach().clone() for p in self.inner.params])
        self.before_release()
        out = self.inner.release(idx, self.tapped(privatizer), scale)
        ctx = out.ctx
        flat = _flat(ctx.noisy)
        square = None if ctx.noisy_square is None else _flat(ctx.noisy_square)
        s = None if scale is None else _flat(scale)
        self.records.append(
            StepRecord(torch.as_tensor(idx).clone(), s, flat.clone(), square, ctx.noise_std, ctx)
        )
        return out

    def before_release(self) -> None:
        """What a subclass keeps of the model before each release (nothing here)."""

    def tapped(self, privatizer):
        """The privatizer the inner backend releases through (a subclass may tap its input)."""
        return privatizer

    def __getattr__(self, name):
        return getattr(self.inner, name)


class _SumTap:
    """A privatizer whose ``release_sum`` first keeps a copy of the clipped sum it is given (float64, flattened), then
    releases it as the wrapped privatizer does; everything else is the wrapped privatizer's."""

    def __init__(self, inner):
        self.inner = inner
        self.summed: torch.Tensor | None = None

    def release_sum(self, summed, scale=None):
        self.summed = _flat(summed)  # a copy: release_sum consumes its input in place
        return self.inner.release_sum(summed, scale)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class FinetuneRecorder(ModelRecorder):
    """:class:`ModelRecorder` for a fine-tuning method: before each release also every tensor the model holds
    (``states``: trainable and frozen parameters, buffers, by state-dict name; what the engine sees), the clipped
    sum the engine hands the privatizer (``clipped``: sum_i clip(s g_i; C), before division by B and the noise) and
    a copy of the release as the variant received it (``noisy``)."""

    def __init__(self, inner, control=None):
        super().__init__(inner, control)
        self.states: list[dict[str, torch.Tensor]] = []
        self.clipped: list[torch.Tensor] = []
        self.noisy: list[list[torch.Tensor]] = []
        self.noisy_square: list[list[torch.Tensor] | None] = []
        self._tap: _SumTap | None = None

    def before_release(self) -> None:
        from dp_adam_bench.audit.meter.oracle import state_of

        self.states.append(state_of(self.inner.model))

    def tapped(self, privatizer):
        self._tap = _SumTap(privatizer)
        return self._tap

    def release(self, idx, privatizer, scale):
        if pinned(privatizer):
            return super().release(idx, privatizer, scale)
        out = super().release(idx, privatizer, scale)
        tap, self._tap = self._tap, None
        numel = sum(p.numel() for p in self.inner.params)
        self.clipped.append(tap.summed if tap.summed is not None else torch.zeros(numel, dtype=torch.float64))
        ctx = out.ctx
        self.noisy.append([g.detach().clone() for g in ctx.noisy])
        sq = ctx.noisy_square
        self.noisy_square.append(None if sq is None else [g.detach().clone() for g in sq])
        return out


def watched(run, checks: bool):
    """The prepared model ``run`` with the engine watch (engine/watch.py) as the meter runs it: off when the meter
    measures the engine on its own (``checks`` False; the start-up checks ran on the honest engine in
    ``prepare``), else every :data:`WATCH_EVERY` steps."""
    if not checks or run.watch is None:
        return dataclasses.replace(run, watch=None)
    run.watch.every = WATCH_EVERY
    return run


def recorder(run, control) -> ModelRecorder:
    """:class:`ModelRecorder` around the run's backend; the control's engine is checked by the run's own engine
    watch from its first step on, as it would be had the run been built with it (``prepare`` checked the honest
    engine before the control replaced it)."""
    out = ModelRecorder(run.backend, control)
    if run.watch is not None and control is not None and control.engine_bug is not None:
        run.watch.seen_step = None
    return out
