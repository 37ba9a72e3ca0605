"""Nothing leaves a step except through the noise: the post-processing check, made while the run trains.

Differential privacy of the whole run rests on one property of each step (Dwork & Roth 2014, Prop. 2.1,
post-processing; the adaptive composition of Abadi et al. 2016, arXiv:1607.00133, Sec. 3, and of Ganesh, McMahan &
Thakurta 2025, Alg. 1): everything the step emits — the parameter update, the optimizer variant's state, a
fine-tuning method's own state (RGP's carriers and residual weights), any tensor the model keeps, the metrics row
the trainer logs — depends on the private batch only through the noisy release ``g~_t``. The privatizer makes that
release; everything after it must be a function of ``g~_t``, the public state before the step and public randomness.

A unit test checks that property of the code as written; this check tests it on the user's model, method and
trainer as they run (:class:`PostProcessingCheck`). At a checked step, after the real release ``g~_t``:

1. *another world*: the model, the random streams (global, task, side information) and the variant are put back as
   they were before the step; another private batch (drawn by the check's own generator, Poisson at the run's rate)
   goes through the same clipping engine and privatizer, but the privatizer is *pinned* to the real release: the
   variant receives the very same ``g~_t``, while every private quantity the step computes on the way (the clipped
   sum, the per-example norms, what the engine and the backend keep) is the other batch's. The post-release part
   (side information, the learning rate, the variant's update, the registered emitters such as the trainer's metrics
   row) runs on a copy of the variant and its state;
2. *the real world*: everything is put back again, the real batch goes through the pinned privatizer once more (so
   the leftovers are the real batch's), and the real post-release part runs on the run's own variant and state;
3. the two worlds' emitted values are compared **bit for bit**. A difference is a private quantity leaving the step
   outside the noise: :class:`PostProcessingLeak` names the field and stops the run before the next release.

The real world's result is the run's result: an honest step's output is bit-identical with or without the check
(tested), so the check changes nothing it does not stop.

What it compares (``emitted``): every tensor of ``model.state_dict()`` (trainable and frozen parameters, buffers),
plain tensor attributes hung on modules, the variant's state (recursively), the variant object's own attributes
(numbers and tensors, recursively through wrapped variants), and each emitter's row (keys under ``diag/`` are the
labelled private diagnostics, excluded by name: they go to ``private_diagnostics.jsonl``, never to shared logs).
An emitter reads the step's :class:`~dp_adam_bench.engine.session.StepResult` of its own world: the diagnostics it
carries (the per-example ``norms``, ``frac_clipped``, the batch's ``loss_nonprivate``) are that world's batch's, so
a row that shares one under any other key differs between the worlds and stops the run.

What it cannot see: a leak on a step it does not check (it runs at the first step, the first step after a resume,
and periodically within ``budget`` of the training time, 2 % by default, or ``every`` N steps); a leak whose value
happens to coincide for the two batches (e.g. a fraction clipped of 1.0 in both); a quantity written somewhere it
does not read (a file, a global variable, a module attribute that is not a tensor or number, the Python logging
module, a callback's own state outside the registered emitters); evaluation metrics (they are a function of the
parameters, compared here, and of held-out data, which it assumes is not the private training set); anything before
the release (clipping, sampling and the noise are the engine watch's, the participation ledger's and the noise
check's). Its cost: two extra passes of the engine over a batch and one extra update per check, and one copy of the
model's tensors, two while comparing (the time is measured in ``describe()``).
"""

from __future__ import annotations

import copy
import math
import numbers
import time
from dataclasses import dataclass, fields, is_dataclass

import torch
from torch import nn

from dp_adam_bench.engine.seeds import task_rng_state
from dp_adam_bench.errors import PrivacyMismatch

DEFAULT_BUDGET = 0.02
#: keys under this prefix are labelled private diagnostics: never shared, so not part of what a step emits
DIAGNOSTIC_PREFIX = "diag/"


class PostProcessingLeak(PrivacyMismatch):
    """A value the step emits changed when only the private batch behind the same noisy release changed: one line
    naming the field, raised before the next release."""


# --- what a step emits --------------------------------------------------------------------------------------------
def _walk(value, path: str, out: dict, skip: set[int], seen: set[int], depth: int = 0, keep=None) -> None:
    """Numbers and tensors reachable from ``value`` (dicts, lists, tuples, dataclasses, plain objects), by path;
    ids in ``skip`` (the model's tensors and modules, read through its state dict) are not entered. ``keep``: how a
    tensor is kept (a copy, or the live tensor)."""
    if depth > 12 or id(value) in skip:
        return
    if isinstance(value, torch.Tensor):
        out[path] = keep(value.detach())
        return
    if isinstance(value, bool | numbers.Number):
        out[path] = value
        return
    if value is None or isinstance(value, str | bytes | torch.dtype | torch.device | torch.Generator):
        return
    if isinstance(value, nn.Module) or callable(value) and not hasattr(value, "__dict__"):
        return
    if id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, dict):
        for k, v in value.items():
            _walk(v, f"{path}[{k!r}]", out, skip, seen, depth + 1, keep)
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            _walk(v, f"{path}[{i}]", out, skip, seen, depth + 1, keep)
    elif is_dataclass(value) and not isinstance(value, type):
        for f in fields(value):
            _walk(getattr(value, f.name, None), f"{path}.{f.name}", out, skip, seen, depth + 1, keep)
    elif hasattr(value, "__dict__") and not isinstance(value, type):
        for k, v in vars(value).items():
            _walk(v, f"{path}.{k}", out, skip, seen, depth + 1, keep)


def model_skip(model: nn.Module | None, params) -> set[int]:
    """Ids the walk of the variant does not enter: the model's modules, parameters and buffers (read through the
    model's own state dict) and the trained tensors."""
    skip = {id(p) for p in params}
    if model is not None:
        skip |= {id(m) for m in model.modules()}
        skip |= {id(t) for t in model.parameters()} | {id(t) for t in model.buffers()}
    return skip


def emitted(
    model: nn.Module | None, params, state, variant, rows: dict[str, dict], copy: bool = True
) -> dict:
    """Everything one step leaves behind, by name (module docstring): copies, or (``copy=False``) the live tensors
    of a world that is not changed before the comparison."""

    def keep(t):
        return t.detach().clone() if copy else t.detach()

    out: dict = {}
    if model is not None:
        for name, t in model.state_dict(keep_vars=True).items():
            out[f"model {name}"] = keep(t)
        for mname, module in model.named_modules():
            for k, v in vars(module).items():
                if isinstance(v, torch.Tensor) and not k.startswith("_"):
                    out[f"model {mname}.{k} (a tensor attribute)"] = keep(v)
    else:
        for i, p in enumerate(params):
            out[f"parameter {i}"] = keep(p)
    skip = model_skip(model, params)
    _walk(state, "variant state", out, skip, set(), keep=keep)
    _walk(variant, f"variant {type(variant).__name__}", out, skip | {id(state)}, set(), keep=keep)
    for name, row in rows.items():
        for k, v in row.items():
            if not str(k).startswith(DIAGNOSTIC_PREFIX):
                out[f"{name} {k!r}"] = v
    return out


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.dtype.is_floating_point or a.dtype.is_complex:  # bits: NaN == NaN, -0.0 != 0.0
            a, b = a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
        return bool(torch.equal(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def first_difference(real: dict, other: dict) -> str | None:
    """The first field whose value differs between the two worlds (or that only one of them emits), or None."""
    for key in real.keys() | other.keys():
        if key not in real or key not in other:
            return f"{key} (emitted in one world only)"
    for key in real:
        if not _same(real[key], other[key]):
            return key
    return None


# --- the random streams a step reads ----------------------------------------------------------------------------
@dataclass
class _RandomState:
    torch_cpu: torch.Tensor
    cuda: list[torch.Tensor] | None
    task: dict
    side: torch.Tensor

    @classmethod
    def take(cls, session) -> _RandomState:
        cuda = (
            torch.cuda.get_rng_state_all()
            if torch.cuda.is_available() and torch.cuda.is_initialized()
            else None
        )
        return cls(
            torch.get_rng_state(),
            cuda,
            {k: v.clone() for k, v in task_rng_state(session.run).items()},
            session.side_gen.get_state(),
        )

    def put(self, session) -> None:
        torch.set_rng_state(self.torch_cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        if self.task:
            session.run.task.load_rng_state(self.task)
        session.side_gen.set_state(self.side)


class _ModelTensors:
    """A copy of every tensor of the model's state dict (or the trained tensors of a toy task), put back in place."""

    def __init__(self, model: nn.Module | None, params):
        live = list(model.state_dict(keep_vars=True).values()) if model is not None else list(params)
        self.live = [t for t in live if isinstance(t, torch.Tensor)]
        self.saved = [t.detach().clone() for t in self.live]

    def put(self) -> None:
        with torch.no_grad():
            for t, s in zip(self.live, self.saved, strict=True):
                t.copy_(s)


# --- the check ----------------------------------------------------------------------------------------------------
class PostProcessingCheck:
    """Replays checked steps in another world and compares what they emit (module docstring). ``population``: the
    private examples' dataset indices; ``rate``: the Poisson rate of the other batch (the plan's expected batch size
    over N); ``settings``: ``every`` (``"auto"``: within ``budget`` of the training time; an int: every N steps; 0:
    only at the start and after a resume) and ``budget``."""

    def __init__(self, population: torch.Tensor, rate: float, seed: int, settings=None):
        settings = settings or {}
        self.population = population
        self.rate = min(max(float(rate), 0.0), 1.0)
        self.generator = torch.Generator().manual_seed(int(seed))
        every = settings.get("every", "auto")
        self.every = every if every == "auto" else int(every)
        self.budget = float(settings.get("budget", DEFAULT_BUDGET))
        if not (math.isfinite(self.budget) and 0 <= self.budget <= 1):
            raise ValueError(f"train.post_processing_check.budget={self.budget} must be in [0, 1]")
        self.pending = "start"  # the first step of a run, and the first after a resume, are always checked
        self.spent = 0.0
        self.trained = 0.0
        self.last_cost = 0.0
        self.checks: list[dict] = []
        self.earlier_checks = 0

    # schedule
    def due(self, step: int) -> str | None:
        """Why the step after ``step`` is checked, or None."""
        if self.pending:
            return self.pending
        if self.every == "auto":
            return "periodic" if self.spent + self.last_cost <= self.budget * self.trained else None
        return "periodic" if self.every and step % self.every == 0 else None

    def after_step(self, seconds: float) -> None:
        self.trained += seconds

    def other_batch(self, exclude_size: int) -> torch.Tensor:
        """Another private batch (dataset indices): Poisson at the run's rate, inclusion drawn in float64 (a float32
        draw rounds q); never empty when the population is not, so the other world clips something."""
        n = len(self.population)
        pick = torch.nonzero(
            torch.rand(n, generator=self.generator, dtype=torch.float64, device="cpu") < self.rate
        ).flatten()
        if not len(pick) and n:
            pick = torch.randint(n, (max(1, exclude_size),), generator=self.generator).unique()
        return self.population[pick]

    # the replay
    def replay(self, session, idx: torch.Tensor, release, scale, before) -> tuple:
        """Run the checked step's two worlds (module docstring) after the real ``release``; returns the real world's
        ``(release, emitted rows)`` with its update applied to the run's variant and state. ``before``: the model's
        tensors and random state taken just before the real release."""
        t0 = time.perf_counter()
        tensors, rng_before = before
        rng_after = _RandomState.take(session)
        pinned = release.ctx
        backend, model = session.backend, session.model
        other_idx = self.other_batch(len(idx))

        # the other world: same release, another private batch, a copy of the variant and its state
        tensors.put()
        rng_before.put(session)
        other = session.privatizer.pinned_release(
            pinned, lambda: backend.release(other_idx, session.privatizer, scale)
        )
        rng_after.put(session)
        own = session.variant, session.state
        variant, state = _copy_variant(*own, model, session.params)
        session.variant, session.state = variant, state  # what the emitters read is this world's
        try:
            session.post_release(other.ctx, variant, state)
            rows = session.emit(other_idx, other)
        finally:
            session.variant, session.state = own
        world_other = emitted(model, session.params, state, variant, rows)
        del variant, state

        # the real world, again: the real batch's leftovers, the run's own variant and state
        tensors.put()
        rng_before.put(session)
        real = session.privatizer.pinned_release(
            pinned, lambda: backend.release(idx, session.privatizer, scale)
        )
        rng_after.put(session)
        session.post_release(real.ctx, session.variant, session.state)
        rows = session.emit(idx, real)
        world_real = emitted(model, session.params, session.state, session.variant, rows, copy=False)

        field = first_difference(world_real, world_other)
        cost = time.perf_counter() - t0
        self.spent += cost
        self.last_cost = cost
        record = {"step": int(session.steps_done), "reason": self.pending or "periodic", "seconds": cost}
        record["fields"] = len(world_real)
        self.pending = None
        if field is not None:
            record["failed"] = field
            self.checks.append(record)
            raise PostProcessingLeak(
                f"post-processing check at step {session.steps_done}: {field} differs between two private batches "
                "behind the same noisy release, so it depends on private data outside the noise (the run stopped "
                "before the next release; fix the code that computes it from the clipped or clean gradient, the "
                "batch or the per-example norms, or label it a diagnostic under 'diag/')"
            )
        self.checks.append(record)
        return real, rows

    # record and state
    def describe(self) -> dict:
        failed = [c for c in self.checks if "failed" in c]
        return {
            "checks": self.earlier_checks + len(self.checks),
            "at_steps": [c["step"] for c in self.checks],
            "fields_compared": max((c["fields"] for c in self.checks), default=0),
            "failed": failed[0]["failed"] if failed else None,
            "seconds": self.spent,
            "share_of_training_time": self.spent / self.trained if self.trained else None,
            "schedule": {"every": self.every, "budget": self.budget},
            "note": "each checked step replayed with another private batch behind the same noisy release: the "
            "parameters, buffers, the variant's and the method's state and the logged row must be bit-identical",
        }

    def state_dict(self) -> dict:
        return {
            "generator": self.generator.get_state(),
            "spent": self.spent,
            "trained": self.trained,
            "checks": self.earlier_checks + len(self.checks),
        }

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"].cpu())
        self.spent, self.trained = float(state["spent"]), float(state["trained"])
        self.earlier_checks = int(state["checks"])
        self.pending = "resume"


def _copy_variant(variant, state, model, params):
    """A deep copy of the variant and its state (together, so that a wrapper holding the state, as RGP's does,
    holds the copy), sharing the model, its modules and its tensors with the run."""
    memo = {i: obj for i, obj in _shared_objects(model, params)}
    return copy.deepcopy((variant, state), memo)


def _shared_objects(model, params):
    for p in params:
        yield id(p), p
    if model is not None:
        for m in model.modules():
            yield id(m), m
        for t in list(model.parameters()) + list(model.buffers()):
            yield id(t), t


def build(run, plan, variant, seeds) -> PostProcessingCheck | None:
    """The run's check (``train.post_processing_check``: ``enabled``, ``every``, ``budget``), or None for a run with
    nothing private to protect (no noise) or a variant marked non-private (it reads the clean gradient by design)."""
    settings = dict(run.cfg.train.get("post_processing_check") or {})
    if not settings.pop("enabled", True) or not (plan.noisy and plan.sigma > 0) or not variant.private:
        return None
    rate = plan.sampler.expected_batch_size / max(1, len(run.population))
    return PostProcessingCheck(run.population, rate, int(seeds.check) ^ _CHECK_STREAM, settings)


_CHECK_STREAM = 0x706F7374  # "post": the other batches' generator, apart from the engine watch's


def before_release(session) -> tuple[_ModelTensors, _RandomState]:
    """What a checked step's replay puts back: the model's tensors and the random streams, just before the release."""
    return _ModelTensors(session.model, session.params), _RandomState.take(session)


def refuse_unreleased(
    where: str,
    step: int,
    logs: dict,
    certified: dict,
    public: frozenset[str] = frozenset(),
    public_prefixes: tuple[str, ...] = (),
    diagnostics: bool = False,
) -> None:
    """The release boundary of a logger: every value in ``logs`` (what ``where`` shares at ``step``) is one the
    check compared (``certified``: the emitters' rows, an evaluation's output, each with the value logged), or
    public by name (``public``: the epsilon spent, ...; ``public_prefixes``); ``diagnostics``: whether ``diag/``
    keys are allowed (they go to the run folder's private file, never to a shared logger). Anything else is a
    statistic no check compared: :class:`PostProcessingLeak`, one line naming it."""
    for key, value in logs.items():
        if key in certified:
            if not _same(value, certified[key]):
                raise PostProcessingLeak(
                    f"{where}: {key!r} = {value!r} at step {step} is not the value the post-processing check "
                    f"compared ({certified[key]!r}): log the emitter's row as it is"
                )
        elif str(key).startswith(DIAGNOSTIC_PREFIX):
            if not diagnostics:
                raise PostProcessingLeak(
                    f"{where}: {key!r} at step {step} is a diagnostic of the private batch, and {where} shares what "
                    "it logs: keep it out of the logs (the run folder's private_diagnostics.jsonl holds diagnostics)"
                )
        elif key not in public and not str(key).startswith(public_prefixes):
            raise PostProcessingLeak(
                f"{where}: {key!r} at step {step} is not a released quantity (no emitter makes it, and it is not "
                "epsilon, an evaluation on held-out data or the run's speed): a statistic of the private batch "
                "in the logs spends privacy no accountant counts; compute it from the released step in an emitter "
                "(PrivateTraining.add_emitter) or label it a diagnostic under 'diag/'"
            )
