"""The ``noise_covariance`` check (joint): every release at every step together (:func:`joint_noise_check`): the
whitened noise of each (release, step) uncorrelated with every other's and carrying its share of its release's noise
energy, as the covariance the mechanism claims says (each release on a stream of its own; std^2 C^{-1} C^{-T} across
steps): noise shared between IME's two releases, reused at any lag, or missing from a step. Exact tests, Bonferroni
over all of them; the power stated in the detail is the correlation caught with probability 0.99."""

from __future__ import annotations

import math

import numpy as np
from scipy import stats

from dp_adam_bench.audit.meter.checks.stats import z_of_p
from dp_adam_bench.audit.meter.result import MeterCheck

#: rows of the joint check's correlation matrix computed at a time
_BLOCK = 1024


def joint_noise_check(releases: list[tuple[str, np.ndarray]], level: float) -> MeterCheck:
    """The noise of every release at every step, together, against the covariance the mechanism claims.

    ``releases``: (name, whitened residual (steps, coordinates)) of each release of the run, as
    :func:`release_stats` makes it (C (y - x), C the strategy: under the claim, std_r z with z white across steps,
    releases and coordinates: every release's noise comes from a stream of its own, and a correlated mechanism's
    covariance std^2 C^{-1} C^{-T} is whitened away). Two families of tests, each exact under the claim:

    * every pair of (release, step) rows: their cosine over the d coordinates, for two independent isotropic
      Gaussian rows c sqrt(d - 1) / sqrt(1 - c^2) ~ t(d - 1) (null sd ~ 1 / sqrt d). Shared or reused noise shows
      here: IME's g and g^2 streams drawn from one seed (the same step of two releases), a draw reused at another
      step at any lag (the ``correlation`` check sees lags 1..LAGS of one release only), a correlated mechanism
      whose noise is not C^{-1} z for the C it claims;
    * every row's share of its release's total noise energy, ~ Beta(d / 2, (T - 1) d / 2): a step with more or
      less noise than the others (the ``noise_std`` check pools the steps).

    Bonferroni over all of them at ``level``. Power: a correlation of the stated size between any two rows is
    caught with probability 0.99 (normal approximation of the cosine). A release without any noise has no
    covariance to test and is left out (its ``noise_std`` check fails); a noise-free step of a noisy release fails
    the energy test."""
    arrays = [(name, np.asarray(r, dtype=np.float64)) for name, r in releases]
    # NaN would pass every comparison below by accident, naming the wrong pair
    bad = next((name for name, r in arrays if not np.isfinite(r).all()), None)
    if bad is not None:
        what = f"non-finite noise in {bad}"
        return MeterCheck("noise_covariance", "joint", math.nan, 0.0, math.inf, False, None, what, what)
    noisy = [
        (name, r) for name, r in arrays if (r != 0).any()
    ]  # a release without noise: nothing to correlate
    if not noisy or noisy[0][1].shape[1] < 2:
        return _untested(f"no noise in {', '.join(n for n, _ in releases)}: nothing to test")
    names = [f"{name}@{t + 1}" for name, r in noisy for t in range(len(r))]
    sizes = [(name, len(r)) for name, r in noisy]
    u = np.concatenate([r for _, r in noisy])
    m, d = u.shape
    energy = (u * u).sum(1)
    # unit rows (a noise-free step stays a zero row)
    u /= np.sqrt(np.maximum(energy, np.finfo(float).tiny))[:, None]
    corr, pair = _largest_cosine(u)
    pairs = m * (m - 1) // 2
    p_var, ratio, counted = _energy_shares(energy, sizes, d)
    tests = pairs + counted
    if not tests:
        return _untested("one row: nothing to test")
    crit = float(stats.norm.isf(level / (2 * tests)))
    row = int(np.argmin(p_var))
    z_pair = z_of_p(_cosine_p(corr, d)) if pairs else 0.0
    z_var = z_of_p(float(p_var[row]))
    largest = f"{abs(corr):.3f} ({names[pair[0]]} ~ {names[pair[1]]})" if pairs else "n/a"
    detail = _detail(releases, sizes, m, d, largest, ratio, crit)
    releases_seen = "+".join(name for name, _ in sizes)
    if z_var > z_pair:
        est, claimed, zw = float(ratio[row]), 1.0, z_var
        detail += f"; worst: the noise energy of {names[row]}"
        short = f"{releases_seen}, {m} rows; noise energy of {names[row]} x {est:.3f}"
    else:
        est, claimed, zw = corr, 0.0, z_pair
        short = f"{releases_seen}, {m} rows; max |corr| {largest}"
    return MeterCheck("noise_covariance", "joint", est, claimed, zw, zw <= crit, None, detail, short)


def _untested(what: str) -> MeterCheck:
    """The check with nothing to test: passed, without a z."""
    return MeterCheck("noise_covariance", "joint", math.nan, 0.0, None, True, None, what, what)


def _largest_cosine(u: np.ndarray) -> tuple[float, tuple[int, int] | None]:
    """The largest |cosine| over the pairs of unit rows ``u`` (signed) and its pair, a block of rows at a time (the
    t-test's p-value falls with |cosine|, so the worst pair is the one with the largest): memory O(block x m), not
    O(m^2)."""
    m = len(u)
    corr, pair = 0.0, None
    for start in range(0, m - 1, _BLOCK):
        g = u[start : start + _BLOCK] @ u[start:].T
        g[np.tril_indices(len(g), 0, g.shape[1])] = 0.0  # each pair once, no row with itself
        k = int(np.argmax(np.abs(g)))
        i, j = divmod(k, g.shape[1])
        if pair is None or abs(g[i, j]) > abs(corr):
            corr, pair = float(np.clip(g[i, j], -1.0, 1.0)), (start + i, start + j)
    return corr, pair


def _cosine_p(corr: float, d: int) -> float:
    """The two-sided p-value of cosine ``corr`` between two independent isotropic Gaussian rows of ``d``
    coordinates: c sqrt(d - 1) / sqrt(1 - c^2) ~ t(d - 1)."""
    t = abs(corr) * math.sqrt(d - 1) / math.sqrt(max(1.0 - corr * corr, 0.0)) if abs(corr) < 1 else math.inf
    return float(2 * stats.t.sf(t, d - 1))


def _energy_shares(energy: np.ndarray, sizes: list[tuple[str, int]], d: int):
    """Per row: the two-sided p-value of its share of its release's noise energy, ~ Beta(d / 2, (T - 1) d / 2)
    under the claim, and that share times T (1 under the claim); and how many rows were tested (a release of one
    step has no share to test)."""
    m = len(energy)
    p_var, ratio, counted, at = np.ones(m), np.ones(m), 0, 0
    for _, k in sizes:
        if k > 1:
            e = energy[at : at + k]
            share = e / e.sum()
            beta = stats.beta(d / 2, (k - 1) * d / 2)
            p_var[at : at + k] = 2 * np.minimum(beta.cdf(share), beta.sf(share))
            ratio[at : at + k] = share * k  # 1 under the claim: a step's noise energy over its release's mean
            counted += k
        at += k
    return p_var, ratio, counted


def _detail(releases, sizes, m: int, d: int, largest: str, ratio: np.ndarray, crit: float) -> str:
    """What was tested, the largest correlation and energy shares found, and the power: the correlation between
    two rows caught with probability 0.99 (normal approximation of the cosine)."""
    rho99 = (crit + float(stats.norm.isf(0.01))) / math.sqrt(d)
    what = ", ".join(f"{name} x {k}" for name, k in sizes) + (
        f"; left out, noise-free: {', '.join(n for n, _ in releases if n not in dict(sizes))}"
        if len(sizes) < len(releases)
        else ""
    )
    return (
        f"{m} rows ({what}) over {d} coordinates: largest |corr| {largest}; a step's noise energy / its "
        f"release's mean {ratio.min():.3f}..{ratio.max():.3f}; a correlation >= {rho99:.3f} between any two rows "
        "is caught with power 0.99"
    )
