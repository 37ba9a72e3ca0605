"""One private training run, a step at a time: the object the CLI trainer and the public API
(:func:`dp_adam_bench.make_private`) both drive.

A :class:`PrivateTraining` is made from a prepared :class:`~dp_adam_bench.engine.trainer.Run` (the task's model or
parameters, the optimizer variant and the privacy plan, all validated). Each :meth:`PrivateTraining.step`

1. draws the next logical batch from the plan's sampler (the sampling the accountant assumes),
2. clips each example's gradient and sums (a clipping engine over physical micro-batches, or a toy task's
   closed-form per-example gradients; :mod:`dp_adam_bench.engine.backends`),
3. makes every noisy release the variant asked for (:class:`~dp_adam_bench.engine.privatizer.Privatizer`: the
   mechanism's noise, divided by the *expected* batch size),
4. updates the parameters with the variant, at the learning rate ``train.lr_schedule`` gives the step, and
5. records the step in the privacy ledger, and the batch and the noise streams' releases in the participation
   ledger (reconciled with the privacy ledger by :meth:`PrivateTraining.participation_report`).

The checks on every step (the engine watch, the participation ledger, the noise check, the post-processing check's
bookkeeping, the moved check, and any a caller adds with :meth:`PrivateTraining.add_observer`) are observers
(:mod:`dp_adam_bench.engine.observers`): hooks before the batch is drawn, on the batch, after the step is recorded
and after the update, each able to stop the run, and a state saved under the check's name.

:meth:`state_dict` / :meth:`load_state_dict` hold everything a resumed run needs to continue exactly as the
uninterrupted one would have: parameters, the variant's state, the noise mechanisms' generators and buffers, the
sampler's state, the ledger, the participation ledger (what the sampler and the noise streams did,
:mod:`dp_adam_bench.engine.participation`), the diagnostics' shadow moments, the engine watch's state and the
random streams (dropout, side information, the watch's check examples, the task's own generators such as
cifar10_cnn's augmentation: ``tasks/base.py``). With them go digests of every generator of the run, taken from the
live generators when the state is saved; :meth:`load_state_dict` recomputes them from the live generators once
everything is restored and refuses to resume on a difference (:func:`verify_restored_generators`), so restore code
that forgets a generator (a resumed run redrawing the noise of steps 1, 2, ..., whose releases then differ by no
noise at all) stops the run instead of passing unnoticed.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from dp_adam_bench.engine import post_processing
from dp_adam_bench.engine.diagnostics import Diagnostics
from dp_adam_bench.engine.distributed import SharedNoise
from dp_adam_bench.engine.noise_check import NoiseCheck
from dp_adam_bench.engine.observers import (
    MovedObserver,
    NoiseObserver,
    ParticipationObserver,
    PostProcessingObserver,
    StepObserver,
    WatchObserver,
)
from dp_adam_bench.engine.participation import ParticipationLedger, reconcile
from dp_adam_bench.engine.privatizer import Privatizer
from dp_adam_bench.engine.seeds import RunSeeds, task_rng_state
from dp_adam_bench.finetune.moved import DEFAULT_AFTER, MovedCheck
from dp_adam_bench.privacy.accounting import AccountantFailure, PrivacyLedger
from dp_adam_bench.privacy.noise_factory import build_mechanisms

log = logging.getLogger(__name__)

#: The keys of :meth:`PrivateTraining.state_dict` that :meth:`~PrivateTraining.load_state_dict` requires (a
#: checkpoint's payload adds its step and fingerprint).
STATE_KEYS = (
    "step",
    "params",
    "variant",
    "privatizer",
    "sampler",
    "ledger",
    "diagnostics",
    "torch_rng",
    "side_rng",
    "torch_rng_ranks",
)
#: The keys :meth:`PrivateTraining.state_dict` adds that older checkpoints lack. Such a checkpoint still loads:
#: ``plan`` is not checked, ``participation`` is marked unobserved, the engine watch and the noise check start
#: afresh, and a log warning says that the task's generators are not restored and the generators not verified.
#: ``task_rng``: every rank's task random state (``tasks/base.py``); ``watch``: the engine watch's state (its
#: check-examples generator, :mod:`dp_adam_bench.engine.watch`) and ``noise_check`` the noise check's record (None
#: without them); ``rng_fingerprints``: a digest of every live generator, checked after a load; ``moved_check``:
#: the starting digests of the trainable tensors and the check's result (finetune/moved.py).
#: the checks' states, each under its observer's name (:mod:`dp_adam_bench.engine.observers`)
OBSERVER_KEYS = ("participation", "watch", "noise_check", "moved_check", "post_processing_check")
OPTIONAL_STATE_KEYS = (
    "plan",
    "participation",
    "task_rng",
    "watch",
    "noise_check",
    "rng_fingerprints",
    "moved_check",
    "post_processing_check",
)


class TrainingComplete(RuntimeError):
    """:meth:`PrivateTraining.step` after the plan's last step (its step count, or the epsilon budget's)."""


@dataclass
class StepResult:
    """What one step did. ``diagnostics`` holds clean-gradient diagnostics (``diag/`` keys, not private outputs),
    empty unless diagnostics are on and due at this step.

    ``norms`` and :attr:`frac_clipped` are diagnostic too: computed on the private batch and not released by the
    mechanism (only the noisy sum is), so publishing them spends privacy the accountant does not count. ``norms``:
    each example's gradient norm before clipping (in the scaled geometry of a scale-then-privatize variant), on the
    model's device, in the order the micro-batches ran; data-parallel, this rank's share. None for closed-form toy
    tasks.

    ``loss_nonprivate`` is diagnostic as well, and says so in its name: the mean loss of the step's logical batch
    (this rank's share, data-parallel), as a 0-dim tensor on the model's device (``float()`` waits for the
    device), computed by the step's own forward before any clipping or noise, at the parameters before the update.
    It is a function of the private batch that the mechanism does not release: reading it is free, publishing it
    (a log, a dashboard, a stopping rule) spends privacy the accountant does not count. The post-processing check
    (:mod:`dp_adam_bench.engine.post_processing`) compares what an emitter's row shares, where it may appear only
    under a ``diag/`` key (a labelled diagnostic, excluded by name, kept in ``private_diagnostics.jsonl``). None
    for closed-form toy tasks (no loss is computed), for the loop and functorch clipping engines (their losses
    stay inside per-example autograd calls; bk, the default, ghost and hooks give it) and for an empty batch.

    ``q``: the plan's sampling rate (the Poisson and cyclic Poisson samplers' q, the shuffle sampler's B/N, the rate
    it is accounted at), public; None for the fixed-size samplers without one (single_pass, balls_in_bins)."""

    step: int
    batch_size: int
    diagnostics: dict
    norms: torch.Tensor | None = None
    clip: float | None = None  # the clip norm C of the step (None: a non-private run, nothing clipped)
    loss_nonprivate: torch.Tensor | None = None  # the batch's mean loss: diagnostic, not released (docstring)
    q: float | None = None  # the plan's sampling rate (None for a sampler without one)

    @property
    def frac_clipped(self) -> float | None:
        """Diagnostic: the fraction of this step's examples whose norm exceeded C (0.0 without clipping or for an
        empty batch; None for toy tasks). Reading it waits for the device (a host sync)."""
        if self.norms is None:
            return None
        if not self.clip or self.norms.numel() == 0:
            return 0.0
        return float((self.norms > self.clip).float().mean())


class PrivateTraining:
    """A private training run that advances one step per :meth:`step` call (see the module docstring).

    ``diagnostics``: an enabled :class:`Diagnostics` makes the privatizer keep the clean mean for it alone.
    """

    def __init__(self, run, diagnostics: Diagnostics | None = None):
        self.run = run
        self.plan = run.plan
        self.variant = run.variant
        self.backend = run.backend
        self.diagnostics = diagnostics
        self._model_task = self.backend.kind == "model"
        params, plan, ddp, seeds = self.backend.params, run.plan, run.ddp, run.seeds
        releases = self.variant.releases()
        mechanisms = []
        if plan.noisy and plan.sigma > 0:
            shapes = [p.shape for p in params]
            dtype, device = params[0].dtype, params[0].device
            if not ddp.active:
                mechanisms = build_mechanisms(
                    plan.strategy, shapes, releases.streams, seeds.noise, dtype, device
                )
            else:  # one noise draw per logical step for the whole world: rank 0's, broadcast (SharedNoise)
                own = (
                    build_mechanisms(plan.strategy, shapes, releases.streams, seeds.noise, dtype, device)
                    if ddp.is_main
                    else [plan.strategy.mechanism() for _ in range(releases.streams)]
                )
                mechanisms = [SharedNoise(m, ddp, shapes, dtype, device) for m in own]
        self.clip = float(run.cfg.privacy.clip) if plan.noisy else None
        self.privatizer = Privatizer(
            clip=self.clip,
            sigma=plan.sigma,
            expected_batch_size=plan.sampler.expected_batch_size,
            mechanisms=mechanisms,
            releases=releases,
            trial_dims=self.backend.trial_dims,
            keep_clean=bool(diagnostics is not None and diagnostics.enabled),
        )
        self.state = self.variant.init(params)
        self.base_lr = self.variant.lr
        self.ledger = plan.new_ledger()
        # what the sampler and the noise streams actually do, reconciled with the ledger (engine/participation.py)
        self.participation = ParticipationLedger(len(run.population), [m._gen for m in mechanisms])
        if run.public is not None:
            # every example a step reads is in the accounted population or in a public set disjoint from it, by
            # index and, where the task gives its examples' content, by content (engine/public_data.py)
            from dp_adam_bench.engine.public_data import check_disjoint

            check_disjoint(run)
        self.side_gen = torch.Generator().manual_seed(seeds.side)
        side = run.cfg.train.get("side_info") or {}
        self._side_batch = int(side.get("batch_size", 256))
        self.steps_done = 0
        self.last_batch_size = 0
        self._batches = None
        if self._model_task:
            _seed_global_rng(ddp, seeds, None)
        self.self_check = run.self_check  # the engine's self-check, made by trainer.prepare before any noise
        # the engine checked again on the weights training reaches, before the release it would vouch for
        self.watch = getattr(run, "watch", None)
        # the noise each release gets, measured and reconciled with the ledger's multiplier every step
        self.noise_check = None
        if mechanisms:
            sens = [self.clip / self.privatizer.B]
            if releases.square_sensitivity is not None:
                sens.append(releases.square_sensitivity(self.clip, self.privatizer.B))
            self.noise_check = NoiseCheck(plan.strategy, plan.sampler.steps, sens)
            self.noise_check.stop = run.cfg.train.get("noise_check", "stop") != "record"
            self.privatizer.noise_check = self.noise_check
        # every trainable tensor moved in the first steps (finetune/moved.py): an adapter the optimizer never
        # updates stops the run instead of reporting the pretrained model as trained
        # everything the step emits depends on the private batch through the noisy release alone, tested by
        # replaying checked steps with another private batch (engine/post_processing.py)
        self.emitters: dict = {}
        self.last_rows: dict | None = None
        self.post_check = post_processing.build(run, plan, self.variant, seeds)
        self.moved_check = None
        if self._model_task:
            after = run.cfg.train.get("moved_check", None)
            self.moved_check = MovedCheck(
                self._trained_tensors, DEFAULT_AFTER if after is None else int(after)
            )
        # the checks on every step, in the order their hooks run (engine/observers.py)
        self.observers: list[StepObserver] = []
        if self.watch is not None:
            self.add_observer(WatchObserver(self.watch))
        self.add_observer(ParticipationObserver(self.participation))
        if self.noise_check is not None:
            self.add_observer(NoiseObserver(self.noise_check))
        if self.moved_check is not None:
            self.add_observer(MovedObserver(self.moved_check))
        if self.post_check is not None:
            self.add_observer(PostProcessingObserver(self.post_check))

    def add_observer(self, observer: StepObserver) -> None:
        """Run ``observer``'s hooks at every step after those already added, and keep its state in checkpoints
        under its name (:mod:`dp_adam_bench.engine.observers`)."""
        if any(o.name == observer.name for o in self.observers):
            raise ValueError(f"an observer named {observer.name!r} is already registered")
        taken = set(STATE_KEYS) | set(OPTIONAL_STATE_KEYS)
        if observer.name in taken and observer.name not in OBSERVER_KEYS:
            # its state would overwrite the run's own in every checkpoint (the ledger, the parameters, ...)
            raise ValueError(
                f"an observer cannot be named {observer.name!r}: a checkpoint keeps the run's own state under it"
            )
        self.observers.append(observer)

    # --- what the run is ------------------------------------------------------------------------------------------
    @property
    def model(self):
        """The ``nn.Module`` being trained (model tasks); None for vectorised toy tasks."""
        return getattr(self.backend, "model", None)

    @property
    def params(self) -> list[torch.Tensor]:
        return self.backend.params

    @property
    def steps(self) -> int:
        """The number of steps the run will take (the plan's, capped by an epsilon budget)."""
        return self.plan.steps

    @property
    def done(self) -> bool:
        return self.steps_done >= self.plan.steps

    @property
    def sigma(self) -> float:
        return self.plan.sigma

    @property
    def q(self) -> float | None:
        """The plan's sampling rate (what the summary records as ``privacy_plan.sampling_rate``); None for the
        fixed-size samplers without one."""
        sampler = self.plan.sampler
        return float(sampler.q) if hasattr(sampler, "q") else None

    @property
    def notes(self) -> list[str]:
        return list(self.plan.notes)

    # --- training -----------------------------------------------------------------------------------------------
    def step(self) -> StepResult:
        """One private step; :class:`TrainingComplete` after the plan's last step."""
        if self._batches is None:
            start = self.steps_done
            self._batches = itertools.islice(
                self.plan.sampler.iter_from(start), max(0, self.plan.steps - start)
            )
        for o in self.observers:  # may stop the run (the engine watch: EngineCheckFailed) before any release
            o.before_step(self, self.steps_done)
        started = time.perf_counter()
        idx = next(self._batches, None)
        if idx is None:
            raise TrainingComplete(
                f"all {self.plan.steps} planned steps are done"
                + (
                    " (the epsilon budget stops the run there)"
                    if self.plan.steps < self.plan.sampler.steps
                    else ""
                )
            )
        # a due engine check runs on this batch's longest and shortest, before its release
        for o in self.observers:
            o.on_batch(self, idx)
        self.steps_done += 1
        run, variant, backend = self.run, self.variant, self.backend
        idx = run.population[idx]
        scale = variant.scale(self.state)  # once per logical step (stp); None for every other variant
        checked = self.post_check is not None and self.post_check.due(self.steps_done - 1)
        before = post_processing.before_release(self) if checked else None
        release = backend.release(idx, self.privatizer, scale)
        if checked:  # the step replayed behind the same release with another private batch (may stop the run)
            release, self.last_rows = self.post_check.replay(self, idx, release, scale, before)
        else:
            self.post_release(release.ctx, variant, self.state)
            self.last_rows = None
        ctx = release.ctx
        self.plan.record_step(self.ledger, self.steps_done)
        for o in self.observers:  # the noise check: a mismatch stops the run before the next release
            o.after_record(self, self.steps_done)
        self.last_batch_size = int(idx.numel())
        diag = None
        norms = getattr(backend, "last_norms", None)
        if release.clean is not None:
            diag = self.diagnostics.observe(
                dataclasses.replace(ctx, clean=release.clean),
                self.state,
                norms=norms,
                scale=scale,
                scale_eps=getattr(variant, "eps_s1", None),
            )
        seconds = time.perf_counter() - started
        for o in self.observers:  # the moved check may stop the run (NotTraining) after this step
            o.after_step(self, self.steps_done, seconds)
        loss = getattr(backend, "last_loss", None)
        return StepResult(self.steps_done, self.last_batch_size, diag or {}, norms, self.clip, loss, self.q)

    def post_release(self, ctx, variant, state) -> None:
        """What a step does after its noisy release ``ctx``: the public side information, the step's learning rate
        and the variant's update of the parameters and ``state``. Post-processing: it may read ``ctx``, the public
        data and the state before the step, nothing computed from the private batch
        (:mod:`dp_adam_bench.engine.post_processing` checks that while the run trains)."""
        run, backend = self.run, self.backend
        if run.public is not None:  # public side information: no clipping, no noise, no privacy cost
            pick = run.public[torch.randint(len(run.public), (self._side_batch,), generator=self.side_gen)]
            ctx.side = backend.public_grad(pick)
        # the schedule is a function of the step alone: a resumed run gets the same learning rates
        variant.lr = self.base_lr * run.schedule.factor(self.steps_done)
        with torch.no_grad():
            variant.update(backend.params, state, ctx)

    def add_emitter(self, name: str, row) -> None:
        """Register ``row(result) -> dict``: what the caller logs or shares after each step, built from the
        :class:`StepResult` and the session. The post-processing check calls it in both of its worlds and compares
        every key not under ``diag/`` (the labelled private diagnostics); the caller then logs what
        :meth:`emit_row` returns for the step, so what it shares is what the check compared."""
        self.emitters[name] = row

    def emit(self, idx: torch.Tensor, release) -> dict[str, dict]:
        """Every emitter's row for the step just taken with the batch ``idx`` (the post-processing check's worlds)."""
        if not self.emitters:
            return {}
        result = StepResult(  # this world's own leftovers: the norms and the loss of the batch ``idx``
            self.steps_done,
            int(idx.numel()),
            {},
            getattr(self.backend, "last_norms", None),
            self.clip,
            getattr(self.backend, "last_loss", None),
            self.q,
        )
        return {name: dict(row(result)) for name, row in self.emitters.items()}

    def emit_row(self, name: str, result: StepResult) -> dict:
        """The emitter ``name``'s row for ``result``; on a checked step, the row the check compared (built in the
        real world), else built now."""
        if result.step != self.steps_done:
            return dict(self.emitters[name](result))
        if self.last_rows is None:
            self.last_rows = {}
        if name not in self.last_rows:  # built once a step, then what every logger of the step reads
            self.last_rows[name] = dict(self.emitters[name](result))
        return dict(self.last_rows[name])

    def _trained_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) of what the variant updates: the trainable parameters, or a wrapper's own list (RGP's
        reconstructed weights, :class:`~dp_adam_bench.finetune.rgp.RGPVariant`)."""
        own = getattr(self.variant, "trained_tensors", None)
        if own is not None:
            return own()
        return [(n, p) for n, p in self.backend.model.named_parameters() if p.requires_grad]

    def check_engine(self, reason: str) -> dict:
        """The engine probe and self-check on the current weights now (:mod:`dp_adam_bench.engine.watch`; the
        trainer calls it at every checkpoint); {} for closed-form toy tasks. :class:`EngineCheckFailed` on a
        failure."""
        return self.watch.check(self.steps_done, reason) if self.watch is not None else {}

    def evaluate(self, final: bool = False) -> dict:
        """The task's metrics on its held-out data (a model in eval mode, without gradients; the next step puts it
        back in train mode). ``final``: the run's last evaluation (E2E decodes only then)."""
        return self.backend.evaluate(final=final)

    # --- privacy ------------------------------------------------------------------------------------------------
    def epsilon(self, accountant: str | None = None) -> dict[str, float] | float:
        """Epsilon spent so far at the plan's delta: a dict over every accountant that could compute it (a
        non-amplified run is charged its whole stream from step 0), or one accountant's value. A non-private
        run has no epsilon: ``{}`` (or ``inf`` for one accountant)."""
        if not self.plan.noisy:
            return {} if accountant is None else float("inf")
        if accountant is not None:
            return self.ledger.epsilon(self.plan.delta, accountant)
        return self.ledger.epsilons_with_errors(self.plan.delta)[0]

    def epsilon_so_far(self) -> dict:
        """``{"epsilon": value}`` under the plan's accountant for the metrics log; {} (and a warning) if it
        cannot be computed."""
        if not self.plan.noisy:
            return {}
        try:
            return {"epsilon": self.ledger.epsilon(self.plan.delta, self.plan.accountant)}
        except AccountantFailure as err:
            log.warning("epsilon under %s not computed: %s", self.plan.accountant, err)
            return {}

    def guarantee(self) -> dict:
        """Which accountant each privacy number uses: ``{"accountant": "rdp", "epsilon": ...}`` (the epsilon spent
        so far under ``accountant``), with ``epsilon_budget`` / ``budget_accountant`` and ``target_epsilon`` /
        ``target_accountant`` where set; a non-amplified run's budget or target is met exactly
        (``exact_gaussian``, its ``exact_gaussian_epsilon`` beside). {} for a non-private run."""
        return self.plan.guarantee(self.ledger)

    def participation_report(self) -> dict:
        """The participation ledger reconciled with the privacy ledger and the plan after the steps taken so far
        (:func:`~dp_adam_bench.engine.participation.reconcile`): ``{"verdict": "consistent" | "MISMATCH: ...",
        "checks": [...], ...}``; the trainer puts it in the summary as ``participation``."""
        streams = self.privatizer.releases.streams if self.privatizer.sigma > 0 else 0
        self.participation.observe_releases(self.privatizer.mechanisms)  # also before the first step
        self.participation.observe_generators([m._gen for m in self.privatizer.mechanisms])
        return reconcile(
            self.participation, self.plan, self.ledger, streams, self.steps_done, noise=self.noise_check
        )

    def check_participation(self) -> dict:
        """:meth:`participation_report`, raising :class:`~dp_adam_bench.errors.PrivacyMismatch` (one line) when
        what ran does not match what the guarantee was computed for."""
        from dp_adam_bench.errors import PrivacyMismatch

        report = self.participation_report()
        if report["verdict"] != "consistent":
            raise PrivacyMismatch(f"participation ledger: {report['verdict']}")
        return report

    # --- state --------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything resuming needs (:data:`STATE_KEYS`, :data:`OPTIONAL_STATE_KEYS`), with a digest of every
        generator of the run taken from the live objects (``rng_fingerprints``, :func:`rng_fingerprints`), which
        :meth:`load_state_dict` compares with the restored ones. Data-parallel, a collective: every rank calls it;
        the per-rank random state (global torch RNG, task generators) and its digests are every rank's."""
        shared, own = rng_fingerprints(self)
        # one collective for what each rank holds of its own: (global torch RNG, task random state, their digests)
        ranks = self.run.ddp.gather_objects((torch.get_rng_state(), task_rng_state(self.run), own))
        checks = {o.name: o.state_dict() for o in self.observers}
        return {
            "step": self.steps_done,
            "params": [p.detach().clone() for p in self.backend.params],
            "variant": self.state,
            "privatizer": self.privatizer.state_dict(),
            "sampler": self.plan.sampler.state_dict(),
            "ledger": self.ledger.to_dict(),
            "diagnostics": self.diagnostics.state_dict() if self.diagnostics is not None else None,
            "torch_rng": torch.get_rng_state(),
            "side_rng": self.side_gen.get_state(),
            "torch_rng_ranks": [r[0] for r in ranks],
            "plan": self.plan.describe(),  # what the ledger was accounted under (checked on load)
            # each check's state under its name (None: the run has no such check), in the order checkpoints
            # have always had them
            "participation": checks.pop("participation", None),
            "task_rng": [r[1] for r in ranks],
            **{k: checks.pop(k, None) for k in OBSERVER_KEYS if k != "participation"},
            **checks,  # the checks a caller added
            "rng_fingerprints": shared | {k: v for r in ranks for k, v in r[2].items()},
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict`'s output (of a run with the same configuration)."""
        missing = [k for k in STATE_KEYS if k not in state]
        if missing:
            raise ValueError(f"not a PrivateTraining state: missing {', '.join(missing)}")
        # its ledger and noise made under another privacy plan (another N, q, B, sampler, sigma, ...): refused in one
        # line naming what changed, before anything is loaded (engine/plan.py resume_refusal)
        from dp_adam_bench.engine.plan import resume_refusal
        from dp_adam_bench.errors import ConfigError

        refusal = resume_refusal(state.get("plan"), self.plan.describe())
        if refusal is not None:
            raise ConfigError(refusal)
        with torch.no_grad():
            for p, saved in zip(self.backend.params, state["params"], strict=True):
                p.copy_(saved.to(p.device))
        self.state = state["variant"]
        # a variant that keeps model weights in its state (RGP's reparametrized weights) writes them back
        restore = getattr(self.variant, "restore", None)
        if restore is not None:
            restore(self.state)
        self.privatizer.load_state_dict(state["privatizer"])
        self.plan.sampler.load_state_dict(state["sampler"])
        self.ledger = PrivacyLedger.from_dict(state["ledger"])
        if self.diagnostics is not None and state["diagnostics"] is not None:
            self.diagnostics.load_state_dict(state["diagnostics"])
        self.side_gen.set_state(state["side_rng"].cpu())
        self.steps_done = int(state["step"])
        self._batches = None
        if self._model_task:
            _seed_global_rng(self.run.ddp, self.run.seeds, state)
        for o in self.observers:  # None: a checkpoint written before the check existed
            o.load_state_dict(state.get(o.name), self.steps_done)
        older = _load_task_rng(self.run, state)
        if "rng_fingerprints" in state:  # everything restored: the live generators against the saved digests
            verify_restored_generators(self, state)
        else:
            older.append("the restored generators are not verified (it holds no generator fingerprints)")
        if older:
            log.warning(
                "the checkpoint of step %d was written by an older version: %s",
                self.steps_done,
                "; ".join(older),
            )

    def close(self) -> None:
        """Release the clipping engine's hooks (the model is left as it was given)."""
        self.backend.close()


def _seed_global_rng(ddp, seeds: RunSeeds, payload: dict | None) -> None:
    """The global torch RNG (dropout masks), a stream of its own (:mod:`dp_adam_bench.engine.seeds`). Rank r > 0
    gets its own stream too, since copies of rank 0's would give the examples at the same position on every rank
    the same dropout masks. A checkpoint holds every rank's state; resumed with another number of ranks, rank r > 0
    starts a fresh stream (the result then differs in dropout only, like any change of the world size)."""
    if payload is None:
        torch.manual_seed(seeds.dropout if ddp.is_main else _rank_seed(seeds, ddp.rank, 0))
        return
    ranks = payload.get("torch_rng_ranks") or []
    if ddp.is_main:
        torch.set_rng_state(payload["torch_rng"].cpu())
    elif len(ranks) == ddp.world:
        torch.set_rng_state(ranks[ddp.rank].cpu())
    else:
        torch.manual_seed(_rank_seed(seeds, ddp.rank, int(payload["step"])))


def _rank_seed(seeds: RunSeeds, rank: int, step: int) -> int:
    return int(np.random.SeedSequence([seeds.dropout, rank, step]).generate_state(1, np.uint64)[0] >> 1)


# --- random state: restoring the task's generators, and a digest of every generator of the run ---------------------
def _load_task_rng(run, state: dict) -> list[str]:
    """Restore this rank's task random state from ``state["task_rng"]`` (every rank's, in rank order); returns what
    an older checkpoint lacked, for the caller's warning. Resumed with another number of ranks, rank r > 0 keeps the
    stream it has (as :func:`_seed_global_rng` gives it a fresh one)."""
    names = sorted(task_rng_state(run))
    if not names:
        return []
    ddp, saved = run.ddp, state.get("task_rng")
    if saved is not None and len(saved) != ddp.world and not ddp.is_main:
        log.info(
            "rank %d: the checkpoint holds %d ranks' task random state: this rank's is not restored",
            ddp.rank,
            len(saved),
        )
        return []
    mine = (saved[ddp.rank] if len(saved) == ddp.world else saved[0]) if saved else None
    if not mine:
        return [
            f"it holds no task random state, so the task's generators ({', '.join(names)}) do not continue where the "
            "killed run's were (the resumed run differs from an uninterrupted one)"
        ]
    run.task.load_rng_state(mine)
    return []


def rng_fingerprints(training: PrivateTraining) -> tuple[dict[str, str], dict[str, str]]:
    """Digests (:func:`~dp_adam_bench.engine.participation.generator_fingerprint`) of every generator of the run,
    read from the live objects, as ``(shared, this rank's)``. Shared (the same on every rank): each noise stream's
    (held by rank 0 alone), the sampler's, the side information's and the engine watch's check examples'. This
    rank's own: the global torch RNG (model tasks; a toy task draws nothing from it, and it is not restored for
    one) and the task's generators."""
    from dp_adam_bench.engine.participation import generator_fingerprint

    shared = {}
    for i, m in enumerate(training.privatizer.mechanisms):
        if m._gen is not None:  # data-parallel ranks > 0 hold no noise generator
            shared[f"noise stream {i}"] = generator_fingerprint(m._gen)
    sampler_gen = getattr(training.plan.sampler, "generator", None)
    if isinstance(sampler_gen, torch.Generator):  # the other samplers draw from their seed alone
        shared["sampler"] = generator_fingerprint(sampler_gen)
    shared["side information"] = generator_fingerprint(training.side_gen)
    watch = getattr(training, "watch", None)
    if watch is not None:
        shared["check examples"] = generator_fingerprint(watch.generator)
    rank = training.run.ddp.rank
    own = {}
    if training._model_task:
        own[f"rank {rank} global (dropout)"] = generator_fingerprint(torch.default_generator)
    for name, value in task_rng_state(training.run).items():
        own[f"rank {rank} task {name!r}"] = generator_fingerprint(_SavedState(value))
    return shared, own


class _SavedState:
    """A generator state as :func:`generator_fingerprint` reads one."""

    def __init__(self, state: torch.Tensor):
        self.state = state

    def get_state(self) -> torch.Tensor:
        return self.state


def verify_restored_generators(training: PrivateTraining, state: dict) -> None:
    """After :meth:`PrivateTraining.load_state_dict` restored ``state``: recompute the digests of the live
    generators (:func:`rng_fingerprints`) and compare them with ``state["rng_fingerprints"]``, taken from the
    live generators when ``state`` was saved, so that restore code that forgets a generator is caught. Raises
    :class:`~dp_adam_bench.errors.PrivacyMismatch` for a noise stream or the sampler (a resumed run would redraw
    released noise, or other batches than the accountant's), :class:`~dp_adam_bench.engine.checkpoint.CheckpointError`
    for any other generator; one line naming the generator. This rank's own generators are checked only where they
    were restored (rank 0, or the same number of ranks)."""
    from dp_adam_bench.engine.checkpoint import CheckpointError
    from dp_adam_bench.errors import PrivacyMismatch

    saved = state["rng_fingerprints"]
    shared, own = rng_fingerprints(training)
    ddp = training.run.ddp
    live = shared | (own if ddp.is_main or len(state.get("torch_rng_ranks") or []) == ddp.world else {})
    wrong = [name for name, digest in live.items() if name in saved and saved[name] != digest]
    if not wrong:
        return
    privacy = [name for name in wrong if name.startswith("noise stream") or name == "sampler"]
    first = (privacy or wrong)[0]
    if first.startswith("noise stream"):
        why = "a resumed run would redraw noise it already released"
    elif first == "sampler":
        why = "a resumed run would not draw the batches the uninterrupted run draws"
    else:
        why = "a resumed run would not continue as the uninterrupted run"
    also = [name for name in wrong if name != first]
    raise (PrivacyMismatch if privacy else CheckpointError)(
        f"resume: the {first} generator after loading is not the one saved at step {int(state['step'])} (saved "
        f"{saved[first]}, restored {live[first]}): {why}"
        + (f" (also wrong: {', '.join(also)})" if also else "")
        + "; refusing to resume"
    )
