"""Provenance in every summary (dp_adam_bench/tracking/provenance.py): the project's own commit, read from where the
package is (a copy without .git inside another repository is "unknown", not that repository's commit), versions,
device and cores; and a real run's summary.json carries it without changing the run's identity."""

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import dp_adam_bench
from dp_adam_bench.paths import PACKAGE_DIR, REPO_ROOT
from dp_adam_bench.tracking.provenance import device_name, project_commit, provenance
from dp_adam_bench.tracking.run_store import run_id

from helpers import compose_cfg, tiny_poisson

FIELDS = {
    "git_commit",
    "package_version",
    "device",
    "gpu_name",
    "torch_version",
    "cuda_version",
    "cpu_count",
    "torch_threads",
    "python_version",
}
pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _git(folder: Path, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    out = subprocess.run(
        ["git", "-C", str(folder), "-c", "user.name=t", "-c", "user.email=t@t", *args],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    return out.stdout.strip()


def _repo(folder: Path) -> Path:
    folder.mkdir(parents=True)
    _git(folder, "init", "-q")
    (folder / "README").write_text("another project\n")
    _git(folder, "add", "README")
    _git(folder, "commit", "-q", "-m", "first")
    return folder


def _copy_package(dest: Path) -> Path:
    shutil.copytree(PACKAGE_DIR, dest / "dp_adam_bench", ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def _commit_seen_by_copy(holder: Path, cwd: Path) -> str:
    """project_commit() as the copy of the package in ``holder`` reports it, run from ``cwd``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env["PYTHONPATH"] = str(holder)
    code = (
        "import dp_adam_bench, pathlib, sys; from dp_adam_bench.tracking.provenance import project_commit; "
        f"assert pathlib.Path(dp_adam_bench.__file__).resolve().parent.parent == pathlib.Path({str(holder)!r})"
        ".resolve(), dp_adam_bench.__file__; print(project_commit())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


def test_a_copy_without_git_inside_another_repository_is_unknown(tmp_path):
    outer = _repo(tmp_path / "outer")
    copy = _copy_package(outer / "copy")  # untracked, inside outer's work tree; run from outer's root
    assert _git(outer, "rev-parse", "HEAD")  # what the cwd-based reading recorded
    assert _commit_seen_by_copy(copy, cwd=outer) == "unknown"
    lone = _copy_package(tmp_path / "lone")  # no repository at all
    assert _commit_seen_by_copy(lone, cwd=tmp_path) == "unknown"


def test_a_checkout_records_its_head_and_dirty_tracked_files(tmp_path):
    repo = _copy_package(tmp_path / "checkout")
    _git(repo, "init", "-q")
    _git(repo, "add", "dp_adam_bench")
    _git(repo, "commit", "-q", "-m", "the package")
    head = _git(repo, "rev-parse", "HEAD")
    elsewhere = _repo(tmp_path / "elsewhere")  # the working directory's repository is not asked
    assert _commit_seen_by_copy(repo, cwd=elsewhere) == head
    with open(repo / "dp_adam_bench" / "errors.py", "a") as fh:
        fh.write("# edited\n")
    assert _commit_seen_by_copy(repo, cwd=elsewhere) == head + "+dirty"
    # the package committed in a sub-folder of a checkout is not that checkout's project
    nested = _repo(tmp_path / "nested")
    _copy_package(nested / "sub")
    _git(nested, "add", "sub")
    _git(nested, "commit", "-q", "-m", "vendored")
    assert _commit_seen_by_copy(nested / "sub", cwd=nested) == "unknown"


def test_this_checkout_records_its_own_head():
    if not (REPO_ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    commit = project_commit()
    assert commit.removesuffix("+dirty") == _git(REPO_ROOT, "rev-parse", "HEAD")


def test_provenance_fields_on_cpu():
    about = provenance(torch.device("cpu"))
    assert set(about) == FIELDS
    assert about["device"] == "cpu" and about["gpu_name"] is None
    assert about["package_version"] == dp_adam_bench.__version__
    assert about["torch_version"] == torch.__version__ and about["cuda_version"] == torch.version.cuda
    assert about["cpu_count"] == os.cpu_count() and about["torch_threads"] == torch.get_num_threads()
    assert about["python_version"] == platform.python_version()
    assert about["git_commit"] == project_commit()
    assert provenance()["device"] is None  # a caller without a device says so
    assert device_name("cpu") == "cpu"
    if torch.cuda.is_available():
        index = torch.cuda.current_device()
        assert device_name("cuda") == f"cuda:{index}"
        assert provenance("cuda")["gpu_name"] == torch.cuda.get_device_name(index)


def test_a_real_run_summary_carries_every_field_and_keeps_its_run_id(isolated_dirs, monkeypatch):
    from dp_adam_bench.tasks import registry
    from dp_adam_bench.train import train

    monkeypatch.setitem(registry.TASKS, "tiny", "tiny_task:TinyTask")
    summary = train(compose_cfg(tiny_poisson("provenance", 3, "train.device=auto")))
    (folder,) = (isolated_dirs / "runs" / "provenance").iterdir()
    saved = json.loads((folder / "summary.json").read_text())
    assert saved == json.loads(json.dumps(summary))
    about = saved["provenance"]
    assert set(about) == FIELDS
    expected_device = "cuda:0" if torch.cuda.is_available() else "cpu"  # auto
    assert about["device"] == expected_device
    assert (about["gpu_name"] is None) == (expected_device == "cpu")
    assert about["torch_version"] == torch.__version__ and about["cuda_version"] == torch.version.cuda
    assert saved["git_commit"] == about["git_commit"] == project_commit()
    # provenance is in the summary, never in the config: the folder is still named by the config alone
    assert folder.name == run_id(yaml.safe_load((folder / "config.yaml").read_text()))
