"""Train a BERT classifier whose encoder is frozen except its last block, on cached outputs of the frozen layers.

Tang & Lécuyer's SNLI model (arXiv:2304.11208, §3) trains only the last encoder block, the pooler and the
classifier; every other layer keeps its pretrained weights. The frozen layers compute the same function of an
example at every step, so their output can be computed once per example and the training step can start at the
last block: on 2 CPU cores this makes a MiniLM-L6 step about 3x faster and an evaluation about 6x faster
(``docs/pitfalls.md``), which is what lets the CPU SNLI tables run long enough to leave chance.

What changes, and what does not:

* **Privacy: nothing.** The cached features of an example are a fixed public function (pretrained, never trained)
  of that example alone, so a per-example gradient of the head is exactly what it is with the full model; clipping,
  noise and accounting are untouched.
* **The function: dropout in the frozen layers is off.** The authors train the whole model in train mode, so the
  frozen layers apply dropout (p = 0.1) to their own activations; here they run in eval mode once. Dropout in the
  trained last block and before the classifier is kept. With dropout off everywhere (``model.eval()``) the head
  on cached features gives the full model's logits to float tolerance (tested).

Built on the transformers BERT modules (``BertLayer``, ``BertPooler`` and the library's own attention-mask
builder), so no attention code of ours: only the split of the forward pass into a cached prefix and a trained head.
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


@torch.no_grad()
def prefix_features(
    model: nn.Module,
    ids: text.Ragged,
    segment_a: np.ndarray,
    *,
    pad_id: int,
    max_length: int,
    batch_size: int,
    iterate: Callable = iter,
) -> text.Ragged:
    """The output of every layer but the last (eval mode: no dropout) for each row of ``ids``: a
    :class:`~dp_adam_bench.tasks.text.Ragged` whose row i is a (len_i, hidden) float32 array."""
    was_training = model.training
    model.eval()
    base = model.base_model
    lengths = ids.lengths()
    offsets = np.zeros(len(ids) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.empty((int(offsets[-1]), model.config.hidden_size), dtype=np.float32)
    order = np.argsort(lengths, kind="stable")  # similar lengths together: little padding
    device = text.model_device(model)
    try:
        for start in iterate(range(0, len(ids), batch_size)):
            idx = order[start : start + batch_size]
            batch = text.pad_batch(
                [ids[int(i)] for i in idx],
                pad_id=pad_id,
                max_length=max_length,
                pad_to="longest",
                segment_a=segment_a[idx],
            )
            batch = {k: v.to(device) for k, v in batch.items()}
            h = base.embeddings(
                input_ids=batch["input_ids"],
                token_type_ids=batch["token_type_ids"],
                position_ids=batch["position_ids"],
            )
            mask = attention_mask_4d(model.config, h, batch["attention_mask"])
            for layer in base.encoder.layer[:-1]:
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
    model_name: str, config, ids: text.Ragged, segment_a: np.ndarray, max_length: int
) -> str | None:
    """A key for the features of ``ids`` under a local pretrained checkpoint: its folder, every file's size and
    modification time, the model config, the token ids, segments and max_length, and the torch / transformers
    versions (their kernels round differently). None for a hub name (no files to fingerprint)."""
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
