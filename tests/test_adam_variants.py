"""Adam-family and SGD variants: sigma = 0 and no clipping against torch optimizers bit for bit, the
bias-corrected variants against their formulas, stp with s = 1 against post-processing, and Phi_t."""

import math

import pytest
import torch

from dp_adam_bench.engine.privatizer import Privatizer
from dp_adam_bench.optim.registry import VARIANTS, build_variant
from dp_adam_bench.privacy.mechanisms import IndependentMechanism
from dp_adam_bench.privacy.strategies import sqrt_prefix_strategy

D, B, STEPS = 7, 5, 25


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(STEPS, B, D, generator=g, dtype=torch.float64)
    y = torch.randn(STEPS, B, generator=g, dtype=torch.float64)
    return x, y


def per_example(theta, x, y):
    # least squares: grad of 0.5 (x.theta - y)^2 per example
    return [(x @ theta - y)[:, None] * x]


def run_ours(name, sigma=0.0, clip=None, scale_one=False, mechanisms=None, **hp):
    x, y = data()
    variant = build_variant(name, **hp)
    if scale_one:
        variant.scale = lambda state: [torch.ones(D, dtype=torch.float64)]
    theta = torch.zeros(D, dtype=torch.float64)
    params = [theta]
    state = variant.init(params)
    priv = Privatizer(
        clip=clip,
        sigma=sigma,
        expected_batch_size=B,
        mechanisms=mechanisms or [],
        releases=variant.releases(),
    )
    for t in range(STEPS):
        variant.update(
            params, state, priv.release_per_example(per_example(theta, x[t], y[t]), variant.scale(state)).ctx
        )
    return theta, state


def run_torch(make_opt):
    x, y = data()
    theta = torch.zeros(D, dtype=torch.float64, requires_grad=True)
    opt = make_opt([theta])
    for t in range(STEPS):
        opt.zero_grad()
        theta.grad = per_example(theta.detach(), x[t], y[t])[0].sum(0) / B
        opt.step()
    return theta.detach()


def test_adam_equals_torch_adam_bit_for_bit():
    ours, _ = run_ours("adam", lr=0.05, beta1=0.9, beta2=0.99, eps=1e-8)
    ref = run_torch(lambda p: torch.optim.Adam(p, lr=0.05, betas=(0.9, 0.99), eps=1e-8, foreach=False))
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_sgd_equals_torch_sgd_bit_for_bit(momentum):
    ours, _ = run_ours("sgd", lr=0.1, momentum=momentum)
    ref = run_torch(lambda p: torch.optim.SGD(p, lr=0.1, momentum=momentum, foreach=False))
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("name", ["noiseless_precond", "ime", "ime_free"])
def test_variants_that_only_differ_under_noise_equal_adam_at_sigma0(name):
    kw = {"eps_s": 1e-8} if name.startswith("ime") else {"eps": 1e-8}
    ours, _ = run_ours(name, lr=0.05, **kw)
    ref, _ = run_ours("adam", lr=0.05, eps=1e-8)
    assert torch.allclose(ours, ref, rtol=1e-12, atol=1e-15)


def test_stp_with_unit_scale_is_postprocessing():
    mech = lambda: [IndependentMechanism().reset([(D,)], seed=3, dtype=torch.float64)]  # noqa: E731
    ours, _ = run_ours("stp", sigma=0.8, clip=0.5, scale_one=True, mechanisms=mech(), lr=0.05, eps_s2=1e-8)
    ref, _ = run_ours("adam", sigma=0.8, clip=0.5, mechanisms=mech(), lr=0.05, eps=1e-8)
    assert torch.allclose(ours, ref, rtol=1e-12, atol=1e-15)


def test_adambc_and_bc_follow_their_formula_by_hand():
    # one coordinate, two steps, independent noise of known variance: check m^ / sqrt(max(v^ - Phi, floor))
    sigma, clip, bsz, lr, b1, b2 = 0.5, 1.0, 4, 0.1, 0.9, 0.99
    phi = (sigma * clip / bsz) ** 2
    for name, kw, floor in (("adambc", {"gamma": 1e-9}, 1e-9), ("bc", {"eps_s": 1e-3}, 1e-6)):
        variant = build_variant(name, lr=lr, beta1=b1, beta2=b2, **kw)
        theta = torch.zeros(1, dtype=torch.float64)
        state = variant.init([theta])
        from dp_adam_bench.optim.base import StepContext

        m = v = 0.0
        expected = 0.0
        for t, g in enumerate([0.3, -0.05], start=1):
            ctx = StepContext(
                step=t,
                noisy=[torch.tensor([g], dtype=torch.float64)],
                noise_std=sigma * clip / bsz,
                noise_variance=phi,
                sigma=sigma,
                clip=clip,
                expected_batch_size=bsz,
            )
            variant.update([theta], state, ctx)
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            mh, vh = m / (1 - b1**t), v / (1 - b2**t)
            expected -= lr * mh / math.sqrt(max(vh - phi, floor))
            assert state["phi"] == pytest.approx(phi, rel=1e-12)  # constant for independent noise
            assert theta.item() == pytest.approx(expected, rel=1e-10)


def test_phi_under_dpmf_is_the_exact_bias_of_v_hat():
    # pure noise, zero gradients: E[v^_t] must equal Phi_t; Monte Carlo over many coordinates
    n, d, sigma, clip, bsz = 12, 200_000, 1.0, 1.0, 1
    strat = sqrt_prefix_strategy(n)
    mech = strat.mechanism().reset([(d,)], seed=0, dtype=torch.float64)
    variant = build_variant("adambc", lr=1e-12, beta2=0.9)
    params = [torch.zeros(d, dtype=torch.float64)]
    state = variant.init(params)
    priv = Privatizer(clip=clip, sigma=sigma, expected_batch_size=bsz, mechanisms=[mech])
    for t in range(1, n + 1):
        variant.update(params, state, priv.release_per_example([torch.zeros(1, d, dtype=torch.float64)]).ctx)
        v_hat = state["v"][0] / (1 - 0.9**t)
        assert float(v_hat.mean()) == pytest.approx(state["phi"], rel=0.02)
    assert state["phi"] > 1.2  # correlated noise: larger than the independent-noise bias (sigma C/B)^2 = 1


def test_every_variant_is_registered_with_its_name():
    for name, cls in VARIANTS.items():
        assert cls.name == name
    expected = {
        "sgd",
        "adam",
        "adambc",
        "bc",
        "ime",
        "ime_free",
        "stp",
        "noiseless_precond",
        "stp_noiseless_precond",
        "adagrad_pp",
        "adagrad_ime",
        "adagrad_ime_free",
    }
    assert expected <= set(VARIANTS)


def test_bad_hyperparameters_fail_clearly():
    with pytest.raises(ValueError, match="optimizer.beta2 must be in"):
        build_variant("adam", lr=0.1, beta2=1.0)
    with pytest.raises(ValueError, match="optimizer.gamma must be > 0"):
        build_variant("adambc", lr=0.1, gamma=0.0)
    with pytest.raises(ValueError, match="optimizer.name='adamax' is not a known optimizer variant"):
        build_variant("adamax", lr=0.1)
    with pytest.raises(ValueError, match="optimizer.lr must be > 0"):
        build_variant("sgd", lr=-1)
