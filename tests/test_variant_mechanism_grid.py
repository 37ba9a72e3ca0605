"""Every optimizer variant composes with every noise mechanism on a model task (SPEC §1: 'all must compose with
every noise mechanism'), through the real trainer, with a finite result and an accounted ledger."""

import math

import pytest

from dp_adam_bench.optim.registry import VARIANTS
from dp_adam_bench.tasks import registry
from dp_adam_bench.train import train

from helpers import compose_cfg

MODEL_VARIANTS = sorted(v for v in VARIANTS if not v.startswith("adagrad"))
MECHANISMS = ["independent", "dpmf_sqrt", "bandmf", "blt"]


@pytest.fixture(autouse=True)
def tiny_task(monkeypatch):
    monkeypatch.setitem(registry.TASKS, "tiny", "tiny_task:TinyTask")


@pytest.mark.parametrize("noise", MECHANISMS)
@pytest.mark.parametrize("variant", MODEL_VARIANTS)
def test_variant_runs_under_mechanism(isolated_dirs, variant, noise):
    overrides = [
        "task.name=tiny",
        "experiment_name=grid",
        f"optimizer={variant}",
        f"noise={noise}",
        "privacy.sigma=1.0",
        "privacy.clip=1.0",
        "train.sampler=single_pass",
        "train.batch_size=16",
        "train.epochs=2",
        "train.clipping=hooks",
        "logger.wandb.mode=disabled",
        "train.side_info.public_examples=8",
        "train.side_info.batch_size=4",
    ]
    if noise == "bandmf":
        overrides.append("noise.bands=2")  # <= steps per epoch, so the sensitivity is exact
    s = train(compose_cfg(overrides))
    assert s["steps"] == (64 - (8 if variant == "side_info" else 0)) // 16 * 2
    assert math.isfinite(s["metrics"]["test_loss"])
    (event,) = s["ledger"]["events"]
    assert event["kind"] == "gaussian" and event["mu"] > 0
    assert s["epsilon"]["pld"] > 0


def test_model_task_batch_larger_than_dataset_is_refused(isolated_dirs):
    base = [
        "task.name=tiny",
        "experiment_name=grid",
        "optimizer=adam",
        "noise=independent",
        "privacy.sigma=1.0",
    ]
    with pytest.raises(
        ValueError, match=r"train.batch_size=100 is larger than the training set \(64 examples\)"
    ):
        train(compose_cfg([*base, "train.batch_size=100", "logger.wandb.mode=disabled"]))
    with pytest.raises(
        ValueError,
        match=r"train.batch_size=100 \(expected batch size\) is larger than the training set \(64 examples\)",
    ):
        poisson = [
            "train.sampler=poisson",
            "train.steps=2",
            "train.batch_size=100",
            "logger.wandb.mode=disabled",
        ]
        train(compose_cfg([*base, *poisson]))
