"""Privacy accounting without training: epsilon of a DP-SGD schedule under every accountant, sigma calibrated
to a target epsilon, and the epsilon of a correlated-noise (matrix factorization) release.

    python examples/epsilon_and_sigma.py
"""

import dp_adam_bench as dab

# Tang & Lecuyer's CIFAR-10 schedule (arXiv 2304.11208): q = 1024 / 50000, sigma = 1, 3,000 steps
q, steps, delta = 1024 / 50_000, 3_000, 1e-5
print("epsilon per accountant:", {k: round(v, 3) for k, v in dab.epsilons(1.0, q, steps, delta).items()})

# Li et al.'s E2E run (arXiv 2110.05679): sigma for epsilon = 8 over their schedule, under RDP
sigma = dab.calibrate_sigma(8.0, delta, 512 / 42_061, 4_108, "rdp")
print(f"sigma for epsilon = 8: {sigma:.4f}")

# a matrix-factorization release is one Gaussian mechanism: epsilon from sigma and the strategy's sensitivity
print(f"MF epsilon (sigma = 4, sensitivity = 2): {dab.mf_epsilon(4.0, 2.0, delta):.3f}")
