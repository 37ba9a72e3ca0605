"""Small models shared by the per-example-gradient engine tests."""

import torch
from torch import nn


class SmallNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3)
        self.emb = nn.Embedding(11, 4)
        self.fc1 = nn.Linear(3 * 4 * 4 + 4, 8)
        self.ln = nn.LayerNorm(8)
        self.fc2 = nn.Linear(8, 5)

    def forward(self, x, tok):
        h = torch.tanh(self.conv(x)).flatten(1)
        e = self.emb(tok).mean(1)
        return self.fc2(self.ln(torch.tanh(self.fc1(torch.cat([h, e], 1)))))


def loss_per_example(forward, batch):
    logits = forward(batch["x"], batch["tok"])
    return nn.functional.cross_entropy(logits, batch["y"], reduction="none")


def make_batch(b=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(b, 2, 6, 6, generator=g),
        "tok": torch.randint(0, 11, (b, 3), generator=g),
        "y": torch.randint(0, 5, (b,), generator=g),
    }


def fresh_model():
    torch.manual_seed(0)
    return SmallNet()
