"""Normalisation layers with a per-coordinate affine map, ``y = x_hat * w + b``: an example's gradient is
``sum g * x_hat`` for ``w`` and ``sum g`` for ``b``, summed over every dimension the affine map is shared across
(positions for ``LayerNorm`` / ``RMSNorm``; positions for ``GroupNorm`` / ``InstanceNorm``, whose parameters
are per channel). ``x_hat`` is recomputed from the captured input with the layer's own normalisation and ``eps``;
the per-example gradients are small (B x channels) and instantiated.

Each example is normalised with its own statistics in all four, so an example's gradient is its own. BatchNorm
and InstanceNorm with running statistics are refused by every engine (:mod:`dp_adam_bench.engine.support`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from dp_adam_bench.engine.bk_rules.dense import from_per_example
from dp_adam_bench.engine.bk_rules.registry import register
from dp_adam_bench.engine.bk_rules.shared import share_instantiated


def _affine_rule(engine, layer, calls, b, normalise, shared_dims):
    """Per-example gradients of ``weight`` / ``bias`` from ``x_hat = normalise(x)`` and the output gradient,
    summed over ``shared_dims(g)``."""
    m = layer.module
    w = getattr(m, "weight", None)
    bias = getattr(m, "bias", None)
    gw = gb = None
    for call in calls:
        g = call.grad
        x = call.args[0].to(g.dtype)
        dims = shared_dims(g)
        if w is not None and w.requires_grad:
            t = g * normalise(x)
            t = t.sum(dims) if dims else t
            gw = t if gw is None else gw + t
        if bias is not None and bias.requires_grad:
            t = g.sum(dims) if dims else g
            gb = t if gb is None else gb + t
    per_ex = {p: t for p, t in ((w, gw), (bias, gb)) if t is not None}
    share_instantiated(engine, layer, per_ex)
    return from_per_example(engine.scaled(per_ex), b, calls[0].grad.device)


def _trailing(m):
    """Dims between the batch and the normalised trailing shape."""
    n = len(m.normalized_shape)
    return lambda g: tuple(range(1, g.dim() - n))


@register(nn.LayerNorm, kind="layernorm", shares=True)
def layer_norm(engine, layer, calls, b):
    m = layer.module
    ns = tuple(m.normalized_shape)
    return _affine_rule(engine, layer, calls, b, lambda x: F.layer_norm(x, ns, eps=m.eps), _trailing(m))


@register(nn.RMSNorm, kind="rmsnorm", shares=True)
def rms_norm(engine, layer, calls, b):
    m = layer.module
    ns = tuple(m.normalized_shape)
    return _affine_rule(engine, layer, calls, b, lambda x: F.rms_norm(x, ns, eps=m.eps), _trailing(m))


def _spatial(g: torch.Tensor) -> tuple:
    return tuple(range(2, g.dim()))


@register(nn.GroupNorm, kind="groupnorm", shares=True)
def group_norm(engine, layer, calls, b):
    m = layer.module
    return _affine_rule(engine, layer, calls, b, lambda x: F.group_norm(x, m.num_groups, eps=m.eps), _spatial)


@register(nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d, kind="instancenorm", shares=True)
def instance_norm(engine, layer, calls, b):
    m = layer.module
    return _affine_rule(engine, layer, calls, b, lambda x: F.instance_norm(x, eps=m.eps), _spatial)
