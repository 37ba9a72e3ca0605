"""Which parameters a run fine-tunes: ``task.finetune`` (CLI, sweeps) or ``make_private(finetune=...)`` (API).

Li, Tramer, Liang & Hashimoto ("Large Language Models Can Be Strong Differentially Private Learners", ICLR 2022,
arXiv 2110.05679, table "Dataset: E2E") compare full fine-tuning of GPT-2 with the parameter-efficient methods:

* ``full`` — every parameter of the model trains;
* ``lora`` — low-rank adapters (Hu et al. 2021, arXiv 2106.09685), from peft (:mod:`.adapters`);
* ``prefix`` — prefix-tuning (Li & Liang 2021, arXiv 2101.00190), from peft (:mod:`.adapters`);
* ``rgp`` — reparametrized gradient perturbation (Yu et al. 2021, arXiv 2106.09352), an algorithm (:mod:`.rgp`);
* ``top<k>`` — the last k transformer blocks (Li et al.'s "top2"), and ``head`` — the output head alone
  (:mod:`.blocks`);
* null — the task's own choice (snli_bert trains its last block, pooler and classifier; the others everything).

A method first freezes every parameter, then opens its own: the engines, the clipping, the noise and the
accountant see only those (the noise dimension is the trainable count, recorded in the summary). A task head that
does not come from pretraining (a classifier: ``classifier``, ``score``) trains with every method, as peft does
with ``modules_to_save`` for sequence classification; a pretrained LM head stays frozen unless the method is
``full`` or ``head``.

Privacy: the method is applied before the engine is built, so the engine checks (probe, self-check, watch) and
the noise run on the trainable set; :mod:`.moved` checks during the first steps that every trainable tensor moved
(Opacus with peft 0.18 trains LoRA weights that never update, silently).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from dp_adam_bench.errors import ConfigError
from dp_adam_bench.registry import Registry

METHODS = Registry("fine-tuning method", "task.finetune")
METHODS.register("full", "dp_adam_bench.finetune.blocks:full")
METHODS.register("head", "dp_adam_bench.finetune.blocks:head")
METHODS.register("top", "dp_adam_bench.finetune.blocks:top")  # spelled top<k>: top1, top2, ...
METHODS.register("lora", "dp_adam_bench.finetune.adapters:lora")
METHODS.register("prefix", "dp_adam_bench.finetune.adapters:prefix")

#: the spellings ``task.finetune`` accepts, for messages
SPELLINGS = ("full", "head", "top<k>", "lora", "prefix", "rgp")

#: heads made for the task (not pretrained): they train with every method
TASK_HEADS = ("classifier", "score", "qa_outputs")


@dataclass
class Finetuned:
    """What a method did: the model to train (the same object, or a wrapper around it), its summary, and a wrapper
    for the optimizer variant (RGP updates the reparametrized weights from its carriers' noisy gradients)."""

    model: nn.Module
    summary: dict = field(default_factory=dict)
    wrap_variant: Callable | None = None  # (variant, model, seed) -> variant


def parse(method) -> tuple[str | None, int | None]:
    """``task.finetune`` -> (registered name, k for ``top<k>``); None for the task's own choice. A ConfigError
    names the value and the valid spellings."""
    if method is None:
        return None, None
    if not isinstance(method, str):
        raise ConfigError(f"task.finetune={method!r}; valid: {', '.join(SPELLINGS)} or null")
    m = re.fullmatch(r"top(\d+)", method)
    if m:
        k = int(m.group(1))
        if k < 1:
            raise ConfigError(f"task.finetune={method!r}: top<k> needs k >= 1 (top1, top2, ...)")
        return "top", k
    if method == "top" or method not in METHODS:
        raise ConfigError(
            f"task.finetune={method!r} is not a known fine-tuning method; valid: {', '.join(SPELLINGS)}"
        )
    return method, None


def apply(model: nn.Module, method, args=None) -> Finetuned:
    """Apply ``method`` (a ``task.finetune`` spelling) with ``args`` (``task.finetune_args``) to ``model`` in place;
    the method's settings and the trainable / frozen counts go into the summary."""
    name, k = parse(method)
    if name is None:
        return Finetuned(model, {"method": None, **counts(model)})
    args = dict(args or {})
    if k is not None:
        args["k"] = k
    out = METHODS.get(name)(model, args)
    out.summary = {"method": method, **out.summary, **counts(out.model)}
    if out.summary["trainable_params"] == 0:
        raise ConfigError(f"task.finetune={method!r} left no parameter of {type(model).__name__} trainable")
    return out


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


@METHODS.register("rgp")
def _rgp(model: nn.Module, args: dict) -> Finetuned:
    """RGP: the target weights reparametrized with gradient carriers (:func:`.rgp.reparametrize`), and the variant
    wrapped to rebuild their updates from the carriers' noisy gradients (:class:`.rgp.RGPVariant`)."""
    from dp_adam_bench.finetune.rgp import RGPVariant, reparametrize

    summary = reparametrize(model, args)
    return Finetuned(model, summary, wrap_variant=lambda variant, m, seed: RGPVariant(variant, m, seed))
