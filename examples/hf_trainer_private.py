"""A Hugging Face ``Trainer`` script made private by one swap: ``Trainer(...)`` -> ``DPTrainer(..., privacy=...)``
(dp_adam_bench.hf_trainer). DP-AdamW on Poisson batches of expected size 16 x 4 (per-device batch x gradient
accumulation), sigma calibrated to epsilon = 8, the epsilon in every log line and on the progress bar; the run is
interrupted after its checkpoint at step 10 and a new process's trainer resumes it from there, with the same
sampler position, noise stream and privacy ledger.

    python examples/hf_trainer_private.py [--model FOLDER] [--text FILE] [--steps 20] [--output_dir DIR]

Without arguments it trains a tiny GPT-2 (built from a config, random weights) on 2,000 synthetic sentences, in
about 20 s on 2 CPU cores. ``--model`` takes any causal LM folder ``AutoModelForCausalLM.from_pretrained`` reads (with
its tokenizer), ``--text`` a text file of one training example per line (the last 10 % held out for evaluation).
"""

import argparse
import tempfile

import datasets
import numpy as np
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    GPT2Config,
    GPT2LMHeadModel,
    PreTrainedTokenizerFast,
    TrainerCallback,
    TrainingArguments,
)

import dp_adam_bench as dab
from dp_adam_bench.hf_trainer import DPTrainer, PrivacyArguments

parser = argparse.ArgumentParser()
parser.add_argument(
    "--model", help="a causal LM folder with its tokenizer (default: a tiny GPT-2 from a config)"
)
parser.add_argument("--text", help="a text file, one example per line (default: synthetic sentences)")
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--output_dir", help="where checkpoints go (default: a new temporary folder)")
cli = parser.parse_args()


def synthetic_sentences(n: int, seed: int = 0) -> list[str]:
    """Sentences of a small grammar: subject, verb, object and an optional ending (5 to 10 words)."""
    subjects = ["the cat", "a dog", "my friend", "the old man", "a small bird", "the teacher"]
    verbs = ["sees", "likes", "finds", "follows", "draws", "remembers"]
    objects = [
        "the red ball",
        "a quiet river",
        "the tall tree",
        "an open door",
        "the morning sun",
        "a new book",
    ]
    endings = ["", "today", "again", "every day", "in the park"]
    rng = np.random.default_rng(seed)
    parts = [subjects, verbs, objects, endings]
    return [" ".join(p for p in (str(rng.choice(words)) for words in parts) if p) + " ." for _ in range(n)]


def word_tokenizer(lines: list[str]) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the words of ``lines`` (the synthetic data needs no pretrained vocabulary)."""
    words = sorted({w for line in lines for w in line.split()})
    vocab = {w: i for i, w in enumerate(["<pad>", "<eos>", "<unk>", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


if cli.text:
    with open(cli.text, encoding="utf-8") as f:
        lines = [line.strip() for line in f if line.strip()]
else:
    lines = synthetic_sentences(2200)
if cli.model:
    tokenizer = AutoTokenizer.from_pretrained(cli.model)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(cli.model)
    dab.fix_model(model)  # unties GPT-2's input and output embeddings (bk clips each module's own gradient)
else:
    tokenizer = word_tokenizer(lines)
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=len(tokenizer), n_positions=32, n_embd=64, n_layer=2, n_head=4, tie_word_embeddings=False,
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    model = GPT2LMHeadModel(config)


def tokenize(batch):
    enc = tokenizer(batch["text"], truncation=True, max_length=31)
    enc["input_ids"] = [ids + [tokenizer.eos_token_id] for ids in enc["input_ids"]]
    enc["attention_mask"] = [mask + [1] for mask in enc["attention_mask"]]
    return enc


split = len(lines) - max(1, len(lines) // 10)
data = datasets.Dataset.from_dict({"text": lines}).map(tokenize, batched=True, remove_columns=["text"])
train, held_out = data.select(range(split)), data.select(range(split, len(lines)))
collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)  # labels = input_ids, padding ignored

args = TrainingArguments(
    output_dir=cli.output_dir or tempfile.mkdtemp(prefix="dp_trainer_"),
    per_device_train_batch_size=16, gradient_accumulation_steps=4,  # Poisson batches of expected size 64
    max_steps=cli.steps, learning_rate=3e-3, lr_scheduler_type="linear", warmup_steps=2,
    logging_steps=5, eval_strategy="steps", eval_steps=10, per_device_eval_batch_size=128,
    save_steps=10, report_to="none", seed=0,
)  # fmt: skip
privacy = PrivacyArguments(target_epsilon=8.0, delta=1e-5, clip=1.0, optimizer="adamw")


class Interrupted(TrainerCallback):
    """Stands in for a job killed right after its checkpoint of step 10."""

    def on_save(self, args, state, control, **kwargs):
        control.should_training_stop = state.global_step == 10


# the Trainer script's one change: DPTrainer(..., privacy=...) instead of Trainer(...)
trainer = DPTrainer(
    model=model, args=args, train_dataset=train, eval_dataset=held_out, data_collator=collator,
    processing_class=tokenizer, callbacks=[Interrupted()], privacy=privacy,
)  # fmt: skip
untrained = trainer.evaluate()["eval_loss"]
trainer.train()
private = trainer.private
print(
    f"sigma = {private.sigma:.3f} calibrated for epsilon = 8 over {private.steps} steps "
    f"(expected batch {private.plan.sampler.expected_batch_size:g} of {len(train)} examples); "
    f"stopped at step {trainer.state.global_step} with epsilon = {private.epsilon('rdp'):.3f}"
)

# a new process would rebuild the model and the trainer the same way, then resume from the last checkpoint
resumed = DPTrainer(
    model=model.__class__(model.config), args=args, train_dataset=train, eval_dataset=held_out,
    data_collator=collator, processing_class=tokenizer, privacy=privacy,
)  # fmt: skip
resumed.train(resume_from_checkpoint=True)
final = resumed.evaluate()["eval_loss"]
print(
    f"resumed at step {trainer.state.global_step}, trained to step {resumed.state.global_step}: held-out loss "
    f"{untrained:.3f} -> {final:.3f}; epsilon (rdp) = {resumed.private.epsilon('rdp'):.3f} at delta = 1e-5"
)
print("guarantee:", resumed.private.guarantee())
