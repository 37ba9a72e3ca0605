"""The public API (dp_adam_bench.make_private): the same run as the CLI trainer, plain torch optimizers without noise
or clipping, exact resume from state_dict, the CLI's refusals, and the examples/ scripts."""

from __future__ import annotations

import copy
import hashlib
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import dp_adam_bench as dab
from dp_adam_bench.tasks import registry

from helpers import CE, ON_CPU, compose_cfg, tiny_data, tiny_model, tiny_poisson

REPO = Path(__file__).resolve().parents[1]


def digest(params) -> str:
    h = hashlib.sha1()
    for p in params:
        h.update(p.detach().cpu().numpy().tobytes())
    return h.hexdigest()


def test_make_private_is_the_cli_run(monkeypatch, isolated_dirs):
    """Same config through the API and through `python -m dp_adam_bench.train`: identical parameters and epsilon."""
    from dp_adam_bench.train import train

    monkeypatch.setitem(registry.TASKS, "tiny", "tiny_task:TinyTask")
    # the API trains the model where it is (the CPU here); the CLI's train.device=auto would take a GPU when there is
    # one, whose noise generator draws other numbers: both on the CPU, the parameters must be bit-identical
    summary = train(compose_cfg(tiny_poisson("api_vs_cli", 6, ON_CPU)))
    _, dataset = tiny_data()
    model = tiny_model()
    private = dab.make_private(
        model, dataset, CE, optimizer="adam", lr=0.01, noise="independent", sigma=1.0, clip=0.5,
        batch_size=16, steps=6, physical_batch_size=5,
    )  # fmt: skip
    while not private.done:
        private.step()
    assert digest(model.parameters()) == summary["final_params_sha1"]
    eps = private.epsilon()
    assert set(eps) == set(summary["epsilon"])
    for k, v in eps.items():
        assert v == pytest.approx(summary["epsilon"][k], rel=1e-9)
    with pytest.raises(dab.TrainingComplete, match="6 planned steps"):
        private.step()


@pytest.mark.parametrize(
    "variant, torch_opt, kwargs",
    [
        ("adam", torch.optim.Adam, {"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8}),
        ("sgd", torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    ],
)
def test_no_noise_no_clipping_is_the_torch_optimizer(variant, torch_opt, kwargs):
    """noise='none' (no noise, no clipping), full-batch single-pass: the variant is torch's optimizer on the mean
    loss (the gradient is divided by the expected batch size N)."""
    _, dataset = tiny_data()
    x, y = dataset.tensors
    ours = tiny_model()
    ref = copy.deepcopy(ours)
    extra = {"momentum": 0.9} if variant == "sgd" else {}
    private = dab.make_private(
        ours, dataset, CE, optimizer=variant, noise="none", lr=kwargs["lr"], optimizer_args=extra,
        sampler="single_pass", batch_size=len(dataset), epochs=5,
    )  # fmt: skip
    assert private.epsilon() == {}
    opt = torch_opt(ref.parameters(), **kwargs)
    for _ in range(5):
        private.step()
        opt.zero_grad()
        nn.functional.cross_entropy(ref(x), y).backward()
        opt.step()
    for a, b in zip(ours.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_state_dict_resume_is_exact(tmp_path):
    """AdamBC + BandMF: 4 steps, state_dict through torch.save, a fresh model and make_private, 4 more steps ==
    8 uninterrupted steps (parameters, epsilon and the noise mechanism's buffers included)."""
    _, dataset = tiny_data()
    args = dict(
        optimizer="adambc", noise="bandmf", noise_args={"bands": 2}, clip=0.5, sigma=1.0, batch_size=16,
        epochs=2, lr=0.01,
    )  # fmt: skip
    straight_model = tiny_model()
    straight = dab.make_private(straight_model, dataset, CE, **args)
    assert straight.steps == 8
    for _ in range(8):
        straight.step()

    first_model = tiny_model()
    first = dab.make_private(first_model, dataset, CE, **args)
    for _ in range(4):
        first.step()
    torch.save(first.state_dict(), tmp_path / "state.pt")
    resumed_model = tiny_model()
    resumed = dab.make_private(resumed_model, dataset, CE, **args)
    resumed.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=False))
    assert resumed.steps_done == 4
    while not resumed.done:
        resumed.step()
    assert digest(resumed_model.parameters()) == digest(straight_model.parameters())
    assert resumed.epsilon() == straight.epsilon()
    with pytest.raises(ValueError, match="missing"):
        resumed.load_state_dict({"step": 3})


def test_target_epsilon_calibrates_sigma():
    _, dataset = tiny_data()
    private = dab.make_private(
        tiny_model(), dataset, CE, optimizer="adam", sigma=None, target_epsilon=3.0, batch_size=16, steps=20
    )
    assert private.sigma == pytest.approx(dab.calibrate_sigma(3.0, 1e-5, 16 / 64, 20, "rdp"))
    while not private.done:
        private.step()
    assert private.epsilon("rdp") == pytest.approx(3.0, abs=0.01)


def _refusal(**overrides):
    _, dataset = tiny_data()
    args = dict(optimizer="adambc", noise="independent", clip=1.0, sigma=1.0, batch_size=16, steps=4)
    args |= overrides
    model = args.pop("model", None) or tiny_model()
    return dab.make_private(model, args.pop("dataset", dataset), args.pop("loss_fn", CE), **args)


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"noise": "bandmf", "sampler": "poisson"}, "^noise='bandmf' with sampler=poisson"),
        ({"sigma": float("nan")}, "^sigma=nan"),
        ({"sigma": -1.0}, "^sigma=-1.0"),
        ({"sigma": None}, "^sigma=None"),
        ({"batch_size": 1000}, "larger than the training set"),
        ({"optimizer": "adamax"}, "optimizer='adamax' is not known; valid: .*adambc"),
        ({"noise": "gauss"}, "noise='gauss' is not known; valid: .*bandmf"),
        ({"optimizer_args": {"beta3": 0.5}}, "unknown key.*beta3; valid: .*beta2"),
        ({"noise_args": {"bands": 2}}, "noise_args: unknown key.*bands"),
        ({"loss_fn": nn.CrossEntropyLoss()}, "reduction='mean'.*reduction='none'"),
        ({"epochs": 2}, "steps=4 and epochs=2: give one"),
        ({"sampler": "single_pass", "steps": 4}, "give epochs"),
        ({"dataset": [torch.zeros(3)] * 4}, "pairs or dicts"),
        ({"clipping": "magic"}, "^clipping='magic'"),
    ],
)
def test_the_api_refuses_what_the_cli_refuses(overrides, match):
    with pytest.raises(dab.ConfigError, match=match):
        _refusal(**overrides)


@pytest.mark.parametrize("self_check", [True, False])
def test_a_loss_that_is_not_per_example_is_named(self_check):
    """Named before the first step, self-check or not: the engine's probe (engine/probe.py) on a few examples already
    calls the loss."""
    _, dataset = tiny_data()
    with pytest.raises(dab.ConfigError, match=r"one loss per example, shape \("):
        dab.make_private(
            tiny_model(), dataset, lambda out, y: nn.functional.cross_entropy(out, y), optimizer="adam", sigma=1.0,
            batch_size=16, steps=2, clipping="hooks", self_check=self_check,
        )  # fmt: skip


def test_dict_datasets_call_the_model_with_keywords():
    """Dict items: every key but target_key goes to model(**inputs); the run trains and is accounted."""

    class KeywordModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 2)

        def forward(self, features):
            return self.lin(features)

    _, pairs = tiny_data()
    x, y = pairs.tensors
    dataset = [{"features": x[i], "target": y[i]} for i in range(len(y))]
    model = KeywordModel()
    before = model.lin.weight.detach().clone()
    seen = []

    def evaluate(m):
        seen.append((m.training, torch.is_grad_enabled()))
        return {"weight_norm": float(m.lin.weight.norm())}

    private = dab.make_private(
        model, dataset, CE, target_key="target", optimizer="adambc", sigma=1.0, batch_size=16, steps=3,
        evaluate=evaluate,
    )  # fmt: skip
    for _ in range(3):
        private.step()
    assert not torch.equal(before, model.lin.weight)
    assert math.isfinite(private.epsilon("pld"))
    assert private.evaluate() == {"weight_norm": pytest.approx(float(model.lin.weight.detach().norm()))}
    assert seen == [(False, False)]
    with pytest.raises(dab.ConfigError, match="target_key='labels'"):
        dab.make_private(model, dataset, CE, sigma=1.0, batch_size=16, steps=3)


EXAMPLES = {
    "own_loop_adambc_bandmf.py": ([], "epsilon at delta"),
    "epsilon_and_sigma.py": ([], "sigma for epsilon = 8"),
    "hf_finetune_bk_clipping.py": (["--steps", "2"], "epsilon (rdp)"),
    "hf_trainer_private.py": ([], "epsilon (rdp) ="),
}


def test_every_example_is_tested():
    assert set(EXAMPLES) == {p.name for p in (REPO / "examples").glob("*.py")}


@pytest.mark.parametrize("name", sorted(EXAMPLES))
@pytest.mark.slow
def test_example_runs(name):
    from dp_adam_bench.tasks.text import minilm_folder

    args, expected = EXAMPLES[name]
    if name == "hf_finetune_bk_clipping.py" and minilm_folder() is None:
        pytest.skip("the [minilm] extra (pretrained MiniLM-L6) is not installed")
    env = os.environ | {"OMP_NUM_THREADS": "2", "DP_ADAM_BENCH_PROGRESS": "off"}
    out = subprocess.run(
        [sys.executable, str(REPO / "examples" / name), *args],
        capture_output=True, text=True, timeout=300, env=env, cwd=REPO,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert expected in out.stdout


def test_amplified_bandmf_through_the_api():
    """BandMF with cyclic Poisson sampling is accepted (amplified BandMF) and accounted one round per cycle."""
    from dp_adam_bench.privacy.accounting.amplified_mf import amplified_bandmf_epsilon

    _, dataset = tiny_data()
    private = dab.make_private(
        tiny_model(), dataset, CE, optimizer="adambc", noise="bandmf", noise_args={"bands": 2},
        sampler="cyclic_poisson", clip=1.0, sigma=1.0, batch_size=8, steps=6,
    )  # fmt: skip
    while not private.done:
        private.step()
    expected = amplified_bandmf_epsilon(1.0, 2 * 8 / 64, 6, 2, 1e-5, "pld")
    assert private.epsilon("pld") == pytest.approx(expected)


def test_a_state_from_another_privacy_plan_is_refused(tmp_path):
    """Loading a state saved under another sigma would continue its ledger under the wrong plan."""
    _, dataset = tiny_data()
    args = dict(optimizer="adam", clip=1.0, batch_size=16, steps=4)
    first = dab.make_private(tiny_model(), dataset, CE, sigma=1.0, **args)
    first.step()
    other = dab.make_private(tiny_model(), dataset, CE, sigma=2.0, **args)
    with pytest.raises(ValueError, match="another privacy plan.*sigma: saved 1.0, here 2.0"):
        other.load_state_dict(first.state_dict())


def test_shuffled_batches_warn_that_epsilon_is_not_a_guarantee():
    _, dataset = tiny_data()
    with pytest.warns(UserWarning, match="not a guarantee"):
        dab.make_private(tiny_model(), dataset, CE, sigma=1.0, sampler="shuffle", batch_size=16, epochs=1)


# --- issue 33: make_private's own names, precision, diagnostics of the step ------------------------------------------


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"clip": None}, r"^clip=None must be"),
        ({"clipping": "ghost", "precision": "bf16"}, r"^precision=bf16 is implemented for clipping=bk.*clipping=ghost"),
        ({"optimizer_args": {"beta1": 2.0}}, r"^optimizer_args\['beta1'\] must be in \[0, 1\)"),
        ({"lr": -1}, r"^lr=-1 must be"),
        ({"delta": 2.0}, r"^delta=2.0 must be"),
        ({"physical_batch_size": 0}, r"^physical_batch_size=0 must be"),
        ({"sampler": "cyclic"}, r"^sampler='cyclic' is not known; valid: .*poisson"),
        ({"precision": "fp16"}, r"^precision='fp16' is not known; valid: fp32, bf16"),
        ({"sigma": None, "target_epsilon": 1.0, "steps": None}, r"^sigma=None .*needs target_epsilon.*steps=None"),
    ],
)  # fmt: skip
def test_errors_name_make_privates_own_arguments(overrides, match):
    """Not the CLI fields the arguments set (privacy.clip, train.clipping, optimizer.beta1): one error, no chain."""
    with pytest.raises(dab.ConfigError, match=match) as caught:
        _refusal(**overrides)
    message = str(caught.value)
    assert "\n" not in message and not any(
        f in message for f in ("privacy.", "train.", "optimizer.", "noise.")
    )
    assert not isinstance(
        caught.value.__cause__, dab.ConfigError
    )  # the CLI-named error is not shown beside it


def test_cli_fields_are_renamed_to_arguments_and_nothing_else():
    from dp_adam_bench.api import in_api_terms

    assert in_api_terms("privacy.clip=null and train.self_check.enabled=false; noise.bands=2") == (
        "clip=None and self_check=False; noise_args['bands']=2"
    )
    assert in_api_terms("optimizer.name='adam' with noise.kind=bandmf (train.sampler).") == (
        "optimizer='adam' with noise=bandmf (sampler)."
    )
    untouched = (
        "train.self_check.tolerance=0.01, train.device=cpu, dp_adam_bench.privacy.accounting, configs/noise.x"
    )
    assert in_api_terms(untouched) == untouched


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_model_is_refused_with_the_fix(dtype):
    """Its optimizer state and updates would be half precision too: refused, naming the parameter and dtype."""
    with pytest.raises(dab.ConfigError, match=rf"^model parameter '0.weight' is {dtype}: keep the model in fp32 and "
                       r"pass precision='bf16'"):  # fmt: skip
        _refusal(model=tiny_model().to(dtype))


@pytest.mark.parametrize("clipping", ["bk", "ghost", "loop"])
def test_a_model_without_trainable_parameters_is_one_line(clipping):
    frozen = tiny_model().requires_grad_(False)
    with pytest.raises(
        dab.ConfigError, match=r"^the model \(Sequential\) has no trainable parameters \(4 param"
    ):
        _refusal(model=frozen, clipping=clipping)
    with pytest.raises(
        dab.ConfigError, match=r"^the model \(Flatten\) has no trainable parameters \(0 param"
    ):
        _refusal(model=nn.Flatten(), clipping=clipping)


def test_bf16_precision_autocasts_with_fp32_parameters_and_state():
    """precision='bf16': the layers compute in bf16 (autocast), the parameters and Adam's moments stay fp32, and the
    step is the fp32 step up to bf16 rounding (same batches and noise)."""
    _, dataset = tiny_data()
    args = dict(optimizer="adam", lr=0.01, noise="independent", sigma=1.0, batch_size=16, steps=2)
    runs = {}
    for precision in ("fp32", "bf16"):
        model = tiny_model()
        seen = []
        model[0].register_forward_hook(lambda mod, inp, out, seen=seen: seen.append(out.dtype))
        private = dab.make_private(model, dataset, CE, precision=precision, **args)
        seen.clear()  # the self-check's forward passes
        while not private.done:
            private.step()
        state = [t for t in torch.utils._pytree.tree_leaves(private.state) if isinstance(t, torch.Tensor)]
        assert state and all(t.dtype == torch.float32 for t in state if t.is_floating_point())
        assert all(p.dtype == torch.float32 for p in model.parameters())
        assert set(seen) == {torch.bfloat16 if precision == "bf16" else torch.float32}
        runs[precision] = torch.cat([p.detach().flatten() for p in model.parameters()])
    start = torch.cat([p.detach().flatten() for p in tiny_model().parameters()])
    moved, gap = (runs["fp32"] - start).norm(), (runs["bf16"] - runs["fp32"]).norm()
    assert 0 < gap < 0.05 * moved


@pytest.mark.parametrize("noise", ["independent", "none"])
def test_step_result_has_each_examples_norm_and_the_fraction_clipped(noise):
    """A full single-pass batch: the step's norms are the per-example gradient norms computed by hand (in the order
    the micro-batches ran: compared sorted), and frac_clipped the share above C (C: half of them above it here)."""
    _, dataset = tiny_data()
    x, y = dataset.tensors
    model = tiny_model()
    hand = []
    for i in range(len(x)):
        grads = torch.autograd.grad(CE(model(x[i : i + 1]), y[i : i + 1]).sum(), list(model.parameters()))
        hand.append(torch.cat([g.flatten() for g in grads]).norm())
    hand = torch.stack(hand)
    clip = float(hand.sort().values[len(x) // 2 - 1 : len(x) // 2 + 1].mean())  # between the middle two
    private = dab.make_private(
        model, dataset, CE, optimizer="sgd", lr=0.1, noise=noise, sigma=1.0, clip=clip, sampler="single_pass",
        batch_size=len(x), epochs=1, physical_batch_size=7,
    )  # fmt: skip
    result = private.step()
    assert result.batch_size == len(x) and result.norms.shape == (len(x),)
    torch.testing.assert_close(result.norms.sort().values.cpu(), hand.sort().values, rtol=1e-4, atol=1e-6)
    expected = float((hand > clip).float().mean()) if noise != "none" else 0.0
    assert result.frac_clipped == expected and expected in (0.0, 0.5)
