"""The clipping engines, by name: the registry behind ``train.clipping``.

Entries are ``"module:attr"`` paths, imported on first use, so that config validation can list the valid names
without importing Opacus, ``torch.func`` or the book-keeping engine. The engines themselves live in
:mod:`dp_adam_bench.engine.grads` (loop, hooks, functorch, ghost) and :mod:`dp_adam_bench.engine.bk` (bk); this
module imports neither, so neither needs to import it back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from dp_adam_bench.registry import Registry

if TYPE_CHECKING:
    from torch import nn

    from dp_adam_bench.engine.grads import GradEngine

ENGINES = Registry("clipping engine", "train.clipping")
ENGINES.register("loop", "dp_adam_bench.engine.grads:LoopEngine")
ENGINES.register("hooks", "dp_adam_bench.engine.grads:HooksEngine")
ENGINES.register("functorch", "dp_adam_bench.engine.grads:FunctorchEngine")
ENGINES.register("ghost", "dp_adam_bench.engine.grads:GhostEngine")
ENGINES.register("bk", "dp_adam_bench.engine.bk:BKEngine")


def build_engine(name: str, model: nn.Module, loss_per_example: Callable) -> GradEngine:
    """The clipping engine ``name`` (a ``train.clipping`` value) on ``model``; an unknown name raises
    :class:`~dp_adam_bench.errors.ConfigError` listing the registered engines. There is no default: the caller
    passes the configured name (``configs/config.yaml`` sets ``train.clipping: bk``)."""
    return ENGINES.build(name, model, loss_per_example)
