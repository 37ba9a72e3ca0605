"""The training loop for vectorised toy tasks with closed-form per-example gradients (e.g. ``logistic_1d``).

sampler -> batch -> per-example gradients -> clip / sum / noise / divide by expected B (Privatizer)
        -> optimizer variant -> privacy ledger (DESIGN.md, "the one pipeline").
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from dp_adam_bench.config import resolve_sigma
from dp_adam_bench.engine.privatizer import Privatizer
from dp_adam_bench.engine.sampling import PoissonSampler, SinglePassSampler
from dp_adam_bench.optim.registry import build_variant
from dp_adam_bench.privacy.noise_factory import build_mechanisms, build_strategy
from dp_adam_bench.tasks.registry import build_task


def build_sampler(cfg, dataset_size: int, seed: int):
    t = cfg.train
    if t.sampler == "single_pass":
        return SinglePassSampler(dataset_size, int(t.batch_size), epochs=int(t.epochs), seed=seed)
    return PoissonSampler(dataset_size, float(t.batch_size), steps=int(t.steps), seed=seed)


def run(cfg, folder, log: Callable[[int, dict], None], task=None) -> dict:
    """Train once; call ``log(step, metrics)`` every ``train.log_every`` steps; return the final summary.

    These runs take seconds, so they have no checkpoints: an interrupted one starts again from scratch.
    """
    from dp_adam_bench.privacy.accounting import PrivacyLedger

    t0 = time.time()
    seed = int(cfg.seed)
    if cfg.train.get("threads"):
        torch.set_num_threads(int(cfg.train.threads))
    torch.manual_seed(seed)
    private = cfg.noise.kind != "none"
    clip = float(cfg.privacy.clip) if private else None
    (folder / "metrics.jsonl").unlink(missing_ok=True)
    task = task or build_task(cfg.task, trials=int(cfg.task.get("trials", 1)), seed=seed)
    sampler = build_sampler(cfg, task.dataset_size, seed)
    sigma = resolve_sigma(cfg, task.dataset_size) if private else 0.0
    opt_kwargs = {k: v for k, v in cfg.optimizer.items() if k != "name"}
    variant = build_variant(cfg.optimizer.name, **opt_kwargs)
    params = task.init_params()
    state = variant.init(params)

    strategy = build_strategy(cfg.noise, sampler.steps) if private else None
    mechanisms = []
    if private and sigma > 0:
        shapes = [p.shape for p in params]
        mechanisms = build_mechanisms(
            strategy, shapes, 1 + variant.extra_noise_streams, seed, params[0].dtype
        )
    privatizer = Privatizer(
        clip=clip,
        sigma=sigma,
        expected_batch_size=sampler.expected_batch_size,
        mechanisms=mechanisms,
        trial_dims=getattr(task, "trial_dims", 0),
        provide_clean=variant.needs_clean,
    )

    ledger = PrivacyLedger()
    privacy_notes = []
    if private and sigma > 0:
        if sampler.amplification:
            q = sampler.q
            for _ in range(sampler.steps):
                ledger.record_poisson_step(sigma * variant.sigma_factor, q)
        else:
            # Each example is in one batch per epoch: a Gaussian mechanism on the whole stream with
            # sensitivity = that of the strategy under `epochs` participations (no amplification).
            participations = int(cfg.train.epochs)
            sens = strategy.sensitivity(
                participations=participations,
                min_separation=sampler.min_separation if participations > 1 else None,
            )
            ledger.record_gaussian(sens / (sigma * variant.sigma_factor))
            privacy_notes.append(
                "single-pass fixed-size batches: accounted without amplification by sampling"
            )
    if variant.sigma_factor != 1.0:
        privacy_notes.append(
            f"{variant.name} noises g and g^2 each with sigma = {sigma:g}: accounted with noise multiplier "
            f"{sigma * variant.sigma_factor:.4g}"
        )
    if variant.needs_fixed_batch and sampler.kind == "poisson":
        raise ValueError(
            f"optimizer {variant.name!r} needs fixed-size batches: use train.sampler=single_pass"
        )
    if variant.needs_clean and not variant.private:
        privacy_notes.append(f"{variant.name} uses clean (un-noised) statistics: a non-private baseline")

    every_log = int(cfg.train.log_every)  # read once: an OmegaConf lookup per step is 15 % of a 1-D run
    for step, idx in enumerate(sampler, start=1):
        per_ex = task.per_example_grads(params, idx)
        ctx = privatizer(per_ex, variant.scale(state))
        with torch.no_grad():
            variant.update(params, state, ctx)
        if step % every_log == 0 or step == sampler.steps:
            metrics = task.evaluate(params)
            log(
                step,
                {f"{k}_mean": float(v.mean()) for k, v in metrics.items()}
                | {f"{k}_std": float(v.std(unbiased=False)) for k, v in metrics.items()},
            )

    final = task.evaluate(params)
    if hasattr(task, "final_diagnostics"):  # optional: per-trial quantities of the final optimizer state
        final = final | task.final_diagnostics(params, variant, state)
    eps = ledger.epsilons(float(cfg.privacy.delta)) if (private and sigma > 0) else {}
    return {
        "metrics": {k: float(v.mean()) for k, v in final.items()}
        | {f"{k}_std": float(v.std(unbiased=False)) for k, v in final.items()},
        "trials": {k: v.tolist() for k, v in final.items()},
        "n_trials": int(final[next(iter(final))].numel()),
        "steps": sampler.steps,
        "private": private and variant.private,
        "sampler": sampler.kind,
        "epsilon": eps,
        "delta": float(cfg.privacy.delta) if private else None,
        "ledger": ledger.to_dict(),
        "privacy_notes": privacy_notes,
        "train_time_s": time.time() - t0,
        "ground_truth": task.ground_truth_loss() if hasattr(task, "ground_truth_loss") else None,
    }
