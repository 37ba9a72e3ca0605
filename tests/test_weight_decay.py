"""Weight decay (issue 35): coupled and decoupled decay against torch's optimizers bit for bit at sigma = 0 without
clipping, under a learning-rate schedule and a mask; DP-AdamW-BC against its formula on noisy releases; the
Hugging Face mask; one-line refusals; the command line, the API and the meter's replay with decay on."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dp_adam_bench.engine.privatizer import Privatizer
from dp_adam_bench.errors import ConfigError
from dp_adam_bench.optim.decay import decay_mask, no_decay_names
from dp_adam_bench.optim.registry import build_variant
from dp_adam_bench.optim.schedule import LRSchedule
from dp_adam_bench.privacy.mechanisms import IndependentMechanism
from dp_adam_bench.tasks import registry

from helpers import compose_cfg

D, B, STEPS, LAMBDA = 6, 5, 20, 0.3
SCHEDULE = LRSchedule("linear", STEPS, 4)


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(STEPS, B, D, generator=g, dtype=torch.float64), torch.randn(
        STEPS, B, generator=g
    ).double()


def _grads(w, b, x, y):  # least squares with a bias: per-example gradients of 0.5 (x.w + b - y)^2
    r = x @ w + b - y
    return [r[:, None] * x, r[:, None]]


def _init():
    return torch.linspace(-1, 1, D, dtype=torch.float64), torch.full((1,), 0.7, dtype=torch.float64)


def run_ours(name, mask=None, sigma=0.0, clip=None, mechanisms=None, record=None, **hp):
    x, y = _data()
    variant = build_variant(name, **hp)
    variant.decay_mask = mask
    params = list(_init())
    state = variant.init(params)
    priv = Privatizer(
        clip=clip,
        sigma=sigma,
        expected_batch_size=B,
        mechanisms=mechanisms or [],
        releases=variant.releases(),
    )
    base = variant.lr
    for t in range(1, STEPS + 1):
        ctx = priv.release_per_example(_grads(*params, x[t - 1], y[t - 1]), None).ctx
        if record is not None:
            record.append((ctx, [p.clone() for p in params]))
        variant.lr = base * SCHEDULE.factor(t)  # as the session does
        variant.update(params, state, ctx)
    return params


def run_torch(make_opt, decays=(True, True)):
    x, y = _data()
    w, b = (p.requires_grad_(True) for p in _init())
    opt = make_opt(
        [{"params": [p]} | ({} if d else {"weight_decay": 0.0}) for p, d in zip((w, b), decays, strict=True)]
    )
    base = opt.param_groups[0]["lr"]
    for t in range(1, STEPS + 1):
        opt.zero_grad()
        w.grad, b.grad = (g.sum(0) / B for g in _grads(w.detach(), b.detach(), x[t - 1], y[t - 1]))
        for group in opt.param_groups:
            group["lr"] = base * SCHEDULE.factor(t)
        opt.step()
    return [w.detach(), b.detach()]


TORCH_CASES = [
    ("adamw", {}, lambda g: torch.optim.AdamW(g, lr=0.05, weight_decay=LAMBDA, foreach=False)),
    (
        "adam",
        {"weight_decay_mode": "coupled"},
        lambda g: torch.optim.Adam(g, lr=0.05, weight_decay=LAMBDA, foreach=False),
    ),
    (
        "sgd",
        {"momentum": 0.9},
        lambda g: torch.optim.SGD(g, lr=0.05, momentum=0.9, weight_decay=LAMBDA, foreach=False),
    ),
    ("adagrad_pp", {}, lambda g: torch.optim.Adagrad(g, lr=0.05, weight_decay=LAMBDA, foreach=False)),
]


@pytest.mark.parametrize("name, hp, make", TORCH_CASES, ids=[c[0] for c in TORCH_CASES])
@pytest.mark.parametrize("mask", [None, [True, False]], ids=["all", "no_bias"])
def test_sigma_zero_equals_torch_bit_for_bit_with_schedule_and_mask(name, hp, make, mask):
    ours = run_ours(name, mask=mask, lr=0.05, weight_decay=LAMBDA, **hp)
    want = run_torch(make, decays=mask or (True, True))
    for a, b in zip(ours, want, strict=True):
        assert torch.equal(a, b), (name, a - b)
    # the decay is on: without it the trajectory differs (the comparison above can fail)
    assert not torch.equal(run_ours(name, mask=mask, lr=0.05, weight_decay=0.0, **hp)[0], ours[0])


def test_decoupled_sgd_shrinks_before_the_step():
    """SGDW without momentum: (1 - eta lambda) theta - eta g, the same as L2 decay up to rounding."""
    coupled = run_ours("sgd", lr=0.05, weight_decay=LAMBDA)
    decoupled = run_ours("sgd", lr=0.05, weight_decay=LAMBDA, weight_decay_mode="decoupled")
    for a, b in zip(coupled, decoupled, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_adamw_bc_is_decay_then_tang_denominator_on_noisy_releases():
    """DP-AdamW-BC with sigma = 1, clipping and a schedule, against the formula written out here from the releases:
    theta <- (1 - eta_t lambda) theta - eta_t m^ / sqrt(max(v^ - Phi, gamma')), Phi = (sigma C / B)^2."""
    sigma, clip, gamma, lr, b1, b2 = 1.0, 0.5, 1e-8, 0.02, 0.9, 0.999
    mech = [IndependentMechanism().reset([(D,), (1,)], seed=5, dtype=torch.float64)]
    record = []
    got = run_ours(
        "adamw_bc",
        mask=[True, False],
        sigma=sigma,
        clip=clip,
        mechanisms=mech,
        record=record,
        lr=lr,
        weight_decay=LAMBDA,
        gamma=gamma,
    )
    phi = (sigma * clip / B) ** 2
    params = list(_init())
    m, v = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    for t, (ctx, before) in enumerate(record, start=1):
        for p, q in zip(params, before, strict=True):
            torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)
        assert ctx.noise_variance == pytest.approx(phi)
        eta = lr * SCHEDULE.factor(t)
        for i, g in enumerate(ctx.noisy):
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            m_hat, v_hat = m[i] / (1 - b1**t), v[i] / (1 - b2**t)
            decay = 1 - eta * LAMBDA if i == 0 else 1.0
            params[i] = decay * params[i] - eta * m_hat / (v_hat - phi).clamp(min=gamma).sqrt()
    for a, b in zip(got, params, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


class _CustomNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return x * self.weight


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 4)
        self.ln = nn.LayerNorm(4)
        self.gn = nn.GroupNorm(2, 4)
        self.final_norm = _CustomNorm()  # a norm HF knows by name only
        self.emb = nn.Embedding(5, 4)
        self.head = nn.Linear(4, 2, bias=False)


def test_mask_excludes_biases_and_norms_as_hugging_face_does():
    net = _Net()
    params = list(net.parameters())
    names = [n for n, _ in net.named_parameters()]
    assert no_decay_names(net) == {
        "lin.bias",
        "ln.weight",
        "ln.bias",
        "gn.weight",
        "gn.bias",
        "final_norm.weight",
    }
    mask = decay_mask(net, params, "bias_and_norm")
    assert [n for n, d in zip(names, mask, strict=True) if d] == ["lin.weight", "emb.weight", "head.weight"]
    assert decay_mask(net, params, "none") == [True] * len(params)


def _tiny(experiment, *extra):
    return [
        "task.name=tiny",
        f"experiment_name={experiment}",
        "noise=independent",
        "privacy.sigma=1.0",
        "privacy.clip=1.0",
        "train.sampler=single_pass",
        "train.batch_size=16",
        "train.epochs=1",
        "logger.wandb.mode=disabled",
        *extra,
    ]


@pytest.fixture
def tiny_task(monkeypatch):
    monkeypatch.setitem(registry.TASKS, "tiny", "tiny_task:TinyTask")


BAD = [
    (
        ["optimizer=adam", "optimizer.weight_decay=-0.1"],
        "optimizer.weight_decay=-0.1 must be a finite number >= 0",
    ),
    (["optimizer=adamw", "optimizer.weight_decay=nan"], "optimizer.weight_decay=nan must be a finite number"),
    (["optimizer=sgd", "optimizer.weight_decay=inf"], "optimizer.weight_decay=inf must be a finite number"),
    (
        ["optimizer=adam", "optimizer.weight_decay_mode=l2"],
        "optimizer.weight_decay_mode='l2'; valid: coupled",
    ),
    (["optimizer=adamw", "optimizer.decay_exclude=biases"], "optimizer.decay_exclude='biases'; valid"),
    (["optimizer=adamw", "optimizer.weight_decay_mode=coupled"], "adamw decays decoupled by definition"),
    (["optimizer=ime", "optimizer.weight_decay=0.1"], "set optimizer.weight_decay_mode=decoupled"),
]


@pytest.mark.parametrize("overrides, expected", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_weight_decay_is_one_line(isolated_dirs, tiny_task, overrides, expected):
    from dp_adam_bench.train import train

    with pytest.raises(ConfigError) as err:
        train(compose_cfg(_tiny("wd_bad", *overrides)))
    assert expected in str(err.value) and len(str(err.value).splitlines()) == 1, str(err.value)


def test_cli_runs_adamw_and_names_runs_as_before(isolated_dirs, tiny_task, monkeypatch):
    import json

    import yaml

    from dp_adam_bench import train as train_mod
    from dp_adam_bench.tracking.run_store import run_id

    monkeypatch.chdir(isolated_dirs)
    overrides = _tiny("wd_cli", "optimizer=adamw", "optimizer.weight_decay=0.05", "train.lr_schedule=linear")
    monkeypatch.setattr("sys.argv", ["dp_adam_bench.train", *overrides])
    train_mod.cli()
    (summary,) = (isolated_dirs / "runs" / "wd_cli").glob("*/summary.json")
    config = yaml.safe_load((summary.parent / "config.yaml").read_text())
    assert json.loads(summary.read_text())["status"] == "complete"
    assert config["optimizer"]["name"] == "adamw" and config["optimizer"]["weight_decay"] == 0.05, config
    # the new fields at the values that decay nothing leave an existing run's id as it was
    cfg = {"optimizer": {"name": "adam", "lr": 0.001}, "seed": 0}
    same = {
        "optimizer": {
            **cfg["optimizer"],
            "weight_decay": 0.0,
            "weight_decay_mode": "coupled",
            "decay_exclude": "bias_and_norm",
        },
        "seed": 0,
    }
    assert run_id(same) == run_id(cfg)
    assert run_id({**same, "optimizer": {**same["optimizer"], "weight_decay": 0.1}}) != run_id(cfg)


def _api_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 3))


def _api_data():
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(32, 4, generator=g), torch.randint(0, 3, (32,), generator=g)
    return [(x[i], y[i]) for i in range(32)], x, y


@pytest.mark.parametrize("custom_mask", [False, True], ids=["default_mask", "all_decay"])
def test_api_adamw_equals_torch_adamw_with_hugging_face_groups(custom_mask):
    """make_private(optimizer="adamw", noise="none", full batches) against torch.optim.AdamW on the mean loss, with
    biases and the LayerNorm left out of the decay (the default), or everything decaying (a user's mask)."""
    from dp_adam_bench.api import make_private

    data, x, y = _api_data()
    model = _api_model()
    mask = (lambda name, p: True) if custom_mask else None
    private = make_private(
        model,
        data,
        nn.CrossEntropyLoss(reduction="none"),
        optimizer="adamw",
        noise="none",
        clip=None,
        batch_size=32,
        epochs=5,
        lr=0.05,
        weight_decay=0.5,
        weight_decay_mask=mask,
        lr_schedule="linear",
        self_check=False,
    )
    while not private.done:
        private.step()
    ref = _api_model()
    decay = [
        p
        for n, p in ref.named_parameters()
        if custom_mask or (n.endswith("weight") and not n.startswith("1."))
    ]
    rest = [p for p in ref.parameters() if all(p is not q for q in decay)]
    opt = torch.optim.AdamW(
        [{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=0.05, weight_decay=0.5
    )
    schedule = LRSchedule("linear", 5, 0)
    for t in range(1, 6):
        for group in opt.param_groups:
            group["lr"] = 0.05 * schedule.factor(t)
        opt.zero_grad()
        nn.functional.cross_entropy(ref(x), y).backward()
        opt.step()
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"weight_decay": -1}, r"^weight_decay=-1 must be a finite number >= 0$"),
        ({"weight_decay_mask": 3}, "weight_decay_mask=3 must be a callable"),
    ],
)
def test_api_refuses_bad_weight_decay_in_its_own_terms(bad, match):
    from dp_adam_bench.api import make_private

    data, _, _ = _api_data()
    loss = nn.CrossEntropyLoss(reduction="none")
    with pytest.raises(ConfigError, match=match):
        make_private(_api_model(), data, loss, optimizer="adam", sigma=1.0, batch_size=8, steps=2, **bad)


@pytest.mark.parametrize("variant", ["adamw", "adamw_bc"])
def test_meter_replays_a_decayed_run_from_its_releases(variant):
    """Weight decay is post-processing: the meter's replay of the registered variant on the releases alone
    reproduces the parameters of the run, decay included (vector path: every tensor decays)."""
    from omegaconf import OmegaConf

    from dp_adam_bench.audit import meter
    from dp_adam_bench.audit.whitebox import compose_config
    from dp_adam_bench.report import privacy_audit

    cfg = compose_config(
        [*privacy_audit.overrides(variant, "independent", "poisson", 150), "optimizer.weight_decay=0.5"]
    )
    OmegaConf.update(cfg, "optimizer.lr", 0.05)
    r = meter.meter_config(cfg, n=150, trials=2)
    check = r.check("post_processing")
    assert check.passed and check.estimate <= 1e-12, r.describe()


def test_model_path_meter_replays_adamw_with_its_bias_left_alone(monkeypatch):
    """Through a real engine on a model with a bias: the replay needs the run's mask (the bias does not decay);
    replayed with every tensor decaying, it would not reproduce the run."""
    from dp_adam_bench.audit import meter
    from dp_adam_bench.audit.whitebox import compose_config
    from dp_adam_bench.report import privacy_audit

    over = [*privacy_audit.overrides("adamw", "independent", "poisson", 150), "optimizer.weight_decay=0.5"]
    r = meter.meter_model(compose_config(over), "bk", n=150)
    assert r.check("post_processing").passed, r.describe()
    from dp_adam_bench.audit.meter import runners

    original = runners.replay_lists  # patched where meter_model calls it
    monkeypatch.setattr(runners, "replay_lists", lambda *a: original(*a[:5], None))
    assert not meter.meter_model(compose_config(over), "bk", n=150).check("post_processing").passed
