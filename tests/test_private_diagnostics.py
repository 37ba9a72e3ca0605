"""What leaves a run (issue 44): the diagnostics computed on private examples (every ``diag/`` key: the realised
Poisson batch size, the fraction clipped, per-example norm quantiles, clean-gradient moments) go to the run folder's
``private_diagnostics.jsonl``, not to ``metrics.jsonl`` or W&B, unless ``logger.share_private_diagnostics=true``; the
summary's self-check and engine-probe records stay out of W&B likewise; the readers merge the diagnostics back; the
run folder's rewrites are atomic."""

from __future__ import annotations

import json
import os

import pytest

from dp_adam_bench.engine import trainer
from dp_adam_bench.errors import ConfigError
from dp_adam_bench.tasks import registry
from dp_adam_bench.tracking import run_store
from dp_adam_bench.tracking.run_store import (
    METRICS_FILE,
    PRIVATE_DIAGNOSTICS_FILE,
    RunFolder,
    load_local_runs,
    read_jsonl,
    read_metrics,
)
from dp_adam_bench.tracking.sources import load_runs, unshared_diagnostics_note
from dp_adam_bench.tracking.wandb_logger import PRIVATE_SUMMARY_KEYS, SUMMARY_JSON_KEY, WandbLogger
from dp_adam_bench.tracking.wandb_source import PROJECT_ENV, records_from_runs
from dp_adam_bench.train import train

from helpers import ON_CPU, compose_cfg, tiny_poisson

wandb = pytest.importorskip("wandb")  # the GPU machines run without W&B (../shared/gpu/on_device.sh)

PRIVATE_SUMMARY = ("self_check", "engine_probe")


@pytest.fixture(autouse=True)
def tiny_task(monkeypatch):
    monkeypatch.setitem(registry.TASKS, "tiny", "tiny_task:TinyTask")


def run_overrides(experiment: str, *extra: str) -> list[str]:
    """A private tiny-task run of 8 Poisson steps logging every step, with clean-gradient diagnostics at steps 4
    and 8 (DP-AdamBC), W&B 'offline' (into the fake)."""
    return [
        *tiny_poisson(experiment, 8, "train.log_every=1"),
        "optimizer=adambc",
        "diagnostics.every=4",
        "logger.wandb.mode=offline",
        *extra,
    ]


def only_folder(root, experiment):
    (folder,) = [p for p in (root / "runs" / experiment).iterdir() if p.is_dir()]
    return folder


def is_diag(key) -> bool:
    return str(key).startswith("diag/")


def test_diag_keys_go_to_the_private_file_not_to_metrics_jsonl_or_wandb(isolated_dirs, fake_wandb):
    train(compose_cfg(run_overrides("split")))
    folder = only_folder(isolated_dirs, "split")

    public = read_jsonl(folder / METRICS_FILE)
    assert [r["step"] for r in public] == list(range(1, 9))  # still one row per logged step
    assert not any(is_diag(k) for r in public for k in r)
    assert all("epsilon" in r for r in public[:-1]) and "test_accuracy" in public[-1]  # the public keys stay

    private = read_jsonl(folder / PRIVATE_DIAGNOSTICS_FILE)
    assert [r["step"] for r in private] == list(range(1, 9))
    assert all(k == "step" or is_diag(k) for r in private for k in r)
    assert all({"diag/batch_size", "diag/frac_clipped"} <= set(r) for r in private)
    assert [r["step"] for r in private if "diag/phi" in r] == [4, 8]

    # the reader merges them back: one row per step with every key, as before the split
    (record,) = load_local_runs(isolated_dirs / "runs", "split")
    merged = record.metrics()
    assert merged == [{**p, **q} for p, q in zip(public, private, strict=True)]
    assert merged[3]["diag/phi"] == pytest.approx((1.0 * 0.5 / 16) ** 2) and "epsilon" in merged[3]

    # W&B: no diag/ key in the history, no self-check or probe record in the summary
    (wb,) = fake_wandb
    assert wb.finished and wb.rows
    assert not any(is_diag(k) for row in wb.rows for k in row)
    assert [row["_step"] for row in wb.rows] == [r["step"] for r in public]
    summary = json.loads((folder / "summary.json").read_text())
    assert all(summary[k] for k in PRIVATE_SUMMARY)  # kept locally
    assert set(PRIVATE_SUMMARY) <= set(PRIVATE_SUMMARY_KEYS)
    assert not any(k in wb.summary for k in PRIVATE_SUMMARY_KEYS)
    mirrored = json.loads(wb.summary[SUMMARY_JSON_KEY])
    shared = {k: v for k, v in summary.items() if k not in PRIVATE_SUMMARY_KEYS}
    shared["participation"] = {"verdict": summary["participation"]["verdict"]}  # its counts stay local
    assert mirrored == shared
    assert not any(is_diag(k) for k in wb.summary)


def test_share_private_diagnostics_also_sends_them_to_wandb(isolated_dirs, fake_wandb):
    train(compose_cfg(run_overrides("shared", "logger.share_private_diagnostics=true")))
    folder = only_folder(isolated_dirs, "shared")
    assert not any(
        is_diag(k) for r in read_jsonl(folder / METRICS_FILE) for k in r
    )  # the folder splits anyway
    (wb,) = fake_wandb
    merged = read_metrics(folder)
    assert [
        {"step": row["_step"], **{k: v for k, v in row.items() if k != "_step"}} for row in wb.rows
    ] == merged
    summary = json.loads((folder / "summary.json").read_text())
    assert all(wb.summary[k] == summary[k] for k in PRIVATE_SUMMARY)
    assert wb.summary[SUMMARY_JSON_KEY] == (folder / "summary.json").read_text()  # verbatim


def test_a_share_flag_that_is_not_a_boolean_is_refused_before_the_run_folder(isolated_dirs):
    with pytest.raises(ConfigError, match="logger.share_private_diagnostics='sometimes'; valid: false"):
        train(compose_cfg(run_overrides("bad", "logger.share_private_diagnostics=sometimes")))
    assert not (isolated_dirs / "runs" / "bad").exists()


def test_the_logger_alone_drops_diag_keys_and_steps_with_nothing_else(tmp_path, fake_wandb):
    wb = WandbLogger(run_dir=tmp_path, name="n", config={}, mode="offline")
    wb.log(1, {"diag/batch_size": 15, "diag/frac_clipped": 0.5})
    wb.log(2, {"diag/batch_size": 17, "epsilon": 0.3})
    wb.summary({"test_loss": 0.2, "diag/phi": 1e-4})
    assert fake_wandb[-1].rows == [{"_step": 2, "epsilon": 0.3}]
    assert fake_wandb[-1].summary == {"test_loss": 0.2}
    with pytest.raises(ValueError, match="share_private_diagnostics must be true or false"):
        WandbLogger(run_dir=tmp_path, name="n", config={}, mode="disabled", share_private_diagnostics="yes")


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_old_run_folders_and_partial_private_files_read_as_expected(tmp_path):
    old = tmp_path / "old"
    old.mkdir()
    rows = [{"step": 1, "diag/frac_clipped": 0.5, "epsilon": 0.1}, {"step": 2, "diag/frac_clipped": 0.25}]
    write_rows(old / METRICS_FILE, rows)
    assert read_metrics(old) == rows  # diag/ keys inside metrics.jsonl, no private file: as before

    new = tmp_path / "new"
    new.mkdir()
    write_rows(new / METRICS_FILE, [{"step": 1, "epsilon": 0.1}, {"step": 2}, {"step": 3, "epsilon": 0.3}])
    # step 2's diagnostics twice (the later wins), step 9's without a metrics.jsonl row (never returned)
    private = [{"step": 2, "diag/a": 0.0}, {"step": 2, "diag/a": 1.0}, {"step": 9, "diag/a": 9.0}]
    write_rows(new / PRIVATE_DIAGNOSTICS_FILE, private)
    assert read_metrics(new) == [
        {"step": 1, "epsilon": 0.1},
        {"step": 2, "diag/a": 1.0},
        {"step": 3, "epsilon": 0.3},
    ]
    assert read_metrics(tmp_path / "none") == []


@pytest.fixture
def replaced(monkeypatch):
    """Every os.replace target, in order (the call goes through)."""
    targets, real = [], os.replace

    def spy(src, dst, *args, **kwargs):
        targets.append(os.fspath(dst))
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", spy)
    return targets


def test_resume_truncates_both_files_atomically_and_keeps_them_consistent(isolated_dirs, replaced):
    extra = ("train.checkpoint_every=2", ON_CPU)  # bit-identical resume: a CPU promise
    full = train(compose_cfg(run_overrides("full", *extra, "logger.wandb.mode=disabled")))
    with pytest.raises(KeyboardInterrupt):
        train(
            compose_cfg(run_overrides("resumed", *extra, "logger.wandb.mode=disabled", "train.stop_after=5"))
        )
    folder = only_folder(isolated_dirs, "resumed")
    assert [r["step"] for r in read_jsonl(folder / PRIVATE_DIAGNOSTICS_FILE)] == [1, 2, 3, 4, 5]
    replaced.clear()
    resumed = train(compose_cfg(run_overrides("resumed", *extra, "logger.wandb.mode=disabled")))
    assert resumed["final_params_sha1"] == full["final_params_sha1"]
    # the resume rewrote both files once, through os.replace (as it did the config and the summary)
    names = [os.path.basename(t) for t in replaced]
    assert [n for n in names if n.endswith(".jsonl")] == [METRICS_FILE, PRIVATE_DIAGNOSTICS_FILE]
    assert {"config.yaml", "summary.json"} <= set(names)
    for name in (METRICS_FILE, PRIVATE_DIAGNOSTICS_FILE):
        assert [r["step"] for r in read_jsonl(folder / name)] == list(range(1, 9))
    assert read_metrics(folder) == read_metrics(only_folder(isolated_dirs, "full"))
    assert not list(folder.glob("*.tmp")) and not list(folder.glob(".*.tmp"))


def test_a_truncation_that_fails_leaves_both_files_whole(tmp_path, monkeypatch):
    public = [{"step": s, "epsilon": s / 10} for s in range(1, 6)]
    private = [{"step": s, "diag/batch_size": 10 + s} for s in range(1, 6)]
    write_rows(tmp_path / METRICS_FILE, public)
    write_rows(tmp_path / PRIVATE_DIAGNOSTICS_FILE, private)
    before = {n: (tmp_path / n).read_text() for n in (METRICS_FILE, PRIVATE_DIAGNOSTICS_FILE)}

    def killed(*args, **kwargs):
        raise OSError("killed before the rename")

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(OSError, match="killed before the rename"):
        trainer._truncate_metrics(tmp_path, 3)
    assert {n: (tmp_path / n).read_text() for n in before} == before  # never rewritten in place
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(before)  # no temporary file left
    monkeypatch.undo()
    trainer._truncate_metrics(tmp_path, 3)
    assert read_jsonl(tmp_path / METRICS_FILE) == public[:3]
    assert read_jsonl(tmp_path / PRIVATE_DIAGNOSTICS_FILE) == private[:3]


def test_a_fresh_start_drops_the_private_rows_of_the_attempt_it_replaces(isolated_dirs):
    # killed without a checkpoint: the relaunch starts afresh, so the killed attempt's diagnostics must go too
    with pytest.raises(KeyboardInterrupt):
        train(compose_cfg(run_overrides("fresh", "logger.wandb.mode=disabled", "train.stop_after=5")))
    train(compose_cfg(run_overrides("fresh", "logger.wandb.mode=disabled")))
    folder = only_folder(isolated_dirs, "fresh")
    for name in (METRICS_FILE, PRIVATE_DIAGNOSTICS_FILE):
        assert [r["step"] for r in read_jsonl(folder / name)] == list(range(1, 9))


def test_the_run_folder_writes_its_config_and_summaries_atomically(tmp_path, replaced):
    folder = RunFolder.create(tmp_path, "exp", {"optimizer": {"name": "sgd", "lr": 0.1}, "seed": 0})
    folder.write_json("ledger.json", {"events": []})
    folder.finish({"metrics": {"test_loss": 0.5}}, seed=0)
    assert [os.path.basename(t) for t in replaced] == ["config.yaml", "ledger.json", "summary.json"]
    assert json.loads((folder.path / "summary.json").read_text())["status"] == "complete"
    assert sorted(p.name for p in folder.path.iterdir()) == [
        ".lock",
        "config.yaml",
        "ledger.json",
        "summary.json",
    ]
    # a rewrite keeps the file's mode
    os.chmod(folder.path / "ledger.json", 0o600)
    run_store.atomic_write_text(folder.path / "ledger.json", "{}")
    assert (folder.path / "ledger.json").stat().st_mode & 0o777 == 0o600


# --- reports reading W&B runs -------------------------------------------------------------------------------------


class FakeApiRun:
    def __init__(self, name, config, rows):
        self.name, self.id, self.group, self.config = name, name, "exp", config
        self.created_at = "2026-01-01T00:00:00"
        self.summary_metrics = {"status": "complete", "metrics": {"test_loss": 0.5}}
        self._rows = rows

    def scan_history(self):
        return iter(self._rows)


def test_reading_wandb_runs_without_their_diagnostics_says_so(isolated_dirs, monkeypatch, capsys):
    rows = [{"_step": 1, "epsilon": 0.1}]
    runs = [
        FakeApiRun("private", {"logger": {"share_private_diagnostics": False}}, rows),
        FakeApiRun("shared", {"logger": {"share_private_diagnostics": True}}, [{**rows[0], "diag/phi": 1.0}]),
        FakeApiRun("before-the-split", {"logger": {"wandb": {"mode": None}}}, [{**rows[0], "diag/phi": 1.0}]),
    ]
    records = records_from_runs(runs, isolated_dirs / "wandb")
    assert [r.diagnostics_shared for r in records] == [True, False, True]  # sorted by name
    note = unshared_diagnostics_note(records, "exp")
    assert note.startswith("note: 1 W&B run(s) of 'exp' (private) carry no diag/ keys")
    assert "logger.share_private_diagnostics=true" in note and "--source local" in note
    assert unshared_diagnostics_note([r for r in records if r.diagnostics_shared], "exp") is None

    class Api:
        def runs(self, path, filters=None, **_):
            return runs

    monkeypatch.delenv(PROJECT_ENV, raising=False)
    monkeypatch.setattr(wandb, "Api", lambda *a, **k: Api())
    loaded = load_runs(isolated_dirs / "runs", "exp", "wandb", "ent/proj")
    assert len(loaded) == 3 and note in capsys.readouterr().err
    assert load_runs(isolated_dirs / "runs", "exp", "local") == [] and capsys.readouterr().err == ""


def test_only_the_participation_verdict_reaches_wandb(tmp_path, fake_wandb):
    """The participation record's counts (pairs drawn: the realised batch sizes added up; examples never sampled;
    the rate test's observed rate) describe the private sampling: W&B gets its verdict alone."""
    wb = WandbLogger(run_dir=tmp_path, name="n", config={}, mode="offline")
    shared = wb.shared_summary(
        {"participation": {"verdict": "consistent", "drawn": 1234, "never_sampled": 7}}
    )
    assert shared == {"participation": {"verdict": "consistent"}}
