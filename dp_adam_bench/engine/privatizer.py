"""Clip, sum, add noise, divide by the *expected* batch size (Ganesh Alg. 1; Tang Alg. 1).

g~_t = (1/B) sum_i clip(s_t * g_i; C) / s_t-style scaling aside, plus (sigma C / B) w_t with w_t from the noise
mechanism. Dividing by the realized batch size under Poisson sampling would leak the batch size, so B is always the
expected batch size given at construction.
"""

from __future__ import annotations

import torch

from dp_adam_bench.engine.grads import clip_factors
from dp_adam_bench.optim.base import StepContext
from dp_adam_bench.privacy.mechanisms import NoiseMechanism


def per_example_norms(per_example: list[torch.Tensor], lead_dims: int) -> torch.Tensor:
    """L2 norm of each example's whole gradient; the first ``lead_dims`` dims index (example, trials...)."""
    sq = None
    for g in per_example:
        s = g.pow(2).reshape(*g.shape[:lead_dims], -1).sum(-1)
        sq = s if sq is None else sq + s
    return sq.sqrt()


class Privatizer:
    """Turns per-example gradients into a :class:`StepContext` for the optimizer variant.

    ``trial_dims`` counts the dimensions after the batch dimension that index independent trials (vectorised toy
    tasks); model tasks use 0.
    """

    def __init__(
        self,
        *,
        clip: float | None,
        sigma: float,
        expected_batch_size: float,
        mechanisms: list[NoiseMechanism],
        trial_dims: int = 0,
        provide_clean: bool = False,
    ):
        if sigma < 0:
            raise ValueError(f"privacy.sigma must be >= 0, got {sigma}")
        if clip is not None and not clip > 0:
            raise ValueError(f"privacy.clip must be > 0 or null (no clipping), got {clip}")
        if sigma > 0 and clip is None:
            raise ValueError(
                "privacy.sigma > 0 needs a clip norm: without clipping the sensitivity is unbounded"
            )
        if sigma > 0 and not mechanisms:
            raise ValueError("privacy.sigma > 0 needs a noise mechanism (noise=independent, dpmf_sqrt, ...)")
        if not expected_batch_size > 0:
            raise ValueError(f"expected batch size must be > 0, got {expected_batch_size}")
        self.clip, self.sigma, self.B = clip, float(sigma), float(expected_batch_size)
        self.mechanisms = mechanisms
        self.trial_dims = trial_dims
        self.provide_clean = provide_clean
        self.step = 0

    @property
    def noise_std(self) -> float:
        """Std of the noise on the averaged gradient, sigma * C / B (0 without noise)."""
        return self.sigma * self.clip / self.B if self.sigma > 0 else 0.0

    def clipped_mean(
        self, per_example: list[torch.Tensor], scale: list[torch.Tensor] | None = None
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """(1/B) sum_i clip(s * g_i; C), and the per-example norms (before clipping) for diagnostics."""
        lead = 1 + self.trial_dims
        if scale is not None:
            per_example = [g * s for g, s in zip(per_example, scale, strict=True)]
        norms = per_example_norms(per_example, lead)
        factor = clip_factors(norms, self.clip)
        out = []
        for g in per_example:
            f = factor.reshape(*factor.shape, *([1] * (g.dim() - lead)))
            out.append((g * f).sum(0) / self.B)
        return out, norms

    def __call__(
        self, per_example: list[torch.Tensor], scale: list[torch.Tensor] | None = None
    ) -> StepContext:
        """Per-example gradients in (vectorised toy tasks), privatized step context out."""
        mean, _ = self.clipped_mean(per_example, scale)
        return self.privatize_mean(mean, scale)

    def privatize_sum(
        self, summed: list[torch.Tensor], scale: list[torch.Tensor] | None = None
    ) -> StepContext:
        """The sum of clipped per-example gradients of a whole logical batch in, privatized step context out."""
        return self.privatize_mean([s / self.B for s in summed], scale)

    def privatize_mean(
        self, mean: list[torch.Tensor], scale: list[torch.Tensor] | None = None
    ) -> StepContext:
        """Add the step's noise to (1/B) sum_i clip(s g_i); undo the scale s for scale-then-privatize."""
        self.step += 1
        unit = None
        if self.sigma > 0:
            unit = self.mechanisms[0].next()
            noisy = [m + self.noise_std * w for m, w in zip(mean, unit, strict=True)]
            variance = self.noise_std**2 * self.mechanisms[0].variance(self.step - 1)
        else:
            noisy, variance = mean, 0.0
        if (
            scale is not None
        ):  # scale-then-privatize: undo the scaling after the noise (Ganesh Alg. 8, line 6)
            noisy = [g / s for g, s in zip(noisy, scale, strict=True)]
            mean = [m / s for m, s in zip(mean, scale, strict=True)]
        return StepContext(
            step=self.step,
            noisy=noisy,
            noise_std=self.noise_std,
            noise_variance=variance,
            sigma=self.sigma,
            clip=self.clip,
            expected_batch_size=self.B,
            clean=mean if self.provide_clean else None,
            unit_noise=unit if self.provide_clean else None,
            noise=self._extra_noise,
        )

    def _extra_noise(self, stream: int) -> list[torch.Tensor]:
        if stream < 1 or stream >= len(self.mechanisms):
            raise ValueError(
                f"noise stream {stream} requested, but only {len(self.mechanisms)} streams exist"
            )
        return self.mechanisms[stream].next()

    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "mechanisms": [m.state_dict() for m in self.mechanisms if m._gen is not None],
        }

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        for m, s in zip(self.mechanisms, state["mechanisms"], strict=True):
            m.load_state_dict(s)
