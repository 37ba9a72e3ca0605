"""``kind: bert_mlm_head``: a pretrained BERT-family encoder given the masked-LM head it ships without.

Ganesh, McMahan & Thakurta (2025, arXiv:2507.01129, §5.2) fine-tune a pretrained TinyBERT *with its MLM head*: their
"no fine-tuning" test loss, 4.955, is a pretrained model's. The encoder available offline, MiniLM-L6-H384 (the
``[minilm]`` extra, a sentence-transformers checkpoint), has no MLM head: a ``BertForMaskedLM`` built from it has a
fresh head and a loss above ln(30522) ≈ 10.3 (10.7 measured on arXiv abstracts, ``docs/pitfalls.md``). This builds
the head, NON-PRIVATELY, with the encoder FROZEN:

* the head is BERT's (``cls.predictions``: dense + GELU + LayerNorm, then the decoder, whose weight is tied to the
  frozen word embeddings, plus its bias): only the transform and the decoder bias train (~0.18M parameters);
* the data are public for the arxiv_mlm task: the abstracts of the **val split** of
  :func:`dp_adam_bench.tasks.arxiv_data.assign_splits`, which its private runs never train on and its test split
  never sees; a ``heldout_fraction`` of them is kept out of the fit to report the head's loss on unseen abstracts;
* BERT's masking (:func:`dp_adam_bench.tasks.text.mask_tokens`): ``corruptions`` static corruptions per abstract,
  each seeded by (corruption, row); the frozen encoder runs once over them, and the head trains on the hidden
  states at the chosen positions (so a step costs one head forward and backward).

It runs on the preset's ``device`` (auto: CUDA when available, as ``train.device``). The result (``model/``) is a
``BertForMaskedLM`` folder: the base encoder's weights unchanged, the fitted head, the
base's tokenizer. The arxiv_mlm task reads it with ``task.pretrain=<preset>``.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F

from dp_adam_bench import progress
from dp_adam_bench.errors import ConfigError
from dp_adam_bench.pretrain.common import BuildLog, check_numbers, finite, load_checkpoint, resolve_device

log = logging.getLogger(__name__)

POSITIVE_INTS = ("max_length", "corruptions", "batch_size", "steps", "encode_batch_size")
NONNEG_INTS = ("seed", "split_seed", "log_every", "checkpoint_every")


def check_spec(spec: dict) -> dict:
    check_numbers(
        spec,
        POSITIVE_INTS,
        NONNEG_INTS,
        ("lr",),
        ("mask_prob", "mask_token_frac", "random_token_frac", "heldout_fraction", "weight_decay"),
    )
    name = spec.get("name", "?")
    if spec["mask_token_frac"] + spec["random_token_frac"] > 1:
        raise ConfigError(f"pretrain {name}: mask_token_frac + random_token_frac must be <= 1")
    if not 0 < spec["heldout_fraction"] < 1:
        raise ConfigError(
            f"pretrain {name}: heldout_fraction must be in (0, 1), got {spec['heldout_fraction']}"
        )
    return spec


def base_folder(spec: dict) -> str:
    from dp_adam_bench.tasks import text

    if spec.get("base"):
        return str(spec["base"])
    return str(text.require_minilm_folder("the bert_mlm_head preset's encoder", instead="set base: <folder>"))


def masked_examples(spec: dict, tokenizer) -> tuple[list, list, str]:
    """(fit, heldout, origin): each a list of (corrupted ids, positions, labels) over the val-split abstracts."""
    from dp_adam_bench.tasks import text
    from dp_adam_bench.tasks.arxiv_data import SPLIT_CODES, assign_splits, load_abstracts

    keys, texts, origin = load_abstracts(spec.get("source") or "auto", spec.get("data_dir"))
    split = assign_splits(
        keys, int(spec["split_seed"]), float(spec["val_fraction"]), float(spec["test_fraction"])
    )
    rows = np.flatnonzero(split == SPLIT_CODES["val"])
    if len(rows) < 2:
        raise ConfigError(f"pretrain {spec['name']}: {len(rows)} abstracts in the val split; need at least 2")
    perm = np.random.default_rng([int(spec["seed"]), 1]).permutation(rows)
    n_held = max(1, int(round(len(rows) * float(spec["heldout_fraction"]))))
    ids = text.tokenize_ragged(tokenizer, [texts[r] for r in rows], max_length=int(spec["max_length"]))[0]
    index = {int(r): i for i, r in enumerate(rows)}
    special = set(tokenizer.all_special_ids)
    special_ids = np.asarray(sorted(special - {tokenizer.unk_token_id}), dtype=np.int64)
    random_ids = np.setdiff1d(np.arange(len(tokenizer), dtype=np.int64), np.asarray(sorted(special)))

    def corrupt(row: int, c: int):
        rng = np.random.default_rng([int(spec["seed"]), c, row])
        return text.mask_tokens(
            ids[index[row]],
            rng,
            mask_prob=float(spec["mask_prob"]),
            mask_id=int(tokenizer.mask_token_id),
            special_ids=special_ids,
            random_ids=random_ids,
            max_predictions=int(spec["max_length"]),
            mask_frac=float(spec["mask_token_frac"]),
            random_frac=float(spec["random_token_frac"]),
        )

    held = [corrupt(int(r), 0) for r in perm[:n_held]]
    fit = [corrupt(int(r), c) for c in range(int(spec["corruptions"])) for r in perm[n_held:]]
    return fit, held, origin


@torch.no_grad()
def encode(encoder, examples: list, pad_id: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states of the frozen encoder at every chosen position (N, hidden) and their labels (N,), on the
    encoder's device."""
    from dp_adam_bench.tasks import text

    encoder.eval()
    device = next(encoder.parameters()).device
    feats, labels = [], []
    for start in progress.iterate(range(0, len(examples), batch_size), desc="encode"):
        chunk = examples[start : start + batch_size]
        batch = text.pad_batch([c for c, _, _ in chunk], pad_id=pad_id, max_length=10**6, pad_to="longest")
        inputs = {k: v.to(device) for k, v in text.bert_inputs(batch).items()}
        hidden = encoder(**inputs, return_dict=True).last_hidden_state
        for j, (_, pos, lab) in enumerate(chunk):
            feats.append(hidden[j, torch.from_numpy(pos).to(device)])
            labels.append(torch.from_numpy(lab))
    return torch.cat(feats), torch.cat(labels).to(device)


def head_loss(mlm, feats: torch.Tensor, labels: torch.Tensor, batch_size: int = 4096) -> float:
    with torch.no_grad():
        total = sum(
            float(
                F.cross_entropy(
                    mlm.cls(feats[i : i + batch_size]), labels[i : i + batch_size], reduction="sum"
                )
            )
            for i in range(0, len(labels), batch_size)
        )
    return total / max(len(labels), 1)


def train(spec: dict, folder: Path, stop_after: int | None = None) -> dict:
    """Fit the head (or resume) into ``folder``; returns the summary written last to ``folder/summary.json``."""
    from transformers import BertForMaskedLM

    from dp_adam_bench.tasks import text

    t0 = time.time()
    device = resolve_device(spec)
    base = base_folder(spec)
    tokenizer = text.load_tokenizer(base)
    config = text.load_config(base)
    text.check_bert(config, "bert_mlm_head")
    torch.manual_seed(int(spec["seed"]))
    mlm = text.load_pretrained(BertForMaskedLM, base, config=config, expected_missing=("cls.",))
    for p in mlm.parameters():
        p.requires_grad_(False)
    head = mlm.cls.predictions
    trainable = [*head.transform.parameters(), head.decoder.bias]
    for p in trainable:
        p.requires_grad_(True)
    mlm.to(device)
    fit, held, origin = masked_examples(spec, tokenizer)
    bs = int(spec["encode_batch_size"])
    x_fit, y_fit = encode(mlm.bert, fit, int(tokenizer.pad_token_id), bs)
    x_held, y_held = encode(mlm.bert, held, int(tokenizer.pad_token_id), bs)
    initial = head_loss(mlm, x_held, y_held)
    opt = torch.optim.AdamW(trainable, lr=float(spec["lr"]), weight_decay=float(spec["weight_decay"]))
    start = load_checkpoint(folder, head, opt)
    steps, batch = int(spec["steps"]), int(spec["batch_size"])
    build = BuildLog(spec, folder, start, stop_after, t0, device)
    mlm.train()
    try:
        loss_sum, loss_n = 0.0, 0
        heldout = (
            None  # the held-out loss at the last logged step (the final one is logged when log_every is set)
        )
        for step in range(start, steps):
            # the positions of a step are a function of (seed, step): a resumed build draws the same ones
            pick = torch.from_numpy(
                np.random.default_rng([int(spec["seed"]), 2, step]).integers(0, len(y_fit), batch)
            ).to(device)
            loss = F.cross_entropy(mlm.cls(x_fit[pick]), y_fit[pick])
            loss_value = finite(spec, loss.item(), step)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_sum, loss_n = loss_sum + loss_value, loss_n + 1
            done = step + 1
            row = {}
            if spec["log_every"] and (done % spec["log_every"] == 0 or done == steps):
                heldout = head_loss(mlm, x_held, y_held)
                row = {"train_loss": loss_sum / loss_n, "heldout_loss": heldout}
                loss_sum, loss_n = 0.0, 0
            build.after_step(done, row, head, opt)
        final_logged = bool(spec["log_every"]) and start < steps  # the loop logged at done == steps
        return build.finish(
            mlm,
            tokenizer,
            {
                "base": base,
                "trainable_parameters": sum(p.numel() for p in trainable),
                "fit_positions": len(y_fit),
                "heldout_positions": len(y_held),
                "heldout_abstracts": len(held),
                "heldout_loss_before": initial,
                "heldout_loss": heldout if final_logged else head_loss(mlm, x_held, y_held),
                "data": origin,
            },
        )
    finally:
        build.close()
