import os

import pytest

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture
def isolated_dirs(tmp_path, monkeypatch):
    """Run store and results in a temporary folder."""
    monkeypatch.setenv("DP_ADAM_BENCH_RUNS", str(tmp_path / "runs"))
    monkeypatch.setenv("DP_ADAM_BENCH_RESULTS", str(tmp_path / "results"))
    return tmp_path
