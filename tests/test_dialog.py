"""The dialog task (dp_adam_bench/tasks/dialog.py): ParlAI's F1 against hand-computed values, the Persona-Chat
readers (the Synthetic-Persona-Chat CSV and TransferTransfo's JSON) on files written here, the prompt's history
window, and a private run end to end through the CLI's train()."""

from __future__ import annotations

import csv
import gzip
import io
import json

import numpy as np
import pytest
from omegaconf import OmegaConf

from dp_adam_bench.tasks.dialog import DialogGpt2, f1, normalize, read_original, read_stand_in

from helpers import compose_cfg, two_private_steps

CONVERSATIONS = [
    (
        "I like cats.\nI am a nurse.",
        "I play chess.\nI live in Paris.",
        "User 1: Hi, how are you?\nUser 2: Good, I just played chess.\nUser 1: I am a nurse, I like cats.\n"
        "User 2: Paris has many cats.",
    ),
    (
        "I surf.",
        "I bake bread.",
        "User 1: Do you like the sea?\nUser 2: I bake bread all day.\nUser 1: I surf every morning.",
    ),
]


def write_csv(path, rows):
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["user 1 personas", "user 2 personas", "Best Generated Conversation"])
    w.writerows(rows)
    path.write_bytes(gzip.compress(buf.getvalue().encode()))


@pytest.fixture
def stand_in(tmp_path):
    folder = tmp_path / "synthetic_persona_chat"
    folder.mkdir()
    write_csv(folder / "valid.csv.gz", CONVERSATIONS * 6)
    write_csv(folder / "test.csv.gz", CONVERSATIONS)
    return folder


def test_f1_is_parlai_unigram_f1_after_normalisation():
    assert normalize("The Cat, a dog!  An owl.") == "cat dog owl"
    assert f1("the cat sat", "a cat sat down") == pytest.approx(2 * 1.0 * (2 / 3) / (1.0 + 2 / 3))
    assert f1("cat cat dog", "cat dog dog") == pytest.approx(2 / 3)  # bags: common = min counts = 2 of 3 each
    assert f1("", "cat") == 0.0 and f1("bird", "cat") == 0.0 and f1("Cat.", "cat") == 1.0


def test_stand_in_reader_gives_every_later_turn_from_its_speakers_side(stand_in):
    examples = read_stand_in(stand_in / "test.csv.gz")
    assert len(examples) == 3 + 2  # every turn after the first
    persona, history, reply = examples[0]
    assert persona == ["I play chess.", "I live in Paris."] and reply == "Good, I just played chess."
    assert history == ["User 1: Hi, how are you?", "User 2:"]
    persona, history, reply = examples[1]
    assert persona == ["I like cats.", "I am a nurse."] and history[-1] == "User 1:" and len(history) == 3


def test_original_persona_chat_json_reader(tmp_path):
    data = {
        "train": [
            {
                "personality": ["i like tea ."],
                "utterances": [
                    {"history": ["hello !"], "candidates": ["wrong .", "hi , i like tea ."]},
                    {"history": ["hello !", "hi , i like tea .", "me too ."], "candidates": ["x", "great ."]},
                ],
            }
        ]
    }
    f = tmp_path / "personachat_self_original.json"
    f.write_text(json.dumps(data))
    ex = read_original(f, "train")
    assert ex[0] == (["i like tea ."], ["User 1: hello !", "User 2:"], "hi , i like tea .")
    assert ex[1][1] == ["User 1: hello !", "User 2: hi , i like tea .", "User 1: me too .", "User 2:"]
    assert ex[1][2] == "great ."


def _cfg(folder, **extra):
    cfg = OmegaConf.load(__import__("dp_adam_bench.paths").paths.CONFIG_DIR / "task" / "dialog.yaml")
    cfg.profile = "cpu"
    cfg.data_dir = str(folder)
    cfg.n_layer, cfg.n_embd, cfg.n_positions, cfg.max_length = 1, 32, 128, 128
    for k, v in extra.items():
        cfg[k] = v
    return cfg


def test_prompt_keeps_the_persona_and_the_last_turns(stand_in):
    task = DialogGpt2(_cfg(stand_in, max_history=1), trials=1, seed=0)
    assert task.dataset_size == 30 and task.test_size == 5
    # the second test example: User 1's persona, one turn of history, then the speaker to reply
    assert (
        task.test_mrs[1] == "Persona: I like cats. I am a nurse.\nUser 2: Good, I just played chess.\nUser 1:"
    )
    assert task.test_refs[1] == ["I am a nurse, I like cats."]
    assert "STAND-IN DATA: Synthetic-Persona-Chat" in task.data_note


@pytest.mark.parametrize("finetune", [None, "lora", "prefix", "rgp"])
def test_a_private_run_end_to_end(stand_in, isolated_dirs, finetune):
    """Two private steps, full fine-tuning and each method of Li et al.'s E2E table that trains fewer parameters."""
    from dp_adam_bench.train import train

    c = compose_cfg(
        [
            "task=dialog",
            *([f"task.finetune={finetune}"] if finetune else []),
            f"task.data_dir={stand_in}",
            "task.n_layer=1",
            "task.n_embd=32",
            "task.n_positions=128",
            "task.max_length=128",
            "task.generate_subset=3",
            "task.max_new_tokens=4",
            *two_private_steps("dialog"),
        ]
    )
    s = train(c)
    m = s["metrics"]
    assert s["steps"] == 2 and s["epsilon"]["rdp"] > 0
    assert (s.get("finetune") or {}).get("method") == finetune
    assert 0 <= m["test_f1"] <= 100 and np.isfinite(m["test_perplexity"])
    assert m["test_perplexity"] == pytest.approx(np.exp(m["test_loss"]))


def test_a_long_prompt_loses_its_oldest_turns_to_fit(stand_in):
    task = DialogGpt2(_cfg(stand_in, max_length=64, max_history=5), trials=1, seed=0)
    budget = 64 - 2 - 48
    for text in task.test_mrs:
        lines = text.split("\n")
        assert lines[0].startswith("Persona: ") and lines[-1] in ("User 1:", "User 2:")
        n = len(task.tokenizer(" " + text, add_special_tokens=False)["input_ids"])
        assert n <= budget or len(lines) == 2  # fits, or only the persona and the speaker are left
    assert task.shortened > 0 and "prompts shortened to their latest turns" in task.data_note
