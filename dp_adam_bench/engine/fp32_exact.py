"""Full-precision fp32 for the kernels that make per-example norms and clipped sums (TF32 and oneDNN's bf16 off).

Why TF32 breaks the clipping bound. The bound is ``||c_i G_i|| <= C`` with ``c_i = min(1, C / ||G_i||)``: it holds
only if the ``G_i`` whose norm is measured is the ``G_i`` that is summed. Engines compute the two from the same
captured activations and output gradients but often through *different kernels*: bk's convolution norms come from
an fp32 matmul (the Gram form, or an unfolded per-example gradient), while its clipped sum comes from
``aten.convolution_backward``, which cuDNN runs in TF32 by default (``torch.backends.cudnn.allow_tf32=True``;
TF32 keeps 10 of fp32's 23 mantissa bits, unit roundoff 2^-11 ~ 4.9e-4). The summed ``c_i G_i`` then carries a
relative error of up to ~1e-3 that the norm never saw, so one example's contribution can exceed C by that much
(about 2e-5 relative in a CPU emulation of a CNN, issue 32) — a sensitivity the accountant does not assume.
The same holds for matmuls with ``torch.backends.cuda.matmul.allow_tf32`` (or
``torch.set_float32_matmul_precision("high")``), and on the CPU for oneDNN's reduced-precision fp32 math
(``torch.backends.mkldnn.*.fp32_precision = "bf16"``).

:func:`ieee_fp32` turns all of these to full IEEE fp32 for the duration of a block and restores the caller's
settings exactly afterwards. Every engine's ``clipped_sum`` (:meth:`dp_adam_bench.engine.grads.GradEngine.clipped_sum`:
forward, backward, norms and sums) runs inside it, except bk's, which computes both its norms and its sums from the
captured inputs and output gradients after one forward and one backward: only that part runs inside it (the forward
and backward keep the user's TF32 speed; their rounding is in the captures both are computed from). So norms and
sums agree to fp32 rounding whatever the device and whatever the user set. Under ``train.precision=bf16``
autocast still casts the forward's matmuls to bf16 (that is the claimed precision); the engine's norms and sums are
fp32 from those bf16 captures. :func:`settings` is what a run records in ``summary.json`` (``fp32_math``).

torch >= 2.9 has per-backend, per-operation ``fp32_precision`` strings ("ieee", "tf32", "bf16", "none" = inherit)
and refuses to *read* the legacy ``allow_tf32`` flags once the new ones were set inconsistently; both are handled:
the new strings where they exist (read and restored verbatim), the legacy flags otherwise.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

#: (backend, operation) pairs whose fp32 math precision torch lets a user lower (torch >= 2.9)
OPS = (
    ("cuda", "matmul"),
    ("cudnn", "conv"),
    ("cudnn", "rnn"),
    ("mkldnn", "matmul"),
    ("mkldnn", "conv"),
    ("mkldnn", "rnn"),
)


def op(backend: str, name: str):
    """``torch.backends.<backend>.<name>`` (e.g. ``cudnn.conv``), or None where this torch has none."""
    return getattr(getattr(torch.backends, backend, None), name, None)


def new_api() -> bool:
    """Whether this torch has the per-operation ``fp32_precision`` settings (torch >= 2.9)."""
    return all(hasattr(op(b, o), "fp32_precision") for b, o in OPS)


def settings() -> dict:
    """The process's fp32 math settings as a run records them (``summary.json``: ``fp32_math``): each (backend,
    operation)'s ``fp32_precision`` (torch >= 2.9; "none" inherits the backend's, then the global one), or on
    older torch the legacy TF32 flags; plus what the clipping engines use whatever these say."""
    out = {"clipping": "ieee (TF32 and bf16 fp32 math off inside every engine's clipped_sum)"}
    if new_api():
        return out | {f"{b}.{o}": str(op(b, o).fp32_precision) for b, o in OPS}
    return out | {
        "cuda.matmul.allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
        "cudnn.allow_tf32": bool(torch.backends.cudnn.allow_tf32),
    }


@contextmanager
def ieee_fp32():
    """Full IEEE fp32 for matmuls, convolutions and RNNs on every backend inside the block; the caller's settings
    are restored exactly on exit (also on an exception)."""
    if new_api():
        saved = {(b, o): op(b, o).fp32_precision for b, o in OPS}
        try:
            for b, o in OPS:
                op(b, o).fp32_precision = "ieee"
            yield
        finally:
            for (b, o), value in saved.items():
                op(b, o).fp32_precision = value
        return
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul
        torch.backends.cudnn.allow_tf32 = cudnn
