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

import re

from torch import nn

from dp_adam_bench.errors import ConfigError
from dp_adam_bench.finetune.common import (  # noqa: F401 (the package's API: the methods' modules use common)
    TASK_HEADS,
    Finetuned,
    counts,
    float_arg,
    freeze_all_but,
    int_arg,
    is_task_head,
    refuse_unknown,
)
from dp_adam_bench.registry import Registry

METHODS = Registry("fine-tuning method", "task.finetune")
METHODS.register("full", "dp_adam_bench.finetune.blocks:full")
METHODS.register("head", "dp_adam_bench.finetune.blocks:head")
METHODS.register("top", "dp_adam_bench.finetune.blocks:top")  # spelled top<k>: top1, top2, ...
METHODS.register("lora", "dp_adam_bench.finetune.adapters:lora")
METHODS.register("prefix", "dp_adam_bench.finetune.adapters:prefix")
METHODS.register("rgp", "dp_adam_bench.finetune.rgp:method")

#: the spellings ``task.finetune`` accepts, for messages
SPELLINGS = ("full", "head", "top<k>", "lora", "prefix", "rgp")


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
