"""Black-box one-run audit with input canaries (Steinke, Nasr & Jagielski 2023, arXiv 2305.08846, §4 "black-box"):
mislabeled training examples, each included with probability 1/2, scored by minus their loss on the *final* model
only. Weaker than the white-box audit (the auditor sees one model, and a canary's gradient is not guaranteed to
reach norm C), but it is what a user can run on their own model task (e.g. CIFAR-10 CNN5).

The wrapped task's dataset is its own examples minus the m chosen canaries, plus the included canaries with their
label shifted by one class; an excluded canary is removed (add/remove adjacency). N therefore depends on how many
canaries are in (by about sqrt(m)), and q = B / N with it: the claim is the run's own epsilon at that N.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch

from dp_adam_bench.audit.bound import (
    Guesses,
    count_correct,
    epsilon_lower_bound,
    gdp_mu_lower_bound,
    max_epsilon,
)
from dp_adam_bench.audit.fdp_bound import fdp_mu_lower_bound

FRACTIONS = (0.01, 0.05, 0.45)


class InputCanaryTask:
    """A model task (``get_batch`` giving a label under ``y``) with mislabeled canaries; everything else delegated."""

    def __init__(self, base, canaries: np.ndarray, included: np.ndarray, num_classes: int):
        self.base, self.num_classes = base, int(num_classes)
        self.canaries = np.asarray(canaries)
        n = base.dataset_size
        rest = np.setdiff1d(np.arange(n), self.canaries)
        self.index = torch.as_tensor(np.concatenate([rest, self.canaries[np.asarray(included, dtype=bool)]]))
        self.flip = torch.zeros(len(self.index), dtype=torch.bool)
        self.flip[len(rest) :] = True

    @property
    def dataset_size(self) -> int:
        return len(self.index)

    def get_batch(self, indices):
        indices = torch.as_tensor(indices)
        batch = self.base.get_batch(self.index[indices])
        flip = self.flip[indices]
        batch["y"] = torch.where(flip, (batch["y"] + 1) % self.num_classes, batch["y"])
        return batch

    def canary_batch(self):
        """Every canary (in or out) with its shifted label."""
        batch = self.base.get_batch(torch.as_tensor(self.canaries))
        batch["y"] = (batch["y"] + 1) % self.num_classes
        return batch

    def __getattr__(self, name):
        return getattr(self.base, name)


def audit_model_task(
    cfg,
    base_task,
    *,
    canaries: int,
    num_classes: int,
    seed: int = 0,
    confidence: float = 0.95,
    control=None,
    control_name: str | None = None,
):
    """Train ``cfg`` once on ``base_task`` with ``canaries`` mislabeled input canaries and return its
    :class:`~dp_adam_bench.audit.whitebox.AuditResult` (``auditor`` = "black-box"); ``control``: a
    :class:`~dp_adam_bench.audit.controls.Control` whose broken privatizer replaces the trainer's."""
    from dp_adam_bench.audit.whitebox import AuditResult, AuditTest
    from dp_adam_bench.engine import trainer

    if (
        isinstance(canaries, bool)
        or not isinstance(canaries, int)
        or not 10 <= canaries < base_task.dataset_size
    ):
        raise ValueError(
            f"canaries={canaries!r} must be an integer in [10, {base_task.dataset_size}) (the task's examples)"
        )
    rng = np.random.default_rng([int(seed), 13])
    chosen = rng.choice(base_task.dataset_size, size=canaries, replace=False)
    included = rng.random(canaries) < 0.5
    task = InputCanaryTask(base_task, chosen, included, num_classes)
    run = trainer.prepare(cfg, task)
    if control is not None:
        _break(run.backend, control)
    model = run.backend.model
    with tempfile.TemporaryDirectory(prefix="dp-adam-bench-audit-") as folder:
        summary = trainer.run(cfg, Path(folder), lambda step, metrics: None, prepared=run)
    model.eval()
    batch = {k: v.to(next(model.parameters()).device) for k, v in task.canary_batch().items()}
    with torch.no_grad():
        score = -task.loss_per_example(model, batch).double().cpu().numpy()
    if not np.all(np.isfinite(score)):
        raise ValueError("a canary's loss is not finite: the run diverged, so its scores cannot be ranked")
    level = (1 - confidence) / len(FRACTIONS)
    tiebreak = np.random.default_rng([int(seed), 7]).permutation(canaries)
    plan = run.plan
    delta = float(plan.delta)
    tests = []
    for frac in FRACTIONS:
        k = max(1, int(frac * canaries))
        r, v = count_correct(Guesses(k, k).guess(score, tiebreak), included)
        tests.append(
            AuditTest(
                "-loss",
                k,
                r,
                v,
                epsilon_lower_bound(canaries, r, v, delta, level),
                gdp_mu_lower_bound(canaries, r, v, level),
                fdp_mu_lower_bound(canaries, r, v, level),
            )
        )
    return AuditResult.of_run(
        run,
        summary,
        canaries=canaries,
        included=int(included.sum()),
        dataset_size=task.dataset_size,
        confidence=confidence,
        tests=tests,
        control=control_name,
        max_possible=max_epsilon(canaries, 2 * max(1, int(max(FRACTIONS) * canaries)), delta, level),
        auditor=f"black-box ({getattr(base_task, 'name', 'model task')})",
        # reported only (the bound never sees inclusion): how far training pulled in-canaries' losses down
        extra={"loss_in": float(-score[included].mean()), "loss_out": float(-score[~included].mean())},
    )


def _break(backend, control) -> None:
    """Route the backend's releases through the control's broken privatizer (built once, from the trainer's)."""
    release, broken = backend.release, {}

    def broken_release(idx, privatizer, scale):
        # the post-processing check's replay of the release
        if getattr(privatizer, "_pinned", None) is not None:
            return release(idx, privatizer, scale)
        if "p" not in broken:
            broken["p"] = control.wrap(privatizer)
        return release(idx, broken["p"], scale)

    backend.release = broken_release
