"""BLT: buffered-linear-Toeplitz noise correlation with O(buffers * d) memory.

Dvijotham, McMahan, Pillutla, Steinke, Thakurta (2024), "Efficient and near-optimal noise generation for
streaming differential privacy" (the BLT parametrisation), and McKenna (2024), "Scaling up the banded matrix
factorization mechanism for differentially private ML" (BLTs as the memory-light alternative to BandMF).

The noise-correlating matrix C^{-1} is lower-triangular Toeplitz with generating function

    C^{-1}(x) = 1 + x * sum_j omega_j / (1 - theta_j x),   i.e. coefficients 1, then sum_j omega_j
    theta_j^{k-1},

so w = C^{-1} z streams with one model-sized buffer per term (m = ``buffers``):

    w_t = z_t + sum_j omega_j s_j,      s_j <- theta_j s_j + z_t       (s_j = 0 at the start).

C itself is the power-series inverse; its coefficients come from the inverse state-space system (an O(n m)
recursion, see :func:`blt_strategy_coefficients`).
The strategy is rescaled to unit max column norm (the first column of a lower-triangular Toeplitz C is its
longest), so the streamed noise is multiplied by that norm.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from scipy.optimize import minimize
from scipy.signal import fftconvolve

from dp_adam_bench.privacy.mechanisms import NoiseMechanism, load_buffers_into, zeroed_buffers
from dp_adam_bench.privacy.strategies import ToeplitzStrategy, check_n


def blt_inverse_coefficients(theta: np.ndarray, omega: np.ndarray, n: int) -> np.ndarray:
    """Toeplitz coefficients of the (unnormalised) C^{-1}: 1, then sum_j omega_j theta_j^{k-1}, k = 1..n-1."""
    theta = np.asarray(theta, dtype=np.float64)
    omega = np.asarray(omega, dtype=np.float64)
    e = np.empty(n)
    e[0] = 1.0
    if n > 1:
        powers = theta[None, :] ** np.arange(n - 1)[:, None]
        e[1:] = powers @ omega
    return e


def blt_strategy_coefficients(theta: np.ndarray, omega: np.ndarray, n: int, block: int = 64) -> np.ndarray:
    """Toeplitz coefficients of the (unnormalised) C = 1 / C^{-1}(x).

    C^{-1} is the state-space system (diag(theta), 1, omega^T, 1); its inverse has state matrix
    M = diag(theta) - 1 omega^T, so c_0 = 1, c_k = -omega^T s_k with s_1 = 1 and s_{k+1} = M s_k
    = theta * s_k + c_k (C is itself a BLT on the same buffers). Iterating the state is numerically stable
    where expanding D(x) / N(x) into polynomial coefficients is not (nearly equal thetas make that
    ill-conditioned). Blocked: rows omega^T M^j for j < block, then one state jump per block, O(n m) work in
    numpy.
    """
    theta = np.asarray(theta, dtype=np.float64)
    omega = np.asarray(omega, dtype=np.float64)
    m = len(theta)
    c = np.zeros(n)
    c[0] = 1.0
    if n == 1:
        return c
    block = max(1, min(block, n - 1))
    rows = np.empty((block, m))
    r = omega.copy()
    for j in range(block):
        rows[j] = r
        r = r * theta - r.sum() * omega  # r^T M
    decay = theta[None, :] ** np.arange(block)[::-1, None]  # decay[j] = theta^{block-1-j}
    s = np.ones(m)
    k = 1
    while k < n:
        length = min(block, n - k)
        c[k : k + length] = -(rows[:length] @ s)
        s = theta**length * s + decay[block - length :].T @ c[k : k + length]
        k += length
    return c


def _earliest_pattern(n: int, participations: int, min_separation: int | None) -> np.ndarray:
    sep = 1 if min_separation is None else int(min_separation)
    return np.arange(0, n, sep)[: int(participations)]


def _blt_loss_and_grad(params: np.ndarray, n: int, pattern: np.ndarray) -> tuple[float, np.ndarray]:
    """||A C^{-1}||_F^2 * sens(C)^2 and its gradient in params = (raw_theta, mass), theta =
    sigmoid(raw_theta), omega = (1 - theta) * mass. ``mass_j`` = omega_j / (1 - theta_j) is the sum of buffer
    j's contributions to the coefficients of C^{-1}; parametrising by it keeps the problem well conditioned
    when theta_j is close to 1.

    sens^2 = ||sum_{a in pattern} C e_a||^2, exact for the earliest pattern when C's coefficients are
    non-negative and non-increasing (see :mod:`dp_adam_bench.privacy.sensitivity`). Gradients by hand in O(n m
    + n log n): F = sum_k (n - k) f_k^2 with f = cumsum(e) as in BandMF, and through c = 1 / e(x), dc = -c^2
    de.
    """
    m = len(params) // 2
    raw, mass = params[:m], params[m:]
    theta = 1.0 / (1.0 + np.exp(-raw))
    omega = (1.0 - theta) * mass
    e = blt_inverse_coefficients(theta, omega, n)
    c = blt_strategy_coefficients(theta, omega, n)
    f = np.cumsum(e)
    w = n - np.arange(n)
    frob = float(np.sum(w * f**2))
    v = np.zeros(n)
    for a in pattern:
        v[a:] += c[: n - a]
    sens_sq = float(np.sum(v**2))
    loss = frob * sens_sq
    if not (np.isfinite(loss) and loss < 1e250):
        return 1e250, np.zeros_like(params)
    grad_e = sens_sq * np.cumsum((2.0 * w * f)[::-1])[::-1]
    grad_c = np.zeros(n)
    for a in pattern:
        grad_c[: n - a] += 2.0 * v[a:]
    cc = fftconvolve(c, c)[:n]
    corr = fftconvolve(grad_c[::-1], cc)  # corr[n-1-j] = sum_t grad_c[t] cc[t-j]
    grad_e += frob * (-corr[n - 1 - np.arange(n)])
    k = np.arange(n - 1)
    powers = theta[None, :] ** k[:, None]  # theta^{k-1} for e_k, k = 1..n-1
    g = grad_e[1:]
    grad_omega = powers.T @ g
    d_powers = np.zeros_like(powers)
    d_powers[1:] = k[1:, None] * theta[None, :] ** (k[1:, None] - 1)
    # omega = (1 - theta) * mass: d/dtheta picks up -mass * d/domega
    grad_theta = omega * (d_powers.T @ g) - mass * grad_omega
    return loss, np.concatenate((grad_theta * theta * (1.0 - theta), grad_omega * (1.0 - theta)))


def _initial_blt(n: int, buffers: int) -> tuple[np.ndarray, np.ndarray]:
    """theta on a log grid of time scales 2..n; omega_j = -0.95 (1 - theta_j) / m, so the off-diagonal part of
    C^{-1} is -0.95 times a mixture of geometric distributions, like the -(probability distribution) off the
    diagonal of A^{-1/2} = (1 - x)^{1/2}. Keeping C^{-1}(1) = 1 + sum_j omega_j / (1 - theta_j) > 0 keeps the
    zeros of C^{-1}(x) outside the unit disc, so C's coefficients stay bounded."""
    taus = np.logspace(np.log10(2.0), np.log10(max(n, 4)), buffers)
    theta = 1.0 - 1.0 / taus
    omega = -0.95 * (1.0 - theta) / buffers
    return theta, omega


_MASS_SCALE = 10.0  # optimiser units: L-BFGS-B's first step moves distance 1, i.e. 0.1 in mass
_MAX_MASS = 5.0


def _polish(
    raw: np.ndarray, mass: np.ndarray, n: int, pattern: np.ndarray, max_iter: int
) -> tuple[float, np.ndarray, np.ndarray]:
    """L-BFGS-B on log(loss) from (raw_theta, mass), restarted while it still improves (restarts clear a
    curvature history spoilt by steps into the unstable region, where C's coefficients blow up).

    With several participations the loss uses the earliest-pattern sensitivity, which is exact only for
    non-negative non-increasing C coefficients; there omega <= 0 is imposed (a bound): C^{-1} = 1 - x p(x)
    with p a non-negative mixture of geometric sequences, so C = 1 / (1 - x p(x)) = sum_j (x p(x))^j has
    non-negative coefficients (checked, together with monotonicity, by the strategy's exact-sensitivity
    path)."""
    m = len(raw)
    # Time scales 1 / (1 - theta) beyond 10 n look constant over the horizon; letting theta -> 1 opens a flat
    # valley (theta -> 1, mass -> infinity at fixed omega) that L-BFGS crawls along.
    raw_max = float(np.log(10.0 * n - 1.0))
    mass_bound = (-_MAX_MASS, _MAX_MASS) if len(pattern) == 1 else (-_MAX_MASS, 0.0)
    bounds = [(-30.0, raw_max)] * m + [(lo * _MASS_SCALE, hi * _MASS_SCALE) for lo, hi in [mass_bound] * m]
    units = np.concatenate((np.ones(m), np.full(m, 1.0 / _MASS_SCALE)))

    def objective(x: np.ndarray) -> tuple[float, np.ndarray]:
        with np.errstate(over="ignore", invalid="ignore"):
            loss, grad = _blt_loss_and_grad(x * units, n, pattern)
        if loss >= 1e250:
            return 600.0, np.zeros_like(x)
        return float(np.log(loss)), grad * units / loss

    x = np.concatenate((np.clip(raw, -30.0, raw_max), np.clip(mass, *mass_bound) * _MASS_SCALE))
    best = objective(x)[0]
    for _ in range(4):
        res = minimize(
            objective,
            x,
            jac=True,
            method="L-BFGS-B",
            bounds=bounds,
            options={"maxiter": max_iter, "ftol": 1e-11, "gtol": 1e-7},
        )
        if not res.fun < best - 1e-12:
            break
        x, best = res.x, float(res.fun)
    return best, x[:m], x[m:] / _MASS_SCALE


@functools.lru_cache(maxsize=64)
def _optimize_blt_cached(
    n: int, buffers: int, participations: int, min_separation: int | None, max_iter: int
) -> tuple[float, tuple[float, ...], tuple[float, ...]]:
    """(log loss, theta, mass) of the best of two starts: the log-grid start and a greedy one that adds a
    buffer (zero mass, theta in the widest gap of time scales) to the optimum with one buffer fewer, so the
    loss never increases with the number of buffers."""
    pattern = _earliest_pattern(n, participations, min_separation)
    theta0, omega0 = _initial_blt(n, buffers)
    starts = [(np.log(theta0 / (1.0 - theta0)), omega0 / (1.0 - theta0))]
    if buffers > 1:
        _, prev_theta, prev_mass = _optimize_blt_cached(
            n, buffers - 1, participations, min_separation, max_iter
        )
        taus = np.sort(np.minimum(1.0 / (1.0 - np.array(prev_theta)), 2.0 * n))
        edges = np.concatenate(([1.5], taus, [2.0 * n]))
        gap = int(np.argmax(np.log(edges[1:]) - np.log(edges[:-1])))
        new_theta = 1.0 - 1.0 / np.sqrt(edges[gap] * edges[gap + 1])
        theta = np.append(prev_theta, new_theta)
        starts.append((np.log(theta / (1.0 - theta)), np.append(prev_mass, 0.0)))
    best = None
    for raw, mass in starts:
        result = _polish(raw, mass, n, pattern, max_iter)
        if best is None or result[0] < best[0]:
            best = result
    log_loss, raw, mass = best
    theta = 1.0 / (1.0 + np.exp(-raw))
    order = np.argsort(theta)
    return log_loss, tuple(float(v) for v in theta[order]), tuple(float(v) for v in mass[order])


def optimize_blt_parameters(
    n: int,
    buffers: int = 4,
    participations: int = 1,
    min_separation: int | None = None,
    *,
    max_iter: int = 1000,
) -> tuple[np.ndarray, np.ndarray]:
    """BLT parameters (theta, omega) minimising the scale-invariant prefix-sum loss
    ||A C^{-1}||_F^2 * sens(C)^2 (the objective of Dvijotham et al. 2024, with the multi-participation
    sensitivity of the earliest pattern (0, s, 2s, ...), exact for non-negative non-increasing C
    coefficients).

    theta = sigmoid(raw) keeps every decay in (0, 1); omega is free for one participation and <= 0 for several
    (see :func:`_polish`). Float64 L-BFGS-B on hand-written gradients, O(n m + n log n) per evaluation; the
    best of a log-grid start and a greedy start from the optimum with one buffer fewer. n = 2000 with 4
    buffers takes 0.3 to 2 s on one core (the greedy chain makes the cost grow like buffers^2). Cached per
    argument tuple in the process.
    """
    n = check_n(n)
    if int(buffers) < 1:
        raise ValueError(f"buffers must be >= 1, got {buffers}")
    _, theta, mass = _optimize_blt_cached(
        n,
        int(buffers),
        int(participations),
        None if min_separation is None else int(min_separation),
        int(max_iter),
    )
    theta = np.array(theta)
    return theta, (1.0 - theta) * np.array(mass)


def optimize_blt(
    n: int, buffers: int = 4, participations: int = 1, min_separation: int | None = None
) -> BLTStrategy:
    """The optimised BLT strategy (:func:`optimize_blt_parameters`) over n steps."""
    theta, omega = optimize_blt_parameters(n, buffers, participations, min_separation)
    return BLTStrategy(n, theta, omega)


class BLTStrategy(ToeplitzStrategy):
    """C = inverse of the BLT C^{-1}(theta, omega), rescaled to unit max column norm (so C^{-1} is multiplied
    by the raw max column norm). ``theta=None`` optimises the parameters (:func:`optimize_blt_parameters`)."""

    name = "blt"

    def __init__(
        self,
        n: int,
        theta: np.ndarray | None = None,
        omega: np.ndarray | None = None,
        *,
        buffers: int = 4,
        participations: int = 1,
        min_separation: int | None = None,
    ):
        super().__init__(n)
        if theta is None or omega is None:
            theta, omega = optimize_blt_parameters(self.n, buffers, participations, min_separation)
        self.theta = np.asarray(theta, dtype=np.float64).ravel()
        self.omega = np.asarray(omega, dtype=np.float64).ravel()
        if self.theta.shape != self.omega.shape:
            raise ValueError(
                f"theta and omega must have the same length, got {self.theta.shape}, {self.omega.shape}"
            )
        if np.any(self.theta <= 0) or np.any(self.theta >= 1):
            raise ValueError("BLT decays theta must lie in (0, 1)")
        self.buffers = len(self.theta)
        raw_c = blt_strategy_coefficients(self.theta, self.omega, self.n)
        self.scale = float(np.linalg.norm(raw_c))
        self.coefs = raw_c / self.scale
        self._inv_coefs = self.scale * blt_inverse_coefficients(self.theta, self.omega, self.n)
        self.name = f"blt_m{self.buffers}"

    def inverse_coefficients(self) -> np.ndarray:
        return self._inv_coefs

    def mechanism(self) -> BLTMechanism:
        return BLTMechanism(self.theta, self.omega, scale=self.scale, n=self.n, name=self.name)

    def describe(self) -> dict:
        return {
            "name": self.name,
            "n": self.n,
            "buffers": self.buffers,
            "theta": self.theta.tolist(),
            "omega": self.omega.tolist(),
        }


class BLTMechanism(NoiseMechanism):
    """Streams w_t = scale * (z_t + sum_j omega_j s_j), s_j <- theta_j s_j + z_t: one (m, *shape) buffer per
    parameter tensor, O(m * d) memory and time per step."""

    name = "blt"

    def __init__(
        self,
        theta: np.ndarray,
        omega: np.ndarray,
        scale: float = 1.0,
        n: int | None = None,
        name: str = "blt",
    ):
        super().__init__()
        self.theta = np.asarray(theta, dtype=np.float64).ravel()
        self.omega = np.asarray(omega, dtype=np.float64).ravel()
        if self.theta.shape != self.omega.shape:
            raise ValueError("theta and omega must have the same length")
        self.scale = float(scale)
        self.n = n
        self.name = name
        self._state: list[torch.Tensor] = []
        self._variance = np.zeros(0)

    def _reset_buffers(self) -> None:
        m = len(self.theta)
        self._state = zeroed_buffers(self._state, [(m, *s) for s in self._shapes], self._dtype, self._device)

    def buffers(self) -> list[torch.Tensor]:
        """The BLT state buffers (one per parameter shape, each (m, *shape))."""
        return self._state

    def next(self) -> list[torch.Tensor]:
        self._check_step()
        z = self._draw_z()
        out = []
        for zi, state in zip(z, self._state, strict=True):
            w = zi.clone()
            # one fused axpy per buffer and term: ~20 % faster on CPU than a matrix-vector product over the
            # stacked buffers followed by a broadcast update (the step is memory bound)
            for j, (theta, omega) in enumerate(zip(self.theta.tolist(), self.omega.tolist(), strict=True)):
                w.add_(state[j], alpha=omega)
                torch.add(zi, state[j], alpha=theta, out=state[j])
            if self.scale != 1.0:
                w.mul_(self.scale)
            out.append(w)
        self.step += 1
        return out

    def variance(self, t: int) -> float:
        if t >= len(self._variance):
            e = blt_inverse_coefficients(self.theta, self.omega, max(t + 1, 2 * len(self._variance)))
            self._variance = np.cumsum((self.scale * e) ** 2)
        return float(self._variance[t])

    def _buffers(self) -> dict[str, object]:
        return {
            "theta": self.theta.tolist(),
            "omega": self.omega.tolist(),
            "scale": self.scale,
            "state": [s.clone() for s in self._state],
        }

    def _load_buffers(self, buffers: dict[str, object]) -> None:
        same = (
            np.array_equal(np.asarray(buffers["theta"]), self.theta)
            and np.array_equal(np.asarray(buffers["omega"]), self.omega)
            and float(buffers["scale"]) == self.scale
        )
        if not same:
            raise ValueError("checkpoint was written by a BLT mechanism with different parameters")
        load_buffers_into(self._state, buffers["state"], "BLT state")
