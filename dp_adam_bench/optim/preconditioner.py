"""The per-coordinate learning rates an optimizer variant would use next, read off its state (diagnostics only).

For the Adam family the step is theta <- theta - lr_t * m^_t with the *effective learning rate*
lr_t = eta / denominator_t, and the denominator is the variant's own (:mod:`dp_adam_bench.optim.adam`):

| variant | second-moment estimate nu (before any floor) | denominator |
|---|---|---|
| adam (post-processing), noiseless_precond | v^ = v / (1 - beta2^t) | sqrt(v^) + eps |
| stp, stp_noiseless_precond | v^ of the *unscaled* noisy (or clean) gradient | sqrt(v^) + eps_s2 |
| bc, adambc | v^ - Phi_t (Phi' or phi_scale * Phi_t when overridden) | sqrt(max(v^ - Phi_t, floor)) |
| ime, ime_free | v^ (may be negative) | sqrt(max(v^, 0)) + eps_s |

The denominator is taken from the variant's own ``denominator`` method, so it cannot drift from what the update
uses; ``nu`` and ``at_floor`` are recomputed here from the variant's attributes (a test checks that they agree).
AdaGrad variants (state ``nu``) are covered too: sqrt(nu) + eps, or max(floor, sqrt(max(nu, 0))) + eps for IME.

Everything here reads optimizer state that may depend on clean (un-noised) statistics; it is a diagnostic for
toy experiments, never a private output.
"""

from __future__ import annotations

import torch

from dp_adam_bench.optim.adagrad import AdaGradIME, AdaGradPP
from dp_adam_bench.optim.adam import Adam, AdamIME, SubtractBias
from dp_adam_bench.optim.base import Variant


def _bias_term(variant: SubtractBias, state: dict) -> float:
    if variant.phi_override is not None:
        return float(variant.phi_override)
    return float(getattr(variant, "phi_scale", 1.0)) * float(state["phi"])


def effective_preconditioner(variant: Variant, state: dict) -> dict[str, list[torch.Tensor]]:
    """Per parameter tensor: ``nu`` (the second-moment estimate under the root, before flooring), ``denominator``,
    ``lr`` = eta / denominator (the per-coordinate learning rate applied to m^) and ``at_floor`` (True where the
    floor / clamp of the variant decides the denominator instead of nu)."""
    if isinstance(variant, Adam):
        t = int(state["step"])
        bc2 = 1 - variant.beta2**t if t > 0 else 1.0
        out = {"nu": [], "denominator": [], "lr": [], "at_floor": []}
        for v in state["v"]:
            v_hat = v / bc2
            denom = variant.denominator(v.clone(), bc2**0.5, state)
            if isinstance(variant, SubtractBias):
                nu = v_hat - _bias_term(variant, state)
                at_floor = nu < variant.floor
            elif isinstance(variant, AdamIME):
                nu, at_floor = v_hat, v_hat < 0
            else:
                nu, at_floor = v_hat, torch.zeros_like(v_hat, dtype=torch.bool)
            out["nu"].append(nu)
            out["denominator"].append(denom)
            out["lr"].append(variant.lr / denom)
            out["at_floor"].append(at_floor)
        return out
    if isinstance(variant, AdaGradIME):
        nus = list(state["nu"])
        denoms = [nu.clamp(min=0).sqrt().clamp_(min=variant.floor).add_(variant.eps) for nu in nus]
        floors = [nu.clamp(min=0).sqrt() < variant.floor for nu in nus]
    elif isinstance(variant, AdaGradPP):
        nus = list(state["nu"])
        denoms = [nu.sqrt().add_(variant.eps) for nu in nus]
        floors = [torch.zeros_like(nu, dtype=torch.bool) for nu in nus]
    else:
        raise ValueError(
            f"no per-coordinate preconditioner for variant {variant.name!r} (not Adam or AdaGrad)"
        )
    return {
        "nu": nus,
        "denominator": denoms,
        "lr": [variant.lr / d for d in denoms],
        "at_floor": floors,
    }
