"""Per-example norms and clipped sums of a dense map ``y_t = W a_t (+ b)`` seen at ``T`` positions per example
(tokens, or the output pixels of a convolution), in groups: the math every weight-matrix rule shares.

For one group the per-example weight gradient is ``G_i^T A_i`` (p x d), and (Li et al. 2022, "Large language
models can be strong differentially private learners", arXiv:2110.05679, Sec. 4, ghost clipping)

    ||G_i^T A_i||_F^2 = <A_i A_i^T, G_i G_i^T>,

the Gram form, which never builds the p x d matrix. :func:`use_gram` picks per layer the cheaper of the Gram form
and instantiating ``G_i^T A_i`` (Bu, Mao & Xu, "Scalable and efficient training of large convolutional neural
networks with differential privacy", NeurIPS 2022, mixed ghost clipping; Bu et al. 2023, arXiv:2210.00038,
book-keeping). The clipped sum is one matmul either way, ``(c * G)^T A`` over all examples and positions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

#: the Gram form pays T^2 (d + p) multiply-adds in small batched matmuls; instantiating pays T p d in matmuls
#: plus ~3 memory-bound passes over the (B, p, d) per-example gradients (write, norm, weighted sum), which on a
#: CPU cost about as much as 10 matmul multiply-adds per element: the Gram form wins iff T^2 (d + p) < ~30 p d.
GRAM_FACTOR = 30
_GRAM_CHUNK = 1 << 24  # at most this many Gram-matrix (or per-example-gradient) entries at once
#: scaled per-example gradients (scale-then-privatize) are only normed, so they are made a cache-sized chunk of
#: examples at a time into one reused buffer and scaled in place: CNN5 B = 256 stp went from 0.53 to 0.28 s a step
#: (2 threads; 16M-entry chunks and a fresh ``w * s`` each: 0.53 s; 256K-entry chunks: 0.34 s)
_SCALED_CHUNK = 1 << 21


def use_gram(T: int, d: int, p: int, fits: bool = True) -> bool:
    """Whether the Gram ("ghost") form is cheaper than instantiating the per-example gradient of a layer
    ``y_t = W a_t`` (W: p x d) seen at ``T`` positions per example; ``fits``: whether a per-example gradient
    (``p d`` numbers) is no larger than what the layer already holds for the clipped sum (its inputs and output
    gradients).

    Per-example cost (as implemented here):

    * Gram: ``A A^T`` and ``G G^T`` cost ``T^2 (d + p)`` multiply-adds; the clipped sum is then one matmul
      ``(c G)^T A`` over all B*T positions, ``T p d`` per example. Extra memory: two T x T matrices per example of
      a chunk.
    * instantiate: ``G_i^T A_i`` costs ``T p d``; then its norm and the c-weighted sum read the (B, p, d) tensor
      again. Extra memory: ``p d`` per example, kept until the clipped sum (instead of the inputs and output
      gradients, which are freed).

    A per-example gradient that does not ``fit`` always takes the Gram form: keeping it would raise the step's
    peak memory, and not keeping it means a second ``T p d`` matmul for the clipped sum, more than the Gram
    form's ``T^2 (d + p)`` whenever ``p d > T (d + p)`` (the memory rule of Bu et al.'s BK-MixOpt, "2 T^2 < p d",
    compares the same two quantities). Otherwise the ``T p d`` matmul is common to both; what differs is
    ``T^2 (d + p)`` matmul work against ``p d`` elements written and read a few times, which is memory-bound.
    Measured on one CPU thread (torch 2.13, B = 8-256), the crossover is at ``T^2 (d + p) / (p d)`` of about 30
    (:data:`GRAM_FACTOR`): CNN5 conv3 (ratio 23) 37 ms Gram vs 63 ms instantiated, GPT-2's MLP in (27) 61 vs
    92 ms, BERT-tiny's FFN (160) 16 vs 8 ms, CNN5 conv2 (967) 211 vs 29 ms. A flop count alone
    (``T^2 (d + p) < 2 p d``) instantiates every Linear of a T = 128 transformer and the LM heads, 1.5-1.75x
    slower end to end. For T = 1 (a Linear on (B, d)) the Gram form is just ``||a||^2 ||g||^2`` and always wins.
    """
    return not fits or T * T * (d + p) < GRAM_FACTOR * p * d


def sq_norms(per_ex: torch.Tensor) -> torch.Tensor:
    """Squared L2 norm of each example's slice: ``linalg.vector_norm`` (one fused pass; ``square().sum()``
    materialises the squares and was ~10x slower on a (B, p, d) tensor here)."""
    return torch.linalg.vector_norm(per_ex.reshape(per_ex.shape[0], -1), dim=1).square()


def weighted(c: torch.Tensor, per_ex: torch.Tensor) -> torch.Tensor:
    """sum_i c_i per_ex[i]."""
    return (c @ per_ex.reshape(per_ex.shape[0], -1)).reshape(per_ex.shape[1:])


def gram_sq(A: torch.Tensor, G: torch.Tensor, same_token: bool = False) -> torch.Tensor:
    """Per-example ``<A_i A_i^T, G_i G_i^T>`` for A (B, T, d), G (B, T, p); with ``same_token`` A holds token ids
    (B, T) and the first Gram matrix is ``[id_t == id_s]``. Chunks of examples keep each Gram matrix batch under
    ``_GRAM_CHUNK`` entries."""
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


def _per_group(t: torch.Tensor) -> torch.Tensor:
    """(B, T, k, n) -> (B * k, T, n): each group as its own example (a view when k == 1)."""
    b, T, k, n = t.shape
    return t[:, :, 0] if k == 1 else t.permute(0, 2, 1, 3).reshape(b * k, T, n)


def _per_example(G: torch.Tensor, A: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``G_i^T A_i`` per example and group: (B, k, p, d), written into ``out`` if given. One group: a plain
    ``bmm``, which reads transposed operands in place (``einsum`` copied them into its preferred layout: most of
    bk's CPU time on CNN5)."""
    if G.shape[2] == 1:
        if out is None:
            return torch.bmm(G[:, :, 0].transpose(1, 2), A[:, :, 0]).unsqueeze(1)
        torch.bmm(G[:, :, 0].transpose(1, 2), A[:, :, 0], out=out[:, 0])
        return out
    w = torch.einsum("btkp,btkd->bkpd", G, A)
    return w if out is None else out.copy_(w)


def weighted_sum(G: torch.Tensor, A: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``sum_i c_i G_i^T A_i`` over examples and positions, per group: (k, p, d), in ``c``'s precision, for
    operands held as (B, T, k, p) / (B, T, k, d) tensors (the clipped sum of a Linear)."""
    Gc = G.to(c.dtype) * c[:, None, None, None]
    A = A.to(c.dtype)
    if G.shape[2] == 1:
        return torch.mm(Gc.reshape(-1, G.shape[3]).t(), A.reshape(-1, A.shape[3])).unsqueeze(0)
    return torch.einsum("btkp,btkd->kpd", Gc, A)


@dataclass
class Operands:
    """What :func:`dense` needs of one layer, however the layer holds its inputs.

    ``G`` (B, T, k, p): the output gradients of ``k`` groups at ``T`` positions; ``d``: the input size of a group;
    ``inputs(i, j)``: the inputs of examples ``i:j``, (j - i, T, k, d) (a Linear's are a view; a convolution's
    patches are unfolded one chunk of examples at a time, so the whole unfolded input never exists);
    ``weight_sum(c)``: ``sum_i c_i G_i^T A_i`` as (k, p, d), from what the layer holds (a Linear: one matmul; a
    convolution: the convolution's own weight-gradient kernel); ``held``: the bytes the layer holds for that sum
    (inputs and output gradients), against which the size of its per-example gradients is weighed;
    ``per_example(i, j)``: optionally, the per-example gradients of examples ``i:j`` as (j - i, k, p, d) by a
    kernel of the layer's own (default: ``G_i^T A_i`` from ``inputs``)."""

    G: torch.Tensor
    d: int
    inputs: Callable[[int, int], torch.Tensor]
    weight_sum: Callable[[torch.Tensor], torch.Tensor]
    held: int
    per_example: Callable[[int, int], torch.Tensor] | None = None


def held_operands(A: torch.Tensor, G: torch.Tensor) -> Operands:
    """:class:`Operands` of inputs ``A`` (B, T, k, d) held as they are (a Linear)."""
    held = A.numel() * A.element_size() + G.numel() * G.element_size()
    return Operands(G, A.shape[3], lambda i, j: A[i:j], lambda c: weighted_sum(G, A, c), held)


def examples_per_chunk(b: int, per_example: int) -> int:
    """Examples per chunk so that a temporary of ``per_example`` numbers per example stays under _GRAM_CHUNK."""
    return max(1, min(b, _GRAM_CHUNK // max(1, per_example)))


def dense(engine, name: str, ops: Operands, *, weight: bool, bias: bool, sw=None, sb=None):
    """Squared per-example norms (B,) of the gradients of a grouped dense map and ``finish(c)`` ->
    ``(weight sum (k, p, d) or None, bias sum (k * p,) or None)``.

    ``ops``: the layer's :class:`Operands`; ``weight`` / ``bias``: whether those parameters are trained;
    ``sw`` (k, p, d) / ``sb`` (k * p,): per-coordinate scales (scale-then-privatize), which force per-example
    gradients for the norms (the Gram form cannot see a per-coordinate scale); they are not kept: the clipped
    sum is ``S * weight_sum(c)``, the scale being the same for every example.

    Everything is computed in the parameters' precision (``engine.dtype``: fp32 under bf16 autocast) from operands
    held as the layer saw them, a chunk of examples at a time (no temporary exceeds _GRAM_CHUNK numbers, and no
    whole-layer copy in another precision is made before the clipped sum)."""
    G = ops.G
    b, T, k, p = G.shape
    d = ops.d
    dt = engine.dtype
    sq = torch.zeros(b, dtype=dt, device=G.device)
    gb = None
    if bias:
        gb = G.sum(1, dtype=dt).reshape(b, k * p)
        if sb is not None:
            gb = gb * sb
        sq = sq + gb.square().sum(1)
    W = None
    if weight:
        if sw is not None:
            engine.record(name, "instantiate")
            gram = False
        else:
            gram = engine.path(name, T, d, p, fits=b * k * p * d * dt.itemsize <= ops.held)
        if not gram and sw is None:
            W = torch.empty(b, k, p, d, dtype=dt, device=G.device)  # kept for the clipped sum
            engine.kept(W)
        step = examples_per_chunk(b, k * max(T * d, T * T if gram else p * d))
        buf = None
        if sw is not None:  # scaled gradients are only normed: cache-sized chunks, one buffer (_SCALED_CHUNK)
            step = max(1, min(b, _SCALED_CHUNK // max(1, k * p * d)))
            if ops.per_example is None:
                buf = torch.empty(step, k, p, d, dtype=dt, device=G.device)
        parts = []
        for i in range(0, b, step):
            j = min(b, i + step)
            if gram:
                a, g = ops.inputs(i, j).to(dt), G[i:j].to(dt)
                parts.append(gram_sq(_per_group(a), _per_group(g)).reshape(j - i, k).sum(1))
                continue
            if ops.per_example is not None:
                w = ops.per_example(i, j).to(dt)
                if W is not None:
                    W[i:j] = w
            else:
                out = W[i:j] if W is not None else (buf[: j - i] if buf is not None else None)
                w = _per_example(G[i:j].to(dt), ops.inputs(i, j).to(dt), out)
            parts.append(sq_norms(w if sw is None else w.mul_(sw)))
        if parts:  # none for an empty batch
            sq = sq + torch.cat(parts)
        if W is not None:
            ops = None  # the clipped sum needs only W: the layer's inputs and output gradients can go

    def finish(c):
        ws = None
        if weight:
            if W is not None:
                ws = weighted(c, W)
            else:
                ws = ops.weight_sum(c)
                if sw is not None:
                    ws = ws * sw
        return ws, (c @ gb if gb is not None else None)

    return sq, finish


def from_per_example(per_ex: dict, b: int, device=None):
    """Norms and finish for layers whose per-example gradients are small and instantiated: ``{param: (B, ...)}``."""
    sq = sum((sq_norms(t) for t in per_ex.values()), torch.zeros(b, device=device))

    def finish(c):
        return {p: weighted(c, t) for p, t in per_ex.items()}

    return sq, finish
