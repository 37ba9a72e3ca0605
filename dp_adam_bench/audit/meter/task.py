"""The meter's vector task: canaries whose per-example gradients the meter knows in closed form.

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

import math

import numpy as np
import torch

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


def example_norms(n: int) -> np.ndarray:
    """The gradient norm of each of ``n`` canaries, in units of C (read from this module's ``NORMS`` at call time:
    tests patch it here)."""
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

    def known_grads(self, idx: torch.Tensor) -> torch.Tensor:
        """The per-example gradients the meter predicts from, (examples, trials, dim)."""
        return self.per_example_grads(None, idx)[0]

    def groups(self) -> dict[str, slice]:
        """The coordinate groups whose noise is checked separately."""
        return {
            "shared": slice(0, 1),
            "own": slice(1, 1 + self.n),
            "null": slice(1 + self.n, self.dim),
        }

    def group_masks(self) -> dict[str, np.ndarray]:
        """:meth:`groups` as boolean masks over the flattened (trials, dim)."""
        out = {}
        for g, sl in self.groups().items():
            mask = np.zeros((self.trials, self.dim), dtype=bool)
            mask[:, sl] = True
            out[g] = mask.reshape(-1)
        return out

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
