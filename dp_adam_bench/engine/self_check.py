"""The engine's self-check on the user's own model, before any noise is released.

The conformance suite (``tests/test_conformance.py``) proves each engine on the layer configurations it knows;
a user's model may still combine layers in a way no test saw (a custom forward, an in-place trick, a layer
subclass). So at the start of every model run (CLI and :func:`dp_adam_bench.make_private`) the engine's per-example
norms and clipped sum for a few real training examples are compared with the loop over batches of size one on
the same model. A relative error above the tolerance stops the run, naming the engine and the error, before the
first step; the error goes into the run summary either way.

The check runs in eval mode (dropout would make the two computations differ; with the Opacus engines, which
record activations only in train mode, the modules owning trainable parameters stay in train mode), under a
forked random state (the run's random streams, hence its results and its resume, are unchanged), and releases
nothing: its only outputs are whether the run starts and a floating-point error, a diagnostic recorded as such
(computed on private examples, outside the accounted mechanism, like the clean-gradient diagnostics).
``train.self_check.enabled=false``
(``make_private(self_check=False)``) skips it, and the summary records that it was skipped.

A resumed run does not repeat a check that passed: the check compares the engine with the loop on the model as
built before any training (the same weights and examples on every attempt), so a resume would recompute the same
numbers. Every checkpoint carries the record of the check that passed with its :func:`carry_key` (the run's
config identity, the check's settings, the engine, the device and the code, a hash of the package's source and
torch's version); a resume that finds the same key in the checkpoint it will load takes that record, marked
``carried_over`` with the checkpoint's step, instead of running the check again. Any difference in the key (a
changed tolerance, another device, edited code, an older checkpoint without a record) runs the check as on a
fresh start.
"""

from __future__ import annotations

import functools
import hashlib
import math
import time

import torch

from dp_adam_bench.engine.grads import clip_factors, loop_grads
from dp_adam_bench.errors import ConfigError

#: relative error allowed: float32 (and TF32 convolutions on CUDA, whose mantissa has 10 bits) differ from the
#: loop by up to ~1e-3; the defects this check exists for were off by 10-150 %
DEFAULT_TOLERANCE = 1e-2
DEFAULT_EXAMPLES = 4


def self_check(engine, batch: dict, clip: float | None, tolerance: float = DEFAULT_TOLERANCE) -> dict:
    """Compare ``engine``'s norms and clipped sum on ``batch`` with the size-one loop; returns the record for the
    summary, or raises :class:`ConfigError` when the relative error exceeds ``tolerance``."""
    model = engine.model
    modes = {m: m.training for m in model.modules()}
    devices = [d for d in {p.device for p in engine.params} if d.type == "cuda"]
    # Opacus records activations only for modules in train mode: those owning trainable parameters stay in it
    keep = getattr(engine, "gsm", None) is not None
    t0 = time.perf_counter()
    with torch.random.fork_rng(devices=devices):
        for m in modes:
            m.training = keep and any(p.requires_grad for p in m.parameters(recurse=False))
        try:
            try:
                got = engine.clipped_sum(batch, clip)
            except ConfigError:
                raise
            except ValueError as err:  # an engine refusing what it met in the forward: one line, no traceback
                raise ConfigError(str(err)) from err
            engine._hooks(False)
            try:
                per_ex = loop_grads(model, engine.loss_per_example, engine.params, batch)
            finally:
                engine._hooks(True)
        finally:
            for m, mode in modes.items():
                m.training = mode
    b = got.count
    norms = torch.sqrt(sum(g.reshape(b, -1).square().sum(1) for g in per_ex))
    f = clip_factors(norms, clip)
    summed = [torch.einsum("b,b...->...", f, g) for g in per_ex]
    tiny = torch.finfo(norms.dtype).tiny
    norm_err = float(((got.norms - norms).abs() / norms.clamp(min=tiny)).max())
    diff = torch.sqrt(sum((s - r).double().square().sum() for s, r in zip(got.summed, summed, strict=True)))
    size = torch.sqrt(sum(r.double().square().sum() for r in summed))
    sum_err = float(diff / size.clamp(min=tiny))
    err = max(norm_err, sum_err)
    record = {
        "enabled": True,
        "examples": b,
        "max_rel_error": err,
        "norm_rel_error": norm_err,
        "sum_rel_error": sum_err,
        "tolerance": tolerance,
        "seconds": time.perf_counter() - t0,
        "note": "diagnostic: computed on private training examples, not part of the accounted release",
    }
    if not err <= tolerance:  # NaN fails too
        raise ConfigError(
            f"self-check: train.clipping={engine.name} computes per-example gradients that differ from the loop "
            f"over batches of size one by {err:.3g} (relative; tolerance {tolerance:g}) on this model, so C would "
            "not bound each example's contribution; stopped before any noise was released. Use "
            "train.clipping=functorch or loop (train.self_check.enabled=false skips this check)"
        )
    return record


@functools.cache
def source_digest() -> str:
    """sha1 of the package's Python source (every ``.py`` file under it, by relative path): edited code, committed
    or not, gives another digest."""
    from dp_adam_bench.paths import PACKAGE_DIR

    h = hashlib.sha1()
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        h.update(path.relative_to(PACKAGE_DIR).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def carry_key(run_fingerprint: str, settings, engine: str, device) -> dict:
    """What a passed check is a statement about (module docstring): the run's config identity (task, model, data,
    clipping, clip, seed, precision: ``engine.checkpoint.fingerprint``), the check's examples and tolerance, the
    engine, the device, and the code."""
    settings = settings or {}
    return {
        "run": run_fingerprint,
        "examples": int(settings.get("examples", DEFAULT_EXAMPLES)),
        "tolerance": float(settings.get("tolerance", DEFAULT_TOLERANCE)),
        "engine": str(engine),
        "device": str(device),
        "source_sha1": source_digest(),
        "torch": str(torch.__version__),
    }


def passed(record: dict) -> bool:
    """Whether ``record`` is that of a check that ran on at least one example and passed."""
    err, tol = record.get("max_rel_error"), record.get("tolerance")
    return bool(
        record.get("enabled")
        and record.get("examples")
        and isinstance(err, float)
        and isinstance(tol, float)
        and math.isfinite(err)
        and err <= tol
    )


def carried_over(saved, key: dict, step: int) -> dict | None:
    """The summary's record for a resume whose checkpoint (written after ``step`` steps) holds ``saved``, the
    ``{"key", "record"}`` of a check of an earlier attempt: that record marked ``carried_over`` when it passed under
    the same ``key``; None otherwise (the check must run)."""
    if not isinstance(saved, dict) or saved.get("key") != key:
        return None
    record = saved.get("record")
    if not isinstance(record, dict) or not passed(record):
        return None
    return {
        **record,
        "carried_over": {
            "checkpoint_step": int(step),
            "note": "passed in an earlier attempt of this run (same run identity, check settings, engine, device "
            "and code) and recorded in the checkpoint this attempt resumed from; not run again",
        },
    }
