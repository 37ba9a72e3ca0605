"""The Hugging Face hub is OFFLINE unless the user opts in: the one place that decides it.

Why: with the hub reachable in principle but no network (a cluster node, a laptop on a train), every
``datasets.load_dataset`` / ``from_pretrained`` of a hub name retries for about 25 s before failing, so a missing
data folder cost that long before its error. Offline, a hub name resolves from the local cache or fails at once.

Rule (:func:`apply_default`, run when ``dp_adam_bench`` is imported, so it covers ``dp-adam-bench train``,
``python -m dp_adam_bench.train``, sweeps, reports and library use alike):

* ``HF_HUB_OFFLINE`` set by the user (to anything) is respected as it is;
* else ``DP_ADAM_BENCH_ONLINE=1`` (or true / yes) leaves the hub online;
* else the hub is made offline: ``HF_HUB_OFFLINE=1`` in the environment (read by huggingface_hub, datasets and
  transformers when they are imported, and inherited by worker processes) and, for modules imported before
  ``dp_adam_bench``, their runtime switches (``huggingface_hub.constants.HF_HUB_OFFLINE``,
  ``datasets.config.HF_HUB_OFFLINE``).

``dp-adam-bench data prepare`` is the command whose point is to download: it goes online with :func:`go_online`
(refused when the user set ``HF_HUB_OFFLINE`` themselves).
"""

from __future__ import annotations

import os
import sys

ONLINE_ENV = "DP_ADAM_BENCH_ONLINE"
OFFLINE_ENV = "HF_HUB_OFFLINE"
# Marks an HF_HUB_OFFLINE that this module set (not the user), so that a child process tells them apart.
_MARK_ENV = "DP_ADAM_BENCH_SET_HF_HUB_OFFLINE"
_TRUE = ("1", "true", "yes", "on")


def _truthy(value: str | None) -> bool:
    return value is not None and value.strip().lower() in _TRUE


def user_offline_setting() -> str | None:
    """The user's own ``HF_HUB_OFFLINE`` (None when unset or set by this module)."""
    if os.environ.get(_MARK_ENV) == "1":
        return None
    return os.environ.get(OFFLINE_ENV)


def online_requested() -> bool:
    """``DP_ADAM_BENCH_ONLINE`` is true."""
    return _truthy(os.environ.get(ONLINE_ENV))


def is_offline() -> bool:
    """Whether hub requests are refused in this process now."""
    return _truthy(os.environ.get(OFFLINE_ENV))


def _sync_loaded_modules(offline: bool) -> None:
    """The runtime switches of hub clients imported before the environment variable changed."""
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:
        constants.HF_HUB_OFFLINE = offline
    config = sys.modules.get("datasets.config")
    if config is not None:
        config.HF_HUB_OFFLINE = offline
        config.HF_DATASETS_OFFLINE = offline


def apply_default() -> bool:
    """Make the hub offline unless the user set ``HF_HUB_OFFLINE`` or ``DP_ADAM_BENCH_ONLINE``; returns whether
    the hub is offline afterwards."""
    user = user_offline_setting()
    if user is not None:
        return _truthy(user)
    if online_requested():
        if os.environ.pop(_MARK_ENV, None) == "1":
            os.environ.pop(OFFLINE_ENV, None)
            _sync_loaded_modules(False)
        return False
    os.environ[OFFLINE_ENV] = "1"
    os.environ[_MARK_ENV] = "1"
    _sync_loaded_modules(True)
    return True


def go_online(why: str) -> None:
    """Let this process reach the hub (``data prepare``); ValueError when the user's ``HF_HUB_OFFLINE`` forbids it."""
    user = user_offline_setting()
    if _truthy(user):
        raise ValueError(
            f"{why} needs the Hugging Face hub, but HF_HUB_OFFLINE={user} is set in your environment: unset it "
            "(or set HF_HUB_OFFLINE=0) to download"
        )
    os.environ[OFFLINE_ENV] = "0"
    os.environ[_MARK_ENV] = "1"
    _sync_loaded_modules(False)


def offline_advice() -> str:
    """Why a hub name did not resolve, and the command that downloads it."""
    if user_offline_setting() is not None:
        reason = f"HF_HUB_OFFLINE={os.environ.get(OFFLINE_ENV)} is set in your environment"
    else:
        reason = f"the hub is offline by default; {ONLINE_ENV}=1 lets runs use it"
    return (
        f"Hub names resolve only from the local cache ({reason}); put them there with: "
        "dp-adam-bench data prepare <task> --profile paper"
    )
