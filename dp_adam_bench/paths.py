"""Where things live: the repository, its configs, the results folder, the run store and the offline data."""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_ROOT = PACKAGE_DIR.parent
CONFIG_DIR = REPO_ROOT / "configs"
PAPER_DIR = CONFIG_DIR / "paper"


def results_dir() -> Path:
    """Generated tables and figures (``DP_ADAM_BENCH_RESULTS`` overrides, e.g. in tests)."""
    return Path(os.environ.get("DP_ADAM_BENCH_RESULTS", REPO_ROOT / "results"))


def runs_dir() -> Path:
    """The run store: one folder per run (``DP_ADAM_BENCH_RUNS`` overrides)."""
    return Path(os.environ.get("DP_ADAM_BENCH_RUNS", REPO_ROOT / "runs"))


def shared_data_dir() -> Path:
    """The offline data folder (``DP_ADAM_BENCH_DATA`` overrides; default ``../shared/data`` beside the checkout)."""
    return Path(os.environ.get("DP_ADAM_BENCH_DATA", REPO_ROOT.parent / "shared" / "data"))


def cache_dir() -> Path:
    """Built artefacts that runs read: pretrained models, cached features (``DP_ADAM_BENCH_CACHE`` overrides;
    default ``.cache/`` in the repository)."""
    return Path(os.environ.get("DP_ADAM_BENCH_CACHE", REPO_ROOT / ".cache"))
