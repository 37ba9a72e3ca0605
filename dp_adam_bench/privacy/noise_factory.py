"""``noise`` config -> strategy for a run of ``steps`` steps."""

from __future__ import annotations

from dp_adam_bench.privacy.strategies import IdentityStrategy, Strategy, sqrt_prefix_strategy


def build_strategy(noise_cfg, steps: int) -> Strategy:
    kind = noise_cfg.kind
    if kind == "independent":
        return IdentityStrategy(steps)
    if kind == "dpmf_sqrt":
        return sqrt_prefix_strategy(steps)
    if kind == "bandmf":
        from dp_adam_bench.privacy.bandmf import BandedToeplitzStrategy, optimize_bandmf

        bands = min(int(noise_cfg.bands), steps)
        return BandedToeplitzStrategy.from_coefficients(optimize_bandmf(steps, bands), steps)
    if kind == "blt":
        from dp_adam_bench.privacy.blt import optimize_blt

        return optimize_blt(steps, buffers=int(noise_cfg.buffers))
    raise ValueError(f"noise.kind={kind!r} has no strategy; valid: independent, dpmf_sqrt, bandmf, blt")


# Noise streams get seeds derived from the run seed, far apart from the sampler's and from each other.
_NOISE_SEED_OFFSET = 1_000_003
_STREAM_STRIDE = 7919


def build_mechanisms(strategy: Strategy, shapes, streams: int, seed: int, dtype, device="cpu") -> list:
    """``streams`` independent streaming mechanisms of ``strategy`` for tensors of ``shapes`` (IME uses two)."""
    mechanisms = []
    for stream in range(streams):
        mech = strategy.mechanism()
        mech.reset(
            shapes, seed=seed * _NOISE_SEED_OFFSET + _STREAM_STRIDE * (stream + 1), dtype=dtype, device=device
        )
        mechanisms.append(mech)
    return mechanisms
