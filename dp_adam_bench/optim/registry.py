"""Variant names -> classes. Adding a variant: a class in one module, a line here, a YAML in configs/optimizer/.

A plug-in (or a test) registers its own with ``VARIANTS.register("name", MyVariant)``.
"""

from __future__ import annotations

from dp_adam_bench.optim.adagrad import AdaGradIME, AdaGradIMEFree, AdaGradPP
from dp_adam_bench.optim.adam import (
    Adam,
    AdamBC,
    AdamIME,
    AdamIMEFree,
    AdamW,
    AdamWBC,
    BiasCorrection,
    NoiselessPreconditioner,
    ScaleThenPrivatize,
    SideInformation,
    STPNoiselessPreconditioner,
)
from dp_adam_bench.optim.base import Variant
from dp_adam_bench.optim.sgd import SGD
from dp_adam_bench.registry import Registry

VARIANTS = Registry("optimizer variant", "optimizer.name")
for _cls in (
    SGD,
    Adam,
    AdamBC,
    AdamW,
    AdamWBC,
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
):
    VARIANTS.register(_cls.name, _cls)


def build_variant(name: str, **hparams) -> Variant:
    """The variant ``name`` with its hyper-parameters; ConfigError for an unknown name."""
    return VARIANTS.build(name, **hparams)
