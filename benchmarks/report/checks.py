"""The engine-watch benchmark (``bench_checks.py``): its target, the checks of the engine on trained weights within
2 % of the training time (issue 44)."""

from __future__ import annotations

import pandas as pd

from .tables import verdict

WATCH_SHARE_MAX = (
    0.02  # the target: the engine watch's share of training time under the auto schedule
)


def target_rows(checks: pd.DataFrame | None) -> list[tuple[str, str, str, str]]:
    """(target, configuration, measured, verdict): one row per model measured."""
    name = f"engine watch (probe + self-check on trained weights) <= {100 * WATCH_SHARE_MAX:g} % of training time"
    if checks is None or checks.empty:
        return [(name, "results_checks.csv", "", "not measured yet")]
    return [
        (
            name,
            f"{r.model} B = {int(r.batch_size)}, {int(r.run_steps)} steps, bk",
            f"{100 * r.run_share:.2f} % ({int(r.run_checks)} checks of {r.check_s_median:.3g} s, steps of "
            f"{r.step_s_median:.3g} s)",
            verdict(r.run_share, WATCH_SHARE_MAX, "%"),
        )
        for _, r in checks.iterrows()
    ]
