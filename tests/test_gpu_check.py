"""The one-command GPU check (benchmarks/gpu_check.py, issue 34) and bench_gpu.py's row handling, proven on a CPU.

The runner: every part in its own process and time limit, its result written as soon as it ends, a failing or
hanging part recorded and the next one run, the budget respected. A real ``--device cpu --quick`` run of a few
parts (the environment, the TF32 check, the sweep's dry run) through the same commands the GPU run uses. A CPU run
never writes the committed report folder or ``results_gpu.csv``. bench_gpu.py: rows appended to the CSV as they
are measured, any error a note on its row, Opacus imported only for its modes, one fp32 math setting for every
mode, recorded in each row.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd
import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import bench_gpu  # noqa: E402
from gpu_check import main  # noqa: E402
from gpu_checks.benches import bench_commands  # noqa: E402
from gpu_checks.part import Ctx, Part, PartFailed, Result  # noqa: E402
from gpu_checks.paths import OUT, RESULTS_GPU  # noqa: E402
from gpu_checks.registry import PARTS  # noqa: E402
from gpu_checks.runner import MIN_PART_S, run_parts  # noqa: E402
from gpu_checks.suite import junit_counts  # noqa: E402
from gpu_checks.tf32 import cmd_tf32  # noqa: E402


def _py(code: str):
    return lambda ctx: [[sys.executable, "-c", code]]


def _ctx(tmp_path, device="cpu") -> Ctx:
    (tmp_path / "out").mkdir(exist_ok=True)
    return Ctx(device, True, tmp_path / "out", tmp_path / "work", 1, False)


#: the report header run_parts writes (a CPU run of the parts above)
HEADER = {"device_name": "CPU", "torch": "-", "commit": "-", "started": "-", "budget_s": 60, "command": "t"}


def _says(word: str):
    def verify(ctx, log):
        if word not in log:
            raise PartFailed(f"no {word!r} in the log")
        return f"said {word}"

    return verify


def test_a_failing_or_hanging_part_is_recorded_and_the_next_parts_still_run(tmp_path):
    ctx = _ctx(tmp_path)
    parts = [
        Part("first", "passes", 30, _py("print('hello')"), _says("hello")),
        Part("crash", "exits 3", 30, _py("import sys; print('boom'); sys.exit(3)"), _says("boom")),
        Part("hang", "sleeps past its limit", 1, _py("import time; time.sleep(30)"), _says("never")),
        Part("wrong", "runs but its check fails", 30, _py("print('other')"), _says("hello")),
        Part("gpu", "needs CUDA", 30, _py("print('x')"), _says("x"), cuda_only=True),
        Part("last", "still runs", 30, _py("print('hello')"), _says("hello")),
    ]
    results = run_parts(parts, ctx, 60, HEADER)
    status = {r.name: r.status for r in results}
    assert status == {
        "first": "passed",
        "crash": "FAILED",
        "hang": "TIMED OUT",
        "wrong": "FAILED",
        "gpu": "skipped: no CUDA",
        "last": "passed",
    }
    by = {r.name: r for r in results}
    assert by["hang"].seconds < 10  # killed at its limit, not waited for
    assert "exit 3" in by["crash"].summary and "boom" in by["crash"].summary  # the log's tail comes along
    assert "no 'hello' in the log" in by["wrong"].summary
    report = (ctx.out / "report.md").read_text()
    assert "| crash | exits 3 | FAILED |" in report and "| last | still runs | passed |" in report
    saved = json.loads((ctx.out / "results.json").read_text())
    assert [p["status"] for p in saved["parts"]] == [r.status for r in results]
    assert (ctx.out / "hang.log").read_text().startswith("$ ")  # each log opens with its command


def test_the_budget_skips_the_parts_it_cannot_start(tmp_path):
    ctx = _ctx(tmp_path)
    slow = Part("slow", "takes the budget", 30, _py("import time; time.sleep(0.5); print('ok')"), _says("ok"))
    after = Part("after", "no time left", 30, _py("print('ok')"), _says("ok"))
    header = {
        "device_name": "CPU",
        "torch": "-",
        "commit": "-",
        "started": "-",
        "budget_s": 21,
        "command": "t",
    }
    (first, second) = run_parts([slow, after], ctx, MIN_PART_S + 0.3, header)
    assert first.status == "passed"
    assert second.status.startswith("skipped: time budget spent")


def test_a_rerun_of_some_parts_keeps_the_others_results(tmp_path):
    ctx = _ctx(tmp_path)
    earlier = [Result("suite", "s", "passed", 90.0, 180, "9 passed").__dict__]
    earlier += [Result("bench_gpu", "b", "TIMED OUT", 150.0, 150, "rows so far").__dict__]
    header = {"device_name": "-", "torch": "-", "commit": "-", "started": "-", "budget_s": 60, "command": "t"}
    again = Part("bench_gpu", "b", 30, _py("print('ok')"), _says("ok"))
    run_parts([again], ctx, 60, header | {"earlier": earlier})
    saved = json.loads((ctx.out / "results.json").read_text())
    assert [(p["name"], p["status"]) for p in saved["parts"]] == [
        ("suite", "passed"),
        ("bench_gpu", "passed"),
    ]
    assert "earlier" not in saved and "keep an earlier run's result" in (ctx.out / "report.md").read_text()


SUITE_XML = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.test_conformance" name="test_grid[f32-ce-linear]"/>
<testcase classname="tests.test_conformance" name="test_grid[f32-ce-conv]"><failure message="x"/></testcase>
<testcase classname="tests.test_conformance" name="test_grid[f64-ce-rnn]"><skipped message="y"/></testcase>
<testcase classname="tests.test_ddp" name="test_two_ranks"><error message="z"/></testcase>
</testsuite></testsuites>"""


def test_the_conformance_part_reads_the_suites_run_of_the_grid(tmp_path):
    ctx = _ctx(tmp_path, "cuda")
    (ctx.out / "suite.xml").write_text(SUITE_XML)
    (part,) = [p for p in PARTS if p.name == "conformance"]
    assert part.commands(ctx) == []  # no second run of the grid
    header = {"device_name": "-", "torch": "-", "commit": "-", "started": "-", "budget_s": 60, "command": "t"}
    (res,) = run_parts([part], ctx, 60, header)
    assert res.status == "FAILED"
    assert res.summary.startswith(
        "1 passed, 1 failed, 0 errors, 1 skipped of 3 (pytest-xdist missing: serial)"
    )
    assert "(from suite.xml): tests.test_conformance::test_grid[f32-ce-conv]" in res.summary
    every = junit_counts(ctx.out / "suite.xml")
    assert (every["tests"], every["errors"], every["failing"][-1]) == (4, 1, "tests.test_ddp::test_two_ranks")


def test_a_cpu_run_writes_neither_the_committed_report_nor_results_gpu_csv(tmp_path, capsys):
    def stamp(path):
        return path.stat().st_mtime_ns if path.exists() else None

    before = stamp(OUT), stamp(RESULTS_GPU)
    with pytest.raises(SystemExit):
        main(["--device", "cpu", "--quick"])
    assert "writes benchmarks/gpu_check only from a CUDA run" in capsys.readouterr().err
    assert (stamp(OUT), stamp(RESULTS_GPU)) == before
    (bench,) = bench_commands(_ctx(tmp_path))
    assert str(RESULTS_GPU) not in bench and bench[bench.index("--out") + 1].startswith(str(tmp_path))
    (cuda,) = bench_commands(_ctx(tmp_path, "cuda"))
    assert cuda[cuda.index("--out") + 1] == str(RESULTS_GPU)


@pytest.mark.slow
def test_a_quick_cpu_run_of_a_real_part(tmp_path):
    """A part's real command through the runner: the sweep's --jobs 2 as a dry run (quick). (Every part at quick
    sizes, about two minutes here: ``make gpu-check-cpu``.)"""
    out = tmp_path / "report"
    rc = main(
        [
            "--device",
            "cpu",
            "--quick",
            "--out",
            str(out),
            "--work",
            str(tmp_path / "w"),
            "--parts",
            "sweep_jobs",
        ]
    )
    saved = json.loads((out / "results.json").read_text())
    assert [(p["name"], p["status"]) for p in saved["parts"]] == [("sweep_jobs", "passed")] and rc == 0
    assert "dry run: 3 multirun commands with 2 joblib workers" in (out / "report.md").read_text()


def test_the_tf32_check_fails_a_clip_factor_a_hair_too_large(monkeypatch):
    """The TF32 check (in this process, quick: CNN5, 4 examples, bk / ghost / hooks and their controls) on a bug it
    was not written for: bk's clip factor 1e-4 too large (no precision involved) breaks the bound."""
    import argparse

    from dp_adam_bench.engine import bk, fp32_exact

    saved = (
        {(b, o): fp32_exact.op(b, o).fp32_precision for b, o in fp32_exact.OPS}
        if fp32_exact.new_api()
        else {}
    )
    real = bk.clip_factors
    monkeypatch.setattr(bk, "clip_factors", lambda norms, clip: real(norms, clip) * (1 + 1e-4))
    try:
        got = cmd_tf32(argparse.Namespace(device="cpu", quick=True))
    finally:
        for (b, o), v in saved.items():
            fp32_exact.op(b, o).fp32_precision = v
    assert set(got["engines"]) == {"bk", "ghost", "hooks"} | {
        f"{e}_control_guard_off" for e in ("bk", "ghost", "hooks")
    }
    assert not got["ok"] and "allowed 1e-05" in got["summary"]
    assert got["engines"]["bk"]["max_excess"] == pytest.approx(1e-4, rel=0.05)
    # the others: every example clipped, each contribution's norm C to fp32 rounding
    for name in ("ghost", "hooks"):
        assert (
            abs(got["engines"][name]["max_excess"]) < 1e-5 and abs(got["engines"][name]["min_excess"]) < 1e-5
        )


def _fake_run_config(calls, fail_mode=None, csv_path=None):
    """bench_gpu.run_config standing in for a measurement: records the fp32 math it ran under and how many rows
    the CSV held when it was called."""

    def run(spec):
        from dp_adam_bench.engine import fp32_exact

        rows_before = len(pd.read_csv(csv_path)) if csv_path and csv_path.exists() else None
        calls.append({"mode": spec["mode"], "fp32": fp32_exact.settings(), "rows_before": rows_before})
        if spec["mode"] == fail_mode:
            raise RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED\nmore lines")
        return {
            "median_step_ms": 10.0,
            "peak_mem_gib": float("nan"),
            "physical_batch_size": spec["batch_size"],
        }

    return run


@pytest.mark.slow
def test_bench_gpu_appends_rows_as_measured_and_records_any_error_on_its_row(tmp_path, monkeypatch):
    out = tmp_path / "gpu.csv"
    calls = []
    monkeypatch.setattr(bench_gpu, "run_config", _fake_run_config(calls, "ghost", out))
    bench_gpu.main(
        ["--device", "cpu", "--quick", "--rows", "cnn5_B2048", "--modes", "nonprivate", "bk", "ghost", "bk"]
        + ["--out", str(out)]
    )
    assert [c["rows_before"] for c in calls] == [0, 1, 2, 3]  # each row was in the file before the next began
    df = pd.read_csv(out)
    assert list(df["mode"]) == ["nonprivate", "bk", "ghost", "bk"]  # the run went on after the error
    ghost = df[df["mode"] == "ghost"].iloc[0]
    assert ghost["notes"] == "error: RuntimeError: cuDNN error: CUDNN_STATUS_NOT_SUPPORTED"
    assert pd.isna(ghost["median_step_ms"]) and (df[df["mode"] == "bk"]["ratio_to_nonprivate"] == 1).all()
    # --append keeps the earlier rows
    bench_gpu.main(
        ["--device", "cpu", "--quick", "--rows", "cnn5_B2048", "--modes", "nonprivate"]
        + ["--out", str(out), "--append"]
    )
    assert len(pd.read_csv(out)) == 5


@pytest.mark.parametrize("kind", ["ieee", "tf32"])
@pytest.mark.slow
def test_bench_gpu_sets_one_fp32_math_for_every_mode_and_records_it(tmp_path, monkeypatch, kind):
    from dp_adam_bench.engine import fp32_exact

    if not fp32_exact.new_api():
        pytest.skip("torch < 2.9: legacy TF32 flags only")
    saved = {(b, o): fp32_exact.op(b, o).fp32_precision for b, o in fp32_exact.OPS}
    calls = []
    monkeypatch.setattr(bench_gpu, "run_config", _fake_run_config(calls))
    try:
        bench_gpu.main(
            ["--device", "cpu", "--quick", "--rows", "cnn5_B2048", "--modes", "nonprivate", "bk", "ghost"]
            + ["--fp32-math", kind, "--out", str(tmp_path / "g.csv")]
        )
        seen = [c["fp32"] for c in calls]
        assert len(seen) == 3 and all(s == seen[0] for s in seen)
        assert seen[0]["cudnn.conv"] == ("tf32" if kind == "tf32" else "ieee")
        assert seen[0]["mkldnn.matmul"] == "ieee"
        df = pd.read_csv(tmp_path / "g.csv")
        assert (
            df["fp32_math"].nunique() == 1
            and f"cudnn.conv={seen[0]['cudnn.conv']}" in df["fp32_math"].iloc[0]
        )
    finally:
        for (b, o), v in saved.items():
            fp32_exact.op(b, o).fp32_precision = v


def test_bench_gpu_imports_opacus_only_for_its_modes(monkeypatch):
    import torch

    monkeypatch.setitem(sys.modules, "opacus", None)  # importing it now raises ImportError
    assert bench_gpu.device_info(torch.device("cpu"), ["nonprivate", "bk", "ghost"])["opacus_version"] == ""
    with pytest.raises(ImportError):
        bench_gpu.device_info(torch.device("cpu"), ["bk", "opacus_hooks"])


def test_a_part_past_its_limit_stops_on_sigint_when_launched_with_sigint_ignored(tmp_path):
    """``nohup make gpu-check &`` starts the runner with SIGINT ignored, which its children inherit; a part past its
    limit must still stop on the SIGINT (and not wait the grace period for SIGKILL)."""
    import signal

    ctx = _ctx(tmp_path)
    part = Part("hang", "sleeps past its limit", 1, _py("import time; time.sleep(30)"), _says("never"))
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        (result,) = run_parts([part], ctx, 60, HEADER)
    finally:
        signal.signal(signal.SIGINT, before)
    assert result.status == "TIMED OUT" and result.seconds < 10
