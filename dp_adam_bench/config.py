"""Validation of a composed config: fail fast, naming the field, the bad value and what would be valid.

Every numeric field is checked with :func:`math.isfinite` as well as its range: ``x < 0`` is False for NaN, and a
NaN sigma once trained with no noise while the run was recorded as private. The lists of valid names come from the
registries (variants, noise mechanisms, tasks, clipping engines, accountants), never from a copy kept here.
Checks that need the data set (a batch larger than it) or the model (a noise mechanism's memory) are made by the
privacy plan (:mod:`dp_adam_bench.engine.plan`), still before anything is written.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from dp_adam_bench.engine.samplers import SAMPLERS
from dp_adam_bench.errors import ConfigError
from dp_adam_bench.optim.schedule import SCHEDULES

#: samplers that fit correlated noise (DP-MF): their participations are accounted with the strategy
MF_SAMPLERS = ("single_pass", "cyclic_poisson", "balls_in_bins")
PROFILES = ("cpu", "paper")
PRECISIONS = ("fp32", "bf16")  # train.precision (model tasks): bf16 = autocast of the forward and backward
DISTRIBUTED = ("auto", "off")
WANDB_MODES = (None, "offline", "online", "disabled")
#: the top-level keys of a run's config (configs/config.yaml and its groups); any other, e.g. ``+foo=1``, is refused
ROOT_KEYS = (
    "task",
    "optimizer",
    "noise",
    "privacy",
    "logger",
    "experiment_name",
    "profile",
    "seed",
    "train",
    "diagnostics",
    "paths",
    "sweep",  # an experiment preset's sweep and per-profile values: not part of a run (train.run_config drops them)
    "profiles",
)
#: the largest seed: torch and numpy take seeds of at most 64 bits
SEED_MAX = 2**63 - 1
#: the largest noise multiplier: beyond it, noise of std sigma C / B buries any gradient (epsilon ~ 0), and its
#: variance, which bias-correcting variants subtract, overflows float32 near sigma C / B = 1e19
SIGMA_MAX = 1e6

_MISSING = object()


def _get(cfg: Mapping, dotted: str, default=_MISSING):
    node = cfg
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            if default is not _MISSING:
                return default
            raise ConfigError(f"missing config field {dotted!r}")
        node = node[part]
    return node


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def number(
    cfg: Mapping,
    dotted: str,
    *,
    low=None,
    high=None,
    low_open=False,
    high_open=False,
    null=False,
    default=_MISSING,
):
    """A finite number in the given range (``null`` allows None); returns it."""
    v = _get(cfg, dotted, default)
    if v is None and null:
        return None
    lo = "" if low is None else f"{'>' if low_open else '>='} {low:g}"
    hi = "" if high is None else f"{'<' if high_open else '<='} {high:g}"
    want = (
        "a finite number"
        + (f" {lo}" if lo else "")
        + (" and" if lo and hi else "")
        + (f" {hi}" if hi else "")
    )
    if null:
        want += " or null"
    if not _is_number(v) or not math.isfinite(v):
        raise ConfigError(f"{dotted}={v!r} must be {want}")
    if low is not None and (v <= low if low_open else v < low):
        raise ConfigError(f"{dotted}={v!r} must be {want}")
    if high is not None and (v >= high if high_open else v > high):
        raise ConfigError(f"{dotted}={v!r} must be {want}")
    return v


def integer(
    cfg: Mapping, dotted: str, *, low: int = 1, high: int | None = None, null: bool = False, default=_MISSING
):
    """An integer >= ``low`` (and <= ``high``; ``null`` allows None); a float such as 2.7 is refused, never
    truncated."""
    v = _get(cfg, dotted, default)
    if v is None and null:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < low or (high is not None and v > high):
        raise ConfigError(
            f"{dotted}={v!r} must be an integer >= {low}"
            + (f" and <= {high}" if high is not None else "")
            + (" or null" if null else "")
        )
    return v


def boolean(cfg: Mapping, dotted: str, default=False) -> bool:
    v = _get(cfg, dotted, default)
    if not isinstance(v, bool):
        raise ConfigError(f"{dotted}={v!r} must be true or false")
    return v


def choice(cfg: Mapping, dotted: str, valid, default=_MISSING):
    v = _get(cfg, dotted, default)
    if v not in valid:
        raise ConfigError(f"{dotted}={v!r}; valid: {', '.join(str(x) for x in valid)}")
    return v


def validate(cfg: Mapping, *, custom_task: bool = False) -> None:
    """Raise :class:`ConfigError` on the first invalid field (or combination of fields). ``custom_task``: the task
    is a user's own objects (:func:`dp_adam_bench.make_private`), not a registered task name."""
    _validate_top_level(cfg, custom_task)
    _validate_optimizer(cfg)
    kind, noise = _validate_noise(cfg)
    sampler = choice(cfg, "train.sampler", SAMPLERS.names())
    _validate_training_options(cfg)
    _validate_accounting(cfg, kind, sampler, noise)
    _validate_schedule(cfg, sampler, noise.private)
    _validate_engine_and_machine(cfg)
    _validate_logger(cfg)


def _validate_top_level(cfg: Mapping, custom_task: bool) -> None:
    """No key outside :data:`ROOT_KEYS`; the seed, the profile, the task's name and trials."""
    from dp_adam_bench.tasks.registry import TASKS

    unknown = sorted(str(k) for k in cfg if k not in ROOT_KEYS)
    if unknown:
        raise ConfigError(
            f"{unknown[0]}={cfg[unknown[0]]!r} is not a config field; valid top-level fields: {', '.join(ROOT_KEYS)}"
        )
    integer(cfg, "seed", low=0, high=SEED_MAX)
    choice(cfg, "profile", PROFILES, default="cpu")
    if not custom_task:
        TASKS.check(_get(cfg, "task.name"))
    integer(cfg, "task.trials", default=1)
    from dp_adam_bench.finetune import parse

    parse(_get(cfg, "task.finetune", None))
    args = _get(cfg, "task.finetune_args", None)
    if args is not None and not isinstance(args, Mapping):
        raise ConfigError(
            f"task.finetune_args={args!r} must be a mapping of the method's settings, e.g. {{r: 8}}"
        )


def _validate_optimizer(cfg: Mapping) -> None:
    """The variant's name, then every hyper-parameter: a field of that variant, a finite number (or null or a
    string where the variant allows one), and through the variant's own checks (its constructor)."""
    from dp_adam_bench.optim.registry import VARIANTS

    opt = _get(cfg, "optimizer")
    VARIANTS.check(_get(cfg, "optimizer.name"))
    number(cfg, "optimizer.lr", low=0, low_open=True)
    fields = variant_fields(VARIANTS.get(opt["name"]))
    for key, value in opt.items():
        if key == "name":
            continue
        if key not in fields:
            raise ConfigError(
                f"optimizer.{key}={value!r} is not a field of optimizer.name={opt['name']!r}; valid: "
                f"{', '.join(sorted(fields))} (to switch variants, choose the group: optimizer=<name>)"
            )
        if value is None or (isinstance(value, str) and isinstance(fields[key], str)):
            continue  # null where the variant allows it (it says so); a string where its default is one
        if not _is_number(value) or not math.isfinite(value):
            raise ConfigError(f"optimizer.{key}={value!r} must be a finite number")
    try:
        VARIANTS.get(opt["name"])(**{k: v for k, v in opt.items() if k != "name"})
    except ConfigError:
        raise
    except (ValueError, TypeError) as err:
        raise ConfigError(str(err) if "optimizer." in str(err) else f"optimizer: {err}") from err


def _validate_noise(cfg: Mapping) -> tuple[str, object]:
    """The noise mechanism's name and its own fields (and any mechanism's memory cap); returns the name and the
    mechanism."""
    from dp_adam_bench.privacy.noise_factory import NOISE

    kind = NOISE.check(_get(cfg, "noise.kind"))
    noise = NOISE.get(kind)
    noise.validate(_get(cfg, "noise"))
    number(
        cfg, "noise.max_memory_gb", low=0, low_open=True, null=True, default=None
    )  # any mechanism's buffers
    return kind, noise


def _validate_training_options(cfg: Mapping) -> None:
    """The learning-rate schedule, the precision (with the clipping engine it needs), the engine's self-check and
    watch, and what the noise check does."""
    choice(cfg, "train.lr_schedule", SCHEDULES, default="constant")
    integer(cfg, "train.lr_warmup_steps", low=0, default=0)
    precision = choice(cfg, "train.precision", PRECISIONS, default="fp32")
    if precision != "fp32" and _get(cfg, "train.clipping", "bk") != "bk":
        raise ConfigError(
            f"train.precision={precision} is implemented for train.clipping=bk (norms, clip factors and sums in "
            f"fp32 from bf16 activations); got train.clipping={_get(cfg, 'train.clipping')}; use bk or fp32"
        )
    integer(cfg, "train.moved_check", low=0, default=3)
    boolean(cfg, "train.self_check.enabled", default=True)
    integer(cfg, "train.self_check.examples", low=1, default=4)
    number(cfg, "train.self_check.tolerance", low=0, low_open=True, default=0.01)
    every = _get(cfg, "train.engine_watch.every", "auto")
    if every != "auto":
        integer(cfg, "train.engine_watch.every", low=0, default=0)
    number(cfg, "train.engine_watch.budget", low=0, high=1, default=0.02)
    boolean(cfg, "train.post_processing_check.enabled", default=True)
    every = _get(cfg, "train.post_processing_check.every", "auto")
    if every != "auto":
        integer(cfg, "train.post_processing_check.every", low=0, default=0)
    number(cfg, "train.post_processing_check.budget", low=0, high=1, default=0.02)
    choice(cfg, "train.noise_check", ("stop", "record"), default="stop")


def _validate_accounting(cfg: Mapping, kind: str, sampler: str, noise) -> None:
    """The accountant's name and the RNG; a private mechanism's privacy fields (:func:`_validate_privacy`)."""
    from dp_adam_bench.privacy.accounting import ACCOUNTANTS

    ACCOUNTANTS.check(_get(cfg, "privacy.accountant", "rdp"))
    boolean(cfg, "privacy.secure_rng")
    if noise.private:
        _validate_privacy(cfg, kind, sampler, noise.correlated)


def _validate_schedule(cfg: Mapping, sampler: str, private: bool) -> None:
    """The batch size and the length of the run in the sampler's terms: steps for Poisson and cyclic Poisson
    (Poisson: null with a target epsilon, train until it), full passes for the fixed-size samplers."""
    cycle = integer(cfg, "train.cycle_length", null=True, default=None)
    if cycle is not None and sampler != "cyclic_poisson":
        raise ConfigError(
            f"train.cycle_length={cycle!r} is only used by train.sampler=cyclic_poisson (got {sampler}); "
            "set it to null (balls_in_bins has N // train.batch_size bins)"
        )
    if sampler == "poisson":
        number(cfg, "train.batch_size", low=0, low_open=True)
        steps = integer(cfg, "train.steps", null=True)
        if steps is None and not (private and _get(cfg, "privacy.target_epsilon", None) is not None):
            raise ConfigError(
                "train.steps=None must be an integer >= 1 with train.sampler=poisson (or null with "
                "privacy.target_epsilon set on a private run: train until that epsilon)"
            )
    elif sampler == "cyclic_poisson":
        number(cfg, "train.batch_size", low=0, low_open=True)
        integer(cfg, "train.steps")
    else:
        integer(cfg, "train.batch_size")
        integer(cfg, "train.epochs")
        steps = _get(cfg, "train.steps", None)
        if steps is not None:
            raise ConfigError(
                f"train.steps={steps!r} is set, but train.sampler={sampler} runs train.epochs full passes; "
                "set train.steps=null (or use train.sampler=poisson)"
            )


def _validate_engine_and_machine(cfg: Mapping) -> None:
    """The clipping engine, micro-batches, logging, evaluation and checkpoint intervals, diagnostics, the device
    and processes, side information and the run's flags."""
    from dp_adam_bench.engine.engines import ENGINES

    ENGINES.check(_get(cfg, "train.clipping", "bk"))
    integer(cfg, "train.physical_batch_size")
    integer(cfg, "train.log_every")
    for field in ("eval_every", "checkpoint_every"):
        integer(cfg, f"train.{field}", low=0, default=0)
    integer(cfg, "train.stop_after", null=True, default=None)
    integer(cfg, "train.threads", null=True, default=None)
    integer(cfg, "diagnostics.every", low=0, default=0)
    number(cfg, "diagnostics.reference_sigma", low=0, null=True, default=None)
    number(cfg, "diagnostics.reference_clip", low=0, low_open=True, null=True, default=None)
    choice(cfg, "train.distributed", DISTRIBUTED, default="auto")
    _validate_device(cfg)
    integer(cfg, "train.side_info.public_examples", default=1000)
    integer(cfg, "train.side_info.batch_size", default=256)
    for flag in ("force", "resume", "eval_at_start"):
        boolean(cfg, f"train.{flag}")


def _validate_device(cfg: Mapping) -> None:
    """``train.device``: auto, cpu, cuda or cuda:<index>, a CUDA one only where CUDA is available."""
    device = _get(cfg, "train.device", "auto")
    if not isinstance(device, str) or not (device in ("auto", "cpu") or device.startswith("cuda")):
        raise ConfigError(f"train.device={device!r}; valid: auto, cpu, cuda, cuda:<index>")
    if device.startswith("cuda"):
        from dp_adam_bench.engine.trainer import resolve_device

        resolve_device(device)  # ConfigError when no CUDA device is available


def _validate_logger(cfg: Mapping) -> None:
    mode = _get(cfg, "logger.wandb.mode", None)
    if mode not in WANDB_MODES:
        raise ConfigError(
            f"logger.wandb.mode={mode!r}; valid: null (offline unless a key is set), offline, online, "
            "disabled"
        )


def variant_fields(cls) -> dict:
    """``{field: default}`` of an optimizer variant: the keyword arguments of every ``__init__`` along its classes
    (a subclass passes the rest on to its base), ``lr`` included; the default is None where there is none."""
    import inspect

    fields: dict = {}
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None or klass is object:
            continue
        for name, param in inspect.signature(init).parameters.items():
            if name != "self" and param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
                default = None if param.default is inspect.Parameter.empty else param.default
                fields.setdefault(name, default)
    return fields


def _validate_privacy(cfg: Mapping, kind: str, sampler: str, correlated: bool) -> None:
    sigma = number(cfg, "privacy.sigma", low=0, high=SIGMA_MAX, null=True)
    number(cfg, "privacy.clip", low=0, low_open=True)
    delta = number(cfg, "privacy.delta", low=0, high=1, low_open=True, high_open=True)
    from dp_adam_bench.privacy.accounting.checks import check_meaningful_delta

    try:  # delta >= 1/2 is refused: the guarantee means nothing (privacy/accounting/checks.py)
        check_meaningful_delta(delta)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    budget = number(cfg, "privacy.epsilon_budget", low=0, low_open=True, null=True, default=None)
    target = number(cfg, "privacy.target_epsilon", low=0, low_open=True, null=True, default=None)
    steps = _get(cfg, "train.steps", None)
    if sigma == 0:
        raise ConfigError(
            f"privacy.sigma=0 with noise={kind} adds no noise but would be recorded as private; use noise=none for "
            "a non-private run, or a sigma > 0"
        )
    if correlated and sampler not in MF_SAMPLERS:
        default = " (the root config's default when noise= is not given)" if kind == "dpmf_sqrt" else ""
        raise ConfigError(
            f"noise.kind={kind!r} with train.sampler={sampler}: {kind}{default} is correlated noise, which this "
            "sampler cannot account for. Either use noise=independent for DP-SGD with this sampler, or keep the "
            "correlated noise with a "
            "sampler that fits it: train.sampler=cyclic_poisson (amplified with noise=bandmf, cycle length >= "
            "bands; Choquette-Choo et al. 2023, arXiv:2306.08153), single_pass (cyclic fixed-size batches, "
            "min-separation = steps per epoch) or balls_in_bins"
        )
    if sigma is None:  # calibrated to privacy.target_epsilon over a fixed schedule (Li et al.)
        fixed = steps is not None or sampler in ("single_pass", "balls_in_bins")
        if target is None or sampler == "shuffle" or not fixed:
            raise ConfigError(
                "privacy.sigma=null (calibrate sigma) needs privacy.target_epsilon, a sampler the accountant "
                "models (poisson, cyclic_poisson, single_pass, balls_in_bins; not shuffle) and a fixed schedule "
                f"(train.steps for poisson / cyclic_poisson); got target_epsilon={target!r}, "
                f"sampler={sampler!r}, steps={steps!r}"
            )
    elif target is not None and not (sampler == "poisson" and steps is None):
        raise ConfigError(
            f"privacy.target_epsilon={target!r} with privacy.sigma={sigma!r} and a fixed schedule would be ignored: "
            "set train.steps=null (Poisson) to train until it, privacy.sigma=null to calibrate sigma to it, or use "
            "privacy.epsilon_budget to cap this schedule"
        )
    if budget is not None and target is not None:
        raise ConfigError(
            f"privacy.epsilon_budget={budget!r} and privacy.target_epsilon={target!r}: set one (the target already "
            "bounds the run)"
        )
