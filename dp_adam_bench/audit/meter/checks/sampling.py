"""The ``sampling`` check: every (step, example) drawn is one the sampler's public structure allows (the steps of its
slot, bin or cyclic group; exact), and the number drawn matches the rate q the ledger records (Poisson, cyclic
Poisson: a binomial z-test, :func:`rate_check`, with its power against q off by ``EFFECT``), or the fixed schedule
exactly (single pass, balls-in-bins).

The structure is re-derived by the meter from each sampler's documented definition and public parameters (seed, N,
B, b: :func:`sampling_reference`), never by replaying the sampler under test, so a sampler whose batches leave its
documented order (reshuffled each epoch, shifted by a step, a wrong partition) fails instead of agreeing with
itself. It cannot see whether Poisson draws are independent across examples and steps beyond their total rate, nor
a rate error too small for the rate test's stated power. The shuffle sampler, accounted as Poisson without being
Poisson, has no structure to re-derive: every pair is its reference, and it fails the fixed-schedule comparison."""

from __future__ import annotations

import math

import numpy as np
import torch

from dp_adam_bench.audit.meter.checks.stats import EFFECT, power_at
from dp_adam_bench.audit.meter.result import MeterCheck


def sampling_reference(sampler, steps: int) -> np.ndarray:
    """(steps, N): whether the sampler's position i may be in the batch of step t (0-based), re-derived here from
    the sampler's documented definition and its public parameters (kind, N, B, b, seed, shuffle), never through
    the sampler's own batches (``iter_from``) or the structures it derived (``groups``, ``members``, ``bins``): a
    sampler whose batches leave its documented order would otherwise be its own reference and agree with itself.

    * single pass: one permutation ``torch.randperm(N)`` from ``torch.Generator().manual_seed(seed)`` (the identity
      without ``shuffle``), cut into N // B batches of B (the last partial batch dropped), cycled epoch after epoch;
    * balls-in-bins: example i's bin is entry i of ``torch.randint(b, (N,))`` from the seed's generator; step t
      holds bin t mod b;
    * cyclic Poisson: group g is ``order[g::b]`` of the seed's permutation ``order``; step t draws from group
      t mod b;
    * Poisson (and any other kind, such as shuffle): every example at every step. Poisson's reference is the whole
      set, independent of the sampler by construction; its draws are judged by the rate alone.
    """
    n, kind = int(sampler.n), getattr(sampler, "kind", "")
    t = np.arange(int(steps))[:, None]
    if kind == "single_pass":
        batch = int(sampler.batch_size)
        per_epoch = n // batch
        order = (
            torch.randperm(n, generator=torch.Generator().manual_seed(int(sampler.seed)))
            if sampler.shuffle
            else torch.arange(n)
        ).numpy()
        slot = np.full(n, -1, dtype=np.int64)  # -1: in the dropped partial batch, never drawn
        slot[order[: per_epoch * batch]] = np.arange(per_epoch * batch) // batch
        return (t % per_epoch) == slot[None, :]
    if kind == "balls_in_bins":
        b = int(sampler.cycle_length)
        bins = torch.randint(b, (n,), generator=torch.Generator().manual_seed(int(sampler.seed))).numpy()
        return (t % b) == bins[None, :]
    if kind == "cyclic_poisson":
        b = int(sampler.cycle_length)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(int(sampler.seed))).numpy()
        group = np.empty(n, dtype=np.int64)
        group[order] = np.arange(n) % b  # order[g::b] is group g
        return (t % b) == group[None, :]
    return np.ones((int(steps), n), dtype=bool)


def sampling_check(recs, population: np.ndarray, sampler, n: int, crit: float) -> MeterCheck:
    """The support (exact) and the rate (Poisson kinds) or the fixed schedule of the batches drawn, against
    :func:`sampling_reference` (independent of the sampler's code). ``population``: the dataset index of each of
    the sampler's positions; ``n``: the task's examples."""
    T = len(recs)
    eligible = sampling_reference(sampler, T)
    pos_of = np.full(n, -1, dtype=np.int64)
    pos_of[population] = np.arange(len(population))
    drawn = np.zeros((T, len(population)), dtype=bool)
    strays = 0  # indices of no private example (out of range, or a public example): outside any structure
    for t, rec in enumerate(recs):
        idx = rec.idx.numpy()
        valid = (idx >= 0) & (idx < n)
        pos = pos_of[idx[valid]]
        strays += int((~valid).sum() + (pos < 0).sum())
        drawn[t, pos[pos >= 0]] = True
    outside = int((drawn & ~eligible).sum()) + strays
    if outside:
        what = f"{outside} (step, example) pairs drawn outside the sampler's public structure"
        return MeterCheck("sampling", "", float(outside), 0.0, None, False, None, what)
    if sampler.kind in ("poisson", "cyclic_poisson"):
        return rate_check(int(drawn.sum()), int(eligible.sum()), float(sampler.q), crit)
    same = bool((drawn == eligible).all())
    what = (
        "every example at exactly the steps of its fixed schedule"
        if same
        else f"{int((eligible & ~drawn).sum())} (step, example) pairs of the fixed schedule not drawn"
    )
    return MeterCheck("sampling", "", float(drawn.sum()), float(eligible.sum()), None, same, 1.0, what)


def rate_check(drawn: int, eligible: int, q: float, crit: float) -> MeterCheck:
    """Poisson-type sampling: ``drawn`` of ``eligible`` (step, example) pairs, each drawn with probability q."""
    expected = q * eligible
    sd = math.sqrt(eligible * q * (1 - q)) if 0 < q < 1 else 0.0
    z = (drawn - expected) / sd if sd > 0 else (0.0 if drawn == expected else math.inf)
    se = sd / expected if expected > 0 else math.inf
    return MeterCheck(
        "sampling",
        "",
        drawn / expected if expected else math.nan,
        1.0,
        z,
        abs(z) <= crit,
        power_at(EFFECT, se, crit),
        f"{drawn} drawn of {eligible} eligible (step, example) pairs at q = {q:.4g}",
    )
