"""What a run shows while it trains: a bar with ETA, loss and epsilon on a terminal, log lines elsewhere."""

from __future__ import annotations

import logging

import pytest

from dp_adam_bench import progress
from dp_adam_bench.tasks import registry

from helpers import compose_cfg, tiny_poisson


@pytest.fixture
def tiny(monkeypatch, isolated_dirs):
    monkeypatch.setitem(registry.TASKS, "tiny", "tiny_task:TinyTask")


def _train(name: str):
    from dp_adam_bench.train import train

    return train(compose_cfg(tiny_poisson(name, 6, "train.log_every=2", "train.eval_every=3")))


def test_the_bar_shows_steps_eta_loss_and_epsilon(tiny, monkeypatch, capsys):
    monkeypatch.setenv("DP_ADAM_BENCH_PROGRESS", "bar")
    monkeypatch.setenv("COLUMNS", "250")  # captured stderr has no width: the bar takes $COLUMNS
    summary = _train("bar")
    err = capsys.readouterr().err
    assert "6/6" in err
    assert "<00:00" in err  # tqdm's elapsed<remaining field (the ETA)
    assert "epsilon (rdp)=" in err and "test_loss=" in err  # epsilon named by its accountant
    eps_shown = float(err.rsplit("epsilon (rdp)=", 1)[1].split(",")[0].split("]")[0])
    assert eps_shown == pytest.approx(summary["epsilon"]["rdp"], rel=1e-3)


def test_off_a_terminal_a_line_at_the_start_and_per_logged_step(tiny, monkeypatch, caplog):
    monkeypatch.setenv("DP_ADAM_BENCH_PROGRESS", "lines")
    with caplog.at_level(logging.INFO, logger="dp_adam_bench.progress"):
        _train("lines")
    lines = [r.getMessage() for r in caplog.records if r.name == "dp_adam_bench.progress"]
    assert [ln.split()[2].rstrip(":") for ln in lines] == ["0/6", "2/6", "4/6", "6/6"]
    assert "training starts" in lines[0]
    assert all("ETA" in ln for ln in lines[1:])
    assert "epsilon (rdp)=" in lines[-1] and "test_loss=" in lines[-1]


def test_off_a_terminal_a_line_at_least_every_30_s_whatever_log_every_says(monkeypatch, caplog):
    """A slow run logs every 100 steps: a line still comes every LINE_EVERY_S seconds, with the ETA and the epsilon
    named by its accountant (asked of the ledger, since unlogged steps carry none)."""
    clock = [0.0]
    monkeypatch.setattr(progress.time, "time", lambda: clock[0])
    monkeypatch.setenv("DP_ADAM_BENCH_PROGRESS", "lines")
    asked = []
    with caplog.at_level(
        logging.INFO, logger="dp_adam_bench.progress"
    ):  # the start line too, in any test order
        bar = progress.Progress(
            1000,
            enabled=True,
            what="slow",
            epsilon=lambda: asked.append(1) or {"epsilon": 1.5},
            accountant="prv",
        )
        for step in range(1, 21):
            clock[0] = 7.0 * step  # 7 s a step
            bar.update(step, {}, logged=step % 100 == 0)
    lines = [r.getMessage() for r in caplog.records if r.name == "dp_adam_bench.progress"]
    assert "training starts" in lines[0]  # the line at step 0, then one every 30 s
    lines = lines[1:]
    assert [ln.split()[2] for ln in lines] == ["5/1000", "10/1000", "15/1000", "20/1000"]  # 35 s apart
    assert all("ETA" in ln and "epsilon (prv)=1.5" in ln for ln in lines)
    assert "ETA 6965 s" in lines[0]  # 35 s for 5 steps, 995 to go
    assert len(asked) == 4


def test_off_shows_nothing(tiny, monkeypatch, caplog, capsys):
    monkeypatch.setenv("DP_ADAM_BENCH_PROGRESS", "off")
    with caplog.at_level(logging.INFO, logger="dp_adam_bench.progress"):
        _train("off")
    assert not [r for r in caplog.records if r.name == "dp_adam_bench.progress"]
    assert "6/6" not in capsys.readouterr().err


def test_auto_follows_the_terminal_and_bad_values_are_named(monkeypatch):
    monkeypatch.delenv("DP_ADAM_BENCH_PROGRESS", raising=False)
    monkeypatch.setattr("sys.stderr.isatty", lambda: False, raising=False)
    assert progress.mode() == "lines"
    monkeypatch.setenv("DP_ADAM_BENCH_PROGRESS", "fancy")
    with pytest.raises(ValueError, match="'fancy' is not one of auto, bar, lines, off"):
        progress.mode()


@pytest.mark.parametrize("mode", ["bar", "lines", "off"])
def test_iterate_yields_every_item(monkeypatch, mode):
    monkeypatch.setenv("DP_ADAM_BENCH_PROGRESS", mode)
    assert list(progress.iterate(range(5), desc="x")) == [0, 1, 2, 3, 4]


def test_diagnostics_are_never_shown_as_progress():
    assert progress._shown({"diag/loss": 1.0, "test_loss": 2.0, "epsilon": 3.0, "lr": 0.1}) == {
        "test_loss": 2.0,
        "epsilon": 3.0,
    }


def test_sweep_progress_counts_runs_across_commands(monkeypatch, capsys):
    monkeypatch.setenv("DP_ADAM_BENCH_PROGRESS", "lines")
    counts = iter([1, 1, 2, 4])
    tracker = progress.SweepProgress(4, lambda: next(counts), what="sweep x", every_s=3600).start()
    tracker.update()  # unchanged: no line
    tracker.update()
    tracker.stop()
    lines = capsys.readouterr().err.strip().splitlines()
    assert [ln.split()[2] for ln in lines] == ["1/4", "2/4", "4/4"]
    assert "ETA" not in lines[0] and "ETA" in lines[1]


@pytest.mark.slow
def test_a_complete_sweep_reports_its_runs_and_launches_nothing(isolated_dirs, monkeypatch, capfd):
    """The real sweep command of ganesh_quadratic's preset with every run already complete: one line, n/n, and no
    multirun launched just to print a "skipped" line per run."""
    from dp_adam_bench import sweep
    from dp_adam_bench.paths import runs_dir
    from dp_adam_bench.tracking.run_store import RunFolder

    monkeypatch.setenv("DP_ADAM_BENCH_PROGRESS", "lines")
    name, ids = sweep.expected_runs("ganesh_quadratic")
    for rid in ids:
        folder = RunFolder.folder(runs_dir(), name, rid)
        folder.mkdir(parents=True)
        (folder / "summary.json").write_text('{"status": "complete"}')
    launched = []
    monkeypatch.setattr(sweep.subprocess, "run", lambda cmd, **kw: launched.append(cmd))
    assert sweep.run_sweep("ganesh_quadratic") == 0
    out, err = capfd.readouterr()
    assert f"sweep ganesh_quadratic: {len(ids)}/{len(ids)} runs complete" in err
    assert f"all {len(ids)} runs are complete, nothing to launch" in out
    assert not launched


def test_a_non_amplified_run_shows_the_epsilon_it_spent_up_front(tiny, monkeypatch, caplog):
    """BandMF on cyclic fixed-size batches logs no per-step epsilon (the whole stream is paid at step 0): the
    progress lines ask the ledger."""
    from dp_adam_bench.train import train

    monkeypatch.setenv("DP_ADAM_BENCH_PROGRESS", "lines")
    over = tiny_poisson(
        "mf", 4, "noise=bandmf", "noise.bands=2", "train.sampler=single_pass", "train.steps=null"
    )
    with caplog.at_level(logging.INFO, logger="dp_adam_bench.progress"):
        summary = train(compose_cfg([*over, "train.log_every=2", "train.epochs=1"]))
    lines = [r.getMessage() for r in caplog.records if r.name == "dp_adam_bench.progress"]
    assert lines and all("epsilon (rdp)=" in ln for ln in lines[1:])
    assert float(lines[-1].split("epsilon (rdp)=")[1].split()[0]) == pytest.approx(
        summary["epsilon"]["rdp"], rel=1e-3
    )


def test_a_complete_run_relaunched_says_it_was_skipped(tiny, capsys):
    first = _train("again")
    assert first is not None
    capsys.readouterr()
    assert _train("again") is None
    err = capsys.readouterr().err
    assert "complete, skipped:" in err and "(train.force=true reruns it)" in err
