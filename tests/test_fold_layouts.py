"""Which example each row of a folded batch belongs to is read on every batch, never kept from an earlier one
(``engine/folds.py``, issue 56).

A model that drops its padding before a layer (``self.head(h[mask])``) or packs its real tokens first gives that
layer rows whose arrangement depends on each example's length. Two batches with the same shapes and the same total
of rows can be arranged differently: bk once kept an arrangement found regular (every example 5 tokens: blocks of
5) and cut a later batch with lengths [6, 4, 5] into equal blocks of 5 (norms 19 % off, the clipped sum's
sensitivity 1.17 C, no check fired). Each case here runs a batch after another of the same shapes arranged
otherwise and compares the engine with the loop over batches of size one (float64), and the clipped sum's
sensitivity through ``make_private``; inputs broadcast over the batch are read the same way.
"""

from __future__ import annotations

import contextlib
import dataclasses
from unittest import mock

import pytest
import torch
from bk_oracle import assert_matches_loop
from conformance_cases import FOLDED, B, T, _packed_inputs
from test_conformance import DEVICE, SETTINGS, build, loss_fn, make_batch, make_model, oracle, run_cell
from torch import nn
from torch.nn import functional as F

from dp_adam_bench.engine.bk import BKEngine
from dp_adam_bench.engine.bk_rules import dense

EXACT = ["loop", "functorch", "bk", "bk:gram", "bk:instantiate", "bk:chunked"]


def _after_full_lengths(case, engine: str, setting: str) -> None:
    """``case``'s batch on an engine that first saw a batch of the same shapes with every example at full length
    (rows in example-major blocks), against the loop on the second batch."""
    dtype, _, rtol = SETTINGS[setting]
    full = dataclasses.replace(case, inputs=_packed_inputs((T,) * B))
    eng = build(engine, make_model(case, dtype), loss_fn(SETTINGS[setting][1]))
    chunked = (
        mock.patch.object(dense, "_GRAM_CHUNK", 1) if engine == "bk:chunked" else contextlib.nullcontext()
    )
    try:
        with chunked:
            eng.clipped_sum(make_batch(full, dtype), 1.0)
            norms, clip, summed = oracle(case, setting)
            out = eng.clipped_sum(make_batch(case, dtype), clip)
    finally:
        eng.close()
    scale = float(norms.max())
    assert torch.allclose(out.norms, norms, rtol=rtol, atol=rtol * scale), (
        f"{engine} on {case.id} ({setting}) after full lengths: norms {out.norms.tolist()} != loop {norms.tolist()}"
    )
    size = max(float(r.abs().max()) for r in summed)
    for s, r in zip(out.summed, summed, strict=True):
        assert torch.allclose(s, r, rtol=rtol, atol=rtol * size), f"{engine} on {case.id}: clipped sum off"


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("case", FOLDED, ids=[c.id for c in FOLDED])
def test_a_packed_batch_matches_the_loop_alone_and_after_one_arranged_otherwise(case, setting):
    """The conformance cases of a data-dependent fold (every example's real tokens packed first): every exact
    engine matches the loop on the batch, on a fresh engine and after a batch of the same B·T rows in blocks."""
    for engine in EXACT:
        assert run_cell(case, engine, setting) == "match", f"{engine} on {case.id} ({setting})"
        _after_full_lengths(case, engine, setting)


@pytest.mark.xfail(
    strict=True,
    raises=RuntimeError,
    reason="Opacus' hooks and ghost take each row of a folded batch for an example (20 norms for 5 examples), "
    "with a RuntimeError instead of a refusal: engine/grads.py does not check the count of norms",
)
@pytest.mark.parametrize("engine", ["hooks", "ghost"])
def test_opacus_engines_on_a_packed_batch_match_or_refuse(engine):
    assert run_cell(FOLDED[0], engine, "f64-ce") in ("match", "refused")


# --------------------------------------------------------------------------------------- the tagger

V, H, C, LONG = 11, 4, 3, 8


class Tagger(nn.Module):
    """A token tagger that drops its padding before the head: ``self.head(h[mask])`` sees the real tokens of the
    batch, a varying number per example, then the logits go back to their positions (zeros at padding)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.enc = nn.Linear(H, H)
        self.head = nn.Linear(H, C)

    def forward(self, ids, mask):
        h = torch.tanh(self.enc(self.emb(ids)))
        keep = mask.bool()
        rows = self.head(h[keep])
        return rows.new_zeros(*ids.shape, C).index_put(keep.nonzero(as_tuple=True), rows)


def _token_mean(logits, labels):
    """Each example's loss: the mean cross-entropy over its own real tokens (labels -100 at padding)."""
    ce = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none", ignore_index=-100)
    real = (labels != -100).to(ce.dtype)
    return (ce * real).sum(1) / real.sum(1)


def _tagger_loss(model, batch):
    return _token_mean(model(batch["ids"], batch["mask"]), batch["labels"])


def _example(length: int, g: torch.Generator, tag: int | None = None) -> dict:
    mask = (torch.arange(LONG) < length).long()
    ids = torch.randint(1, V, (LONG,), generator=g) * mask
    tags = torch.full((LONG,), tag) if tag is not None else torch.randint(0, C, (LONG,), generator=g)
    return {"ids": ids, "mask": mask, "labels": tags.masked_fill(mask == 0, -100)}


def _tagger_batch(lengths, seed: int, device) -> dict:
    g = torch.Generator().manual_seed(seed)
    items = [_example(n, g) for n in lengths]
    return {k: torch.stack([it[k] for it in items]).to(device) for k in items[0]}


@pytest.mark.parametrize("mode", ["auto", "gram", "instantiate"])
def test_dropped_padding_with_equal_totals_is_placed_per_batch(mode):
    """The issue's arrangement: after a batch whose examples all have 5 real tokens (15 rows: blocks of 5), a
    batch with lengths [6, 4, 5] (15 rows too) gets each example's own rows: norms and clipped sum match the loop,
    and the rows' owners were read on both batches (one probe backward each)."""
    torch.manual_seed(0)
    model = Tagger().double().to(DEVICE)
    engine = BKEngine(model, _tagger_loss, mode=mode)
    for lengths, seed in (([5, 5, 5], 0), ([6, 4, 5], 1), ([6, 4, 5], 2), ([5, 5, 5], 3)):
        batch = _tagger_batch(lengths, seed, DEVICE)
        assert_matches_loop(engine.clipped_sum(batch, 0.5), model, _tagger_loss, engine.params, batch, 0.5)
    assert engine.fold_probes == 4
    assert engine.choices["head (folded)"] == "example"  # the last batch: blocks of 5, read, not assumed
    engine.close()


def test_the_clipped_sum_moves_by_at_most_c_through_make_private():
    """The issue's reproduction through make_private (bk, Adam, C = 1, sigma = 1, B = 8): training on examples that
    mostly have 5 real tokens (batches in blocks of 5), then on a batch whose lengths total a multiple of 5 in
    another arrangement, removing any one example moves the engine's clipped sum by at most C, and the norms are
    the loop's."""
    import dp_adam_bench as dab

    g = torch.Generator().manual_seed(0)
    # most examples 5 tokens; a few long and short ones with opposite tags, whose rows blocks of 5 would mix
    data = [_example(5, g) for _ in range(40)]
    data += [_example(8, g, tag=0), _example(2, g, tag=1), _example(6, g, tag=2), _example(4, g, tag=0)]
    torch.manual_seed(0)
    model = Tagger()
    clip = 1.0
    private = dab.make_private(
        model,
        data,
        _token_mean,
        optimizer="adam",
        clip=clip,
        sigma=1.0,
        batch_size=8,
        steps=6,
        lr=0.05,
        seed=0,
    )
    while not private.done:
        private.step()
    engine, task = private.backend.engine, private.run.task
    # float32 sums of at most 15 rows of 4-wide products per parameter: a few hundred roundings of 6e-8 each
    tol = 1e-5
    for picked in (
        [40, 41, 0],
        [42, 43, 1],
        [40, 41, 42, 43, 0, 1],
    ):  # lengths [8, 2, 5], [6, 4, 5], ...: 5·b
        idx = torch.tensor(picked)
        batch = {k: v.to(private.backend.device) for k, v in task.get_batch(idx).items()}
        assert int(batch["mask"].sum()) == 5 * len(picked)  # the same rows per example as the blocks of 5
        full = engine.clipped_sum(batch, clip)
        assert_matches_loop(
            full, model, task.loss_per_example, engine.params, batch, clip, rtol=tol, atol=tol * 1e-3
        )
        for j in range(len(picked)):
            rest = torch.tensor(picked[:j] + picked[j + 1 :])
            rest_batch = {k: v.to(private.backend.device) for k, v in task.get_batch(rest).items()}
            without = engine.clipped_sum(rest_batch, clip)
            moved = torch.sqrt(
                sum((a - b).square().sum() for a, b in zip(full.summed, without.summed, strict=True))
            )
            assert float(moved) <= clip * (1 + tol), (
                f"removing example {picked[j]} moves the sum by {float(moved)}"
            )
    private.close()


# ------------------------------------------------------------------------------- inputs broadcast over the batch

SPECIAL = 1


class GatedTable(nn.Module):
    """A table of biases computed by a Linear from a (1, T, 2) buffer (bk expands its input to one copy per
    example), read as one (T, H) table by the examples that hold a special token: each batch's own examples use
    copy 0, so whether that copy carries one example's loss or several depends on the data."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.table = nn.Linear(2, H)
        self.register_buffer("coords", torch.randn(1, 5, 2, generator=torch.Generator().manual_seed(3)))
        self.head = nn.Linear(H, C)

    def forward(self, ids):
        row = self.table(self.coords).reshape(-1, H)[: ids.shape[1]]
        gate = (ids == SPECIAL).any(1).to(row.dtype)[:, None, None]
        return self.head((self.emb(ids) + gate * row).mean(1))


def _ids_loss(model, batch):
    return F.cross_entropy(model(batch["ids"]), batch["y"], reduction="none")


def _gated_batch(special_in, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, V, (3, 5), generator=g)
    for i in special_in:
        ids[i, 2] = SPECIAL
    return {"ids": ids.to(DEVICE), "y": torch.randint(0, C, (3,), generator=g).to(DEVICE)}


def test_a_broadcast_input_is_read_on_every_batch():
    """A batch where only example 0 uses the expanded table (its copy 0: it looks like one copy per example), then
    one where two examples use copy 0: refused naming the layer, not computed with the first batch's arrangement
    (which gave example 0 both examples' gradients of the table)."""
    torch.manual_seed(0)
    model = GatedTable().double().to(DEVICE)
    engine = BKEngine(model, _ids_loss)
    first = _gated_batch([0], 0)
    assert_matches_loop(engine.clipped_sum(first, 0.5), model, _ids_loss, engine.params, first, 0.5)
    with pytest.raises(
        ValueError, match=r"layer 'table' \(Linear\) sees 3 rows for a batch of 3 examples, and a"
    ):
        engine.clipped_sum(_gated_batch([0, 1], 1), 0.5)
    engine.close()


class PositionTable(nn.Module):
    """Parameters of its own, no bk rule (the generic rule), and an output of leading size 1 for the whole batch,
    as a custom positional encoding returns ``self.table[None]``."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(5, H, generator=torch.Generator().manual_seed(4)))

    def forward(self, ids):
        return self.table[None] * 1.0


class WithPositions(nn.Module):
    def __init__(self, read):
        super().__init__()
        self.read = read
        self.emb = nn.Embedding(V, H)
        self.pos = PositionTable()
        self.head = nn.Linear(H, C)

    def forward(self, ids):
        p = self.pos(ids)
        if self.read == "view":  # one copy for every example, as Swinv2 reads its position-bias MLP
            p = p.reshape(-1, H)[: ids.shape[1]]
        return self.head((self.emb(ids) + p).mean(1))


@pytest.mark.parametrize("read", ["broadcast", "view"])
def test_a_generic_output_broadcast_over_the_batch_is_placed_or_refused(read):
    """The generic rule's output of leading size 1, expanded to one copy per example: exact where each example
    uses its own copy; refused naming the module where the model reads one copy for all (it was silently given
    to example 0 before its rows were read)."""
    torch.manual_seed(0)
    model = WithPositions(read).double().to(DEVICE)
    engine = BKEngine(model, _ids_loss)
    batch = _gated_batch([], 0)
    if read == "view":
        with pytest.raises(ValueError, match=r"module 'pos' \(PositionTable\) sees 3 rows for a batch of 3"):
            engine.clipped_sum(batch, 0.5)
    else:
        assert_matches_loop(engine.clipped_sum(batch, 0.5), model, _ids_loss, engine.params, batch, 0.5)
    engine.close()


# --------------------------------------------------------------------------------------- gradients that cancel


class Cancelling(nn.Module):
    """OPT's flatten before a Linear whose output the model scales up and back down (``y * A - y * (A - 1)``,
    A = 1e7, in float32): the backward cancels terms 1e7 times its result, so the gradient reaching the Linear is
    mostly rounding, as on weights trained to 1e5. Weighting an example's loss by 3 changes that rounding; by a
    power of two it does not."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.fc = nn.Linear(H, H)
        self.head = nn.Linear(H, C)

    def forward(self, ids):
        b, t = ids.shape
        y = self.fc(self.emb(ids).reshape(b * t, H))
        y = y * 1e7 - y * (1e7 - 1)
        return self.head(torch.tanh(y).view(b, t, H).mean(1))


def test_rows_whose_gradient_is_mostly_rounding_are_read_again_in_binary(monkeypatch):
    """The first reading (weights 1..B) fails on such rows; the second, in binary digits (weights 1 and 2: exact
    in floating point), places every row: the batch trains instead of being refused as if rows mixed examples."""
    from dp_adam_bench.engine import folds

    readings, owners = [], folds.owners

    def spy(g, weighted, base, b):
        found = owners(g, weighted, base, b)
        readings.append((base, len(weighted), found[1]))
        return found

    monkeypatch.setattr(folds, "owners", spy)
    torch.manual_seed(0)
    model = Cancelling().to(DEVICE)
    engine = BKEngine(model, _ids_loss)
    batch = _gated_batch([], 0)
    out = engine.clipped_sum(batch, 0.5)
    assert readings == [(3, 1, False), (2, 2, True)]  # B = 3: one probe in base 3, then two binary digits
    assert engine.fold_probes == 3 and engine.choices["fc (folded)"] == "example"
    assert out.norms.shape == (3,) and bool(torch.isfinite(out.norms).all())
    engine.close()
