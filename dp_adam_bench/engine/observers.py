"""The checks that watch every step of a :class:`~dp_adam_bench.engine.session.PrivateTraining`, behind one
protocol (issue 59).

A check is a :class:`StepObserver`: a ``name`` (its key in a checkpoint) and hooks the session calls in order at
every step, each of which may stop the run by raising a :class:`~dp_adam_bench.errors.PrivacyMismatch` (one line):

1. :meth:`~StepObserver.before_step` ``(session, step)``: before the batch of step ``step + 1`` is drawn;
2. :meth:`~StepObserver.on_batch` ``(session, idx)``: the drawn batch (the sampler's indices into the private
   population), before its release;
3. :meth:`~StepObserver.after_record` ``(session, step)``: the step released and recorded in the privacy ledger;
4. :meth:`~StepObserver.after_step` ``(session, step, seconds)``: after the update, ``seconds`` the step's time;

and :meth:`~StepObserver.state_dict` / :meth:`~StepObserver.load_state_dict` ``(state, steps)``, saved under its
name (``state`` None: a checkpoint written before the check existed, after ``steps`` steps). The session holds
them as a list (:attr:`PrivateTraining.observers`); a new check is one class and one
:meth:`PrivateTraining.add_observer` call. The adapters below put the run's own checks behind it: the engine
watch (:mod:`dp_adam_bench.engine.watch`), the participation ledger (:mod:`dp_adam_bench.engine.participation`),
the noise check (:mod:`dp_adam_bench.engine.noise_check`), the post-processing check's bookkeeping
(:mod:`dp_adam_bench.engine.post_processing`; its replay wraps the release itself and stays in the step) and the
moved check (:mod:`dp_adam_bench.finetune.moved`). Opacus' ``GradSampleModule`` hooks and optax's chained
transforms play the same role for theirs; none of them has a per-step check list with checkpointed state.
"""

from __future__ import annotations


class StepObserver:
    """A check on every step (module docstring). Every hook does nothing unless overridden."""

    name = "observer"

    def before_step(self, session, step: int) -> None:
        """Before the batch of step ``step + 1`` is drawn."""

    def on_batch(self, session, idx) -> None:
        """The drawn batch ``idx`` (the sampler's indices into the private population), before its release."""

    def after_record(self, session, step: int) -> None:
        """Step ``step`` released and recorded in the session's privacy ledger."""

    def after_step(self, session, step: int, seconds: float) -> None:
        """After step ``step``'s update; ``seconds``: the step's time as the session measured it."""

    def state_dict(self) -> dict | None:
        return None

    def load_state_dict(self, state: dict | None, steps: int) -> None:
        """Restore :meth:`state_dict`'s output; None for a checkpoint written before this check (``steps`` done)."""


class WatchObserver(StepObserver):
    """The engine watch: a check before a release when due, on the batch's outliers once drawn."""

    name = "watch"

    def __init__(self, watch):
        self.watch = watch

    def before_step(self, session, step: int) -> None:
        self.watch.before_step(step)

    def on_batch(self, session, idx) -> None:
        self.watch.note_batch(session.run.population[idx])

    def after_step(self, session, step: int, seconds: float) -> None:
        self.watch.after_step(step, seconds)

    def state_dict(self) -> dict:
        return self.watch.state_dict()

    def load_state_dict(self, state: dict | None, steps: int) -> None:
        if state is not None:
            self.watch.load_state_dict(state)


class ParticipationObserver(StepObserver):
    """The participation ledger: which examples each step read (reconciled with the privacy ledger later)."""

    name = "participation"

    def __init__(self, ledger):
        self.ledger = ledger

    def on_batch(self, session, idx) -> None:
        self.ledger.observe(idx)

    def state_dict(self) -> dict:
        return self.ledger.state_dict()

    def load_state_dict(self, state: dict | None, steps: int) -> None:
        if state is not None:
            self.ledger.load_state_dict(state)
        else:  # the steps before it existed were not observed
            self.ledger.mark_unobserved(steps)


class NoiseObserver(StepObserver):
    """The noise check: each release's noise against the ledger's multiplier (a mismatch stops the run before the
    next release)."""

    name = "noise_check"

    def __init__(self, noise_check):
        self.noise_check = noise_check

    def after_record(self, session, step: int) -> None:
        self.noise_check.check_step(session.plan, session.ledger, step)

    def state_dict(self) -> dict:
        return self.noise_check.state_dict()

    def load_state_dict(self, state: dict | None, steps: int) -> None:
        if state is not None:
            self.noise_check.load_state_dict(state)


class PostProcessingObserver(StepObserver):
    """The post-processing check's budget and record (its replay of a due step is part of the step itself); the
    first step after a resume is checked, whatever the checkpoint holds."""

    name = "post_processing_check"

    def __init__(self, check):
        self.check = check

    def after_step(self, session, step: int, seconds: float) -> None:
        self.check.after_step(seconds)

    def state_dict(self) -> dict:
        return self.check.state_dict()

    def load_state_dict(self, state: dict | None, steps: int) -> None:
        if state is not None:
            self.check.load_state_dict(state)
        self.check.pending = "resume"


class MovedObserver(StepObserver):
    """Every trainable tensor moved within the first steps (an adapter never updated stops the run)."""

    name = "moved_check"

    def __init__(self, moved):
        self.moved = moved

    def after_step(self, session, step: int, seconds: float) -> None:
        # a step counts when it read examples or added noise (an empty Poisson batch without noise moves nothing)
        counts = session.last_batch_size > 0 or (session.plan.noisy and session.plan.sigma > 0)
        self.moved.after_step(step, session.plan.steps, counts)

    def state_dict(self) -> dict:
        return self.moved.state_dict()

    def load_state_dict(self, state: dict | None, steps: int) -> None:
        if state is not None:
            self.moved.load_state_dict(state)
