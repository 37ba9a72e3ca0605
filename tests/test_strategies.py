"""Strategies and streaming noise mechanisms: dense, banded (BandMF) and BLT."""

import copy
import math

import numpy as np
import pytest
import torch

from dp_adam_bench.privacy.bandmf import (
    BandedMechanism,
    BandedToeplitzStrategy,
    _bandmf_loss_and_grad,
    inverse_series,
    optimize_bandmf,
)
from dp_adam_bench.privacy.blt import (
    BLTMechanism,
    BLTStrategy,
    _blt_loss_and_grad,
    blt_inverse_coefficients,
    blt_strategy_coefficients,
    optimize_blt,
    optimize_blt_parameters,
)
from dp_adam_bench.privacy.mechanisms import DenseMechanism
from dp_adam_bench.privacy.sensitivity import brute_force_sensitivity
from dp_adam_bench.privacy.strategies import IdentityStrategy, Strategy, prefix_workload, sqrt_prefix_strategy

SHAPES = [(3,), (2, 2)]


def _stream(mech, steps, shapes=SHAPES, seed=11, dtype=torch.float64):
    mech.reset(shapes, seed=seed, dtype=dtype)
    return [mech.next() for _ in range(steps)]


def _dense_reference(strategy, steps, shapes=SHAPES, seed=11):
    """C^{-1} z for the z the mechanisms draw: same generator, same order (step by step, shape by shape)."""
    gen = torch.Generator().manual_seed(seed)
    zs = [[torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes] for _ in range(steps)]
    c_inv = torch.as_tensor(strategy.inverse_matrix()[:steps, :steps])
    return [
        [sum(c_inv[t, u] * zs[u][k] for u in range(t + 1)) for k in range(len(shapes))] for t in range(steps)
    ]


def _assert_streams_close(a, b, tol=1e-10):
    for step_a, step_b in zip(a, b, strict=True):
        for x, y in zip(step_a, step_b, strict=True):
            torch.testing.assert_close(x, y, rtol=tol, atol=tol)


# --- strategies ---------------------------------------------------------------------------------------------
def test_sqrt_strategy_squares_to_the_workload_up_to_scale():
    n = 12
    strat = sqrt_prefix_strategy(n)
    c = strat.matrix()
    assert strat.max_column_norm() == pytest.approx(1.0)
    scale_sq = prefix_workload(n)[0, 0] / (c @ c)[0, 0]
    np.testing.assert_allclose(scale_sq * (c @ c), prefix_workload(n), atol=1e-12)


@pytest.mark.parametrize(
    "strategy",
    [BandedToeplitzStrategy(40, 5), BLTStrategy(40, buffers=2), sqrt_prefix_strategy(40)],
    ids=["bandmf", "blt", "sqrt"],
)
def test_structured_strategies_agree_with_their_dense_matrices(strategy):
    c, c_inv = strategy.matrix(), strategy.inverse_matrix()
    np.testing.assert_allclose(c @ c_inv, np.eye(strategy.n), atol=1e-10)
    assert np.sqrt(np.max(np.sum(c**2, axis=0))) == pytest.approx(1.0)
    np.testing.assert_allclose(strategy.row_variance(), np.sum(c_inv**2, axis=1), rtol=1e-10)
    assert strategy.prefix_rmse() == pytest.approx(Strategy.prefix_rmse(strategy), rel=1e-10)
    mech = strategy.mechanism()
    assert [mech.variance(t) for t in range(strategy.n)] == pytest.approx(list(strategy.row_variance()))


def test_bandmf_gradient_matches_finite_differences():
    rng = np.random.default_rng(0)
    tail = np.array([0.5, 0.3, 0.2, 0.1]) + 0.01 * rng.standard_normal(4)
    _, grad = _bandmf_loss_and_grad(tail, 30)
    eye = np.eye(4) * 1e-6
    num = [
        (_bandmf_loss_and_grad(tail + e, 30)[0] - _bandmf_loss_and_grad(tail - e, 30)[0]) / 2e-6 for e in eye
    ]
    np.testing.assert_allclose(grad, num, rtol=1e-6)


def test_blt_gradient_matches_finite_differences():
    params = np.array([0.2, 1.5, 3.0, -0.4, -0.2, -0.1])
    for pattern in (np.array([0]), np.array([0, 10, 20])):
        _, grad = _blt_loss_and_grad(params, 40, pattern)
        eye = np.eye(6) * 1e-6
        num = [
            (_blt_loss_and_grad(params + e, 40, pattern)[0] - _blt_loss_and_grad(params - e, 40, pattern)[0])
            / 2e-6
            for e in eye
        ]
        np.testing.assert_allclose(grad, num, rtol=1e-5)


def test_bandmf_limits_identity_and_dense_toeplitz():
    n = 64
    one = BandedToeplitzStrategy(n, 1)
    np.testing.assert_allclose(one.matrix(), np.eye(n))
    assert one.prefix_rmse() == pytest.approx(IdentityStrategy(n).prefix_rmse())
    full = BandedToeplitzStrategy(n, n).prefix_rmse()
    sqrt = sqrt_prefix_strategy(n).prefix_rmse()
    # the sqrt factorization is Toeplitz, so the optimised dense Toeplitz can only match or beat it, by little
    assert full <= sqrt * (1 + 1e-9)
    assert full >= 0.95 * sqrt
    # more bands never hurt
    rmses = [BandedToeplitzStrategy(n, b).prefix_rmse() for b in (1, 2, 4, 8, 16)]
    assert all(a >= b - 1e-12 for a, b in zip(rmses, rmses[1:], strict=False))


def test_bandmf_optimum_is_cached_and_normalised():
    a = optimize_bandmf(200, 16)
    b = optimize_bandmf(200, 16)
    np.testing.assert_array_equal(a, b)
    assert np.linalg.norm(a) == pytest.approx(1.0)
    assert len(optimize_bandmf(10, 50)) == 10  # bands clipped to n


def test_blt_coefficients_and_optimisation():
    theta, omega = np.array([0.3, 0.8, 0.97]), np.array([-0.3, -0.05, -0.004])
    e = blt_inverse_coefficients(theta, omega, 150)
    np.testing.assert_allclose(
        blt_strategy_coefficients(theta, omega, 150), inverse_series(e, 150), atol=1e-13
    )
    n = 128
    rmses = [BLTStrategy(n, buffers=m).prefix_rmse() for m in (1, 2, 3)]
    assert all(a >= b - 1e-9 for a, b in zip(rmses, rmses[1:], strict=False))
    # 3 buffers come within 2 % of the optimal dense Toeplitz (BandMF with b = n)
    assert rmses[-1] <= 1.02 * BandedToeplitzStrategy(n, n).prefix_rmse()
    strat = optimize_blt(n, 2)
    assert isinstance(strat, BLTStrategy) and strat.buffers == 2


def test_blt_multi_participation_strategy_has_exact_sensitivity():
    n, k, sep = 12, 2, 4
    theta, omega = optimize_blt_parameters(n, 2, participations=k, min_separation=sep)
    strat = BLTStrategy(n, theta, omega)
    assert np.all(omega <= 0)
    assert np.all(strat.coefs >= 0) and np.all(np.diff(strat.coefs) <= 1e-15)
    exact = brute_force_sensitivity(strat.matrix(), k, sep)
    assert strat.sensitivity(k, sep) == pytest.approx(exact, rel=1e-10)


# --- mechanisms ---------------------------------------------------------------------------------------------
def test_dense_mechanism_empirical_covariance():
    n, trials = 8, 20000
    strat = sqrt_prefix_strategy(n)
    mech = DenseMechanism(strat.inverse_matrix())
    mech.reset([(trials,)], seed=3, dtype=torch.float64)
    w = torch.stack([mech.next()[0] for _ in range(n)]).numpy()  # (n, trials)
    cov = w @ w.T / trials
    c_inv = strat.inverse_matrix()
    np.testing.assert_allclose(cov, c_inv @ c_inv.T, atol=0.06)


@pytest.mark.parametrize("kind", ["bandmf", "blt"])
def test_streaming_mechanisms_equal_dense_correlated_noise(kind):
    n = 30
    strat = BandedToeplitzStrategy(n, 6) if kind == "bandmf" else BLTStrategy(n, buffers=3)
    streamed = _stream(strat.mechanism(), n)
    _assert_streams_close(streamed, _dense_reference(strat, n))
    _assert_streams_close(streamed, _stream(DenseMechanism(strat.inverse_matrix()), n))


@pytest.mark.parametrize("kind", ["bandmf", "blt", "dense"])
def test_state_dict_round_trip_mid_stream(kind):
    n = 20
    strat = {
        "bandmf": BandedToeplitzStrategy(n, 4),
        "blt": BLTStrategy(n, buffers=2),
        "dense": sqrt_prefix_strategy(n),
    }[kind]
    mech = strat.mechanism()
    mech.reset(SHAPES, seed=5, dtype=torch.float32)
    for _ in range(7):
        mech.next()
    state = copy.deepcopy(mech.state_dict())
    continued = [mech.next() for _ in range(8)]
    resumed_mech = strat.mechanism()
    resumed_mech.load_state_dict(state)
    resumed = [resumed_mech.next() for _ in range(8)]
    for a, b in zip(continued, resumed, strict=True):
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y)


def test_state_dict_rejects_other_coefficients():
    mech = BandedMechanism(np.array([1.0, 0.5]), name="bandmf_b2")
    mech.reset(SHAPES, seed=0)
    state = mech.state_dict()
    other = BandedMechanism(np.array([1.0, 0.4]), name="bandmf_b2")
    with pytest.raises(ValueError, match="coefficients"):
        other.load_state_dict(state)
    blt = BLTMechanism(np.array([0.5]), np.array([-0.2]), name="blt_m1")
    blt.reset(SHAPES, seed=0)
    with pytest.raises(ValueError, match="parameters"):
        BLTMechanism(np.array([0.6]), np.array([-0.2]), name="blt_m1").load_state_dict(blt.state_dict())


def test_streaming_memory_does_not_grow_with_steps():
    bands, buffers, steps = 5, 3, 400
    band = BandedMechanism(np.array([1.0, 0.5, 0.3, 0.2, 0.1]))  # n=None: unbounded stream
    blt = BLTMechanism(np.array([0.2, 0.7, 0.95]), np.array([-0.2, -0.05, -0.01]))
    for mech, per_shape in ((band, bands - 1), (blt, buffers)):
        mech.reset(SHAPES, seed=1)
        for _ in range(steps):
            mech.next()
        bufs = mech.buffers()
        assert len(bufs) == len(SHAPES)
        assert [tuple(b.shape) for b in bufs] == [(per_shape, *s) for s in SHAPES]
        assert sum(b.numel() for b in bufs) == per_shape * sum(math.prod(s) for s in SHAPES)
        state = mech.state_dict()["buffers"]
        tensors = state["ring"] if "ring" in state else state["state"]
        assert sum(t.numel() for t in tensors) == per_shape * sum(math.prod(s) for s in SHAPES)


def test_mechanisms_refuse_steps_beyond_the_strategy():
    mech = BandedToeplitzStrategy(3, 2).mechanism()
    mech.reset(SHAPES, seed=0)
    for _ in range(3):
        mech.next()
    with pytest.raises(RuntimeError, match="covers 3 steps"):
        mech.next()


def test_sqrt_prefix_strategy_is_toeplitz_and_equals_the_dense_construction():
    from dp_adam_bench.privacy.mechanisms import DenseMechanism
    from dp_adam_bench.privacy.strategies import DenseStrategy, ToeplitzStrategy, sqrt_prefix_coefficients
    from dp_adam_bench.privacy.toeplitz import toeplitz_lower

    n = 64
    strat = sqrt_prefix_strategy(n)
    dense = DenseStrategy(toeplitz_lower(sqrt_prefix_coefficients(n)), name="dpmf_sqrt")
    assert isinstance(strat, ToeplitzStrategy) and strat.name == "dpmf_sqrt"
    np.testing.assert_allclose(strat.matrix(), dense.matrix(), atol=1e-14)
    np.testing.assert_allclose(strat.inverse_matrix(), dense.inverse_matrix(), atol=1e-12)
    np.testing.assert_allclose(strat.row_variance(), dense.row_variance(), rtol=1e-12)
    assert strat.prefix_rmse() == pytest.approx(dense.prefix_rmse(), rel=1e-12)
    assert strat.max_column_norm() == pytest.approx(1.0, rel=1e-14)
    for k, sep in [(1, None), (3, 20)]:
        assert strat.sensitivity(participations=k, min_separation=sep) == pytest.approx(
            dense.sensitivity(participations=k, min_separation=sep), rel=1e-12
        )
    mech = strat.mechanism()
    assert isinstance(mech, DenseMechanism) and mech.name == "dpmf_sqrt"
    np.testing.assert_allclose(mech.c_inverse, dense.inverse_matrix(), atol=1e-12)


@pytest.mark.parametrize("kind", ["bandmf", "blt"])
def test_a_loaded_state_is_copied_into_the_buffers_the_mechanism_holds(kind):
    """load_state_dict neither allocates a second set of buffers nor shares storage with the state it was given;
    a state whose buffers have other shapes is refused."""
    strat = BandedToeplitzStrategy(20, 4) if kind == "bandmf" else BLTStrategy(20, buffers=2)
    mech = strat.mechanism()
    mech.reset(SHAPES, seed=5, dtype=torch.float32)
    for _ in range(3):
        mech.next()
    state = mech.state_dict()
    resumed = strat.mechanism()
    resumed.reset(SHAPES, seed=0, dtype=torch.float32)  # as a resumed run's session builds it
    held = [b.data_ptr() for b in resumed.buffers()]
    resumed.load_state_dict(state)
    assert [b.data_ptr() for b in resumed.buffers()] == held
    saved = state["buffers"]["ring" if kind == "bandmf" else "state"]
    assert all(torch.equal(b, s) for b, s in zip(resumed.buffers(), saved, strict=True))
    for s in saved:
        s.add_(1.0)  # the state's tensors are not the mechanism's
    assert not any(torch.equal(b, s) for b, s in zip(resumed.buffers(), saved, strict=True))
    wrong = copy.deepcopy(mech.state_dict())
    wrong["buffers"]["ring" if kind == "bandmf" else "state"][0] = torch.zeros(1)
    with pytest.raises(ValueError, match="buffers have shapes"):
        strat.mechanism().load_state_dict(wrong)
