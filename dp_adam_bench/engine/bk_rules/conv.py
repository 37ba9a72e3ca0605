"""``nn.Conv1d`` / ``Conv2d`` / ``Conv3d`` with any stride, padding (numbers, ``same``, ``valid``), dilation,
groups and ``padding_mode``: a convolution is a grouped dense map applied at every output position to the patch
of (padded) input under the kernel, so the rule hands :func:`~dp_adam_bench.engine.bk_rules.dense.dense` the
patches and the output gradients.

The input is padded explicitly, in the layer's own mode (``reflect``, ``replicate``, ``circular`` or zeros), with
the amounts the layer itself uses (``_reversed_padding_repeated_twice``: for ``same`` with an even kernel, the
extra element on the right, as ``F.conv2d(padding="same")`` does); a rule that ignored the mode would compute the
gradient of a different function.

Memory and speed (Bu, Mao & Xu, "Scalable and efficient training of large convolutional neural networks with
differential privacy", NeurIPS 2022): the unfolded patches are ``prod(kernel)`` times the input, so they are made
one chunk of examples at a time, from ``Tensor.unfold`` views over all spatial dimensions at once (no per-image
im2col kernel: ``F.unfold`` launches one per image on CUDA), and dropped once that chunk's norms are known. The
clipped sum ``sum_i c_i G_i^T A_i`` is the convolution's own weight gradient of the padded input with the output
gradients scaled by ``c`` (``aten.convolution_backward``: cuDNN / oneDNN), so it needs no patches at all, and
the input is held as the layer saw it (padded a chunk at a time, or by the kernel itself).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from dp_adam_bench.engine.bk_rules.dense import Operands, dense
from dp_adam_bench.engine.bk_rules.registry import register


def padded(conv: nn.modules.conv._ConvNd, x: torch.Tensor) -> torch.Tensor:
    """``x`` padded as ``conv`` pads it (its padding mode and amounts)."""
    if not any(conv._reversed_padding_repeated_twice):
        return x
    mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
    return F.pad(x, conv._reversed_padding_repeated_twice, mode=mode)


def patches(conv: nn.modules.conv._ConvNd, x: torch.Tensor) -> torch.Tensor:
    """Padded input (B, C, *S) -> (B, L, groups, C / groups * prod(kernel)): the patch under the kernel at each of
    the L output positions, per group, in the order of ``conv.weight``'s (C / groups, *kernel) dimensions (one
    copy, returned as a strided view of it)."""
    n = len(conv.kernel_size)
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


def _symmetric_zero_padding(conv: nn.modules.conv._ConvNd) -> list[int] | None:
    """The per-dimension zero padding of ``conv`` if the convolution kernel can apply it itself (zeros, the same
    amount on both sides), else None (pad explicitly)."""
    if conv.padding_mode != "zeros":
        return None
    pads = conv._reversed_padding_repeated_twice  # (last dim left, right, ...)
    left, right = pads[0::2], pads[1::2]
    return list(reversed(left)) if left == right else None


def _weight_grad(conv: nn.modules.conv._ConvNd, x, grad, weight, groups: int) -> torch.Tensor:
    """``aten.convolution_backward``'s weight gradient (only) for ``conv``'s geometry with ``weight`` (its shape is
    what is read) and ``groups``, for input ``x`` (not padded: symmetric zero padding is left to the kernel, any
    other padding is applied first) and output gradient ``grad``, in the parameters' precision."""
    n = len(conv.kernel_size)
    pad = _symmetric_zero_padding(conv)
    if pad is None:
        x, pad = padded(conv, x), [0] * n
    dt = conv.weight.dtype
    return torch.ops.aten.convolution_backward(
        grad.to(dt),
        x.to(dt),
        weight,
        None,
        conv.stride,
        pad,
        conv.dilation,
        False,
        [0] * n,
        groups,
        [False, True, False],
    )[1]


def weight_grad(conv: nn.modules.conv._ConvNd, x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The gradient of ``conv.weight`` summed over the batch, for input ``x`` (not padded) and output gradient
    ``grad``: the kernel a non-private backward runs."""
    return _weight_grad(conv, x, grad, conv.weight, conv.groups)


#: on a CPU, per-example gradients of a convolution with at least GROUPED_MIN_CHANNELS input channels per group
#: and GROUPED_MIN_POSITIONS output positions come from one grouped weight-gradient convolution
#: (:func:`per_example_grads`), others from unfolded patches and ``bmm``. Measured (torch 2.13, oneDNN, 2 threads,
#: B = 128-256, 3x3 kernels; patches vs grouped): 32 -> 64 channels at 15 x 15 outputs, 46.6 vs 19.1 ms; 16 -> 16
#: at 32 x 32, 45.6 vs 5.7 ms; 32 -> 64 at 8 x 8, 4.5 vs 3.8 ms; but 3 -> 32 at 30 x 30, 9.5 vs 14.6 ms; 64 -> 128
#: at 7 x 7, 52.8 vs 98.4 ms; 128 -> 256 at 3 x 3, 102.8 vs 327.9 ms. On CUDA the patches and ``bmm`` are used
#: (cuDNN is slow on convolutions with thousands of groups; not measured here).
GROUPED_MIN_CHANNELS = 8
GROUPED_MIN_POSITIONS = 64


def grouped_kernel(conv: nn.modules.conv._ConvNd, device: torch.device, positions: int) -> bool:
    """Whether ``conv``'s per-example gradients at ``positions`` output positions come from
    :func:`per_example_grads` on ``device``."""
    return (
        device.type == "cpu"
        and conv.in_channels // conv.groups >= GROUPED_MIN_CHANNELS
        and positions >= GROUPED_MIN_POSITIONS
    )


def per_example_grads(conv: nn.modules.conv._ConvNd, x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Per-example weight gradients (B, out, in / groups, *kernel) of ``conv`` for input ``x`` (not padded) and
    output gradient ``grad``, as one weight-gradient convolution with the examples as groups (Rochette, Manoel &
    Tramel, "Efficient per-example gradient computations in convolutional neural networks", arXiv:1912.06015)."""
    b, w = x.shape[0], conv.weight
    one = w.new_empty((1,) * w.dim()).expand(b * w.shape[0], *w.shape[1:])  # only its shape is read
    flat = (x.reshape(1, -1, *x.shape[2:]), grad.reshape(1, -1, *grad.shape[2:]))  # (1, B * channels, *S)
    return _weight_grad(conv, *flat, one, b * conv.groups).reshape(b, *w.shape)


@register(nn.Conv1d, nn.Conv2d, nn.Conv3d, kind="conv")
def conv(engine, layer, calls, b):
    m = layer.module
    g = m.groups
    xs = [call.args[0] for call in calls]
    grads = [call.grad for call in calls]
    # (B, L, g, out / g): the output gradients at every output position, per group (a view)
    Gs = [grad.reshape(b, g, grad.shape[1] // g, -1).permute(0, 3, 1, 2) for grad in grads]
    G = Gs[0] if len(Gs) == 1 else torch.cat(Gs, 1)
    d = m.in_channels // g * math.prod(m.kernel_size)
    w, bias = m.weight, m.bias

    def inputs(i, j):
        ps = [patches(m, padded(m, x[i:j])) for x in xs]  # module reuse: every call's positions side by side
        return ps[0] if len(ps) == 1 else torch.cat(ps, 1)

    def weight_sum(c):
        cs = c.reshape(b, *[1] * (grads[0].dim() - 1))
        return sum(weight_grad(m, x, grad * cs) for x, grad in zip(xs, grads, strict=True)).reshape(g, -1, d)

    def per_example(i, j):
        ws = sum(per_example_grads(m, x[i:j], grad[i:j]) for x, grad in zip(xs, grads, strict=True))
        return ws.reshape(j - i, g, -1, d)

    grouped = grouped_kernel(m, xs[0].device, G.shape[1])
    held = sum(t.numel() * t.element_size() for t in (*xs, *grads))
    sw = engine.scale_of(w)
    sq, fin = dense(
        engine,
        layer.name,
        Operands(G, d, inputs, weight_sum, held, per_example if grouped else None),
        weight=w.requires_grad,
        bias=bias is not None and bias.requires_grad,
        sw=None if sw is None else sw.reshape(g, -1, d),
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
