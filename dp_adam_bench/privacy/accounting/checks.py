"""Validation of accounting inputs: a ValueError naming the bad value and the valid range, never a deep
traceback from a library."""

from __future__ import annotations

import math
import numbers


def is_real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def check_positive(name: str, value: object) -> float:
    if not is_real(value) or not math.isfinite(float(value)) or float(value) <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def check_sigma(sigma: object) -> float:
    return check_positive("sigma (noise multiplier)", sigma)


def check_q(q: object) -> float:
    if not is_real(q) or not (0.0 < float(q) <= 1.0):
        raise ValueError(f"q (sampling rate) must be in (0, 1], got {q!r}")
    return float(q)


def check_delta(delta: object, name: str = "delta") -> float:
    if not is_real(delta) or not (0.0 < float(delta) < 1.0):
        raise ValueError(f"{name} must be in (0, 1), got {delta!r}")
    return float(delta)


#: privacy.delta at or above which a run is refused. A mechanism that publishes one training example, chosen
#: uniformly at random, in full is (0, 1/N)-DP (the "name and shame" mechanism; Dwork & Roth 2014, Sec. 2.3); for
#: every data set of N >= 2 examples it is therefore (0, 1/2)-DP. At delta >= 1/2 the guarantee thus allows
#: publishing a whole record whatever N is, and the accountants answer epsilon = 0 for any noise that moves the
#: output distribution by less than delta in total variation (a silent, meaningless number). This bound is known
#: before the data is (config validation); the sharper, data-dependent one, delta >= 1/N, is a caveat the plan
#: names once N is known (:func:`delta_caveat`).
MEANINGLESS_DELTA = 0.5


def check_meaningful_delta(delta: float, name: str = "privacy.delta") -> float:
    """ValueError (the config turns it into a ConfigError) when ``delta`` >= :data:`MEANINGLESS_DELTA`."""
    if float(delta) >= MEANINGLESS_DELTA:
        raise ValueError(
            f"{name}={delta!r} >= {MEANINGLESS_DELTA:g} means nothing: publishing one random training example in "
            f"full is (0, {MEANINGLESS_DELTA:g})-DP for any data set of 2 or more examples, and every accountant "
            f"reports epsilon = 0 there; valid: 0 < {name} < {MEANINGLESS_DELTA:g}, and below 1 / N (N the number "
            "of training examples) for a meaningful guarantee (1e-5 or N^-1.1 are usual)"
        )
    return float(delta)


def delta_caveat(delta: float, n: int) -> str | None:
    """One line when ``delta`` >= 1 / ``n``: the guarantee then allows publishing about delta N examples in full
    (the mechanism that publishes each example with probability delta is (0, delta)-DP); None otherwise."""
    if delta is None or n < 1 or float(delta) < 1.0 / n:
        return None
    return (
        f"privacy.delta = {delta:g} >= 1/N = {1.0 / n:.3g} (N = {n} private examples): this (epsilon, delta) "
        f"also holds for a mechanism that publishes about delta N = {delta * n:.3g} training example(s) in full; "
        "use delta < 1/N"
    )


def check_epsilon(epsilon: object, name: str = "epsilon") -> float:
    return check_positive(name, epsilon)


def check_count(value: object, name: str = "steps") -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        if is_real(value) and math.isfinite(float(value)) and float(value).is_integer():
            value = int(value)
        else:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if int(value) < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)
