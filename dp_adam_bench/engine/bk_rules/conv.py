"""``nn.Conv1d`` / ``Conv2d`` / ``Conv3d`` with any stride, padding (numbers, ``same``, ``valid``), dilation,
groups and ``padding_mode``: a convolution is a grouped dense map applied at every output position to the patch
of (padded) input under the kernel, so the rule unfolds the input into patches and hands them to
:func:`~dp_adam_bench.engine.bk_rules.dense.dense`.

The input is padded explicitly, in the layer's own mode (``reflect``, ``replicate``, ``circular`` or zeros), with
the amounts the layer itself uses (``_reversed_padding_repeated_twice``: for ``same`` with an even kernel, the
extra element on the right, as ``F.conv2d(padding="same")`` does); a rule that ignored the mode would compute the
gradient of a different function. The patches come from ``Tensor.unfold`` views over all spatial dimensions at
once, so there is no per-image im2col kernel (``F.unfold`` launches one per image on CUDA).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from dp_adam_bench.engine.bk_rules.dense import dense
from dp_adam_bench.engine.bk_rules.registry import register


def patches(conv: nn.modules.conv._ConvNd, x: torch.Tensor) -> torch.Tensor:
    """(B, C, *S) -> (B, L, groups, C / groups * prod(kernel)) (a strided view): the input patch under the kernel
    at each of the L output positions, per group, in the order of ``conv.weight``'s (C / groups, *kernel)
    dimensions."""
    n = len(conv.kernel_size)
    mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
    if any(conv._reversed_padding_repeated_twice):
        x = F.pad(x, conv._reversed_padding_repeated_twice, mode=mode)
    for i, (k, s, dil) in enumerate(zip(conv.kernel_size, conv.stride, conv.dilation, strict=True)):
        x = x.unfold(2 + i, dil * (k - 1) + 1, s)  # appends the window as a trailing dimension
    if any(dil > 1 for dil in conv.dilation):
        x = x[(Ellipsis, *(slice(None, None, dil) for dil in conv.dilation))]
    b, c = x.shape[:2]
    out = x.shape[2 : 2 + n]
    g = conv.groups
    x = x.reshape(b, g, c // g, *out, *conv.kernel_size)
    # copied in im2col's layout, (B, g, C/g, *k, *out): the positions innermost, read in order (2-5x faster on
    # a CPU than copying straight into (B, *out, g, C/g, *k)); returned as a (B, L, g, d) view of it
    x = x.permute(0, 1, 2, *range(3 + n, 3 + 2 * n), *range(3, 3 + n)).reshape(b, g, -1, math.prod(out))
    return x.permute(0, 3, 1, 2)


@register(nn.Conv1d, nn.Conv2d, nn.Conv3d, kind="conv")
def conv(engine, layer, calls, b):
    m = layer.module
    g = m.groups
    As, Gs = [], []
    for call in calls:
        grad = call.grad
        As.append(patches(m, call.args[0].to(grad.dtype)))
        Gs.append(grad.reshape(b, g, grad.shape[1] // g, -1).permute(0, 3, 1, 2))  # (B, L, g, out / g)
    A = As[0] if len(As) == 1 else torch.cat(As, 1)
    G = Gs[0] if len(Gs) == 1 else torch.cat(Gs, 1)
    w, bias = m.weight, m.bias
    shape = (
        g,
        w.shape[0] // g,
        A.shape[3],
    )  # the weight as (groups, out / groups, in / groups * prod(kernel))
    sw = engine.scale_of(w)
    sq, fin = dense(
        engine,
        layer.name,
        A,
        G,
        weight=w.requires_grad,
        bias=bias is not None and bias.requires_grad,
        sw=None if sw is None else sw.reshape(shape),
        sb=engine.scale_of(bias) if bias is not None else None,
    )

    def finish(c):
        ws, bs = fin(c)
        out = {}
        if ws is not None:
            out[w] = ws.reshape(w.shape)
        if bs is not None:
            out[bias] = bs
        return out

    return sq, finish
