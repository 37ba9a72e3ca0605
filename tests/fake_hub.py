"""A fake Hugging Face hub for the paper profiles: a temporary cache in the layouts ``from_pretrained`` and
``datasets.load_dataset`` read with ``HF_HUB_OFFLINE=1``, holding under the real repository names the paper
profiles use tiny random-weight models of the same classes and small data sets with the hub's columns and splits.

* Models: ``<HF_HUB_CACHE>/models--<org>--<name>/refs/main`` (a commit hash) and ``snapshots/<hash>/`` with what
  ``save_pretrained`` writes, as ``huggingface_hub`` leaves a downloaded repository. GPT-2 gets the real GPT-2
  tokenizer files of the offline data (``gpt2_tokenizer``); the BERT family gets the BERT WordPiece vocabulary of
  the offline data (``bert_tiny/vocab.txt``; bert-base-cased's own cased vocabulary is not offline).
* Data sets: ``<HF_DATASETS_CACHE>/<org>___<name>/<config>/<version>/<hash>/`` with ``dataset_info.json`` and one
  Arrow file per split, the cache a finished ``load_dataset(<org>/<name>)`` leaves; offline, ``load_dataset``
  falls back to it ("Using the latest cached version of the dataset"). Written by the datasets library's own
  Parquet builder, so the features (ClassLabel, Image) are the hub's.

Sizes are chosen so that a smoke run keeps each paper table's sampling: the SNLI train split is large enough for an
expected Poisson batch of about one example at the paper's q = 256 / 549,367, and the arXiv train split holds more
than the 666 steps per epoch of Ganesh et al.'s single-pass schedule at one example per step.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from dp_adam_bench.paths import shared_data_dir

COMMIT = "0123456789abcdef0123456789abcdef01234567"  # the fake repositories' one revision

WORDS = (
    "a man woman child dog cat plays runs sits eats reads the in on at park street river table food coffee "
    "shop restaurant city centre near family friendly cheap expensive rating high low model network learning "
    "private gradient noise adam optimizer bias second moment results we show method paper data training"
).split()

#: the hub names the paper profiles load (configs/task/*.yaml, dp_adam_bench/tasks/*.py)
MODELS = ("gpt2", "bert-base-cased", "prajjwal1/bert-tiny", "roberta-base")
DATASETS = ("uoft-cs/cifar10", "stanfordnlp/snli", "e2e_nlg", "gfissore/arxiv-abstracts-2021", "nyu-mll/glue")


def hub_env(root: Path) -> dict[str, str]:
    """The environment that points every Hugging Face library at the fake hub, offline."""
    root = Path(root)
    return {
        "HF_HOME": str(root),
        "HF_HUB_CACHE": str(root / "hub"),
        "HF_DATASETS_CACHE": str(root / "datasets"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }


def _snapshot(root: Path, repo: str) -> Path:
    repo_dir = root / "hub" / ("models--" + repo.replace("/", "--"))
    (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
    (repo_dir / "refs" / "main").write_text(COMMIT)
    snap = repo_dir / "snapshots" / COMMIT
    snap.mkdir(parents=True, exist_ok=True)
    return snap


def _sentence(rng: np.random.Generator, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS, size=int(rng.integers(lo, hi)))).capitalize() + "."


# --------------------------------------------------------------------------------------------- models


def _gpt2(root: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    snap = _snapshot(root, "gpt2")
    for f in ("vocab.json", "merges.txt"):  # the real GPT-2 tokenizer files (byte-level BPE, 50,257 tokens)
        shutil.copy(shared_data_dir() / "gpt2_tokenizer" / f, snap / f)
    # gpt2's own config.json, shrunk: the same class, vocabulary and positions, 2 layers of width 32
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=1024, vocab_size=50257)
    GPT2LMHeadModel(config).save_pretrained(snap)


def _bert(root: Path, repo: str, *, lower: bool, hidden: int = 32) -> None:
    from transformers import BertConfig, BertForPreTraining

    snap = _snapshot(root, repo)
    src = shared_data_dir() / "bert_tiny"
    for f in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(src / f, snap / f)
    if not lower:  # bert-base-cased's tokenizer does not lower-case
        tok = json.loads((snap / "tokenizer.json").read_text())
        tok["normalizer"]["lowercase"] = False
        (snap / "tokenizer.json").write_text(json.dumps(tok))
        cfg = json.loads((snap / "tokenizer_config.json").read_text())
        cfg["do_lower_case"] = False
        (snap / "tokenizer_config.json").write_text(json.dumps(cfg))
    n_vocab = sum(1 for _ in open(src / "vocab.txt", encoding="utf-8"))
    config = BertConfig(
        vocab_size=n_vocab,
        hidden_size=hidden,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=512,
    )
    # the hub checkpoints are pre-training checkpoints (encoder + pooler + MLM and NSP heads)
    BertForPreTraining(config).save_pretrained(snap)


def _roberta(root: Path) -> None:
    """roberta-base: GPT-2's byte-level BPE with RoBERTa's special tokens (<s> 0, <pad> 1, </s> 2, <unk> 3, <mask>
    last, as in the real vocabulary), a tiny masked-LM of RoBERTa's class and positions (padding_idx + 1 on)."""
    from transformers import AutoTokenizer, RobertaConfig, RobertaForMaskedLM

    snap = _snapshot(root, "roberta-base")
    gpt2 = json.loads((shared_data_dir() / "gpt2_tokenizer" / "vocab.json").read_text(encoding="utf-8"))
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3} | {t: i + 4 for t, i in gpt2.items()}
    vocab["<mask>"] = len(vocab)
    (snap / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    shutil.copy(shared_data_dir() / "gpt2_tokenizer" / "merges.txt", snap / "merges.txt")
    (snap / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "RobertaTokenizer"}))
    tok = AutoTokenizer.from_pretrained(snap)
    config = RobertaConfig(
        vocab_size=len(tok), hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=514, type_vocab_size=1, pad_token_id=1,
    )  # fmt: skip
    RobertaForMaskedLM(config).save_pretrained(snap)
    tok.save_pretrained(snap)


# --------------------------------------------------------------------------------------------- data sets


def _cache_dataset(root: Path, repo: str, config_name: str, splits: dict, features) -> None:
    """Write ``splits`` ({split: columns}) as the datasets cache of ``load_dataset(repo)``."""
    import datasets
    from datasets.packaged_modules.parquet.parquet import Parquet

    src = root / "src" / repo.replace("/", "--")
    src.mkdir(parents=True, exist_ok=True)
    files = {}
    for split, cols in splits.items():
        path = src / f"{split}-00000-of-00001.parquet"
        datasets.Dataset.from_dict(cols, features=features).to_parquet(str(path))
        files[split] = str(path)
    name = repo.split("/")[-1]
    cache = root / "datasets"
    staging = root / "staging"
    builder = Parquet(
        cache_dir=str(staging),
        dataset_name=name,
        config_name=config_name,
        data_files=files,
        features=features,
        hash="f" * 16,
    )
    builder.download_and_prepare()
    # the builder names its folder <name>/<config>-<config id>; load_dataset(<org>/<name>) looks in
    # <org>___<name>/<config>/<version>/<hash>
    built = staging / name
    target = cache / ("___".join([*repo.split("/")[:-1], name]))
    target.mkdir(parents=True, exist_ok=True)
    for config_dir in built.iterdir():
        if config_dir.is_dir():
            shutil.move(str(config_dir), str(target / config_name))
    shutil.rmtree(staging)


def _cifar10(root: Path, rng) -> None:
    import datasets

    names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    feats = datasets.Features({"img": datasets.Image(), "label": datasets.ClassLabel(names=names)})
    from PIL import Image

    def split(n):
        x = rng.integers(0, 256, size=(n, 32, 32, 3), dtype=np.uint8)
        return {"img": [Image.fromarray(a) for a in x], "label": rng.integers(0, 10, n).tolist()}

    _cache_dataset(root, "uoft-cs/cifar10", "plain_text", {"train": split(400), "test": split(100)}, feats)


def _snli(root: Path, rng) -> None:
    import datasets

    feats = datasets.Features(
        {
            "premise": datasets.Value("string"),
            "hypothesis": datasets.Value("string"),
            "label": datasets.ClassLabel(names=["entailment", "neutral", "contradiction"]),
        }
    )

    def split(n):
        labels = rng.integers(0, 3, n)
        labels[rng.random(n) < 0.01] = -1  # like the hub's SNLI: pairs without a gold label have label -1
        return {
            "premise": [_sentence(rng, 5, 14) for _ in range(n)],
            "hypothesis": [_sentence(rng, 3, 8) for _ in range(n)],
            "label": labels.tolist(),
        }

    splits = {"train": split(2400), "validation": split(100), "test": split(100)}
    _cache_dataset(root, "stanfordnlp/snli", "plain_text", splits, feats)


def _glue_sst2(root: Path, rng) -> None:
    """nyu-mll/glue, configuration sst2: lower-cased sentences, labels 0 / 1 (its test split is unlabelled: -1)."""
    import datasets

    feats = datasets.Features(
        {
            "sentence": datasets.Value("string"),
            "label": datasets.ClassLabel(names=["negative", "positive"]),
            "idx": datasets.Value("int32"),
        }
    )

    def split(n, labelled=True):
        return {
            "sentence": [_sentence(rng, 3, 12).lower() for _ in range(n)],
            "label": rng.integers(0, 2, n).tolist() if labelled else [-1] * n,
            "idx": list(range(n)),
        }

    splits = {"train": split(600), "validation": split(60), "test": split(60, labelled=False)}
    _cache_dataset(root, "nyu-mll/glue", "sst2", splits, feats)


def _e2e(root: Path, rng) -> None:
    import datasets

    feats = datasets.Features(
        {"meaning_representation": datasets.Value("string"), "human_reference": datasets.Value("string")}
    )

    def split(n_mr, refs):
        mrs, out = [], []
        for _ in range(n_mr):
            mr = (
                f"name[{rng.choice(WORDS).title()}], eatType[{rng.choice(['pub', 'restaurant', 'coffee shop'])}], "
                f"food[{rng.choice(['French', 'English', 'Italian'])}], "
                f"area[{rng.choice(['riverside', 'city centre'])}]"
            )
            for _ in range(refs):
                mrs.append(mr)
                out.append(_sentence(rng, 6, 20))
        return {"meaning_representation": mrs, "human_reference": out}

    splits = {"train": split(200, 2), "validation": split(20, 2), "test": split(20, 3)}
    _cache_dataset(root, "e2e_nlg", "default", splits, feats)


def _arxiv(root: Path, rng) -> None:
    import datasets

    cols = ("id", "submitter", "authors", "title", "comments", "journal-ref", "doi", "abstract", "report-no")
    feats = datasets.Features(
        {c: datasets.Value("string") for c in cols}
        | {
            "categories": datasets.Sequence(datasets.Value("string")),
            "versions": datasets.Sequence(datasets.Value("string")),
        }
    )
    n = 900
    data = {c: [None] * n for c in cols}
    data["id"] = [f"21{i // 100:02d}.{i:05d}" for i in range(n)]
    data["title"] = [_sentence(rng, 4, 9) for _ in range(n)]
    data["abstract"] = [" ".join(_sentence(rng, 8, 20) for _ in range(4)) for _ in range(n)]
    data["categories"] = [["cs.LG"] for _ in range(n)]
    data["versions"] = [["v1"] for _ in range(n)]
    _cache_dataset(root, "gfissore/arxiv-abstracts-2021", "default", {"train": data}, feats)


#: the local data folder the smokes read (``DP_ADAM_BENCH_DATA``): only what no hub name serves, Persona-Chat (the
#: dialog task reads ``personachat_self_original.json`` from a folder, as a user who has it provides it)
LOCAL_DATA = "local_data"


def _persona_chat(root: Path, rng) -> None:
    """``<root>/local_data/persona_chat/personachat_self_original.json`` in TransferTransfo's layout: per dialog its
    ``personality`` and ``utterances``, each with the ``history`` so far and ``candidates`` ending in the gold reply."""

    def dialogs(n):
        out = []
        for _ in range(n):
            history, utterances = [_sentence(rng, 4, 10)], []
            for _ in range(3):
                reply = _sentence(rng, 4, 12)
                utterances.append({"candidates": [_sentence(rng, 4, 12), reply], "history": list(history)})
                history += [reply, _sentence(rng, 4, 10)]
            out.append({"personality": [_sentence(rng, 4, 8) for _ in range(4)], "utterances": utterances})
        return out

    folder = root / LOCAL_DATA / "persona_chat"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "personachat_self_original.json").write_text(
        json.dumps({"train": dialogs(400), "valid": dialogs(10)})
    )


def build_fake_hub(root: Path, seed: int = 0) -> Path:
    """Build the fake hub under ``root`` (call with the environment of :func:`hub_env` set, or not: the paths are
    explicit); returns ``root``."""
    root = Path(root)
    rng = np.random.default_rng(seed)
    _gpt2(root)
    _bert(root, "bert-base-cased", lower=False)
    # width 16: the paper's BandMF keeps b - 1 = 127 copies of the trained model, and its checkpoint is written and
    # read in every BandMF smoke run; with the untied decoder (the full BERT vocabulary x width twice) this model has
    # 1.02M parameters, still above the 1M-coordinate sample of the diagnostics' quantiles, and the BK engine
    # takes the same path for every layer as at width 32
    _bert(root, "prajjwal1/bert-tiny", lower=True, hidden=16)
    _cifar10(root, rng)
    _snli(root, rng)
    _e2e(root, rng)
    _arxiv(root, rng)
    _roberta(root)
    _glue_sst2(root, rng)
    _persona_chat(root, rng)
    (root / "FAKE_HUB.json").write_text(json.dumps({"models": MODELS, "datasets": DATASETS}))
    return root
