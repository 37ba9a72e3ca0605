"""Local sweeps: how many runs at once (``--jobs``, ``--jobs-per-gpu``), on which GPU each worker runs, and a run
locked by another process skipped inside a multirun while its siblings run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dp_adam_bench import placement, sweep
from dp_adam_bench.errors import ConfigError
from dp_adam_bench.placement import ENV_SLOT_DIR, ENV_SLOTS, LocalJobs, claim_gpu, plan_local_jobs

from helpers import TINY_1D, compose_cfg

# --- how many at once, with how many threads, on which GPU ----------------------------------------------------------


def test_without_a_gpu_jobs_are_cores_with_one_thread_each():
    assert plan_local_jobs(None, None, [], 16) == LocalJobs(jobs=16, threads=1)
    assert plan_local_jobs(2, None, [], 2) == LocalJobs(jobs=2, threads=1)
    assert plan_local_jobs(None, None, [], None) == LocalJobs(jobs=1, threads=1)
    assert plan_local_jobs(2, None, [], 2).env() == {}


def test_with_gpus_one_worker_per_gpu_spread_over_the_gpus_first():
    assert plan_local_jobs(None, None, ["0", "1"], 16) == LocalJobs(jobs=2, threads=8, gpu_slots=("0", "1"))
    four = plan_local_jobs(None, 2, ["0", "1"], 16)
    assert four == LocalJobs(jobs=4, threads=4, gpu_slots=("0", "1", "0", "1"))
    assert four.env() == {ENV_SLOTS: "0,1,0,1"}
    # --jobs N: N workers round-robin over the GPUs; the GPU names are CUDA_VISIBLE_DEVICES' own
    assert plan_local_jobs(3, None, ["2", "5"], 2).gpu_slots == ("2", "5", "2")
    assert plan_local_jobs(9, None, ["0"], 16) == LocalJobs(jobs=9, threads=1, gpu_slots=("0",) * 9)


@pytest.mark.parametrize(
    "jobs, per_gpu, gpus, match",
    [
        (0, None, [], r"--jobs 0: must be a whole number >= 1"),
        (None, -1, ["0"], r"--jobs-per-gpu -1: must be a whole number >= 1"),
        (2, 2, ["0"], r"--jobs 2 and --jobs-per-gpu 2: give one of them"),
        (None, 2, [], r"--jobs-per-gpu 2: this machine has no visible GPU"),
    ],
)
def test_bad_job_counts_are_refused_in_one_line(jobs, per_gpu, gpus, match):
    with pytest.raises(ConfigError, match=match):
        plan_local_jobs(jobs, per_gpu, gpus, 4)


def test_visible_gpus_follow_cuda_visible_devices(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert placement.visible_gpus({}) == ["0", "1"]
    assert placement.visible_gpus({"CUDA_VISIBLE_DEVICES": "3,7"}) == ["3", "7"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert placement.visible_gpus({"CUDA_VISIBLE_DEVICES": "3,7"}) == []


def _machine(monkeypatch, gpus: list[str], cores: int) -> None:
    """Pretend this machine has these visible GPUs and cores."""
    monkeypatch.setattr(sweep, "visible_gpus", lambda: gpus)
    monkeypatch.setattr(sweep, "cores", lambda: cores)


def _commands(*args, **kwargs):
    return sweep.sweep_commands("tang_fig1_cifar10", "cpu", *args, **kwargs)


def test_joblib_commands_on_a_cpu_machine(monkeypatch):
    _machine(monkeypatch, [], 2)
    (cmd, *_) = _commands("joblib", local=sweep.local_jobs(2))
    assert "hydra.launcher.n_jobs=2" in cmd and "train.threads=1" in cmd
    _machine(monkeypatch, [], 16)
    (cmd, *_) = _commands("joblib")  # default: a worker per core
    assert "hydra.launcher.n_jobs=16" in cmd and "train.threads=1" in cmd
    (cmd, *_) = _commands("joblib", ["train.threads=4"])  # the user's own count stays
    assert [a for a in cmd if a.startswith("train.threads=")] == ["train.threads=4"]


def test_joblib_commands_on_a_gpu_machine(monkeypatch, capsys):
    _machine(monkeypatch, ["0", "1"], 16)
    (cmd, *_) = _commands("joblib", local=sweep.local_jobs(None, 2))
    assert "hydra.launcher.n_jobs=4" in cmd and "train.threads=4" in cmd
    assert sweep.run_sweep("tang_fig1_cifar10", "cpu", None, dry_run=True, jobs_per_gpu=2) == 0
    out = capsys.readouterr().out
    assert "joblib: 4 runs at once, 4 torch thread(s) each, one GPU per worker, slots 0,1,0,1" in out
    printed = [line for line in out.splitlines() if line.startswith("+ ")]
    assert len(printed) == 3 and all(line.startswith(f"+ {ENV_SLOTS}=0,1,0,1 ") for line in printed)


def test_a_sweep_launches_its_commands_with_the_gpu_slots(isolated_dirs, monkeypatch):
    monkeypatch.setattr(sweep, "visible_gpus", lambda: ["0"])
    monkeypatch.setattr(sweep, "_sweep_progress", lambda *a, **k: None)
    seen = []

    class Done:  # a multirun that has already ended
        def __init__(self, cmd, env):
            workers = next(a for a in cmd if a.startswith("hydra.launcher.n_jobs="))
            seen.append((env[ENV_SLOTS], workers))

        def poll(self):
            return 0

    monkeypatch.setattr(subprocess, "Popen", Done)
    assert sweep.run_sweep("tang_fig1_cifar10", "cpu", "joblib", jobs=3) == 0
    # its 3 multiruns (3 seeds each) packed onto the 3 workers, every slot in each one's environment
    assert seen == [("0,0,0", "hydra.launcher.n_jobs=3")] * 3


@pytest.mark.parametrize(
    "launcher, jobs, per_gpu, want",
    [
        (None, None, None, "basic"),
        (None, 4, None, "joblib"),
        (None, None, 2, "joblib"),
        ("basic", 1, None, "basic"),
    ],
)
def test_the_launcher_follows_the_job_count(launcher, jobs, per_gpu, want):
    assert sweep.resolve_launcher(launcher, jobs, per_gpu) == want


@pytest.mark.parametrize(
    "launcher, jobs, per_gpu, match",
    [
        (
            "basic",
            4,
            None,
            r"--jobs 4 with --launcher basic, which runs one job at a time: use --launcher joblib",
        ),
        ("slurm", 2, None, r"--jobs / --jobs-per-gpu place jobs on this machine; with --launcher slurm"),
        ("local", None, None, r"unknown launcher 'local'; valid: basic, joblib, slurm"),
    ],
)
def test_a_job_count_the_launcher_cannot_honour_is_refused(launcher, jobs, per_gpu, match):
    with pytest.raises(ValueError, match=match):
        sweep.resolve_launcher(launcher, jobs, per_gpu)


def test_the_cli_refuses_a_bad_job_count_in_one_line(capsys):
    from dp_adam_bench.cli import main

    assert main(["sweep", "tang_fig1_cifar10", "--jobs", "0", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: --jobs 0: must be a whole number >= 1"


def test_reproduce_takes_the_same_job_options(isolated_dirs, monkeypatch, capsys):
    from dp_adam_bench.cli import main

    monkeypatch.setattr(sweep, "visible_gpus", lambda: [])  # a machine without a GPU, on any machine
    # no stale runs to set aside in an empty run store (composing the preset's 91 run configs takes ~8 s)
    monkeypatch.setattr(sweep, "set_aside_stale_runs", lambda *args, **kwargs: [])
    assert main(["reproduce", "ganesh_fig2", "--jobs-per-gpu", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --jobs-per-gpu 2: this machine has no visible GPU") and "\n" not in err


# --- each worker claims a GPU slot for its life --------------------------------------------------------------------


@pytest.fixture
def slots(tmp_path, monkeypatch):
    """A GPU sweep's environment (slots 0,1,0) with a slot folder of its own; no slot held by this process."""
    monkeypatch.setattr(placement, "_HELD", None)
    env = {ENV_SLOTS: "0,1,0", ENV_SLOT_DIR: str(tmp_path / "slots")}
    yield env
    if placement._HELD is not None:
        placement._HELD[0].close()


def _as_another_worker(monkeypatch):
    """Forget this process's slot without releasing it: the next claim acts as another worker would."""
    monkeypatch.setattr(placement, "_HELD", None)


def test_workers_claim_free_slots_gpus_first_and_see_one_gpu(slots, monkeypatch):
    held = []
    for _ in range(3):
        env = dict(slots)
        gpu = claim_gpu(env)
        assert env["CUDA_VISIBLE_DEVICES"] == gpu
        held.append((gpu, placement._HELD))
        assert claim_gpu(env) == gpu  # the same worker keeps its slot
        _as_another_worker(monkeypatch)
    assert [g for g, _ in held] == ["0", "1", "0"]
    with pytest.raises(TimeoutError, match=r"no free GPU slot among 0,1,0 in .* after 0.2 s"):
        claim_gpu(dict(slots), poll_s=0.05, timeout_s=0.2)  # every slot taken: a fourth worker waits
    held[1][1][0].close()  # the worker on GPU 1 ends: its slot is free again
    assert claim_gpu(dict(slots), timeout_s=1) == "1"
    for _, h in held:
        h[0].close()


def test_outside_a_gpu_sweep_nothing_is_claimed(monkeypatch):
    monkeypatch.setattr(placement, "_HELD", None)
    env = {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert claim_gpu(env) is None and env == {"CUDA_VISIBLE_DEVICES": "0,1"} and placement._HELD is None


# --- a locked run inside a multirun -------------------------------------------------------------------------------

TOY = ["optimizer=adagrad_pp", "noise=none", *TINY_1D]  # a non-private 1-D toy run: about a second


@pytest.mark.parametrize("launcher", ["basic", "joblib"])
@pytest.mark.slow
def test_a_locked_run_in_a_multirun_is_skipped_and_its_siblings_run(tmp_path, launcher):
    """Two seeds in one multirun while another process trains seed 0: seed 0 is skipped with one line, seed 1
    runs, and the command succeeds (it aborted its siblings with the lock error). The joblib workers are those of
    a GPU sweep (two slots on GPU 0; the toy task runs on the CPU whatever the GPU): each claims a slot first."""
    from dp_adam_bench.tracking.run_store import RunFolder, is_complete, run_id
    from dp_adam_bench.train import run_config

    base = [*TOY, "experiment_name=locked_multirun", "logger.wandb.mode=disabled"]
    ids = {s: run_id(run_config(compose_cfg([*base, f"seed={s}"]))) for s in (0, 1)}
    runs = tmp_path / "runs"
    holder = RunFolder.acquire(runs, "locked_multirun", ids[0])  # "another process" training seed 0
    extra, env = [], {"DP_ADAM_BENCH_RUNS": str(runs), "DP_ADAM_BENCH_PROGRESS": "off"}
    if launcher == "joblib":
        extra = ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "train.threads=1"]
        env |= {ENV_SLOTS: "0,0", ENV_SLOT_DIR: str(tmp_path / "slots")}
    try:
        out = subprocess.run(
            [sys.executable, "-m", "dp_adam_bench.train", "-m", *base, "seed=0,1", *extra],
            capture_output=True,
            text=True,
            timeout=240,
            env={**os.environ, **env},
            cwd=tmp_path,
        )
    finally:
        holder.release()
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if line.startswith("locked, skipped:")]
    assert len(lines) == 1 and str(RunFolder.folder(runs, "locked_multirun", ids[0])) in lines[0]
    assert "the rest of this multirun goes on" in lines[0]
    assert is_complete(RunFolder.folder(runs, "locked_multirun", ids[1]))
    assert not is_complete(RunFolder.folder(runs, "locked_multirun", ids[0]))
    if (
        launcher == "joblib"
    ):  # a worker claimed a slot (the first) before its job; no slot outside a GPU sweep
        assert "this worker runs its jobs on GPU 0 (slot gpu0-0.lock of 0,0)" in out.stdout + out.stderr
        assert (tmp_path / "slots" / "gpu0-0.lock").is_file()
    else:
        assert "runs its jobs on GPU" not in out.stdout + out.stderr


def test_a_locked_run_outside_a_multirun_still_fails_in_one_line():
    from dp_adam_bench.tracking.run_store import RunLockedError

    assert placement.skip_locked_run(RunLockedError("/x", {"pid": 1, "host": "h"})) is False


def test_reproduce_sweeps_the_presets_a_table_also_reads(isolated_dirs, monkeypatch):
    """ganesh_fig3_horizon's paper profile reads ganesh_fig3's runs as its longest horizon: reproduce sweeps that
    preset first (complete runs are skipped by the sweep), then its own; the cpu profile runs every horizon
    itself and sweeps only its own preset."""
    from dp_adam_bench.cli import main
    from dp_adam_bench.report import document, registry

    swept = []
    monkeypatch.setattr(sweep, "set_aside_stale_runs", lambda *args, **kwargs: [])
    monkeypatch.setattr(sweep, "run_sweep", lambda experiment, *a, **kw: swept.append(experiment) or 0)
    monkeypatch.setattr(registry, "build", lambda tid, ctx: [])
    monkeypatch.setattr(document, "build_document", lambda out: out)
    assert main(["reproduce", "ganesh_fig3_horizon"]) == 0
    assert swept == ["ganesh_fig3_horizon"]
    swept.clear()
    assert main(["reproduce", "ganesh_fig3_horizon", "--profile", "paper"]) == 0
    assert swept == ["ganesh_fig3", "ganesh_fig3_horizon"]
