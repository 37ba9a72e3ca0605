"""The 2-D quadratic of Ganesh, McMahan & Thakurta §4.1-4.3 (the running example of their §4).

A. Ganesh, H. B. McMahan, A. Thakurta, "On Design Principles for Private Adaptive Optimizers" (2025,
arXiv:2507.01129).

Model (x, y); the loss on example (a, b) is (c_x / 2)(x - a)^2 + (c_y / 2)(y - b)^2 with (a, b) ~ N(0, I), a fresh
example every step, c_x >> c_y. The paper's formula is \\frac{c_x}{2}(x-a)^2 (its HTML rendering reads "cx2(xa)2",
which is easy to misread as c_x^2 (x - a)^2): with the 1/2 the per-example gradient is c (theta - a), so
E[g^2] = c^2 (theta^2 + 1) and non-private Adam's per-coordinate learning rates are ~ (1/c_x, 1/c_y), the inverse
Hessian, exactly as §4.1 says.

* Per-example gradient: g_i = (c_x (x - a_i), c_y (y - b_i)); closed form, no autograd.
* Expected loss E_{a,b}[loss] = (c_x/2)(x^2 + Var a) + (c_y/2)(y^2 + Var b); its minimum is at (0, 0), so the
  metric ``excess_loss`` = (c_x/2) x^2 + (c_y/2) y^2 (per trial), with its two halves ``excess_loss_x/_y``.
* Data: one example per index *and trial* (trials are independent repetitions of the whole stochastic
  experiment), drawn from ``data_seed`` once, so a run is reproducible. ``n_examples`` should be
  steps x batch size, with ``train.sampler=single_pass`` and ``train.epochs=1``: every example is used once ("a new
  example every step"), accounted without amplification.
* ``equivalent_noise_std: s`` (§4.2): draw (a, b) with variances 1 + B s^2 / c_x^2 and 1 + B s^2 / c_y^2 instead
  of 1. The averaged gradient of a batch of B then has exactly the distribution of the private one with noise
  N(0, s^2 I) added (clipping aside): the "different data distribution without DP noise" of §4.2.
* ``final_diagnostics`` (called by the training loop at the end): the optimizer's per-coordinate effective
  learning rates and second-moment estimates (see :mod:`dp_adam_bench.optim.preconditioner`), per trial.
"""

from __future__ import annotations

import numpy as np
import torch

from dp_adam_bench.optim.preconditioner import effective_preconditioner


class Quadratic2D:
    name = "quadratic_2d"
    trial_dims = 1  # parameters (trials, 2); per-example gradients (B, trials, 2)

    def __init__(self, cfg, *, trials: int, seed: int):
        self.c = (float(cfg.c_x), float(cfg.c_y))
        if not min(self.c) > 0:
            raise ValueError(f"task.c_x and task.c_y must be > 0, got {self.c}")
        self.n_examples = int(cfg.n_examples)
        if self.n_examples < 1:
            raise ValueError(f"task.n_examples must be >= 1, got {self.n_examples}")
        self.trials = int(trials)
        self.init = (float(cfg.get("x0", 1.0)), float(cfg.get("y0", 1.0)))
        self.batch_size = int(cfg.get("batch_size", 1))
        s = cfg.get("equivalent_noise_std")
        self.equivalent_noise_std = None if s is None else float(s)
        if self.equivalent_noise_std is not None and self.equivalent_noise_std < 0:
            raise ValueError(f"task.equivalent_noise_std must be >= 0 or null, got {s}")
        self.dtype = torch.float64
        self.c_vec = torch.tensor(self.c, dtype=self.dtype)
        self.data_var = torch.ones(2, dtype=self.dtype)
        if self.equivalent_noise_std:
            self.data_var = 1 + self.batch_size * self.equivalent_noise_std**2 / self.c_vec**2
        rng = np.random.default_rng(int(cfg.data_seed))
        z = torch.tensor(rng.standard_normal((self.n_examples, self.trials, 2)), dtype=self.dtype)
        # (n_examples, trials, 2): the example (a, b) of each index and trial
        self.ab = z * self.data_var.sqrt()

    @property
    def dataset_size(self) -> int:
        return self.n_examples

    def init_params(self) -> list[torch.Tensor]:
        return [torch.tensor(self.init, dtype=self.dtype).expand(self.trials, 2).clone()]

    def per_example_grads(self, params: list[torch.Tensor], idx: torch.Tensor) -> list[torch.Tensor]:
        """c * (theta - (a, b)) for each example of the batch and each trial: shape (B, trials, 2)."""
        return [self.c_vec * (params[0][None] - self.ab[idx])]

    def loss(self, params: list[torch.Tensor], idx: torch.Tensor) -> torch.Tensor:
        """Per-example loss, shape (B, trials)."""
        return (0.5 * self.c_vec * (params[0][None] - self.ab[idx]) ** 2).sum(-1)

    def expected_loss(self, params: list[torch.Tensor]) -> torch.Tensor:
        """E_{a,b}[loss] in closed form, per trial."""
        return (0.5 * self.c_vec * (params[0] ** 2 + self.data_var)).sum(-1)

    def evaluate(self, params: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        part = 0.5 * self.c_vec * params[0] ** 2  # expected loss minus its minimum, per coordinate
        return {"excess_loss": part.sum(-1), "excess_loss_x": part[:, 0], "excess_loss_y": part[:, 1]}

    def final_diagnostics(self, params, variant, state) -> dict[str, torch.Tensor]:
        """Per-trial effective learning rates eta / denominator in x and y, their ratio lr_y / lr_x (non-private
        theory: c_x / c_y), the second-moment estimates nu under the root and whether a floor decided the
        denominator."""
        pre = effective_preconditioner(variant, state)
        lr, nu, floor = pre["lr"][0], pre["nu"][0], pre["at_floor"][0]
        return {
            "lr_x": lr[:, 0],
            "lr_y": lr[:, 1],
            "lr_ratio": lr[:, 1] / lr[:, 0],
            "nu_x": nu[:, 0],
            "nu_y": nu[:, 1],
            "at_floor_x": floor[:, 0].to(self.dtype),
            "at_floor_y": floor[:, 1].to(self.dtype),
        }
