"""Inputs broadcast over the batch: a layer called with a leading size of 1 while the batch has B > 1 examples.

Hugging Face models look up their position embeddings with one (1, T) row of ``position_ids`` and add the (1, T, d)
result to the (B, T, d) token embeddings, so every example's gradient of the position table flows through the same
row. Engines that compute per-example gradients layer by layer (bk, Opacus' hooks and ghost clipping) need that
layer's input with one row per example. :func:`expand_primary` expands the layer's primary input (its first
positional argument, or its first keyword argument) to B rows: a view, no copy. The layer's output then has one row
per example, which the model's broadcasting op combines exactly as it combined the single row, and each example's
gradient through the layer is its own row's. bk checks that each example did use its own row (a model that views
the expanded output and reads row 0 for everyone, as Swinv2 reads its position-bias MLP, is refused naming the
layer; one whose forward fails on the expansion, as DeBERTa's relative embeddings, gets the layer called as the model
calls it: :mod:`dp_adam_bench.engine.folds`); for Opacus' hooks and ghost clipping the engine self-check compares
with the size-one loop.
"""

from __future__ import annotations

import torch

from dp_adam_bench.engine.support import own_trainable


def _expanded(x, b: int, contiguous: bool):
    if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == 1:
        x = x.expand(b, *x.shape[1:])
        return x.contiguous() if contiguous else x
    return None


def expand_primary(args: tuple, kwargs: dict, b: int, contiguous: bool = False):
    """``(args, kwargs)`` with the primary input expanded from 1 to ``b`` rows, or None when there is nothing to
    expand (a batch of one, or a primary input that is not a tensor of leading size 1). ``contiguous``: a copy
    instead of a view (Opacus' ghost norms ``view`` their inputs)."""
    if b <= 1:
        return None
    if args:
        x = _expanded(args[0], b, contiguous)
        return None if x is None else ((x, *args[1:]), kwargs)
    if kwargs:
        key = next(iter(kwargs))
        x = _expanded(kwargs[key], b, contiguous)
        return None if x is None else (args, {**kwargs, key: x})
    return None


def install(model: torch.nn.Module, batch_size, contiguous: bool = False) -> list:
    """Forward pre-hooks expanding the primary input of every module owning trainable parameters to
    ``batch_size()`` rows while ``batch_size()`` is not None; returns the hooks' removers."""

    def hook(module, args, kwargs):
        b = batch_size()
        return None if b is None else expand_primary(args, kwargs, b, contiguous)

    return [
        m.register_forward_pre_hook(hook, with_kwargs=True).remove
        for m in model.modules()
        if own_trainable(m)
    ]
