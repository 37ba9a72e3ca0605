"""Privacy accounting for DP-SGD-style training and DP-MF releases (SPEC §2).

Thin wrappers around the libraries, never a re-derivation:

* ``rdp`` — Opacus' RDP accountant for the Poisson-subsampled Gaussian (Mironov, Talwar & Zhang 2019), with
  Opacus' RDP -> (eps, delta) conversion (Balle et al. 2020, Thm. 21; the same as Canonne, Kamath & Steinke
  2020, Prop. 12, which private-transformers calls ``rdp_cks``) over Opacus' default orders.
* ``prv`` — Opacus' PRV accountant (Gopi, Lee & Wutschitz 2021, "numerical composition of privacy random
  variables", what Li et al. call "composing trade-off functions"). We report the *central estimate*; Opacus'
  own ``PRVAccountant.get_epsilon`` returns the upper end of its error band (estimate + ``eps_error``).
* ``pld`` — dp-accounting's privacy-loss-distribution accountant (Koskela et al. 2020; Doroshenko et al.
  2022), pessimistic discretisation with interval 1e-4 (dp-accounting's default), so an upper bound up to
  float error.
* ``gdp_clt`` — mu-GDP through the central limit theorem of Bu, Dong, Long & Su (2020),
  mu = q sqrt(T (e^{1/sigma^2} - 1)), then the exact mu-GDP -> (eps, delta) dual (Dong, Roth & Su 2022, Cor.
  2.13). **An approximation (CLT), not a guarantee**: it can fall below the exact PLD value (PITFALLS.md,
  "Accounting").

All use the add-or-remove-one neighbouring relation with Poisson sampling at rate q, unit sensitivity and
noise multiplier sigma (noise std sigma * C on the clipped sum). :class:`PrivacyLedger` records what a run
released and composes it under any of the four accountants.
"""

from __future__ import annotations

import json
import math
import numbers
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import lru_cache

import dp_accounting
import numpy as np
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from opacus.accountants import RDPAccountant
from opacus.accountants.analysis import prv as prv_lib
from opacus.accountants.analysis import rdp as rdp_lib
from scipy import optimize
from scipy.special import log_ndtr

ACCOUNTANTS = ("rdp", "prv", "pld", "gdp_clt")

#: Opacus' default RDP orders (``RDPAccountant.DEFAULT_ALPHAS``; private-transformers uses the same list).
RDP_ORDERS: tuple[float, ...] = tuple(float(a) for a in RDPAccountant.DEFAULT_ALPHAS)
#: dp-accounting's default PLD discretisation interval; the value every reported ``pld`` epsilon uses.
PLD_DISCRETIZATION = 1e-4
#: Opacus' default ``eps_error`` of ``PRVAccountant.get_epsilon`` (mesh and truncation of the PRV domain).
PRV_EPS_ERROR = 0.01

# Cheap variants used only to *locate* a root before the reported accountant confirms it. A coarser PLD grid
# is still a pessimistic (upper) bound; the PRV central estimate moves by < 1e-4 with eps_error (measured).
_PLD_COARSE_DISCRETIZATION = 1e-3
_PRV_COARSE_EPS_ERROR = 0.05

_SIGMA_MIN, _SIGMA_MAX = 1e-2, 1e6
_STEPS_MAX = 10**9


# ------------------------------------------------------------------------------------------------------------
# input validation
# ------------------------------------------------------------------------------------------------------------


def _is_real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _check_positive(name: str, value: object) -> float:
    if not _is_real(value) or not math.isfinite(float(value)) or float(value) <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def _check_sigma(sigma: object) -> float:
    return _check_positive("sigma (noise multiplier)", sigma)


def _check_q(q: object) -> float:
    if not _is_real(q) or not (0.0 < float(q) <= 1.0):
        raise ValueError(f"q (sampling rate) must be in (0, 1], got {q!r}")
    return float(q)


def _check_delta(delta: object, name: str = "delta") -> float:
    if not _is_real(delta) or not (0.0 < float(delta) < 1.0):
        raise ValueError(f"{name} must be in (0, 1), got {delta!r}")
    return float(delta)


def _check_epsilon(epsilon: object, name: str = "epsilon") -> float:
    return _check_positive(name, epsilon)


def _check_count(value: object, name: str = "steps") -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        if _is_real(value) and float(value).is_integer():
            value = int(value)
        else:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if int(value) < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def _check_accountant(accountant: object) -> str:
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"unknown accountant {accountant!r}; valid accountants: {', '.join(ACCOUNTANTS)}")
    return str(accountant)


# ------------------------------------------------------------------------------------------------------------
# the Gaussian mechanism, exactly (Balle & Wang 2018)
# ------------------------------------------------------------------------------------------------------------


def _log_gaussian_delta(epsilon: float, mu: float) -> float:
    """log delta(eps) of the Gaussian mechanism; -inf where delta underflows."""
    log_a = float(log_ndtr(-epsilon / mu + mu / 2))
    log_b = epsilon + float(log_ndtr(-epsilon / mu - mu / 2))
    diff = min(log_b - log_a, 0.0)  # b <= a mathematically; clip float noise
    if diff == 0.0:
        return -math.inf
    # log(a - b) = log a + log(1 - e^{diff}), with log(-expm1) accurate for diff near 0 and very negative.
    return log_a + math.log(-math.expm1(diff))


def gaussian_delta(epsilon: float, mu: float) -> float:
    """Exact delta(eps) of the Gaussian mechanism with mu = sensitivity / sigma.

    Balle & Wang (2018), Theorem 8: delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2). Evaluated in
    log space with ``scipy.special.log_ndtr`` so that large eps (where both terms underflow) stays accurate.
    The same curve is the mu-GDP -> (eps, delta) dual (Dong, Roth & Su 2022, Cor. 2.13). ``epsilon`` may be 0
    (delta(0) is the total-variation distance 2 Phi(mu/2) - 1).
    """
    if not _is_real(epsilon) or not math.isfinite(float(epsilon)) or float(epsilon) < 0:
        raise ValueError(f"epsilon must be a finite number >= 0, got {epsilon!r}")
    mu = _check_positive("mu", mu)
    return math.exp(_log_gaussian_delta(float(epsilon), mu))


def _gaussian_epsilon(mu: float, delta: float) -> float:
    log_delta = math.log(delta)
    if _log_gaussian_delta(0.0, mu) <= log_delta:
        return 0.0
    hi = mu * mu / 2 + mu * math.sqrt(2 * -log_delta) + 1.0
    while _log_gaussian_delta(hi, mu) > log_delta:
        hi *= 2
    return float(
        optimize.brentq(lambda e: _log_gaussian_delta(e, mu) - log_delta, 0.0, hi, xtol=1e-13, rtol=1e-14)
    )


def gaussian_epsilon(mu: float, delta: float) -> float:
    """Smallest eps with delta(eps) <= ``delta`` for the Gaussian mechanism with mu = sensitivity / sigma.

    The inverse of :func:`gaussian_delta` by Brent's method (Balle & Wang 2018, Theorem 8); 0 when the
    mechanism is already (0, delta)-DP.
    """
    return _gaussian_epsilon(_check_positive("mu", mu), _check_delta(delta))


def _gaussian_mu(epsilon: float, delta: float) -> float:
    log_delta = math.log(delta)
    lo, hi = 1e-3, 1.0
    while _log_gaussian_delta(epsilon, lo) > log_delta:
        lo /= 2
    while _log_gaussian_delta(epsilon, hi) < log_delta:
        hi *= 2
    return float(
        optimize.brentq(lambda m: _log_gaussian_delta(epsilon, m) - log_delta, lo, hi, xtol=1e-14, rtol=1e-14)
    )


def gaussian_mu(epsilon: float, delta: float) -> float:
    """Largest mu = sensitivity / sigma for which the Gaussian mechanism is (eps, delta)-DP.

    The analytic Gaussian calibration of Balle & Wang (2018, Alg. 1) solved directly on Theorem 8 with Brent's
    method (delta(eps) is increasing in mu). ``sigma = sensitivity / gaussian_mu(eps, delta)``.
    """
    return _gaussian_mu(_check_epsilon(epsilon), _check_delta(delta))


def mf_epsilon(sigma: float, sensitivity: float, delta: float) -> float:
    """Epsilon of a DP-MF release without amplification (Ganesh et al. §5.2, SPEC §2).

    The whole noisy stream C x + sigma z is one Gaussian mechanism whose L2 sensitivity is the strategy's
    sensitivity under the participation schedule, so eps = :func:`gaussian_epsilon` (mu = sensitivity /
    sigma).
    """
    sigma = _check_sigma(sigma)
    sensitivity = _check_positive("sensitivity", sensitivity)
    return _gaussian_epsilon(sensitivity / sigma, _check_delta(delta))


# ------------------------------------------------------------------------------------------------------------
# Poisson-subsampled Gaussian, one accountant at a time
# ------------------------------------------------------------------------------------------------------------


def gdp_clt_mu(sigma: float, q: float, steps: int) -> float:
    """mu of T Poisson-subsampled Gaussian steps under the GDP central limit theorem.

    Bu, Dong, Long & Su (2020), Thm. 2 / Opacus ``compute_mu_poisson``: mu = q sqrt(T (e^{1/sigma^2} - 1)).
    An asymptotic approximation (T -> infinity, q sqrt(T) fixed), not a bound.
    """
    sigma, q, steps = _check_sigma(sigma), _check_q(q), _check_count(steps)
    return _gdp_clt_mu(sigma, q, steps)


def _gdp_clt_mu(sigma: float, q: float, steps: float) -> float:
    # expm1 keeps precision for large sigma; inf for tiny sigma means no privacy under the CLT.
    with np.errstate(over="ignore"):
        growth = float(np.expm1(1.0 / sigma**2))
    return q * math.sqrt(steps * growth)


def _rdp_eps_from_vector(rdp: np.ndarray, delta: float) -> float:
    with warnings.catch_warnings():
        # Opacus warns when the optimum is the largest/smallest order; the bound stays valid, only looser.
        warnings.simplefilter("ignore", UserWarning)
        eps, _ = rdp_lib.get_privacy_spent(orders=list(RDP_ORDERS), rdp=rdp, delta=delta)
    return max(float(eps), 0.0)


@lru_cache(maxsize=4096)
def _rdp_vector(sigma: float, q: float) -> np.ndarray:
    """RDP of one Poisson-subsampled Gaussian step at :data:`RDP_ORDERS` (linear in the number of steps)."""
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        vec = np.asarray(rdp_lib.compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=list(RDP_ORDERS)))
    vec = np.asarray(vec, dtype=float)
    vec.setflags(write=False)
    return vec


def _eps_rdp(sigma: float, q: float, steps: int, delta: float) -> float:
    return _rdp_eps_from_vector(steps * _rdp_vector(sigma, q), delta)


def _prv_epsilon(history: list[tuple[float, float, int]], delta: float, eps_error: float) -> float:
    """Central estimate of Opacus' PRV accountant for a history of (sigma, q, steps).

    The same construction as ``opacus.accountants.PRVAccountant._get_dprv`` (domain from Gopi et al. Remark
    5.6, mesh eps_error / sqrt(T log(12/delta_error) / 2), truncation, discretisation, FFT composition), built
    from the public ``opacus.accountants.analysis.prv`` functions so that the estimate, not the upper bound,
    is returned.
    """
    delta_error = delta / 1000  # Opacus' default
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        prvs = [prv_lib.PoissonSubsampledGaussianPRV(q, sigma) for sigma, q, _ in history]
        counts = [n for _, _, n in history]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            size = prv_lib.compute_safe_domain_size(
                prvs=prvs, max_self_compositions=counts, eps_error=eps_error, delta_error=delta_error
            )
        mesh = eps_error / math.sqrt(sum(counts) * math.log(12 / delta_error) / 2)
        domain = prv_lib.Domain.create_aligned(-size, size, mesh)
        dprvs = [
            prv_lib.discretize(prv_lib.TruncatedPrivacyRandomVariable(p, domain.t_min, domain.t_max), domain)
            for p in prvs
        ]
        composed = prv_lib.compose_heterogeneous(dprvs=dprvs, num_self_compositions=counts)
        try:
            _, estimate, _ = composed.compute_epsilon(delta, delta_error, eps_error)
        except RuntimeError:
            # Raised when delta(t_min) <= delta already, i.e. the mechanism is (0, delta)-DP.
            return 0.0
    return max(float(estimate), 0.0)


def _eps_prv(sigma: float, q: float, steps: int, delta: float, eps_error: float = PRV_EPS_ERROR) -> float:
    return _prv_epsilon([(sigma, q, steps)], delta, eps_error)


@lru_cache(maxsize=64)
def _pld_single_step(sigma: float, q: float, discretization: float):
    """dp-accounting PLD of one Poisson-subsampled Gaussian step (add-or-remove, pessimistic)."""
    return pld_lib.from_gaussian_mechanism(
        standard_deviation=sigma,
        sensitivity=1.0,
        sampling_prob=q,
        value_discretization_interval=discretization,
        neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
    )


def _eps_pld(
    sigma: float, q: float, steps: int, delta: float, discretization: float = PLD_DISCRETIZATION
) -> float:
    # Identical to PLDAccountant.compose(PoissonSampledDpEvent(q, GaussianDpEvent(sigma)), steps), which
    # builds the same single-step PLD and self-composes it; caching the single step lets steps_to_epsilon
    # reuse it.
    pld = _pld_single_step(sigma, q, discretization).self_compose(steps)
    return max(float(pld.get_epsilon_for_delta(delta)), 0.0)


def _eps_gdp(sigma: float, q: float, steps: int, delta: float) -> float:
    mu = _gdp_clt_mu(sigma, q, steps)
    if not math.isfinite(mu):
        return math.inf
    return _gaussian_epsilon(mu, delta)


_EPS_FNS: dict[str, Callable[[float, float, int, float], float]] = {
    "rdp": _eps_rdp,
    "prv": _eps_prv,
    "pld": _eps_pld,
    "gdp_clt": _eps_gdp,
}


@lru_cache(maxsize=4096)
def _epsilon_cached(sigma: float, q: float, steps: int, delta: float, accountant: str) -> float:
    return _EPS_FNS[accountant](sigma, q, steps, delta)


def epsilon(sigma: float, q: float, steps: int, delta: float, accountant: str = "rdp") -> float:
    """Epsilon of ``steps`` Poisson-subsampled Gaussian steps (DP-SGD, Abadi et al. 2016, Alg. 1) at
    ``delta``.

    ``accountant``: ``rdp`` (Opacus RDP), ``prv`` (Opacus PRV, central estimate), ``pld`` (dp-accounting PLD)
    or ``gdp_clt`` (GDP central limit theorem: an approximation, not a guarantee). See the module docstring.
    """
    sigma, q, steps = _check_sigma(sigma), _check_q(q), _check_count(steps)
    delta, accountant = _check_delta(delta), _check_accountant(accountant)
    return _epsilon_cached(sigma, q, steps, delta, accountant)


def epsilons(sigma: float, q: float, steps: int, delta: float) -> dict[str, float]:
    """:func:`epsilon` under every accountant in :data:`ACCOUNTANTS` (what Li et al. report beside RDP)."""
    return {name: epsilon(sigma, q, steps, delta, name) for name in ACCOUNTANTS}


# ------------------------------------------------------------------------------------------------------------
# calibration: sigma for a target epsilon, steps for a budget
# ------------------------------------------------------------------------------------------------------------


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
    lo_ok, hi_ok = target - tol, target
    aim = math.log(target - tol / 2)

    def g(e: float) -> float:
        return math.log(e) if e > 0 else -745.0

    u0 = math.log(sigma0)
    e0 = eps_fn(sigma0) if eps0 is None else eps0
    if lo_ok <= e0 <= hi_ok:
        return sigma0, e0, slope
    # lo: a point with eps > target (sigma too small); hi: eps < target - tol (sigma too large).
    lo = (u0, e0) if e0 > hi_ok else None
    hi = (u0, e0) if e0 < lo_ok else None
    prev = (u0, e0)
    for _ in range(200):
        if lo is not None and hi is not None:
            break
        e_prev = prev[1]
        if e_prev == math.inf:
            step = 1.0  # no privacy at all: sigma far too small
        elif e_prev <= 0:
            step = -1.0  # eps 0: sigma far too large
        else:
            step = (aim - g(e_prev)) / slope
            step = max(min(step * 1.5, 3.0), -3.0)  # overshoot a little to bracket in one step
            if abs(step) < 1e-3:
                step = math.copysign(1e-3, step)
        u = min(max(prev[0] + step, math.log(_SIGMA_MIN)), math.log(_SIGMA_MAX))
        if u == prev[0]:
            side = "above" if hi is None else "below"
            raise ValueError(
                f"target_epsilon {target!r} is not reachable with sigma in [{_SIGMA_MIN}, {_SIGMA_MAX}]: "
                f"epsilon stays {side} it for this q, number of steps and accountant"
            )
        e = eps_fn(math.exp(u))
        if lo_ok <= e <= hi_ok:
            return math.exp(u), e, slope
        if 0 < e < math.inf and 0 < e_prev < math.inf:
            s = (g(e) - g(e_prev)) / (u - prev[0])
            if s < 0:
                slope = s
        if e > hi_ok:
            lo = (u, e) if lo is None or u > lo[0] else lo
        else:
            hi = (u, e) if hi is None or u < hi[0] else hi
        prev = (u, e)
    else:
        raise RuntimeError(f"could not bracket sigma for target epsilon {target!r}")

    # Illinois: f values are stored and the end retained twice in a row has its f halved.
    (u_lo, e_lo), (u_hi, e_hi) = lo, hi
    f_lo = g(e_lo) - aim if math.isfinite(e_lo) else math.inf
    f_hi = g(e_hi) - aim
    side = 0
    for _ in range(200):
        if math.isfinite(f_lo):
            u = (u_lo * f_hi - u_hi * f_lo) / (f_hi - f_lo)
            if not (u_lo < u < u_hi):
                u = (u_lo + u_hi) / 2
        else:
            u = (u_lo + u_hi) / 2
        e = eps_fn(math.exp(u))
        f = g(e) - aim if math.isfinite(e) else math.inf
        if lo_ok <= e <= hi_ok:
            if math.isfinite(e_lo) and e_lo > 0 and e_hi > 0:
                slope = (g(e_hi) - g(e_lo)) / (u_hi - u_lo)
            return math.exp(u), e, slope
        if e > hi_ok:
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
    # Tolerance below the accountant's resolution (e.g. a flat RDP piece): the conservative end.
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
    ``accountant``. ``gdp_clt`` is solved in closed form (invert the Gaussian dual for mu, then
    mu = q sqrt(T (e^{1/sigma^2} - 1)) for sigma). The others use a safeguarded secant search in log-log
    space; ``pld`` and ``prv`` first locate the root with a cheap variant of the same accountant (coarser PLD
    grid, larger PRV ``eps_error``) and then confirm with the reported one, typically in one or two full
    evaluations.
    """
    target = _check_epsilon(target_epsilon, "target_epsilon")
    delta, q, steps = _check_delta(delta), _check_q(q), _check_count(steps)
    accountant = _check_accountant(accountant)
    tol = 0.01 * min(1.0, target) if tol is None else _check_positive("tol", tol)
    if tol >= target:
        raise ValueError(f"tol must be in (0, target_epsilon={target!r}), got {tol!r}")

    # Closed form under the CLT: the starting point for the other accountants too.
    mu = _gaussian_mu(target, delta)
    ratio = (mu / q) ** 2 / steps  # = e^{1/sigma^2} - 1
    sigma_gdp = 1.0 / math.sqrt(math.log1p(ratio))
    if accountant == "gdp_clt":
        sigma = sigma_gdp
        for _ in range(60):  # float rounding may leave eps a hair above target
            if _eps_gdp(sigma, q, steps, delta) <= target:
                return sigma
            sigma = math.nextafter(sigma, math.inf) * (1 + 1e-15)
        return sigma
    sigma0 = min(max(sigma_gdp, _SIGMA_MIN), _SIGMA_MAX)

    def exact(s: float) -> float:
        return _epsilon_cached(s, q, steps, delta, accountant)

    if accountant == "rdp":
        return _solve_sigma(exact, target, tol, sigma0)[0]

    if accountant == "pld":

        def coarse(s: float) -> float:
            return _eps_pld(s, q, steps, delta, _PLD_COARSE_DISCRETIZATION)

    else:

        def coarse(s: float) -> float:
            return _eps_prv(s, q, steps, delta, _PRV_COARSE_EPS_ERROR)

    sigma_c, _, slope = _solve_sigma(coarse, target, tol / 2, sigma0)
    return _solve_sigma(exact, target, tol, sigma_c, slope=slope)[0]


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
    none).

    Tang & Lecuyer's T = f(eps, delta, B, N, sigma) (Alg. 1 input). ``rdp`` uses linearity of RDP in T,
    ``gdp_clt`` is closed form, ``pld`` reuses one single-step PLD for every T, ``prv`` locates T with a cheap
    ``eps_error`` and confirms it with the reported one.
    """
    target = _check_epsilon(target_epsilon, "target_epsilon")
    sigma, q, delta = _check_sigma(sigma), _check_q(q), _check_delta(delta)
    accountant = _check_accountant(accountant)

    def exact(t: int) -> float:
        return _epsilon_cached(sigma, q, t, delta, accountant)

    with np.errstate(over="ignore"):
        growth = float(np.expm1(1.0 / sigma**2))
    t_gdp = (_gaussian_mu(target, delta) / q) ** 2 / growth  # the CLT answer: a good first guess for all
    t_guess = int(min(max(t_gdp, 1.0), _STEPS_MAX))
    if accountant == "gdp_clt":
        return _largest_steps(exact, target, t_guess)[0]
    if accountant == "rdp":
        return _largest_steps(
            lambda t: _rdp_eps_from_vector(t * _rdp_vector(sigma, q), delta), target, t_guess
        )[0]
    if accountant == "pld":

        def coarse(t: int) -> float:
            return _eps_pld(sigma, q, t, delta, _PLD_COARSE_DISCRETIZATION)

    else:

        def coarse(t: int) -> float:
            return _eps_prv(sigma, q, t, delta, _PRV_COARSE_EPS_ERROR)

    t_c, slope = _largest_steps(coarse, target, t_guess)
    return _largest_steps(exact, target, max(t_c, 1), slope)[0]


# ------------------------------------------------------------------------------------------------------------
# the ledger: what a run released
# ------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PoissonGaussianEvent:
    """``count`` DP-SGD steps: Poisson sampling at rate q, Gaussian noise multiplier sigma (Abadi et al.
    2016)."""

    sigma: float
    q: float
    count: int = 1
    kind = "poisson_gaussian"

    def __post_init__(self) -> None:
        object.__setattr__(self, "sigma", _check_sigma(self.sigma))
        object.__setattr__(self, "q", _check_q(self.q))
        object.__setattr__(self, "count", _check_count(self.count, "count"))

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
        object.__setattr__(self, "mu", _check_positive("mu", self.mu))
        object.__setattr__(self, "count", _check_count(self.count, "count"))

    def same_mechanism(self, other: object) -> bool:
        return isinstance(other, GaussianEvent) and self.mu == other.mu

    def with_count(self, count: int) -> GaussianEvent:
        return GaussianEvent(self.mu, count)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "mu": self.mu, "count": self.count}


LedgerEvent = PoissonGaussianEvent | GaussianEvent
_EVENT_KINDS = {"poisson_gaussian": PoissonGaussianEvent, "gaussian": GaussianEvent}
LEDGER_FORMAT = "dp_adam_bench.privacy_ledger"
LEDGER_VERSION = 1


class PrivacyLedger:
    """Append-only, run-length encoded record of the private releases of one run.

    Consecutive identical mechanisms collapse into one event with a count, so a 10^5-step DP-SGD run is one
    event. JSON round trip through :meth:`to_dict` / :meth:`from_dict` (run folders, checkpoints);
    :meth:`extend` merges another ledger (a resumed run) and collapses the seam. :meth:`epsilon` composes all
    events.
    """

    def __init__(self, events: Iterable[LedgerEvent] = ()) -> None:
        self._events: list[LedgerEvent] = []
        for event in events:
            self.append(event)

    # -- recording -------------------------------------------------------------------------------------------
    def append(self, event: LedgerEvent) -> PrivacyLedger:
        if not isinstance(event, PoissonGaussianEvent | GaussianEvent):
            raise ValueError(f"not a ledger event: {event!r}; valid kinds: {', '.join(_EVENT_KINDS)}")
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
            if kind not in _EVENT_KINDS:
                raise ValueError(
                    f"unknown ledger event kind {kind!r}; valid kinds: {', '.join(_EVENT_KINDS)}"
                )
            fields = {k: v for k, v in raw.items() if k != "kind"}
            try:
                ledger.append(_EVENT_KINDS[kind](**fields))
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
        """Epsilon at ``delta`` of everything recorded, composed under ``accountant``.

        * Only DP-SGD steps with one (sigma, q): :func:`epsilon` of the total count.
        * Only Gaussian events: they compose exactly into one Gaussian with mu = sqrt(sum count * mu^2)
          (Dong, Roth & Su 2022, Cor. 3.3), reported exactly under ``pld``/``prv``/``gdp_clt`` and through RDP
          (alpha mu^2 / 2, Mironov 2017) under ``rdp``.
        * Mixed: ``pld`` composes dp-accounting events in a ``PLDAccountant``; ``prv`` composes heterogeneous
          PRVs (the Gaussian part as a PRV with q = 1); ``rdp`` adds RDP curves; ``gdp_clt`` adds mu^2 (CLT
          for the sampled part, exact for the Gaussian part).
        """
        delta, accountant = _check_delta(delta), _check_accountant(accountant)
        poisson = [e for e in self._events if isinstance(e, PoissonGaussianEvent)]
        gauss = [e for e in self._events if isinstance(e, GaussianEvent)]
        if not self._events:
            return 0.0
        mechanisms = {(e.sigma, e.q) for e in poisson}
        if not gauss and len(mechanisms) == 1:
            sigma, q = mechanisms.pop()
            return epsilon(sigma, q, self.num_poisson_steps, delta, accountant)
        mu_sq_gauss = sum(e.count * e.mu**2 for e in gauss)
        if accountant == "rdp":
            rdp = sum((e.count * _rdp_vector(e.sigma, e.q) for e in poisson), np.zeros(len(RDP_ORDERS)))
            rdp = rdp + np.asarray(RDP_ORDERS) * mu_sq_gauss / 2
            return _rdp_eps_from_vector(rdp, delta)
        if accountant == "gdp_clt":
            mu_sq = mu_sq_gauss + sum(_gdp_clt_mu(e.sigma, e.q, e.count) ** 2 for e in poisson)
            return _gaussian_epsilon(math.sqrt(mu_sq), delta) if math.isfinite(mu_sq) else math.inf
        if not poisson:
            return _gaussian_epsilon(math.sqrt(mu_sq_gauss), delta)
        if accountant == "pld":
            acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=PLD_DISCRETIZATION)
            for e in poisson:
                acc.compose(
                    dp_accounting.PoissonSampledDpEvent(e.q, dp_accounting.GaussianDpEvent(e.sigma)), e.count
                )
            if gauss:
                acc.compose(dp_accounting.GaussianDpEvent(1.0 / math.sqrt(mu_sq_gauss)))
            return max(float(acc.get_epsilon(delta)), 0.0)
        history = [(e.sigma, e.q, e.count) for e in poisson]
        if gauss:
            history.append((1.0 / math.sqrt(mu_sq_gauss), 1.0, 1))
        return _prv_epsilon(history, delta, PRV_EPS_ERROR)

    def epsilons(self, delta: float) -> dict[str, float]:
        """:meth:`epsilon` under every accountant in :data:`ACCOUNTANTS`."""
        return {name: self.epsilon(delta, name) for name in ACCOUNTANTS}
