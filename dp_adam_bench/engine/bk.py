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

bk owns a rule for every layer type it knows (no delegation to Opacus, whose rules are wrong on several
configurations: :mod:`dp_adam_bench.engine.support`). A module with parameters of its own and no rule (a
``cls_token``, ``LlamaRMSNorm``, a 0-dim logit scale on the root, a subclass of a known layer) takes the generic
rule (:mod:`dp_adam_bench.engine.bk_rules.generic`): its forward recomputed one example at a time from the captured
inputs, refused naming the module where the recomputation does not reproduce the batch's output.

A module called several times in one forward (weight sharing by *module reuse*, e.g. a block applied twice)
is exact: its calls are concatenated along the position axis, since the per-example gradient is the sum over
all positions of all calls. The same ``nn.Parameter`` registered in several modules that all run (tied input and
output embeddings, an encoder-decoder's ``shared`` table) is exact too: its per-example gradient is the sum over
the layers, so its squared norm takes the cross terms between them besides each layer's own, which
:mod:`dp_adam_bench.engine.bk_rules.shared` adds (the two-layer Gram form, or instantiated gradients), and its
clipped sum is the sum of the layers'. A layer whose rule cannot hand in its part (a convolution, attention) is
refused naming it (:func:`dp_adam_bench.fix_model` unties those, and only those).

**Scale-then-privatize** (Ganesh et al. Alg. 8: clip ``s * g_i`` for a per-coordinate scale ``s``): the Gram form
cannot see a per-coordinate scale, so with ``scale`` every dense layer computes its per-example weight gradients
in chunks of examples (``||S * (G_i^T A_i)||_F^2``, never the whole (B, p, d) tensor at once) and embeddings take
the distinct-(example, token) path; the clipped sum stays one matmul, ``S * ((c * G)^T A)``, since the scale is
the same for every example. Still one forward and one backward.

Inputs broadcast over the batch (a hooked layer called with a leading size of 1, as Hugging Face's (1, T)
``position_ids``) are expanded to one row per example before the layer runs (:mod:`dp_adam_bench.engine.broadcast`),
so each example's gradient through them is its own; T5's relative position bias, looked up with a table that has no
batch dimension at all, has its own adapter (:mod:`dp_adam_bench.engine.bk_rules.t5`).

A hooked layer whose input leads with rows that are not one per example (OPT's (B·T, H) before its feed-forward
block, Swin's (B·windows, tokens, C), the real tokens of a batch with its padding dropped) is *folded*: after the
backward, each row's example is read off a second backward of the losses weighted by example
(:mod:`dp_adam_bench.engine.folds`), on every batch (an arrangement can depend on the data: never kept from one
batch for the next), over the part of the graph above the deepest folded call; the rows are then gathered per
example as more positions. An input expanded from a row shared by the batch is read the same way. The Linear,
Embedding and norm rules and the generic rule take folded inputs; a convolution, ``nn.MultiheadAttention`` or
``EmbeddingBag`` with a folded input is refused naming the layer, and so is a row that carries the losses of
several examples.

Limitations: a sequence-first input whose length happens to equal B cannot be told apart from a batch-first one, as
in Opacus (``nn.MultiheadAttention`` handles its own ``batch_first=False``; the self-check compares with the loop);
a layer whose input leads with B is taken to hold example i in row i, unread: a model that reorders its batch between
layers (sorting it by length, as packing does) gets wrong norms there, seen only by the self-check and the watch;
a hooked layer's output must not be modified in place afterwards (refused with a ValueError, as torch refuses it
with full backward hooks).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils import _pytree as pytree

from dp_adam_bench.engine import folds
from dp_adam_bench.engine.bk_rules import Rule, adapter_for, rule_for
from dp_adam_bench.engine.bk_rules.dense import GRAM_FACTOR, use_gram  # noqa: F401  (re-exported)
from dp_adam_bench.engine.bk_rules.generic import GENERIC
from dp_adam_bench.engine.bk_rules.shared import Use, cross_terms
from dp_adam_bench.engine.broadcast import expand_primary
from dp_adam_bench.engine.fp32_exact import ieee_fp32
from dp_adam_bench.engine.grads import ClippedSum, GradEngine, batch_len, clip_factors
from dp_adam_bench.engine.support import own_trainable

MODES = ("auto", "gram", "instantiate")


@dataclass
class _Call:
    """One captured call of a layer (or one projection inside it: ``piece``): its inputs, and after the backward
    the gradient of the summed loss with respect to its output."""

    args: tuple
    kwargs: dict
    piece: str | int | None = None
    grad: torch.Tensor | None = None
    output: torch.Tensor | None = None  # generic rule: the output it must reproduce
    group: int = 0  # generic rule: the forward call this piece belongs to
    #: the output (generic rule) or primary input leads with rows that are not one per example (engine/folds.py)
    folded: bool = False
    #: generic rule: an output shared by every example, expanded to the rows of its parent's folded input
    broadcast: bool = False
    rows: torch.Tensor | None = None  # (B, k): each example's rows, once placed (engine/folds.py)
    fold_kind: str | None = None  # "example", "position" or "irregular"
    fold_inputs: frozenset = frozenset()  # generic rule: flat indices of the inputs gathered per example


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
    output-gradient chain, never the parameters' (non-clipped) gradients. A folded call's capture also takes the
    *fold anchor*: the probe backwards of :mod:`~dp_adam_bench.engine.folds` ask for that one alone, so they run
    only the part of the graph above the deepest folded call."""

    @staticmethod
    def forward(ctx, out, anchor, call, clone=False, fold_anchor=None):
        ctx.call = call
        # returned as is, the output is a view of the layer's own; a copy where the model changes it in place
        return out.clone() if clone else out

    @staticmethod
    def backward(ctx, grad):
        ctx.call.grad = grad.detach()
        return grad, None, None, None, None


def _unshareable(shared: dict) -> None:
    """Refuse, naming the layer, a use of a shared parameter whose rule handed the engine no per-example form of its
    gradient (:mod:`~dp_adam_bench.engine.bk_rules.shared`): its cross terms with the other uses cannot be
    computed, so the parameter's per-example norm would be wrong."""
    for name, _, active, uses in shared.values():
        given = {u.layer for u in uses}
        missing = [layer for layer in active if layer.name not in given]
        if missing:
            layer = missing[0]
            others = ", ".join(repr(x.name) for x in active if x is not layer)
            raise ValueError(
                f"bk clipping: parameter {name!r} is used by layer {layer.name!r} ({type(layer.module).__name__}, "
                f"bk rule {layer.kind!r}) and by {others} in one forward (tied weights), and the {layer.kind} rule "
                "cannot add its per-example gradient to the others'; untie it there (dp_adam_bench.fix_model) or "
                "use clipping functorch / loop"
            )


def _in_place(err: RuntimeError) -> bool:
    """A captured output modified in place: torch says so in the forward (a custom Function's output is a view)
    or, where it is not treated as a view, in the backward (a saved tensor's version changed)."""
    text = str(err)
    return "_Capture" in text and ("inplace" in text or "in-place" in text)


def _refuse_in_place(err: RuntimeError) -> None:
    """One message for an in-place change that copies of the captured outputs did not cure."""
    if _in_place(err):
        raise ValueError(
            "bk clipping: the output of a hooked layer is modified in place (e.g. nn.ReLU(inplace=True) or `+=` "
            "right after a Linear / Conv / Embedding / norm layer); make that operation out of place or use "
            "train.clipping=functorch"
        ) from err


@dataclass
class _BatchCall:
    """What one :meth:`BKEngine.clipped_sum` holds while it runs, made at its start and dropped at its end: the
    batch's ``b`` examples, the per-coordinate scale (scale-then-privatize: id(param) -> scale), the anchors the
    captures hang on while its forward is recorded (the folded calls' second one too), the layers whose broadcast
    input was expanded in call order and those whose call has yet to be captured, and, while its norms are
    computed, the parameters several layers used (id(param) -> (name, param, its layers, their Uses);
    bk_rules/shared.py)."""

    b: int
    scale: dict[int, torch.Tensor] | None = None
    anchor: torch.Tensor | None = None
    fold_anchor: torch.Tensor | None = None
    expanded: list = field(default_factory=list)
    pending: set = field(default_factory=set)
    shared: dict[int, tuple] = field(default_factory=dict)


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


#: how many layers' broadcast expansion a batch may undo (each: the forward once more) before its error stands
_MAX_UNEXPANDED = 64

#: rule kinds that take a folded input as more positions per example (engine/folds.py): their per-example gradient
#: is a sum over rows, and they read only the primary input
_FOLDABLE = ("linear", "embedding", "layernorm", "rmsnorm")


def _unfolded(call: _Call) -> _Call:
    """A folded call with its rows gathered per example (:mod:`dp_adam_bench.engine.folds`): the output gradient,
    the output and every input leading with the same rows become (B, k, ...); an output shared by every example
    (``broadcast``) gets its examples' row gradients summed, and is an ordinary per-example piece again."""
    if not call.folded or call.rows is None:
        return call
    index = call.rows
    R = call.grad.shape[0]
    if index.shape == (R, 1) and torch.equal(index[:, 0], torch.arange(R, device=index.device)):
        call.folded = False  # one row per example, each its own (an expanded input or output): as it is
        return call
    call.grad = folds.gather(call.grad, index)
    if call.output is not None:
        call.output = folds.gather(call.output, index)
    if call.broadcast:
        call.grad = call.grad.sum(1)
        call.output = call.output[:, 0]
        call.folded = False
        return call
    flat, spec = pytree.tree_flatten((call.args, call.kwargs))
    gathered = set()
    for k, t in enumerate(flat):
        if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == R:
            flat[k] = folds.gather(t, index)
            gathered.add(k)
    call.args, call.kwargs = pytree.tree_unflatten(flat, spec)
    call.fold_inputs = frozenset(gathered)
    return call


class BKEngine(GradEngine):
    """Book-keeping clipping: per-example norms and the clipped sum from one forward and one backward.

    ``mode``: ``auto`` (per-layer ``use_gram``), or ``gram`` / ``instantiate`` to force one path for the weight
    matrices and embeddings (tests, experiments). ``choices`` maps each such layer (or attention projection) to
    the path its last ``clipped_sum`` took.
    """

    name = "bk"
    fp32_whole = False  # only the rules' norms and sums run in full fp32 (see _clipped_sum)

    def __init__(self, model: nn.Module, loss_per_example, mode: str = "auto"):
        if mode not in MODES:
            raise ValueError(f"bk mode={mode!r}; valid: {', '.join(MODES)}")
        super().__init__(model, loss_per_example)  # refuses every layer without an exact rule
        self.mode = mode
        self.choices: dict[str, str] = {}
        #: diagnostic, of the last clipped_sum: ``captured_bytes`` (inputs and output gradients held after the
        #: backward) and ``per_example_bytes`` (per-example gradients kept until the clipped sum)
        self.memory: dict[str, int] = {"captured_bytes": 0, "per_example_bytes": 0}
        if not self.params:
            raise ValueError(
                "bk clipping: the model has no trainable parameters (requires_grad=True): nothing to train privately"
            )
        self.dtype = self.params[0].dtype
        #: the name each trainable parameter is reported by (its first registration: ``shared.weight`` of T5)
        self._param_names = {id(p): n for n, p in model.named_parameters()}
        self.layers: list[_Layer] = []
        for mname, m in model.named_modules():
            own = own_trainable(m)
            if own:
                self.layers.append(_Layer(mname or "<root>", m, rule_for(m) or GENERIC, list(own.values())))
        # what one clipped_sum holds while it runs (_BatchCall), None outside it: evaluation and mean_grad record
        # nothing, and nothing of a batch outlives its clipped sum
        self._call: _BatchCall | None = None
        self._undo = []
        for mname, m in model.named_modules():
            adapter = adapter_for(m)
            undo = adapter(self, mname, m) if adapter is not None else None
            if undo is not None:
                self._undo.append(undo)
        self._group = 0
        #: the layers never to expand (their expansion broke the model's forward)
        self._no_expand: set[str] = set()
        #: generic rule: per module, the inputs (flat indices) its last replay took per example (bk_rules/generic.py)
        self.replay_splits: dict[str, frozenset] = {}
        # set once a forward modified a captured output in place (Hugging Face's ResNet: `hidden += residual` on a
        # norm's output): from then on the captures return copies (one more activation-sized tensor per layer)
        self._clone = False
        #: generic rule: each module's parent, and while recording the leading size of each such parent's input
        self._parents: dict[str, nn.Module] = {}
        self._rows_in: dict[nn.Module, int] = {}
        #: engine/folds.py: probe backwards run (each folded batch of more than one example reads its rows' owners)
        self.fold_probes = 0
        modules = dict(model.named_modules())
        for layer in self.layers:
            if layer.rule is GENERIC and layer.name != "<root>":
                parent = modules[layer.name.rpartition(".")[0]]
                if parent not in self._rows_in:
                    self._rows_in[parent] = 0
                    pre = parent.register_forward_pre_hook(self._note_rows, with_kwargs=True)
                    self._undo.append(pre.remove)
                self._parents[layer.name] = parent
        self._rows_in.clear()
        for layer in self.layers:
            if layer.rule.install is not None:
                self._undo.append(layer.rule.install(self, layer))
            elif layer.rule is GENERIC:
                handle = layer.module.register_forward_hook(self._make_generic_hook(layer), with_kwargs=True)
                self._undo.append(handle.remove)
            else:
                pre = layer.module.register_forward_pre_hook(self._make_pre_hook(layer), with_kwargs=True)
                handle = layer.module.register_forward_hook(self._make_hook(layer), with_kwargs=True)
                self._undo += [pre.remove, handle.remove]

    # --- capture (used by the hooks and by rules that capture inside a forward) ----------------------------------
    def recording(self) -> bool:
        return self._call is not None and self._call.anchor is not None and torch.is_grad_enabled()

    @contextmanager
    def not_recording(self):
        """Nothing is recorded inside the block (a rule running the original module for a reference)."""
        call = self._call
        anchor = call.anchor if call is not None else None
        if call is not None:
            call.anchor = None
        try:
            yield
        finally:
            if call is not None:
                call.anchor = anchor

    @property
    def batch_size(self) -> int:
        """The examples of the batch being recorded (0 outside a clipped sum)."""
        return self._call.b if self._call is not None else 0

    def capture(
        self,
        layer: _Layer,
        out: torch.Tensor,
        args: tuple,
        kwargs: dict | None = None,
        piece=None,
        folded: bool = False,
    ):
        """``out`` routed through ``_Capture`` with a new call of ``layer`` holding ``args`` (the first one must
        have the examples along dim 0); ``out`` itself when nothing is being recorded. ``folded``: its rows are to
        be placed per example after the backward (engine/folds.py) even though the input leads with B (an input
        the engine expanded from a row shared by the batch)."""
        if not self.recording() or not isinstance(out, torch.Tensor) or not out.requires_grad:
            return out
        if args:
            x = args[0]
            own = ", ".join(own_trainable(layer.module))
            if not isinstance(x, torch.Tensor) or x.dim() == 0:
                shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise ValueError(
                    f"bk clipping: layer {layer.name!r} ({type(layer.module).__name__}, parameters {own}) got an "
                    f"input of shape {shape}, without the examples along a first dimension, so each example's "
                    "gradient of the layer cannot be told apart; freeze the layer (requires_grad_(False)), feed it "
                    "one row per example, or use clipping loop"
                )
            if x.shape[0] != self._call.b:
                if layer.kind not in _FOLDABLE:
                    raise ValueError(
                        f"bk clipping: layer {layer.name!r} ({type(layer.module).__name__}, parameters {own}) got "
                        f"an input of shape {tuple(x.shape)}, whose first dimension is not the batch size "
                        f"{self._call.b}: the examples are folded into another dimension, which bk's "
                        f"{layer.kind} rule cannot take apart (the Linear, Embedding and norm rules and the "
                        "generic rule can); freeze the layer (requires_grad_(False)), feed it one row per "
                        "example, or use clipping functorch / loop"
                    )
                folded = True  # its rows are placed after the backward (engine/folds.py)
        call = _Call(
            tuple(_detach(t) for t in args), {k: _detach(v) for k, v in (kwargs or {}).items()}, piece
        )
        call.folded = folded
        layer.calls.append(call)
        return _Capture.apply(
            out, self._call.anchor, call, self._clone, self._call.fold_anchor if folded else None
        )

    def _note_rows(self, module, args, kwargs):
        """Pre-hook on a generic module's parent: the leading size of its first tensor input while recording."""
        if self.recording():
            first = next(
                (t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.dim()), None
            )
            self._rows_in[module] = first.shape[0] if first is not None else self._call.b

    def _make_pre_hook(self, layer: _Layer):
        """Inputs broadcast over the batch (:mod:`dp_adam_bench.engine.broadcast`) expanded to one row per example;
        which row each example then uses is checked after the backward like a folded input's (engine/folds.py): a
        model that reads row 0 for every example (Swinv2's position-bias MLP, viewed and indexed) is refused, not
        silently given all examples' gradients in row 0. A layer whose expansion made the forward fail (a model
        that reshapes with the size it expects) is called as the model calls it from then on."""

        def pre(module, args, kwargs):
            if not self.recording() or layer.name in self._no_expand:
                return None
            out = expand_primary(args, kwargs, self._call.b)
            if out is not None:
                self._call.expanded.append(layer)
                self._call.pending.add(id(layer))
            return out

        return pre

    def _make_generic_hook(self, layer: _Layer):
        """Capture for a module without a rule (:mod:`~dp_adam_bench.engine.bk_rules.generic`): its inputs as
        called (positional and keyword), and every floating output tensor that needs a gradient, with its value."""

        parent = self._parents.get(layer.name)

        def hook(module, args, kwargs, output):
            if not self.recording():
                return None
            b = self._call.b
            leaves, spec = pytree.tree_flatten(output)
            stored = pytree.tree_map(_detach, (tuple(args), dict(kwargs)))
            self._group += 1
            new = []
            for k, t in enumerate(leaves):
                if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point():
                    folded = broadcast = False
                    if t.dim() > 0 and t.shape[0] == 1 and b > 1:
                        # broadcast over the batch: one row per example, or per row of the parent's input where
                        # that folds the examples (Swin's relative position bias beside (B·windows, ...) scores);
                        # which example uses which row is read after the backward (engine/folds.py), as for an
                        # expanded input: a model that reads one copy for every example is refused
                        rows = max(self._rows_in.get(parent, b), b)
                        broadcast, folded = rows != b, True
                        t = t.expand(rows, *t.shape[1:])
                    elif t.dim() == 0:
                        raise ValueError(
                            f"bk clipping: module {layer.name!r} ({type(module).__name__}) has parameters of its "
                            f"own and returns a 0-dim output, without the batch ({b}) along dim 0, so no example's "
                            "gradient of its parameters can be told apart; return a batched tensor (e.g. x * s "
                            "instead of s) or use clipping functorch / loop"
                        )
                    elif t.shape[0] != b:
                        folded = True  # its rows are placed after the backward (engine/folds.py)
                    call = _Call(*stored, piece=k, output=t.detach(), group=self._group)
                    call.folded, call.broadcast = folded, broadcast
                    layer.calls.append(call)
                    t = _Capture.apply(
                        t, self._call.anchor, call, self._clone, self._call.fold_anchor if folded else None
                    )
                new.append(t)
            return pytree.tree_unflatten(new, spec)

        return hook

    def _make_hook(self, layer: _Layer):
        def hook(module, args, kwargs, output):
            if not self.recording():
                return None
            expanded = id(layer) in self._call.pending
            self._call.pending.discard(id(layer))
            # an expanded input's rows are checked after the backward like a fold's (engine/folds.py)
            return self.capture(
                layer,
                output,
                tuple(args) if args else tuple(kwargs.values()),
                kwargs if args else None,
                folded=expanded,
            )

        return hook

    # --- what rules ask of the engine -----------------------------------------------------------------------------
    def path(self, name: str, T: int, d: int, p: int, embedding: bool = False, fits: bool = True) -> bool:
        """Whether the layer ``name`` takes the Gram form (True) or instantiates per-example gradients; recorded
        in ``choices``. An embedding's instantiated path only sums the T output gradients per distinct token;
        ``fits``: see :func:`~dp_adam_bench.engine.bk_rules.dense.use_gram`."""
        # a per-coordinate scale: only instantiated per-example gradients see it
        if self._scale() is not None:
            gram = False
        elif self.mode != "auto":
            gram = self.mode == "gram"
        else:
            gram = T == 1 if embedding else use_gram(T, d, p, fits)
        self.record(name, "gram" if gram else "instantiate")
        return gram

    def record(self, name: str, choice: str) -> None:
        self.choices[name] = choice

    def shares(self, param: nn.Parameter | None) -> bool:
        """Whether ``param`` is used by several layers in the batch being computed: their rules then hand in
        its per-example gradient with :meth:`share`."""
        return param is not None and self._call is not None and id(param) in self._call.shared

    def share(self, param: nn.Parameter, use: Use) -> None:
        """One layer's per-example gradient of a shared parameter (:mod:`~dp_adam_bench.engine.bk_rules.shared`),
        for the cross terms between its uses."""
        self._call.shared[id(param)][3].append(use)

    def kept(self, t: torch.Tensor) -> None:
        """Note a per-example gradient tensor a rule keeps until the clipped sum (``memory``)."""
        self.memory["per_example_bytes"] += t.numel() * t.element_size()

    def scale_of(self, param: nn.Parameter | None) -> torch.Tensor | None:
        """The per-coordinate scale of ``param`` (scale-then-privatize), or None."""
        scale = self._scale()
        return None if scale is None or param is None else scale[id(param)]

    def scaled(self, per_ex: dict) -> dict:
        """Instantiated per-example gradients ``{param: (B, *shape)}`` times their scales, if any."""
        scale = self._scale()
        if scale is None:
            return per_ex
        return {p: t * scale[id(p)] for p, t in per_ex.items()}

    def _scale(self) -> dict[int, torch.Tensor] | None:
        return self._call.scale if self._call is not None else None

    # --- engine interface -------------------------------------------------------------------------------------------
    def _record(self, batch, b: int, anchor: torch.Tensor) -> None:
        """Steps 1-2 of the module docstring: the forward with captures and the one backward (and, where a call
        is folded, the probe backwards that place its rows: :meth:`_place_rows`)."""
        for layer in self.layers:
            layer.calls = []
        self._rows_in.clear()  # filled again by the parents' pre-hooks in this forward
        fold_anchor = torch.zeros((), dtype=anchor.dtype, device=anchor.device, requires_grad=True)
        self._call.anchor, self._call.fold_anchor = anchor, fold_anchor
        try:
            losses = self.loss_per_example(self.model, batch)
        finally:
            self._call.anchor = self._call.fold_anchor = None
        if losses.shape != (b,):
            raise ValueError(
                f"bk clipping: loss_per_example returned shape {tuple(losses.shape)}, want ({b},)"
            )
        self._loss_sum = losses.detach().sum()  # ClippedSum.loss_sum: a diagnostic, never released
        folded = [(layer, call) for layer in self.layers for call in layer.calls if call.folded]
        probe = b > 1 and bool(folded)
        torch.autograd.grad(losses.sum(), [anchor], allow_unused=True, retain_graph=probe)
        if folded:
            self._place_rows(folded, losses, fold_anchor, b, probe)

    def _place_rows(self, folded, losses, fold_anchor, b: int, probe: bool) -> None:
        """Each folded call's rows assigned to their examples, read off the probe backwards of this batch
        (:mod:`dp_adam_bench.engine.folds`). Never kept for a later batch: which rows are whose can depend on the
        data (the real tokens of each example, with its padding dropped), and two batches with the same shapes
        can be arranged differently. The probes ask only for the fold anchor, so they run the graph above the
        deepest folded call, not the whole backward again.

        Where a row does not read as one example's, the rows are read again in binary digits (weights 1 and 2,
        ceil(log2 B) probes): a gradient dominated by rounding (a backward that cancels terms far larger than its
        result, on weights trained to 1e5) is not scaled exactly by a weight of 3, but is by a power of two, so an
        example's own rows then reproduce bit for bit and only rows that carry several examples' losses stay
        unread (refused)."""
        if not probe:  # one example: every row is its own
            for layer, call in folded:
                if call.grad is not None:
                    call.rows = torch.arange(call.grad.shape[0], device=call.grad.device)[None]
                    call.fold_kind = "example"
                    self.record(f"{layer.name} (folded)", "example")
            return
        dtype = next((c.grad.dtype for _, c in folded if c.grad is not None), losses.dtype)
        read = self._read_owners(folded, losses, fold_anchor, b, *folds.digits_base(b, dtype))
        if not all(ok for _, ok in read.values()):
            again = self._read_owners(folded, losses, fold_anchor, b, 2, max(1, (b - 1).bit_length()))
            read = {key: again[key] if not ok else (owner, ok) for key, (owner, ok) in read.items()}
        for layer, call in folded:
            if call.grad is None:
                continue
            owner, ok = read[id(call)]
            if not ok:
                raise ValueError(
                    f"bk clipping: {'module' if layer.rule is GENERIC else 'layer'} {layer.name!r} "
                    f"({type(layer.module).__name__}) sees {call.grad.shape[0]} rows for a batch of {b} examples, "
                    "and a row carries the losses of several examples (an input shared by the batch, such as a "
                    "position-bias table computed once for all examples, or rows that mix examples), so no "
                    "example's gradient of its parameters can be told apart; freeze the layer "
                    "(requires_grad_(False)), keep the examples apart in the model's forward, or use clipping "
                    "functorch / loop"
                )
            kind, index = folds.arrangement(owner, b)
            call.rows, call.fold_kind = index, kind
            self.record(f"{layer.name} (folded)", kind)

    def _read_owners(self, folded, losses, fold_anchor, b: int, base: int, digits: int) -> dict:
        """``{id(call): (owner, ok)}`` of every folded call with a gradient, from ``digits`` probe backwards of
        the losses weighted by their examples' digits in ``base`` (:func:`~dp_adam_bench.engine.folds.owners`);
        the graph is kept for another reading."""
        calls = [call for layer in self.layers for call in layer.calls]
        summed = [call.grad for call in calls]
        weighted: dict[int, list] = {id(call): [] for _, call in folded}
        try:
            for digit in range(digits):
                w = folds.probe_weights(b, base, digit, losses.dtype, losses.device)
                for call in calls:
                    call.grad = None
                torch.autograd.grad((losses * w).sum(), [fold_anchor], allow_unused=True, retain_graph=True)
                self.fold_probes += 1
                for _, call in folded:
                    weighted[id(call)].append(call.grad)
        finally:
            for call, g in zip(calls, summed, strict=True):
                call.grad = g
        read = {}
        for _, call in folded:
            if call.grad is not None:
                gw = weighted[id(call)]
                read[id(call)] = (
                    (None, False) if any(g is None for g in gw) else folds.owners(call.grad, gw, base, b)
                )
        return read

    def _clipped_sum(self, batch, clip, scale):
        b = batch_len(batch)
        call = self._call = _BatchCall(b)
        if scale is not None:  # shapes checked by GradEngine.clipped_sum
            call.scale = {id(p): s.to(p.dtype) for p, s in zip(self.params, scale, strict=True)}
        ref = self.params[0]
        self.dtype = ref.dtype  # the precision of norms, clip factors and sums (rules read it)
        anchor = torch.zeros((), dtype=ref.dtype, device=ref.device, requires_grad=True)
        try:
            unexpanded = 0
            while True:
                call.expanded, call.pending = [], set()
                try:
                    self._record(batch, b, anchor)
                    break
                except RuntimeError as err:
                    if not self._clone and _in_place(err):
                        self._clone = True  # and once more, with copies of the captured outputs
                        continue
                    last = call.expanded[-1].name if call.expanded else None
                    if last is not None and last not in self._no_expand and unexpanded < _MAX_UNEXPANDED:
                        # the model reshapes what the expanded layer returned: call it as the model does (its
                        # input then leads with 1, a fold engine/folds.py checks) and run the batch again
                        self._no_expand.add(last)
                        unexpanded += 1
                        continue
                    _refuse_in_place(err)
                    raise
                finally:
                    call.pending = set()
            call.shared = self._shared_in_forward()
            sq = torch.zeros(b, dtype=ref.dtype, device=ref.device)
            finishers = []
            self.memory = {"captured_bytes": _captured_bytes(self.layers), "per_example_bytes": 0}
            # under mixed precision (autocast) the captures are bf16 / fp16: norms, clip factors and sums are
            # computed in the parameters' precision, outside autocast (which would cast the matmuls down again);
            # the dense rules (Linear, convolutions: most of the captured memory) bring a chunk at a time to that
            # precision, the others their whole (small) captures
            # full fp32 for the kernels that make norms and sums (TF32 would give the sums an error the norms never
            # saw: engine/fp32_exact.py); the forward and backward above keep the user's settings, since both the
            # norms and the sums are computed here from the same captures
            with torch.autocast(ref.device.type, enabled=False), ieee_fp32():
                for layer in self.layers:
                    calls = [_unfolded(call) for call in layer.calls if call.grad is not None]
                    if layer.kind not in _CHUNKED_PRECISION:
                        calls = [_in_precision(call, ref.dtype) for call in calls]
                    if not calls:
                        continue
                    layer_sq, finish = layer.rule.compute(self, layer, calls, b)
                    layer.calls = []  # what the clipped sum needs is now held by ``finish``
                    sq = sq + layer_sq.to(sq.dtype)
                    finishers.append(finish)
                _unshareable(call.shared)
                for name, param, _, uses in call.shared.values():
                    sq = sq + cross_terms(self, name, param, uses, b).to(sq.dtype)
                call.shared = {}
                # a parameter's cross terms can be negative: an example whose uses cancel has a small norm, and
                # rounding must not make its square negative
                norms = sq.clamp(min=0).sqrt()
                f = clip_factors(norms, clip)
                found: dict[int, torch.Tensor] = {}
                for finish in finishers:
                    for p, s in finish(f).items():
                        # a shared parameter's clipped sum is the sum over the layers that use it
                        found[id(p)] = s if id(p) not in found else found[id(p)] + s
        finally:
            self._call = None  # nothing of this batch outlives its clipped sum
            for layer in self.layers:
                layer.calls = []
        summed = [found[id(p)].detach() if id(p) in found else torch.zeros_like(p) for p in self.params]
        return ClippedSum(summed, norms.detach(), b)

    def _shared_in_forward(self) -> dict[int, tuple]:
        """The parameters that several layers used in the recorded forward (tied weights), each with its name and
        those layers; a parameter registered in several modules of which one ran (T5's ``shared`` beside the
        ``embed_tokens`` that look it up) is an ordinary one."""
        users: dict[int, tuple] = {}
        for layer in self.layers:
            if any(call.grad is not None for call in layer.calls):
                for p in layer.params:
                    users.setdefault(id(p), (p, []))[1].append(layer)
        return {
            pid: (self._param_names.get(pid, "?"), p, active, [])
            for pid, (p, active) in users.items()
            if len(active) > 1
        }

    def close(self):
        for undo in self._undo:
            undo()
        self._undo = []
