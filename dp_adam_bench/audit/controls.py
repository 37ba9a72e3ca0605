"""Deliberately broken privatizers: the controls an audit must catch (they exist only here, never in a run).

Each takes the place of the trainer's :class:`~dp_adam_bench.engine.privatizer.Privatizer` (same clip, sigma,
expected batch size, noise mechanisms and releases) and breaks one thing, while the run still claims the epsilon of
the plan:

* ``tenth_noise`` — noise std a tenth of k sigma C / B (a scale bug);
* ``no_noise`` — no noise at all (the bound's power: every canary is then exactly visible);
* ``reused_noise`` — the first noise draw replayed at every step (a noise stream reused across steps);
* ``cycle_ignored`` — cyclic Poisson sampling that forgets its cycle: every example may join every step (Poisson at
  the group rate q = b B / N over the whole dataset), while the run is still accounted as amplified BandMF with one
  Poisson-subsampled Gaussian per cycle (Choquette-Choo et al. 2023, arXiv 2306.08153, Thm. 4 needs an example to
  be sampled only at the steps of its group, t = g mod b): each example gets b times the participations claimed;
* ``clean_square`` — independent moment estimation whose release of g^2 is the clean g^2 (Ganesh, McMahan &
  Thakurta 2025, arXiv 2507.01129, Alg. 6 without the noise on its second release): the variant's update reads the
  clean second moment.

The registered non-private baselines (``noiseless_precond``, ``stp_noiseless_precond``: clean second moments by
design) are audited as controls too, with the epsilon their noise would claim.

The planted-bug catalogue (issue 25): nine realistic bugs, each a few lines of the kind that happens in real code,
applied here through the same mechanism (a privatizer, sampler, variant or clipping-engine replacement; nothing in
``engine/`` or ``optim/`` is changed):

* ``half_noise`` — noise std halved (every release);
* ``realized_batch`` — the clipped sum divided by the realized batch size instead of the expected one;
* ``bc_clean_v`` — Ganesh et al.'s bias correction (bc) feeding its second moment from the clean clipped gradient
  while the run is still marked private;
* ``double_rate`` — a Poisson sampler drawing at 2q while the ledger and the privatizer use q;
* ``bias_unclipped`` — bias gradients escaping clipping: the clipping engine's sum for bias parameters replaced by
  the sum of unclipped per-example bias gradients (a wrapper at the engine interface, ``clipped_sum``; model tasks);
* ``reused_mf_draw`` — a correlated-noise mechanism whose Gaussian draw z is made once and reused at every step
  (the C^{-1} recursion still runs on it);
* ``stp_prescale_norms`` — scale-then-privatize clipping factors from the norms of the unscaled gradients;
* ``ime_free_inverted`` — "IME for free" with its sigma factor inverted (sqrt 2 instead of 1 / sqrt 2): the
  accountant sees twice the noise multiplier the mechanism has;
* ``ime_sq_understated`` — IME's g^2 release with sensitivity C^2 / B^2 instead of (2B - 1) C^2 / B^2.

Issue 32's planted kinds:

* ``same_seed_streams`` — IME's two noise streams (g and g^2) drawn from the same seed: the meter's joint-noise
  check (``noise_covariance``) sees their correlation of 1.
* ``mf_one_participation`` — a single-pass run of 2 epochs whose DP-MF sensitivity is computed for one
  participation (the plan's ``sensitivity``, and the ledger's Gaussian mechanism with it): the participation ledger
  sees examples in 2 batches, a separation apart, that need more.
* ``ledger_round_short`` — the privacy ledger records one Poisson round fewer than the steps taken (the plan's
  ``rounds_after`` off by one); its true epsilon is about the claim (``leaks=False``), the participation ledger's
  rounds check sees it.

Issue 56's planted kinds, in a fine-tuning method's own code (``method_bug``: a broken method installed in place of
the registered one while the run is prepared, so it is applied by ``trainer.prepare`` before the engine is built, as
a user's method is; model tasks through :func:`~dp_adam_bench.audit.meter.finetune_runners.meter_finetune` and
:func:`~dp_adam_bench.audit.meter.finetune_runners.audit_finetune`):

* ``rgp_clean_carriers`` — RGP whose power iteration takes the latest clean clipped gradient (rebuilt by Eq. 3 from
  the un-noised carrier gradients) as its history, instead of the weights updated from the noisy release: the next
  carriers, model parameters saved with the run, are the top singular vectors of the clean gradient. The update of
  W itself is the honest noisy one.
* ``lora_input_stats`` — LoRA adapters that keep, beside A and B, a running mean of |x| of their inputs over the
  training batches (an activation-aware scale, saved with the adapter as a buffer): a statistic of the private
  batches in the model's state. Training itself is the honest LoRA.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from dp_adam_bench.engine.grads import batch_len, clip_factors
from dp_adam_bench.engine.plan import PrivacyPlan
from dp_adam_bench.engine.privatizer import Privatizer, Release, per_example_norms
from dp_adam_bench.engine.sampling import CyclicPoissonSampler, PoissonSampler
from dp_adam_bench.finetune.common import Finetuned
from dp_adam_bench.optim.adam import AdamIMEFree, BiasCorrection
from dp_adam_bench.registry import Registry


def rebuilt(cls: type[Privatizer], p: Privatizer) -> Privatizer:
    """A ``cls`` privatizer with everything ``p`` was built with (its noise check too: a broken privatizer is
    watched like the one it replaces)."""
    q = cls(
        clip=p.clip,
        sigma=p.sigma,
        expected_batch_size=p.B,
        mechanisms=p.mechanisms,
        releases=p.releases,
        trial_dims=p.trial_dims,
        keep_clean=p.keep_clean,
    )
    q.noise_check = p.noise_check
    if q.noise_check is not None:  # recorded, not raised: the audit runs the control to its end, and the
        q.noise_check.stop = False  # participation ledger's noise check names it among what caught it
    return q


class ScaledNoisePrivatizer(Privatizer):
    """Adds ``factor`` times the noise it claims."""

    factor = 0.1

    @property
    def noise_std(self) -> float:
        return super().noise_std * self.factor


class NoNoisePrivatizer(ScaledNoisePrivatizer):
    factor = 0.0


class _Replay:
    """A noise mechanism that returns its first draw at every step."""

    def __init__(self, mechanism):
        self.inner = mechanism
        self.first = None

    def next(self):
        if self.first is None:
            self.first = self.inner.next()
        return self.first

    def variance(self, t: int) -> float:
        return self.inner.variance(t)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class ReusedNoisePrivatizer(Privatizer):
    def __init__(self, **kw):
        kw["mechanisms"] = [_Replay(m) for m in kw["mechanisms"]]
        super().__init__(**kw)


class CleanSquarePrivatizer(Privatizer):
    """Releases g^2 without its noise (the gradient release keeps its noise)."""

    def release_mean(self, mean, scale=None, **kw) -> Release:
        out = super().release_mean(mean, scale, **kw)  # keeps mean clean: g^2 is released
        if out.ctx.noisy_square is None:
            raise ValueError("the clean_square control needs a variant that releases g^2 (ime, adagrad_ime)")
        out.ctx.noisy_square = [m * m for m in mean]
        return out


class HalfNoisePrivatizer(ScaledNoisePrivatizer):
    factor = 0.5


class RealizedBatchPrivatizer(Privatizer):
    """Divides the clipped sum by the realized batch size (the rows it was given) instead of the expected B; the
    noise keeps its std k sigma C / B."""

    def clipped_mean(self, per_example, scale=None):
        out, norms = super().clipped_mean(per_example, scale)
        b = per_example[0].shape[0]
        return ([o * (self.B / b) for o in out] if b else out), norms


class PreScaleNormsPrivatizer(Privatizer):
    """Scale-then-privatize whose clip factors come from the norms of the *unscaled* gradients ||g_i||, while the
    scaled s g_i is what is summed: a scaled contribution has norm C ||s g_i|| / ||g_i||, not C."""

    def clipped_mean(self, per_example, scale=None):
        if scale is None:
            return super().clipped_mean(per_example, scale)
        lead = 1 + self.trial_dims
        norms = per_example_norms(per_example, lead)  # the bug: before scaling
        factor = clip_factors(norms, self.clip)
        out = []
        for g, s in zip(per_example, scale, strict=True):
            f = factor.reshape(*factor.shape, *([1] * (g.dim() - lead)))
            out.append((g * s * f).sum(0) / self.B)
        return out, norms


class ReusedDrawPrivatizer(Privatizer):
    """Each noise mechanism draws its standard normal z once and reuses it at every step; a correlated mechanism
    still runs its C^{-1} recursion on the repeated draw."""

    def __init__(self, **kw):
        super().__init__(**kw)
        for m in self.mechanisms:
            first = m._draw_z()
            m._draw_z = lambda first=first: [z.clone() for z in first]


class UnderstatedSquarePrivatizer(Privatizer):
    """IME's g^2 release noised for a sensitivity of C^2 / B^2 (the (2B - 1) cross term forgotten)."""

    def __init__(self, **kw):
        rel = kw["releases"]
        if rel.square_sensitivity is None:
            raise ValueError(
                "the ime_sq_understated control needs a variant that releases g^2 (ime, adagrad_ime)"
            )
        kw["releases"] = dataclasses.replace(rel, square_sensitivity=lambda clip, b: clip**2 / b**2)
        super().__init__(**kw)


class SameSeedStreamsPrivatizer(Privatizer):
    """Every noise stream started from the first stream's seed (issue 32: IME's g and g^2 noise built with one
    seed): each release alone has the noise it states, but g~ and the g^2 release carry the same draw, so one
    combination of the two has no noise at all."""

    def __init__(self, **kw):
        super().__init__(**kw)
        if len(self.mechanisms) < 2:
            raise ValueError(
                "the same_seed_streams control needs a variant with two noise streams (ime, adagrad_ime)"
            )
        first = self.mechanisms[0]._gen.get_state()
        for m in self.mechanisms[1:]:
            m._gen.set_state(first)


def one_participation_sensitivity(plan):
    """The plan of a single-pass run with its sensitivity (and its ledger's Gaussian mechanism) computed for one
    participation whatever the epochs: what the run claims when ``participations = 1`` is passed by mistake."""
    if plan.accounting != "gaussian" or plan.sampler.kind != "single_pass":
        raise ValueError(
            f"the mf_one_participation control breaks a single-pass run's sensitivity, got {plan.accounting!r} "
            f"accounting with sampler {plan.sampler.kind!r}"
        )
    return dataclasses.replace(plan, sensitivity=plan.strategy.sensitivity(participations=1))


class _RoundShortPlan(PrivacyPlan):
    def rounds_after(self, step: int) -> int:
        return max(0, super().rounds_after(step) - 1)


def one_round_short(plan):
    """The plan whose ledger gets one Poisson round fewer than the steps taken."""
    if plan.accounting not in ("poisson", "amplified_mf"):
        raise ValueError(
            f"the ledger_round_short control needs Poisson rounds, got {plan.accounting!r} accounting"
        )
    return _RoundShortPlan(**{f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)})


class CleanSecondMomentBC(BiasCorrection):
    """bc whose second moment is fed the clean clipped gradient (asks the privatizer for it) while it still says
    it is private: the ledger accounts it as a private run."""

    needs_clean = True

    def second_moment_input(self, ctx, first):
        return [c * c for c in ctx.clean]


class InvertedFactorIMEFree(AdamIMEFree):
    """IME for free with its sigma factor inverted: accounted at sigma sqrt 2 instead of sigma / sqrt 2."""

    sigma_factor = math.sqrt(2.0)


class DoubleRateSampler(PoissonSampler):
    """A Poisson sampler that draws each example with probability 2q while it reports q (and the expected batch
    size q N) to the ledger and the privatizer."""

    def __init__(self, honest: PoissonSampler):
        if not isinstance(honest, PoissonSampler) or honest.kind != "poisson":
            raise ValueError(
                f"the double_rate control breaks a Poisson sampler, got {getattr(honest, 'kind', honest)!r}"
            )
        self.__dict__.update(honest.__dict__)

    def iter_from(self, step: int) -> Iterator[torch.Tensor]:
        for _ in range(step, self._steps):
            mask = torch.rand(self.n, generator=self.generator) < min(1.0, 2 * self.q)
            yield mask.nonzero().squeeze(1)


class UnclippedBiasEngine:
    """A clipping engine whose sum for bias parameters (trainable parameters named ``*bias``) is the sum of the
    *unclipped* per-example bias gradients; everything else is the wrapped engine's. Planted at the engine
    interface (``clipped_sum``), so any engine can carry it."""

    def __init__(self, inner, model):
        self.inner = inner
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.bias = [i for i, n in enumerate(names) if n.endswith("bias")]
        if not self.bias:
            raise ValueError("the bias_unclipped control needs a model with bias parameters")

    def clipped_sum(self, batch, clip, scale=None):
        cs = self.inner.clipped_sum(batch, clip, scale)
        n = batch_len(batch)
        if n:
            full = self.inner.mean_grad(batch)
            for i in self.bias:
                cs.summed[i] = full[i] * n
        return cs

    def __getattr__(self, name):
        return getattr(self.inner, name)


def halved_column_norm(plan):
    """Issue 44's planted slip: the strategy's column norm halved in the plan (a stand-in for any slip in
    ``account_sigma`` or the column norms), so the privacy ledger records twice the noise multiplier the privatizer
    applies and the run reports a fraction of its epsilon (0.586 for 1.460 in the review)."""
    if plan.accounting not in ("poisson", "amplified_mf"):
        raise ValueError(
            f"the ledger_sigma_doubled control needs Poisson rounds, got {plan.accounting!r} accounting"
        )
    return dataclasses.replace(plan, column_norm=plan.column_norm / 2)


class NormWithoutBiasEngine:
    """bk whose per-example norms leave out the bias gradients, their sums kept (issue 44: the self-check compared
    totals, and a bias ~1/1000 of its weight moved the total by less than its tolerance). Planted in bk's dense
    rule for the duration of each ``clipped_sum``, so the clip factors use the short norms."""

    def __init__(self, inner, model):
        if getattr(inner, "name", "") != "bk":
            raise ValueError(
                "the bias_norm_dropped control plants its bug in bk's dense rule: use clipping bk"
            )
        self.inner = inner

    def clipped_sum(self, batch, clip, scale=None):
        import importlib

        linear = importlib.import_module("dp_adam_bench.engine.bk_rules.linear")
        real = linear.dense

        def dense(engine, name, ops, *, weight, bias, sw=None, sb=None):
            sq, finish = real(engine, name, ops, weight=weight, bias=bias, sw=sw, sb=sb)
            if bias:
                gb = ops.G.sum(1, dtype=engine.dtype).reshape(sq.shape[0], -1)
                sq = sq - (gb if sb is None else gb * sb).square().sum(1)
            return sq, finish

        linear.dense = dense
        try:
            return self.inner.clipped_sum(batch, clip, scale)
        finally:
            linear.dense = real

    def __getattr__(self, name):
        return getattr(self.inner, name)


class WrongWhenTrainedEngine:
    """An engine right on the weights it starts from and wrong once they have moved: its per-example norms 0.9 of
    the true ones after the first update (issue 44's zero-gate adapter: a use of a parameter outside its module
    behind a gate at 0 is invisible at step 0, and bk's norms were 0.974-0.9998 of the true ones once trained)."""

    def __init__(self, inner, model):
        self.inner = inner
        self.start = [p.detach().clone() for p in inner.params]

    def clipped_sum(self, batch, clip, scale=None):
        if all(torch.equal(p, s) for p, s in zip(self.inner.params, self.start, strict=True)):
            return self.inner.clipped_sum(batch, clip, scale)
        n = batch_len(batch)
        if not n:
            return self.inner.clipped_sum(batch, clip, scale)
        per_ex = self.inner.clipped_sum  # the honest norms, then the sum clipped at the short ones
        honest = per_ex(batch, None, scale)
        short = honest.norms * 0.9
        # one example at a time: the honest engine's gradient of each, clipped at its short norm
        summed = [torch.zeros_like(p) for p in self.inner.params]
        for i in range(n):
            one = {k: v[i : i + 1] for k, v in batch.items()}
            g = per_ex(one, None, scale).summed
            f = clip_factors(short[i : i + 1], clip)[0] if clip else 1.0
            for acc, gi in zip(summed, g, strict=True):
                acc.add_(gi * f)
        honest.summed, honest.norms = summed, short
        return honest

    def __getattr__(self, name):
        return getattr(self.inner, name)


def restart_noise_stream(payload: dict, run) -> dict:
    """Issue 44's planted resume bug, applied to the checkpoint a resumed run loads: the noise generator's state is
    the fresh stream's (as when the restore code forgets to set it), so the resumed run redraws the noise of steps
    1, 2, ... and the difference of two releases is noise-free."""
    from dp_adam_bench.privacy.noise_factory import build_mechanisms

    params = run.backend.params
    fresh = build_mechanisms(
        run.plan.strategy,
        [p.shape for p in params],
        run.variant.releases().streams,
        run.seeds.noise,
        params[0].dtype,
        params[0].device,
    )
    for saved, m in zip(payload["privatizer"]["mechanisms"], fresh, strict=True):
        saved["generator"] = m._gen.get_state()
    return payload


class CycleIgnoredSampler(CyclicPoissonSampler):
    """A cyclic Poisson sampler that ignores the cycle: at every step every example joins with probability q (the
    group rate b B / N), instead of only the members of group t mod b. Its ``cycle_length`` is the honest
    sampler's, and the plan counts rounds from the step, so the run is still accounted one amplified round per
    cycle."""

    def __init__(self, honest: CyclicPoissonSampler):
        if not isinstance(honest, CyclicPoissonSampler):
            raise ValueError(
                f"the {type(self).__name__} control breaks a cyclic Poisson sampler, got "
                f"{getattr(honest, 'kind', honest)!r}"
            )
        self.__dict__.update(honest.__dict__)
        self.generator = torch.Generator().manual_seed(honest.seed * 1_000_003 + 1)

    def iter_from(self, step: int) -> Iterator[torch.Tensor]:
        for t in range(step, self.steps):
            mask = torch.rand(self.n, generator=self.generator) < self.q
            self.position = t + 1
            yield mask.nonzero().squeeze(1)


# --- issue 56: slips in a fine-tuning method's own code ------------------------------------------------------------
def _clean_carrier_rgp():
    """The RGP variant of ``rgp_clean_carriers`` (a class built on first use: finetune/rgp.py imports the optimizer
    registry)."""
    from dp_adam_bench.finetune.rgp import RGPVariant, decompose, power_start, reconstruct

    class CleanCarrierRGP(RGPVariant):
        """RGP whose next carriers are the power iteration on the latest *clean* clipped gradient of each weight
        (Eq. 3 on the un-noised carrier gradients, which it asks the privatizer for), while it still says it is
        private; the weights W are updated from the noisy release as in honest RGP."""

        needs_clean = True

        def releases(self):
            return dataclasses.replace(self.inner.releases(), clean=True)

        def update(self, params, state, ctx):
            layout = self._check(params)
            carriers = [
                (lay.carrier_L.weight.clone(), lay.carrier_R.weight.clone()) for _, lay in self.layers
            ]
            super().update(params, state, ctx)
            with torch.no_grad():
                for k, ((_, layer), i, j) in enumerate(
                    zip(self.layers, layout.left, layout.right, strict=True)
                ):
                    left, right = carriers[k]
                    history = reconstruct(
                        ctx.clean[i], ctx.clean[j], left, right
                    )  # the bug: clean, not noisy
                    w = state["weight"][k]
                    start = power_start(
                        w.shape[1], layer.rank, self.seed, int(ctx.step) + 1, k, dtype=w.dtype
                    )
                    layer.set_carriers(
                        w, *decompose(history, layer.rank, layer.power_iters, start.to(w.device))
                    )

    return CleanCarrierRGP


def rgp_clean_carriers(model, args: dict) -> Finetuned:
    """``task.finetune=rgp`` with :func:`_clean_carrier_rgp`'s variant in place of :class:`RGPVariant`."""
    from dp_adam_bench.finetune.rgp import reparametrize

    summary = reparametrize(model, args)
    variant = _clean_carrier_rgp()
    return Finetuned(model, summary, wrap_variant=lambda inner, m, seed: variant(inner, m, seed))


#: the running mean's weight of the newest batch (lora_input_stats)
INPUT_STATS_MOMENTUM = 0.1


def lora_input_stats(model, args: dict) -> Finetuned:
    """``task.finetune=lora``, each adapted layer also keeping ``lora_input_scale``: a buffer of the running mean of
    |x| per input feature over the batches it sees in training (updated by a forward pre-hook)."""
    from dp_adam_bench.finetune.adapters import lora

    out = lora(model, args)
    layers = [m for _, m in out.model.named_modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")]

    def track(module, inputs):
        if module.training:
            with torch.no_grad():
                x = inputs[0].detach()
                stat = x.abs().reshape(-1, x.shape[-1]).mean(0).to(module.lora_input_scale.dtype)
                module.lora_input_scale.mul_(1 - INPUT_STATS_MOMENTUM).add_(INPUT_STATS_MOMENTUM * stat)

    for layer in layers:
        w = layer.base_layer.weight
        layer.register_buffer("lora_input_scale", torch.zeros(w.shape[1], dtype=w.dtype, device=w.device))
        layer.register_forward_pre_hook(track)
    return Finetuned(out.model, out.summary, out.wrap_variant)


@dataclass(frozen=True)
class Control:
    """A control row: the registered variant, mechanism and sampler it runs, and what is broken: the privatizer
    (None for a registered non-private baseline), the sampler (``sampler_bug``: the plan's sampler -> its
    replacement), the variant (``variant_bug``: a class built with the config's optimizer fields in place of the
    registered one, and the plan rebuilt for it, so its sigma factor reaches the ledger) or the clipping engine
    (``engine_bug``: (engine, model) -> a wrapper; model tasks only) or the privacy plan (``plan_bug``: the
    prepared run's plan -> the broken plan the run is accounted with) or the checkpoint a resumed run loads
    (``resume_at`` / ``checkpoint_bug``) or a fine-tuning method (``method_bug``: (model, args) -> Finetuned, in
    place of the registered method ``finetune`` while the run is prepared; model tasks only). ``planted``: one of
    issue 25's (or 32's, 44's, 56's) planted kinds; ``leaks``: False for a bug whose true epsilon is about the
    claim."""

    variant: str
    noise: str
    sampler: str
    privatizer: type[Privatizer] | None
    what: str
    sampler_bug: type | None = None
    variant_bug: type | None = None
    engine_bug: type | None = None
    plan_bug: Callable | None = None
    planted: bool = False
    leaks: bool = True
    #: resume the run from a checkpoint after this many steps (a resumed run: issue 44); with ``checkpoint_bug``
    #: (payload, run) -> payload applied to the checkpoint it resumes from
    resume_at: int | None = None
    checkpoint_bug: Callable | None = None
    #: the fine-tuning method the control runs (``task.finetune``), and its broken version
    finetune: str | None = None
    method_bug: Callable | None = None

    def wrap(self, p: Privatizer) -> Privatizer:
        return p if self.privatizer is None else rebuilt(self.privatizer, p)

    def wrap_sampler(self, sampler):
        return sampler if self.sampler_bug is None else self.sampler_bug(sampler)

    def wrap_engine(self, engine, model):
        return engine if self.engine_bug is None else self.engine_bug(engine, model)

    def apply_to_run(self, run, cfg):
        """The prepared ``run`` with the broken variant and a plan built for it, or with the broken plan
        (unchanged without either)."""
        if self.plan_bug is not None:
            return dataclasses.replace(run, plan=self.plan_bug(run.plan))
        if self.variant_bug is None:
            return run
        from dp_adam_bench.engine.plan import build_plan

        variant = self.variant_bug(**{k: v for k, v in cfg.optimizer.items() if k != "name"})
        plan = build_plan(
            cfg,
            len(run.population),
            variant,
            numel=run.backend.numel_per_trial,
            sampler_seed=run.seeds.sampler,
        )
        return dataclasses.replace(run, variant=variant, plan=plan)

    def installed(self):
        """A context in which ``task.finetune=<finetune>`` applies the broken method (a no-op without one)."""
        if self.method_bug is None:
            return contextlib.nullcontext()
        from dp_adam_bench.finetune import METHODS, parse

        return METHODS.replaced(parse(self.finetune)[0], self.method_bug)  # top<k>: registered as "top"

    @property
    def model_only(self) -> bool:
        """Only a model task (a clipping engine, a fine-tuning method) can carry this bug."""
        return self.engine_bug is not None or self.method_bug is not None


CONTROLS = Registry("audit control", "audit.control")
for _name, _control in (
    (
        "noiseless_precond",
        Control("noiseless_precond", "independent", "poisson", None, "non-private baseline: clean g^2 in v"),
    ),
    (
        "noiseless_precond_mf",
        Control(
            "noiseless_precond", "dpmf_sqrt", "single_pass", None, "non-private baseline: clean g^2 in v"
        ),
    ),
    (
        "stp_noiseless_precond",
        Control(
            "stp_noiseless_precond",
            "independent",
            "poisson",
            None,
            "non-private baseline: clean g^2 in v (stp)",
        ),
    ),
    ("tenth_noise", Control("adam", "independent", "poisson", ScaledNoisePrivatizer, "noise std / 10")),
    ("tenth_noise_mf", Control("sgd", "dpmf_sqrt", "single_pass", ScaledNoisePrivatizer, "noise std / 10")),
    ("no_noise", Control("adam", "independent", "poisson", NoNoisePrivatizer, "no noise at all")),
    (
        "reused_noise",
        Control(
            "adam", "independent", "poisson", ReusedNoisePrivatizer, "first noise draw reused every step"
        ),
    ),
    (
        "cycle_ignored",
        Control(
            "sgd",
            "bandmf",
            "cyclic_poisson",
            None,
            "cyclic Poisson sampling every example at every step, accounted as amplified BandMF",
            CycleIgnoredSampler,
        ),
    ),
    (
        "clean_square",
        Control(
            "ime", "independent", "single_pass", CleanSquarePrivatizer, "IME's g^2 released without noise"
        ),
    ),
):
    CONTROLS.register(_name, _control)
for _name, _control in (
    ("half_noise", Control("adam", "independent", "poisson", HalfNoisePrivatizer, "noise std halved")),
    (
        "realized_batch",
        Control(
            "adam",
            "independent",
            "poisson",
            RealizedBatchPrivatizer,
            "clipped sum divided by the realized batch size",
            leaks=False,
        ),
    ),
    (
        "bc_clean_v",
        Control(
            "bc",
            "independent",
            "poisson",
            None,
            "bc's second moment from the clean clipped gradient",
            variant_bug=CleanSecondMomentBC,
        ),
    ),
    (
        "double_rate",
        Control(
            "adam",
            "independent",
            "poisson",
            None,
            "Poisson sampler at 2q while the accountant uses q",
            sampler_bug=DoubleRateSampler,
        ),
    ),
    (
        "bias_unclipped",
        Control(
            "adam",
            "independent",
            "poisson",
            None,
            "bias gradients escaping clipping (wrapped bk engine)",
            engine_bug=UnclippedBiasEngine,
        ),
    ),
    (
        "reused_mf_draw",
        Control(
            "adam",
            "dpmf_sqrt",
            "single_pass",
            ReusedDrawPrivatizer,
            "correlated-noise draw reused at every step",
        ),
    ),
    (
        "stp_prescale_norms",
        Control(
            "stp",
            "independent",
            "poisson",
            PreScaleNormsPrivatizer,
            "scale-then-privatize norms taken before scaling",
        ),
    ),
    (
        "ime_free_inverted",
        Control(
            "ime_free",
            "independent",
            "single_pass",
            None,
            "IME-for-free's sigma factor inverted",
            variant_bug=InvertedFactorIMEFree,
        ),
    ),
    (
        "ime_sq_understated",
        Control(
            "ime",
            "independent",
            "single_pass",
            UnderstatedSquarePrivatizer,
            "IME's g^2 sensitivity understated (2B - 1 -> 1)",
        ),
    ),
    (
        "same_seed_streams",
        Control(
            "ime",
            "independent",
            "single_pass",
            SameSeedStreamsPrivatizer,
            "IME's g and g^2 noise streams from the same seed",
        ),
    ),
    (
        "mf_one_participation",
        Control(
            "sgd",
            "dpmf_sqrt",
            "single_pass",
            None,
            "2-epoch single pass whose MF sensitivity is computed for 1 participation",
            plan_bug=one_participation_sensitivity,
        ),
    ),
    (
        "ledger_round_short",
        Control(
            "adam",
            "independent",
            "poisson",
            None,
            "privacy ledger one Poisson round short of the steps taken",
            plan_bug=one_round_short,
            leaks=False,
        ),
    ),
    (
        "ledger_sigma_doubled",
        Control(
            "adam",
            "independent",
            "poisson",
            None,
            "column norm halved: the ledger records twice the noise multiplier applied",
            plan_bug=halved_column_norm,
        ),
    ),
    (
        "ledger_sigma_doubled_mf",
        Control(
            "sgd",
            "bandmf",
            "cyclic_poisson",
            None,
            "BandMF column norm halved: each amplified round recorded at twice its multiplier",
            plan_bug=halved_column_norm,
        ),
    ),
    (
        "bias_norm_dropped",
        Control(
            "adam",
            "independent",
            "poisson",
            None,
            "bias gradients left out of bk's per-example norms (their sums kept)",
            engine_bug=NormWithoutBiasEngine,
        ),
    ),
    (
        "wrong_when_trained",
        Control(
            "adam",
            "independent",
            "poisson",
            None,
            "engine right at the initial weights, norms 0.9 of the true ones once trained",
            engine_bug=WrongWhenTrainedEngine,
        ),
    ),
    (
        "rgp_clean_carriers",
        Control(
            "adam",
            "independent",
            "poisson",
            None,
            "RGP's carriers from the power iteration on the clean clipped gradient, not the noisy release",
            finetune="rgp",
            method_bug=rgp_clean_carriers,
        ),
    ),
    (
        "lora_input_stats",
        Control(
            "adam",
            "independent",
            "poisson",
            None,
            "LoRA adapters keeping a running mean of their private inputs (a buffer saved with the adapter)",
            finetune="lora",
            method_bug=lora_input_stats,
        ),
    ),
    (
        "resume_redraws_noise",
        Control(
            "adam",
            "independent",
            "poisson",
            None,
            "resumed run whose noise generator is not restored: it redraws the noise of steps 1, 2, ...",
            resume_at=50,
            checkpoint_bug=restart_noise_stream,
        ),
    ),
):
    CONTROLS.register(_name, dataclasses.replace(_control, planted=True))
