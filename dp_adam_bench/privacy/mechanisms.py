"""Streaming noise mechanisms: yield w_t = (C^{-1} z)_t, one model-shaped noise draw per step.

Interface (what the privatizer and the optimizers see; Ganesh et al. Algorithm 1 with C^{-1} z in place of z):

* ``reset(shapes, seed, dtype, device)`` — start a fresh stream for tensors of the given shapes.
* ``next()`` — the noise for the current step (a list of tensors, unit noise multiplier: the caller multiplies by
  sigma * clip / expected_batch_size), then advance.
* ``variance(t)`` — the per-coordinate variance of w_t for unit-variance z (row norm^2 of C^{-1}, 0-based t).
* ``state_dict()`` / ``load_state_dict()`` — everything needed to resume the stream bit-identically
  (step, generator state, buffers), so checkpoints keep the noise a run would have had.

Independent trials are vectorised by giving shapes with a leading trials dimension: every coordinate gets its own
i.i.d. z, so trials are independent streams.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np
import torch


def zeroed_buffers(
    old: list[torch.Tensor], shapes: Sequence[Sequence[int]], dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """Zero streaming buffers of ``shapes``: ``old`` zeroed in place when it already has exactly these shapes, dtype
    and device, else new tensors. A resumed run resets its mechanism twice (when its session is built, then in
    ``load_state_dict``); BandMF's buffers are ``b - 1`` copies of the model (a GB for BERT-tiny at b = 128), and a
    second allocation would hold two of them at once."""
    shapes = [torch.Size(s) for s in shapes]
    if len(old) == len(shapes) and all(
        t.shape == s and t.dtype == dtype and t.device == device for t, s in zip(old, shapes, strict=True)
    ):
        for t in old:
            t.zero_()
        return old
    return [torch.zeros(s, dtype=dtype, device=device) for s in shapes]


def load_buffers_into(buffers: list[torch.Tensor], saved: Sequence[torch.Tensor], what: str) -> None:
    """Copy a checkpoint's ``saved`` buffers into the mechanism's own ``buffers`` (converting dtype and device):
    no second copy of them is allocated, and the mechanism never shares storage with the state it was given."""
    if len(saved) != len(buffers) or any(s.shape != b.shape for s, b in zip(saved, buffers, strict=False)):
        raise ValueError(
            f"checkpoint {what} buffers have shapes {[tuple(s.shape) for s in saved]}, this mechanism's "
            f"{[tuple(b.shape) for b in buffers]}"
        )
    for b, s in zip(buffers, saved, strict=True):
        b.copy_(s)


class NoiseMechanism(ABC):
    """Base class: owns a torch.Generator and a step counter; subclasses add their buffers."""

    name: str = "mechanism"

    def __init__(self) -> None:
        self.step = 0
        self._shapes: list[torch.Size] | None = None
        self._gen: torch.Generator | None = None
        self._dtype = torch.float32
        self._device = torch.device("cpu")

    def reset(
        self,
        shapes: Sequence[Sequence[int]],
        seed: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> NoiseMechanism:
        self._shapes = [torch.Size(s) for s in shapes]
        self._dtype = dtype
        self._device = torch.device(device)
        self._gen = torch.Generator(device=self._device)
        self._gen.manual_seed(int(seed))
        self.step = 0
        self._reset_buffers()
        return self

    def _reset_buffers(self) -> None:  # noqa: B027 - optional hook, most mechanisms have no buffers
        """Subclasses allocate their streaming buffers here."""

    def buffer_floats(self, numel: int) -> int:
        """How many floats the streaming buffers hold for a model of ``numel`` coordinates (0: none beyond the
        current draw). The plan checks this before allocating, so a run that cannot fit is refused up front."""
        return 0

    def _draw_z(self) -> list[torch.Tensor]:
        if self._shapes is None or self._gen is None:
            raise RuntimeError(f"{type(self).__name__}.next() called before reset(shapes, seed)")
        return [
            torch.randn(s, generator=self._gen, dtype=self._dtype, device=self._device) for s in self._shapes
        ]

    def _check_step(self) -> int:
        """The current step, after checking it lies within the strategy's ``n`` steps (when it has one)."""
        n = getattr(self, "n", None)
        if n is not None and self.step >= n:
            raise RuntimeError(
                f"{self.name}: the strategy covers {n} steps but step {self.step + 1} was requested; "
                "build the strategy for the run's number of steps"
            )
        return self.step

    @abstractmethod
    def next(self) -> list[torch.Tensor]:
        """Noise for the current step (unit noise multiplier); advances the stream."""

    @abstractmethod
    def variance(self, t: int) -> float:
        """Per-coordinate variance of w_t (0-based step) for unit-variance z."""

    # --- checkpointing ---------------------------------------------------------------------------------------
    def _buffers(self) -> dict[str, object]:
        return {}

    def _load_buffers(self, buffers: dict[str, object]) -> None:  # noqa: B027 - optional hook
        """Subclasses restore their streaming buffers here."""

    def state_dict(self) -> dict:
        if self._gen is None:
            raise RuntimeError("cannot checkpoint a mechanism that was never reset")
        return {
            "name": self.name,
            "step": self.step,
            "shapes": [list(s) for s in self._shapes],
            "dtype": str(self._dtype),
            "generator": self._gen.get_state(),
            "buffers": self._buffers(),
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("name") != self.name:
            raise ValueError(
                f"checkpoint holds noise state of mechanism {state.get('name')!r}, but this run uses {self.name!r}"
            )
        shapes = [torch.Size(s) for s in state["shapes"]]
        dtype = getattr(torch, state["dtype"].replace("torch.", ""))
        self.reset(shapes, seed=0, dtype=dtype, device=self._device)
        self._gen.set_state(state["generator"].cpu())  # generator states are CPU byte tensors
        self.step = int(state["step"])
        self._load_buffers(state["buffers"])


class IndependentMechanism(NoiseMechanism):
    """w_t = z_t: independent Gaussian noise (DP-SGD)."""

    name = "independent"

    def next(self) -> list[torch.Tensor]:
        z = self._draw_z()
        self.step += 1
        return z

    def variance(self, t: int) -> float:
        return 1.0


class DenseMechanism(NoiseMechanism):
    """w_t = sum_{s<=t} C^{-1}[t, s] z_s for any dense lower-triangular C^{-1}.

    Keeps every past z: O(t * d) memory, so it is for small models or short runs (the 1-D experiments, tests).
    Banded and BLT strategies stream with O(b * d) memory instead.
    """

    name = "dense"

    def __init__(self, c_inverse: np.ndarray, name: str = "dense"):
        super().__init__()
        c_inverse = np.asarray(c_inverse, dtype=np.float64)
        if c_inverse.ndim != 2 or c_inverse.shape[0] != c_inverse.shape[1]:
            raise ValueError(f"C^-1 must be a square matrix, got shape {c_inverse.shape}")
        self.c_inverse = c_inverse
        self.n = c_inverse.shape[0]
        self.name = name
        self._history: list[torch.Tensor] = []

    def buffer_floats(self, numel: int) -> int:
        return self.n * numel

    def _reset_buffers(self) -> None:
        # one (n, *shape) tensor per parameter, filled as the stream advances
        self._history = [
            torch.empty((self.n, *s), dtype=self._dtype, device=self._device) for s in self._shapes
        ]
        self._c_inv_t = torch.as_tensor(self.c_inverse, dtype=self._dtype, device=self._device)

    def next(self) -> list[torch.Tensor]:
        t = self._check_step()
        row = self._c_inv_t[t, : t + 1]
        out = []
        for hist, z in zip(self._history, self._draw_z(), strict=True):
            hist[t] = z
            out.append(torch.tensordot(row, hist[: t + 1], dims=1))
        self.step += 1
        return out

    def variance(self, t: int) -> float:
        return float(np.sum(self.c_inverse[t, : t + 1] ** 2))

    def _buffers(self) -> dict[str, object]:
        return {"history": [h[: self.step].clone() for h in self._history]}

    def _load_buffers(self, buffers: dict[str, object]) -> None:
        for hist, saved in zip(self._history, buffers["history"], strict=True):
            hist[: saved.shape[0]] = saved
