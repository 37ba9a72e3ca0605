"""What the meter reports: one :class:`MeterCheck` per check (its estimate against the claim, z, power, verdict) and
the :class:`MeterResult` of a row (every check of one config, and the cells the privacy-audit table shows)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class MeterCheck:
    """One check: ``estimate`` against ``claimed`` (ratios where the quantity has a scale), its z-score (or None
    for an exact check), whether it passed, and its power against a 10 % error (None where none is defined)."""

    name: str
    release: str  # "g", "g^2", "joint" or "" (sampling, post-processing)
    estimate: float
    claimed: float
    z: float | None
    passed: bool
    power: float | None = None
    detail: str = ""
    short: str = ""  # the worst finding in a few words (a table cell)

    def describe(self) -> str:
        z = f", z = {self.z:+.2f}" if self.z is not None else ""
        pw = f", power at 10 % = {self.power:.4f}" if self.power is not None else ""
        tag = "ok" if self.passed else "FAIL"
        what = f"{self.name}" + (f" [{self.release}]" if self.release else "")
        return f"  {what:<22} {self.estimate:.5g} vs {self.claimed:.5g}{z}{pw} -> {tag}" + (
            f" ({self.detail})" if self.detail else ""
        )


@dataclass
class MeterResult:
    variant: str
    noise: str
    sampler: str
    sigma: float
    account_sigma: float
    steps: int
    trials: int
    dataset_size: int
    batch_size: float
    alpha: float
    checks: list[MeterCheck] = field(default_factory=list)
    control: str | None = None
    engine: str | None = None  # the clipping engine (model path); None: the vector task
    method: str | None = None  # the fine-tuning method (task.finetune) of a fine-tuning row; None: none

    @property
    def failed(self) -> list[MeterCheck]:
        return [c for c in self.checks if not c.passed]

    @property
    def passed(self) -> bool:
        return not self.failed

    @property
    def power(self) -> float:
        """The least stated power (10 % error) over the checks that state one."""
        return min((c.power for c in self.checks if c.power is not None), default=math.nan)

    def check(self, name: str, release: str = "") -> MeterCheck | None:
        return next((c for c in self.checks if c.name == name and c.release == release), None)

    @property
    def joint(self) -> str:
        """One cell: the joint-noise check's verdict and its worst finding ('' without one; 'n/a' where there
        was nothing to test)."""
        c = self.check("noise_covariance", "joint")
        if c is None:
            return ""
        verdict = "n/a" if c.z is None else "pass" if c.passed else "FAIL"
        return verdict + (f": {c.short}" if c.short else "")

    def summary(self) -> str:
        """One cell: 'pass' or 'FAIL: <checks>'."""
        if self.passed:
            return "pass"
        return "FAIL: " + ", ".join(c.name + (f" [{c.release}]" if c.release else "") for c in self.failed)

    def describe(self) -> str:
        head = (
            f"meter: {self.variant} x {self.noise} x {self.sampler}"
            + (f" (model task, {self.engine} engine)" if self.engine and not self.method else "")
            + (f" (fine-tuning {self.method}, {self.engine} engine)" if self.method else "")
            + (f" [control {self.control}]" if self.control else "")
            + f": sigma = {self.sigma:g} (accounted {self.account_sigma:.4g}), {self.steps} steps, N = "
            f"{self.dataset_size}, B = {self.batch_size:g}, {self.trials} trials; each check at level "
            f"{self.alpha:g} / {len(self.checks)}"
        )
        return "\n".join(
            [head, *(c.describe() for c in self.checks), f"  -> {self.summary()} (power {self.power:.4f})"]
        )
