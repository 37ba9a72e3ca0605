"""The privatizer: clip, sum, add noise, divide by the *expected* batch size — and nothing noisy leaves a step any
other way (Ganesh, McMahan & Thakurta, "On Design Principles for Private Adaptive Optimizers", Alg. 1 and 6;
Tang & Lécuyer, "DP-Adam: Correcting DP Bias in Adam's Second Moment Estimation", 2023, Alg. 1).

Per step it makes every release the optimizer variant asked for (:class:`~dp_adam_bench.optim.base.Releases`):

* the gradient, g~_t = (1/B) sum_i clip(s g_i; C) / s + k (sigma C / B) w_t, where w_t comes from the noise
  mechanism's first stream, k is the variant's noise scale (sqrt 2 for independent moment estimation) and s the
  scale of scale-then-privatize (Ganesh Alg. 8; 1 otherwise);
* for independent moment estimation, g_t^2 + k sigma S2 w'_t on the mechanism's second, independent stream, with S2
  the L2 sensitivity of g_t^2 (Ganesh §3.2);
* the clean (un-noised) mean, only to a non-private baseline that asks for it, and separately to the diagnostics
  (which log it under ``diag/``, never as a private output).

Dividing by the realized batch size under Poisson sampling would leak the batch size, so B is always the expected
batch size given at construction.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dp_adam_bench.engine.grads import clip_factors
from dp_adam_bench.optim.base import Releases, StepContext
from dp_adam_bench.privacy.mechanisms import NoiseMechanism


def per_example_norms(per_example: list[torch.Tensor], lead_dims: int) -> torch.Tensor:
    """L2 norm of each example's whole gradient; the first ``lead_dims`` dims index (example, trials...).
    An empty batch (0 examples) gives an empty tensor of norms."""
    sq = None
    for g in per_example:
        s = g.pow(2)
        if g.dim() > lead_dims:  # flatten, not reshape(..., -1): a batch of 0 examples has 0 elements
            s = s.flatten(lead_dims).sum(-1)
        sq = s if sq is None else sq + s
    return sq.sqrt()


@dataclass
class Release:
    """One step's output: ``ctx`` holds only what the variant may read; ``clean`` is for diagnostics alone."""

    ctx: StepContext
    clean: list[torch.Tensor] | None


class Privatizer:
    """Turns clipped gradients into a private :class:`StepContext` for the optimizer variant.

    ``trial_dims`` counts the dimensions after the batch dimension that index independent trials (vectorised toy
    tasks); model tasks use 0. ``keep_clean``: also return the clean mean for diagnostics.
    """

    def __init__(
        self,
        *,
        clip: float | None,
        sigma: float,
        expected_batch_size: float,
        mechanisms: list[NoiseMechanism],
        releases: Releases | None = None,
        trial_dims: int = 0,
        keep_clean: bool = False,
    ):
        if not (isinstance(sigma, (int, float)) and math.isfinite(sigma) and sigma >= 0):
            raise ValueError(f"privacy.sigma must be a finite number >= 0, got {sigma}")
        if clip is not None and not (math.isfinite(clip) and clip > 0):
            raise ValueError(f"privacy.clip must be a finite number > 0 or null (no clipping), got {clip}")
        if sigma > 0 and clip is None:
            raise ValueError(
                "privacy.sigma > 0 needs a clip norm: without clipping the sensitivity is unbounded"
            )
        self.releases = releases or Releases()
        if sigma > 0 and len(mechanisms) != self.releases.streams:
            raise ValueError(
                f"the variant's releases need {self.releases.streams} noise stream(s), got {len(mechanisms)} "
                "(noise=independent, dpmf_sqrt, ... builds them)"
            )
        if not (math.isfinite(expected_batch_size) and expected_batch_size > 0):
            raise ValueError(f"expected batch size must be > 0, got {expected_batch_size}")
        self.clip, self.sigma, self.B = clip, float(sigma), float(expected_batch_size)
        self.mechanisms = mechanisms
        self.trial_dims = trial_dims
        self.keep_clean = keep_clean
        self.step = 0
        #: measures every noise tensor added to a release (engine/noise_check.py); set by the training session
        self.noise_check = None
        self._pinned: StepContext | None = None  # see pinned_release

    @property
    def noise_std(self) -> float:
        """Std of the noise on the averaged gradient, k sigma C / B (0 without noise)."""
        return self.sigma * self.clip / self.B * self.releases.noise_scale if self.sigma > 0 else 0.0

    def clipped_mean(
        self, per_example: list[torch.Tensor], scale: list[torch.Tensor] | None = None
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """(1/B) sum_i clip(s * g_i; C), and the per-example norms (before clipping). Vectorised toy tasks."""
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

    def release_per_example(
        self, per_example: list[torch.Tensor], scale: list[torch.Tensor] | None = None
    ) -> Release:
        """Per-example gradients in (vectorised toy tasks), the step's private releases out."""
        mean, _ = self.clipped_mean(per_example, scale)
        return self.release_mean(mean, scale)

    def release_sum(self, summed: list[torch.Tensor], scale: list[torch.Tensor] | None = None) -> Release:
        """The sum of clipped per-example gradients of a whole logical batch in, the step's private releases out.

        ``summed`` is consumed (the caller's accumulator): it is divided by B and noised in place, so that a step
        holds no more parameter-sized copies than it must (GPT-2 small on a CPU: 2 fewer, 1.3 GB)."""
        return self.release_mean([s.div_(self.B) for s in summed], scale, consume=True)

    def release_mean(
        self, mean: list[torch.Tensor], scale: list[torch.Tensor] | None = None, *, consume: bool = False
    ) -> Release:
        """Add the step's noise to (1/B) sum_i clip(s g_i); undo the scale s for scale-then-privatize.

        ``consume``: ``mean`` is the caller's to overwrite: the noise is added to it in place unless the clean mean
        is still needed (``keep_clean``, a variant that reads it, the release of g^2)."""
        if self._pinned is not None:
            return self._pinned_mean(mean, scale)
        self.step += 1
        rel = self.releases
        std = self.noise_std
        noisy_square = None
        if self.sigma > 0:
            unit = self.mechanisms[0].next()
            in_place = consume and not (self.keep_clean or rel.clean or rel.square_sensitivity is not None)
            noisy = [self._add(m, std * w, 0, in_place) for m, w in zip(mean, unit, strict=True)]
            del unit
            variance = std**2 * self.mechanisms[0].variance(self.step - 1)
        else:
            noisy, variance = mean, 0.0
        if rel.square_sensitivity is not None:
            if scale is not None:
                raise ValueError("a release of g^2 together with scale-then-privatize is not defined")
            noisy_square = [m * m for m in mean]
            if self.sigma > 0:
                sq_std = rel.noise_scale * self.sigma * rel.square_sensitivity(self.clip, self.B)
                w2 = self.mechanisms[1].next()
                noisy_square = [self._add(q, sq_std * w, 1) for q, w in zip(noisy_square, w2, strict=True)]
        if (
            scale is not None
        ):  # scale-then-privatize: undo the scaling after the noise (Ganesh Alg. 8, line 6)
            noisy = [g / s for g, s in zip(noisy, scale, strict=True)]
            mean = [m / s for m, s in zip(mean, scale, strict=True)]
        ctx = StepContext(
            step=self.step,
            noisy=noisy,
            noise_std=std,
            noise_variance=variance,
            sigma=self.sigma,
            clip=self.clip,
            expected_batch_size=self.B,
            noisy_square=noisy_square,
            clean=mean if rel.clean else None,
        )
        return Release(ctx, mean if self.keep_clean else None)

    def pinned_release(self, ctx: StepContext, make: Callable[[], Release]) -> Release:
        """``make()`` (a backend's release of some batch) with every noisy release pinned to ``ctx``'s: the batch is
        clipped and summed as usual, but no noise is drawn, no step counted, and the variant receives ``ctx``'s
        noisy tensors (copies). The post-processing check (:mod:`dp_adam_bench.engine.post_processing`) replays a
        step so, with another private batch behind the same release."""
        self._pinned = ctx
        try:
            return make()
        finally:
            self._pinned = None

    def _pinned_mean(self, mean: list[torch.Tensor], scale) -> Release:
        ctx = self._pinned
        if scale is not None:
            mean = [m / s for m, s in zip(mean, scale, strict=True)]
        pinned = dataclasses.replace(
            ctx,
            noisy=[g.clone() for g in ctx.noisy],
            noisy_square=None if ctx.noisy_square is None else [g.clone() for g in ctx.noisy_square],
            clean=mean if self.releases.clean else None,
            side=None,
        )
        return Release(pinned, mean if self.keep_clean else None)

    def _add(
        self, release: torch.Tensor, noise: torch.Tensor, stream: int, in_place: bool = False
    ) -> torch.Tensor:
        """``release + noise`` (in place when allowed), the noise as added shown to :attr:`noise_check` first: the
        check measures the tensors that reach the release, one parameter at a time (no extra model-sized copy)."""
        if self.noise_check is not None:
            self.noise_check.observe(stream, [noise], self.step - 1)
        return release.add_(noise) if in_place else release + noise

    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "mechanisms": [m.state_dict() for m in self.mechanisms if m._gen is not None],
        }

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        for m, s in zip(self.mechanisms, state["mechanisms"], strict=True):
            m.load_state_dict(s)
