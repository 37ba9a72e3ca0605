"""``nn.MultiheadAttention``: its in-projection weights act inside ``F.multi_head_attention_forward`` (the
packed ``in_proj_weight`` is one (3E, E) matrix whose row blocks project the query, the key and the value), and
its ``out_proj`` is applied as a function, not called as a module, so no output hook can see them.

While bk records a batch, :func:`install` swaps the instance's ``forward`` for :func:`_forward`, the same
computation written with each projection visible: ``q = query W_q^T + b_q`` (likewise k, v) goes through the
engine's capture, ``bias_k`` / ``bias_v`` (``add_bias_kv``) are captured as one appended position per example,
and ``out_proj`` is called as a module (its own Linear rule). Each row block of ``in_proj_weight`` is then a
dense map with its own inputs and output gradients, and an example's gradient of ``in_proj_weight`` is the three
blocks stacked: its squared norm is the sum of theirs. Outside a recorded batch (evaluation, ``mean_grad``) the
module's own forward runs.

``nn.TransformerEncoderLayer`` / ``TransformerDecoderLayer`` with ``batch_first=False`` hand their feed-forward
Linear layers and norms sequence-first tensors, on which no rule can tell the examples apart. While bk records, an
adapter (:func:`_batch_first_while_recording`) transposes the layer's inputs to batch-first and runs it with its
attention set to ``batch_first=True``: the same function (the feed-forward part acts per position, the masks do
not depend on the layout), with every tensor batch-first.

The conformance suite checks the gradients match the loop over batches of size one (which runs torch's own
forward), with masks, ``add_bias_kv``, ``add_zero_attn``, ``kdim`` / ``vdim``, both layouts.
"""

from __future__ import annotations

import inspect
import math

import torch
from torch import nn
from torch.nn import functional as F

from dp_adam_bench.engine.bk_rules.dense import dense, held_operands, sq_norms, weighted
from dp_adam_bench.engine.bk_rules.linear import stack_calls
from dp_adam_bench.engine.bk_rules.registry import register, register_adapter

_SIGNATURE = inspect.signature(nn.MultiheadAttention.forward)


def _merged_mask(m, attn_mask, key_padding_mask, b, T, S, dtype):
    """torch's mask semantics (bool: True = masked; float: added), merged to a shape broadcastable to
    (B, heads, T, S), or None."""
    key_padding_mask = F._canonical_mask(
        mask=key_padding_mask,
        mask_name="key_padding_mask",
        other_type=F._none_or_dtype(attn_mask),
        other_name="attn_mask",
        target_type=dtype,
    )
    attn_mask = F._canonical_mask(
        mask=attn_mask,
        mask_name="attn_mask",
        other_type=None,
        other_name="",
        target_type=dtype,
        check_other=False,
    )
    mask = None
    if attn_mask is not None:
        mask = (
            attn_mask.reshape(1, 1, T, -1)
            if attn_mask.dim() == 2
            else attn_mask.reshape(b, m.num_heads, T, -1)
        )
    if key_padding_mask is not None:
        kpm = key_padding_mask.reshape(b, 1, 1, -1)
        mask = kpm if mask is None else mask + kpm
    return mask


def _forward(engine, layer, original, *args, **kwargs):
    """``nn.MultiheadAttention.forward`` with the projections captured (see the module docstring)."""
    if not engine.recording():
        return original(*args, **kwargs)
    m = layer.module
    bound = _SIGNATURE.bind(m, *args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    query, key, value = a["query"], a["key"], a["value"]
    attn_mask, key_padding_mask, is_causal = a["attn_mask"], a["key_padding_mask"], a["is_causal"]
    if query.dim() != 3:
        raise ValueError(
            f"bk clipping: MultiheadAttention {layer.name!r} got an unbatched query of shape {tuple(query.shape)}; "
            "bk needs batched inputs"
        )
    if not m.batch_first:
        query, key, value = (t.transpose(0, 1) for t in (query, key, value))
    b, T, E = query.shape
    H, hd = m.num_heads, m.head_dim
    if m._qkv_same_embed_dim:
        wq, wk, wv = m.in_proj_weight.chunk(3)
    else:
        wq, wk, wv = m.q_proj_weight, m.k_proj_weight, m.v_proj_weight
    bq = bk = bv = None
    if m.in_proj_bias is not None:
        bq, bk, bv = m.in_proj_bias.chunk(3)
    q = engine.capture(layer, F.linear(query, wq, bq), (query,), piece="q")
    k = engine.capture(layer, F.linear(key, wk, bk), (key,), piece="k")
    v = engine.capture(layer, F.linear(value, wv, bv), (value,), piece="v")
    if is_causal and attn_mask is None:
        raise RuntimeError("Need attn_mask if specifying the is_causal hint (as nn.MultiheadAttention)")
    # as F.multi_head_attention_forward: the hint replaces the mask only without key padding and weights
    causal = bool(is_causal and key_padding_mask is None and not a["need_weights"])
    if causal:
        attn_mask = None
    if m.bias_k is not None:
        k = torch.cat(
            [k, engine.capture(layer, m.bias_k.reshape(1, 1, E).expand(b, 1, E), (), piece="bias_k")], 1
        )
        v = torch.cat(
            [v, engine.capture(layer, m.bias_v.reshape(1, 1, E).expand(b, 1, E), (), piece="bias_v")], 1
        )
        attn_mask = None if attn_mask is None else F.pad(attn_mask, (0, 1))
        key_padding_mask = None if key_padding_mask is None else F.pad(key_padding_mask, (0, 1))
    if m.add_zero_attn:
        k = torch.cat([k, k.new_zeros(b, 1, E)], 1)
        v = torch.cat([v, v.new_zeros(b, 1, E)], 1)
        attn_mask = None if attn_mask is None else F.pad(attn_mask, (0, 1))
        key_padding_mask = None if key_padding_mask is None else F.pad(key_padding_mask, (0, 1))
    S = k.shape[1]
    q = q.reshape(b, T, H, hd).transpose(1, 2)
    k = k.reshape(b, S, H, hd).transpose(1, 2)
    v = v.reshape(b, S, H, hd).transpose(1, 2)
    mask = _merged_mask(m, attn_mask, key_padding_mask, b, T, S, q.dtype)
    dropout = m.dropout if m.training else 0.0
    weights = None
    if a["need_weights"]:
        scores = (q * math.sqrt(1.0 / hd)) @ k.transpose(-2, -1)
        if mask is not None:
            scores = scores + mask
        weights = scores.softmax(-1)
        if dropout > 0:
            weights = F.dropout(weights, p=dropout)
        out = weights @ v
        if a["average_attn_weights"]:
            weights = weights.mean(1)
    else:
        out = F.scaled_dot_product_attention(q, k, v, mask, dropout, is_causal=causal)
    out = m.out_proj(out.transpose(1, 2).reshape(b, T, E))  # a module call: its Linear rule captures it
    if not m.batch_first:
        out = out.transpose(0, 1)
    return out, weights


def _swap_forward(module: nn.Module, make):
    """Give ``module`` the instance forward ``make(original)`` (``original``: its forward until now); returns the
    function that restores it (the class's forward, or the instance forward it had)."""
    own = module.__dict__.get("forward")
    module.forward = make(module.forward)

    def restore():
        if own is None:
            del module.forward
        else:
            module.forward = own

    return restore


def install(engine, layer):
    """Route ``layer.module``'s forward through :func:`_forward`; returns the function that restores it."""

    def make(original):
        return lambda *args, **kwargs: _forward(engine, layer, original, *args, **kwargs)

    return _swap_forward(layer.module, make)


@register(nn.MultiheadAttention, kind="attention", install=install)
def attention(engine, layer, calls, b):
    m = layer.module
    E = m.embed_dim
    by_piece: dict[str, list] = {}
    for call in calls:
        by_piece.setdefault(call.piece, []).append(call)
    bias = m.in_proj_bias
    train_bias = bias is not None and bias.requires_grad
    sq = torch.zeros(b, dtype=calls[0].grad.dtype, device=calls[0].grad.device)
    parts = []  # (weight param, rows or None, finish)
    for i, piece in enumerate("qkv"):
        if not by_piece.get(piece):
            continue
        if m._qkv_same_embed_dim:
            w, rows = m.in_proj_weight, slice(i * E, (i + 1) * E)
        else:
            w, rows = getattr(m, f"{piece}_proj_weight"), None
        sw = engine.scale_of(w)
        sb = engine.scale_of(bias) if train_bias else None
        A, G = stack_calls(by_piece[piece], b)
        s, fin = dense(
            engine,
            f"{layer.name}.{piece}_proj",
            held_operands(A, G),
            weight=w.requires_grad,
            bias=train_bias,
            sw=None if sw is None else (sw if rows is None else sw[rows])[None],
            sb=None if sb is None else sb[i * E : (i + 1) * E],
        )
        sq = sq + s
        parts.append((i, w, rows, fin))
    extra = {}
    for name in ("bias_k", "bias_v"):
        p = getattr(m, name)
        if p is not None and p.requires_grad and by_piece.get(name):
            extra[p] = sum(c.grad.sum(1) for c in by_piece[name])  # (B, E)
    extra = engine.scaled({p: t.reshape(b, *p.shape) for p, t in extra.items()})
    for t in extra.values():
        sq = sq + sq_norms(t)

    def finish(c):
        out = {}
        for i, w, rows, fin in parts:
            ws, bs = fin(c)
            if ws is not None:
                if rows is None:
                    out[w] = ws[0]
                else:
                    out.setdefault(w, torch.zeros_like(w))[rows] = ws[0]
            if bs is not None:
                out.setdefault(bias, torch.zeros_like(bias))[i * E : (i + 1) * E] = bs
        for p, t in extra.items():
            out[p] = weighted(c, t)
        return out

    return sq, finish


_LAYER_INPUTS = {nn.TransformerEncoderLayer: ("src",), nn.TransformerDecoderLayer: ("tgt", "memory")}


@register_adapter(nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)
def _batch_first_while_recording(engine, name, module):
    """For a sequence-first transformer layer: run it batch-first while bk records (see the module docstring)."""
    attns = [m for m in (getattr(module, "self_attn", None), getattr(module, "multihead_attn", None)) if m]
    if all(m.batch_first for m in attns):
        return None
    names = _LAYER_INPUTS[type(module)]
    signature = inspect.signature(type(module).forward)

    def make(original):
        def forward(*args, **kwargs):
            if not engine.recording():
                return original(*args, **kwargs)
            bound = signature.bind(module, *args, **kwargs)
            if bound.arguments[names[0]].dim() != 3:  # unbatched: no batch to find
                return original(*args, **kwargs)
            for n in names:
                bound.arguments[n] = bound.arguments[n].transpose(0, 1)
            for m in attns:
                m.batch_first = True
            try:
                out = original(*bound.args[1:], **bound.kwargs)
            finally:
                for m in attns:
                    m.batch_first = False
            return out.transpose(0, 1)

        return forward

    return _swap_forward(module, make)
