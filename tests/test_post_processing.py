"""The post-processing check (dp_adam_bench/engine/post_processing.py): an honest step comes out bit-identical with
and without the check, for every kind of variant, fine-tuning method and trainer; a private quantity that leaves a
step outside the noise (a variant's or a method's state, a model buffer, a logged statistic) stops the run naming
the field."""

from __future__ import annotations

import pytest
import torch
import transformers
from test_finetune import Tokens, lm_loss, tiny_gpt2
from torch import nn

import dp_adam_bench as dab
from dp_adam_bench.engine.post_processing import PostProcessingLeak, first_difference
from dp_adam_bench.finetune import rgp

from helpers import CE, tiny_data, tiny_model


def run(model, data, loss, *, check, steps=4, **kw):
    kw = {"optimizer": "adam", "sigma": 1.0, "batch_size": 16, "lr": 0.01, "self_check": False} | kw
    length = {} if "epochs" in kw else {"steps": steps}
    private = dab.make_private(model, data, loss, post_processing_check=check, **length, **kw)
    while not private.done:
        private.step()
    return private


def tensors(model) -> list[torch.Tensor]:
    return [t.detach().clone() for t in model.state_dict().values()]


def bit_identical(a, b) -> bool:
    return len(a) == len(b) and all(
        x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize(
    "kw",
    [
        {"optimizer": "sgd", "lr": 0.1},
        {"optimizer": "adam"},
        {"optimizer": "adambc"},
        {
            "optimizer": "ime",
            "sampler": "single_pass",
            "epochs": 1,
        },  # a second release (g^2), its own noise stream
        {"optimizer": "stp"},  # scale-then-privatize: the scale reaches clipping
        {"optimizer": "adam", "noise": "bandmf", "noise_args": {"bands": 2}, "sampler": "cyclic_poisson"},
    ],
    ids=lambda kw: "-".join(str(v) for v in kw.values() if not isinstance(v, dict)),
)
def test_an_honest_step_is_the_same_with_and_without_the_check(kw):
    """The check replays every step (every=1) in two worlds and keeps the real one: the run is bit-identical to an
    unchecked one, so a check that passes changes nothing."""
    _, data = tiny_data()
    plain = tensors(run(tiny_model(0), data, CE, check="off", **kw).model)
    private = run(tiny_model(0), data, CE, check=1, **kw)
    assert bit_identical(plain, tensors(private.model))
    record = private.post_check.describe()
    assert record["checks"] == 4 and record["failed"] is None and record["fields_compared"] > 4


@pytest.mark.parametrize("method", [None, "lora", "prefix", "top1", "head", "rgp"])
def test_every_fine_tuning_method_passes_and_is_unchanged(method):
    plain = run(tiny_gpt2(), Tokens(), lm_loss, check="off", finetune=method, lr=1e-3)
    checked = run(tiny_gpt2(), Tokens(), lm_loss, check=1, finetune=method, lr=1e-3)
    assert bit_identical(tensors(plain.model), tensors(checked.model))
    assert checked.post_check.describe()["failed"] is None


# --- planted leaks: each a private quantity written into something the step emits ------------------------------------
def test_a_variant_state_fed_by_the_per_example_norms_is_caught(monkeypatch):
    """An Adam whose state keeps the batch's mean gradient norm (as a 'gradient norm' EMA, say)."""
    from dp_adam_bench.optim.adam import Adam

    _, data = tiny_data()
    private = dab.make_private(
        tiny_model(0), data, CE, optimizer="adam", sigma=1.0, batch_size=16, steps=4, lr=0.01,
        post_processing_check=0,
    )  # fmt: skip
    update = Adam.update

    def leaky(self, params, state, ctx):
        update(self, params, state, ctx)
        state["norm_ema"] = private.backend.last_norms.mean()

    monkeypatch.setattr(Adam, "update", leaky)
    with pytest.raises(PostProcessingLeak, match=r"step 1: variant state\['norm_ema'\] differs"):
        private.step()


def test_rgp_carriers_from_the_clean_gradient_are_caught(monkeypatch):
    """The planted kind of the review: RGP's power iteration fed from the clipped, un-noised gradient (here the
    engine's clipped sum, kept by a privatizer that remembers it) instead of the historical noisy update."""
    from dp_adam_bench.engine.privatizer import Privatizer

    kept = {}
    release_sum = Privatizer.release_sum

    def remembering(self, summed, scale=None):
        kept["clean"] = [s.clone() for s in summed]
        return release_sum(self, summed, scale)

    decompose = rgp.decompose

    def from_clean(delta, rank, iters, start):
        if "clean" not in kept:  # reparametrize's first decomposition, before any step
            return decompose(delta, rank, iters, start)
        return decompose(delta + kept["clean"][0].flatten()[0] * torch.ones_like(delta), rank, iters, start)

    monkeypatch.setattr(Privatizer, "release_sum", remembering)
    monkeypatch.setattr(rgp, "decompose", from_clean)
    with pytest.raises(PostProcessingLeak, match=r"carrier|residual|variant state"):
        run(tiny_gpt2(), Tokens(), lm_loss, check="auto", finetune="rgp", lr=1e-3, steps=2)


class _RunningMean(nn.Module):
    """A layer that keeps a running mean of its inputs in a buffer, as BatchNorm does: a statistic of the private
    batch written into the model outside the noise."""

    def __init__(self, d: int):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.register_buffer("mean", torch.zeros(d))

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.mean.mul_(0.9).add_(0.1 * x.mean(0))
        return self.lin(x)


def test_a_buffer_written_from_the_batch_is_caught():
    _, data = tiny_data()
    torch.manual_seed(0)
    model = nn.Sequential(_RunningMean(6), nn.Tanh(), nn.Linear(6, 2))
    with pytest.raises(PostProcessingLeak, match=r"model 0\.mean differs"):
        run(model, data, CE, check="auto", steps=2)


def test_a_statistic_in_the_logged_row_is_caught_and_a_diagnostic_is_not():
    _, data = tiny_data()
    private = dab.make_private(
        tiny_model(0), data, CE, sigma=1.0, batch_size=16, steps=3, lr=0.01, post_processing_check=1,
    )  # fmt: skip
    private.add_emitter("log", lambda r: {"lr": private.variant.lr, "diag/frac_clipped": r.frac_clipped})
    for _ in range(3):
        private.step()  # a labelled diagnostic is excluded by name
    private = dab.make_private(
        tiny_model(0), data, CE, sigma=1.0, batch_size=16, steps=3, lr=0.01, post_processing_check=1,
    )  # fmt: skip
    private.add_emitter("log", lambda r: {"lr": private.variant.lr, "mean_norm": float(r.norms.mean())})
    with pytest.raises(PostProcessingLeak, match=r"log 'mean_norm' differs"):
        private.step()


def test_the_first_step_after_a_resume_is_checked():
    _, data = tiny_data()

    def make():
        return dab.make_private(
            tiny_model(0), data, CE, sigma=1.0, batch_size=16, steps=6, lr=0.01, post_processing_check=0
        )

    first = make()
    for _ in range(3):
        first.step()
    again = make()
    again.load_state_dict(first.state_dict())
    again.step()
    checks = again.post_check.describe()
    assert checks["checks"] == 2 and checks["at_steps"] == [4]  # one at the start of the first run, one here


def test_a_non_private_run_has_no_check():
    _, data = tiny_data()
    private = dab.make_private(
        tiny_model(0), data, CE, noise="none", clip=None, batch_size=16, steps=2, lr=0.01
    )
    assert private.post_check is None


def test_bad_settings_are_one_line():
    _, data = tiny_data()
    with pytest.raises(dab.ConfigError, match=r"post_processing_check='sometimes' must be 'auto', 'off' or"):
        dab.make_private(
            tiny_model(0), data, CE, sigma=1.0, batch_size=16, steps=2, post_processing_check="sometimes"
        )


def test_the_comparison_is_on_bits():
    a = {"x": torch.tensor([0.0, float("nan")]), "n": 1.0}
    assert first_difference(a, {"x": torch.tensor([0.0, float("nan")]), "n": 1.0}) is None
    assert first_difference(a, {"x": torch.tensor([-0.0, float("nan")]), "n": 1.0}) == "x"
    assert first_difference(a, {"x": a["x"], "n": 1.0 + 1e-16}) is None  # the same double
    assert first_difference(a, {"x": a["x"], "n": 1.0000001}) == "n"
    assert first_difference(a, {"x": a["x"]}) == "n (emitted in one world only)"


# --- the Hugging Face Trainer ----------------------------------------------------------------------------------------
def test_dptrainer_refuses_a_logged_statistic_of_the_batch(tmp_path, monkeypatch):
    """The planted kind of the review: a statistic of the private batch added to what the Trainer logs."""
    from test_hf_trainer import QUICK, token_rows, training_args

    from dp_adam_bench.hf_trainer import DPTrainer, PrivacyArguments

    trainer = DPTrainer(
        model=gpt2_tiny(), args=training_args(tmp_path, max_steps=3), train_dataset=token_rows(32),
        privacy=PrivacyArguments(sigma=1.0, **QUICK),
    )  # fmt: skip
    log = DPTrainer._log_save_evaluate

    def leaky(self, private, ignore, start):
        if self.control.should_log:
            self.log({"clip_fraction": self.last_step.frac_clipped})
        log(self, private, ignore, start)

    monkeypatch.setattr(DPTrainer, "_log_save_evaluate", leaky)
    with pytest.raises(PostProcessingLeak, match=r"'clip_fraction' at step \d+ is not a released quantity"):
        trainer.train()


def gpt2_tiny():
    from test_hf_trainer import gpt2

    return gpt2()


def test_dptrainer_logs_are_unchanged_by_the_check(tmp_path):
    from test_hf_trainer import QUICK, token_rows, training_args

    from dp_adam_bench.hf_trainer import DPTrainer, PrivacyArguments

    out = {}
    for check in ("off", "1"):
        trainer = DPTrainer(
            model=gpt2_tiny(), args=training_args(tmp_path / check, max_steps=3), train_dataset=token_rows(32),
            privacy=PrivacyArguments(sigma=1.0, post_processing_check=check, **QUICK),
        )  # fmt: skip
        trainer.train()
        out[check] = tensors(trainer.model)
    assert bit_identical(out["off"], out["1"])


assert transformers  # the Trainer tests need it installed (the dev extra)
