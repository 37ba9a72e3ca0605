"""The lecture's building blocks (Karimireddy, CSCI 699 lecture notes, week 3).

Laplace and Gaussian mechanisms, the classic and the analytic Gaussian calibration, basic and advanced
composition, amplification by Poisson subsampling, and private mean estimation with clipping. Small numpy
functions with input checks; the exact Gaussian curve they share lives in :mod:`.accounting`.

Neighbouring relation: the notes define DP "for any neighboring datasets D, D' in X^n", i.e. same-size
datasets differing in one record (replace-one), and derive the clipped mean's sensitivity 2 tau / n from it.
:func:`private_mean` follows that by default; ``neighbouring="add_remove"`` gives the add-or-remove-one
relation with n treated as public (sensitivity tau / n), the relation the DP-SGD accountants in
:mod:`.accounting` use.
"""

from __future__ import annotations

import math
import numbers
import warnings

import numpy as np

from dp_adam_bench.privacy.accounting import gaussian_mu
from dp_adam_bench.privacy.accounting.checks import check_delta, check_positive, is_real

NEIGHBOURING = ("replace_one", "add_remove")


def _delta_closed(name: str, value: object) -> float:
    if not is_real(value) or not (0.0 <= float(value) < 1.0):
        raise ValueError(f"{name} must be in [0, 1), got {value!r}")
    return float(value)


def _count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def _rng(rng: object) -> np.random.Generator:
    if not isinstance(rng, np.random.Generator):
        raise ValueError(f"rng must be a numpy.random.Generator (np.random.default_rng(seed)), got {rng!r}")
    return rng


def _add_noise(value, noise_fn):
    arr = np.asarray(value, dtype=float)
    noisy = arr + noise_fn(arr.shape)
    return float(noisy) if noisy.ndim == 0 else noisy


# ----------------------------------------------------------------------------------------------------------
# mechanisms and calibration
# ----------------------------------------------------------------------------------------------------------


def laplace_mechanism(value, sensitivity: float, epsilon: float, rng: np.random.Generator):
    """f(D) + Lap(Delta_1 / eps) per coordinate: eps-DP for an L1-sensitivity-Delta_1 query (notes, "Recap";
    Dwork et al. 2006). Returns a float for a scalar ``value``, an array otherwise.
    """
    scale = check_positive("sensitivity", sensitivity) / check_positive("epsilon", epsilon)
    rng = _rng(rng)
    return _add_noise(value, lambda shape: rng.laplace(0.0, scale, size=shape))


def gaussian_sigma_classic(sensitivity: float, epsilon: float, delta: float, strict: bool = True) -> float:
    """Classic calibration sigma = Delta_2 sqrt(2 ln(1.25 / delta)) / eps (notes, "Analytic vs. programatic
    Gaussian Mechanism"; Dwork & Roth 2014, Thm. A.1).

    The theorem only covers eps in (0, 1). Outside it this raises ValueError, or with ``strict=False`` warns
    and returns the formula's value (which is then not a proven calibration).
    """
    sensitivity = check_positive("sensitivity", sensitivity)
    epsilon = check_positive("epsilon", epsilon)
    delta = check_delta(delta, "delta")
    if epsilon >= 1.0:
        msg = (
            f"the classic Gaussian calibration needs epsilon in (0, 1), got {epsilon!r}; "
            "use gaussian_sigma_analytic for any epsilon"
        )
        if strict:
            raise ValueError(msg)
        warnings.warn(msg, stacklevel=2)
    return sensitivity * math.sqrt(2.0 * math.log(1.25 / delta)) / epsilon


def gaussian_sigma_analytic(sensitivity: float, epsilon: float, delta: float) -> float:
    """Smallest sigma for which N(0, sigma^2) noise on an L2-sensitivity-Delta_2 query is (eps, delta)-DP.

    The analytic Gaussian mechanism (Balle & Wang 2018, Thm. 8 and Alg. 1, cited in the notes): solve
    Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2) = delta for mu = Delta_2 / sigma by root finding on the
    exact curve (:func:`dp_adam_bench.privacy.accounting.gaussian_delta`). Valid for every eps > 0.
    """
    sensitivity = check_positive("sensitivity", sensitivity)
    return sensitivity / gaussian_mu(check_positive("epsilon", epsilon), check_delta(delta, "delta"))


def gaussian_mechanism(value, sigma: float, rng: np.random.Generator):
    """f(D) + N(0, sigma^2 I) (notes, "Recap: Gaussian mechanism"); sigma from the calibrations above."""
    sigma = check_positive("sigma", sigma)
    rng = _rng(rng)
    return _add_noise(value, lambda shape: rng.normal(0.0, sigma, size=shape))


# ----------------------------------------------------------------------------------------------------------
# composition and amplification
# ----------------------------------------------------------------------------------------------------------


def basic_composition(eps: float, delta: float, k: int) -> tuple[float, float]:
    """k-fold composition of an (eps, delta)-DP mechanism is (k eps, k delta)-DP (notes, "Composition" theorem
    for pure DP; Dwork & Roth 2014, Thm. 3.16 for delta > 0). ``delta`` may be 0 (pure DP)."""
    eps = check_positive("eps", eps)
    delta = _delta_closed("delta", delta)
    k = _count("k", k)
    return k * eps, k * delta


def advanced_composition(eps: float, delta: float, k: int, delta_prime: float) -> tuple[float, float]:
    """Advanced composition of k (eps, delta)-DP mechanisms (notes, "Theorem. Advanced Composition").

    eps~ = eps sqrt(2 k ln(1/delta')) + k eps (e^eps - 1) / (e^eps + 1), delta~ = k delta + delta'.
    The slide prints the second term as k (e^eps - 1)/(e^eps + 1), without the factor eps; the form used here
    (with it) is what the notes' Azuma argument proves: each privacy loss lies in [-eps, eps]
    and has mean at most eps tanh(eps / 2) = eps (e^eps - 1)/(e^eps + 1) (Bun & Steinke 2016; Kairouz, Oh &
    Viswanath 2015). Dwork & Roth (2014, Thm. 3.20) state the looser k eps (e^eps - 1).
    """
    eps = check_positive("eps", eps)
    delta = _delta_closed("delta", delta)
    k = _count("k", k)
    delta_prime = check_delta(delta_prime, "delta_prime")
    eps_total = eps * math.sqrt(2.0 * k * math.log(1.0 / delta_prime)) + k * eps * math.tanh(eps / 2.0)
    return eps_total, k * delta + delta_prime


def poisson_amplification(eps: float, q: float, delta: float = 0.0) -> tuple[float, float]:
    """Amplification by Poisson subsampling at rate q (notes, "Theorem. Subsampling Amplification", "Poisson
    Sampling only!"): an (eps, delta)-DP mechanism run on a Poisson subsample is
    (ln(1 - q + q e^eps), q delta)-DP. Evaluated as log1p(q expm1(eps)) for accuracy at small q eps."""
    eps = check_positive("eps", eps)
    if not is_real(q) or not (0.0 < float(q) <= 1.0):
        raise ValueError(f"q (sampling rate) must be in (0, 1], got {q!r}")
    delta = _delta_closed("delta", delta)
    return math.log1p(float(q) * math.expm1(eps)), float(q) * delta


# ----------------------------------------------------------------------------------------------------------
# private mean estimation
# ----------------------------------------------------------------------------------------------------------


def clip_rows(x, clip: float) -> np.ndarray:
    """Scale each row x_i to L2 norm at most ``clip``: x_i min(1, clip / ||x_i||_2) (a 1-D x is n scalars)."""
    clip = check_positive("clip", clip)
    arr = np.asarray(x, dtype=float)
    rows = arr.reshape(arr.shape[0], -1) if arr.ndim > 1 else arr.reshape(-1, 1)
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    with np.errstate(divide="ignore"):
        scale = np.minimum(1.0, clip / np.where(norms > 0, norms, np.inf))
    return (rows * scale).reshape(arr.shape)


def private_mean_sensitivity(n: int, clip: float, neighbouring: str = "replace_one") -> float:
    """L2 sensitivity of (1/n) sum_i clip(x_i): 2 clip / n for replace-one (the notes' relation, "sensitivity
    bounded 2 tau / n"), clip / n for add-or-remove-one with the public n as denominator."""
    n = _count("n", n)
    clip = check_positive("clip", clip)
    if neighbouring not in NEIGHBOURING:
        raise ValueError(f"unknown neighbouring relation {neighbouring!r}; valid: {', '.join(NEIGHBOURING)}")
    return (2.0 if neighbouring == "replace_one" else 1.0) * clip / n


def private_mean_sigma(
    n: int, clip: float, epsilon: float, delta: float, neighbouring: str = "replace_one"
) -> float:
    """Noise std of :func:`private_mean`: analytic Gaussian sigma for :func:`private_mean_sensitivity`."""
    return gaussian_sigma_analytic(private_mean_sensitivity(n, clip, neighbouring), epsilon, delta)


def private_mean(
    x,
    clip: float,
    epsilon: float,
    delta: float,
    rng: np.random.Generator,
    neighbouring: str = "replace_one",
):
    """(eps, delta)-DP mean of the rows of ``x`` (notes, "Unbounded Mean Estimation: Utility of private
    mean").

    mu_hat = (1/n) sum_i clip_tau(x_i) + N(0, sigma^2 I): rows clipped to L2 norm ``clip``, averaged over the
    known n, Gaussian noise from the analytic calibration (Balle & Wang 2018) with sensitivity 2 clip / n
    (replace-one, as in the notes) or clip / n (``neighbouring="add_remove"``). The notes' own noise level
    rho = 2 tau log(2/delta) / (n eps) adds more noise than even the classic calibration for delta < 0.5.
    Returns a float for 1-D ``x`` (n scalars), else an array of shape x.shape[1:].
    """
    arr = np.asarray(x, dtype=float)
    if arr.ndim == 0 or arr.shape[0] < 1:
        raise ValueError(f"x must have at least one row, got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ValueError("x must be finite (clipping cannot bound inf or nan)")
    sigma = private_mean_sigma(arr.shape[0], clip, epsilon, delta, neighbouring)
    mean = clip_rows(arr, clip).mean(axis=0)
    return gaussian_mechanism(mean, sigma, rng)
