"""The meter's model task: a model for the real clipping engines whose per-example gradients are known in closed
form, so that the meter can predict every release made through an engine (bk, ghost, hooks, functorch, loop)."""

from __future__ import annotations

import math

import numpy as np
import torch

from dp_adam_bench.audit.meter.task import SHARED, class_members, example_norms

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

    def known_grads(self, idx: torch.Tensor) -> torch.Tensor:
        """:meth:`closed_form_grads` flattened and joined, (examples, weight and bias coordinates)."""
        return torch.cat([g.reshape(len(idx), -1) for g in self.closed_form_grads(idx)], dim=1)

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
