"""The GLUE accounting table's helper that turns a printed GDP + CLT epsilon into the step count behind it."""

from __future__ import annotations

import pytest

from dp_adam_bench.privacy.accounting import epsilon
from dp_adam_bench.report.li_glue_accounting import gdp_steps_for


@pytest.mark.parametrize("target", [1.73, 4.33])
def test_gdp_steps_for_is_the_first_step_count_that_reaches_the_target(target):
    sigma, q, delta = 0.8221, 1000 / 67349, 1 / (2 * 67349)
    steps = gdp_steps_for(target, sigma, q, delta, start=203)
    assert (
        epsilon(sigma, q, steps, delta, "gdp_clt") >= target > epsilon(sigma, q, steps - 1, delta, "gdp_clt")
    )
