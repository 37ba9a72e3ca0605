"""Tang & Lecuyer Fig. 1 (right), SNLI with a BERT-family encoder: see :mod:`dp_adam_bench.report.tang_fig1`."""

from dp_adam_bench.report.tang_fig1 import build_for


def build(profile: str = "cpu") -> list:
    return build_for("snli", profile)
