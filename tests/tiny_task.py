"""A tiny synthetic classification task implementing the ModelTask interface, for engine tests."""

import torch
from torch import nn

from dp_adam_bench.tasks.base import ModelTask


class TinyTask(ModelTask):
    name = "tiny"

    def __init__(self, cfg, *, trials: int, seed: int):
        g = torch.Generator().manual_seed(123)
        self.n = int(cfg.get("n", 64))
        self.x = torch.randn(self.n, 6, generator=g)
        self.y = (self.x[:, 0] + 0.5 * self.x[:, 1] > 0).long()
        self.xt = torch.randn(200, 6, generator=g)
        self.yt = (self.xt[:, 0] + 0.5 * self.xt[:, 1] > 0).long()

    @property
    def dataset_size(self):
        return self.n

    def build_model(self):
        return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))

    def get_batch(self, indices):
        return {"x": self.x[indices], "y": self.y[indices]}

    def loss_per_example(self, forward, batch):
        return nn.functional.cross_entropy(forward(batch["x"]), batch["y"], reduction="none")

    def evaluate(self, model):
        # the test inputs follow the model (the trainer moves it to train.device: cuda when available)
        p = next(model.parameters())
        xt, yt = self.xt.to(device=p.device, dtype=p.dtype), self.yt.to(p.device)
        with torch.no_grad():
            logits = model(xt)
        return {
            "test_accuracy": float((logits.argmax(1) == yt).float().mean() * 100),
            "test_loss": float(nn.functional.cross_entropy(logits, yt)),
        }
