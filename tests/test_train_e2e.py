"""End to end: Hydra config -> run folder + W&B offline run; rerun skipping; seeded reproducibility."""

import json
from pathlib import Path

import pytest
import yaml

from dp_adam_bench.train import train

from helpers import TINY_1D, compose_cfg
from wandb_reader import history

BASE = ["optimizer=adagrad_ime", "noise=dpmf_sqrt", "privacy.sigma=0.1", "experiment_name=e2e", *TINY_1D]


def run_folder(root: Path) -> Path:
    (folder,) = [p for p in (root / "runs" / "e2e").iterdir() if p.is_dir()]
    return folder


def test_run_writes_complete_folder_and_same_metrics_to_wandb(isolated_dirs):
    summary = train(compose_cfg(BASE))
    folder = run_folder(isolated_dirs)
    cfg = yaml.safe_load((folder / "config.yaml").read_text())
    assert cfg["optimizer"]["name"] == "adagrad_ime" and cfg["privacy"]["sigma"] == 0.1
    metrics = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [20, 40, 60]
    saved = json.loads((folder / "summary.json").read_text())
    assert saved["status"] == "complete" and saved["seed"] == 0 and saved["git_commit"]
    assert saved["metrics"]["test_loss"] == pytest.approx(summary["metrics"]["test_loss"])
    assert len(saved["trials"]["test_loss"]) == 3
    assert saved["epsilon"]["pld"] > 0 and (folder / "ledger.json").exists()
    # the offline W&B run carries exactly the metrics of metrics.jsonl, at the same steps
    (wandb_file,) = folder.glob("wandb/offline-run-*/run-*.wandb")
    rows = history(wandb_file)
    assert len(rows) == len(metrics)
    for row, m in zip(rows, metrics, strict=True):
        assert row["_step"] == m["step"]
        for key, value in m.items():
            if key != "step":
                assert row[key] == pytest.approx(value)


def test_complete_run_is_skipped_and_force_reruns(isolated_dirs):
    assert train(compose_cfg(BASE)) is not None
    assert train(compose_cfg(BASE)) is None
    assert train(compose_cfg([*BASE, "train.force=true"])) is not None


def test_same_seed_same_result_other_seed_differs(isolated_dirs):
    a = train(compose_cfg([*BASE, "logger.wandb.mode=disabled"]))
    b = train(compose_cfg([*BASE, "logger.wandb.mode=disabled", "train.force=true"]))
    c = train(compose_cfg([*BASE, "logger.wandb.mode=disabled", "seed=1"]))
    assert a["trials"] == b["trials"]
    assert a["trials"] != c["trials"]


def test_nonprivate_run_records_no_noise_and_no_clipping(isolated_dirs):
    summary = train(
        compose_cfg(
            [
                "optimizer=adagrad_pp",
                "noise=none",
                "experiment_name=e2e",
                "logger.wandb.mode=disabled",
                *TINY_1D,
            ]
        )
    )
    cfg = yaml.safe_load((run_folder(isolated_dirs) / "config.yaml").read_text())
    assert cfg["privacy"]["sigma"] == 0.0 and cfg["privacy"]["clip"] is None
    assert summary["private"] is False and summary["epsilon"] == {}
    assert summary["metrics"]["test_loss_std"] == 0.0  # deterministic without noise


@pytest.mark.parametrize("variant,factor", [("adagrad_ime", 1.0), ("adagrad_ime_free", 2**0.5)])
def test_ime_for_free_is_accounted_at_its_real_cost(isolated_dirs, variant, factor):
    # IME noises g and g^2 with sqrt(2) sigma each: joint mu = 1/sigma. "For free" uses sigma each: mu = sqrt(2)/sigma.
    s = train(
        compose_cfg(
            [
                f"optimizer={variant}",
                "noise=independent",
                "privacy.sigma=0.5",
                "experiment_name=e2e",
                "logger.wandb.mode=disabled",
                *TINY_1D,
            ]
        )
    )
    (event,) = s["ledger"]["events"]
    assert event["kind"] == "gaussian"
    assert event["mu"] == pytest.approx(factor / 0.5)
    assert any("accounted with noise multiplier" in n for n in s["privacy_notes"]) == (factor != 1.0)


def test_ime_with_poisson_batches_is_refused(isolated_dirs):
    with pytest.raises(ValueError, match="Poisson batches are unbounded"):
        train(
            compose_cfg(
                [
                    "optimizer=adagrad_ime",
                    "noise=independent",
                    "privacy.sigma=0.5",
                    "train.sampler=poisson",
                    "train.steps=5",
                    "experiment_name=e2e",
                    "logger.wandb.mode=disabled",
                    *TINY_1D,
                ]
            )
        )
