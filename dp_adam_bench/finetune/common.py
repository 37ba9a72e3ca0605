"""What the fine-tuning methods share: the result of a method, the parameter counts, freezing by name, and the
one-line checks of ``task.finetune_args``."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from dp_adam_bench.errors import ConfigError

#: heads made for the task (not pretrained): they train with every method
TASK_HEADS = ("classifier", "score", "qa_outputs")


@dataclass
class Finetuned:
    """What a method did: the model to train (the same object, or a wrapper around it), its summary, and a wrapper
    for the optimizer variant (RGP updates the reparametrized weights from its carriers' noisy gradients)."""

    model: nn.Module
    summary: dict = field(default_factory=dict)
    wrap_variant: Callable | None = None  # (variant, model, seed) -> variant


def counts(model: nn.Module) -> dict:
    """Trainable and frozen parameter counts (the noise dimension is the trainable count)."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return {"trainable_params": trainable, "frozen_params": total - trainable}


def freeze_all_but(model: nn.Module, keep: Callable[[str], bool]) -> list[str]:
    """requires_grad = keep(name) for every parameter; the names kept."""
    kept = []
    for n, p in model.named_parameters():
        p.requires_grad_(bool(keep(n)))
        if p.requires_grad:
            kept.append(n)
    return kept


def is_task_head(name: str) -> bool:
    """A parameter of a head made for the task (:data:`TASK_HEADS`), by its dotted name."""
    return any(part in TASK_HEADS for part in name.split("."))


def int_arg(args: dict, key: str, default: int, method: str, low: int = 1) -> int:
    """``task.finetune_args.<key>`` as an integer >= ``low``, or a one-line ConfigError."""
    v = args.get(key, default)
    if v is None:
        v = default
    if (
        isinstance(v, bool)
        or not isinstance(v, (int, float))
        or not math.isfinite(v)
        or not float(v).is_integer()
    ):
        raise ConfigError(f"task.finetune_args.{key}={v!r} ({method}) must be an integer >= {low}")
    if int(v) < low:
        raise ConfigError(f"task.finetune_args.{key}={v!r} ({method}) must be an integer >= {low}")
    return int(v)


def float_arg(args: dict, key: str, default: float, method: str, low: float = 0.0, high=math.inf) -> float:
    """``task.finetune_args.<key>`` as a finite number in [low, high), or a one-line ConfigError."""
    v = args.get(key, default)
    if v is None:
        v = default
    ok = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and low <= v < high
    if not ok:
        raise ConfigError(
            f"task.finetune_args.{key}={v!r} ({method}) must be a finite number in [{low}, {high})"
        )
    return float(v)


def refuse_unknown(args: dict, known: tuple[str, ...], method: str) -> None:
    """A ConfigError naming a ``task.finetune_args`` key the method does not read."""
    extra = sorted(set(args) - set(known) - {"k"})
    if extra:
        raise ConfigError(
            f"task.finetune_args.{extra[0]} is not a setting of task.finetune={method}; its settings: "
            f"{', '.join(known) or 'none'}"
        )
