"""W&B: run labels, the summary the logger mirrors, reports reading runs back from the W&B API, the dashboard.

No network: the W&B API is a fake serving either runs rebuilt from real offline W&B run files (what ``wandb sync``
would upload) or runs made from run folders the way the logger sends them.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from dp_adam_bench.cli import main
from dp_adam_bench.report.aggregate import select_best
from dp_adam_bench.tracking import wandb_dashboard as dash
from dp_adam_bench.tracking.run_store import load_local_runs
from dp_adam_bench.tracking.sources import RUN_SOURCE_ENV, load_runs, merge_records
from dp_adam_bench.tracking.wandb_logger import SUMMARY_JSON_KEY, WandbLogger, run_labels
from dp_adam_bench.tracking.wandb_source import PROJECT_ENV, WandbSourceError, load_wandb_runs

from helpers import TINY_1D, compose_cfg
from wandb_reader import history, records

wandb = pytest.importorskip("wandb")  # the GPU machines run without W&B (../shared/gpu/on_device.sh)

PROJECT = "ent/dp-adam-bench"


# --- a fake W&B public API -------------------------------------------------------------------------------------


class FakeRun:
    """What ``wandb.Api().runs(...)`` yields, with the attributes the source reads."""

    def __init__(self, name, group, config, summary, rows, created_at="2026-01-01T00:00:00", run_id=None):
        self.name, self.group, self.config, self.created_at = name, group, config, created_at
        self.id = run_id or f"id-{name}-{created_at}"
        self.summary_metrics = summary
        self._rows = rows

    def scan_history(self):
        return iter(self._rows)


class FakeApi:
    def __init__(self, runs):
        self._runs, self.calls = list(runs), []

    def runs(self, path, filters=None, **_):
        self.calls.append((path, filters))
        return [r for r in self._runs if r.group == (filters or {}).get("group")]


@pytest.fixture
def sources(monkeypatch):
    """No source or project from the environment (the CLI's defaults); the tests set them where they mean to."""
    monkeypatch.delenv(RUN_SOURCE_ENV, raising=False)
    monkeypatch.delenv(PROJECT_ENV, raising=False)
    return monkeypatch


def serve(monkeypatch, runs) -> FakeApi:
    api = FakeApi(runs)
    monkeypatch.setattr(wandb, "Api", lambda *a, **k: api)
    return api


def as_wandb_run(folder: Path, group: str, created_at="2026-01-01T00:00:00") -> FakeRun:
    """A run folder as the logger leaves it in W&B: config, history rows under ``_step``, the summary with the
    mirrored summary.json (W&B's own keys beside it)."""
    config = yaml.safe_load((folder / "config.yaml").read_text())
    rows = []
    if (folder / "metrics.jsonl").exists():
        for line in (folder / "metrics.jsonl").read_text().splitlines():
            row = json.loads(line)
            rows.append({"_step": row.pop("step"), "_runtime": 1.0, "_timestamp": 1.7e9, **row})
    summary = {"_step": rows[-1]["_step"] if rows else 0, "_runtime": 1.0}
    if (folder / "summary.json").exists():
        text = (folder / "summary.json").read_text()
        summary.update(json.loads(text))
        summary[SUMMARY_JSON_KEY] = text
    return FakeRun(folder.name, group, {"_wandb": {"cli_version": "x"}, **config}, summary, rows, created_at)


def write_run(root, experiment, name, opt, noise, lr, trials, complete=True, steps=(10, 20)):
    folder = root / experiment / name
    folder.mkdir(parents=True)
    cfg = {
        "optimizer": {"name": opt, "lr": lr},
        "noise": {"kind": noise},
        "privacy": {"delta": 1e-5},
        "seed": 0,
    }
    (folder / "config.yaml").write_text(yaml.safe_dump(cfg))
    mean = sum(trials) / len(trials)
    rows = [{"step": s, "test_loss_mean": mean + (steps[-1] - s) / 100, "epsilon": 0.1 * s} for s in steps]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if complete:
        summary = {
            "status": "complete",
            "metrics": {"test_loss": mean},
            "trials": {"test_loss": trials},
            "ground_truth": 0.6,
            "n_trials": len(trials),
            "steps": steps[-1],
            "epsilon": {"pld": 50.0, "rdp": 60.0},
        }
        (folder / "summary.json").write_text(json.dumps(summary))
    return folder


@pytest.fixture
def fig2_store(isolated_dirs):
    """ganesh_fig2-shaped runs: two tuned learning rates per (optimizer, noise), one incomplete run."""
    root = isolated_dirs / "runs"
    write_run(root, "ganesh_fig2", "np-a", "adagrad_pp", "none", 1.0, [0.601])
    write_run(root, "ganesh_fig2", "np-b", "adagrad_pp", "none", 0.1, [0.650])
    for noise in ("dpmf_sqrt", "independent"):
        write_run(root, "ganesh_fig2", f"pp-a-{noise}", "adagrad_pp", noise, 0.1, [0.62, 0.64])
        write_run(root, "ganesh_fig2", f"pp-b-{noise}", "adagrad_pp", noise, 1.0, [0.605, 0.607])
        write_run(root, "ganesh_fig2", f"ime-{noise}", "adagrad_ime", noise, 1.0, [0.602, 0.604])
        write_run(root, "ganesh_fig2", f"imef-{noise}", "adagrad_ime_free", noise, 1.0, [0.603, 0.603])
    write_run(root, "ganesh_fig2", "killed", "adagrad_ime", "dpmf_sqrt", 3.0, [0.1], complete=False)
    return isolated_dirs


def cells_of(records):
    cells = select_best(records, per=["optimizer", "noise"], tuned=["optimizer.lr"], metric="test_loss")
    return {k: (c.mean, c.std, c.n, c.chosen, c.values) for k, c in cells.items()}


# --- part 1: labels and the mirrored summary ---------------------------------------------------------------------


RUN_CFG = {
    "experiment_name": "tang_fig1_cifar10_paper",
    "profile": "paper",
    "task": {"name": "cifar10_cnn"},
    "optimizer": {"name": "adambc", "lr": 0.001},
    "noise": {"kind": "independent"},
    "seed": 0,
}


def test_runs_are_grouped_by_experiment_and_tagged_with_its_axes(tmp_path, fake_wandb):
    assert run_labels(RUN_CFG) == {
        "group": "tang_fig1_cifar10_paper",
        "job_type": "adambc+independent",
        "tags": ["tang_fig1_cifar10_paper", "cifar10_cnn", "adambc", "independent", "paper"],
    }
    WandbLogger(run_dir=tmp_path, name="adambc-independent-lr0.001-s0-x", config=RUN_CFG, mode="offline")
    kw = fake_wandb[-1].kwargs
    assert kw["group"] == "tang_fig1_cifar10_paper" and kw["job_type"] == "adambc+independent"
    assert kw["tags"] == ["tang_fig1_cifar10_paper", "cifar10_cnn", "adambc", "independent", "paper"]
    assert (
        kw["name"] == "adambc-independent-lr0.001-s0-x"
        and kw["config"] == RUN_CFG
        and kw["mode"] == "offline"
    )
    # tags a caller gives are kept, the standard ones added once
    WandbLogger(run_dir=tmp_path, name="n", config=RUN_CFG, mode="offline", tags=["adambc", "pilot"])
    assert fake_wandb[-1].kwargs["tags"] == ["adambc", "pilot", "tang_fig1_cifar10_paper", "cifar10_cnn"] + [
        "independent",
        "paper",
    ]
    # a disabled logger makes no W&B run
    WandbLogger(run_dir=tmp_path, name="n", config=RUN_CFG, mode="disabled")
    assert len(fake_wandb) == 2


def test_finished_run_summary_mirrors_summary_json_and_a_failed_one_has_no_status(tmp_path, fake_wandb):
    summary = {
        "status": "complete",
        "metrics": {"test_accuracy": 61.0},
        "epsilon": {"rdp": 7.0},
        "steps": 549,
    }
    done = tmp_path / "done"
    done.mkdir()
    (done / "summary.json").write_text(json.dumps(summary))
    wb = WandbLogger(run_dir=done, name="done", config=RUN_CFG, mode="offline")
    wb.log(10, {"test_accuracy": 50.0})
    wb.summary({"test_accuracy": 61.0})
    wb.finish()
    run = fake_wandb[-1]
    assert run.finished and run.summary["status"] == "complete" and run.summary["epsilon"] == {"rdp": 7.0}
    assert run.summary["metrics"] == {"test_accuracy": 61.0} and run.summary["steps"] == 549
    assert json.loads(run.summary[SUMMARY_JSON_KEY]) == summary
    assert run.summary["test_accuracy"] == 61.0  # the flat final metric, for dashboards

    failed = tmp_path / "failed"
    failed.mkdir()
    wb = WandbLogger(run_dir=failed, name="failed", config=RUN_CFG, mode="offline")
    wb.finish()
    assert "status" not in fake_wandb[-1].summary and SUMMARY_JSON_KEY not in fake_wandb[-1].summary


# --- part 2: records from W&B ------------------------------------------------------------------------------------


def offline_wandb_run(folder: Path) -> FakeRun:
    """The W&B run a real offline run file describes (what ``wandb sync`` uploads), as the public API shows it:
    name, group, config from the run record, the final summary, the history."""
    (wandb_file,) = folder.glob("wandb/offline-run-*/run-*.wandb")
    from wandb.proto import wandb_internal_pb2 as pb

    meta, config, summary = {}, {}, {}
    for raw in records(wandb_file):
        rec = pb.Record()
        rec.ParseFromString(raw)
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            meta = {
                "name": rec.run.display_name,
                "group": rec.run.run_group,
                "job_type": rec.run.job_type,
                "tags": list(rec.run.tags),
            }
            config.update({i.key: json.loads(i.value_json) for i in rec.run.config.update})
        elif kind == "config":
            config.update({i.key: json.loads(i.value_json) for i in rec.config.update})
        elif kind == "summary":
            for item in rec.summary.update:
                summary[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    run = FakeRun(meta["name"], meta["group"], config, summary, history(wandb_file))
    run.job_type, run.tags = meta["job_type"], meta["tags"]
    return run


def test_offline_wandb_runs_rebuild_the_run_store_records(isolated_dirs, sources):
    """Real training runs with real (offline) W&B runs: the W&B side alone gives the same records and cells."""
    from dp_adam_bench.train import train

    base = ["noise=dpmf_sqrt", "privacy.sigma=0.1", "experiment_name=wbsrc", *TINY_1D]
    for opt, lr in (("adagrad_ime", 0.1), ("adagrad_ime", 1.0), ("adagrad_pp", 0.1)):
        train(compose_cfg([*base, f"optimizer={opt}", f"optimizer.lr={lr}"]))
    local = load_local_runs(isolated_dirs / "runs", "wbsrc")
    remote_runs = [offline_wandb_run(r.path) for r in local]
    assert {r.group for r in remote_runs} == {"wbsrc"}
    assert remote_runs[0].job_type.endswith("+dpmf_sqrt")
    assert {"wbsrc", "logistic_1d", "dpmf_sqrt", "cpu"} <= set(remote_runs[0].tags)

    api = serve(sources, remote_runs)
    remote = load_wandb_runs("wbsrc", PROJECT)
    assert api.calls == [(PROJECT, {"group": "wbsrc"})]
    assert [r.path.name for r in remote] == [r.path.name for r in local]
    for a, b in zip(local, remote, strict=True):
        # W&B holds the participation ledger's verdict alone (its counts describe the private sampling)
        shared = {**a.summary, "participation": {"verdict": a.summary["participation"]["verdict"]}}
        assert b.complete and b.config == a.config and b.summary == shared
        assert [m["step"] for m in b.metrics()] == [m["step"] for m in a.metrics()]
        for ma, mb in zip(a.metrics(), b.metrics(), strict=True):
            assert mb == pytest.approx(ma)
    assert cells_of(remote) == cells_of(local)


def test_records_from_wandb_aggregate_to_the_same_cells_as_the_run_store(fig2_store, sources):
    local = load_local_runs(fig2_store / "runs", "ganesh_fig2")
    serve(sources, [as_wandb_run(r.path, "ganesh_fig2") for r in local])
    remote = load_wandb_runs("ganesh_fig2", PROJECT)
    assert [(r.path.name, r.complete) for r in remote] == [(r.path.name, r.complete) for r in local]
    assert [r.path.name for r in remote if not r.complete] == ["killed"]
    assert cells_of(remote) == cells_of(local)
    pp = remote[[r.path.name for r in remote].index("pp-b-dpmf_sqrt")]
    assert pp.summary["epsilon"] == {"pld": 50.0, "rdp": 60.0} and pp.summary["steps"] == 20
    assert (
        pp.metrics()
        == load_local_runs(fig2_store / "runs", "ganesh_fig2")[
            [r.path.name for r in local].index("pp-b-dpmf_sqrt")
        ].metrics()
    )


def test_report_from_wandb_writes_the_same_table_as_from_the_run_store(fig2_store, sources):
    from dp_adam_bench.report import ganesh_fig2

    local = load_local_runs(fig2_store / "runs", "ganesh_fig2")
    api = serve(sources, [as_wandb_run(r.path, "ganesh_fig2") for r in local])
    ganesh_fig2.build()
    from_store = pd.read_csv(fig2_store / "results" / "ganesh_fig2.csv")
    md_store = (fig2_store / "results" / "ganesh_fig2.md").read_text()
    assert main(["report", "ganesh_fig2", "--source", "wandb", "--wandb-project", PROJECT]) == 0
    assert api.calls == [(PROJECT, {"group": "ganesh_fig2"})]
    assert RUN_SOURCE_ENV not in os.environ and PROJECT_ENV not in os.environ  # the CLI passes a context
    pd.testing.assert_frame_equal(pd.read_csv(fig2_store / "results" / "ganesh_fig2.csv"), from_store)
    assert (fig2_store / "results" / "ganesh_fig2.md").read_text() == md_store


def test_the_wandb_runs_of_one_run_id_fold_into_one_record_like_its_folder(sources):
    """Killed at step 30 and resumed from the step-20 checkpoint, then forced to rerun, then a crashed rerun."""
    cfg = {"optimizer": {"name": "adam", "lr": 0.1}, "noise": {"kind": "independent"}, "seed": 0}
    done = {"status": "complete", "metrics": {"test_loss": 0.5}, "steps": 40}

    def run(at, steps, summary, tag):
        rows = [{"_step": s, "test_loss": s / 100, "attempt": tag} for s in steps]
        meta = {"_step": steps[-1]}
        if summary:
            meta.update(summary)
            meta[SUMMARY_JSON_KEY] = json.dumps(summary)
        return FakeRun("r1", "exp", cfg, meta, rows, created_at=f"2026-01-01T0{at}:00:00")

    killed = run(1, (10, 20, 30), None, "killed")
    resumed = run(2, (30, 40), done, "resumed")
    serve(sources, [resumed, killed])
    (rec,) = load_wandb_runs("exp", PROJECT)
    assert rec.complete and rec.summary == done
    assert [(m["step"], m["attempt"]) for m in rec.metrics()] == [
        (10, "killed"),
        (20, "killed"),
        (30, "resumed"),
        (40, "resumed"),
    ]
    forced = run(3, (10, 20, 30, 40), {**done, "metrics": {"test_loss": 0.4}}, "forced")
    crashed = run(4, (10,), None, "crashed")
    serve(sources, [killed, resumed, forced, crashed])
    (rec,) = load_wandb_runs("exp", PROJECT)
    assert rec.summary["metrics"] == {"test_loss": 0.4}
    assert {m["attempt"] for m in rec.metrics()} == {"forced"} and len(rec.metrics()) == 4


def test_both_completes_the_run_store_with_wandb_runs_it_lacks(fig2_store, sources):
    root = fig2_store / "runs"
    local = load_local_runs(root, "ganesh_fig2")
    remote = [as_wandb_run(r.path, "ganesh_fig2") for r in local]
    # W&B also has the killed run finished elsewhere, and a run the store lacks
    killed = next(r for r in remote if r.name == "killed")
    killed.summary_metrics = {
        "status": "complete",
        "metrics": {"test_loss": 0.5},
        "trials": {"test_loss": [0.5]},
    }
    extra = write_run(fig2_store / "elsewhere", "ganesh_fig2", "zz-extra", "adagrad_pp", "none", 3.0, [0.7])
    serve(sources, [*remote, as_wandb_run(extra, "ganesh_fig2")])
    merged = load_runs(root, "ganesh_fig2", "both", PROJECT)
    names = [r.path.name for r in merged]
    assert names == sorted([r.path.name for r in local] + ["zz-extra"])
    assert all(r.complete for r in merged)
    by_name = {r.path.name: r for r in merged}
    assert str(by_name["killed"].path).startswith("wandb:") and by_name["pp-a-dpmf_sqrt"].path.parent == (
        root / "ganesh_fig2"
    )
    assert merge_records(local, []) == local


def test_wandb_source_without_api_key_or_network_says_so(fig2_store, sources, capsys):
    def no_key(*_, **__):
        raise wandb.errors.UsageError("No API key configured. Use `wandb login` to log in.")

    sources.setattr(wandb, "Api", no_key)
    assert main(["report", "ganesh_fig2", "--source", "wandb", "--wandb-project", PROJECT]) == 2
    err = capsys.readouterr().err
    assert (
        "cannot read runs from W&B: no API key" in err and "WANDB_API_KEY" in err and "--source local" in err
    )

    def offline(*_, **__):
        raise wandb.errors.CommError("Failed to execute API request: network unreachable")

    sources.setattr(wandb, "Api", offline)
    with pytest.raises(WandbSourceError, match=r"cannot reach W&B .*network unreachable"):
        load_wandb_runs("ganesh_fig2", PROJECT)
    # local stays the default, and needs no network
    assert len(load_runs(fig2_store / "runs", "ganesh_fig2")) == 11


def test_wandb_source_with_no_runs_in_the_group_names_group_and_project(isolated_dirs, sources):
    serve(sources, [])
    sources.setenv(PROJECT_ENV, PROJECT)  # the default project when none is given
    with pytest.raises(
        WandbSourceError, match=r"no W&B runs in group 'ganesh_fig2' of project 'ent/dp-adam-bench'"
    ):
        load_runs(isolated_dirs / "runs", "ganesh_fig2", "wandb")
    with pytest.raises(ValueError, match=r"run source 'cloud' is not one of: local, wandb, both"):
        load_runs(isolated_dirs / "runs", "ganesh_fig2", "cloud")
    # the CLI's default source comes from the environment, checked the same way
    sources.setenv(RUN_SOURCE_ENV, "cloud")
    assert main(["report", "ganesh_fig2"]) == 2


# --- part 3: the dashboard ---------------------------------------------------------------------------------------


def all_presets():
    return sorted(p.stem for p in (dash.CONFIG_DIR / "experiment").glob("*.yaml"))


@pytest.mark.slow
def test_dashboard_yaml_is_valid_and_keeps_diagnostics_apart():
    spec = dash.load_spec()
    plans = dash.dashboard_plan(spec, dash.experiment_info(all_presets(), "paper"))
    assert len(plans) == len(all_presets())
    for plan in plans:
        private = [s for s in plan["sections"] if not s.get("diagnostic")]
        diagnostic = [s for s in plan["sections"] if s.get("diagnostic")]
        assert private and diagnostic
        assert all("diagnostic, not private" in s["name"] for s in diagnostic)
        panels = [p for s in private for p in s["panels"]]
        lines = [p for p in panels if p["kind"] == "line"]
        assert any(plan["metric"] in p["y"] and p["groupby"] == "config.optimizer.name" for p in lines)
        assert any(p.get("y") == ["epsilon"] for p in lines)
        assert any(
            p["kind"] == "bar" and p["metrics"] == [plan["metric"]] and p["groupby"] == "JobType"
            for p in panels
        )
        assert not any(
            str(k).startswith("diag/") for p in panels for k in p.get("y", []) + p.get("metrics", [])
        )
        diag_keys = [k for s in diagnostic for p in s["panels"] for k in p.get("y", [])]
        assert diag_keys and all(k.startswith("diag/") for k in diag_keys)
    tang = next(p for p in plans if p["experiment"] == "tang_fig1_cifar10")
    assert tang["group"] == "tang_fig1_cifar10_paper" and tang["metric"] == "test_accuracy"


@pytest.mark.parametrize(
    "edit,match",
    [
        (
            lambda s: s["sections"][0]["panels"][0]["y"].append("diag/phi"),
            "diag/ keys belong in the diagnostic",
        ),
        (lambda s: s["sections"][1].update(name="diag"), "must say 'diagnostic, not private'"),
        (lambda s: s["sections"][0]["panels"][0].update(kind="pie"), r"kind='pie'; valid: line, bar"),
        (lambda s: s["sections"][0]["panels"][0].update(groupby="optimizer"), r"groupby='optimizer'; valid"),
    ],
)
def test_a_bad_dashboard_yaml_fails_naming_the_entry(tmp_path, edit, match):
    spec = yaml.safe_load(dash.DASHBOARD_FILE.read_text())
    edit(spec)
    bad = tmp_path / "dashboard.yaml"
    bad.write_text(yaml.safe_dump(spec))
    with pytest.raises(ValueError, match=match):
        dash.load_spec(bad)


@pytest.mark.slow
def test_dashboard_dry_run_prints_the_plan_without_network(monkeypatch, capsys):
    def no_network(*_, **__):
        raise AssertionError("the dry run must not reach W&B")

    monkeypatch.setattr(wandb, "Api", no_network)
    hide_wandb_workspaces(monkeypatch)  # nor need the package
    args = ["wandb-dashboard", "--project", PROJECT, "--experiment", "tang_fig1_cifar10", "--dry-run"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "workspace 'tang_fig1_cifar10_cpu: headline comparisons' in ent/dp-adam-bench" in out
    assert "W&B group = 'tang_fig1_cifar10_cpu'" in out
    assert "[line] test_accuracy vs step, by optimizer" in out and "[line] epsilon vs step" in out
    assert "[bar] final test_accuracy by optimizer x mechanism" in out
    assert "section 'diag/: diagnostic, not private'" in out
    # every preset when none is named
    assert main(["wandb-dashboard", "--project", PROJECT, "--dry-run"]) == 0
    assert capsys.readouterr().out.count("workspace '") == len(all_presets())


def hide_wandb_workspaces(monkeypatch):
    for name in ("wandb_workspaces", "wandb_workspaces.workspaces", "wandb_workspaces.reports"):
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "wandb_workspaces.reports.v2", None)


def test_dashboard_without_the_package_or_an_entity_says_what_to_do(monkeypatch, capsys):
    hide_wandb_workspaces(monkeypatch)
    assert main(["wandb-dashboard", "--project", PROJECT, "--experiment", "ganesh_fig2"]) == 2
    assert 'pip install -e ".[dashboard]"' in capsys.readouterr().err
    assert main(["wandb-dashboard", "--project", "dp-adam-bench", "--experiment", "ganesh_fig2"]) == 2
    assert "ENTITY/dp-adam-bench" in capsys.readouterr().err


def test_dashboard_builds_wandb_workspaces_objects():
    pytest.importorskip("wandb_workspaces", reason="optional extra [dashboard]")
    plans = dash.dashboard_plan(dash.load_spec(), dash.experiment_info(["ganesh_fig2"], "cpu"))
    (workspace,) = dash.build_workspaces(plans, "ent", "dp-adam-bench")
    assert workspace.entity == "ent" and workspace.name == "ganesh_fig2: headline comparisons"
    assert [s.name for s in workspace.sections] == [
        "ganesh_fig2: private results",
        "diag/: diagnostic, not private",
    ]
    view = json.dumps(workspace._to_model().model_dump(by_alias=True), default=str)  # what save() would send
    assert '"groupBy": "optimizer.value.name"' in view and '"groupBy": "jobType"' in view
    assert '"name": "group"' in view and "ganesh_fig2" in view
