"""Samplers: which examples form each logical batch.

* :class:`PoissonSampler` — each example joins each batch independently with probability q. This is what the
  DP-SGD accountants (RDP, PRV, PLD, GDP-CLT) assume; batches have random size with mean q N.
* :class:`SinglePassSampler` — fixed-size batches cycling through *one* seeded permutation, epoch after epoch.
  This is the DP-MF setting of Ganesh et al. (each example participates once per epoch, accounted as a Gaussian
  mechanism *without* amplification). Because every epoch uses the same order, two participations of an example
  are exactly ``steps_per_epoch`` steps apart: the min-separation that BandMF's sensitivity needs
  (b <= steps_per_epoch). Reshuffling every epoch would break that guarantee, so it is not offered.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


class SinglePassSampler:
    kind = "single_pass"
    amplification = False

    def __init__(
        self, dataset_size: int, batch_size: int, epochs: int = 1, seed: int = 0, shuffle: bool = True
    ):
        if batch_size < 1 or batch_size > dataset_size:
            raise ValueError(f"batch size must be in [1, dataset size = {dataset_size}], got {batch_size}")
        if epochs < 1:
            raise ValueError(f"epochs must be >= 1, got {epochs}")
        self.n, self.batch_size, self.epochs = dataset_size, batch_size, epochs
        self.seed = int(seed)
        self.shuffle = shuffle
        self.steps_per_epoch = dataset_size // batch_size  # the last partial batch is dropped (fixed size)

    @property
    def steps(self) -> int:
        return self.steps_per_epoch * self.epochs

    @property
    def expected_batch_size(self) -> float:
        return float(self.batch_size)

    @property
    def min_separation(self) -> int:
        return self.steps_per_epoch

    def __iter__(self) -> Iterator[torch.Tensor]:
        return self.iter_from(0)

    def iter_from(self, step: int) -> Iterator[torch.Tensor]:
        """Batches for steps ``step+1 .. steps`` (the order depends only on the seed, so resuming is exact)."""
        gen = torch.Generator().manual_seed(self.seed)
        order = torch.randperm(self.n, generator=gen) if self.shuffle else torch.arange(self.n)
        for t in range(step, self.steps):
            i = t % self.steps_per_epoch
            yield order[i * self.batch_size : (i + 1) * self.batch_size]

    def state_dict(self) -> dict:
        return {"kind": self.kind}

    def load_state_dict(self, state: dict) -> None:
        pass


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
        return self.iter_from(0)

    def iter_from(self, step: int) -> Iterator[torch.Tensor]:
        """Batches for steps ``step+1 .. steps``; the generator state is the resumable state (see state_dict)."""
        for _ in range(step, self._steps):
            mask = torch.rand(self.n, generator=self.generator) < self.q
            yield mask.nonzero().squeeze(1)

    def state_dict(self) -> dict:
        return {"kind": self.kind, "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"].cpu())


class ShuffleSampler(SinglePassSampler):
    """Fixed-size batches from a fresh permutation every epoch — what most non-private code does.

    NOT what the DP-SGD accountants assume: runs using it are accounted as if Poisson-sampled with q = B/N and
    their run folders and reports say that the sampling does not match the accountant.
    """

    kind = "shuffle"
    amplification = True

    @property
    def q(self) -> float:
        return self.batch_size / self.n

    @property
    def min_separation(self) -> int:
        return 1

    def iter_from(self, step: int) -> Iterator[torch.Tensor]:
        for t in range(step, self.steps):
            epoch, i = divmod(t, self.steps_per_epoch)
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            order = torch.randperm(self.n, generator=gen)
            yield order[i * self.batch_size : (i + 1) * self.batch_size]
