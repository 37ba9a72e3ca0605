"""Tang & Lecuyer Fig. 3 ablations on cifar10: see :mod:`dp_adam_bench.report.tang_fig3`."""

from dp_adam_bench.report.tang_fig3 import build_for


def build(profile: str = "cpu") -> list:
    return build_for("cifar10", profile)
