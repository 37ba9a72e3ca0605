"""Learning-rate schedules: the factor that multiplies ``optimizer.lr`` at step t (``train.lr_schedule``).

* ``constant`` — factor 1 (the default, and every preset's unless it says otherwise).
* ``linear`` — linear warm-up over ``train.lr_warmup_steps`` steps, then linear decay towards 0 at the last planned
  step: Li, Tramer, Liang & Hashimoto, "Large Language Models Can Be Strong Differentially Private Learners"
  (ICLR 2022, arXiv:2110.05679), whose training script offers ``lr_decay`` through transformers'
  ``get_linear_schedule_with_warmup``. Update t (1-based) of T with W warm-up steps uses ``t / W`` for t <= W and
  ``(T - t + 1) / (T - W)`` after: the same as that scheduler without warm-up, and with warm-up the same shifted by
  one update, because its first warm-up update has lr 0. No step is spent at lr 0; the last uses ``1 / (T - W)``.

A schedule is a pure function of the step number, so a resumed run uses the learning rates the uninterrupted run
would have, and the privacy of a run does not depend on it (the learning rate acts on released, noisy quantities:
post-processing).
"""

from __future__ import annotations

from dataclasses import dataclass

from dp_adam_bench.errors import ConfigError

SCHEDULES = ("constant", "linear")


@dataclass(frozen=True)
class LRSchedule:
    name: str
    total_steps: int
    warmup_steps: int = 0

    def factor(self, t: int) -> float:
        """The multiplier of the base learning rate for update ``t`` (1-based)."""
        if self.name == "constant":
            return 1.0
        if t <= self.warmup_steps:
            return t / self.warmup_steps
        return max(0.0, (self.total_steps - t + 1) / (self.total_steps - self.warmup_steps))


def build_schedule(name, warmup_steps, total_steps: int) -> LRSchedule:
    """The schedule ``train.lr_schedule`` names, over a run of ``total_steps`` planned steps; ConfigError naming
    the field for an unknown name or a warm-up that is not an integer in [0, total_steps)."""
    # the same checks as config.validate's choice / integer (config imports this module, not the reverse)
    name = name or "constant"
    if name not in SCHEDULES:
        raise ConfigError(f"train.lr_schedule={name!r}; valid: {', '.join(SCHEDULES)}")
    warmup_steps = warmup_steps or 0
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ConfigError(f"train.lr_warmup_steps={warmup_steps!r} must be an integer >= 0")
    if warmup_steps and name == "constant":
        raise ConfigError(
            f"train.lr_warmup_steps={warmup_steps} needs a schedule that warms up; set train.lr_schedule=linear"
        )
    if warmup_steps >= max(int(total_steps), 1):
        raise ConfigError(
            f"train.lr_warmup_steps={warmup_steps} must be < the run's {total_steps} planned steps"
        )
    return LRSchedule(name, int(total_steps), warmup_steps)
