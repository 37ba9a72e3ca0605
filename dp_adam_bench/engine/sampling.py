"""Samplers: which examples form each logical batch.

* :class:`PoissonSampler` — each example joins each batch independently with probability q. This is what the
  DP-SGD accountants (RDP, PRV, PLD, GDP-CLT) assume; batches have random size with mean q N.
* :class:`SinglePassSampler` — fixed-size batches cycling through *one* seeded permutation, epoch after epoch.
  This is the DP-MF setting of Ganesh et al. (each example participates once per epoch, accounted as a Gaussian
  mechanism *without* amplification). Because every epoch uses the same order, two participations of an example
  are exactly ``steps_per_epoch`` steps apart: the min-separation that BandMF's sensitivity needs
  (b <= steps_per_epoch). Reshuffling every epoch would break that guarantee, so it is not offered.

The Poisson-type samplers include an example when a float64 uniform from their generator is below q (a Python
float): the realised inclusion probability is ceil(q 2^53) / 2^53, at most 2^-53 (1.2e-16) above q. Float32
uniforms (torch's default) are multiples of 2^-24, which rounds the probability up to ceil(q 2^24) / 2^24: +0.58 %
at N = 1e7, B = 64 and +33 % at q = 1.5 / 2^24, more privacy spent than the accountant's q says.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch


class SinglePassSampler:
    """Fixed-size batches cycling through one seeded permutation (module docstring).

    Definition (re-derived independently by the mechanism meter, :func:`dp_adam_bench.audit.meter.sampling_reference`):
    order = ``torch.randperm(N, generator=torch.Generator().manual_seed(seed))`` (``torch.arange(N)`` without
    ``shuffle``); step t (0-based) is ``order[i B : (i + 1) B]`` with i = t mod (N // B); the last N mod B examples
    of the order are never drawn.
    """

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
    """Poisson sampling: at every step each of the N examples joins the batch independently with probability
    q = B / N (B the expected batch size), the sampling the DP-SGD accountants assume.

    Exactness of q: example i is in the batch when u_i < q, u_i a float64 uniform from the sampler's generator
    (torch's doubles are multiples of 2^-53), so the realised inclusion probability is ceil(q 2^53) / 2^53: q up to
    an excess below 2^-53 = 1.2e-16 absolute. Float32 uniforms, torch's default dtype, are multiples of 2^-24, and
    the probability would be ceil(q 2^24) / 2^24 >= q: +0.58 % at N = 1e7, B = 64, +11.8 % at N = 5e7, B = 16,
    +33 % at q = 1.5 / 2^24, all of it privacy that the accountant's q does not count. The generator state is the
    resumable state (:meth:`state_dict`).
    """

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
            # float64 uniforms: the inclusion probability is q to 2^-53 (the class docstring)
            mask = torch.rand(self.n, generator=self.generator, dtype=torch.float64) < self.q
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


class CyclicPoissonSampler:
    """Cyclic Poisson sampling with cycle length ``cycle_length`` (b) and expected batch size B.

    Guarantees (tested): the groups partition the examples (sizes differ by at most one); the batch of step t
    (0-based) holds only members of group t mod b, each included independently with probability
    q = b B / N, so an example's participations are at least b steps apart. The generator state and the
    step are the resumable state; the partition depends on the seed only: group g is ``order[g::b]`` of
    order = ``torch.randperm(N, generator=torch.Generator().manual_seed(seed))`` (the definition the mechanism
    meter re-derives, :func:`dp_adam_bench.audit.meter.sampling_reference`).

    Exactness of q: a member joins when a float64 uniform from the generator is below q, so the realised inclusion
    probability is ceil(q 2^53) / 2^53, an excess below 2^-53 = 1.2e-16 absolute. Float32 uniforms (multiples of
    2^-24) would round it up to ceil(q 2^24) / 2^24, as much as +33 % at q = 1.5 / 2^24 (see
    :class:`PoissonSampler`).
    """

    kind = "cyclic_poisson"
    amplification = True

    def __init__(
        self, dataset_size: int, expected_batch_size: float, steps: int, cycle_length: int, seed: int = 0
    ):
        if not isinstance(cycle_length, int) or isinstance(cycle_length, bool) or cycle_length < 1:
            raise ValueError(f"cycle length must be an integer >= 1, got {cycle_length!r}")
        if cycle_length > dataset_size:
            raise ValueError(
                f"cycle length {cycle_length} is larger than the dataset ({dataset_size} examples)"
            )
        q = cycle_length * expected_batch_size / dataset_size
        if not (math.isfinite(q) and 0 < q <= 1):
            raise ValueError(
                f"cycle length x expected batch size / dataset size = {cycle_length} x {expected_batch_size} / "
                f"{dataset_size} = {q:.4g} must be in (0, 1]: each group of N / b examples must hold the "
                "expected batch"
            )
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        self.n, self.cycle_length, self.q, self._steps = dataset_size, cycle_length, q, steps
        self.seed = int(seed)
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed))
        self.groups = [order[g :: self.cycle_length] for g in range(self.cycle_length)]
        self.generator = torch.Generator().manual_seed(self.seed * 1_000_003 + 1)
        self.position = 0  # batches drawn so far (the step of the last batch, 1-based)

    @property
    def steps(self) -> int:
        return self._steps

    @property
    def expected_batch_size(self) -> float:
        return self.q * self.n / self.cycle_length

    @property
    def min_separation(self) -> int:
        return self.cycle_length

    def __iter__(self) -> Iterator[torch.Tensor]:
        return self.iter_from(0)

    def iter_from(self, step: int) -> Iterator[torch.Tensor]:
        """Batches for steps ``step+1 .. steps``; the generator state is the resumable state (see state_dict)."""
        for t in range(step, self._steps):
            group = self.groups[t % self.cycle_length]
            # float64 uniforms: the inclusion probability is q to 2^-53 (the class docstring)
            mask = torch.rand(len(group), generator=self.generator, dtype=torch.float64) < self.q
            self.position = t + 1
            yield group[mask]

    def state_dict(self) -> dict:
        return {"kind": self.kind, "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"].cpu())


class BallsInBinsSampler:
    """Balls-in-bins batches: b = ``cycle_length`` bins, each example in one bin chosen uniformly at random
    (independently per example, once, from the seed); step t (0-based) is bin t mod b.

    Guarantees (tested): an example appears at every step congruent to its bin modulo b and at no other, so
    ``epochs`` participations exactly b steps apart; P(bin = j) = 1 / b for every example and bin. No random
    state beyond the seed: resuming is exact. The bins are ``torch.randint(b, (N,),
    generator=torch.Generator().manual_seed(seed))`` (the definition the mechanism meter re-derives,
    :func:`dp_adam_bench.audit.meter.sampling_reference`).
    """

    kind = "balls_in_bins"
    amplification = (
        False  # accounted by the conservative bound (see dp_adam_bench.privacy.accounting.amplified_mf)
    )

    def __init__(self, dataset_size: int, cycle_length: int, epochs: int = 1, seed: int = 0):
        if not isinstance(cycle_length, int) or isinstance(cycle_length, bool) or not 1 <= cycle_length:
            raise ValueError(f"number of bins must be an integer >= 1, got {cycle_length!r}")
        if cycle_length > dataset_size:
            raise ValueError(
                f"number of bins {cycle_length} is larger than the dataset ({dataset_size} examples)"
            )
        if epochs < 1:
            raise ValueError(f"epochs must be >= 1, got {epochs}")
        self.n, self.cycle_length, self.epochs, self.seed = dataset_size, cycle_length, epochs, int(seed)
        gen = torch.Generator().manual_seed(self.seed)
        self.bins = torch.randint(self.cycle_length, (self.n,), generator=gen)
        self.members = [(self.bins == j).nonzero().squeeze(1) for j in range(self.cycle_length)]

    @property
    def steps(self) -> int:
        return self.cycle_length * self.epochs

    @property
    def steps_per_epoch(self) -> int:
        return self.cycle_length

    @property
    def expected_batch_size(self) -> float:
        return self.n / self.cycle_length

    @property
    def min_separation(self) -> int:
        return self.cycle_length

    def __iter__(self) -> Iterator[torch.Tensor]:
        return self.iter_from(0)

    def iter_from(self, step: int) -> Iterator[torch.Tensor]:
        for t in range(step, self.steps):
            yield self.members[t % self.cycle_length]

    def state_dict(self) -> dict:
        return {"kind": self.kind}

    def load_state_dict(self, state: dict) -> None:
        pass
