"""The benchmark scripts: bench_engines.py end to end on a tiny configuration, run_all.py and the README writer
(benchmarks/report/)."""

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
from report import profiles, registry  # noqa: E402
from report.provenance import record_provenance  # noqa: E402
from report.readme import render_readme, write_readme  # noqa: E402

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
    pd.DataFrame(
        [
            {
                "table": "ganesh_fig2",
                "wandb_mode": "disabled",
                "runs": 91,
                "sweep_s": 10.0,
                "total_s": 12.0,
                "s_per_run": 0.11,
                "threads": 2,
            }
        ]
    ).to_csv(d / "results_fig2.csv", index=False)
    pd.DataFrame(
        [
            {
                "model": "cnn5",
                "batch_size": 256,
                "run_steps": 200,
                "run_checks": 6,
                "run_share": 0.019,
                "check_s_median": 1.5,
                "step_s_median": 0.6,
            }
        ]
    ).to_csv(d / "results_checks.csv", index=False)


def _target(readme: str, target: str, config: str) -> str:
    for line in readme.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith(target) and cells[1].startswith(config):
            return cells[3]
    raise AssertionError(f"no target row {target!r} / {config!r}")


def test_readme_from_fake_csvs(tmp_path):
    _fake_csvs(tmp_path)
    record_provenance(tmp_path, "results_engines.csv", "python benchmarks/bench_engines.py", 12.3)
    path = write_readme(tmp_path, tmp_path / "README.md")
    readme = path.read_text()

    for b in registry.BENCHES.values():
        assert f"## {b.title}: `{b.csv}`" in readme
    assert "make bench" in readme and "python benchmarks/run_all.py --quick" in readme
    assert "Fake CPU 9000" in readme
    # which command, and when: recorded for engines, not for the other four
    assert "Produced by `python benchmarks/bench_engines.py`" in readme
    assert (
        json.loads((tmp_path / "results_provenance.json").read_text())["results_engines.csv"]["finished"]
        in readme
    )
    assert readme.count("Command not recorded") == 4
    assert _target(readme, "1-D logistic Fig. 2", "W&B disabled").startswith("met (12")
    assert _target(readme, "engine watch", "cnn5 B = 256").startswith("met (1.9 %")
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
    readme = render_readme(tmp_path)
    assert "Not measured yet: run `python benchmarks/bench_noise.py`" in readme
    assert _target(readme, "BandMF", "results_noise.csv") == "not measured yet"
    assert _target(readme, "BLT", "results_noise.csv") == "not measured yet"

    # noise measured, but no d = 4.4M model in the engines CSV
    _fake_csvs(tmp_path)
    df = pd.read_csv(tmp_path / "results_engines.csv")
    df[df["model"] == "cnn5"].to_csv(tmp_path / "results_engines.csv", index=False)
    readme = render_readme(tmp_path)
    assert _target(readme, "BandMF", "results_noise.csv").startswith("not measured yet")

    for f in tmp_path.glob("results_*.csv"):
        f.unlink()
    readme = render_readme(tmp_path)
    assert readme.count("Not measured yet: run") == len(registry.default_benches())
    targets = readme.split("## Targets")[1].split("\n## ")[0]
    verdicts = [ln.rsplit("|", 2)[1].strip() for ln in targets.splitlines() if "| " in ln]
    assert verdicts[0] == "verdict" and len(verdicts) > 5
    assert all(v == "not measured yet" for v in verdicts[1:])


def test_quick_rows_are_flagged(tmp_path):
    _fake_csvs(tmp_path)
    df = pd.read_csv(tmp_path / "results_engines.csv")
    df["steps"] = 2
    df.to_csv(tmp_path / "results_engines.csv", index=False)
    readme = render_readme(tmp_path)
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
    rows.append({"model": "cnn5", "batch_size": 256, "mode": "bk", "median_step_s": 1.0})
    assert bench_engines._stp_engine("auto", rows, "cnn5", 256)[0] == "bk"
    assert bench_engines._stp_engine("auto", [], "cnn5", 256)[0] == "bk"


# ------------------------------------------------------------------------------------ language models, profiles


@pytest.fixture
def one_thread(monkeypatch):
    """BENCH_THREADS=1 for in-process benchmark code; torch's thread count restored afterwards."""
    import torch

    monkeypatch.setenv("BENCH_THREADS", "1")
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_language_models_have_the_issue_shapes():
    """Full-size builders on the meta device (no memory, no time): the shapes the issues ask for."""
    import torch

    with torch.device("meta"):
        gpt2 = bench_engines.build_gpt2_small()
        mlm = bench_engines.build_bert_tiny_mlm()
        clf = bench_engines.build_bert_tiny()
    assert gpt2.seq_len == mlm.seq_len == clf.seq_len == 128
    lm = gpt2.model.lm
    assert (lm.config.n_layer, lm.config.n_embd, lm.config.n_head, lm.config.vocab_size) == (
        12,
        768,
        12,
        50257,
    )
    assert lm.lm_head.weight is not lm.transformer.wte.weight  # untied
    assert (
        sum(p.numel() for p in gpt2.model.parameters()) == 124_439_808 + 50257 * 768
    )  # + the untied lm_head
    assert not any(type(m).__name__ == "Conv1D" for m in gpt2.model.modules())
    assert mlm.model.cls.predictions.decoder.weight is not mlm.model.bert.embeddings.word_embeddings.weight
    b = mlm.make_batch(3, torch.Generator().manual_seed(0))
    assert b["input_ids"].shape == (3, 128) and b["mlm_positions"].shape == (3, 19)  # 15 % of 126
    pos = b["mlm_positions"]
    assert (pos.diff(dim=1) > 0).all() and pos.min() >= 1 and pos.max() <= 126
    g = gpt2.make_batch(2, torch.Generator().manual_seed(0))
    assert g["target_positions"][0].tolist() == list(range(63, 127))
    assert torch.equal(g["target_labels"], g["input_ids"][:, 64:])


@pytest.mark.parametrize("model", ["bert_tiny_mlm", "gpt2_small"])
@pytest.mark.slow
def test_language_models_run_every_mode_quick(model, one_thread):
    """run_one in this process (no interpreter start-up per mode) on the tiny --quick shapes."""
    rows = []
    for mode, engine in [
        ("nonprivate", ""),
        ("ghost", "ghost"),
        ("bk", "bk"),
        ("hooks", "hooks"),
        ("stp", "bk"),
        ("stp", "hooks"),
    ]:
        spec = {"model": model, "batch_size": 3, "mode": mode, "engine": engine, "physical_batch_size": 2}
        rows.append(bench_engines.run_one(spec | {"warmup": 0, "steps": 1, "quick": True}))
    assert [r["engine"] for r in rows] == ["torch.optim.Adam", "ghost", "bk", "hooks", "bk", "hooks"]
    for r in rows:
        assert r["median_step_s"] > 0 and r["peak_rss_default_gib"] > 0 and r["seq_len"] == 16
        assert r["threads"] == 1 and r["transformers_version"]
    assert [r["physical_batch_size"] for r in rows] == [3, 2, 2, 2, 2, 2]  # DP modes in micro-batches
    memory = bench_engines.run_one(spec | {"warmup": 0, "steps": 1, "quick": True, "memory": True})
    assert list(memory) == ["peak_rss_gib"] and memory["peak_rss_gib"] > 0  # the memory child's one number
    assert "functorch" in bench_engines.UNSUPPORTED[model]
    planned = bench_engines.plan([model], [8], bench_engines.MODES, ["bk", "hooks"])
    assert [(m, e) for _, _, m, e in planned] == [
        ("nonprivate", None),
        ("ghost", "ghost"),
        ("bk", "bk"),
        ("hooks", "hooks"),
        ("stp", "bk"),
        ("stp", "hooks"),
    ]


def test_profile_step_writes_its_file(tmp_path, one_thread):
    import profile_step
    from opacus.grad_sample import GradSampleModule

    from dp_adam_bench.engine import grads

    samplers, summed = dict(GradSampleModule.GRAD_SAMPLERS), grads._sum_materialised
    kw = {"warmup": 1, "steps": 1, "quick": True, "out_dir": tmp_path}
    ref = profile_step.profile("gpt2_small", 2, "nonprivate", **kw)
    path = profile_step.profile("gpt2_small", 2, "bk", **kw)
    hooks = profile_step.profile("cnn5", 2, "hooks", **kw)
    assert ref.name == "gpt2_small_B2_nonprivate.txt" and path.name == "gpt2_small_B2_bk.txt"
    text = path.read_text()
    assert text.splitlines()[1].startswith("Summary: gpt2_small B=2 bk:")
    assert "vs non-private" in text.splitlines()[1]  # the reference profile was there
    for phase in ("forward", "backward", "norms", "clipped_sum", "noise", "optimizer"):
        assert f"| {phase} |" in text
    assert "Top 25 operators by self CPU time" in text and "aten::" in text
    info = json.loads(path.with_suffix(".json").read_text())
    assert info["phases_s"]["norms"] > 0 and info["mode"] == "bk" and info["quick"]
    assert "| per_example_grads |" in hooks.read_text()
    # Opacus and the library are as they were
    assert dict(GradSampleModule.GRAD_SAMPLERS) == samplers and grads._sum_materialised is summed
    assert profile_step.profile_name("m", 8, "stp", "hooks") == "m_B8_stp-hooks"
    assert profile_step.profile_name("m", 8, "stp", "bk") == "m_B8_stp"
    # under bf16 autocast the forward's matmuls take bf16 inputs and bk's norms and sums fp32 ones (fp32_exact.py),
    # (the captures cast up): the precision breakdown says which, per phase
    bf16 = profile_step.profile("gpt2_small", 2, "bk", precision="bf16", **kw)
    assert bf16.name == "gpt2_small_B2_bk_bf16.txt"
    rows = {tuple(c.strip() for c in ln.split("|")[1:4]) for ln in bf16.read_text().splitlines()}
    assert ("forward", "matmul / conv", "BFloat16") in rows
    assert ("norms", "matmul / conv", "float") in rows and ("clipped_sum", "matmul / conv", "float") in rows
    assert ("forward", "matmul / conv", "BFloat16") not in {
        tuple(c.strip() for c in ln.split("|")[1:4]) for ln in path.read_text().splitlines()
    }  # the fp32 profile has none
    # the README lists it with its summary
    section = "\n".join(profiles.profiles_section(tmp_path.parent / "x"))
    assert "No profiles yet" in section
    (tmp_path / "profiles").mkdir()
    for f in tmp_path.glob("gpt2_small_B2_*"):
        f.rename(tmp_path / "profiles" / f.name)
    section = "\n".join(profiles.profiles_section(tmp_path))
    assert "[`profiles/gpt2_small_B2_bk.txt`](profiles/gpt2_small_B2_bk.txt) (QUICK" in section
    assert info["summary"] in section


def _lm_rows():
    rows = _engine_rows(
        "gpt2_small",
        8,
        {"nonprivate": 10.0, "ghost": 21.0, "bk": 14.0, "hooks": 24.0, "stp": 25.0},
        {"nonprivate": 4.0, "ghost": 5.0, "bk": 4.4, "hooks": 9.0, "stp": 6.0},
        163037184,
        stp_engine="bk",
    )
    rows += [
        r | {"engine": "hooks", "median_step_s": 40.0, "ratio_to_nonprivate": 4.0}
        for r in _engine_rows(
            "gpt2_small", 8, {"nonprivate": 10.0, "stp": 40.0}, {"nonprivate": 4, "stp": 9}, 1
        )
        if r["mode"] == "stp"
    ]
    rows += _engine_rows(
        "gpt2_small", 32, {"nonprivate": 40.0, "ghost": 84.0}, {"nonprivate": 9, "ghost": 10}, 1
    )
    return rows


def test_ratio_table_and_misses(tmp_path):
    _fake_csvs(tmp_path)
    df = pd.concat([pd.read_csv(tmp_path / "results_engines.csv"), pd.DataFrame(_lm_rows())])
    df.to_csv(tmp_path / "results_engines.csv", index=False)
    readme = render_readme(tmp_path)
    table = readme.split("## DP step against non-private")[1].split("## Profiles")[0]
    row = next(ln for ln in table.splitlines() if ln.startswith("| GPT-2-small-shaped (`gpt2_small`) | 8 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert "1.40x / 1.10x" in cells  # bk: time / memory
    assert "2.50x / 1.50x" in cells and "4.00x / 2.25x" in cells  # stp via bk, stp via hooks
    assert cells[-3] == "bk: met (1.40x <= 1.50x)"
    assert cells[-2] == "bk (fastest): met (1.10x <= 1.20x)"
    assert cells[-1] == "via bk: met (2.50x <= 3.00x)"
    row32 = next(
        ln for ln in table.splitlines() if ln.startswith("| GPT-2-small-shaped (`gpt2_small`) | 32 |")
    )
    assert row32.count("no target (issue B: B = 8)") == 3
    cnn = next(ln for ln in table.splitlines() if ln.startswith("| CNN5 (`cnn5`) | 256 |"))
    assert "ghost: MISSED x1.33 (2.00x vs 1.50x)" in cnn
    assert "GPT-2-small-shaped at B = 256 (issue A) is not run" in readme and "40 s per non-private" in readme
    assert "| gpt2_small, B=32 (outside the issue's table) |" in readme

    eng = pd.read_csv(tmp_path / "results_engines.csv")
    got = [(m["model"], m["batch_size"], m["mode"], m["engine"]) for m in profiles.misses(eng)]
    assert all(mode in ("nonprivate", "bk", "stp") for _, _, mode, _ in got)
    assert ("cnn5", 256, "stp", "functorch") not in got  # stp off bk is a comparison, not profiled
    # only ours is profiled (bk, stp via bk); Opacus' modes are the comparison
    assert not any(mode in ("ghost", "hooks", "functorch") for _, _, mode, _ in got)
    assert ("gpt2_small", 8, "bk", None) not in got and ("gpt2_small", 8, "stp", "bk") not in got  # both met
    assert not any(m == "gpt2_small" and b == 32 for m, b, _, _ in got)  # outside issue B's table


def test_run_all_presets_merge_into_out_dir(tmp_path, monkeypatch):
    calls = []

    class Done:
        returncode = 0

    def fake_run(cmd, **kw):
        calls.append(cmd[1:])
        Path(cmd[cmd.index("--out") + 1]).write_text("model\n")
        return Done()

    monkeypatch.setattr(run_all.subprocess, "run", fake_run)
    assert run_all.run_bench("engines", False, tmp_path)
    names = [p.name for p in registry.ENGINE_PRESETS]
    assert len(calls) == len(names) and "--merge" not in calls[0]
    assert all("--merge" in c for c in calls[1:])
    assert all(c[c.index("--out") + 1] == str(tmp_path / "results_engines.csv") for c in calls)
    assert {"gpt2_small_B8", "gpt2_small_B32", "bert_tiny_mlm"} <= set(names)
    calls.clear()
    assert run_all.run_bench("engines", False, tmp_path, ["gpt2_small_B8"])
    assert len(calls) == 1 and "--merge" in calls[0] and "8" in calls[0]
    prov = json.loads((tmp_path / "results_provenance.json").read_text())["results_engines.csv"]
    assert "gpt2_small" in prov["command"] and prov["sha256"]
    assert not (Path(run_all.BENCH_DIR) / "results_engines.csv").samefile(tmp_path / "results_engines.csv")


def test_run_profiles_profiles_the_misses_and_drops_stale_files(tmp_path, monkeypatch):
    _fake_csvs(tmp_path)
    folder = tmp_path / "profiles"
    folder.mkdir()
    for stale in ("cnn5_B256_ghost.txt", "bert_tiny_B256_old.txt", "gpt2_small_B8_keep.txt"):
        (folder / stale).write_text("Summary: old\n")
    calls = []

    class Done:
        returncode = 0

    monkeypatch.setattr(run_all.subprocess, "run", lambda cmd, **kw: calls.append(cmd[2:]) or Done())
    assert run_all.run_profiles(tmp_path, pairs={("cnn5", 256), ("bert_tiny", 256)})
    modes = [(c[c.index("--model") + 1], c[c.index("--mode") + 1]) for c in calls]
    # the fake CSV has no bk row and stp only via functorch (a comparison): nothing of ours misses, nothing runs
    assert modes == []
    assert sorted(f.name for f in folder.iterdir()) == [
        "gpt2_small_B8_keep.txt"
    ]  # only pairs in scope dropped


# ------------------------------------------------------------------------------------------------------ GPU


def _gpu_rows(model, b, precision, ms, gib, physical=None):
    """results_gpu.csv rows of one (model, B, precision): ``ms`` / ``gib`` per mode, ratios to nonprivate."""
    return [
        {
            "model": model,
            "batch_size": b,
            "physical_batch_size": physical or b,
            "mode": mode,
            "precision": precision,
            "median_step_ms": ms[mode],
            "ratio_to_nonprivate": ms[mode] / ms["nonprivate"],
            "peak_mem_gib": gib[mode],
            "ratio_mem_to_nonprivate": gib[mode] / gib["nonprivate"],
            "device": "cuda",
            "device_name": "Fake GPU 80GB",
            "torch_version": "2.13.0+cu128",
            "cuda_version": "12.8",
            "opacus_version": "1.6.0",
            "date": "2026-11-23T00:00:00+00:00",
            "warmup": 3,
            "steps": 20,
            "notes": "",
        }
        for mode in ms
    ]


def _gpu_section(readme: str) -> str:
    return readme.split("## GPU training step per mode: `results_gpu.csv`")[1]


def test_readme_gpu_section_without_a_gpu_run(tmp_path):
    _fake_csvs(tmp_path)
    readme = render_readme(tmp_path)
    section = _gpu_section(readme)
    assert section.strip().startswith("No GPU run is recorded yet.")
    assert "`make bench-gpu`" in section and "python benchmarks/bench_gpu.py --device cuda" in section
    assert "peak GPU memory" in section and "Opacus hooks" in section  # what it measures
    assert "<= 1.3x" in section and "1.1x" in section  # the targets it will be checked against
    assert "| " not in section  # a paragraph, no table
    assert "Not measured yet: run `python benchmarks/bench_gpu.py`" not in readme


def test_readme_gpu_section_from_results_gpu_csv(tmp_path):
    _fake_csvs(tmp_path)
    without = render_readme(tmp_path)
    ms = {"nonprivate": 100.0, "bk": 110.0, "ghost": 140.0, "opacus_ghost": 150.0, "opacus_hooks": 200.0}
    gib = {"nonprivate": 10.0, "bk": 10.5, "ghost": 12.0, "opacus_ghost": 13.0, "opacus_hooks": 20.0}
    rows = _gpu_rows("gpt2_small", 8, "bf16", ms, gib)
    ms = {"nonprivate": 10.0, "bk": 14.0, "ghost": 12.0, "opacus_ghost": 13.0, "opacus_hooks": 12.5}
    gib = {"nonprivate": 2.0, "bk": 2.0, "ghost": 2.2, "opacus_ghost": 2.4, "opacus_hooks": 3.0}
    rows += _gpu_rows("cnn5", 256, "fp32", ms, gib)
    ms = {"nonprivate": 20.0, "bk": 22.0}  # the same (model, B) in micro-batches: a row of its own
    gib = {"nonprivate": 1.0, "bk": 1.1}
    rows += _gpu_rows("cnn5", 256, "fp32", ms, gib, physical=64)
    pd.DataFrame(rows).to_csv(tmp_path / "results_gpu.csv", index=False)
    readme = render_readme(tmp_path)

    # the CPU sections do not change
    head = "## GPU training step per mode"
    assert readme.split(head)[0] == without.split(head)[0]
    section = _gpu_section(readme)
    assert "No GPU run is recorded yet" not in section
    assert "Command not recorded" in section and "Default command: `make bench-gpu`" in section
    assert "device_name = Fake GPU 80GB" in section  # the CSV as a table, constant columns in the caption
    assert "| gpt2_small | 8 | 8 | bk | bf16 | 110 | 1.1 | 10.5 | 1.05 |" in section

    def cells(prefix):
        row = next(ln for ln in section.splitlines() if ln.startswith(prefix))
        return [c.strip() for c in row.strip("|").split("|")]

    head_cells = cells("| model | B | micro-batch | precision |")
    assert head_cells[5:9] == [f"{m} x time / x mem" for m in ("bk", "ghost", "opacus_ghost", "opacus_hooks")]
    assert head_cells[9:] == ["time <= 1.3x", "memory <= 1.3x", "bk faster than Opacus", "goal <= 1.1x"]
    gpt2 = cells("| gpt2_small | 8 | whole | bf16 |")
    assert gpt2[4] == "100.0 ms, 10.00 GiB"
    assert gpt2[5:9] == ["1.10x / 1.05x", "1.40x / 1.20x", "1.50x / 1.30x", "2.00x / 2.00x"]
    assert gpt2[9] == "bk: met (1.10x <= 1.30x); ghost: MISSED x1.08 (1.40x vs 1.30x)"
    assert gpt2[10] == "bk: met (1.05x <= 1.30x); ghost: met (1.20x <= 1.30x)"
    assert gpt2[11] == "met (bk 110.0 ms vs opacus_ghost 150.0 ms)"
    assert gpt2[12] == "bk: met (1.10x <= 1.10x); ghost: MISSED x1.27 (1.40x vs 1.10x)"
    cnn = cells("| cnn5 | 256 | whole | fp32 |")
    assert cnn[9] == "bk: MISSED x1.08 (1.40x vs 1.30x); ghost: met (1.20x <= 1.30x)"
    assert cnn[11] == "MISSED x1.12 (bk 14.0 ms vs opacus_hooks 12.5 ms)"  # the faster Opacus mode
    micro = cells("| cnn5 | 256 | 64 | fp32 |")  # against its own non-private step, not the whole batch's
    assert micro[4] == "20.0 ms, 1.00 GiB" and micro[5] == "1.10x / 1.10x (4 micro-batches)"
    assert micro[9] == "bk: met (1.10x <= 1.30x); ghost: not measured"
    # the GPU rows are not CPU targets
    assert "Fake GPU" not in readme.split("## Targets")[1].split(head)[0]


def test_run_all_runs_the_gpu_benchmark_only_when_named(tmp_path, monkeypatch):
    _fake_csvs(tmp_path)
    scripts = []

    class Done:
        returncode = 0

    def fake_run(cmd, **kw):
        scripts.append(Path(cmd[1]).name)
        if cmd[1].endswith("bench_gpu.py"):
            assert cmd[2:4] == ["--device", "cuda"]
        return Done()

    monkeypatch.setattr(run_all.subprocess, "run", fake_run)
    run_all.main(["--out-dir", str(tmp_path), "--no-profiles"])
    assert "bench_gpu.py" not in scripts
    assert set(scripts) == {b.script for b in registry.default_benches().values()}
    scripts.clear()
    run_all.main(["--out-dir", str(tmp_path), "--only", "gpu"])
    assert scripts == ["bench_gpu.py"]


@pytest.mark.slow
def test_bench_gpu_runs_every_mode_on_cpu_and_never_writes_results_gpu_csv(tmp_path, one_thread):
    """The GPU benchmark's code paths on a CPU (tiny shapes): every mode of a micro-batched row, ratios to its own
    non-private step; without CUDA it refuses to write benchmarks/results_gpu.csv."""
    import bench_gpu

    out = tmp_path / "gpu.csv"
    bench_gpu.main(
        ["--device", "cpu", "--quick", "--rows", "cnn5_B2048_micro512", "--warmup", "0", "--steps", "1"]
        + ["--precision", "fp32", "bf16", "--out", str(out)]
    )
    df = pd.read_csv(out)
    assert list(df.columns) == bench_gpu.COLUMNS
    fp32 = df[df["precision"] == "fp32"]
    assert list(fp32["mode"]) == list(bench_gpu.MODES)
    assert (
        set(df[df["precision"] == "bf16"]["mode"]) == bench_gpu.BF16_MODES
    )  # bf16 is bk's (and non-private's)
    assert (df["batch_size"] == 16).all() and (df["physical_batch_size"] == 4).all()
    assert (df["notes"] == "4 micro-batches").all()
    assert (df[df["mode"] == "nonprivate"]["ratio_to_nonprivate"] == 1).all()
    assert (df["median_step_ms"] > 0).all() and df["peak_mem_gib"].isna().all()  # no device memory on a CPU
    assert (df["device"] == "cpu").all()
    bk = df[df["mode"] == "bk"]  # where bk's memory goes; other modes leave the columns empty
    assert (bk["bk_captured_gib"] > 0).all() and (bk["bk_per_example_gib"] > 0).all()
    assert df[df["mode"] != "bk"]["bk_captured_gib"].isna().all()

    def stamp():
        return bench_gpu.OUT.stat().st_mtime_ns if bench_gpu.OUT.exists() else None

    before = stamp()
    with pytest.raises(SystemExit):
        bench_gpu.main(["--device", "cpu", "--quick"])  # the default --out is results_gpu.csv
    assert stamp() == before


@pytest.mark.parametrize("device", ["tpu", "nonsense:3"])
def test_bench_gpu_refuses_a_bad_device_in_one_line(device, tmp_path, capsys):
    import bench_gpu

    with pytest.raises(SystemExit):
        bench_gpu.main(["--device", device, "--out", str(tmp_path / "x.csv")])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"--device {device!r}: valid: cuda, cuda:N (a visible GPU) or cpu" in err


@pytest.mark.slow
def test_bench_checks_quick_measures_the_watch(tmp_path):
    """bench_checks.py end to end on tiny shapes: one row per model with the step, the check and the run's share
    (issue 44's cost of the engine watch); the README's target row reads it."""
    import bench_checks
    from report import checks

    out = tmp_path / "results_checks.csv"
    bench_checks.main(["--quick", "--out", str(out)])
    df = pd.read_csv(out)
    assert (
        list(df.model) == ["cnn5", "bert_tiny"]
        and (df.check_s_median > 0).all()
        and (df.run_checks >= 1).all()
    )
    rows = checks.target_rows(df)
    assert len(rows) == 2 and all(r[0].startswith("engine watch") for r in rows)
