"""Report CSVs keep 10 significant digits, so machine-level noise (FFT accountants, BLAS) does not change them."""

from __future__ import annotations

import math

import pandas as pd

from dp_adam_bench.report.common import CSV_SIGNIFICANT_DIGITS, round_significant, write_csv


def test_noise_in_the_15th_digit_writes_the_same_bytes(tmp_path):
    values = [
        2.9999994998731925,
        149.09269485026581,
        2.384185791015625e-07,
        0.012172796652480921,
        -5.00126807e-07,
    ]
    a = pd.DataFrame(
        {"row": ["a", "b", "c", "d", "e"], "ours": values, "mixed": [549, 1.5, None, "x", float("nan")]}
    )
    b = a.copy()
    b["ours"] = [v * (1 + 3e-15) for v in values]
    write_csv(a, tmp_path / "a.csv")
    write_csv(b, tmp_path / "b.csv")
    assert (tmp_path / "a.csv").read_bytes() == (tmp_path / "b.csv").read_bytes()
    back = pd.read_csv(tmp_path / "a.csv")
    for x, y in zip(values, back["ours"], strict=True):
        assert math.isclose(x, y, rel_tol=10.0 ** (1 - CSV_SIGNIFICANT_DIGITS))
    text = (tmp_path / "a.csv").read_text()
    assert ",549\n" in text and "549.0" not in text  # an int in a mixed column stays an int
    assert "2.999999500" not in text and "2.9999995" in text


def test_round_significant_leaves_non_finite_and_non_floats():
    assert round_significant(float("inf")) == float("inf")
    assert math.isnan(round_significant(float("nan")))
    assert round_significant(7) == 7 and round_significant("1.23456789012345") == "1.23456789012345"
    assert round_significant(0.0) == 0.0
    assert round_significant(1.23456789012345) == 1.234567890
