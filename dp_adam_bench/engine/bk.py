"""Book-keeping (BK) per-example clipping: one forward, one backward, no second backward.

Z. Bu, Y.-X. Wang, S. Zha and G. Karypis, "Differentially private optimization on large model at small cost",
ICML 2023, arXiv:2210.00038 (book-keeping, BK-MixOpt); X. Li, F. Tramèr, P. Liang and T. Hashimoto, "Large language
models can be strong differentially private learners", ICLR 2022, arXiv:2110.05679 (ghost clipping).

How one micro-batch is processed (``BKEngine.clipped_sum``):

1. **Forward** with hooks: a forward hook on every layer with trainable parameters keeps that call's inputs
   (detached) and passes the layer's output through ``_Capture``, an identity autograd function. All ``_Capture``
   nodes also take one scalar *anchor* leaf. (Attention, whose parameters act inside its forward, captures its
   projections itself: :mod:`dp_adam_bench.engine.bk_rules.attention`.)
2. **One backward**: ``torch.autograd.grad(sum_i loss_i, anchor)``. Each ``_Capture`` node stores the gradient
   of the summed loss with respect to its layer's output, ``g``. Because only the anchor is requested, autograd
   prunes the parameter branches: the (non-clipped) weight gradients are never computed and ``p.grad`` is never
   touched, so the backward costs roughly the input-gradient half of a normal one.
3. **Per-layer norms** from ``(a, g)`` by the layer's rule (:mod:`dp_adam_bench.engine.bk_rules`, one small module
   per layer family, each tested against the loop over batches of size one): for weight matrices the Gram form or
   the instantiated per-example gradient, whichever is cheaper (``use_gram``; the choice is recorded in
   ``BKEngine.choices``).
4. **Clip factors** ``c_i = min(1, C / ||g_i||)`` from the summed squared norms of all layers.
5. **Clipped sum** per layer, without another backward: ``sum_i c_i G_i^T A_i`` as one matmul ``(c * G)^T A``
   (Gram path) or as the c-weighted sum of the instantiated per-example gradients.

bk owns a rule for every layer it accepts (no delegation to Opacus, whose rules are wrong on several
configurations: :mod:`dp_adam_bench.engine.support`); any other parameterised module is refused before the run,
naming it and the engines that support it.

A module called several times in one forward (weight sharing by *module reuse*, e.g. a block applied twice)
is exact: its calls are concatenated along the position axis, since the per-example gradient is the sum over
all positions of all calls. The same ``nn.Parameter`` registered in two modules (tied embeddings) is refused,
as Opacus ghost clipping does.

**Scale-then-privatize** (Ganesh et al. Alg. 8: clip ``s * g_i`` for a per-coordinate scale ``s``): the Gram form
cannot see a per-coordinate scale, so with ``scale`` every dense layer computes its per-example weight gradients
in chunks of examples (``||S * (G_i^T A_i)||_F^2``, never the whole (B, p, d) tensor at once) and embeddings take
the distinct-(example, token) path; the clipped sum stays one matmul, ``S * ((c * G)^T A)``, since the scale is
the same for every example. Still one forward and one backward.

Limitations: the batch must be the first dimension of every hooked layer's input (a wrong leading size is refused,
e.g. HF ``position_ids`` of shape (1, T) — pass (B, T) — but a sequence-first input whose length happens to equal B
cannot be told apart, as in Opacus; ``nn.MultiheadAttention`` handles its own ``batch_first=False``); a hooked
layer's output must not be modified in place afterwards (refused with a ValueError, as torch refuses it with full
backward hooks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from dp_adam_bench.engine.bk_rules import Rule, adapter_for, rule_for
from dp_adam_bench.engine.bk_rules.dense import GRAM_FACTOR, use_gram  # noqa: F401  (re-exported)
from dp_adam_bench.engine.grads import ClippedSum, GradEngine, batch_len, clip_factors

MODES = ("auto", "gram", "instantiate")


@dataclass
class _Call:
    """One captured call of a layer (or one projection inside it: ``piece``): its inputs, and after the backward
    the gradient of the summed loss with respect to its output."""

    args: tuple
    kwargs: dict
    piece: str | None = None
    grad: torch.Tensor | None = None


@dataclass
class _Layer:
    name: str
    module: nn.Module
    rule: Rule
    params: list[nn.Parameter]  # the module's own trainable parameters
    calls: list[_Call] = field(default_factory=list)

    @property
    def kind(self) -> str:
        return self.rule.kind


class _Capture(torch.autograd.Function):
    """Identity on a layer's output that records the gradient reaching it. Its second input, the anchor, is the
    only tensor the backward asks for, so autograd runs exactly the nodes that lead to some capture: the
    output-gradient chain, never the parameters' (non-clipped) gradients."""

    @staticmethod
    def forward(ctx, out, anchor, call):
        ctx.call = call
        return out

    @staticmethod
    def backward(ctx, grad):
        ctx.call.grad = grad.detach()
        return grad, None, None


def _check_untied(model: nn.Module) -> None:
    """Refuse one ``nn.Parameter`` registered in two different modules (reusing a whole module is fine)."""
    owner: dict[int, tuple[nn.Module, str]] = {}
    for mname, m in model.named_modules(remove_duplicate=False):
        for pname, p in m._parameters.items():
            if p is None:
                continue
            full = f"{mname}.{pname}" if mname else pname
            first = owner.setdefault(id(p), (m, full))
            if first[0] is not m:
                raise ValueError(
                    f"parameter tying is not supported by the bk clipping engine: {first[1]!r} and {full!r} are "
                    "the same tensor in two modules. Untie them (e.g. tie_word_embeddings=False and copy the "
                    "weights) or use train.clipping=hooks or train.clipping=functorch"
                )


def _refuse_in_place(err: RuntimeError) -> None:
    """A captured output modified in place: torch says so in the forward (a custom Function's output is a view)
    or, where it is not treated as a view, in the backward (a saved tensor's version changed); one message."""
    text = str(err)
    if "_Capture" in text and ("inplace" in text or "in-place" in text):
        raise ValueError(
            "bk clipping: the output of a hooked layer is modified in place (e.g. nn.ReLU(inplace=True) or `+=` "
            "right after a Linear / Conv / Embedding / norm layer); make that operation out of place or use "
            "train.clipping=functorch"
        ) from err


def _in_precision(call: _Call, dtype: torch.dtype) -> _Call:
    """``call`` with its floating inputs and output gradient at least in ``dtype`` (the parameters' precision)."""

    def up(t):
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype:
            return t.to(torch.promote_types(t.dtype, dtype))
        return t

    call.args = tuple(up(t) for t in call.args)
    call.kwargs = {k: up(v) for k, v in call.kwargs.items()}
    call.grad = up(call.grad)
    return call


#: rule kinds that bring their captures to the parameters' precision a chunk at a time (bk_rules.dense)
_CHUNKED_PRECISION = ("linear", "conv")


def _captured_bytes(layers) -> int:
    """Bytes of the distinct storages the layers' calls hold (inputs and output gradients)."""
    seen: dict[int, int] = {}
    for layer in layers:
        for call in layer.calls:
            for t in (*call.args, *call.kwargs.values(), call.grad):
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    st = t.untyped_storage()
                    seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _detach(t):
    return t.detach() if isinstance(t, torch.Tensor) else t


class BKEngine(GradEngine):
    """Book-keeping clipping: per-example norms and the clipped sum from one forward and one backward.

    ``mode``: ``auto`` (per-layer ``use_gram``), or ``gram`` / ``instantiate`` to force one path for the weight
    matrices and embeddings (tests, experiments). ``choices`` maps each such layer (or attention projection) to
    the path its last ``clipped_sum`` took.
    """

    name = "bk"

    def __init__(self, model: nn.Module, loss_per_example, mode: str = "auto"):
        if mode not in MODES:
            raise ValueError(f"bk mode={mode!r}; valid: {', '.join(MODES)}")
        super().__init__(model, loss_per_example)  # refuses every layer without an exact rule
        self.mode = mode
        self.choices: dict[str, str] = {}
        #: diagnostic, of the last clipped_sum: ``captured_bytes`` (inputs and output gradients held after the
        #: backward) and ``per_example_bytes`` (per-example gradients kept until the clipped sum)
        self.memory: dict[str, int] = {"captured_bytes": 0, "per_example_bytes": 0}
        self.dtype = self.params[0].dtype if self.params else torch.float32
        _check_untied(model)
        self.layers: list[_Layer] = []
        for mname, m in model.named_modules():
            params = [p for p in m._parameters.values() if p is not None and p.requires_grad]
            if params:
                self.layers.append(_Layer(mname or "<root>", m, rule_for(m), params))
        # set only inside clipped_sum: outside it (evaluation, mean_grad) nothing is recorded
        self._anchor: torch.Tensor | None = None
        self._batch = 0
        self._scale: dict[int, torch.Tensor] | None = None  # id(param) -> per-coordinate scale (stp only)
        self._undo = []
        for mname, m in model.named_modules():
            adapter = adapter_for(m)
            undo = adapter(self, mname, m) if adapter is not None else None
            if undo is not None:
                self._undo.append(undo)
        for layer in self.layers:
            if layer.rule.install is not None:
                self._undo.append(layer.rule.install(self, layer))
            else:
                handle = layer.module.register_forward_hook(self._make_hook(layer), with_kwargs=True)
                self._undo.append(handle.remove)

    # --- capture (used by the hooks and by rules that capture inside a forward) ----------------------------------
    def recording(self) -> bool:
        return self._anchor is not None and torch.is_grad_enabled()

    def capture(self, layer: _Layer, out: torch.Tensor, args: tuple, kwargs: dict | None = None, piece=None):
        """``out`` routed through ``_Capture`` with a new call of ``layer`` holding ``args`` (the first one must
        have the examples along dim 0); ``out`` itself when nothing is being recorded."""
        if not self.recording() or not isinstance(out, torch.Tensor) or not out.requires_grad:
            return out
        if args:
            x = args[0]
            if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[0] != self._batch:
                shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise ValueError(
                    f"bk clipping: layer {layer.name!r} ({type(layer.module).__name__}) got an input of shape "
                    f"{shape}, whose first dimension is not the batch size {self._batch}; every hooked layer needs "
                    "the examples along dim 0 (for Hugging Face models pass position_ids / token_type_ids of "
                    "shape (B, T))"
                )
        call = _Call(
            tuple(_detach(t) for t in args), {k: _detach(v) for k, v in (kwargs or {}).items()}, piece
        )
        layer.calls.append(call)
        return _Capture.apply(out, self._anchor, call)

    def _make_hook(self, layer: _Layer):
        def hook(module, args, kwargs, output):
            if not self.recording():
                return None
            return self.capture(
                layer, output, tuple(args) if args else tuple(kwargs.values()), kwargs if args else None
            )

        return hook

    # --- what rules ask of the engine -----------------------------------------------------------------------------
    def path(self, name: str, T: int, d: int, p: int, embedding: bool = False, fits: bool = True) -> bool:
        """Whether the layer ``name`` takes the Gram form (True) or instantiates per-example gradients; recorded
        in ``choices``. An embedding's instantiated path only sums the T output gradients per distinct token;
        ``fits``: see :func:`~dp_adam_bench.engine.bk_rules.dense.use_gram`."""
        if self._scale is not None:  # a per-coordinate scale: only instantiated per-example gradients see it
            gram = False
        elif self.mode != "auto":
            gram = self.mode == "gram"
        else:
            gram = T == 1 if embedding else use_gram(T, d, p, fits)
        self.record(name, "gram" if gram else "instantiate")
        return gram

    def record(self, name: str, choice: str) -> None:
        self.choices[name] = choice

    def kept(self, t: torch.Tensor) -> None:
        """Note a per-example gradient tensor a rule keeps until the clipped sum (``memory``)."""
        self.memory["per_example_bytes"] += t.numel() * t.element_size()

    def scale_of(self, param: nn.Parameter | None) -> torch.Tensor | None:
        """The per-coordinate scale of ``param`` (scale-then-privatize), or None."""
        return None if self._scale is None or param is None else self._scale[id(param)]

    def scaled(self, per_ex: dict) -> dict:
        """Instantiated per-example gradients ``{param: (B, *shape)}`` times their scales, if any."""
        if self._scale is None:
            return per_ex
        return {p: t * self._scale[id(p)] for p, t in per_ex.items()}

    # --- engine interface -------------------------------------------------------------------------------------------
    def _clipped_sum(self, batch, clip, scale):
        b = batch_len(batch)
        if scale is not None:  # shapes checked by GradEngine.clipped_sum
            self._scale = {id(p): s.to(p.dtype) for p, s in zip(self.params, scale, strict=True)}
        ref = self.params[0]
        self.dtype = ref.dtype  # the precision of norms, clip factors and sums (rules read it)
        anchor = torch.zeros((), dtype=ref.dtype, device=ref.device, requires_grad=True)
        for layer in self.layers:
            layer.calls = []
        self._anchor, self._batch = anchor, b
        try:
            try:
                losses = self.loss_per_example(self.model, batch)
            except RuntimeError as err:
                _refuse_in_place(err)
                raise
            finally:
                self._anchor = None
            if losses.shape != (b,):
                raise ValueError(
                    f"bk clipping: loss_per_example returned shape {tuple(losses.shape)}, want ({b},)"
                )
            try:
                torch.autograd.grad(losses.sum(), [anchor], allow_unused=True)
            except RuntimeError as err:
                _refuse_in_place(err)
                raise
            sq = torch.zeros(b, dtype=ref.dtype, device=ref.device)
            finishers = []
            self.memory = {"captured_bytes": _captured_bytes(self.layers), "per_example_bytes": 0}
            # under mixed precision (autocast) the captures are bf16 / fp16: norms, clip factors and sums are
            # computed in the parameters' precision, outside autocast (which would cast the matmuls down again);
            # the dense rules (Linear, convolutions: most of the captured memory) bring a chunk at a time to that
            # precision, the others their whole (small) captures
            with torch.autocast(ref.device.type, enabled=False):
                for layer in self.layers:
                    calls = [call for call in layer.calls if call.grad is not None]
                    if layer.kind not in _CHUNKED_PRECISION:
                        calls = [_in_precision(call, ref.dtype) for call in calls]
                    if not calls:
                        continue
                    layer_sq, finish = layer.rule.compute(self, layer, calls, b)
                    layer.calls = []  # what the clipped sum needs is now held by ``finish``
                    sq = sq + layer_sq.to(sq.dtype)
                    finishers.append(finish)
                norms = sq.sqrt()
                f = clip_factors(norms, clip)
                found: dict[int, torch.Tensor] = {}
                for finish in finishers:
                    for p, s in finish(f).items():
                        found[id(p)] = s
        finally:
            self._scale = None
            for layer in self.layers:
                layer.calls = []
        summed = [found[id(p)].detach() if id(p) in found else torch.zeros_like(p) for p in self.params]
        return ClippedSum(summed, norms.detach(), b)

    def close(self):
        for undo in self._undo:
            undo()
        self._undo = []
