"""Calibration: the noise multiplier for a target epsilon, and the number of steps a budget allows.

Both are guarantees, so both refuse accountants whose value is not an upper bound on epsilon (``gdp_clt``)
and use the upper bound of those that report an error band (``prv``: Opacus' ``get_epsilon`` convention,
estimate + eps_error). The searches evaluate the same accountant objects that report epsilon; a grid an
accountant refuses (see :mod:`.base`) counts as "epsilon too large" while searching, and a search whose answer
depends on a refused evaluation raises a ValueError carrying the reason.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from dp_adam_bench.privacy.accounting.base import AccountantFailure, get_guarantee_accountant
from dp_adam_bench.privacy.accounting.checks import (
    check_count,
    check_delta,
    check_epsilon,
    check_positive,
    check_q,
    check_sigma,
)
from dp_adam_bench.privacy.accounting.events import PoissonGaussianEvent
from dp_adam_bench.privacy.accounting.gaussian import gaussian_mu_unchecked
from dp_adam_bench.privacy.accounting.pld import PldAccountant
from dp_adam_bench.privacy.accounting.prv import PRV_EPS_ERROR, PrvAccountant
from dp_adam_bench.privacy.accounting.rdp import rdp_epsilon_from_vector, rdp_vector

_SIGMA_MIN, _SIGMA_MAX = 1e-2, 1e6
_STEPS_MAX = 10**9

# Cheap variants used only to *locate* a root before the reported accountant confirms it. A coarser PLD grid
# is still a pessimistic (upper) bound; the PRV central estimate moves by < 1e-4 with eps_error (measured), so
# coarse estimate + PRV_EPS_ERROR locates the fine upper bound.
_COARSE_PLD = PldAccountant(discretization=1e-3)
_COARSE_PRV = PrvAccountant(eps_error=0.05)


class _Refusals:
    """Wraps an epsilon function: a refused evaluation (AccountantFailure) reads as inf, and is remembered."""

    def __init__(self, fn: Callable[[float], float]):
        self.fn, self.failures = fn, {}

    def __call__(self, x):
        try:
            return self.fn(x)
        except AccountantFailure as err:
            self.failures[x] = err.reason
            return math.inf

    def note(self) -> str:
        if not self.failures:
            return ""
        x, reason = next(iter(self.failures.items()))
        return f" ({len(self.failures)} evaluation(s) refused, e.g. at {x:g}: {reason})"


def _events(sigma: float, q: float, steps: int) -> tuple[PoissonGaussianEvent, ...]:
    return (PoissonGaussianEvent(sigma, q, steps),)


class _Aim:
    """The window ``[target - tol, target]`` a sigma search must land in, and the point it aims at, in
    g = log eps: the middle of the window."""

    def __init__(self, target: float, tol: float):
        self.target, self.lo_ok, self.hi_ok = target, target - tol, target
        self.g = math.log(target - tol / 2)

    def hit(self, e: float) -> bool:
        return self.lo_ok <= e <= self.hi_ok


def _g(e: float) -> float:
    """log eps, with eps = 0 read as the log of the smallest double."""
    return math.log(e) if e > 0 else -745.0


def _solve_sigma(
    eps_fn: Callable[[float], float],
    target: float,
    tol: float,
    sigma0: float,
    eps0: float | None = None,
    slope: float = -2.0,
) -> tuple[float, float, float]:
    """Find sigma with target - tol <= eps_fn(sigma) <= target; eps_fn must decrease in sigma.

    Regula falsi with the Illinois modification on u = log sigma and g = log eps (nearly linear there), after
    secant steps from ``sigma0`` to bracket the root. Returns (sigma, eps(sigma), d log eps / d log sigma).
    """
    aim = _Aim(target, tol)
    e0 = eps_fn(sigma0) if eps0 is None else eps0
    if aim.hit(e0):
        return sigma0, e0, slope
    lo, hi, slope, found = _bracket(eps_fn, aim, (math.log(sigma0), e0), slope)
    if found is not None:
        return found
    return _illinois(eps_fn, aim, lo, hi, slope)


def _bracket(eps_fn, aim: _Aim, start: tuple[float, float], slope: float):
    """Secant steps in (u, g) from ``start`` = (u0, eps(sigma0)) until one point has eps above the window (lo:
    sigma too small) and one below it (hi: sigma too large). Returns (lo, hi, slope, None), or (.., (sigma, eps,
    slope)) when a step lands in the window; a ValueError when sigma leaves [_SIGMA_MIN, _SIGMA_MAX] first."""
    u0, e0 = start
    lo = (u0, e0) if e0 > aim.hi_ok else None
    hi = (u0, e0) if e0 < aim.lo_ok else None
    prev = start
    for _ in range(200):
        if lo is not None and hi is not None:
            return lo, hi, slope, None
        e_prev = prev[1]
        u = min(max(prev[0] + _secant_step(e_prev, aim, slope), math.log(_SIGMA_MIN)), math.log(_SIGMA_MAX))
        if u == prev[0]:
            side = "above" if hi is None else "below"
            raise ValueError(
                f"target_epsilon {aim.target!r} is not reachable with sigma in [{_SIGMA_MIN}, {_SIGMA_MAX}]: "
                f"epsilon stays {side} it for this q, number of steps and accountant"
            )
        e = eps_fn(math.exp(u))
        if aim.hit(e):
            return lo, hi, slope, (math.exp(u), e, slope)
        if 0 < e < math.inf and 0 < e_prev < math.inf:
            s = (_g(e) - _g(e_prev)) / (u - prev[0])
            if s < 0:
                slope = s
        if e > aim.hi_ok:
            lo = (u, e) if lo is None or u > lo[0] else lo
        else:
            hi = (u, e) if hi is None or u < hi[0] else hi
        prev = (u, e)
    raise RuntimeError(f"could not bracket sigma for target epsilon {aim.target!r}")


def _secant_step(e_prev: float, aim: _Aim, slope: float) -> float:
    """The next step in u from a point of epsilon ``e_prev``: along the slope to the aim, 1.5 times over (to
    bracket in one step), at most 3 and at least 1e-3 in size; +1 from eps = inf (no privacy at all: sigma far
    too small), -1 from eps = 0 (sigma far too large)."""
    if e_prev == math.inf:
        return 1.0
    if e_prev <= 0:
        return -1.0
    step = (aim.g - _g(e_prev)) / slope
    step = max(min(step * 1.5, 3.0), -3.0)
    if abs(step) < 1e-3:
        step = math.copysign(1e-3, step)
    return step


def _illinois(eps_fn, aim: _Aim, lo: tuple[float, float], hi: tuple[float, float], slope: float):
    """Regula falsi between the bracket's ends ``lo`` (eps above the window) and ``hi`` (below it), each (u,
    eps): the Illinois modification halves the stored f of an end retained twice in a row. Returns (sigma, eps,
    slope); when the bracket closes without a point in the window (the tolerance is below the accountant's
    resolution, e.g. a flat RDP piece), the conservative end, ``hi``."""
    (u_lo, e_lo), (u_hi, e_hi) = lo, hi
    f_lo = _g(e_lo) - aim.g if math.isfinite(e_lo) else math.inf
    f_hi = _g(e_hi) - aim.g
    side = 0
    for _ in range(200):
        if math.isfinite(f_lo):
            u = (u_lo * f_hi - u_hi * f_lo) / (f_hi - f_lo)
            if not (u_lo < u < u_hi):
                u = (u_lo + u_hi) / 2
        else:
            u = (u_lo + u_hi) / 2
        e = eps_fn(math.exp(u))
        f = _g(e) - aim.g if math.isfinite(e) else math.inf
        if aim.hit(e):
            if math.isfinite(e_lo) and e_lo > 0 and e_hi > 0:
                slope = (_g(e_hi) - _g(e_lo)) / (u_hi - u_lo)
            return math.exp(u), e, slope
        if e > aim.hi_ok:
            u_lo, e_lo, f_lo = u, e, f
            if side == -1:
                f_hi /= 2
            side = -1
        else:
            u_hi, e_hi, f_hi = u, e, f
            if side == 1 and math.isfinite(f_lo):
                f_lo /= 2
            side = 1
        if u_hi - u_lo < 1e-13:
            break
    return math.exp(u_hi), e_hi, slope


def calibrate_sigma(
    target_epsilon: float,
    delta: float,
    q: float,
    steps: int,
    accountant: str = "rdp",
    tol: float | None = None,
) -> float:
    """Noise multiplier sigma with ``target_epsilon - tol <= epsilon(sigma, ...) <= target_epsilon``.

    ``tol`` defaults to 0.01 (0.01 * target_epsilon for targets below 1).

    The calibration DP-SGD runs before training (Opacus' ``get_noise_multiplier``, whose
    ``epsilon_tolerance`` defaults to the same 0.01): the returned sigma never overshoots the budget under
    ``accountant``, which must be a guarantee accountant (``rdp``, ``prv`` with its upper bound, ``pld``;
    ``gdp_clt`` is refused). The search is a safeguarded secant in log-log space started from the GDP-CLT
    closed form (invert the Gaussian dual for mu, then mu = q sqrt(T (e^{1/sigma^2} - 1)) for sigma);
    ``pld`` and ``prv`` first locate the root with a cheap variant of the same accountant (coarser PLD grid,
    larger PRV ``eps_error``) and then confirm with the reported one, typically in one or two full evaluations.
    """
    target = check_epsilon(target_epsilon, "target_epsilon")
    delta, q, steps = check_delta(delta), check_q(q), check_count(steps)
    acc = get_guarantee_accountant(accountant, "calibrating sigma")
    tol = 0.01 * min(1.0, target) if tol is None else check_positive("tol", tol)
    if tol >= target:
        raise ValueError(f"tol must be in (0, target_epsilon={target!r}), got {tol!r}")

    # Closed form under the CLT: the starting point.
    mu = gaussian_mu_unchecked(target, delta)
    ratio = (mu / q) ** 2 / steps  # = e^{1/sigma^2} - 1
    sigma_gdp = 1.0 / math.sqrt(math.log1p(ratio))
    sigma0 = min(max(sigma_gdp, _SIGMA_MIN), _SIGMA_MAX)

    exact = _Refusals(lambda s: acc.epsilon(_events(s, q, steps), delta))
    if acc.name == "pld":
        coarse = _Refusals(lambda s: _COARSE_PLD.epsilon(_events(s, q, steps), delta))
    elif acc.name == "prv":
        coarse = _Refusals(lambda s: _COARSE_PRV.estimate(_events(s, q, steps), delta) + PRV_EPS_ERROR)
    else:
        coarse = None
    slope = -2.0
    try:
        if coarse is not None:
            sigma0, _, slope = _solve_sigma(coarse, target, tol / 2, sigma0)
        return _solve_sigma(exact, target, tol, sigma0, slope=slope)[0]
    except ValueError as err:
        raise ValueError(f"{err}{exact.note() or (coarse.note() if coarse else '')}") from None


def _largest_steps(
    eps_fn: Callable[[int], float], target: float, t0: int, slope: float = 0.5
) -> tuple[int, float]:
    """Largest T in [0, _STEPS_MAX] with eps_fn(T) <= target (eps_fn increasing in T), searched from guess t0.

    Secant steps on (log T, log eps), starting from the guess ``slope`` = d log eps / d log T, each aimed just
    past the boundary so that the next evaluation brackets it; bisection every other step once the bracket is
    slow to close. eps_fn(0) is taken as 0. Returns (T, last slope estimate).
    """
    cache: dict[int, float] = {}

    def f(t: int) -> float:
        if t not in cache:
            cache[t] = eps_fn(t)
        return cache[t]

    log_target = math.log(target)
    lo, hi = 0, None  # f(lo) <= target < f(hi)
    t = max(1, min(int(t0), _STEPS_MAX))
    last: tuple[int, float] | None = None
    bracketed_steps = 0
    for _ in range(500):
        e = f(t)
        if e <= target:
            lo = t
        else:
            hi = t
        if hi is not None and hi - lo <= 1:
            return lo, slope
        if lo >= _STEPS_MAX:
            raise ValueError(f"epsilon stays <= {target!r} for more than {_STEPS_MAX} steps")
        if last is not None and 0 < e < math.inf and 0 < last[1] < math.inf and last[0] != t:
            estimate = (math.log(e) - math.log(last[1])) / (math.log(t) - math.log(last[0]))
            if estimate > 0:
                slope = estimate
        last = (t, e)
        if 0 < e < math.inf:
            t_star = t * math.exp(min(max((log_target - math.log(e)) / slope, -30.0), 30.0))
        else:
            t_star = t / 2
        # Aim just past the predicted boundary, on the side not yet known.
        cand = math.floor(min(t_star, _STEPS_MAX)) + (1 if e <= target else 0)
        if hi is not None and lo > 0:
            bracketed_steps += 1
            if bracketed_steps >= 4 and bracketed_steps % 2 == 0:
                cand = (lo + hi) // 2
        cand = max(cand, lo + 1)
        cand = min(cand, hi - 1 if hi is not None else _STEPS_MAX)
        t = cand
    return lo, slope


def steps_to_epsilon(
    target_epsilon: float, sigma: float, q: float, delta: float, accountant: str = "rdp"
) -> int:
    """Largest number of steps T with ``epsilon(sigma, q, T, delta, accountant) <= target_epsilon`` (0 if
    none), under a guarantee accountant (``gdp_clt`` is refused; ``prv`` uses its upper bound).

    Tang & Lecuyer's T = f(eps, delta, B, N, sigma) (2024, arXiv:2312.14334, Alg. 1 input). ``rdp`` uses
    linearity of RDP in T, ``pld`` reuses one single-step PLD for every T, ``prv`` locates T with a cheap
    ``eps_error`` and confirms it with the reported one; all start from the GDP-CLT answer.
    """
    target = check_epsilon(target_epsilon, "target_epsilon")
    sigma, q, delta = check_sigma(sigma), check_q(q), check_delta(delta)
    acc = get_guarantee_accountant(accountant, "a privacy budget")

    with np.errstate(over="ignore"):
        growth = float(np.expm1(1.0 / sigma**2))
    t_gdp = (gaussian_mu_unchecked(target, delta) / q) ** 2 / growth  # the CLT answer: a good first guess
    t_guess = int(min(max(t_gdp, 1.0), _STEPS_MAX))
    if acc.name == "rdp":
        return _largest_steps(
            lambda t: rdp_epsilon_from_vector(t * rdp_vector(sigma, q), delta), target, t_guess
        )[0]
    exact = _Refusals(lambda t: acc.epsilon(_events(sigma, q, t), delta))
    slope = 0.5
    if acc.name in ("pld", "prv"):
        if acc.name == "pld":
            coarse = _Refusals(lambda t: _COARSE_PLD.epsilon(_events(sigma, q, t), delta))
        else:
            coarse = _Refusals(lambda t: _COARSE_PRV.estimate(_events(sigma, q, t), delta) + PRV_EPS_ERROR)
        t_guess, slope = _largest_steps(coarse, target, t_guess)
    steps = _largest_steps(exact, target, max(t_guess, 1), slope)[0]
    if steps + 1 in exact.failures:
        raise ValueError(
            f"cannot tell whether {steps + 1} steps stay within epsilon {target:g} under {acc.name}: "
            f"{exact.failures[steps + 1]}"
        )
    return steps
