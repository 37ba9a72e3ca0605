"""Modules with parameters of their own and no rule of their own: a ``cls_token`` or position-embedding tensor
(``ViTEmbeddings``), a LayerScale gamma, a 0-dim logit scale on the root module, a custom norm class
(``LlamaRMSNorm``, ``T5LayerNorm``), a subclass of a layer with a rule (its forward may differ).

The per-example gradient of such a module's own parameters is computed from what bk captured for it, its inputs
and the gradient of the summed loss with respect to its output(s), by recomputing the module's forward one example
at a time and taking the vector-Jacobian product with that example's output gradient: ``torch.func.vmap`` over the
examples of ``grad`` of ``<f(theta; x_i), g_i>`` (Opacus' functorch fallback for unknown layers works the same way),
or, where the forward cannot be vmapped (data-dependent control flow), a loop over the examples. The module's
children keep their own rules: only the module's own parameters are differentiated (``functional_call`` with those
alone). The per-example gradients are instantiated (B x the module's own parameter count).

Every argument of the call is captured (positional and keyword: masks, position biases, position ids, numbers,
flags) and passed to the replay. Which tensor inputs are per example is not known from their shapes alone: a (T,)
row of position ids, or a bias (heads, T, T), leads with B whenever T or the number of heads happens to equal B.
The replay first takes every input with B rows along dim 0 per example; where that does not reproduce the batch's
outputs, it tries again with one, two, ... of them (never the module's primary input) passed whole, and keeps the
first split that does, per module, for the next batch (at most 16 splits a call). A split whose replay reproduces
every example's outputs computes that example's function of the module's parameters, so its vector-Jacobian
product is that example's gradient.

Exactness is checked, not assumed: the recomputed outputs must equal the outputs the batch forward produced (the
recomputation returns them as well). A forward that mixes the examples, or draws random numbers (dropout with
``p > 0`` in train mode), does not reproduce them and is refused naming the module; ``nn.Dropout`` children with
``p = 0`` are put in eval mode for the recomputation (the same function, no random draw).

An output must keep the examples along dim 0 (a leading dimension of 1, broadcast over the batch, is expanded to
the batch by the engine: each example's gradient through it is then its own); an output without the batch
dimension cannot be told apart per example and is refused.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn
from torch.utils import _pytree as pytree

from dp_adam_bench.engine.bk_rules.dense import from_per_example
from dp_adam_bench.engine.bk_rules.registry import Rule
from dp_adam_bench.engine.bk_rules.shared import share_instantiated
from dp_adam_bench.engine.support import own_trainable


def _tolerance(dtype: torch.dtype) -> float:
    """Relative error allowed between the batch forward's output and its recomputation: a few units of the
    output's precision (bf16 outputs of an autocast forward are recomputed in fp32), at least 1e-3 (matmuls may
    block differently for one example); dropout with p = 0.1 already changes outputs by 11 %."""
    return max(1e-3, 4 * torch.finfo(dtype).eps)


class _ZeroDropoutOff:
    """``nn.Dropout`` modules with ``p = 0`` under ``module`` in eval mode (identity, no random draw) for a block."""

    def __init__(self, module: nn.Module):
        self.mods = [
            m
            for m in module.modules()
            if isinstance(m, nn.modules.dropout._DropoutNd) and m.p == 0 and m.training
        ]

    def __enter__(self):
        for m in self.mods:
            m.training = False

    def __exit__(self, *exc):
        for m in self.mods:
            m.training = True


def _group(calls) -> list[list]:
    """The captured pieces of each forward call, in call order (one piece per tensor output with a gradient)."""
    groups: dict[int, list] = {}
    for call in calls:
        groups.setdefault(call.group, []).append(call)
    return list(groups.values())


def _batched(t, b: int) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == b


def _per_example_vmap(module, params, flat, spec, batched, pieces):
    """vmap over the examples; an input in ``batched`` is sliced to the example's row (kept with a leading 1), or
    to its rows if it was gathered from a folded batch (``fold_inputs``, (k, ...)); a folded piece's output is
    the example's k rows."""
    from torch.func import functional_call, grad, vmap

    dims = [0 if k in batched else None for k in range(len(flat))]
    gathered = pieces[0].fold_inputs
    lift = [d == 0 and k not in gathered for k, d in enumerate(dims)]
    grads = [c.grad for c in pieces]
    keys = [c.piece for c in pieces]
    rows = [c.folded for c in pieces]

    def one(p, inputs, gs):
        inputs = [t.unsqueeze(0) if up else t for t, up in zip(inputs, lift, strict=True)]
        a, kw = pytree.tree_unflatten(inputs, spec)
        leaves = pytree.tree_leaves(functional_call(module, p, a, kw))
        outs = [leaves[k] for k in keys]
        total = sum((o * (g if r else g.unsqueeze(0))).sum() for o, g, r in zip(outs, gs, rows, strict=True))
        return total, [o if r or o.shape[0] != 1 else o.squeeze(0) for o, r in zip(outs, rows, strict=True)]

    detached = {n: p.detach() for n, p in params.items()}
    fn = vmap(grad(one, has_aux=True), in_dims=(None, dims, [0] * len(grads)), randomness="error")
    per_ex, outs = fn(detached, flat, grads)
    return per_ex, outs


def _per_example_loop(module, params, flat, spec, batched, pieces, b):
    names = list(params)
    rows, outs = [], [[] for _ in pieces]
    gathered = pieces[0].fold_inputs
    for i in range(b):
        inputs = [
            (t[i] if k in gathered else t[i : i + 1]) if k in batched else t for k, t in enumerate(flat)
        ]
        a, kw = pytree.tree_unflatten(inputs, spec)
        with torch.enable_grad():
            leaves = pytree.tree_leaves(module(*a, **kw))
            got_outs = [leaves[c.piece] for c in pieces]
            grads = [c.grad[i] if c.folded else c.grad[i : i + 1] for c in pieces]
            for o, g in zip(got_outs, grads, strict=True):
                if o.shape != g.shape:
                    shape = tuple(o.shape[1:]) if o.dim() and o.shape[0] == 1 else tuple(o.shape)
                    return None, shape  # not this example's rows: the caller says so
            total = sum((o * g).sum() for o, g in zip(got_outs, grads, strict=True))
            got = torch.autograd.grad(total, [params[n] for n in names], allow_unused=True)
        rows.append(
            [g if g is not None else torch.zeros_like(params[n]) for g, n in zip(got, names, strict=True)]
        )
        for k, (o, c) in enumerate(zip(got_outs, pieces, strict=True)):
            outs[k].append(o.detach() if c.folded else o.detach()[0])
    per_ex = {n: torch.stack([r[j] for r in rows]) for j, n in enumerate(names)}
    return per_ex, [torch.stack(o) for o in outs]


#: at most this many ways of splitting a call's inputs into per-example and shared ones are replayed
_MAX_SPLITS = 16


def _splits(flat, b: int, known) -> list[frozenset]:
    """The sets of inputs (flat indices) to replay as per-example, in the order tried: ``known`` (the split that
    reproduced this module's last batch) first, then every input with B rows along dim 0, then with one, two, ...
    of those other than the first (the module's primary input) passed whole instead. An input whose leading size
    is B only by coincidence (BART's (T,) ``position_ids`` with T = B) is per-example under the first split and
    shared under a later one; the replay that reproduces the batch's outputs decides."""
    cands = [k for k, t in enumerate(flat) if _batched(t, b)]
    first = [k for k in cands if k == 0]
    rest = [k for k in cands if k != 0]
    order = [frozenset(cands)] if known is None else [known, frozenset(cands)]
    for n in range(1, len(rest) + 1):
        for dropped in itertools.combinations(rest, n):
            order.append(frozenset(first + [k for k in rest if k not in dropped]))
    seen, out = set(), []
    for split in order:
        if split not in seen:
            seen.add(split)
            out.append(split)
    return out[:_MAX_SPLITS]


def _differs(pieces, outs) -> str | None:
    """Why the replayed outputs ``outs`` do not reproduce the batch's (shape or value), or None."""
    for call, out in zip(pieces, outs, strict=True):
        ref = call.output
        if out.shape != ref.shape:  # e.g. a sequence-first output whose length happens to equal B
            return (
                f"one example gives an output of shape {tuple(out.shape[1:])}, the batch {tuple(ref.shape[1:])} "
                "per example"
            )
        scale = ref.abs().max().clamp(min=torch.finfo(ref.dtype).tiny)
        err = float((out.detach().to(ref.dtype) - ref).abs().max() / scale) if ref.numel() else 0.0
        if not err <= _tolerance(ref.dtype):
            return f"its recomputed output differs by {err:.2g} (relative)"
    return None


def _replay(engine, layer, params, pieces, b, how):
    """Per-example gradients of one forward call (its captured ``pieces``) and how they were computed: the first
    split of its inputs (:func:`_splits`) whose replay reproduces the batch's outputs, by vmap or, where vmap
    cannot run the forward, one example at a time."""
    m = layer.module
    flat, spec = pytree.tree_flatten((pieces[0].args, pieces[0].kwargs))
    known = engine.replay_splits.get(layer.name)
    why = None
    for split in _splits(flat, b, known):
        per_ex = None
        by = how
        if how == "vmap":
            try:
                per_ex, outs = _per_example_vmap(m, params, flat, spec, split, pieces)
            except RuntimeError as err:
                if "random" in str(err):
                    raise ValueError(
                        _not_reproducible(layer, "it draws random numbers (dropout with p > 0)")
                    ) from err
                # data-dependent control flow or an op vmap does not take, or inputs split wrongly: this split
                # one example at a time; the loop is kept only if it is what reproduces the batch
                by = "loop"
        if per_ex is None:
            try:
                per_ex, outs = _per_example_loop(m, params, flat, spec, split, pieces, b)
            except RuntimeError as err:  # inputs split wrongly can make the forward fail: try the next split
                why = (
                    why or f"it raises {type(err).__name__} on one example: {str(err).splitlines()[0][:120]}"
                )
                continue
            if per_ex is None:
                why = why or (
                    f"one example gives an output of shape {outs}, the batch "
                    f"{tuple(pieces[0].output.shape[1:])} per example"
                )
                continue
        differs = _differs(pieces, outs)
        if differs is None:
            engine.replay_splits[layer.name] = split
            return per_ex, by
        why = why or differs
    raise ValueError(_not_reproducible(layer, why))


def generic(engine, layer, calls, b):
    """Per-example gradients of ``layer.module``'s own parameters by recomputing its forward per example."""
    m = layer.module
    params = own_trainable(m)
    total: dict[str, torch.Tensor] = {}
    # a module whose forward vmap could not batch once takes the loop from then on (no failed vmap every step)
    how = "loop" if engine.choices.get(layer.name) == "generic:loop" else "vmap"
    with _ZeroDropoutOff(m):
        for pieces in _group(calls):
            _refuse_irregular(layer, pieces)
            per_ex, how = _replay(engine, layer, params, pieces, b, how)
            for n, g in per_ex.items():
                total[n] = g if n not in total else total[n] + g
    engine.record(layer.name, f"generic:{how}")
    per_param = {params[n]: g.to(engine.dtype) for n, g in total.items()}
    share_instantiated(engine, layer, per_param)
    return from_per_example(engine.scaled(per_param), b, calls[0].grad.device)


def _refuse_irregular(layer, pieces) -> None:
    """A replay needs each example's rows, all of them: a folded call whose rows are not in a regular arrangement
    (engine/folds.py), or whose outputs are arranged differently from one another, is refused."""
    folded = [c for c in pieces if c.folded]
    if not folded:
        return
    first = folded[0].rows
    if any(c.fold_kind == "irregular" for c in folded) or any(
        c.rows.shape != first.shape or not torch.equal(c.rows, first) for c in folded
    ):
        raise ValueError(
            _not_reproducible(
                layer,
                "its outputs fold the examples into rows of no regular arrangement (B·k rows, example- or "
                "position-major)",
            )
        )


def _not_reproducible(layer, why: str) -> str:
    names = ", ".join(own_trainable(layer.module))
    return (
        f"bk clipping: module {layer.name!r} ({type(layer.module).__name__}, parameters {names}) has no bk rule, "
        f"and its forward is not reproducible one example at a time ({why}), so its per-example gradients cannot "
        "be computed exactly: make its dropout p = 0 (or the model's dropout off), keep the examples apart in its "
        "forward, or use clipping functorch / loop"
    )


#: the rule bk uses for a module type without a registered rule (``BKEngine`` installs its capture)
GENERIC = Rule("generic", generic, shares=True)
