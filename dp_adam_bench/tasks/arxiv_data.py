"""The arXiv abstracts (Ganesh, McMahan & Thakurta 2025, arXiv:2507.01129, §5.2): reading them and the fixed
train / val / test split by a seeded hash of the arXiv id. Used by the arxiv_mlm task and by the pretraining presets
that read the same public text (:mod:`dp_adam_bench.pretrain`)."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import numpy as np

from dp_adam_bench.paths import shared_data_dir
from dp_adam_bench.tasks import text
from dp_adam_bench.tasks.base import missing_data, try_hub

FOLDER = "arxiv_abstracts"
DATA_FILE = "arxiv_abstracts.jsonl.gz"
HF_NAME = (
    "gfissore/arxiv-abstracts-2021"  # ≈ 2M abstracts, columns id / abstract (paper profile; needs the hub)
)
SOURCES = ("auto", "local", "hf")
SPLIT_CODES = {"train": 0, "val": 1, "test": 2}


def read_abstracts(path: str | os.PathLike) -> tuple[list[str], list[str]]:
    """(keys, abstracts) from a JSON-lines file (gzipped or not) with ``abstract`` and optional ``arxiv_id``."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    keys, texts = [], []
    with opener(path, "rt", encoding="utf-8") as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                abstract = row["abstract"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path}: line {i + 1} is not a JSON object with an 'abstract' ({e})") from e
            if not isinstance(abstract, str) or not abstract.strip():
                continue
            aid = row.get("arxiv_id")
            keys.append(f"id:{aid}" if aid else f"text:{abstract.strip().lower()}")
            texts.append(abstract)
    if not texts:
        raise ValueError(f"{path}: no abstracts")
    return keys, texts


def load_abstracts_hf(name: str = HF_NAME, text_field: str = "abstract", id_field: str = "id"):
    import datasets

    d = datasets.load_dataset(name, split="train")
    ids = d[id_field] if id_field in d.column_names else [None] * len(d)
    texts = [t for t in d[text_field]]
    keys = [f"id:{i}" if i else f"text:{t.strip().lower()}" for i, t in zip(ids, texts, strict=True)]
    return keys, texts


def load_abstracts(source: str = "auto", data_dir=None, hf_name: str = HF_NAME, **hf_kw):
    """(keys, abstracts, description); FileNotFoundError listing everything tried when nothing is found."""
    if source not in SOURCES:
        raise ValueError(f"unknown arXiv source {source!r}; valid: {', '.join(SOURCES)}")
    tried = []
    if source in ("auto", "local"):
        cands = []
        if data_dir is not None:
            d = Path(data_dir).expanduser()
            cands += [d] if d.suffix in (".gz", ".jsonl") else [d / DATA_FILE, d / FOLDER / DATA_FILE]
        cands.append(shared_data_dir() / FOLDER / DATA_FILE)
        for c in dict.fromkeys(cands):
            if c.is_file():
                keys, texts = read_abstracts(c)
                return keys, texts, f"local:{c}"
            tried.append(f"{c} does not exist")
    if source in ("auto", "hf"):
        data = try_hub(source, hf_name, lambda: load_abstracts_hf(hf_name, **hf_kw), tried)
        if data is not None:
            return (*data, f"hf:{hf_name}")
    raise missing_data(
        "arXiv abstracts",
        source,
        tried,
        f"Provide task.data_dir=/path/to/folder holding {DATA_FILE} (JSON lines with 'abstract' and optional "
        f"'arxiv_id'); the shared offline copy is {shared_data_dir() / FOLDER / DATA_FILE} (DP_ADAM_BENCH_DATA sets "
        "the data folder); or hub access for task.source=hf.",
        task="arxiv_mlm",
    )


def assign_splits(keys: list[str], seed: int, val_fraction: float, test_fraction: float) -> np.ndarray:
    """Split code per row (0 train, 1 val, 2 test) from a seeded sha256 of the key: fixed, machine-independent."""
    if not (0 <= val_fraction < 1 and 0 < test_fraction < 1 and val_fraction + test_fraction < 1):
        raise ValueError(
            f"task.val_fraction={val_fraction} and task.test_fraction={test_fraction}: want test_fraction > 0, "
            "both >= 0 and a sum < 1"
        )
    u = np.fromiter((text.stable_unit_hash(k, seed) for k in keys), dtype=np.float64, count=len(keys))
    return np.where(u < test_fraction, 2, np.where(u < test_fraction + val_fraction, 1, 0)).astype(np.int8)
