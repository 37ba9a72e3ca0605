"""The random streams of a run, each from its own seed.

Reproducible mode (the default, for research): every stream is derived from the run's ``seed``, so a run can be
repeated and resumed bit-identically. The sampler keeps the seed itself and the noise streams keep their historic
offsets (:func:`dp_adam_bench.privacy.noise_factory.noise_seed`), so earlier results stay reproducible; the global
torch RNG (dropout masks) gets a stream of its own from :class:`numpy.random.SeedSequence`, because seeding it
with the sampler's seed made dropout and batch selection draw from the same Mersenne-Twister sequence.

Secure mode (``privacy.secure_rng=true``, for training on real private data): the sampler's and the noise
mechanisms' seeds come from the operating system's cryptographically secure generator (:mod:`secrets`), as Opacus'
``secure_mode`` does, so nobody holding the config can regenerate the noise and subtract it. Such a run is not
reproducible, its summary says so, and it writes no checkpoints (they would hold the generators' states). The
generators themselves stay torch's (Mersenne Twister / Philox): the noise is unpredictable without the seed, but
this is not a defence against floating-point attacks on the Gaussian sampler (Mironov 2012; Haney et al. 2022).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import numpy as np
import torch

_DROPOUT_STREAM = 0x64726F70  # "drop"
_SIDE_STREAM = 17
_CHECK_STREAM = 0x63686B  # "chk"


@dataclass(frozen=True)
class RunSeeds:
    model: int  # model initialisation (the same on every data-parallel rank)
    sampler: int
    noise: int  # base of the noise streams (noise_factory.noise_seed)
    dropout: int  # the global torch RNG after the model is built
    side: int  # public side-information batches
    secure: bool
    check: int = 0  # which private examples the engine checks read (engine/watch.py); no effect on training

    @classmethod
    def derive(cls, seed: int, *, secure: bool = False) -> RunSeeds:
        dropout = int(
            np.random.SeedSequence([int(seed), _DROPOUT_STREAM]).generate_state(1, np.uint64)[0] >> 1
        )
        check = int(np.random.SeedSequence([int(seed), _CHECK_STREAM]).generate_state(1, np.uint64)[0] >> 1)
        if secure:
            return cls(
                model=int(seed),
                sampler=secrets.randbits(63),
                noise=secrets.randbits(40),
                dropout=dropout,
                side=int(seed) + _SIDE_STREAM,
                secure=True,
            )
        return cls(
            model=int(seed),
            sampler=int(seed),
            noise=int(seed),
            dropout=dropout,
            side=int(seed) + _SIDE_STREAM,
            secure=False,
            check=check,
        )

    def describe(self) -> dict:
        if self.secure:
            return {"mode": "secure", "reproducible": False, "note": "sampler and noise seeded from secrets"}
        return {"mode": "reproducible", "reproducible": True}


def task_rng_state(run) -> dict[str, torch.Tensor]:
    """The task's random state, ``task.rng_state()`` (``tasks/base.py``); {} for a task without one."""
    get = getattr(getattr(run, "task", None), "rng_state", None)
    if get is None:
        return {}
    state = dict(get())
    bad = [k for k, v in state.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise TypeError(
            f"{type(run.task).__name__}.rng_state() must map names to tensors (generator states); "
            f"{', '.join(map(repr, bad))} are not"
        )
    return state
