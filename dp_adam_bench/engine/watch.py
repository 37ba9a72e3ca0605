"""The engine watched over the whole run, not only on the fresh model (issue 44).

The engine probe (:mod:`dp_adam_bench.engine.probe`) and the self-check (:mod:`dp_adam_bench.engine.self_check`)
compare the clipping engine with autograd and with the size-one loop. Run once on the model as built, they miss
what the fresh weights hide: a parameter used outside its module behind a gate that starts at 0 (LLaMA-Adapter,
ControlNet, ReZero, LoRA's B = 0) has an exactly zero gradient at step 0, so the engine's missed use is zero too;
after training opens the gate, bk's per-example norms were 0.974-0.9998 of the true ones and an example
contributed 1.026 C to the noised sum, with every start-up check passed. :class:`EngineWatch` checks again:

* **on the weights in use**: at the start (before the run folder exists), after a checkpoint is loaded (the first
  step of a resumed run, before its first release), at every checkpoint, and periodically, within a budget of the
  training time it measures itself (``train.engine_watch.budget``, 2 % by default; or every N steps);
* **on examples drawn at random** from the private population by a generator of its own (seeded from the run's
  seed, in every checkpoint), not the first k (sorted data leaves branches unchecked), **and on the logical batch's
  outliers**: its longest and its shortest example (:meth:`EngineWatch.note_batch`; size: the non-padding
  positions of the task's ``attention_mask`` where its batch has one, else the non-zero entries of the example's
  tensors), where bugs that depend on the lengths in a batch show (issue 56: a fold layout kept from a batch of
  equal lengths and reused for one of lengths [6, 4, 5]). A periodic check waits for the step's batch to be drawn,
  so it sees that batch's outliers before its release; a check at the start or a resume has no batch yet (random
  examples only), one at a checkpoint takes the last batch's. The outliers cost no generator draws: a resumed run
  draws the same random examples as an uninterrupted one;
* **per parameter**: the probe perturbs the weights when a parameter's gradient is exactly zero (a closed gate)
  and lists the parameters still zero as *unverified*; the self-check compares each parameter's clipped sum and
  the norms with every parameter weighted to an equal share. A parameter unverified at one check is verified by a
  later one that sees its gradient non-zero; the summary lists those never verified.

A failed check raises :class:`EngineCheckFailed` (a :class:`~dp_adam_bench.errors.PrivacyMismatch`): the step that
called it makes no release, the trainer writes ``stopped_by_check.json`` in the run folder and the run is not
complete, so no report reads it. Everything here is a diagnostic on private examples: its errors go to the local
summary, never to W&B or the shared metrics.

Cost: each check is one probe (an engine pass and a backward on one example) and one self-check (an engine pass,
k + 2 size-one backwards, one scaled engine pass per 200 parameter tensors), and the sizes of the batch's examples
(one ``get_batch`` of it). ``budget`` bounds the periodic checks' share of the measured step time (a check made
inside a step is not counted as training time); the start, resume and checkpoint checks are always made and
counted in it.
"""

from __future__ import annotations

import math
import time

import torch

from dp_adam_bench.errors import ConfigError, PrivacyMismatch

DEFAULT_BUDGET = 0.02


class EngineCheckFailed(PrivacyMismatch):
    """The engine failed a probe or self-check on the weights the run has reached: one line, raised before the
    next release."""


class EngineWatch:
    """Checks of the engine on the current weights (module docstring). ``check_fn(batch_idx, generator, reason)``
    runs the probe and the self-check on the private examples ``batch_idx`` and returns their records (raising
    :class:`ConfigError` on a failure); ``population``: the private examples' dataset indices; ``sizes(idx)``: each
    of the examples ``idx``'s size (:meth:`~dp_adam_bench.engine.backends.ModelBackend.example_sizes`), or None for
    random examples only."""

    def __init__(
        self, check_fn, population: torch.Tensor, examples: int, seed: int, settings=None, sizes=None
    ):
        settings = settings or {}
        self.check_fn = check_fn
        self.sizes = sizes
        self.batch: torch.Tensor | None = None  # the last logical batch noted (dataset indices)
        self.deferred: int | None = None  # a periodic check due at this step, waiting for the step's batch
        self.noting = False  # whether the session notes its batches (then periodic checks wait for them)
        self.in_step = 0.0  # seconds of checks made inside the step being timed (not training time)
        self.population = population
        self.examples = max(1, int(examples))
        self.generator = torch.Generator().manual_seed(int(seed))
        every = settings.get("every", "auto")
        self.every = every if every == "auto" else int(every)
        self.budget = float(settings.get("budget", DEFAULT_BUDGET))
        self.checks: list[dict] = []
        self.earlier_checks = 0  # made by earlier attempts of a resumed run (their details are in no summary)
        self.seen_step: int | None = None  # the step whose weights were last checked or trained here
        self.spent = 0.0  # seconds in checks
        self.trained = 0.0  # seconds in training steps
        self.last_cost = 0.0
        self.unverified: set[str] | None = None  # never verified so far (None before the first check)

    def choose(self) -> torch.Tensor:
        """``examples`` distinct private examples at random (dataset indices)."""
        n = len(self.population)
        k = min(self.examples, n)
        if n <= 1_000_000:
            pick = torch.randperm(n, generator=self.generator)[:k]
        else:  # no O(N) permutation per check on large datasets: k draws, repeats dropped
            pick = torch.unique(torch.randint(n, (k,), generator=self.generator))
        return self.population[pick]

    def outliers(self, batch: torch.Tensor | None) -> torch.Tensor:
        """The longest and the shortest example of ``batch`` (dataset indices; the first of equal sizes), by
        ``sizes``; none without a batch or ``sizes``."""
        if batch is None or self.sizes is None or not len(batch):
            return batch.new_zeros(0) if batch is not None else torch.zeros(0, dtype=torch.long, device="cpu")
        size = torch.as_tensor(self.sizes(batch)).reshape(-1).cpu()
        if size.shape != (len(batch),):
            raise ValueError(f"engine watch: sizes gave {tuple(size.shape)} for a batch of {len(batch)}")
        picks = [int(torch.argmax(size)), int(torch.argmin(size))]
        return batch.reshape(-1)[torch.tensor(sorted(set(picks)), device=batch.device)]

    def check_examples(self) -> torch.Tensor:
        """A check's examples: :meth:`choose` (random), then the last noted batch's :meth:`outliers` not already
        among them."""
        idx = self.choose()
        extra = self.outliers(self.batch)
        if len(extra):
            extra = extra.to(idx.device, idx.dtype)
            idx = torch.cat([idx, extra[~torch.isin(extra, idx)]])
        return idx

    def note_batch(self, batch: torch.Tensor) -> None:
        """The logical batch of the step about to be released (dataset indices), before its release: later checks
        take its outliers, and a periodic check that :meth:`before_step` found due runs now, on them, so it can stop
        the run (:class:`EngineCheckFailed`) before this batch is released."""
        self.batch = batch.detach().reshape(-1)
        self.noting = True
        if self.deferred is not None:
            step, self.deferred = self.deferred, None
            t0 = time.perf_counter()
            try:
                self.check(step, "periodic")
            finally:
                self.in_step += time.perf_counter() - t0

    def check(self, step: int, reason: str) -> dict:
        """Probe and self-check on the current weights; :class:`EngineCheckFailed` (``reason`` at ``step``) on a
        failure, which happens before the caller's next release."""
        if not len(self.population):
            return {}
        t0 = time.perf_counter()
        idx = self.check_examples()
        try:
            records = self.check_fn(idx, self.generator, reason)
        except ConfigError as err:
            self.checks.append({"step": step, "reason": reason, "failed": str(err)})
            if reason == "start":  # before the run folder exists: a refusal of the config, as before any run
                raise
            line = str(err).replace(
                "stopped before any noise was released", f"stopped before the release of step {step + 1}"
            )
            raise EngineCheckFailed(
                f"engine check at step {step} ({reason}, on the weights training reached): {line}"
            ) from None
        cost = time.perf_counter() - t0
        self.spent += cost
        self.last_cost = cost
        self.seen_step = step
        unverified = set(records.get("unverified", []))
        self.unverified = unverified if self.unverified is None else self.unverified & unverified
        self.checks.append(
            {
                "step": step,
                "reason": reason,
                "max_rel_error": records.get("max_rel_error", math.nan),
                "unverified": sorted(unverified),
                "seconds": cost,
            }
        )
        return records

    def before_step(self, step: int) -> None:
        """Before the release of step ``step + 1``: a check when the weights are not the ones last seen here (a
        checkpoint was loaded) or when the periodic schedule says so."""
        self.in_step = 0.0
        if self.seen_step != step:
            self.check(step, "resume" if step else "start")
        elif self.due(step):
            if self.noting:  # on the step's batch, once drawn (note_batch)
                self.deferred = step
            else:
                self.check(step, "periodic")

    def due(self, step: int) -> bool:
        if self.every == "auto":
            return self.spent + self.last_cost <= self.budget * self.trained and step > 0
        return bool(self.every) and step > 0 and step % self.every == 0

    def after_step(self, step: int, seconds: float) -> None:
        """``seconds``: the step as the session timed it, less any check :meth:`note_batch` made inside it."""
        self.trained += max(0.0, seconds - self.in_step)
        self.in_step = 0.0
        self.seen_step = step

    def describe(self) -> dict:
        failed = [c for c in self.checks if "failed" in c]
        return {
            "checks": self.earlier_checks + len(self.checks),
            "at_steps": [c["step"] for c in self.checks],
            "reasons": sorted({c["reason"] for c in self.checks}),
            "max_rel_error": max(
                (c["max_rel_error"] for c in self.checks if "failed" not in c), default=None
            ),
            "never_verified": sorted(self.unverified or []),
            "failed": failed[0]["failed"] if failed else None,
            "seconds": self.spent,
            "share_of_training_time": self.spent / self.trained if self.trained else None,
            "schedule": {"every": self.every, "budget": self.budget},
            "note": "diagnostic: the engine against autograd and the size-one loop on random private examples at "
            "the weights training reached, not part of the accounted release",
        }

    def state_dict(self) -> dict:
        """The generator and the record (the weights are the checkpoint's own: a resume checks them again)."""
        return {
            "generator": self.generator.get_state(),
            "unverified": sorted(self.unverified) if self.unverified is not None else None,
            "spent": self.spent,
            "trained": self.trained,
            "checks": self.earlier_checks + len(self.checks),
        }

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"].cpu())
        self.unverified = set(state["unverified"]) if state.get("unverified") is not None else None
        self.spent, self.trained = float(state["spent"]), float(state["trained"])
        self.earlier_checks = int(state["checks"])
        self.seen_step = None  # the loaded weights are checked before the next release
