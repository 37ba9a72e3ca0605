"""Which layers each clipping engine computes exactly — checked before a run, so that no engine is silently wrong.

Privacy rests on every example's contribution to the noised sum having norm at most C, which holds only if the
engine computes each example's gradient exactly. Three kinds of layer are refused:

* **No per-example gradient exists** (:func:`undefined`), whatever the engine: BatchNorm (batch statistics mix the
  examples), InstanceNorm with running statistics and BatchNorm's running statistics (statistics of the private
  data, released with the model without noise), Embedding / EmbeddingBag with ``scale_grad_by_freq`` (a row's
  gradient is divided by its frequency in the *whole batch*, so one example's contribution depends on the others
  and is not bounded by C), and with ``max_norm`` (the forward renormalises, in place, the rows the private batch
  looks up: a change to the parameters that bypasses clipping and noise). Sparse embedding gradients are not
  supported by the privatizer.
* **bk**: a configuration a rule of :mod:`dp_adam_bench.engine.bk_rules` refuses. A module type without a rule is
  not refused: bk's generic rule (:mod:`dp_adam_bench.engine.bk_rules.generic`) recomputes its forward one example
  at a time and refuses, in the forward, a module whose recomputation does not reproduce the batch's output.
* **hooks / ghost** (Opacus' per-sample rules): anything outside what the conformance suite
  (``tests/test_conformance.py``) showed them to compute exactly. Opacus 1.6 is silently wrong on convolutions with a
  ``padding_mode`` other than zeros, on Embedding with ``padding_idx`` when a padding token is in the batch, and on
  EmbeddingBag when an id repeats in a bag; it crashes on ``nn.MultiheadAttention``, LayerNorm without bias and
  (ghost) Linear on inputs of more than 3 dimensions (``docs/pitfalls.md`` has a reproduction of each).

``loop`` and ``functorch`` differentiate one example at a time, so they are exact for every layer that has a
per-example gradient. A refusal names every offending layer and the engines that do support it.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from dp_adam_bench.errors import ConfigError

ENGINE_ORDER = ("bk", "functorch", "loop", "hooks", "ghost")


def undefined(m: nn.Module) -> str | None:
    """Why no engine can bound one example's contribution through ``m``, or None."""
    if isinstance(m, nn.modules.batchnorm._BatchNorm):
        return (
            f"{type(m).__name__} normalises with statistics of the whole batch, so no example's gradient is its "
            "own; use GroupNorm or LayerNorm"
        )
    if isinstance(m, nn.modules.instancenorm._InstanceNorm) and m.track_running_stats:
        return (
            f"{type(m).__name__}(track_running_stats=True) keeps running statistics of the private data, released "
            "with the model without noise; set track_running_stats=False"
        )
    if isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
        name = type(m).__name__
        if m.scale_grad_by_freq and m.weight.requires_grad:
            return (
                f"{name}(scale_grad_by_freq=True) divides a row's gradient by its frequency in the whole batch, so "
                "one example's contribution depends on the others and is not bounded by C; set "
                "scale_grad_by_freq=False"
            )
        if m.max_norm is not None:
            return (
                f"{name}(max_norm={m.max_norm}) renormalises the looked-up rows in place during the forward, a "
                "change to the parameters that depends on the private batch and bypasses clipping and noise; "
                "set max_norm=None"
            )
        if m.sparse and m.weight.requires_grad:
            return f"{name}(sparse=True) makes sparse gradients, which the privatizer does not take; set sparse=False"
    return None


def _bk(m: nn.Module) -> str | None:
    from dp_adam_bench.engine.bk_rules import rule_for

    rule = rule_for(m)  # None: the generic rule, which checks its own exactness in the forward
    return rule.refuse(m) if rule is not None and rule.refuse is not None else None


def _everything(m: nn.Module) -> None:
    return None


def _opacus() -> Callable[[nn.Module], str | None]:
    def check(m: nn.Module) -> str | None:
        t = type(m)
        name = t.__name__
        if t is nn.Linear or (t.__name__ == "Conv1D" and t.__module__.startswith("transformers")):
            return None
        if t in (nn.Conv1d, nn.Conv2d, nn.Conv3d):
            if m.padding_mode != "zeros":
                return f"{name}(padding_mode={m.padding_mode!r}): Opacus' rule ignores the padding mode"
            return None
        if t is nn.Embedding:
            if m.padding_idx is not None:
                return (
                    f"Embedding(padding_idx={m.padding_idx}): Opacus' rule gives the padding row a gradient when a "
                    "padding token is in the batch"
                )
            return None
        if t is nn.LayerNorm:
            return None if m.bias is not None else "LayerNorm(bias=False): Opacus' rule crashes"
        if t in (nn.GroupNorm, nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d, nn.RMSNorm):
            return None
        if t is nn.MultiheadAttention:
            return "nn.MultiheadAttention: Opacus' hooks crash on it"
        if t is nn.EmbeddingBag:
            return "EmbeddingBag: Opacus' rule is wrong when an id repeats in a bag"
        return f"{name}: not shown exact for Opacus by the conformance suite"

    return check


#: engine name -> why a module (with trainable parameters of its own) is refused, or None
CHECKS: dict[str, Callable[[nn.Module], str | None]] = {
    "bk": _bk,
    "functorch": _everything,
    "loop": _everything,
    "hooks": _opacus(),
    "ghost": _opacus(),
}


def own_trainable(m: nn.Module) -> dict[str, nn.Parameter]:
    """``m``'s own trainable parameters (not its children's), by name."""
    return {n: p for n, p in m._parameters.items() if p is not None and p.requires_grad}


def problems(model: nn.Module, engine: str) -> list[tuple[str, str, bool]]:
    """``(layer name, reason, undefined)`` for every module of ``model`` that ``engine`` cannot compute exactly."""
    out = []
    check = CHECKS.get(engine, _everything)
    for name, m in model.named_modules():
        name = name or "<root>"
        why = undefined(m)
        if why is not None:
            out.append((name, why, True))
        elif own_trainable(m):
            why = check(m)
            if why is not None:
                out.append((name, why, False))
    return out


def supporting(m: nn.Module) -> list[str]:
    """The engines that compute ``m``'s per-example gradient exactly (none if it has none)."""
    if undefined(m) is not None:
        return []
    return [e for e in ENGINE_ORDER if CHECKS[e](m) is None]


def check_model(model: nn.Module, engine: str) -> None:
    """Refuse, in one message, every layer of ``model`` whose per-example gradient ``engine`` cannot compute
    exactly (naming each layer, why, and the engines that can), before anything runs."""
    found = problems(model, engine)
    if not found:
        return
    modules = dict(model.named_modules())
    lines = []
    for name, why, undef in found:
        module = modules["" if name == "<root>" else name]
        own = list(own_trainable(module))
        params = f" [its parameters: {', '.join(own)}]" if own else ""
        if undef:
            lines.append(
                f"{name!r}: {why}{params} (no engine can; dp_adam_bench.fix_model swaps BatchNorm for GroupNorm)"
            )
        else:
            others = [e for e in supporting(module) if e != engine]
            lines.append(
                f"{name!r}: {why}{params}; use "
                + (" or ".join(f"train.clipping={e}" for e in others) or "no engine")
            )
    raise ConfigError(
        f"train.clipping={engine} cannot compute exact per-example gradients, so C would not bound each example's "
        f"contribution: " + "; ".join(lines)
    )
