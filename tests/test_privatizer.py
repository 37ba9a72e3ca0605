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


@pytest.mark.parametrize("keep", ["nothing", "keep_clean", "clean", "square"])
def test_release_sum_noises_in_place_only_what_nobody_reads(keep):
    """release_sum consumes its accumulator; the releases, the clean mean a diagnostic or a variant reads, and the
    mechanism's own draws are those of a release that copies."""
    from dp_adam_bench.optim.base import Releases

    releases = {
        "clean": Releases(clean=True),
        "square": Releases(noise_scale=2**0.5, square_sensitivity=lambda c, b: c * c / b),
    }.get(keep, Releases())
    summed = [torch.randn(3, 4, generator=torch.Generator().manual_seed(0)), torch.arange(5.0)]
    out = {}
    for consume in (True, False):
        mechs = [IndependentMechanism().reset([(3, 4), (5,)], seed=1) for _ in range(releases.streams)]
        priv = Privatizer(
            clip=1.0,
            sigma=0.7,
            expected_batch_size=4,
            mechanisms=mechs,
            releases=releases,
            keep_clean=keep == "keep_clean",
        )
        mine = [s.clone() for s in summed]
        rel = priv.release_sum(mine) if consume else priv.release_mean([s / 4 for s in summed])
        out[consume] = rel, mine
    (fast, mine), (slow, _) = out[True], out[False]
    for a, b in zip(fast.ctx.noisy, slow.ctx.noisy, strict=True):
        assert torch.equal(a, b)
    clean = fast.clean if keep == "keep_clean" else fast.ctx.clean
    if keep in ("keep_clean", "clean"):
        for c, s in zip(clean, summed, strict=True):
            assert torch.equal(c, s / 4)  # not the noised values
    if keep == "square":
        for a, b in zip(fast.ctx.noisy_square, slow.ctx.noisy_square, strict=True):
            assert torch.equal(a, b)
    if keep == "nothing":
        assert all(a is m for a, m in zip(fast.ctx.noisy, mine, strict=True))  # no copy made


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
