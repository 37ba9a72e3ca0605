"""Run an experiment preset's sweep: ``dp-adam-bench sweep <experiment> [--profile cpu|paper] [--launcher ...]``.

A preset (``configs/experiment/<name>.yaml``) declares its sweep as data, under one ``sweep:`` node that is not
part of any run's config (so it is not part of a run's id either)::

    sweep:
      entries:  {<label>: {<override key>: [values...], ...}, ...}  # each entry a Cartesian product; an entry
                                                                    # set to null is dropped (a preset that
                                                                    # extends another removes its entries so);
                                                                    # an entry with an empty value list runs
                                                                    # nothing (a profile can empty an entry)
      grid:     {<override key>: [values...]}                       # crossed with every entry
      seeds:    [0, 1, 2]                                           # optional; an entry may set its own `seed`
      selection: {metric: ..., mode: min|max, per: [...], tuned: [...]}   # what the reports select by
      profiles: {cpu: {...}, paper: {...}}   # the sweep's own per-profile values: ${sweep.profiles.${profile}.x}

Each entry becomes one Hydra multirun of ``dp_adam_bench.train``. Runs whose folders are complete are skipped by
the training entry point, so an interrupted sweep is finished by launching it again; a run another process is
training (its folder locked) is skipped with a line, and its siblings run.

Locally, ``basic`` runs one job at a time; ``joblib`` (``--jobs N``, ``--jobs-per-gpu k``) runs N at once, one GPU
per worker when the machine has GPUs (:mod:`dp_adam_bench.placement`).

A name that is not a preset, given overrides, is an *ad-hoc grid* (``dp-adam-bench sweep NAME key=a,b key2=c,d``):
one Hydra multirun of ``dp_adam_bench.train`` with ``experiment_name=NAME`` and the overrides (comma lists swept),
with the same launchers, progress and skipping of complete runs; ``dp-adam-bench report NAME`` then reads its runs
(:func:`adhoc_error` says which names are refused, and why).
"""

from __future__ import annotations

import itertools
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from dp_adam_bench.errors import ConfigError
from dp_adam_bench.paths import CONFIG_DIR
from dp_adam_bench.placement import LocalJobs, plan_local_jobs, visible_gpus

LAUNCHERS = ("basic", "joblib", "slurm")


def load_preset(experiment: str, profile: str = "cpu", overrides: Sequence[str] = ()) -> dict:
    """Compose the root config with ``experiment=<name>`` and return it as plain data, its ``sweep`` node
    resolved for ``profile`` (entries set to null removed)."""
    available = presets()
    if experiment not in available:
        raise ValueError(f"unknown experiment {experiment!r}; valid presets: {', '.join(available)}")
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[f"experiment={experiment}", f"profile={profile}", *overrides])
    data = OmegaConf.to_container(cfg, resolve=False)
    sweep = OmegaConf.to_container(cfg.sweep, resolve=True) if cfg.get("sweep") is not None else {}
    unknown = sorted(set(sweep) - set(SWEEP_KEYS))
    if unknown:
        raise ConfigError(
            f"sweep.{unknown[0]} in configs/experiment/{experiment}.yaml is not a sweep key; valid: "
            f"{', '.join(SWEEP_KEYS)}"
        )
    sweep["entries"] = {
        k: v
        for k, v in (sweep.get("entries") or {}).items()
        if v is not None and not any(isinstance(x, list) and not x for x in v.values())
    }
    data["sweep"] = sweep
    data["experiment_name"] = str(cfg.experiment_name)  # the run store folder / W&B group, for this profile
    return data


#: the keys of a preset's ``sweep:`` node
SWEEP_KEYS = ("entries", "grid", "seeds", "selection", "profiles")
SELECTION_KEYS = ("metric", "mode", "per", "tuned", "heldout_seeds")


@dataclass(frozen=True)
class Selection:
    """How a report picks a table cell from a tuning grid: within each group of runs equal in ``per``, the
    ``tuned`` setting with the best mean final ``metric`` (``mode`` min or max). Runs with a seed in
    ``heldout_seeds`` take no part in the choice: they score the chosen setting afresh (no winner's curse: a
    setting chosen on seeds that happened to do well is not also judged on them)."""

    metric: str
    mode: str
    per: tuple[str, ...]
    tuned: tuple[str, ...] = ()
    heldout_seeds: tuple[int, ...] = ()


@dataclass(frozen=True)
class SweepSpec:
    """A preset's ``sweep:`` node for one profile, resolved."""

    experiment: str
    profile: str
    name: str  # the runs' experiment_name: their run store folder and W&B group
    entries: dict[str, dict]
    grid: dict
    seeds: list | None
    selection: Selection | None

    def points(self) -> list[dict]:
        """Every run of the sweep as ``{override key: value}`` (seed included when the sweep sets one), in the
        order the multiruns launch them."""
        out = []
        for entry in (self.entries or {"all": {}}).values():
            keys = ({"seed": self.seeds} if self.seeds is not None else {}) | {**entry, **self.grid}
            values = [v if isinstance(v, list) else [v] for v in keys.values()]
            out += [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*values)]
        return out


def sweep_spec(experiment: str, profile: str = "cpu") -> SweepSpec:
    """The preset's sweep for ``profile``; a bad ``selection`` fails naming the key and the valid ones."""
    preset = load_preset(experiment, profile)
    sweep = preset["sweep"]
    selection = sweep.get("selection")
    if selection is not None:
        where = f"sweep.selection of configs/experiment/{experiment}.yaml"
        unknown = sorted(set(selection) - set(SELECTION_KEYS))
        if unknown or "metric" not in selection or "per" not in selection:
            raise ConfigError(
                f"{where} = {selection!r}: needs metric and per (optional: mode, tuned, heldout_seeds); valid keys: "
                f"{', '.join(SELECTION_KEYS)}"
            )
        mode = selection.get("mode", "min")
        if mode not in ("min", "max"):
            raise ConfigError(f"{where}: mode={mode!r}; valid: min, max")
        heldout = selection.get("heldout_seeds") or ()
        if not isinstance(heldout, list | tuple) or not all(
            isinstance(x, int) and not isinstance(x, bool) for x in heldout
        ):
            raise ConfigError(f"{where}: heldout_seeds={heldout!r}; valid: a list of whole-number seeds")
        selection = Selection(
            str(selection["metric"]),
            mode,
            tuple(selection["per"]),
            tuple(selection.get("tuned") or ()),
            tuple(heldout),
        )
    return SweepSpec(
        experiment=experiment,
        profile=profile,
        name=preset["experiment_name"],
        entries=sweep["entries"],
        grid=sweep.get("grid") or {},
        seeds=sweep.get("seeds"),
        selection=selection,
    )


def override_value(x) -> str:
    return "null" if x is None else str(x)


def _values(v) -> str:
    return ",".join(override_value(x) for x in (v if isinstance(v, list) else [v]))


def _override(key: str, value, keys: dict) -> str:
    """``key=v1,v2`` (a Hydra sweep) or ``key=v``. A single value of a key inside a config group that is itself
    swept (``optimizer.eps_s=1e-4`` with ``optimizer=ime,bc``) is written as ``choice(v)``: Hydra applies plain
    overrides to the *default* group option before sweeping, which may not have that key."""
    group = key.split(".", 1)[0]
    values = value if isinstance(value, list) else [value]
    swept_group = "." in key and isinstance(keys.get(group), list) and len(keys[group]) > 1
    if len(values) == 1 and swept_group:
        return f"{key}=choice({override_value(values[0])})"
    return f"{key}={_values(value)}"


def cores() -> int:
    """CPU cores this process may use (its affinity, e.g. a container's or a SLURM allocation's share)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def resolve_launcher(launcher: str | None, jobs: int | None = None, jobs_per_gpu: int | None = None) -> str:
    """The launcher a sweep uses: the one given, else ``joblib`` when ``--jobs`` / ``--jobs-per-gpu`` is given,
    else ``basic``; a job count the launcher cannot honour is refused in one line."""
    if launcher is not None and launcher not in LAUNCHERS:
        raise ValueError(f"unknown launcher {launcher!r}; valid: {', '.join(LAUNCHERS)}")
    counted = jobs is not None or jobs_per_gpu is not None
    if launcher is None:
        return "joblib" if counted else "basic"
    if launcher == "basic" and (jobs_per_gpu is not None or (jobs is not None and jobs != 1)):
        flag = f"--jobs {jobs}" if jobs is not None else f"--jobs-per-gpu {jobs_per_gpu}"
        raise ConfigError(
            f"{flag} with --launcher basic, which runs one job at a time: use --launcher joblib"
        )
    if launcher == "slurm" and counted:
        raise ConfigError(
            "--jobs / --jobs-per-gpu place jobs on this machine; with --launcher slurm every job is a SLURM task "
            "with its own GPU (hydra.launcher.gpus_per_node), at most hydra.launcher.array_parallelism at once"
        )
    return launcher


def local_jobs(jobs: int | None = None, jobs_per_gpu: int | None = None) -> LocalJobs:
    """The joblib parallelism of a local sweep on this machine (:func:`dp_adam_bench.placement.plan_local_jobs`
    with this machine's visible GPUs and cores)."""
    return plan_local_jobs(jobs, jobs_per_gpu, visible_gpus(), cores())


def sweep_commands(
    experiment: str,
    profile: str = "cpu",
    launcher: str = "basic",
    overrides: Sequence[str] = (),
    local: LocalJobs | None = None,
) -> list[list[str]]:
    """The ``python -m dp_adam_bench.train -m ...`` command lines that make up the sweep. ``local``: the joblib
    launcher's workers and threads per run (default: :func:`local_jobs`); with GPU slots the commands also need
    ``local.env()``."""
    if launcher not in LAUNCHERS:
        raise ValueError(f"unknown launcher {launcher!r}; valid: {', '.join(LAUNCHERS)}")
    spec = sweep_spec(experiment, profile)
    sweeps, grid, seeds = spec.entries or {"all": {}}, spec.grid, spec.seeds
    given = {
        o.split("=", 1)[0].lstrip("+") for o in overrides if "=" in o
    }  # the user's keys replace swept ones
    commands = []
    for entry in sweeps.values():
        args = [f"experiment={experiment}", f"profile={profile}"]
        keys = {**entry, **grid}
        args += [_override(k, v, keys) for k, v in keys.items() if k not in given]
        if seeds is not None and "seed" not in given and "seed" not in entry:
            args.append(f"seed={_values(seeds)}")
        args += _launcher_args(launcher, local, given)
        commands.append([python_executable(), "-m", "dp_adam_bench.train", "-m", *args, *overrides])
    return commands


def _launcher_args(launcher: str, local: LocalJobs | None, given: set[str]) -> list[str]:
    """The overrides that pick the multirun's launcher (joblib: its workers, and one torch thread count per run
    unless the user gave ``train.threads``)."""
    if launcher == "joblib":
        local = local or local_jobs()
        args = ["hydra/launcher=joblib", f"hydra.launcher.n_jobs={local.jobs}"]
        return args + ([f"train.threads={local.threads}"] if "train.threads" not in given else [])
    return ["hydra/launcher=slurm"] if launcher == "slurm" else []


def presets() -> list[str]:
    """The experiment presets (``configs/experiment/<name>.yaml``), sorted."""
    return sorted(p.stem for p in (CONFIG_DIR / "experiment").glob("*.yaml"))


def is_preset(experiment: str) -> bool:
    return experiment in presets()


#: the profile a run gets when none is given (configs/config.yaml): an ad-hoc grid's command names another only
ROOT_PROFILE = "cpu"
#: an example of an ad-hoc grid, for the refusals
ADHOC_EXAMPLE = "task=logistic_1d optimizer=sgd,adambc seed=0,1"


def _override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def preset_folder_names() -> dict[str, str]:
    """{run store folder: the preset whose runs live there} for every preset and profile: its ``experiment_name``
    as the preset's file writes it, ``${profile}`` filled in (every preset names its folder so; tested against the
    composed config)."""
    import yaml

    out = {}
    for name in presets():
        data = yaml.safe_load((CONFIG_DIR / "experiment" / f"{name}.yaml").read_text()) or {}
        folder = data.get("experiment_name")
        for profile in ("cpu", "paper"):
            if isinstance(folder, str):
                out.setdefault(folder.replace("${profile}", profile), name)
    return out


def adhoc_error(name: str, overrides: Sequence[str]) -> str | None:
    """Why ``sweep NAME overrides`` is not an ad-hoc grid, in one line that says what to do; None when it is
    (``name`` is not a preset). Refused: no config overrides (nothing says what to run); a name that is not a run
    store folder name (``a=b``: the grid's name was left out); the folder of a preset's runs (the grid's runs
    would mix with the preset's in its reports); a report table id or group (``report NAME`` would build that
    table, not the grid's); ``experiment_name=`` among the overrides (NAME is the grid's experiment_name)."""
    from dp_adam_bench.report import registry

    example = f"dp-adam-bench sweep {name if _plain_name(name) else 'my_grid'} {ADHOC_EXAMPLE}"
    if "=" in name:
        return (
            f"{name!r} is an override, not a name: an ad-hoc grid is named first ({example}); the presets: "
            f"{', '.join(presets())}"
        )
    if not _plain_name(name):
        return (
            f"{name!r} cannot name an ad-hoc grid's run folder (runs/<name>/): use letters, digits, '-', '_' and "
            f"'.', not starting with '_' or '.' ({example})"
        )
    config = [o for o in overrides if not _is_hydra_override(o)]
    if not config:
        return (
            f"unknown experiment {name!r} and no overrides to sweep: give the grid's overrides to sweep an ad-hoc "
            f"grid named {name} ({example}), or name a preset: {', '.join(presets())}"
        )
    owner = preset_folder_names().get(name)
    if owner is not None:
        return (
            f"{name!r} is the run folder of preset {owner}'s runs: an ad-hoc grid of that name would mix its runs "
            f"with the preset's; name the grid otherwise, or run the preset: dp-adam-bench sweep {owner}"
        )
    if name in registry.GROUPS or name in registry.REPORTS:
        return (
            f"{name!r} is a report table (dp-adam-bench report {name} would build that table, not this grid's): "
            "name the grid otherwise"
        )
    named = [o for o in config if _override_key(o) == "experiment_name"]
    if named:
        return f"{named[0]!r}: an ad-hoc grid's runs are named by the sweep's NAME ({name}); leave it out"
    return None


def _plain_name(name: str) -> bool:
    import re

    return bool(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name))


def adhoc_commands(
    name: str,
    profile: str = ROOT_PROFILE,
    launcher: str = "basic",
    overrides: Sequence[str] = (),
    local: LocalJobs | None = None,
) -> list[list[str]]:
    """The one ``python -m dp_adam_bench.train -m experiment_name=NAME ...`` command of an ad-hoc grid (the
    overrides as given, comma lists swept by Hydra), with the launcher's overrides as :func:`sweep_commands` adds
    them; ``profile=`` only when it is not the root config's. Refused as :func:`adhoc_error` says."""
    if launcher not in LAUNCHERS:
        raise ValueError(f"unknown launcher {launcher!r}; valid: {', '.join(LAUNCHERS)}")
    bad = adhoc_error(name, overrides)
    if bad:
        raise ConfigError(bad)
    given = {_override_key(o) for o in overrides if "=" in o}
    args = [f"experiment_name={name}"]
    if profile != ROOT_PROFILE and "profile" not in given:
        args.append(f"profile={profile}")
    args += _launcher_args(launcher, local, given)
    return [[python_executable(), "-m", "dp_adam_bench.train", "-m", *args, *overrides]]


def python_executable() -> str:
    """The interpreter a sweep launches its runs with: this one (``python`` if Python cannot tell)."""
    return sys.executable or "python"


def shell_line(cmd: Sequence[str]) -> str:
    """A command as one line a POSIX shell runs as is (every argument quoted where it needs to be)."""
    return shlex.join(cmd)


def override_error(experiment: str, profile: str, overrides: Sequence[str]) -> str | None:
    """Why the preset's config (an ad-hoc grid's: the root config) does not compose with the sweep's extra config
    overrides, in the training entry point's one line (:func:`dp_adam_bench.train.compose_error`: the override,
    and what is valid); None when it composes. A swept override (``optimizer=adam,sgd``) is checked at each of its
    values."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    from dp_adam_bench.train import compose_error

    config = [o for o in overrides if not _is_hydra_override(o)]
    if not config:
        return None
    try:
        (jobs,) = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(config), None)
    except HydraException:
        return compose_error(config)  # names the override that does not parse
    preset = [f"experiment={experiment}"] if is_preset(experiment) else []  # else an ad-hoc grid's name
    for job in jobs:
        err = compose_error([*preset, f"profile={profile}", *job])
        if err:
            return err
    return None


def _is_hydra_override(override: str) -> bool:
    return override.lstrip("+~").startswith(("hydra.", "hydra/"))


def slurm_launcher_params(experiment: str, profile: str = "cpu", overrides: Sequence[str] = ()) -> dict:
    """The ``hydra.launcher`` config the submitit SLURM launcher will get for this preset, resolved: Hydra's own
    composition (``return_hydra_config=True``, ``hydra/launcher=slurm``), with the user's ``hydra.*`` overrides.

    ``hydra.job.name`` is set to ``train``, the name Hydra gives the job of ``python -m dp_adam_bench.train``;
    ``submitit_folder`` holds the sweep folder's timestamp, which a real launch takes at its own start.
    """
    preset = [f"experiment={experiment}"] if is_preset(experiment) else []  # else an ad-hoc grid's name
    if preset:
        load_preset(experiment, profile)  # a preset that does not compose fails in one line
    hydra_overrides = [o for o in overrides if _is_hydra_override(o)]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(
            "config",
            overrides=[
                *preset,
                f"profile={profile}",
                "hydra/launcher=slurm",
                "hydra.job.name=train",
                *hydra_overrides,
            ],
            return_hydra_config=True,
        )
    return OmegaConf.to_container(cfg.hydra.launcher, resolve=True)


def count_jobs(command: Sequence[str]) -> int:
    """Jobs one multirun command launches: the product of its sweep overrides' lengths, parsed as Hydra's basic
    sweeper parses them (``a=1,2``, ``range(...)``, ``choice(...)``)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    args = list(command)
    args = args[args.index("-m") + 1 :] if "-m" in args else args
    n = 1
    for override in OverridesParser.create().parse_overrides([a for a in args if "=" in a]):
        if override.is_sweep_override() and not override.key_or_group.startswith("hydra"):
            n *= len(list(override.sweep_string_iterator()))
    return n


def sbatch_lines(launcher_params: dict, n_jobs: int) -> list[str]:
    """The ``#SBATCH`` lines submitit writes for a job array of ``n_jobs`` with these launcher params.

    The same translation as the submitit launcher (hydra's generic names to submitit's slurm ones, memory in GB
    to sbatch's unit) and submitit's own sbatch writer, so the dry run shows what the cluster will be asked for.
    """
    from submitit.slurm.slurm import SlurmExecutor, _convert_mem, _make_sbatch_string

    params = {k: v for k, v in launcher_params.items() if k not in ("_target_", "max_num_timeout")}
    folder = params.pop("submitit_folder")
    renames = SlurmExecutor._equivalence_dict()
    slurm = {renames.get(k) or k: v for k, v in params.items()}
    if slurm.get("mem") is not None:
        slurm["mem"] = _convert_mem(slurm["mem"])
    script = _make_sbatch_string(
        command="<submitit runs the job>", folder=folder, map_count=n_jobs if n_jobs > 1 else None, **slurm
    )
    return [line for line in script.splitlines() if line.startswith("#SBATCH")]


# The launcher settings a reader checks first, in this order; the rest follow alphabetically.
_SLURM_KEYS = (
    "partition",
    "account",
    "qos",
    "nodes",
    "tasks_per_node",
    "gpus_per_node",
    "cpus_per_task",
    "mem_gb",
    "timeout_min",
    "array_parallelism",
    "submitit_folder",
)


def slurm_plan(
    experiment: str, profile: str, commands: Sequence[Sequence[str]], overrides: Sequence[str] = ()
) -> str:
    """Text for ``sweep --launcher slurm --dry-run``: the composed launcher settings (the main ones always, the
    others when set), the sbatch header submitit will write, and the job array of each multirun command."""
    params = slurm_launcher_params(experiment, profile, overrides)
    keys = [k for k in _SLURM_KEYS if k in params]
    keys += sorted(
        k for k in params if k not in _SLURM_KEYS and k != "_target_" and params[k] not in (None, {}, [])
    )
    what = f"experiment={experiment}" if is_preset(experiment) else f"the ad-hoc grid {experiment},"
    lines = [f"SLURM launcher (hydra.launcher composed for {what} profile={profile}):"]
    lines += [f"  {k}: {override_value(params[k])}" for k in keys]
    if not params.get("partition"):
        lines.append("  (partition null: the cluster's default partition; set hydra.launcher.partition=...)")
    counts = [count_jobs(cmd) for cmd in commands]
    header = [line for line in sbatch_lines(params, max(counts)) if not line.startswith("#SBATCH --array=")]
    lines.append("sbatch header submitit writes (each multirun command is one job array; the sweep folder's")
    lines.append("timestamp is taken when the sweep starts):")
    lines += [f"  {line}" for line in header]
    for i, n in enumerate(counts, 1):
        array = [line for line in sbatch_lines(params, n) if line.startswith("#SBATCH --array=")]
        lines.append(f"  command {i}: {n} job{'s' if n != 1 else ''}" + (f", {array[0]}" if array else ""))
    return "\n".join(lines)


def run_sweep(
    experiment: str,
    profile: str = "cpu",
    launcher: str | None = "basic",
    overrides: Sequence[str] = (),
    dry_run: bool = False,
    jobs: int | None = None,
    jobs_per_gpu: int | None = None,
) -> int:
    """Run (or, ``dry_run``, print) the sweep's multirun commands (an ad-hoc grid's one command when
    ``experiment`` is not a preset, :func:`adhoc_commands`); the first that fails stops the sweep with its
    exit code. With joblib and more than one worker the commands run side by side, packed onto the workers
    (:mod:`dp_adam_bench.packing`), else one after the other. ``launcher`` None: joblib when ``jobs`` /
    ``jobs_per_gpu`` is given, else basic."""
    launcher = resolve_launcher(launcher, jobs, jobs_per_gpu)
    local = local_jobs(jobs, jobs_per_gpu) if launcher == "joblib" else None
    adhoc = not is_preset(experiment)
    build = adhoc_commands if adhoc else sweep_commands
    commands = build(experiment, profile, launcher, overrides, local=local)
    env = local.env() if local is not None else {}
    if local is not None:
        where = f"one GPU per worker, slots {','.join(local.gpu_slots)}" if local.gpu_slots else "on the CPU"
        print(f"joblib: {local.jobs} runs at once, {local.threads} torch thread(s) each, {where}", flush=True)
    if dry_run and launcher == "slurm":
        print(slurm_plan(experiment, profile, commands, overrides), flush=True)
    packed = not dry_run and local is not None and local.jobs > 1 and len(commands) > 1
    if packed:  # composing every run's config takes ~0.1 s a run: say why nothing starts yet
        print(f"sweep {experiment}: counting the pending runs of {len(commands)} multiruns ...", flush=True)
    elif adhoc and not dry_run and count_jobs(commands[0]) > 20:
        print(f"sweep {experiment}: counting the pending runs of the grid ...", flush=True)
    # an ad-hoc grid's runs are its command's jobs, worked out before launching: all complete, nothing launches
    per_command = [command_runs([cmd]) for cmd in commands] if packed or (adhoc and not dry_run) else None
    tracker = None if dry_run else _sweep_progress(experiment, profile, commands, overrides, per_command)
    prefix = "".join(f"{k}={shlex.quote(v)} " for k, v in env.items())
    forced = any(_override_key(o) == "train.force" for o in overrides)  # the runs decide: they may rerun
    try:
        if (
            tracker is not None
            and (all(_is_hydra_override(o) for o in overrides) or adhoc and not forced)
            and tracker.done == tracker.total
        ):
            print(  # every run of the preset is complete: no multirun launched just to skip each one
                f"sweep {experiment}: all {tracker.total} runs are complete, nothing to launch "
                "(train.force=true reruns them)",
                flush=True,
            )
            return 0
        if packed:
            return _run_packed(commands, per_command, local.jobs, env, prefix)
        for cmd in commands:
            print("+ " + prefix + shell_line(cmd), flush=True)
            if dry_run:
                continue
            rc = subprocess.run(cmd, check=False, env={**os.environ, **env} if env else None).returncode
            if rc != 0:
                print(f"sweep command failed with exit code {rc}", file=sys.stderr)
                return rc
    finally:
        if tracker is not None:
            tracker.stop()
    return 0


def _run_packed(commands, per_command, workers: int, env: dict, prefix: str) -> int:
    """The commands side by side on ``workers`` workers, each given as many as it has pending runs
    (:func:`dp_adam_bench.packing.run_packed`)."""
    from dp_adam_bench.packing import Entry, run_packed
    from dp_adam_bench.paths import runs_dir

    pending = [len(runs) - _counter(runs_dir(), runs)() for runs in per_command]
    entries = [Entry(tuple(cmd), n) for cmd, n in zip(commands, pending, strict=True)]

    def start(cmd):
        print("+ " + prefix + shell_line(cmd), flush=True)
        return subprocess.Popen(cmd, env={**os.environ, **env} if env else None)

    rc = run_packed(entries, workers, start)
    if rc != 0:
        print(
            f"sweep command failed with exit code {rc} (the commands already running were let finish)",
            file=sys.stderr,
        )
    return rc


def _sweep_progress(
    experiment: str,
    profile: str,
    commands: Sequence[Sequence[str]],
    overrides: Sequence[str],
    per_command: Sequence[set] | None = None,
):
    """Runs done / total across all the sweep's multirun commands (:class:`~dp_adam_bench.progress.SweepProgress`),
    counted in the run store, runs completed by an earlier launch included. With the preset's runs (no config
    overrides) the run ids are the preset's (:func:`expected_runs`); with config overrides they are the commands'
    own (:func:`command_runs`), worked out in the tracker's thread while the runs start (a second or two).
    ``per_command``: the commands' runs, already worked out."""
    from dp_adam_bench.paths import runs_dir
    from dp_adam_bench.progress import SweepProgress

    root = runs_dir()
    what = f"sweep {experiment}"
    if per_command is not None:
        runs = set().union(*per_command)
        return SweepProgress(len(runs), _counter(root, runs), what=what).start()
    if all(_is_hydra_override(o) for o in overrides):
        name, ids = expected_runs(experiment, profile)
        return SweepProgress(len(ids), _counter(root, {(name, rid) for rid in ids}), what=what).start()

    def setup():
        _lowest_priority()  # the composing waits for the runs, not the runs for it
        runs = command_runs(commands)
        return len(runs), _counter(root, runs)

    return SweepProgress(None, None, what=what, setup=setup).start()


def _lowest_priority() -> None:
    """The calling thread at nice 19 (Linux sets priorities per thread); elsewhere nothing."""
    import threading

    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass


def _counter(root, runs: set[tuple[str, str]]):
    """How many of the runs ``(experiment_name, run id)`` under ``root`` are complete (a callable)."""
    from dp_adam_bench.tracking.run_store import RunFolder, is_complete

    folders = [RunFolder.folder(root, name, rid) for name, rid in sorted(runs)]
    return lambda: sum(is_complete(f) for f in folders)


def command_runs(commands: Sequence[Sequence[str]]) -> set[tuple[str, str]]:
    """(experiment_name, run id) of every job the multirun commands launch, as the training entry point names them:
    each command's overrides expanded as Hydra's basic sweeper expands them (the cross product of its swept keys, a
    key given twice taking its last value), each job composed (~0.1 s) and named by run_config + run_id."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from dp_adam_bench.tracking.run_store import run_id
    from dp_adam_bench.train import run_config

    parser = OverridesParser.create()
    runs = set()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        for cmd in commands:
            args = [a for a in cmd if "=" in a and not _is_hydra_override(a)]
            (jobs,) = BasicSweeper.split_arguments(parser.parse_overrides(args), None)
            for job in jobs:
                data = run_config(compose("config", overrides=job))
                runs.add((data["experiment_name"], run_id(data)))
    return runs


def expected_runs(experiment: str, profile: str = "cpu") -> tuple[str, set[str]]:
    """(experiment_name, run ids) of every run the preset's sweep consists of, as the training entry point names
    them (the same compose + run_config + run_id path)."""
    from dp_adam_bench.tracking.run_store import run_id

    ids, name = set(), None
    points = sweep_spec(experiment, profile).points()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        for point in points:
            data = _point_config(experiment, profile, point)
            ids.add(run_id(data))
            name = data["experiment_name"]
    return name, ids


def _point_config(experiment: str, profile: str, point: dict) -> dict:
    """The run config of one sweep point (inside an ``initialize_config_dir`` of :data:`CONFIG_DIR`)."""
    from dp_adam_bench.train import run_config

    overrides = [f"experiment={experiment}", f"profile={profile}"]
    overrides += [f"{k}={override_value(v)}" for k, v in point.items()]
    return run_config(compose("config", overrides=overrides))


def runs_folder_name(experiment: str, profile: str = "cpu") -> str:
    """The ``experiment_name`` (the run store's folder) of the preset's runs, :func:`expected_runs`' name, from its
    first sweep point's config alone (a preset's points share it; composing all of them takes ~0.1 s each)."""
    point = sweep_spec(experiment, profile).points()[0]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return _point_config(experiment, profile, point)["experiment_name"]


def set_aside_stale_runs(experiment: str, profile: str = "cpu", root: Path | None = None) -> list[Path]:
    """Move run folders of the experiment that the current preset no longer produces (an older grid, an older
    config) to ``<experiment_name>/_stale/``, so that reports aggregate exactly the preset's runs. Nothing is
    deleted."""
    from dp_adam_bench.paths import runs_dir

    name, ids = expected_runs(experiment, profile)
    base = Path(root or runs_dir()) / name
    moved = []
    for cfg_file in sorted(base.glob("*/config.yaml")):
        folder = cfg_file.parent
        if folder.name not in ids:
            target = base / "_stale" / folder.name
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.exists():
                shutil.rmtree(target)
            shutil.move(str(folder), str(target))
            moved.append(target)
    return moved
