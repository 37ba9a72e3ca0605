"""The benchmark scripts: bench_engines.py end to end on a tiny configuration, run_all.py's README writer."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

BENCH_DIR = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH_DIR))

import bench_engines  # noqa: E402
import run_all  # noqa: E402

REQUIRED = [
    "model",
    "batch_size",
    "mode",
    "engine",
    "median_step_s",
    "ratio_to_nonprivate",
    "peak_rss_gib",
    "ratio_mem_to_nonprivate",
    "threads",
    "torch_version",
    "opacus_version",
    "cpu",
    "date",
]


@pytest.mark.slow
def test_bench_engines_quick_writes_the_csv(tmp_path):
    out = tmp_path / "engines.csv"
    env = dict(os.environ, BENCH_THREADS="1")
    cmd = [sys.executable, str(BENCH_DIR / "bench_engines.py"), "--quick", "--modes", "nonprivate", "ghost"]
    done = subprocess.run(cmd + ["--out", str(out)], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    df = pd.read_csv(out)
    assert list(df.columns[: len(REQUIRED)]) == REQUIRED
    assert list(df["mode"]) == ["nonprivate", "ghost"]
    assert set(df["batch_size"]) == {16} and set(df["model"]) == {"cnn5"}
    assert (df["median_step_s"] > 0).all() and (df["peak_rss_gib"] > 0).all()
    assert (df["threads"] == 1).all() and (df["steps"] == 2).all()
    assert list(df["engine"]) == ["torch.optim.Adam", "ghost"]
    np_row, ghost = df.iloc[0], df.iloc[1]
    assert np_row.ratio_to_nonprivate == pytest.approx(1.0)
    assert ghost.ratio_to_nonprivate == pytest.approx(ghost.median_step_s / np_row.median_step_s)
    assert ghost.ratio_mem_to_nonprivate == pytest.approx(ghost.peak_rss_gib / np_row.peak_rss_gib)
    assert "| cnn5 | 16 | ghost |" in done.stdout


def _engine_rows(model, b, times, mems, params, stp_engine="functorch"):
    rows = []
    for mode, t in times.items():
        rows.append(
            {
                "model": model,
                "batch_size": b,
                "mode": mode,
                "engine": {"nonprivate": "torch.optim.Adam", "stp": stp_engine}.get(mode, mode),
                "median_step_s": t,
                "ratio_to_nonprivate": t / times["nonprivate"],
                "peak_rss_gib": mems[mode],
                "ratio_mem_to_nonprivate": mems[mode] / mems["nonprivate"],
                "threads": 2,
                "torch_version": "2.13.0+cpu",
                "opacus_version": "1.6.0",
                "cpu": "Fake CPU 9000",
                "date": "2026-11-22T00:00:00+00:00",
                "min_step_s": t,
                "rss_before_steps_gib": 0.4,
                "physical_batch_size": min(b, 256),
                "warmup": 2,
                "steps": 5,
                "params": params,
                "notes": "",
            }
        )
    return rows


def _fake_csvs(d: Path) -> None:
    rows = _engine_rows(
        "cnn5",
        256,
        {"nonprivate": 1.0, "ghost": 2.0, "hooks": 3.0, "functorch": 2.5, "stp": 3.5},
        {"nonprivate": 1.0, "ghost": 1.35, "hooks": 1.5, "functorch": 1.6, "stp": 1.7},
        411466,
    )
    rows += _engine_rows(
        "bert_tiny", 256, {"nonprivate": 1.0, "ghost": 2.0}, {"nonprivate": 1, "ghost": 1.3}, 4386178
    )
    pd.DataFrame(rows).to_csv(d / "results_engines.csv", index=False)
    pd.DataFrame(
        [
            {"mechanism": "bandmf_b128", "model": "tinybert_4.4M", "ms_per_step_median": 150.0, "threads": 1},
            {"mechanism": "blt_4", "model": "tinybert_4.4M", "ms_per_step_median": 50.0, "threads": 1},
        ]
    ).to_csv(d / "results_noise.csv", index=False)
    pd.DataFrame(
        [
            {"setting": "a", "accountant": "rdp", "calibrate_s_median": 0.05, "repeats": 3},
            {"setting": "b", "accountant": "rdp", "calibrate_s_median": 0.07, "repeats": 3},
            {"setting": "a", "accountant": "pld", "calibrate_s_median": 1.2, "repeats": 3},
        ]
    ).to_csv(d / "results_accounting.csv", index=False)


def _target(readme: str, target: str, config: str) -> str:
    for line in readme.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith(target) and cells[1].startswith(config):
            return cells[3]
    raise AssertionError(f"no target row {target!r} / {config!r}")


def test_readme_from_fake_csvs(tmp_path):
    _fake_csvs(tmp_path)
    run_all.record_provenance(tmp_path, "results_engines.csv", "python benchmarks/bench_engines.py", 12.3)
    path = run_all.write_readme(tmp_path, tmp_path / "README.md")
    readme = path.read_text()

    for b in run_all.BENCHES.values():
        assert f"## {b.title}: `{b.csv}`" in readme
    assert "make bench" in readme and "python benchmarks/run_all.py --quick" in readme
    assert "Fake CPU 9000" in readme
    # which command, and when: recorded for engines, not for the other two
    assert "Produced by `python benchmarks/bench_engines.py`" in readme
    assert (
        json.loads((tmp_path / "results_provenance.json").read_text())["results_engines.csv"]["finished"]
        in readme
    )
    assert readme.count("Command not recorded") == 2
    # tables come from the CSVs
    assert "| cnn5 | 256 | ghost | ghost | 2 | 2 | 1.35 | 1.35 |" in readme
    assert "Same in every row:" in readme and "cpu = Fake CPU 9000" in readme
    # targets, computed
    assert _target(readme, "DP step / non-private", "cnn5, B=256").startswith("missed by 0.50x")
    assert _target(readme, "DP step / non-private", "bert_tiny, B=256").startswith("missed by 0.50x")
    assert _target(readme, "peak memory", "cnn5, B=256").startswith("missed by 0.15x")
    assert _target(readme, "peak memory", "bert_tiny, B=256").startswith("missed by 0.10x")
    assert _target(readme, "stp step", "cnn5, B=256").startswith("missed by 0.50x")
    assert _target(readme, "BandMF", "bert_tiny").startswith("met (7.5 %")  # 150 ms / 2 s
    assert _target(readme, "BLT", "bert_tiny").startswith("missed by 0.5 %")  # 50 ms / 2 s = 2.5 %
    assert _target(readme, "sigma calibration", "rdp").startswith("met")
    assert _target(readme, "sigma calibration", "pld").startswith("missed by 0.2 s")
    assert _target(readme, "PITFALLS Opacus ghost on the small CNN, time", "cnn5").startswith("met: beats")
    ghost_mem = _target(readme, "PITFALLS Opacus ghost on the small CNN, memory", "cnn5")
    assert ghost_mem == "missed by 0.05x (within the PITFALLS range, not beaten)"
    assert _target(readme, "PITFALLS Opacus hooks on the small CNN, memory", "cnn5") == "met (1.50x <= 3.00x)"
    assert _target(readme, "PITFALLS Opacus hooks on the small CNN, time", "cnn5").startswith("met: beats")
    assert "not measured yet" not in readme
    assert "--quick` runs" not in readme


def test_readme_says_what_is_not_measured(tmp_path):
    _fake_csvs(tmp_path)
    (tmp_path / "results_noise.csv").unlink()
    readme = run_all.render_readme(tmp_path)
    assert "Not measured yet: run `python benchmarks/bench_noise.py`" in readme
    assert _target(readme, "BandMF", "results_noise.csv") == "not measured yet"
    assert _target(readme, "BLT", "results_noise.csv") == "not measured yet"

    # noise measured, but no d = 4.4M model in the engines CSV
    _fake_csvs(tmp_path)
    df = pd.read_csv(tmp_path / "results_engines.csv")
    df[df["model"] == "cnn5"].to_csv(tmp_path / "results_engines.csv", index=False)
    readme = run_all.render_readme(tmp_path)
    assert _target(readme, "BandMF", "results_noise.csv").startswith("not measured yet")

    for f in tmp_path.glob("results_*.csv"):
        f.unlink()
    readme = run_all.render_readme(tmp_path)
    assert readme.count("Not measured yet: run") == 3
    verdicts = [
        ln.rsplit("|", 2)[1].strip() for ln in readme.split("## Targets")[1].splitlines() if "| " in ln
    ]
    assert verdicts[0] == "verdict" and len(verdicts) > 5
    assert all(v == "not measured yet" for v in verdicts[1:])


def test_quick_rows_are_flagged(tmp_path):
    _fake_csvs(tmp_path)
    df = pd.read_csv(tmp_path / "results_engines.csv")
    df["steps"] = 2
    df.to_csv(tmp_path / "results_engines.csv", index=False)
    readme = run_all.render_readme(tmp_path)
    assert "--quick` runs" in readme
    assert _target(readme, "DP step / non-private", "cnn5, B=256").startswith("QUICK RUN, not representative")
    # accounting rows are not engine rows
    assert _target(readme, "sigma calibration", "rdp").startswith("met")


def test_stp_engine_is_the_faster_measured_one():
    rows = [
        {"model": "cnn5", "batch_size": 256, "mode": "hooks", "median_step_s": 2.0},
        {"model": "cnn5", "batch_size": 256, "mode": "functorch", "median_step_s": 1.5},
        {"model": "cnn5", "batch_size": 2048, "mode": "hooks", "median_step_s": 9.0},
    ]
    assert bench_engines._stp_engine("auto", rows, "cnn5", 256)[0] == "functorch"
    assert bench_engines._stp_engine("auto", rows, "cnn5", 2048)[0] == "hooks"
    assert bench_engines._stp_engine("hooks", rows, "cnn5", 256)[0] == "hooks"
