"""The one DP training loop, for ``nn.Module`` tasks and vectorised toy tasks alike (docs/design.md, "the one
pipeline").

plan (sampler, sigma, strategy, ledger, steps; :mod:`dp_adam_bench.engine.plan`) -> for each step: logical batch
-> clipped sum (a clipping engine over physical micro-batches, or the toy task's closed-form per-example gradients;
:mod:`dp_adam_bench.engine.backends`) -> privatizer (every noisy release; divide by the *expected* batch size) ->
optimizer variant -> ledger; with evaluation, diagnostics, checkpoints and the plan's epsilon budget.

Resuming: with ``train.checkpoint_every > 0`` a checkpoint is written every that many steps; a run whose folder
holds a checkpoint continues from it, with the same sampler, noise stream and ledger it would have had, and ends
bit-identical (same seed, CPU) to the uninterrupted run.

Data-parallel (``torchrun --nproc_per_node=N``, model tasks, see :mod:`dp_adam_bench.engine.distributed`): every
rank draws the same logical batch and clips its share of it; the clipped sums are all-reduced, rank 0 alone draws
the noise and broadcasts it, and every rank applies the same update. The ledger is the one-process ledger (the
sampler is global), and the result equals the one-process run up to the order of float additions. Only rank 0
evaluates, logs, and writes the run folder (metrics, diagnostics, checkpoints); every rank reads the checkpoint.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dp_adam_bench import finetune
from dp_adam_bench.engine import checkpoint as ckpt
from dp_adam_bench.engine import distributed, memory
from dp_adam_bench.engine.backends import ModelBackend, VectorBackend
from dp_adam_bench.engine.diagnostics import Diagnostics
from dp_adam_bench.engine.fp32_exact import settings as fp32_settings
from dp_adam_bench.engine.plan import PrivacyPlan, build_plan
from dp_adam_bench.engine.post_processing import refuse_unreleased
from dp_adam_bench.engine.seeds import RunSeeds
from dp_adam_bench.engine.self_check import DEFAULT_EXAMPLES, carried_over, carried_probe, carry_key, passed
from dp_adam_bench.engine.session import PrivateTraining
from dp_adam_bench.engine.watch import EngineWatch
from dp_adam_bench.errors import ConfigError, PrivacyMismatch
from dp_adam_bench.optim.base import Variant
from dp_adam_bench.optim.decay import decay_mask
from dp_adam_bench.optim.registry import build_variant
from dp_adam_bench.optim.schedule import LRSchedule, build_schedule
from dp_adam_bench.progress import Progress

log = logging.getLogger(__name__)


def resolve_device(name: str | None) -> torch.device:
    """``auto``: CUDA when available, else CPU. Bit-identical resume is promised on CPU only."""
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(
            f"train.device={name!r} but no CUDA device is available; use train.device=cpu or auto"
        )
    return torch.device(name)


def is_vector_task(task) -> bool:
    """A closed-form toy task with vectorised trials (``per_example_grads``), not an ``nn.Module`` task."""
    return hasattr(task, "per_example_grads")


def population_and_public(cfg, task, seed: int, needed: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(private indices, public indices) of ``task``, public only for a side-information variant (``needed``).

    A task with a public set of its own (``task.public_size``: make_private's ``public_dataset``) serves it at
    indices ``N .. N + public_size - 1`` after its ``N = task.dataset_size`` private examples: the population is
    ``0 .. N - 1``, all of the private data, and nothing is cut from it. Any other task (the command line's) holds
    public examples out of its training set (:func:`split_public`). The two are checked disjoint, by index and
    where the task gives it by content, when the session is made (:mod:`dp_adam_bench.engine.public_data`)."""
    given = getattr(task, "public_size", None)
    if given is None:
        return split_public(cfg, task.dataset_size, seed, needed)
    from dp_adam_bench.engine.public_data import refuse_public_mismatch

    n, m = int(task.dataset_size), int(given)
    refuse_public_mismatch(cfg.optimizer.name, needed, m)
    return torch.arange(n), (torch.arange(n, n + m) if needed else None)


def split_public(cfg, n: int, seed: int, needed: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(private indices, public indices) of a command-line task. Side-information variants hold
    ``train.side_info.public_examples`` examples out of the task's training set (a seeded choice, printed in the
    run's privacy notes: Ganesh et al.'s held-out public data); the sampler and the accountant only ever see the
    rest. The split is disjoint by index by construction; :func:`~dp_adam_bench.engine.public_data.check_disjoint`
    checks it again, and by content where the task gives its examples' content (``example_content``)."""
    if not needed:
        return torch.arange(n), None
    side = cfg.train.get("side_info") or {}
    k = int(side.get("public_examples", 1000))
    if not 0 < k < n:
        raise ConfigError(f"train.side_info.public_examples={k} must be in (0, {n}) (the training set size)")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(int(side.get("split_seed", 0))))
    return perm[k:].sort().values, perm[:k].sort().values


@dataclass
class Run:
    """Everything a run is made of, built (and validated) before any file is written: see :func:`prepare`."""

    cfg: object
    task: object
    backend: ModelBackend | VectorBackend
    variant: Variant
    plan: PrivacyPlan
    seeds: RunSeeds
    population: torch.Tensor  # the task's indices of the private examples: the sampler's and accountant's N
    # the task's indices of side information's public examples (population_and_public), None without
    public: torch.Tensor | None
    ddp: distributed.DistContext
    schedule: LRSchedule  # the factor of optimizer.lr at each step (train.lr_schedule)
    self_check: dict = field(default_factory=dict)  # the engine's self-check (model tasks)
    # what a passed self-check is about (engine/self_check.py carry_key): saved with it in every checkpoint
    self_check_key: dict | None = None
    # the engine against autograd on a probe batch (engine/probe.py; model tasks)
    engine_probe: dict = field(default_factory=dict)
    # the engine checked again on the weights training reaches (engine/watch.py; model tasks)
    watch: EngineWatch | None = None
    # task.finetune: the method, its settings, and the trainable (noised) and frozen parameter counts (model tasks)
    finetune: dict = field(default_factory=dict)


def build(cfg, folder: Path | None = None) -> Run:
    """Threads, seed, the task and :func:`prepare`: the one way a config becomes a :class:`Run`."""
    from dp_adam_bench.tasks.registry import build_task

    if cfg.train.get("threads"):
        torch.set_num_threads(int(cfg.train.threads))
    torch.manual_seed(int(cfg.seed))
    task = build_task(cfg.task, trials=int(cfg.task.get("trials", 1)), seed=int(cfg.seed))
    return prepare(cfg, task, folder)


def prepare(cfg, task, folder: Path | None = None) -> Run:
    """Build the task's model or parameters, the variant and the privacy plan; ConfigError for anything the run
    could not do honestly. Nothing is written. ``folder``: the run folder :func:`run` will train in; when the run
    resumes from a checkpoint there that records a passed engine self-check under the same key, that record is
    carried over instead of running the check again (:mod:`dp_adam_bench.engine.self_check`)."""
    seeds = RunSeeds.derive(int(cfg.seed), secure=bool(cfg.privacy.get("secure_rng", False)))
    ddp = _distributed(cfg, task)
    variant = build_variant(cfg.optimizer.name, **{k: v for k, v in cfg.optimizer.items() if k != "name"})
    torch.manual_seed(seeds.model)  # every rank builds the same model
    backend, variant, finetuned = _backend(cfg, task, variant, ddp, seeds)
    try:
        _refuse_scale_without_support(cfg, variant, backend)
        population, public = population_and_public(cfg, task, int(cfg.seed), variant.needs_side_info)
        plan = build_plan(
            cfg, len(population), variant, numel=backend.numel_per_trial, sampler_seed=seeds.sampler
        )
        schedule = build_schedule(cfg.train.get("lr_schedule"), cfg.train.get("lr_warmup_steps"), plan.steps)
        checks = (
            {}
            if is_vector_task(task)
            else _engine_checks(cfg, task, backend, plan, population, seeds, folder)
        )
    except Exception:
        backend.close()
        raise
    return Run(
        cfg=cfg,
        task=task,
        backend=backend,
        variant=variant,
        plan=plan,
        seeds=seeds,
        population=population,
        public=public,
        ddp=ddp,
        schedule=schedule,
        finetune=finetuned,
        **checks,
    )


def _distributed(cfg, task) -> distributed.DistContext:
    """The data-parallel context (torchrun), refused for the closed-form toy tasks."""
    ddp = distributed.setup(cfg.train.get("distributed", "auto"), cfg.train.get("device", "auto"))
    if ddp.active and is_vector_task(task):
        raise ConfigError(
            f"task.name={task.name!r} is a closed-form toy task that runs in one process; data-parallel training "
            "(torchrun) is for model tasks"
        )
    return ddp


def _backend(cfg, task, variant: Variant, ddp, seeds: RunSeeds) -> tuple:
    """``(backend, variant, finetune summary)``: a toy task's vectorised backend, or the model on its device with
    the trainable set ``task.finetune`` chose (before the engine is built, so that it, the checks and the noise
    see only those), its clipping engine and the variant's weight-decay mask (and RGP's wrapper)."""
    if is_vector_task(task):
        return VectorBackend(task), variant, {}
    device = ddp.device or resolve_device(cfg.train.get("device", "auto"))
    task_cfg = cfg.get("task") or {}
    tuned = finetune.apply(
        task.build_model().to(device), task_cfg.get("finetune"), _plain(task_cfg.get("finetune_args"))
    )
    backend = ModelBackend(
        task,
        tuned.model,
        cfg.train.clipping,
        cfg.train.physical_batch_size,
        ddp,
        device,
        precision=cfg.train.get("precision", "fp32"),
    )
    # which tensors weight decay acts on, from the model's names and module types (optim/decay.py)
    variant.decay_mask = decay_mask(tuned.model, backend.params, variant.decay_exclude)
    if tuned.wrap_variant is not None:
        variant = tuned.wrap_variant(variant, tuned.model, seeds.model)
    return backend, variant, tuned.summary


def _refuse_scale_without_support(cfg, variant: Variant, backend) -> None:
    if variant.scale(variant.init(backend.params)) is not None and not backend.supports_scale:
        raise ConfigError(
            f"optimizer.name={variant.name!r} clips per-coordinate scaled per-example gradients "
            f"(scale-then-privatize), which train.clipping={cfg.train.clipping} cannot compute; set "
            "train.clipping=bk, hooks or functorch"
        )


def _engine_checks(cfg, task, backend, plan: PrivacyPlan, population, seeds: RunSeeds, folder) -> dict:
    """The engine against autograd and the size-one loop on a few of the user's examples, drawn at random
    (engine/watch.py), before any run folder is written or noise released, then again as the run trains: the
    Run's ``self_check``, ``self_check_key``, ``engine_probe`` and ``watch``. A resume that carries over a check
    (and its probe) passed under the same key skips the start check; it checks the loaded weights again before
    its first release (EngineWatch.before_step)."""
    clip = float(cfg.privacy.clip) if plan.noisy else None
    settings = cfg.train.get("self_check") or {}
    watch = EngineWatch(
        lambda idx, gen, why: backend.engine_check(idx, gen, clip, settings, start=why == "start"),
        population,
        int(settings.get("examples", DEFAULT_EXAMPLES)),
        seeds.check,
        cfg.train.get("engine_watch"),
        sizes=backend.example_sizes,
    )
    check, key, probed = {}, None, {}
    if settings.get("enabled", True):
        fp = ckpt.fingerprint(_to_dict(cfg))
        key = carry_key(fp, settings, backend.engine_name, backend.device, backend.model, task)
        found = (
            ckpt.peek(folder, fp, "self_check")
            if key is not None and folder and cfg.train.get("resume", True)
            else None
        )
        check = carried_over(found[1], key, found[0]) if found else None
        probed = carried_probe(found[1], found[0]) if check else None
    # every use of every parameter seen by the engine (engine/probe.py), self-check or not
    if not (check and probed):
        records = watch.check(0, "start")
        probed, check = records["probe"], records["self_check"]
    return {"self_check": check, "self_check_key": key, "engine_probe": probed, "watch": watch}


def _check_to_carry(r: Run) -> dict | None:
    """The checkpoint's ``self_check`` entry: the passed check (as first run), its key and the engine probe's
    record, or None."""
    record = {k: v for k, v in r.self_check.items() if k != "carried_over"}
    if not (r.self_check_key and passed(record)):
        return None
    probe = {k: v for k, v in r.engine_probe.items() if k != "carried_over"}
    return {"key": r.self_check_key, "record": record, "probe": probe}


#: written in the run folder when an engine or noise check stops a run: the run is not complete, and no report
#: reads it
STOPPED_FILE = "stopped_by_check.json"


def _record_stop(folder: Path, session: PrivateTraining, err: Exception) -> None:
    """What stopped the run (one line), at which step, and the engine checks so far, written before the error
    propagates: the run is not complete (no summary), so reports leave it out, and a relaunch starts it again."""
    from dp_adam_bench.tracking.run_store import atomic_write_text, json_safe

    record = {
        "status": "stopped_by_check",
        "error": str(err),
        "step": session.steps_done,
        "engine_watch": session.watch.describe() if session.watch is not None else {},
        "noise_check": session.noise_check.describe() if session.noise_check is not None else {},
        "post_processing_check": session.post_check.describe() if session.post_check is not None else {},
    }
    atomic_write_text(folder / STOPPED_FILE, json.dumps(json_safe(record), indent=2))


def _truncate_metrics(folder: Path, step: int) -> None:
    """On resume from the checkpoint of ``step``: keep the rows up to ``step`` of ``metrics.jsonl`` and of
    ``private_diagnostics.jsonl`` (the diag/ keys of the same steps), each rewritten atomically (a temporary file in
    the folder, fsynced, then ``os.replace``): a kill during the rewrite leaves the old file or the new one."""
    from dp_adam_bench.tracking.run_store import METRICS_FILE, PRIVATE_DIAGNOSTICS_FILE, atomic_write_text

    for name in (METRICS_FILE, PRIVATE_DIAGNOSTICS_FILE):
        f = folder / name
        if f.exists():
            lines = [ln for ln in f.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= step]
            atomic_write_text(f, "".join(ln + "\n" for ln in lines))


def run(cfg, folder: Path, log_metrics: Callable[[int, dict], None], prepared: Run | None = None) -> dict:
    """Train one run whose folder is ``folder``; returns its summary. Data-parallel, every rank must call it (same
    config, same folder); only rank 0's summary carries metrics and epsilons, and only rank 0 calls
    ``log_metrics`` or writes into ``folder``. ``prepared``: the :func:`build` result (built here if None)."""
    t0 = time.time()
    r = prepared or build(cfg, folder)
    try:
        return _train(r, folder, log_metrics, t0)
    finally:
        r.backend.close()


def _train(r: Run, folder: Path, log_metrics, t0: float) -> dict:
    """The run from step 0, or from the checkpoint in ``folder``, to its summary (``t0``: when it started)."""
    session = PrivateTraining(r, _diagnostics(r, folder))
    notes = _privacy_notes(r)
    fp = ckpt.fingerprint(_to_dict(r.cfg))
    start = _resume(r, session, folder, fp)
    untrained = _evaluate_untrained(r, start, log_metrics)
    step, last_metrics = _train_steps(r, session, folder, fp, start, log_metrics)
    return _summary(r, session, step, last_metrics, untrained, notes, t0)


def _diagnostics(r: Run, folder: Path) -> Diagnostics:
    """Rank 0's clean-gradient diagnostics (``diagnostics.*``; model tasks): the clean sum it observes is the
    all-reduced, global one."""
    cfg, ddp = r.cfg, r.ddp
    diag_cfg = cfg.get("diagnostics") or {}
    diag_every = int(diag_cfg.get("every", 0) or 0) if r.backend.kind == "model" else 0
    return Diagnostics(
        every=diag_every if ddp.is_main else 0,
        beta1=float(cfg.optimizer.get("beta1", 0.9)),
        beta2=float(cfg.optimizer.get("beta2", 0.999)),
        reference_sigma=diag_cfg.get("reference_sigma"),
        reference_clip=diag_cfg.get("reference_clip") or cfg.privacy.get("clip"),
        hist_dir=folder / "diagnostics" if diag_cfg.get("histograms", True) and ddp.is_main else None,
        seed=int(cfg.seed),
    )


def _privacy_notes(r: Run) -> list[str]:
    """The plan's notes, and where side information's public examples come from."""
    notes = list(r.plan.notes)
    if r.public is not None and getattr(r.task, "public_size", None) is not None:
        notes.append(
            f"side information: the {len(r.public)} examples of the public set given as public (never sampled, "
            f"clipped, noised or accounted); the private set has N = {len(r.population)}"
        )
    elif r.public is not None:
        notes.append(
            f"side information: {len(r.public)} training examples held out as public; the private set "
            f"has N = {len(r.population)}"
        )
    return notes


def _resume(r: Run, session: PrivateTraining, folder: Path, fp: str) -> int:
    """The step the run starts after: that of the checkpoint in ``folder`` (``train.resume``; its metric rows
    past it dropped), else 0 (an earlier attempt's ``metrics.jsonl`` removed). Data-parallel, every rank then
    holds rank 0's parameters."""
    cfg, backend, ddp = r.cfg, r.backend, r.ddp
    start = 0
    payload = ckpt.load(folder, fp, backend.params[0].device) if cfg.train.get("resume", True) else None
    if payload is not None:
        start = int(payload["step"])
        session.load_state_dict(payload)
        if ddp.is_main:
            _truncate_metrics(folder, start)
            log.info("resumed %s from step %d", folder.name, start)
    elif ddp.is_main and (folder / "metrics.jsonl").exists():
        (folder / "metrics.jsonl").unlink()
    if ddp.active:  # a safety net for tasks whose build_model is not deterministic across processes
        ddp.broadcast_([p.data for p in backend.model.parameters()])
    return start


def _evaluate_untrained(r: Run, start: int, log_metrics) -> dict:
    """The untrained model's metrics (Ganesh Fig. 3 "no fine-tuning"; the reference of the divergence note): with
    ``train.eval_at_start`` logged as step 0, and always for toys, which evaluate in closed form, cheaply. {} on a
    resume."""
    if start == 0 and r.cfg.train.get("eval_at_start") and r.ddp.is_main:
        untrained = r.backend.evaluate(final=False)
        log_metrics(0, untrained)
        return untrained
    if start == 0 and r.backend.kind != "model":
        return r.backend.evaluate(final=False)
    return {}


@dataclass(frozen=True)
class _Cadence:
    """How often the loop logs, evaluates and checkpoints, read once: an OmegaConf lookup per step is slow on
    toys. ``stop_after`` is a test hook (simulate a kill after this many steps); ``trim_heap``: CPU model steps
    allocate their activations on the host heap (engine/memory.py), on a GPU they do not."""

    log: int
    eval: int
    checkpoint: int
    stop_after: int | None
    trim_heap: bool

    @classmethod
    def of(cls, r: Run) -> _Cadence:
        train = r.cfg.train
        return cls(
            log=int(train.get("log_every") or 100),
            eval=int(train.get("eval_every") or 0),
            checkpoint=int(train.get("checkpoint_every") or 0),
            stop_after=train.get("stop_after"),
            trim_heap=r.backend.kind == "model" and torch.device(r.backend.device).type == "cpu",
        )


def _train_steps(r: Run, session: PrivateTraining, folder: Path, fp: str, start: int, log_metrics):
    """The steps after ``start`` until the plan's last (plan.steps < sampler.steps when the epsilon budget stops
    the run: the step that would exceed it is never drawn), each logged, shown and checkpointed on its cadence;
    returns (last step, last evaluation). An engine or noise check (engine/watch.py, engine/noise_check.py)
    stops the run before its next release: what stopped it is recorded in ``folder`` and the error propagates."""
    plan, ddp = r.plan, r.ddp
    cadence = _Cadence.of(r)
    session.add_emitter(ROW, _released_row(r, session, lambda step: step == plan.steps))
    last_metrics: dict = {}
    step = start
    bar = Progress(
        plan.steps,
        start,
        enabled=ddp.is_main,
        what=folder.name,
        epsilon=session.epsilon_so_far if plan.noisy else None,
        accountant=plan.accountant if plan.noisy else None,
    )
    try:
        while not session.done:
            result = session.step()
            step = result.step
            if cadence.trim_heap and step % memory.TRIM_EVERY == 0:
                memory.release_free_memory()
            metrics, logged, last_metrics = _step_metrics(r, session, result, cadence, last_metrics)
            if metrics and ddp.is_main:
                # what metrics.jsonl and W&B get: the compared row, the evaluation, epsilon and diag/ keys (those
                # go to the run folder's private file), nothing else (engine/post_processing.py)
                certified = session.emit_row(ROW, result) | last_metrics
                refuse_unreleased("the metrics log", step, metrics, certified, _PUBLIC_ROW, diagnostics=True)
                log_metrics(step, metrics)
            bar.update(step, metrics, logged)
            if cadence.checkpoint and step % cadence.checkpoint == 0:
                _save_checkpoint(r, session, folder, fp)
            if cadence.stop_after is not None and step >= int(cadence.stop_after):
                bar.close()
                raise KeyboardInterrupt(f"train.stop_after={cadence.stop_after} reached (simulated kill)")
    except PrivacyMismatch as err:
        if ddp.is_main:
            _record_stop(folder, session, err)
        bar.close()
        raise
    bar.close()
    return step, last_metrics


def _step_metrics(r: Run, session: PrivateTraining, result, cadence: _Cadence, last_metrics: dict):
    """(the step's metrics, whether it is a logged step, the latest evaluation). A logged step adds the batch
    size and the fraction clipped (model tasks; every rank logs on the same steps, so the all-reduce inside is
    safe) or the toy's closed-form evaluation, and the learning rate the step used; an evaluated step (rank 0,
    model tasks) the evaluation; either, under amplified accounting, the epsilon so far (a cheap, cached call)."""
    plan, backend, ddp = r.plan, r.backend, r.ddp
    model_task = backend.kind == "model"
    step = result.step
    metrics = dict(result.diagnostics)
    final_step = step == plan.steps
    logged = step % cadence.log == 0 or final_step
    if logged:
        if model_task:
            metrics |= {"diag/batch_size": result.batch_size} | backend.clipped_fraction(session.clip)
        metrics |= session.emit_row(ROW, result)
    evaluated = model_task and ddp.is_main and ((cadence.eval and step % cadence.eval == 0) or final_step)
    if evaluated:
        last_metrics = backend.evaluate(final=final_step)
        metrics |= last_metrics
    if (logged or evaluated) and plan.amplified and ddp.is_main:
        metrics |= session.epsilon_so_far()
    return metrics, logged, last_metrics


#: the emitter of the logged row (PrivateTraining.add_emitter): what the post-processing check compares
ROW = "metrics row"
#: logged keys public by construction: the epsilon spent (the ledger's, a function of the plan and the step)
_PUBLIC_ROW = frozenset({"epsilon"})


def _released_row(r: Run, session: PrivateTraining, final_step):
    """The logged row's shared part for a step (the post-processing check replays it, engine/post_processing.py):
    a toy's closed-form evaluation and the learning rate the step used. Not the ``diag/`` keys, and not the
    held-out evaluation (a function of the parameters, which the check compares)."""

    def row(result) -> dict:
        out = {} if r.backend.kind == "model" else r.backend.evaluate(final=final_step(result.step))
        if r.schedule.name != "constant":
            out["lr"] = session.variant.lr
        return out

    return row


def _save_checkpoint(r: Run, session: PrivateTraining, folder: Path, fp: str) -> None:
    """The weights this checkpoint saves, checked first (engine/watch.py: every rank runs the same check); the
    state is a collective, every rank takes part; rank 0 writes it."""
    session.check_engine("checkpoint")
    state = session.state_dict()
    if r.ddp.is_main:
        ckpt.save(folder, {"fingerprint": fp, **state, "self_check": _check_to_carry(r)})


def _summary(
    r: Run, session: PrivateTraining, step: int, last_metrics: dict, untrained: dict, notes, t0
) -> dict:
    """What the run reports (rank 0's carries the metrics and epsilons): the final evaluation (again when the run
    resumed from a checkpoint of its last step), the privacy record, the backend's part, and a divergence note."""
    plan, backend, ddp = r.plan, r.backend, r.ddp
    if backend.kind == "model" and ddp.is_main and not last_metrics:
        last_metrics = backend.evaluate(final=True)
    summary = {
        "metrics": last_metrics,
        **_privacy_summary(r, session, step),
        "privacy_notes": notes,
        "stopped_by_budget": plan.steps < plan.sampler.steps,
        "train_time_s": time.time() - t0,
        "final_params_sha1": _params_digest(backend.params),
        # steps replayed behind the same release with another private batch (engine/post_processing.py)
        "post_processing_check": session.post_check.describe() if session.post_check is not None else None,
    }
    if getattr(backend.task, "data_note", None):  # what model and data (e.g. pretrained on what, how long)
        summary["data_note"] = backend.task.data_note
    summary |= _backend_summary(r, session)
    diverged = divergence_note(summary["metrics"], untrained, backend.params) if ddp.is_main else None
    if diverged:  # the CLI prints it (dp_adam_bench.train)
        summary["diverged"] = diverged
    return summary


def _privacy_summary(r: Run, session: PrivateTraining, step: int) -> dict:
    """The steps, the sampler, the epsilons and the accountant of each, the plan, the ledger, and the checks of
    what ran against it."""
    plan, ddp = r.plan, r.ddp
    eps, eps_errors = (
        session.ledger.epsilons_with_errors(plan.delta) if plan.noisy and ddp.is_main else ({}, {})
    )
    return {
        "steps": step,
        "planned_steps": plan.sampler.steps,
        "private": plan.private,
        "sampler": plan.sampler.kind,
        "epsilon": eps,
        "epsilon_errors": eps_errors,
        # which accountant the reported epsilon, the budget and the target use
        "guarantee": plan.guarantee(session.ledger) if ddp.is_main else {},
        "sigma": plan.sigma,
        "delta": plan.delta,
        "privacy_plan": plan.describe(),
        "rng": r.seeds.describe(),
        "ledger": session.ledger.to_dict(),
        # what ran, reconciled with what the ledger and the sensitivity assumed (engine/participation.py);
        # train.py fails the run, after writing the summary, on a MISMATCH
        "participation": session.participation_report() if ddp.is_main else {},
        # the noise added to each release against the ledger's multiplier (engine/noise_check.py)
        "noise_check": session.noise_check.describe() if session.noise_check is not None else {},
    }


def _backend_summary(r: Run, session: PrivateTraining) -> dict:
    """Model tasks: the clipping engine, the world size and the engine's checks; toys: their trials' results."""
    backend = r.backend
    if backend.kind != "model":
        return backend.final_summary(r.variant, session.state)
    return {
        "clipping": backend.engine_name,
        "world_size": r.ddp.world,
        "self_check": session.self_check,
        "engine_probe": r.engine_probe,
        # the engine checked again as the run trained (engine/watch.py)
        "engine_watch": session.watch.describe() if session.watch is not None else {},
        # which parameters trained (task.finetune), how many (the noise dimension), and that each moved
        "finetune": r.finetune,
        "moved_check": session.moved_check.result if session.moved_check is not None else None,
        # the TF32 / reduced-precision fp32 settings (engine/fp32_exact.py); clipping runs in IEEE fp32
        "fp32_math": fp32_settings(),
    }


#: a final loss this many times the untrained model's is a divergence
DIVERGED_FACTOR = 10.0


def divergence_note(final: dict, untrained: dict, params) -> str | None:
    """A one-line note when training diverged: non-finite parameters, a non-finite final loss, or a final loss
    more than :data:`DIVERGED_FACTOR` times the untrained model's (where it was evaluated); None otherwise."""
    if not all(bool(torch.isfinite(p).all()) for p in params):
        return "diverged: the final parameters hold NaN or inf (lower optimizer.lr)"
    for key, value in final.items():
        if "loss" not in key or key.endswith("_std") or not isinstance(value, (int, float)):
            continue
        if not math.isfinite(value):
            return f"diverged: the final {key} is {value} (lower optimizer.lr)"
        ref = untrained.get(key, untrained.get(f"{key}_mean"))
        if isinstance(ref, (int, float)) and math.isfinite(ref) and ref > 0 and value > DIVERGED_FACTOR * ref:
            return (
                f"diverged: the final {key} = {value:.4g} is over {DIVERGED_FACTOR:g} times the untrained "
                f"model's {ref:.4g} (lower optimizer.lr)"
            )
    return None


def _params_digest(params) -> str:
    import hashlib

    h = hashlib.sha1()
    for p in params:
        h.update(p.detach().cpu().numpy().tobytes())
    return h.hexdigest()


def _plain(value):
    """A config node as plain Python (dicts, lists), anything else as it is."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    return (
        OmegaConf.to_container(value, resolve=True) if isinstance(value, (DictConfig, ListConfig)) else value
    )


def _to_dict(cfg) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg, resolve=True)
