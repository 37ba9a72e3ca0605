"""What each release should be: the meter's own prediction of its mean from the task's known per-example gradients
(its own clipping, not the engine's), x_t = (1/B) sum_{i in batch_t} clip(s_t g_i; C), beside the recorded release
g~_t (in the clipping geometry: s_t g~_t for scale-then-privatize) and, for independent moment estimation, the
release of g_t^2 beside the square of the unscaled mean."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from dp_adam_bench.audit.meter.checks.row import Release
from dp_adam_bench.audit.meter.recording import StepRecord


def clipped_mean(scaled: torch.Tensor, clip: float, batch: float) -> torch.Tensor:
    """(1/B) sum_i clip(s g_i; C) of the scaled per-example gradients ``scaled`` (examples first, coordinates
    last)."""
    norms = scaled.pow(2).sum(-1).sqrt()
    f = torch.where(norms > clip, clip / norms, torch.ones_like(norms))
    return (scaled * f[..., None]).sum(0) / batch


def predicted(task, records: list[StepRecord], clip: float, batch: float, known=None):
    """Per step, flattened, (steps, coordinates): the release s g~, its predicted mean, and the predicted mean
    unscaled; ``task.known_grads`` gives the per-example gradients, or ``known(t, record)`` (t from 0: the oracle's
    gradients at the step's parameters, oracle.py)."""
    ys, xs, means = [], [], []
    for t, rec in enumerate(records):
        g = task.known_grads(rec.idx) if known is None else known(t, rec)
        s = rec.scale if rec.scale is not None else torch.ones(g.shape[1:], dtype=torch.float64)
        x = clipped_mean(g * s, clip, batch)
        ys.append((rec.noisy * s).numpy().reshape(-1))
        xs.append(x.numpy().reshape(-1))
        means.append((x / s).numpy().reshape(-1))
    return np.stack(ys), np.stack(xs), np.stack(means)


def releases(
    task,
    records: list[StepRecord],
    clip: float,
    batch: float,
    stated_square: Callable[[], float],
    known=None,
) -> list[Release]:
    """The run's releases beside their predictions: g~ (the std the privatizer stated at the first step,
    sensitivity C / B) and, where the run released it, g^2 (``stated_square()``, sensitivity (2 B_max - 1) C^2 /
    B^2 with B_max the largest batch seen: the cross terms of the square of the mean). ``known``: see
    :func:`predicted`; the slope by norm class where the task gives its classes (``class_masks``)."""
    y, x, mean = predicted(task, records, clip, batch, known)
    classes = task.class_masks() if hasattr(task, "class_masks") else None
    out = [Release("g", y, x, records[0].noise_std, clip / batch, classes)]
    if records[0].noisy_square is not None:  # no scale: the privatizer refuses g^2 with scale-then-privatize
        y2 = np.stack([rec.noisy_square.numpy().reshape(-1) for rec in records])
        b_max = max(len(rec.idx) for rec in records)
        out.append(Release("g^2", y2, mean**2, stated_square(), (2 * b_max - 1) * clip**2 / batch**2))
    return out
