import pytest
import torch

from dp_adam_bench.engine.privatizer import Privatizer, per_example_norms
from dp_adam_bench.privacy.mechanisms import IndependentMechanism


def test_clipping_and_division_by_expected_batch_size():
    g = [torch.tensor([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0]]), torch.tensor([[0.0], [0.0], [1.0]])]
    priv = Privatizer(clip=1.0, sigma=0.0, expected_batch_size=10, mechanisms=[])
    mean, norms = priv.clipped_mean(g)
    assert torch.allclose(norms, torch.tensor([5.0, 0.5, 1.0]))
    # example 0 clipped to norm 1, the others unchanged; divided by the expected B = 10, not the realized 3
    assert torch.allclose(mean[0], torch.tensor([0.6 + 0.3, 0.8 + 0.4]) / 10)
    assert torch.allclose(mean[1], torch.tensor([1.0]) / 10)


def test_norms_per_trial():
    g = [torch.arange(12.0).reshape(2, 3, 2)]  # (batch, trials, coords)
    norms = per_example_norms(g, lead_dims=2)
    assert norms.shape == (2, 3)
    assert torch.allclose(norms[1, 2], torch.tensor([10.0, 11.0]).norm())


def test_realized_noise_std_is_sigma_c_over_b():
    d, sigma, clip, B = 50000, 1.3, 0.5, 8
    mech = IndependentMechanism().reset([(d,)], seed=0)
    priv = Privatizer(clip=clip, sigma=sigma, expected_batch_size=B, mechanisms=[mech])
    ctx = priv.release_per_example([torch.zeros(3, d)]).ctx
    assert ctx.noise_std == pytest.approx(sigma * clip / B)
    assert float(ctx.noisy[0].std()) == pytest.approx(sigma * clip / B, rel=0.02)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(clip=1.0, sigma=-0.1, expected_batch_size=1, mechanisms=[]), "sigma"),
        (dict(clip=0.0, sigma=0.0, expected_batch_size=1, mechanisms=[]), "clip"),
        (dict(clip=None, sigma=1.0, expected_batch_size=1, mechanisms=[]), "clip norm"),
        (dict(clip=1.0, sigma=1.0, expected_batch_size=1, mechanisms=[]), "noise stream"),
        (dict(clip=1.0, sigma=float("nan"), expected_batch_size=1, mechanisms=[]), "sigma"),
        (dict(clip=float("inf"), sigma=1.0, expected_batch_size=1, mechanisms=[]), "clip"),
    ],
)
def test_bad_privatizer_settings_fail_clearly(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Privatizer(**kwargs)


def test_single_pass_sampler_keeps_min_separation_across_epochs():
    from dp_adam_bench.engine.sampling import SinglePassSampler

    sampler = SinglePassSampler(20, 4, epochs=3, seed=1)
    batches = list(sampler)
    assert len(batches) == sampler.steps == 15
    where = {}
    for t, b in enumerate(batches):
        for i in b.tolist():
            where.setdefault(i, []).append(t)
    assert all(len(ts) == 3 for ts in where.values())
    assert all(
        min(b - a for a, b in zip(ts, ts[1:], strict=False)) == sampler.min_separation == 5
        for ts in where.values()
    )


def test_poisson_batch_sizes_follow_binomial():
    from dp_adam_bench.engine.sampling import PoissonSampler

    sampler = PoissonSampler(1000, 50, steps=2000, seed=0)
    sizes = torch.tensor([len(b) for b in sampler], dtype=torch.float64)
    assert float(sizes.mean()) == pytest.approx(50, rel=0.02)
    assert float(sizes.var()) == pytest.approx(1000 * 0.05 * 0.95, rel=0.1)
