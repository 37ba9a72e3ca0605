"""AdaGrad and its private variants (Ganesh et al. §5.1, Algorithm 3).

* ``adagrad_pp`` — AdaGrad via post-processing: plain AdaGrad on the privatized gradient. With sigma = 0 and no
  clipping it *is* non-private AdaGrad, and matches ``torch.optim.Adagrad`` (eps = 1e-10 added to sqrt(nu), the
  same operation order) bit for bit, with coupled ``weight_decay`` too (g + lambda theta, as
  ``torch.optim.Adagrad(weight_decay=...)``).
* ``adagrad_ime`` — independent moment estimation (Kalinin et al.; Ganesh Alg. 6 adapted to AdaGrad): the
  gradient and its square are noised separately, g_t + sqrt(2) (C/B) sigma w1_t and
  g_t^2 + sqrt(2) S2 sigma w2_t, where S2 is the L2 sensitivity of g_t^2 (below). The accumulator nu can go
  negative, so the step is eta / max(floor, sqrt(max(nu, 0))) with floor = 1 as in §5.1.
* ``adagrad_ime_free`` — the same "for free": the sqrt(2) factors dropped (each half alone gets sigma).

Weight decay (:mod:`dp_adam_bench.optim.base`): coupled or decoupled for ``adagrad_pp``; decoupled only for the IME
variants, whose accumulator is fed by the separate release of g^2, which an L2 term added to g would not reach.

Sensitivity of g_t^2 under zero-out adjacency with batch size B (Ganesh §3.2): the derivation bounds it by
(2B - 1) C^2 / B^2, while Algorithm 6 as printed adds noise with (2B + 1) C^2 / B^2. Both are valid (the printed
one is looser); we default to the derived, tight value and keep the printed one selectable
(``sq_sensitivity: printed``). For B = 1 they differ by 3x. The bound needs the realized batch size to be at most B:
with Poisson sampling the realized batch is unbounded, so IME is only private with fixed-size batches.
"""

from __future__ import annotations

import functools
import math

import torch

from dp_adam_bench.optim.base import Releases, StepContext, Variant


class AdaGradPP(Variant):
    name = "adagrad_pp"

    def __init__(self, lr: float, eps: float = 1e-10, **kw):
        super().__init__(lr, **kw)
        if eps < 0:
            raise ValueError(f"optimizer.eps must be >= 0, got {eps}")
        self.eps = float(eps)

    def init(self, params):
        return {"nu": [torch.zeros_like(p) for p in params]}

    def update(self, params, state, ctx: StepContext):
        grads = self.with_coupled_decay(params, ctx.noisy)
        self.apply_decoupled_decay(params)
        for p, g, nu in zip(params, grads, state["nu"], strict=True):
            nu.addcmul_(g, g, value=1)
            p.addcdiv_(g, nu.sqrt().add_(self.eps), value=-self.lr)


def square_sensitivity(clip: float, batch_size: float, form: str = "derived") -> float:
    """L2 sensitivity of the squared averaged clipped gradient g_t^2 (Ganesh §3.2)."""
    if form == "derived":
        return (2 * batch_size - 1) * clip**2 / batch_size**2
    if form == "printed":
        return (2 * batch_size + 1) * clip**2 / batch_size**2
    raise ValueError(f"optimizer.sq_sensitivity must be 'derived' or 'printed', got {form!r}")


def ime_releases(split_factor: float, sq_form: str) -> Releases:
    """What independent moment estimation needs released (Ganesh Alg. 6): g + k (C/B) sigma w1 and
    g^2 + k S2 sigma w2 on two independent streams, both made by the privatizer (k = sqrt 2, or 1 "for free")."""
    return Releases(
        noise_scale=split_factor, square_sensitivity=functools.partial(square_sensitivity, form=sq_form)
    )


class AdaGradIME(Variant):
    name = "adagrad_ime"
    needs_fixed_batch = True
    split_factor = math.sqrt(2.0)
    coupled_decay = False

    def __init__(
        self, lr: float, floor: float = 1.0, eps: float = 0.0, sq_sensitivity: str = "derived", **kw
    ):
        super().__init__(lr, **kw)
        if floor < 0 or eps < 0:
            raise ValueError(f"optimizer.floor and optimizer.eps must be >= 0, got {floor}, {eps}")
        if floor == 0 and eps == 0:
            raise ValueError("optimizer.floor and optimizer.eps are both 0: the step would divide by zero")
        square_sensitivity(1.0, 1.0, sq_sensitivity)  # validates the name
        self.floor, self.eps, self.sq_form = float(floor), float(eps), sq_sensitivity

    def releases(self) -> Releases:
        return ime_releases(self.split_factor, self.sq_form)

    def init(self, params):
        return {"nu": [torch.zeros_like(p) for p in params]}

    def update(self, params, state, ctx: StepContext):
        if ctx.noisy_square is None:
            raise RuntimeError("adagrad_ime needs the privatizer's release of g^2 (StepContext.noisy_square)")
        self.apply_decoupled_decay(params)
        for p, g, q, nu in zip(params, ctx.noisy, ctx.noisy_square, state["nu"], strict=True):
            nu.add_(q)
            denom = nu.clamp(min=0).sqrt().clamp_(min=self.floor).add_(self.eps)
            p.addcdiv_(g, denom, value=-self.lr)


class AdaGradIMEFree(AdaGradIME):
    """IME "for free" (Ganesh §5.1): each half gets the full sigma, so the pair costs what a single release with
    sigma / sqrt(2) costs; the run is accounted that way (it is not free, the paper uses it as a comparison)."""

    name = "adagrad_ime_free"
    split_factor = 1.0
    sigma_factor = 1 / math.sqrt(2.0)
