"""One ``nn.Parameter`` used by several layers in one forward: tied input and output embeddings (GPT-2, T5, BART,
Llama variants with ``tie_word_embeddings``), an encoder-decoder's ``shared`` table looked up by the encoder's and
the decoder's ``embed_tokens``.

An example's gradient of such a parameter ``W`` is the sum over its uses, ``g_i = sum_u g_i^u``, so its squared
norm is not the sum of the uses' squared norms (what each layer's rule computes) but

    ||g_i||^2 = sum_u ||g_i^u||^2 + 2 sum_{u < v} <g_i^u, g_i^v>_F,

and its clipped sum is the sum of the uses' clipped sums (same clip factors). The engine adds the *cross terms*
``<g_i^u, g_i^v>`` computed here; untying the parameter (one trained copy per use) would change the model.

Each use hands in its per-example gradient as a :class:`Use`: a factor pair ``g_i^u = L_i^T R_i`` in the
parameter's layout, or the instantiated tensor.

* a Linear ``y = W a``, W (p, d): ``L = G`` (T, p), ``R = A`` (T, d); GPT-2's ``Conv1D`` (W stored (d, p)):
  ``L = A``, ``R = G``;
* an Embedding, W (V, H), as the linear map of the one-hot ids: ``L = onehot(ids)`` (T, V), ``R = G`` (T, H),
  held as the ids (never a one-hot matrix);
* any other rule (the generic rule, norms): its instantiated per-example gradients (B, *W.shape).

For two factor pairs the cross term is the Gram form of ghost clipping extended to two layers (Li et al. 2022,
arXiv:2110.05679, Sec. 4, whose ``||G^T A||^2 = <A A^T, G G^T>`` is the case u = v):

    <L_u^T R_u, L_v^T R_v>_F = sum_{t,s} (L_u L_v^T)_{ts} (R_u R_v^T)_{ts},

with ``(L_u L_v^T)_{ts}`` the index-equality mask ``[id_t = id'_s]`` for two embeddings and the gather
``L_v[s, id_t]`` for an embedding against a dense factor (the tied LM head's output gradient at the looked-up
token: T_u x T_v numbers per example, never a (T, V) one-hot). Where that costs more than instantiating both
gradients (``T_u T_v (n + l)`` against ``GRAM_FACTOR m n`` per example, as :func:`~.dense.use_gram` weighs the Gram
form of one layer; Bu et al. 2023, arXiv:2210.00038, book-keeping), or where a use is held instantiated, or under a
per-coordinate scale (scale-then-privatize: ``<S g^u, S g^v>``, which no Gram form sees), the per-example gradients
are instantiated a chunk of examples at a time and their inner products summed; the choice is recorded in
``BKEngine.choices`` under ``"<parameter> (shared)"``. A use whose rule gives neither form (a convolution, an
``nn.MultiheadAttention`` projection) is refused naming the layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dp_adam_bench.engine.bk_rules.dense import GRAM_FACTOR, examples_per_chunk


@dataclass
class Use:
    """One layer's per-example gradient of a shared parameter: ``L^T R`` per example with ``L`` (B, T, m) or the
    one-hot of ``ids`` (B, T) and ``R`` (B, T, n); or ``per_ex`` (B, *shape) instantiated. Unscaled (a
    per-coordinate scale is applied by :func:`cross_terms`)."""

    layer: str
    L: torch.Tensor | None = None
    ids: torch.Tensor | None = None
    R: torch.Tensor | None = None
    per_ex: torch.Tensor | None = None

    @property
    def factored(self) -> bool:
        return self.per_ex is None

    @property
    def T(self) -> int:
        return self.R.shape[1]

    def instantiate(self, i: int, j: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """The per-example gradients of examples ``i:j``, (j - i, *shape), in ``dtype``."""
        if self.per_ex is not None:
            return self.per_ex[i:j].to(dtype).reshape(j - i, *shape)
        R = self.R[i:j].to(dtype)
        if self.ids is not None:
            rows = shape[0]
            out = R.new_zeros(j - i, rows, R.shape[2])
            out.scatter_add_(1, self.ids[i:j, :, None].expand(-1, -1, R.shape[2]), R)
            return out.reshape(j - i, *shape)
        return torch.bmm(self.L[i:j].to(dtype).transpose(1, 2), R).reshape(j - i, *shape)


def _outer(u: Use, v: Use, i: int, j: int, dtype) -> torch.Tensor:
    """``L_u L_v^T`` for examples ``i:j``: (j - i, T_u, T_v)."""
    if u.ids is not None and v.ids is not None:
        return (u.ids[i:j, :, None] == v.ids[i:j, None, :]).to(dtype)
    if u.ids is not None:  # (L_u L_v^T)_{ts} = L_v[s, id_t]
        Lv = v.L[i:j].to(dtype)
        return torch.gather(Lv, 2, u.ids[i:j, None, :].expand(-1, Lv.shape[1], -1)).transpose(1, 2)
    if v.ids is not None:
        return _outer(v, u, i, j, dtype).transpose(1, 2)
    return torch.bmm(u.L[i:j].to(dtype), v.L[i:j].to(dtype).transpose(1, 2))


def _gram_cross(u: Use, v: Use, b: int, dtype) -> torch.Tensor:
    """``<L_u^T R_u, L_v^T R_v>`` per example by the two-layer Gram form (module docstring)."""
    step = examples_per_chunk(b, u.T * v.T)
    out = []
    for i in range(0, b, step):
        j = min(b, i + step)
        rr = torch.bmm(u.R[i:j].to(dtype), v.R[i:j].to(dtype).transpose(1, 2))
        out.append((_outer(u, v, i, j, dtype) * rr).sum((1, 2)))
    return torch.cat(out)  # b >= 1: an empty batch never reaches the engine's rules


def _instantiated_cross(u: Use, v: Use, b: int, shape: tuple, dtype, s2: torch.Tensor | None) -> torch.Tensor:
    """``<S g^u_i, S g^v_i>`` per example from the instantiated gradients, a chunk of examples at a time."""
    step = examples_per_chunk(b, int(torch.Size(shape).numel()))
    out = []
    for i in range(0, b, step):
        j = min(b, i + step)
        prod = u.instantiate(i, j, shape, dtype) * v.instantiate(i, j, shape, dtype)
        if s2 is not None:
            prod = prod * s2
        out.append(prod.reshape(j - i, -1).sum(1))
    return torch.cat(out)


def _gram_cheaper(u: Use, v: Use, shape: tuple) -> bool:
    """Whether the two-layer Gram form costs less than instantiating both gradients (module docstring)."""
    m = shape[0]
    n = int(torch.Size(shape[1:]).numel())
    width = lambda w: 1 if w.ids is not None else w.L.shape[2]  # noqa: E731  (L's width: 1 for ids, a gather)
    return u.T * v.T * (n + min(width(u), width(v))) < GRAM_FACTOR * m * n


def cross_terms(engine, name: str, param, uses: list[Use], b: int) -> torch.Tensor:
    """``2 sum_{u < v} <S g^u_i, S g^v_i>`` (B,) for the uses of ``param`` (named ``name``), ``S`` its
    per-coordinate scale if any; the path taken is recorded in ``engine.choices[name + " (shared)"]``."""
    dtype = engine.dtype
    shape = tuple(param.shape)
    scale = engine.scale_of(param)
    s2 = None if scale is None else (scale.to(dtype) ** 2)
    total = torch.zeros(b, dtype=dtype, device=param.device)
    paths = set()
    for k, u in enumerate(uses):
        for v in uses[k + 1 :]:
            gram = u.factored and v.factored and s2 is None and len(shape) == 2
            if gram and engine.mode != "auto":
                gram = engine.mode == "gram"
            elif gram:
                gram = _gram_cheaper(u, v, shape)
            if gram:
                total = total + 2 * _gram_cross(u, v, b, dtype)
            else:
                total = total + 2 * _instantiated_cross(u, v, b, shape, dtype, s2)
            paths.add("gram" if gram else "instantiate")
    engine.record(f"{name} (shared)", "+".join(sorted(paths)))
    return total


def share_instantiated(engine, layer, per_ex: dict) -> None:
    """Hand the engine the instantiated per-example gradients ``{param: (B, *shape)}`` (unscaled) of those of
    ``layer``'s parameters that other layers use too."""
    for p, t in per_ex.items():
        if engine.shares(p):
            engine.share(p, Use(layer.name, per_ex=t))
