"""The oracle of the engine tests: per-example gradients from the loop over batches of size one
(:func:`dp_adam_bench.engine.grads.loop_grads`), their norms, and the sum clipped to C (Abadi et al. 2016,
arXiv:1607.00133, Algorithm 1: g_i * min(1, C / ||g_i||))."""

from __future__ import annotations

import torch

from dp_adam_bench.engine.grads import loop_grads


def loop_reference(model, loss, params, batch, clip: float, scale=None):
    """(per-example norms (B,), clipped sums, one per parameter) from the loop; ``scale``: a per-parameter factor
    applied to each example's gradient first (an engine's ``scale`` argument)."""
    per_ex = loop_grads(model, loss, params, batch)
    if scale is not None:
        per_ex = [g * s for g, s in zip(per_ex, scale, strict=True)]
    b = per_ex[0].shape[0]
    norms = torch.sqrt(sum(g.reshape(b, -1).square().sum(1) for g in per_ex))
    f = clip / norms.clamp(min=clip)
    return norms, [torch.einsum("b,b...->...", f, g) for g in per_ex]


def assert_matches_loop(got, model, loss, params, batch, clip: float, *, rtol=1e-10, atol=1e-14):
    """An engine's ``clipped_sum`` result ``got`` (norms, summed) against :func:`loop_reference`, in float64
    tolerances by default; returns the loop's norms."""
    norms, summed = loop_reference(model, loss, params, batch, clip)
    torch.testing.assert_close(got.norms, norms, rtol=rtol, atol=0)
    for s, want in zip(got.summed, summed, strict=True):
        torch.testing.assert_close(s, want, rtol=rtol, atol=atol)
    return norms
