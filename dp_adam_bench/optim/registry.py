"""Variant names -> classes. Adding a variant: a class in one module, a line here, a YAML in configs/optimizer/."""

from __future__ import annotations

from dp_adam_bench.optim.adagrad import AdaGradIME, AdaGradIMEFree, AdaGradPP
from dp_adam_bench.optim.adam import (
    Adam,
    AdamBC,
    AdamIME,
    AdamIMEFree,
    BiasCorrection,
    NoiselessPreconditioner,
    ScaleThenPrivatize,
    SideInformation,
    STPNoiselessPreconditioner,
)
from dp_adam_bench.optim.base import Variant
from dp_adam_bench.optim.sgd import SGD

VARIANTS: dict[str, type[Variant]] = {
    cls.name: cls
    for cls in (
        SGD,
        Adam,
        AdamBC,
        BiasCorrection,
        AdamIME,
        AdamIMEFree,
        ScaleThenPrivatize,
        NoiselessPreconditioner,
        STPNoiselessPreconditioner,
        SideInformation,
        AdaGradPP,
        AdaGradIME,
        AdaGradIMEFree,
    )
}


def build_variant(name: str, **hparams) -> Variant:
    if name not in VARIANTS:
        raise ValueError(f"unknown optimizer variant {name!r}; valid variants: {', '.join(sorted(VARIANTS))}")
    return VARIANTS[name](**hparams)
