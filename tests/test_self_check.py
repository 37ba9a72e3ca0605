"""The engine's self-check on the user's own model (engine/self_check.py): it runs at the start of every model run,
records its error in the summary, stops a silently wrong engine before any noise is released, leaves the run's
results unchanged, and can be switched off (recorded)."""

import pytest
import torch

from dp_adam_bench import make_private
from dp_adam_bench.engine import fp32_exact
from dp_adam_bench.engine.bk import BKEngine
from dp_adam_bench.engine.self_check import self_check
from dp_adam_bench.errors import ConfigError
from dp_adam_bench.tasks import registry
from dp_adam_bench.train import train

from helpers import CE, compose_cfg, tiny_data, tiny_model, tiny_poisson
from small_models import fresh_model, loss_per_example, make_batch


@pytest.fixture
def tiny_task(monkeypatch):
    monkeypatch.setitem(registry.TASKS, "tiny", "tiny_task:TinyTask")


def _shrink_norms(monkeypatch, factor=0.8):
    """A planted engine defect: bk reports every norm ``factor`` times too small (and clips accordingly)."""
    real = BKEngine._clipped_sum

    def wrong(self, batch, clip, scale):
        out = real(self, batch, clip, scale)
        out.norms = out.norms * factor
        return out

    monkeypatch.setattr(BKEngine, "_clipped_sum", wrong)


def _swap_norms(monkeypatch):
    """A planted defect only a comparison example by example sees: bk reports each example's norm as its
    neighbour's (the sums, and one example on its own, are right: the engine probe passes it)."""
    real = BKEngine._clipped_sum

    def wrong(self, batch, clip, scale):
        out = real(self, batch, clip, scale)
        out.norms = out.norms.roll(1)
        return out

    monkeypatch.setattr(BKEngine, "_clipped_sum", wrong)


@pytest.mark.parametrize("engine", ["bk", "functorch", "hooks", "ghost"])
def test_an_exact_engine_passes_and_the_model_is_left_as_it_was(engine):
    from dp_adam_bench.engine.engines import build_engine

    model = fresh_model()
    model.train()
    eng = build_engine(engine, model, loss_per_example)
    rng = torch.get_rng_state()
    record = self_check(eng, make_batch(), 0.5)
    eng.close()
    assert record["enabled"] and record["examples"] == 6
    assert record["max_rel_error"] < 1e-5 and record["seconds"] > 0
    assert model.training  # back in the mode it was in
    assert torch.equal(torch.get_rng_state(), rng)  # the run's random stream is untouched
    assert all(p.grad is None for p in model.parameters())


def test_a_wrong_engine_is_stopped_naming_the_error(monkeypatch):
    _shrink_norms(monkeypatch)
    eng = BKEngine(fresh_model(), loss_per_example)
    with pytest.raises(ConfigError, match=r"self-check: train\.clipping=bk .* by 0\.2 .*tolerance 0\.01"):
        self_check(eng, make_batch(), 0.5)


def test_make_private_stops_before_any_noise_and_records_the_check(monkeypatch):
    task, data = tiny_data()
    kw = dict(optimizer="adam", sigma=1.0, clip=0.5, batch_size=16, steps=2, lr=0.01)
    private = make_private(tiny_model(), data, CE, **kw)
    assert private.self_check["enabled"] and private.self_check["max_rel_error"] < 1e-5
    assert private.steps_done == 0

    _swap_norms(monkeypatch)
    with pytest.raises(ConfigError, match="self-check: .* stopped before any noise was released"):
        make_private(tiny_model(), data, CE, **kw)
    skipped = make_private(tiny_model(), data, CE, self_check=False, **kw)
    assert skipped.self_check == {"enabled": False}
    with pytest.raises(ConfigError, match="self_check='yes' must be True or False"):
        make_private(tiny_model(), data, CE, self_check="yes", **kw)


def test_cli_runs_record_the_check_and_it_changes_no_result(isolated_dirs, tiny_task):
    base = tiny_poisson("self_check", 3)
    checked = train(compose_cfg(base))
    assert checked["self_check"]["enabled"] and checked["self_check"]["max_rel_error"] < 1e-5
    assert checked["self_check"]["examples"] == 4
    off = train(compose_cfg([*base, "train.self_check.enabled=false", "train.force=true"]))
    assert off["self_check"] == {"enabled": False}
    assert off["final_params_sha1"] == checked["final_params_sha1"]  # same run, same result
    # the engine probe runs whether the self-check does or not; the summary records the fp32 math settings
    for summary in (checked, off):
        assert summary["engine_probe"]["examples"] == 1 and summary["engine_probe"]["max_rel_error"] < 1e-5
        assert summary["fp32_math"] == fp32_exact.settings() and summary["fp32_math"]["clipping"].startswith(
            "ieee"
        )
    with pytest.raises(ConfigError, match=r"train\.self_check\.tolerance=nan must be a finite number > 0"):
        train(compose_cfg([*base, "train.self_check.tolerance=nan"]))


def test_cli_run_with_a_wrong_engine_stops_before_its_run_folder(isolated_dirs, tiny_task, monkeypatch):
    _swap_norms(monkeypatch)
    with pytest.raises(ConfigError, match="self-check"):
        train(compose_cfg(tiny_poisson("self_check_wrong", 3)))
    runs = isolated_dirs / "runs" / "self_check_wrong"
    assert not runs.exists() or not any(runs.iterdir())  # refused like a bad config: no run folder


def test_an_engine_refusal_met_in_the_forward_is_one_config_error():
    """ghost refuses a Linear on a 4-D input only when it sees one: during the self-check, as a ConfigError (one
    line on the command line), before any run folder or noise."""
    from torch import nn

    from dp_adam_bench.engine.engines import build_engine

    model = nn.Linear(3, 2)
    eng = build_engine("ghost", model, lambda forward, batch: forward(batch["x"]).sum((1, 2, 3)))
    with pytest.raises(ConfigError, match=r"train\.clipping=ghost: Linear '<root>' got a 4-D input"):
        self_check(eng, {"x": torch.randn(2, 4, 5, 3)}, 1.0)
    eng.close()


def _count_checks(monkeypatch) -> list:
    """Every run of the start-up check on the model as built (the comparison itself, not its record) appends to
    the returned list; the engine watch's checks of the trained weights (resume, checkpoints: engine/watch.py) do
    not."""
    from dp_adam_bench.engine import backends
    from dp_adam_bench.engine.watch import EngineWatch

    calls, real, real_check = [], backends.self_check, EngineWatch.check
    reason = []

    def counted(*args, **kwargs):
        if reason and reason[-1] == "start":
            calls.append(1)
        return real(*args, **kwargs)

    def watched(self, step, why):
        reason.append(why)
        return real_check(self, step, why)

    monkeypatch.setattr(backends, "self_check", counted)
    monkeypatch.setattr(EngineWatch, "check", watched)
    return calls


def test_a_resumed_run_carries_over_the_check_its_first_attempt_passed(isolated_dirs, tiny_task, monkeypatch):
    """The check compares the engine with the loop on the model as built, before any step: a resume would compute
    the same numbers. The checkpoint records the passed check; the resume takes that record, marked as carried
    over, and does not run the check again."""
    calls = _count_checks(monkeypatch)
    base = tiny_poisson("self_check_resume", 4, "train.checkpoint_every=1")
    with pytest.raises(KeyboardInterrupt):
        train(compose_cfg([*base, "train.stop_after=2"]))
    assert len(calls) == 1
    resumed = train(compose_cfg(base))
    assert len(calls) == 1  # not run again on resume
    check = resumed["self_check"]
    assert check["carried_over"]["checkpoint_step"] == 2
    assert "not run again" in check["carried_over"]["note"]
    # the record is the one the check computes on this run: a fresh run of the same config gets the same numbers
    fresh = train(compose_cfg([*base, "experiment_name=self_check_fresh"]))
    assert len(calls) == 2 and "carried_over" not in fresh["self_check"]
    same = ("enabled", "examples", "max_rel_error", "norm_rel_error", "sum_rel_error", "tolerance")
    assert {k: check[k] for k in same} == {k: fresh["self_check"][k] for k in same}
    # the engine probe, run before the check in the first attempt, is carried over with it
    assert resumed["engine_probe"]["carried_over"]["checkpoint_step"] == 2
    assert resumed["engine_probe"]["max_rel_error"] == fresh["engine_probe"]["max_rel_error"]
    assert "carried_over" not in fresh["engine_probe"]
    assert resumed["final_params_sha1"] == fresh["final_params_sha1"]


def test_a_resume_under_other_check_settings_runs_the_check(isolated_dirs, tiny_task, monkeypatch):
    calls = _count_checks(monkeypatch)
    base = tiny_poisson("self_check_other", 4, "train.checkpoint_every=1")
    with pytest.raises(KeyboardInterrupt):
        train(compose_cfg([*base, "train.stop_after=2"]))
    resumed = train(compose_cfg([*base, "train.self_check.tolerance=0.02"]))
    assert len(calls) == 2
    assert "carried_over" not in resumed["self_check"] and resumed["self_check"]["tolerance"] == 0.02
    # a checkpoint whose key differs in the code (an edit between the kill and the resume) is not trusted either
    with pytest.raises(KeyboardInterrupt):
        train(compose_cfg([*base, "experiment_name=self_check_code", "train.stop_after=2"]))
    from dp_adam_bench.engine import self_check as module

    monkeypatch.setattr(module, "source_digest", lambda: "edited")
    resumed = train(compose_cfg([*base, "experiment_name=self_check_code"]))
    assert len(calls) == 4 and "carried_over" not in resumed["self_check"]


USER_TASK = """
import torch
from torch import nn

from tiny_task import TinyTask


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 2)

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        {edit}
        return self.fc2(h)


class UserTask(TinyTask):
    def build_model(self):
        return Net()
"""


def test_a_resume_after_the_models_code_changed_runs_the_check_again(isolated_dirs, tmp_path, monkeypatch):
    """Issue 32's reproduction: a task defined outside the package trains 2 steps and is killed; its forward is
    then changed to mix the examples of a batch. The carry key holds the source of every class the model and the
    task are made of (engine/self_check.py model_digest), so the resume runs the check again, which refuses."""
    import sys

    from dp_adam_bench.engine.self_check import carry_key

    calls = _count_checks(monkeypatch)
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = tmp_path / "user_task_32.py"

    def define(edit: str):
        module.write_text(USER_TASK.replace("{edit}", edit))
        sys.modules.pop("user_task_32", None)
        monkeypatch.setitem(registry.TASKS, "tiny", "user_task_32:UserTask")

    define("pass")
    base = tiny_poisson("self_check_user_code", 4, "train.checkpoint_every=1")
    with pytest.raises(KeyboardInterrupt):
        train(compose_cfg([*base, "train.stop_after=2"]))
    assert len(calls) == 1
    define("h = h - 3 * h.mean(0)")
    with pytest.raises(ConfigError, match=r"self-check: train\.clipping=bk .* by 0\.[1-9]\d* .*\(relative"):
        train(compose_cfg(base))
    assert len(calls) == 2
    # the key names the versions of what defines the computation beyond the package; a class without readable
    # source (built by exec) gives no key: nothing is carried over, the check runs on every attempt
    key = carry_key("run", {}, "bk", "cpu", nn_linear := torch.nn.Linear(2, 2))
    assert {"torch", "transformers", "opacus", "model_sha1"} <= set(key)
    scope: dict = {}
    exec("import torch\nclass Anon(torch.nn.Linear):\n    pass\n", scope)
    assert carry_key("run", {}, "bk", "cpu", scope["Anon"](2, 2)) is None
    assert carry_key("run", {}, "bk", "cpu", nn_linear) == key
