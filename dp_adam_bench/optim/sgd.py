"""DP-SGD with optional heavy-ball momentum on the privatized gradient (all three papers' baseline).

Same operation order as ``torch.optim.SGD`` (momentum buffer b <- mu b + g, first step b = g; no dampening), so
sigma = 0 without clipping matches it bit for bit, with coupled ``weight_decay`` too (g + lambda theta before the
momentum, as ``torch.optim.SGD(weight_decay=...)``). Decoupled decay (``weight_decay_mode=decoupled``) shrinks
theta by 1 - eta_t lambda before the step (SGDW, Loshchilov & Hutter 2019); see :mod:`dp_adam_bench.optim.base`.
"""

from __future__ import annotations

import torch

from dp_adam_bench.optim.base import StepContext, Variant


class SGD(Variant):
    name = "sgd"

    def __init__(self, lr: float, momentum: float = 0.0, **kw):
        super().__init__(lr, **kw)
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"optimizer.momentum must be in [0, 1), got {momentum}")
        self.momentum = float(momentum)

    def init(self, params):
        return {"buf": [None for _ in params]} if self.momentum else {}

    def update(self, params, state, ctx: StepContext):
        grads = self.with_coupled_decay(params, ctx.noisy)
        self.apply_decoupled_decay(params)
        for i, (p, g) in enumerate(zip(params, grads, strict=True)):
            if self.momentum:
                buf = state["buf"][i]
                if buf is None:
                    buf = state["buf"][i] = torch.clone(g).detach()
                else:
                    buf.mul_(self.momentum).add_(g)
                g = buf
            p.add_(g, alpha=-self.lr)
