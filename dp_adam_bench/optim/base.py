"""The interface between the privatizer and an optimizer variant.

A variant is a small class with ``init(params) -> state`` and ``update(params, state, ctx)``, in the spirit of optax's
``GradientTransformation`` but stateful tensors updated in place (PyTorch style). State is an explicit dict of
tensors that checkpoints save; nothing is hung on parameters.

The privatizer (:mod:`dp_adam_bench.engine.privatizer`) owns clipping and *every* noisy release; a variant says
what it needs released (:class:`Releases`) and receives only private quantities in :class:`StepContext`:

* ``noisy`` — the privatized gradient g~_t = g_t + k (sigma C / B) w_t (Ganesh, McMahan & Thakurta, "On Design
  Principles for Private Adaptive Optimizers", Alg. 1/5), k = ``Releases.noise_scale`` (sqrt 2 for independent
  moment estimation).
* ``noisy_square`` — for variants with ``Releases.square_sensitivity``: g_t^2 + k sigma S2 w'_t on the
  privatizer's second, independent noise stream (independent moment estimation, Ganesh et al. Alg. 6).
* ``clean`` — the averaged clipped gradient *before* noise. Given only to variants marked ``private = False``
  (non-private baselines such as the noiseless preconditioner) that ask for it; the trainer records such runs as
  non-private. Diagnostics receive it separately and log it under ``diag/``.
* ``side`` — the mean gradient of a public batch (data held out of the private set), for ``needs_side_info``.
* ``noise_std`` = k sigma C / B and ``noise_variance`` = noise_std^2 * Var[w_t] (the Phi_t of bias correction:
  (sigma C / B)^2 for independent noise, times the row norm^2 of C^{-1} for DP-MF).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

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
    noisy_square: list[torch.Tensor] | None = None  # the private release of g^2 (Releases.square_sensitivity)
    clean: list[torch.Tensor] | None = None  # non-private baselines only (Releases.clean)
    side: list[torch.Tensor] | None = None  # mean gradient of a public batch (side-information variants)


@dataclass(frozen=True)
class Releases:
    """What the privatizer releases each step for a variant.

    * ``noise_scale`` k multiplies the noise of every release (IME splits the budget between g and g^2 and adds
      sqrt(2) times the noise to each; "IME for free" keeps k = 1 and is accounted with sigma / sqrt 2 instead).
    * ``square_sensitivity(C, B)``: when set, g^2 is released too, with noise std k sigma S2 on an independent
      stream, S2 the L2 sensitivity of the squared averaged clipped gradient.
    * ``clean``: hand the un-noised averaged clipped gradient to the variant (non-private baselines only).
    """

    noise_scale: float = 1.0
    square_sensitivity: Callable[[float, float], float] | None = None
    clean: bool = False

    @property
    def streams(self) -> int:
        """Independent noise streams these releases consume each step."""
        return 1 + (self.square_sensitivity is not None)


class Variant(ABC):
    """An optimizer variant; subclasses set ``name`` and implement ``init`` / ``update``."""

    name: str = "variant"
    needs_clean: bool = (
        False  # a non-private baseline that reads StepContext.clean (requires private = False)
    )
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
        # the learning rate of the current step: the session sets it to optimizer.lr times the schedule's factor
        # (dp_adam_bench.optim.schedule) before each update
        self.lr = float(lr)

    @abstractmethod
    def init(self, params: list[torch.Tensor]) -> dict:
        """Fresh optimizer state for these parameters."""

    @abstractmethod
    def update(self, params: list[torch.Tensor], state: dict, ctx: StepContext) -> None:
        """Apply one step in place."""

    def releases(self) -> Releases:
        """What the privatizer must release for this variant each step (see :class:`Releases`)."""
        return Releases(clean=self.needs_clean)

    def scale(self, state: dict) -> list[torch.Tensor] | None:
        """Per-coordinate scale s_t applied to per-example gradients before clipping (scale-then-privatize);
        None for every other variant."""
        return None
