"""Tiny models of the families people fine-tune, built offline from their configs (random weights), with a batch
of per-example inputs as a user passes them: the bring-your-own-model zoo of ``tests/test_model_zoo.py``.

Each entry is ``name -> (build() -> nn.Module, batch(b, generator) -> dict)``; ``loss_per_example(model, batch)``
gives one loss per example for every entry (the model's own output, reduced within each example). Models are in
train mode with dropout 0 (the per-example comparison is then deterministic); the dropout path is exercised by the
engines' own tests.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

T = 8  # tokens per example
VOCAB = 50
IMAGE = 16  # pixels per side


def _tokens(b: int, g: torch.Generator, pad_last: bool = True) -> dict:
    ids = torch.randint(3, VOCAB, (b, T), generator=g)
    mask = torch.ones(b, T, dtype=torch.long)
    if pad_last and b > 1:  # one padded example, so the attention mask matters
        mask[0, T - 3 :] = 0
        ids[0, T - 3 :] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _classify(b, g, classes=3):
    return {**_tokens(b, g), "labels": torch.randint(0, classes, (b,), generator=g)}


def _lm(b, g):
    batch = _tokens(b, g)
    return {**batch, "labels": batch["input_ids"].clone()}


def _hf(config: str, model: str, **kwargs):
    """A randomly initialised ``transformers.<model>`` built from ``transformers.<config>(**kwargs)``."""

    def build():
        import transformers

        return getattr(transformers, model)(getattr(transformers, config)(**kwargs))

    return build


_NO_DROPOUT = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
_ENCODER = {"vocab_size": VOCAB, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2}
_bert = _hf(
    "BertConfig", "BertForSequenceClassification", **_ENCODER, **_NO_DROPOUT, intermediate_size=32,
    max_position_embeddings=32, num_labels=3,
)  # fmt: skip
_distilbert = _hf(
    "DistilBertConfig", "DistilBertForSequenceClassification", vocab_size=VOCAB, dim=16, n_layers=2, n_heads=2,
    hidden_dim=32, max_position_embeddings=32, num_labels=3, dropout=0.0, attention_dropout=0.0,
    seq_classif_dropout=0.0,
)  # fmt: skip
_roberta = _hf(
    "RobertaConfig", "RobertaForSequenceClassification", **_ENCODER, **_NO_DROPOUT, intermediate_size=32,
    max_position_embeddings=40, num_labels=3,
)  # fmt: skip
_gpt2 = _hf(
    "GPT2Config", "GPT2LMHeadModel", vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=32,
    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False,
)  # fmt: skip
_gpt2_tied = _hf(
    "GPT2Config", "GPT2LMHeadModel", vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=32,
    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=1,
)  # fmt: skip
_opt = _hf(
    "OPTConfig", "OPTForCausalLM", vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, ffn_dim=32,
    num_attention_heads=2, max_position_embeddings=32, word_embed_proj_dim=16, dropout=0.0, attention_dropout=0.0,
    pad_token_id=0, bos_token_id=1, eos_token_id=1,
)  # fmt: skip
_qwen2 = _hf(
    "Qwen2Config", "Qwen2ForCausalLM", vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=True,
)  # fmt: skip
_llama = _hf(
    "LlamaConfig", "LlamaForCausalLM", vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=False,
)  # fmt: skip


class T5EncoderClassifier(nn.Module):
    """A T5 encoder with a linear head on the mean of its non-padded states (T5 has no sequence classifier that
    takes an encoder alone)."""

    def __init__(self):
        super().__init__()
        from transformers import T5Config, T5EncoderModel

        cfg = T5Config(
            vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2, dropout_rate=0.0,
            relative_attention_num_buckets=8,
        )  # fmt: skip
        self.encoder = T5EncoderModel(cfg)
        self.head = nn.Linear(16, 3)

    def forward(self, input_ids, attention_mask):
        h = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        return self.head((h * m).sum(1) / m.sum(1))


_T5 = dict(
    vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2, dropout_rate=0.0,
    relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
)  # fmt: skip
_t5 = _hf(
    "T5Config", "T5ForConditionalGeneration", **_T5
)  # tied: shared encoder / decoder embeddings and head
_t5_classifier = _hf("T5Config", "T5ForSequenceClassification", **_T5, num_labels=3, classifier_dropout=0.0)
_BART = dict(
    vocab_size=VOCAB, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
    decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32, dropout=0.0,
    attention_dropout=0.0, activation_dropout=0.0, scale_embedding=True, pad_token_id=0, bos_token_id=2,
    eos_token_id=1, decoder_start_token_id=1,
)  # fmt: skip
_bart = _hf("BartConfig", "BartForConditionalGeneration", **_BART)
_bart_classifier = _hf(
    "BartConfig", "BartForSequenceClassification", **_BART, num_labels=3, classifier_dropout=0.0
)


def _eos_tokens(b, g):
    """Token batches that end each example with the eos token (1), which T5's and BART's classifiers pool."""
    batch = _tokens(b, g)
    length = batch["attention_mask"].sum(1)
    batch["input_ids"][torch.arange(b), length - 1] = 1
    return batch


def _eos_classify(b, g, classes=3):
    return {**_eos_tokens(b, g), "labels": torch.randint(0, classes, (b,), generator=g)}


def _seq2seq(b, g):
    """The tokenizer's batch of a sequence-to-sequence task: source tokens and target labels (-100 on padding)."""
    batch = _eos_tokens(b, g)
    labels = torch.randint(3, VOCAB, (b, 5), generator=g)
    labels[:, -1] = 1
    if b > 1:
        labels[0, 3:] = -100
    return {**batch, "labels": labels}


_vit = _hf(
    "ViTConfig", "ViTForImageClassification", image_size=IMAGE, patch_size=8, num_channels=3, hidden_size=16,
    num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, num_labels=3, **_NO_DROPOUT,
)  # fmt: skip


_swin = _hf(
    "SwinConfig",
    "SwinForImageClassification",
    image_size=IMAGE,
    patch_size=2,
    num_channels=3,
    embed_dim=8,
    depths=[2, 1],
    num_heads=[2, 2],
    window_size=4,
    num_labels=3,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
    drop_path_rate=0.0,
)  # fmt: skip  (8 x 8 patches in 4 windows of 4 x 4; the second block of stage 1 shifts them: masked attention)
_dinov2 = _hf(
    "Dinov2Config",
    "Dinov2ForImageClassification",
    image_size=IMAGE,
    patch_size=8,
    hidden_size=16,
    num_hidden_layers=2,
    num_attention_heads=2,
    mlp_ratio=2,
    num_labels=3,
    layerscale_value=0.5,
    drop_path_rate=0.0,
    **_NO_DROPOUT,
)  # fmt: skip  (LayerScale: a per-channel gamma, the generic rule)


def _images(b, g):
    return {
        "pixel_values": torch.randn(b, 3, IMAGE, IMAGE, generator=g),
        "labels": torch.randint(0, 3, (b,), generator=g),
    }


# Hugging Face's ResNet (BatchNorm in every block, as torchvision's): refused as built, trains after fix_model swaps
# BatchNorm for GroupNorm (torchvision's PyPI wheels are built for CUDA torch and do not load beside the CPU torch
# this suite installs; test_model_zoo runs torchvision's ResNet-18 where it loads)
_resnet = _hf(
    "ResNetConfig", "ResNetForImageClassification", num_channels=3, embedding_size=8, hidden_sizes=[8, 16],
    depths=[1, 1], layer_type="basic", num_labels=3,
)  # fmt: skip


class LogitScaleNet(nn.Module):
    """A learnable 0-dim logit scale on the root module (as in CLIP), beside ordinary layers."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.proj = nn.Linear(16, 3)
        self.logit_scale = nn.Parameter(torch.tensor(0.5))

    def forward(self, input_ids, attention_mask):
        h = self.emb(input_ids).mean(1)
        return self.proj(h) * self.logit_scale.exp()


def _encoder_layer():
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    return _TorchEncoder(nn.TransformerEncoder(layer, 2, enable_nested_tensor=True))


class _TorchEncoder(nn.Module):
    """torch's own ``nn.TransformerEncoder`` with a padding mask (its nested-tensor fast path in eval mode)."""

    def __init__(self, encoder):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.encoder = encoder
        self.head = nn.Linear(16, 3)

    def forward(self, input_ids, attention_mask):
        h = self.encoder(self.emb(input_ids), src_key_padding_mask=attention_mask == 0)
        return self.head(h[:, 0])


def _token_ce(logits, labels, mask):
    """Causal-LM loss per example: next-token cross-entropy averaged over the example's non-padded tokens."""
    logits, labels, mask = logits[:, :-1], labels[:, 1:], mask[:, 1:].to(logits.dtype)
    ce = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
    return (ce * mask).sum(1) / mask.sum(1).clamp(min=1)


def _logits(out):
    return out.logits if hasattr(out, "logits") else out


def classify_loss(model, batch):
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    return F.cross_entropy(_logits(model(**inputs)), batch["labels"], reduction="none")


def lm_loss(model, batch):
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    return _token_ce(_logits(out), batch["labels"], batch["attention_mask"])


def seq2seq_loss(model, batch):
    """Per-example mean token cross-entropy of an encoder-decoder fed the tokenizer's batch: its decoder reads the
    labels shifted, as the model builds them (dp_adam_bench.engine.seq2seq)."""
    from dp_adam_bench.engine.seq2seq import with_decoder_inputs

    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**with_decoder_inputs(model, inputs, batch["labels"])).logits
    labels = batch["labels"]
    ce = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none", ignore_index=-100)
    kept = (labels != -100).to(ce.dtype)
    return (ce * kept).sum(1) / kept.sum(1).clamp(min=1)


def image_loss(model, batch):
    out = model(batch["pixel_values"])
    return F.cross_entropy(_logits(out), batch["labels"], reduction="none")


#: name -> (build, batch(b, generator), loss_per_example(model, batch))
ZOO: dict[str, tuple[Callable, Callable, Callable]] = {
    "bert": (_bert, _classify, classify_loss),
    "distilbert": (_distilbert, _classify, classify_loss),
    "roberta": (_roberta, _classify, classify_loss),
    "gpt2": (_gpt2, _lm, lm_loss),
    "gpt2_tied": (_gpt2_tied, _lm, lm_loss),
    "opt": (_opt, _lm, lm_loss),
    "qwen2": (_qwen2, _lm, lm_loss),
    "t5": (_t5, _seq2seq, seq2seq_loss),
    "t5_classifier": (_t5_classifier, _eos_classify, classify_loss),
    "bart": (_bart, _seq2seq, seq2seq_loss),
    "bart_classifier": (_bart_classifier, _eos_classify, classify_loss),
    "swin": (_swin, _images, image_loss),
    "dinov2": (_dinov2, _images, image_loss),
    "llama": (_llama, _lm, lm_loss),
    "t5_encoder": (T5EncoderClassifier, _classify, classify_loss),
    "vit": (_vit, _images, image_loss),
    "resnet": (_resnet, _images, image_loss),
    "logit_scale": (LogitScaleNet, _classify, classify_loss),
    "torch_encoder": (_encoder_layer, _classify, classify_loss),
}


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = ZOO[name][0]()
    model.train()
    return model


def batch(name: str, b: int, seed: int = 0) -> dict:
    return ZOO[name][1](b, torch.Generator().manual_seed(seed))


def loss_fn(name: str):
    return ZOO[name][2]
