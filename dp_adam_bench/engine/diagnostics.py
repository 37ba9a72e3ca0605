"""Second-moment diagnostics of Tang & Lecuyer (Table 1, Fig. 2) and Ganesh et al. (Figs. 4-6).

Everything here is computed from the **clean** (un-noised) clipped gradient or compares private state against
it, so it is *diagnostic*: logged under the ``diag/`` prefix, never a private output. A run with diagnostics on is
still private in what it trains and releases as the model, but its logs are not.

Logged every ``diagnostics.every`` steps:

* ``diag/grad_norm_over_clip`` — ||g_t|| / C for the averaged clipped clean gradient (Ganesh Fig. 5);
* for Adam-family variants (state with ``m``, ``v``): summary statistics (min, q1, median, q3, max, mean) of v^c
  (bias-corrected EMA of the clean g_t^2, same beta2 — Tang's v_t^c), v^p (the optimizer's private v^), and
  v^p - Phi_t; the fraction of coordinates of v^p - Phi_t that are negative (Ganesh Fig. 4) and of v^p itself
  (``diag/frac_v_negative``: IME's v, an EMA of separately noised g^2, goes negative; Ganesh §4.4);
* ``diag/norm_over_clip_{median,q90,max}`` — quantiles of the last step's per-example norms over C (for
  scale-then-privatize the norms of the *scaled* per-example gradients s_t * g_i, which its clip acts on; the
  fraction above C is ``diag/frac_clipped``, logged by the trainer);
* scale-then-privatize (Ganesh Alg. 8): ``diag/stp_scale_{min,median,max}`` of s_t = 1 / (sqrt(v^_{t-1}) +
  eps_s1) and ``diag/stp_frac_sqrtv_above_eps_s1``, the fraction of coordinates where sqrt(v^) exceeds eps_s1,
  i.e. where the scale differs from the constant 1 / eps_s1 by more than a factor 2 (near 0: the scale is
  uniform and STP clips like post-processing DP-Adam with its clip divided by eps_s1);
* ``diag/frac_v_below_bias`` — the fraction of coordinates of v^ below the reference bias C^2 sigma_ref^2 / B^2
  (Ganesh Fig. 6, meant for non-private runs; sigma_ref = ``diagnostics.reference_sigma``, C =
  ``diagnostics.reference_clip``, default ``privacy.clip``, which a non-private run records but does not apply);
* histograms (Tang Fig. 2): a seeded sample of coordinates of m^c, m^p, v^c, v^p, v^p - Phi and the three update
  ratios m^c/sqrt(v^c), m^c/sqrt(v^p), m^c/sqrt(v^p - Phi) saved to ``diagnostics/step_<t>.npz`` in the run folder.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

STATS = ("min", "q1", "median", "q3", "max", "mean")
MAX_QUANTILE_SAMPLE = 1_000_000


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).double() for t in tensors])


def summary_stats(x: torch.Tensor, gen: torch.Generator) -> dict[str, float]:
    sample = (
        x
        if x.numel() <= MAX_QUANTILE_SAMPLE
        else x[torch.randint(x.numel(), (MAX_QUANTILE_SAMPLE,), generator=gen)]
    )
    q = torch.quantile(sample, torch.tensor([0.25, 0.5, 0.75], dtype=sample.dtype, device=sample.device))
    return {
        "min": float(x.min()),
        "q1": float(q[0]),
        "median": float(q[1]),
        "q3": float(q[2]),
        "max": float(x.max()),
        "mean": float(x.mean()),
    }


def _norm_quantiles(norms: torch.Tensor | None, clip: float | None) -> dict[str, float]:
    if norms is None or not norms.numel() or not clip:
        return {}
    r = norms.detach().double() / clip
    q = torch.quantile(r, torch.tensor([0.5, 0.9], dtype=torch.float64, device=r.device))
    return {
        "diag/norm_over_clip_median": float(q[0]),
        "diag/norm_over_clip_q90": float(q[1]),
        "diag/norm_over_clip_max": float(norms.max()) / clip,
    }


def _scale_stats(s: torch.Tensor, eps_s1: float | None, gen: torch.Generator) -> dict[str, float]:
    stats = summary_stats(s, gen)
    out = {f"diag/stp_scale_{k}": stats[k] for k in ("min", "median", "max")}
    if eps_s1:  # sqrt(v^) > eps_s1  <=>  s < 1 / (2 eps_s1)
        out["diag/stp_frac_sqrtv_above_eps_s1"] = float((s < 0.5 / eps_s1).double().mean())
    return out


class Diagnostics:
    def __init__(
        self,
        *,
        every: int,
        beta1: float = 0.9,
        beta2: float = 0.999,
        reference_sigma: float | None = None,
        reference_clip: float | None = None,
        hist_dir: Path | None = None,
        hist_size: int = 100_000,
        seed: int = 0,
    ):
        if every < 0:
            raise ValueError(f"diagnostics.every must be >= 0 (0 = off), got {every}")
        self.every, self.beta1, self.beta2 = int(every), float(beta1), float(beta2)
        self.reference_sigma = reference_sigma
        self.reference_clip = reference_clip
        self.hist_dir = Path(hist_dir) if hist_dir is not None else None
        self.hist_size = hist_size
        self.seed = seed
        self.state: dict = {"t": 0, "m": None, "v": None, "norm_sum": 0.0}

    @property
    def enabled(self) -> bool:
        return self.every > 0

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        self.state = state

    def observe(
        self,
        ctx,
        variant_state: dict,
        *,
        norms: torch.Tensor | None = None,
        scale: list[torch.Tensor] | None = None,
        scale_eps: float | None = None,
    ) -> dict[str, float] | None:
        """Update the clean shadow moments; at logging steps return the ``diag/`` metrics. ``norms``: the step's
        per-example norms (as clipped); ``scale`` / ``scale_eps``: scale-then-privatize's s_t and its eps_s1."""
        if not self.enabled or ctx.clean is None:
            return None
        st = self.state
        st["t"] += 1
        t, b1, b2 = st["t"], self.beta1, self.beta2
        if st["m"] is None:
            st["m"] = [torch.zeros_like(c) for c in ctx.clean]
            st["v"] = [torch.zeros_like(c) for c in ctx.clean]
        for c, m, v in zip(ctx.clean, st["m"], st["v"], strict=True):
            m.lerp_(c, 1 - b1)
            v.mul_(b2).addcmul_(c, c, value=1 - b2)
        gnorm = float(_flat(ctx.clean).norm()) / ctx.clip if ctx.clip else float("nan")
        st["norm_sum"] += gnorm
        if t % self.every:
            return None
        gen = torch.Generator().manual_seed(self.seed + t)
        out = {"diag/grad_norm_over_clip": gnorm, "diag/grad_norm_over_clip_avg": st["norm_sum"] / t}
        out |= _norm_quantiles(norms, ctx.clip)
        if scale is not None:
            out |= _scale_stats(_flat(scale), scale_eps, gen)
        m_c = _flat(st["m"]) / (1 - b1**t)
        v_c = _flat(st["v"]) / (1 - b2**t)
        arrays = {"m_clean": m_c, "v_clean": v_c}
        out |= {f"diag/v_clean_{k}": val for k, val in summary_stats(v_c, gen).items()}
        if "v" in variant_state and "m" in variant_state and isinstance(variant_state["v"], list):
            vt = variant_state["step"]
            v_p = _flat(variant_state["v"]) / (1 - b2**vt)
            m_p = _flat(variant_state["m"]) / (1 - b1**vt)
            phi = float(variant_state.get("phi", 0.0))
            corrected = v_p - phi
            out |= {f"diag/v_private_{k}": val for k, val in summary_stats(v_p, gen).items()}
            out |= {f"diag/v_private_minus_phi_{k}": val for k, val in summary_stats(corrected, gen).items()}
            out["diag/phi"] = phi
            out["diag/frac_negative_after_bc"] = float((corrected < 0).double().mean())
            out["diag/frac_v_negative"] = float((v_p < 0).double().mean())
            arrays |= {
                "m_private": m_p,
                "v_private": v_p,
                "v_private_minus_phi": corrected,
                "update_clean": m_c / v_c.sqrt(),
                "update_private_v": m_c / v_p.sqrt(),
                "update_corrected_v": m_c / corrected.clamp(min=1e-30).sqrt(),
            }
            clip = ctx.clip or self.reference_clip  # a non-private run does not clip: use the reference C
            if self.reference_sigma is not None and clip:
                bias = (clip * self.reference_sigma / ctx.expected_batch_size) ** 2
                out["diag/reference_bias"] = bias
                out["diag/frac_v_below_bias"] = float((v_p < bias).double().mean())
        if self.hist_dir is not None:
            self.hist_dir.mkdir(parents=True, exist_ok=True)
            n = arrays["m_clean"].numel()
            idx = torch.randperm(n, generator=gen)[: self.hist_size]
            np.savez_compressed(
                self.hist_dir / f"step_{t}.npz",
                **{k: a[idx.to(a.device)].float().cpu().numpy() for k, a in arrays.items()},
            )
        return out
