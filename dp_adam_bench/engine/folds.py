"""Batches folded into another dimension: a hooked layer whose input leads with ``R`` rows, ``R`` not the batch
size ``B`` (OPT's decoder layers flatten (B, T, H) to (B·T, H) before their feed-forward block; Swin partitions each
image into windows, (B·windows, tokens, C); a model that drops padding tokens keeps only the real ones, a varying
number per example). Which rows belong to which example is read off the gradients, not guessed from the shapes.

bk's one backward gives each captured layer output ``y`` the gradient of the summed loss, ``g = sum_i dl_i/dy``. A
second backward of the weighted sum ``sum_i w_i l_i`` gives ``g^w = sum_i w_i dl_i/dy``. A row ``r`` through which
only example ``i``'s loss depends on ``y_r`` has ``g^w_r = w_i g_r``: the ratio ``<g^w_r, g_r> / ||g_r||^2`` names
its example (the *owner*). A row whose ratio is none of the weights (it carries several examples' losses) is
refused, naming the layer. With weights ``w_i = i + 1`` one backward separates every example in fp32 / fp64; under
half precision (bf16 autocast: ~3 significant digits) the owner is read in base ``m = ceil(sqrt(B))`` digits, one
backward each (two), so that neighbouring weights stay at least 1/m apart. A row whose gradient is exactly zero
has no owner to read: it adds nothing to any example's gradient (a weight gradient is a sum over rows of
``g_r`` times something), so the dense, embedding and norm rules drop it; the generic rule, which replays the
module per example from its inputs, needs every row placed and takes only the regular arrangements below.

With the owners known, each example's rows are gathered into ``(B, k, ...)`` (k the most rows an example has,
shorter examples padded with zero rows, which add nothing) and the layer's rule takes the k rows as k more
positions, exactly as it takes the tokens of an unfolded batch: ``sum_r g_r^T a_r`` over an example's rows is its
gradient (Bu et al. 2023, arXiv:2210.00038, book-keeping: the per-example gradient of a linear map is a sum over
the positions it is applied at; Li et al. 2022, arXiv:2110.05679, Sec. 4, its Gram form).

Two arrangements are regular: example-major (``reshape(B·k, ...)`` of a (B, k, ...) tensor, Swin's windows; row
``r`` belongs to example ``r // k``) and position-major (a (k, B, ...) tensor flattened; ``r % B``); the generic
rule takes only those. An input (or a generic module's output) that bk expanded from one row shared by the batch
to one row per example (:mod:`dp_adam_bench.engine.broadcast`) is read the same way: a model that reads one copy
for every example (Swinv2's position-bias MLP, viewed and indexed) is refused, not given to example 0.

**Read on every batch, never kept.** Which rows are whose can depend on the data, not only on the shapes: with
the padding dropped, an example owns as many rows as it has real tokens, and two batches with the same B and the
same R (every example 5 tokens; lengths [6, 4, 5]) are arranged differently; with a fixed ``max_length`` the
shapes are equal for any arrangement. A layout kept per (layer call, R / B) once cut such a batch into equal
blocks (norms 19 % off, the clipped sum's sensitivity 1.17 C: issue 56), and no key on shapes can tell the two
apart; knowing each example's row count needs the probe itself. So every batch of more than one example with a
folded call runs the probe (``BKEngine.fold_probes`` counts them). The probe backwards ask only for a second
anchor that the folded calls' captures alone take, so autograd runs the part of the graph above the deepest
folded call: the whole input-gradient chain again for OPT's or Swin's first block and for position embeddings
at the bottom, only the head for a tagger that drops its padding before it.

Cost, measured (CPU, 1 thread, torch 2.13, before = the kept layout, after = read per batch, alternating in one
process, median of 24 steps, two runs): OPT-like (4 layers, H 128, T 64, B 16) 115 -> 170 ms a bk step (+47 %); a
BERT-like encoder of the same size, whose only folded call is its position embedding (a (1, T) row of ids,
expanded) 105 -> 146 ms (+40 %); the zoo's tiny OPT +28-30 %, Swin +32-38 %, BERT +17 %; a tagger that drops its
padding before the head +44-46 % of a 1-2 ms step. Almost all of it is the probe backward; reading the owners is a
few passes over each folded gradient in its own precision. A row that does not read as one example's is read
again in binary digits (weights 1 and 2, exact in floating point, ceil(log2 B) probes) before it is refused: a
gradient that is mostly rounding (weights trained to 1e5) changes when a loss is weighted by 3, not by 2.

A wrong arrangement cannot pass silently: owners are read, not assumed, and the engine self-check compares the
result with the loop over batches of size one. What the reading cannot see: a row that carries a small share of
another example's loss (below ``_RATIO_SLACK`` of its gradient over the two weights' difference) is read as its main
example's; only a model that breaks the per-example contract (an example's loss depending on another's data) makes
one.
"""

from __future__ import annotations

import math

import torch

#: a row's ratio must be within this fraction of a unit of a weight (digit) to name its owner
_RATIO_SLACK = 0.25


def digits_base(b: int, dtype: torch.dtype) -> tuple[int, int]:
    """``(base, digits)`` of the probe weights: one digit of base B in fp32 / fp64, two of base ceil(sqrt(B))
    in half precision."""
    if dtype in (torch.float16, torch.bfloat16) and b > 8:
        return max(2, math.ceil(math.sqrt(b))), 2
    return max(b, 1), 1


def probe_weights(b: int, base: int, digit: int, dtype, device) -> torch.Tensor:
    """The loss weights of one probe backward: ``w_i = (i // base^digit) % base + 1``."""
    i = torch.arange(b, device=device)
    return ((i // base**digit) % base + 1).to(dtype)


def owners(g: torch.Tensor, weighted: list[torch.Tensor], base: int, b: int) -> tuple[torch.Tensor, bool]:
    """Each row's example from the summed gradient ``g`` (R, ...) and the probes' weighted ones: (R,) long, -1 for
    a row with a zero gradient; and whether every row with a gradient has exactly one owner.

    Computed in the gradients' own precision (half precision brought to fp32): the probes' rounding, not this
    arithmetic, is what the quarter-unit slack absorbs, and fp64 copies of every folded layer's gradients cost more
    than the probe backward itself (OPT-like, 4 layers: 49 of 84 ms a step). A row whose largest entry is below
    2^-50 or above 2^50 (a confident prediction's 1e-20) is scaled to 1 first, so that its squares neither
    underflow, and the row be taken for zero, nor overflow."""
    R = g.shape[0]
    work = g.dtype if g.dtype in (torch.float32, torch.float64) else torch.float32
    g = g.reshape(R, -1).to(work)
    top = torch.linalg.vector_norm(g, ord=math.inf, dim=1) if g.shape[1] else g.new_zeros(R)
    live = top > 0
    odd = live & ((top < 2.0**-50) | (top > 2.0**50))
    unit = torch.where(odd, top, torch.ones_like(top))[:, None] if bool(odd.any()) else None
    if unit is not None:
        g = g / unit
    sq = torch.linalg.vecdot(g, g)
    norm = sq.sqrt()
    owner = torch.zeros(R, dtype=torch.long, device=g.device)
    ok = True
    for digit, gw in enumerate(weighted):
        gw = gw.reshape(R, -1).to(work)
        if unit is not None:
            gw = gw / unit
        ratio = torch.linalg.vecdot(gw, g) / sq.clamp(min=torch.finfo(work).tiny)
        near = ratio.round()
        resid = torch.linalg.vector_norm(torch.addcmul(gw, near[:, None], g, value=-1), dim=1)
        fits = (
            ((ratio - near).abs() <= _RATIO_SLACK)
            & (near >= 1)
            & (near <= base)
            & (resid <= _RATIO_SLACK * norm)
        )
        ok = ok and bool(fits[live].all())
        owner = owner + (near.long().clamp(1, base) - 1) * base**digit
    ok = ok and bool((owner[live] < b).all())
    return torch.where(live, owner, torch.full_like(owner, -1)), ok


def regular(kind: str, R: int, b: int, device) -> torch.Tensor:
    """The (B, k) row index of a regular arrangement of ``R`` rows."""
    rows = torch.arange(R, device=device)
    return rows.reshape(b, R // b) if kind == "example" else rows.reshape(R // b, b).t()


def arrangement(owner: torch.Tensor, b: int) -> tuple[str, torch.Tensor]:
    """``(kind, index)``: ``example`` / ``position`` (regular, every row placed) or ``irregular``, and the (B, k)
    row index of each example's rows (``R`` = a zero row appended for padding)."""
    R = owner.shape[0]
    live = owner >= 0
    rows = torch.arange(R, device=owner.device)
    if R % b == 0:
        k = R // b
        if bool((owner[live] == rows[live] // k).all()):
            return "example", regular("example", R, b, owner.device)
        if bool((owner[live] == rows[live] % b).all()):
            return "position", regular("position", R, b, owner.device)
    counts = torch.bincount(owner[live], minlength=b)
    k = int(counts.max()) if counts.numel() else 0
    index = torch.full((b, max(k, 1)), R, dtype=torch.long, device=owner.device)
    order = torch.argsort(owner[live], stable=True)
    ids = rows[live][order]
    who = owner[live][order]
    start = torch.cumsum(counts, 0) - counts
    slot = torch.arange(ids.shape[0], device=owner.device) - start[who]
    index[who, slot] = ids
    return "irregular", index


def gather(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The rows of ``t`` (R, ...) at ``index`` (B, k), index R a zero row: (B, k, ...)."""
    R = t.shape[0]
    if bool((index < R).all()):
        return t[index]
    padded = torch.cat([t, t.new_zeros(1, *t.shape[1:])])
    return padded[index]
