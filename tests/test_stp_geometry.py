"""Scale-then-privatize's clipping geometry, for every engine that supports it, against a size-one loop.

Scale-then-privatize (Ganesh et al. Alg. 8) clips s * g_i: the norm that decides each example's clip factor is
||s * g_i||, not ||g_i||. The reference here runs each example alone (a batch of one, plain autograd, no engine),
scales its gradient, takes the norm and clips; every engine that accepts a scale must return the same norms and the
same clipped sum. A scale far from 1 makes the two geometries disagree by far more than the tolerance, so an engine
that took its norms before scaling fails (checked below on a deliberately wrong reference).
"""

from __future__ import annotations

import pytest
import torch

from dp_adam_bench.engine.engines import ENGINES, build_engine

from small_models import fresh_model, loss_per_example, make_batch

CLIP = 25.0  # between the scaled norms of the batch: some examples are clipped, some not


def _scales(model, seed=3):
    g = torch.Generator().manual_seed(seed)
    # per-coordinate scales spanning two orders of magnitude, as stp's 1 / (sqrt(v) + eps) does
    return [10 ** (2 * torch.rand(p.shape, generator=g) - 1) for p in model.parameters() if p.requires_grad]


def _size_one(batch, scale, clip, *, prescale_norms=False, magnitudes=None):
    """(norms ||s g_i||, sum_i clip(s g_i; C)) from one backward per example on a batch of one; ``magnitudes``, a
    list, receives sum_i |clip(s g_i; C)| per parameter (the scale of the sum's terms, for its rounding bound)."""
    model = fresh_model()
    params = [p for p in model.parameters() if p.requires_grad]
    n = next(iter(batch.values())).shape[0]
    norms, summed = [], [torch.zeros_like(p) for p in params]
    mags = [torch.zeros_like(p) for p in params]
    for i in range(n):
        one = {k: v[i : i + 1] for k, v in batch.items()}
        grads = torch.autograd.grad(loss_per_example(model, one).sum(), params)
        scaled = [g * s for g, s in zip(grads, scale, strict=True)]
        norm = torch.sqrt(sum(g.pow(2).sum() for g in (grads if prescale_norms else scaled)))
        factor = min(1.0, clip / float(norm))
        norms.append(norm)
        for acc, mag, g in zip(summed, mags, scaled, strict=True):
            acc.add_(g * factor)
            mag.add_(g.abs() * factor)
    if magnitudes is not None:
        magnitudes.extend(mags)
    return torch.stack(norms), summed


def _stp_engines() -> list[str]:
    names = []
    for name in ENGINES.names():
        eng = build_engine(name, fresh_model(), loss_per_example)
        if eng.supports_scale:
            names.append(name)
        eng.close()
    return names


def test_the_engines_that_support_stp_are_the_documented_ones():
    assert set(_stp_engines()) == {"bk", "hooks", "functorch", "loop"}


@pytest.mark.parametrize("name", ["bk", "hooks", "functorch", "loop"])
def test_scaled_norms_and_clipped_sum_equal_the_size_one_loop(name):
    batch = make_batch(b=7, seed=11)
    eng = build_engine(name, fresh_model(), loss_per_example)
    scale = _scales(fresh_model())
    try:
        out = eng.clipped_sum(batch, CLIP, scale)
    finally:
        eng.close()
    mags = []
    ref_norms, ref_sum = _size_one(batch, scale, CLIP, magnitudes=mags)
    torch.testing.assert_close(out.norms, ref_norms, rtol=1e-4, atol=1e-6)
    # A float32 rounding bound, not atol 1e-6 (terms up to 33 here: the ratio to that atol moved 0.17 -> 0.58 with
    # the vector width and BLAS of the CPU). Each element sums b clipped per-example terms, each the end of a
    # backward whose longest sum has fan_in products (fc1: 52), so it is within (fan_in + b) eps sum_i |f_i s g_i|
    # of exact in any summation order (Higham's gamma_n); measured 4.7-6.8 eps sum_i |f_i s g_i| on AVX-512, AVX2,
    # SSE and 1 or 2 threads. A norm taken before scaling is off by O(1).
    n = max(p[0].numel() for p in fresh_model().parameters() if p.dim() > 1) + len(ref_norms)
    eps = torch.finfo(ref_norms.dtype).eps
    for s, r, mag in zip(out.summed, ref_sum, mags, strict=True):
        worst = float(((s - r).abs() / (eps * mag)).nan_to_num(nan=0.0).max())
        assert bool(((s - r).abs() <= n * eps * mag).all()), f"{name}: {worst:.3g} eps sum |terms|, bound {n}"
    # the batch mixes clipped and unclipped examples in the scaled geometry, so the factor matters
    assert bool((ref_norms > CLIP).any()) and bool((ref_norms < CLIP).any())


def test_norms_taken_before_scaling_would_fail_this_test():
    """The planted bug of scale-then-privatize (clip factors from ||g_i||): its norms and sum differ from the
    scaled geometry's by far more than the tolerance above."""
    batch = make_batch(b=7, seed=11)
    scale = _scales(fresh_model())
    good_norms, good_sum = _size_one(batch, scale, CLIP)
    bad_norms, bad_sum = _size_one(batch, scale, CLIP, prescale_norms=True)
    assert not torch.allclose(good_norms, bad_norms, rtol=1e-2)
    assert not all(torch.allclose(g, b, rtol=1e-2) for g, b in zip(good_sum, bad_sum, strict=True))


def test_the_size_one_loop_without_scale_is_plain_clipping():
    batch = make_batch(b=5, seed=2)
    ones = [torch.ones_like(p) for p in fresh_model().parameters()]
    norms, summed = _size_one(batch, ones, CLIP)
    eng = build_engine("loop", fresh_model(), loss_per_example)
    out = eng.clipped_sum(batch, CLIP)
    torch.testing.assert_close(out.norms, norms, rtol=1e-5, atol=1e-7)
    for s, r in zip(out.summed, summed, strict=True):
        torch.testing.assert_close(s, r, rtol=1e-5, atol=1e-7)
