"""How a user controls runs from the command line (issue 33): train.force reruns from scratch, Ctrl-C stops a run or a
sweep with one line saying how to go on (exit 130), and the note on the CLI's default sampler for independent noise.
The sweep's progress count after an interrupted sweep is checked in test_sweep_resume (it needs a real sweep)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from dp_adam_bench import cli
from dp_adam_bench import train as train_mod
from dp_adam_bench.engine.checkpoint import FILENAME
from dp_adam_bench.engine.session import PrivateTraining
from dp_adam_bench.tasks import registry

from helpers import ON_CPU, compose_cfg, tiny_poisson


@pytest.fixture
def steps_taken(monkeypatch, isolated_dirs):
    """The tiny task registered, and a list that grows by one per private step any run takes."""
    monkeypatch.setitem(registry.TASKS, "tiny", "tiny_task:TinyTask")
    taken, step = [], PrivateTraining.step

    def counted(self):
        taken.append(1)
        return step(self)

    monkeypatch.setattr(PrivateTraining, "step", counted)
    return taken


def test_force_reruns_from_scratch_whether_the_run_is_complete_or_checkpointed(steps_taken, isolated_dirs):
    """A killed run's relaunch with train.force=true takes all 4 steps (a resume would take 2 from the step-2
    checkpoint); a complete run forced again takes all 4 (a resume from its step-4 checkpoint took 0) and leaves no
    checkpoint of the run it replaced."""
    base = tiny_poisson("force", 4, "train.checkpoint_every=2", ON_CPU)
    with pytest.raises(KeyboardInterrupt):
        train_mod.train(compose_cfg([*base, "train.stop_after=3"]))
    folder = next((isolated_dirs / "runs" / "force").iterdir())
    assert len(steps_taken) == 3 and (folder / FILENAME).exists()

    steps_taken.clear()
    forced = train_mod.train(compose_cfg([*base, "train.force=true"]))
    assert len(steps_taken) == 4 and "carried_over" not in forced["self_check"]
    assert train_mod.train(compose_cfg(base)) is None  # complete: skipped

    steps_taken.clear()
    again = train_mod.train(compose_cfg([*base, "train.force=true", "train.checkpoint_every=0"]))
    assert len(steps_taken) == 4 and not (folder / FILENAME).exists()
    assert again["final_params_sha1"] == forced["final_params_sha1"]  # the same run, computed again


@pytest.mark.slow
def test_ctrl_c_stops_a_run_with_one_line_and_exit_130(tmp_path):
    """A real SIGINT to `python -m dp_adam_bench.train` while it trains: no traceback, one line saying how to go
    on, the shell's exit code for SIGINT."""
    err = tmp_path / "stderr"
    cmd = [sys.executable, "-m", "dp_adam_bench.train", "task=logistic_1d", "noise=independent",
           "train.sampler=poisson", "train.batch_size=10", "train.steps=100000000",
           "logger.wandb.mode=disabled"]  # fmt: skip
    env = {**os.environ, "DP_ADAM_BENCH_RUNS": str(tmp_path / "runs"), "DP_ADAM_BENCH_PROGRESS": "off"}
    with open(err, "w") as fh:
        # the child takes SIGINT as a terminal's Ctrl-C delivers it, even when this session was started in the
        # background (nohup ... &), whose children inherit SIGINT ignored
        proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=fh,
            cwd=tmp_path,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        deadline = time.time() + 120
        while "run folder:" not in err.read_text() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)  # inside the training loop
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=60)
    lines = err.read_text().strip().splitlines()
    assert rc == 130, lines
    assert "Traceback" not in err.read_text() and len(lines) == 2, (
        lines
    )  # "run folder: ..." and the line below
    assert lines[-1].startswith(
        "interrupted (Ctrl-C): run the same command again to go on: a complete run is"
    )


@pytest.mark.parametrize("command", ["sweep", "reproduce", "report"])
def test_ctrl_c_in_a_command_is_one_line_and_exit_130(monkeypatch, capsys, command):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("dp_adam_bench.sweep.run_sweep", interrupted)
    monkeypatch.setattr("dp_adam_bench.report.registry.resolve", interrupted)
    argv = {"sweep": ["sweep", "ganesh_quadratic"], "reproduce": ["reproduce", "ganesh_quadratic"]}
    assert cli.main(argv.get(command, [command, "ganesh_quadratic"])) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    if command == "report":
        assert err[0] == "interrupted (Ctrl-C): report stopped before it finished"
    else:
        assert err[0].startswith("interrupted (Ctrl-C): launch the same command again to finish the sweep:")


@pytest.mark.parametrize(
    "overrides, noted",
    [
        (["noise=independent"], True),
        (["noise=independent", "train.sampler=single_pass"], False),  # chosen, not defaulted
        (["noise=independent", "train.sampler=poisson", "train.steps=5"], False),
        (["noise=bandmf"], False),  # correlated noise: single_pass is its sampler
        (["experiment=ganesh_fig2"], False),  # a preset's choice
    ],
)
def test_the_default_single_pass_sampler_with_independent_noise_is_noted(overrides, noted):
    note = train_mod.default_sampler_note(compose_cfg(overrides), overrides)
    assert (note is not None) == noted
    if noted:
        assert "train.sampler=poisson" in note and "without amplification" in note


def test_sweep_progress_set_up_in_its_thread_counts_from_there(monkeypatch, capsys):
    """SweepProgress(setup=...): the first line comes from the thread once set-up returns (total, count), counting
    the runs already complete; a set-up that fails shows nothing and stopping still works."""
    from dp_adam_bench.progress import SweepProgress

    monkeypatch.setenv("DP_ADAM_BENCH_PROGRESS", "lines")
    counts = iter([2, 3])
    tracker = SweepProgress(None, None, what="sweep x", every_s=3600, setup=lambda: (3, lambda: next(counts)))
    tracker.start().stop()
    assert [ln.split()[2] for ln in capsys.readouterr().err.strip().splitlines()] == ["2/3", "3/3"]

    def broken():
        raise ValueError("a config that does not compose")

    SweepProgress(None, None, what="sweep y", every_s=3600, setup=broken).start().stop()
    assert capsys.readouterr().err == ""
