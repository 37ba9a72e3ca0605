"""Fine-tuning a part of the pretrained network as it is: ``full``, ``head`` and ``top<k>`` (Li et al. 2022,
arXiv 2110.05679, table "Dataset: E2E": "top2", the top 2 transformer blocks).

* ``full``: every parameter.
* ``head``: the output head (``lm_head``; BERT's masked-LM ``cls``; a classifier and the pooler under it).
* ``top<k>``: the last k transformer blocks, the normalisation layer that follows them (GPT-2's ``ln_f``), the
  pooler, and a classifier made for the task. A pretrained LM head stays frozen: Li et al. name blocks only, and on
  GPT-2 the head is the size of the input embedding (38.6 M of 124 M parameters), which would dominate the noise.

The blocks are the model's longest ``nn.ModuleList`` of modules of one class (GPT-2's ``transformer.h``, BERT's
``encoder.layer``); a model with none is refused with ``top<k>``.
"""

from __future__ import annotations

from torch import nn

from dp_adam_bench.errors import ConfigError
from dp_adam_bench.finetune.common import Finetuned, freeze_all_but, is_task_head, refuse_unknown

#: module names of output heads (``head``) and of the layer under a classifier
LM_HEADS = ("lm_head", "cls")
POOLERS = ("pooler",)


def full(model: nn.Module, args: dict) -> Finetuned:
    refuse_unknown(args, (), "full")
    freeze_all_but(model, lambda n: True)
    return Finetuned(model, {})


def head(model: nn.Module, args: dict) -> Finetuned:
    refuse_unknown(args, (), "head")
    heads = LM_HEADS + POOLERS
    # by identity, not name: a head tied to the input embedding (GPT-2's lm_head) is listed under the embedding's name
    ids = {
        id(p)
        for n, m in model.named_modules()
        if n.rsplit(".", 1)[-1] in heads or is_task_head(n)
        for p in m.parameters()
    }
    kept = freeze_all_but_ids(model, ids)
    if not kept:
        raise ConfigError(
            f"task.finetune=head: {type(model).__name__} has no output head named {', '.join(heads)} or a "
            "classifier; use top<k> or lora"
        )
    return Finetuned(model, {"trained_modules": sorted({n.rsplit(".", 1)[0] for n in kept})})


def top(model: nn.Module, args: dict) -> Finetuned:
    k = int(args["k"])
    refuse_unknown(args, (), f"top{k}")
    name, blocks, parent = transformer_blocks(model)
    if k > len(blocks):
        raise ConfigError(f"task.finetune=top{k}: {type(model).__name__} has {len(blocks)} blocks ({name})")
    prefixes = [f"{name}.{i}." for i in range(len(blocks) - k, len(blocks))]
    prefixes += [f"{n}." for n in final_norms(model, name, parent)]
    kept = freeze_all_but(
        model,
        lambda n: is_task_head(n) or any(p in POOLERS for p in n.split(".")) or n.startswith(tuple(prefixes)),
    )
    heads = sorted({n.rsplit(".", 1)[0] for n in kept if not n.startswith(tuple(prefixes))})
    return Finetuned(model, {"trained_modules": [p.rstrip(".") for p in prefixes] + heads})


def transformer_blocks(model: nn.Module) -> tuple[str, nn.ModuleList, str]:
    """(dotted name, the list, its parent's name) of the model's longest ``nn.ModuleList`` whose entries are all of
    one class: the transformer blocks."""
    best = None
    for name, m in model.named_modules():
        # blocks have layers of their own: an MLP's list of nn.Linear is not a stack of blocks
        if (
            isinstance(m, nn.ModuleList)
            and len(m)
            and len({type(b) for b in m}) == 1
            and any(m[0].children())
        ):
            if best is None or len(m) > len(best[1]):
                best = (name, m)
    if best is None:
        raise ConfigError(
            f"task.finetune=top<k>: {type(model).__name__} has no list of transformer blocks (an nn.ModuleList of "
            "one block class); use full, head or lora"
        )
    name = best[0]
    return name, best[1], name.rsplit(".", 1)[0] if "." in name else ""


def final_norms(model: nn.Module, blocks: str, parent: str) -> list[str]:
    """Normalisation layers beside the blocks in their parent module (GPT-2's ``transformer.ln_f``, Llama's
    ``model.norm``): applied to the last block's output."""
    owner = model.get_submodule(parent) if parent else model
    out = []
    for child_name, child in owner.named_children():
        full_name = f"{parent}.{child_name}" if parent else child_name
        if full_name != blocks and "norm" in type(child).__name__.lower():
            out.append(full_name)
    return out


def freeze_all_but_ids(model: nn.Module, ids: set[int]) -> list[str]:
    """requires_grad only for the parameters whose ``id`` is in ``ids``; their names."""
    kept = []
    for n, p in model.named_parameters():
        p.requires_grad_(id(p) in ids)
        if p.requires_grad:
            kept.append(n)
    return kept
