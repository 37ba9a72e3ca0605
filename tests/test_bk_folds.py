"""bk on batches folded into another dimension (``engine/folds.py``): layers whose input leads with B·k rows
example-major (OPT's flatten, Swin's windows), position-major, or a varying number of rows per example (padding
dropped) get exact per-example gradients, checked against the loop over batches of size one in float64; rows that
carry several examples' losses are refused in one line naming the layer."""

from __future__ import annotations

import pytest
import torch
from bk_oracle import assert_matches_loop
from torch import nn
from torch.nn import functional as F

from dp_adam_bench.engine import folds
from dp_adam_bench.engine.bk import BKEngine

H, T, V = 6, 5, 13
CLIP = 0.4


class Folded(nn.Module):
    """Embedding -> a Linear, a LayerNorm and a module without a rule (a LayerScale) on the tokens folded as
    ``how`` says -> a classifier on each example's mean token."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.emb = nn.Embedding(V, H)
        self.fc = nn.Linear(H, H)
        self.norm = nn.LayerNorm(H)
        self.scale = LayerScale()
        self.head = nn.Linear(H, 3)

    def forward(self, ids, mask):
        h = self.emb(ids)
        b = h.shape[0]
        if self.how == "example":  # OPT: (B, T, H) -> (B·T, H)
            flat = self.scale(self.norm(torch.tanh(self.fc(h.reshape(-1, H)))))
            h = flat.view(b, T, H)
        elif self.how == "position":  # sequence-first, flattened: row t·B + i
            flat = self.scale(self.norm(torch.tanh(self.fc(h.transpose(0, 1).reshape(-1, H)))))
            h = flat.view(T, b, H).transpose(0, 1)
        elif self.how == "unpadded":  # only the real tokens, a varying number per example
            keep = mask.reshape(-1).bool()
            rows = self.norm(torch.tanh(self.fc(h.reshape(-1, H)[keep])))
            h = h.new_zeros(b * T, H).index_put((keep.nonzero()[:, 0],), rows).view(b, T, H)
        elif self.how == "mixed":  # every row carries every example's loss
            flat = self.fc(h.reshape(-1, H))
            h = (flat + flat.mean(0, keepdim=True)).view(b, T, H)
        m = mask[..., None].to(h.dtype)
        return self.head((h * m).sum(1) / m.sum(1))


class LayerScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.gamma = nn.Parameter(torch.linspace(0.5, 1.5, H))

    def forward(self, x):
        return x * self.gamma


def _loss(model, batch):
    return F.cross_entropy(model(batch["ids"], batch["mask"]), batch["y"], reduction="none")


def _batch(b, seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(b, T, dtype=torch.long)
    mask[0, -2:] = 0
    if b > 2:
        mask[2, -1:] = 0
    return {
        "ids": torch.randint(0, V, (b, T), generator=g),
        "mask": mask,
        "y": torch.randint(0, 3, (b,), generator=g),
    }


def _check(engine, model, batch):
    got = engine.clipped_sum(batch, CLIP)
    assert_matches_loop(got, model, _loss, engine.params, batch, CLIP)


@pytest.mark.parametrize("how", ["example", "position", "unpadded"])
def test_folded_rows_are_placed_and_exact(how):
    torch.manual_seed(0)
    model = Folded(how).double()
    engine = BKEngine(model, _loss)
    for seed, b in ((0, 4), (1, 4), (2, 3), (3, 1)):  # the same shape twice, then others
        _check(engine, model, _batch(b, seed))
        if b > 1:  # read on this batch, never kept for the next one (test_fold_layouts.py)
            want = how if how != "unpadded" else "irregular"
            folded = ("fc", "norm") if how == "unpadded" else ("fc", "norm", "scale")
            assert {n: engine.choices[f"{n} (folded)"] for n in folded} == dict.fromkeys(folded, want)
    assert engine.fold_probes == 3  # one probe backward per batch of more than one example (fp64: one digit)
    engine.close()


def test_rows_that_mix_examples_are_refused_naming_the_layer():
    torch.manual_seed(0)
    model = Folded("mixed").double()
    engine = BKEngine(model, _loss)
    with pytest.raises(
        ValueError, match=r"layer 'fc' \(Linear\) sees 20 rows for a batch of 4 examples"
    ) as err:
        engine.clipped_sum(_batch(4), CLIP)
    assert "\n" not in str(err.value)
    engine.close()


def test_a_generic_module_needs_every_row_placed():
    """The generic rule replays the module from each example's rows: an irregular arrangement is refused."""

    class Unpadded(Folded):
        def forward(self, ids, mask):
            h = self.emb(ids)
            keep = mask.reshape(-1).bool()
            rows = self.scale(h.reshape(-1, H)[keep])
            h = h.new_zeros(ids.numel(), H).index_put((keep.nonzero()[:, 0],), rows).view(*ids.shape, H)
            return self.head(h.mean(1))

    model = Unpadded("unpadded").double()
    engine = BKEngine(model, _loss)
    with pytest.raises(ValueError, match=r"module 'scale' \(LayerScale, parameters gamma\) has no bk rule"):
        engine.clipped_sum(_batch(4), CLIP)
    engine.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_owners_are_read_off_the_weighted_gradients(dtype):
    """folds.owners on gradients of a random arrangement of 40 examples' rows, in fp32 (one probe) and bf16
    (two digits of base 7): every row with a gradient is placed, a zero row is not, a mixed row is refused."""
    g = torch.Generator().manual_seed(0)
    b, k = 40, 3
    owner = torch.randperm(b * k, generator=g) % b
    rows = torch.randn(b * k, 2, 4, generator=g)
    rows[5] = 0
    base, digits = folds.digits_base(b, dtype)
    assert (base, digits) == ((b, 1) if dtype == torch.float32 else (7, 2))
    grad = rows.to(dtype)
    weighted = [
        (folds.probe_weights(b, base, d, torch.float64, "cpu")[owner][:, None, None] * rows).to(dtype)
        for d in range(digits)
    ]
    found, ok = folds.owners(grad, weighted, base, b)
    assert ok
    want = owner.clone()
    want[5] = -1
    assert torch.equal(found, want)
    kind, index = folds.arrangement(found, b)
    assert kind == "irregular" and index.shape == (b, k)
    mixed = [w.clone() for w in weighted]
    mixed[-1][7] = mixed[-1][7] + 0.5 * mixed[-1][8]  # row 7 now also carries row 8's example
    assert not folds.owners(grad, mixed, base, b)[1]


class SharedTable(nn.Module):
    """A table of biases computed once for all examples by a Linear on a (1, K, 2) buffer, then read as Swinv2
    reads its position-bias MLP (``view(-1, H)`` and indexed: only row 0 of an expanded input is used) or as
    DeBERTa reads its relative embeddings (reshaped with the size it expects: the expanded input breaks it)."""

    def __init__(self, read):
        super().__init__()
        self.read = read
        self.emb = nn.Embedding(V, H)
        self.table = nn.Linear(2, H)
        self.register_buffer("coords", torch.randn(1, T, 2, generator=torch.Generator().manual_seed(3)))
        self.head = nn.Linear(H, 3)

    def forward(self, ids, mask):
        bias = self.table(self.coords)
        if self.read == "view":
            bias = bias.view(-1, H)[torch.arange(T)]  # (T, H): row 0 of an expansion
        else:
            bias = bias.reshape(T, H)  # fails on an expansion to B rows
        return self.head((self.emb(ids) + bias).mean(1))


@pytest.mark.parametrize("read", ["view", "reshape"])
def test_a_shared_input_the_model_does_not_broadcast_is_refused_naming_the_layer(read):
    """An input broadcast over the batch is expanded to one row per example only where each example then uses
    its own row (checked as a fold's rows are); otherwise refused in one line, never silently all in row 0."""
    torch.manual_seed(0)
    model = SharedTable(read).double()
    engine = BKEngine(model, _loss)
    with pytest.raises(
        ValueError, match=r"layer 'table' \(Linear\) sees (3|1) rows? for a batch of 3 examples, and a"
    ):
        engine.clipped_sum(_batch(3), CLIP)
    assert engine._no_expand == ({"table"} if read == "reshape" else set())
    _check(engine, model, _batch(1))  # one example: its gradient is the batch's
    engine.close()
