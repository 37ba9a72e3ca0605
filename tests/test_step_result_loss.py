"""``StepResult.loss_nonprivate`` and ``StepResult.q`` (issue 58; dp_adam_bench/engine/session.py).

The loss is the step's own forward's mean loss on the logical batch, checked against the task's loss recomputed
here at the parameters before the step (a full batch, so the batch is known); it is a diagnostic of the private
batch, so the post-processing check stops a run whose logged row shares it under a plain key and lets it through
under ``diag/`` (the labelled diagnostics, excluded by name). q is the plan's sampling rate, B/N for Poisson
sampling and None for single-pass batches."""

from __future__ import annotations

import pytest
import torch

import dp_adam_bench as dab
from dp_adam_bench.engine.post_processing import DIAGNOSTIC_PREFIX, PostProcessingLeak
from dp_adam_bench.engine.session import StepResult

from helpers import CE, compose_cfg, tiny_data, tiny_model


def mean_loss(model, data) -> float:
    """The mean cross-entropy of the whole dataset, computed here (the oracle)."""
    x, y = data.tensors
    with torch.no_grad():
        return float(CE(model(x), y).mean())


@pytest.mark.parametrize("clipping", ["bk", "ghost", "hooks"])
def test_the_loss_is_the_batch_mean_before_the_update(clipping):
    _, data = tiny_data()
    n = len(data)
    model = tiny_model(0)
    private = dab.make_private(
        model, data, CE, sigma=1.0, batch_size=n, epochs=2, sampler="single_pass", lr=0.01, clipping=clipping,
        physical_batch_size=n // 3,  # micro-batches: the mean is over the whole logical batch
    )  # fmt: skip
    for _ in range(2):
        expected = mean_loss(private.model, data)
        result = private.step()
        assert result.batch_size == n
        assert isinstance(result.loss_nonprivate, torch.Tensor) and result.loss_nonprivate.dim() == 0
        assert float(result.loss_nonprivate) == pytest.approx(expected, rel=1e-5)
    assert mean_loss(private.model, data) != pytest.approx(expected, rel=1e-7)  # the update came after it
    assert result.q is None  # single_pass: no sampling rate


@pytest.mark.parametrize("clipping", ["loop", "functorch"])
def test_engines_that_do_not_see_the_losses_give_none(clipping):
    _, data = tiny_data()
    private = dab.make_private(
        tiny_model(0), data, CE, sigma=1.0, batch_size=16, steps=1, lr=0.01, clipping=clipping
    )
    assert private.step().loss_nonprivate is None


def test_q_is_the_poisson_rate_and_the_plan_records_the_same():
    _, data = tiny_data()
    private = dab.make_private(tiny_model(0), data, CE, sigma=1.0, batch_size=16, steps=2, lr=0.01)
    result = private.step()
    assert result.q == pytest.approx(16 / len(data), rel=1e-12)
    assert result.q == private.plan.describe()["sampling_rate"]


def test_a_closed_form_toy_task_has_no_loss():
    from dp_adam_bench.config import validate
    from dp_adam_bench.engine import trainer
    from dp_adam_bench.engine.session import PrivateTraining

    toy = ["task=logistic_1d", "task.n_train=200", "task.n_test=50", "optimizer=sgd", "privacy.sigma=2.0"]
    cfg = compose_cfg(
        [*toy, "noise=independent", "train.sampler=poisson", "train.batch_size=20", "train.steps=3"]
    )
    validate(cfg)
    result = PrivateTraining(trainer.build(cfg)).step()
    assert result.loss_nonprivate is None and result.q == pytest.approx(20 / 200)


def test_the_post_processing_check_passes_with_the_loss_and_stops_a_row_that_shares_it():
    _, data = tiny_data()

    def private():
        return dab.make_private(
            tiny_model(0), data, CE, sigma=1.0, batch_size=16, steps=3, lr=0.01, post_processing_check=1
        )

    # the field present, the row the released quantities: every step checked, none fails
    run = private()
    run.add_emitter("log", lambda r: {"lr": run.variant.lr, "q": r.q})
    while not run.done:
        assert run.step().loss_nonprivate is not None
    assert run.post_check.describe()["checks"] == 3 and run.post_check.describe()["failed"] is None
    # shared as a labelled diagnostic: excluded by name, as every diag/ key
    run = private()
    run.add_emitter(
        "log", lambda r: {"lr": run.variant.lr, f"{DIAGNOSTIC_PREFIX}loss": float(r.loss_nonprivate)}
    )
    while not run.done:
        run.step()
    assert run.post_check.describe()["failed"] is None
    # shared as if it were released: the other private batch's loss differs, and the run stops naming it
    run = private()
    run.add_emitter("log", lambda r: {"lr": run.variant.lr, "loss": float(r.loss_nonprivate)})
    with pytest.raises(PostProcessingLeak, match=r"step 1: log 'loss' differs between two private batches"):
        run.step()


def test_the_loss_is_documented_as_a_diagnostic_that_is_not_released():
    doc = " ".join(StepResult.__doc__.split())
    assert "``loss_nonprivate`` is diagnostic" in doc
    assert "a function of the private batch that the mechanism does not release" in doc
    assert "only under a ``diag/`` key" in doc and "None for closed-form toy tasks" in doc
    assert "nonprivate" in next(f for f in StepResult.__dataclass_fields__ if "loss" in f)
