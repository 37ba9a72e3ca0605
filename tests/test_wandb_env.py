"""The standard W&B environment variables win over our defaults (a value set in the config wins over both)."""

from __future__ import annotations

import pytest

from dp_adam_bench.tracking.wandb_logger import resolve_settings
from dp_adam_bench.train import train

from helpers import compose_cfg

W_VARS = ("WANDB_MODE", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_DIR", "WANDB_API_KEY", "WANDB_DISABLED")


@pytest.fixture
def clean_wandb_env(monkeypatch):
    for v in W_VARS:
        monkeypatch.delenv(v, raising=False)
    return monkeypatch


def test_defaults_without_environment(clean_wandb_env):
    s = resolve_settings(mode=None, project=None, entity=None, run_dir="/runs/r1")
    assert s == {"mode": "offline", "project": "dp-adam-bench", "entity": None, "dir": "/runs/r1"}
    clean_wandb_env.setenv("WANDB_API_KEY", "k" * 40)
    assert resolve_settings(mode=None, project=None, entity=None, run_dir="r")["mode"] == "online"


def test_environment_wins_over_our_defaults(clean_wandb_env):
    env = {
        "WANDB_MODE": "disabled",
        "WANDB_PROJECT": "p",
        "WANDB_ENTITY": "e",
        "WANDB_DIR": "/w",
        "WANDB_API_KEY": "k",
    }
    for k, v in env.items():
        clean_wandb_env.setenv(k, v)
    s = resolve_settings(mode=None, project=None, entity=None, run_dir="/runs/r1")
    assert s == {"mode": "disabled", "project": "p", "entity": "e", "dir": "/w"}
    # values set in the config are the user's choice: they win
    s = resolve_settings(mode="offline", project="mine", entity="me", run_dir="/runs/r1")
    assert (s["mode"], s["project"], s["entity"]) == ("offline", "mine", "me")


def test_wandb_disabled_and_old_mode_names(clean_wandb_env):
    clean_wandb_env.setenv("WANDB_DISABLED", "true")
    assert resolve_settings(mode=None, project=None, entity=None, run_dir="r")["mode"] == "disabled"
    clean_wandb_env.setenv("WANDB_MODE", "dryrun")
    assert resolve_settings(mode=None, project=None, entity=None, run_dir="r")["mode"] == "offline"
    clean_wandb_env.setenv("WANDB_MODE", "sometimes")
    with pytest.raises(ValueError, match="WANDB_MODE='sometimes'.*offline, online, disabled"):
        resolve_settings(mode=None, project=None, entity=None, run_dir="r")


def test_a_run_with_wandb_mode_disabled_in_the_environment_writes_no_wandb_folder(
    isolated_dirs, clean_wandb_env
):
    # was: logger.wandb.mode null ignored WANDB_MODE=disabled and wrote wandb/offline-run-*
    clean_wandb_env.setenv("WANDB_MODE", "disabled")
    cfg = compose_cfg(
        [
            "task=logistic_1d",
            "task.n_train=50",
            "task.n_test=100",
            "task.trials=2",
            "optimizer=sgd",
            "noise=none",
            "train.batch_size=10",
            "experiment_name=wandb_env",
        ]
    )
    assert cfg.logger.wandb.mode is None
    summary = train(cfg)
    assert summary["status"] == "complete"
    runs = isolated_dirs / "runs" / "wandb_env"
    assert [p for p in runs.iterdir() if p.is_dir()], "no run folder"
    assert not list(runs.rglob("wandb")) and not list(runs.rglob("offline-run-*"))
