"""bk's generic rule replays a module without a rule one example at a time from every argument it was called with
(positional and keyword: masks, position biases, position ids, numbers), deciding which inputs are per example by
the replay that reproduces the batch's outputs (``bk_rules/generic.py``): against the size-one loop in float64, and
refused in one line naming the module where no replay does."""

from __future__ import annotations

import pytest
import torch
from bk_oracle import assert_matches_loop
from torch import nn
from torch.nn import functional as F

from dp_adam_bench.engine.bk import BKEngine

H = 4


class BiasedMix(nn.Module):
    """A layer with parameters of its own and no rule, called with a per-example mask (keyword), a bias shared by
    all examples (heads, T, T) and (T,) position ids, a float and a flag: every kind of extra argument."""

    def __init__(self, T):
        super().__init__()
        self.w = nn.Parameter(torch.randn(H, H) / 2)
        self.pos = nn.Parameter(torch.randn(T + 2, H) / 2)
        self.gamma = nn.Parameter(torch.ones(H))

    def forward(self, x, bias, position_ids, scale=1.0, *, mask=None, causal=False):
        h = x @ self.w + self.pos[position_ids + 2]
        scores = h @ h.transpose(1, 2) * scale + bias.mean(0)
        if causal:
            scores = scores + torch.full_like(scores, -1e9).triu(1)
        if mask is not None:
            scores = scores.masked_fill(mask[:, None, :] == 0, -1e9)
        return self.gamma * (scores.softmax(-1) @ h)


class Net(nn.Module):
    def __init__(self, T):
        super().__init__()
        self.emb = nn.Embedding(11, H)
        self.mix = BiasedMix(T)
        self.bias = nn.Parameter(torch.randn(2, T, T) / 3, requires_grad=False)
        self.head = nn.Linear(H, 3)

    def forward(self, ids, mask):
        T = ids.shape[1]
        h = self.mix(self.emb(ids), self.bias, torch.arange(T), 0.5, mask=mask, causal=True)
        return self.head(h.mean(1))


def _loss(model, batch):
    return F.cross_entropy(model(batch["ids"], batch["mask"]), batch["y"], reduction="none")


def _batch(b, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(b, T, dtype=torch.long)
    mask[0, -1] = 0
    return {
        "ids": torch.randint(0, 11, (b, T), generator=g),
        "mask": mask,
        "y": torch.randint(0, 3, (b,), generator=g),
    }


def _check(model, loss, batch, clip=0.7):
    engine = BKEngine(model, loss)
    got = engine.clipped_sum(batch, clip)
    engine.close()
    assert_matches_loop(got, model, loss, engine.params, batch, clip)
    return engine


@pytest.mark.parametrize("b", [3, 5, 2])  # 5: the (T,) position ids and the (2, T, T) bias lead with B... and
def test_every_argument_is_replayed(b):  # 2: the bias's leading heads dimension equals B
    torch.manual_seed(0)
    model = Net(T=5).double()
    engine = _check(model, _loss, _batch(b, 5))
    assert engine.choices["mix"].startswith("generic")


def test_a_module_whose_examples_mix_is_refused_naming_it():
    class Mixes(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(H))

        def forward(self, x, mask=None):
            return x * self.w + x.mean(0, keepdim=True)  # every example sees the others

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(11, H)
            self.mixes = Mixes()
            self.head = nn.Linear(H, 3)

        def forward(self, ids, mask):
            return self.head(self.mixes(self.emb(ids), mask=mask).mean(1))

    model = Model().double()
    engine = BKEngine(model, _loss)
    with pytest.raises(ValueError, match=r"module 'mixes' \(Mixes, parameters w\) has no bk rule") as err:
        engine.clipped_sum(_batch(3, 4), 1.0)
    assert "\n" not in str(err.value)
    engine.close()
