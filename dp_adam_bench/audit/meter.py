"""A mechanism meter: white-box measurements, from one run, of the quantities the accountant assumed, each tested
against its claimed value with a stated power.

An epsilon audit (:mod:`~dp_adam_bench.audit.whitebox`) asks whether the canaries *look* more private than claimed;
it only sees bugs large enough to move a lower bound past the claim. The meter instead measures the mechanism the
accountant reasons about, directly: it runs the config (its variant, noise mechanism, sigma, clip, delta, sampler
and schedule, through the real trainer and privatizer) on :class:`MeterTask`, whose per-example gradients it knows,
and records every released quantity of every step: the batch the backend was asked to release, the noisy gradient
g~_t (in the clipping geometry: s_t g~_t for scale-then-privatize) and, for independent moment estimation, the
release of g_t^2. From those it predicts each release's mean, x_t = (1/B) sum_{i in batch_t} clip(s_t g_i; C)
(the meter's own clipping, not the engine's), and whitens by the mechanism's strategy C (released noise
std * C^{-1} z, so C (release - x) = std * z is white noise under the claim). Checks, per row:

* ``sampling`` — every (step, example) drawn is one the sampler's public structure allows (the steps of its slot,
  bin or cyclic group; exact), and the number drawn matches the rate q the ledger records (Poisson, cyclic
  Poisson: a binomial z-test), or the fixed schedule exactly (single pass, balls-in-bins). The structure is
  re-derived by the meter from each sampler's documented definition and public parameters (seed, N, B, b:
  :func:`sampling_reference`), never by replaying the sampler under test, so a sampler whose batches leave its
  documented order (reshuffled each epoch, shifted by a step, a wrong partition) fails instead of agreeing with
  itself. It cannot see whether Poisson draws are independent across examples and steps beyond their total rate,
  nor a rate error too small for the rate test's stated power. The shuffle sampler, accounted as Poisson without
  being Poisson, has no structure to re-derive: every pair is its reference, and it fails the fixed-schedule
  comparison;
* ``sensitivity`` (per release) — the slope a of the whitened release on the whitened prediction C x: a = 1 means
  each example moves the release by exactly its clipped contribution, C / B in L2 (a z-test, SE from the measured
  noise);
* ``noise_std`` (per release) — the std of the whitened residual against the std the privatizer states (k sigma
  C / B, the variant's Phi comes from it; for g^2 k sigma S2), pooled and per coordinate group (the shared
  coordinate, the examples' own coordinates, coordinates no example touches);
* ``correlation`` (per release) — the whitened residual's autocorrelation at lags 1..``LAGS`` across steps (a
  chi-square test): the noise is C^{-1} z with the mechanism's own C, not a reused or mis-correlated draw;
* ``noise_covariance`` (joint) — every release at every step together (:func:`joint_noise_check`): the whitened
  noise of each (release, step) uncorrelated with every other's and carrying its share of its release's noise
  energy, as the covariance the mechanism claims says (each release on a stream of its own; std^2 C^{-1} C^{-T}
  across steps): noise shared between IME's two releases, reused at any lag, or missing from a step;
* ``multiplier`` — the noise multiplier of the joint release, (sum_r (Delta_r a_r / std_r)^2)^{-1/2}, with the
  measured stds and slopes and the sensitivities Delta_r the meter derives from the release's mean function
  (C / B for g~; (2 B_max - 1) C^2 / B^2 for the square of the mean, B_max the largest batch seen), tested
  one-sided against the noise multiplier the accountant used (``plan.account_sigma``): a mechanism noisier than
  accounted is no privacy bug, one less noisy is;
* ``post_processing`` — the registered variant, replayed on the recorded releases alone (no clean gradient),
  reproduces the run's parameters at every step (exact, to 1e-12): the update is a function of the releases.

Every statistical check is a z- or chi-square test at level ``ALPHA`` / (number of checks) (a union bound: a
correct mechanism fails any check of a row with probability <= ALPHA). Its power against a 10 % error
(``EFFECT``: sigma, the sensitivity or q off by 10 %) is computed from the run's own standard errors and stated
with the result; tests/test_meter.py plants such errors many times and checks the detection rate.

Canaries share coordinates: each example's gradient is a vector of norm ``NORMS[i % 8]`` C (five in eight 1e6 C,
clipped to exactly C; one each 1.01 C, 0.99 C and C / 2, the last two not clipped: a clip factor wrong below C,
such as every gradient scaled to exactly C, moves the release; the slope of each class is reported in the
sensitivity check's detail, but only the pooled slope is tested, so an error confined to gradients within 1 % of C
moves it by about 0.1 % and is not seen) with weight ``SHARED`` on one coordinate every example shares and the
rest on a coordinate of its own, so the square of the mean has the cross term 2 x_shared x_i of every pair of
examples, whence IME's (2B - 1) C^2 / B^2 sensitivity. The task has ``trials`` independent trials (the vector
backend's trial dimension: the same batches, independent noise) so that a 100-step run has the stated power.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np
import torch
from omegaconf import OmegaConf
from scipy import stats

from dp_adam_bench.engine.backends import VectorBackend
from dp_adam_bench.errors import ConfigError

#: weight of the shared coordinate in every example's (unit) gradient direction; the rest is on its own coordinate
SHARED = 0.95
#: coordinates no example touches (pure noise)
NULL_COORDS = 64
#: the canaries' gradient norms, in units of C, by example (example i has NORMS[i % len(NORMS)]): mostly far above C
#: (clipped to exactly C, also after stp's per-coordinate scale), one in eight each just above and just below C and
#: at half of C (not clipped), so that a wrong clip factor for gradients near or below C (every gradient scaled to
#: exactly C; min(1, C / n) written as C / n) moves the release away from the meter's prediction. Five in eight far
#: above C keep the square of the mean, so the stated power of IME's g^2 release, >= 0.99 on the table's rows
NORMS = (1e6, 1e6, 1e6, 1e6, 1e6, 1.01, 0.99, 0.5)
#: norm (in units of C) -> the name of its class
NORM_CLASSES = {1e6: "far above C", 1.01: "just above C", 0.99: "just below C", 0.5: "C / 2"}
#: independent trials of the meter task (same batches, independent noise)
TRIALS = 16
#: lags of the autocorrelation test
LAGS = 10
#: the probability that a correct mechanism fails any check of a row (union bound over the checks)
ALPHA = 1e-3
#: the relative error whose detection probability (power) is stated
EFFECT = 0.10
#: relative tolerance of the post-processing replay
REPLAY_TOL = 1e-12


def example_norms(n: int) -> np.ndarray:
    """The gradient norm of each of ``n`` canaries, in units of C."""
    return np.asarray(NORMS, dtype=np.float64)[np.arange(int(n)) % len(NORMS)]


def class_members(n: int) -> dict[str, np.ndarray]:
    """Norm class -> the canaries (of ``n``) in it (classes with none left out)."""
    norms = example_norms(n)
    out = {name: np.flatnonzero(norms == value) for value, name in NORM_CLASSES.items()}
    return {name: ids for name, ids in out.items() if len(ids)}


class MeterTask:
    """A vector task with known, parameter-free per-example gradients: example i is NORMS[i % 8] C (SHARED e_0 +
    sqrt(1 - SHARED^2) e_{1+i}); NULL_COORDS coordinates after them are never touched. ``trials`` independent trials
    (parameters of shape (trials, 1 + n + NULL_COORDS), float64)."""

    name = "meter_canaries"
    trial_dims = 1

    def __init__(self, n: int, clip: float, trials: int = TRIALS, null: int = NULL_COORDS):
        self.n, self.trials, self.null = int(n), int(trials), int(null)
        self.dim = 1 + self.n + self.null
        self.magnitudes = torch.as_tensor(example_norms(self.n) * float(clip))
        self.own = math.sqrt(1.0 - SHARED**2)

    @property
    def dataset_size(self) -> int:
        return self.n

    def init_params(self) -> list[torch.Tensor]:
        return [torch.zeros(self.trials, self.dim, dtype=torch.float64)]

    def per_example_grads(self, params, idx: torch.Tensor) -> list[torch.Tensor]:
        idx = torch.as_tensor(idx, dtype=torch.long)
        g = torch.zeros(len(idx), self.trials, self.dim, dtype=torch.float64)
        m = self.magnitudes[idx]
        g[:, :, 0] = (m * SHARED)[:, None]
        g[torch.arange(len(idx)), :, 1 + idx] = (m * self.own)[:, None]
        return [g]

    def groups(self) -> dict[str, slice]:
        """The coordinate groups whose noise is checked separately."""
        return {
            "shared": slice(0, 1),
            "own": slice(1, 1 + self.n),
            "null": slice(1 + self.n, self.dim),
        }

    def class_masks(self) -> dict[str, np.ndarray]:
        """Norm class -> the examples' own coordinates of that class, over the flattened (trials, dim)."""
        out = {}
        for name, ids in class_members(self.n).items():
            mask = np.zeros((self.trials, self.dim), dtype=bool)
            mask[:, 1 + ids] = True
            out[name] = mask.reshape(-1)
        return out

    def evaluate(self, params) -> dict[str, torch.Tensor]:
        return {"meter_param_norm": params[0].norm(dim=1)}


@dataclass
class StepRecord:
    idx: torch.Tensor
    scale: torch.Tensor | None
    noisy: torch.Tensor
    noisy_square: torch.Tensor | None
    noise_std: float
    ctx: object  # the step's StepContext (side information is set on it after the release)


class MeterBackend(VectorBackend):
    """The vector backend, recording every release and the parameters before it; with a control, its broken
    privatizer (built once from the trainer's) makes the releases."""

    def __init__(self, task: MeterTask, control=None):
        super().__init__(task)
        self.control = control
        self._broken = None
        self.privatizer = None
        self.records: list[StepRecord] = []
        self.params_before: list[torch.Tensor] = []

    def release(self, idx, privatizer, scale):
        if self.control is not None:
            if self._broken is None:
                self._broken = self.control.wrap(privatizer)
            privatizer = self._broken
        self.privatizer = privatizer
        self.params_before.append(self.params[0].detach().clone())
        out = super().release(idx, privatizer, scale)
        ctx = out.ctx
        self.records.append(
            StepRecord(
                idx=torch.as_tensor(idx).clone(),
                scale=None if scale is None else scale[0].detach().clone(),
                noisy=ctx.noisy[0].detach().clone(),
                noisy_square=None if ctx.noisy_square is None else ctx.noisy_square[0].detach().clone(),
                noise_std=float(ctx.noise_std),
                ctx=ctx,
            )
        )
        return out

    def public_grad(self, pick: torch.Tensor) -> list[torch.Tensor]:
        return [g.mean(0) for g in self.task.per_example_grads(self.params, pick)]


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
            + (f" (model task, {self.engine} engine)" if self.engine else "")
            + (f" [control {self.control}]" if self.control else "")
            + f": sigma = {self.sigma:g} (accounted {self.account_sigma:.4g}), {self.steps} steps, N = "
            f"{self.dataset_size}, B = {self.batch_size:g}, {self.trials} trials; each check at level "
            f"{self.alpha:g} / {len(self.checks)}"
        )
        return "\n".join(
            [head, *(c.describe() for c in self.checks), f"  -> {self.summary()} (power {self.power:.4f})"]
        )


# --- the statistics (pure functions of the recorded arrays: tests/test_meter.py simulates them) -------------------
def critical(alpha: float, tests: int, two_sided: bool = True) -> float:
    """The z a test must exceed to fail at level alpha / tests."""
    level = alpha / tests
    return float(stats.norm.isf(level / 2 if two_sided else level))


def power_at(effect: float, se: float, crit: float) -> float:
    """P[|z| > crit] (two-sided, far tail neglected) when the true relative error is ``effect``, the SE ``se``."""
    if not se > 0:
        return 1.0
    return float(stats.norm.cdf(abs(effect) / se - crit))


@dataclass
class ReleaseStats:
    """Estimates for one release from its whitened arrays."""

    slope: float
    slope_se: float  # relative
    std: float
    std_se: float  # relative (of the std, under the claim)
    group_std: dict[str, float]
    group_n: dict[str, int]
    lag_q: float  # sum_l n_l rho_l^2, chi-square with LAGS degrees of freedom under the claim
    lags: int
    n: int
    #: the whitened residual C (y - x), (steps, coordinates): std * white noise under the claim
    resid: np.ndarray | None = field(default=None, repr=False)
    #: norm class -> (slope, relative SE) on the own coordinates of that class's examples
    class_slope: dict[str, tuple[float, float]] = field(default_factory=dict)


def release_stats(
    y: np.ndarray,
    x: np.ndarray,
    strategy: np.ndarray | None,
    groups: dict[str, np.ndarray] | None = None,
    classes: dict[str, np.ndarray] | None = None,
) -> ReleaseStats:
    """``y``: the release, ``x``: its predicted mean, both (steps, coordinates); ``strategy``: C (None: I);
    ``groups``: name -> boolean mask over the coordinates (noise std by group); ``classes``: norm class -> mask
    over the coordinates (the slope by class)."""
    t = len(y)
    if strategy is not None:
        c = np.asarray(strategy, dtype=np.float64)[:t, :t]
        y, x = c @ y, c @ x
    xx = float((x * x).sum())
    slope = float((y * x).sum() / xx) if xx > 0 else math.nan
    resid = y - x
    n = resid.size
    std = float(np.sqrt((resid * resid).mean()))
    slope_se = std / math.sqrt(xx) if xx > 0 else math.inf
    group_std, group_n = {}, {}
    for name, mask in (groups or {}).items():
        r = resid[:, mask]
        group_std[name] = float(np.sqrt((r * r).mean())) if r.size else math.nan
        group_n[name] = int(r.size)
    lags = min(LAGS, t - 1)
    q = 0.0
    for lag in range(1, lags + 1):
        prod = resid[lag:] * resid[:-lag]
        rho = float(prod.mean()) / (std * std) if std > 0 else 0.0
        q += prod.size * rho * rho
    class_slope = {}
    for name, mask in (classes or {}).items():
        cx, cy = x[:, mask], y[:, mask]
        cxx = float((cx * cx).sum())
        if cxx > 0:
            class_slope[name] = (float((cy * cx).sum()) / cxx, std / math.sqrt(cxx))
    return ReleaseStats(
        slope, slope_se, std, 1 / math.sqrt(2 * n), group_std, group_n, q, lags, n, resid, class_slope
    )


def _ratio(a: float, b: float) -> float:
    """a / b, with 0 / 0 = 1 (a noise-free release stated as noise-free) and a / 0 = inf."""
    if b > 0:
        return a / b
    return 1.0 if a == 0 else math.inf


def _z(diff: float, se: float) -> float:
    """diff / se, with 0 / 0 = 0 and diff / 0 = +-inf."""
    if se > 0 and math.isfinite(se):
        return diff / se
    if diff == 0 or not math.isfinite(se):
        return 0.0 if diff == 0 or se > 0 else math.copysign(math.inf, diff)
    return math.copysign(math.inf, diff)


def release_checks(name: str, s: ReleaseStats, stated_std: float, alpha_crit: float) -> list[MeterCheck]:
    """The sensitivity, noise_std and correlation checks of one release."""
    out = []
    z = _z(s.slope - 1, s.slope_se)
    out.append(
        MeterCheck(
            "sensitivity",
            name,
            s.slope,
            1.0,
            z,
            abs(z) <= alpha_crit,
            power_at(EFFECT, s.slope_se, alpha_crit),
            "slope of the release on its predicted clipped mean"
            + (
                "; by norm (own coordinates): "
                + ", ".join(f"{k} {a:.3f} +- {se:.3f}" for k, (a, se) in s.class_slope.items())
                if s.class_slope
                else ""
            ),
        )
    )
    ratio = _ratio(s.std, stated_std)
    z = _z(ratio - 1, s.std_se)
    worst, detail = z, []
    for g, gs in s.group_std.items():
        if s.group_n[g]:
            gz = _z(_ratio(gs, stated_std) - 1, 1 / math.sqrt(2 * s.group_n[g]))
            detail.append(f"{g} {_ratio(gs, stated_std):.4f}")
            if abs(gz) > abs(worst):
                worst = gz
    out.append(
        MeterCheck(
            "noise_std",
            name,
            ratio,
            1.0,
            z,
            abs(worst) <= alpha_crit,
            power_at(EFFECT, s.std_se, alpha_crit),
            "measured / stated std; by group: " + ", ".join(detail),
        )
    )
    p = float(stats.chi2.sf(s.lag_q, s.lags)) if s.lags else 1.0
    zq = float(stats.norm.isf(max(p / 2, 1e-300))) if p < 1 else 0.0
    out.append(
        MeterCheck(
            "correlation",
            name,
            s.lag_q / max(s.lags, 1),
            1.0,
            zq,
            zq <= alpha_crit,
            None,
            f"whitened residual, lags 1..{s.lags}: chi2 / df",
        )
    )
    return out


def multiplier_check(
    parts: list[tuple[float, float, float, float, float]], account_sigma: float, crit_one_sided: float
) -> MeterCheck:
    """``parts``: per release (sensitivity Delta, slope a, slope SE (relative), std, std SE (relative)). The joint
    noise multiplier (sum_r (Delta_r a_r / std_r)^2)^{-1/2} against the accountant's, one-sided."""
    if any(s <= 0 for _, _, _, s, _ in parts):  # a release without noise: no multiplier at all
        mult, se = 0.0, 0.0
    else:
        u = [(d * a / s) ** 2 for d, a, _, s, _ in parts]
        total = sum(u)
        mult = total**-0.5 if total > 0 else math.inf
        rel_u = [2 * math.hypot(sa / max(abs(a), 1e-300), ss) for _, a, sa, _, ss in parts]
        se = 0.5 * math.sqrt(sum((ui * ri) ** 2 for ui, ri in zip(u, rel_u, strict=True))) / total
    ratio = mult / account_sigma
    z = _z(ratio - 1, se)
    return MeterCheck(
        "multiplier",
        "joint",
        ratio,
        1.0,
        z,
        z >= -crit_one_sided,
        power_at(EFFECT, se, crit_one_sided),
        f"measured {mult:.4g} / accounted {account_sigma:.4g} (one-sided: fails only below)",
    )


#: rows of the joint check's correlation matrix computed at a time
_BLOCK = 1024


def _z_of_p(p: float) -> float:
    """The two-sided normal z of p-value ``p`` (inf for 0)."""
    return float(stats.norm.isf(max(p / 2, 1e-300))) if p > 0 else math.inf


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
    names, rows, sizes = [], [], []
    for name, r in releases:
        r = np.asarray(r, dtype=np.float64)
        if not np.isfinite(
            r
        ).all():  # NaN would pass every comparison below by accident, naming the wrong pair
            what = f"non-finite noise in {name}"
            return MeterCheck("noise_covariance", "joint", math.nan, 0.0, math.inf, False, None, what, what)
        if not (r != 0).any():  # a release without noise: nothing to correlate
            continue
        names += [f"{name}@{t + 1}" for t in range(len(r))]
        rows.append(r)
        sizes.append((name, len(r)))
    if not rows or rows[0].shape[1] < 2:
        what = f"no noise in {', '.join(n for n, _ in releases)}: nothing to test"
        return MeterCheck("noise_covariance", "joint", math.nan, 0.0, None, True, None, what, what)
    u = np.concatenate(rows)
    m, d = u.shape
    energy = (u * u).sum(1)
    # unit rows (a noise-free step stays a zero row)
    u /= np.sqrt(np.maximum(energy, np.finfo(float).tiny))[:, None]
    # the largest |cosine| over the pairs, a block of rows at a time (the t-test's p-value falls with |cosine|, so
    # the worst pair is the one with the largest): memory O(block x m), not O(m^2)
    corr, pair = 0.0, None
    for start in range(0, m - 1, _BLOCK):
        g = u[start : start + _BLOCK] @ u[start:].T
        g[np.tril_indices(len(g), 0, g.shape[1])] = 0.0  # each pair once, no row with itself
        k = int(np.argmax(np.abs(g)))
        i, j = divmod(k, g.shape[1])
        if pair is None or abs(g[i, j]) > abs(corr):
            corr, pair = float(np.clip(g[i, j], -1.0, 1.0)), (start + i, start + j)
    pairs = m * (m - 1) // 2
    p_pair = 1.0
    if pairs:
        t = (
            abs(corr) * math.sqrt(d - 1) / math.sqrt(max(1.0 - corr * corr, 0.0))
            if abs(corr) < 1
            else math.inf
        )
        p_pair = float(2 * stats.t.sf(t, d - 1))
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
    tests = pairs + counted
    if not tests:
        what = "one row: nothing to test"
        return MeterCheck("noise_covariance", "joint", math.nan, 0.0, None, True, None, what, what)
    crit = float(stats.norm.isf(level / (2 * tests)))
    row = int(np.argmin(p_var))
    z_pair = _z_of_p(p_pair) if pairs else 0.0
    z_var = _z_of_p(float(p_var[row]))
    rho99 = (crit + float(stats.norm.isf(0.01))) / math.sqrt(d)
    what = ", ".join(f"{name} x {k}" for name, k in sizes) + (
        f"; left out, noise-free: {', '.join(n for n, _ in releases if n not in dict(sizes))}"
        if len(sizes) < len(releases)
        else ""
    )
    largest = f"{abs(corr):.3f} ({names[pair[0]]} ~ {names[pair[1]]})" if pairs else "n/a"
    detail = (
        f"{m} rows ({what}) over {d} coordinates: largest |corr| {largest}; a step's noise energy / its "
        f"release's mean {ratio.min():.3f}..{ratio.max():.3f}; a correlation >= {rho99:.3f} between any two rows "
        "is caught with power 0.99"
    )
    releases_seen = "+".join(name for name, _ in sizes)
    if z_var > z_pair:
        est, claimed, zw = float(ratio[row]), 1.0, z_var
        detail += f"; worst: the noise energy of {names[row]}"
        short = f"{releases_seen}, {m} rows; noise energy of {names[row]} x {est:.3f}"
    else:
        est, claimed, zw = corr, 0.0, z_pair
        short = f"{releases_seen}, {m} rows; max |corr| {largest}"
    return MeterCheck("noise_covariance", "joint", est, claimed, zw, zw <= crit, None, detail, short)


def rate_check(drawn: int, eligible: int, q: float, crit: float) -> MeterCheck:
    """Poisson-type sampling: ``drawn`` of ``eligible`` (step, example) pairs, each drawn with probability q."""
    expected = q * eligible
    sd = math.sqrt(eligible * q * (1 - q)) if 0 < q < 1 else 0.0
    z = (drawn - expected) / sd if sd > 0 else (0.0 if drawn == expected else math.inf)
    se = sd / expected if expected > 0 else math.inf
    return MeterCheck(
        "sampling",
        "",
        drawn / expected if expected else math.nan,
        1.0,
        z,
        abs(z) <= crit,
        power_at(EFFECT, se, crit),
        f"{drawn} drawn of {eligible} eligible (step, example) pairs at q = {q:.4g}",
    )


# --- the run ---------------------------------------------------------------------------------------------------
def sampling_reference(sampler, steps: int) -> np.ndarray:
    """(steps, N): whether the sampler's position i may be in the batch of step t (0-based), re-derived here from
    the sampler's documented definition and its public parameters (kind, N, B, b, seed, shuffle), never through
    the sampler's own batches (``iter_from``) or the structures it derived (``groups``, ``members``, ``bins``): a
    sampler whose batches leave its documented order would otherwise be its own reference and agree with itself.

    * single pass: one permutation ``torch.randperm(N)`` from ``torch.Generator().manual_seed(seed)`` (the identity
      without ``shuffle``), cut into N // B batches of B (the last partial batch dropped), cycled epoch after epoch;
    * balls-in-bins: example i's bin is entry i of ``torch.randint(b, (N,))`` from the seed's generator; step t
      holds bin t mod b;
    * cyclic Poisson: group g is ``order[g::b]`` of the seed's permutation ``order``; step t draws from group
      t mod b;
    * Poisson (and any other kind, such as shuffle): every example at every step. Poisson's reference is the whole
      set, independent of the sampler by construction; its draws are judged by the rate alone.
    """
    n, kind = int(sampler.n), getattr(sampler, "kind", "")
    t = np.arange(int(steps))[:, None]
    if kind == "single_pass":
        batch = int(sampler.batch_size)
        per_epoch = n // batch
        order = (
            torch.randperm(n, generator=torch.Generator().manual_seed(int(sampler.seed)))
            if sampler.shuffle
            else torch.arange(n)
        ).numpy()
        slot = np.full(n, -1, dtype=np.int64)  # -1: in the dropped partial batch, never drawn
        slot[order[: per_epoch * batch]] = np.arange(per_epoch * batch) // batch
        return (t % per_epoch) == slot[None, :]
    if kind == "balls_in_bins":
        b = int(sampler.cycle_length)
        bins = torch.randint(b, (n,), generator=torch.Generator().manual_seed(int(sampler.seed))).numpy()
        return (t % b) == bins[None, :]
    if kind == "cyclic_poisson":
        b = int(sampler.cycle_length)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(int(sampler.seed))).numpy()
        group = np.empty(n, dtype=np.int64)
        group[order] = np.arange(n) % b  # order[g::b] is group g
        return (t % b) == group[None, :]
    return np.ones((int(steps), n), dtype=bool)


def _sampling_check(recs, population: np.ndarray, sampler, n: int, crit: float) -> MeterCheck:
    """The support (exact) and the rate (Poisson kinds) or the fixed schedule of the batches drawn, against
    :func:`sampling_reference` (independent of the sampler's code). ``population``: the dataset index of each of
    the sampler's positions; ``n``: the task's examples."""
    T = len(recs)
    eligible = sampling_reference(sampler, T)
    pos_of = np.full(n, -1, dtype=np.int64)
    pos_of[population] = np.arange(len(population))
    drawn = np.zeros((T, len(population)), dtype=bool)
    strays = 0  # indices of no private example (out of range, or a public example): outside any structure
    for t, rec in enumerate(recs):
        idx = rec.idx.numpy()
        valid = (idx >= 0) & (idx < n)
        pos = pos_of[idx[valid]]
        strays += int((~valid).sum() + (pos < 0).sum())
        drawn[t, pos[pos >= 0]] = True
    outside = int((drawn & ~eligible).sum()) + strays
    if outside:
        what = f"{outside} (step, example) pairs drawn outside the sampler's public structure"
        return MeterCheck("sampling", "", float(outside), 0.0, None, False, None, what)
    if sampler.kind in ("poisson", "cyclic_poisson"):
        return rate_check(int(drawn.sum()), int(eligible.sum()), float(sampler.q), crit)
    same = bool((drawn == eligible).all())
    what = (
        "every example at exactly the steps of its fixed schedule"
        if same
        else f"{int((eligible & ~drawn).sum())} (step, example) pairs of the fixed schedule not drawn"
    )
    return MeterCheck("sampling", "", float(drawn.sum()), float(eligible.sum()), None, same, 1.0, what)


def _predicted(task: MeterTask, records: list[StepRecord], clip: float, batch: float):
    """Per step: the predicted scaled mean (trials, dim) and the unscaled mean, with the meter's own clipping."""
    xs, means = [], []
    for rec in records:
        g = task.per_example_grads(None, rec.idx)[0]
        s = rec.scale if rec.scale is not None else torch.ones(task.trials, task.dim, dtype=torch.float64)
        sg = g * s
        norms = sg.pow(2).sum(-1).sqrt()  # (b, trials)
        f = torch.where(norms > clip, clip / norms, torch.ones_like(norms))
        x = (sg * f[..., None]).sum(0) / batch
        xs.append(x)
        means.append(x / s)
    return xs, means


def _replay(run, records: list[StepRecord], before: list[torch.Tensor], final: torch.Tensor) -> MeterCheck:
    """The registered variant on the recorded releases alone reproduces the trajectory."""
    from dp_adam_bench.optim.registry import build_variant

    cfg = run.cfg
    variant = build_variant(cfg.optimizer.name, **{k: v for k, v in cfg.optimizer.items() if k != "name"})
    variant.decay_mask = run.variant.decay_mask  # weight decay's mask: the model's structure, not data
    params = [before[0].clone()]
    after = [*before[1:], final]
    worst, failed_at, why = 0.0, None, ""
    try:
        state = variant.init(params)
        base = variant.lr
        for t, (rec, target) in enumerate(zip(records, after, strict=True), start=1):
            ctx = dataclasses.replace(
                rec.ctx,
                noisy=[rec.noisy.clone()],
                noisy_square=None if rec.noisy_square is None else [rec.noisy_square.clone()],
                clean=None,
            )
            variant.lr = base * run.schedule.factor(t)
            with torch.no_grad():
                variant.update(params, state, ctx)
            scale = float(target.abs().max()) or 1.0
            err = float((params[0] - target).abs().max()) / scale
            worst = max(worst, err)
            if err > REPLAY_TOL and failed_at is None:
                failed_at = t
    except Exception as exc:  # e.g. a variant that needs the clean gradient
        why = f"the registered variant cannot run on the releases alone: {type(exc).__name__}: {exc}"
        return MeterCheck("post_processing", "", math.inf, REPLAY_TOL, None, False, None, why)
    detail = (
        "replayed from the releases"
        if failed_at is None
        else f"the run's parameters differ from the replay from step {failed_at}"
    )
    return MeterCheck(
        "post_processing", "", worst, REPLAY_TOL, None, failed_at is None, None, detail + " (max rel. diff)"
    )


def meter_config(
    cfg,
    *,
    n: int = 1200,
    trials: int = TRIALS,
    control=None,
    control_name: str | None = None,
    alpha: float = ALPHA,
) -> MeterResult:
    """Meter the mechanism of config ``cfg`` (validated) on a :class:`MeterTask` of ``n`` examples; ``control``: a
    :class:`~dp_adam_bench.audit.controls.Control` (its broken privatizer, sampler or variant replace the run's)."""
    from dp_adam_bench.audit.whitebox import AUDIT_OVERRIDES, run_controlled
    from dp_adam_bench.engine import trainer
    from dp_adam_bench.optim.registry import VARIANTS
    from dp_adam_bench.privacy.noise_factory import NOISE

    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    for key, value in AUDIT_OVERRIDES.items():
        OmegaConf.update(cfg, key, value, force_add=True)
    if not NOISE.get(cfg.noise.kind).private:
        raise ConfigError(f"noise.kind={cfg.noise.kind!r} adds no noise: there is no mechanism to meter")
    side = VARIANTS.get(cfg.optimizer.name).needs_side_info
    if side:  # as the audit: a public share held out of the private set
        public = max(1, n // 12)
        OmegaConf.update(cfg, "train.side_info.public_examples", public, force_add=True)
        batch = min(int(cfg.train.side_info.get("batch_size", 256)), public)
        OmegaConf.update(cfg, "train.side_info.batch_size", batch, force_add=True)
    clip = float(cfg.privacy.clip)
    task = MeterTask(n, clip, trials)
    run = trainer.prepare(cfg, task)
    run.backend.close()
    backend = MeterBackend(task, control)
    population = run.population.numpy()
    # the sampling check's reference is the meter's own (sampling_reference), not run_controlled's eligible steps:
    # those replay the sampler under test
    run, _, honest_sampler, _ = run_controlled(
        cfg, run, control, lambda run: backend, np.arange(len(population)), prefix="dp-adam-bench-meter-"
    )
    plan = run.plan
    recs = backend.records
    T = len(recs)
    B = float(honest_sampler.expected_batch_size)
    strategy = plan.strategy.matrix() if plan.strategy is not None else None
    has_square = recs[0].noisy_square is not None
    # sampling, multiplier, noise covariance, post-processing + 3 per release
    checks_count = 4 + 3 * (1 + has_square)
    crit = critical(alpha, checks_count)
    crit1 = critical(alpha, checks_count, two_sided=False)
    checks: list[MeterCheck] = []

    checks.append(_sampling_check(recs, population, honest_sampler, task.n, crit))
    kind = honest_sampler.kind

    # the releases
    xs, means = _predicted(task, recs, clip, B)
    groups = {}
    for g, sl in task.groups().items():
        mask = np.zeros((trials, task.dim), dtype=bool)
        mask[:, sl] = True
        groups[g] = mask.reshape(-1)
    y = np.stack(
        [(rec.noisy * (rec.scale if rec.scale is not None else 1.0)).numpy().reshape(-1) for rec in recs]
    )
    x = np.stack([v.numpy().reshape(-1) for v in xs])
    sg = release_stats(y, x, strategy, groups, task.class_masks())
    stated = recs[0].noise_std
    checks += release_checks("g", sg, stated, crit)
    parts = [(clip / B, sg.slope, sg.slope_se, sg.std, sg.std_se)]
    whitened = [("g", sg.resid)]
    if has_square:
        y2 = np.stack([rec.noisy_square.numpy().reshape(-1) for rec in recs])
        x2 = np.stack([(m * m).numpy().reshape(-1) for m in means])
        s2 = release_stats(y2, x2, strategy, groups)
        p = backend.privatizer
        stated2 = p.releases.noise_scale * p.sigma * p.releases.square_sensitivity(p.clip, p.B)
        checks += release_checks("g^2", s2, stated2, crit)
        b_max = max(len(rec.idx) for rec in recs)
        parts.append(((2 * b_max - 1) * clip**2 / B**2, s2.slope, s2.slope_se, s2.std, s2.std_se))
        whitened.append(("g^2", s2.resid))
    checks.insert(1, multiplier_check(parts, float(plan.account_sigma), crit1))
    checks.append(joint_noise_check(whitened, alpha / checks_count))
    checks.append(_replay(run, recs, backend.params_before, backend.params[0].detach().clone()))
    return MeterResult(
        variant=run.variant.name,
        noise=str(cfg.noise.kind),
        sampler=kind,
        sigma=float(plan.sigma),
        account_sigma=float(plan.account_sigma),
        steps=T,
        trials=trials,
        dataset_size=n,
        batch_size=B,
        alpha=alpha,
        checks=checks,
        control=control_name,
    )


# --- the real path: a model task through the clipping engines ----------------------------------------------------
#: the model-path canaries' gradient norm, in units of C (float32 parameters: far above C, far from overflow)
MODEL_NORM = 1e3


class _Bilinear(torch.nn.Module):
    """y = W x + b with W of shape (2, features): a model whose per-example loss <u, W x + b> has the gradients
    (u x^T, u), known in closed form whatever the parameters."""

    def __init__(self, features: int):
        super().__init__()
        self.lin = torch.nn.Linear(features, 2)

    def forward(self, x):
        return self.lin(x)


class ModelMeterTask:
    """A model task for the real clipping engines: example i has input x_i = a (SHARED e_0 + sqrt(1 - SHARED^2)
    e_{1+i}) and loss <e_0, W x_i + b>, so its gradient is x_i on W's first row and 1 on the first bias: every example
    shares W[0, 0] and the bias b[0] and owns W[0, 1 + i]; W's second row and b[1] are never touched. ``a`` makes
    the gradient norm MODEL_NORM C, so every example is clipped; with ``norms``, example i's loss is weighted so
    that its gradient norm is NORMS[i % 8] C instead (MODEL_NORM C for the class far above C): the meter's
    canaries below and near C."""

    name = "meter_model"

    def __init__(
        self,
        n: int,
        clip: float,
        shared: float = SHARED,
        included: np.ndarray | None = None,
        norms: bool = False,
    ):
        self.n = int(n)
        weights = np.ones(self.n)
        if norms:
            weights = np.minimum(example_norms(self.n), MODEL_NORM) / MODEL_NORM
        self.weights = torch.as_tensor(weights, dtype=torch.float64)
        self.features = 1 + self.n
        self.shared = float(shared)
        # ||(x_i, 1)|| = MODEL_NORM C: a^2 + 1 = (MODEL_NORM C)^2
        self.a = math.sqrt((MODEL_NORM * float(clip)) ** 2 - 1.0)
        # the white-box audit's inclusion flags: an excluded example's loss is 0 (a zero gradient: zero-out)
        self.included = None if included is None else torch.as_tensor(np.asarray(included, dtype=bool))

    @property
    def dataset_size(self) -> int:
        return self.n

    def inputs(self, idx: torch.Tensor) -> torch.Tensor:
        idx = torch.as_tensor(idx, dtype=torch.long)
        x = torch.zeros(len(idx), self.features, dtype=torch.float64)
        x[:, 0] = self.a * self.shared
        x[torch.arange(len(idx)), 1 + idx] = self.a * math.sqrt(1.0 - self.shared**2)
        return x

    def build_model(self) -> torch.nn.Module:
        return _Bilinear(self.features)

    def get_batch(self, indices) -> dict:
        idx = torch.as_tensor(indices, dtype=torch.long)
        keep = self.weights[idx] * (1.0 if self.included is None else self.included[idx].double())
        return {"x": self.inputs(idx).float(), "keep": keep.float()}

    def loss_per_example(self, forward, batch):
        return forward(batch["x"])[:, 0] * batch["keep"]

    def evaluate(self, model) -> dict:
        return {"meter_weight_norm": float(model.lin.weight.norm())}

    def closed_form_grads(self, idx: torch.Tensor) -> list[torch.Tensor]:
        """The closed-form per-example gradients (weight, bias), float64, in the model's parameter order (not
        named per_example_grads: that would make the trainer take it for a vector task)."""
        x = self.inputs(idx)
        idx = torch.as_tensor(idx, dtype=torch.long)
        keep = self.weights[idx].clone()
        if self.included is not None:
            keep = keep * self.included[idx].double()
        w = torch.zeros(len(x), 2, self.features, dtype=torch.float64)
        w[:, 0] = x * keep[:, None]
        b = torch.zeros(len(x), 2, dtype=torch.float64)
        b[:, 0] = keep
        return [w, b]

    def groups(self) -> dict[str, np.ndarray]:
        """Coordinate groups over the flattened (weight, bias)."""
        f = self.features
        size = 2 * f + 2
        out = {}
        for name, idx in (
            ("shared", [0]),
            ("own", list(range(1, f))),
            ("null", list(range(f, 2 * f)) + [2 * f + 1]),
            ("bias", [2 * f]),
        ):
            mask = np.zeros(size, dtype=bool)
            mask[idx] = True
            out[name] = mask
        return out

    def class_masks(self) -> dict[str, np.ndarray]:
        """Norm class -> its examples' own weights W[0, 1 + i], over the flattened (weight, bias)."""
        out = {}
        for name, ids in class_members(self.n).items():
            mask = np.zeros(2 * self.features + 2, dtype=bool)
            mask[1 + ids] = True
            out[name] = mask
        return out


class ModelRecorder:
    """Wraps the trainer's :class:`~dp_adam_bench.engine.backends.ModelBackend`: records every release (through its
    public ``release``) and the parameters before it; a control's broken engine (at the engine interface,
    ``clipped_sum``) or privatizer replaces the real one."""

    def __init__(self, inner, control=None):
        self.inner = inner
        self.control = control
        self._broken = None
        self.privatizer = None
        self.records: list[StepRecord] = []
        self.params_before: list[list[torch.Tensor]] = []
        if control is not None:
            inner.engine = control.wrap_engine(inner.engine, inner.model)

    def release(self, idx, privatizer, scale):
        if self.control is not None:
            if self._broken is None:
                self._broken = self.control.wrap(privatizer)
            privatizer = self._broken
        self.privatizer = privatizer
        self.params_before.append([p.detach().clone() for p in self.inner.params])
        out = self.inner.release(idx, privatizer, scale)
        ctx = out.ctx
        flat = torch.cat([g.detach().double().reshape(-1) for g in ctx.noisy])
        square = None
        if ctx.noisy_square is not None:
            square = torch.cat([g.detach().double().reshape(-1) for g in ctx.noisy_square])
        s = None if scale is None else torch.cat([v.detach().double().reshape(-1) for v in scale])
        self.records.append(
            StepRecord(torch.as_tensor(idx).clone(), s, flat.clone(), square, ctx.noise_std, ctx)
        )
        return out

    def __getattr__(self, name):
        return getattr(self.inner, name)


#: the engine watch's period in the meter's checked runs (``self_check=True``): every this many steps
WATCH_EVERY = 10


def watched(run, checks: bool):
    """The prepared model ``run`` with the engine watch (engine/watch.py) as the meter runs it: off when the meter
    measures the engine on its own (``checks`` False; the start-up checks ran on the honest engine in
    ``prepare``), else every :data:`WATCH_EVERY` steps."""
    if not checks or run.watch is None:
        return dataclasses.replace(run, watch=None)
    run.watch.every = WATCH_EVERY
    return run


def recorder(run, control) -> ModelRecorder:
    """:class:`ModelRecorder` around the run's backend; the control's engine is checked by the run's own engine
    watch from its first step on, as it would be had the run been built with it (``prepare`` checked the honest
    engine before the control replaced it)."""
    out = ModelRecorder(run.backend, control)
    if run.watch is not None and control is not None and control.engine_bug is not None:
        run.watch.seen_step = None
    return out


def _replay_lists(
    cfg, schedule, records, before: list[list[torch.Tensor]], final: list[torch.Tensor], decay_mask=None
):
    """:func:`_replay` for parameter lists (model tasks)."""
    from dp_adam_bench.optim.registry import build_variant

    variant = build_variant(cfg.optimizer.name, **{k: v for k, v in cfg.optimizer.items() if k != "name"})
    variant.decay_mask = decay_mask
    params = [p.clone() for p in before[0]]
    after = [*before[1:], final]
    worst, failed_at = 0.0, None
    try:
        state = variant.init(params)
        base = variant.lr
        for t, (rec, target) in enumerate(zip(records, after, strict=True), start=1):
            ctx = dataclasses.replace(rec.ctx, noisy=[g.detach().clone() for g in rec.ctx.noisy], clean=None)
            variant.lr = base * schedule.factor(t)
            with torch.no_grad():
                variant.update(params, state, ctx)
            scale = max(float(p.abs().max()) for p in target) or 1.0
            err = max(float((p - q).abs().max()) for p, q in zip(params, target, strict=True)) / scale
            worst = max(worst, err)
            if err > REPLAY_TOL and failed_at is None:
                failed_at = t
    except Exception as exc:
        why = f"the registered variant cannot run on the releases alone: {type(exc).__name__}: {exc}"
        return MeterCheck("post_processing", "", math.inf, REPLAY_TOL, None, False, None, why)
    detail = (
        "replayed from the releases"
        if failed_at is None
        else f"differs from the replay from step {failed_at}"
    )
    return MeterCheck("post_processing", "", worst, REPLAY_TOL, None, failed_at is None, None, detail)


def meter_model(
    cfg,
    engine: str,
    *,
    n: int = 1200,
    control=None,
    control_name: str | None = None,
    alpha: float = ALPHA,
    self_check: bool = False,
) -> MeterResult:
    """Meter config ``cfg`` on :class:`ModelMeterTask` through the clipping engine ``engine`` (bk, ghost, hooks,
    functorch, loop), on the CPU: the sensitivity, noise and post-processing checks of :func:`meter_config` over
    the model's flattened parameters (its bias among them), and the sampling checks. One trial (a model), so the
    stated power is the run's own. ``self_check``: keep the trainer's start-up comparison of the engine with the
    size-one loop (``train.self_check``; off by default, so that the meter measures the engine on its own)."""
    from dp_adam_bench.audit.whitebox import AUDIT_OVERRIDES, run_controlled
    from dp_adam_bench.engine import trainer

    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    fixed = {"train.clipping": engine, "train.device": "cpu", "train.self_check.enabled": bool(self_check)}
    for key, value in {**AUDIT_OVERRIDES, **fixed}.items():
        OmegaConf.update(cfg, key, value, force_add=True)
    clip = float(cfg.privacy.clip)
    task = ModelMeterTask(n, clip, norms=True)
    run = watched(trainer.prepare(cfg, task), self_check)
    population = run.population.numpy()
    # as meter_config: the sampling check has its own reference (sampling_reference), not run_controlled's
    run, _, honest_sampler, _ = run_controlled(
        cfg,
        run,
        control,
        lambda run: recorder(run, control),
        np.arange(len(population)),
        prefix="dp-adam-bench-meter-",
    )
    backend, plan = run.backend, run.plan
    recs = backend.records
    B = float(honest_sampler.expected_batch_size)
    has_square = recs[0].noisy_square is not None
    checks_count = 4 + 3 * (1 + has_square)  # as meter_config's
    crit = critical(alpha, checks_count)
    crit1 = critical(alpha, checks_count, two_sided=False)
    checks = [_sampling_check(recs, population, honest_sampler, task.n, crit)]
    ys, xs = [], []
    for rec in recs:
        grads = [g.reshape(len(rec.idx), -1) for g in task.closed_form_grads(rec.idx)]
        g = torch.cat(grads, dim=1)
        s = rec.scale if rec.scale is not None else torch.ones(g.shape[1], dtype=torch.float64)
        sg = g * s
        norms = sg.pow(2).sum(1).sqrt()
        f = torch.where(norms > clip, clip / norms, torch.ones_like(norms))
        xs.append(((sg * f[:, None]).sum(0) / B).numpy())
        ys.append((rec.noisy * s).numpy())
    strategy = plan.strategy.matrix() if plan.strategy is not None else None
    sg_stats = release_stats(np.stack(ys), np.stack(xs), strategy, task.groups(), task.class_masks())
    checks += release_checks("g", sg_stats, recs[0].noise_std, crit)
    parts = [(clip / B, sg_stats.slope, sg_stats.slope_se, sg_stats.std, sg_stats.std_se)]
    whitened = [("g", sg_stats.resid)]
    if has_square:  # no scale: the privatizer refuses g^2 with scale-then-privatize
        y2 = np.stack([rec.noisy_square.numpy() for rec in recs])
        s2 = release_stats(y2, np.stack(xs) ** 2, strategy, task.groups())
        p = backend.privatizer
        checks += release_checks(
            "g^2", s2, p.releases.noise_scale * p.sigma * p.releases.square_sensitivity(clip, B), crit
        )
        b_max = max(len(rec.idx) for rec in recs)
        parts.append(((2 * b_max - 1) * clip**2 / B**2, s2.slope, s2.slope_se, s2.std, s2.std_se))
        whitened.append(("g^2", s2.resid))
    checks.insert(1, multiplier_check(parts, float(plan.account_sigma), crit1))
    checks.append(joint_noise_check(whitened, alpha / checks_count))
    final = [p.detach().clone() for p in backend.inner.params]
    checks.append(
        _replay_lists(cfg, run.schedule, recs, backend.params_before, final, run.variant.decay_mask)
    )
    return MeterResult(
        variant=run.variant.name,
        noise=str(cfg.noise.kind),
        sampler=honest_sampler.kind,
        sigma=float(plan.sigma),
        account_sigma=float(plan.account_sigma),
        steps=len(recs),
        trials=1,
        dataset_size=n,
        batch_size=B,
        alpha=alpha,
        checks=checks,
        control=control_name,
        engine=engine,
    )


def audit_model(
    cfg,
    engine: str,
    *,
    canaries: int = 1000,
    seed: int = 0,
    control=None,
    control_name: str | None = None,
    confidence: float = 0.95,
    meter: bool = True,
):
    """The white-box one-run audit (:mod:`~dp_adam_bench.audit.whitebox`'s scores, both bounds) through a model
    task and the real clipping engine ``engine``: :class:`ModelMeterTask` with every example a canary that owns its
    weight W[0, 1 + i] outright (no shared weight; the bias b[0] is shared), in with probability 1/2 (excluded: a
    zero loss, so a zero gradient), trajectories and releases read from the recorded steps. ``meter``: attach
    :func:`meter_model` of the same config (its own task, with the shared coordinate) to the result."""
    from dp_adam_bench.audit.whitebox import AUDIT_OVERRIDES, AuditResult, judge, run_controlled
    from dp_adam_bench.engine import trainer

    raw = cfg
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    fixed = {"train.clipping": engine, "train.device": "cpu", "train.self_check.enabled": False}
    for key, value in {**AUDIT_OVERRIDES, **fixed}.items():
        OmegaConf.update(cfg, key, value, force_add=True)
    n = int(canaries)
    included = np.random.default_rng([int(seed), 12]).random(n) < 0.5
    task = ModelMeterTask(n, float(cfg.privacy.clip), shared=0.0, included=included)
    run = watched(trainer.prepare(cfg, task), False)
    population = run.population.numpy()
    if len(population) != n:
        run.backend.close()
        raise ConfigError("the model-path audit holds no public examples out (side-information variants)")
    positions = np.empty(n, dtype=np.int64)
    positions[population] = np.arange(n)  # canary i (dataset index i) at this position of the sampler
    # eligible: the audit's matched filter (whitebox.eligible_steps, the sampler's own seed-determined order). It is
    # a detection statistic, not a check of the sampler: following the sampler's order keeps its power and never
    # depends on which canaries are in. Whether that order is the documented one is the meter's sampling check
    # (sampling_reference), attached below unless meter=False.
    run, summary, _, eligible = run_controlled(
        cfg, run, control, lambda run: recorder(run, control), positions
    )
    backend, plan = run.backend, run.plan
    weights = [b[0][0, 1:].double() for b in backend.params_before]
    weights.append(backend.inner.params[0][0, 1:].detach().double())
    theta = torch.stack(weights).numpy()
    released = torch.stack([r.ctx.noisy[0][0, 1:].detach().double() for r in backend.records]).numpy()
    f = task.features
    scaled = np.stack(
        [(r.noisy[1:f] * (r.scale[1:f] if r.scale is not None else 1.0)).numpy() for r in backend.records]
    )
    strategy = plan.strategy.matrix() if plan.strategy is not None else None
    tests, most = judge(
        theta, included, float(plan.delta), confidence, seed, eligible, strategy, released, scaled
    )
    metered = meter_model(raw, engine, n=n, control=control, control_name=control_name) if meter else None
    return AuditResult.of_run(
        run,
        summary,
        meter=metered,
        canaries=n,
        included=int(included.sum()),
        dataset_size=n,
        confidence=confidence,
        tests=tests,
        control=control_name,
        max_possible=most,
        auditor=f"white-box (model task, {engine})",
    )
