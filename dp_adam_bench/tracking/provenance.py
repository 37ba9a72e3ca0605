"""What made a result: the project's own commit, its version, the device, torch and CUDA, the machine's cores.

Every run summary (``summary.json``) and every pretraining build's summary records :func:`provenance` under
``provenance``. The commit is read from the package's own location, never from the working directory: a copy of the
project without its ``.git`` that sits inside another repository records ``"unknown"``, not that repository's commit.
"""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import dp_adam_bench
from dp_adam_bench.paths import PACKAGE_DIR

UNKNOWN = "unknown"


def _git(folder: Path, *args: str) -> str | None:
    """``git -C folder args`` stdout (stripped), or None when git is missing or fails."""
    try:
        out = subprocess.run(
            ["git", "-C", str(folder), *args], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def project_commit(package_dir: Path = PACKAGE_DIR) -> str:
    """HEAD of the git checkout that holds the package (``+dirty`` when tracked files differ from it), or
    ``"unknown"`` unless the package folder sits at the top of a checkout that tracks it: ``git rev-parse
    --show-toplevel`` run in the package folder must name the folder holding the package."""
    package_dir = Path(package_dir).resolve()
    holder = package_dir.parent
    top = _git(package_dir, "rev-parse", "--show-toplevel")
    if not top or Path(top).resolve() != holder:
        return UNKNOWN
    tracked = _git(holder, "ls-files", "--", f"{package_dir.name}/__init__.py")
    head = _git(holder, "rev-parse", "--verify", "HEAD")
    if not tracked or not head:  # the package is not part of that checkout, or it has no commit yet
        return UNKNOWN
    dirty = _git(holder, "status", "--porcelain", "--untracked-files=no")
    return head + ("+dirty" if dirty else "")


def device_name(device) -> str | None:
    """``cpu`` or ``cuda:<index>`` (a bare ``cuda`` is the current CUDA device); None when not given."""
    if device is None:
        return None
    import torch

    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return str(device)


def provenance(device=None) -> dict:
    """The project's commit (:func:`project_commit`) and version, the device a run used (``device``: a
    ``torch.device`` or its name; None when the caller has none), the GPU's name on CUDA, torch's version and the CUDA
    version torch was built with (None for a CPU build), the machine's CPU cores and torch's intra-op threads, and
    Python's version."""
    import torch

    name = device_name(device)
    gpu = None
    if name is not None and name.startswith("cuda"):
        gpu = torch.cuda.get_device_name(torch.device(name))
    return {
        "git_commit": project_commit(),
        "package_version": dp_adam_bench.__version__,
        "device": name,
        "gpu_name": gpu,
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python_version": platform.python_version(),
    }
