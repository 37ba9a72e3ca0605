"""A Hugging Face ``Trainer`` that trains privately: swap ``Trainer(...)`` for ``DPTrainer(..., privacy=...)``.

>>> from dp_adam_bench.hf_trainer import DPTrainer, PrivacyArguments
>>> trainer = DPTrainer(model=model, args=training_args, train_dataset=train, eval_dataset=held_out,
...                     data_collator=collator, privacy=PrivacyArguments(target_epsilon=8.0, clip=1.0))
>>> trainer.train()                      # logs "epsilon" beside the learning rate; the progress bar shows it
>>> trainer.train(resume_from_checkpoint=True)   # in a new process: continues the same privacy state

:meth:`DPTrainer.train` builds the run with :func:`dp_adam_bench.make_private`, the same
:class:`~dp_adam_bench.engine.session.PrivateTraining` the CLI drives (its variants, noise mechanisms, samplers,
clipping engines and accountants), and steps it, driving the Trainer's own machinery around each step.

What it uses of the ``Trainer``: ``TrainingArguments`` (``learning_rate``, ``lr_scheduler_type`` ``constant`` or
``linear`` with ``warmup_steps``, ``weight_decay``, ``adam_beta1`` / ``adam_beta2`` / ``adam_epsilon`` where the
variant has them, ``max_steps`` or ``num_train_epochs``, ``per_device_train_batch_size`` and
``gradient_accumulation_steps``, ``seed``, ``bf16``, the logging / evaluation / save strategies and steps,
``save_total_limit``, ``load_best_model_at_end``), ``self.state`` (``global_step``, ``epoch``, ``log_history``,
``trainer_state.json``), ``self.callback_handler``'s events (the progress bar, the logging integrations and
callbacks such as ``EarlyStoppingCallback`` see the Trainer's events), the ``data_collator`` (applied to one
example at a time, see below), the removal of the columns the model's ``forward`` does not take,
:meth:`~transformers.Trainer.evaluate` on ``eval_dataset`` (the model's own mean loss and ``compute_metrics``:
held-out data, not the private training set), and :meth:`~transformers.Trainer.save_model` /
``_load_from_checkpoint`` for the weights, in the Trainer's layout ``output_dir/checkpoint-<step>/``.

What it does not use, and why: the Trainer's training loop (its ``DataLoader`` shuffles the data into batches of a
fixed size, which the accountant's Poisson sampling is not, and its loss is the batch mean, whose gradient cannot be
clipped per example); its optimizer and scheduler (the variant of ``PrivacyArguments.optimizer`` updates the
parameters with the noisy gradient; ``optim`` is ignored); ``max_grad_norm`` (the Trainer's clipping of the batch
gradient: DP clips each example's gradient to ``PrivacyArguments.clip`` instead); the training loss (see below).

* **Batches.** ``batch_size = per_device_train_batch_size × gradient_accumulation_steps`` is the *expected*
  logical batch size of the sampler the accountant assumes (Poisson for independent noise): each step's batch
  size varies, the noisy sum is divided by the expected size, and the logical batch runs in micro-batches of
  ``per_device_train_batch_size`` examples (the Trainer's gradient accumulation, as logical batches).
* **Per-example losses** (Li, Tramer, Liang & Hashimoto 2022, "Large language models can be strong differentially
  private learners", arXiv 2110.05679: a sequence's loss is the mean over its own tokens, so each example's
  gradient is clipped as one unit): ``loss_kind="auto"`` picks from the model's class ``causal_lm`` (labels
  shifted by one, -100 ignored, mean over each example's predicted tokens), ``masked_lm`` and
  ``token_classification`` (mean over each example's labelled tokens), ``sequence_classification`` (cross-entropy,
  MSE or BCE per example, as the model's ``problem_type``); or pass ``compute_loss_per_example(model, inputs) ->
  (batch,)`` (or override the method of that name).
* **Collation.** The engine draws examples by index, so each example goes through the ``data_collator`` alone and is
  padded on the right to the longest ``input_ids`` of the training set (``attention_mask`` 0, ``labels`` -100):
  padded positions change no example's loss, and every micro-batch has the same shape. A collator that draws random
  numbers (masked-LM masking) does so under torch's generator seeded from (``seed``, the example, the step), so the
  engine's checks and a resume do not change the masks.
* **Logs.** Every ``logging_steps`` the log has ``epsilon`` (spent so far, under ``PrivacyArguments.accountant`` at
  ``delta``: :meth:`PrivateTraining.epsilon_so_far`; ``inf`` for a non-private ``noise="none"`` run) and
  ``learning_rate``; the progress bar shows the epsilon too. The training loss is **not** logged: it is a statistic
  of the private batch, which the mechanism does not release (only the noisy clipped sum), and the logs go to the
  integrations (W&B, TensorBoard, the Hub); the repository keeps such diagnostics out of them (``diag/`` keys,
  :mod:`dp_adam_bench.tracking.run_store`). Watch ``eval_loss`` on held-out data instead; ``trainer.last_step``
  holds the last step's :class:`~dp_adam_bench.engine.session.StepResult` (batch size, per-example norms) for
  private debugging.
* **Checkpoints** (``save_strategy``): the model, the training arguments and ``trainer_state.json`` as the Trainer
  writes them, and the privacy state (:meth:`PrivateTraining.state_dict`: sampler position, noise generators and
  mechanism state, ledger, variant state, random streams) in ``checkpoint-<step>/privacy_state/``
  (:mod:`dp_adam_bench.engine.checkpoint`: atomic, loaded without unpickling code, refused when written by another
  configuration). ``train(resume_from_checkpoint=True | path)`` restores both and continues exactly as the
  uninterrupted run; a resume whose privacy plan differs from the checkpoint's (another ``train_dataset`` size,
  batch, sampler, sigma, ...) is refused in one line naming what changed, before anything is loaded. The privacy
  state holds the noise generators' state: keep checkpoints as private as the data (they are not pushed to the Hub;
  ``push_to_hub`` of the final model pushes no ``checkpoint-*`` folder), and a ``secure_rng`` run writes none.
* **Model selection.** ``load_best_model_at_end`` and ``EarlyStoppingCallback`` choose by ``eval_dataset``'s
  metrics; the epsilon covers the training set only, so evaluate on public or held-out data.
* **Budget.** With ``epsilon_budget`` the run stops before the step that would exceed it (the plan caps the steps;
  ``state.max_steps`` is the capped count), and a log line says so.

Refused in one :class:`~dp_adam_bench.errors.ConfigError` line: several GPUs or distributed launches (the CLI's
``torchrun`` path trains data-parallel), DeepSpeed / FSDP, ``fp16`` (``bf16`` trains under bf16 autocast with fp32
parameters: ``precision="bf16"``), a ``train_sampling_strategy`` / ``group_by_length`` other than the default,
learning-rate schedules other than ``constant`` / ``linear``, ``auto_find_batch_size``, ``label_smoothing_factor``,
``model_init`` and hyperparameter search, an optimizer or ``compute_loss_func`` given to the Trainer, an iterable
data set, a model without trainable parameters, and a second ``train()`` without ``resume_from_checkpoint`` (its
epsilon would not include the first run's).

Prior art: dp-transformers (Wutschitz, Inan & Manoel, microsoft/dp-transformers) adapts the Trainer to Opacus with
``OpacusDPTrainer`` (Poisson batches through Opacus' data loader) and a ``DPCallback`` that steps the private
optimizer and accountant from the Trainer's own loop. Here the loop is the engine's, because the engine, not the
Trainer, must choose the batches, the micro-batches and the per-example losses the accountant's guarantee is about.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from torch import nn
from torch.nn import functional as F
from transformers.trainer_callback import ExportableState, ProgressCallback, TrainerState
from transformers.trainer_utils import (
    PREFIX_CHECKPOINT_DIR,
    SaveStrategy,
    TrainOutput,
    rotate_checkpoints,
    speed_metrics,
)
from transformers.training_args import ParallelMode

from dp_adam_bench.errors import ConfigError

__all__ = ["DPTrainer", "PrivacyArguments", "per_example_loss", "loss_kind_of", "LOSS_KINDS"]

log = logging.getLogger(__name__)

#: the per-example losses :func:`per_example_loss` computes from a model's logits and ``labels``
LOSS_KINDS = ("causal_lm", "masked_lm", "token_classification", "sequence_classification")
#: the folder of a checkpoint that holds the privacy state (beside the Trainer's files)
PRIVACY_STATE_DIR = "privacy_state"
#: the key under which each training example carries its index (the engine's "target": the model sees the rest)
INDEX_KEY = "dp_example_index"
IGNORE_INDEX = -100
_TRAINER_STATE = "trainer_state.json"


@dataclass
class PrivacyArguments:
    """The privacy of a :class:`DPTrainer` run: :func:`dp_adam_bench.make_private`'s arguments that
    ``TrainingArguments`` has no field for (the rest come from it: see the module docstring). A dataclass, so
    ``transformers.HfArgumentParser((TrainingArguments, PrivacyArguments))`` reads it from the command line."""

    target_epsilon: float | None = field(
        default=None, metadata={"help": "calibrate sigma to this epsilon over the whole run (sigma unset)"}
    )
    sigma: float | None = field(default=None, metadata={"help": "noise multiplier (or give target_epsilon)"})
    epsilon_budget: float | None = field(
        default=None, metadata={"help": "stop before the step that would exceed this epsilon"}
    )
    delta: float = field(default=1e-5, metadata={"help": "delta of the (epsilon, delta) guarantee"})
    clip: float | None = field(default=1.0, metadata={"help": "per-example L2 clip norm C"})
    optimizer: str = field(
        default="adamw",
        metadata={
            "help": "variant of configs/optimizer/ (adamw: the Trainer's AdamW; adam, adambc, sgd, ...); "
            "learning_rate and weight_decay come from TrainingArguments"
        },
    )
    optimizer_args: dict[str, Any] | str | None = field(
        default=None, metadata={"help": "the variant's other fields (make_private's optimizer_args; JSON)"}
    )
    noise: str = field(
        default="independent", metadata={"help": "none | independent | dpmf_sqrt | bandmf | blt"}
    )
    noise_args: dict[str, Any] | str | None = field(
        default=None, metadata={"help": "the mechanism's fields, e.g. {'bands': 4} (JSON)"}
    )
    sampler: str | None = field(
        default=None, metadata={"help": "default: poisson (independent noise), single_pass (correlated)"}
    )
    accountant: str = field(default="rdp", metadata={"help": "rdp | prv | pld (epsilon, target and budget)"})
    clipping: str = field(
        default="bk", metadata={"help": "per-example clipping engine: bk | ghost | hooks | ..."}
    )
    loss_kind: str = field(
        default="auto",
        metadata={"help": "auto | causal_lm | masked_lm | token_classification | sequence_classification"},
    )
    secure_rng: bool = field(
        default=False,
        metadata={"help": "sampler and noise seeds from the OS CSPRNG (real data; no checkpoints)"},
    )
    self_check: bool = field(
        default=True, metadata={"help": "check the engine against the size-one loop before the first step"}
    )
    engine_watch_every: str = field(
        default="auto",
        metadata={"help": "re-check the engine: auto, or every N steps (0: after a resume only)"},
    )
    post_processing_check: str = field(
        default="auto",
        metadata={
            "help": "replay steps with another private batch behind the same release, everything emitted compared: "
            "auto, every N steps (0: first step and resume only), or off"
        },
    )

    def __post_init__(self):
        for name in ("optimizer_args", "noise_args"):  # from the command line: JSON
            value = getattr(self, name)
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as err:
                    raise ConfigError(f"{name}={value!r} is not JSON: {err}") from None
                setattr(self, name, value)
            if value is not None and not isinstance(value, Mapping):
                raise ConfigError(f"{name}={value!r} must be a dict of the fields to set")


# --- per-example losses -------------------------------------------------------------------------------------------
def loss_kind_of(model: nn.Module) -> str:
    """The per-example loss a Hugging Face model's head calls for (one of :data:`LOSS_KINDS`), from its class (the
    base model of a PEFT model); ConfigError when the class does not say."""
    from transformers.models.auto import modeling_auto as auto

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    name = type(base).__name__
    tables = {
        "causal_lm": auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        "masked_lm": auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
        "token_classification": auto.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES,
        "sequence_classification": auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
    }
    for kind, table in tables.items():
        names = {n for v in table.values() for n in ((v,) if isinstance(v, str) else v)}
        if name in names:
            return kind
    suffixes = {
        "causal_lm": ("ForCausalLM", "LMHeadModel"),
        "masked_lm": ("ForMaskedLM",),
        "token_classification": ("ForTokenClassification",),
        "sequence_classification": ("ForSequenceClassification",),
    }
    for kind, ends in suffixes.items():
        if name.endswith(ends):
            return kind
    raise ConfigError(
        f"loss_kind='auto' cannot tell the per-example loss of a {name}; pass PrivacyArguments(loss_kind=...) "
        f"({', '.join(LOSS_KINDS)}) or DPTrainer(compute_loss_per_example=fn(model, inputs) -> (batch,))"
    )


def per_example_loss(
    model: nn.Module, inputs: Mapping[str, torch.Tensor], kind: str = "auto"
) -> torch.Tensor:
    """One loss per example, shape ``(batch,)``, of ``model`` on ``inputs`` (the model's keyword arguments and
    ``labels``, which the model is not given: the loss is computed here from its logits). ``kind``: one of
    :data:`LOSS_KINDS`, or ``auto`` (:func:`loss_kind_of`). The batch mean equals the model's own ``loss`` where
    that is a mean over examples (sequence classification) or, for token losses, where every example has the same
    number of labelled tokens."""
    if kind == "auto":
        kind = loss_kind_of(model)
    if kind not in LOSS_KINDS:
        raise ConfigError(f"loss_kind={kind!r} is not known; valid: auto, {', '.join(LOSS_KINDS)}")
    if "labels" not in inputs:
        raise ConfigError(
            f"the training examples have no 'labels' (after the data collator) for the {kind} loss; add them, or "
            "pass compute_loss_per_example"
        )
    labels = inputs["labels"]
    out = model(**{k: v for k, v in inputs.items() if k != "labels"})
    logits = out.logits if hasattr(out, "logits") else out[0]
    if kind == "sequence_classification":
        return _sequence_classification_losses(model, logits, labels)
    if kind == "causal_lm":  # token t predicts token t + 1
        logits, labels = logits[:, :-1], labels[:, 1:]
    token = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]),
        labels.reshape(-1),
        reduction="none",
        ignore_index=IGNORE_INDEX,
    ).view(labels.shape)
    return token.sum(1) / (labels != IGNORE_INDEX).sum(1).clamp(min=1)


def _sequence_classification_losses(model: nn.Module, logits: torch.Tensor, labels: torch.Tensor):
    """As ``*ForSequenceClassification`` computes its loss (``config.problem_type``, else from ``num_labels`` and
    the labels' dtype), one value per example."""
    config = getattr(model, "config", None)
    num_labels = logits.shape[-1]
    problem = getattr(config, "problem_type", None)
    if problem is None:
        if num_labels == 1:
            problem = "regression"
        elif labels.dtype in (torch.long, torch.int):
            problem = "single_label_classification"
        else:
            problem = "multi_label_classification"
    logits = logits.float()
    if problem == "regression":
        diff = logits.view(len(labels), -1) - labels.float().view(len(labels), -1)
        return (diff**2).mean(1)
    if problem == "single_label_classification":
        return F.cross_entropy(logits.view(-1, num_labels), labels.view(-1), reduction="none")
    return F.binary_cross_entropy_with_logits(logits, labels.float(), reduction="none").mean(1)


class _PerExampleLoss(nn.Module):
    """The model as the engine trains it: ``forward(**inputs)`` returns each example's loss, ``fn(model, inputs)``
    on the whole batch (labels included). The engine's hooks act on the model's layers inside."""

    def __init__(self, model: nn.Module, fn: Callable[[nn.Module, dict], torch.Tensor]):
        super().__init__()
        self.model = model
        self._fn = fn

    def forward(self, **inputs):
        return self._fn(self.model, inputs)


def _losses_as_given(losses: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``make_private``'s ``loss_fn``: the wrapped model already returns one loss per example."""
    return losses


# --- the training examples as the engine reads them ---------------------------------------------------------------
class _TrainingExamples:
    """The training set as ``make_private`` reads it: example ``i`` through the Trainer's data collator alone, its
    token sequences padded on the right to ``length``, with its index under :data:`INDEX_KEY`."""

    def __init__(
        self,
        dataset,
        collate,
        keep,
        length,
        pad_values,
        pad_labels,
        add_mask,
        lm_labels,
        seed,
        step,
        name="training",
    ):
        self.dataset, self.collate, self.keep = dataset, collate, keep
        self.length, self.pad_values, self.pad_labels = length, pad_values, pad_labels
        self.add_mask, self.lm_labels = add_mask, lm_labels
        self.seed, self.step, self.name = seed, step, name

    def __len__(self) -> int:
        return len(self.dataset)

    def example_content(self, i: int):
        """Example ``i`` as the data set holds it, in the columns the model reads: what the public / private
        overlap check compares (:func:`~dp_adam_bench.engine.public_data.check_disjoint`), before the collator's
        random masking (a function of the position) and without the index key."""
        item = self.dataset[int(i)]
        if self.keep is not None:
            item = {k: v for k, v in item.items() if k in self.keep}
        return item

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        i = int(i)
        item = self.example_content(i)
        # a collator's random draws (masked-LM masking): a function of the seed, the example and the step
        seed = np.random.SeedSequence([self.seed, i, self.step()]).generate_state(1, np.uint64)[0] >> 1
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(seed))
            batch = self.collate([item])
        example = {k: v[0] for k, v in batch.items() if isinstance(v, torch.Tensor)}
        if "input_ids" in example and self.length is not None:
            example = self._padded(example, i)
        example[INDEX_KEY] = torch.tensor(i)
        return example

    def _padded(self, ex: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
        n = ex["input_ids"].shape[0]
        if n > self.length:
            raise ConfigError(
                f"the data collator made {self.name} example {i} longer than the longest input_ids of the "
                f"{self.name} set ({n} > {self.length} tokens); pad or truncate the data set itself"
            )
        if self.add_mask and "attention_mask" not in ex:
            ex["attention_mask"] = torch.ones(n, dtype=torch.long)
        if self.lm_labels and "labels" not in ex:  # as DataCollatorForLanguageModeling(mlm=False)
            labels = ex["input_ids"].clone()
            if "attention_mask" in ex:
                labels[ex["attention_mask"] == 0] = IGNORE_INDEX
            ex["labels"] = labels
        if n == self.length:
            return ex
        out = {}
        for k, v in ex.items():
            if v.ndim >= 1 and v.shape[0] == n and (k != "labels" or self.pad_labels):
                tail = v.new_full((self.length - n, *v.shape[1:]), self.pad_values.get(k, 0))
                v = torch.cat([v, tail])
            out[k] = v
        return out


def _longest(dataset) -> int | None:
    """The longest ``input_ids`` of the data set (a ``datasets.Dataset`` column read at once); None without any."""
    names = getattr(dataset, "column_names", None)
    if names is not None:
        return max(map(len, dataset["input_ids"])) if "input_ids" in names else None
    first = dataset[0]
    if not isinstance(first, Mapping) or "input_ids" not in first:
        return None
    return max(len(dataset[i]["input_ids"]) for i in range(len(dataset)))


# --- the trainer --------------------------------------------------------------------------------------------------
class DPTrainer(transformers.Trainer):
    """A :class:`transformers.Trainer` whose :meth:`train` trains privately (the module docstring).

    ``privacy``: a :class:`PrivacyArguments` (or a dict of its fields). ``compute_loss_per_example(model, inputs) ->
    (batch,)``: one loss per example instead of the built-in loss of ``privacy.loss_kind``. ``public_dataset``:
    public rows, in ``train_dataset``'s form, for ``privacy.optimizer="side_info"`` alone (required by it, refused
    otherwise; :func:`dp_adam_bench.make_private`'s ``public_dataset``): collated and padded as the training rows,
    never sampled, clipped, noised or accounted, and refused if a row of it is one of ``train_dataset``'s (by
    content: :mod:`dp_adam_bench.engine.public_data`). Every other argument is the ``Trainer``'s. After
    :meth:`train`, :attr:`private` is the run (``trainer.private.epsilon()``, ``.guarantee()``,
    ``.check_participation()``)."""

    def __init__(
        self,
        *args,
        privacy: PrivacyArguments | Mapping[str, Any],
        compute_loss_per_example: Callable[[nn.Module, dict], torch.Tensor] | None = None,
        public_dataset=None,
        **kwargs,
    ):
        if isinstance(privacy, Mapping):
            privacy = PrivacyArguments(**privacy)
        if not isinstance(privacy, PrivacyArguments):
            raise ConfigError(
                f"privacy must be a PrivacyArguments (or a dict of its fields), got {privacy!r}"
            )
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if training_args is not None:  # before the Trainer sets up devices and precision for them
            _refuse_training_args(training_args)
        _refuse_trainer_arguments(args, kwargs)
        super().__init__(*args, **kwargs)
        _refuse_training_args(self.args)
        _warn_ignored(self.args)
        self.privacy = privacy
        self._loss_fn = compute_loss_per_example
        self._loss_kind = None
        if compute_loss_per_example is None:
            kind = privacy.loss_kind
            if kind != "auto" and kind not in LOSS_KINDS:
                raise ConfigError(f"loss_kind={kind!r} is not known; valid: auto, {', '.join(LOSS_KINDS)}")
            self._loss_kind = loss_kind_of(self.model) if kind == "auto" else kind
        if not any(p.requires_grad for p in self.model.parameters()):
            raise ConfigError(
                f"the model ({type(self.model).__name__}) has no trainable parameters: nothing to train privately"
            )
        if privacy.noise != "none" and privacy.sigma is None and privacy.target_epsilon is None:
            raise ConfigError(
                "PrivacyArguments: give sigma= (noise multiplier) or target_epsilon= (sigma calibrated)"
            )
        sampler = _sampler_of(privacy)
        if self.args.max_steps > 0 and sampler not in (None, "poisson", "cyclic_poisson"):
            raise ConfigError(
                f"max_steps={self.args.max_steps} with sampler={sampler!r}: fixed-size samplers run full passes; "
                "set max_steps=-1 and num_train_epochs"
            )
        if privacy.secure_rng and self.args.save_strategy != SaveStrategy.NO:
            raise ConfigError(
                "secure_rng=True writes no checkpoints (they would hold the noise generators' state): set "
                "TrainingArguments(save_strategy='no')"
            )
        if self.train_dataset is not None:
            _refuse_dataset(self.train_dataset)
        if public_dataset is not None:
            _refuse_dataset(public_dataset, "public_dataset")
        _refuse_public_mismatch(privacy.optimizer, public_dataset)
        #: side information's public examples (``PrivacyArguments.optimizer="side_info"`` alone): never sampled,
        #: clipped, noised or accounted, never cut from ``train_dataset``
        self.public_dataset = public_dataset
        self._private = None
        self._started = False
        #: the last step's :class:`~dp_adam_bench.engine.session.StepResult` (private: batch size, norms)
        self.last_step = None

    # --- what the run is ------------------------------------------------------------------------------------------
    @property
    def private(self):
        """The :class:`~dp_adam_bench.engine.session.PrivateTraining` of the last :meth:`train` (None before)."""
        return self._private

    @property
    def logical_batch_size(self) -> int:
        """The expected logical batch size: ``per_device_train_batch_size × gradient_accumulation_steps``."""
        return int(self.args.per_device_train_batch_size) * int(self.args.gradient_accumulation_steps)

    def compute_loss_per_example(self, model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """One loss per example, shape ``(batch,)``: ``compute_loss_per_example`` as given, else
        :func:`per_example_loss` of ``privacy.loss_kind``. Override it in a subclass as ``compute_loss``."""
        if self._loss_fn is not None:
            return self._loss_fn(model, inputs)
        return per_example_loss(model, inputs, self._loss_kind)

    # --- training -------------------------------------------------------------------------------------------------
    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial=None,
        ignore_keys_for_eval: list[str] | None = None,
        **kwargs,
    ) -> TrainOutput:
        """Train privately to the end of the plan (or the epsilon budget); ``resume_from_checkpoint`` (``True``: the
        last ``checkpoint-*`` of ``output_dir``) restores the model and the privacy state and continues exactly as
        the uninterrupted run. Returns the Trainer's ``TrainOutput`` with ``training_loss = nan`` (not computed: a
        statistic of private data) and ``metrics`` with the run's ``epsilon``."""
        if trial is not None or kwargs:
            raise ConfigError(
                "DPTrainer.train: hyperparameter search (trial) and other train() arguments are not supported: "
                "each trial would spend privacy on the same data"
            )
        if resume_from_checkpoint is False:
            resume_from_checkpoint = None
        if self._started and resume_from_checkpoint is None:
            raise ConfigError(
                "train() already ran on this DPTrainer: a second run from its weights would report an epsilon "
                "without the first's; pass resume_from_checkpoint, or make a new DPTrainer and model"
            )
        if self.train_dataset is None:
            raise ConfigError("DPTrainer.train needs a train_dataset")
        _refuse_dataset(self.train_dataset)
        checkpoint = self._checkpoint_folder(resume_from_checkpoint)
        if checkpoint is not None:  # another train_dataset: refused before the run is even built
            self._refuse_changed_run(checkpoint, {"population": len(self.train_dataset)})
        if self._private is not None:
            self._private.close()
            self._private = None
        private = self._private = self._make_private()
        self._started = True
        self.is_in_train = True
        try:
            # a resume compares the whole privacy plan and the configuration with the checkpoint's before it loads
            # anything: the weights, the Trainer's state, then the privacy state
            payload = self._privacy_payload(private, checkpoint) if checkpoint is not None else None
            if checkpoint is not None:
                self._load_from_checkpoint(checkpoint)  # the weights, as the Trainer loads them
            self._start_state(private, checkpoint)
            if payload is not None:
                private.load_state_dict(payload)
            return self._train_steps(private, ignore_keys_for_eval)
        except BaseException:
            private.close()  # the engine's hooks off the model; the run's privacy record stays in self.private
            self.is_in_train = False
            raise

    def _checkpoint_folder(self, resume_from_checkpoint) -> str | None:
        if resume_from_checkpoint is None:
            return None
        if resume_from_checkpoint is True:
            folder = _last_complete_checkpoint(self.args.output_dir)
            if folder is None:
                raise ConfigError(
                    f"resume_from_checkpoint=True: no complete DPTrainer checkpoint-* folder in "
                    f"{self.args.output_dir}"
                )
        else:
            folder = str(resume_from_checkpoint)
        if not os.path.isdir(os.path.join(folder, PRIVACY_STATE_DIR)):
            raise ConfigError(
                f"resume_from_checkpoint={folder!r} holds no {PRIVACY_STATE_DIR}/ (not a DPTrainer checkpoint): "
                "without the privacy state the run cannot continue its sampler, noise and ledger"
            )
        return folder

    def _make_private(self):
        """:func:`~dp_adam_bench.make_private` from the training arguments and ``self.privacy``."""
        from dp_adam_bench.api import make_private

        args, p = self.args, self.privacy
        examples, public = self._example_sets()
        batch = self.logical_batch_size
        length = {"steps": int(args.max_steps)} if args.max_steps > 0 else {"epochs": args.num_train_epochs}
        schedule, warmup = _schedule(args, batch, len(examples), length)
        return make_private(
            _PerExampleLoss(self.model, self.compute_loss_per_example),
            examples,
            _losses_as_given,
            optimizer=p.optimizer,
            noise=p.noise,
            clip=p.clip,
            sigma=p.sigma,
            target_epsilon=p.target_epsilon,
            epsilon_budget=p.epsilon_budget,
            delta=p.delta,
            batch_size=batch,
            sampler=p.sampler,
            accountant=p.accountant,
            lr=args.learning_rate,
            lr_schedule=schedule,
            lr_warmup_steps=warmup,
            optimizer_args=_optimizer_args(args, p),
            weight_decay=args.weight_decay,
            noise_args=p.noise_args,
            clipping=p.clipping,
            physical_batch_size=int(args.per_device_train_batch_size),
            precision="bf16" if args.bf16 else "fp32",
            target_key=INDEX_KEY,
            seed=int(args.seed),
            secure_rng=p.secure_rng,
            self_check=p.self_check,
            engine_watch_every=_watch_every(p.engine_watch_every),
            public_dataset=public,
            post_processing_check=_watch_every(p.post_processing_check),
            **length,
        )

    def _training_examples(self) -> _TrainingExamples:
        """The training set through the collator, one example at a time, padded (:meth:`_example_sets`)."""
        return self._example_sets()[0]

    def _example_sets(self) -> tuple[_TrainingExamples, _TrainingExamples | None]:
        """The training set, and the public set where one was given, through the collator one example at a time,
        each padded to the longest ``input_ids`` of the two."""
        self._set_signature_columns_if_needed()
        sets = [self._model_columns(self.train_dataset, "training")]
        if self.public_dataset is not None:
            sets.append(self._model_columns(self.public_dataset, "public"))
        longest = [n for n in (_longest(d) for d, _ in sets) if n is not None]
        length = _padded_length(max(longest) if longest else None, self.data_collator)
        accepts = set(self._signature_columns)
        # with a loss of one's own, the padding follows the model's convention (a causal LM's labels are its input)
        kind = self._loss_kind or _kind_or_none(self.model)
        examples = [
            _TrainingExamples(
                dataset,
                self.data_collator,
                keep,
                length,
                self._pad_values(),
                pad_labels=kind != "sequence_classification",
                add_mask="attention_mask" in accepts,
                lm_labels=kind == "causal_lm",
                seed=int(self.args.seed),
                step=lambda: self._private.steps_done if self._private is not None else 0,
                name=name,
            )
            for (dataset, keep), name in zip(sets, ("training", "public"), strict=False)
        ]
        return examples[0], (examples[1] if len(examples) > 1 else None)

    def _model_columns(self, dataset, description: str):
        """(``dataset``, the columns to keep or None): the columns the model's ``forward`` does not take removed, as
        the Trainer does with ``remove_unused_columns``."""
        if not self.args.remove_unused_columns:
            return dataset, None
        if hasattr(dataset, "column_names") and hasattr(dataset, "remove_columns"):
            return self._remove_unused_columns(dataset, description=description), None
        return dataset, set(self._signature_columns)

    def _pad_values(self) -> dict[str, int]:
        """What pads each token key: the tokenizer's pad id (else the model config's, else 0), mask 0, labels
        -100."""
        tokenizer = self.processing_class or getattr(self.data_collator, "tokenizer", None)
        pad = getattr(tokenizer, "pad_token_id", None)
        if pad is None:
            pad = getattr(getattr(self.model, "config", None), "pad_token_id", None)
        return {
            "input_ids": int(pad) if pad is not None else 0,
            "attention_mask": 0,
            "labels": IGNORE_INDEX,
            "special_tokens_mask": 1,
            "token_type_ids": int(getattr(tokenizer, "pad_token_type_id", 0) or 0),
        }

    def _start_state(self, private, checkpoint: str | None) -> None:
        """``self.state`` for a run of ``private.steps`` steps (from the checkpoint's ``trainer_state.json`` on
        resume), the callbacks' references, and the budget's log line."""
        args = self.args
        self.state = TrainerState(stateful_callbacks=_stateful(self))
        if checkpoint is not None and os.path.isfile(os.path.join(checkpoint, _TRAINER_STATE)):
            self.state = TrainerState.load_from_json(os.path.join(checkpoint, _TRAINER_STATE))
            self._load_callback_state()
        self.state.train_batch_size = int(args.per_device_train_batch_size)
        self.state.compute_steps(args, private.steps)
        epochs = private.steps * self._passes_per_step(private)
        self.state.init_training_references(self, private.steps, math.ceil(epochs - 1e-9), None)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        plan = private.plan
        log.info(
            "DPTrainer: %d steps, expected batch %g (%s sampling, micro-batches of %d), sigma %.4g, clip %s, "
            "epsilon under %s at delta %g",
            private.steps,
            plan.sampler.expected_batch_size,
            plan.sampler.kind,
            args.per_device_train_batch_size,
            private.sigma,
            private.clip,
            plan.accountant,
            plan.delta or 0.0,
        )
        if plan.budget is not None and plan.steps < plan.sampler.steps:
            log.warning(
                "epsilon_budget=%g stops the run after %d of its %d planned steps: the next step would exceed it "
                "(under %s)",
                plan.budget,
                plan.steps,
                plan.sampler.steps,
                plan.bound_accountant,
            )

    def _refuse_changed_run(self, checkpoint: str, here: dict) -> None:
        """ConfigError in one line when the privacy plan ``here`` (:meth:`PrivacyPlan.describe`'s fields, all or
        some) differs from the one the checkpoint was written under: another ``train_dataset`` size (N) first, then
        q, B, the sampler, sigma, ... (:func:`~dp_adam_bench.engine.plan.resume_refusal`). A checkpoint written
        before a field was recorded is not compared on it."""
        from dp_adam_bench.engine.plan import resume_refusal

        refusal = resume_refusal(
            _saved_plan(checkpoint), here, data="train_dataset", saved_by="the checkpoint's run"
        )
        if refusal is not None:
            raise ConfigError(f"{refusal} ({checkpoint})")

    def _privacy_payload(self, private, checkpoint: str) -> dict:
        """The checkpoint's privacy state, read and checked but not loaded: written under the same privacy plan
        (:meth:`_refuse_changed_run`), by the same configuration (its fingerprint), at the step of its
        ``trainer_state.json``."""
        from dp_adam_bench.engine import checkpoint as ckpt

        self._refuse_changed_run(checkpoint, private.plan.describe())
        folder = Path(checkpoint) / PRIVACY_STATE_DIR
        payload = ckpt.load(folder, _fingerprint(private), private.params[0].device)
        if payload is None:
            raise ConfigError(
                f"{folder} holds no privacy state: cannot continue the run's sampler, noise and ledger"
            )
        trainer_state = os.path.join(checkpoint, _TRAINER_STATE)  # without it the Trainer's state starts at 0
        step = TrainerState.load_from_json(trainer_state).global_step if os.path.isfile(trainer_state) else 0
        if step != int(payload["step"]):
            raise ConfigError(
                f"{checkpoint}: trainer_state.json is at step {step}, the privacy state at step "
                f"{int(payload['step'])}; refusing to resume from a mixed checkpoint"
            )
        return payload

    @staticmethod
    def _passes_per_step(private) -> float:
        return private.plan.sampler.expected_batch_size / len(private.run.population)

    def _train_steps(self, private, ignore_keys_for_eval) -> TrainOutput:
        """Step ``private`` to its end, with the Trainer's callbacks, logs, evaluations and checkpoints."""
        args = self.args
        start_time, first = time.time(), private.steps_done
        self._dp_last_logged = self.state.global_step
        self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
        if args.eval_on_start and first == 0:
            self._evaluate(None, ignore_keys_for_eval, skip_scheduler=True)
        per_step = self._passes_per_step(private)
        private.add_emitter(LOG_ROW, lambda result: {"learning_rate": float(private.variant.lr)})
        self.state.epoch = private.steps_done * per_step
        if not private.done:
            self.control = self.callback_handler.on_epoch_begin(args, self.state, self.control)
        while not private.done:
            self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
            self.last_step = private.step()
            step = self.state.global_step = private.steps_done
            self.state.epoch = step * per_step
            self.control = self.callback_handler.on_step_end(args, self.state, self.control)
            self._log_save_evaluate(private, ignore_keys_for_eval, start_time)
            if int(step * per_step + 1e-9) > int((step - 1) * per_step + 1e-9) or private.done:
                self.control = self.callback_handler.on_epoch_end(args, self.state, self.control)
                self._log_save_evaluate(private, ignore_keys_for_eval, start_time)
                if not (private.done or self.control.should_training_stop):
                    self.control = self.callback_handler.on_epoch_begin(args, self.state, self.control)
            if self.control.should_training_stop:
                break
        return self._finish(private, first, start_time)

    def _log_save_evaluate(self, private, ignore_keys_for_eval, start_time: float) -> None:
        """As the Trainer's ``_maybe_log_save_evaluate``: the log (epsilon, learning rate; no training loss), the
        evaluation and the checkpoint its callbacks asked for at this step."""
        if self.control.should_log and self.state.global_step > self._dp_last_logged:
            self._dp_last_logged = self.state.global_step
            row = private.emit_row(LOG_ROW, self.last_step)
            self.log({**row, **self._epsilon_log(private)}, start_time)
        if self.control.should_evaluate:
            metrics = self._evaluate(None, ignore_keys_for_eval)
            new_best = self._determine_best_metric(metrics=metrics, trial=None)
            if self.args.save_strategy == SaveStrategy.BEST:
                self.control.should_save = new_best
        if self.control.should_save:
            self._save_private_checkpoint(private)
            self.control = self.callback_handler.on_save(self.args, self.state, self.control)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """The Trainer's ``log``, behind the release boundary while :meth:`train` steps: a value logged at a step is
        one the post-processing check compared (an emitter's row: :meth:`PrivateTraining.add_emitter`), the
        epsilon spent, an evaluation's (``eval_`` / ``test_``, on held-out data) or the run's speed; anything else,
        ``diag/`` diagnostics of the private batch included, is refused in one line (the Trainer's loggers share
        what they get: W&B, TensorBoard, the console)."""
        private = self._private
        if private is not None and self.is_in_train and self.last_step is not None:
            _only_released(logs, private, self.last_step)
        super().log(logs, start_time)

    def _epsilon_log(self, private) -> dict[str, float]:
        """``{"epsilon": spent so far}`` (``inf`` without noise, ``nan`` if the accountant failed: its warning says
        why), also shown on the progress bar."""
        if not private.plan.noisy:
            eps = math.inf
        else:
            eps = float(private.epsilon_so_far().get("epsilon", math.nan))
        for cb in self.callback_handler.callbacks:
            bar = getattr(cb, "training_bar", None) if isinstance(cb, ProgressCallback) else None
            if bar is not None:
                bar.set_postfix({"epsilon": f"{eps:.4g}"}, refresh=False)
        return {"epsilon": eps}

    def _save_private_checkpoint(self, private) -> None:
        """``output_dir/checkpoint-<step>/``: the model and arguments (``save_model``), the privacy state and
        ``trainer_state.json``; older checkpoints rotated out per ``save_total_limit``."""
        from dp_adam_bench.engine import checkpoint as ckpt

        private.check_engine("checkpoint")  # the weights this checkpoint saves, checked first (as the CLI)
        run_dir = self.args.output_dir
        folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        self.save_model(folder, _internal_call=True)
        state_dir = Path(folder) / PRIVACY_STATE_DIR
        state_dir.mkdir(parents=True, exist_ok=True)
        ckpt.save(state_dir, {"fingerprint": _fingerprint(private), **private.state_dict()})
        if self.state.best_global_step:
            best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.best_global_step}")
            if os.path.exists(best):
                self.state.best_model_checkpoint = best
        for cb in _stateful(self):
            name, cb_state = cb.__class__.__name__, cb.state()
            if isinstance(self.state.stateful_callbacks.get(name), list):
                self.state.stateful_callbacks[name].append(cb_state)
            else:
                self.state.stateful_callbacks[name] = cb_state
        self.state.save_to_json(os.path.join(folder, _TRAINER_STATE))
        rotate_checkpoints(
            output_dir=run_dir,
            save_total_limit=self.args.save_total_limit,
            best_model_checkpoint=self.state.best_model_checkpoint,
            use_mtime=True,
        )

    def _finish(self, private, first: int, start_time: float) -> TrainOutput:
        """The run's metrics (speed, epsilon) logged, the participation ledger reconciled with the privacy ledger,
        the best model loaded if asked, ``on_train_end``; the engine's hooks released."""
        done = private.steps_done - first
        metrics = speed_metrics("train", start_time, num_steps=done)
        metrics |= self._epsilon_log(private)
        self.log(dict(metrics))
        plan = private.plan
        if plan.budget is not None and plan.steps < plan.sampler.steps and private.done:
            log.warning(
                "stopped by epsilon_budget=%g after %d of %d planned steps: epsilon = %.4g under %s",
                plan.budget,
                private.steps_done,
                plan.sampler.steps,
                metrics["epsilon"],
                plan.accountant,
            )
        private.check_participation()  # what ran against what the guarantee was computed for (one line if not)
        if self.args.load_best_model_at_end and self.state.best_model_checkpoint is not None:
            self._load_best_model()
        self.control = self.callback_handler.on_train_end(self.args, self.state, self.control)
        private.close()
        self.is_in_train = False
        return TrainOutput(self.state.global_step, math.nan, metrics)


#: the emitter of the Trainer's logged row at a step (PrivateTraining.add_emitter)
LOG_ROW = "trainer log"
#: what the Trainer logs that no emitter makes: public by construction (the plan's epsilon, HF's epoch counter,
#: the run's speed at its end)
_PUBLIC_LOG_KEYS = frozenset(
    {"epsilon", "epoch", "train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos"}
)


def _only_released(logs: dict, private, result) -> None:
    """Refuse a logged value that the post-processing check did not compare (:meth:`DPTrainer.log`)."""
    from dp_adam_bench.engine.post_processing import refuse_unreleased

    rows = {k: v for name in private.emitters for k, v in private.emit_row(name, result).items()}
    refuse_unreleased("DPTrainer.log", result.step, logs, rows, _PUBLIC_LOG_KEYS, ("eval_", "test_"))


# --- settings: what is refused, and how the Trainer's arguments map to make_private's --------------------------------
def _refuse_training_args(args) -> None:
    """One ConfigError line for what a DPTrainer cannot honour (the module docstring); warnings for the Trainer's
    settings it ignores."""
    if getattr(args, "fp16", False) or getattr(args, "half_precision_backend", "auto") == "apex":
        raise ConfigError(
            "fp16=True: the privatized update needs fp32 parameters, norms and noise; use bf16=True (bf16 autocast "
            "with fp32 parameters, clipping='bk') or fp32"
        )
    if getattr(args, "world_size", 1) > 1 or getattr(args, "parallel_mode", None) == ParallelMode.DISTRIBUTED:
        raise ConfigError(
            f"DPTrainer trains in one process (world_size={args.world_size}): for data-parallel private training "
            "use the CLI: torchrun --nproc_per_node=N -m dp_adam_bench.train task=..."
        )
    if getattr(args, "n_gpu", 1) > 1:
        raise ConfigError(
            f"n_gpu={args.n_gpu}: the Trainer would use torch.nn.DataParallel; DPTrainer trains on one device: "
            "set CUDA_VISIBLE_DEVICES to one GPU, or use the CLI's torchrun path for several"
        )
    if getattr(args, "deepspeed", None) or getattr(args, "fsdp", None):
        raise ConfigError(
            "deepspeed / fsdp: DPTrainer trains the model on one device (the CLI's torchrun path: DDP)"
        )
    strategy = getattr(args, "train_sampling_strategy", "random")
    if getattr(args, "group_by_length", False) or strategy not in ("random", None):
        name = "group_by_length" if getattr(args, "group_by_length", False) else strategy
        raise ConfigError(
            f"train_sampling_strategy={name!r}: DPTrainer draws the batches the accountant assumes (Poisson for "
            "independent noise; PrivacyArguments.sampler), not the Trainer's; leave the default"
        )
    if getattr(args, "auto_find_batch_size", False):
        raise ConfigError(
            "auto_find_batch_size=True changes the batch size the privacy plan is computed for; set "
            "per_device_train_batch_size (the micro-batch) and gradient_accumulation_steps"
        )
    if getattr(args, "label_smoothing_factor", 0.0):
        raise ConfigError(
            "label_smoothing_factor: DPTrainer's per-example losses are not smoothed; pass "
            "compute_loss_per_example=fn(model, inputs) -> (batch,) for a smoothed loss"
        )
    if _schedule_name(args) == "constant" and args.warmup_steps:
        raise ConfigError(
            f"warmup_steps={args.warmup_steps} with lr_scheduler_type='constant': warm up with 'linear'"
        )


def _warn_ignored(args) -> None:
    """Warnings for the Trainer's settings a DPTrainer does not use."""
    defaults = {f.name: f.default for f in dataclasses.fields(transformers.TrainingArguments)}
    if args.max_grad_norm and args.max_grad_norm != defaults.get("max_grad_norm"):
        warnings.warn(
            f"max_grad_norm={args.max_grad_norm} is not used: DP clips each example's gradient to "
            "PrivacyArguments.clip instead of the batch gradient",
            stacklevel=3,
        )
    optim, default_optim = (str(getattr(o, "value", o)) for o in (args.optim, defaults["optim"]))
    if optim != default_optim:
        warnings.warn(
            f"optim={args.optim} is not used: PrivacyArguments.optimizer (a variant of configs/optimizer/) updates "
            "the parameters with the privatized gradient",
            stacklevel=3,
        )


def _refuse_trainer_arguments(args: tuple, kwargs: dict) -> None:
    """The Trainer's constructor arguments a DPTrainer cannot use."""
    names = ("model", "args", "data_collator", "train_dataset", "eval_dataset", "processing_class")
    given = dict(zip(names + ("model_init",), args, strict=False)) | kwargs
    if given.get("model_init") is not None:
        raise ConfigError(
            "model_init: DPTrainer trains the model it is given (no re-initialisation, no search)"
        )
    if given.get("compute_loss_func") is not None:
        raise ConfigError(
            "compute_loss_func is a batch loss; DP needs one loss per example: pass "
            "compute_loss_per_example=fn(model, inputs) -> (batch,)"
        )
    opt = given.get("optimizers", (None, None))
    if any(o is not None for o in opt) or given.get("optimizer_cls_and_kwargs") is not None:
        raise ConfigError(
            "optimizers / optimizer_cls_and_kwargs: the privatized gradient is applied by the variant named by "
            "PrivacyArguments.optimizer (configs/optimizer/), with TrainingArguments' learning rate and schedule"
        )


def _refuse_dataset(dataset, name: str = "train_dataset") -> None:
    if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
        raise ConfigError(
            f"{name} is a {type(dataset).__name__} without len() and [i]: Poisson sampling draws examples "
            "by index from a map-style data set"
        )


def _refuse_public_mismatch(optimizer: str, public_dataset) -> None:
    """A side-information variant without ``public_dataset``, or ``public_dataset`` for a variant that reads none:
    refused at construction, in make_private's words (an unknown variant: make_private refuses it)."""
    from dp_adam_bench.engine.public_data import refuse_public_mismatch
    from dp_adam_bench.optim.registry import VARIANTS

    if optimizer not in VARIANTS:
        return
    size = 0 if public_dataset is None else len(public_dataset)
    refuse_public_mismatch(optimizer, VARIANTS.get(optimizer).needs_side_info, size)


def _schedule_name(args) -> str:
    name = str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type))
    if name not in ("constant", "linear"):
        raise ConfigError(
            f"lr_scheduler_type={name!r}: DPTrainer's schedules are 'constant' and 'linear' (with warmup_steps)"
        )
    return name


def _schedule(args, batch: int, n: int, length: dict) -> tuple[str, int]:
    """(``lr_schedule``, ``lr_warmup_steps``) for make_private: ``linear`` warms up over ``warmup_steps`` (a ratio
    < 1 of the run's steps), ``constant`` takes none."""
    name = _schedule_name(args)
    warmup = args.warmup_steps or 0
    if 0 < warmup < 1:
        steps = length.get("steps") or max(1, round(length["epochs"] * n / batch))
        warmup = math.ceil(warmup * steps)
    return name, int(warmup)


def _optimizer_args(args, p: PrivacyArguments) -> dict:
    """``PrivacyArguments.optimizer_args``, with the Trainer's ``adam_beta1`` / ``adam_beta2`` / ``adam_epsilon``
    for the variant's ``beta1`` / ``beta2`` / ``eps`` where it has them and they are not given."""
    from omegaconf import OmegaConf

    from dp_adam_bench.paths import CONFIG_DIR

    out = dict(p.optimizer_args or {})
    path = CONFIG_DIR / "optimizer" / f"{p.optimizer}.yaml"
    # an unknown name: make_private refuses it
    fields = set(OmegaConf.load(path)) if path.is_file() else set()
    for name, value in (("beta1", args.adam_beta1), ("beta2", args.adam_beta2), ("eps", args.adam_epsilon)):
        if name in fields and name not in out:
            out[name] = float(value)
    return out


def _kind_or_none(model: nn.Module) -> str | None:
    try:
        return loss_kind_of(model)
    except ConfigError:
        return None


def _sampler_of(p: PrivacyArguments) -> str | None:
    """The sampler make_private will use (its default for the mechanism); None for an unknown mechanism, which
    make_private refuses naming it."""
    if p.sampler is not None:
        return p.sampler
    from dp_adam_bench.privacy.noise_factory import NOISE

    try:
        return "single_pass" if NOISE.get(p.noise).correlated else "poisson"
    except ConfigError:  # make_private's refusal names the mechanism
        return None


def _watch_every(value) -> int | str:
    value = str(value)
    return int(value) if value.isdigit() else value


def _padded_length(longest: int | None, collate) -> int | None:
    """The length every training example is padded to: the longest ``input_ids``, up to the collator's
    ``pad_to_multiple_of`` or ``max_length`` padding."""
    if longest is None:
        return None
    if getattr(collate, "padding", None) == "max_length" and getattr(collate, "max_length", None):
        longest = max(longest, int(collate.max_length))
    multiple = getattr(collate, "pad_to_multiple_of", None)
    if multiple:
        longest = -(-longest // int(multiple)) * int(multiple)
    return longest


def _last_complete_checkpoint(run_dir: str) -> str | None:
    """The ``checkpoint-<step>`` folder of ``run_dir`` with the highest step that holds the privacy state and
    ``trainer_state.json`` (written last: a save killed half-way leaves a folder without it, which is skipped)."""
    from dp_adam_bench.engine import checkpoint as ckpt

    if not os.path.isdir(run_dir):
        return None
    steps = []
    for name in os.listdir(run_dir):
        m = re.fullmatch(rf"{PREFIX_CHECKPOINT_DIR}-(\d+)", name)
        folder = os.path.join(run_dir, name)
        if m and os.path.isfile(os.path.join(folder, _TRAINER_STATE)):
            if os.path.isfile(os.path.join(folder, PRIVACY_STATE_DIR, ckpt.FILENAME)):
                steps.append((int(m.group(1)), folder))
    return max(steps)[1] if steps else None


def _saved_plan(checkpoint: str) -> dict | None:
    """The privacy plan a DPTrainer checkpoint was written under (``PrivateTraining.state_dict()["plan"]``), read
    memory-mapped with the loader of :mod:`dp_adam_bench.engine.checkpoint` (``weights_only``: no code runs) and
    whatever configuration wrote it, so that a changed data set is named before the configuration's fingerprint
    is compared. None without one (an older checkpoint; an unreadable file, which the load refuses saying why)."""
    from torch.serialization import safe_globals

    from dp_adam_bench.engine import checkpoint as ckpt

    path = Path(checkpoint) / PRIVACY_STATE_DIR / ckpt.FILENAME
    try:
        with safe_globals(ckpt.SAFE_GLOBALS):
            payload = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - unusable: ckpt.load refuses it with the reason
        return None
    plan = payload.get("plan") if isinstance(payload, dict) else None
    return plan if isinstance(plan, dict) else None


def _stateful(trainer) -> list:
    """The callbacks (and the control) whose state a checkpoint carries, as the Trainer lists them."""
    return [
        c for c in trainer.callback_handler.callbacks + [trainer.control] if isinstance(c, ExportableState)
    ]


def _fingerprint(private) -> str:
    """The configuration's fingerprint (as the CLI's checkpoints carry): a checkpoint of another is refused."""
    from omegaconf import OmegaConf

    from dp_adam_bench.engine import checkpoint as ckpt

    return ckpt.fingerprint(OmegaConf.to_container(private.run.cfg, resolve=True))
