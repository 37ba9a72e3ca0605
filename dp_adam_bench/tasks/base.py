"""The interface of a model task (CIFAR-10 CNN, language tasks): what the DP engine needs and nothing more.

A task knows data loading, the model builder, the per-example loss and the metrics; it knows nothing of privacy
(``docs/design.md``, "the one pipeline"). The engine asks it for:

* ``dataset_size`` — N, the number of training examples (the sampler's population);
* ``build_model()`` — a fresh ``nn.Module`` (deterministic given ``torch.manual_seed``);
* ``get_batch(indices)`` — a dict of tensors for those training examples (CPU), leading dim = len(indices);
* ``loss_per_example(forward, batch)`` — a tensor of shape (len(batch),), one loss per example, where
  ``forward(**inputs)`` runs the model (the engine passes the module itself, an Opacus wrapper, or a
  ``torch.func.functional_call`` closure for vmap — so the task must call the model only through ``forward``);
* ``evaluate(model)`` — a dict of float metrics on the held-out set (e.g. ``test_accuracy``, ``test_loss``).

A per-example loss must depend on that example only (no batch statistics such as BatchNorm): otherwise
per-example gradients and the privacy analysis are wrong.

Optional, for a task that keeps random state of its own which training draws from (cifar10_cnn's augmentation
generator): ``rng_state()`` returns it as ``{name: uint8 tensor}`` (``torch.Generator.get_state()``), and
``load_rng_state(state)`` restores it from that dict. The checkpoint saves it beside the engine's generators
(:meth:`~dp_adam_bench.engine.session.PrivateTraining.state_dict`), so that a killed and resumed run continues
exactly as the uninterrupted one; after a resume each tensor's digest is compared with the one saved. A task
whose randomness is a function of fixed seeds only (a data subset drawn at construction, arxiv_mlm's per-row
masks) needs neither. The global torch RNG (dropout) is checkpointed by the engine.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn


class ModelTask(ABC):
    name: str = "task"
    trial_dims: int = 0

    @property
    @abstractmethod
    def dataset_size(self) -> int: ...

    @abstractmethod
    def build_model(self) -> nn.Module: ...

    @abstractmethod
    def get_batch(self, indices: torch.Tensor) -> dict[str, torch.Tensor]: ...

    @abstractmethod
    def loss_per_example(
        self, forward: Callable[..., torch.Tensor], batch: dict[str, torch.Tensor]
    ) -> torch.Tensor: ...

    @abstractmethod
    def evaluate(self, model: nn.Module) -> dict[str, float]: ...


class LabelledTask(ModelTask):
    """A model task whose training and evaluation labels are the tensors ``y_train`` and ``y_test``: its sizes are
    theirs."""

    y_train: torch.Tensor
    y_test: torch.Tensor

    @property
    def dataset_size(self) -> int:
        return int(self.y_train.shape[0])

    @property
    def test_size(self) -> int:
        return int(self.y_test.shape[0])


def count_field(k, what: str, n: int) -> int:
    """``task.<what>`` as an integer in [1, n], or a ValueError naming the field (NaN, 2.5, "abc" and true included)."""
    if isinstance(k, bool) or not isinstance(k, (int, float, np.integer)) or not float(k).is_integer():
        raise ValueError(f"task.{what} must be an integer in [1, {n}] or null, got {k!r}")
    k = int(k)
    if not 1 <= k <= n:
        raise ValueError(f"task.{what} must be in [1, {n}] or null, got {k}")
    return k


def subset_indices(n: int, k, rng: np.random.Generator, what: str) -> np.ndarray | None:
    """``k`` of ``n`` indices without replacement (sorted), or None for ``k`` null."""
    if k is None:
        return None
    k = count_field(k, what, n)
    return np.sort(rng.choice(n, size=k, replace=False))


def try_hub(source: str, hf_name: str, load: Callable[[], Any], tried: list[str]) -> Any | None:
    """``load()`` from the Hugging Face hub. With ``source=hf`` a failure propagates; with ``auto`` (the last
    resort after local folders) it is recorded in ``tried`` and None is returned."""
    try:
        return load()
    except Exception as e:  # noqa: BLE001 - offline, missing package, unknown name: all mean "not from the hub"
        if source == "hf":
            raise
        from dp_adam_bench import hub

        offline = " (the hub is offline: only the local cache is read, see below)" if hub.is_offline() else ""
        tried.append(
            f"Hugging Face hub: datasets.load_dataset({hf_name!r}) failed ({type(e).__name__}: {e}){offline}"
        )
        return None


def missing_data(
    what: str, source: str, tried: list[str], how: str, *, task: str | None = None, profile: str = "cpu"
) -> FileNotFoundError:
    """The error for data found nowhere: every place tried, how to provide it, and the ``data prepare`` command of
    ``task`` that downloads it (offline hub: said why)."""
    from dp_adam_bench import hub

    prepare = ""
    if task is not None:
        prepare = f"\nDownload it with: dp-adam-bench data prepare {task}"
        prepare += " --profile paper" if profile == "paper" else ""
        if hub.is_offline():
            prepare += f" (the hub is offline for runs; {hub.ONLINE_ENV}=1 lets them use it)"
    return FileNotFoundError(
        f"no {what} found (source={source!r}). Tried:\n  - " + "\n  - ".join(tried) + "\n" + how + prepare
    )


def data_folders(data_dir, name: str) -> list[Path]:
    """Where a loader looks for a data set's files, in order: ``task.data_dir``, ``task.data_dir/<name>``, then the
    shared offline folder ``<shared data>/<name>`` (duplicates removed)."""
    from dp_adam_bench.paths import shared_data_dir

    out = []
    if data_dir is not None:
        d = Path(data_dir).expanduser()
        out += [d, d / name]
    out.append(shared_data_dir() / name)
    return list(dict.fromkeys(out))


def task_profile(cfg) -> str:
    """``task.profile`` (cpu | paper; null = cpu), refused with the valid values otherwise."""
    profile = str(cfg.get("profile") or "cpu")
    if profile not in ("cpu", "paper"):
        raise ValueError(f"task.profile={profile!r}; valid: cpu, paper")
    return profile
