"""Sequence-to-sequence fine-tuning from the tokenizer's own batch (``input_ids``, ``attention_mask``, ``labels``;
``engine/seq2seq.py``): the decoder inputs built from the labels are the ones the model builds in its own forward,
and T5 and BART (tied embeddings as built) train through make_private with bk, its self-check against the size-one
loop passing."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from dp_adam_bench.engine.seq2seq import decoder_input_ids, with_decoder_inputs
from dp_adam_bench.errors import ConfigError

SOURCES = [
    "translate english to german : the house is small",
    "translate english to german : the house is big",
    "translate english to german : the house is green",
    "translate english to german : the small house",
    "translate english to german : the big green house",
    "translate english to german : the house",
]
TARGETS = ["das haus ist klein", "das haus ist gross", "das haus ist grun", "das kleine haus", "das grosse grune haus",
           "das haus"]  # fmt: skip


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = " ".join(SOURCES + TARGETS).split()
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(dict.fromkeys(words))}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )


def _batch():
    """The tokenizer's batch, labels padded with -100 (as DataCollatorForSeq2Seq pads them)."""
    tok = _tokenizer()
    batch = dict(tok(SOURCES, text_target=TARGETS, padding="longest", return_tensors="pt"))
    batch["labels"] = batch["labels"].masked_fill(batch["labels"] == tok.pad_token_id, -100)
    return batch, len(tok)


def _t5(vocab):
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.T5Config(
        vocab_size=vocab, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2, dropout_rate=0.0,
        relative_attention_num_buckets=4, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    )  # fmt: skip
    return transformers.T5ForConditionalGeneration(cfg)


def _bart(vocab):
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.BartConfig(
        vocab_size=vocab, d_model=8, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=16, decoder_ffn_dim=16, max_position_embeddings=32, dropout=0.0,
        scale_embedding=True, pad_token_id=0, bos_token_id=2, eos_token_id=1, decoder_start_token_id=1,
    )  # fmt: skip
    return transformers.BartForConditionalGeneration(cfg)


BUILD = {"t5": _t5, "bart": _bart}


def token_loss(output, labels):
    """The user's loss: each example's mean cross-entropy over its labelled tokens (logits aligned with labels)."""
    ce = F.cross_entropy(output.logits.transpose(1, 2), labels, reduction="none", ignore_index=-100)
    kept = (labels != -100).to(ce.dtype)
    return (ce * kept).sum(1) / kept.sum(1).clamp(min=1)


@pytest.mark.parametrize("family", sorted(BUILD))
def test_decoder_inputs_are_the_models_own(family):
    batch, vocab = _batch()
    torch.manual_seed(0)
    model = BUILD[family](vocab).eval()
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    built = with_decoder_inputs(model, inputs, batch["labels"])
    assert set(built) == {"input_ids", "attention_mask", "decoder_input_ids"}
    with torch.no_grad():
        own = model(**batch)  # the model shifts its labels itself
        ours = model(**built)
    torch.testing.assert_close(ours.logits, own.logits, rtol=0, atol=0)
    # the model's mean token loss is ours averaged over tokens (equal when weighted by each example's count)
    kept = (batch["labels"] != -100).sum(1)
    mean = (token_loss(ours, batch["labels"]) * kept).sum() / kept.sum()
    torch.testing.assert_close(mean, own.loss)


def test_a_model_without_its_own_shift_gets_labels_shifted_by_its_config():
    """A model without ``prepare_decoder_input_ids_from_labels`` is fed the labels shifted right, its
    decoder_start_token_id first and -100 as its pad; one without those ids is refused in one line."""
    from types import SimpleNamespace

    labels = torch.tensor([[5, 6, -100, -100], [7, 8, 9, 1]])
    bare = SimpleNamespace(config=SimpleNamespace(decoder_start_token_id=2, pad_token_id=0))
    want = torch.tensor([[2, 5, 6, 0], [2, 7, 8, 9]])
    torch.testing.assert_close(decoder_input_ids(bare, labels), want)
    with pytest.raises(ConfigError, match="decoder_start_token_id") as err:
        decoder_input_ids(SimpleNamespace(config=SimpleNamespace(pad_token_id=0)), labels)
    assert "\n" not in str(err.value)


def test_classifier_labels_and_given_decoder_inputs_are_left_alone():
    batch, vocab = _batch()
    model = _t5(vocab)
    inputs = {"input_ids": batch["input_ids"]}
    assert (
        with_decoder_inputs(model, inputs, torch.tensor([0, 1, 0, 1, 0, 1])) is inputs
    )  # (B,): a classifier
    given = {**inputs, "decoder_input_ids": batch["input_ids"][:, :2]}
    assert with_decoder_inputs(model, given, batch["labels"]) is given
    plain = torch.nn.Linear(2, 2)
    assert with_decoder_inputs(plain, inputs, batch["labels"]) is inputs


@pytest.mark.parametrize("family", sorted(BUILD))
def test_seq2seq_fine_tune_from_the_tokenizers_batch(family):
    """make_private with bk on the tokenizer's batch as it comes: tied embeddings as built (not untied), the
    self-check against the size-one loop passes, and the parameters move."""
    import dp_adam_bench as dab

    batch, vocab = _batch()
    torch.manual_seed(0)
    model = BUILD[family](vocab)
    ids = sorted(id(p) for p in model.parameters())
    dataset = [{k: v[i] for k, v in batch.items()} for i in range(len(SOURCES))]
    before = [p.detach().clone() for p in model.parameters()]
    private = dab.make_private(
        model, dataset, token_loss, optimizer="adam", sigma=1.0, batch_size=3, steps=2, lr=1e-2, seed=0
    )
    while not private.done:
        private.step()
    assert private.self_check["max_rel_error"] < 1e-5
    assert sorted(id(p) for p in model.parameters()) == ids  # still tied: nothing untied
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    private.close()
