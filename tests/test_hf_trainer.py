"""The Hugging Face Trainer path (dp_adam_bench.hf_trainer): DPTrainer trains tiny GPT-2 and BERT models privately
with the engine's Poisson batches, per-example losses and accounting, logs epsilon, checkpoints and resumes
bit-identically, stops at an epsilon budget, and refuses what it cannot honour in one line."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
import transformers
from torch.utils.data import default_collate

import dp_adam_bench as dab
from dp_adam_bench.hf_trainer import INDEX_KEY, DPTrainer, PrivacyArguments, per_example_loss

VOCAB = 100
#: the engine's checks at start-up and while training (their own tests are elsewhere); off where a test is about
#: something else, to keep it fast
QUICK = {"self_check": False, "engine_watch_every": "0"}


def gpt2(seed: int = 0, dropout: float = 0.1) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def bert_config(**kw) -> transformers.BertConfig:
    return transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=37,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **kw,
    )  # fmt: skip


def token_rows(n: int, seed: int = 0, lengths=(4, 12)) -> list[dict]:
    """``n`` examples of random tokens (1..VOCAB-1) of random lengths in ``[lengths[0], lengths[1])``."""
    rng = np.random.default_rng(seed)
    return [{"input_ids": rng.integers(1, VOCAB, rng.integers(*lengths)).tolist()} for _ in range(n)]


def training_args(tmp_path, **kw) -> transformers.TrainingArguments:
    base = dict(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, gradient_accumulation_steps=2,
        max_steps=4, learning_rate=1e-2, lr_scheduler_type="constant", logging_steps=2, save_strategy="no",
        report_to="none", disable_tqdm=True, seed=0,
    )  # fmt: skip
    return transformers.TrainingArguments(**(base | kw))


def params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    """Bit-identical on the CPU; on a GPU, within float rounding (its scatter-adds are not deterministic)."""
    for x, y in zip(a, b, strict=True):
        if x.device.type == "cpu":
            assert torch.equal(x, y)
        else:
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message
    return message


# --- (a) end to end -----------------------------------------------------------------------------------------------
def test_gpt2_trains_privately_and_logs_epsilon(tmp_path, capsys):
    """A datasets.Dataset of variable-length token lists with a column the model does not take: every trainable
    tensor moves, each log has the epsilon spent so far (the accountant's, for the steps taken), none has a
    training loss, the held-out evaluation runs, and the progress bar shows the epsilon."""
    import datasets

    rows = [r | {"text": "unused"} for r in token_rows(64)]
    # held out: equal lengths and labels, for the Trainer's own evaluation with default_data_collator
    held_out = [r | {"labels": r["input_ids"]} for r in token_rows(8, seed=1, lengths=(8, 9))]
    train, held_out = datasets.Dataset.from_list(rows), datasets.Dataset.from_list(held_out)
    model = gpt2()
    before = params(model)
    args = training_args(
        tmp_path, eval_strategy="steps", eval_steps=2, disable_tqdm=False, dataloader_pin_memory=False
    )
    trainer = DPTrainer(
        model=model, args=args, train_dataset=train, eval_dataset=held_out,
        data_collator=transformers.default_data_collator, privacy=PrivacyArguments(sigma=1.0, clip=1.0),
    )  # fmt: skip
    out = trainer.train()
    after = params(model)
    assert all(not torch.equal(b, a) for b, a in zip(before, after, strict=True))
    private = trainer.private
    assert private.steps_done == trainer.state.global_step == out.global_step == 4
    logged = [h for h in trainer.state.log_history if "epsilon" in h]
    assert [h["step"] for h in logged] == [2, 4, 4]  # logging_steps=2, then the run's metrics
    for h in logged:
        assert h["epsilon"] == pytest.approx(dab.epsilons(1.0, 8 / 64, h["step"], 1e-5)["rdp"], rel=1e-9)
    assert logged[-1]["epsilon"] == private.epsilon("rdp") == private.epsilon_so_far()["epsilon"]
    assert out.metrics["epsilon"] == private.epsilon("rdp")
    assert not any("loss" in h for h in trainer.state.log_history if "eval_loss" not in h)
    assert [h["step"] for h in trainer.state.log_history if "eval_loss" in h] == [2, 4]
    assert "epsilon=" in capsys.readouterr().err  # on the progress bar


def test_bert_classifier_from_a_list_of_dicts(tmp_path):
    """Sequence classification (per-example cross-entropy) on a plain list of dicts with ``label``, padded per
    example to the longest sequence; the model's own BERT padding id and attention mask."""
    rows = [r | {"label": i % 3} for i, r in enumerate(token_rows(48))]
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(bert_config(num_labels=3))
    before = params(model)
    trainer = DPTrainer(
        model=model, args=training_args(tmp_path, max_steps=3), train_dataset=rows,
        privacy=PrivacyArguments(sigma=1.0, optimizer="adam", **QUICK),
    )  # fmt: skip
    trainer.train()
    assert trainer._loss_kind == "sequence_classification"
    moved = [not torch.equal(b, a) for b, a in zip(before, params(model), strict=True)]
    trainable = [p.requires_grad for p in model.parameters()]
    assert moved == trainable
    assert trainer.state.log_history[-1]["epsilon"] == trainer.private.epsilon("rdp")


# --- (b) batches --------------------------------------------------------------------------------------------------
def test_batches_are_poisson_and_accumulation_makes_logical_batches(tmp_path):
    """per_device_train_batch_size x gradient_accumulation_steps is the Poisson sampler's expected batch; each
    step's batch size varies and runs in micro-batches of at most per_device_train_batch_size examples."""
    model = gpt2()
    trainer = DPTrainer(
        model=model, args=training_args(tmp_path, max_steps=8, gradient_accumulation_steps=3),
        train_dataset=token_rows(64),
        # the post-processing check's replays run the engine on more batches: off, to count the run's own
        privacy=PrivacyArguments(sigma=1.0, post_processing_check="off", **QUICK),
    )  # fmt: skip
    micro, steps = [], []

    class Watch(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            micro.append([])

        def on_step_end(self, args, state, control, **kw):
            steps.append(trainer.last_step.batch_size)

    def record(module, args, kwargs):
        if micro:
            micro[-1].append(kwargs["input_ids"].shape[0])

    trainer.add_callback(Watch())
    handle = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        trainer.train()
    finally:
        handle.remove()
    sampler = trainer.private.plan.sampler
    assert sampler.kind == "poisson" and sampler.expected_batch_size == 12 == trainer.logical_batch_size
    assert trainer.private.backend.physical == 4
    assert len(steps) == 8 and len(set(steps)) > 1  # Poisson: the batch size varies
    assert [sum(m) for m in micro] == steps
    assert all(0 < size <= 4 for m in micro for size in m)


# --- (c) per-example losses ---------------------------------------------------------------------------------------
def test_causal_lm_per_example_loss_against_the_model():
    """Equal lengths: the batch mean is the model's own loss; each example's loss is the model's loss on that
    example alone."""
    model = gpt2().eval()
    ids = torch.randint(1, VOCAB, (5, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        losses = per_example_loss(model, {"input_ids": ids, "labels": ids})
        assert losses.shape == (5,)
        torch.testing.assert_close(losses.mean(), model(input_ids=ids, labels=ids).loss)
        for i in range(5):
            alone = model(input_ids=ids[i : i + 1], labels=ids[i : i + 1]).loss
            torch.testing.assert_close(losses[i], alone)


@pytest.mark.parametrize("family", ["gpt2", "bert_classifier", "bert_mlm"])
def test_padded_training_examples_keep_each_examples_loss(tmp_path, family):
    """The examples the engine reads (collated one by one, padded on the right to the longest): each example's
    loss in the padded batch is the model's own loss on that example alone, unpadded."""
    rows = token_rows(6, lengths=(3, 10))
    if family == "gpt2":
        model = gpt2(dropout=0.0)
    elif family == "bert_classifier":
        torch.manual_seed(0)
        model = transformers.BertForSequenceClassification(bert_config(num_labels=2))
        rows = [r | {"labels": i % 2} for i, r in enumerate(rows)]
    else:
        torch.manual_seed(0)
        model = transformers.BertForMaskedLM(bert_config())
        rows = [r | {"labels": [t if j % 2 else -100 for j, t in enumerate(r["input_ids"])]} for r in rows]
    trainer = DPTrainer(
        model=model, args=training_args(tmp_path), train_dataset=rows, privacy=PrivacyArguments(sigma=1.0)
    )
    examples = trainer._training_examples()
    device = next(model.parameters()).device
    batch = default_collate([examples[i] for i in range(len(rows))])
    lengths = [len(r["input_ids"]) for r in rows]
    assert min(lengths) < max(lengths) and batch["input_ids"].shape == (6, max(lengths))
    assert batch[INDEX_KEY].tolist() == list(range(6))
    batch = {k: v.to(device) for k, v in batch.items() if k != INDEX_KEY}
    model.eval()
    with torch.no_grad():
        losses = per_example_loss(model, batch)
        for i, row in enumerate(rows):
            alone = {k: torch.tensor([v]).to(device) for k, v in row.items()}
            alone.setdefault("labels", alone["input_ids"])  # gpt2: the training examples' labels are made
            torch.testing.assert_close(losses[i], model(**alone).loss, rtol=1e-5, atol=1e-5)


def test_a_per_example_loss_of_ones_own(tmp_path):
    """compute_loss_per_example(model, inputs) replaces the built-in loss: it gets each micro-batch with its labels
    (made from input_ids for a causal LM) and the model the engine runs."""
    calls = []

    def loss(model, inputs):
        calls.append(sorted(inputs))
        return per_example_loss(model, inputs, "causal_lm")

    model = gpt2()
    before = params(model)
    trainer = DPTrainer(
        model=model, args=training_args(tmp_path, max_steps=2), train_dataset=token_rows(32),
        compute_loss_per_example=loss, privacy=PrivacyArguments(sigma=1.0, **QUICK),
    )  # fmt: skip
    trainer.train()
    assert calls and all(c == ["attention_mask", "input_ids", "labels"] for c in calls)
    assert all(not torch.equal(b, a) for b, a in zip(before, params(model), strict=True))


# --- (d) checkpoint and resume --------------------------------------------------------------------------------------
def test_resume_from_a_checkpoint_is_the_uninterrupted_run(tmp_path):
    """Checkpoint at step 3 of 6, the run stopped there; a new DPTrainer on a freshly initialised model resumes
    from it: the final weights are bit-identical (CPU) to the uninterrupted run's, with the same epsilon and the
    same log."""
    rows = token_rows(64)
    kw = dict(max_steps=6, lr_scheduler_type="linear", warmup_steps=2, logging_steps=1)

    def trainer(folder, seed=0, callbacks=None, **extra):
        return DPTrainer(
            model=gpt2(seed), args=training_args(tmp_path / folder, **kw, **extra), train_dataset=rows,
            callbacks=callbacks, privacy=PrivacyArguments(sigma=1.0, **QUICK),
        )  # fmt: skip

    whole = trainer("whole")
    whole.train()

    class Interrupt(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step == 3

    first = trainer("cut", callbacks=[Interrupt()], save_strategy="steps", save_steps=3)
    first.train()
    assert first.state.global_step == 3
    folder = tmp_path / "cut" / "out" / "checkpoint-3"
    assert (folder / "model.safetensors").is_file() and (folder / "privacy_state" / "checkpoint.pt").is_file()
    (folder.parent / "checkpoint-9").mkdir()  # a save killed before its trainer_state.json: not resumed from
    resumed = trainer("cut", seed=1, save_strategy="steps", save_steps=3)  # other initial weights: all loaded
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 6
    assert_same(params(resumed.model), params(whole.model))
    assert resumed.private.epsilon("rdp") == whole.private.epsilon("rdp")
    # the checkpoint's log (steps 1-3), then the resumed run's: the uninterrupted run's log, timings aside
    logs = [
        [
            {k: v for k, v in h.items() if "runtime" not in k and "per_second" not in k}
            for h in t.state.log_history
        ]
        for t in (whole, resumed)
    ]
    assert logs[1] == logs[0]


def test_a_checkpoint_without_privacy_state_is_refused(tmp_path):
    (tmp_path / "plain").mkdir()
    trainer = DPTrainer(
        model=gpt2(), args=training_args(tmp_path), train_dataset=token_rows(16), privacy={"sigma": 1.0}
    )
    with pytest.raises(dab.ConfigError, match="not a DPTrainer checkpoint") as err:
        trainer.train(resume_from_checkpoint=str(tmp_path / "plain"))
    one_line(err)


# --- (e) epsilon budget ---------------------------------------------------------------------------------------------
def test_an_epsilon_budget_stops_the_run_before_it_is_exceeded(tmp_path, caplog):
    eps = [dab.epsilons(1.0, 8 / 64, k, 1e-5)["rdp"] for k in (3, 4)]
    budget = (eps[0] + eps[1]) / 2
    trainer = DPTrainer(
        model=gpt2(), args=training_args(tmp_path, max_steps=10), train_dataset=token_rows(64),
        privacy=PrivacyArguments(sigma=1.0, epsilon_budget=budget, **QUICK),
    )  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="dp_adam_bench.hf_trainer"):
        out = trainer.train()
    assert trainer.private.steps == out.global_step == trainer.state.max_steps == 3
    assert out.metrics["epsilon"] == pytest.approx(eps[0]) and out.metrics["epsilon"] <= budget
    assert "stops the run after 3 of its 10 planned steps" in caplog.text
    assert "stopped by epsilon_budget" in caplog.text


# --- (f) refusals -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args, match",
    [
        ({"fp16": True}, "fp16=True"),
        ({"lr_scheduler_type": "cosine"}, "lr_scheduler_type='cosine'"),
        ({"train_sampling_strategy": "group_by_length"}, "train_sampling_strategy='group_by_length'"),
        ({"auto_find_batch_size": True}, "auto_find_batch_size"),
        ({"lr_scheduler_type": "constant", "warmup_steps": 2}, "warm up with 'linear'"),
    ],
)
def test_what_cannot_be_honest_is_refused_in_one_line(tmp_path, args, match):
    with pytest.raises(dab.ConfigError, match=match) as err:
        DPTrainer(
            model=gpt2(), args=training_args(tmp_path, **args), train_dataset=token_rows(16), privacy={}
        )
    one_line(err)


def test_other_refusals(tmp_path):
    rows = token_rows(16)
    frozen = gpt2().requires_grad_(False)
    with pytest.raises(dab.ConfigError, match="no trainable parameters") as err:
        DPTrainer(model=frozen, args=training_args(tmp_path), train_dataset=rows, privacy={"sigma": 1.0})
    one_line(err)
    with pytest.raises(dab.ConfigError, match="give sigma= .* or target_epsilon="):
        DPTrainer(model=gpt2(), args=training_args(tmp_path), train_dataset=rows, privacy={})
    with pytest.raises(dab.ConfigError, match="fixed-size samplers run full passes; set max_steps=-1") as err:
        DPTrainer(
            model=gpt2(), args=training_args(tmp_path), train_dataset=rows,
            privacy={"sigma": 1.0, "noise": "bandmf", "noise_args": {"bands": 2}},
        )  # fmt: skip
    one_line(err)
    with pytest.raises(dab.ConfigError, match="compute_loss_per_example"):
        DPTrainer(
            model=gpt2(), args=training_args(tmp_path), train_dataset=rows, privacy={"sigma": 1.0},
            compute_loss_func=lambda outputs, labels, num_items_in_batch=None: outputs.loss,
        )  # fmt: skip
    trainer = DPTrainer(
        model=gpt2(), args=training_args(tmp_path, max_steps=1), train_dataset=rows,
        privacy=PrivacyArguments(sigma=1.0, **QUICK),
    )  # fmt: skip
    trainer.train()
    with pytest.raises(dab.ConfigError, match="already ran") as err:
        trainer.train()
    one_line(err)


def test_bf16_is_make_privates_bf16_precision(tmp_path):
    """bf16=True: the forward and backward under bf16 autocast, parameters, norms and noise fp32."""
    trainer = DPTrainer(
        model=gpt2(), args=training_args(tmp_path, max_steps=1, bf16=True, use_cpu=True),
        train_dataset=token_rows(16), privacy=PrivacyArguments(sigma=1.0, **QUICK),
    )  # fmt: skip
    trainer.train()
    assert trainer.private.run.cfg.train.precision == "bf16"
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())


# --- (g) without noise or clipping: plain SGD -------------------------------------------------------------------------
def test_noiseless_unclipped_sgd_step_is_torch_sgd(tmp_path):
    """noise='none', optimizer='sgd' and an expected batch of the whole data set (Poisson at q = 1: every example):
    one step is torch.optim.SGD's on the model's own mean loss."""
    ids = torch.randint(1, VOCAB, (16, 8), generator=torch.Generator().manual_seed(0))
    rows = [{"input_ids": r.tolist()} for r in ids]
    model = gpt2(dropout=0.0)
    trainer = DPTrainer(
        model=model, args=training_args(tmp_path, max_steps=1, per_device_train_batch_size=8, learning_rate=0.5),
        train_dataset=rows, privacy=PrivacyArguments(noise="none", optimizer="sgd", **QUICK),
    )  # fmt: skip
    reference = gpt2(dropout=0.0).to(next(model.parameters()).device)
    opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    batch = ids.to(next(model.parameters()).device)
    reference(input_ids=batch, labels=batch).loss.backward()
    opt.step()
    out = trainer.train()
    assert trainer.last_step.batch_size == 16
    assert out.metrics["epsilon"] == float("inf")  # not private
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_privacy_arguments_from_the_command_line():
    parser = transformers.HfArgumentParser((transformers.TrainingArguments, PrivacyArguments))
    _, privacy = parser.parse_args_into_dataclasses(
        [
            "--output_dir",
            "unused",
            "--target_epsilon",
            "8",
            "--noise_args",
            '{"bands": 4}',
            "--report_to",
            "none",
        ]
    )
    assert privacy.target_epsilon == 8.0 and privacy.noise_args == {"bands": 4}
