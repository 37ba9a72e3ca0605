"""Validation of a composed config: fail fast, naming the field, the bad value and what would be valid."""

from __future__ import annotations

from collections.abc import Mapping

NOISE_KINDS = ("none", "independent", "dpmf_sqrt", "bandmf", "blt")
SAMPLERS = ("single_pass", "poisson", "shuffle")
ENGINES = ("ghost", "hooks", "functorch", "loop", "bk")
PROFILES = ("cpu", "paper")


from dp_adam_bench.errors import ConfigError  # noqa: E402,F401  (re-exported: the historic import path)


def _num(cfg: Mapping, dotted: str):
    node = cfg
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            raise ConfigError(f"missing config field {dotted!r}")
        node = node[part]
    return node


def validate(cfg: Mapping) -> None:
    """Raise :class:`ConfigError` on the first invalid field."""
    from dp_adam_bench.optim.registry import VARIANTS
    from dp_adam_bench.tasks.registry import TASKS

    task = _num(cfg, "task.name")
    if task not in TASKS:
        raise ConfigError(f"task.name={task!r} is not a known task; valid: {', '.join(sorted(TASKS))}")
    opt = _num(cfg, "optimizer.name")
    if opt not in VARIANTS:
        raise ConfigError(
            f"optimizer.name={opt!r} is not a known variant; valid: {', '.join(sorted(VARIANTS))}"
        )
    lr = _num(cfg, "optimizer.lr")
    if not isinstance(lr, (int, float)) or not lr > 0:
        raise ConfigError(f"optimizer.lr={lr!r} must be a number > 0")
    kind = _num(cfg, "noise.kind")
    if kind not in NOISE_KINDS:
        raise ConfigError(f"noise.kind={kind!r} is not a known mechanism; valid: {', '.join(NOISE_KINDS)}")
    profile = cfg.get("profile", "cpu")
    if profile not in PROFILES:
        raise ConfigError(f"profile={profile!r}; valid: {', '.join(PROFILES)}")
    if kind != "none":
        sigma = _num(cfg, "privacy.sigma")
        target = cfg.get("privacy", {}).get("target_epsilon")
        if sigma is None:  # calibrated to privacy.target_epsilon over train.steps Poisson steps (Li et al.)
            steps = cfg.get("train", {}).get("steps")
            if target is None or _num(cfg, "train.sampler") != "poisson" or steps is None:
                raise ConfigError(
                    "privacy.sigma=null (calibrate sigma) needs privacy.target_epsilon, train.sampler=poisson "
                    f"and a fixed train.steps; got target_epsilon={target!r}, sampler={_num(cfg, 'train.sampler')!r}, "
                    f"steps={steps!r}"
                )
        elif not isinstance(sigma, (int, float)) or sigma < 0:
            raise ConfigError(
                f"privacy.sigma={sigma!r} must be a number >= 0 (the noise multiplier), or null to calibrate it "
                "to privacy.target_epsilon"
            )
        clip = _num(cfg, "privacy.clip")
        if clip is None or not isinstance(clip, (int, float)) or not clip > 0:
            raise ConfigError(
                f"privacy.clip={clip!r} must be a number > 0 for a private run (null clipping only with noise=none)"
            )
        delta = _num(cfg, "privacy.delta")
        if not isinstance(delta, (int, float)) or not 0 < delta < 1:
            raise ConfigError(f"privacy.delta={delta!r} must be in (0, 1)")
    sampler = _num(cfg, "train.sampler")
    if sampler not in SAMPLERS:
        raise ConfigError(f"train.sampler={sampler!r}; valid: {', '.join(SAMPLERS)}")
    bs = _num(cfg, "train.batch_size")
    if not isinstance(bs, (int, float)) or not bs > 0:
        raise ConfigError(f"train.batch_size={bs!r} must be > 0")
    clipping = cfg.get("train", {}).get("clipping", "ghost")
    if clipping not in ENGINES:
        raise ConfigError(f"train.clipping={clipping!r}; valid: {', '.join(ENGINES)}")
    if sampler in ("poisson", "shuffle") and kind not in ("none", "independent"):
        raise ConfigError(
            f"noise.kind={kind!r} with train.sampler={sampler}: correlated noise is accounted here only without "
            "amplification; use train.sampler=single_pass (cyclic batches, min-separation = steps per epoch)"
        )
    budget = cfg.get("privacy", {}).get("epsilon_budget")
    if budget is not None and (not isinstance(budget, (int, float)) or budget <= 0):
        raise ConfigError(f"privacy.epsilon_budget={budget!r} must be > 0 or null")
    if sampler in ("single_pass", "shuffle"):
        epochs = _num(cfg, "train.epochs")
        if not isinstance(epochs, int) or epochs < 1:
            raise ConfigError(f"train.epochs={epochs!r} must be an integer >= 1")
    else:
        steps = _num(cfg, "train.steps")
        target = cfg.get("privacy", {}).get("target_epsilon")
        if steps is None and target is not None:
            if not isinstance(target, (int, float)) or target <= 0:
                raise ConfigError(f"privacy.target_epsilon={target!r} must be > 0")
            if kind == "none" or not cfg["privacy"].get("sigma"):
                raise ConfigError(
                    "privacy.target_epsilon sets the number of steps only for a private run (sigma > 0)"
                )
        elif not isinstance(steps, int) or steps < 1:
            raise ConfigError(
                f"train.steps={steps!r} must be an integer >= 1 with train.sampler=poisson "
                "(or null with privacy.target_epsilon set)"
            )
    if kind == "bandmf":
        bands = _num(cfg, "noise.bands")
        if not isinstance(bands, int) or bands < 1:
            raise ConfigError(f"noise.bands={bands!r} must be an integer >= 1")
    if kind == "blt":
        buffers = _num(cfg, "noise.buffers")
        if not isinstance(buffers, int) or buffers < 1:
            raise ConfigError(f"noise.buffers={buffers!r} must be an integer >= 1")
    trials = cfg.get("task", {}).get("trials", 1)
    if not isinstance(trials, int) or trials < 1:
        raise ConfigError(f"task.trials={trials!r} must be an integer >= 1")


def resolve_sigma(cfg, n: int) -> float:
    """privacy.sigma, or — when it is null — the sigma that reaches privacy.target_epsilon after train.steps
    Poisson steps under privacy.accountant (Li et al. calibrate sigma to eps = 3 / 8 this way, under RDP)."""
    p = cfg.privacy
    if p.sigma is not None:
        return float(p.sigma)
    from dp_adam_bench.privacy.accounting import calibrate_sigma

    q = float(cfg.train.batch_size) / n
    return calibrate_sigma(
        float(p.target_epsilon), float(p.delta), q, int(cfg.train.steps), p.get("accountant", "rdp")
    )
