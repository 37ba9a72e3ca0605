"""Train the top of a frozen BERT-family encoder on cached outputs of its frozen lower layers.

Tang & Lécuyer's SNLI model (arXiv:2304.11208, §3) trains only the last encoder block, the pooler and the
classifier; every other layer keeps its pretrained weights. The frozen layers compute the same function of an
example at every step, so their output can be computed once per example and the training step can start above
them: on 2 CPU cores this makes a MiniLM-L6 step about 3x faster and an evaluation about 6x faster
(``docs/pitfalls.md``), which is what lets the CPU SNLI tables run long enough to leave chance
(:class:`LastBlockClassifier`). The GLUE task (:mod:`dp_adam_bench.tasks.glue`, ``task.cache_frozen_prefix``)
uses the same split with any number k of trained top blocks (k = 0: the head alone on the encoder's output): a
classifier on [CLS] or on the mean-pooled, L2-normalised sentence embedding (:class:`TopBlocksClassifier`), or
text infilling's masked-LM head at the mask (:class:`TopBlocksLabelWords`), which lets Li et al.'s SST-2 table run
in the paper's privacy regime (all its training sentences, B = 1000, 3 epochs) on a CPU.

What changes, and what does not:

* **Privacy: nothing.** The cached features of an example are a fixed public function (pretrained, never trained)
  of that example alone, so a per-example gradient of the trained part is exactly what it is with the full model
  whose lower layers are frozen; clipping, noise and accounting are untouched.
* **The function: dropout in the frozen layers is off.** The authors train the whole model in train mode, so the
  frozen layers apply dropout (p = 0.1) to their own activations; here they run in eval mode once. Dropout in the
  trained blocks and before the classifier is kept. With dropout off everywhere (``model.eval()``) the top on
  cached features gives the full model's logits to float tolerance (tested).
* **Infilling reads only the label words' rows of the masked-LM decoder** (:func:`label_word_decoder`): the loss
  and the prediction read the label words' logits alone, so every other row of the decoder gets a zero gradient
  in the full model; dropping them computes the same function and the same per-example gradients of what is
  read. The decoder is tied to the input embedding in the pretrained model; here the embedding is frozen inside
  the cache, so the trained rows are an untied copy (as :func:`~dp_adam_bench.tasks.text.prepare_bert_for_dp`
  makes anyway).

Built on the transformers BERT modules (``BertLayer``, ``BertPooler`` and the library's own attention-mask
builder), so no attention code of ours: only the split of the forward pass into a cached prefix and a trained top.
"""

from __future__ import annotations

import hashlib
import logging
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

from dp_adam_bench.files import write_atomic
from dp_adam_bench.tasks import text

log = logging.getLogger(__name__)
_CACHE_FORMAT = 1


def attention_mask_4d(config, hidden_states: torch.Tensor, attention_mask: torch.Tensor):
    """The mask BERT's own forward builds from a (B, T) 0/1 mask (``BertModel._create_attention_masks``)."""
    from transformers.masking_utils import create_bidirectional_mask

    return create_bidirectional_mask(
        config=config, inputs_embeds=hidden_states, attention_mask=attention_mask
    )


class LastBlockClassifier(nn.Module):
    """The trained part of a ``BertForSequenceClassification`` (last encoder block, pooler, dropout, classifier),
    run on the hidden states the frozen layers before it produced. ``forward(hidden_states, attention_mask)`` returns
    the (B, num_labels) logits. The modules are the model's own (same parameters, same names below ``head.``)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        base = model.base_model
        self.config = model.config
        self.layer = base.encoder.layer[-1]
        self.pooler = base.pooler
        self.dropout = model.dropout
        self.classifier = model.classifier

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.layer(hidden_states, attention_mask_4d(self.config, hidden_states, attention_mask))
        pooled = self.pooler(h) if self.pooler is not None else h[:, 0]
        return self.classifier(self.dropout(pooled))


#: how a classifier on the top reads the sequence: BERT's pooler on [CLS] (RoBERTa's head on <s>), or the mean of
#: the real tokens, L2-normalised (:func:`mean_pooled`)
POOLINGS = ("cls", "mean")


def mean_pooled(hidden_states: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, hidden): the mean of each example's real tokens (``attention_mask`` 1), scaled to unit L2 norm — the
    sentence embedding of sentence-transformers' ``Pooling(mean)`` + ``Normalize`` (all-MiniLM-L6-v2's own). A
    function of one example at a time: no statistic of the batch enters it."""
    m = attention_mask.unsqueeze(-1).to(hidden_states.dtype)
    pooled = (hidden_states * m).sum(1) / m.sum(1).clamp_min(1e-9)
    return torch.nn.functional.normalize(pooled, p=2.0, dim=-1)


def _top_blocks(model: nn.Module, k: int) -> nn.ModuleList:
    """The last ``k`` encoder blocks of a BERT-family model (the model's own modules), k in [0, layers]."""
    blocks = model.base_model.encoder.layer
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= len(blocks):
        raise ValueError(
            f"trained blocks k={k!r}: the encoder has {len(blocks)} layers; valid: 0..{len(blocks)}"
        )
    return nn.ModuleList(list(blocks)[len(blocks) - k :])


def _run_blocks(config, blocks: nn.ModuleList, hidden_states: torch.Tensor, attention_mask: torch.Tensor):
    if not len(blocks):
        return hidden_states
    mask = attention_mask_4d(config, hidden_states, attention_mask)
    for block in blocks:
        hidden_states = block(hidden_states, mask)
    return hidden_states


class TopBlocksClassifier(nn.Module):
    """The trained top of a ``BertForSequenceClassification`` / ``RobertaForSequenceClassification``: its last
    ``k`` encoder blocks (``layer``, k may be 0) and a classifier, on the hidden states of the frozen layers below.
    ``pooling``: ``cls`` — the model's own head (BERT: pooler, dropout, classifier; RoBERTa: its classification head
    on <s>); ``mean`` — :func:`mean_pooled`, dropout (the config's classifier dropout) and a new ``classifier``
    ``nn.Linear`` initialised as transformers initialises one (normal, std ``initializer_range``, zero bias).
    ``forward(hidden_states, attention_mask)`` returns the (B, num_labels) logits."""

    def __init__(self, model: nn.Module, k: int, pooling: str = "cls"):
        super().__init__()
        if pooling not in POOLINGS:
            raise ValueError(f"pooling={pooling!r}; valid: {', '.join(POOLINGS)}")
        config = model.config
        self.config = config
        self.pooling = pooling
        self.layer = _top_blocks(model, k)
        if pooling == "cls":
            self.pooler = getattr(model.base_model, "pooler", None)
            self.dropout = getattr(model, "dropout", None) if self.pooler is not None else None
            self.classifier = model.classifier
            return
        p = getattr(config, "classifier_dropout", None)
        self.dropout = nn.Dropout(config.hidden_dropout_prob if p is None else p)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        with torch.no_grad():
            self.classifier.weight.normal_(0.0, float(config.initializer_range))
            self.classifier.bias.zero_()

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = _run_blocks(self.config, self.layer, hidden_states, attention_mask)
        if self.pooling == "mean":
            return self.classifier(self.dropout(mean_pooled(h, attention_mask)))
        if self.pooler is None:  # RoBERTa's classification head reads <s> itself
            return self.classifier(h)
        return self.classifier(self.dropout(self.pooler(h)))


def label_word_decoder(head: nn.Module, words: Sequence[int]) -> nn.Module:
    """Replace the ``decoder`` of a masked-LM ``head`` (BERT's ``cls``, RoBERTa's ``lm_head``) by a ``nn.Linear``
    holding only the ``words``' rows and biases, in that order: the head then returns the label words' logits, the
    values the full head gives at those ids (module docstring). The head must have been through
    :func:`~dp_adam_bench.tasks.text.prepare_bert_for_dp` (one bias, the decoder's)."""
    owners = [m for m in head.modules() if isinstance(getattr(m, "decoder", None), nn.Linear)]
    if len(owners) != 1:
        raise ValueError(
            f"{type(head).__name__} has {len(owners)} decoders (nn.Linear named decoder); need one"
        )
    owner = owners[0]
    if owner._parameters.get("bias") is not None:
        raise ValueError(
            f"{type(owner).__name__} keeps a bias beside its decoder's: call text.prepare_bert_for_dp first"
        )
    dec = owner.decoder
    rows = torch.as_tensor(list(words), dtype=torch.long, device=dec.weight.device)
    new = nn.Linear(dec.in_features, len(rows), bias=dec.bias is not None)
    new = new.to(device=dec.weight.device, dtype=dec.weight.dtype)
    with torch.no_grad():
        new.weight.copy_(dec.weight.index_select(0, rows))
        if dec.bias is not None:
            new.bias.copy_(dec.bias.index_select(0, rows))
    new.weight.requires_grad_(dec.weight.requires_grad)
    if new.bias is not None:
        new.bias.requires_grad_(dec.bias.requires_grad)
    owner.decoder = new
    return head


class TopBlocksLabelWords(nn.Module):
    """Text infilling on the trained top of a masked LM (``BertForMaskedLM`` or ``RobertaForMaskedLM``): its last
    ``k`` encoder blocks (``layer``) and its masked-LM head (under its own name, ``cls`` or ``lm_head``) with the
    decoder cut to the label words (:func:`label_word_decoder`), on the hidden states of the frozen layers below.
    ``forward(hidden_states, attention_mask, mask_position)`` returns the (B, words) logits at the mask."""

    def __init__(self, mlm: nn.Module, k: int, words: Sequence[int]):
        super().__init__()
        self.config = mlm.config
        self.layer = _top_blocks(mlm, k)
        self.head_name = "cls" if hasattr(mlm, "cls") else "lm_head"
        self.add_module(self.head_name, label_word_decoder(getattr(mlm, self.head_name), words))

    def forward(self, hidden_states, attention_mask, mask_position) -> torch.Tensor:
        h = _run_blocks(self.config, self.layer, hidden_states, attention_mask)
        at = mask_position.view(-1, 1, 1).expand(-1, 1, h.shape[-1])
        return getattr(self, self.head_name)(torch.gather(h, 1, at))[:, 0, :]


@torch.no_grad()
def prefix_features(
    model: nn.Module,
    ids: text.Ragged,
    segment_a: np.ndarray | None,
    *,
    pad_id: int,
    max_length: int,
    batch_size: int,
    iterate: Callable = iter,
    layers: int | None = None,
    batch_of: Callable[[np.ndarray], dict[str, torch.Tensor]] | None = None,
) -> text.Ragged:
    """The output of the embeddings and the first ``layers`` encoder layers (null: every layer but the last; eval
    mode: no dropout) for each row of ``ids``: a :class:`~dp_adam_bench.tasks.text.Ragged` whose row i is a
    (len_i, hidden) float32 array. ``batch_of(idx)`` builds the (B, T) input ids, masks, segment and position ids of
    those rows (a family's own position numbering, e.g. RoBERTa's); by default ``pad_batch`` of ``ids`` with
    ``segment_a``."""
    was_training = model.training
    model.eval()
    base = model.base_model
    blocks = base.encoder.layer
    n = len(blocks) - 1 if layers is None else int(layers)
    if not 0 <= n <= len(blocks):
        raise ValueError(f"layers={layers!r}: the encoder has {len(blocks)} layers")
    if batch_of is None:

        def batch_of(idx):
            return text.pad_batch(
                [ids[int(i)] for i in idx],
                pad_id=pad_id,
                max_length=max_length,
                pad_to="longest",
                segment_a=segment_a[idx],
            )

    lengths = ids.lengths()
    offsets = np.zeros(len(ids) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.empty((int(offsets[-1]), model.config.hidden_size), dtype=np.float32)
    order = np.argsort(lengths, kind="stable")  # similar lengths together: little padding
    device = text.model_device(model)
    try:
        for start in iterate(range(0, len(ids), batch_size)):
            idx = order[start : start + batch_size]
            batch = {k: v.to(device) for k, v in batch_of(idx).items()}
            h = base.embeddings(
                input_ids=batch["input_ids"],
                token_type_ids=batch["token_type_ids"],
                position_ids=batch["position_ids"],
            )
            mask = attention_mask_4d(model.config, h, batch["attention_mask"])
            for layer in blocks[:n]:
                h = layer(h, mask)
            h = h.float().cpu().numpy()
            for j, i in enumerate(idx):
                flat[offsets[i] : offsets[i + 1]] = h[j, : lengths[i]]
    finally:
        model.train(was_training)
    return text.Ragged(flat, offsets)


def pad_features(rows: Sequence[np.ndarray]) -> dict[str, torch.Tensor]:
    """Right-padded (B, T, hidden) ``hidden_states`` (zeros at padding) and (B, T) ``attention_mask``; T is the
    longest row rounded up to a multiple of 8, as :func:`~dp_adam_bench.tasks.text.pad_batch` pads tokens."""
    longest = max((len(r) for r in rows), default=1)
    t = max(8, -(-longest // 8) * 8)
    width = rows[0].shape[1] if rows else 1
    hidden = torch.zeros((len(rows), t, width), dtype=torch.float32)
    mask = torch.zeros((len(rows), t), dtype=torch.long)
    for i, r in enumerate(rows):
        hidden[i, : len(r)] = torch.from_numpy(r)
        mask[i, : len(r)] = 1
    return {"hidden_states": hidden, "attention_mask": mask}


def cache_key(
    model_name: str, config, ids: text.Ragged, segment_a: np.ndarray, max_length: int, extra: str = ""
) -> str | None:
    """A key for the features of ``ids`` under a local pretrained checkpoint: its folder, every file's size and
    modification time, the model config, the token ids, segments and max_length, ``extra`` (what else decides the
    features: how many layers ran, the position numbering), and the torch / transformers versions (their kernels
    round differently). None for a hub name (no files to fingerprint)."""
    import transformers

    folder = Path(model_name)
    if not folder.is_dir():
        return None
    h = hashlib.sha256()
    h.update(
        f"v{_CACHE_FORMAT}|{folder.resolve()}|{max_length}|{torch.__version__}|{transformers.__version__}".encode()
    )
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        st = f.stat()
        h.update(f"|{f.relative_to(folder)}:{st.st_size}:{st.st_mtime_ns}".encode())
    h.update(config.to_json_string(use_diff=False).encode())
    if extra:  # absent for the SNLI task's keys, which stay as they were
        h.update(f"|{extra}".encode())
    for a in (ids.flat, ids.offsets, np.asarray(segment_a)):
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:20]


def load_or_compute(path: Path | None, compute: Callable[[], text.Ragged]) -> text.Ragged:
    """The features cached in ``path`` (a ``.npz`` of ``flat`` and ``offsets``), else ``compute()`` written there
    atomically (two runs starting together never read a half-written file). An unreadable cache is recomputed with
    a warning; ``path`` None computes without caching."""
    if path is not None and path.is_file():
        try:
            with np.load(path) as z:
                feats = text.Ragged(z["flat"], z["offsets"])
            log.info("frozen-layer features read from %s", path)
            return feats
        except Exception as e:  # noqa: BLE001 - any unreadable cache means "compute again"
            warnings.warn(f"ignoring unreadable feature cache {path} ({type(e).__name__}: {e})", stacklevel=2)
    feats = compute()
    if path is None:
        return feats
    try:
        write_atomic(path, lambda f: np.savez(f, flat=feats.flat, offsets=feats.offsets))
    except OSError as e:
        warnings.warn(f"could not write the feature cache {path} ({e}); continuing without it", stacklevel=2)
    return feats
