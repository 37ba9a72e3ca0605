"""Non-private pretraining of the starting points a CPU machine lacks: ``dp-adam-bench pretrain <preset>``.

Li, Tramèr, Liang & Hashimoto (ICLR 2022, arXiv:2110.05679) fine-tune *pretrained* GPT-2 with DP-Adam; their
point is that pretraining plus large batches make DP fine-tuning work. No GPT-2 weights exist offline, so a preset
(``configs/pretrain/<name>.yaml``) pretrains a small ``GPT2LMHeadModel`` with the real GPT-2 tokenizer, causal LM
loss, NON-PRIVATELY on public text disjoint from the private task: the arXiv abstracts of the offline data (the train
split of :func:`dp_adam_bench.tasks.arxiv_mlm.assign_splits`, validated on its val split) for E2E fine-tuning.
That is what GPT-2 is too: a model pretrained without privacy on public web text, then fine-tuned privately. It is
a far smaller model on far less text than GPT-2 (124M parameters, 40 GB of WebText), and the tables that use it say so.

Training: GPT-2 style packing (abstracts joined with ``<|endoftext|>``, cut into blocks of ``block_size`` tokens),
AdamW with linear warm-up and cosine decay, gradient-norm clipping at ``grad_clip`` (an optimisation aid, not DP),
tied input / output embeddings as GPT-2 has them. The block order of epoch e is a permutation seeded by
(seed, e), so a run is a function of its preset; it checkpoints every ``checkpoint_every`` steps (model, optimizer,
torch RNG) and resumes exactly from the last checkpoint.

Output: ``<cache>/pretrained/<name>-<hash of the preset>/`` (``DP_ADAM_BENCH_CACHE``, default ``.cache/`` in the
repository), holding ``model/`` (``save_pretrained``: config, weights and the tokenizer files; loads with
``GPT2LMHeadModel.from_pretrained``), ``metrics.jsonl`` (train loss every ``log_every`` steps, validation loss
every ``eval_every``), ``summary.json`` (written last: its presence marks the model complete) and, while training,
``checkpoint.pt``. Runs are logged to W&B like training runs (offline by default). A task that names a preset
(``task.pretrain``) calls :func:`ensure`, which builds the model once under a lock and then reads the cache.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import yaml

from dp_adam_bench import progress
from dp_adam_bench.errors import ConfigError
from dp_adam_bench.paths import CONFIG_DIR, REPO_ROOT, shared_data_dir

log = logging.getLogger(__name__)

PRESET_DIR = CONFIG_DIR / "pretrain"
CHECKPOINT = "checkpoint.pt"
SUMMARY = "summary.json"
# keys that change how a pretraining run is watched, not the model it makes (left out of the cache key)
OPERATIONAL_KEYS = ("log_every", "eval_every", "checkpoint_every", "val_blocks", "wandb")
POSITIVE_INTS = ("n_layer", "n_embd", "n_head", "n_positions", "block_size", "batch_size", "steps")
NONNEG_INTS = ("warmup_steps", "seed", "log_every", "eval_every", "checkpoint_every", "val_blocks")


def cache_dir() -> Path:
    """Built artefacts that runs read (``DP_ADAM_BENCH_CACHE`` overrides; default ``.cache/`` in the repository)."""
    return Path(os.environ.get("DP_ADAM_BENCH_CACHE", REPO_ROOT / ".cache"))


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
    """ConfigError naming the bad value when a preset cannot make a model."""
    name = spec.get("name", "?")
    for key in POSITIVE_INTS + NONNEG_INTS:
        v = spec.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < (1 if key in POSITIVE_INTS else 0):
            need = ">= 1" if key in POSITIVE_INTS else ">= 0"
            raise ConfigError(f"pretrain {name}: {key} must be an integer {need}, got {v!r}")
    for key, lo, hi in (("lr", 0, None), ("grad_clip", 0, None), ("weight_decay", -1e-300, None)):
        v = spec.get(key)
        if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= lo or (hi is not None and v > hi):
            raise ConfigError(f"pretrain {name}: {key} must be a finite number > {max(lo, 0)}, got {v!r}")
    for key in ("dropout", "min_lr_ratio"):
        v = spec.get(key)
        if (
            not isinstance(v, (int, float))
            or not math.isfinite(v)
            or not 0 <= v < 1 + (key == "min_lr_ratio")
        ):
            raise ConfigError(f"pretrain {name}: {key} must be in [0, 1], got {v!r}")
    if spec["n_embd"] % spec["n_head"]:
        raise ConfigError(
            f"pretrain {name}: n_embd={spec['n_embd']} must be divisible by n_head={spec['n_head']}"
        )
    if spec["block_size"] > spec["n_positions"]:
        raise ConfigError(
            f"pretrain {name}: block_size={spec['block_size']} > n_positions={spec['n_positions']}"
        )
    if spec["warmup_steps"] >= spec["steps"]:
        raise ConfigError(
            f"pretrain {name}: warmup_steps={spec['warmup_steps']} must be < steps={spec['steps']}"
        )
    return spec


def spec_hash(spec: dict) -> str:
    ident = {k: v for k, v in spec.items() if k not in OPERATIONAL_KEYS}
    return hashlib.sha1(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:10]


def folder_for(spec: dict) -> Path:
    return cache_dir() / "pretrained" / f"{spec['name']}-{spec_hash(spec)}"


def is_complete(folder: Path) -> bool:
    return (folder / SUMMARY).is_file() and (folder / "model" / "config.json").is_file()


def architecture(spec: dict) -> dict:
    """The GPT-2 architecture of a preset, as the E2E task's ``n_layer`` ... keys (for a from-scratch control)."""
    return {k: spec[k] for k in ("n_layer", "n_embd", "n_head", "n_positions")}


# --------------------------------------------------------------------------------------------- data


def tokenizer_path(spec: dict) -> str:
    return str(spec.get("tokenizer") or shared_data_dir() / "gpt2_tokenizer")


def token_blocks(spec: dict, tokenizer) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(train blocks, validation blocks, data origin): the abstracts of each split, each followed by eos, packed
    into rows of ``block_size`` tokens (the incomplete last block dropped)."""
    from dp_adam_bench.tasks.arxiv_mlm import assign_splits, load_abstracts

    keys, texts, origin = load_abstracts(spec.get("source") or "auto", spec.get("data_dir"))
    split = assign_splits(
        keys, int(spec["split_seed"]), float(spec["val_fraction"]), float(spec["test_fraction"])
    )
    eos = int(tokenizer.eos_token_id)
    out = []
    for code in (0, 1):  # train, val
        chosen = [" " + t.strip() for t, s in zip(texts, split, strict=True) if s == code]
        ids = tokenizer(chosen, add_special_tokens=False)["input_ids"]
        flat = np.fromiter((i for row in ids for i in (*row, eos)), dtype=np.int64)
        n = len(flat) // spec["block_size"]
        out.append(torch.from_numpy(flat[: n * spec["block_size"]].reshape(n, spec["block_size"])))
    if len(out[0]) < spec["batch_size"]:
        raise ConfigError(
            f"pretrain {spec['name']}: {len(out[0])} training blocks of {spec['block_size']} tokens, fewer than "
            f"batch_size={spec['batch_size']}"
        )
    return out[0], out[1], origin


def batch_rows(step: int, n_blocks: int, batch_size: int, seed: int) -> np.ndarray:
    """Block indices of ``step``: epoch e walks a permutation seeded by (seed, e); a function of the step only."""
    per_epoch = n_blocks // batch_size
    epoch, k = divmod(step, per_epoch)
    perm = np.random.default_rng([seed, epoch]).permutation(n_blocks)
    return perm[k * batch_size : (k + 1) * batch_size]


# --------------------------------------------------------------------------------------------- model and loop


def build_model(spec: dict, vocab_size: int, eos: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(int(spec["seed"]))
    p = float(spec["dropout"])
    config = GPT2Config(
        vocab_size=vocab_size,
        bos_token_id=eos,
        eos_token_id=eos,
        tie_word_embeddings=True,  # as GPT-2; the E2E task unties (clones the embedding into lm_head) for DP
        resid_pdrop=p,
        embd_pdrop=p,
        attn_pdrop=p,
        **architecture(spec),
    )
    config._attn_implementation = "sdpa"
    return GPT2LMHeadModel(config)


def lr_at(step: int, spec: dict) -> float:
    """Linear warm-up to ``lr`` over ``warmup_steps``, then cosine decay to ``min_lr_ratio * lr`` at ``steps``."""
    lr, warm, total = float(spec["lr"]), int(spec["warmup_steps"]), int(spec["steps"])
    if step < warm:
        return lr * (step + 1) / warm
    t = (step - warm) / max(1, total - warm)
    floor = float(spec["min_lr_ratio"])
    return lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t)))


@torch.no_grad()
def mean_loss(model, blocks: torch.Tensor, batch_size: int) -> float:
    was = model.training
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(blocks), batch_size):
        x = blocks[start : start + batch_size]
        out = model(input_ids=x, labels=x)
        n = x.numel() - len(x)  # predicted tokens
        total += float(out.loss) * n
        count += n
    model.train(was)
    return total / max(count, 1)


def _save_checkpoint(folder: Path, step: int, model, opt) -> None:
    tmp = folder / f".{CHECKPOINT}.tmp"
    torch.save(
        {
            "step": step,
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "rng": torch.get_rng_state(),
        },
        tmp,
    )
    tmp.replace(folder / CHECKPOINT)


def _load_checkpoint(folder: Path, model, opt) -> int:
    path = folder / CHECKPOINT
    if not path.is_file():
        return 0
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        return int(state["step"])
    except Exception as err:  # a torn or foreign file: say which and how to start over
        raise ConfigError(
            f"pretraining checkpoint {path} cannot be read ({type(err).__name__}: {str(err).splitlines()[0]}); "
            "delete it to start the "
            "pretraining over"
        ) from err


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop logged rows past ``step`` (a resumed run logs them again)."""
    if not path.is_file():
        return
    rows = [r for r in path.read_text().splitlines() if r.strip() and json.loads(r)["step"] <= step]
    path.write_text("".join(r + "\n" for r in rows))


class Interrupted(RuntimeError):
    """Raised by :func:`train` with ``stop_after``: the run stopped after a checkpoint (tests, like a kill)."""


def train(spec: dict, folder: Path, stop_after: int | None = None) -> dict:
    """Pretrain (or resume) into ``folder``; returns the summary written last to ``folder/summary.json``.
    ``stop_after``: checkpoint after that step and raise :class:`Interrupted` (how tests kill a run)."""
    from dp_adam_bench.tasks.e2e_gpt2 import load_gpt2_tokenizer
    from dp_adam_bench.tracking.run_store import RunFolder, git_commit
    from dp_adam_bench.tracking.wandb_logger import WandbLogger

    t0 = time.time()
    tokenizer = load_gpt2_tokenizer(tokenizer_path(spec))
    train_blocks, val_blocks, origin = token_blocks(spec, tokenizer)
    val_blocks = val_blocks[: int(spec["val_blocks"])]
    model = build_model(spec, len(tokenizer), int(tokenizer.eos_token_id))
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": float(spec["weight_decay"])},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=float(spec["lr"]),
        betas=(0.9, 0.95),
    )
    start = _load_checkpoint(folder, model, opt)
    _truncate_metrics(folder / "metrics.jsonl", start)
    run = RunFolder(folder)
    wb_cfg = {"experiment_name": "pretrain", "task": {"name": spec["name"]}, "pretrain": spec}
    wandb = WandbLogger(
        run_dir=folder,
        name=folder.name,
        config=wb_cfg,
        mode=(spec.get("wandb") or {}).get("mode"),
        tags=["pretrain"],
    )
    n_params = sum(p.numel() for p in model.parameters())
    log.info(
        "pretraining %s: %.1fM parameters, %d train / %d val blocks of %d tokens (%s), steps %d..%d",
        spec["name"],
        n_params / 1e6,
        len(train_blocks),
        len(val_blocks),
        spec["block_size"],
        origin,
        start,
        spec["steps"],
    )
    model.train()
    loss_sum, loss_n = 0.0, 0
    bar = progress.Progress(int(spec["steps"]), start, what=f"pretrain {spec['name']}")
    try:
        for step in range(start, int(spec["steps"])):
            for group in opt.param_groups:
                group["lr"] = lr_at(step, spec)
            x = train_blocks[batch_rows(step, len(train_blocks), int(spec["batch_size"]), int(spec["seed"]))]
            loss = model(input_ids=x, labels=x).loss
            loss_value = loss.item()
            if not math.isfinite(loss_value):
                raise RuntimeError(f"pretrain {spec['name']}: loss {loss_value} at step {step}; lower lr")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), float(spec["grad_clip"]))
            opt.step()
            loss_sum, loss_n = loss_sum + loss_value, loss_n + 1
            done = step + 1
            row = {}
            if spec["log_every"] and done % spec["log_every"] == 0:
                row.update(train_loss=loss_sum / loss_n, lr=lr_at(step, spec))
                loss_sum, loss_n = 0.0, 0
            if spec["eval_every"] and done % spec["eval_every"] == 0 and done < spec["steps"]:
                row["val_loss"] = mean_loss(model, val_blocks, int(spec["batch_size"]))
            if row:
                run.log(done, row)
                wandb.log(done, row)
            bar.update(done, {"train_loss": row["train_loss"]} if "train_loss" in row else {}, bool(row))
            if spec["checkpoint_every"] and done % spec["checkpoint_every"] == 0 and done < spec["steps"]:
                _save_checkpoint(folder, done, model, opt)
            if stop_after is not None and done == stop_after:
                _save_checkpoint(folder, done, model, opt)
                raise Interrupted(f"stopped after step {done}")
        val = mean_loss(model, val_blocks, int(spec["batch_size"]))
        run.log(int(spec["steps"]), {"val_loss": val})
        wandb.log(int(spec["steps"]), {"val_loss": val})
        out = folder / "model"
        shutil.rmtree(out, ignore_errors=True)
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        summary = {
            "status": "complete",
            "name": spec["name"],
            "spec": spec,
            "parameters": n_params,
            "train_blocks": len(train_blocks),
            "tokens_seen": int(spec["steps"]) * int(spec["batch_size"]) * int(spec["block_size"]),
            "epochs": int(spec["steps"]) * int(spec["batch_size"]) / len(train_blocks),
            "val_loss": val,
            "data": origin,
            "resumed_from_step": start or None,
            "wall_time_s_this_session": time.time() - t0,
            "git_commit": git_commit(),
            "command": f"dp-adam-bench pretrain {spec['name']}",
        }
        run.write_json(SUMMARY, summary)
        (folder / CHECKPOINT).unlink(missing_ok=True)
        return summary
    finally:
        bar.close()
        wandb.finish()


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
            train(copy.deepcopy(spec), folder, stop_after)
    finally:
        lock.release()
    return folder / "model"


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
