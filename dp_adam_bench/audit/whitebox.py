"""White-box one-run audit with gradient canaries, through the real trainer (Steinke, Nasr & Jagielski 2023,
arXiv 2305.08846, §4 "white-box" with Dirac gradient canaries).

The task is replaced by :class:`CanaryTask`, a closed-form vector task whose dataset holds ``m`` canaries and some
background examples; everything else is the config's: the variant, the noise mechanism, sigma, clip, delta, the
sampler and its schedule, and the privacy plan and ledger that give the claimed epsilon. Each canary is included
independently with probability 1/2 (Steinke et al. Alg. 1). Canary i owns one coordinate of the parameters, on which
every background gradient is zero; included, its per-example gradient is a Dirac vector of norm far above C on that
coordinate (clipped to exactly C by the privatizer, after stp's scaling); excluded, it is a zero row (zero-out
adjacency; with division by the *expected* batch size a zero row is the same as no row, so it is also removal). The
canaries are examples of the dataset, so they follow the sampler the accountant assumes: Poisson with q = B / N, or
their fixed slots of the cyclic single-pass order (one participation per epoch) under DP-MF. They enter as
per-example gradients *before clipping*, so every path of the variant sees them as it would a real example.

The auditor sees the parameters before every step and at the end (the strongest threat model DP covers). Scores
(fixed before any data was seen; each canary's coordinate theta_j over steps t = 0..T):

* ``descent`` = theta_0 - theta_T: how far the coordinate moved against the canary's gradient;
* ``path`` = -sum_t |theta_t - theta_{t-1}|: minus the path length (a variant whose second moment is the clean g^2
  divides the noise of an absent canary's coordinate by eps alone and makes it travel far);
* ``roughness`` = sum_t |d_t - d_{t-1}| with d_t = theta_t - theta_{t-1}: how irregular the steps are (with one
  noise draw reused every step an absent canary's coordinate moves by the same amount each step);
* ``eligible``: a matched filter on the canary's eligible steps. With a noise strategy C (lower triangular, C = I
  for independent noise) the released gradients are g_t = x_t + (C^{-1} z)_t, so y = C g = C x + z has white noise
  and a participation at step s adds a multiple of the column C e_s; the log-likelihood ratio of a participation at
  s is then proportional to (C^T C g)_s. With g taken as -d (exact for SGD up to the learning rate and 1 / B, a
  heuristic for the adaptive variants), the score sums (C^T C (-d))_s over the steps s at which the canary *can*
  be sampled: the sampler's public structure, never its random draws (single pass and balls-in-bins: the steps of
  its slot or bin; cyclic Poisson: the steps t = g mod b of its group g; Poisson: every step, where with C = I it
  equals ``descent``). Under cyclic Poisson a canary has ceil(T / b) chances among T steps, and summing the noise
  of the other steps would drown it;
* ``release``: the same matched filter on the *released* noisy gradient g~ (in the clipping geometry, s_t g~_t for
  scale-then-privatize) instead of the update: the optimal test of a Gaussian release whatever the variant does
  with it afterwards (the auditor sees every release: the accountant's claim is about them);
* ``precond``: sum_t log(|g~_t| / |d_t|) over the canary's coordinate: minus the log of the step the variant takes
  per unit of released gradient, i.e. its preconditioner. It sees preconditioner leaks through the update's
  magnitude, not its sign (a second moment fed with the clean g^2 makes an absent canary's coordinate take huge
  steps, a present one's small steps).

The guesses are +1 on the k highest and -1 on the k lowest scores for k in ``FRACTIONS`` of m: 6 scores x 3 values
of k are 18 pre-registered tests, each judged at significance beta / 18, so that the largest of their bounds holds
with confidence 1 - beta (a union bound; no test is chosen after looking at the data). Which scores a path computes
is fixed by what its auditor sees, never by the data: the audit through a fine-tuning method
(meter/finetune_runners.py) has no release coordinate per canary and adds a ``state`` score, 5 x 3 = 15 tests. Nothing
the auditor uses depends on which canaries are in: the eligible steps come from the sampler's seed-determined
partition or order.

Three bounds come from the same tests: Steinke et al.'s epsilon at the run's delta
(:func:`~dp_adam_bench.audit.bound.epsilon_lower_bound`), a Gaussian one
(:func:`~dp_adam_bench.audit.bound.gdp_mu_lower_bound`): the largest mu for which the run is shown not to be mu-GDP,
testing the whole privacy curve of mu-GDP instead of one (epsilon, delta) point; it is read as an epsilon at the
run's delta through the mu-GDP curve, and judged against the claim's own mu (:attr:`AuditResult.claimed_mu`); and
the f-DP one-run audit of Mahloujifar, Melis & Chaudhuri 2025 with the Gaussian curves
(:func:`~dp_adam_bench.audit.fdp_bound.fdp_mu_lower_bound`), read and judged as the mu-GDP one.
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from dp_adam_bench.audit.bound import (
    Guesses,
    count_correct,
    epsilon_lower_bound,
    gdp_epsilon,
    gdp_mu_lower_bound,
    max_epsilon,
)
from dp_adam_bench.audit.fdp_bound import fdp_mu_lower_bound
from dp_adam_bench.engine.backends import VectorBackend
from dp_adam_bench.errors import ConfigError, PrivacyMismatch

SCORES = ("descent", "path", "roughness", "eligible", "release", "precond")
FRACTIONS = (
    0.01,
    0.05,
    0.45,
)  # k / m guessed on each side; 0.45: below m/2 so perfect scores guess all right
#: the canary's gradient norm, in units of C: far above C, so that clipping makes it exactly C (also after stp's
#: per-coordinate scale, which is at most 1 / eps_s1)
CANARY_NORM = 1e6


class CanaryTask:
    """A vector task: ``m`` canaries (each owning a coordinate) and background examples (a least-squares fit on
    ``background_dim`` coordinates of their own). Parameters: one float64 vector, background coordinates first."""

    name = "audit_canaries"
    trial_dims = 0

    def __init__(
        self,
        n: int,
        slots: torch.Tensor,
        included: np.ndarray,
        clip: float,
        background_dim: int = 8,
        seed: int = 0,
    ):
        m = len(slots)
        if len(included) != m:
            raise ValueError(f"{len(included)} inclusion flags for {m} canaries")
        self.n, self.m, self.d_bg = int(n), m, int(background_dim)
        self.canary_of = torch.full((self.n,), -1, dtype=torch.long)
        self.canary_of[slots] = torch.arange(m)
        self.included = torch.as_tensor(np.asarray(included, dtype=bool))
        self.magnitude = CANARY_NORM * float(clip)
        gen = torch.Generator().manual_seed(int(seed))
        self.targets = torch.randn(self.n, self.d_bg, generator=gen, dtype=torch.float64)

    @property
    def dataset_size(self) -> int:
        return self.n

    def init_params(self) -> list[torch.Tensor]:
        return [torch.zeros(self.d_bg + self.m, dtype=torch.float64)]

    def per_example_grads(self, params: list[torch.Tensor], idx: torch.Tensor) -> list[torch.Tensor]:
        g = torch.zeros(len(idx), self.d_bg + self.m, dtype=torch.float64)
        which = self.canary_of[idx]
        bg = which < 0
        g[bg, : self.d_bg] = params[0][: self.d_bg] - self.targets[idx[bg]]
        rows = (~bg).nonzero().squeeze(1)
        c = which[rows]
        keep = self.included[c]
        g[rows[keep], self.d_bg + c[keep]] = self.magnitude
        return [g]

    def evaluate(self, params: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        fit = params[0][: self.d_bg] - self.targets.mean(0)
        return {"background_excess_loss": 0.5 * fit.pow(2).sum().reshape(1)}


class AuditBackend(VectorBackend):
    """The vector backend, observing the canaries' coordinates before every step; with a control, its broken
    privatizer takes the trainer's place. ``public_grad``: the mean (unclipped) gradient of public examples, for
    side-information variants (background examples only: canaries are never public)."""

    def __init__(self, task: CanaryTask, control=None):
        super().__init__(task)
        self.control = control
        self._broken = None
        self.trajectory: list[torch.Tensor] = []
        self.released: list[torch.Tensor] = []  # g~ on the canaries' coordinates, as the variant receives it
        self.scaled: list[torch.Tensor] = []  # the same in the clipping geometry (s g~; = g~ without stp)

    def observe(self) -> None:
        self.trajectory.append(self.params[0][self.task.d_bg :].detach().clone())

    def release(self, idx, privatizer, scale):
        if (
            getattr(privatizer, "_pinned", None) is not None
        ):  # the post-processing check's replay: no new release
            return super().release(idx, privatizer, scale)
        self.observe()
        if self.control is not None:
            if self._broken is None:
                self._broken = self.control.wrap(privatizer)
            privatizer = self._broken
        out = super().release(idx, privatizer, scale)
        g = out.ctx.noisy[0][self.task.d_bg :].detach().clone()
        self.released.append(g)
        self.scaled.append(g if scale is None else g * scale[0][self.task.d_bg :])
        return out

    def public_grad(self, pick: torch.Tensor) -> list[torch.Tensor]:
        return [g.mean(0) for g in self.task.per_example_grads(self.params, pick)]


def scores(
    theta: np.ndarray,
    eligible: np.ndarray | None = None,
    strategy: np.ndarray | None = None,
    released: np.ndarray | None = None,
    scaled: np.ndarray | None = None,
    extra: dict[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """The pre-registered scores of each canary from its coordinate's trajectory ``theta`` (steps + 1, m);
    ``eligible`` (steps, m): the steps at which each canary can be sampled (None: every step); ``strategy``: the
    noise strategy's matrix C, at least steps x steps (None: C = I, independent noise); ``released`` (steps, m):
    the noisy gradient g~ the variant received on each canary's coordinate, ``scaled`` the same in the clipping
    geometry (default ``released``): with them, the ``release`` and ``precond`` scores too. ``extra``: further
    scores (name -> one per canary) the auditor computed from what it saw, fixed before the run (the fine-tuning
    audit's ``state``, meter/finetune_runners.py)."""
    d = np.diff(theta, axis=0)
    if eligible is None:
        eligible = np.ones(d.shape, dtype=bool)
    if eligible.shape != d.shape:
        raise ValueError(f"eligible steps of shape {eligible.shape} for {d.shape} (steps, canaries) updates")
    c = None
    if strategy is not None:
        c = np.asarray(strategy, dtype=np.float64)
        if c.ndim != 2 or c.shape[0] < len(d) or c.shape[0] != c.shape[1]:
            raise ValueError(f"strategy matrix of shape {c.shape} for {len(d)} steps: need a square matrix")
        c = c[: len(d), : len(d)]

    def matched(x: np.ndarray) -> np.ndarray:
        return np.where(eligible, x if c is None else c.T @ (c @ x), 0.0).sum(0)

    out = {
        "descent": theta[0] - theta[-1],
        "path": -np.abs(d).sum(0),
        "roughness": np.abs(np.diff(d, axis=0)).sum(0) if len(d) > 1 else np.zeros(theta.shape[1]),
        "eligible": matched(-d),
    }
    if released is not None:
        released = np.asarray(released, dtype=np.float64)
        if released.shape != d.shape:
            raise ValueError(f"released gradients of shape {released.shape} for {d.shape} (steps, canaries)")
        out["release"] = matched(released if scaled is None else np.asarray(scaled, dtype=np.float64))
        tiny = np.finfo(np.float64).tiny
        out["precond"] = (np.log(np.abs(released) + tiny) - np.log(np.abs(d) + tiny)).sum(0)
    for name, score in (extra or {}).items():
        score = np.asarray(score, dtype=np.float64)
        if name in out or score.shape != (theta.shape[1],):
            raise ValueError(f"extra score {name!r} of shape {score.shape} for {theta.shape[1]} canaries")
        out[name] = score
    return out


def eligible_steps(sampler, positions: np.ndarray, steps: int) -> np.ndarray:
    """(steps, m): whether the example at sampler position ``positions[i]`` can be in the batch of step t (0-based),
    from the sampler's public, seed-determined structure only (never from a random draw of the run)."""
    positions = np.asarray(positions)
    out = np.zeros((steps, len(positions)), dtype=bool)
    kind = getattr(sampler, "kind", "")
    if kind == "cyclic_poisson":
        group = np.empty(sampler.n, dtype=np.int64)
        for g, members in enumerate(sampler.groups):
            group[members.numpy()] = g
        return (np.arange(steps)[:, None] % sampler.cycle_length) == group[positions][None, :]
    if kind in ("single_pass", "balls_in_bins"):  # deterministic given the seed: replay the order
        where = np.full(sampler.n, -1, dtype=np.int64)
        where[positions] = np.arange(len(positions))
        for t, batch in zip(range(steps), sampler.iter_from(0), strict=False):
            hit = where[batch.numpy()]
            out[t, hit[hit >= 0]] = True
        return out
    out[:] = True  # Poisson (and anything else): every step
    return out


@dataclass
class AuditTest:
    score: str
    k: int
    guesses: int
    correct: int
    epsilon_lower: float
    gdp_mu_lower: float = 0.0  # the largest mu-GDP this test rejects (same significance)
    fdp_mu_lower: float = 0.0  # the same, by Mahloujifar et al.'s f-DP audit (dp_adam_bench.audit.fdp_bound)


@dataclass(frozen=True)
class Observed:
    """What a white-box auditor saw of a run: the trajectories ``theta`` (steps + 1, m), which canaries were
    included, and what :func:`judge` reads beside them (see :func:`scores` and :func:`eligible_steps`)."""

    theta: np.ndarray
    included: np.ndarray
    eligible: np.ndarray | None
    strategy: np.ndarray | None
    released: np.ndarray | None
    scaled: np.ndarray | None
    extra: dict[str, np.ndarray] | None = None  # further pre-registered scores (see :func:`scores`)


@dataclass
class AuditResult:
    """One audited run: what it claims, what the canaries show, and the verdict."""

    variant: str
    noise: str
    sampler: str
    sigma: float
    steps: int
    canaries: int
    included: int
    dataset_size: int
    batch_size: float
    claimed_epsilon: float
    accountant: str
    delta: float
    confidence: float
    tests: list[AuditTest] = field(default_factory=list)
    control: str | None = None
    max_possible: float = math.nan
    auditor: str = "white-box"
    extra: dict = field(default_factory=dict)
    #: the mu of the claim: the ledger's own for a non-amplified (Gaussian) run, exactly; for an amplified run the
    #: mu-GDP curve through (claimed epsilon, delta), a Gaussian reading of a curve that is not Gaussian
    claimed_mu: float = math.nan
    claimed_mu_exact: bool = False
    meter: object = None  # the mechanism meter's result for the same config (dp_adam_bench.audit.meter)
    #: the run's participation ledger reconciled with its accounting (summary["participation"],
    #: dp_adam_bench.engine.participation); {} when the run did not record one
    participation: dict = field(default_factory=dict)
    #: the run's own checks that refused or stopped it (summary["stopped_by"]: a resumed run's restored-generator
    #: check, issue 44), the run then measured with that check bypassed
    stopped_by: list = field(default_factory=list)

    @classmethod
    def judged(
        cls, run, summary: dict, seen: Observed, confidence: float, seed: int, **fields
    ) -> AuditResult:
        """:meth:`of_run` with the pre-registered tests (:func:`judge`) on what the auditor ``seen``."""
        tests, most = judge(
            seen.theta,
            seen.included,
            float(run.plan.delta),
            confidence,
            seed,
            seen.eligible,
            seen.strategy,
            seen.released,
            seen.scaled,
            seen.extra,
        )
        included = int(seen.included.sum())
        return cls.of_run(
            run, summary, included=included, confidence=confidence, tests=tests, max_possible=most, **fields
        )

    @classmethod
    def of_run(cls, run, summary: dict, **fields) -> AuditResult:
        """The result of an audited training run (the prepared ``run`` and its ``summary``): what the run claims is
        read from its own plan and ledger; ``fields`` give the rest (canaries, included, dataset_size, tests, ...).
        ValueError when the plan's accountant gave no epsilon."""
        plan = run.plan
        accountant = plan.accountant
        if accountant not in summary["epsilon"]:
            reason = (summary.get("epsilon_errors") or {}).get(accountant)
            raise ValueError(f"the {accountant} accountant gave no epsilon for this run: {reason}")
        from dp_adam_bench.privacy.accounting.gaussian import gaussian_mu

        claimed = float(summary["epsilon"][accountant])
        exact = plan.accounting == "gaussian" and plan.sensitivity is not None
        if exact:
            mu = float(plan.sensitivity) / float(plan.account_sigma)
        else:
            mu = gaussian_mu(claimed, float(plan.delta)) if claimed > 0 else 0.0
        fields = {
            "claimed_mu": mu,
            "claimed_mu_exact": exact,
            "participation": summary.get("participation") or {},
            "stopped_by": list(summary.get("stopped_by") or []),
        } | fields
        return cls(
            variant=run.variant.name,
            noise=str(run.cfg.noise.kind),
            sampler=plan.sampler.kind,
            sigma=float(plan.sigma),
            steps=int(summary["steps"]),
            batch_size=float(plan.sampler.expected_batch_size),
            claimed_epsilon=float(summary["epsilon"][accountant]),
            accountant=accountant,
            delta=float(plan.delta),
            **fields,
        )

    @property
    def audit_epsilon_lower(self) -> float:
        return max((t.epsilon_lower for t in self.tests), default=0.0)

    @property
    def best(self) -> AuditTest | None:
        return max(self.tests, key=lambda t: t.epsilon_lower) if self.tests else None

    @property
    def gdp_mu_lower(self) -> float:
        return max((t.gdp_mu_lower for t in self.tests), default=0.0)

    @property
    def gdp_best(self) -> AuditTest | None:
        return max(self.tests, key=lambda t: t.gdp_mu_lower) if self.tests else None

    @property
    def gdp_epsilon_lower(self) -> float:
        """The epsilon at the run's delta of the largest mu-GDP rejected (see :func:`~dp_adam_bench.audit.bound.
        gdp_epsilon`: a lower bound on epsilon if the run's privacy curve is Gaussian)."""
        return gdp_epsilon(self.gdp_mu_lower, self.delta)

    @property
    def fdp_mu_lower(self) -> float:
        return max((t.fdp_mu_lower for t in self.tests), default=0.0)

    @property
    def fdp_best(self) -> AuditTest | None:
        return max(self.tests, key=lambda t: t.fdp_mu_lower) if self.tests else None

    @property
    def fdp_epsilon_lower(self) -> float:
        """The epsilon at the run's delta of the largest mu-GDP the f-DP audit rejects (as
        :attr:`gdp_epsilon_lower`)."""
        return gdp_epsilon(self.fdp_mu_lower, self.delta)

    @property
    def fdp_above(self) -> bool:
        """The f-DP bound exceeds the claim's mu."""
        return bool(self.tests) and self.fdp_mu_lower > self.claimed_mu

    @property
    def gdp_above(self) -> bool:
        """The Gaussian bound exceeds the claim's mu."""
        return bool(self.tests) and self.gdp_mu_lower > self.claimed_mu

    @property
    def caught_by(self) -> list[str]:
        """What shows this run is not what it claims: the one-run bound, the Gaussian bound, the meter."""
        out = []
        if self.audit_epsilon_lower > self.claimed_epsilon:
            out.append("audit (Steinke)")
        if self.gdp_above:
            out.append("audit (GDP)")
        if self.fdp_above:
            out.append("audit (f-DP)")
        if self.meter is not None and not self.meter.passed:
            out.append("meter: " + ", ".join(c.name for c in self.meter.failed))
        if self.ledger_verdict.startswith("MISMATCH"):
            failed = [c["check"] for c in self.participation.get("checks", []) if not c["ok"]]
            out.append("participation ledger: " + ", ".join(failed))
        return out + list(self.stopped_by)

    @property
    def ledger_verdict(self) -> str:
        """The participation ledger's verdict on the run ("consistent", "MISMATCH: ..."; "" if none)."""
        return self.participation.get("verdict", "")

    @property
    def verdict(self) -> str:
        above = bool(self.caught_by)
        if self.control is None:
            return "VIOLATION" if above else "consistent"
        return "caught" if above else "missed"

    def row(self) -> dict:
        best, gbest, fbest, m = self.best, self.gdp_best, self.fdp_best, self.meter
        meter = {}
        if m is not None:
            mult, sens = m.check("multiplier", "joint"), m.check("sensitivity", "g")
            samp = m.check("sampling")
            meter = {
                "meter": m.summary(),
                "meter_joint": m.joint,
                "meter_sigma_ratio": mult.estimate if mult else math.nan,
                "meter_sensitivity": sens.estimate if sens else math.nan,
                "meter_rate": samp.estimate / samp.claimed if samp and samp.claimed else math.nan,
                "meter_power": m.power,
            }
        return {
            "auditor": self.auditor,
            "variant": self.variant,
            "noise": self.noise,
            "sampler": self.sampler,
            "sigma": self.sigma,
            "steps": self.steps,
            "canaries": self.canaries,
            "claimed_epsilon": self.claimed_epsilon,
            "accountant": self.accountant,
            "audit_epsilon_lower": self.audit_epsilon_lower,
            "best_test": f"{best.score}, k={best.k}: {best.correct}/{best.guesses}" if best else "",
            "max_possible": self.max_possible,
            "claimed_mu": self.claimed_mu,
            "gdp_mu_lower": self.gdp_mu_lower,
            "gdp_epsilon_lower": self.gdp_epsilon_lower,
            "gdp_best_test": f"{gbest.score}, k={gbest.k}: {gbest.correct}/{gbest.guesses}"
            if gbest and gbest.gdp_mu_lower > 0
            else "",
            "fdp_mu_lower": self.fdp_mu_lower,
            "fdp_epsilon_lower": self.fdp_epsilon_lower,
            "fdp_best_test": f"{fbest.score}, k={fbest.k}: {fbest.correct}/{fbest.guesses}"
            if fbest and fbest.fdp_mu_lower > 0
            else "",
            **meter,
            "participation": self.ledger_verdict.split(":")[0],
            "control": self.control or "",
            "caught_by": "; ".join(self.caught_by),
            "verdict": self.verdict,
        }

    def describe(self) -> str:
        lines = [
            f"{self.auditor}: {self.variant} x {self.noise} x {self.sampler}"
            + (f" [control {self.control}]" if self.control else "")
            + f": sigma = {self.sigma:g}, {self.steps} steps, N = {self.dataset_size}, B = {self.batch_size:g}, "
            f"{self.canaries} canaries ({self.included} in)",
            f"  claimed epsilon = {self.claimed_epsilon:.4g} ({self.accountant}, delta = {self.delta:g})",
        ]
        for t in self.tests:
            lines.append(
                f"  {t.score:<10} k = {t.k:<4} {t.correct:>4}/{t.guesses:<4} correct -> "
                f"epsilon >= {t.epsilon_lower:.4g}"
            )
        lines.append(
            f"  audit lower bound = {self.audit_epsilon_lower:.4g} at {self.confidence:.0%} confidence (at most "
            f"{self.max_possible:.4g} with these canaries)"
        )
        lines.append(
            f"  Gaussian bound: not mu-GDP for mu < {self.gdp_mu_lower:.4g} (claim: mu = {self.claimed_mu:.4g}, "
            f"{'exact' if self.claimed_mu_exact else 'the Gaussian curve through the claimed epsilon'}); as an "
            f"epsilon at delta: {self.gdp_epsilon_lower:.4g}; f-DP bound (Mahloujifar et al.): mu < "
            f"{self.fdp_mu_lower:.4g}, epsilon {self.fdp_epsilon_lower:.4g} -> {self.verdict}"
            + (f" (caught by {'; '.join(self.caught_by)})" if self.caught_by else "")
        )
        if self.meter is not None:
            lines.append(self.meter.describe())
        if self.ledger_verdict:
            lines.append(f"  participation ledger: {self.ledger_verdict}")
        return "\n".join(lines)


def judge(
    theta: np.ndarray,
    included: np.ndarray,
    delta: float,
    confidence: float,
    seed: int = 0,
    eligible: np.ndarray | None = None,
    strategy: np.ndarray | None = None,
    released: np.ndarray | None = None,
    scaled: np.ndarray | None = None,
    extra: dict[str, np.ndarray] | None = None,
) -> tuple[list[AuditTest], float]:
    """The pre-registered tests on the trajectories ``theta`` (steps + 1, m) and the most they could show;
    ``eligible``, ``strategy``, ``released``, ``scaled``, ``extra``: see :func:`scores` and :func:`eligible_steps`.
    Each of the scores computed (which ones depends on what the auditor of that path sees, never on the data) is
    tested at every k of ``FRACTIONS``, each test at significance (1 - confidence) / (their number)."""
    m = theta.shape[1]
    if not np.all(np.isfinite(theta)):
        raise ValueError(
            "a canary coordinate is not finite: the run diverged, so its scores cannot be ranked"
        )
    computed = scores(theta, eligible, strategy, released, scaled, extra)
    family = len(computed) * len(FRACTIONS)
    level = (1 - confidence) / family
    tiebreak = np.random.default_rng([int(seed), 7]).permutation(m)
    tests = []
    for name, s in computed.items():
        if not np.all(np.isfinite(s)):
            raise ValueError(f"the {name} score is not finite for every canary")
        for frac in FRACTIONS:
            k = max(1, int(frac * m))
            r, v = count_correct(Guesses(k, k).guess(s, tiebreak), included)
            tests.append(
                AuditTest(
                    name,
                    k,
                    r,
                    v,
                    epsilon_lower_bound(m, r, v, delta, level),
                    gdp_mu_lower_bound(m, r, v, level),
                    fdp_mu_lower_bound(m, r, v, level),
                )
            )
    r_max = 2 * max(1, int(max(FRACTIONS) * m))
    return tests, max_epsilon(m, r_max, delta, level)


def run_controlled(cfg, run, control, make_backend, positions, prefix: str = "dp-adam-bench-audit-"):
    """Train ``run`` (made by ``trainer.prepare``) with a recording backend and, if given, a control applied: its
    variant and plan (``control.apply_to_run``), then its sampler wrapped around the honest one. ``make_backend(run)``
    gives the backend (after the control, so it may wrap ``run.backend``); the run folder is a temporary one.
    Returns (the run as trained, its summary, the honest sampler, and for each of ``positions`` the steps the honest
    sampler made it eligible in, as :func:`eligible_steps`)."""
    from dp_adam_bench.engine import trainer

    if control is not None:  # a broken variant, and the plan built for it
        run = control.apply_to_run(run, cfg)
    backend = make_backend(run)
    plan = run.plan
    honest = plan.sampler
    eligible = eligible_steps(honest, positions, plan.steps)  # the honest sampler's, before any draw
    if control is not None:
        plan = dataclasses.replace(plan, sampler=control.wrap_sampler(honest))
    run = dataclasses.replace(run, backend=backend, plan=plan)
    with tempfile.TemporaryDirectory(prefix=prefix) as folder:
        if control is not None and control.resume_at:
            summary, run = run_resumed(cfg, run, control, make_backend, Path(folder))
        else:
            summary = trainer.run(cfg, Path(folder), lambda step, metrics: None, prepared=run)
    return run, summary, honest, eligible


#: the run's own checks that stop it mid-run (by class name) after which the audit and the meter run it again with
#: that check off, so that they measure what the check prevented: (what it is, its config switch)
RUN_STOPS = {
    "PostProcessingLeak": ("post-processing check", "train.post_processing_check.enabled"),
}


def retried(cfg, attempt):
    """``attempt(cfg)``, and when one of :data:`RUN_STOPS` stops the run, ``attempt`` again on a copy of ``cfg`` with
    that check off. Returns (the result, the stops: one line each, naming the check and its message)."""
    stops = []
    while True:
        try:
            return attempt(cfg), stops
        except PrivacyMismatch as err:
            which = RUN_STOPS.get(type(err).__name__)
            if which is None or any(s.startswith(which[0]) for s in stops):
                raise
            stops.append(f"{which[0]} ({which[1].rsplit('.', 1)[0]}): {str(err).splitlines()[0][:240]}")
            cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
            OmegaConf.update(cfg, which[1], False, force_add=True)


#: what a recording backend keeps per step: a resumed run's second attempt continues the first's lists
_RECORDED = ("records", "params_before", "trajectory", "released", "scaled")


def run_resumed(cfg, run, control, make_backend, folder: Path):
    """Issue 44: ``run`` (already controlled and recording) killed after ``control.resume_at`` steps with a
    checkpoint there, that checkpoint broken by ``control.checkpoint_bug`` if any, and resumed from it in a fresh
    process's way (prepare, the control, a new recording backend that continues the first one's records). When the
    resumed run refuses its checkpoint (a restored generator that is not the one saved: engine/session.py), the
    refusal goes to ``summary["stopped_by"]`` and the run is resumed once more with that check bypassed, so that the
    audit and the meter measure what the check prevented. Returns (summary, the resumed run)."""
    from omegaconf import OmegaConf

    from dp_adam_bench.engine import checkpoint as ckpt
    from dp_adam_bench.engine import session as session_module
    from dp_adam_bench.engine import trainer
    from dp_adam_bench.errors import PrivacyMismatch

    k = int(control.resume_at)

    def with_train(**keys):
        out = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
        for key, value in keys.items():
            OmegaConf.update(out, f"train.{key}", value, force_add=True)
        return out

    first = with_train(checkpoint_every=k, stop_after=k, resume=True)
    try:  # the trainer reads the prepared run's own config
        trainer.run(first, folder, lambda step, metrics: None, prepared=dataclasses.replace(run, cfg=first))
    except KeyboardInterrupt:
        pass
    second = with_train(checkpoint_every=k, stop_after=None, resume=True)
    if control.checkpoint_bug is not None:
        fp = ckpt.fingerprint(trainer._to_dict(second))
        ckpt.save(folder, control.checkpoint_bug(ckpt.load(folder, fp), run))

    def attempt():
        again = control.apply_to_run(trainer.prepare(second, run.task, folder), second)
        backend = make_backend(again)
        if backend is not run.backend:  # a new recorder: it continues the first attempt's records
            for name in _RECORDED:
                if hasattr(run.backend, name) and hasattr(backend, name):
                    setattr(backend, name, [*getattr(run.backend, name), *getattr(backend, name)])
        if hasattr(backend, "_broken"):  # a control's privatizer is built again around this attempt's
            backend._broken = None
        sampler = control.wrap_sampler(again.plan.sampler)
        return dataclasses.replace(
            again, backend=backend, plan=dataclasses.replace(again.plan, sampler=sampler)
        )

    stopped = []
    resumed = attempt()
    try:
        summary = trainer.run(second, folder, lambda step, metrics: None, prepared=resumed)
    except PrivacyMismatch:  # the refusal is what the row records; its line is in the run log
        stopped.append("resume check (restored generators)")
        resumed = attempt()
        real = session_module.verify_restored_generators
        session_module.verify_restored_generators = lambda *a, **kw: None
        try:
            summary = trainer.run(second, folder, lambda step, metrics: None, prepared=resumed)
        finally:
            session_module.verify_restored_generators = real
    return {**summary, "stopped_by": stopped}, resumed


AUDIT_OVERRIDES = {
    "train.log_every": 10**9,  # evaluate once, at the end
    "train.eval_every": 0,
    "train.checkpoint_every": 0,
    "train.resume": False,
    "train.stop_after": None,
    "diagnostics.every": 0,
    # a noise mismatch recorded, not raised mid-run: the audit runs a control to its end and the participation
    # ledger's noise check names it (engine/noise_check.py)
    "train.noise_check": "record",
}


def audit_config(
    cfg,
    *,
    canaries: int = 1000,
    background: int = 200,
    seed: int = 0,
    control=None,
    control_name: str | None = None,
    confidence: float = 0.95,
    meter=None,
) -> AuditResult:
    """Audit the config ``cfg`` (validated) with ``canaries`` white-box canaries; ``control``: a
    :class:`~dp_adam_bench.audit.controls.Control` whose privatizer (sampler, variant) replaces the trainer's;
    ``meter``: also run this mechanism meter on the same config and control
    (:func:`dp_adam_bench.audit.meter.meter_config`, passed in: the meter imports this module, not the reverse)."""
    from dp_adam_bench.engine import trainer
    from dp_adam_bench.optim.registry import VARIANTS

    if isinstance(canaries, bool) or not isinstance(canaries, int) or canaries < 10:
        raise ConfigError(f"audit canaries={canaries!r} must be an integer >= 10")
    if isinstance(background, bool) or not isinstance(background, int) or background < 2:
        raise ConfigError(f"audit background={background!r} must be an integer >= 2")
    if not 0 < confidence < 1:
        raise ConfigError(f"audit confidence={confidence!r} must be in (0, 1)")
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    for key, value in AUDIT_OVERRIDES.items():
        OmegaConf.update(cfg, key, value, force_add=True)
    from dp_adam_bench.privacy.noise_factory import NOISE

    if not NOISE.get(cfg.noise.kind).private:
        raise ConfigError(
            f"noise.kind={cfg.noise.kind!r} adds no noise: there is no claimed epsilon to audit"
        )
    side = VARIANTS.get(cfg.optimizer.name).needs_side_info
    if side:  # the public examples come from the background, never from the canaries
        public = max(1, background // 2)
        OmegaConf.update(cfg, "train.side_info.public_examples", public, force_add=True)
        batch = min(int(cfg.train.side_info.get("batch_size", 256)), public)
        OmegaConf.update(cfg, "train.side_info.batch_size", batch, force_add=True)
    n = canaries + background
    population, _ = trainer.split_public(cfg, n, int(cfg.seed), side)
    rng = np.random.default_rng([int(seed), 12])
    positions = rng.permutation(len(population))[:canaries]  # in the sampler's numbering of the private set
    slots = population[torch.as_tensor(positions)]
    included = rng.random(canaries) < 0.5
    task = CanaryTask(n, slots, included, float(cfg.privacy.clip), seed=int(seed))

    def attempt(cfg):
        run = trainer.prepare(cfg, task)
        run.backend.close()
        backend = AuditBackend(task, control)
        return backend, *run_controlled(cfg, run, control, lambda run: backend, positions)

    (backend, run, summary, _, eligible), stops = retried(cfg, attempt)
    summary = {**summary, "stopped_by": [*(summary.get("stopped_by") or []), *stops]}
    plan = run.plan
    backend.observe()  # the final parameters
    theta = torch.stack(backend.trajectory).numpy()
    if theta.shape[0] - 1 != plan.steps:
        raise ValueError(f"the audit observed {theta.shape[0] - 1} steps of the {plan.steps} planned")
    strategy = plan.strategy.matrix() if plan.strategy is not None else None
    released = torch.stack(backend.released).numpy()
    scaled = torch.stack(backend.scaled).numpy()
    metered = meter(cfg, n=n, control=control, control_name=control_name) if meter is not None else None
    observed = Observed(theta, included, eligible, strategy, released, scaled)
    return AuditResult.judged(
        run,
        summary,
        observed,
        confidence,
        seed,
        meter=metered,
        canaries=canaries,
        dataset_size=n,
        control=control_name,
    )


def compose_config(overrides: list[str]):
    """The config the command line would build from these Hydra overrides, validated."""
    from hydra import compose, initialize_config_dir

    from dp_adam_bench.config import validate
    from dp_adam_bench.paths import CONFIG_DIR

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides))
    validate(cfg)
    return cfg
