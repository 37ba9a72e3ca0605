"""``kind: gpt2_clm``: a small GPT-2 pretrained with the causal LM loss on public text (``gpt2_arxiv`` preset).

The model is a ``GPT2LMHeadModel`` with the real GPT-2 tokenizer, trained NON-PRIVATELY on the arXiv abstracts of the
offline data (the train split of :func:`dp_adam_bench.tasks.arxiv_data.assign_splits`, validated on its val split),
public text disjoint from E2E, for the CPU ``li_e2e`` table. It is a far smaller model on far less text than GPT-2
(124M parameters, 40 GB of WebText), and the tables that use it say so.

Training: GPT-2 style packing (abstracts joined with ``<|endoftext|>``, cut into blocks of ``block_size`` tokens),
AdamW with linear warm-up and cosine decay, gradient-norm clipping at ``grad_clip`` (an optimisation aid, not DP),
tied input / output embeddings as GPT-2 has them, on the preset's ``device`` (auto: CUDA when available, as
``train.device``). The block order of epoch e is a permutation seeded by
(seed, e), so a build is a function of its preset; it checkpoints every ``checkpoint_every`` steps (model,
optimizer, torch RNG) and resumes exactly from the last checkpoint. Logged to ``metrics.jsonl`` and W&B (offline by
default) like a training run.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import numpy as np
import torch

from dp_adam_bench.errors import ConfigError
from dp_adam_bench.paths import shared_data_dir
from dp_adam_bench.pretrain.common import BuildLog, check_numbers, finite, load_checkpoint, resolve_device

log = logging.getLogger(__name__)

POSITIVE_INTS = ("n_layer", "n_embd", "n_head", "n_positions", "block_size", "batch_size", "steps")
NONNEG_INTS = ("warmup_steps", "seed", "log_every", "eval_every", "checkpoint_every", "val_blocks")


def check_spec(spec: dict) -> dict:
    name = spec.get("name", "?")
    check_numbers(
        spec, POSITIVE_INTS, NONNEG_INTS, ("lr", "grad_clip"), ("dropout", "min_lr_ratio", "weight_decay")
    )
    if spec["n_embd"] % spec["n_head"]:
        raise ConfigError(
            f"pretrain {name}: n_embd={spec['n_embd']} must be divisible by n_head={spec['n_head']}"
        )
    if spec["block_size"] > spec["n_positions"]:
        raise ConfigError(
            f"pretrain {name}: block_size={spec['block_size']} > n_positions={spec['n_positions']}"
        )
    v = spec.get("vocab_size")
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 512):
        raise ConfigError(
            f"pretrain {name}: vocab_size must be null (GPT-2's 50,257 tokens) or an integer >= 512 (the byte tokens "
            f"and the most frequent merges), got {v!r}"
        )
    if spec["warmup_steps"] >= spec["steps"]:
        raise ConfigError(
            f"pretrain {name}: warmup_steps={spec['warmup_steps']} must be < steps={spec['steps']}"
        )
    return spec


def architecture(spec: dict) -> dict:
    """The GPT-2 architecture of a preset, as the E2E task's ``n_layer`` ... keys (for a from-scratch control)."""
    return {k: spec[k] for k in ("n_layer", "n_embd", "n_head", "n_positions")}


# --------------------------------------------------------------------------------------------- data


def tokenizer_path(spec: dict) -> str:
    return str(spec.get("tokenizer") or shared_data_dir() / "gpt2_tokenizer")


def corpus_ids(spec: dict, tokenizer) -> tuple[list[list[int]], list[list[int]], str]:
    """(train, validation, data origin): the GPT-2 ids of each split's abstracts (the test split is never read)."""
    from dp_adam_bench.tasks.arxiv_data import assign_splits, load_abstracts

    keys, texts, origin = load_abstracts(spec.get("source") or "auto", spec.get("data_dir"))
    split = assign_splits(
        keys, int(spec["split_seed"]), float(spec["val_fraction"]), float(spec["test_fraction"])
    )
    train, val = (
        tokenizer(
            [" " + t.strip() for t, s in zip(texts, split, strict=True) if s == code],
            add_special_tokens=False,
        )["input_ids"]
        for code in (0, 1)
    )
    return train, val, origin


def spec_tokenizer(spec: dict, tokenizer, train_ids: list[list[int]], origin: str):
    """The tokenizer a build of ``spec`` trains with: GPT-2's own, or with ``vocab_size`` a
    :class:`~dp_adam_bench.tasks.compact_vocab.CompactTokenizer` whose vocabulary is chosen from the train split's
    GPT-2 token counts (public data only)."""
    from dp_adam_bench.tasks.compact_vocab import CompactTokenizer, CompactVocab

    if spec.get("vocab_size") is None:
        return tokenizer
    vocab = CompactVocab.from_corpus(tokenizer, train_ids, spec["vocab_size"])
    return CompactTokenizer(tokenizer, vocab, source=f"{vocab_size_note(spec)}, {origin}")


def preset_tokenizer(spec: dict):
    """The tokenizer of ``spec``'s build without building it (a deterministic function of the public corpus): what
    a from-scratch control of the same network needs."""
    from dp_adam_bench.tasks.text import load_gpt2_tokenizer

    tokenizer = load_gpt2_tokenizer(tokenizer_path(spec))
    if spec.get("vocab_size") is None:
        return tokenizer
    train, _, origin = corpus_ids(spec, tokenizer)
    return spec_tokenizer(spec, tokenizer, train, origin)


def token_blocks(spec: dict, tokenizer) -> tuple[torch.Tensor, torch.Tensor, str, object]:
    """(train blocks, validation blocks, data origin, tokenizer): the abstracts of each split, each followed by
    eos, packed into rows of ``block_size`` tokens (the incomplete last block dropped), in the ids of
    :func:`spec_tokenizer` (returned)."""
    train, val, origin = corpus_ids(spec, tokenizer)
    tokenizer = spec_tokenizer(spec, tokenizer, train, origin)
    if spec.get("vocab_size") is not None:
        train, val = ([tokenizer.vocab.to_compact(row) for row in ids] for ids in (train, val))
    eos = int(tokenizer.eos_token_id)
    out = []
    for ids in (train, val):
        flat = np.fromiter((i for row in ids for i in (*row, eos)), dtype=np.int64)
        n = len(flat) // spec["block_size"]
        out.append(torch.from_numpy(flat[: n * spec["block_size"]].reshape(n, spec["block_size"])))
    if len(out[0]) < spec["batch_size"]:
        raise ConfigError(
            f"pretrain {spec['name']}: {len(out[0])} training blocks of {spec['block_size']} tokens, fewer than "
            f"batch_size={spec['batch_size']}"
        )
    return out[0], out[1], origin, tokenizer


def vocab_size_note(spec: dict) -> str:
    """What a ``vocab_size`` preset's vocabulary is, for notes and the saved tokenizer."""
    return (
        f"{spec['vocab_size']:,}-token vocabulary (the byte tokens, <|endoftext|> and the GPT-2 merges most "
        "frequent in the arXiv train split)"
    )


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
    """The mean next-token loss over ``blocks`` (on any device: each batch goes to the model's)."""
    was = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for start in range(0, len(blocks), batch_size):
        x = blocks[start : start + batch_size].to(device)
        out = model(input_ids=x, labels=x)
        n = x.numel() - len(x)  # predicted tokens
        total += float(out.loss) * n
        count += n
    model.train(was)
    return total / max(count, 1)


def train(spec: dict, folder: Path, stop_after: int | None = None) -> dict:
    """Pretrain (or resume) into ``folder``; returns the summary written last to ``folder/summary.json``.
    ``stop_after``: checkpoint after that step and raise ``Interrupted`` (how tests kill a run)."""
    from dp_adam_bench.tasks.text import load_gpt2_tokenizer

    t0 = time.time()
    device = resolve_device(spec)
    tokenizer = load_gpt2_tokenizer(tokenizer_path(spec))
    train_blocks, val_blocks, origin, tokenizer = token_blocks(spec, tokenizer)
    val_blocks = val_blocks[: int(spec["val_blocks"])]
    model = build_model(spec, len(tokenizer), int(tokenizer.eos_token_id)).to(device)
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
    start = load_checkpoint(folder, model, opt)
    n_params = sum(p.numel() for p in model.parameters())
    log.info(
        "pretraining %s on %s: %.1fM parameters, %d train / %d val blocks of %d tokens (%s), steps %d..%d",
        spec["name"],
        device,
        n_params / 1e6,
        len(train_blocks),
        len(val_blocks),
        spec["block_size"],
        origin,
        start,
        spec["steps"],
    )
    build = BuildLog(spec, folder, start, stop_after, t0, device)
    model.train()
    loss_sum, loss_n = 0.0, 0
    try:
        for step in range(start, int(spec["steps"])):
            for group in opt.param_groups:
                group["lr"] = lr_at(step, spec)
            rows = batch_rows(step, len(train_blocks), int(spec["batch_size"]), int(spec["seed"]))
            x = train_blocks[rows].to(device)
            loss = model(input_ids=x, labels=x).loss
            loss_value = finite(spec, loss.item(), step)
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
            build.after_step(done, row, model, opt)
        val = mean_loss(model, val_blocks, int(spec["batch_size"]))
        build.log(int(spec["steps"]), {"val_loss": val})
        return build.finish(
            model,
            tokenizer,
            {
                "parameters": n_params,
                "train_blocks": len(train_blocks),
                "tokens_seen": int(spec["steps"]) * int(spec["batch_size"]) * int(spec["block_size"]),
                "epochs": int(spec["steps"]) * int(spec["batch_size"]) / len(train_blocks),
                "val_loss": val,
                "data": origin,
            },
        )
    finally:
        build.close()
