"""The DP training loop for ``nn.Module`` tasks (DESIGN.md, "the one pipeline").

sampler -> logical batch -> physical micro-batches -> clipped sums (grads engine) -> privatizer (noise, divide
by the *expected* batch size) -> optimizer variant -> ledger; with evaluation, diagnostics, checkpoints and an
optional epsilon budget.

Resuming: with ``train.checkpoint_every > 0`` a checkpoint is written every that many steps; a run whose folder
holds a checkpoint continues from it, with the same sampler, noise stream and ledger it would have had, and ends
bit-identical (same seed, CPU) to the uninterrupted run.

Data-parallel (``torchrun --nproc_per_node=N``, see :mod:`dp_adam_bench.engine.distributed`): every rank draws
the same logical batch and clips its share of it; the clipped sums are all-reduced, rank 0 alone draws the noise
and broadcasts it, and every rank applies the same update. The ledger is the one-process ledger (the sampler is
global), and the result equals the one-process run up to the order of float additions. Only rank 0 evaluates,
logs, and writes the run folder (metrics, diagnostics, checkpoints); every rank reads the checkpoint to resume.
"""

from __future__ import annotations

import inspect
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from dp_adam_bench.config import resolve_sigma
from dp_adam_bench.engine import checkpoint as ckpt
from dp_adam_bench.engine import distributed
from dp_adam_bench.engine.diagnostics import Diagnostics
from dp_adam_bench.engine.distributed import SharedNoise
from dp_adam_bench.engine.engines import build_engine
from dp_adam_bench.engine.privatizer import Privatizer
from dp_adam_bench.engine.sampling import PoissonSampler, ShuffleSampler, SinglePassSampler
from dp_adam_bench.optim.registry import build_variant
from dp_adam_bench.privacy.noise_factory import build_mechanisms, build_strategy

log = logging.getLogger(__name__)


class BudgetExhausted(RuntimeError):
    pass


def resolve_device(name: str | None) -> torch.device:
    """``auto``: CUDA when available, else CPU. Bit-identical resume is promised on CPU only."""
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(
            f"train.device={name!r} but no CUDA device is available; use train.device=cpu or auto"
        )
    return torch.device(name)


def split_public(cfg, n: int, seed: int, needed: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(private indices, public indices). Side-information variants hold ``train.side_info.public_examples``
    examples out of the private set (a seeded choice); the sampler and the accountant only ever see the rest."""
    if not needed:
        return torch.arange(n), None
    side = cfg.train.get("side_info") or {}
    k = int(side.get("public_examples", 1000))
    if not 0 < k < n:
        raise ValueError(f"train.side_info.public_examples={k} must be in (0, {n}) (the training set size)")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(int(side.get("split_seed", 0))))
    return perm[k:].sort().values, perm[:k].sort().values


def poisson_steps(cfg, n: int) -> int:
    """train.steps, or — when it is null and privacy.target_epsilon is set — the number of steps that reaches
    that epsilon under privacy.accountant (Tang et al. train "until eps ~ 7")."""
    if cfg.train.steps is not None:
        return int(cfg.train.steps)
    from dp_adam_bench.privacy.accounting import steps_to_epsilon

    p = cfg.privacy
    q = float(cfg.train.batch_size) / n
    return steps_to_epsilon(
        float(p.target_epsilon), float(p.sigma), q, float(p.delta), p.get("accountant", "rdp")
    )


def build_sampler(cfg, n: int, seed: int):
    t = cfg.train
    if t.sampler == "poisson":
        return PoissonSampler(n, float(t.batch_size), steps=poisson_steps(cfg, n), seed=seed)
    if int(t.batch_size) > n:
        raise ValueError(f"train.batch_size={t.batch_size} is larger than the training set ({n} examples)")
    cls = ShuffleSampler if t.sampler == "shuffle" else SinglePassSampler
    return cls(n, int(t.batch_size), epochs=int(t.epochs), seed=seed)


def _truncate_metrics(folder: Path, step: int) -> None:
    f = folder / "metrics.jsonl"
    if f.exists():
        lines = [ln for ln in f.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= step]
        f.write_text("".join(ln + "\n" for ln in lines))


def _seed_global_rng(ddp, seed: int, payload: dict | None) -> None:
    """The global torch RNG (dropout masks). Rank 0 keeps the one-process stream (``torch.manual_seed(seed)``, or
    the checkpointed state); the other ranks get streams of their own, since copies of rank 0's would give the
    examples at the same position on every rank the same dropout masks. A checkpoint holds every rank's state;
    resumed with another number of ranks, rank r > 0 starts a fresh stream (the result then differs in dropout
    only, like any change of the world size)."""
    if payload is None:
        if not ddp.is_main:
            torch.manual_seed(seed * 1_000_003 + ddp.rank)
        return
    ranks = payload.get("torch_rng_ranks") or []
    if ddp.is_main:
        torch.set_rng_state(payload["torch_rng"].cpu())
    elif len(ranks) == ddp.world:
        torch.set_rng_state(ranks[ddp.rank].cpu())
    else:
        torch.manual_seed(seed * 1_000_003 + ddp.rank + 7919 * int(payload["step"]))


def _public_grad(engine, task, pick: torch.Tensor, device, ddp) -> list[torch.Tensor]:
    """Mean gradient of the public side-information batch ``pick`` (the same indices on every rank). Data-parallel:
    rank r takes ``pick[r::world]`` and the count-weighted means are all-reduced into the global mean."""
    if not ddp.active:
        return engine.mean_grad({k: v.to(device) for k, v in task.get_batch(pick).items()})
    mine = pick[ddp.rank :: ddp.world]
    if len(mine):
        grads = engine.mean_grad({k: v.to(device) for k, v in task.get_batch(mine).items()})
        grads = [g * len(mine) for g in grads]
    else:
        grads = [torch.zeros_like(p) for p in engine.params]
    ddp.all_reduce_(grads)
    return [g / len(pick) for g in grads]


def run(cfg, folder: Path, log_metrics: Callable[[int, dict], None], task=None) -> dict:
    """Train one model-task run whose folder is ``folder``; returns its summary. Data-parallel, every rank must
    call it (same config, same folder); only rank 0's summary carries metrics and epsilons, and only rank 0 calls
    ``log_metrics`` or writes into ``folder``."""
    from dp_adam_bench.privacy.accounting import PrivacyLedger, mf_epsilon, steps_to_epsilon
    from dp_adam_bench.tasks.registry import build_task

    t0 = time.time()
    seed = int(cfg.seed)
    if cfg.train.get("threads"):
        torch.set_num_threads(int(cfg.train.threads))
    ddp = distributed.setup(cfg.train.get("distributed", "auto"), cfg.train.get("device", "auto"))
    torch.manual_seed(seed)  # every rank builds the same model
    task = task or build_task(cfg.task, trials=1, seed=seed)
    device = ddp.device or resolve_device(cfg.train.get("device", "auto"))
    model = task.build_model().to(device)
    params = [p for p in model.parameters() if p.requires_grad]

    private = cfg.noise.kind != "none"
    clip = float(cfg.privacy.clip) if private else None
    delta = float(cfg.privacy.delta)
    variant = build_variant(cfg.optimizer.name, **{k: v for k, v in cfg.optimizer.items() if k != "name"})
    population, public = split_public(cfg, task.dataset_size, seed, variant.needs_side_info)
    sampler = build_sampler(cfg, len(population), seed)
    sigma = resolve_sigma(cfg, len(population)) if private else 0.0
    side_gen = torch.Generator().manual_seed(seed + 17)
    engine_name = cfg.train.get("clipping") or "ghost"
    engine = build_engine(engine_name, model, task.loss_per_example)
    if variant.scale(variant.init(params)) is not None and not engine.supports_scale:
        engine.close()
        raise ValueError(
            f"optimizer {variant.name!r} clips per-coordinate scaled per-example gradients (scale-then-privatize), "
            f"which {engine_name} clipping cannot compute; set train.clipping=bk, hooks or functorch"
        )
    if variant.needs_fixed_batch and sampler.kind == "poisson":
        raise ValueError(
            f"optimizer {variant.name!r} bounds the sensitivity of g^2 assuming at most B examples per batch; "
            "Poisson batches are unbounded: use train.sampler=single_pass"
        )
    account_sigma = sigma * variant.sigma_factor  # the noise multiplier the accountant sees

    diag_cfg = cfg.get("diagnostics") or {}
    diag_every = int(diag_cfg.get("every", 0) or 0)
    diagnostics = Diagnostics(  # rank 0's: the clean sum it observes is the all-reduced, global one
        every=diag_every if ddp.is_main else 0,
        beta1=float(cfg.optimizer.get("beta1", 0.9)),
        beta2=float(cfg.optimizer.get("beta2", 0.999)),
        reference_sigma=diag_cfg.get("reference_sigma"),
        reference_clip=diag_cfg.get("reference_clip") or cfg.privacy.get("clip"),
        hist_dir=folder / "diagnostics" if diag_cfg.get("histograms", True) and ddp.is_main else None,
        seed=seed,
    )

    strategy = build_strategy(cfg.noise, sampler.steps) if private else None
    mechanisms = []
    if private and sigma > 0:
        shapes = [p.shape for p in params]
        streams = 1 + variant.extra_noise_streams
        if not ddp.active:
            mechanisms = build_mechanisms(strategy, shapes, streams, seed, params[0].dtype, device)
        else:  # one noise draw per logical step for the whole world: rank 0's, broadcast (SharedNoise)
            own = (
                build_mechanisms(strategy, shapes, streams, seed, params[0].dtype, device)
                if ddp.is_main
                else [strategy.mechanism() for _ in range(streams)]
            )
            mechanisms = [SharedNoise(m, ddp, shapes, params[0].dtype, device) for m in own]
    privatizer = Privatizer(
        clip=clip,
        sigma=sigma,
        expected_batch_size=sampler.expected_batch_size,
        mechanisms=mechanisms,
        provide_clean=variant.needs_clean or diag_every > 0,  # the same on every rank
    )

    # --- accounting: what the sampler allows the accountant to assume ---------------------------------------------
    ledger = PrivacyLedger()
    notes: list[str] = []
    max_steps = sampler.steps
    budget = cfg.privacy.get("epsilon_budget")
    accountant = cfg.privacy.get("accountant", "rdp")
    if private and sigma > 0:
        if sampler.kind == "shuffle":
            notes.append(
                "fixed-size shuffled batches: accounted as Poisson sampling with q = B/N, which the "
                "sampler does NOT implement (not DP-faithful)"
            )
        if not sampler.amplification:
            participations = int(cfg.train.epochs)
            sens = strategy.sensitivity(
                participations=participations,
                min_separation=sampler.min_separation if participations > 1 else None,
            )
            notes.append(
                f"single-pass fixed-size batches ({participations} participation(s), min separation "
                f"{sampler.min_separation}): a Gaussian mechanism with sensitivity {sens:.4g}, no "
                "amplification by sampling"
            )
            if budget is not None and mf_epsilon(account_sigma, sens, delta) > float(budget):
                raise BudgetExhausted(
                    f"the whole run costs epsilon = {mf_epsilon(account_sigma, sens, delta):.3f} > "
                    f"privacy.epsilon_budget = {budget}; nothing was trained"
                )
        else:
            if budget is not None:
                max_steps = min(
                    sampler.steps,
                    steps_to_epsilon(float(budget), account_sigma, sampler.q, delta, accountant),
                )
    if public is not None:
        notes.append(
            f"side information: {len(public)} training examples held out as public; the private set "
            f"has N = {len(population)}"
        )
    if variant.sigma_factor != 1.0:
        notes.append(
            f"{variant.name} releases {1 + variant.extra_noise_streams} noisy quantities per step with sigma = "
            f"{sigma:g} each: accounted with noise multiplier {account_sigma:.4g}"
        )
    if variant.needs_clean and not variant.private:
        notes.append(f"{variant.name} uses clean (un-noised) statistics: a non-private baseline")

    # --- resume ------------------------------------------------------------------------------------------------------
    fp = ckpt.fingerprint(cfg if isinstance(cfg, dict) else _to_dict(cfg))
    state = variant.init(params)
    start = 0
    payload = ckpt.load(folder, fp, device) if cfg.train.get("resume", True) else None
    if payload is not None:
        start = int(payload["step"])
        with torch.no_grad():
            for p, saved in zip(params, payload["params"], strict=True):
                p.copy_(saved.to(device))
        state = payload["variant"]
        privatizer.load_state_dict(payload["privatizer"])
        sampler.load_state_dict(payload["sampler"])
        ledger = PrivacyLedger.from_dict(payload["ledger"])
        diagnostics.load_state_dict(payload["diagnostics"])
        side_gen.set_state(payload["side_rng"].cpu())
        if ddp.is_main:
            _truncate_metrics(folder, start)
            log.info("resumed %s from step %d", folder.name, start)
    elif ddp.is_main and (folder / "metrics.jsonl").exists():
        (folder / "metrics.jsonl").unlink()
    _seed_global_rng(ddp, seed, payload)
    if ddp.active:  # a safety net for tasks whose build_model is not deterministic across processes
        ddp.broadcast_([p.data for p in model.parameters()])

    if private and sigma > 0 and not sampler.amplification and start == 0:
        ledger.record_gaussian(sens / account_sigma)

    phys = int(cfg.train.get("physical_batch_size") or 256)
    every_ckpt = int(cfg.train.get("checkpoint_every") or 0)
    every_log = int(cfg.train.get("log_every") or 100)
    every_eval = int(cfg.train.get("eval_every") or 0)
    stop_after = cfg.train.get("stop_after")  # test hook: simulate a kill after this many steps
    # the untrained model (Ganesh Fig. 3 "no fine-tuning")
    if start == 0 and cfg.train.get("eval_at_start") and ddp.is_main:
        model.eval()
        with torch.no_grad():
            log_metrics(0, evaluate(task, model, final=False))
    stopped_by_budget = False
    last_metrics: dict = {}
    step = start
    for step, idx in enumerate(sampler.iter_from(start), start=start + 1):
        if step > max_steps:
            stopped_by_budget = True
            step -= 1
            notes.append(
                f"stopped before step {step + 1}: it would exceed privacy.epsilon_budget = {budget} "
                f"under {accountant}"
            )
            break
        summed = [torch.zeros_like(p) for p in params]
        counts = torch.zeros(2, dtype=torch.float64, device=device)  # (examples, clipped ones) on this rank
        model.train()
        idx = population[idx]
        scale = variant.scale(state)  # once per logical step (stp); None for every other variant
        for chunk in idx[ddp.rank :: ddp.world].split(phys):  # this rank's share of the logical batch
            if not len(chunk):  # an empty Poisson batch, or fewer examples than ranks
                continue
            batch = {k: v.to(device) for k, v in task.get_batch(chunk).items()}
            cs = engine.clipped_sum(batch, clip, scale)
            for acc, s in zip(summed, cs.summed, strict=True):
                acc.add_(s)
            counts[0] += cs.norms.numel()
            if clip:
                counts[1] += (cs.norms > clip).sum()
        ddp.all_reduce_(summed)  # the global sum of clipped gradients, before any noise
        ctx = privatizer.privatize_sum(summed, scale)
        if public is not None:  # public side information: no clipping, no noise, no privacy cost
            pick = public[
                torch.randint(
                    len(public),
                    (int((cfg.train.get("side_info") or {}).get("batch_size", 256)),),
                    generator=side_gen,
                )
            ]
            ctx.side = _public_grad(engine, task, pick, device, ddp)
        with torch.no_grad():
            variant.update(params, state, ctx)
        if private and sigma > 0 and sampler.amplification:
            ledger.record_poisson_step(account_sigma, sampler.q)
        metrics = {}
        diag = diagnostics.observe(ctx, state)
        if diag:
            metrics |= diag
        if step % every_log == 0 or step == sampler.steps:
            ddp.all_reduce_([counts])  # every rank logs on the same steps: a collective is safe here
            metrics |= {
                "diag/batch_size": int(idx.numel()),  # realized size: depends on the sample
                "diag/frac_clipped": float(counts[1] / counts[0]) if clip and counts[0] > 0 else 0.0,
            }
        if ddp.is_main and ((every_eval and step % every_eval == 0) or step == sampler.steps):
            model.eval()
            with torch.no_grad():
                last_metrics = evaluate(task, model, final=step == sampler.steps)
            metrics |= last_metrics
            if private and sigma > 0 and sampler.amplification:
                metrics["epsilon"] = ledger.epsilon(delta, accountant)
        if metrics and ddp.is_main:
            log_metrics(step, metrics)
        if every_ckpt and step % every_ckpt == 0:
            rng_states = ddp.gather_objects(torch.get_rng_state())  # a collective: every rank takes part
            if ddp.is_main:
                ckpt.save(
                    folder,
                    {
                        "step": step,
                        "fingerprint": fp,
                        "params": [p.detach().clone() for p in params],
                        "variant": state,
                        "privatizer": privatizer.state_dict(),
                        "sampler": sampler.state_dict(),
                        "ledger": ledger.to_dict(),
                        "diagnostics": diagnostics.state_dict(),
                        "torch_rng": torch.get_rng_state(),
                        "side_rng": side_gen.get_state(),
                        "torch_rng_ranks": rng_states,
                    },
                )
        if stop_after is not None and step >= int(stop_after):
            raise KeyboardInterrupt(f"train.stop_after={stop_after} reached (simulated kill)")
    engine.close()
    if ddp.is_main and (not last_metrics or stopped_by_budget):
        model.eval()
        with torch.no_grad():
            last_metrics = evaluate(task, model, final=True)
    eps = ledger.epsilons(delta) if (private and sigma > 0 and ddp.is_main) else {}
    return {
        "metrics": last_metrics,
        "steps": step,
        "planned_steps": sampler.steps,
        "private": private and variant.private,
        "sampler": sampler.kind,
        "clipping": engine_name,
        "epsilon": eps,
        "sigma": sigma,
        "delta": delta if private else None,
        "ledger": ledger.to_dict(),
        "privacy_notes": notes,
        "stopped_by_budget": stopped_by_budget,
        "train_time_s": time.time() - t0,
        "world_size": ddp.world,
        "final_params_sha1": _params_digest(params),
    }


def evaluate(task, model, *, final: bool) -> dict:
    """``task.evaluate(model)``, telling tasks whose ``evaluate`` takes ``final`` whether this is the run's last
    evaluation (e2e_gpt2 decodes the test MRs, its costly part, only then)."""
    if "final" in inspect.signature(task.evaluate).parameters:
        return task.evaluate(model, final=final)
    return task.evaluate(model)


def _params_digest(params) -> str:
    import hashlib

    h = hashlib.sha1()
    for p in params:
        h.update(p.detach().cpu().numpy().tobytes())
    return h.hexdigest()


def _to_dict(cfg) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg, resolve=True)
