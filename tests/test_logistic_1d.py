import numpy as np
import torch
from omegaconf import OmegaConf

from dp_adam_bench.tasks.logistic_1d import Logistic1D, binary_entropy, population_ground_truth_loss


def make(n_train=1000, n_test=10000, trials=4, sparsity=0.9):
    cfg = OmegaConf.create(dict(n_train=n_train, n_test=n_test, sparsity=sparsity, data_seed=0))
    return Logistic1D(cfg, trials=trials, seed=0)


def test_population_ground_truth_matches_monte_carlo():
    # E_x[H(sigmoid(x))], x ~ N(0,1): quadrature vs a large Monte-Carlo sample, and the value quoted in the issue
    pop = population_ground_truth_loss()
    x = np.random.default_rng(1).standard_normal(2_000_000)
    h = binary_entropy(1 / (1 + np.exp(-x)))
    assert abs(pop - h.mean()) < 4 * h.std() / np.sqrt(x.size)
    assert abs(pop - 0.5994) < 5e-5


def test_ground_truth_test_loss_is_within_monte_carlo_error():
    task = make()
    # the test loss of theta=1 is an average of 10,000 i.i.d. cross-entropies with std about 0.25
    assert abs(task.ground_truth_loss() - population_ground_truth_loss()) < 4 * 0.3 / np.sqrt(10000)


def test_training_inputs_are_sparsified_test_inputs_are_not():
    task = make()
    assert float((task.x_train == 0).double().mean()) == 0.9
    assert float((task.x_test == 0).double().mean()) == 0.0


def test_per_example_gradients_match_autograd():
    task = make(n_train=20, n_test=10, trials=3, sparsity=0.0)
    theta = torch.tensor([0.3, -1.0, 2.0], dtype=torch.float64)
    idx = torch.arange(5)
    grads = task.per_example_grads([theta], idx)[0]
    for i in range(5):
        for k in range(3):
            th = theta[k].clone().requires_grad_(True)
            z = th * task.x_train[i]
            loss = torch.nn.functional.softplus(z) - task.y_train[i] * z
            (g,) = torch.autograd.grad(loss, th)
            assert torch.allclose(grads[i, k], g)
