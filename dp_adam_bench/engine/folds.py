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
``r`` belongs to example ``r // k``) and position-major (a (k, B, ...) tensor flattened; ``r % B``). An arrangement
found regular on the rows that have an owner is extended to all rows and kept for that layer call and shape
(``B``, ``R``), so later batches of the same shape need no second backward; any other arrangement is read again on
every batch. A wrong guess cannot pass silently: owners are read, not assumed, and the engine self-check compares
the result with the loop over batches of size one.
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
    a row with a zero gradient; and whether every row with a gradient has exactly one owner."""
    R = g.shape[0]
    g = g.reshape(R, -1).double()
    sq = g.square().sum(1)
    live = sq > 0
    owner = torch.zeros(R, dtype=torch.long, device=g.device)
    ok = True
    for digit, gw in enumerate(weighted):
        gw = gw.reshape(R, -1).double()
        ratio = (gw * g).sum(1) / sq.clamp(min=torch.finfo(torch.float64).tiny)
        near = ratio.round()
        resid = (gw - near[:, None] * g).square().sum(1).sqrt()
        fits = (
            ((ratio - near).abs() <= _RATIO_SLACK)
            & (near >= 1)
            & (near <= base)
            & (resid <= _RATIO_SLACK * sq.sqrt())
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
