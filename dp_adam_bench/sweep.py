"""Run an experiment preset's sweep: ``dp-adam-bench sweep <experiment> [--profile cpu|paper] [--launcher ...]``.

A preset (``configs/experiment/<name>.yaml``) declares its sweep as data:

    sweeps:   {<label>: {<override key>: [values...], ...}, ...}   # each entry a Cartesian product; an entry
                                                                  # set to null is dropped (a preset that
                                                                  # extends another removes its entries so)
    grid:     {<override key>: [values...]}                         # crossed with every entry
    seeds:    [0, 1, 2]                                             # optional

Each entry becomes one Hydra multirun of ``dp_adam_bench.train``. Runs whose folders are complete are skipped by
the training entry point, so an interrupted sweep is finished by launching it again.
"""

from __future__ import annotations

import itertools
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from dp_adam_bench.paths import CONFIG_DIR

LAUNCHERS = ("basic", "joblib", "slurm")


def load_preset(experiment: str, profile: str = "cpu", overrides: Sequence[str] = ()) -> dict:
    """Compose the root config with ``experiment=<name>`` and return it as plain data."""
    available = sorted(p.stem for p in (CONFIG_DIR / "experiment").glob("*.yaml"))
    if experiment not in available:
        raise ValueError(f"unknown experiment {experiment!r}; valid presets: {', '.join(available)}")
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[f"experiment={experiment}", f"profile={profile}", *overrides])
    data = OmegaConf.to_container(cfg, resolve=False)
    # The sweep's own keys may depend on the profile (e.g. ``seeds: ${profiles.${profile}.seeds}``): resolve them.
    for key in ("sweeps", "grid", "seeds"):
        if cfg.get(key) is not None:
            data[key] = OmegaConf.to_container(cfg[key], resolve=True)
    if data.get(
        "sweeps"
    ):  # entries set to null are removed (a preset extending another drops its entries so)
        data["sweeps"] = {k: v for k, v in data["sweeps"].items() if v is not None}
    return data


def _value(x) -> str:
    return "null" if x is None else str(x)


def _values(v) -> str:
    return ",".join(_value(x) for x in (v if isinstance(v, list) else [v]))


def sweep_commands(
    experiment: str, profile: str = "cpu", launcher: str = "basic", overrides: Sequence[str] = ()
) -> list[list[str]]:
    """The ``python -m dp_adam_bench.train -m ...`` command lines that make up the sweep."""
    if launcher not in LAUNCHERS:
        raise ValueError(f"unknown launcher {launcher!r}; valid: {', '.join(LAUNCHERS)}")
    preset = load_preset(experiment, profile)
    sweeps = preset.get("sweeps") or {"all": {}}
    grid = preset.get("grid") or {}
    seeds = preset.get("seeds")
    given = {
        o.split("=", 1)[0].lstrip("+") for o in overrides if "=" in o
    }  # the user's keys replace swept ones
    commands = []
    for entry in sweeps.values():
        args = [f"experiment={experiment}", f"profile={profile}"]
        args += [f"{k}={_values(v)}" for k, v in {**entry, **grid}.items() if k not in given]
        if seeds is not None and "seed" not in given:
            args.append(f"seed={_values(seeds)}")
        if launcher == "joblib":
            args += ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "train.threads=1"]
        elif launcher == "slurm":
            args += ["hydra/launcher=slurm"]
        commands.append([sys.executable, "-m", "dp_adam_bench.train", "-m", *args, *overrides])
    return commands


def run_sweep(
    experiment: str,
    profile: str = "cpu",
    launcher: str = "basic",
    overrides: Sequence[str] = (),
    dry_run: bool = False,
) -> int:
    for cmd in sweep_commands(experiment, profile, launcher, overrides):
        print("+ " + " ".join(cmd[1:]), flush=True)
        if dry_run:
            continue
        rc = subprocess.run(cmd, check=False).returncode
        if rc != 0:
            print(f"sweep command failed with exit code {rc}", file=sys.stderr)
            return rc
    return 0


def expected_runs(experiment: str, profile: str = "cpu") -> tuple[str, set[str]]:
    """(experiment_name, run ids) of every run the preset's sweep consists of, as the training entry point names
    them (the same compose + run_config + run_id path)."""
    from dp_adam_bench.tracking.run_store import run_id
    from dp_adam_bench.train import run_config

    preset = load_preset(experiment, profile)
    sweeps = preset.get("sweeps") or {"all": {}}
    grid = preset.get("grid") or {}
    seeds = preset.get("seeds")
    ids, name = set(), None
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        for entry in sweeps.values():
            keys = {**entry, **grid} | ({"seed": seeds} if seeds is not None else {})
            values = [v if isinstance(v, list) else [v] for v in keys.values()]
            for combo in itertools.product(*values):
                overrides = [f"experiment={experiment}", f"profile={profile}"]
                overrides += [f"{k}={_value(v)}" for k, v in zip(keys, combo, strict=True)]
                data = run_config(compose("config", overrides=overrides))
                ids.add(run_id(data))
                name = data["experiment_name"]
    return name, ids


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
