"""The privacy ledger: what a run released, composed under any accountant."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator

from dp_adam_bench.privacy.accounting.base import ACCOUNTANTS, AccountantFailure, get_accountant
from dp_adam_bench.privacy.accounting.checks import check_delta
from dp_adam_bench.privacy.accounting.events import (
    EVENT_KINDS,
    GaussianEvent,
    LedgerEvent,
    PoissonGaussianEvent,
)

LEDGER_FORMAT = "dp_adam_bench.privacy_ledger"
LEDGER_VERSION = 1


class PrivacyLedger:
    """Append-only, run-length encoded record of the private releases of one run.

    Consecutive identical mechanisms collapse into one event with a count, so a 10^5-step DP-SGD run is one
    event. JSON round trip through :meth:`to_dict` / :meth:`from_dict` (run folders, checkpoints);
    :meth:`extend` merges another ledger (a resumed run) and collapses the seam. :meth:`epsilon` composes all
    events under one accountant, :meth:`epsilons_with_errors` under every one, keeping the reason of any that
    fails so that a run summary is always written.
    """

    def __init__(self, events: Iterable[LedgerEvent] = ()) -> None:
        self._events: list[LedgerEvent] = []
        for event in events:
            self.append(event)

    # -- recording -------------------------------------------------------------------------------------------
    def append(self, event: LedgerEvent) -> PrivacyLedger:
        if not isinstance(event, PoissonGaussianEvent | GaussianEvent):
            raise ValueError(f"not a ledger event: {event!r}; valid kinds: {', '.join(EVENT_KINDS)}")
        if self._events and self._events[-1].same_mechanism(event):
            last = self._events.pop()
            event = last.with_count(last.count + event.count)
        self._events.append(event)
        return self

    def record_poisson_step(self, sigma: float, q: float, count: int = 1) -> PrivacyLedger:
        """Record ``count`` DP-SGD steps (one per optimizer step)."""
        return self.append(PoissonGaussianEvent(sigma, q, count))

    def record_gaussian(self, mu: float, count: int = 1) -> PrivacyLedger:
        """Record a non-amplified Gaussian mechanism with mu = sensitivity / sigma (a whole DP-MF release)."""
        return self.append(GaussianEvent(mu, count))

    def extend(self, other: PrivacyLedger | Iterable[LedgerEvent]) -> PrivacyLedger:
        for event in other.events if isinstance(other, PrivacyLedger) else other:
            self.append(event)
        return self

    def __add__(self, other: PrivacyLedger) -> PrivacyLedger:
        return PrivacyLedger(self._events).extend(other)

    # -- inspection ------------------------------------------------------------------------------------------
    @property
    def events(self) -> tuple[LedgerEvent, ...]:
        return tuple(self._events)

    @property
    def num_poisson_steps(self) -> int:
        return sum(e.count for e in self._events if isinstance(e, PoissonGaussianEvent))

    def __len__(self) -> int:
        return len(self._events)

    def __iter__(self) -> Iterator[LedgerEvent]:
        return iter(tuple(self._events))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PrivacyLedger) and self._events == other._events

    def __repr__(self) -> str:
        return f"PrivacyLedger({self._events!r})"

    # -- serialisation ---------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "format": LEDGER_FORMAT,
            "version": LEDGER_VERSION,
            "events": [e.to_dict() for e in self._events],
        }

    @classmethod
    def from_dict(cls, data: dict) -> PrivacyLedger:
        if not isinstance(data, dict) or "events" not in data:
            raise ValueError(f"not a privacy ledger dict (needs an 'events' list): {data!r}")
        version = data.get("version", LEDGER_VERSION)
        if version != LEDGER_VERSION:
            raise ValueError(f"unsupported ledger version {version!r}; valid versions: {LEDGER_VERSION}")
        ledger = cls()
        for raw in data["events"]:
            kind = raw.get("kind") if isinstance(raw, dict) else None
            if kind not in EVENT_KINDS:
                raise ValueError(f"unknown ledger event kind {kind!r}; valid kinds: {', '.join(EVENT_KINDS)}")
            fields = {k: v for k, v in raw.items() if k != "kind"}
            try:
                ledger.append(EVENT_KINDS[kind](**fields))
            except TypeError as err:
                raise ValueError(f"bad fields for a {kind!r} event: {raw!r} ({err})") from None
        return ledger

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> PrivacyLedger:
        return cls.from_dict(json.loads(text))

    # -- composition -----------------------------------------------------------------------------------------
    def epsilon(self, delta: float, accountant: str = "pld") -> float:
        """Epsilon at ``delta`` of everything recorded, composed under ``accountant`` (a name in
        ``ACCOUNTANTS``). Gaussian events compose exactly into one Gaussian (Dong, Roth & Su 2022,
        arXiv:1905.02383, Cor. 3.3); see each accountant's module for the rest. Raises
        :class:`AccountantFailure` (a ValueError) with the reason when the accountant cannot answer."""
        delta = check_delta(delta)
        return get_accountant(accountant).epsilon(self._events, delta)

    def epsilons_with_errors(self, delta: float) -> tuple[dict[str, float], dict[str, str]]:
        """(epsilon of every accountant that answered, a one-line reason for every one that failed).

        Never raises for an accountant's failure (only for an invalid ``delta``): writing a run summary must
        not lose the run because one library cannot handle its noise level."""
        delta = check_delta(delta)
        values: dict[str, float] = {}
        errors: dict[str, str] = {}
        for name in ACCOUNTANTS:
            try:
                values[name] = self.epsilon(delta, name)
            except AccountantFailure as err:
                errors[name] = err.reason
        return values, errors

    def epsilons(self, delta: float) -> dict[str, float]:
        """The epsilons of :meth:`epsilons_with_errors` (accountants that failed are left out)."""
        return self.epsilons_with_errors(delta)[0]
