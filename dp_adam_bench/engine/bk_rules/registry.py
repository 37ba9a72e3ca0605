"""The registry of bk's per-layer rules (see the package docstring): module type -> :class:`Rule`."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class Rule:
    """How bk handles one module type: ``compute`` (see the module docstring); ``refuse(module)`` returns why a
    configuration of that type cannot be computed exactly (or None); ``install(engine, layer)`` replaces the
    generic output capture for modules whose parameters act inside their forward (attention) and returns a
    function that undoes it; ``accepts(module)``: whether a module of a type matched by name computes what the
    rule assumes (otherwise it takes the generic rule); ``shares``: whether ``compute`` hands the engine its
    per-example gradient of a parameter several layers use (``engine.share``,
    :mod:`~dp_adam_bench.engine.bk_rules.shared`), so that tied weights through it are exact."""

    kind: str
    compute: Callable
    refuse: Callable[[nn.Module], str | None] | None = None
    install: Callable | None = None
    shares: bool = False
    accepts: Callable[[nn.Module], bool] | None = None


_RULES: dict[type, Rule] = {}
_BY_NAME: dict[tuple[str, str], Rule] = {}  # (module prefix, class name): types from optional packages


def register(
    *types: type | tuple[str, str], kind: str, refuse=None, install=None, shares=False, accepts=None
):
    """Register the decorated ``compute`` for ``types`` (exact classes; ``(module prefix, class name)`` for
    classes of packages that need not be installed, such as transformers' ``Conv1D``; the class name may be an
    ``fnmatch`` pattern, ``*ScaledWordEmbedding``)."""

    def wrap(compute):
        rule = Rule(kind, compute, refuse, install, shares, accepts)
        for t in types:
            if isinstance(t, tuple):
                _BY_NAME[t] = rule
            else:
                _RULES[t] = rule
        return compute

    return wrap


def rule_for(module: nn.Module) -> Rule | None:
    """The rule of ``module``'s exact type (subclasses may change the forward, so they need their own), or None."""
    t = type(module)
    rule = _RULES.get(t)
    if rule is None:
        rule = next(
            (
                r
                for (mod, name), r in _BY_NAME.items()
                if fnmatch.fnmatchcase(t.__name__, name) and t.__module__.startswith(mod)
            ),
            None,
        )
    if rule is not None and rule.accepts is not None and not rule.accepts(module):
        return None
    return rule


_ADAPTERS: dict[type, Callable] = {}
_ADAPTERS_BY_NAME: dict[tuple[str, str], Callable] = {}


def register_adapter(*types: type | tuple[str, str]):
    """Register the decorated ``install(engine, name, module) -> undo or None`` for modules of ``types`` (with or
    without parameters of their own; ``(module prefix, class name)`` for optional packages) that bk must call
    differently while it records a batch, e.g. sequence-first transformer layers, whose inner Linear layers would
    otherwise see the sequence along dim 0."""

    def wrap(install):
        for t in types:
            if isinstance(t, tuple):
                _ADAPTERS_BY_NAME[t] = install
            else:
                _ADAPTERS[t] = install
        return install

    return wrap


def adapter_for(module: nn.Module) -> Callable | None:
    t = type(module)
    found = _ADAPTERS.get(t)
    if found is None:
        found = next(
            (
                a
                for (mod, name), a in _ADAPTERS_BY_NAME.items()
                if t.__name__ == name and t.__module__.startswith(mod)
            ),
            None,
        )
    return found


def supported_types() -> list[str]:
    """The class names that have a rule, for messages."""
    return sorted({t.__name__ for t in _RULES} | {name for _, name in _BY_NAME})
