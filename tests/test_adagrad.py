"""AdaGrad variants: sigma = 0 oracles against torch.optim.Adagrad and hand-computed steps; noise scales."""

import math

import pytest
import torch
from omegaconf import OmegaConf

from dp_adam_bench.engine.privatizer import Privatizer
from dp_adam_bench.optim.adagrad import square_sensitivity
from dp_adam_bench.optim.registry import build_variant
from dp_adam_bench.privacy.mechanisms import IndependentMechanism
from dp_adam_bench.privacy.strategies import sqrt_prefix_strategy
from dp_adam_bench.tasks.logistic_1d import Logistic1D


def task(trials=5):
    cfg = OmegaConf.create(dict(n_train=300, n_test=100, sparsity=0.9, data_seed=3))
    return Logistic1D(cfg, trials=trials, seed=0)


def run_variant(name, steps=300, sigma=0.0, clip=None, mech=None, **hp):
    t = task()
    variant = build_variant(name, lr=0.5, **hp)
    params = t.init_params()
    state = variant.init(params)
    mechs = []
    if sigma > 0:
        for s in range(variant.releases().streams):
            m = (mech or IndependentMechanism)()
            m = m if not callable(getattr(m, "reset", None)) else m
            mechs.append(m.reset([params[0].shape], seed=10 + s, dtype=torch.float64))
    priv = Privatizer(
        clip=clip,
        sigma=sigma,
        expected_batch_size=1,
        mechanisms=mechs,
        trial_dims=1,
        releases=variant.releases(),
    )
    for i in range(steps):
        ctx = priv.release_per_example(t.per_example_grads(params, torch.tensor([i]))).ctx
        variant.update(params, state, ctx)
    return t, params[0]


def torch_adagrad(steps=300):
    t = task()
    theta = torch.zeros(5, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.Adagrad([theta], lr=0.5, eps=1e-10)
    for i in range(steps):
        opt.zero_grad()
        theta.grad = t.per_example_grads([theta.detach()], torch.tensor([i]))[0].sum(0)
        opt.step()
    return theta.detach()


def test_postprocessing_with_sigma0_no_clip_equals_torch_adagrad_bit_for_bit():
    _, ours = run_variant("adagrad_pp")
    assert torch.equal(ours, torch_adagrad())


@pytest.mark.parametrize("name", ["adagrad_ime", "adagrad_ime_free"])
def test_ime_with_sigma0_floor0_equals_torch_adagrad_bit_for_bit(name):
    _, ours = run_variant(name, floor=0.0, eps=1e-10)
    assert torch.equal(ours, torch_adagrad())


def test_ime_sigma0_follows_its_formula_by_hand():
    # two steps by hand: nu_t = sum g^2, theta -= lr * g / max(1, sqrt(nu))
    t = task(trials=1)
    t.x_train[:2] = torch.tensor([2.0, -1.5], dtype=torch.float64)
    t.y_train[:2] = torch.tensor([1.0, 0.0], dtype=torch.float64)
    variant = build_variant("adagrad_ime", lr=0.5)
    params = t.init_params()
    state = variant.init(params)
    priv = Privatizer(
        clip=None, sigma=0.0, expected_batch_size=1, mechanisms=[], trial_dims=1, releases=variant.releases()
    )
    theta, nu = 0.0, 0.0
    for i in range(2):
        x, y = float(t.x_train[i]), float(t.y_train[i])
        g = (1 / (1 + math.exp(-theta * x)) - y) * x
        nu += g * g
        theta -= 0.5 * g / max(1.0, math.sqrt(nu))
        variant.update(
            params, state, priv.release_per_example(t.per_example_grads(params, torch.tensor([i]))).ctx
        )
        assert params[0].item() == pytest.approx(theta, rel=1e-12)


def test_square_sensitivity_forms():
    assert square_sensitivity(1.0, 1, "derived") == 1.0
    assert square_sensitivity(1.0, 1, "printed") == 3.0
    assert square_sensitivity(2.0, 4, "derived") == pytest.approx(7 * 4 / 16)
    with pytest.raises(ValueError, match="sq_sensitivity"):
        square_sensitivity(1.0, 1, "other")


@pytest.mark.parametrize("name,factor", [("adagrad_ime", math.sqrt(2)), ("adagrad_ime_free", 1.0)])
def test_ime_noise_scales(name, factor):
    # With a zero gradient stream, the first step's update reveals the noise on g (lr * noisy_g / max(1, ...)),
    # and nu after one step is the noise on g^2: std sqrt(2) sigma C/B and sqrt(2) sigma S2 (S2 = 1 at B = 1).
    trials, sigma = 20000, 0.7
    variant = build_variant(name, lr=1.0, floor=1e6)  # huge floor: update = noisy_g / 1e6
    params = [torch.zeros(trials, dtype=torch.float64)]
    state = variant.init(params)
    mechs = [IndependentMechanism().reset([(trials,)], seed=s, dtype=torch.float64) for s in (1, 2)]
    priv = Privatizer(
        clip=1.0,
        sigma=sigma,
        expected_batch_size=1,
        mechanisms=mechs,
        trial_dims=1,
        releases=variant.releases(),
    )
    variant.update(params, state, priv.release_per_example([torch.zeros(1, trials, dtype=torch.float64)]).ctx)
    g_noise = -params[0] * 1e6
    assert float(g_noise.std()) == pytest.approx(factor * sigma, rel=0.03)
    assert float(state["nu"][0].std()) == pytest.approx(factor * sigma * 1.0, rel=0.03)


def test_dpmf_noise_through_privatizer_has_row_variance():
    n, trials, sigma = 6, 40000, 0.5
    strat = sqrt_prefix_strategy(n)
    mech = strat.mechanism().reset([(trials,)], seed=0, dtype=torch.float64)
    priv = Privatizer(clip=2.0, sigma=sigma, expected_batch_size=4, mechanisms=[mech], trial_dims=1)
    for t in range(n):
        ctx = priv.release_per_example([torch.zeros(4, trials, dtype=torch.float64)]).ctx
        expected = (sigma * 2.0 / 4) ** 2 * strat.row_variance()[t]
        assert ctx.noise_variance == pytest.approx(expected)
        assert float(ctx.noisy[0].var()) == pytest.approx(expected, rel=0.04)
