"""1-D sparse logistic regression (Ganesh, McMahan & Thakurta §5.1, Fig. 2).

A. Ganesh, H. B. McMahan, A. Thakurta, "On Design Principles for Private Adaptive Optimizers" (2025,
arXiv:2507.01129), §5.1: "We generate 1000 training samples and do a single epoch with batch size 1"; published
test losses in ``configs/paper/ganesh.yaml`` (``fig2``).

x ~ N(0, 1), y ~ Bernoulli(sigmoid(x)); loss l(theta; x, y) = y log(1/p) + (1 - y) log(1/(1 - p)),
p = sigmoid(theta x); the ground truth is theta = 1. 90 % of the *training* inputs are set to x = 0 (their gradient
is 0), the 10,000 test points are not sparsified.

The model is a scalar, so all trials are vectorised: the parameter has shape (trials,) and each coordinate is an
independent trial with its own noise. The data set is the same for every trial (only the DP noise differs), which
is how we read "the average of 30 trials"; the data seed is a config field.

Per-example gradients are closed-form here, (sigmoid(theta x) - y) x, so this task needs no autograd engine.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def binary_entropy(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, 1e-15, 1 - 1e-15)
    return -(p * np.log(p) + (1 - p) * np.log1p(-p))


def population_ground_truth_loss(quad_points: int = 200) -> float:
    """E_x[H(sigmoid(x))] for x ~ N(0, 1): the expected test loss of theta = 1 (Gauss-Hermite quadrature)."""
    nodes, weights = np.polynomial.hermite_e.hermegauss(quad_points)
    return float(np.sum(weights * binary_entropy(1 / (1 + np.exp(-nodes)))) / math.sqrt(2 * math.pi))


class Logistic1D:
    """Data, per-example gradients and test loss for the 1-D logistic experiment."""

    name = "logistic_1d"
    trial_dims = 1  # parameters carry a leading trials dimension

    def __init__(self, cfg, *, trials: int, seed: int):
        self.n_train = int(cfg.n_train)
        self.n_test = int(cfg.n_test)
        self.sparsity = float(cfg.sparsity)
        if not 0.0 <= self.sparsity <= 1.0:
            raise ValueError(f"task.sparsity must be in [0, 1], got {self.sparsity}")
        if self.n_train < 1 or self.n_test < 1:
            raise ValueError(f"task.n_train and task.n_test must be >= 1, got {self.n_train}, {self.n_test}")
        self.trials = trials
        rng = np.random.default_rng(int(cfg.data_seed))
        x = rng.standard_normal(self.n_train)
        y = rng.random(self.n_train) < 1 / (1 + np.exp(-x))
        zero = rng.permutation(self.n_train)[: int(round(self.sparsity * self.n_train))]
        x[zero] = 0.0
        xt = rng.standard_normal(self.n_test)
        yt = rng.random(self.n_test) < 1 / (1 + np.exp(-xt))
        dt = torch.float64
        self.x_train, self.y_train = torch.tensor(x, dtype=dt), torch.tensor(y, dtype=dt)
        self.x_test, self.y_test = torch.tensor(xt, dtype=dt), torch.tensor(yt, dtype=dt)
        self.dtype = dt

    @property
    def dataset_size(self) -> int:
        return self.n_train

    def init_params(self) -> list[torch.Tensor]:
        return [torch.zeros(self.trials, dtype=self.dtype)]

    def per_example_grads(self, params: list[torch.Tensor], idx: torch.Tensor) -> list[torch.Tensor]:
        """Gradients of each example in the batch ``idx`` for every trial: shape (B, trials)."""
        theta = params[0]
        x, y = self.x_train[idx][:, None], self.y_train[idx][:, None]
        return [(torch.sigmoid(theta[None, :] * x) - y) * x]

    def test_loss(self, params: list[torch.Tensor]) -> torch.Tensor:
        """Mean test cross-entropy per trial, shape (trials,)."""
        z = params[0][:, None] * self.x_test[None, :]
        y = self.y_test[None, :]
        # y log(1/p) + (1-y) log(1/(1-p)) with p = sigmoid(z), in the stable softplus form
        return (torch.nn.functional.softplus(z) - y * z).mean(dim=1)

    def ground_truth_loss(self) -> float:
        return float(self.test_loss([torch.ones(1, dtype=self.dtype)])[0])

    def evaluate(self, params: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"test_loss": self.test_loss(params)}
