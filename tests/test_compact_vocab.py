"""GPT-2's BPE over a compact vocabulary (dp_adam_bench/tasks/compact_vocab.py): lossless on any text, every dropped
token spelled by kept tokens whose strings concatenate to its own, the most frequent merges of the corpus kept,
bad sizes and files refused, and the E2E task reading it from a pretraining build."""

import json

import pytest

from dp_adam_bench.paths import shared_data_dir
from dp_adam_bench.tasks.compact_vocab import (
    FILE,
    CompactTokenizer,
    CompactVocab,
    base_ids,
    load_tokenizer,
    merge_children,
)

TOKENIZER = shared_data_dir() / "gpt2_tokenizer"
pytestmark = pytest.mark.skipif(not TOKENIZER.is_dir(), reason="needs the offline GPT-2 tokenizer")

CORPUS = [
    " We prove a lower bound on the sample complexity of private learning.",
    " The model is trained with differentially private stochastic gradient descent.",
    " Gradient clipping bounds the sensitivity of each step.",
]
ODD = [
    " name[Fitzbillies], eatType[coffee shop], priceRange[more than £30], near[Café Adriatic]",
    " Zizzi's crème brûlée — 5 out of 5!\n\nNew line\ttab  double  space",
    " 日本語のテキスト and emoji 🍕🍝",
    "",
]


@pytest.fixture(scope="module")
def gpt2():
    from dp_adam_bench.tasks.text import load_gpt2_tokenizer

    return load_gpt2_tokenizer(TOKENIZER)


@pytest.fixture(scope="module")
def small(gpt2):
    ids = gpt2(CORPUS, add_special_tokens=False)["input_ids"]
    return CompactTokenizer(gpt2, CompactVocab.from_corpus(gpt2, ids, 300))


def test_every_text_round_trips_and_only_kept_ids_appear(gpt2, small):
    assert len(small) == 300 and small.eos_token_id == 299  # eos (50256) is the largest kept GPT-2 id
    for text in CORPUS + ODD:
        ids = small(text)["input_ids"]
        assert all(0 <= k < 300 for k in ids)
        assert small.decode(ids, clean_up_tokenization_spaces=False) == text
        assert len(ids) >= len(gpt2(text)["input_ids"])


def test_the_full_vocabulary_encodes_exactly_as_gpt2(gpt2):
    full = CompactTokenizer(gpt2, CompactVocab.from_corpus(gpt2, [], len(gpt2)))
    for text in CORPUS + ODD:
        assert full(text)["input_ids"] == gpt2(text)["input_ids"]


def test_a_dropped_token_is_spelled_by_its_merge_tree_leaves(gpt2, small):
    """Oracle: the kept tokens' strings concatenate to the dropped token's string (byte-level BPE strings)."""
    vocab = small.vocab
    dropped = [g for g in range(len(gpt2)) if g not in vocab.index][::997]
    assert dropped
    for g in dropped:
        leaves = vocab.to_gpt2(vocab.to_compact([g]))
        assert len(leaves) >= 2 and all(k in vocab.index for k in leaves)
        assert "".join(gpt2.convert_ids_to_tokens(leaves)) == gpt2.convert_ids_to_tokens(g)


def test_the_most_frequent_merges_are_kept(gpt2):
    children = merge_children(gpt2)
    base = base_ids(gpt2, children)
    assert len(base) == 257 and 50256 in base  # 256 bytes and <|endoftext|>
    rare, common = sorted(children)[-2:]  # two late (WebText-rare) merges
    corpus = [[common] * 3, [rare, common], [rare]]
    vocab = CompactVocab.from_corpus(gpt2, corpus, 259)
    assert {rare, common} <= set(vocab.gpt2_ids) and set(base) <= set(vocab.gpt2_ids)
    vocab = CompactVocab.from_corpus(gpt2, [[common] * 3, [rare]], 258)
    assert common in vocab.gpt2_ids and rare not in vocab.gpt2_ids
    # slots the corpus does not fill go to GPT-2's earliest merges
    vocab = CompactVocab.from_corpus(gpt2, [], 259)
    assert vocab.gpt2_ids == sorted([*base, *sorted(children)[:2]])


@pytest.mark.parametrize("size", [257, 100, 50258, True, 300.0])
def test_bad_sizes_are_refused(gpt2, size):
    with pytest.raises(ValueError, match="vocab_size="):
        CompactVocab.from_corpus(gpt2, [], size)


def test_a_vocabulary_without_the_byte_tokens_is_refused(gpt2):
    children = merge_children(gpt2)
    base = base_ids(gpt2, children)
    with pytest.raises(ValueError, match="must keep every byte token"):
        CompactVocab(base[1:], children, base)


def test_saved_vocabulary_loads_and_a_corrupt_file_is_named(gpt2, small, tmp_path):
    small.source = "test corpus"
    small.save_pretrained(tmp_path)
    data = json.loads((tmp_path / FILE).read_text())
    assert data["size"] == 300 and data["source"] == "test corpus"
    again = load_tokenizer(tmp_path)
    assert isinstance(again, CompactTokenizer) and again.vocab.gpt2_ids == small.vocab.gpt2_ids
    assert again.source == "test corpus"
    assert again(ODD[0])["input_ids"] == small(ODD[0])["input_ids"]
    (tmp_path / FILE).write_text(json.dumps({**data, "gpt2_ids": data["gpt2_ids"][1:]}))  # a byte token lost
    with pytest.raises(ValueError, match=f"{FILE} cannot be read .*must keep every byte token"):
        load_tokenizer(tmp_path)
    (tmp_path / FILE).write_text("{not json")
    with pytest.raises(ValueError, match=f"{FILE} cannot be read"):
        load_tokenizer(tmp_path)
    assert not isinstance(load_tokenizer(TOKENIZER), CompactTokenizer)  # no file: GPT-2's own vocabulary


def test_newline_tokens_are_found_for_the_decoding_ban(small):
    vocab = small.get_vocab()
    assert len(vocab) == 300
    bad = [k for t, k in vocab.items() if "\n" in small.convert_tokens_to_string([t])]
    assert bad == [small.vocab.index[198]]  # "\n"; "\n\n" (628) is not kept: it is spelled "\n" "\n"
