"""Per-example gradients and clipping for ``nn.Module`` tasks.

Every engine answers the same question for one physical micro-batch: the **sum of clipped per-example
gradients** (optionally clipped in a scaled geometry, s * g_i, for scale-then-privatize) and the per-example
norms before clipping (diagnostics). The privatizer then adds noise and divides by the expected batch size.

| engine | how | materialises g_i | stp (per-coordinate scale) |
|---|---|---|---|
| ``loop`` | one backward per example (the oracle in tests) | yes | yes |
| ``hooks`` | Opacus ``GradSampleModule`` hooks | yes | yes |
| ``functorch`` | ``torch.func.vmap(grad(.))`` over examples | yes | yes |
| ``ghost`` | Opacus ghost clipping (see below) | no | no |
| ``bk`` | book-keeping, one backward (``engine/bk.py``) | per layer, by cost | yes (per-layer, chunked) |

Ghost clipping gets the norms from activations and backprops, then runs a second backward of the loss re-weighted
by the clip factors. A per-coordinate scale changes the norm in a way ghost norms cannot see, so scale-then-privatize
needs per-example gradients: the materialising engines, or bk (which instantiates them a chunk of examples at a
time, layer by layer).

Opacus is used for what it does well (grad samplers per layer type, ghost norms); the state it hangs on
parameters (``grad_sample``, ``_norm_sample``) is read and cleared inside this module and never leaks out.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

ENGINES = ("loop", "hooks", "functorch", "ghost", "bk")

# torch warns on every backward when the first layer's input needs no grad; Opacus' hooks still fire correctly
warnings.filterwarnings("ignore", message="Full backward hook is firing", category=UserWarning)


def clip_factors(norms: torch.Tensor, clip: float | None) -> torch.Tensor:
    """min(1, C / ||g_i||), exactly (no epsilon): C / max(||g_i||, C)."""
    if clip is None:
        return torch.ones_like(norms)
    return clip / norms.clamp(min=clip)


@dataclass
class ClippedSum:
    summed: list[torch.Tensor]  # sum_i clip(s * g_i) (in the scaled geometry if a scale was given)
    norms: torch.Tensor  # ||s * g_i|| before clipping, one per example
    count: int


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _sum_materialised(per_ex: list[torch.Tensor], clip, scale) -> ClippedSum:
    if scale is not None:
        per_ex = [g * s for g, s in zip(per_ex, scale, strict=True)]
    b = per_ex[0].shape[0]
    norms = torch.sqrt(sum(g.reshape(b, -1).pow(2).sum(1) for g in per_ex))
    f = clip_factors(norms, clip)
    summed = [torch.einsum("b,b...->...", f, g) for g in per_ex]
    return ClippedSum(summed, norms, b)


class GradEngine:
    """Base: ``clipped_sum(batch, clip, scale)`` on one micro-batch; ``params`` are the trainable parameters."""

    name = "engine"
    supports_scale = True

    def __init__(self, model: nn.Module, loss_per_example: Callable):
        self.model = model
        self.loss_per_example = loss_per_example
        self.params = _trainable(model)

    def per_example_grads(self, batch: dict) -> list[torch.Tensor]:
        raise NotImplementedError(f"the {self.name} engine does not materialise per-example gradients")

    def clipped_sum(
        self, batch: dict, clip: float | None, scale: list[torch.Tensor] | None = None
    ) -> ClippedSum:
        if scale is not None and not self.supports_scale:
            raise ValueError(
                f"clipping engine {self.name!r} cannot clip per-coordinate scaled gradients (scale-then-privatize); "
                "use engine=hooks or engine=functorch"
            )
        return _sum_materialised(self.per_example_grads(batch), clip, scale)

    def close(self) -> None:
        """Remove hooks so the model is a plain module again."""

    def _hooks(self, enabled: bool) -> None:
        gsm = getattr(self, "gsm", None)
        if gsm is not None:
            (gsm.enable_hooks if enabled else gsm.disable_hooks)()

    def mean_grad(self, batch: dict) -> list[torch.Tensor]:
        """Plain gradient of the mean loss (no per-example work, hooks off): for public side information."""
        self._hooks(False)
        try:
            loss = self.loss_per_example(self.model, batch).mean()
            grads = torch.autograd.grad(loss, self.params, allow_unused=True)
        finally:
            self._hooks(True)
        return [g if g is not None else torch.zeros_like(p) for g, p in zip(grads, self.params, strict=True)]


def _slice(batch: dict, i: int) -> dict:
    return {k: v[i : i + 1] for k, v in batch.items()}


def _batch_len(batch: dict) -> int:
    return next(iter(batch.values())).shape[0]


class LoopEngine(GradEngine):
    """One forward/backward per example: slow, obviously correct — the oracle the other engines are tested against."""

    name = "loop"

    def per_example_grads(self, batch):
        rows = []
        for i in range(_batch_len(batch)):
            loss = self.loss_per_example(self.model, _slice(batch, i)).sum()
            rows.append(torch.autograd.grad(loss, self.params, allow_unused=True))
        return [
            torch.stack([r[k] if r[k] is not None else torch.zeros_like(p) for r in rows])
            for k, p in enumerate(self.params)
        ]


class HooksEngine(GradEngine):
    """Opacus per-layer grad samplers (``GradSampleModule``, hooks mode)."""

    name = "hooks"

    def __init__(self, model, loss_per_example, force_functorch: bool = False):
        from opacus.grad_sample import GradSampleModule

        super().__init__(model, loss_per_example)
        self.gsm = GradSampleModule(
            model, batch_first=True, loss_reduction="sum", strict=True, force_functorch=force_functorch
        )

    def per_example_grads(self, batch):
        loss = self.loss_per_example(self.gsm, batch).sum()
        loss.backward()
        out = []
        for p in self.params:
            gs = p.grad_sample
            out.append(gs if gs is not None else torch.zeros(_batch_len(batch), *p.shape, dtype=p.dtype))
            p.grad_sample = None
            p.grad = None
        return out

    def close(self):
        self.gsm._close()


class FunctorchEngine(GradEngine):
    """``torch.func``: vmap of the gradient of one example's loss (no hooks, one vectorised pass)."""

    name = "functorch"

    def __init__(self, model, loss_per_example):
        super().__init__(model, loss_per_example)
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.frozen = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}
        self.buffers = dict(model.named_buffers())

    def per_example_grads(self, batch):
        from torch.func import functional_call, grad, vmap

        model, task_loss = self.model, self.loss_per_example

        def one(params, example):
            example = {k: v.unsqueeze(0) for k, v in example.items()}
            state = {**self.frozen, **params, **self.buffers}
            return task_loss(lambda *a, **k: functional_call(model, state, a, k), example).sum()

        params = {n: p.detach() for n, p in zip(self.names, self.params, strict=True)}
        grads = vmap(grad(one), in_dims=(None, 0), randomness="different")(params, batch)
        return [grads[n] for n in self.names]


class GhostEngine(GradEngine):
    """Opacus ghost clipping: per-example norms without per-example gradients, clipped sum by a second backward."""

    name = "ghost"
    supports_scale = False

    def __init__(self, model, loss_per_example):
        from opacus.grad_sample import GradSampleModuleFastGradientClipping

        super().__init__(model, loss_per_example)
        self.gsm = GradSampleModuleFastGradientClipping(
            model, batch_first=True, loss_reduction="sum", max_grad_norm=1.0, use_ghost_clipping=True
        )

    def clipped_sum(self, batch, clip, scale=None):
        if scale is not None:
            return super().clipped_sum(batch, clip, scale)  # raises the explanatory error
        losses = self.loss_per_example(self.gsm, batch)
        losses.sum().backward(retain_graph=True)
        norms = self.gsm.get_norm_sample().detach()
        for p in self.params:
            p.grad = None
            p._norm_sample = None
        f = clip_factors(norms, clip)
        self.gsm.disable_hooks()
        try:
            (f * losses).sum().backward()
        finally:
            self.gsm.enable_hooks()
        summed = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in self.params]
        for p in self.params:
            p.grad = None
        return ClippedSum(summed, norms, _batch_len(batch))

    def close(self):
        self.gsm._close()


def build_engine(name: str, model: nn.Module, loss_per_example: Callable) -> GradEngine:
    from dp_adam_bench.engine.bk import BKEngine  # lazy: bk imports this module

    engines = {
        "loop": LoopEngine,
        "hooks": HooksEngine,
        "functorch": FunctorchEngine,
        "ghost": GhostEngine,
        "bk": BKEngine,
    }
    if name not in engines:
        raise ValueError(f"unknown clipping engine {name!r}; valid: {', '.join(ENGINES)}")
    return engines[name](model, loss_per_example)
