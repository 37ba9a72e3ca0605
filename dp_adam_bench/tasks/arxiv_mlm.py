"""Masked-token prediction with BERT-tiny on arXiv abstracts (Ganesh, McMahan & Thakurta §5.2, Fig. 3).

A. Ganesh, H. B. McMahan, A. Thakurta, "On Design Principles for Private Adaptive Optimizers" (2025,
arXiv:2507.01129), §5.2: a pretrained TinyBERT (≈ 4.4M trainable parameters; BERT L = 2, H = 128, A = 2)
fine-tuned on "the masked token prediction task as defined in [Devlin et al.]" on arXiv abstracts truncated to 512
tokens, split ≈ 1.7M / 0.1M / 0.1M; 2000 steps of B = 2048, clip 1.0; metric: test loss (no fine-tuning: 4.955).

Masking (BERT, Devlin et al. 2019, ``create_pretraining_data.py``): of the non-special tokens of a sequence
([CLS] abstract [SEP]), max(1, round(15 %)) are chosen uniformly (``mask_prob``); each becomes [MASK] with
probability 0.8, a random token with probability 0.1, else stays (``mask_token_frac``, ``random_token_frac``).
The corruption of an example is a function of (``mask_seed``, the example's row in the data file) only, so every
example has a fixed corruption and its loss is reproducible (static masking, as in BERT's pre-generated data).

Loss: the model predicts only at the (at most ``max_predictions``) chosen positions, as BERT's pre-training does
(``masked_lm_positions``): the hidden states are gathered there before the MLM head, which leaves every
per-example gradient unchanged but makes the 30,522-way decoder (and its ghost norm, whose cost grows with the
square of the number of positions) about T / max_predictions times cheaper. An example's loss is the mean
cross-entropy over its chosen positions; ``test_loss`` is the mean over all chosen test positions.

Split: fixed, by a seeded hash (``split_seed``) of the arXiv id (of the abstract text when the id is missing):
``test_fraction`` to test, ``val_fraction`` to validation, the rest to train, the same on every machine.

Profiles: ``cpu``: the 19,834 abstracts of ``shared/data/arxiv_abstracts`` and the BERT-tiny architecture from the
offline ``shared/data/bert_tiny`` config and tokenizer, RANDOMLY INITIALISED (no pretrained weights exist offline;
``data_note`` says so), 128 tokens. ``paper``: ``prajjwal1/bert-tiny`` (pretrained, from the hub), 512 tokens.

The model is :func:`prepare_bert_for_dp`-ed: the decoder is untied from the word embeddings (ghost clipping refuses
tied parameters; this adds 3.9M trainable parameters to the 4.4M of the tied model) and the duplicate
``cls.predictions.bias`` registration is removed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from dp_adam_bench import progress
from dp_adam_bench.paths import shared_data_dir
from dp_adam_bench.tasks import fields, text
from dp_adam_bench.tasks.arxiv_data import (  # noqa: F401 (the data functions are part of this task's API)
    DATA_FILE,
    FOLDER,
    HF_NAME,
    SOURCES,
    SPLIT_CODES,
    assign_splits,
    load_abstracts,
    load_abstracts_hf,
    read_abstracts,
)
from dp_adam_bench.tasks.base import ModelTask, subset_indices, task_profile

log = logging.getLogger(__name__)

PAPER_MODEL = "prajjwal1/bert-tiny"
CPU_MODEL_FOLDER = "bert_tiny"
MODEL_HINT = (
    "Set task.model to a local folder with config.json and tokenizer files (vocab.txt or tokenizer.json; weights "
    "too when task.pretrained=true), e.g. shared/data/bert_tiny (dp-adam-bench data prepare arxiv_mlm downloads "
    "it), or to a hub name with hub access."
)


class MaskedLMAtPositions(nn.Module):
    """A BERT masked-LM whose head runs only at the given positions: logits of shape (B, P, vocab).

    Wraps the ``bert`` encoder and ``cls`` head of a (prepared) ``BertForMaskedLM``; parameter names stay
    ``bert.*`` and ``cls.*``.
    """

    def __init__(self, mlm: nn.Module):
        super().__init__()
        self.bert = mlm.bert
        self.cls = mlm.cls
        self.config = mlm.config

    def forward(self, input_ids, attention_mask, token_type_ids, position_ids, mlm_positions):
        hidden = text.encode(self.bert, input_ids, attention_mask, token_type_ids, position_ids)
        at = mlm_positions.unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
        return self.cls(torch.gather(hidden, 1, at))


def default_model(profile: str) -> str:
    return PAPER_MODEL if profile == "paper" else str(shared_data_dir() / CPU_MODEL_FOLDER)


# --------------------------------------------------------------------------------------------- task


class ArxivMLM(ModelTask):
    """Masked-token prediction on arXiv abstracts with BERT-tiny: data, masking, model, loss and test loss.

    Config fields: ``profile``; ``model`` (folder or hub name; null = the profile default) and ``pretrained``
    (null = false for cpu, true for paper); ``source`` (auto | local | hf; null = auto for cpu, hf for paper),
    ``data_dir``, ``hf_name``;
    ``max_length``; ``pad_to``; ``mask_prob``, ``mask_token_frac``, ``random_token_frac``, ``max_predictions``
    (null = max(1, round(mask_prob · (max_length − 2)))), ``mask_seed``; ``split_seed``, ``val_fraction``,
    ``test_fraction``, ``eval_split`` (test | val); ``train_subset`` / ``test_subset`` (seeded with ``data_seed``);
    ``val_subset`` (null, or that many val-split abstracts, drawn after the other two with ``data_seed``, scored
    beside the eval split as ``val_loss`` / ``val_accuracy``: a hyperparameter can then be chosen on val and the
    same runs reported on test; needs ``eval_split=test``);
    ``eval_batch_size``; ``dropout`` (null = the config's); ``untie_embeddings`` (true: needed for ghost clipping).
    """

    name = "arxiv_mlm"
    trial_dims = 0

    def __init__(self, cfg, *, trials: int, seed: int):
        del trials, seed
        self.profile = task_profile(cfg)
        self.pretrain_summary: dict | None = None
        self.model_name, self.pretrained = self._choose_model(cfg)
        self.max_length = fields.max_length(cfg)
        self.pad_to = fields.pad_to(cfg, "max_length")
        self._read_masking(cfg)
        self.eval_batch_size = fields.positive(cfg, "eval_batch_size", 256)
        self.dropout = cfg.get("dropout")
        self.untie = bool(cfg.get("untie_embeddings", True))
        eval_split = fields.eval_split(cfg, ("test", "val"))
        keys, texts = self._split_abstracts(cfg, eval_split)
        self._load_tokenizer()
        self.train_ids = self._tokenize([texts[i] for i in self.train_rows])
        self.test_ids = self._tokenize([texts[i] for i in self.test_rows])
        self.val_ids = None if self.val_rows is None else self._tokenize([texts[i] for i in self.val_rows])
        self.data_note = self._data_note(len(keys))
        log.info("arxiv_mlm: %s; %s", self.data_source, self.data_note)

    def _choose_model(self, cfg) -> tuple[str, bool]:
        """(model folder or hub name, pretrained): ``task.pretrain``'s build, else ``task.model`` (null: the
        profile's) with ``task.pretrained`` (null: the paper profile's only)."""
        if cfg.get("pretrain"):
            return self._from_pretrain_preset(cfg)
        pretrained = cfg.get("pretrained")
        model_name = str(cfg.get("model") or default_model(self.profile))
        return model_name, (self.profile == "paper") if pretrained is None else bool(pretrained)

    def _read_masking(self, cfg) -> None:
        """BERT's masking fields (module docstring): the share of tokens chosen, how they are replaced, at most how
        many per example, and the seed of every example's fixed corruption."""
        self.mask_prob = float(cfg.get("mask_prob", 0.15))
        self.mask_token_frac = float(cfg.get("mask_token_frac", 0.8))
        self.random_token_frac = float(cfg.get("random_token_frac", 0.1))
        if not 0 < self.mask_prob < 1:
            raise ValueError(f"task.mask_prob must be in (0, 1), got {self.mask_prob}")
        if (
            self.mask_token_frac < 0
            or self.random_token_frac < 0
            or self.mask_token_frac + self.random_token_frac > 1
        ):
            raise ValueError("task.mask_token_frac and task.random_token_frac must be >= 0 with a sum <= 1")
        mp = cfg.get("max_predictions")
        self.max_predictions = (
            text.num_to_mask(self.max_length - 2, self.mask_prob) if mp is None else int(mp)
        )
        if self.max_predictions < 1:
            raise ValueError(f"task.max_predictions must be >= 1, got {self.max_predictions}")
        self.mask_seed = int(cfg.get("mask_seed", 0))

    def _split_abstracts(self, cfg, eval_split: str) -> tuple[list[str], list[str]]:
        """The abstracts' keys and texts; the rows of the data file each split trains or scores on (the hash split,
        then ``train_subset``, ``test_subset`` and ``val_subset`` in that order from ``data_seed``)."""
        # null source: cpu reads the local file (then the hub); paper wants the full corpus from the hub
        source = str(cfg.get("source") or ("hf" if self.profile == "paper" else "auto"))
        keys, texts, self.data_source = load_abstracts(
            source, cfg.get("data_dir"), str(cfg.get("hf_name") or HF_NAME)
        )
        split = assign_splits(
            keys,
            int(cfg.get("split_seed", 0)),
            float(cfg.get("val_fraction", 0.05)),
            float(cfg.get("test_fraction", 0.05)),
        )
        self.split_sizes = {s: int((split == c).sum()) for s, c in SPLIT_CODES.items()}
        rng = np.random.default_rng(int(cfg.get("data_seed", 0)))
        tr_rows = np.flatnonzero(split == SPLIT_CODES["train"])
        te_rows = np.flatnonzero(split == SPLIT_CODES[eval_split])
        if len(tr_rows) == 0 or len(te_rows) == 0:
            raise ValueError(
                f"the hash split left {self.split_sizes}: too few abstracts for train / {eval_split}"
            )
        tr = subset_indices(len(tr_rows), cfg.get("train_subset"), rng, "train_subset")
        te = subset_indices(len(te_rows), cfg.get("test_subset"), rng, "test_subset")
        self.train_rows = tr_rows if tr is None else tr_rows[tr]  # rows of the data file: the masking key
        self.test_rows = te_rows if te is None else te_rows[te]
        self.val_rows = None
        if cfg.get("val_subset") is not None:
            if eval_split != "test":
                raise ValueError(
                    f"task.val_subset={cfg.get('val_subset')} scores val beside the eval split, but "
                    f"task.eval_split={eval_split!r}: use eval_split=test, or val_subset=null"
                )
            va_rows = np.flatnonzero(split == SPLIT_CODES["val"])
            va = subset_indices(len(va_rows), cfg.get("val_subset"), rng, "val_subset")
            self.val_rows = va_rows if va is None else va_rows[va]
        return keys, texts

    def _load_tokenizer(self) -> None:
        """The model's tokenizer, its [MASK] and [PAD] ids, the ids never chosen for masking and the ids a chosen
        token may be replaced by."""
        self.tokenizer = text.load_tokenizer(self.model_name, hint=MODEL_HINT)
        tok = self.tokenizer
        for what in ("mask_token_id", "pad_token_id"):
            if getattr(tok, what) is None:
                raise ValueError(f"the tokenizer of {self.model_name} has no {what.split('_')[0]} token")
        self.mask_id, self.pad_id = int(tok.mask_token_id), int(tok.pad_token_id)
        special = set(tok.all_special_ids)
        # never chosen: [CLS], [SEP], [PAD], [MASK]; [UNK] stands for a real word and is maskable (as in BERT)
        self.special_ids = np.asarray(sorted(special - {tok.unk_token_id}), dtype=np.int64)
        # random replacements: any non-special token
        self.random_ids = np.setdiff1d(np.arange(len(tok), dtype=np.int64), np.asarray(sorted(special)))

    def _data_note(self, n_abstracts: int) -> str:
        """What differs from Ganesh et al.'s setting (the data, the starting point, truncation), for the summary."""
        notes = []
        if self.data_source.startswith("local:"):
            notes.append(
                f"{n_abstracts:,} arXiv abstracts ({self.split_sizes['train']:,} / {self.split_sizes['val']:,} / "
                f"{self.split_sizes['test']:,} train / val / test by hash; Ganesh et al.: ≈ 1.7M / 0.1M / 0.1M)"
            )
        if self.pretrain_summary is not None:
            ps = self.pretrain_summary
            base = Path(str(ps["base"]))
            # the [minilm] package keeps its weights in <package>/model: name the package
            base_name = base.parent.name if base.name == "model" else base.name
            notes.append(
                f"encoder {base_name} PRETRAINED (public; all of it fine-tuned here), with a masked-LM head fitted "
                f"NON-PRIVATELY, encoder frozen, by `dp-adam-bench pretrain {ps['name']}` on "
                f"{ps['fit_positions']:,} masked positions "
                f"of val-split abstracts (held-out loss {ps['heldout_loss']:.3f} nats; Ganesh et al. start from "
                "pretrained TinyBERT and its MLM head: 4.955)"
            )
        elif not self.pretrained:
            notes.append(
                "BERT-tiny RANDOMLY INITIALISED: no pretrained weights offline (Ganesh et al. fine-tune a "
                "pretrained TinyBERT: test loss 4.955 before fine-tuning; a random model starts near ln(30522) ≈ 10.3)"
            )
        if self.max_length != 512:
            notes.append(f"abstracts truncated to {self.max_length} tokens (paper: 512)")
        return "; ".join(notes) if notes else "as in the paper"

    def _from_pretrain_preset(self, cfg) -> tuple[str, bool]:
        """(model folder, True) for ``task.pretrain``: a ``bert_mlm_head`` preset's encoder with its fitted MLM head,
        built once and cached by :func:`dp_adam_bench.pretrain.ensure`."""
        from dp_adam_bench import pretrain

        spec = pretrain.task_spec(
            cfg, "bert_mlm_head", self.name, "needs a bert_mlm_head preset (such as minilm_mlm_head)"
        )
        name = spec["name"]
        if cfg.get("pretrained") is not None and not bool(cfg.get("pretrained")):
            raise ValueError(
                f"task.pretrain={name!r} is a pretrained starting point; task.pretrained=false contradicts it"
            )
        for key in (
            "split_seed",
            "val_fraction",
            "test_fraction",
        ):  # the head's public data = this task's val split
            if float(spec[key]) != float(cfg.get(key, spec[key])):
                raise ValueError(
                    f"task.{key}={cfg.get(key)} differs from the {name} preset's {key}={spec[key]}: the head would "
                    "have been fitted on abstracts this task's split does not hold out"
                )
        folder = pretrain.ensure(spec)
        self.pretrain_summary = pretrain.built_summary(folder)
        return str(folder), True

    def _tokenize(self, texts: list[str]) -> text.Ragged:
        return text.tokenize_ragged(self.tokenizer, texts, max_length=self.max_length)[0]

    @property
    def dataset_size(self) -> int:
        return len(self.train_rows)

    @property
    def test_size(self) -> int:
        return len(self.test_rows)

    # ------------------------------------------------------------------------------------------------- model

    def build_model(self) -> nn.Module:
        from transformers import BertForMaskedLM

        config = text.load_config(self.model_name, hint=MODEL_HINT)
        text.check_bert(config, self.name)
        text.set_dropout(config, self.dropout)
        if len(self.tokenizer) > config.vocab_size:
            raise ValueError(
                f"the tokenizer has {len(self.tokenizer)} tokens but the model's vocab_size is {config.vocab_size}"
            )
        if self.pretrained:
            mlm = text.load_pretrained(BertForMaskedLM, self.model_name, config=config, hint=MODEL_HINT)
        else:
            mlm = BertForMaskedLM(config)
        # untie=False keeps the tied embeddings (hooks / loop engines only: ghost clipping refuses them)
        text.prepare_bert_for_dp(mlm, untie=self.untie)
        return MaskedLMAtPositions(mlm)

    # ------------------------------------------------------------------------------------------------- data

    def corrupt(self, ids: np.ndarray, row: int):
        """The fixed corruption of the example in row ``row`` of the data file: (corrupted ids, positions, labels),
        a function of (mask_seed, row) only; see :func:`text.mask_tokens`."""
        rng = np.random.default_rng([self.mask_seed, int(row)])
        return text.mask_tokens(
            ids,
            rng,
            mask_prob=self.mask_prob,
            mask_id=self.mask_id,
            special_ids=self.special_ids,
            random_ids=self.random_ids,
            max_predictions=self.max_predictions,
            mask_frac=self.mask_token_frac,
            random_frac=self.random_token_frac,
        )

    def _batch(self, ids: text.Ragged, rows: np.ndarray, idx, pad_to: str):
        idx = np.asarray(torch.as_tensor(idx, dtype=torch.long).cpu().numpy()).reshape(-1)
        corrupted, positions, labels = [], [], []
        for i in idx:
            c, p, y = self.corrupt(ids[int(i)], rows[int(i)])
            corrupted.append(c)
            positions.append(p)
            labels.append(y)
        batch = text.pad_batch(corrupted, pad_id=self.pad_id, max_length=self.max_length, pad_to=pad_to)
        pos = torch.zeros((len(idx), self.max_predictions), dtype=torch.long)
        lab = torch.full((len(idx), self.max_predictions), text.IGNORE_INDEX, dtype=torch.long)
        for j, (p, y) in enumerate(zip(positions, labels, strict=True)):
            pos[j, : len(p)] = torch.from_numpy(p)
            lab[j, : len(y)] = torch.from_numpy(y)
        batch["mlm_positions"] = pos
        batch["mlm_labels"] = lab
        return batch

    def get_batch(self, indices) -> dict[str, torch.Tensor]:
        # training examples are keyed by their row in the data file, whatever the split's subset
        return self._batch(self.train_ids, self.train_rows, indices, self.pad_to)

    @staticmethod
    def token_losses(forward: Callable[..., torch.Tensor], batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Cross-entropy at each chosen position, (B, P); 0 where the label is -100 (no prediction)."""
        logits = forward(
            **text.bert_inputs(batch),
            mlm_positions=batch["mlm_positions"],
        )
        return F.cross_entropy(
            logits.transpose(1, 2), batch["mlm_labels"], reduction="none", ignore_index=text.IGNORE_INDEX
        )

    def loss_per_example(
        self, forward: Callable[..., torch.Tensor], batch: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        text.refuse_vmap(batch, self.name)
        tl = self.token_losses(forward, batch)
        count = (batch["mlm_labels"] != text.IGNORE_INDEX).sum(1).clamp(min=1)
        return tl.sum(1) / count

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        out = self._score(model, self.test_ids, self.test_rows, "test")
        if self.val_ids is not None:
            out |= self._score(model, self.val_ids, self.val_rows, "val")
        return out

    def _score(self, model: nn.Module, ids: text.Ragged, rows: np.ndarray, split: str) -> dict[str, float]:
        device = text.model_device(model)
        loss_sum, correct, count = 0.0, 0, 0
        # batches of similar lengths, each padded to its longest row: the sums do not depend on the order
        order = np.argsort(ids.lengths(), kind="stable")
        for start in progress.iterate(range(0, len(rows), self.eval_batch_size), desc="evaluate"):
            idx = order[start : start + self.eval_batch_size]
            # the fixed corruption of each example (a function of its row)
            batch = self._batch(ids, rows, idx, "longest")
            batch = {k: v.to(device) for k, v in batch.items()}
            logits = model(**text.bert_inputs(batch), mlm_positions=batch["mlm_positions"]).float()
            y = batch["mlm_labels"]
            valid = y != text.IGNORE_INDEX
            loss_sum += float(F.cross_entropy(logits[valid], y[valid], reduction="sum"))
            correct += int((logits[valid].argmax(-1) == y[valid]).sum())
            count += int(valid.sum())
        return {
            f"{split}_loss": loss_sum / max(count, 1),
            f"{split}_accuracy": 100.0 * correct / max(count, 1),
        }
