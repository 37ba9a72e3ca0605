"""What the pretraining kinds share: the cache location, file names, checks of numeric preset values, the device a
build runs on, and the checkpoint a build resumes from."""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

from dp_adam_bench.errors import ConfigError
from dp_adam_bench.paths import CONFIG_DIR, cache_dir  # noqa: F401 - cache_dir is re-exported

PRESET_DIR = CONFIG_DIR / "pretrain"
CHECKPOINT = "checkpoint.pt"
SUMMARY = "summary.json"
# keys that change how a pretraining run is watched, not the model it makes (left out of the cache key)
# (``device``: a GPU build equals the CPU one up to float rounding, as train.device leaves a run's identity alone)
OPERATIONAL_KEYS = (
    "log_every",
    "eval_every",
    "checkpoint_every",
    "val_blocks",
    "encode_batch_size",
    "wandb",
    "device",
)
KINDS = ("gpt2_clm", "bert_mlm_head")


class Interrupted(RuntimeError):
    """Raised by a trainer with ``stop_after``: the build stopped after a checkpoint (how tests kill a build)."""


def check_numbers(spec: dict, positive: tuple, nonneg: tuple, positive_floats: tuple, unit: tuple) -> None:
    """ConfigError naming the first key whose value is not an integer >= 1 (``positive``), >= 0 (``nonneg``), a
    finite number > 0 (``positive_floats``) or in [0, 1] (``unit``); NaN fails every check."""
    name = spec.get("name", "?")
    for key in positive + nonneg:
        v = spec.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < (1 if key in positive else 0):
            need = ">= 1" if key in positive else ">= 0"
            raise ConfigError(f"pretrain {name}: {key} must be an integer {need}, got {v!r}")
    for key in positive_floats:
        v = spec.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ConfigError(f"pretrain {name}: {key} must be a finite number > 0, got {v!r}")
    for key in unit:
        v = spec.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 <= v <= 1:
            raise ConfigError(f"pretrain {name}: {key} must be in [0, 1], got {v!r}")


DEVICES = "auto, cpu, cuda, cuda:<index>"


def resolve_device(spec: dict):
    """The torch device of a build: the preset's ``device`` with ``train.device``'s meaning (``auto``: CUDA when
    available, else CPU; :func:`dp_adam_bench.engine.trainer.resolve_device`). ConfigError naming the field for
    anything else, or for a CUDA device this machine does not have."""
    import torch

    from dp_adam_bench.engine.trainer import resolve_device as resolve

    name, value = spec.get("name", "?"), spec.get("device", "auto")
    if not isinstance(value, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?", value):
        raise ConfigError(f"pretrain {name}: device must be one of {DEVICES}, got {value!r}")
    try:
        device = resolve(value)
    except ConfigError:  # its message names train.device
        raise ConfigError(
            f"pretrain {name}: device={value!r} but no CUDA device is available; use device=cpu or auto"
        ) from None
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(
            f"pretrain {name}: device={value!r} but this machine has {torch.cuda.device_count()} CUDA device(s)"
        )
    return device


def save_checkpoint(folder: Path, step: int, model, opt) -> None:
    """The state a build resumes from: step, trainable state, optimizer and torch RNG, the CUDA one too when the
    model is on a GPU (written atomically)."""
    import torch

    state = {
        "step": step,
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "rng": torch.get_rng_state(),
    }
    device = next(model.parameters()).device
    if device.type == "cuda":
        state["cuda_rng"] = torch.cuda.get_rng_state(device)
    tmp = folder / f".{CHECKPOINT}.tmp"
    torch.save(state, tmp)
    tmp.replace(folder / CHECKPOINT)


def load_checkpoint(folder: Path, model, opt) -> int:
    """The step of ``folder``'s checkpoint, its state loaded into ``model`` and ``opt`` on the model's device (0:
    none); a file that cannot be read is a ConfigError naming it."""
    import torch

    path = folder / CHECKPOINT
    if not path.is_file():
        return 0
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])  # torch moves its state to the parameters' device
        torch.set_rng_state(state["rng"])
        device = next(model.parameters()).device
        if device.type == "cuda" and "cuda_rng" in state:
            torch.cuda.set_rng_state(state["cuda_rng"], device)
        return int(state["step"])
    except Exception as err:  # a torn or foreign file: say which and how to start over
        raise ConfigError(
            f"pretraining checkpoint {path} cannot be read ({type(err).__name__}: {str(err).splitlines()[0]}); "
            "delete it to start the pretraining over"
        ) from err


def truncate_metrics(path: Path, step: int) -> None:
    """Drop logged rows past ``step`` (a resumed run logs them again)."""
    if not path.is_file():
        return
    rows = [r for r in path.read_text().splitlines() if r.strip() and json.loads(r)["step"] <= step]
    path.write_text("".join(r + "\n" for r in rows))


def finite(spec: dict, loss: float, step: int) -> float:
    """``loss``, or a RuntimeError when it is NaN or infinite (a build must not save a diverged model)."""
    if not math.isfinite(loss):
        raise RuntimeError(f"pretrain {spec['name']}: loss {loss} at step {step}; lower lr")
    return loss


class BuildLog:
    """What every kind's build records: ``metrics.jsonl`` and W&B (as a training run), the progress bar (or lines),
    the checkpoint schedule (and a test's simulated kill, ``stop_after``), and at the end the ``model/`` folder and
    the summary, written last, with the build's provenance (``device``: the device it trained on)."""

    def __init__(self, spec: dict, folder: Path, start: int, stop_after: int | None, t0: float, device):
        from dp_adam_bench import progress
        from dp_adam_bench.tracking.run_store import RunFolder
        from dp_adam_bench.tracking.wandb_logger import WandbLogger

        self.spec, self.folder, self.start, self.stop_after, self.t0 = spec, folder, start, stop_after, t0
        self.device = device
        self.steps = int(spec["steps"])
        truncate_metrics(folder / "metrics.jsonl", start)
        self.run = RunFolder(folder)
        self.wandb = WandbLogger(
            run_dir=folder,
            name=folder.name,
            config={"experiment_name": "pretrain", "task": {"name": spec["name"]}, "pretrain": spec},
            mode=(spec.get("wandb") or {}).get("mode"),
            tags=["pretrain"],
        )
        self.bar = progress.Progress(self.steps, start, what=f"pretrain {spec['name']}")

    def log(self, step: int, row: dict) -> None:
        if row:
            self.run.log(step, row)
            self.wandb.log(step, row)

    def after_step(self, done: int, row: dict, model, opt) -> None:
        """Log ``row`` (may be empty), move the bar, checkpoint when due; raise :class:`Interrupted` at
        ``stop_after`` once its checkpoint is written."""
        self.log(done, row)
        self.bar.update(done, row, bool(row))
        every = int(self.spec["checkpoint_every"])
        due = every and done % every == 0 and done < self.steps
        if due or done == self.stop_after:
            save_checkpoint(self.folder, done, model, opt)
        if done == self.stop_after:
            raise Interrupted(f"stopped after step {done}")

    def finish(self, model, tokenizer, summary: dict) -> dict:
        """Save ``model`` and ``tokenizer`` into ``model/``, then the summary (its presence marks the build
        complete), and drop the checkpoint."""
        import shutil

        from dp_adam_bench.tracking.provenance import provenance

        out = self.folder / "model"
        shutil.rmtree(out, ignore_errors=True)
        model.to("cpu").save_pretrained(out)  # CPU tensors: the folder loads the same on any machine
        tokenizer.save_pretrained(out)
        spec = self.spec
        about = provenance(self.device)
        summary = {
            "status": "complete",
            "name": spec["name"],
            "kind": spec["kind"],
            "spec": spec,
            **summary,
            "resumed_from_step": self.start or None,
            "wall_time_s_this_session": time.time() - self.t0,
            "git_commit": about["git_commit"],
            "command": f"dp-adam-bench pretrain {spec['name']}",
            "provenance": about,
        }
        self.run.write_json(SUMMARY, summary)
        (self.folder / CHECKPOINT).unlink(missing_ok=True)
        return summary

    def close(self) -> None:
        self.bar.close()
        self.wandb.finish()
