"""Tang & Lecuyer Fig. 1 (left), CIFAR-10 with CNN5: see :mod:`dp_adam_bench.report.tang_fig1`."""

from dp_adam_bench.report.tang_fig1 import build_for


def build(profile: str = "cpu") -> list:
    return build_for("cifar10", profile)
