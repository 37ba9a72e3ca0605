"""``nn.Linear`` on inputs of any rank (B, ..., d), and transformers' GPT-2 ``Conv1D`` (a Linear whose weight is
stored transposed, (d, p)). Every position along the middle dimensions is one more row of ``A_i`` / ``G_i``."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from dp_adam_bench.engine.bk_rules.dense import dense, held_operands
from dp_adam_bench.engine.bk_rules.registry import register
from dp_adam_bench.engine.bk_rules.shared import Use


def stack_calls(calls, b: int):
    """(A, G) of shape (B, T, 1, d) / (B, T, 1, p): every call's positions side by side (module reuse: the
    per-example gradient sums over all positions of all calls), each in the precision the layer saw."""
    As = [c.args[0].reshape(b, -1, c.args[0].shape[-1]) for c in calls]
    Gs = [c.grad.reshape(b, -1, c.grad.shape[-1]) for c in calls]
    A = As[0] if len(As) == 1 else torch.cat(As, 1)
    G = Gs[0] if len(Gs) == 1 else torch.cat(Gs, 1)
    return A[:, :, None], G[:, :, None]


@register(nn.Linear, NonDynamicallyQuantizableLinear, ("transformers", "Conv1D"), kind="linear", shares=True)
def linear(engine, layer, calls, b):
    m = layer.module
    transposed = type(m).__name__ == "Conv1D"  # GPT-2: y = x @ W + b, W (d, p)
    A, G = stack_calls(calls, b)
    w, bias = m.weight, m.bias
    if engine.shares(w):  # tied weights (bk_rules/shared.py): G^T A per example, A^T G for Conv1D's (d, p)
        a, g = A[:, :, 0], G[:, :, 0]
        engine.share(w, Use(layer.name, L=a, R=g) if transposed else Use(layer.name, L=g, R=a))
    if engine.shares(bias):
        engine.share(bias, Use(layer.name, per_ex=G[:, :, 0].sum(1)))
    sw = engine.scale_of(w)
    if sw is not None:
        sw = (sw.t() if transposed else sw)[None]
    sq, fin = dense(
        engine,
        layer.name,
        held_operands(A, G),
        weight=w.requires_grad,
        bias=bias is not None and bias.requires_grad,
        sw=sw,
        sb=engine.scale_of(bias) if bias is not None else None,
    )

    def finish(c):
        ws, bs = fin(c)
        out = {}
        if ws is not None:
            out[w] = ws[0].t() if transposed else ws[0]
        if bs is not None:
            out[bias] = bs
        return out

    return sq, finish
