"""Book-keeping (BK) per-example clipping: one forward, one backward, no second backward.

Z. Bu, Y.-X. Wang, S. Zha and G. Karypis, "Differentially private optimization on large model at small cost",
ICML 2023 (book-keeping, BK-MixOpt); X. Li, F. Tramèr, P. Liang and T. Hashimoto, "Large language models can be
strong differentially private learners", ICLR 2022 (ghost clipping).

How one micro-batch is processed (``BKEngine.clipped_sum``):

1. **Forward** with hooks: a forward hook on every supported layer keeps that call's input ``a`` (detached) and
   passes the layer's output through ``_Capture``, an identity autograd function. All ``_Capture`` nodes also take
   one scalar *anchor* leaf.
2. **One backward**: ``torch.autograd.grad(sum_i loss_i, anchor)``. Each ``_Capture`` node stores the gradient
   of the summed loss with respect to its layer's output, ``g``. Because only the anchor is requested, autograd
   prunes the parameter branches: the (non-clipped) weight gradients are never computed and ``p.grad`` is never
   touched, so the backward costs roughly the input-gradient half of a normal one.
3. **Per-layer norms** from ``(a, g)``: for a layer ``y_t = W a_t (+ b)`` over ``T`` positions (tokens, or
   output pixels of a convolution after ``unfold``), the per-example weight gradient is ``G_i^T A_i`` (p x d) and
   ``||G_i^T A_i||_F^2 = <A_i A_i^T, G_i G_i^T>`` (the Gram or "ghost" form). ``use_gram(T, d, p)`` picks, per
   layer and per call, the cheaper of the Gram form and instantiating ``G_i^T A_i``; the choice is recorded in
   ``BKEngine.choices``.
4. **Clip factors** ``c_i = min(1, C / ||g_i||)`` from the summed squared norms of all layers.
5. **Clipped sum** per layer, without another backward: ``sum_i c_i G_i^T A_i`` as one matmul
   ``(c * G)^T A`` (Gram path) or as the c-weighted sum of the instantiated per-example gradients.

Layers with a native rule: ``nn.Linear`` (inputs (B, d) or (B, ..., d)), transformers' GPT-2 ``Conv1D`` (a Linear
with transposed weight), ``nn.Conv2d`` with ``groups=1`` (any stride / padding / dilation / padding mode, via
``unfold``), ``nn.Embedding`` (the per-example gradient is a scatter of the output gradients onto the rows of the
example's tokens: Gram form ``sum_{t,s} [id_t = id_s] g_t . g_s``, or — the cheaper default — summing the
output gradients per distinct (example, token) pair; the clipped sum by ``index_add``) and ``nn.LayerNorm``
(per-example gradients instantiated: ``sum_t g_t * x_hat_t`` and ``sum_t g_t``).

**Fallback**: any other module type with trainable parameters for which Opacus has a per-sample gradient
function (``GroupNorm``, ``InstanceNorm*``, ``RMSNorm``, ``Conv1d``/``Conv3d``, grouped ``Conv2d``,
``EmbeddingBag``, ``RNNLinear``, ``SequenceBias``) is handled with that function on the same captured ``(a, g)``
(per-example gradients instantiated for those layers only). A parameterised module with neither is refused at
construction with an error naming the module types (use ``train.clipping=hooks`` or ``functorch``).

A module called several times in one forward (weight sharing by *module reuse*, e.g. a block applied twice)
is exact: its calls are concatenated along the position axis, since the per-example gradient is the sum over
all positions of all calls. The same ``nn.Parameter`` registered in two modules (tied embeddings) is refused,
as Opacus ghost clipping does.

**Scale-then-privatize** (Ganesh et al. Alg. 8: clip ``s * g_i`` for a per-coordinate scale ``s``): the Gram form
cannot see a per-coordinate scale, so with ``scale`` every dense layer computes its per-example weight gradients
in chunks of examples (``||S * (G_i^T A_i)||_F^2``; memory ``_GRAM_CHUNK`` floats at a time, never the whole
(B, p, d) tensor) and embeddings take the distinct-(example, token) path; the clipped sum stays one matmul,
``S * ((c * G)^T A)``, since the scale is the same for every example. Still one forward and one backward.

Limitations: the batch must be the first dimension of every hooked
layer's input (a wrong leading size is refused, e.g. HF ``position_ids`` of shape (1, T) — pass (B, T) — but a
sequence-first input whose length happens to equal B cannot be told apart, as in Opacus); a hooked layer's output
must not be modified in place afterwards (refused with a ValueError, as torch refuses it with full backward
hooks); ``nn.Embedding`` with ``scale_grad_by_freq`` and layers that mix examples (BatchNorm) are refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

from dp_adam_bench.engine.grads import ClippedSum, GradEngine, batch_len, clip_factors

MODES = ("auto", "gram", "instantiate")
_GRAM_CHUNK = 1 << 24  # at most this many Gram-matrix entries (per matrix) at once: chunks of examples


#: the Gram form pays T^2 (d + p) multiply-adds in small batched matmuls; instantiating pays T p d in matmuls
#: plus ~3 memory-bound passes over the (B, p, d) per-example gradients (write, norm, weighted sum), which on a
#: CPU cost about as much as 10 matmul multiply-adds per element: the Gram form wins iff T^2 (d + p) < ~30 p d.
GRAM_FACTOR = 30


def use_gram(T: int, d: int, p: int) -> bool:
    """Whether the Gram ("ghost") form is cheaper than instantiating the per-example gradient of a layer
    ``y_t = W a_t`` (W: p x d) seen at ``T`` positions per example.

    Per-example cost (as implemented here):

    * Gram: ``A A^T`` and ``G G^T`` cost ``T^2 (d + p)`` multiply-adds; the clipped sum is then one matmul
      ``(c G)^T A`` over all B*T positions, ``T p d`` per example. Extra memory: two T x T matrices.
    * instantiate: ``G_i^T A_i`` costs ``T p d``; then its norm and the c-weighted sum read the (B, p, d) tensor
      again. Extra memory: ``p d`` per example, kept until the clipped sum.

    The ``T p d`` matmul is common to both; what differs is ``T^2 (d + p)`` matmul work against ``p d`` elements
    written and read a few times, which is memory-bound. Measured on one CPU thread (torch 2.13, B = 8-256),
    the crossover is at ``T^2 (d + p) / (p d)`` of about 30 (:data:`GRAM_FACTOR`): CNN5 conv3 (ratio 23) 37 ms
    Gram vs 63 ms instantiated, GPT-2's MLP in (27) 61 vs 92 ms, GPT-2's attention projections (43) 17 vs 15 ms,
    BERT-tiny's FFN (160) 16 vs 8 ms, CNN5 conv2 (967) 211 vs 29 ms. A flop count alone (``T^2 (d + p) < 2 p d``)
    instantiates every Linear of a T = 128 transformer and the LM heads, 1.5-1.75x slower end to end (and the
    heads' per-example gradients alone are 8 x 768 x 50257 floats for GPT-2 at B = 8). Bu et al.'s BK-MixOpt rule
    ``2 T^2 < p d`` compares the two paths' memory instead. For T = 1 (a Linear on (B, d)) the Gram form is just
    ``||a||^2 ||g||^2`` and always wins. Embeddings do not use this rule: their instantiated path only sums
    the output gradients per distinct (example, token), O(T p), so they take it unless T = 1.
    """
    return T * T * (d + p) < GRAM_FACTOR * p * d


@dataclass
class _Call:
    """One forward call of a hooked layer: its inputs, and (after the backward) its output gradient."""

    inputs: tuple
    grad: torch.Tensor | None = None


@dataclass
class _Layer:
    name: str
    module: nn.Module
    kind: str  # linear | conv1d_hf | conv2d | embedding | layernorm | opacus
    params: list[nn.Parameter]  # the module's own trainable parameters
    calls: list[_Call] = field(default_factory=list)
    sampler: Callable | None = None  # opacus per-sample gradient function (kind == "opacus")


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


def _is_hf_conv1d(m: nn.Module) -> bool:
    return type(m).__name__ == "Conv1D" and type(m).__module__.startswith("transformers")


def _native_kind(m: nn.Module) -> str | None:
    t = type(m)
    if t is nn.Linear:
        return "linear"
    if t is nn.Conv2d and m.groups == 1:
        return "conv2d"
    if t is nn.Embedding:
        return "embedding"
    if t is nn.LayerNorm:
        return "layernorm"
    if _is_hf_conv1d(m):
        return "conv1d_hf"
    return None


def _opacus_samplers() -> dict:
    import opacus.grad_sample  # noqa: F401  (registers the per-layer grad samplers)
    from opacus.grad_sample.grad_sample_module import GradSampleModule

    return GradSampleModule.GRAD_SAMPLERS


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


def _unfold(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, L, C*kh*kw): the patches a groups=1 convolution multiplies by its weight."""
    padding = conv.padding
    if isinstance(padding, str) or conv.padding_mode != "zeros":
        mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
        x = F.pad(x, conv._reversed_padding_repeated_twice, mode=mode)
        padding = 0
    cols = F.unfold(x, conv.kernel_size, dilation=conv.dilation, padding=padding, stride=conv.stride)
    return cols.transpose(1, 2)


def _gram_sq(A: torch.Tensor, G: torch.Tensor, same_token: bool = False) -> torch.Tensor:
    """Per-example ``<A_i A_i^T, G_i G_i^T>``; with ``same_token`` A holds token ids (B, T) and the first Gram
    matrix is ``[id_t == id_s]``."""
    b, T = G.shape[:2]
    if T == 1 and not same_token:
        return A.square().sum((1, 2)) * G.square().sum((1, 2))
    step = max(1, _GRAM_CHUNK // (T * T))
    out = []
    for i in range(0, b, step):
        a, g = A[i : i + step], G[i : i + step]
        gg = torch.bmm(g, g.transpose(1, 2))
        aa = (a[:, :, None] == a[:, None, :]).to(gg.dtype) if same_token else torch.bmm(a, a.transpose(1, 2))
        out.append((aa * gg).sum((1, 2)))
    return torch.cat(out).clamp(min=0)


def _sq_norms(per_ex: torch.Tensor) -> torch.Tensor:
    """Squared L2 norm of each example's slice: ``linalg.vector_norm`` (one fused pass; ``square().sum()``
    materialises the squares and was ~10x slower on a (B, p, d) tensor here)."""
    return torch.linalg.vector_norm(per_ex.reshape(per_ex.shape[0], -1), dim=1).square()


def _scaled_sq(A: torch.Tensor, G: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """Per-example ``||S * (G_i^T A_i)||_F^2`` for a (p, d) scale ``S``, instantiating ``G_i^T A_i`` for a chunk of
    examples at a time (at most ``_GRAM_CHUNK`` entries)."""
    b, _, d = A.shape
    p = G.shape[2]
    step = max(1, _GRAM_CHUNK // (p * d))
    out = []
    for i in range(0, b, step):
        W = torch.bmm(G[i : i + step].transpose(1, 2), A[i : i + step])
        out.append(_sq_norms(W * S))
    return torch.cat(out)


def _weighted(c: torch.Tensor, per_ex: torch.Tensor) -> torch.Tensor:
    """sum_i c_i per_ex[i]."""
    return (c @ per_ex.reshape(per_ex.shape[0], -1)).reshape(per_ex.shape[1:])


class BKEngine(GradEngine):
    """Book-keeping clipping: per-example norms and the clipped sum from one forward and one backward.

    ``mode``: ``auto`` (per-layer ``use_gram``), or ``gram`` / ``instantiate`` to force one path for the
    Linear / Conv1D / Conv2d / Embedding layers (tests, experiments). ``choices`` maps each such layer's name to
    the path its last ``clipped_sum`` took.
    """

    name = "bk"

    def __init__(self, model: nn.Module, loss_per_example: Callable, mode: str = "auto"):
        super().__init__(model, loss_per_example)
        if mode not in MODES:
            raise ValueError(f"bk mode={mode!r}; valid: {', '.join(MODES)}")
        self.mode = mode
        self.choices: dict[str, str] = {}
        _check_untied(model)
        self.layers: list[_Layer] = []
        unsupported: dict[str, list[str]] = {}
        samplers = None
        for mname, m in model.named_modules():
            params = [p for p in m._parameters.values() if p is not None and p.requires_grad]
            if not params:
                continue
            kind = _native_kind(m)
            sampler = None
            if kind == "embedding" and m.scale_grad_by_freq:
                kind = None
                unsupported.setdefault("Embedding(scale_grad_by_freq=True)", []).append(mname)
                continue
            if kind is None:
                samplers = _opacus_samplers() if samplers is None else samplers
                sampler = samplers.get(type(m))
                if sampler is None:
                    unsupported.setdefault(type(m).__name__, []).append(mname or "<root>")
                    continue
                kind = "opacus"
            self.layers.append(_Layer(mname or "<root>", m, kind, params, sampler=sampler))
        if unsupported:
            listing = "; ".join(f"{t} ({', '.join(names)})" for t, names in sorted(unsupported.items()))
            raise ValueError(
                f"the bk clipping engine has no per-example gradient rule for: {listing}. Use "
                "train.clipping=hooks (Opacus, with a per-layer functorch fallback) or train.clipping=functorch, "
                "or replace these layers"
            )
        # set only inside clipped_sum: outside it (evaluation, mean_grad) the hooks record nothing
        self._anchor: torch.Tensor | None = None
        self._batch = 0
        self._scale: dict[int, torch.Tensor] | None = None  # id(param) -> per-coordinate scale (stp only)
        self._handles = [
            layer.module.register_forward_hook(self._make_hook(layer), with_kwargs=True)
            for layer in self.layers
        ]

    # --- hooks ----------------------------------------------------------------------------------------------------
    def _make_hook(self, layer: _Layer):
        def hook(module, args, kwargs, output):
            anchor = self._anchor
            if anchor is None or not torch.is_grad_enabled() or not isinstance(output, torch.Tensor):
                return None
            if not output.requires_grad:
                return None
            inputs = tuple(args) if args else tuple(kwargs.values())
            x = inputs[0]
            if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[0] != self._batch:
                shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise ValueError(
                    f"bk clipping: layer {layer.name!r} ({type(module).__name__}) got an input of shape {shape}, "
                    f"whose first dimension is not the batch size {self._batch}; every hooked layer needs the "
                    "examples along dim 0 (for Hugging Face models pass position_ids / token_type_ids of "
                    "shape (B, T))"
                )
            call = _Call(tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in inputs))
            layer.calls.append(call)
            return _Capture.apply(output, anchor, call)

        return hook

    # --- per-layer rules: (squared norms (B,), finish(c) -> {param: clipped sum}) -----------------------------------
    def _path(self, name: str, T: int, d: int, p: int, embedding: bool = False) -> bool:
        if self._scale is not None:  # a per-coordinate scale: only instantiated per-example gradients see it
            gram = False
        elif self.mode != "auto":
            gram = self.mode == "gram"
        else:  # an embedding's "instantiated" path only sums the T output gradients per distinct token: O(T p)
            gram = T == 1 if embedding else use_gram(T, d, p)
        self.choices[name] = "gram" if gram else "instantiate"
        return gram

    def _scale_of(self, param: nn.Parameter) -> torch.Tensor | None:
        return None if self._scale is None else self._scale[id(param)]

    def _dense(self, layer: _Layer, calls: list[_Call], b: int):
        m = layer.module
        As, Gs = [], []
        for call in calls:
            x, g = call.inputs[0], call.grad
            if layer.kind == "conv2d":
                a = _unfold(m, x.to(g.dtype))
                g = g.reshape(b, g.shape[1], -1).transpose(1, 2)
            else:
                a = x.reshape(b, -1, x.shape[-1]).to(g.dtype)
                g = g.reshape(b, -1, g.shape[-1])
            As.append(a)
            Gs.append(g)
        A = As[0] if len(As) == 1 else torch.cat(As, 1)
        G = Gs[0] if len(Gs) == 1 else torch.cat(Gs, 1)
        T, d, p = A.shape[1], A.shape[2], G.shape[2]
        weight, bias = m.weight, m.bias
        sq = torch.zeros(b, dtype=G.dtype, device=G.device)
        gb = G.sum(1) if bias is not None and bias.requires_grad else None
        if gb is not None:
            sb = self._scale_of(bias)
            if sb is not None:
                gb = gb * sb
            sq = sq + gb.square().sum(1)
        W = sw = None
        if weight.requires_grad:
            sw = self._scale_of(weight)
            if sw is not None:  # (p, d), in the layout of G_i^T A_i
                sw = sw.t() if layer.kind == "conv1d_hf" else sw.reshape(p, d)
                sq = sq + _scaled_sq(A, G, sw)
            elif self._path(layer.name, T, d, p):
                sq = sq + _gram_sq(A, G)
            else:
                W = torch.bmm(G.transpose(1, 2), A)  # (B, p, d)
                sq = sq + _sq_norms(W)
                A = G = None  # the clipped sum needs only W: free the (unfolded) activations now
            if sw is not None:
                self.choices[layer.name] = "instantiate"

        def finish(c):
            out = {}
            if weight.requires_grad:
                if W is not None:
                    s = _weighted(c, W)
                else:
                    s = torch.mm((G * c[:, None, None]).reshape(-1, p).t(), A.reshape(-1, d))
                    if sw is not None:
                        s = s * sw
                out[weight] = s.t() if layer.kind == "conv1d_hf" else s.reshape(weight.shape)
            if gb is not None:
                out[bias] = c @ gb
            return out

        return sq, finish

    def _embedding(self, layer: _Layer, calls: list[_Call], b: int):
        m = layer.module
        ids = torch.cat([call.inputs[0].reshape(b, -1) for call in calls], 1)
        G = torch.cat([call.grad.reshape(b, -1, call.grad.shape[-1]) for call in calls], 1)
        if m.padding_idx is not None:  # that row gets no gradient
            G = G.masked_fill((ids == m.padding_idx)[..., None], 0)
        V, p = m.weight.shape
        sw = self._scale_of(m.weight)
        if self._path(layer.name, ids.shape[1], 1, p, embedding=True):
            sq = _gram_sq(ids, G, same_token=True)

            def finish(c):
                rows = (G * c[:, None, None]).reshape(-1, p)
                return {m.weight: torch.zeros_like(m.weight).index_add_(0, ids.reshape(-1), rows)}

            return sq, finish
        # the per-example gradient's nonzero rows: sum the output gradients per distinct (example, token)
        key = (torch.arange(b, device=ids.device)[:, None] * V + ids).reshape(-1)
        uniq, inverse = torch.unique(key, return_inverse=True)
        S = G.new_zeros(uniq.numel(), p).index_add_(0, inverse, G.reshape(-1, p))
        example, row = uniq // V, uniq % V
        if sw is not None:
            S = S * sw[row]
        sq = G.new_zeros(b).index_add_(0, example, S.square().sum(1))

        def finish(c):
            return {m.weight: torch.zeros_like(m.weight).index_add_(0, row, S * c[example][:, None])}

        return sq, finish

    def _layernorm(self, layer: _Layer, calls: list[_Call], b: int):
        m = layer.module
        ns = tuple(m.normalized_shape)
        gw = gb = None
        for call in calls:
            x, g = call.inputs[0].to(call.grad.dtype), call.grad
            dims = tuple(range(1, g.dim() - len(ns)))
            if m.weight is not None and m.weight.requires_grad:
                xhat = F.layer_norm(x, ns, eps=m.eps)
                w = (g * xhat).sum(dims) if dims else g * xhat
                gw = w if gw is None else gw + w
            if m.bias is not None and m.bias.requires_grad:
                v = g.sum(dims) if dims else g
                gb = v if gb is None else gb + v
        per_ex = {p: t for p, t in ((m.weight, gw), (m.bias, gb)) if t is not None}
        return self._from_per_example(self._scaled(per_ex), b)

    def _scaled(self, per_ex: dict) -> dict:
        if self._scale is None:
            return per_ex
        return {p: t * self._scale[id(p)] for p, t in per_ex.items()}

    def _opacus(self, layer: _Layer, calls: list[_Call], b: int):
        per_ex: dict = {}
        for call in calls:
            for p, gs in layer.sampler(layer.module, list(call.inputs), call.grad).items():
                if p.requires_grad:
                    per_ex[p] = gs if p not in per_ex else per_ex[p] + gs
        return self._from_per_example(self._scaled(per_ex), b)

    @staticmethod
    def _from_per_example(per_ex: dict, b: int):
        sq = sum((_sq_norms(t) for t in per_ex.values()), torch.zeros(()))

        def finish(c):
            return {p: _weighted(c, t) for p, t in per_ex.items()}

        return sq, finish

    # --- engine interface -------------------------------------------------------------------------------------------
    def _clipped_sum(self, batch, clip, scale):
        b = batch_len(batch)
        if scale is not None:  # shapes checked by GradEngine.clipped_sum
            self._scale = {id(p): s.to(p.dtype) for p, s in zip(self.params, scale, strict=True)}
        ref = self.params[0]
        anchor = torch.zeros((), dtype=ref.dtype, device=ref.device, requires_grad=True)
        for layer in self.layers:
            layer.calls = []
        self._anchor, self._batch = anchor, b
        try:
            try:
                losses = self.loss_per_example(self.model, batch)
            except RuntimeError as err:
                if "Output 0 of _Capture is a view and is being modified inplace" in str(err):
                    raise ValueError(
                        "bk clipping: the output of a hooked layer is modified in place (e.g. nn.ReLU(inplace="
                        "True) or `+=` right after a Linear / Conv2d / Embedding / LayerNorm); make that operation "
                        "out of place or use train.clipping=functorch"
                    ) from err
                raise
            finally:
                self._anchor = None
            if losses.shape != (b,):
                raise ValueError(
                    f"bk clipping: loss_per_example returned shape {tuple(losses.shape)}, want ({b},)"
                )
            torch.autograd.grad(losses.sum(), [anchor], allow_unused=True)
            rules = {
                "linear": self._dense,
                "conv1d_hf": self._dense,
                "conv2d": self._dense,
                "embedding": self._embedding,
                "layernorm": self._layernorm,
                "opacus": self._opacus,
            }
            sq = torch.zeros(b, dtype=losses.dtype, device=losses.device)
            finishers = []
            for layer in self.layers:
                calls = [call for call in layer.calls if call.grad is not None]
                if not calls:
                    continue
                layer_sq, finish = rules[layer.kind](layer, calls, b)
                layer.calls = []  # what the clipped sum needs is now held by ``finish``
                sq = sq + layer_sq.to(sq.dtype)
                finishers.append(finish)
            norms = sq.sqrt()
            f = clip_factors(norms, clip)
            found: dict[int, torch.Tensor] = {}
            for finish in finishers:
                for p, s in finish(f.to(ref.dtype)).items():
                    found[id(p)] = s
        finally:
            self._scale = None
            for layer in self.layers:
                layer.calls = []
        summed = [found[id(p)].detach() if id(p) in found else torch.zeros_like(p) for p in self.params]
        return ClippedSum(summed, norms.detach(), b)

    def close(self):
        for h in self._handles:
            h.remove()
        self._handles = []
