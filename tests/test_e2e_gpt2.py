"""The e2e_gpt2 task (Li et al. 2022, GPT-2 on E2E NLG) on tiny fixtures: E2E-format CSVs written here and a 1-layer
GPT-2 (n_embd 32) with the offline GPT-2 tokenizer (shared/data/gpt2_tokenizer, 50,257 tokens).

Checked: the formatting (prompt and padding labelled -100, the reference and the final eos labelled, (B, T)
positions), the target-only loss against a hand computation from the full logits, per-example losses independent
of the batch and of the padding, the untied output layer and the exact Conv1D -> Linear swap, beam search without
line breaks, the E2E metrics on hand-checkable cases, the missing-data error, per-example norms and clipped sums of
the ghost, bk and hooks engines against the loop oracle, and a few DP steps through Hydra and the trainer.
"""

import csv
import gzip
import json
import math

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from test_text_tasks import _median_norm, _oracle_check
from torch.nn import functional as F

from dp_adam_bench.engine.engines import build_engine
from dp_adam_bench.paths import shared_data_dir
from dp_adam_bench.tasks import e2e_metrics, text
from dp_adam_bench.tasks.e2e_gpt2 import (
    E2EGpt2,
    GPT2AtTargets,
    conv1d_to_linear,
    group_by_mr,
    load_e2e_split,
    read_e2e_csv,
)

from helpers import compose_cfg, release_in_micro_batch_order, two_private_steps

torch.set_num_threads(1)

TOKENIZER = shared_data_dir() / "gpt2_tokenizer"
pytestmark = pytest.mark.skipif(
    not (TOKENIZER / "vocab.json").is_file(),
    reason="needs shared/data/gpt2_tokenizer (GPT-2 vocab.json, merges.txt)",
)

NAMES = ["The Eagle", "Café Adriatic", "Blue Spice", "The Vaults", "Zizzi"]
FOODS = ["Italian", "French", "English", "Chinese"]
PRICES = ["cheap", "moderate", "more than £30"]


def _mr(i: int) -> str:
    return f"name[{NAMES[i % 5]}], eatType[pub], food[{FOODS[i % 4]}], priceRange[{PRICES[i % 3]}]"


def _ref(i: int, k: int) -> str:
    return [
        f"{NAMES[i % 5]} is a {PRICES[i % 3]} pub serving {FOODS[i % 4]} food.",
        f"There is a pub, {NAMES[i % 5]}, with {FOODS[i % 4]} food; prices are {PRICES[i % 3]}.",
        f'"{NAMES[i % 5]}" serves {FOODS[i % 4]} food at {PRICES[i % 3]} prices.',
    ][k % 3]


def _write(path, rows):
    with gzip.open(path, "wt", encoding="utf-8", newline="") as f:
        w = csv.writer(f)
        w.writerow(["mr", "ref"])
        w.writerows(rows)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """trainset.csv.gz (40 pairs) and testset_w_refs.csv.gz (12 MRs with 1-3 consecutive references each)."""
    root = tmp_path_factory.mktemp("e2e")
    _write(root / "trainset.csv.gz", [(_mr(i), _ref(i, i)) for i in range(40)])
    _write(
        root / "testset_w_refs.csv.gz",
        [(_mr(100 + g), _ref(g, k)) for g in range(12) for k in range(1 + g % 3)],
    )
    return root


def cfg(data_dir, **kw):
    base = {
        "name": "e2e_gpt2",
        "profile": "cpu",
        "data_dir": str(data_dir),
        "n_layer": 1,
        "n_embd": 32,
        "n_head": 2,
        "n_positions": 128,
        "dropout": 0.0,
        "max_length": 96,
        "eval_batch_size": 7,
        "generate_subset": 4,
        "max_new_tokens": 6,
        "num_beams": 3,
    }
    return OmegaConf.create({**base, **kw})


@pytest.fixture(scope="module")
def task(data_dir):
    return E2EGpt2(cfg(data_dir), trials=1, seed=0)


def fresh(task, seed=0):
    torch.manual_seed(seed)
    return task.build_model()


# --------------------------------------------------------------------------------------------- metrics


def test_bleu_known_values():
    assert e2e_metrics.bleu(["The cat sat on the mat."], [["the cat sat on the mat ."]]) == pytest.approx(100)
    # hand count: 1- to 4-gram precisions 4/6, 3/5, 2/4, 1/3, equal lengths (no brevity penalty)
    expected = 100 * math.exp(np.mean(np.log([4 / 6, 3 / 5, 2 / 4, 1 / 3])))
    assert e2e_metrics.bleu(["a b c d e f"], [["a b c d x y"]]) == pytest.approx(expected)
    # a variable number of references per MR; the closest reference length sets the brevity penalty
    two = e2e_metrics.bleu(["a b c d e f", "p q r s t u"], [["a b c d x y", "z"], ["p q r s t u"]])
    assert 0 < two < 100
    short = e2e_metrics.bleu(["a b c d"], [["a b c d e f g h"]])  # precision 1, penalty exp(1 - 8/4)
    assert short == pytest.approx(100 * math.exp(1 - 8 / 4))
    with pytest.raises(ValueError, match="non-empty list"):
        e2e_metrics.bleu(["x"], [[]])


def test_rouge_l_is_the_e2e_scorer_definition():
    assert e2e_metrics.rouge_l(["The Vaults is a pub."], [["the vaults is a pub"]]) == pytest.approx(100)
    # LCS 3: precision 3/3, recall 3/6; F_beta with beta = 1.2 (pycocoevalcap)
    f = (1 + 1.44) * 1.0 * 0.5 / (0.5 + 1.44 * 1.0)
    assert e2e_metrics.rouge_l(["the cat sat"], [["the cat sat on the mat"]]) == pytest.approx(100 * f)
    # maximum precision and maximum recall come from different references: F = 1, whereas the best single
    # reference's F would be below 1
    assert e2e_metrics.rouge_l(["a b c d"], [["a b", "a b c d e f g h"]]) == pytest.approx(100)
    assert e2e_metrics.rouge_l(["x y", "a b"], [["q"], ["a b"]]) == pytest.approx(50)  # mean over MRs
    assert e2e_metrics.coco_tokens('The "Vaults", a pub (cheap).') == ["the", "vaults", "a", "pub", "cheap"]


# --------------------------------------------------------------------------------------------- data


def test_csv_reading_and_grouping(data_dir, tmp_path):
    mrs, refs = read_e2e_csv(data_dir / "testset_w_refs.csv.gz")
    assert len(mrs) == sum(1 + g % 3 for g in range(12)) and refs[2].startswith(
        "There is a pub, Café Adriatic"
    )
    uniq, groups, row_group = group_by_mr(mrs, refs)
    assert len(uniq) == 12 and [len(g) for g in groups] == [1 + g % 3 for g in range(12)]
    assert [uniq[g] for g in row_group] == mrs
    (tmp_path / "testset.csv").write_text("MR\nname[x]\n")
    with pytest.raises(ValueError, match="expected the E2E columns mr,ref"):
        read_e2e_csv(tmp_path / "testset.csv")


def test_missing_data_folder_names_it(data_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("DP_ADAM_BENCH_DATA", str(tmp_path / "no_shared"))
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match=rf"(?s)no E2E 'train' split.*{missing}.*task.data_dir"):
        load_e2e_split("train", "local", missing)
    with pytest.raises(
        FileNotFoundError, match=rf"(?s){missing}.*trainset.csv.gz.*Hugging Face hub.*task.data_dir"
    ):
        E2EGpt2(cfg(missing, tokenizer=str(TOKENIZER)), trials=1, seed=0)  # auto: the hub fails offline too
    with pytest.raises(FileNotFoundError, match=rf"tokenizer folder {missing} does not exist"):
        E2EGpt2(cfg(data_dir, tokenizer=str(missing)), trials=1, seed=0)
    (tmp_path / "empty_tok").mkdir()
    (tmp_path / "empty_tok" / "vocab.json").write_text("{}")
    (tmp_path / "empty_tok" / "merges.txt").write_text("")
    with pytest.raises(FileNotFoundError, match="vocabulary files were not found"):
        E2EGpt2(cfg(data_dir, tokenizer=str(tmp_path / "empty_tok")), trials=1, seed=0)


def test_formatting_labels_and_positions(task, data_dir):
    tok, eos = task.tokenizer, task.eos_id
    assert len(tok) == 50_257 and eos == 50_256 and task.dataset_size == 40 and len(task.test_mrs) == 12
    assert task.test_size == sum(1 + g % 3 for g in range(12))  # test_loss uses every reference
    b = task.get_batch(torch.tensor([3, 0, 7]))
    t = b["input_ids"].shape[1]
    assert t % 8 == 0 and all(
        b[k].shape == (3, t) for k in ("input_ids", "attention_mask", "position_ids", "labels")
    )
    assert b["position_ids"].is_contiguous() and b["position_ids"].stride(0) == t
    mrs, refs = read_e2e_csv(data_dir / "trainset.csv.gz")
    for j, i in enumerate([3, 0, 7]):
        n = int(b["attention_mask"][j].sum())
        ids, lab = b["input_ids"][j].tolist(), b["labels"][j].tolist()
        prompt = tok(" " + mrs[i])["input_ids"] + [eos]
        target = tok(" " + refs[i])["input_ids"] + [eos]
        assert ids[:n] == prompt + target  # " mr" <eos> " ref" <eos>, then padding
        assert lab[: len(prompt)] == [-100] * len(prompt)  # the prompt, its bos included, is masked
        assert lab[len(prompt) : n] == target and lab[n - 1] == eos  # reference and final eos are labelled
        assert lab[n:] == [-100] * (t - n) and bool(b["attention_mask"][j, n:].eq(0).all())
        assert b["position_ids"][j, :n].tolist() == list(range(n))
        assert tok.decode(target[:-1]) == " " + refs[i]
        # the gathered targets: the label at position s is predicted from position s - 1
        k = len(target)
        pos, y = b["target_positions"][j], b["target_labels"][j]
        assert pos[:k].tolist() == list(range(len(prompt) - 1, n - 1)) and y[:k].tolist() == target
        assert bool(y[k:].eq(-100).all())
    # truncation keeps the prompt and cuts the target's tail (the final eos is then not predicted)
    short = E2EGpt2(cfg(data_dir, max_length=30), trials=1, seed=0)  # the longest MR has 26 tokens
    sb = short.get_batch(torch.tensor([0]))
    lp = len(tok(" " + mrs[0])["input_ids"]) + 1
    assert sb["input_ids"].shape[1] == 30 and int((sb["labels"] != -100).sum()) == 30 - lp
    assert sb["labels"][0, -1] != eos and short.truncated["train"] == 40
    assert "40 train / " in short.data_note and "truncated to 30 tokens" in short.data_note
    with pytest.raises(ValueError, match="leaves no room"):
        E2EGpt2(cfg(data_dir, max_length=20), trials=1, seed=0)


# --------------------------------------------------------------------------------------------- model and loss


def test_model_is_untied_and_conv1d_swap_is_exact(task):
    from transformers.pytorch_utils import Conv1D

    model = fresh(task)
    lm = model.lm
    assert isinstance(model, GPT2AtTargets) and text.shared_parameters(model) == []
    assert lm.lm_head.weight is not lm.transformer.wte.weight and lm.config.tie_word_embeddings is False
    assert torch.equal(lm.lm_head.weight, lm.transformer.wte.weight)  # Li et al.: the embedding cloned
    lm.tie_weights()  # nothing re-ties them
    assert lm.lm_head.weight is not lm.transformer.wte.weight
    assert not any(isinstance(m, Conv1D) for m in model.modules())
    assert lm.config._attn_implementation == "sdpa" and lm.config.resid_pdrop == 0.0
    # the same model before the swap (Conv1D) computes the same function
    orig = E2EGpt2.__new__(E2EGpt2)
    orig.__dict__.update(task.__dict__, swap_conv1d=False)
    conv = fresh(orig)
    assert sum(isinstance(m, Conv1D) for m in conv.modules()) == 4  # c_attn, c_proj, c_fc, mlp c_proj
    batch = task.get_batch(torch.arange(5))
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids", "target_positions")}
    before = conv.eval()(**inputs)
    assert sorted(conv1d_to_linear(conv.lm)) == sorted(
        [
            "transformer.h.0.attn.c_attn",
            "transformer.h.0.attn.c_proj",
            "transformer.h.0.mlp.c_fc",
            "transformer.h.0.mlp.c_proj",
        ]
    )
    torch.testing.assert_close(conv(**inputs), before, rtol=0, atol=1e-6)
    torch.testing.assert_close(model.eval()(**inputs), before, rtol=0, atol=1e-6)


def test_target_only_loss_equals_a_hand_computation(task):
    model = fresh(task).eval()
    batch = task.get_batch(torch.tensor([5, 1, 2, 9]))
    losses = task.loss_per_example(model, batch)
    # by hand from the full (B, T, V) logits: shift, keep the labelled targets, mean per example
    logits = model.lm(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
    ).logits
    logp = F.log_softmax(logits[:, :-1], -1)
    y = batch["labels"][:, 1:]
    for j in range(4):
        keep = y[j] != -100
        nll = -logp[j, keep].gather(1, y[j, keep, None]).squeeze(1)
        assert int(keep.sum()) == len(task.train_ref_ids[[5, 1, 2, 9][j]]) + 1  # reference tokens + eos
        torch.testing.assert_close(losses[j], nll.mean(), rtol=1e-5, atol=1e-5)
    assert float(losses.detach().mean()) == pytest.approx(math.log(50_257), abs=0.3)  # fresh: ~uniform


def test_per_example_loss_independent_of_batch_and_padding(task, data_dir):
    model = fresh(task).train()
    idx = torch.tensor([4, 11, 0, 23, 8])
    batch = task.get_batch(idx)
    losses = task.loss_per_example(model, batch)
    single = torch.cat([task.loss_per_example(model, task.get_batch(idx[i : i + 1])) for i in range(5)])
    torch.testing.assert_close(single, losses, rtol=1e-5, atol=1e-5)
    fixed = E2EGpt2(cfg(data_dir, pad_to="max_length"), trials=1, seed=0)
    fb = fixed.get_batch(idx)
    assert fb["input_ids"].shape[1] == 96 > batch["input_ids"].shape[1]
    torch.testing.assert_close(fixed.loss_per_example(model, fb), losses, rtol=1e-5, atol=1e-5)
    # the task calls the model only through forward, with explicit (B, T) positions
    seen = []

    def forward(**kw):
        seen.append({k: tuple(v.shape) for k, v in kw.items()})
        return model(**kw)

    task.loss_per_example(forward, batch)
    assert len(seen) == 1 and seen[0]["position_ids"] == batch["input_ids"].shape


def test_functorch_engine_is_refused_clearly(task):
    eng = build_engine("functorch", fresh(task).train(), task.loss_per_example)
    with pytest.raises(ValueError, match=r"set train.clipping=bk \(the default\), ghost, hooks or loop"):
        eng.per_example_grads(task.get_batch(torch.arange(2)))


@pytest.mark.parametrize("swap", [True, False], ids=["linear", "conv1d"])
def test_clipping_engines_match_the_loop_oracle(task, swap):
    t = task
    if not swap:  # bk has a native Conv1D rule; Opacus falls back to a slow path there, so only bk is checked
        t = E2EGpt2.__new__(E2EGpt2)
        t.__dict__.update(task.__dict__, swap_conv1d=False)
    model = fresh(t)
    batch = t.get_batch(torch.tensor([2, 17, 5, 30]))
    batch["input_ids"][1, 3] = batch["input_ids"][1, 5]  # a repeated token: embedding rows summed per example
    clip = _median_norm(model, t, batch)
    engines = ("ghost", "bk", "hooks") if swap else ("bk",)
    norms = _oracle_check(model, t.loss_per_example, batch, clip=clip, engines=engines)
    assert norms.shape == (4,)


def test_micro_batches_by_length_change_no_clipped_sum(task):
    """The backend splits a logical batch in the task's ``micro_batch_order`` (by length: less padding); the sum of
    clipped per-example gradients is the one of the unsorted split, and the sorted micro-batches pad less."""
    idx = torch.tensor([3, 38, 0, 21, 9, 14, 27, 33, 5, 11])
    n = task.train_mr_ids.lengths()[task.train_mr_of_row] + task.train_ref_ids.lengths()
    ordered = task.micro_batch_order(idx)
    assert sorted(ordered.tolist()) == sorted(idx.tolist())
    assert list(n[ordered.numpy()]) == sorted(n[idx.numpy()])
    model = fresh(task)
    out = {o: release_in_micro_batch_order(task, model, idx, o) for o in (True, False)}
    for a, b in zip(out[True][0], out[False][0], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert out[True][1] < out[False][1]


# --------------------------------------------------------------------------------------------- decoding


def test_beam_search_outputs_text_without_line_breaks(task):
    model = fresh(task).eval()
    lm = model.lm
    with torch.no_grad():  # make every position prefer a newline, then "\n\n", then " the"
        bias = torch.randn(32)
        lm.transformer.ln_f.weight.zero_()
        lm.transformer.ln_f.bias.copy_(bias)
        lm.lm_head.weight.zero_()
        for tok_id, scale in ((198, 10.0), (628, 9.0), (44320, 8.0), (262, 5.0)):
            lm.lm_head.weight[tok_id] = scale * bias / bias.norm()
    assert [[198], [628], [44320]] == task.bad_words_ids
    outs = task.generate(model, [0, 3, 5])
    assert outs == ["the the the the the the"] * 3  # 6 new tokens, never a line break
    assert task.decode([262, 3290, 50256, 262]) == "the dog" and task.decode([262, 198, 3290]) == "the"


def test_evaluate_decodes_only_at_the_final_evaluation(task, data_dir):
    model = fresh(task).eval()
    m = task.evaluate(model)
    assert set(m) == {"test_loss"} and m["test_loss"] == pytest.approx(math.log(50_257), abs=0.3)
    f = task.evaluate(model, final=True)
    assert set(f) == {"test_loss", "test_bleu", "test_rougeL"} and f["test_loss"] == m["test_loss"]
    assert 0 <= f["test_bleu"] <= 100 and 0 <= f["test_rougeL"] <= 100
    gens = task.last_generations
    assert len(gens) == 4 and all(g["generated"] and "\n" not in g["generated"] for g in gens)
    assert gens[2]["references"] == task.test_refs[2] and len(gens[2]["references"]) == 3
    every = E2EGpt2(cfg(data_dir, generate_every_eval=True, generate_subset=2), trials=1, seed=0)
    assert "test_bleu" in every.evaluate(model)
    assert "first 2 of 12" in every.data_note
    never = E2EGpt2(cfg(data_dir, generate_subset=0), trials=1, seed=0)
    assert set(never.evaluate(model, final=True)) == {"test_loss"}


# --------------------------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_dp_steps_through_train(data_dir, isolated_dirs):
    from dp_adam_bench.train import train

    c = compose_cfg(
        [
            "task=e2e_gpt2",
            f"task.data_dir={data_dir}",
            "task.n_layer=1",
            "task.n_embd=32",
            "task.n_positions=128",
            "task.max_length=96",
            "task.test_subset=6",
            "task.generate_subset=3",
            "task.max_new_tokens=5",
            "task.num_beams=2",
            *two_private_steps("e2e", "train.clipping=ghost", "train.eval_every=1", "train.log_every=1"),
        ]
    )
    assert c.task.profile == "cpu" and c.task.generate_subset == 3
    s = train(c)
    assert s["steps"] == 2 and s["clipping"] == "ghost" and s["epsilon"]["rdp"] > 0
    m = s["metrics"]
    assert set(m) >= {"test_loss", "test_bleu", "test_rougeL"} and np.isfinite(m["test_loss"])
    assert 0 <= m["test_bleu"] <= 100 and 0 <= m["test_rougeL"] <= 100
    # decoding ran at the final evaluation only (step 2), not at the step-1 evaluation
    lines = [json.loads(x) for x in next(isolated_dirs.rglob("metrics.jsonl")).read_text().splitlines()]
    evals = {r["step"]: r for r in lines if "test_loss" in r}
    assert "test_bleu" not in evals[1] and "test_bleu" in evals[2]


# --------------------------------------------------------------------------------------------- the real CPU profile


@pytest.mark.skipif(not (shared_data_dir() / "e2e_nlg").is_dir(), reason="needs shared/data/e2e_nlg")
def test_real_cpu_profile_defaults():
    t = E2EGpt2(
        OmegaConf.create({"profile": "cpu", "train_subset": 64, "test_subset": 8, "generate_subset": None}),
        trials=1,
        seed=0,
    )
    assert t.full_sizes == {"train": 42_061, "test": 4_693, "test_mrs": 630}
    assert t.dataset_size == 64 and len(t.test_mrs) == 8 and t.n_generate == 8 and t.max_new_tokens == 60
    assert "TRAINED FROM SCRATCH" in t.data_note and "compare orderings" in t.data_note
    assert t.tokenizer_name == str(TOKENIZER) and t.truncated == {"train": 0, "test": 0}
    torch.manual_seed(0)
    model = t.build_model()
    assert model.config.n_layer == 2 and model.config.n_embd == 128 and model.config.resid_pdrop == 0.1
    # 2 x 50,257 x 128 (embedding + untied head) + 256 x 128 positions + 2 blocks + final LayerNorm
    assert sum(p.numel() for p in model.parameters()) == 13_295_360
    loss = t.loss_per_example(model.eval(), t.get_batch(torch.arange(3)))
    assert loss.shape == (3,) and float(loss.detach().mean()) == pytest.approx(math.log(50_257), abs=0.3)


@pytest.mark.parametrize("method", ["lora", "prefix", "top1", "rgp"])
def test_each_finetuning_method_runs_end_to_end(method, data_dir, isolated_dirs):
    """task.finetune through the CLI's train(): the run trains and decodes (prefix-tuning through peft's generate),
    its summary records the method and the trainable count, and every trainable tensor moved."""
    from dp_adam_bench.train import train

    c = compose_cfg(
        [
            "task=e2e_gpt2",
            f"task.data_dir={data_dir}",
            "task.n_layer=2",
            "task.n_embd=32",
            "task.n_positions=128",
            "task.max_length=96",
            "task.test_subset=4",
            "task.generate_subset=2",
            "task.max_new_tokens=4",
            "task.num_beams=2",
            f"task.finetune={method}",
            *two_private_steps("e2e_methods", "train.steps=3"),
        ]
    )
    s = train(c)
    assert s["steps"] == 3 and s["finetune"]["method"] == method
    assert s["moved_check"]["unmoved"] == [] and s["moved_check"]["step"] == 3
    assert 0 < s["finetune"]["trainable_params"] < 13_295_360 and {"test_bleu", "test_loss"} <= set(
        s["metrics"]
    )
