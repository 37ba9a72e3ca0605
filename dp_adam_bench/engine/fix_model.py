"""Make a model one the clipping engines can train privately, saying what was changed (as Opacus'
``ModuleValidator.fix`` does for BatchNorm).

:func:`fix_model` changes, in place:

* **BatchNorm** (its statistics mix the examples, so no example's gradient is its own) -> ``GroupNorm`` over the
  same channels (Wu & He 2018, arXiv:1803.08494; the replacement Opacus and the DP image literature use), with the
  largest number of groups up to 32 that divides the channels, its affine weight and bias copied;
* **InstanceNorm with running statistics** (statistics of the private data, released without noise) -> the same
  layer without them;
* **tied parameters that bk cannot combine** (one ``nn.Parameter`` in two modules of which one has a bk rule that
  cannot add its per-example gradient to the other uses': a convolution, ``nn.MultiheadAttention``) -> one copy per
  module, each trained on its own (a Hugging Face config's ``tie_word_embeddings`` is set to False so that
  ``tie_weights()`` does not tie them again). Tied embeddings and LM heads (GPT-2, T5, BART, Llama with
  ``tie_word_embeddings``), an encoder-decoder's ``shared`` table, and any parameter shared by Linear, Embedding,
  norm layers and modules without a rule are left tied: bk computes their per-example gradients exactly as the sum
  over the uses (:mod:`dp_adam_bench.engine.bk_rules.shared`), so the model trained is the model asked for;
* **half-precision trainable parameters** (bf16 / fp16: Adam's state would be kept in that precision) -> fp32
  (train in bf16 with ``precision="bf16"``, which keeps fp32 parameters and state).

What it does not need to change: Hugging Face's (1, T) ``position_ids`` broadcast over the batch are handled by the
engines (:mod:`dp_adam_bench.engine.broadcast`). What it cannot change: a parameter used outside the module that
owns it (``h @ self.emb.weight.T`` in a forward), refused at the start of a run.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def _groups(channels: int) -> int:
    return math.gcd(32, channels)


def _group_norm(bn: nn.modules.batchnorm._BatchNorm) -> nn.GroupNorm:
    gn = nn.GroupNorm(_groups(bn.num_features), bn.num_features, eps=bn.eps, affine=bn.affine)
    if bn.affine:
        with torch.no_grad():
            gn.weight.copy_(bn.weight)
            gn.bias.copy_(bn.bias)
        gn.weight.requires_grad_(bn.weight.requires_grad)
        gn.bias.requires_grad_(bn.bias.requires_grad)
    ref = next(bn.parameters(), None)
    if ref is None:
        ref = next(bn.buffers(), None)
    return gn.to(ref.device) if ref is not None else gn


def _replace_norms(model: nn.Module, changes: list[str]) -> nn.Module:
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if isinstance(child, nn.modules.batchnorm._BatchNorm):
                gn = _group_norm(child)
                setattr(module, child_name, gn)
                changes.append(
                    f"{full}: {type(child).__name__}({child.num_features}) -> GroupNorm({gn.num_groups}, "
                    f"{child.num_features})"
                )
            elif isinstance(child, nn.modules.instancenorm._InstanceNorm) and child.track_running_stats:
                child.track_running_stats = False
                child.running_mean = child.running_var = None
                child.num_batches_tracked = None
                changes.append(f"{full}: {type(child).__name__} without running statistics")
    if isinstance(model, nn.modules.batchnorm._BatchNorm):
        gn = _group_norm(model)
        changes.append(f"<root>: {type(model).__name__}({model.num_features}) -> GroupNorm")
        return gn
    return model


def _unshareable_kind(modules: list[nn.Module]) -> str | None:
    """The kind of the first bk rule among ``modules``' that cannot add its per-example gradient of a shared
    parameter to the other uses' (:mod:`dp_adam_bench.engine.bk_rules.shared`), or None when all can."""
    from dp_adam_bench.engine.bk_rules import rule_for

    for m in modules:
        rule = rule_for(m)  # None: the generic rule, which can
        if rule is not None and not rule.shares:
            return rule.kind
    return None


def _untie(model: nn.Module, changes: list[str]) -> None:
    owners: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None and all(m is not module for m in owners.get(id(p), [])):
                owners.setdefault(id(p), []).append(module)
    seen: dict[int, tuple[nn.Module, str]] = {}
    for mname, module in model.named_modules(remove_duplicate=False):
        for pname, p in list(module._parameters.items()):
            if p is None:
                continue
            full = f"{mname}.{pname}" if mname else pname
            first = seen.setdefault(id(p), (module, full))
            if first[0] is module:
                continue
            kind = _unshareable_kind(owners[id(p)])
            if kind is None:
                continue  # bk adds the uses' per-example gradients exactly: the model stays as it was built
            copy = nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
            setattr(module, pname, copy)
            seen[id(copy)] = (module, full)
            changes.append(
                f"{full}: untied from {first[1]} (a copy, trained on its own; bk's {kind} rule cannot add "
                "per-example gradients across layers)"
            )
    config = getattr(model, "config", None)
    if changes and config is not None and getattr(config, "tie_word_embeddings", False):
        config.tie_word_embeddings = False


def _to_fp32(model: nn.Module, changes: list[str]) -> nn.Module:
    half = [p for p in model.parameters() if p.requires_grad and p.dtype in (torch.bfloat16, torch.float16)]
    if half:
        dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in half})
        changes.append(
            f"<model>: cast from {'/'.join(dtypes)} to float32 ({len(half)} trainable parameter tensors; train in "
            "bf16 with precision='bf16', which keeps fp32 parameters and optimizer state)"
        )
        model = model.float()
    return model


def fix_model(model: nn.Module, verbose: bool = True) -> tuple[nn.Module, list[str]]:
    """``(model, changes)``: ``model`` made trainable by the clipping engines (module docstring), in place where
    it can be (a BatchNorm root module is replaced), and one line per change. ``verbose`` prints the changes."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"fix_model takes an nn.Module, got {type(model).__name__}")
    changes: list[str] = []
    model = _replace_norms(model, changes)
    untied: list[str] = []
    _untie(model, untied)
    changes += untied
    model = _to_fp32(model, changes)
    if verbose:
        print(f"fix_model: {len(changes)} change(s)" + "".join(f"\n  {c}" for c in changes))
    return model, changes
