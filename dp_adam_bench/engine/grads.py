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

An **empty micro-batch** (an empty Poisson batch is a legal DP step: its release is the noise alone) returns zero
sums and no norms from :meth:`GradEngine.clipped_sum` itself, before any engine runs its forward (Opacus' samplers
and ``torch.func.vmap`` fail on zero examples).

The engines are selected by name through :data:`dp_adam_bench.engine.engines.ENGINES` (``train.clipping``).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from dp_adam_bench.engine import broadcast
from dp_adam_bench.engine.fp32_exact import ieee_fp32

# torch warns on every backward when the first layer's input needs no grad; Opacus' hooks still fire correctly
warnings.filterwarnings("ignore", message="Full backward hook is firing", category=UserWarning)


def clip_factors(norms: torch.Tensor, clip: float | None) -> torch.Tensor:
    """min(1, C / ||g_i||), exactly (no epsilon): C / max(||g_i||, C)."""
    if clip is None:
        return torch.ones_like(norms)
    return clip / norms.clamp(min=clip)


@dataclass
class ClippedSum:
    # sum_i clip(s * g_i) (in the scaled geometry if a scale was given): fresh tensors the caller owns
    summed: list[torch.Tensor]
    norms: torch.Tensor  # ||s * g_i|| before clipping, one per example
    count: int
    # sum_i loss_i of the micro-batch, as the engine's own forward computed it (detached; a diagnostic of the
    # private batch, never released): bk, ghost and hooks; None for loop and functorch (their losses stay inside
    # per-example autograd calls) and for an empty batch
    loss_sum: torch.Tensor | None = None


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def batch_len(batch: dict) -> int:
    """The number of examples in ``batch``: the leading size of its first tensor (examples along dim 0)."""
    first = next(iter(batch.values()), None) if isinstance(batch, dict) else None
    if not isinstance(first, torch.Tensor) or first.dim() == 0:
        raise ValueError(
            "a batch must be a dict of tensors with the examples along dim 0; got "
            f"{type(batch).__name__} whose first value is {type(first).__name__}"
            + (f" of shape {tuple(first.shape)}" if isinstance(first, torch.Tensor) else "")
        )
    return first.shape[0]


def zero_sum(params: list[torch.Tensor]) -> ClippedSum:
    """The clipped sum of no examples: zeros of every parameter's shape, dtype and device, and no norms."""
    ref = params[0] if params else torch.empty(0, device="cpu")  # no parameters: nothing to follow
    return ClippedSum(
        [torch.zeros_like(p) for p in params], torch.zeros(0, dtype=ref.dtype, device=ref.device), 0
    )


def _sum_materialised(per_ex: list[torch.Tensor], clip, scale) -> ClippedSum:
    if scale is not None:
        per_ex = [g * s for g, s in zip(per_ex, scale, strict=True)]
    b = per_ex[0].shape[0]
    norms = torch.sqrt(
        sum(g.reshape(b, *g.shape[1:], 1).flatten(1).pow(2).sum(1) for g in per_ex)
    )  # flatten, not reshape(b, -1): b may be 0; the trailing 1 keeps a 0-dim parameter's (B,) a matrix
    f = clip_factors(norms, clip)
    summed = [torch.einsum("b,b...->...", f, g) for g in per_ex]
    return ClippedSum(summed, norms, b)


class GradEngine:
    """Base: ``clipped_sum(batch, clip, scale)`` on one micro-batch; ``params`` are the trainable parameters.

    Subclasses implement :meth:`per_example_grads` (materialising engines) or override :meth:`_clipped_sum`;
    :meth:`clipped_sum` checks the scale and answers an empty batch before either runs."""

    name = "engine"
    supports_scale = True
    # the losses' sum of the micro-batch being clipped (ClippedSum.loss_sum), noted by an engine that sees them
    _loss_sum: torch.Tensor | None = None
    #: whether the whole of ``_clipped_sum`` (forward and backward too) runs in full fp32 (``ieee_fp32``)
    fp32_whole = True

    def __init__(self, model: nn.Module, loss_per_example: Callable):
        from dp_adam_bench.engine.support import check_model

        check_model(model, self.name)  # every layer exact for this engine, or a refusal naming it
        self.model = model
        self.loss_per_example = loss_per_example
        self.params = _trainable(model)

    def per_example_grads(self, batch: dict) -> list[torch.Tensor]:
        raise NotImplementedError(f"the {self.name} engine does not materialise per-example gradients")

    def clipped_sum(
        self, batch: dict, clip: float | None, scale: list[torch.Tensor] | None = None
    ) -> ClippedSum:
        """``sum_i clip(s * g_i)`` over the examples of ``batch`` and the norms ``||s * g_i||`` before clipping
        (``s`` = ``scale``, one tensor per trainable parameter, or None)."""
        if scale is not None:
            if not self.supports_scale:
                raise ValueError(
                    f"clipping engine {self.name!r} cannot clip per-coordinate scaled gradients "
                    "(scale-then-privatize); set train.clipping=bk, hooks, functorch or loop"
                )
            scale = list(scale)
            if len(scale) != len(self.params) or any(
                s.shape != p.shape for s, p in zip(scale, self.params, strict=False)
            ):
                raise ValueError(
                    f"{self.name} clipping: scale must hold one tensor of each trainable parameter's shape "
                    f"({len(self.params)} tensors), got {[tuple(s.shape) for s in scale]}"
                )
        if batch_len(batch) == 0:
            return zero_sum(self.params)
        self._loss_sum = None  # an engine whose forward computes the losses notes their sum here
        # norms and sums in the precision they claim: no TF32 / bf16 fp32 math in any kernel (engine/fp32_exact.py);
        # an engine that makes both from captures of its forward and backward narrows this to that part itself
        with ieee_fp32() if self.fp32_whole else contextlib.nullcontext():
            out = self._clipped_sum(batch, clip, scale)
        if out.loss_sum is None:
            out.loss_sum, self._loss_sum = self._loss_sum, None
        return out

    def _clipped_sum(self, batch: dict, clip: float | None, scale: list[torch.Tensor] | None) -> ClippedSum:
        """:meth:`clipped_sum` on a batch of at least one example, ``scale`` already checked."""
        return _sum_materialised(self.per_example_grads(batch), clip, scale)

    def close(self) -> None:
        """Remove hooks so the model is a plain module again."""

    def _hooks(self, enabled: bool) -> None:
        gsm = getattr(self, "gsm", None)
        if gsm is not None:
            (gsm.enable_hooks if enabled else gsm.disable_hooks)()

    def mean_grad(self, batch: dict) -> list[torch.Tensor]:
        """Plain gradient of the mean loss (no per-example work, hooks off): for public side information."""
        return self.plain_grad(batch, "mean")

    def plain_grad(self, batch: dict, reduce: str) -> list[torch.Tensor]:
        """Autograd's gradient of the ``reduce`` (``mean`` or ``sum``) of the per-example losses, hooks off."""
        self._hooks(False)
        try:
            losses = self.loss_per_example(self.model, batch)
            loss = losses.mean() if reduce == "mean" else losses.sum()
            grads = torch.autograd.grad(loss, self.params, allow_unused=True)
        finally:
            self._hooks(True)
        return [g if g is not None else torch.zeros_like(p) for g, p in zip(grads, self.params, strict=True)]


def refuse_in_place(err: RuntimeError, engine: str) -> None:
    """A layer's output modified in place after Opacus' backward hooks wrapped it (``x += residual`` right after
    a hooked layer, as Hugging Face's ResNet does): torch forbids it; one line instead of its traceback."""
    text = str(err)
    if "BackwardHookFunction" in text and ("inplace" in text or "in-place" in text):
        raise ValueError(
            f"clipping {engine}: a hooked layer's output is modified in place (e.g. `x += residual` or "
            "nn.ReLU(inplace=True) right after a layer with parameters), which Opacus' backward hooks do not allow; "
            "use clipping bk (which then records copies of the layers' outputs) or functorch / loop"
        ) from err


def _slice(batch: dict, i: int) -> dict:
    return {k: v[i : i + 1] for k, v in batch.items()}


def loop_grads(model: nn.Module, loss_per_example: Callable, params: list, batch: dict) -> list[torch.Tensor]:
    """Per-example gradients by one forward and backward per example (batches of size one): the oracle."""
    rows = []
    for i in range(batch_len(batch)):
        loss = loss_per_example(model, _slice(batch, i)).sum()
        rows.append(torch.autograd.grad(loss, params, allow_unused=True))
    return [
        torch.stack([r[k] if r[k] is not None else torch.zeros_like(p) for r in rows])
        for k, p in enumerate(params)
    ]


class LoopEngine(GradEngine):
    """One forward/backward per example: slow, obviously correct — the oracle the other engines are tested against."""

    name = "loop"

    def per_example_grads(self, batch):
        return loop_grads(self.model, self.loss_per_example, self.params, batch)


class HooksEngine(GradEngine):
    """Opacus per-layer grad samplers (``GradSampleModule``, hooks mode)."""

    name = "hooks"

    def __init__(self, model, loss_per_example, force_functorch: bool = False):
        from opacus.grad_sample import GradSampleModule

        super().__init__(model, loss_per_example)
        self.gsm = GradSampleModule(
            model, batch_first=True, loss_reduction="sum", strict=True, force_functorch=force_functorch
        )
        self._batch: int | None = None  # set while a batch is recorded: broadcast inputs expand to it
        self._undo = broadcast.install(model, lambda: self._batch, contiguous=True)

    def per_example_grads(self, batch):
        self._batch = batch_len(batch)
        try:
            loss = self.loss_per_example(self.gsm, batch).sum()
        except RuntimeError as err:
            refuse_in_place(err, self.name)
            raise
        finally:
            self._batch = None
        self._loss_sum = loss.detach()
        loss.backward()
        out, b = [], batch_len(batch)
        for p in self.params:
            gs = p.grad_sample
            out.append(gs if gs is not None else p.new_zeros(b, *p.shape))
            p.grad_sample = None
            p.grad = None
        return out

    def close(self):
        for undo in self._undo:
            undo()
        self._undo = []
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
        from torch.nn.attention import SDPBackend, sdpa_kernel

        model, task_loss = self.model, self.loss_per_example

        def one(params, example):
            example = {k: v.unsqueeze(0) for k, v in example.items()}
            state = {**self.frozen, **params, **self.buffers}
            return task_loss(lambda *a, **k: functional_call(model, state, a, k), example).sum()

        params = {n: p.detach() for n, p in zip(self.names, self.params, strict=True)}
        try:
            # the math kernel of scaled_dot_product_attention: CUDA's fused kernels have no vmap rule for a mask
            # batched over examples (nn.MultiheadAttention with a mask: "attn_bias: wrong shape")
            with sdpa_kernel(SDPBackend.MATH):
                grads = vmap(grad(one), in_dims=(None, 0), randomness="different")(params, batch)
        except RuntimeError as err:
            if "vmap" not in str(err) and "functorch" not in str(err).lower():
                raise
            text = str(err)
            why = (
                "data-dependent control flow or .item() in the forward, e.g. Hugging Face's attention-mask code"
                if "data-dependent" in text
                else text.strip().splitlines()[0][:160]
            )
            raise ValueError(
                f"clipping functorch cannot vectorise this model's forward over examples with torch.func.vmap "
                f"({why}); use clipping bk (exact on Hugging Face models) or loop"
            ) from err
        return [grads[n] for n in self.names]


def _refuse_tied(model: nn.Module) -> None:
    """One line, before Opacus raises its NotImplementedError, for a trainable parameter registered in two modules
    (tied embeddings), which Opacus' ghost clipping does not take."""
    owner: dict[int, str] = {}
    for mname, m in model.named_modules():
        for pname, p in m._parameters.items():
            if p is None or not p.requires_grad:
                continue
            full = f"{mname}.{pname}" if mname else pname
            first = owner.setdefault(id(p), full)
            if first != full:
                raise ValueError(
                    f"train.clipping=ghost: {first!r} and {full!r} are one parameter (tied weights), which Opacus' "
                    "ghost clipping does not support; use train.clipping=bk (exact on tied weights), hooks or loop"
                )


class GhostEngine(GradEngine):
    """Opacus ghost clipping: per-example norms without per-example gradients, clipped sum by a second backward."""

    name = "ghost"
    supports_scale = False

    def __init__(self, model, loss_per_example):
        from opacus.grad_sample import GradSampleModuleFastGradientClipping

        super().__init__(model, loss_per_example)
        _refuse_tied(model)
        self.gsm = GradSampleModuleFastGradientClipping(
            model, batch_first=True, loss_reduction="sum", max_grad_norm=1.0, use_ghost_clipping=True
        )
        self._calls: dict[str, int] | None = None  # calls per layer in the forward of _clipped_sum
        self._batch: int | None = None  # set while a batch is recorded: broadcast inputs expand to it
        self._undo = broadcast.install(model, lambda: self._batch, contiguous=True)
        self._guards = [
            m.register_forward_pre_hook(self._guard(name or "<root>", m))
            for name, m in model.named_modules()
            if any(p.requires_grad for p in m.parameters(recurse=False))
        ]

    def _guard(self, name: str, module: nn.Module):
        """Refuse, before Opacus fails deep inside, what its ghost norms do not take: a Linear on inputs of more
        than 3 dimensions, and a layer called twice in one forward (module reuse)."""

        def check(m, args):
            x = args[0] if args else None
            if type(module) is nn.Linear and isinstance(x, torch.Tensor) and x.dim() > 3:
                raise ValueError(
                    f"train.clipping=ghost: Linear {name!r} got a {x.dim()}-D input {tuple(x.shape)}; Opacus' ghost "
                    "norms take 2-D or 3-D inputs only; use train.clipping=bk or functorch"
                )
            if self._calls is not None:
                self._calls[name] = self._calls.get(name, 0) + 1
                if self._calls[name] > 1:
                    raise ValueError(
                        f"train.clipping=ghost: layer {name!r} is called more than once in one forward (module "
                        "reuse), which Opacus' ghost clipping does not support; use train.clipping=bk or functorch"
                    )

        return check

    def _clipped_sum(self, batch, clip, scale):
        self._calls, self._batch = {}, batch_len(batch)
        try:
            losses = self.loss_per_example(self.gsm, batch)
        except RuntimeError as err:
            refuse_in_place(err, self.name)
            raise
        finally:
            self._calls, self._batch = None, None
        self._loss_sum = losses.detach().sum()
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
        return ClippedSum(summed, norms, batch_len(batch))

    def close(self):
        for h in self._guards:
            h.remove()
        for undo in self._undo:
            undo()
        self._guards, self._undo = [], []
        self.gsm._close()
