"""The engine probe: does the engine see every use of every parameter? Run before every model run, even with the
self-check off.

bk, hooks and ghost compute per-example gradients module by module, from what each module that owns parameters
sees in its own forward. A parameter used *outside* the module that owns it — weight tying written as
``logits = h @ self.emb.weight.T`` in a parent's forward — passes the support check (every module has a rule) and is
silently missed: the engine reports per-example norms that are too low, so C no longer bounds each example's
contribution (issue 32: 2.26 instead of 2.39 for the size-one loop, float64). loop and functorch differentiate
the whole model per example and see every use.

One engine pass on one example, no clipping (``clip=None``: the clip factor is 1, so the engine's "clipped sum"
is its gradient of that example), against autograd's gradient of the same example's loss:

1. **Per parameter**: a missed use shows in the parameter it belongs to (bk, hooks).
2. **The norm**: the per-example norm the engine reports must be the norm of the example's gradient. Ghost
   clipping takes its *sum* from a second, ordinary backward (which sees every use), so only its norms are
   wrong; this comparison finds it, and Opacus' per-parameter ghost norms name the parameter.

A parameter whose relative difference exceeds :func:`tolerance` is refused in one :class:`ConfigError` line naming
it and the fix. The probe releases nothing (like the self-check, a diagnostic on a private example). Cost: one
engine pass and one ordinary backward on one example, in fp32 outside autocast (which use reads which parameter
does not depend on the precision). Measured on the paper smokes (CPU, one thread, mean per run): 0.02 s on
tang_fig1_cifar10's CNN (ghost), 0.01 s on tang_fig1_snli's BERT, 0.08 s on li_e2e's GPT-2, 0.10 s on
ganesh_fig3's masked language model (bk; its self-check: 0.53 s). It runs on every attempt of a run except a
resume that carries the self-check over under the same key (engine/self_check.py), which carries its record too.
One example, not a batch: an outside use is a property of the model's code, seen in any example that reaches it;
bugs that need two examples to show are the self-check's.

What it cannot see: anything that keeps one example's gradient right and gets the split of a batch wrong — a
forward that mixes examples (``h - h.mean(0)``), an engine that swaps two examples' gradients; the self-check
(:mod:`dp_adam_bench.engine.self_check`) compares every example with the size-one loop. A use of a parameter
that the first example does not reach (a branch taken only for other inputs). It sees other engine defects that
change one example's gradient or norm (a rule dropping a bias gradient, norms scaled wrongly), though not by that
name: its message says what differs and by how much.

:func:`neutral` is the forward both this probe and the self-check run in: the path training takes (train mode,
so e.g. ``nn.TransformerEncoder`` never takes its eval-only nested-tensor fast path), with dropout neutralised
so that two forwards of the same examples compute the same function.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager

import torch
from torch import nn

from dp_adam_bench.engine.fp32_exact import ieee_fp32
from dp_adam_bench.errors import ConfigError

#: relative difference allowed in fp32 / fp64: the two sides differ only in the order of float operations (up to
#: 1.3e-5 measured on the paper smokes' models); a missed use is a fraction of the parameter's gradient (0.65 for
#: the tied embedding of issue 32)
TOLERANCE = 1e-3
#: a parameter's difference is measured relative to its own gradient, but at least to this fraction of the whole
#: gradient's norm: a parameter whose gradient is almost zero is not refused for rounding
FLOOR = 1e-3


def tolerance(dtype: torch.dtype) -> float:
    """:data:`TOLERANCE`, or 8 units in the last place of a parameter in half precision (bf16: 0.0625)."""
    return max(TOLERANCE, 8 * torch.finfo(dtype).eps)


@contextmanager
def neutral(model: nn.Module):
    """The forward training takes, made repeatable: every module in train mode (as ``ModelBackend.release`` puts
    them), dropout probabilities set to 0 (``nn.Dropout`` and friends, and float attributes whose name contains
    ``dropout``, as ``nn.MultiheadAttention`` and Hugging Face attention keep them; dropout with p = 0 returns its
    input unchanged, so the masks drawn no longer matter), torch's MHA fast path off, and a forked random state
    (the run's random streams are untouched). Restored on exit.

    Train mode with p = 0 is exact; forking the random state instead and drawing "the same" masks would not be:
    a batch draws one (B, ...) mask, the size-one loop B masks of (1, ...), from different positions of the
    stream. Randomness the model draws in other ways (a hard-coded ``F.dropout(x, 0.1)``, stochastic depth) is not
    neutralised: the two computations then differ and the check refuses the model."""
    modes = {m: m.training for m in model.modules()}
    saved: list[tuple[object, str, float]] = []
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            saved.append((m, "p", m.p))
        for name, value in vars(m).items():
            if "dropout" in name and isinstance(value, float) and value > 0:
                saved.append((m, name, value))
    devices = sorted({p.device for p in model.parameters() if p.device.type == "cuda"}, key=str)
    fastpath = torch.backends.mha.get_fastpath_enabled()
    try:
        with torch.random.fork_rng(devices=devices):
            for m in modes:
                m.training = True
            for obj, name, _ in saved:
                setattr(obj, name, 0.0)
            torch.backends.mha.set_fastpath_enabled(False)
            yield
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
        for obj, name, value in saved:
            setattr(obj, name, value)
        for m, mode in modes.items():
            m.training = mode


def clipped_sum(engine, batch: dict, clip: float | None):
    """``engine.clipped_sum``, an engine's refusal of what it met in the forward as one :class:`ConfigError` line."""
    try:
        return engine.clipped_sum(batch, clip)
    except ConfigError:
        raise
    except ValueError as err:  # an engine refusing what it met in the forward: one line, no traceback
        raise ConfigError(str(err)) from err


def _rel(a: torch.Tensor, b: torch.Tensor, floor: float) -> float:
    d = float((a.double() - b.double()).norm())
    return d / max(float(b.double().norm()), floor, torch.finfo(torch.float64).tiny)


def _ghost_norms(engine, one: dict) -> list[float] | None:
    """Opacus' per-parameter ghost norms of the single example ``one`` (ghost only; None for other engines)."""
    gsm = getattr(engine, "gsm", None)
    if engine.name != "ghost" or gsm is None:
        return None
    try:
        engine.loss_per_example(gsm, one).sum().backward()
        return [
            float(getattr(p, "_norm_sample", torch.zeros(1, device=p.device)).reshape(-1)[0])
            for p in engine.params
        ]
    finally:
        for p in engine.params:
            p.grad = None
            p._norm_sample = None


def probe(engine, batch: dict) -> dict:
    """Compare ``engine`` with autograd on the first example of ``batch`` (module docstring); returns the record
    for the summary, or raises :class:`ConfigError` naming the first parameter whose gradient the engine gets
    wrong."""
    t0 = time.perf_counter()
    names = [n for n, p in engine.model.named_parameters() if p.requires_grad]
    one = {k: v[:1] for k, v in batch.items()}
    # full fp32 for both sides (engine/fp32_exact.py): TF32's error in autograd's reference is of the tolerance's size
    with neutral(engine.model), ieee_fp32(), torch.autocast(engine.params[0].device.type, enabled=False):
        got, ref = clipped_sum(engine, one, None), engine.plain_grad(one, "sum")
        norm = float(torch.sqrt(sum(r.double().square().sum() for r in ref)))
        if not (math.isfinite(norm) and math.isfinite(float(got.norms[0]))):
            raise ConfigError(
                f"engine probe: the gradient of the first training example is not finite (autograd's norm {norm}, "
                f"train.clipping={engine.name}'s {float(got.norms[0])}): check the loss and the model's inputs "
                "(a NaN or inf loss) before training privately"
            )
        errs = [_rel(g, r, FLOOR * norm) for g, r in zip(got.summed, ref, strict=True)]
        norm_err = abs(float(got.norms[0]) - norm) / max(norm, torch.finfo(torch.float64).tiny)
        what = "the engine's gradient of one example differs from autograd's"
        bad = [
            i for i, (e, p) in enumerate(zip(errs, engine.params, strict=True)) if not e <= tolerance(p.dtype)
        ]
        if not bad and not norm_err <= tolerance(engine.params[0].dtype):
            ghost = _ghost_norms(
                engine, one
            )  # ghost: its sum is right, its norms are not; Opacus' name the part
            if ghost is not None:
                errs = [
                    abs(n - float(r.double().norm())) / max(float(r.double().norm()), FLOOR * norm, 1e-300)
                    for n, r in zip(ghost, ref, strict=True)
                ]
                what = "the engine's norm of one example's gradient differs from autograd's"
                bad = [
                    i
                    for i, (e, p) in enumerate(zip(errs, engine.params, strict=True))
                    if not e <= tolerance(p.dtype)
                ]
            if not bad:  # the norm is wrong but no parameter's gradient is: name no parameter
                raise ConfigError(
                    f"engine probe: train.clipping={engine.name} reports a per-example norm {float(got.norms[0]):.6g}"
                    f" where autograd's gradient of the same example has norm {norm:.6g} (relative error "
                    f"{norm_err:.3g}), so C would not bound each example's contribution; stopped before any noise was "
                    "released. Use train.clipping=functorch"
                )
    record = {
        "examples": 1,
        "max_rel_error": max([*errs, norm_err]),
        "tolerance": tolerance(engine.params[0].dtype),
        "seconds": time.perf_counter() - t0,
        "note": "diagnostic: the engine's unclipped gradient and norm of one private training example against "
        "autograd's, not part of the accounted release",
    }
    if bad:
        i = bad[0]
        others = (
            f" (and {len(bad) - 1} more: {', '.join(names[j] for j in bad[1:4])})" if len(bad) > 1 else ""
        )
        raise ConfigError(
            f"engine probe: train.clipping={engine.name} misses part of the gradient of parameter {names[i]!r}"
            f"{others}: {what} by {errs[i]:.3g} (relative; tolerance {tolerance(engine.params[i].dtype):g}), "
            "typically a use of the parameter outside the module that owns it (weight tying written as "
            "h @ emb.weight.T), which this engine does not see, so C would not bound each example's contribution; "
            "stopped before any noise was released. Untie it, move the use into the owning module, or use "
            "train.clipping=functorch"
        )
    return record
