"""Bad configs fail fast with a message naming the field and the valid values."""

import pytest
from hydra.errors import ConfigCompositionException

from dp_adam_bench.config import ConfigError, validate
from dp_adam_bench.train import run_config

from helpers import compose_cfg


def check(overrides):
    validate(run_config(compose_cfg(overrides)))


def test_default_config_is_valid():
    check([])
    check(["experiment=ganesh_fig2"])


@pytest.mark.parametrize(
    "override,match",
    [
        ("optimizer.name=adamw_magic", r"optimizer.name='adamw_magic'.*valid: adagrad_ime"),
        ("privacy.sigma=-0.5", r"privacy.sigma=-0.5 must be a finite number >= 0"),
        ("privacy.clip=0", r"privacy.clip=0 must be a finite number > 0"),
        ("privacy.clip=-1", r"privacy.clip=-1"),
        ("privacy.delta=1.5", r"privacy.delta=1.5 must be a finite number > 0 and < 1"),
        ("optimizer.lr=0", r"optimizer.lr=0 must be a finite number > 0"),
        ("train.epochs=0", r"train.epochs=0 must be an integer >= 1"),
        ("noise.kind=laplace", r"noise.kind='laplace'.*valid: bandmf, blt, dpmf_sqrt, independent, none"),
        ("task.name=imagenet", r"task.name='imagenet' is not a known task; valid: .*logistic_1d"),
        (
            "train.sampler=uniform",
            r"train.sampler=.uniform.; valid: balls_in_bins, cyclic_poisson, poisson, shuffle",
        ),
    ],
)
def test_bad_values_name_the_field(override, match):
    with pytest.raises(ConfigError, match=match):
        check([override])


def test_poisson_needs_positive_steps():
    with pytest.raises(ConfigError, match=r"train.steps=0 must be an integer >= 1"):
        check(["train.sampler=poisson", "train.steps=0", "noise=independent"])
    with pytest.raises(ConfigError, match=r"train.steps=None"):
        check(["train.sampler=poisson", "noise=independent"])


def test_unknown_group_option_lists_the_available_ones():
    with pytest.raises(ConfigCompositionException, match=r"(?s)optimizer.*adagrad_ime"):
        compose_cfg(["optimizer=does_not_exist"])


def test_batch_larger_than_dataset_is_refused(isolated_dirs):
    from dp_adam_bench.train import train

    cfg = compose_cfg(
        ["task.n_train=10", "train.batch_size=11", "logger.wandb.mode=disabled", "privacy.sigma=0.1"]
    )
    with pytest.raises(
        ValueError, match=r"train.batch_size=11 is larger than the training set \(10 examples\)"
    ):
        train(cfg)


def test_cli_reports_config_errors_with_exit_code_2(capsys):
    from dp_adam_bench import train as train_mod

    with pytest.raises(SystemExit) as exc:
        train_mod.main(compose_cfg(["privacy.sigma=-1"]))  # hydra.main passes a given config straight through
    assert exc.value.code == 2
    assert "privacy.sigma=-1" in capsys.readouterr().err


def test_experiment_preset_overrides_root_values():
    cfg = compose_cfg(["experiment=ganesh_fig2"])
    assert cfg.experiment_name == "ganesh_fig2"
    assert cfg.privacy.sigma == 0.1 and cfg.task.trials == 30


def test_single_optimizer_preset_runs_one_cell_with_its_optimizer():
    """li_e2e's cells are all (DP-)Adam: one cell composed without optimizer= is Adam at the preset's lr, not the
    root default (adagrad_pp)."""
    cfg = compose_cfg(["experiment=li_e2e", "profile=cpu", "noise=none"])
    assert cfg.optimizer.name == "adam" and cfg.optimizer.lr == 0.002


def test_correlated_noise_with_amplified_samplers_is_refused():
    with pytest.raises(ConfigError, match=r"noise.kind='bandmf' with train.sampler=poisson.*single_pass"):
        check(["noise=bandmf", "train.sampler=poisson", "train.steps=10"])
    with pytest.raises(ConfigError, match=r"noise.kind='dpmf_sqrt' with train.sampler=shuffle"):
        check(["noise=dpmf_sqrt", "train.sampler=shuffle"])


def _presets():
    from dp_adam_bench.paths import CONFIG_DIR

    return sorted(p.stem for p in (CONFIG_DIR / "experiment").glob("*.yaml"))


@pytest.mark.parametrize("profile", ["cpu", "paper"])
@pytest.mark.parametrize("preset", _presets())
@pytest.mark.slow
def test_every_experiment_preset_composes_and_every_sweep_point_validates(preset, profile):
    from dp_adam_bench.sweep import override_value as _value
    from dp_adam_bench.sweep import sweep_spec

    spec = sweep_spec(preset, profile)
    sweeps = spec.entries or {"all": {}}
    grid = spec.grid
    for entry in sweeps.values():
        # the first value of every swept key must give a valid run config
        overrides = [f"experiment={preset}", f"profile={profile}"]
        overrides += [
            f"{k}={_value((v if isinstance(v, list) else [v])[0])}" for k, v in {**entry, **grid}.items()
        ]
        validate(run_config(compose_cfg(overrides)))


def test_a_profile_empties_a_sweep_entry_with_an_empty_list():
    """ganesh_fig3_horizon's paper-only cells are empty lists on the CPU: no run (and no ``optimizer=`` with no
    value in a multirun line), while the paper profile runs them."""
    from dp_adam_bench.sweep import sweep_commands, sweep_spec

    cpu = {p["optimizer"] for p in sweep_spec("ganesh_fig3_horizon", "cpu").points()}
    paper = {p["optimizer"] for p in sweep_spec("ganesh_fig3_horizon", "paper").points()}
    assert cpu == {"adam", "stp", "sgd"} and paper == {"adam", "stp", "bc", "sgd"}  # bc: paper-only
    assert not any(c.endswith("=") for cmd in sweep_commands("ganesh_fig3_horizon", "cpu") for c in cmd)


def test_sweep_dry_run_lists_one_multirun_per_entry():
    from dp_adam_bench.sweep import sweep_commands

    cmds = sweep_commands("tang_fig1_cifar10", "cpu", "joblib")
    assert len(cmds) == 3
    assert all("-m" in c and "seed=0,1,2" in c and "hydra/launcher=joblib" in c for c in cmds)


def test_slurm_launcher_config_composes():
    from hydra import compose, initialize_config_dir

    from dp_adam_bench.paths import CONFIG_DIR

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(
            "config",
            overrides=["experiment=tang_fig1_cifar10", "hydra/launcher=slurm"],
            return_hydra_config=True,
        )
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert launcher.gpus_per_node == 1 and launcher.timeout_min == 240 and launcher.mem_gb == 64


def test_a_single_value_inside_a_swept_group_is_written_as_a_choice_sweep():
    from dp_adam_bench.sweep import sweep_commands

    cmds = [" ".join(c) for c in sweep_commands("ganesh_fig3_tuning", "cpu")]
    ime_bc = next(c for c in cmds if "optimizer=ime,bc" in c)
    # a plain optimizer.eps_s=... would be applied to the default optimizer (adagrad_pp, no eps_s) and fail
    assert "optimizer.eps_s=choice(0.0001)" in ime_bc and "optimizer.lr=0.0001,0.0003" in ime_bc
    assert "privacy.sigma=0.015625" in ime_bc  # not inside the swept group: plain


@pytest.mark.slow
def test_an_entry_can_set_its_own_seeds():
    from dp_adam_bench.sweep import expected_runs, runs_folder_name, sweep_commands

    cmds = [" ".join(c) for c in sweep_commands("ganesh_fig3", "cpu")]
    noiseless = [c for c in cmds if "noiseless_precond" in c]
    assert len(noiseless) == 6 and all(c.count("seed=") == 1 and c.endswith("seed=0") for c in noiseless)
    assert all(c.endswith("seed=0,1") for c in cmds if "noiseless_precond" not in c)
    name, ids = expected_runs("ganesh_fig3", "cpu")
    assert runs_folder_name("ganesh_fig3", "cpu") == name == "ganesh_fig3_cpu"  # from one config, not all
    assert (
        len(ids) == 2 * 2 + 5 * 3 * 2 + 2 * 3
    )  # non-private rows and the DP rows (2 seeds), noiseless (1 seed)


@pytest.mark.slow
def test_ganesh_presets_that_tune_on_a_grid_select_on_val_abstracts_scored_in_every_run():
    """Where a Fig. 3 preset selects among several settings (the paper profile's grid, the horizon study), every
    run scores val abstracts (task.val_subset) and the rule reads val_loss, so the tables' test losses are not
    selected on themselves; the tuning presets score val as their eval split and need no val_subset."""
    from dp_adam_bench.sweep import sweep_spec

    for preset, profile in (
        ("ganesh_fig3", "paper"),
        ("ganesh_fig3_horizon", "cpu"),
        ("ganesh_fig3_horizon", "paper"),
    ):
        assert sweep_spec(preset, profile).selection.metric == "val_loss", (preset, profile)
        cfg = compose_cfg([f"experiment={preset}", f"profile={profile}"])
        assert cfg.task.val_subset and cfg.task.eval_split == "test", (preset, profile)
    assert sweep_spec("ganesh_fig3", "cpu").selection.metric == "test_loss"  # one setting a cell
    for preset in ("ganesh_fig3_tuning", "ganesh_fig3_pilots"):
        for profile in ("cpu", "paper"):
            cfg = compose_cfg([f"experiment={preset}", f"profile={profile}"])
            assert cfg.task.eval_split == "val" and cfg.task.val_subset is None, (preset, profile)


@pytest.mark.parametrize(
    "selection, match",
    [
        (
            {"metric": "test_loss", "per": ["optimizer"], "heldout_seeds": [2, "3"]},
            r"heldout_seeds=\[2, '3'\]",
        ),
        (
            {"metric": "test_loss", "per": ["optimizer"], "heldout_seeds": 2},
            r"heldout_seeds=2; valid: a list",
        ),
        (
            {"metric": "test_loss", "per": ["optimizer"], "holdout": [2]},
            r"valid keys: metric, mode, per, tuned",
        ),
    ],
)
def test_a_bad_selection_is_refused_naming_the_key(monkeypatch, selection, match):
    from dp_adam_bench import sweep
    from dp_adam_bench.errors import ConfigError

    preset = {"experiment_name": "x_cpu", "sweep": {"entries": {}, "selection": selection}}
    monkeypatch.setattr(sweep, "load_preset", lambda experiment, profile="cpu": preset)
    with pytest.raises(ConfigError, match=match):
        sweep.sweep_spec("ganesh_fig3_horizon", "cpu")


def test_held_out_seeds_reach_the_selection_and_only_the_cpu_profile_runs_them():
    from dp_adam_bench.sweep import sweep_spec

    cpu, paper = sweep_spec("ganesh_fig3_horizon", "cpu"), sweep_spec("ganesh_fig3_horizon", "paper")
    assert cpu.selection.heldout_seeds == (2, 3) and paper.selection.heldout_seeds == ()
    held = [p for p in cpu.points() if p["seed"] in cpu.selection.heldout_seeds]
    assert len(held) == 8 and {p["task.train_subset"] for p in held} == {1536}  # 4 cells x 2 seeds, 96 steps
    assert not [p for p in paper.points() if p["seed"] not in paper.seeds]


def test_a_registered_sampler_is_valid_and_built_without_touching_the_validator():
    """Samplers are a registry (engine/samplers.py) like the other pieces: an entry added there is a valid
    train.sampler for the validator and the one build_sampler builds, with no other edit."""
    from dp_adam_bench.engine.plan import build_sampler
    from dp_adam_bench.engine.samplers import SAMPLERS

    built = []

    def every_example(cfg, n, steps, seed):
        built.append((n, steps, seed))
        return "the sampler"

    cfg = run_config(compose_cfg(["train.sampler=every_example", "noise=independent"]))
    with pytest.raises(
        ConfigError, match="train.sampler='every_example'; valid: balls_in_bins, cyclic_poisson"
    ):
        validate(cfg)
    with SAMPLERS.replaced("every_example", every_example):
        validate(cfg)
        from omegaconf import OmegaConf

        assert build_sampler(OmegaConf.create(cfg), 10, 3, 7) == "the sampler" and built == [(10, 3, 7)]
        # but no accountant here knows its sampling: a private run with it is refused, not accounted as Poisson
        from dp_adam_bench.engine.trainer import build

        with pytest.raises(
            ConfigError, match="train.sampler='every_example' is registered, but the accounting"
        ):
            build(OmegaConf.create(cfg))
