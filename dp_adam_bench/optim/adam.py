"""Adam and its private variants (Ganesh et al. Algorithms 4-9; Tang & Lecuyer Algorithm 1).

All variants share Adam's moment recursions (m_t, v_t, bias corrections 1 - beta^t) and differ in what feeds
them and in the denominator:

| name | first moment fed with | second moment fed with | step |
|---|---|---|---|
| adam (post-processing, "DP-Adam-Biased") | g~ | g~^2 | m^ / (sqrt(v^) + eps) |
| adambc (Tang Eq. 3) | g~ | g~^2 | m^ / sqrt(max(v^ - Phi_t, gamma')) — no eps outside the root |
| bc (Ganesh Alg. 7) | g~ | g~^2 | m^ / sqrt(max(v^ - Phi_t, eps_s^2)) |
| ime (Ganesh Alg. 6) | g + sqrt2 (C/B) sigma w1 | g^2 + sqrt2 S2 sigma w2 | m^ / (sqrt(max(v^, 0)) + eps_s) |
| stp (Ganesh Alg. 8) | (sum clip(s g_i) + noise) / s | same, squared | m^ / (sqrt(v^) + eps_s2) |
| noiseless_precond (Alg. 9 variant, non-private) | g~ | clean g^2 | m^ / (sqrt(v^) + eps) |

For stp the scale is s_t = 1 / (sqrt(v^_{t-1}) + eps_s1).

Phi_t is the exact bias of v^_t from the noise: for independent noise Phi = (sigma C / B)^2 (Tang); for DP-MF it
follows the recursion Phi_t = (beta2 - beta2^t)/(1 - beta2^t) Phi_{t-1} + (1 - beta2)/(1 - beta2^t) Var[noise_t],
with Var[noise_t] = (sigma C / B)^2 ||row_t(C^{-1})||^2 — the closed form of Ganesh App. A (see
:mod:`dp_adam_bench.privacy.adam_bias` for why the recursion printed in the paper is not used).

``adam`` follows ``torch.optim.Adam``'s single-tensor operation order, so with sigma = 0 and no clipping it matches
``torch.optim.Adam(foreach=False)`` bit for bit, with coupled ``weight_decay`` too (lambda theta added to g~
before both moments).

Weight decay (:mod:`dp_adam_bench.optim.base`; data-independent, so post-processing): every variant takes
``weight_decay`` with ``weight_decay_mode`` coupled (L2, refused where the second moment is fed by something other
than g~: ime, ime_free, noiseless_precond, stp_noiseless_precond, side_info) or decoupled. Two variants are
decoupled by definition, after Chooi, Cong, Li & Sun, "DP-AdamW: Investigating Decoupled Weight Decay and Bias
Correction in Private Deep Learning" (arXiv:2511.07843, 2025):

| name | step |
|---|---|
| adamw (DP-AdamW) | theta <- (1 - eta_t lambda) theta, then adam's step on g~ |
| adamw_bc (DP-AdamW-BC) | theta <- (1 - eta_t lambda) theta, then adambc's step (Tang Eq. 3 denominator) |

The paper's own equations were not available to us: these definitions follow its abstract ("a differentially
private variant of the AdamW optimizer with DP bias correction for the second moment estimator"), i.e. AdamW
(Loshchilov & Hutter 2019, as ``torch.optim.AdamW``: the decay scaled by the current scheduled learning rate, eps
outside the root) on the privatized gradient, and the same with Tang & Lecuyer's bias-corrected denominator
sqrt(max(v^ - Phi_t, gamma')). With sigma = 0 and no clipping ``adamw`` matches ``torch.optim.AdamW(foreach=False)``
bit for bit.
"""

from __future__ import annotations

import math

import torch

from dp_adam_bench.optim.adagrad import ime_releases, square_sensitivity
from dp_adam_bench.optim.base import Releases, StepContext, Variant


class Adam(Variant):
    """DP-Adam via post-processing: plain Adam on the privatized gradient."""

    name = "adam"

    def __init__(self, lr: float, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8, **kw):
        super().__init__(lr, **kw)
        for field, v in (("beta1", beta1), ("beta2", beta2)):
            if not 0.0 <= v < 1.0:
                raise ValueError(f"optimizer.{field} must be in [0, 1), got {v}")
        if eps < 0:
            raise ValueError(f"optimizer.eps must be >= 0, got {eps}")
        self.beta1, self.beta2, self.eps = float(beta1), float(beta2), float(eps)

    def init(self, params):
        return {
            "step": 0,
            "m": [torch.zeros_like(p) for p in params],
            "v": [torch.zeros_like(p) for p in params],
            "phi": 0.0,
        }

    # what feeds the moments --------------------------------------------------------------------------------------
    def first_moment_input(self, ctx: StepContext) -> list[torch.Tensor]:
        return ctx.noisy

    def second_moment_input(self, ctx: StepContext, first: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """What v is fed with; None means the square of the first-moment input (fused, as torch.optim.Adam)."""
        return None

    def denominator(self, v: torch.Tensor, bc2_sqrt: float, state: dict) -> torch.Tensor:
        return (v.sqrt() / bc2_sqrt).add_(self.eps)

    def update(self, params, state, ctx: StepContext):
        state["step"] += 1
        t = state["step"]
        b1, b2 = self.beta1, self.beta2
        # exact bias of v^_t under the mechanism (Phi_t; constant (sigma C/B)^2 for independent noise)
        bc2 = 1 - b2**t
        state["phi"] = ((b2 - b2**t) * state["phi"] + (1 - b2) * ctx.noise_variance) / bc2
        first = self.with_coupled_decay(params, self.first_moment_input(ctx))
        second = self.second_moment_input(ctx, first)
        self.apply_decoupled_decay(params)
        step_size = self.lr / (1 - b1**t)
        bc2_sqrt = bc2**0.5
        for i, (p, g, m, v) in enumerate(zip(params, first, state["m"], state["v"], strict=True)):
            m.lerp_(g, 1 - b1)
            if second is None:
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
            else:
                v.mul_(b2).add_(second[i], alpha=1 - b2)
            p.addcdiv_(m, self.denominator(v, bc2_sqrt, state), value=-step_size)


class DecoupledDecay:
    """Mixin for the AdamW variants: weight decay decoupled by definition, lambda = 0.01 by default
    (``torch.optim.AdamW``'s)."""

    def __init__(self, lr: float, weight_decay: float = 0.01, weight_decay_mode: str = "decoupled", **kw):
        if weight_decay_mode != "decoupled":
            raise ValueError(
                f"optimizer.weight_decay_mode={weight_decay_mode!r}: {self.name} decays decoupled by definition; "
                "for coupled (L2) decay use the variant without W (adam, adambc) with weight_decay"
            )
        super().__init__(lr, weight_decay=weight_decay, weight_decay_mode=weight_decay_mode, **kw)


class AdamW(DecoupledDecay, Adam):
    """DP-AdamW (Chooi et al. 2025, as defined in the module docstring): AdamW on the privatized gradient."""

    name = "adamw"


class SubtractBias(Adam):
    """v^ - Phi_t floored at ``floor`` inside the square root, no eps outside."""

    floor = 1e-8

    def __init__(self, lr: float, phi: float | None = None, phi_scale: float = 1.0, **kw):
        super().__init__(lr, **kw)
        if phi is not None and phi < 0:
            raise ValueError(f"optimizer.phi must be >= 0 or null (exact bias), got {phi}")
        if phi_scale < 0:
            raise ValueError(f"optimizer.phi_scale must be >= 0, got {phi_scale}")
        # Tang Fig. 3 ablation: subtract a fixed Phi' (phi), or phi_scale times the exact bias, instead of it
        self.phi_override, self.phi_scale = phi, float(phi_scale)

    def denominator(self, v, bc2_sqrt, state):
        phi = self.phi_scale * state["phi"] if self.phi_override is None else self.phi_override
        return (v / bc2_sqrt**2 - phi).clamp_(min=self.floor).sqrt_()


class AdamBC(SubtractBias):
    """Tang & Lecuyer's DP-AdamBC: m^ / sqrt(max(v^ - Phi, gamma'))."""

    name = "adambc"

    def __init__(self, lr: float, gamma: float = 1e-8, **kw):
        super().__init__(lr, **kw)
        if not gamma > 0:
            raise ValueError(f"optimizer.gamma must be > 0 (the floor gamma' under the root), got {gamma}")
        self.floor = float(gamma)


class AdamWBC(DecoupledDecay, AdamBC):
    """DP-AdamW-BC (Chooi et al. 2025, as defined in the module docstring): decoupled decay, then DP-AdamBC's
    step m^ / sqrt(max(v^ - Phi_t, gamma'))."""

    name = "adamw_bc"


class BiasCorrection(SubtractBias):
    """Ganesh et al.'s bias correction: m^ / sqrt(max(v^ - Phi_t, eps_s^2))."""

    name = "bc"

    def __init__(self, lr: float, eps_s: float = 1e-4, **kw):
        super().__init__(lr, **kw)
        if not eps_s > 0:
            raise ValueError(f"optimizer.eps_s must be > 0, got {eps_s}")
        self.floor = float(eps_s) ** 2


class AdamIME(Adam):
    """Independent moment estimation: g and g^2 released separately by the privatizer, each with sqrt(2) times the
    noise (Ganesh Alg. 6; Kalinin et al.). The variant only reads the two private releases."""

    name = "ime"
    coupled_decay = False
    needs_fixed_batch = True  # the sensitivity of g^2, (2B - 1) C^2 / B^2, assumes at most B examples
    split_factor = math.sqrt(2.0)

    def __init__(self, lr: float, eps_s: float = 1e-4, sq_sensitivity: str = "derived", **kw):
        super().__init__(lr, eps=eps_s, **kw)
        square_sensitivity(1.0, 1.0, sq_sensitivity)
        self.sq_form = sq_sensitivity

    def releases(self) -> Releases:
        return ime_releases(self.split_factor, self.sq_form)

    def second_moment_input(self, ctx, first):
        return ctx.noisy_square

    def denominator(self, v, bc2_sqrt, state):
        return (v.clamp(min=0).sqrt() / bc2_sqrt).add_(self.eps)


class AdamIMEFree(AdamIME):
    """IME without the sqrt(2) factors: accounted with noise multiplier sigma / sqrt(2) (see base.Variant)."""

    name = "ime_free"
    split_factor = 1.0
    sigma_factor = 1 / math.sqrt(2.0)


class ScaleThenPrivatize(Adam):
    """Scale-then-privatize (Ganesh Alg. 8; Li et al.): clip s_t * g_i with s_t = 1/(sqrt(v^_{t-1}) + eps_s1),
    noise, divide by s_t, then Adam with eps_s2. Needs per-example gradients scaled per coordinate, so it cannot
    use ghost clipping."""

    name = "stp"

    def __init__(self, lr: float, eps_s1: float = 1e-4, eps_s2: float = 1e-8, **kw):
        super().__init__(lr, eps=eps_s2, **kw)
        if not eps_s1 > 0:
            raise ValueError(f"optimizer.eps_s1 must be > 0, got {eps_s1}")
        self.eps_s1 = float(eps_s1)

    def scale(self, state):
        t = state["step"]
        if t == 0:
            return [torch.full_like(v, 1.0 / self.eps_s1) for v in state["v"]]
        bc2_sqrt = (1 - self.beta2**t) ** 0.5
        return [1.0 / ((v.sqrt() / bc2_sqrt) + self.eps_s1) for v in state["v"]]


class NoiselessPreconditioner(Adam):
    """Non-private baseline (Ganesh Fig. 3): first moment from g~, second moment from the clean clipped g."""

    name = "noiseless_precond"
    coupled_decay = False
    needs_clean = True
    private = False

    def second_moment_input(self, ctx, first):
        return [c * c for c in ctx.clean]


class SideInformation(Adam):
    """Preconditioner from side information (Ganesh Alg. 9): the first moment from the privatized gradient, the
    second moment from the gradient of a *public* batch (data held out of the private training set), so it costs
    no privacy. Alg. 9 divides by sqrt(v^) alone; eps keeps the step finite where the public gradient is zero."""

    name = "side_info"
    coupled_decay = False
    needs_side_info = True

    def second_moment_input(self, ctx, first):
        if ctx.side is None:
            raise RuntimeError("side_info needs a public-batch gradient from the trainer (ctx.side)")
        return [g * g for g in ctx.side]


class STPNoiselessPreconditioner(ScaleThenPrivatize):
    """Scale-then-privatize whose preconditioner uses the clean (un-noised, unscaled) clipped gradient."""

    name = "stp_noiseless_precond"
    coupled_decay = False
    needs_clean = True
    private = False

    def second_moment_input(self, ctx, first):
        return [c * c for c in ctx.clean]  # the privatizer unscales clean when a scale is used
