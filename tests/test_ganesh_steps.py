"""The effective step of each Fig. 3 variant (report/ganesh_steps.py) against the paper's update rules written out
here, on logged second moments made in the test."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from dp_adam_bench.report.ganesh_steps import STEP, effective_steps, order_reading


def _run(opt, col, lr, loss, diag, **opt_kw):
    cfg = {"optimizer": {"name": opt, "lr": lr, **opt_kw}, "noise": {"kind": "independent"}, "col": col}
    rounds = [{"step": 8, **diag}, {"step": 16, **{k: 3 * v for k, v in diag.items()}}]  # mean: 2 x diag
    return SimpleNamespace(config=cfg, summary={"metrics": {"test_loss": loss}}, metrics=lambda: rounds)


def _place(cfg):
    return {"adam": "pp", "bc": "bc", "ime": "ime", "sgd": "sgd"}[cfg["optimizer"]["name"]], cfg["col"]


def _v(med, q1, q3, prefix="diag/v_private_"):
    return {f"{prefix}median": med, f"{prefix}q1": q1, f"{prefix}q3": q3}


def test_each_variants_step_is_its_update_rule_on_a_steady_gradient():
    phi = 2.4e-7
    runs = [
        _run(
            "adam",
            "a",
            3e-4,
            5.7,
            _v(1.2e-7, 1e-7, 1.5e-7) | {"diag/phi": phi / 2, "diag/v_clean_median": 1e-15},
        ),
        _run("bc", "a", 3e-4, 5.6, _v(-1e-8, -4e-8, 3e-8, "diag/v_private_minus_phi_"), eps_s=1e-4),
        _run("ime", "a", 1e-4, 5.65, _v(2e-8, -1e-8, 1e-6), eps_s=1e-4),
        _run("sgd", "a", 0.3, 5.62, {}, momentum=0.9),
    ]
    df = effective_steps(runs, _place).set_index("row")
    # the logged rounds average to 2 x the values above
    assert df.loc["pp", STEP] == pytest.approx(3e-4 / (math.sqrt(2.4e-7) + 1e-8))
    assert df.loc["pp", "median clean v / Phi"] == pytest.approx(2e-15 / phi)
    assert df.loc["bc", STEP] == pytest.approx(3e-4 / 1e-4)  # v^ - Phi < eps_s^2: the floor
    assert df.loc["bc", "at q3 of v^"] == pytest.approx(3e-4 / math.sqrt(6e-8))
    assert df.loc["ime", "at q1 of v^"] == pytest.approx(1e-4 / 1e-4)  # v^ < 0: sqrt(max(v^, 0)) = 0
    assert df.loc["ime", "at q3 of v^"] == pytest.approx(1e-4 / (math.sqrt(2e-6) + 1e-4))
    assert df.loc["sgd", STEP] == pytest.approx(3.0) and df.loc["sgd", "at q1 of v^"] == pytest.approx(3.0)
    text = order_reading(df.reset_index(), ["a"])
    # steps bc 3, ime 0.33, pp 0.61, sgd 3 -> ranks (3.5, 1, 2, 3.5); losses 5.6, 5.65, 5.7, 5.62 -> (1, 3, 4, 2)
    assert "the variants within a column: a rho -0.74" in text
    # ime's step: 1.0 at q1 (v^ < 0) against 0.066 at q3; bc's 3 / 1.9 and pp's ~1.1 stay below 10
    assert "Not uniform across coordinates (q1 / q3 step > 10): ime, so" in text
    assert "one variant across the columns" not in text  # one column: no row to rank


def test_order_reading_ranks_one_variant_across_the_columns_and_needs_three_cells():
    runs = [
        _run("adam", c, 3e-4, loss, _v(v, v, v) | {"diag/phi": 1.0, "diag/v_clean_median": 1e-8})
        for c, v, loss in (("low", 6e-8, 5.63), ("bandmf", 6e-7, 5.81), ("high", 2.4e-7, 5.75))
    ]
    df = effective_steps(runs, _place)
    text = order_reading(df, ["low", "bandmf", "high"])
    assert "one variant across the columns (step -> loss): pp rho -1.00" in text
    assert "the median clean v is 1e-08 of Phi or less" in text
    assert order_reading(df.iloc[:2], ["low", "bandmf", "high"]) is None
