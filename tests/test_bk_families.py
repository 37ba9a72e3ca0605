"""Families outside the model zoo built from the same patterns (scaled and shared embeddings, tied heads, layer
scales, relative position biases, window attention, encoder-decoders fed the tokenizer's batch): bk either matches
the loop over batches of size one in float64, or refuses in one line naming the layer. Tiny configs, one or two
layers, random weights."""

from __future__ import annotations

import re

import pytest
import torch
from bk_oracle import assert_matches_loop
from torch.nn import functional as F

from dp_adam_bench.engine.bk import BKEngine
from dp_adam_bench.engine.seq2seq import with_decoder_inputs

B, T, V = 3, 6, 40
CLIP = 0.5


def _tf():
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


def lm_loss(m, b):
    logits = m(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    return F.cross_entropy(logits[:, :-1].transpose(1, 2), b["input_ids"][:, 1:], reduction="none").mean(1)


def seq2seq_loss(m, b):
    inputs = with_decoder_inputs(
        m, {"input_ids": b["input_ids"], "attention_mask": b["attention_mask"]}, b["labels"]
    )
    return F.cross_entropy(m(**inputs).logits.transpose(1, 2), b["labels"], reduction="none").mean(1)


def cls_loss(m, b):
    logits = m(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    return F.cross_entropy(logits, b["y"], reduction="none")


def image_loss(m, b):
    return F.cross_entropy(m(b["pixel_values"]).logits, b["y"], reduction="none")


_S2S = dict(
    vocab_size=V, d_model=8, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
    encoder_ffn_dim=16, decoder_ffn_dim=16, max_position_embeddings=32, dropout=0.0, pad_token_id=0,
    decoder_start_token_id=2, bos_token_id=2, eos_token_id=1,
)  # fmt: skip
_DEC = dict(vocab_size=V, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2)
_NODROP = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)

#: name -> (config class, model class, config kwargs, loss, batch kind, expected: "exact" or a refusal's pattern)
FAMILIES = {
    "mbart": ("MBartConfig", "MBartForConditionalGeneration", dict(_S2S, scale_embedding=True), seq2seq_loss, "text",
              "exact"),
    "marian": ("MarianConfig", "MarianMTModel", _S2S, seq2seq_loss, "text", "exact"),
    "pegasus": ("PegasusConfig", "PegasusForConditionalGeneration", _S2S, seq2seq_loss, "text", "exact"),
    "mt5": ("MT5Config", "MT5ForConditionalGeneration", dict(vocab_size=V, d_model=8, d_kv=4, d_ff=16, num_layers=1,
            num_heads=2, dropout_rate=0.0, relative_attention_num_buckets=4, decoder_start_token_id=0),
            seq2seq_loss, "text", "exact"),
    "albert": ("AlbertConfig", "AlbertForSequenceClassification", dict(vocab_size=V, embedding_size=4, hidden_size=8,
               num_hidden_layers=2, num_attention_heads=2, intermediate_size=16, num_labels=3,
               max_position_embeddings=32, classifier_dropout_prob=0.0, **_NODROP), cls_loss, "text", "exact"),
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(vocab_size=V, hidden_size=8, n_layer=1, n_head=2,
              hidden_dropout=0.0, attention_dropout=0.0), lm_loss, "text", "exact"),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(_DEC, num_key_value_heads=1, head_dim=4,
              max_position_embeddings=32), lm_loss, "text", "exact"),
    "phi": ("PhiConfig", "PhiForCausalLM", dict(_DEC, max_position_embeddings=32, resid_pdrop=0.0, embd_pdrop=0.0),
            lm_loss, "text", "exact"),
    "beit": ("BeitConfig", "BeitForImageClassification", dict(image_size=16, patch_size=8, hidden_size=8,
             num_hidden_layers=1, num_attention_heads=2, intermediate_size=16, num_labels=3,
             use_relative_position_bias=True, layer_scale_init_value=0.5, drop_path_rate=0.0, **_NODROP),
             image_loss, "image", "exact"),
    # refused in one line, naming the layer: their position tables are computed once for every example
    "swinv2": ("Swinv2Config", "Swinv2ForImageClassification", dict(image_size=16, patch_size=2, embed_dim=8,
               depths=[2], num_heads=[2], window_size=4, num_labels=3, drop_path_rate=0.0, **_NODROP), image_loss,
               "image", r"layer 'swinv2\.encoder\.layers\.0\.blocks\.0\.attention\.self\.continuous_position_bias_mlp"
               r"\.0' \(Linear\) sees \d+ rows? for a batch of 3 examples"),
    "deberta_v2": ("DebertaV2Config", "DebertaV2ForSequenceClassification", dict(vocab_size=V, hidden_size=8,
                   num_hidden_layers=1, num_attention_heads=2, intermediate_size=16, num_labels=3,
                   relative_attention=True, position_buckets=4, max_relative_positions=8, pos_att_type=["p2c", "c2p"],
                   max_position_embeddings=32, **_NODROP), cls_loss, "text",
                   r"layer 'deberta\.encoder\.layer\.0\.attention\.self\.\w+_proj' \(Linear\) sees 1 row"),
}  # fmt: skip


def _batch(kind):
    g = torch.Generator().manual_seed(0)
    y = torch.tensor([0, 1, 2])
    if kind == "image":
        return {"pixel_values": torch.randn(B, 3, 16, 16, generator=g, dtype=torch.float64), "y": y}
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, -2:] = 0
    labels = torch.randint(3, V, (B, 4), generator=g)
    return {
        "input_ids": torch.randint(3, V, (B, T), generator=g),
        "attention_mask": mask,
        "labels": labels,
        "y": y,
    }


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_is_exact_or_refused_naming_the_layer(name):
    tf = _tf()
    config, model, kwargs, loss, kind, expected = FAMILIES[name]
    torch.manual_seed(0)
    m = getattr(tf, model)(getattr(tf, config)(**kwargs)).double().train()
    batch = _batch(kind)
    engine = BKEngine(m, loss)
    try:
        got = engine.clipped_sum(batch, CLIP)
    except ValueError as err:
        assert expected != "exact", f"{name}: refused: {err}"
        assert "\n" not in str(err)
        assert re.search(expected, str(err)), str(err)
        return
    finally:
        engine.close()
    assert expected == "exact", f"{name}: expected a refusal, got an exact-looking result"
    assert_matches_loop(got, m, loss, engine.params, batch, CLIP, rtol=1e-9, atol=1e-13)
