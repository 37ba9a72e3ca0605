"""Chit-chat dialog with GPT-2 on the Persona-Chat format: a persona and the conversation so far in, the next reply
out; F1 of the generated reply and perplexity (Li, Tramer, Liang & Hashimoto, ICLR 2022, arXiv:2110.05679, table
"Dataset: Persona-Chat": GPT-2 F1 15.90 / perplexity 24.59 at eps = 3, ``configs/paper/li.yaml`` dialog).

The task is :class:`~dp_adam_bench.tasks.e2e_gpt2.E2EGpt2` with other data and metrics: an example's prompt is its
speaker's persona and the last ``max_history`` turns before the reply (each on its own line, ``User 1: ...``), its
target the reply; the model, the target-only loss, the pretraining presets, the fine-tuning methods
(``task.finetune``) and the decoding are E2E's. Every turn after the first is an example, predicted from its own
speaker's side with its own speaker's persona (as Persona-Chat's "self" files give each dialog from both sides).

Metrics (Li et al. use the ConvAI2 evaluation of Hugging Face's TransferTransfo, Wolf et al. 2019, arXiv
1901.08149; Dinan et al. 2019, "The Second Conversational Intelligence Challenge (ConvAI2)", arXiv 1902.00098):

* ``test_perplexity``: exp of the mean cross-entropy per reply token (the reply and its final eos) over the
  evaluated examples (``test_loss``);
* ``test_f1`` (0-100): ParlAI's F1 — the reply and the generated text normalised (lower case, punctuation and the
  articles a / an / the removed, white space collapsed), then the harmonic mean of the precision and recall of
  their bags of tokens — averaged over the examples decoded (greedy decoding, ``num_beams`` 1 by default).

Data (``task.source`` auto: ``task.data_dir``, then the shared offline folder):

* ``synthetic_persona_chat`` (the offline stand-in, Jandaghi et al. 2023, arXiv 2312.10007): Persona-Chat's own
  personas and validation / test split with LLM-written conversations, CSV ``user 1 personas, user 2 personas,
  Best Generated Conversation``. It has no train split: the stand-in trains on its validation conversations and
  evaluates on its test ones, and a table built on it says so (``data_note``).
* Persona-Chat itself, for a user who has it: ``personachat_self_original.json`` (Hugging Face's TransferTransfo
  file: ``{"train": [...], "valid": [...]}``, each dialog a ``personality`` and ``utterances`` whose ``history``
  and last ``candidates`` entry are the context and the reply) in ``task.data_dir``; train on ``train``, evaluate on
  ``valid`` (Li et al. report the validation split).
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import re
import string
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from torch import nn

from dp_adam_bench.tasks import fields
from dp_adam_bench.tasks.base import data_folders, missing_data, subset_indices
from dp_adam_bench.tasks.e2e_gpt2 import E2EGpt2

STAND_IN = "synthetic_persona_chat"
STAND_IN_FILES = {"train": "valid.csv.gz", "test": "test.csv.gz"}
ORIGINAL_FILE = "personachat_self_original.json"
ORIGINAL_SPLITS = {"train": "train", "test": "valid"}
#: Li et al.'s GPT-2 at eps = 3 (configs/paper/li.yaml), quoted in data_note
PAPER_EPS3 = "F1 15.90, perplexity 24.59"
#: tokens of ``max_length`` a prompt leaves for the reply and its eos (longer prompts lose their oldest turns)
REPLY_RESERVE = 48

# ------------------------------------------------------------------------------------------------- metrics

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def normalize(text: str) -> str:
    """ParlAI's ``normalize_answer``: lower case, no punctuation, no articles, single spaces."""
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCT)).split())


def f1(generated: str, reference: str) -> float:
    """ParlAI's unigram F1 of two texts after :func:`normalize` (0 when either is empty or nothing overlaps)."""
    g, r = normalize(generated).split(), normalize(reference).split()
    common = sum((Counter(g) & Counter(r)).values())
    if not g or not r or common == 0:
        return 0.0
    precision, recall = common / len(g), common / len(r)
    return 2 * precision * recall / (precision + recall)


# ------------------------------------------------------------------------------------------------- data


def _turns(conversation: str) -> list[tuple[str, str]]:
    """(speaker, text) of each line ``User k: text`` of a stand-in conversation (other lines are skipped)."""
    out = []
    for line in conversation.splitlines():
        m = re.match(r"\s*(User [12])\s*:\s*(.*\S)\s*$", line)
        if m:
            out.append((m.group(1), m.group(2)))
    return out


def read_stand_in(path: Path) -> list[tuple[list[str], list[str], str]]:
    """(persona sentences, history lines, reply) for every turn after the first of every conversation of a
    Synthetic-Persona-Chat CSV, from its speaker's side."""
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    reader = csv.DictReader(io.StringIO(raw.decode("utf-8-sig")))
    cols = {c.strip().lower(): c for c in reader.fieldnames or []}
    need = ("user 1 personas", "user 2 personas", "best generated conversation")
    if any(c not in cols for c in need):
        raise ValueError(f"{path}: expected the columns {', '.join(need)}, got {reader.fieldnames}")
    examples = []
    for row in reader:
        personas = {
            "User 1": [s.strip() for s in row[cols["user 1 personas"]].splitlines() if s.strip()],
            "User 2": [s.strip() for s in row[cols["user 2 personas"]].splitlines() if s.strip()],
        }
        turns = _turns(row[cols["best generated conversation"]])
        lines = [f"{who}: {said}" for who, said in turns]
        for i in range(1, len(turns)):
            who, said = turns[i]
            examples.append((personas[who], lines[:i] + [f"{who}:"], said))
    if not examples:
        raise ValueError(f"{path}: no conversation turns")
    return examples


def read_original(path: Path, split: str) -> list[tuple[list[str], list[str], str]]:
    """(persona sentences, history lines, reply) of Persona-Chat's ``personachat_self_original.json`` split: each
    utterance's history (alternating, the other side first) and its gold reply (the last candidate)."""
    data = json.loads(path.read_text())
    if split not in data:
        raise ValueError(f"{path}: no {split!r} split (has {', '.join(data)})")
    examples = []
    for dialog in data[split]:
        persona = [s.strip() for s in dialog["personality"]]
        for u in dialog["utterances"]:
            history = list(u["history"])
            # the reply's speaker is "User 2"; the history alternates back from the other side
            n = len(history)
            lines = [f"User {1 if (n - k) % 2 else 2}: {h.strip()}" for k, h in enumerate(history)]
            examples.append((persona, lines + ["User 2:"], u["candidates"][-1].strip()))
    return examples


def load_dialog_split(split: str, data_dir) -> tuple[list, str, bool]:
    """(examples, origin, whether it is the stand-in) of ``train`` or ``test``: Persona-Chat's JSON when a folder
    has it, else the Synthetic-Persona-Chat stand-in."""
    tried = []
    for folder in data_folders(data_dir, "persona_chat"):
        f = folder / ORIGINAL_FILE
        if f.is_file():
            return read_original(f, ORIGINAL_SPLITS[split]), f"local:{f}[{ORIGINAL_SPLITS[split]}]", False
        tried.append(str(f))
    for folder in data_folders(data_dir, STAND_IN):
        f = folder / STAND_IN_FILES[split]
        if f.is_file():
            return read_stand_in(f), f"local:{f}", True
        tried.append(str(f))
    raise missing_data(
        f"Persona-Chat {split!r} split",
        "local",
        tried,
        f"Provide task.data_dir with {ORIGINAL_FILE} (Persona-Chat as Hugging Face's TransferTransfo ships it) or "
        f"the Synthetic-Persona-Chat CSVs ({', '.join(STAND_IN_FILES.values())}).",
    )


# ------------------------------------------------------------------------------------------------- task


class DialogGpt2(E2EGpt2):
    """Persona-Chat with GPT-2 (module docstring). Config fields: E2EGpt2's, plus ``max_history`` (turns of context,
    2 x 2 + 1 = 5 by default as TransferTransfo's ``max_history=2``) and ``generate_subset`` (examples decoded for
    F1); ``num_beams`` defaults to 1 (greedy), ``max_new_tokens`` to 40."""

    name = "dialog"

    def __init__(self, cfg, *, trials: int, seed: int):
        self.max_history = fields.positive(cfg, "max_history", 5)
        super().__init__(cfg, trials=trials, seed=seed)

    def _read_options(self, cfg) -> None:
        super()._read_options(cfg)
        self.num_beams = fields.positive(cfg, "num_beams", 1)
        mnt = cfg.get("max_new_tokens")
        self.max_new_tokens = 40 if mnt is None else int(mnt)
        if self.max_new_tokens < 1:
            raise ValueError(f"task.max_new_tokens must be >= 1, got {self.max_new_tokens}")

    def _load_pairs(self, cfg, eval_split: str):
        del eval_split
        data_dir = cfg.get("data_dir")
        train, self.train_source, stand_in = load_dialog_split("train", data_dir)
        test, self.test_source, _ = load_dialog_split("test", data_dir)
        self.stand_in = stand_in
        self.full_sizes = {"train": len(train), "test": len(test), "test_mrs": len(test)}
        rng = np.random.default_rng(int(cfg.get("data_seed", 0)))
        tr = subset_indices(len(train), cfg.get("train_subset"), rng, "train_subset")
        if tr is not None:
            train = [train[i] for i in tr]
        te = subset_indices(len(test), cfg.get("test_subset"), rng, "test_subset")
        if te is not None:
            test = [test[i] for i in te]
        self._examples = {"train": train, "test": test}
        self.test_mrs = [self.prompt_text(p, h) for p, h, _ in test]
        self.test_refs = [[r] for _, _, r in test]
        return (
            [self.prompt_text(p, h) for p, h, _ in train],
            [r for _, _, r in train],
            (tr is not None, te is not None),
        )

    def _tokenize_pairs(self, tr_mrs: list[str], tr_refs: list[str]) -> None:
        """E2E's tokenisation, after each prompt is fitted to ``max_length`` (:meth:`fit_prompts`)."""
        tr_mrs = self.fit_prompts(self._examples["train"], tr_mrs)
        self.test_mrs = self.fit_prompts(self._examples["test"], self.test_mrs)
        super()._tokenize_pairs(tr_mrs, tr_refs)

    def fit_prompts(self, examples, prompts: list[str]) -> list[str]:
        """Each prompt whose tokens leave fewer than :data:`REPLY_RESERVE` of ``max_length`` for the reply loses its
        oldest turns, one at a time, down to the persona and the reply's speaker (as TransferTransfo keeps only the
        last turns); ``shortened`` counts them."""
        budget = self.max_length - 2 - REPLY_RESERVE

        def length(text: str) -> int:
            return len(self.tokenizer(" " + text, add_special_tokens=False)["input_ids"])

        out = list(prompts)
        shortened = 0
        for i, text in enumerate(out):
            if length(text) <= budget:
                continue
            persona, history, _ = examples[i]
            context = history[:-1][-self.max_history :]
            while context and length(self.prompt_text(persona, [*context, history[-1]])) > budget:
                context = context[1:]
            out[i] = self.prompt_text(persona, [*context, history[-1]])
            shortened += 1
        self.shortened = getattr(self, "shortened", 0) + shortened
        return out

    def prompt_text(self, persona: list[str], history: list[str]) -> str:
        """``Persona: <sentences>`` and the last ``max_history`` turns, one a line, ending with the reply's speaker."""
        context = history[:-1][-self.max_history :] + history[-1:]
        return "\n".join(["Persona: " + " ".join(persona), *context])

    def _data_note(self, eval_split: str, train_subset: bool, test_subset: bool) -> str:
        del eval_split
        notes = [self._pretrain_note()] if self.pretrain_preset else []
        if self.stand_in:
            notes.append(
                "STAND-IN DATA: Synthetic-Persona-Chat (Persona-Chat's personas, LLM-written conversations), trained "
                "on its validation conversations and evaluated on its test ones; not Persona-Chat's text "
                f"(Li et al.: GPT-2 on Persona-Chat, {PAPER_EPS3} at eps = 3)"
            )
        if train_subset:
            notes.append(f"{self.dataset_size:,} of the {self.full_sizes['train']:,} training replies")
        if test_subset:
            notes.append(f"{len(self.test_mrs)} of the {self.full_sizes['test']:,} evaluated replies")
        if self.n_generate < len(self.test_mrs):
            notes.append(f"F1 on the first {self.n_generate} evaluated replies (task.generate_subset)")
        if getattr(self, "shortened", 0):
            notes.append(
                f"{self.shortened} prompts shortened to their latest turns to fit {self.max_length} tokens"
            )
        if self.truncated["train"] or self.truncated["test"]:
            notes.append(
                f"{self.truncated['train']} train / {self.truncated['test']} test examples truncated to "
                f"{self.max_length} tokens"
            )
        return "; ".join(notes)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, final: bool = False) -> dict[str, float]:
        """``test_loss`` and ``test_perplexity`` always; ``test_f1`` (0-100) when decoding runs (the final evaluation,
        or every one with ``generate_every_eval``)."""
        loss = self.test_loss(model)
        metrics = {"test_loss": loss, "test_perplexity": float(np.exp(loss))}
        if self.n_generate and (final or self.generate_every_eval):
            hyps = self.generate(model)
            refs = [r[0] for r in self.test_refs[: len(hyps)]]
            metrics["test_f1"] = 100.0 * float(np.mean([f1(h, r) for h, r in zip(hyps, refs, strict=True)]))
            self.last_generations = [
                {"prompt": p, "generated": h, "reference": r}
                for p, h, r in zip(self.test_mrs, hyps, refs, strict=False)
            ]
        return metrics
