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
