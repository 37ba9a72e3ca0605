"""bk on one parameter used by several layers in one forward (tied weights, ``engine/bk_rules/shared.py``): the
per-example norms and the clipped sum, per parameter, against the loop over batches of size one in float64, on
every pair of uses bk combines (embedding + tied LM head, encoder + decoder embeddings, a dense layer, a norm and
the generic rule), on each path (Gram, instantiated, scale-then-privatize); refused naming the layer where a rule
cannot combine; and ``fix_model`` leaving alone what bk trains as it is."""

from __future__ import annotations

import pytest
import torch
from bk_oracle import loop_reference
from torch import nn
from torch.nn import functional as F

from dp_adam_bench.engine.bk import BKEngine
from dp_adam_bench.engine.fix_model import fix_model

B, T, V = 3, 5, 23
CLIP = 0.3


def _quiet():
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


def gpt2_tied():
    tf = _quiet()
    cfg = tf.GPT2Config(
        vocab_size=V, n_embd=8, n_layer=1, n_head=2, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return tf.GPT2LMHeadModel(cfg)


def t5_tied():
    tf = _quiet()
    cfg = tf.T5Config(
        vocab_size=V, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2, dropout_rate=0.0,
        relative_attention_num_buckets=4, tie_word_embeddings=True,
    )  # fmt: skip
    return tf.T5ForConditionalGeneration(cfg)


def bart_tied():
    tf = _quiet()
    cfg = tf.BartConfig(
        vocab_size=V, d_model=8, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=16, decoder_ffn_dim=16, max_position_embeddings=16, dropout=0.0,
        scale_embedding=True, pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
    )  # fmt: skip
    return tf.BartForConditionalGeneration(cfg)


def lm_loss(model, batch):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return F.cross_entropy(logits[:, :-1].transpose(1, 2), batch["input_ids"][:, 1:], reduction="none").mean(
        1
    )


def seq2seq_loss(model, batch):
    logits = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        decoder_input_ids=batch["decoder"],
    ).logits
    return F.cross_entropy(logits.transpose(1, 2), batch["labels"], reduction="none").mean(1)


class Mixed(nn.Module):
    """One (V, 6) table used four ways: looked up twice by two Embedding modules (one of them twice), as a Linear
    head's weight, and by a module without a rule (the generic rule: instantiated per-example gradients), beside a
    LayerNorm whose weight a second LayerNorm shares (instantiated by the norm rule), and a square weight a Linear
    (y = x W^T) and transformers' Conv1D (y = x W) share, with their biases (dense factors against dense factors,
    one of them transposed)."""

    def __init__(self):
        from transformers.pytorch_utils import Conv1D

        super().__init__()
        self.a = nn.Embedding(V, 6)
        self.b = nn.Embedding(V, 6, padding_idx=0)
        self.b.weight = self.a.weight
        self.head = nn.Linear(6, V, bias=False)
        self.head.weight = self.a.weight
        self.custom = _Custom(self.a.weight)
        self.n1, self.n2 = nn.LayerNorm(6), nn.LayerNorm(6)
        self.n2.weight = self.n1.weight
        self.sq1, self.sq2 = nn.Linear(6, 6), Conv1D(6, 6)
        self.sq2.weight, self.sq2.bias = self.sq1.weight, self.sq1.bias

    def forward(self, input_ids, attention_mask):
        h = self.a(input_ids) + self.b(input_ids.flip(1)) + self.a(input_ids.roll(1, 1))
        h = self.n2(torch.tanh(self.n1(h)))
        h = self.sq2(torch.tanh(self.sq1(h)))
        return self.head(h) + self.custom(h)


class _Custom(nn.Module):
    def __init__(self, w):
        super().__init__()
        self.w = w

    def forward(self, h):
        return torch.tanh(h @ self.w.t())


def mixed_loss(model, batch):
    logits = model(batch["input_ids"], batch["attention_mask"])
    return F.cross_entropy(logits.transpose(1, 2), batch["labels"], reduction="none").mean(1)


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (B, T), generator=g)
    ids[0, 0] = 0  # a padding id for the Embedding with padding_idx
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, -2:] = 0
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "decoder": torch.randint(3, V, (B, 4), generator=g),
        "labels": torch.randint(3, V, (B, T), generator=g),
    }


CASES = {
    "gpt2_tied": (gpt2_tied, lm_loss),
    "t5_tied": (t5_tied, seq2seq_loss),
    "bart_tied": (bart_tied, seq2seq_loss),
    "mixed": (Mixed, mixed_loss),
}


def _setup(case, seed=0):
    build, loss = CASES[case]
    torch.manual_seed(seed)
    model = build().double().train()
    batch = _batch(seed)
    if case != "mixed":
        batch["labels"] = batch["labels"][:, :4]
    return model, loss, batch


def _reference(model, loss, params, batch, scale=None):
    return loop_reference(model, loss, params, batch, CLIP, scale)


def _assert_exact(got, norms, summed):
    torch.testing.assert_close(got.norms, norms, rtol=1e-10, atol=0)
    for s, r in zip(got.summed, summed, strict=True):
        torch.testing.assert_close(s, r, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("mode", ["auto", "gram", "instantiate"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_shared_parameter_is_exact(case, mode):
    model, loss, batch = _setup(case)
    shared_before = len({id(p) for p in model.parameters()})
    engine = BKEngine(model, loss, mode=mode)
    got = engine.clipped_sum(batch, CLIP)
    engine.close()
    _assert_exact(got, *_reference(model, loss, engine.params, batch))
    shared = [k for k in engine.choices if k.endswith("(shared)")]
    assert shared, f"{case}: no shared parameter was combined ({engine.choices})"
    if mode != "auto" and case != "mixed":
        assert {engine.choices[k] for k in shared} == {mode}
    assert len({id(p) for p in model.parameters()}) == shared_before  # nothing untied


@pytest.mark.parametrize("case", ["gpt2_tied", "mixed"])
def test_shared_parameter_scaled(case):
    """Scale-then-privatize: ||S g_i|| with g_i summed over the uses (the cross terms weighted by S^2)."""
    model, loss, batch = _setup(case)
    engine = BKEngine(model, loss)
    g = torch.Generator().manual_seed(7)
    scale = [torch.rand(p.shape, generator=g, dtype=p.dtype) + 0.5 for p in engine.params]
    got = engine.clipped_sum(batch, CLIP, scale)
    engine.close()
    _assert_exact(got, *_reference(model, loss, engine.params, batch, scale))


def test_mixed_takes_every_path():
    """The mixed model's shared table meets an Embedding twice (ids against ids), a Linear (ids against a dense
    factor) and the generic rule (instantiated), and the norms' shared weight two instantiated uses."""
    model, loss, batch = _setup("mixed")
    engine = BKEngine(model, loss)
    engine.clipped_sum(batch, CLIP)
    engine.close()
    assert engine.choices["a.weight (shared)"] == "gram+instantiate"
    assert engine.choices["n1.weight (shared)"] == "instantiate"
    assert (
        engine.choices["sq1.weight (shared)"] == "gram"
        and engine.choices["sq1.bias (shared)"] == "instantiate"
    )
    assert engine.choices["custom"].startswith("generic")


class TiedConvs(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, 4)
        self.c1 = nn.Conv1d(4, 4, 3, padding=1)
        self.c2 = nn.Conv1d(4, 4, 3, padding=1)
        self.c2.weight = self.c1.weight
        self.head = nn.Linear(4, 3)

    def forward(self, input_ids, attention_mask):
        h = self.emb(input_ids).transpose(1, 2)
        return self.head(self.c2(torch.tanh(self.c1(h))).mean(2))


def test_unshareable_rule_is_refused_naming_the_layer():
    model = TiedConvs().double()
    batch = _batch()
    labels = torch.tensor([0, 1, 2])

    def loss(m, b):
        return F.cross_entropy(m(b["input_ids"], b["attention_mask"]), b["labels"], reduction="none")

    batch["labels"] = labels
    engine = BKEngine(model, loss)
    with pytest.raises(ValueError, match=r"parameter 'c1.weight' is used by layer 'c1' \(Conv1d") as err:
        engine.clipped_sum(batch, CLIP)
    assert "\n" not in str(err.value) and "fix_model" in str(err.value)
    engine.close()
    # fix_model unties what bk cannot combine, and only that
    model, changes = fix_model(model, verbose=False)
    assert changes == ["c2.weight: untied from c1.weight (a copy, trained on its own; bk's conv rule cannot add "
                       "per-example gradients across layers)"]  # fmt: skip
    engine = BKEngine(model, loss)
    got = engine.clipped_sum(batch, CLIP)
    engine.close()
    _assert_exact(got, *_reference(model, loss, engine.params, batch))


@pytest.mark.parametrize("case", ["gpt2_tied", "t5_tied", "bart_tied", "mixed"])
def test_fix_model_keeps_what_bk_combines(case):
    model, _, _ = _setup(case)
    ids = sorted(id(p) for p in model.parameters())
    config = getattr(model, "config", None)
    tie = getattr(config, "tie_word_embeddings", None)
    model, changes = fix_model(model, verbose=False)
    assert changes == []
    assert sorted(id(p) for p in model.parameters()) == ids
    if config is not None:
        assert config.tie_word_embeddings == tie
