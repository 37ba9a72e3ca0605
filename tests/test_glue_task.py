"""The GLUE task (dp_adam_bench/tasks/glue.py) on tiny fixtures made here: a 2-layer BERT masked-LM and encoder
saved with ``save_pretrained``, a small WordPiece vocabulary, and GLUE TSVs in each task's column layout.

Oracles: the infilling model's label-word logits against the full masked-LM's logits at the mask; the templates
against LM-BFF's notation spelled out by hand; bk's per-example norms and clipped sums against the loop over
batches of size one, for both objectives."""

import gzip

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from test_text_tasks import tiny_bert_config

from dp_adam_bench.engine.engines import build_engine
from dp_adam_bench.engine.grads import clip_factors
from dp_adam_bench.tasks.glue import (
    SPECS,
    GlueTask,
    LabelWordScores,
    label_word_ids,
    load_glue_split,
    read_glue_file,
    render_template,
)

from helpers import compose_cfg, release_in_micro_batch_order, two_private_steps, wordpiece_tokenizer

torch.set_num_threads(1)

WORDS = (
    "a the film movie is was it great terrible good bad plot acting and not very fun dull no yes maybe "
    "what who does do cat dog sat on mat where man runs"
).split()
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, ".", ",", "?", "##s"]
SST2_TRAIN = [
    ("1", "the film is great ."),
    ("0", "the plot is dull"),
    ("1", "very fun acting"),
    ("0", "a bad movie ."),
    ("1", "good film and great acting ."),
    ("0", "not fun , not good"),
    ("1", "it was great"),
    ("0", "the movie is terrible ."),
]
SST2_DEV = [("1", "great fun ."), ("0", "dull and bad ."), ("1", "the acting is good")]


def _tsv(path, header, rows):
    with gzip.open(path, "wt") as f:
        f.write("\t".join(header) + "\n")
        for r in rows:
            f.write("\t".join(r) + "\n")


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    """Folders: ``mlm`` (a pretrained tiny BertForMaskedLM + tokenizer), ``encoder`` (its encoder alone), ``data``
    (sst2/ label-first as the offline copy, mnli/ qnli/ qqp/ in GLUE's own layout)."""
    from transformers import BertForMaskedLM

    root = tmp_path_factory.mktemp("glue")
    tok = wordpiece_tokenizer(root / "tok", VOCAB)
    torch.manual_seed(0)
    mlm = BertForMaskedLM(tiny_bert_config(vocab_size=len(VOCAB)))
    with torch.no_grad():
        for p in mlm.parameters():
            p.add_(0.05 * torch.randn_like(p))
    mlm.save_pretrained(root / "mlm")
    tok.save_pretrained(root / "mlm")
    mlm.bert.save_pretrained(root / "encoder")
    tok.save_pretrained(root / "encoder")
    data = root / "data"
    for name in ("sst2", "mnli", "qnli", "qqp"):
        (data / name).mkdir(parents=True)
    _tsv(data / "sst2" / "train.tsv.gz", ["label", "sentence"], SST2_TRAIN)
    _tsv(data / "sst2" / "dev.tsv.gz", ["label", "content"], SST2_DEV)
    pairs = [("what does the cat do?", "The cat sat on the mat."), ("who runs?", "A man runs.")]
    _tsv(
        data / "mnli" / "train.tsv.gz",
        ["index", "genre", "sentence1", "sentence2", "label1", "gold_label"],
        [("0", "g", "The cat sat.", "A cat sat.", "entailment", "entailment"),
         ("1", "g", "The dog runs.", "No dog runs.", "neutral", "contradiction")],
    )  # fmt: skip
    _tsv(data / "qnli" / "dev.tsv.gz", ["index", "question", "sentence", "label"],
         [("0", *pairs[0], "entailment"), ("1", *pairs[1], "not_entailment")])  # fmt: skip
    _tsv(data / "qqp" / "dev.tsv.gz", ["id", "qid1", "qid2", "question1", "question2", "is_duplicate"],
         [("0", "1", "2", *pairs[0], "1"), ("1", "3", "4", *pairs[1], "0")])  # fmt: skip
    return root


def glue_cfg(fixtures, **kw):
    base = dict(name="glue_sst2", profile="cpu", glue="sst2", objective="classifier", model=str(fixtures / "encoder"),
                pretrained=True, data_dir=str(fixtures / "data"), max_length=24, pad_to="longest")  # fmt: skip
    return OmegaConf.create({**base, **kw})


def test_each_glue_layout_is_read_with_its_labels(fixtures):
    data = fixtures / "data"
    sst = read_glue_file(data / "sst2" / "train.tsv.gz", SPECS["sst2"])
    assert (
        sst.b is None
        and sst.a[0] == "the film is great ."
        and sst.labels.tolist() == [1, 0, 1, 0, 1, 0, 1, 0]
    )
    mnli = read_glue_file(data / "mnli" / "train.tsv.gz", SPECS["mnli"])
    assert mnli.b == ["A cat sat.", "No dog runs."] and mnli.labels.tolist() == [
        1,
        0,
    ]  # gold_label, not label1
    assert read_glue_file(data / "qnli" / "dev.tsv.gz", SPECS["qnli"]).labels.tolist() == [0, 1]
    assert read_glue_file(data / "qqp" / "dev.tsv.gz", SPECS["qqp"]).labels.tolist() == [1, 0]
    bad = fixtures / "bad.tsv.gz"
    _tsv(bad, ["label", "sentence"], [("1", "fine"), ("positive", "oops")])
    with pytest.raises(ValueError, match=r"row 1 has label='positive'; want one of \('0', '1'\)"):
        read_glue_file(bad, SPECS["sst2"])


def test_templates_are_lm_bffs(fixtures):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(fixtures / "mlm")

    def words(ids):
        return tok.convert_ids_to_tokens(ids)

    ids, m = render_template(SPECS["sst2"].template, tok, ["the plot is dull"], 32)
    assert (
        words(ids) == ["[CLS]", "the", "plot", "is", "dull", "it", "was", "[MASK]", ".", "[SEP]"] and m == 7
    )
    # MNLI: sentence 0 loses its last character ('?'), then '?', the mask, ',', sentence 1 with a lower-case start
    ids, m = render_template(SPECS["mnli"].template, tok, ["what does the cat do?", "The cat sat."], 32)
    assert words(ids) == ["[CLS]", "what", "does", "the", "cat", "do", "?", "[MASK]", ",", "the", "cat", "sat",
                          ".", "[SEP]"]  # fmt: skip
    # too long: the longest sentence loses tokens from its head, the template's own tokens stay
    ids, m = render_template(SPECS["sst2"].template, tok, ["a bad movie and a dull plot and not fun"], 9)
    assert words(ids) == ["[CLS]", "and", "not", "fun", "it", "was", "[MASK]", ".", "[SEP]"] and m == 6
    assert label_word_ids(tok, SPECS["sst2"].words, SPECS["sst2"].labels) == tok.convert_tokens_to_ids(
        ["terrible", "great"]
    )
    with pytest.raises(ValueError, match=r"label word 'dogs' \(label 1\) is 2 tokens"):
        label_word_ids(tok, {"0": "bad", "1": "dogs"}, ("0", "1"))
    with pytest.raises(
        ValueError, match=r"label word 'awesome' \(label 1\) is not in this tokenizer's vocab"
    ):
        label_word_ids(tok, {"0": "bad", "1": "awesome"}, ("0", "1"))


def test_infilling_scores_are_the_masked_lms_logits_of_the_label_words(fixtures):
    from transformers import BertForMaskedLM

    task = GlueTask(glue_cfg(fixtures, objective="infilling", model=str(fixtures / "mlm")), trials=1, seed=0)
    model = task.build_model().eval()
    assert isinstance(model, LabelWordScores)
    batch = task.get_batch(torch.arange(4))
    got = task.logits(model, batch)
    full = BertForMaskedLM.from_pretrained(fixtures / "mlm").eval()
    with torch.no_grad():
        logits = full(
            **{k: batch[k] for k in ("input_ids", "attention_mask", "token_type_ids", "position_ids")}
        ).logits
    rows = torch.arange(4)
    want = logits[rows, batch["mask_position"]][:, task.word_ids]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert (batch["input_ids"][rows, batch["mask_position"]] == 4).all()  # [MASK] where the scores are read


@pytest.mark.parametrize("objective", ["classifier", "infilling"])
@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_bk_matches_the_loop(fixtures, request, family, objective):
    """Per-example norms and the clipped sum of bk against the loop over batches of size one, for each model family
    and objective (a masked-LM folder serves the classifier too: its encoder loads, the head is new)."""
    folder = request.getfixturevalue("roberta") if family == "roberta" else fixtures / "mlm"
    task = GlueTask(glue_cfg(fixtures, objective=objective, model=str(folder)), trials=1, seed=0)
    torch.manual_seed(0)
    model = task.build_model().train()
    batch = task.get_batch(torch.arange(8))
    ref = build_engine("loop", model, task.loss_per_example).per_example_grads(batch)
    norms = torch.sqrt(sum(g.reshape(8, -1).pow(2).sum(1) for g in ref))
    clip = float(norms.median())
    f = clip_factors(norms, clip)
    eng = build_engine("bk", model, task.loss_per_example)
    try:
        out = eng.clipped_sum(batch, clip)
    finally:
        eng.close()
    torch.testing.assert_close(out.norms, norms, rtol=1e-4, atol=1e-6)
    for s, g in zip(out.summed, ref, strict=True):
        torch.testing.assert_close(s, torch.einsum("b,b...->...", f, g), rtol=1e-4, atol=2e-5)


def test_evaluate_scores_dev_and_bad_settings_are_one_line(fixtures):
    task = GlueTask(glue_cfg(fixtures), trials=1, seed=0)
    assert (
        task.dataset_size == 8 and task.test_size == 3 and "GLUE sst2 train (8) / dev (3)" in task.data_note
    )
    m = task.evaluate(task.build_model())
    assert 0 <= m["test_accuracy"] <= 100 and np.isfinite(m["test_loss"])
    for kw, msg in (
        ({"glue": "cola"}, "task.glue='cola'; valid: sst2, mnli, qnli, qqp"),
        ({"objective": "prompt"}, "task.objective='prompt'; valid: classifier, infilling"),
        ({"eval_split": "train"}, "task.train_split and task.eval_split are both 'train'"),
        (
            {"eval_split": "dev_mismatched"},
            "GLUE sst2 has no split 'dev_mismatched'; valid: train, dev, test",
        ),
    ):
        with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)")):
            GlueTask(glue_cfg(fixtures, **kw), trials=1, seed=0)
    # an encoder without its masked-LM head cannot read the label words' prior: refused, not a random head
    headless = GlueTask(glue_cfg(fixtures, objective="infilling"), trials=1, seed=0)  # the 'encoder' folder
    with pytest.raises(
        ValueError, match=r"has no weights for cls\.\* \(\d+ tensors\): task.objective=infilling"
    ):
        headless.build_model()
    with pytest.raises(
        ValueError, match=r"glue_sst2 supports BERT and RoBERTa checkpoints .* model_type='gpt2'"
    ):
        gpt2 = fixtures / "gpt2"
        gpt2.mkdir(exist_ok=True)
        (gpt2 / "config.json").write_text('{"model_type": "gpt2"}')
        GlueTask(glue_cfg(fixtures, model=str(gpt2)), trials=1, seed=0)
    with pytest.raises(FileNotFoundError, match=r"no GLUE qnli 'train' split found \(source='local'\)"):
        GlueTask(glue_cfg(fixtures, glue="qnli", source="local"), trials=1, seed=0)


def test_the_hubs_glue_columns_and_integer_labels_become_ours(fixtures, monkeypatch):
    """datasets.load_dataset("nyu-mll/glue", task) when no folder has the files: MNLI's premise / hypothesis and its
    label order (0 entailment, 1 neutral, 2 contradiction) mapped onto the files' label names."""
    import datasets

    calls = []

    def fake(name, config, split):
        calls.append((name, config, split))
        return {"premise": ["The cat sat.", "A dog runs."], "hypothesis": ["A cat sat.", "No dog runs."],
                "label": [0, 2]}  # fmt: skip

    monkeypatch.setattr(datasets, "load_dataset", fake)
    data, origin = load_glue_split(SPECS["mnli"], "dev", fixtures / "nowhere", "hf")
    assert (
        calls == [("nyu-mll/glue", "mnli", "validation_matched")]
        and origin == "hf:nyu-mll/glue/mnli[validation_matched]"
    )
    assert data.a == ["The cat sat.", "A dog runs."] and data.b == ["A cat sat.", "No dog runs."]
    assert [SPECS["mnli"].labels[i] for i in data.labels] == ["entailment", "contradiction"]
    with pytest.raises(ValueError, match=r"labels outside 0\.\.2"):
        monkeypatch.setattr(
            datasets, "load_dataset", lambda *a, **k: {"premise": ["x"], "hypothesis": ["y"], "label": [-1]}
        )
        load_glue_split(SPECS["mnli"], "dev", None, "hf")


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["classifier", "infilling"])
def test_micro_batches_by_length_change_no_clipped_sum(fixtures, objective):
    """The backend splits a logical batch in the task's ``micro_batch_order`` (by token count); the clipped sum is
    the one of the sampling order, and the sorted micro-batches' longest rows add up to less (the fixtures' batches
    all pad to 8, a multiple of 8, so their widths cannot show it)."""
    task = GlueTask(glue_cfg(fixtures, objective=objective, model=str(fixtures / "mlm")), trials=1, seed=0)
    idx = torch.tensor([4, 2, 6, 0, 3, 1, 5, 7])  # the longest sentence among the shortest
    ordered = task.micro_batch_order(idx)
    n = task.train_ids.lengths()
    assert sorted(ordered.tolist()) == sorted(idx.tolist())
    assert list(n[ordered.numpy()]) == sorted(n[idx.numpy()])
    torch.manual_seed(0)
    model = task.build_model().train()
    out = {o: release_in_micro_batch_order(task, model, idx, o) for o in (True, False)}
    for a, b in zip(out[True][0], out[False][0], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)

    def longest(order):
        return sum(int(n[c.numpy()].max()) for c in order.split(3))

    assert longest(ordered) < longest(idx)


@pytest.mark.parametrize("finetune", ["lora", "rgp", "head", "prefix"])
def test_each_method_that_trains_fewer_parameters_takes_two_dp_steps(fixtures, isolated_dirs, finetune):
    """LoRA, RGP and the head train the classifier privately; prefix-tuning, which peft builds for generation
    only, is refused in one line before any step."""
    from dp_adam_bench.errors import ConfigError
    from dp_adam_bench.train import train

    cfg = compose_cfg(
        [
            "task=glue_sst2",
            f"task.finetune={finetune}",
            f"task.model={fixtures / 'mlm'}",
            f"task.data_dir={fixtures / 'data'}",
            "task.max_length=24",
            *two_private_steps("glue", batch=4, physical=3),
        ]
    )
    if finetune == "prefix":
        with pytest.raises(ConfigError, match="peft cannot prefix-tune BertForSequenceClassification") as err:
            train(cfg)
        assert "\n" not in str(err.value)
        return
    s = train(cfg)
    total = sum(p.numel() for p in GlueTask(cfg.task, trials=1, seed=0).build_model().parameters())
    assert s["steps"] == 2 and s["finetune"]["method"] == finetune
    assert 0 < s["finetune"]["trainable_params"] < total
    assert s["self_check"]["max_rel_error"] < 1e-3 and 0 <= s["metrics"]["test_accuracy"] <= 100


def test_two_dp_steps_of_infilling_through_train(fixtures, isolated_dirs):
    from dp_adam_bench.train import train

    cfg = compose_cfg(
        [
            "task=glue_sst2",
            "task.objective=infilling",
            f"task.model={fixtures / 'mlm'}",
            f"task.data_dir={fixtures / 'data'}",
            "task.max_length=24",
            *two_private_steps("glue", batch=4, physical=3),
        ]
    )
    s = train(cfg)
    assert s["steps"] == 2 and s["clipping"] == "bk" and s["self_check"]["max_rel_error"] < 1e-3
    assert 0 <= s["metrics"]["test_accuracy"] <= 100 and s["epsilon"]["rdp"] > 0


# --------------------------------------------------------------------------------------------- RoBERTa (paper)


@pytest.fixture(scope="module")
def roberta(tmp_path_factory, fixtures):
    """A tiny RobertaForMaskedLM (pretrained, perturbed) with a byte-level BPE vocabulary trained here, in which
    ' great' and ' terrible' are single tokens, as in RoBERTa's."""
    import json

    from tokenizers import ByteLevelBPETokenizer
    from transformers import AutoTokenizer, RobertaConfig, RobertaForMaskedLM

    folder = tmp_path_factory.mktemp("roberta")
    corpus = [s for _, s in SST2_TRAIN + SST2_DEV] + ["it was great", "it was terrible"] * 20
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        corpus * 5,
        vocab_size=300,
        min_frequency=1,
        special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
    )
    bpe.save_model(str(folder))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "RobertaTokenizer"}))
    tok = AutoTokenizer.from_pretrained(folder)
    config = RobertaConfig(
        vocab_size=len(tok), hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=66, type_vocab_size=1, pad_token_id=tok.pad_token_id, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    mlm = RobertaForMaskedLM(config)
    with torch.no_grad():
        for p in mlm.parameters():
            p.add_(0.05 * torch.randn_like(p))
    mlm.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def test_roberta_infilling_scores_are_its_own_forwards_with_its_own_positions(fixtures, roberta):
    """Our explicit positions (padding_idx + 1 on) and one segment give what RobertaForMaskedLM computes alone."""
    from transformers import RobertaForMaskedLM

    task = GlueTask(glue_cfg(fixtures, objective="infilling", model=str(roberta)), trials=1, seed=0)
    model = task.build_model().eval()
    assert (
        isinstance(model, LabelWordScores) and model.base_name == "roberta" and model.head_name == "lm_head"
    )
    batch = task.get_batch(torch.arange(8))
    real = batch["attention_mask"].bool()
    assert (
        not real.all()
        and (batch["position_ids"][~real] == 1).all()
        and (batch["position_ids"][:, 0] == 2).all()
    )
    assert (batch["token_type_ids"] == 0).all()
    full = RobertaForMaskedLM.from_pretrained(roberta).eval()
    with torch.no_grad():
        logits = full(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    want = logits[torch.arange(8), batch["mask_position"]][:, task.word_ids]
    torch.testing.assert_close(task.logits(model, batch), want, rtol=1e-5, atol=1e-6)
    # the label words are read as they follow a space: RoBERTa's ' great', not the word-initial 'great'
    assert task.tokenizer.convert_ids_to_tokens(task.word_ids) == ["Ġterrible", "Ġgreat"]


@pytest.mark.parametrize("objective", ["classifier", "infilling"])
def test_roberta_runs_log_clean_gradient_diagnostics(fixtures, roberta, isolated_dirs, objective):
    """The li_glue preset logs clean-gradient diagnostics on every private row (its table's noise note reads them):
    RoBERTa, the paper profile's family, with both objectives, logs ||g|| / C and the private and clean v."""
    import json

    from dp_adam_bench.train import train

    cfg = compose_cfg(
        [
            "task=glue_sst2",
            f"task.objective={objective}",
            f"task.model={roberta}",
            f"task.data_dir={fixtures / 'data'}",
            "task.max_length=24",
            "diagnostics.every=1",
            "diagnostics.histograms=false",
            *two_private_steps("glue_diag", batch=4, physical=3),
        ]
    )
    s = train(cfg)
    assert s["steps"] == 2
    folder = next((isolated_dirs / "runs" / "glue_diag").glob("*/private_diagnostics.jsonl"))
    rows = [json.loads(line) for line in folder.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["diag/grad_norm_over_clip"] >= 0 and r["diag/v_private_median"] > 0
        assert "diag/v_clean_median" in r
