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

Weight decay (``weight_decay`` = lambda, on every variant), of one of two kinds (``weight_decay_mode``):

* ``coupled`` — L2 regularisation: lambda theta is added to the privatized gradient inside the optimizer, before it
  feeds the moments, as ``torch.optim.SGD / Adam / Adagrad(weight_decay=...)`` do. Only for variants whose moments
  are all fed by that one gradient (``coupled_decay``); those fed by a separate release of g^2 (IME), the clean
  gradient or a public one are refused (their second moment would not see the decay).
* ``decoupled`` — theta <- theta - eta_t lambda theta outside the preconditioner, eta_t the current scheduled
  learning rate (Loshchilov & Hutter, "Decoupled Weight Decay Regularization", ICLR 2019; ``torch.optim.AdamW``'s
  ``param.mul_(1 - lr * weight_decay)`` before the step).

Either way the decay is a function of the parameters alone, which are themselves a function of the past releases:
it reads no data, so it is post-processing and costs no privacy (the accountant sees only the releases, and the
meter's replay from the releases reproduces a decayed run). ``decay_mask`` (one bool per parameter tensor, set by
the trainer from the model's parameter names and module types, :mod:`dp_adam_bench.optim.decay`; None: all decay)
says which tensors decay; ``decay_exclude`` names the rule (``bias_and_norm``: Hugging Face Trainer's, biases and
normalisation weights excluded; ``none``).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

WEIGHT_DECAY_MODES = ("coupled", "decoupled")
#: optimizer.decay_exclude: which parameter tensors do not decay (dp_adam_bench.optim.decay)
DECAY_EXCLUDE = ("bias_and_norm", "none")


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

    # False: coupled (L2) weight decay is refused, the moments being fed by more than the privatized gradient
    coupled_decay: bool = True

    def __init__(
        self,
        lr: float,
        weight_decay: float = 0.0,
        weight_decay_mode: str = "coupled",
        decay_exclude: str = "bias_and_norm",
        **hparams,
    ):
        if not lr > 0:
            raise ValueError(f"optimizer.lr must be > 0, got {lr}")
        # the learning rate of the current step: the session sets it to optimizer.lr times the schedule's factor
        # (dp_adam_bench.optim.schedule) before each update
        self.lr = float(lr)
        if isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float)):
            raise ValueError(f"optimizer.weight_decay={weight_decay!r} must be a finite number >= 0")
        if not (math.isfinite(weight_decay) and weight_decay >= 0):
            raise ValueError(f"optimizer.weight_decay={weight_decay!r} must be a finite number >= 0")
        if weight_decay_mode not in WEIGHT_DECAY_MODES:
            raise ValueError(
                f"optimizer.weight_decay_mode={weight_decay_mode!r}; valid: {', '.join(WEIGHT_DECAY_MODES)}"
            )
        if decay_exclude not in DECAY_EXCLUDE:
            raise ValueError(f"optimizer.decay_exclude={decay_exclude!r}; valid: {', '.join(DECAY_EXCLUDE)}")
        if weight_decay and weight_decay_mode == "coupled" and not self.coupled_decay:
            raise ValueError(
                f"optimizer.weight_decay_mode=coupled with optimizer.name={self.name!r}: its second moment is not "
                "fed by the privatized gradient, so L2 decay added to that gradient would not reach it; set "
                "optimizer.weight_decay_mode=decoupled"
            )
        self.weight_decay, self.weight_decay_mode = float(weight_decay), weight_decay_mode
        self.decay_exclude = decay_exclude
        self.decay_mask: list[bool] | None = None  # set by the trainer (None: every tensor decays)

    @abstractmethod
    def init(self, params: list[torch.Tensor]) -> dict:
        """Fresh optimizer state for these parameters."""

    @abstractmethod
    def update(self, params: list[torch.Tensor], state: dict, ctx: StepContext) -> None:
        """Apply one step in place."""

    def _decays(self, params: list[torch.Tensor]) -> list[bool]:
        mask = self.decay_mask
        if mask is None:
            return [True] * len(params)
        if len(mask) != len(params):
            raise ValueError(f"decay_mask has {len(mask)} entries for {len(params)} parameter tensors")
        return mask

    def with_coupled_decay(self, params: list[torch.Tensor], grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """g + lambda theta on the decaying tensors under coupled (L2) decay, as ``torch.optim.Adam``'s
        ``grad.add(param, alpha=weight_decay)`` (new tensors: the release is not modified); else ``grads``."""
        if not self.weight_decay or self.weight_decay_mode != "coupled":
            return grads
        return [
            g.add(p, alpha=self.weight_decay) if d else g
            for p, g, d in zip(params, grads, self._decays(params), strict=True)
        ]

    def apply_decoupled_decay(self, params: list[torch.Tensor]) -> None:
        """theta <- (1 - eta_t lambda) theta on the decaying tensors under decoupled decay (``torch.optim.AdamW``'s
        ``param.mul_(1 - lr * weight_decay)``, eta_t the current step's scheduled learning rate)."""
        if not self.weight_decay or self.weight_decay_mode != "decoupled":
            return
        factor = 1 - self.lr * self.weight_decay
        for p, d in zip(params, self._decays(params), strict=True):
            if d:
                p.mul_(factor)

    def releases(self) -> Releases:
        """What the privatizer must release for this variant each step (see :class:`Releases`)."""
        return Releases(clean=self.needs_clean)

    def scale(self, state: dict) -> list[torch.Tensor] | None:
        """Per-coordinate scale s_t applied to per-example gradients before clipping (scale-then-privatize);
        None for every other variant."""
        return None
