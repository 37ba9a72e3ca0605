"""GPT-2's tokenizer over a smaller vocabulary: the byte tokens plus the most frequent BPE merges of a public corpus.

Why: at the CPU profile's width (128), GPT-2's 50,257-token output layer is most of a small model's parameters and
most of a fine-tuning step (measured on one thread, B = 256 on E2E: the output layer's matmuls, log-softmax and
zero-fills take ~85 % of a 10 s DP step). ``vocab_size: 8192`` in a ``gpt2_clm`` pretraining preset keeps the
real GPT-2 byte-level BPE (the offline ``vocab.json`` / ``merges.txt``) and only restricts which of its tokens the
model has rows for. No library does this (Hugging Face tokenizers can add tokens but not drop merges), hence this
module.

The restriction is lossless. GPT-2's vocabulary is 256 byte tokens, ``<|endoftext|>``, and one token per merge rule
``a b -> ab`` (50,000). Every merged token therefore has exactly one split into two vocabulary tokens, so a token
that was dropped is rewritten as the kept tokens at the leaves of its merge tree (recursively), and the byte string,
hence the text, is unchanged. Which merged tokens are kept is decided by their frequency in the PUBLIC pretraining
corpus (the arXiv abstracts' train split), never by the private fine-tuning data (whose token set would itself be
a release about it). The cost: text far from that corpus (E2E's restaurant names) splits into more tokens (measured
for E2E at 8,192: 1.55x the GPT-2 length; arXiv 1.07x).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

FILE = "compact_vocab.json"


def merge_children(tokenizer) -> dict[int, tuple[int, int]]:
    """GPT-2 id of every merged token -> the ids of the two tokens its merge rule joins (from the fast tokenizer's
    own serialised model, so it works for a folder with only ``tokenizer.json``)."""
    model = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    vocab = model["vocab"]
    children = {}
    for rule in model["merges"]:
        a, b = rule.split(" ", 1) if isinstance(rule, str) else rule
        children[vocab[a + b]] = (vocab[a], vocab[b])
    return children


def base_ids(tokenizer, children: dict[int, tuple[int, int]]) -> list[int]:
    """The ids no merge produces (GPT-2: the 256 byte tokens and ``<|endoftext|>``): every compact vocabulary keeps
    them, so that any text still encodes."""
    return [i for i in range(len(tokenizer)) if i not in children]


class CompactVocab:
    """A kept subset of GPT-2 ids (sorted ascending; compact id k is ``gpt2_ids[k]``) and the rewriting of any GPT-2
    id sequence into it."""

    def __init__(self, gpt2_ids: Sequence[int], children: dict[int, tuple[int, int]], base: Sequence[int]):
        self.gpt2_ids = sorted({int(i) for i in gpt2_ids})
        self.index = {g: k for k, g in enumerate(self.gpt2_ids)}
        missing = [i for i in base if i not in self.index]
        if missing:
            raise ValueError(
                f"a compact vocabulary must keep every byte token and <|endoftext|>; missing GPT-2 ids {missing[:5]}"
            )
        base_set = set(base)
        unknown = [i for i in self.gpt2_ids if i not in children and i not in base_set]
        if unknown:
            raise ValueError(f"GPT-2 ids {unknown[:5]} are not in the tokenizer's vocabulary")
        self.children = children
        self._expand: dict[int, tuple[int, ...]] = {}

    @classmethod
    def from_corpus(cls, tokenizer, texts_ids: Iterable[Sequence[int]], size: int) -> CompactVocab:
        """The ``size`` tokens: every non-merged token (bytes, eos) and the most frequent merged tokens of the
        corpus ``texts_ids`` (GPT-2 ids), ties and tokens the corpus lacks in GPT-2's merge order (a lower id is an
        earlier merge): a function of the corpus alone."""
        children = merge_children(tokenizer)
        base = base_ids(tokenizer, children)
        if isinstance(size, bool) or not isinstance(size, int) or not len(base) < size <= len(tokenizer):
            raise ValueError(
                f"vocab_size={size}: must be > the {len(base)} byte / special tokens and <= {len(tokenizer)}"
            )
        counts = Counter(i for ids in texts_ids for i in ids if i in children)
        ranked = sorted(children, key=lambda i: (-counts.get(i, 0), i))
        return cls(base + ranked[: size - len(base)], children, base)

    def __len__(self) -> int:
        return len(self.gpt2_ids)

    def _leaves(self, g: int) -> tuple[int, ...]:
        if g in self.index:
            return (self.index[g],)
        out = self._expand.get(g)
        if out is None:
            a, b = self.children[g]
            out = self._leaves(a) + self._leaves(b)
            self._expand[g] = out
        return out

    def to_compact(self, gpt2_ids: Iterable[int]) -> list[int]:
        return [k for g in gpt2_ids for k in self._leaves(int(g))]

    def to_gpt2(self, compact_ids: Iterable[int]) -> list[int]:
        return [self.gpt2_ids[int(k)] for k in compact_ids]

    def save(self, folder: Path, source: str) -> None:
        (Path(folder) / FILE).write_text(
            json.dumps({"size": len(self), "source": source, "gpt2_ids": self.gpt2_ids}) + "\n"
        )


class CompactTokenizer:
    """A GPT-2 fast tokenizer whose ids are those of a :class:`CompactVocab`: the calls the language tasks make
    (``__call__``, ``decode``, ``eos_token_id``, ``len``, ``get_vocab``, ``convert_tokens_to_string``,
    ``save_pretrained``) give and take compact ids."""

    def __init__(self, tokenizer, vocab: CompactVocab, source: str = ""):
        self.base, self.vocab = tokenizer, vocab
        self.source = source  # where the vocabulary came from
        self.eos_token_id = vocab.index[int(tokenizer.eos_token_id)]

    def __len__(self) -> int:
        return len(self.vocab)

    def __call__(self, texts, texts_b=None, **kwargs) -> dict:
        if texts_b is not None:
            raise ValueError("the compact GPT-2 tokenizer encodes single texts, not pairs")
        truncation, max_length = kwargs.pop("truncation", False), kwargs.pop("max_length", None)
        kwargs.pop("return_attention_mask", None)
        kwargs.pop("return_token_type_ids", None)
        single = isinstance(texts, str)
        ids = self.base([texts] if single else list(texts), return_attention_mask=False, **kwargs)[
            "input_ids"
        ]
        out = [self.vocab.to_compact(row) for row in ids]
        if truncation and max_length is not None:
            out = [row[:max_length] for row in out]
        return {"input_ids": out[0] if single else out}

    def decode(self, ids, **kwargs) -> str:
        return self.base.decode(self.vocab.to_gpt2(ids), **kwargs)

    def get_vocab(self) -> dict[str, int]:
        names = self.base.convert_ids_to_tokens(self.vocab.gpt2_ids)
        return {t: k for k, t in enumerate(names)}

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return self.base.convert_tokens_to_string(tokens)

    def save_pretrained(self, folder) -> None:
        self.base.save_pretrained(folder)
        self.vocab.save(Path(folder), self.source)


def load_tokenizer(folder_or_name):
    """The GPT-2 tokenizer of ``folder_or_name``, as a :class:`CompactTokenizer` when the folder holds a
    ``compact_vocab.json`` (a model pretrained with ``vocab_size``)."""
    from dp_adam_bench.tasks.text import load_gpt2_tokenizer

    tok = load_gpt2_tokenizer(folder_or_name)
    path = Path(str(folder_or_name)).expanduser() / FILE
    if not path.is_file():
        return tok
    try:
        data = json.loads(path.read_text())
        children = merge_children(tok)
        vocab = CompactVocab([int(i) for i in data["gpt2_ids"]], children, base_ids(tok, children))
    except (OSError, ValueError, KeyError, TypeError) as err:  # a torn file, or ids this tokenizer lacks
        raise ValueError(
            f"{path} cannot be read ({type(err).__name__}: {err}); rebuild the pretraining"
        ) from err
    return CompactTokenizer(tok, vocab, source=str(data.get("source", "")))
