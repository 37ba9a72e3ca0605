"""The one pipeline: regression tests for what the privacy plan, the privatizer and the unified trainer fixed, and
the README's promise that a variant or a mechanism is one class and one registry line."""

from __future__ import annotations

import math

import pytest
import torch

from dp_adam_bench.train import train

from helpers import compose_cfg, tiny_poisson

LOGISTIC = [
    "task=logistic_1d",
    "task.n_test=200",
    "task.trials=3",
    "optimizer=adagrad_pp",
    "logger.wandb.mode=disabled",
]


def poisson_logistic(*extra):
    return [*LOGISTIC, "noise=independent", "train.sampler=poisson", "experiment_name=pipe", *extra]


def test_toy_task_honours_the_epsilon_budget(isolated_dirs):
    # was: logistic_1d, q = 0.01, sigma = 1, budget 1.0 trained all 300 steps and reported eps_rdp = 1.45
    s = train(
        compose_cfg(
            poisson_logistic(
                "task.n_train=1000",
                "train.batch_size=10",
                "train.steps=300",
                "privacy.sigma=1.0",
                "privacy.epsilon_budget=1.0",
            )
        )
    )
    assert s["stopped_by_budget"] and 0 < s["steps"] < 300
    assert s["epsilon"]["rdp"] <= 1.0
    assert any("epsilon_budget = 1" in n for n in s["privacy_notes"])


def test_toy_task_trains_until_the_target_epsilon(isolated_dirs):
    # was: TypeError from int(None) in build_sampler
    from dp_adam_bench.privacy.accounting import steps_to_epsilon

    s = train(
        compose_cfg(
            poisson_logistic(
                "task.n_train=1000",
                "train.batch_size=10",
                "train.steps=null",
                "privacy.sigma=1.0",
                "privacy.target_epsilon=1.0",
            )
        )
    )
    assert s["steps"] == steps_to_epsilon(1.0, 1.0, 0.01, 1e-5, "rdp") > 0
    assert s["epsilon"]["rdp"] <= 1.0


def test_empty_poisson_batches_are_noise_only_steps(isolated_dirs):
    # was: "cannot reshape tensor of 0 elements"; q = 2/60: about 2 in 3 batches are empty over 200 steps
    s = train(
        compose_cfg(
            poisson_logistic("task.n_train=60", "train.batch_size=2", "train.steps=200", "privacy.sigma=1.0")
        )
    )
    assert s["steps"] == 200 and math.isfinite(s["metrics"]["test_loss"])


def test_empty_poisson_batch_on_a_model_task(isolated_dirs, monkeypatch):
    from dp_adam_bench.tasks import registry

    monkeypatch.setitem(registry.TASKS, "tiny", "tiny_task:TinyTask")
    for engine in ("bk", "hooks", "loop"):
        extra = ("train.batch_size=0.2", f"train.clipping={engine}")  # q = 0.2 / 64: mostly empty batches
        s = train(compose_cfg(tiny_poisson(f"empty_{engine}", 6, *extra)))
        assert s["steps"] == 6 and math.isfinite(s["metrics"]["test_loss"])


def test_toy_task_resumes_bit_identically_from_its_checkpoint(isolated_dirs):
    base = poisson_logistic(
        "task.n_train=200",
        "train.batch_size=10",
        "train.steps=30",
        "privacy.sigma=1.0",
        "train.checkpoint_every=5",
        "optimizer=adagrad_pp",
    )
    full = train(compose_cfg([*base, "experiment_name=full"]))
    with pytest.raises(KeyboardInterrupt):
        train(compose_cfg([*base, "experiment_name=killed", "train.stop_after=12"]))
    resumed = train(compose_cfg([*base, "experiment_name=killed"]))
    assert resumed["final_params_sha1"] == full["final_params_sha1"]
    assert resumed["ledger"] == full["ledger"] and resumed["epsilon"] == full["epsilon"]


def test_target_steps_use_the_variant_sigma_factor():
    # was: poisson_steps used the raw sigma, not sigma times the variant's sigma factor
    from omegaconf import OmegaConf

    from dp_adam_bench.engine.plan import build_plan
    from dp_adam_bench.optim.adam import Adam
    from dp_adam_bench.privacy.accounting import steps_to_epsilon

    class HalfSigma(Adam):
        sigma_factor = 0.5

    cfg = OmegaConf.create(
        compose_cfg(
            poisson_logistic(
                "train.batch_size=10", "train.steps=null", "privacy.sigma=2.0", "privacy.target_epsilon=2.0"
            )
        )
    )
    plan = build_plan(cfg, 1000, HalfSigma(lr=0.1), numel=3, sampler_seed=0)
    assert plan.account_sigma == 1.0
    assert plan.steps == steps_to_epsilon(2.0, 1.0, 0.01, 1e-5, "rdp")


def test_dropout_and_sampler_draw_from_different_streams():
    from dp_adam_bench.engine.seeds import RunSeeds

    seeds = [RunSeeds.derive(s) for s in range(5)]
    assert all(
        r.sampler == s for s, r in enumerate(seeds)
    )  # the sampler keeps the seed: results stay as they were
    assert len({r.dropout for r in seeds}) == 5 and all(r.dropout != r.sampler for r in seeds)
    torch.manual_seed(seeds[0].dropout)
    a = torch.rand(8)
    b = torch.rand(8, generator=torch.Generator().manual_seed(seeds[0].sampler))
    assert not torch.equal(a, b)


def test_secure_rng_is_not_reproducible_and_says_so(isolated_dirs):
    base = poisson_logistic("task.n_train=200", "train.batch_size=10", "train.steps=20", "privacy.sigma=1.0")
    a = train(compose_cfg([*base, "experiment_name=sec_a", "privacy.secure_rng=true"]))
    b = train(compose_cfg([*base, "experiment_name=sec_b", "privacy.secure_rng=true"]))
    c = train(compose_cfg([*base, "experiment_name=rep_c"]))
    d = train(compose_cfg([*base, "experiment_name=rep_d"]))
    assert a["rng"]["mode"] == "secure" and not a["rng"]["reproducible"]
    assert a["metrics"] != b["metrics"]
    assert c["rng"]["reproducible"] and c["metrics"] == d["metrics"]


def test_a_variant_and_a_mechanism_registered_from_a_test_file_run_end_to_end(isolated_dirs, monkeypatch):
    """The README's claim: a variant is one class + one registry line (+ a YAML for the CLI); so is a mechanism."""
    from dp_adam_bench.optim.base import Variant
    from dp_adam_bench.optim.registry import VARIANTS
    from dp_adam_bench.privacy.noise_factory import NOISE, NoiseKind
    from dp_adam_bench.privacy.strategies import IdentityStrategy

    class SignSGD(Variant):
        name = "toy_sign_sgd"

        def init(self, params):
            return {}

        def update(self, params, state, ctx):
            for p, g in zip(params, ctx.noisy, strict=True):
                p.add_(torch.sign(g), alpha=-self.lr)

    monkeypatch.setitem(VARIANTS, "toy_sign_sgd", SignSGD)
    monkeypatch.setitem(NOISE, "toy_iid", NoiseKind(strategy=lambda cfg, steps: IdentityStrategy(steps)))
    base = [*LOGISTIC, "task.n_train=100", "train.batch_size=10", "privacy.sigma=0.5", "noise=independent"]
    # the variant has no YAML of its own: renamed in place, the default optimizer's eps (not its field) goes
    sign = ["optimizer.name=toy_sign_sgd", "~optimizer.eps"]
    ours = train(compose_cfg([*base, *sign, "noise.kind=toy_iid", "experiment_name=toy"]))
    ref = train(compose_cfg([*base, *sign, "experiment_name=ref"]))
    assert ours["private"] and ours["ledger"] == ref["ledger"] and ours["epsilon"] == ref["epsilon"]
    assert ours["metrics"] == ref["metrics"]  # same strategy, same seeds: the same noise
    with pytest.raises(Exception, match="toy_sign_sgd"):
        VARIANTS.check("toy_sign_sgd_unregistered")


def test_ime_releases_come_only_from_the_privatizer():
    """IME's variant never sees the clean gradient: its StepContext carries only private releases."""
    from dp_adam_bench.engine.privatizer import Privatizer
    from dp_adam_bench.optim.registry import build_variant
    from dp_adam_bench.privacy.mechanisms import IndependentMechanism

    for name in ("ime", "ime_free", "adagrad_ime", "adagrad_ime_free", "adam", "stp"):
        v = build_variant(name, lr=0.1)
        rel = v.releases()
        mechs = [IndependentMechanism().reset([(4,)], seed=s) for s in range(rel.streams)]
        priv = Privatizer(
            clip=1.0, sigma=1.0, expected_batch_size=2, mechanisms=mechs, releases=rel, keep_clean=True
        )
        out = priv.release_per_example([torch.randn(3, 4)])
        assert out.ctx.clean is None and out.clean is not None
        assert (out.ctx.noisy_square is not None) == name.endswith(("ime", "ime_free"))
    baseline = build_variant("noiseless_precond", lr=0.1)
    priv = Privatizer(
        clip=1.0,
        sigma=1.0,
        expected_batch_size=2,
        mechanisms=[IndependentMechanism().reset([(4,)], seed=0)],
        releases=baseline.releases(),
    )
    assert priv.release_per_example([torch.randn(3, 4)]).ctx.clean is not None  # non-private baseline only


def test_an_accountant_failing_never_loses_the_run(isolated_dirs, monkeypatch):
    # was: a sigma = 0.001 run trained, then PRV tried to allocate 4.73 TiB while the summary was written
    import json

    from dp_adam_bench.tasks import registry

    monkeypatch.setitem(registry.TASKS, "tiny", "tiny_task:TinyTask")
    extra = ("train.batch_size=8", "privacy.sigma=0.001", "train.eval_every=1")
    s = train(compose_cfg(tiny_poisson("tinysigma", 3, *extra)))
    assert "prv" in s["epsilon_errors"] and "rdp" in s["epsilon"]
    (folder,) = (isolated_dirs / "runs" / "tinysigma").iterdir()
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["epsilon_errors"]["prv"]


def test_a_second_launch_of_a_running_run_is_refused_naming_the_holder(isolated_dirs, capsys):
    # was: two copies of the same run wrote one folder (every metrics line twice, two W&B runs)
    import os

    from omegaconf import OmegaConf

    from dp_adam_bench import train as train_mod
    from dp_adam_bench.tracking.run_store import RunFolder, run_id

    cfg = compose_cfg(
        poisson_logistic(
            "task.n_train=100",
            "train.batch_size=10",
            "train.steps=5",
            "privacy.sigma=1.0",
            "experiment_name=locked",
        )
    )
    data = train_mod.run_config(cfg)
    holder = RunFolder.acquire(isolated_dirs / "runs", "locked", run_id(data))  # "the first launch"
    try:
        with pytest.raises(SystemExit) as exc:
            train_mod.main(OmegaConf.create(cfg))
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert f"pid {os.getpid()}" in err or str(os.getpid()) in err
        assert not (holder.path / "metrics.jsonl").exists()
    finally:
        holder.release()
    assert train(cfg)["steps"] == 5  # once the holder is gone, the run goes ahead
