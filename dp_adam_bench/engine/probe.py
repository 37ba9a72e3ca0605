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
that the probed example does not reach (a branch taken only for other inputs): the engine watch
(:mod:`dp_adam_bench.engine.watch`) probes a random example at every check, the first of its draws whose gradient
is not all zero, and a parameter whose gradient is exactly zero at the current weights is probed again with the
weights :func:`perturbed` (a gate at 0), and listed as unverified when still zero. It sees other engine defects that
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
#: how far :func:`perturbed` moves each parameter, relative to its RMS: enough to open a gate at exactly 0, small
#: enough to keep the model's loss finite and its activations in their usual range
PERTURBATION = 0.05


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


def clipped_sum(engine, batch: dict, clip: float | None, scale=None):
    """``engine.clipped_sum``, an engine's refusal of what it met in the forward as one :class:`ConfigError` line."""
    try:
        return engine.clipped_sum(batch, clip, scale)
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


def _compare(engine, one: dict, clip: float | None = None) -> dict:
    """The engine's unclipped gradient and norm of the single example ``one`` against autograd's (both in full fp32
    outside autocast): per-parameter relative errors, the norm's, and which parameters autograd gives exactly zero."""
    with neutral(engine.model), ieee_fp32(), torch.autocast(engine.params[0].device.type, enabled=False):
        got, ref = clipped_sum(engine, one, None), engine.plain_grad(one, "sum")
        norm = float(torch.sqrt(sum(r.double().square().sum() for r in ref)))
        if not (math.isfinite(norm) and math.isfinite(float(got.norms[0]))):
            raise ConfigError(
                f"engine probe: the gradient of a training example is not finite (autograd's norm {norm}, "
                f"train.clipping={engine.name}'s {float(got.norms[0])}): check the loss and the model's inputs "
                "(a NaN or inf loss) before training privately"
            )
        errs = [_rel(g, r, FLOOR * norm) for g, r in zip(got.summed, ref, strict=True)]
        # against the larger of the norm and C (when the run clips): C bounds min(||g||, C), and the Gram form's
        # norm of an example far below C (its gradient cancelling across positions) carries ~1e-2 of itself
        norm_err = abs(float(got.norms[0]) - norm) / max(norm, clip or 0.0, torch.finfo(torch.float64).tiny)
        ghost = _ghost_norms(engine, one)  # ghost: Opacus' per-parameter norms (its sum comes from autograd)
        # squared norms, which add across parameters: a part that should be 0 (a key bias, whose gradient softmax
        # cancels) comes out of the Gram form as sqrt(rounding), ~3e-4 of its layer, but its square is rounding
        norm_errs = (
            [
                abs(n * n - float(r.double().square().sum()))
                / max(float(r.double().square().sum()), (FLOOR * norm) ** 2, 1e-300)
                for n, r in zip(ghost, ref, strict=True)
            ]
            if ghost is not None
            else None
        )
    zero = [i for i, r in enumerate(ref) if not bool(r.any())]
    return {
        "errs": errs,
        "norm_err": norm_err,
        "norm": norm,
        "got_norm": float(got.norms[0]),
        "norm_errs": norm_errs,
        "zero": zero,
    }


@contextmanager
def perturbed(params, generator: torch.Generator, scale: float = PERTURBATION):
    """Every trainable parameter moved by ``scale`` times its RMS (times 1 for an all-zero tensor: a zero-initialised
    gate, LoRA's B) in a random direction from ``generator``, and restored bit for bit on exit. A parameter whose
    gradient is exactly zero at the current weights (behind a gate at 0) is then reached by the check: which uses
    of a parameter an engine sees is a property of the model's code, not of the weights' values."""
    saved = [p.detach().clone() for p in params]
    try:
        with torch.no_grad():
            for p in params:
                rms = float(p.double().square().mean().sqrt()) if p.numel() else 0.0
                # drawn on the CPU (the generator's device), then moved: the same draws on every device
                step = torch.randn(p.shape, generator=generator, dtype=torch.float64, device="cpu")
                p.add_((scale * (rms if rms > 0 else 1.0) * step).to(p.device, p.dtype))
        yield
    finally:
        with torch.no_grad():
            for p, s in zip(params, saved, strict=True):
                p.copy_(s)


def probe(engine, batch: dict, generator: torch.Generator | None = None, clip: float | None = None) -> dict:
    """Compare ``engine`` with autograd on the first example of ``batch`` (module docstring); returns the record
    for the summary, or raises :class:`ConfigError` naming the first parameter whose gradient the engine gets
    wrong.

    A parameter whose reference gradient is exactly zero at this example and these weights is not verified by the
    comparison (0 = 0 whatever the engine would do with a non-zero gradient). With a ``generator``, the comparison
    is made again with every parameter :func:`perturbed`; parameters still exactly zero there (unused by this
    example's loss) are listed in the record as ``unverified``, never counted as passed."""
    t0 = time.perf_counter()
    names = [n for n, p in engine.model.named_parameters() if p.requires_grad]
    one = {k: v[:1] for k, v in batch.items()}
    result = _compare(engine, one, clip)
    _refuse(engine, names, result, "")
    perturbation = None
    if result["zero"] and generator is not None:
        with perturbed(engine.params, generator):
            again = _compare(engine, one, clip)
        _refuse(engine, names, again, " (with the weights perturbed, since its gradient is zero at them)")
        perturbation = {
            "parameters_reached": len(result["zero"]) - len(set(again["zero"]) & set(result["zero"]))
        }
        zero = sorted(set(result["zero"]) & set(again["zero"]))
        errs = [max(a, b) for a, b in zip(result["errs"], again["errs"], strict=True)]
    else:
        zero, errs = result["zero"], result["errs"]
    record = {
        "examples": 1,
        "max_rel_error": max([*errs, result["norm_err"]]),
        "tolerance": tolerance(engine.params[0].dtype),
        "unverified": [names[i] for i in zero],
        "seconds": time.perf_counter() - t0,
        "note": "diagnostic: the engine's unclipped gradient and norm of one private training example against "
        "autograd's, not part of the accounted release; 'unverified': parameters whose gradient was exactly zero "
        "(also with the weights perturbed), which the comparison cannot see",
    }
    if perturbation is not None:
        record["perturbed"] = perturbation
    return record


def _refuse(engine, names: list[str], result: dict, when: str) -> None:
    """The :class:`ConfigError` of a :func:`_compare` ``result`` beyond tolerance: the first parameter whose gradient
    (or, ghost, whose norm) differs, else the norm alone."""
    errs, norm_err = result["errs"], result["norm_err"]
    what = "the engine's gradient of one example differs from autograd's"
    bad = [i for i, (e, p) in enumerate(zip(errs, engine.params, strict=True)) if not e <= tolerance(p.dtype)]
    if (
        not bad and result["norm_errs"] is not None
    ):  # ghost: its sum is right by construction, its norms may not be
        errs = result["norm_errs"]
        what = "the engine's norm of one example's gradient differs from autograd's"
        bad = [
            i for i, (e, p) in enumerate(zip(errs, engine.params, strict=True)) if not e <= tolerance(p.dtype)
        ]
    if bad:
        i = bad[0]
        others = (
            f" (and {len(bad) - 1} more: {', '.join(names[j] for j in bad[1:4])})" if len(bad) > 1 else ""
        )
        raise ConfigError(
            f"engine probe: train.clipping={engine.name} misses part of the gradient of parameter {names[i]!r}"
            f"{others}{when}: {what} by {errs[i]:.3g} (relative; tolerance {tolerance(engine.params[i].dtype):g}), "
            "typically a use of the parameter outside the module that owns it (weight tying written as "
            "h @ emb.weight.T), which this engine does not see, so C would not bound each example's contribution; "
            "stopped before any noise was released. Untie it, move the use into the owning module, or use "
            "train.clipping=functorch"
        )
    if not norm_err <= tolerance(engine.params[0].dtype):
        raise ConfigError(
            f"engine probe: train.clipping={engine.name} reports a per-example norm {result['got_norm']:.6g}{when} "
            f"where autograd's gradient of the same example has norm {result['norm']:.6g} (relative error "
            f"{norm_err:.3g}), so C would not bound each example's contribution; stopped before any noise was "
            "released. Use train.clipping=functorch"
        )
