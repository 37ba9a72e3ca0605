"""Issue 47: cutting the long entry points into named steps changed nothing they do.

``config.validate``, ``make_private``, ``cli.main``, ``paper_plan.model_shape`` and the ``e2e_gpt2``,
``arxiv_mlm`` and ``snli_bert`` task constructors, each on cheap inputs, against :data:`GOLDEN`
(``tests/data/identity_entry_points.json``): what the original code (commit 382cf8b, before the refactor) gave for
the same inputs, measured with this file's own functions. Bulky values are compared by digest (the first 16 hex
digits of a SHA-1 of their JSON), floats at 6 significant digits; paths are written relative to the checkout, the
data folder, the interpreter and the test's temporary folder.

An intended change of any of these outputs updates :data:`GOLDEN`: ``DP_ADAM_BENCH_IDENTITY_DUMP=<file.json>``
makes every test write what it measures into that file instead of comparing.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

import dp_adam_bench as dab
from dp_adam_bench.paths import CONFIG_DIR, REPO_ROOT, shared_data_dir
from dp_adam_bench.tasks import text

from helpers import CE, first_abstracts, tiny_data, tiny_model

DUMP = os.environ.get("DP_ADAM_BENCH_IDENTITY_DUMP")
#: what the original code (commit 382cf8b) gave, as measured by the tests below
#: the first step's parameters are compared to this relative tolerance (printed at 6 significant digits)
STEP_RTOL = 1e-4
GOLDEN = json.loads((Path(__file__).parent / "data" / "identity_entry_points.json").read_text("utf-8"))
TOKENIZER = shared_data_dir() / "gpt2_tokenizer"
ABSTRACTS = shared_data_dir() / "arxiv_abstracts" / "arxiv_abstracts.jsonl.gz"


# --------------------------------------------------------------------------------------------- measuring


def digest(value) -> str:
    blob = json.dumps(value, sort_keys=True, default=str).encode()
    return hashlib.sha1(blob).hexdigest()[:16]


def g6(x) -> str | None:
    """A float at 6 significant digits (None stays None)."""
    return None if x is None else f"{float(x):.6g}"


_PORTABLE: list[tuple[str, str]] = []


def portable(s: str) -> str:
    """``s`` with this machine's folders named (the interpreter, the data folder, the checkout, the tmp folder) and
    without the names registered after the goldens (:func:`before_new_names`)."""
    for path, name in _PORTABLE:
        s = s.replace(path, name)
    return before_new_names(s)


# registered after the goldens (382cf8b), which the refactor they guard did not touch: report tables and a task
# (and train.moved_check, a config field added since, which messages listing train's fields name)
NEW_NAMES = (
    "li_glue_accounting",
    "li_dialog_accounting",
    "li_glue",
    "glue_sst2",
    "li_e2e_methods",
    "dialog",
    "li_dialog",
    "li_hyperparams",
    "moved_check",
)


# config fields added after the goldens, at the value that computes what the goldens' runs computed (issue 45)
NEW_FIELDS = {"train.moved_check": 3, "task.finetune": None, "task.finetune_args": {}}


def before_new_fields(cfg: dict) -> dict:
    """``cfg`` without the :data:`NEW_FIELDS` still at their default (the config the goldens saw)."""
    out = json.loads(json.dumps(cfg, default=str))
    for dotted, default in NEW_FIELDS.items():
        *parents, last = dotted.split(".")
        node = out
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and last in node and node[last] == default:
            del node[last]
    return out


def before_new_names(text: str) -> str:
    """``text`` without the lines that describe a :data:`NEW_NAMES` entry (``name: ...`` and its indented
    continuation lines) and without its place in a list (comma- or space-separated, quoted or not)."""
    kept, skipping = [], False
    for ln in text.splitlines(keepends=True):
        skipping = any(ln.startswith(f"{n}:") for n in NEW_NAMES) or (skipping and ln[:1].isspace())
        if not skipping:
            kept.append(ln)
    out = "".join(kept)
    for n in NEW_NAMES:  # the whole name only: li_glue is not the start of li_glue_accounting
        out = re.sub(rf"(, | )(['\"]?){re.escape(n)}\2(?!\w)", "", out)
    return out


@pytest.fixture(autouse=True)
def _named_folders(tmp_path):
    _PORTABLE[:] = [
        (sys.executable, "<python>"),
        (str(shared_data_dir()), "<data>"),
        (str(REPO_ROOT), "<repo>"),
        (str(tmp_path), "<tmp>"),
    ]
    yield
    _PORTABLE.clear()


def fingerprint(value):
    """A JSON-able, address-free picture of ``value``: arrays and tensors by dtype, shape and digest; ragged token
    rows by their two arrays; tokenizers by class and size; containers element by element."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    if isinstance(value, np.ndarray):
        return f"{value.dtype}{list(value.shape)}:{hashlib.sha1(value.tobytes()).hexdigest()[:16]}"
    if isinstance(value, text.Ragged):
        return {"flat": fingerprint(value.flat), "offsets": fingerprint(value.offsets)}
    if isinstance(value, dict):
        return {str(k): fingerprint(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [fingerprint(v) for v in value]
        return items if len(json.dumps(items)) <= 200 else f"{len(items)} items:{digest(items)}"
    if isinstance(value, float):
        return g6(value)
    if isinstance(value, str):
        return portable(value)
    if value is None or isinstance(value, (bool, int)):
        return value
    if hasattr(value, "get_vocab"):  # a tokenizer
        return f"{type(value).__name__}(len={len(value)})"
    return type(value).__name__


def error_of(fn, *args, **kwargs) -> str:
    """What ``fn(*args, **kwargs)`` raises, as ``Type: message`` (or ``ok``)."""
    try:
        fn(*args, **kwargs)
    except Exception as err:  # noqa: BLE001 - any refusal is part of what the entry point does
        return f"{type(err).__name__}: {portable(str(err))}"
    return "ok"


@pytest.fixture(scope="module")
def golden():
    """``check(name, value)``: ``value`` (as JSON) equals ``GOLDEN[name]``; with DP_ADAM_BENCH_IDENTITY_DUMP, kept
    and written to that file at the end of the module instead."""
    measured: dict = {}

    def check(name: str, value) -> None:
        value = json.loads(json.dumps(value, default=str))
        if DUMP:
            measured[name] = value
            return
        assert name in GOLDEN, f"no golden value for {name!r}"
        want = GOLDEN[name]
        if isinstance(value, dict) and "step" in value and isinstance(want, dict) and "step" in want:
            value, want = dict(value), dict(want)  # GOLDEN stays as read
            (*head, got_params), (*want_head, want_params) = value.pop("step"), want.pop("step")
            assert head == want_head, f"{name}: the first step's batch or clipped fraction changed"
            assert got_params == pytest.approx(want_params, rel=STEP_RTOL, abs=1e-6), (
                f"{name}: the first step moved"
            )
        if isinstance(value, dict) and "evaluate" in value and isinstance(want, dict) and "evaluate" in want:
            # metrics of the trained model, float32 sums at 6 digits: the 6th digit can round the other way on a
            # CPU whose sums differ in the last bits (weight_norm 1.0669335 here, 1.0669338 under
            # ATEN_CPU_CAPABILITY=default), so the values are compared within STEP_RTOL, not as digits
            value, want = dict(value), dict(want)
            got_eval, want_eval = value.pop("evaluate"), want.pop("evaluate")
            assert set(got_eval) == set(want_eval), f"{name}: the metrics changed"
            for key, digits in want_eval.items():
                assert float(got_eval[key]) == pytest.approx(float(digits), rel=STEP_RTOL), (
                    f"{name}: {key} moved"
                )
        assert value == want, f"{name}: the refactor changed what this entry point gives"

    yield check
    if DUMP:
        old = json.loads(Path(DUMP).read_text("utf-8")) if os.path.exists(DUMP) else {}
        blob = json.dumps(old | measured, indent=1, sort_keys=True, ensure_ascii=False)
        Path(DUMP).write_text(blob + "\n", "utf-8")


# --------------------------------------------------------------------------------------------- config.validate


def _presets() -> list[str]:
    return sorted(p.stem for p in (CONFIG_DIR / "experiment").glob("*.yaml"))


def _first_point(preset: str, profile: str) -> list[str]:
    """The overrides of a preset's first sweep point, as tests/test_config.py composes them."""
    from dp_adam_bench.sweep import override_value, sweep_spec

    spec = sweep_spec(preset, profile)
    overrides = [f"experiment={preset}", f"profile={profile}"]
    for entry in list((spec.entries or {"all": {}}).values())[:1]:
        values = {**entry, **spec.grid}
        overrides += [
            f"{k}={override_value((v if isinstance(v, list) else [v])[0])}" for k, v in values.items()
        ]
    return overrides


#: the bases whose every field is set to each of :data:`BAD_VALUES` in turn
BASES = {
    "default": [],
    "poisson": ["noise=independent", "train.sampler=poisson", "train.batch_size=8", "train.steps=10"],
    "cyclic_bandmf": ["noise=bandmf", "train.sampler=cyclic_poisson", "train.batch_size=8", "train.steps=10"],
    "snli_bf16": ["task=snli_bert", "optimizer=adam", "train.precision=bf16"],
    "calibrate": [
        "noise=independent",
        "train.sampler=poisson",
        "train.batch_size=8",
        "train.steps=10",
        "privacy.sigma=null",
        "privacy.target_epsilon=3",
    ],
}
BAD_VALUES = (float("nan"), -1, 0, 2.5, "abc", None, True, 10**20)


def _leaves(node: dict, prefix: str = ""):
    for key, value in node.items():
        if isinstance(value, dict) and value:
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"


def _with(cfg: dict, dotted: str, value) -> dict:
    out = json.loads(json.dumps(cfg))
    node = out
    *parents, last = dotted.split(".")
    for part in parents:
        node = node[part]
    node[last] = value
    return out


def validate_messages(cfg: dict) -> dict:
    """``validate``'s answer for ``cfg`` and for ``cfg`` with each field set to each bad value."""
    from dp_adam_bench.config import validate

    out = {"as composed": error_of(validate, cfg)}
    for field in _leaves(cfg):
        for bad in BAD_VALUES:
            out[f"{field}={bad!r}"] = error_of(validate, _with(cfg, field, bad))
    return out


@pytest.mark.slow
def test_validate_gives_the_same_answers(golden):
    from hydra import compose, initialize_config_dir

    from dp_adam_bench.config import validate
    from dp_adam_bench.train import run_config

    # the cpu profile's first sweep points (tests/test_config.py validates both profiles' points)
    points = {
        f"{preset}/cpu": _first_point(preset, "cpu") for preset in _presets() if preset not in NEW_NAMES
    }
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        for name, overrides in BASES.items():
            messages = validate_messages(
                before_new_fields(run_config(compose("config", overrides=overrides)))
            )
            golden(f"validate/{name}", digest(messages))
        for name, overrides in points.items():
            cfg = before_new_fields(run_config(compose("config", overrides=overrides)))
            golden(f"validate/{name}", f"{digest(cfg)} {error_of(validate, cfg)}")
        own = {**run_config(compose("config", overrides=[])), "task": {"name": "not registered"}}
    golden("validate/own_task", [error_of(validate, own, custom_task=flag) for flag in (True, False)])


# --------------------------------------------------------------------------------------------- make_private


def private_fingerprint(private) -> dict:
    """The resolved config, the privacy plan, the sampler and the variant of a :class:`PrivateTraining`, and its
    first step (batch size, fraction clipped, the parameters after it at 6 significant digits)."""
    plan, run = private.plan, private.run
    mask = getattr(private.variant, "decay_mask", None)
    before = {
        "config": digest(before_new_fields(OmegaConf.to_container(run.cfg, resolve=True))),
        "plan": {
            "steps": plan.steps,
            "sigma": g6(plan.sigma),
            "account_sigma": g6(plan.account_sigma),
            "noisy": plan.noisy,
            "private": plan.private,
            "calibrated": plan.calibrated,
            "accounting": plan.accounting,
            "accountant": plan.accountant,
            "delta": g6(plan.delta),
            "budget": g6(plan.budget),
            "target": g6(plan.target),
            "sensitivity": g6(plan.sensitivity),
            "column_norm": g6(plan.column_norm),
            "strategy": type(plan.strategy).__name__,
            "notes": [portable(n) for n in plan.notes],
            "warnings": [portable(n) for n in plan.warnings],
            "caveats": [portable(n) for n in plan.caveats],
        },
        "sampler": [type(plan.sampler).__name__, plan.sampler.kind, g6(plan.sampler.expected_batch_size)],
        "variant": [type(private.variant).__name__, g6(private.variant.lr)],
        "decay_mask": None if mask is None else [bool(m) for m in mask],
        "self_check": sorted(private.self_check or {}),
        "guarantee": fingerprint(private.guarantee()),
    }
    if private.done:
        return before
    result = private.step()
    params = torch.cat([p.detach().flatten().double().cpu() for p in private.params])
    return before | {
        "step": [
            result.batch_size,
            g6(result.frac_clipped),
            # the values, not a digest of their digits: a CPU with other vector units may move the last bits, and a
            # rounded digit with them; the check compares them within STEP_RTOL
            [float(f"{v:.6g}") for v in params.tolist()],
        ]
    }


def _keyword_dataset():
    _, pairs = tiny_data()
    x, y = pairs.tensors
    return [{"features": x[i], "target": y[i]} for i in range(len(y))]


class _KeywordModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(6, 2)

    def forward(self, features):
        return self.lin(features)


#: accepted combinations (those tests/test_api.py and tests/test_newcomer.py use, and the other arguments)
ACCEPTED = {
    "cli_run": dict(optimizer="adam", lr=0.01, noise="independent", sigma=1.0, clip=0.5, batch_size=16, steps=6,
                    physical_batch_size=5),
    "no_noise_adam": dict(optimizer="adam", noise="none", lr=0.01, sampler="single_pass", batch_size=64, epochs=5),
    "no_noise_sgd": dict(optimizer="sgd", noise="none", lr=0.1, optimizer_args={"momentum": 0.9},
                         sampler="single_pass", batch_size=64, epochs=5),
    "adambc_bandmf": dict(optimizer="adambc", noise="bandmf", noise_args={"bands": 2}, clip=0.5, sigma=1.0,
                          batch_size=16, epochs=2, lr=0.01),
    "bandmf_calibrated": dict(optimizer="adam", noise="bandmf", noise_args={"bands": 2}, sigma=None,
                              target_epsilon=4.0, batch_size=16, epochs=1),
    "no_noise_poisson": dict(noise="none", batch_size=16, steps=2),
    "budget": dict(optimizer="adam", sigma=2.0, epsilon_budget=3.0, batch_size=16, steps=200),
    "amplified_bandmf": dict(optimizer="adambc", noise="bandmf", noise_args={"bands": 2}, sampler="cyclic_poisson",
                             clip=1.0, sigma=1.0, batch_size=8, steps=6),
    "ime_single_pass": dict(optimizer="ime", sigma=1.0, batch_size=16, epochs=2, sampler="single_pass"),
    "bf16": dict(optimizer="adam", lr=0.01, noise="independent", sigma=1.0, batch_size=16, steps=2,
                 precision="bf16"),
    "single_pass_sgd": dict(optimizer="sgd", lr=0.1, noise="independent", sigma=1.0, clip=0.3,
                            sampler="single_pass", batch_size=64, epochs=1, physical_batch_size=7),
    "schedule_decay": dict(optimizer="adamw", sigma=1.0, batch_size=16, steps=5, lr_schedule="linear",
                           lr_warmup_steps=2, weight_decay=0.1, weight_decay_mask=lambda n, p: n.endswith("weight"),
                           clipping="hooks", self_check=False, engine_watch_every=2, seed=3),
    "ghost_poisson_epochs": dict(optimizer="adam", sigma=1.0, batch_size=16, epochs=0.5, clipping="ghost",
                                 delta=1e-6),
    "secure": dict(optimizer="adam", sigma=1.0, batch_size=16, steps=2, secure_rng=True),
}  # fmt: skip

#: refused combinations: the tests' and a few more of the checks make_private makes itself
REFUSED = {
    "bandmf_poisson": dict(noise="bandmf", sampler="poisson"),
    "sigma_nan": dict(sigma=float("nan")),
    "sigma_none": dict(sigma=None),
    "batch_too_large": dict(batch_size=1000),
    "unknown_optimizer": dict(optimizer="adamax"),
    "unknown_noise": dict(noise="gauss"),
    "unknown_optimizer_arg": dict(optimizer_args={"beta3": 0.5}),
    "unknown_noise_arg": dict(noise_args={"bands": 2}),
    "rename_optimizer": dict(optimizer_args={"name": "sgd"}),
    "mean_loss": dict(loss_fn=torch.nn.CrossEntropyLoss()),
    "loss_not_callable": dict(loss_fn=3),
    "steps_and_epochs": dict(epochs=2),
    "steps_fixed_size": dict(sampler="single_pass"),
    "not_pairs": dict(dataset=[torch.zeros(3)] * 4),
    "empty": dict(dataset=[]),
    "no_len": dict(dataset=iter([])),
    "not_a_module": dict(model=lambda x: x),
    "target_key": dict(dataset="keyword"),
    "clipping": dict(clipping="magic"),
    "clip_none": dict(clip=None),
    "bf16_ghost": dict(clipping="ghost", precision="bf16"),
    "beta1": dict(optimizer_args={"beta1": 2.0}),
    "lr": dict(lr=-1),
    "delta": dict(delta=2.0),
    "physical": dict(physical_batch_size=0),
    "sampler": dict(sampler="cyclic"),
    "precision": dict(precision="fp16"),
    "target_without_steps": dict(sigma=None, target_epsilon=1.0, steps=None),
    "epochs_nan": dict(steps=None, epochs=float("nan")),
    "batch_nan": dict(steps=None, epochs=1, batch_size=float("nan")),
    "mask": dict(weight_decay_mask=3),
    "self_check": dict(self_check="yes"),
    "half": dict(model="bf16"),
    "meta": dict(model="meta"),
}


def _model(which):
    if which == "bf16":
        return tiny_model().to(torch.bfloat16)
    if which == "meta":
        return tiny_model().to("meta")
    return which if which is not None else tiny_model()


def test_make_private_builds_the_same_run(golden):
    _, dataset = tiny_data()
    for name, args in ACCEPTED.items():
        value = private_fingerprint(dab.make_private(tiny_model(), dataset, CE, **args))
        if name == "secure":  # the OS's randomness: the plan is fixed, the step is not
            value.pop("step")
        golden(f"make_private/{name}", value)
    keyword = dab.make_private(
        _KeywordModel(), _keyword_dataset(), CE, target_key="target", optimizer="adambc", sigma=1.0, batch_size=16,
        steps=3, evaluate=lambda m: {"weight_norm": float(m.lin.weight.norm())},
    )  # fmt: skip
    golden(
        "make_private/keyword", private_fingerprint(keyword) | {"evaluate": fingerprint(keyword.evaluate())}
    )
    with pytest.warns(UserWarning) as caught:
        dab.make_private(tiny_model(), dataset, CE, sigma=1.0, sampler="shuffle", batch_size=16, epochs=1)
    golden("make_private/shuffle_warning", [str(w.message) for w in caught])


def test_make_private_refuses_the_same_way(golden):
    _, dataset = tiny_data()
    base = dict(optimizer="adambc", noise="independent", clip=1.0, sigma=1.0, batch_size=16, steps=4)
    for name, overrides in REFUSED.items():
        args = base | overrides
        model = _model(args.pop("model", None))
        data = args.pop("dataset", dataset)
        data = _keyword_dataset() if isinstance(data, str) else data
        loss_fn = args.pop("loss_fn", CE)
        golden(f"make_private/refused/{name}", error_of(dab.make_private, model, data, loss_fn, **args))


# --------------------------------------------------------------------------------------------- cli.main

#: commands that train nothing; each is run by ``main`` and its exit code, stdout and stderr compared
COMMANDS = {
    "help": ["--help"],
    "no_command": [],
    **{f"{c}_help": [c, "--help"] for c in ("report", "sweep", "reproduce", "pretrain", "wandb-dashboard", "data",
                                            "privacy", "audit")},
    "report_list": ["report", "--list"],
    "report_unknown": ["report", "nope"],
    "report_bad_option": ["report", "--bogus"],
    "report_extra": ["report", "--list", "seed=1"],
    "sweep_dry_run_extra": ["sweep", "ganesh_quadratic", "seed=3", "--dry-run", "--launcher", "joblib", "--jobs", "2"],
    "sweep_bad_option": ["sweep", "ganesh_quadratic", "--dry-run", "--bogus"],
    "sweep_unknown": ["sweep", "nope", "--dry-run"],
    "sweep_bad_override": ["sweep", "ganesh_quadratic", "--dry-run", "train.stpes=3"],
    "pretrain_bad_key": ["pretrain", "gpt2_arxiv", "nosuch=1"],
    "pretrain_unknown": ["pretrain", "gpt3"],
    "dashboard_dry_run": ["wandb-dashboard", "--project", "e/p", "--dry-run", "--experiment", "ganesh_quadratic"],
    "dashboard_no_entity": ["wandb-dashboard", "--project", "p", "--experiment", "ganesh_quadratic"],
    "data_list": ["data", "list", "all", "--profile", "all"],
    "audit_list": ["audit", "--list-controls"],
}  # fmt: skip
#: commands whose work is stopped by Ctrl-C (a KeyboardInterrupt from what they call)
INTERRUPTED = {
    "sweep": ["sweep", "ganesh_quadratic"],
    "reproduce": ["reproduce", "ganesh_quadratic"],
    "report": ["report", "ganesh_quadratic"],
    "pretrain": ["pretrain", "gpt2_arxiv"],
}


def run_main(argv: list[str]) -> list:
    """``[exit code, stdout, stderr]`` of ``cli.main(argv)`` (SystemExit's code for argparse's exits)."""
    from dp_adam_bench.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(list(argv))
        except SystemExit as stop:
            rc = f"SystemExit({stop.code})"
    return [rc, portable(out.getvalue()), portable(err.getvalue())]


def _compact(result: list) -> list:
    """Long outputs by digest, short ones as they are (readable when they differ)."""
    return [v if not isinstance(v, str) or len(v) <= 300 else f"{len(v)} chars:{digest(v)}" for v in result]


def test_cli_main_prints_the_same(golden, monkeypatch, isolated_dirs):
    monkeypatch.setenv("COLUMNS", "100")  # argparse wraps its help to the terminal
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # a sweep's --jobs plan as on a CPU (the goldens' machine)
    monkeypatch.setattr(sys, "argv", ["dp-adam-bench"])
    for name, argv in COMMANDS.items():
        golden(f"cli/{name}", _compact(run_main(argv)))

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("dp_adam_bench.sweep.run_sweep", interrupted)
    monkeypatch.setattr("dp_adam_bench.report.registry.resolve", interrupted)
    monkeypatch.setattr("dp_adam_bench.pretrain.load_spec", interrupted)
    for name, argv in INTERRUPTED.items():
        golden(f"cli/interrupted/{name}", _compact(run_main(argv)))

    seen = []
    monkeypatch.setattr("dp_adam_bench.train.cli", lambda: seen.append(list(sys.argv)))
    golden("cli/train", [run_main(["train", "task=logistic_1d", "--multirun", "seed=1,2"]), seen])


# --------------------------------------------------------------------------------------------- model_shape

SHAPES = {
    "cifar10_cnn": {"name": "cifar10_cnn"},
    "e2e_gpt2": {"name": "e2e_gpt2"},
    "snli_bert": {"name": "snli_bert", "max_length": 128},
    "snli_bert_longest_unfrozen": {"name": "snli_bert", "pad_to": "longest", "freeze_pretrained": False},
    "arxiv_mlm": {"name": "arxiv_mlm", "max_length": 512},
    "arxiv_mlm_tied_local": {"name": "arxiv_mlm", "max_length": 128, "untie_embeddings": False,
                             "model": str(shared_data_dir() / "bert_tiny")},
}  # fmt: skip


def test_model_shape_is_the_same(golden):
    from dp_adam_bench.paper_plan import model_shape

    for name, task in SHAPES.items():
        golden(f"model_shape/{name}", asdict(model_shape({"task": task})))


# --------------------------------------------------------------------------------------------- task constructors


def task_fingerprint(task) -> dict:
    """Every attribute the constructor set, fingerprinted, and the sizes."""
    return {k: fingerprint(v) for k, v in sorted(vars(task).items())} | {
        "dataset_size": task.dataset_size,
        "test_size": task.test_size,
    }


E2E = {
    "cpu": {"profile": "cpu", "train_subset": 64, "test_subset": 8, "generate_subset": None, "n_layer": 1,
            "n_embd": 32, "n_head": 2},
    "cpu_named_model": {"profile": "cpu", "model": "gpt2", "train_subset": 32, "test_subset": 5, "max_length": 64,
                        "pad_to": "max_length", "eval_split": "dev", "dropout": 0.2, "max_new_tokens": 7,
                        "data_seed": 3, "generate_subset": 2, "num_beams": 2, "swap_conv1d": False},
    "paper": {"profile": "paper", "tokenizer": str(TOKENIZER), "source": "local", "train_subset": 16,
              "test_subset": 4, "attn_implementation": "eager", "generate_every_eval": True},
}  # fmt: skip
E2E_REFUSED = {
    "pretrained_without_model": {"pretrained": True},
    "dropout": {"dropout": 1.0},
    "max_length": {"max_length": 4},
    "short_max_length": {"max_length": 20},
    "pad_to": {"pad_to": "right"},
    "eval_batch_size": {"eval_batch_size": 0},
    "generate_subset": {"generate_subset": -1},
    "num_beams": {"num_beams": 0},
    "max_new_tokens": {"max_new_tokens": 0},
    "eval_split": {"eval_split": "val"},
    "source": {"source": "web"},
    "subset": {"train_subset": 10**9},
}


@pytest.mark.skipif(
    not (TOKENIZER / "vocab.json").is_file() or not (shared_data_dir() / "e2e_nlg").is_dir(),
    reason="needs shared/data/gpt2_tokenizer and shared/data/e2e_nlg",
)
def test_e2e_gpt2_constructor_builds_the_same_task(golden, monkeypatch, tmp_path):
    from dp_adam_bench.tasks.e2e_gpt2 import E2EGpt2

    for name, cfg in E2E.items():
        golden(f"e2e_gpt2/{name}", task_fingerprint(E2EGpt2(OmegaConf.create(cfg), trials=1, seed=0)))
    base = E2E["cpu"] | {"train_subset": 16, "test_subset": 3}
    for name, cfg in E2E_REFUSED.items():
        golden(
            f"e2e_gpt2/refused/{name}",
            error_of(E2EGpt2, OmegaConf.create(base | cfg), trials=1, seed=0),
        )
    monkeypatch.setenv("DP_ADAM_BENCH_DATA", str(tmp_path / "no_data"))  # no shared copy to fall back on
    missing = base | {"source": "local", "data_dir": str(tmp_path / "e2e")}
    golden("e2e_gpt2/refused/missing_data", error_of(E2EGpt2, OmegaConf.create(missing), trials=1, seed=0))


def _mlm(data, **kw) -> dict:
    return {"name": "arxiv_mlm", "profile": "cpu", "data_dir": str(data), "max_length": 48, "val_fraction": 0.1,
            "test_fraction": 0.2, "dropout": 0.0} | kw  # fmt: skip


ARXIV = {
    "cpu": {},
    "subsets_val": {"train_subset": 50, "test_subset": 10, "val_subset": 8, "data_seed": 2},
    "masking": {"mask_prob": 0.3, "mask_token_frac": 0.5, "random_token_frac": 0.3, "max_predictions": 5,
                "mask_seed": 4, "pad_to": "longest", "eval_split": "val", "untie_embeddings": False,
                "split_seed": 7, "eval_batch_size": 5, "max_length": 128},
    "paper_local": {"profile": "paper", "source": "local", "pretrained": False,
                    "model": str(shared_data_dir() / "bert_tiny")},
}  # fmt: skip
ARXIV_REFUSED = {
    "max_length": {"max_length": 4},
    "pad_to": {"pad_to": "left"},
    "mask_prob": {"mask_prob": 1.0},
    "fracs": {"mask_token_frac": 0.8, "random_token_frac": 0.3},
    "negative_frac": {"mask_token_frac": -0.1},
    "max_predictions": {"max_predictions": 0},
    "eval_batch_size": {"eval_batch_size": 0},
    "eval_split": {"eval_split": "dev"},
    "val_subset_on_val": {"eval_split": "val", "val_subset": 5},
    "empty_split": {"test_fraction": 0.0, "val_fraction": 0.0},
    "subset": {"test_subset": 10**6},
    "missing_model": {"model": "/nonexistent/bert"},
    "pretrain_kind": {"pretrain": "gpt2_arxiv"},
}


@pytest.mark.skipif(
    not ABSTRACTS.is_file() or not (shared_data_dir() / "bert_tiny").is_dir(),
    reason="needs shared/data/arxiv_abstracts and shared/data/bert_tiny",
)
def test_arxiv_mlm_constructor_builds_the_same_task(golden, monkeypatch, tmp_path):
    from dp_adam_bench.tasks.arxiv_mlm import ArxivMLM

    data = first_abstracts(tmp_path / "arxiv_abstracts.jsonl.gz", 150)
    for name, kw in ARXIV.items():
        golden(
            f"arxiv_mlm/{name}",
            task_fingerprint(ArxivMLM(OmegaConf.create(_mlm(data, **kw)), trials=1, seed=0)),
        )
    for name, kw in ARXIV_REFUSED.items():
        golden(
            f"arxiv_mlm/refused/{name}",
            error_of(ArxivMLM, OmegaConf.create(_mlm(data, **kw)), trials=1, seed=0),
        )
    monkeypatch.setenv("DP_ADAM_BENCH_DATA", str(tmp_path / "no_data"))  # no shared copy to fall back on
    missing = _mlm(tmp_path / "arxiv", source="local", model=str(ABSTRACTS.parents[1] / "bert_tiny"))
    golden("arxiv_mlm/refused/missing_data", error_of(ArxivMLM, OmegaConf.create(missing), trials=1, seed=0))


SNLI = {
    "cpu": {"train_subset": 40, "test_subset": 20},
    "longest": {"pad_to": "longest", "max_length": 40, "eval_batch_size": 9, "train_split": "test",
                "eval_split": "dev", "validation_subset": 10, "test_subset": 30, "data_seed": 5, "train_subset": 30},
}  # fmt: skip
SNLI_REFUSED = {
    "max_length": {"max_length": 4},
    "pad_to": {"pad_to": "left"},
    "eval_batch_size": {"eval_batch_size": 0},
    "same_splits": {"train_split": "test"},
    "source": {"source": "web"},
}


@pytest.mark.skipif(
    not (shared_data_dir() / "snli_1.0").is_dir() or not (shared_data_dir() / "bert_tiny").is_dir(),
    reason="needs shared/data/snli_1.0 and shared/data/bert_tiny",
)
def test_snli_bert_constructor_builds_the_same_task(golden, monkeypatch, tmp_path):
    """snli_bert's fields and data search are the ones the other two tasks use (tasks/fields.py, local_or_hub.py)."""
    from dp_adam_bench.tasks.snli_bert import SnliBert

    base = {
        "name": "snli_bert",
        "profile": "cpu",
        "model": str(shared_data_dir() / "bert_tiny"),
        "eval_split": "test",
    }
    for name, kw in SNLI.items():
        golden(f"snli_bert/{name}", task_fingerprint(SnliBert(OmegaConf.create(base | kw), trials=1, seed=0)))
    for name, kw in SNLI_REFUSED.items():
        golden(f"snli_bert/refused/{name}", error_of(SnliBert, OmegaConf.create(base | kw), trials=1, seed=0))
    monkeypatch.setenv("DP_ADAM_BENCH_DATA", str(tmp_path / "no_data"))  # no shared copy to fall back on
    missing = base | {"source": "local", "data_dir": str(tmp_path / "snli")}
    golden("snli_bert/refused/missing_data", error_of(SnliBert, OmegaConf.create(missing), trials=1, seed=0))
