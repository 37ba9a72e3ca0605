"""One folder per run, readable without W&B.

Layout of ``runs/<experiment>/<run_id>/``:

* ``config.yaml`` — the resolved config the run used;
* ``metrics.jsonl`` — one JSON object per logged step (``{"step": t, ...}``), without the ``diag/`` keys;
* ``private_diagnostics.jsonl`` — the ``diag/`` keys of the same steps (``{"step": t, "diag/...": ...}``, only steps
  that logged any): statistics computed on the private training examples (realised Poisson batch sizes, fractions
  clipped, per-example norm quantiles, clean-gradient moments), outside the accounted release. NOT private: it
  stays in the run folder, never goes to W&B unless ``logger.share_private_diagnostics=true``, and must not be
  shared. :meth:`RunRecord.metrics` merges it back by step, so reports read one row per step as before (and run
  folders written before the split, with ``diag/`` keys inside ``metrics.jsonl``, read the same);
* ``ledger.json`` — the privacy ledger;
* ``summary.json`` — written last, with ``status: complete``, final metrics, wall time, git commit, seed, and
  ``provenance`` (commit, package version, device, GPU, torch and CUDA versions, cores).

A folder without ``summary.json`` (or whose status is not ``complete``) is an incomplete run: the report lists it
and leaves it out of every table.

Run ids are deterministic (a readable prefix plus a hash of the config), so a relaunched sweep finds its own
folders and skips complete runs.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

IDENTITY_KEYS = (
    "task",
    "optimizer",
    "noise",
    "privacy",
    "train",
    "diagnostics",
    "seed",
    "experiment_name",
    "profile",
)
# train.* keys that change how a run is operated, not what it computes: relaunching with other values must find
# (and resume or skip) the same run folder
OPERATIONAL_TRAIN_KEYS = (
    "force",
    "threads",
    "stop_after",
    "resume",
    "checkpoint_every",
    "log_every",
    "eval_every",
    "eval_at_start",
    "distributed",  # data-parallel or not, the same result up to float summation order
    "self_check",  # a check before the first step: it changes nothing the run computes
    "engine_watch",  # the same checks as the run trains (engine/watch.py): they change nothing it computes
    "noise_check",  # stop or record on a noise mismatch (engine/noise_check.py): the same computation
    "moved_check",  # every trainable tensor moved (finetune/moved.py): a check, the same computation
    "post_processing_check",  # steps replayed behind the same release (engine/post_processing.py): same result
)
# train.* keys added after runs existed, at the value that computes what those runs computed: left out of the
# identity at that value, so that existing run folders keep their names (and resume, or are skipped as complete)
LATER_TRAIN_DEFAULTS = {"lr_schedule": "constant", "lr_warmup_steps": 0, "precision": "fp32"}
# optimizer.* keys added after runs existed (weight decay, issue 35), likewise left out at the value that decays
# nothing
LATER_OPTIMIZER_DEFAULTS = {
    "weight_decay": 0.0,
    "weight_decay_mode": "coupled",
    "decay_exclude": "bias_and_norm",
}

# task.* keys added after runs existed, likewise left out at the value that scores no more than those runs did
LATER_TASK_DEFAULTS = {"val_subset": None, "finetune": None, "finetune_args": {}}


def _without(section: dict, defaults: dict, drop=()) -> dict:
    """``section`` less the keys in ``drop`` and the later-added keys still at their ``defaults`` value."""
    return {k: v for k, v in section.items() if k not in drop and not (k in defaults and v == defaults[k])}


def run_identity(cfg: dict) -> dict:
    """The part of a config that determines a run's result."""
    ident = {k: cfg.get(k) for k in IDENTITY_KEYS}
    if hasattr(ident["task"], "items"):
        ident["task"] = _without(ident["task"], LATER_TASK_DEFAULTS)
    if hasattr(ident["optimizer"], "items"):
        ident["optimizer"] = _without(ident["optimizer"], LATER_OPTIMIZER_DEFAULTS)
    ident["train"] = _without(cfg.get("train") or {}, LATER_TRAIN_DEFAULTS, OPERATIONAL_TRAIN_KEYS)
    return ident


def identity_hash(cfg: dict) -> str:
    return hashlib.sha1(json.dumps(run_identity(cfg), sort_keys=True, default=str).encode()).hexdigest()


def run_id(cfg: dict) -> str:
    """Readable, deterministic id: ``<optimizer>-<noise>-lr<lr>-s<seed>-<hash of the identity keys>``."""
    digest = identity_hash(cfg)[:8]
    opt = cfg.get("optimizer", {}) or {}
    noise = cfg.get("noise", {}) or {}
    lr = opt.get("lr")
    lr_part = f"lr{lr:g}" if isinstance(lr, (int, float)) else "lrna"
    return f"{opt.get('name', 'opt')}-{noise.get('kind', 'noise')}-{lr_part}-s{cfg.get('seed', 0)}-{digest}"


#: the file a run's diagnostics computed on private examples go to (see the module docstring)
PRIVATE_DIAGNOSTICS_FILE = "private_diagnostics.jsonl"
METRICS_FILE = "metrics.jsonl"
#: metrics under this prefix are diagnostics computed on private examples: kept out of ``metrics.jsonl`` and W&B
PRIVATE_PREFIX = "diag/"


def is_private_key(key: str) -> bool:
    """Whether a logged metric is a diagnostic computed on private examples (a ``diag/`` key)."""
    return str(key).startswith(PRIVATE_PREFIX)


def split_private(metrics: dict) -> tuple[dict, dict]:
    """``(public, private)``: ``metrics`` less its ``diag/`` keys, and those keys."""
    public = {k: v for k, v in metrics.items() if not is_private_key(k)}
    private = {k: v for k, v in metrics.items() if is_private_key(k)}
    return public, private


def atomic_write_text(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` all at once: written to a temporary file in the same folder, flushed and
    fsynced, then renamed over ``path`` (``os.replace``), and the folder fsynced. A reader, or a writer killed
    half-way, sees the old file or the whole new one, never half of it. The new file keeps the old one's mode
    (0644 for a new file)."""
    path = Path(path)
    try:
        mode = path.stat().st_mode & 0o777
    except FileNotFoundError:
        mode = 0o644
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` durable (best effort: some file systems refuse to open a directory)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_jsonl(path: Path) -> list[dict]:
    """The JSON objects of a ``.jsonl`` file, one a line (blank lines skipped); [] when there is no file."""
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_metrics(folder: Path) -> list[dict]:
    """A run folder's logged rows, one per logged step: ``metrics.jsonl`` with each row's ``diag/`` keys from
    ``private_diagnostics.jsonl`` merged back in by step. Rows of the private file at a step ``metrics.jsonl`` does
    not have are not returned (every logged step writes its ``metrics.jsonl`` row first); a folder without the
    private file (written before the split) reads as its ``metrics.jsonl``."""
    folder = Path(folder)
    rows = read_jsonl(folder / METRICS_FILE)
    private = {r["step"]: r for r in read_jsonl(folder / PRIVATE_DIAGNOSTICS_FILE)}  # the last row of a step
    if not private:
        return rows
    return [{**r, **{k: v for k, v in private.get(r["step"], {}).items() if k != "step"}} for r in rows]


def json_safe(obj):
    """JSON-safe: tensors/arrays to lists, NaN/inf to None."""
    if hasattr(obj, "tolist"):
        obj = obj.tolist()
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


class RunLockedError(RuntimeError):
    """Another live process holds the run folder's lock: the same run is already running."""

    def __init__(self, path: Path, holder: dict | None):
        self.path, self.holder = Path(path), holder or {}
        if holder:
            started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(holder.get("started", 0))))
            who = f"pid {holder.get('pid')} on host {holder.get('host')}, started {started}"
        else:
            who = "a process that has not written its name yet"
        super().__init__(
            f"run folder {self.path} is locked by {who}: the same run is already running. Wait for it, or stop "
            "that process (a killed run releases the lock and can be resumed)."
        )


LOCK_FILE = ".lock"


class RunLock:
    """An exclusive ``fcntl.flock`` on ``<run folder>/.lock``, held for the life of a run.

    The kernel drops the lock when the process exits, however it exits, so a killed run never leaves a stale
    lock behind; the file itself stays (deleting it would let two processes lock two different files). The
    holder's pid, host and start time are written into the file so that a refused launch can name it.
    """

    def __init__(self, path: Path, fh):
        self.path, self._fh = Path(path), fh

    @classmethod
    def acquire(cls, folder: Path) -> RunLock:
        """Lock ``folder`` (created if missing), or raise :class:`RunLockedError` naming the holder."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        fh = open(folder / LOCK_FILE, "a+")  # noqa: SIM115 - kept open for the life of the lock
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            text = fh.read()
            fh.close()
            try:
                holder = json.loads(text) if text.strip() else None
            except json.JSONDecodeError:
                holder = None
            raise RunLockedError(folder, holder) from None
        fh.seek(0)
        fh.truncate()
        fh.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}))
        fh.flush()
        return cls(folder, fh)

    @staticmethod
    def check(folder: Path) -> None:
        """Raise :class:`RunLockedError` if a live process holds ``folder``'s lock; creates nothing. A fast look
        before a run's set-up: :meth:`acquire` still decides, after it."""
        try:
            fh = open(Path(folder) / LOCK_FILE)  # noqa: SIM115 - closed below, which drops a lock taken here
        except OSError:  # no lock file: never locked
            return
        with fh:
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                text = fh.read()
                try:
                    holder = json.loads(text) if text.strip() else None
                except json.JSONDecodeError:
                    holder = None
                raise RunLockedError(folder, holder) from None

    @property
    def held(self) -> bool:
        return self._fh is not None

    def release(self) -> None:
        """Unlock (idempotent). Closing the file releases the flock."""
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class RunFolder:
    """Writer for one run folder; holds the folder's :class:`RunLock` until :meth:`finish` or :meth:`close`."""

    def __init__(self, path: Path, lock: RunLock | None = None):
        self.path = Path(path)
        self.lock = lock
        self.start = time.time()
        self._logged = False  # whether this writer has logged a row yet

    @staticmethod
    def folder(root: Path, experiment: str, run: str) -> Path:
        """``<root>/<experiment>/<run id>``."""
        return Path(root) / experiment / run

    @classmethod
    def acquire(cls, root: Path, experiment: str, run: str) -> RunLock:
        """Lock the folder of run id ``run`` before anything is written to it (and before deciding whether the
        run is complete, so that the answer cannot change under the caller). Raises :class:`RunLockedError`
        when another process holds it."""
        return RunLock.acquire(cls.folder(root, experiment, run))

    @classmethod
    def create(cls, root: Path, experiment: str, cfg: dict, lock: RunLock | None = None) -> RunFolder:
        """Lock the run's folder (or take over ``lock``, from :meth:`acquire` on the same folder), then start the
        run in it: the old summary is removed and the config written."""
        path = cls.folder(root, experiment, run_id(cfg))
        if lock is None:
            lock = RunLock.acquire(path)
        elif lock.path != path or not lock.held:
            raise ValueError(
                f"the lock given is for {lock.path} (held: {lock.held}), not for the run folder {path}"
            )
        folder = cls(path, lock)
        # metrics.jsonl is kept: a resumed run truncates it to its checkpoint; a fresh start removes it
        (path / "summary.json").unlink(missing_ok=True)
        atomic_write_text(path / "config.yaml", yaml.safe_dump(cfg, sort_keys=False))
        return folder

    def log(self, step: int, metrics: dict) -> None:
        """Append one logged step: ``{"step": step, ...}`` less the ``diag/`` keys to ``metrics.jsonl`` (always, so
        that it has a row per logged step), and the ``diag/`` keys, if any, to ``private_diagnostics.jsonl``.

        ``metrics.jsonl`` is written first: a writer killed between the two leaves a step without its diagnostics,
        never diagnostics without their step. At this writer's first row, a private file beside no
        ``metrics.jsonl`` is left from an earlier attempt that this one does not resume (the trainer removes
        ``metrics.jsonl`` when it starts afresh and truncates both files when it resumes): it is removed."""
        public, private = split_private(metrics)
        if not self._logged:
            self._logged = True
            if not (self.path / METRICS_FILE).exists():
                (self.path / PRIVATE_DIAGNOSTICS_FILE).unlink(missing_ok=True)
        with open(self.path / METRICS_FILE, "a") as fh:
            fh.write(json.dumps(json_safe({"step": step, **public})) + "\n")
        if private:
            with open(self.path / PRIVATE_DIAGNOSTICS_FILE, "a") as fh:
                fh.write(json.dumps(json_safe({"step": step, **private})) + "\n")

    def write_json(self, name: str, payload: dict) -> None:
        """Write ``<folder>/<name>`` atomically (:func:`atomic_write_text`)."""
        atomic_write_text(self.path / name, json.dumps(json_safe(payload), indent=2))

    def finish(self, summary: dict, seed: int, device=None) -> dict:
        """Write ``summary.json`` (last) and release the lock. ``device``: what the run computed on, recorded with
        the commit, versions and cores under ``provenance`` (:mod:`dp_adam_bench.tracking.provenance`);
        ``git_commit`` repeats its commit at the top level, where earlier summaries have it."""
        from dp_adam_bench.tracking.provenance import provenance

        about = provenance(device)
        payload = {
            "status": "complete",
            "wall_time_s": time.time() - self.start,
            "git_commit": about["git_commit"],
            "seed": seed,
            **summary,
            "provenance": about,
        }
        self.write_json("summary.json", payload)  # last: its presence marks the run complete
        self.close()
        return payload

    def close(self) -> None:
        """Release the folder's lock (a failed run calls this too; finish() does it itself)."""
        if self.lock is not None:
            self.lock.release()

    def __enter__(self) -> RunFolder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class RunRecord:
    """A run read back from the store."""

    path: Path
    config: dict
    summary: dict | None

    @property
    def complete(self) -> bool:
        return bool(self.summary) and self.summary.get("status") == "complete"

    def metrics(self) -> list[dict]:
        """One row per logged step, the ``diag/`` keys merged back in (:func:`read_metrics`)."""
        return read_metrics(self.path)


def is_complete(path: Path) -> bool:
    f = Path(path) / "summary.json"
    if not f.exists():
        return False
    try:
        return json.loads(f.read_text()).get("status") == "complete"
    except json.JSONDecodeError:
        return False


def load_local_runs(root: Path, experiment: str) -> list[RunRecord]:
    """Every run folder of an experiment in the run store, complete or not."""
    base = Path(root) / experiment
    records = []
    if not base.is_dir():
        return records
    for cfg_file in sorted(base.glob("*/config.yaml")):
        folder = cfg_file.parent
        with open(cfg_file) as fh:
            cfg = yaml.safe_load(fh)
        summary = None
        if (folder / "summary.json").exists():
            try:
                summary = json.loads((folder / "summary.json").read_text())
            except json.JSONDecodeError:
                summary = None
        records.append(RunRecord(folder, cfg, summary))
    return records
