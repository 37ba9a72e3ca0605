"""Non-private pretraining of the starting points a CPU machine lacks: ``dp-adam-bench pretrain <preset>``.

A preset is ``configs/pretrain/<name>.yaml``; its ``kind`` picks the trainer:

* ``gpt2_clm`` (:mod:`.gpt2_clm`): a small GPT-2 trained with the causal LM loss on public text (the arXiv
  abstracts), the starting point of the CPU ``li_e2e`` table (Li et al. 2022, arXiv:2110.05679, fine-tune
  pretrained GPT-2; no GPT-2 weights exist offline);
* ``bert_mlm_head`` (:mod:`.mlm_head`): a pretrained BERT-family encoder (MiniLM-L6, the ``[minilm]`` extra, ships
  without its masked-LM head) given a masked-LM head fitted with the encoder frozen on public text, so that a
  BERT masked-LM fine-tuning starts from a pretrained model's loss (Ganesh, McMahan & Thakurta 2025,
  arXiv:2507.01129, §5.2 fine-tune a pretrained TinyBERT with its MLM head).

Both train WITHOUT privacy on public data that the private runs do not train on, as the papers' starting points were
(GPT-2 on WebText, BERT on books and Wikipedia). Output: ``<cache>/pretrained/<name>-<hash of the preset>/``
(``DP_ADAM_BENCH_CACHE``, default ``.cache/`` in the repository) with ``model/`` (``save_pretrained``: config,
weights, tokenizer), ``metrics.jsonl`` and ``summary.json`` (written last: its presence marks the model complete).
A task that names a preset (``task.pretrain``) calls :func:`ensure`, which builds the model once under a lock and
then reads the cache; ``make pretrain`` builds it ahead of time.
"""

from __future__ import annotations

import copy
import hashlib
import json
import time
from pathlib import Path

import yaml

from dp_adam_bench.errors import ConfigError
from dp_adam_bench.pretrain.common import (
    CHECKPOINT,
    KINDS,
    OPERATIONAL_KEYS,
    PRESET_DIR,
    SUMMARY,
    Interrupted,
    cache_dir,
    resolve_device,
)

__all__ = [
    "CHECKPOINT",
    "PRESET_DIR",
    "SUMMARY",
    "Interrupted",
    "cache_dir",
    "ensure",
    "folder_for",
    "load_spec",
]


def presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def load_spec(name: str, overrides: dict | None = None) -> dict:
    """The preset ``configs/pretrain/<name>.yaml`` with ``overrides`` (a flat dict of its keys) applied, checked."""
    path = PRESET_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"unknown pretraining preset {name!r}; valid: {', '.join(presets()) or 'none'}")
    spec = yaml.safe_load(path.read_text())
    for key, value in (overrides or {}).items():
        if key not in spec:
            raise ConfigError(f"pretrain {name}: unknown key {key!r}; valid: {', '.join(sorted(spec))}")
        spec[key] = value
    return check_spec(spec)


def check_spec(spec: dict) -> dict:
    """ConfigError naming the bad value when a preset cannot make a model (the checks of its ``kind``) or names a
    device this machine cannot run it on."""
    kind = spec.get("kind")
    if kind not in KINDS:
        raise ConfigError(
            f"pretrain {spec.get('name', '?')}: kind must be one of {', '.join(KINDS)}, got {kind!r}"
        )
    resolve_device(spec)
    return _module(kind).check_spec(spec)


def task_spec(cfg, kind: str, task: str, need: str) -> dict:
    """The preset a task config names (``task.pretrain``, with ``task.pretrain_overrides``), checked against the
    task: ValueError when ``task.model`` names another starting point or the preset is not of ``kind`` (the message
    says what the task ``need``s)."""
    from omegaconf import OmegaConf

    name = str(cfg.get("pretrain"))
    if cfg.get("model"):
        raise ValueError(
            f"task.model={cfg.get('model')!r} and task.pretrain={name!r} both name the starting point; set one of them"
        )
    overrides = cfg.get("pretrain_overrides") or {}
    if OmegaConf.is_config(overrides):
        overrides = OmegaConf.to_container(overrides, resolve=True)
    spec = load_spec(name, dict(overrides))
    if spec["kind"] != kind:
        raise ValueError(f"task.pretrain={name!r} is a {spec['kind']} preset; the {task} task {need}")
    return spec


def built_summary(model_folder: Path) -> dict:
    """The summary of the build whose ``model/`` folder this is."""
    return json.loads((Path(model_folder).parent / SUMMARY).read_text())


def _module(kind: str):
    if kind == "gpt2_clm":
        from dp_adam_bench.pretrain import gpt2_clm

        return gpt2_clm
    from dp_adam_bench.pretrain import mlm_head

    return mlm_head


def spec_hash(spec: dict) -> str:
    """The cache key: every key that changes the model (``kind`` is implied by the keys a preset has)."""
    ident = {k: v for k, v in spec.items() if k not in OPERATIONAL_KEYS and k != "kind"}
    return hashlib.sha1(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:10]


def folder_for(spec: dict) -> Path:
    return cache_dir() / "pretrained" / f"{spec['name']}-{spec_hash(spec)}"


def is_complete(folder: Path) -> bool:
    return (folder / SUMMARY).is_file() and (folder / "model" / "config.json").is_file()


def ensure(spec: dict, stop_after: int | None = None) -> Path:
    """The ``model/`` folder of ``spec``'s pretrained model: read from the cache, or trained once (under a lock, so
    parallel runs of a sweep wait for one build instead of each training their own)."""
    folder = folder_for(spec)
    if is_complete(folder):
        return folder / "model"
    folder.mkdir(parents=True, exist_ok=True)
    lock = _wait_for_lock(folder)
    try:
        if not is_complete(folder):  # another process may have finished it while we waited
            print(
                f"pretraining {spec['name']} (once; cached in {folder}); `dp-adam-bench pretrain {spec['name']}` "
                "does this ahead of time",
                flush=True,
            )
            (folder / "spec.json").write_text(json.dumps(spec, indent=2))
            _show_progress_lines()
            _module(spec["kind"]).train(copy.deepcopy(spec), folder, stop_after)
    finally:
        lock.release()
    return folder / "model"


def _show_progress_lines() -> None:
    """Off a terminal a build reports its progress as INFO log lines (:mod:`dp_adam_bench.progress`), as a training
    run does. ``dp-adam-bench pretrain`` configures no logging (a Hydra run does), and importing Opacus sets the root
    logger to WARNING: unless a level was set for the package's logger, let its INFO records through, to stderr when
    nothing else handles them."""
    import logging
    import sys

    logger = logging.getLogger("dp_adam_bench")
    if logger.level == logging.NOTSET and logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    if not logger.hasHandlers():
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
        logger.addHandler(handler)


def _wait_for_lock(folder: Path, poll_s: float = 5.0):
    from dp_adam_bench.tracking.run_store import RunLock, RunLockedError

    announced = False
    while True:
        try:
            return RunLock.acquire(folder)
        except RunLockedError:
            if not announced:
                print(f"waiting for another process pretraining into {folder}", flush=True)
                announced = True
            time.sleep(poll_s)


def parse_overrides(items: list[str]) -> dict:
    """``key=value`` strings -> a dict with YAML-typed values."""
    out = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"pretrain: expected key=value, got {item!r}")
        key, value = item.split("=", 1)
        out[key.strip()] = yaml.safe_load(value)
    return out
