"""train.lr_schedule: the factors against transformers' linear schedule, the run against torch's Adam driven by a
LambdaLR, exact resume mid-decay, the refusals, and run folders of constant-lr runs keeping their names."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

import dp_adam_bench as dab
from dp_adam_bench.config import validate
from dp_adam_bench.errors import ConfigError
from dp_adam_bench.optim.schedule import build_schedule
from dp_adam_bench.tasks import registry
from dp_adam_bench.tracking.run_store import identity_hash
from dp_adam_bench.train import train

from helpers import CE, ON_CPU, compose_cfg, tiny_data, tiny_model, tiny_poisson

BASE = tiny_poisson("sched", 8, "train.log_every=1")


def test_factors():
    assert [build_schedule("constant", 0, 4).factor(t) for t in range(1, 5)] == [1.0] * 4
    assert [build_schedule("linear", 0, 4).factor(t) for t in range(1, 5)] == [1.0, 0.75, 0.5, 0.25]
    warm = build_schedule("linear", 2, 6)
    assert [warm.factor(t) for t in range(1, 7)] == [0.5, 1.0, 1.0, 0.75, 0.5, 0.25]
    assert build_schedule(None, None, 3).name == "constant"


def test_decay_is_transformers_linear_schedule_shifted_by_one_step():
    """Update t uses what transformers' get_linear_schedule_with_warmup gives its update t - 1 (0-based), except
    during warm-up, where ours skips that scheduler's zero-lr first update."""
    from transformers import get_linear_schedule_with_warmup

    p = nn.Parameter(torch.zeros(1))
    for warmup, total in ((0, 7), (3, 10)):
        opt = torch.optim.SGD([p], lr=1.0)
        sched = get_linear_schedule_with_warmup(opt, warmup, total)
        theirs = []
        for _ in range(total + 1):
            theirs.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        ours = [build_schedule("linear", warmup, total).factor(t) for t in range(1, total + 1)]
        # update t: theirs at index t - 1, except that warm-up starts one update later (no lr-0 first step)
        expected = [theirs[t] if t <= warmup else theirs[t - 1] for t in range(1, total + 1)]
        assert ours == pytest.approx(expected)


def test_no_noise_linear_schedule_is_torch_adam_with_lambdalr():
    """noise='none' full-batch single-pass with linear decay == torch.optim.Adam stepped by a LambdaLR giving the
    same factors: the schedule scales the whole Adam step (lr / (1 - beta1^t)), as torch's does."""
    _, dataset = tiny_data()
    x, y = dataset.tensors
    ours = tiny_model()
    ref = copy.deepcopy(ours)
    private = dab.make_private(
        ours, dataset, CE, optimizer="adam", noise="none", lr=0.05, lr_schedule="linear", lr_warmup_steps=2,
        sampler="single_pass", batch_size=len(dataset), epochs=6,
    )  # fmt: skip
    factor = build_schedule("linear", 2, 6).factor
    opt = torch.optim.Adam(ref.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: factor(k + 1))
    for _ in range(6):
        private.step()
        opt.zero_grad()
        nn.functional.cross_entropy(ref(x), y).backward()
        opt.step()
        sched.step()
    for a, b in zip(ours.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # and the decay mattered: the constant-lr run ends elsewhere
    const = tiny_model()
    plain = dab.make_private(
        const, dataset, CE, optimizer="adam", noise="none", lr=0.05, sampler="single_pass",
        batch_size=len(dataset), epochs=6,
    )  # fmt: skip
    while not plain.done:
        plain.step()
    assert not torch.allclose(next(const.parameters()), next(ours.parameters()))


def test_resume_mid_decay_is_bit_identical_and_logs_the_lr(monkeypatch, isolated_dirs):
    monkeypatch.setitem(registry.TASKS, "tiny", "tiny_task:TinyTask")
    # bit-identical resume is a CPU promise; the constant-schedule run below is on the CPU too, so that the two differ
    # by their schedule alone
    extra = ["train.lr_schedule=linear", "train.lr_warmup_steps=2", "train.checkpoint_every=2", ON_CPU]
    full = train(compose_cfg([*BASE, *extra, "experiment_name=full"]))
    with pytest.raises(KeyboardInterrupt):
        train(compose_cfg([*BASE, *extra, "train.stop_after=5"]))
    (folder,) = [p for p in (isolated_dirs / "runs" / "sched").iterdir() if p.is_dir()]
    resumed = train(compose_cfg([*BASE, *extra]))
    assert resumed["final_params_sha1"] == full["final_params_sha1"]
    lrs = [json.loads(line)["lr"] for line in (folder / "metrics.jsonl").read_text().splitlines()]
    factor = build_schedule("linear", 2, 8).factor
    assert lrs == pytest.approx([0.01 * factor(t) for t in range(1, 9)])
    constant = train(compose_cfg([*BASE, "experiment_name=const", ON_CPU]))
    assert constant["final_params_sha1"] != full["final_params_sha1"]


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["train.lr_schedule=cosine"], r"train.lr_schedule='cosine'; valid: constant, linear"),
        (
            ["train.lr_schedule=linear", "train.lr_warmup_steps=-1"],
            r"train.lr_warmup_steps=-1 must be an integer",
        ),
        (
            ["train.lr_schedule=linear", "train.lr_warmup_steps=2.5"],
            r"train.lr_warmup_steps=2.5 must be an integer",
        ),
    ],
)
def test_bad_schedule_fields_are_refused_in_one_line(overrides, match):
    with pytest.raises(ConfigError, match=match):
        validate(compose_cfg([*BASE, *overrides]), custom_task=True)


def test_warmup_that_cannot_fit_is_refused_before_training():
    with pytest.raises(ConfigError, match=r"train.lr_warmup_steps=8 must be < the run's 8 planned steps"):
        build_schedule("linear", 8, 8)
    with pytest.raises(ConfigError, match=r"lr_warmup_steps=2 needs a schedule that warms up"):
        build_schedule("constant", 2, 8)
    for bad in (float("nan"), True, "2"):
        with pytest.raises(ConfigError, match="train.lr_warmup_steps"):
            build_schedule("linear", bad, 8)
    _, dataset = tiny_data()
    with pytest.raises(ConfigError, match="must be < the run's 3 planned steps"):
        dab.make_private(
            tiny_model(), dataset, CE, optimizer="adam", noise="none", lr=0.05, lr_schedule="linear",
            lr_warmup_steps=3, sampler="single_pass", batch_size=len(dataset), epochs=3,
        )  # fmt: skip


def test_constant_schedule_keeps_existing_run_names():
    """A run of the constant default has the identity it had before train.lr_schedule existed."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(compose_cfg(BASE), resolve=True)
    before = copy.deepcopy(cfg)
    del before["train"]["lr_schedule"], before["train"]["lr_warmup_steps"]
    assert identity_hash(cfg) == identity_hash(before)
    cfg["train"]["lr_schedule"] = "linear"
    assert identity_hash(cfg) != identity_hash(before)
