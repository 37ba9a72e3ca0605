"""The noise-mechanism registry: ``noise.kind`` -> how to build the run's strategy, and its streaming mechanisms.

Adding a mechanism: a :class:`~dp_adam_bench.privacy.strategies.Strategy` (with ``.mechanism()`` and
``.sensitivity()``) in one module, one ``NOISE.register(...)`` line here, one YAML in ``configs/noise/``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dp_adam_bench.errors import ConfigError
from dp_adam_bench.privacy.strategies import IdentityStrategy, Strategy, sqrt_prefix_strategy
from dp_adam_bench.registry import Registry


@dataclass(frozen=True)
class NoiseKind:
    """One noise mechanism as the config names it.

    * ``strategy(noise_cfg, steps)`` builds the factorization for a run of ``steps`` steps (None: no noise).
    * ``correlated``: noise correlated across steps (DP-MF); accounted here over cyclic fixed-size batches only.
    * ``int_params``: fields of ``noise.*`` that must be integers >= 1 (e.g. BandMF's ``bands``).
    """

    strategy: Callable[..., Strategy] | None
    correlated: bool = False
    int_params: tuple[str, ...] = ()

    @property
    def private(self) -> bool:
        return self.strategy is not None

    def validate(self, noise_cfg) -> None:
        for name in self.int_params:
            v = noise_cfg.get(name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"noise.{name}={v!r} must be an integer >= 1")


def _bandmf(noise_cfg, steps: int) -> Strategy:
    from dp_adam_bench.privacy.bandmf import BandedToeplitzStrategy, optimize_bandmf

    bands = min(int(noise_cfg.bands), steps)
    return BandedToeplitzStrategy.from_coefficients(optimize_bandmf(steps, bands), steps)


def _blt(noise_cfg, steps: int) -> Strategy:
    from dp_adam_bench.privacy.blt import optimize_blt

    return optimize_blt(steps, buffers=int(noise_cfg.buffers))


NOISE = Registry("noise mechanism", "noise.kind")
NOISE.register("none", NoiseKind(strategy=None))
NOISE.register("independent", NoiseKind(strategy=lambda cfg, steps: IdentityStrategy(steps)))
NOISE.register(
    "dpmf_sqrt", NoiseKind(strategy=lambda cfg, steps: sqrt_prefix_strategy(steps), correlated=True)
)
NOISE.register("bandmf", NoiseKind(strategy=_bandmf, correlated=True, int_params=("bands",)))
NOISE.register("blt", NoiseKind(strategy=_blt, correlated=True, int_params=("buffers",)))


def build_strategy(noise_cfg, steps: int) -> Strategy:
    """The strategy of a private mechanism for a run of ``steps`` steps."""
    kind: NoiseKind = NOISE.get(noise_cfg.kind)
    if kind.strategy is None:
        raise ConfigError(f"noise.kind={noise_cfg.kind!r} adds no noise and has no strategy")
    return kind.strategy(noise_cfg, steps)


# Noise streams get seeds derived from the run seed, far apart from the sampler's and from each other.
_NOISE_SEED_OFFSET = 1_000_003
_STREAM_STRIDE = 7919


def noise_seed(seed: int, stream: int) -> int:
    """The reproducible seed of noise stream ``stream`` (0-based) of a run seeded ``seed``."""
    return seed * _NOISE_SEED_OFFSET + _STREAM_STRIDE * (stream + 1)


def build_mechanisms(strategy: Strategy, shapes, streams: int, seed: int, dtype, device="cpu") -> list:
    """``streams`` independent streaming mechanisms of ``strategy`` for tensors of ``shapes`` (IME uses two)."""
    mechanisms = []
    for stream in range(streams):
        mech = strategy.mechanism()
        mech.reset(shapes, seed=noise_seed(seed, stream), dtype=dtype, device=device)
        mechanisms.append(mech)
    return mechanisms
