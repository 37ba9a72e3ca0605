"""One interface for every accountant, and the registry that names them.

An :class:`Accountant` composes a sequence of ledger events (:mod:`.events`) into an epsilon at a given delta:

* ``epsilon(events, delta)`` — the reported value;
* ``bounds(events, delta)`` — (lower, upper) around the true epsilon as far as the method knows it
  (``upper = inf`` when it gives no bound), and ``error_bound(events, delta)`` — how far the reported value
  may be from the truth;
* ``guarantee`` — True when the reported value is an upper bound on the true epsilon, so that it may be used
  to calibrate noise and to enforce budgets; False for approximations (the GDP central limit theorem).

Every accountant is bounded in time and memory: it estimates the size of its numerical grid before building
it and refuses past a cap, and any error raised inside a library becomes an :class:`AccountantFailure` with a
one-line reason, so one accountant failing never hides the others (see ``PrivacyLedger.epsilons_with_errors``).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import ClassVar

from dp_adam_bench.privacy.accounting.checks import check_delta
from dp_adam_bench.privacy.accounting.events import LedgerEvent, compact
from dp_adam_bench.registry import Registry


class AccountantFailure(ValueError):
    """An accountant could not compute epsilon for these events (a refused grid, a library error); the
    message is one line naming the accountant and the reason."""

    def __init__(self, accountant: str, reason: str):
        self.accountant, self.reason = accountant, reason
        super().__init__(f"{accountant}: {reason}")


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")


@dataclass(frozen=True)
class Accountant(ABC):
    """Composes ledger events into (eps, delta); subclasses implement :meth:`_epsilon` (and :meth:`_bounds`).

    Instances are frozen dataclasses of their numerical parameters, so results are cached per (accountant,
    events, delta)."""

    name: ClassVar[str] = "accountant"
    label: ClassVar[str] = ""
    guarantee: ClassVar[bool] = True

    # -- the interface -------------------------------------------------------------------------------------------
    def epsilon(self, events: Iterable[LedgerEvent], delta: float) -> float:
        """Epsilon at ``delta`` of ``events`` composed; raises :class:`AccountantFailure` with a reason when the
        accountant cannot answer (never a library traceback, never an unbounded allocation)."""
        events, delta = compact(events), check_delta(delta)
        if not events:
            return 0.0
        return cached_epsilon(self, events, delta)

    def bounds(self, events: Iterable[LedgerEvent], delta: float) -> tuple[float, float]:
        """(lower, upper) with lower <= true epsilon <= upper as far as this method knows (upper = inf: no
        bound)."""
        events, delta = compact(events), check_delta(delta)
        if not events:
            return 0.0, 0.0
        return self._guarded(self._bounds, events, delta)

    def error_bound(self, events: Iterable[LedgerEvent], delta: float) -> float:
        """How far :meth:`epsilon` may be from the true epsilon: max(value - lower, upper - value)."""
        value = self.epsilon(events, delta)
        lower, upper = self.bounds(events, delta)
        return max(value - lower, upper - value, 0.0)

    # -- for subclasses ------------------------------------------------------------------------------------------
    @abstractmethod
    def _epsilon(self, events: tuple[LedgerEvent, ...], delta: float) -> float:
        """Epsilon of non-empty, compacted events at a valid delta."""

    def _bounds(self, events: tuple[LedgerEvent, ...], delta: float) -> tuple[float, float]:
        value = self._epsilon(events, delta)
        return (0.0, value) if self.guarantee else (0.0, math.inf)

    def fail(self, reason: str) -> AccountantFailure:
        return AccountantFailure(self.name, reason)

    def _guarded(self, fn: Callable, *args):
        """``fn(*args)`` with every library error turned into an AccountantFailure (the libraries raise
        RuntimeError, ValueError, FloatingPointError, MemoryError... from deep inside)."""
        try:
            out = fn(*args)
        except AccountantFailure:
            raise
        except Exception as err:  # noqa: BLE001 - a library failure must not lose the run; the reason is kept
            raise self.fail(_one_line(err)) from err
        values = out if isinstance(out, tuple) else (out,)
        if any(math.isnan(float(v)) for v in values):
            raise self.fail(f"the computation returned NaN ({out!r})")
        return out


@lru_cache(maxsize=4096)
def cached_epsilon(acc: Accountant, events: tuple[LedgerEvent, ...], delta: float) -> float:
    value = float(acc._guarded(acc._epsilon, events, delta))
    return max(value, 0.0)


ACCOUNTANTS = Registry("accountant", "privacy.accountant")
ACCOUNTANTS.register("rdp", "dp_adam_bench.privacy.accounting.rdp:RdpAccountant")
ACCOUNTANTS.register("prv", "dp_adam_bench.privacy.accounting.prv:PrvAccountant")
ACCOUNTANTS.register("pld", "dp_adam_bench.privacy.accounting.pld:PldAccountant")
ACCOUNTANTS.register("gdp_clt", "dp_adam_bench.privacy.accounting.gdp_clt:GdpCltAccountant")

_DEFAULTS: dict[str, Accountant] = {}


def get_accountant(name: str) -> Accountant:
    """The accountant registered as ``name`` with its default parameters (a ConfigError naming the valid
    names otherwise)."""
    ACCOUNTANTS.check(name)
    if name not in _DEFAULTS:
        _DEFAULTS[name] = ACCOUNTANTS.build(name)
    return _DEFAULTS[name]


def guarantee_names() -> tuple[str, ...]:
    return tuple(n for n in ACCOUNTANTS if get_accountant(n).guarantee)


def get_guarantee_accountant(name: str, purpose: str) -> Accountant:
    """:func:`get_accountant`, refusing accountants whose value is not an upper bound on epsilon: a budget or
    a calibrated sigma must hold, not hold approximately."""
    acc = get_accountant(name)
    if not acc.guarantee:
        raise ValueError(
            f"accountant {name!r} ({acc.label}) is an approximation, not an upper bound on epsilon, so it "
            f"cannot be used for {purpose}; valid accountants: {', '.join(guarantee_names())}"
        )
    return acc
