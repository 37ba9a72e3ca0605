"""The ``clipped_sum`` check (exact, fine-tuning rows): at every step, the clipped sum the engine handed the
privatizer equals the meter's own, sum_{i in batch_t} clip(s_t g_i; C) with each g_i from the oracle (autograd on that
example alone, oracle.py), to the rounding of float32. It sees an engine (or a method's layer) that clips or sums
wrong at any step, on the trainable tensors the method opened, before any noise; it needs no statistics (no power to
state: every step is compared). It cannot see what is added after the privatizer's input (the noise checks) or
what leaves the step outside the release (post_processing)."""

from __future__ import annotations

import math

import torch

from dp_adam_bench.audit.meter.result import MeterCheck

#: float32 roundings allowed per clipped example on each coordinate: the engine and the oracle each compute a
#: per-example gradient in float32 (a product of a few factors, a sum over at most a few dozen positions) and its
#: norm, then scale it to norm <= C: a relative error of a few tens of eps on a contribution of size <= C
ROUNDINGS = 64


def tolerance(examples: int, clip: float) -> float:
    """The largest difference of one coordinate of two float32 computations of a sum of ``examples`` clipped
    gradients, each of norm <= ``clip``: ``examples`` x C x ROUNDINGS x eps(float32)."""
    return max(1, int(examples)) * float(clip) * ROUNDINGS * float(torch.finfo(torch.float32).eps)


def clipped_sum_check(engine_sums, oracle_sums, batch_sizes, clip: float) -> MeterCheck:
    """``engine_sums`` and ``oracle_sums``: per step, the flattened clipped sums (float64); ``batch_sizes``: the
    examples of each step. The largest difference over its step's tolerance decides."""
    worst, worst_step, failed = 0.0, None, []
    for t, (got, want, b) in enumerate(zip(engine_sums, oracle_sums, batch_sizes, strict=True), start=1):
        diff = float((got - want).abs().max()) if got.numel() else 0.0
        if not math.isfinite(diff):
            diff = math.inf
        ratio = diff / tolerance(b, clip)
        if ratio > worst:
            worst, worst_step = ratio, t
        if ratio > 1:
            failed.append(t)
    detail = (
        f"{len(engine_sums)} steps, the engine's clipped sum within float32 rounding of the oracle's"
        if not failed
        else f"the engine's clipped sum differs from the oracle's (autograd per example) at {len(failed)} of "
        f"{len(engine_sums)} steps, first {failed[0]}, worst step {worst_step}"
    )
    return MeterCheck(
        "clipped_sum", "g", worst, 1.0, None, not failed, None, detail + " (largest diff / tolerance)"
    )
