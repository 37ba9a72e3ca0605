"""Per-example gradient engines against the loop over batches of size one; ghost norms against materialised."""

import pytest
import torch

from dp_adam_bench.engine.grads import build_engine, clip_factors

from small_models import fresh_model, loss_per_example, make_batch


@pytest.fixture(scope="module")
def oracle():
    model = fresh_model()
    eng = build_engine("loop", model, loss_per_example)
    return eng.per_example_grads(make_batch())


@pytest.mark.parametrize("name", ["hooks", "functorch"])
def test_materialised_per_example_grads_match_loop(name, oracle):
    eng = build_engine(name, fresh_model(), loss_per_example)
    grads = eng.per_example_grads(make_batch())
    eng.close()
    for g, ref in zip(grads, oracle, strict=True):
        assert torch.allclose(g, ref, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", ["hooks", "functorch", "ghost"])
@pytest.mark.parametrize("clip", [None, 0.5])
def test_clipped_sums_and_norms_match_loop(name, clip, oracle):
    b = oracle[0].shape[0]
    ref_norms = torch.sqrt(sum(g.reshape(b, -1).pow(2).sum(1) for g in oracle))
    f = clip_factors(ref_norms, clip)
    ref_sum = [torch.einsum("b,b...->...", f, g) for g in oracle]
    eng = build_engine(name, fresh_model(), loss_per_example)
    out = eng.clipped_sum(make_batch(), clip)
    eng.close()
    assert torch.allclose(out.norms, ref_norms, rtol=1e-4)
    for s, ref in zip(out.summed, ref_sum, strict=True):
        assert torch.allclose(s, ref, atol=1e-5, rtol=1e-4)
    if clip is not None:
        assert bool((ref_norms > clip).any())  # the test really clips something


def test_scaled_clipping_with_materialised_engine():
    oracle_eng = build_engine("loop", fresh_model(), loss_per_example)
    scale = [torch.rand_like(p) + 0.5 for p in oracle_eng.params]
    ref = oracle_eng.clipped_sum(make_batch(), 0.3, scale)
    eng = build_engine("functorch", fresh_model(), loss_per_example)
    out = eng.clipped_sum(make_batch(), 0.3, scale)
    for s, r in zip(out.summed, ref.summed, strict=True):
        assert torch.allclose(s, r, atol=1e-5, rtol=1e-4)


def test_ghost_refuses_scale_then_privatize_with_a_clear_message():
    eng = build_engine("ghost", fresh_model(), loss_per_example)
    scale = [torch.ones_like(p) for p in eng.params]
    with pytest.raises(ValueError, match="scale-then-privatize.*engine=hooks or engine=functorch"):
        eng.clipped_sum(make_batch(), 1.0, scale)
    eng.close()


def test_unknown_engine():
    with pytest.raises(
        ValueError, match="unknown clipping engine 'fast'; valid: loop, hooks, functorch, ghost"
    ):
        build_engine("fast", fresh_model(), loss_per_example)
