"""The hub is offline unless the user opts in (dp_adam_bench.hub), and a missing data folder fails at once with
the folder and the ``data prepare`` command (it used to cost ~25 s of hub retries)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from dp_adam_bench import hub
from dp_adam_bench.paths import REPO_ROOT

_HUB_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", hub.ONLINE_ENV, hub._MARK_ENV)


def _python(code: str, **env: str) -> tuple[str, float]:
    base = {k: v for k, v in os.environ.items() if k not in _HUB_VARS}
    base["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + base.get("PYTHONPATH", "")
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.strip(), time.monotonic() - t0


SWITCHES = (
    "import huggingface_hub.constants as c, datasets.config as d; print(c.HF_HUB_OFFLINE, d.HF_HUB_OFFLINE)"
)


@pytest.mark.slow
def test_offline_by_default_whether_the_hub_clients_are_imported_before_or_after():
    before, _ = _python(SWITCHES.replace("; print", "; import dp_adam_bench; print"))
    after, _ = _python("import dp_adam_bench; " + SWITCHES)
    assert before == after == "True True"


@pytest.mark.slow
def test_opt_in_and_an_explicit_user_setting_are_respected():
    assert _python("import dp_adam_bench; " + SWITCHES, DP_ADAM_BENCH_ONLINE="1")[0] == "False False"
    assert _python("import dp_adam_bench; " + SWITCHES, HF_HUB_OFFLINE="0")[0] == "False False"
    # an explicit user setting wins over the opt-in too
    assert _python("import dp_adam_bench; " + SWITCHES, HF_HUB_OFFLINE="1", DP_ADAM_BENCH_ONLINE="1")[0] == (
        "True True"
    )


def test_go_online_switches_modules_already_imported():
    out, _ = _python(
        "import dp_adam_bench, huggingface_hub.constants as c, datasets.config as d, os; "
        "from dp_adam_bench import hub; hub.go_online('test'); "
        "print(c.HF_HUB_OFFLINE, d.HF_HUB_OFFLINE, os.environ['HF_HUB_OFFLINE'])"
    )
    assert out == "False False 0"


def test_go_online_refuses_the_users_offline_setting(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv(hub._MARK_ENV, raising=False)
    with pytest.raises(ValueError, match="unset it"):
        hub.go_online("data prepare")


@pytest.mark.slow
def test_a_missing_data_folder_fails_fast_naming_the_folder_and_the_prepare_command(tmp_path):
    code = (
        "from dp_adam_bench.tasks.cifar10_cnn import load_cifar10_described\n"
        "try:\n    load_cifar10_described()\nexcept FileNotFoundError as e:\n    print(e)\n"
    )
    out, seconds = _python(code, DP_ADAM_BENCH_DATA=str(tmp_path / "nodata"))
    assert str(tmp_path / "nodata" / "cifar10" / "cifar10_jpeg_q75.tar.gz") in out
    assert "dp-adam-bench data prepare cifar10_cnn" in out and "DP_ADAM_BENCH_ONLINE=1" in out
    # against the same imports on this machine now: a busy machine (16 xdist workers on a GPU box) took 24 s
    _, imports = _python("import dp_adam_bench.tasks.cifar10_cnn")
    extra = seconds - imports
    assert extra < 10, f"took {extra:.1f} s more than its imports: the hub was retried"  # ~25 s of retries
