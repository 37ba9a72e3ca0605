"""DP-SGD with optional heavy-ball momentum on the privatized gradient (all three papers' baseline).

Same operation order as ``torch.optim.SGD`` (momentum buffer b <- mu b + g, first step b = g; no dampening), so
sigma = 0 without clipping matches it bit for bit.
"""

from __future__ import annotations

import torch

from dp_adam_bench.optim.base import StepContext, Variant


class SGD(Variant):
    name = "sgd"

    def __init__(self, lr: float, momentum: float = 0.0, **_):
        super().__init__(lr)
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"optimizer.momentum must be in [0, 1), got {momentum}")
        self.momentum = float(momentum)

    def init(self, params):
        return {"buf": [None for _ in params]} if self.momentum else {}

    def update(self, params, state, ctx: StepContext):
        for i, (p, g) in enumerate(zip(params, ctx.noisy, strict=True)):
            if self.momentum:
                buf = state["buf"][i]
                if buf is None:
                    buf = state["buf"][i] = torch.clone(g).detach()
                else:
                    buf.mul_(self.momentum).add_(g)
                g = buf
            p.add_(g, alpha=-self.lr)
