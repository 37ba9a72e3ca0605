"""Shared test helpers: compose a config the way the CLI does."""

from __future__ import annotations

from hydra import compose, initialize_config_dir

from dp_adam_bench.paths import CONFIG_DIR

TINY_1D = ["task.n_train=60", "task.n_test=500", "task.trials=3", "train.log_every=20"]


def compose_cfg(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose("config", overrides=overrides)
