"""``nn.Embedding`` and ``nn.EmbeddingBag``: an example's gradient of the table is a scatter of its output
gradients onto the rows of the ids it looked up.

With ``padding_idx`` the padding row receives no gradient (torch's own backward zeroes it), so output gradients at
padding positions are dropped before anything else. Two exact paths for the norms: the Gram form
``sum_{t,s} [id_t = id_s] g_t . g_s`` (T^2 per example), or — the default unless T = 1 — the output gradients
summed per distinct (example, id) pair, which are the nonzero rows of the example's gradient (O(T p)). The
clipped sum is an ``index_add`` either way.

``EmbeddingBag`` reduces each bag (one example: 2-D ids (B, L)) to one vector, so the gradient reaching id ``t`` of
bag ``i`` is ``w_it g_i`` with ``w_it`` = 1 (``sum``), the per-sample weight (``sum`` with
``per_sample_weights``) or 1 / (the bag's non-padding ids) (``mean``); it then takes the Embedding path. ``max``
(the gradient goes to the arg-max id of each coordinate) and 1-D ids with offsets (the examples are not along
dim 0) are refused. ``scale_grad_by_freq`` and ``max_norm`` are refused by every engine
(:mod:`dp_adam_bench.engine.support`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from dp_adam_bench.engine.bk_rules.dense import gram_sq
from dp_adam_bench.engine.bk_rules.registry import register
from dp_adam_bench.engine.bk_rules.shared import Use


def token_rule(engine, name: str, m: nn.Module, ids: torch.Tensor, G: torch.Tensor, b: int):
    """Norms and finish of a table ``m.weight`` (V, p) whose rows ``ids`` (B, T) received output gradients
    ``G`` (B, T, p) (padding positions already zeroed)."""
    V, p = m.weight.shape
    sw = engine.scale_of(m.weight)
    if engine.shares(m.weight):  # tied weights (bk_rules/shared.py): onehot(ids)^T G per example
        engine.share(m.weight, Use(name, ids=ids, R=G))
    if engine.path(name, ids.shape[1], 1, p, embedding=True):
        sq = gram_sq(ids, G, same_token=True)

        def finish(c):
            rows = (G * c[:, None, None]).reshape(-1, p)
            return {m.weight: torch.zeros_like(m.weight).index_add_(0, ids.reshape(-1), rows)}

        return sq, finish
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


@register(nn.Embedding, kind="embedding", shares=True)
def embedding(engine, layer, calls, b):
    m = layer.module
    ids = torch.cat([c.args[0].reshape(b, -1) for c in calls], 1)
    G = torch.cat([c.grad.reshape(b, -1, c.grad.shape[-1]) for c in calls], 1)
    if m.padding_idx is not None:
        G = G.masked_fill((ids == m.padding_idx)[..., None], 0)
    return token_rule(engine, layer.name, m, ids, G, b)


def _scale_of(m: nn.Module):
    """A scaled word embedding's scalar ``embed_scale`` (a number or a one-element tensor), or None."""
    s = getattr(m, "embed_scale", None)
    if isinstance(s, (int, float)) and not isinstance(s, bool):
        return float(s)
    if isinstance(s, torch.Tensor) and s.numel() == 1:
        return s.detach().reshape(())
    return None


def _is_scaled_lookup(m: nn.Module) -> bool:
    """Whether ``m`` computes ``embedding(ids) * embed_scale``, as every ``*ScaledWordEmbedding`` of transformers
    5 does (BART, mBART, M2M100, Pegasus-X, Gemma, ...): checked on one id, so that a class of that name computing
    something else takes the generic rule."""
    s = _scale_of(m)
    if s is None or not isinstance(m, nn.Embedding) or m.weight.device.type == "meta":
        return False
    ids = torch.tensor([[m.num_embeddings - 1]], device=m.weight.device)
    try:
        with torch.no_grad():
            out = m(ids)
    except Exception:  # noqa: BLE001  (any failure: not the lookup this rule assumes)
        return False
    want = F.embedding(ids, m.weight, m.padding_idx) * s
    return isinstance(out, torch.Tensor) and out.shape == want.shape and torch.equal(out, want.to(out.dtype))


@register(("transformers", "*ScaledWordEmbedding"), kind="embedding", shares=True, accepts=_is_scaled_lookup)
def scaled_embedding(engine, layer, calls, b):
    """``embedding(ids) * embed_scale``: the Embedding rule with the output gradients times the scale."""
    m = layer.module
    s = _scale_of(m)
    ids = torch.cat([c.args[0].reshape(b, -1) for c in calls], 1)
    G = torch.cat([c.grad.reshape(b, -1, c.grad.shape[-1]) for c in calls], 1) * s
    if m.padding_idx is not None:
        G = G.masked_fill((ids == m.padding_idx)[..., None], 0)
    return token_rule(engine, layer.name, m, ids, G, b)


def _refuse_bag(m: nn.EmbeddingBag) -> str | None:
    if m.mode == "max":
        return (
            "EmbeddingBag(mode='max') has no bk rule (use mode 'sum' or 'mean', or train.clipping=functorch)"
        )
    return None


def _bag_call(m: nn.EmbeddingBag, call, name: str):
    """(ids (B, L), per-sample weights or None) of one call; 1-D ids with offsets are refused."""
    args = list(call.args) + [None] * 3
    ids = args[0]
    offsets = args[1] if args[1] is not None else call.kwargs.get("offsets")
    psw = args[2] if args[2] is not None else call.kwargs.get("per_sample_weights")
    if ids.dim() != 2 or offsets is not None:
        raise ValueError(
            f"bk clipping: EmbeddingBag {name!r} got 1-D ids with offsets; bk needs 2-D ids of shape (B, L), one "
            "bag per example (or use train.clipping=functorch)"
        )
    return ids, psw


@register(nn.EmbeddingBag, kind="embedding_bag", refuse=_refuse_bag, shares=True)
def embedding_bag(engine, layer, calls, b):
    m = layer.module
    ids_all, G_all = [], []
    for call in calls:
        ids, psw = _bag_call(m, call, layer.name)
        keep = torch.ones_like(ids, dtype=call.grad.dtype)
        if m.padding_idx is not None:
            keep = keep.masked_fill(ids == m.padding_idx, 0)
        if m.mode == "mean":
            w = keep / keep.sum(1, keepdim=True).clamp(min=1)
        else:
            w = keep if psw is None else keep * psw.to(keep.dtype)
        ids_all.append(ids)
        G_all.append(w[..., None] * call.grad[:, None, :])
    ids = torch.cat(ids_all, 1)
    G = torch.cat(G_all, 1)
    return token_rule(engine, layer.name, m, ids, G, b)
