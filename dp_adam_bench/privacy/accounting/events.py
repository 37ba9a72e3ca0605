"""What a run releases, as events an accountant composes.

* :class:`PoissonGaussianEvent` — ``count`` DP-SGD steps: Poisson sampling at rate q, Gaussian noise with
  multiplier sigma on the sum of gradients clipped to norm 1 (Abadi et al. 2016, arXiv:1607.00133, Alg. 1).
* :class:`GaussianEvent` — ``count`` non-amplified Gaussian mechanisms with mu = sensitivity / sigma (a whole
  DP-MF release, Choquette-Choo et al. 2022, arXiv:2211.06530).

All accountants use the add-or-remove-one neighbouring relation.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from dp_adam_bench.privacy.accounting.checks import check_count, check_positive, check_q, check_sigma


@dataclass(frozen=True)
class PoissonGaussianEvent:
    """``count`` DP-SGD steps: Poisson sampling at rate q, Gaussian noise multiplier sigma (Abadi et al.
    2016)."""

    sigma: float
    q: float
    count: int = 1
    kind = "poisson_gaussian"

    def __post_init__(self) -> None:
        object.__setattr__(self, "sigma", check_sigma(self.sigma))
        object.__setattr__(self, "q", check_q(self.q))
        object.__setattr__(self, "count", check_count(self.count, "count"))

    def same_mechanism(self, other: object) -> bool:
        return isinstance(other, PoissonGaussianEvent) and (self.sigma, self.q) == (other.sigma, other.q)

    def with_count(self, count: int) -> PoissonGaussianEvent:
        return PoissonGaussianEvent(self.sigma, self.q, count)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "sigma": self.sigma, "q": self.q, "count": self.count}


@dataclass(frozen=True)
class GaussianEvent:
    """``count`` non-amplified Gaussian mechanisms with mu = sensitivity / sigma (e.g. one whole DP-MF
    release)."""

    mu: float
    count: int = 1
    kind = "gaussian"

    def __post_init__(self) -> None:
        object.__setattr__(self, "mu", check_positive("mu", self.mu))
        object.__setattr__(self, "count", check_count(self.count, "count"))

    def same_mechanism(self, other: object) -> bool:
        return isinstance(other, GaussianEvent) and self.mu == other.mu

    def with_count(self, count: int) -> GaussianEvent:
        return GaussianEvent(self.mu, count)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "mu": self.mu, "count": self.count}


LedgerEvent = PoissonGaussianEvent | GaussianEvent
EVENT_KINDS = {"poisson_gaussian": PoissonGaussianEvent, "gaussian": GaussianEvent}


def compact(events: Iterable[LedgerEvent]) -> tuple[LedgerEvent, ...]:
    """The events with consecutive identical mechanisms merged into one event with the summed count."""
    out: list[LedgerEvent] = []
    for event in events:
        if not isinstance(event, PoissonGaussianEvent | GaussianEvent):
            raise ValueError(f"not a ledger event: {event!r}; valid kinds: {', '.join(EVENT_KINDS)}")
        if out and out[-1].same_mechanism(event):
            event = _merge(out.pop(), event)
        out.append(event)
    return tuple(out)


def _merge(a: LedgerEvent, b: LedgerEvent) -> LedgerEvent:
    return a.with_count(a.count + b.count)


def split(events: Iterable[LedgerEvent]) -> tuple[list[PoissonGaussianEvent], float]:
    """(the DP-SGD events, sum of count * mu^2 over the Gaussian events).

    Gaussian mechanisms compose exactly into one Gaussian with mu = sqrt(sum count * mu^2) (Dong, Roth & Su
    2022, arXiv:1905.02383, Cor. 3.3), so every accountant sees them as one.
    """
    poisson = [e for e in events if isinstance(e, PoissonGaussianEvent)]
    mu_sq = math.fsum(e.count * e.mu**2 for e in events if isinstance(e, GaussianEvent))
    return poisson, mu_sq
