"""W&B adapter: the same metrics as ``metrics.jsonl``, offline by default.

What does not go to W&B (W&B dashboards are shared): the ``diag/`` keys, statistics computed on the private
training examples outside the accounted release (the realised Poisson batch size, a count of sensitivity 1; the
fraction clipped; per-example norm quantiles; clean-gradient moments), and the summary's ``self_check``,
``engine_probe`` and ``engine_watch`` records (floating-point errors of the clipping engine measured on private
examples, :data:`PRIVATE_SUMMARY_KEYS`). The run folder keeps them (``private_diagnostics.jsonl``,
``summary.json``). ``share_private_diagnostics=True`` (``logger.share_private_diagnostics=true``) sends them too, for
a project whose dashboards only its owner reads.

Settings (:func:`resolve_settings`): a value set in the config (``logger.wandb.*``) is used as given; for a field
left null the standard W&B environment variable wins over our default:

* mode: ``WANDB_MODE`` (``online``, ``offline``, ``disabled``; W&B's ``dryrun`` / ``run`` mean offline / online;
  ``WANDB_DISABLED=true`` means disabled), else ``online`` when ``WANDB_API_KEY`` is set and ``offline`` when not
  (without a key, ``wandb.init`` in its default mode fails at once with a UsageError, see docs/pitfalls.md);
* project: ``WANDB_PROJECT``, else ``dp-adam-bench``; entity: ``WANDB_ENTITY``, else W&B's default;
* W&B's files: ``WANDB_DIR``, else the run folder.

Labels (:func:`run_labels`), so that the W&B UI and the saved dashboard (``configs/wandb/dashboard.yaml``) can slice
a sweep without reading configs:

* ``group`` = the experiment name: one sweep is one W&B group, and a report's experiment is that group;
* ``job_type`` = ``<optimizer>+<mechanism>``: W&B can group by one run attribute per panel, and the headline
  comparison is optimizer x noise mechanism;
* ``tags`` = experiment, task, optimizer, mechanism (noise kind) and profile, for the run table's tag filter.

At the end the run's summary mirrors ``summary.json`` (status, metrics, trials, epsilon per accountant, steps,
privacy notes...; less its private records, above), both as top-level keys for the UI and, losslessly, as one JSON
string under :data:`SUMMARY_JSON_KEY`: with the config and the history, a W&B run alone rebuilds the run store's
``RunRecord`` (:mod:`dp_adam_bench.tracking.wandb_source`), so reports can read runs made on another machine;
without its ``diag/`` keys unless they were shared (the W&B reader says so when a report reads such runs).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from dp_adam_bench.tracking.run_store import split_private

# The summary.json of the run, verbatim, in the W&B summary (nested W&B summary values are not guaranteed to come
# back from the API exactly as written, a JSON string is).
SUMMARY_JSON_KEY = "run_summary_json"
#: summary.json records computed on private examples (engine/self_check.py, engine/probe.py, engine/watch.py; and
#: of ``participation`` only its verdict goes to W&B, its counts describing the private sampling): not
#: sent to W&B unless private diagnostics are shared
PRIVATE_SUMMARY_KEYS = ("self_check", "engine_probe", "engine_watch")
# W&B refuses tags and job types longer than this.
_MAX_LABEL = 64


DEFAULT_PROJECT = "dp-adam-bench"
MODES = ("offline", "online", "disabled")
# W&B's older names for the modes
_MODE_ALIASES = {"dryrun": "offline", "run": "online"}


def resolve_mode(mode: str | None) -> str:
    """``mode`` if set; else ``$WANDB_MODE`` (or ``$WANDB_DISABLED``); else online with an API key, offline without."""
    if mode:
        if mode not in MODES:
            raise ValueError(f"logger.wandb.mode must be offline, online or disabled, got {mode!r}")
        return mode
    env = os.environ.get("WANDB_MODE", "").strip().lower()
    if env:
        env = _MODE_ALIASES.get(env, env)
        if env not in MODES:
            raise ValueError(
                f"WANDB_MODE={os.environ['WANDB_MODE']!r} in the environment; valid: offline, online, disabled "
                "(or unset it)"
            )
        return env
    if os.environ.get("WANDB_DISABLED", "").strip().lower() in ("1", "true", "yes"):
        return "disabled"
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


def resolve_settings(
    *, mode: str | None, project: str | None, entity: str | None, run_dir: str | os.PathLike
) -> dict:
    """``mode``, ``project``, ``entity`` and ``dir`` for ``wandb.init``: config values as given, null ones from the
    standard W&B environment variables, else our defaults (the module docstring lists them)."""
    return {
        "mode": resolve_mode(mode),
        "project": project or os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT,
        "entity": entity or os.environ.get("WANDB_ENTITY") or None,
        "dir": os.environ.get("WANDB_DIR") or str(run_dir),
    }


def run_labels(config: dict) -> dict:
    """W&B ``group``, ``job_type`` and ``tags`` of a resolved run config (see the module docstring)."""
    experiment = str(config.get("experiment_name") or "adhoc")
    task = str((config.get("task") or {}).get("name", "task"))
    optimizer = str((config.get("optimizer") or {}).get("name", "optimizer"))
    mechanism = str((config.get("noise") or {}).get("kind", "noise"))
    profile = str(config.get("profile") or "cpu")
    tags = []
    for tag in (experiment, task, optimizer, mechanism, profile):
        if tag[:_MAX_LABEL] not in tags:
            tags.append(tag[:_MAX_LABEL])
    return {"group": experiment, "job_type": f"{optimizer}+{mechanism}"[:_MAX_LABEL], "tags": tags}


class WandbLogger:
    """One W&B run beside one run folder (``run_dir``, which also holds W&B's files)."""

    def __init__(
        self,
        *,
        run_dir: Path,
        name: str,
        config: dict,
        mode: str | None,
        group: str | None = None,
        tags: list[str] | None = None,
        project: str | None = None,
        entity: str | None = None,
        share_private_diagnostics: bool = False,
    ):
        """``group`` and ``tags`` default to :func:`run_labels`; tags given are kept, the standard ones added;
        ``mode``, ``project``, ``entity``: see :func:`resolve_settings`. ``share_private_diagnostics``: also send
        the ``diag/`` keys and the summary's private records (the module docstring); off by default."""
        if not isinstance(share_private_diagnostics, bool):
            raise ValueError(
                f"logger.share_private_diagnostics must be true or false, got {share_private_diagnostics!r}"
            )
        self.share_private_diagnostics = share_private_diagnostics
        self.settings = resolve_settings(mode=mode, project=project, entity=entity, run_dir=run_dir)
        self.mode = self.settings["mode"]
        self.run_dir = Path(run_dir)
        self.run = None
        if self.mode == "disabled":
            return
        import wandb

        labels = run_labels(config)
        all_tags = [t[:_MAX_LABEL] for t in (tags or [])]
        all_tags += [t for t in labels["tags"] if t not in all_tags]
        os.environ.setdefault("WANDB_SILENT", "true")
        self.run = wandb.init(
            project=self.settings["project"],
            entity=self.settings["entity"],
            name=name,
            group=group or labels["group"],
            job_type=labels["job_type"],
            tags=all_tags,
            config=config,
            dir=self.settings["dir"],
            mode=self.mode,
            reinit="finish_previous",
        )

    def shared(self, metrics: dict) -> dict:
        """What of ``metrics`` goes to W&B: all of it when private diagnostics are shared, else the non-``diag/``
        keys."""
        return dict(metrics) if self.share_private_diagnostics else split_private(metrics)[0]

    def shared_summary(self, payload: dict) -> dict:
        """``payload`` (a run summary) as W&B receives it: without :data:`PRIVATE_SUMMARY_KEYS` and the ``diag/``
        keys of its ``metrics``, unless private diagnostics are shared."""
        if self.share_private_diagnostics:
            return dict(payload)
        out = {k: v for k, v in payload.items() if k not in PRIVATE_SUMMARY_KEYS}
        if isinstance(
            out.get("participation"), dict
        ):  # its counts (pairs drawn: the realised batch sizes added
            # up, never-sampled examples, the rate test's observed rate) are statistics of the private sampling
            out["participation"] = {"verdict": out["participation"].get("verdict")}
        if isinstance(out.get("metrics"), dict):
            out["metrics"] = self.shared(out["metrics"])
        return self.shared(out)

    def log(self, step: int, metrics: dict) -> None:
        """Log one step's metrics, less what is not shared (:meth:`shared`); nothing when that leaves nothing."""
        if self.run is not None:
            shared = self.shared(metrics)
            if shared:
                self.run.log(shared, step=step)

    def summary(self, values: dict) -> None:
        """Set W&B summary keys, less what is not shared (:meth:`shared_summary`)."""
        if self.run is not None:
            for k, v in self.shared_summary(values).items():
                self.run.summary[k] = v

    def _mirror_run_summary(self) -> None:
        """Copy the run folder's ``summary.json`` into the W&B summary, if the run wrote one.

        Read from the folder, not passed in, so that W&B carries exactly what the run store holds: a run that
        failed before ``summary.json`` gets no ``status`` in W&B either, and is incomplete in both. Less what is
        not shared (:meth:`shared_summary`): then the JSON string is the shared part, re-serialised.
        """
        path = self.run_dir / "summary.json"
        if not path.exists():
            return
        try:
            text = path.read_text()
            payload = json.loads(text)
        except (OSError, json.JSONDecodeError):
            return
        shared = self.shared_summary(payload)
        self.summary(shared)
        self.run.summary[SUMMARY_JSON_KEY] = text if shared == payload else json.dumps(shared, indent=2)

    def finish(self) -> None:
        if self.run is not None:
            self._mirror_run_summary()
            self.run.finish()
            self.run = None

    @property
    def run_path(self) -> str | None:
        return None if self.run is None else self.run.dir
