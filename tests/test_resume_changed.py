"""Issue 56, "resume refuses what changed": the saved privacy plan records N, q, B and the sampler; a resume with
another data set (or batch, or sampler) is refused in one line naming it, before any state is loaded (DPTrainer,
make_private's load_state_dict, the CLI's checkpoint); a checkpoint written before those fields existed loads as
before."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

import dp_adam_bench as dab
from dp_adam_bench.engine.plan import resume_refusal
from dp_adam_bench.errors import ConfigError
from dp_adam_bench.hf_trainer import DPTrainer, PrivacyArguments

from helpers import CE, tiny_data, tiny_model

NEW_FIELDS = ("population", "sampling_rate", "expected_batch_size", "sampler")


def one_line(err: pytest.ExceptionInfo) -> str:
    assert "\n" not in str(err.value)
    return str(err.value)


def tensors(value) -> list[torch.Tensor]:
    """Every tensor in a nested state (dicts in key order, lists in order), cloned."""
    if isinstance(value, torch.Tensor):
        return [value.detach().clone()]
    if isinstance(value, dict):
        return [t for k in sorted(value, key=str) for t in tensors(value[k])]
    if isinstance(value, list | tuple):
        return [t for v in value for t in tensors(v)]
    return []


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# --- what the plan records ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw, q, sampler",
    [
        (dict(noise="independent", steps=3), 16 / 64, {"kind": "poisson"}),
        (dict(noise="bandmf", noise_args={"bands": 2}, sampler="cyclic_poisson", steps=4), 2 * 16 / 64,
         {"kind": "cyclic_poisson", "cycle_length": 2}),
        (dict(noise="dpmf_sqrt", epochs=2), None,
         {"kind": "single_pass", "batch_size": 16, "epochs": 2, "steps_per_epoch": 4}),
    ],
)  # fmt: skip
def test_the_plan_records_n_q_b_and_the_sampler(kw, q, sampler):
    """Against the arguments: N = len(dataset), q = B / N (b B / N for cyclic Poisson; none for fixed-size
    batches), B, and the sampler's kind and settings."""
    _, data = tiny_data()
    private = dab.make_private(
        tiny_model(), data, CE, sigma=1.0, clip=1.0, batch_size=16, self_check=False, **kw
    )
    plan = private.plan.describe()
    assert plan["population"] == 64 and plan["expected_batch_size"] == 16.0
    assert plan["sampling_rate"] == q and plan["sampler"] == sampler
    assert resume_refusal(plan, private.plan.describe()) is None


def test_the_refusal_names_a_changed_data_set_first_and_compares_only_saved_fields():
    saved = {"population": 1500, "sampling_rate": 8 / 1500, "sigma": 1.0}
    here = {"population": 1400, "sampling_rate": 8 / 1400, "sigma": 1.0, "new_field": 3}
    why = resume_refusal(saved, here, data="train_dataset", saved_by="the checkpoint's run")
    assert why.startswith(
        "train_dataset has 1,400 examples, the checkpoint's run had 1,500: resume with the same data"
    )
    assert "sampling_rate: saved" in why and "sigma" not in why and "new_field" not in why
    assert resume_refusal({"sigma": 1.0}, here) is None  # an older checkpoint: N, q, B, sampler not compared
    assert resume_refusal(None, here) is None
    other = resume_refusal({"sigma": 1.0}, {"sigma": 2.0})
    assert other == (
        "this state was saved by a run with another privacy plan (sigma: saved 1.0, here 2.0); resume it with the "
        "same arguments"
    )


# --- make_private ---------------------------------------------------------------------------------------------------
def _run(n: int, **kw):
    task, data = tiny_data()
    data = torch.utils.data.TensorDataset(task.x[:n], task.y[:n])
    args = dict(optimizer="adam", sigma=1.0, clip=1.0, batch_size=8, steps=4, self_check=False) | kw
    return dab.make_private(tiny_model(), data, CE, **args)


def test_make_private_refuses_a_state_from_another_data_set_size_with_nothing_loaded():
    first = _run(64)
    first.step()
    first.step()
    state = first.state_dict()
    other = _run(56)
    before = (
        tensors(list(other.params)),
        tensors(other.state),
        tensors(other.plan.sampler.state_dict()),
        tensors(other.privatizer.state_dict()),
    )
    with pytest.raises(
        ConfigError,
        match=r"^the private data set has 56 examples, the saved run's had 64: resume with the same data",
    ) as e:
        other.load_state_dict(state)
    assert "sampling_rate: saved 0.125, here 0.14285" in one_line(e)
    after = (
        tensors(list(other.params)),
        tensors(other.state),
        tensors(other.plan.sampler.state_dict()),
        tensors(other.privatizer.state_dict()),
    )
    assert all(same(a, b) for a, b in zip(before, after, strict=True))
    assert other.steps_done == 0 and other.ledger.num_poisson_steps == 0 and other.participation.steps == 0


def test_make_private_names_another_batch_size_and_sampler():
    state = _run(64).state_dict()
    with pytest.raises(
        ConfigError, match=r"another privacy plan \(.*expected_batch_size: saved 8.0, here 16.0"
    ):
        _run(64, batch_size=16).load_state_dict(state)
    with pytest.raises(ConfigError, match=r"sampler: saved \{'kind': 'poisson'\}, here \{'kind': 'shuffle'"):
        with pytest.warns(UserWarning, match="not a guarantee"):
            shuffled = _run(64, sampler="shuffle", steps=None, epochs=1)
        shuffled.load_state_dict(state)


def test_a_state_saved_before_the_new_fields_still_resumes_bit_identically():
    """An older checkpoint's plan (without N, q, B, sampler) is compared on what it holds and continues exactly
    where the uninterrupted run goes."""
    whole = _run(64)
    while not whole.done:
        whole.step()
    first = _run(64)
    first.step()
    first.step()
    state = first.state_dict()
    state["plan"] = {k: v for k, v in state["plan"].items() if k not in NEW_FIELDS}
    resumed = _run(64)
    resumed.load_state_dict(state)
    while not resumed.done:
        resumed.step()
    assert same(tensors(list(resumed.params)), tensors(list(whole.params)))


# --- DPTrainer ------------------------------------------------------------------------------------------------------
VOCAB = 60


def gpt2(seed: int) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=16, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=0, pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def rows(n: int) -> list[dict]:
    rng = np.random.default_rng(0)
    return [{"input_ids": rng.integers(1, VOCAB, rng.integers(4, 10)).tolist()} for _ in range(n)]


class StopAt(transformers.TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop = state.global_step == self.step


def trainer(tmp_path, data, seed=0, callbacks=None, accumulation=2, **length):
    length = length or {"max_steps": 6}
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, gradient_accumulation_steps=accumulation,
        learning_rate=1e-2, lr_scheduler_type="constant", logging_steps=1, save_strategy="steps", save_steps=3,
        report_to="none", disable_tqdm=True, seed=0, **length,
    )  # fmt: skip
    privacy = PrivacyArguments(sigma=1.0, self_check=False, engine_watch_every="0")
    return DPTrainer(model=gpt2(seed), args=args, train_dataset=data, callbacks=callbacks, privacy=privacy)


def params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("length", [{"max_steps": 6}, {"num_train_epochs": 0.5}])
def test_dptrainer_resumed_with_another_train_dataset_size_refuses_with_nothing_loaded(tmp_path, length):
    """The issue's case: checkpoint at step 3 of a run on 64 examples, resumed on 56. One line naming
    train_dataset before the run is built: the weights, the Trainer's state and any privacy state as they were.
    With num_train_epochs the steps (and the configuration's fingerprint) change too: the data set is still what is
    named."""
    first = trainer(tmp_path, rows(64), callbacks=[StopAt(3)], **length)
    first.train()
    assert first.state.global_step == 3
    resumed = trainer(tmp_path, rows(56), seed=1, **length)
    weights = params(resumed.model)
    with pytest.raises(
        ConfigError,
        match=r"^train_dataset has 56 examples, the checkpoint's run had 64: resume with the same data",
    ) as e:
        resumed.train(resume_from_checkpoint=True)
    assert "checkpoint-3" in one_line(e)
    assert same(params(resumed.model), weights)
    assert resumed.private is None and resumed.state.global_step == 0


def test_dptrainer_resumed_with_another_batch_refuses_before_loading(tmp_path):
    """Past the data set's check, the whole plan is compared after the run is built and before the weights, the
    Trainer's state or the privacy state are loaded: the parameters, the variant's state, the sampler and the
    ledger are the fresh run's."""
    first = trainer(tmp_path, rows(64), callbacks=[StopAt(3)])
    first.train()
    resumed = trainer(tmp_path, rows(64), seed=1, accumulation=1)
    weights = params(resumed.model)
    with pytest.raises(
        ConfigError, match=r"another privacy plan \(.*expected_batch_size: saved 8.0, here 4.0"
    ) as e:
        resumed.train(resume_from_checkpoint=True)
    one_line(e)
    private = resumed.private
    assert same(params(resumed.model), weights)
    fresh = private.variant.init(private.params)
    assert same(tensors(private.state), tensors(fresh))
    seed = private.run.seeds.sampler
    assert torch.equal(
        private.plan.sampler.generator.get_state(), torch.Generator().manual_seed(seed).get_state()
    )
    assert private.steps_done == 0 and private.ledger.num_poisson_steps == 0
    assert resumed.state.global_step == 0


# --- the command line -----------------------------------------------------------------------------------------------
def test_the_clis_resume_names_a_changed_data_set(isolated_dirs, monkeypatch):
    """A checkpoint whose plan had another N (the task's data changed on disk under the same configuration):
    refused in one line naming the data set, before the session loads anything."""
    from dp_adam_bench.engine.checkpoint import FILENAME
    from dp_adam_bench.tasks import registry
    from dp_adam_bench.train import train

    from helpers import compose_cfg, tiny_poisson

    monkeypatch.setitem(registry.TASKS, "tiny", "tiny_task:TinyTask")
    overrides = tiny_poisson("changed", 6, "train.checkpoint_every=2", "train.device=cpu")
    with pytest.raises(KeyboardInterrupt):
        train(compose_cfg([*overrides, "train.stop_after=3"]))
    (folder,) = [p for p in (isolated_dirs / "runs" / "changed").iterdir() if p.is_dir()]
    payload = torch.load(folder / FILENAME, weights_only=False)
    payload["plan"]["population"] = 70
    torch.save(payload, folder / FILENAME)
    with pytest.raises(
        ConfigError, match=r"^the private data set has 64 examples, the saved run's had 70"
    ) as e:
        train(compose_cfg(overrides))
    one_line(e)
