"""Which parameter tensors weight decay acts on (``optimizer.decay_exclude``; the variants read the mask).

``bias_and_norm`` (the default) follows Hugging Face's ``Trainer.get_decay_parameter_names``: no decay for the
parameters of normalisation layers (by module type: LayerNorm, GroupNorm, BatchNorm / InstanceNorm, RMSNorm) or
whose name says bias or norm (``bias``, ``layernorm``, ``rmsnorm``, a ``norm`` / ``*_norm`` component, for norms
written as custom modules). ``none`` decays every tensor. The mask reads the model's structure and parameter names
only, never data, so it changes nothing in the privacy analysis.

Closed-form toy tasks have unnamed parameters: everything decays there (the variant's ``decay_mask = None``).
"""

from __future__ import annotations

import re

import torch
from torch import nn

#: normalisation layers whose parameters do not decay under ``bias_and_norm``
NORM_TYPES: tuple[type, ...] = (
    nn.LayerNorm,
    nn.GroupNorm,
    nn.LocalResponseNorm,
    nn.modules.batchnorm._NormBase,  # BatchNorm*d, InstanceNorm*d (affine), SyncBatchNorm
) + ((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())
#: parameter names that do not decay under ``bias_and_norm`` (transformers' forbidden_name_patterns)
NO_DECAY_NAME = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)", re.IGNORECASE)


def no_decay_names(model: nn.Module) -> set[str]:
    """The names (as ``model.named_parameters()`` gives them) of the parameters ``bias_and_norm`` leaves alone."""
    out = set()
    for mod_name, module in model.named_modules():
        for p_name, _ in module.named_parameters(recurse=False):
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            if isinstance(module, NORM_TYPES) or NO_DECAY_NAME.search(full):
                out.add(full)
    return out


def decay_mask(model: nn.Module, params: list[torch.Tensor], exclude: str) -> list[bool]:
    """One bool per tensor of ``params`` (the trained parameters, in the optimizer's order): True where it decays."""
    if exclude == "none":
        return [True] * len(params)
    if exclude != "bias_and_norm":
        raise ValueError(f"optimizer.decay_exclude={exclude!r}; valid: bias_and_norm, none")
    skip = no_decay_names(model)
    # a tensor shared under two names (tied weights) decays unless one of its names is excluded
    excluded = {id(p) for name, p in model.named_parameters(remove_duplicate=False) if name in skip}
    return [id(p) not in excluded for p in params]


def mask_from_names(model: nn.Module, params: list[torch.Tensor], decays) -> list[bool]:
    """The mask from a predicate ``decays(name, parameter) -> bool`` over ``model.named_parameters()`` (the public
    API's ``weight_decay_mask``)."""
    names = {}
    for name, p in model.named_parameters():
        names.setdefault(id(p), name)
    return [bool(decays(names[id(p)], p)) for p in params]
