"""Samplers: which examples form each logical batch.

* :class:`PoissonSampler` — each example joins each batch independently with probability q. This is what the
  DP-SGD accountants (RDP, PRV, PLD, GDP-CLT) assume; batches have random size with mean q N.
* :class:`SinglePassSampler` — fixed-size batches over one or more passes of a (seeded) permutation. This is the
  DP-MF setting of Ganesh et al. §5.1 (each example participates once per epoch, accounted as a Gaussian
  mechanism *without* amplification). Used with independent noise it is also accounted without amplification.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


class SinglePassSampler:
    kind = "single_pass"
    amplification = False

    def __init__(self, dataset_size: int, batch_size: int, epochs: int = 1, seed: int = 0, shuffle: bool = True):
        if batch_size < 1 or batch_size > dataset_size:
            raise ValueError(f"batch size must be in [1, dataset size = {dataset_size}], got {batch_size}")
        if epochs < 1:
            raise ValueError(f"epochs must be >= 1, got {epochs}")
        self.n, self.batch_size, self.epochs = dataset_size, batch_size, epochs
        self.generator = torch.Generator().manual_seed(int(seed))
        self.shuffle = shuffle
        self.steps_per_epoch = dataset_size // batch_size  # the last partial batch is dropped (fixed size)

    @property
    def steps(self) -> int:
        return self.steps_per_epoch * self.epochs

    @property
    def expected_batch_size(self) -> float:
        return float(self.batch_size)

    def __iter__(self) -> Iterator[torch.Tensor]:
        for _ in range(self.epochs):
            order = torch.randperm(self.n, generator=self.generator) if self.shuffle else torch.arange(self.n)
            for i in range(self.steps_per_epoch):
                yield order[i * self.batch_size : (i + 1) * self.batch_size]


class PoissonSampler:
    kind = "poisson"
    amplification = True

    def __init__(self, dataset_size: int, expected_batch_size: float, steps: int, seed: int = 0):
        if not 0 < expected_batch_size <= dataset_size:
            raise ValueError(
                f"expected batch size must be in (0, dataset size = {dataset_size}], got {expected_batch_size}"
            )
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        self.n, self.q, self._steps = dataset_size, expected_batch_size / dataset_size, steps
        self.generator = torch.Generator().manual_seed(int(seed))

    @property
    def steps(self) -> int:
        return self._steps

    @property
    def expected_batch_size(self) -> float:
        return self.q * self.n

    def __iter__(self) -> Iterator[torch.Tensor]:
        for _ in range(self._steps):
            mask = torch.rand(self.n, generator=self.generator) < self.q
            yield mask.nonzero().squeeze(1)
