"""The interface between the privatizer and an optimizer variant.

A variant is a small class with ``init(params) -> state`` and ``update(params, state, ctx)``, in the spirit of optax's
``GradientTransformation`` but stateful tensors updated in place (PyTorch style). State is an explicit dict of
tensors that checkpoints save; nothing is hung on parameters.

What a variant may read from :class:`StepContext`:

* ``noisy`` — the privatized gradient g~_t = g_t + (sigma C / B) w_t (Ganesh Alg. 1/5). Always private.
* ``clean`` — the averaged clipped gradient g_t *before* noise. Only provided to variants that declare
  ``needs_clean = True`` because their algorithm privatizes a function of it themselves (independent moment
  estimation noises g_t^2 with its own stream) or because they are *non-private baselines* (noiseless
  preconditioner). Anything derived from it and logged must be labelled diagnostic.
* ``unit_noise`` — w_t of the gradient's own stream, given together with ``clean``.
* ``side`` — the mean gradient of a public batch (data held out of the private set), for ``needs_side_info``.
* ``noise(stream)`` — unit noise for this step from an extra, independent stream (IME's second stream).
* ``noise_std`` = sigma * C / B and ``noise_variance`` = noise_std^2 * Var[w_t] (the Phi_t of bias correction:
  (sigma C / B)^2 for independent noise, times the row norm^2 of C^{-1} for DP-MF).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class StepContext:
    step: int  # 1-based t
    noisy: list[torch.Tensor]
    noise_std: float
    noise_variance: float
    sigma: float
    clip: float | None
    expected_batch_size: float
    clean: list[torch.Tensor] | None = None
    unit_noise: list[torch.Tensor] | None = None  # w_t of the gradient's own stream (with clean, for IME)
    side: list[torch.Tensor] | None = None  # mean gradient of a public batch (side-information variants)
    noise: Callable[[int], list[torch.Tensor]] = field(default=lambda stream: [])


class Variant(ABC):
    """An optimizer variant; subclasses set ``name`` and implement ``init`` / ``update``."""

    name: str = "variant"
    needs_clean: bool = False  # see StepContext.clean
    extra_noise_streams: int = 0  # independent noise streams beyond the gradient's own
    private: bool = True  # False for baselines that use clean statistics (never report them as private)
    needs_side_info: bool = False  # True: the trainer supplies ctx.side from a public batch
    # The noise multiplier the accountant must use is sigma * sigma_factor: IME "for free" releases two
    # quantities each with the full sigma, i.e. a joint mechanism with noise multiplier sigma / sqrt(2).
    sigma_factor: float = 1.0
    # True: the variant's sensitivity argument needs every batch to have at most B examples (fixed-size batches)
    needs_fixed_batch: bool = False

    def __init__(self, lr: float, **hparams):
        if not lr > 0:
            raise ValueError(f"optimizer.lr must be > 0, got {lr}")
        self.lr = float(lr)

    @abstractmethod
    def init(self, params: list[torch.Tensor]) -> dict:
        """Fresh optimizer state for these parameters."""

    @abstractmethod
    def update(self, params: list[torch.Tensor], state: dict, ctx: StepContext) -> None:
        """Apply one step in place."""

    def scale(self, state: dict) -> list[torch.Tensor] | None:
        """Per-coordinate scale s_t applied to per-example gradients before clipping (scale-then-privatize);
        None for every other variant."""
        return None
