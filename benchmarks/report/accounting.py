"""The accounting benchmark (``bench_accounting.py``): its target, sigma calibration in under a second."""

from __future__ import annotations

import pandas as pd

from .tables import num, verdict

CALIBRATION_MAX_S = 1.0  # the target: sigma calibration, seconds


def target_rows(acc: pd.DataFrame | None) -> list[tuple[str, str, str, str]]:
    """(target, configuration, measured, verdict): the slowest setting of each accountant."""
    name = f"sigma calibration < {CALIBRATION_MAX_S:g} s"
    if acc is None or acc.empty:
        return [(name, "results_accounting.csv", "", "not measured yet")]
    out = []
    for accountant, g in acc.groupby("accountant", sort=False):
        worst = g.loc[g["calibrate_s_median"].idxmax()]
        out.append(
            (
                name,
                f"{accountant} (slowest of {len(g)} settings: {worst.setting})",
                f"{num(worst.calibrate_s_median, 's')} (median)",
                verdict(worst.calibrate_s_median, CALIBRATION_MAX_S, "s", strict=True),
            )
        )
    return out
