"""Deliberately broken privatizers: the controls an audit must catch (they exist only here, never in a run).

Each takes the place of the trainer's :class:`~dp_adam_bench.engine.privatizer.Privatizer` (same clip, sigma,
expected batch size, noise mechanisms and releases) and breaks one thing, while the run still claims the epsilon of
the plan:

* ``tenth_noise`` — noise std a tenth of k sigma C / B (a scale bug);
* ``no_noise`` — no noise at all (the bound's power: every canary is then exactly visible);
* ``reused_noise`` — the first noise draw replayed at every step (a noise stream reused across steps);
* ``cycle_ignored`` — cyclic Poisson sampling that forgets its cycle: every example may join every step (Poisson at
  the group rate q = b B / N over the whole dataset), while the run is still accounted as amplified BandMF with one
  Poisson-subsampled Gaussian per cycle (Choquette-Choo et al. 2023, arXiv 2306.08153, Thm. 4 needs an example to
  be sampled only at the steps of its group, t = g mod b): each example gets b times the participations claimed;
* ``clean_square`` — independent moment estimation whose release of g^2 is the clean g^2 (Ganesh, McMahan &
  Thakurta 2025, arXiv 2507.01129, Alg. 6 without the noise on its second release): the variant's update reads the
  clean second moment.

The registered non-private baselines (``noiseless_precond``, ``stp_noiseless_precond``: clean second moments by
design) are audited as controls too, with the epsilon their noise would claim.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from dp_adam_bench.engine.privatizer import Privatizer, Release
from dp_adam_bench.engine.sampling import CyclicPoissonSampler
from dp_adam_bench.registry import Registry


def rebuilt(cls: type[Privatizer], p: Privatizer) -> Privatizer:
    """A ``cls`` privatizer with everything ``p`` was built with."""
    return cls(
        clip=p.clip,
        sigma=p.sigma,
        expected_batch_size=p.B,
        mechanisms=p.mechanisms,
        releases=p.releases,
        trial_dims=p.trial_dims,
        keep_clean=p.keep_clean,
    )


class ScaledNoisePrivatizer(Privatizer):
    """Adds ``factor`` times the noise it claims."""

    factor = 0.1

    @property
    def noise_std(self) -> float:
        return super().noise_std * self.factor


class NoNoisePrivatizer(ScaledNoisePrivatizer):
    factor = 0.0


class _Replay:
    """A noise mechanism that returns its first draw at every step."""

    def __init__(self, mechanism):
        self.inner = mechanism
        self.first = None

    def next(self):
        if self.first is None:
            self.first = self.inner.next()
        return self.first

    def variance(self, t: int) -> float:
        return self.inner.variance(t)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class ReusedNoisePrivatizer(Privatizer):
    def __init__(self, **kw):
        kw["mechanisms"] = [_Replay(m) for m in kw["mechanisms"]]
        super().__init__(**kw)


class CleanSquarePrivatizer(Privatizer):
    """Releases g^2 without its noise (the gradient release keeps its noise)."""

    def release_mean(self, mean, scale=None) -> Release:
        out = super().release_mean(mean, scale)
        if out.ctx.noisy_square is None:
            raise ValueError("the clean_square control needs a variant that releases g^2 (ime, adagrad_ime)")
        out.ctx.noisy_square = [m * m for m in mean]
        return out


class CycleIgnoredSampler(CyclicPoissonSampler):
    """A cyclic Poisson sampler that ignores the cycle: at every step every example joins with probability q (the
    group rate b B / N), instead of only the members of group t mod b. Its ``cycle_length`` is the honest
    sampler's, and the plan counts rounds from the step, so the run is still accounted one amplified round per
    cycle."""

    def __init__(self, honest: CyclicPoissonSampler):
        self.__dict__.update(honest.__dict__)
        self.generator = torch.Generator().manual_seed(honest.seed * 1_000_003 + 1)

    def iter_from(self, step: int) -> Iterator[torch.Tensor]:
        for t in range(step, self.steps):
            mask = torch.rand(self.n, generator=self.generator) < self.q
            self.position = t + 1
            yield mask.nonzero().squeeze(1)


@dataclass(frozen=True)
class Control:
    """A control row: the registered variant, mechanism and sampler it runs, and the broken privatizer (None for a
    registered non-private baseline) or broken sampler (``sampler_bug``: the plan's sampler -> its replacement)."""

    variant: str
    noise: str
    sampler: str
    privatizer: type[Privatizer] | None
    what: str
    sampler_bug: type | None = None

    def wrap(self, p: Privatizer) -> Privatizer:
        return p if self.privatizer is None else rebuilt(self.privatizer, p)

    def wrap_sampler(self, sampler):
        if self.sampler_bug is None:
            return sampler
        if not isinstance(sampler, CyclicPoissonSampler):
            raise ValueError(
                f"the {self.sampler_bug.__name__} control breaks a cyclic Poisson sampler, got {sampler.kind!r}"
            )
        return self.sampler_bug(sampler)


CONTROLS = Registry("audit control", "audit.control")
for _name, _control in (
    (
        "noiseless_precond",
        Control("noiseless_precond", "independent", "poisson", None, "non-private baseline: clean g^2 in v"),
    ),
    (
        "noiseless_precond_mf",
        Control(
            "noiseless_precond", "dpmf_sqrt", "single_pass", None, "non-private baseline: clean g^2 in v"
        ),
    ),
    (
        "stp_noiseless_precond",
        Control(
            "stp_noiseless_precond",
            "independent",
            "poisson",
            None,
            "non-private baseline: clean g^2 in v (stp)",
        ),
    ),
    ("tenth_noise", Control("adam", "independent", "poisson", ScaledNoisePrivatizer, "noise std / 10")),
    ("tenth_noise_mf", Control("sgd", "dpmf_sqrt", "single_pass", ScaledNoisePrivatizer, "noise std / 10")),
    ("no_noise", Control("adam", "independent", "poisson", NoNoisePrivatizer, "no noise at all")),
    (
        "reused_noise",
        Control(
            "adam", "independent", "poisson", ReusedNoisePrivatizer, "first noise draw reused every step"
        ),
    ),
    (
        "cycle_ignored",
        Control(
            "sgd",
            "bandmf",
            "cyclic_poisson",
            None,
            "cyclic Poisson sampling every example at every step, accounted as amplified BandMF",
            CycleIgnoredSampler,
        ),
    ),
    (
        "clean_square",
        Control(
            "ime", "independent", "single_pass", CleanSquarePrivatizer, "IME's g^2 released without noise"
        ),
    ),
):
    CONTROLS.register(_name, _control)
