"""Per-example gradient engines against the loop over batches of size one; ghost norms against materialised;
empty batches; the engine registry."""

import pytest
import torch

from dp_adam_bench.engine.engines import ENGINES, build_engine
from dp_adam_bench.engine.grads import clip_factors
from dp_adam_bench.errors import ConfigError

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
    # A float32 rounding bound, not atol 1e-6 (its ratio moved 0.25 -> 0.38 with the CPU's vector width): each
    # gradient is the end of a backward whose longest sum has fan_in products (fc1: 52), within
    # fan_in eps max |g| of the loop's in any summation order (Higham's gamma_n); measured at most 8.5 eps max |g|.
    fan_in = max(p[0].numel() for p in fresh_model().parameters() if p.dim() > 1)
    for g, ref in zip(grads, oracle, strict=True):
        assert torch.allclose(
            g, ref, rtol=0, atol=fan_in * torch.finfo(ref.dtype).eps * float(ref.abs().max())
        )


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
    with pytest.raises(
        ValueError, match=r"scale-then-privatize.*train\.clipping=bk, hooks, functorch or loop"
    ):
        eng.clipped_sum(make_batch(), 1.0, scale)
    eng.close()


def test_unknown_engine_names_the_field_and_every_engine():
    with pytest.raises(
        ConfigError,
        match=r"train\.clipping='fast' is not a known clipping engine; valid: bk, functorch, ghost, hooks, loop$",
    ):
        build_engine("fast", fresh_model(), loss_per_example)


def test_no_engine_is_chosen_for_a_missing_name():
    """No silent default: a missing train.clipping is an error, not some engine."""
    with pytest.raises(ConfigError, match="train.clipping=None"):
        build_engine(None, fresh_model(), loss_per_example)


def test_registry_holds_the_five_engines_by_their_classes():
    from dp_adam_bench.engine.bk import BKEngine
    from dp_adam_bench.engine.grads import FunctorchEngine, GhostEngine, HooksEngine, LoopEngine

    assert ENGINES.field == "train.clipping"
    assert {n: ENGINES.get(n) for n in ENGINES} == {
        "bk": BKEngine,
        "functorch": FunctorchEngine,
        "ghost": GhostEngine,
        "hooks": HooksEngine,
        "loop": LoopEngine,
    }


# --------------------------------------------------------------------------------- empty batches (noise-only steps)


def _empty_batch():
    return {k: v[:0] for k, v in make_batch().items()}


def _no_forward(forward, batch):
    raise AssertionError(f"the loss was evaluated on an empty batch of shape {tuple(batch['x'].shape)}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("stp", [False, True])
@pytest.mark.parametrize("name", ENGINES.names())
def test_empty_batch_is_a_zero_sum_with_no_norms(name, stp, dtype):
    """An empty Poisson batch is a legal DP step (the release is the noise alone): every engine returns zeros of
    each parameter's shape, dtype and device and an empty norms tensor, and never runs the model on 0 examples
    (Opacus' samplers, vmap and the materialised reshape fail there)."""
    model = fresh_model().to(dtype)
    eng = build_engine(name, model, loss_per_example)
    if stp and not eng.supports_scale:
        eng.close()
        pytest.skip(f"{name} refuses a scale (tested above)")
    scale = [torch.rand_like(p) + 0.5 for p in eng.params] if stp else None
    eng.loss_per_example = _no_forward
    out = eng.clipped_sum(_empty_batch(), 0.5, scale)
    eng.close()
    assert out.count == 0
    assert out.norms.shape == (0,) and out.norms.dtype == dtype and out.norms.device == eng.params[0].device
    assert len(out.summed) == len(eng.params) == len(list(model.parameters()))
    for s, p in zip(out.summed, eng.params, strict=True):
        assert s.shape == p.shape and s.dtype == p.dtype and s.device == p.device
        assert not s.requires_grad
        assert torch.equal(s, torch.zeros_like(p))
    assert all(p.grad is None for p in model.parameters())


def test_empty_batch_still_checks_the_scale():
    eng = build_engine("functorch", fresh_model(), loss_per_example)
    with pytest.raises(ValueError, match="one tensor of each trainable parameter's shape"):
        eng.clipped_sum(_empty_batch(), 1.0, [torch.ones(3)])


def test_a_batch_that_is_not_a_dict_of_tensors_is_named():
    eng = build_engine("loop", fresh_model(), loss_per_example)
    with pytest.raises(ValueError, match="dict of tensors with the examples along dim 0"):
        eng.clipped_sum({}, 1.0)
