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

import torch

#: the Gram form pays T^2 (d + p) multiply-adds in small batched matmuls; instantiating pays T p d in matmuls
#: plus ~3 memory-bound passes over the (B, p, d) per-example gradients (write, norm, weighted sum), which on a
#: CPU cost about as much as 10 matmul multiply-adds per element: the Gram form wins iff T^2 (d + p) < ~30 p d.
GRAM_FACTOR = 30
_GRAM_CHUNK = 1 << 24  # at most this many Gram-matrix (or per-example-gradient) entries at once


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
    instantiates every Linear of a T = 128 transformer and the LM heads, 1.5-1.75x slower end to end. Bu et al.'s
    BK-MixOpt rule ``2 T^2 < p d`` compares the two paths' memory instead. For T = 1 (a Linear on (B, d)) the Gram
    form is just ``||a||^2 ||g||^2`` and always wins.
    """
    return T * T * (d + p) < GRAM_FACTOR * p * d


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


def _per_example(G: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    """``G_i^T A_i`` per example and group: (B, k, p, d). One group: a plain ``bmm``, which reads transposed
    operands in place (``einsum`` copied them into its preferred layout: most of bk's CPU time on CNN5)."""
    if G.shape[2] == 1:
        return torch.bmm(G[:, :, 0].transpose(1, 2), A[:, :, 0]).unsqueeze(1)
    return torch.einsum("btkp,btkd->bkpd", G, A)


def _weighted_sum(G: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    """``sum_i G_i^T A_i`` over examples and positions, per group: (k, p, d)."""
    if G.shape[2] == 1:
        return torch.mm(G.reshape(-1, G.shape[3]).t(), A.reshape(-1, A.shape[3])).unsqueeze(0)
    return torch.einsum("btkp,btkd->kpd", G, A)


def dense(engine, name: str, A, G, *, weight: bool, bias: bool, sw=None, sb=None):
    """Squared per-example norms (B,) of the gradients of a grouped dense map and ``finish(c)`` ->
    ``(weight sum (k, p, d) or None, bias sum (k * p,) or None)``.

    ``A`` (B, T, k, d) are the inputs and ``G`` (B, T, k, p) the output gradients of ``k`` groups at ``T``
    positions; ``weight`` / ``bias``: whether those parameters are trained; ``sw`` (k, p, d) / ``sb`` (k * p,):
    per-coordinate scales (scale-then-privatize), which force the instantiated path (the Gram form cannot see a
    per-coordinate scale), a chunk of examples at a time."""
    b, T, k, d = A.shape
    p = G.shape[3]
    sq = torch.zeros(b, dtype=G.dtype, device=G.device)
    gb = None
    if bias:
        gb = G.sum(1).reshape(b, k * p)
        if sb is not None:
            gb = gb * sb
        sq = sq + gb.square().sum(1)
    W = None
    if weight:
        if sw is not None:
            engine.record(name, "instantiate")
            step = max(1, _GRAM_CHUNK // (k * p * d))
            sq = sq + torch.cat(
                [sq_norms(_per_example(G[i : i + step], A[i : i + step]) * sw) for i in range(0, b, step)]
            )
        elif engine.path(name, T, d, p):
            sq = sq + gram_sq(_per_group(A), _per_group(G)).reshape(b, k).sum(1)
        else:
            W = _per_example(G, A)
            sq = sq + sq_norms(W)
            A = G = None  # the clipped sum needs only W: free the (unfolded) activations now

    def finish(c):
        ws = None
        if weight:
            if W is not None:
                ws = weighted(c, W)
            else:
                ws = _weighted_sum(G * c[:, None, None, None], A)
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
