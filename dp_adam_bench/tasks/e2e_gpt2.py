"""Table-to-text generation with GPT-2 on E2E NLG (Li, Tramèr, Liang & Hashimoto, full fine-tuning).

X. Li, F. Tramèr, P. Liang, T. Hashimoto, "Large language models can be strong differentially private learners",
ICLR 2022 (arXiv:2110.05679), E2E table-to-text results: GPT-2 (124M) fully fine-tuned on the E2E restaurant data
set (Novikova et al. 2017, arXiv:1706.09254; 42,061 train / 4,672 dev / 4,693 test (MR, reference) pairs, 630 test
MRs) with DP-Adam and ghost clipping; BLEU 61.519 / ROUGE-L 65.670 at ε = 3. What their code
(github.com/lxuechen/private-transformers, ``examples/table2text``) does, and this task reproduces:

* **Format** (``LineByLineE2ETextDataset``): ``" {mr} {bos} {ref} {eos}"``, where GPT-2's one special token
  ``<|endoftext|>`` (id 50256) is both bos and eos. Here the ids are built piecewise:
  ``prompt = tok(" " + mr) + [eos]``, ``target = tok(" " + ref) + [eos]`` (tokenising the joined string would add
  a stray space token before the special token). Li et al. use the prefix-tuning re-formatting of the same CSVs
  (``name : The Vaults | Type : pub | ...`` with tokenised references), which is not stored offline; this task uses
  the original CSV text of both (``name[The Vaults], eatType[pub], ...``) for training and evaluation alike.
* **Loss only on the target**: labels are -100 on the prompt (the bos included) and on padding; the first target
  token is predicted from the bos position, and the final eos is predicted (it teaches the model to stop). The
  per-example loss is the MEAN cross-entropy over that example's target tokens (their ``compute_loss``:
  ``loss.sum(dim=1) / seq_lens``), which is what gets clipped. Padding: they add a ``[PAD]`` token (vocabulary
  50,258); here batches are right-padded with eos under a zero attention mask and label -100, which leaves every
  real token's output unchanged (causal attention), so the vocabulary stays 50,257. They drop the few pairs longer
  than 100 tokens (``max_seq_len``); here no pair is dropped (the longest has 121 tokens, ``max_length`` is 128).
* **Model**: ``GPT2LMHeadModel`` with ``tie_word_embeddings=False`` and the input embedding CLONED into the output
  layer ("Clone the embedding into the lm_head for better initialization"): ghost clipping (Opacus and the ``bk``
  engine) refuses tied parameters. Every transformers ``Conv1D`` is replaced by the equivalent ``nn.Linear``
  (transposed weight): exact, and Opacus has no fast per-sample rule for Conv1D (``docs/pitfalls.md``: 18 % / 31 %
  faster GPT-2 steps with hooks / ghost). Dropout: the checkpoint's 0.1, in train mode, as in their runs.
  ``position_ids`` of shape (B, T) and the attention mask are always passed (``docs/pitfalls.md``: (1, T)
  positions make Opacus' position-embedding gradients silently wrong).
* **Decoding** (``decoding_utils.generate``): beam search with 5 beams, no sampling, up to 100 new tokens
  (``max_new_tokens``; cpu default 60), newline tokens banned (``bad_words_ids``; here every token whose text
  contains a newline, a superset of their ids 198 and 628), cut at the first eos, stripped (decoded without
  ``clean_up_tokenization_spaces``: their references are space-tokenised, these are the original text); one output
  per test MR, scored against all of that MR's references with the E2E scorer's BLEU and ROUGE-L
  (:mod:`dp_adam_bench.tasks.e2e_metrics`, which also says why NIST / METEOR / CIDEr are not computed).

Evaluation (``evaluate``): ``test_loss`` is the token-level mean cross-entropy over the target tokens of every
(MR, reference) pair of the evaluated MRs (all references of each MR); ``test_bleu`` and ``test_rougeL`` (0-100,
as the paper prints them) come from decoding the first ``generate_subset`` evaluated MRs (null: all 630), at the
final evaluation only unless ``generate_every_eval`` (decoding dominates an evaluation's cost on a CPU). The last
decoded texts are kept in ``E2EGpt2.last_generations`` (the trainer gives tasks no run folder to write to).

Efficiency: the 50,257-way output layer is applied only at the positions that predict a target token
(:class:`GPT2AtTargets`); logits elsewhere have label -100 and contribute nothing, so losses and every per-example
gradient are unchanged, while the output layer (most of the compute of the small CPU model) and its ghost norm
get cheaper by the ratio of sequence length to target length: measured on one thread, B = 32, T = 128, a
non-private step takes 2.1 s instead of 10 s with the full (B, T, 50257) logits.

Profiles: ``paper``: pretrained ``gpt2`` (124M) and its tokenizer from the hub. ``cpu`` (``task.pretrain=gpt2_arxiv``
in the li_e2e preset): no GPT-2 weights exist offline, so the starting point is a small GPT-2 (the offline GPT-2
tokenizer, over the 8,192-token vocabulary the build chose from its public corpus:
:mod:`dp_adam_bench.tasks.compact_vocab`) pretrained NON-PRIVATELY on public arXiv abstracts by
:mod:`dp_adam_bench.pretrain` (built once, then cached); ``task.pretrained=false`` trains the same network, with
the same vocabulary, from a random initialisation (the control). Without ``task.pretrain`` and ``task.model``, the
cpu profile builds the ``n_layer`` / ``n_embd`` / ``n_head`` GPT-2 from scratch (all 50,257 tokens). ``data_note``
says which, and it goes into the run summary.

Throughput: the examples of a logical batch are split into micro-batches by length (``micro_batch_order``: less
padding, the same clipped sum), and the cross-entropy runs on flat (B·P, vocab) rows (class-dim-1 cross-entropy on
(B, vocab, P) copies the logits); together a B = 256 DP step of the 2-layer CPU model fell from 12.4 s to 6.0 s.

Clipping engines: bk (the default), ghost, hooks, loop; not functorch (vmap fails inside transformers' mask code).
"""

from __future__ import annotations

import csv
import gzip
import io
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from dp_adam_bench import progress
from dp_adam_bench.finetune.adapters import prefix_length
from dp_adam_bench.paths import shared_data_dir
from dp_adam_bench.tasks import compact_vocab, e2e_metrics, fields, text
from dp_adam_bench.tasks.base import ModelTask, data_folders, missing_data, subset_indices, task_profile
from dp_adam_bench.tasks.local_or_hub import local_or_hub
from dp_adam_bench.tasks.text import TOKENIZER_HINT, load_gpt2_tokenizer  # noqa: F401 (part of this API)

log = logging.getLogger(__name__)

FOLDER = "e2e_nlg"
FILES = {"train": "trainset", "dev": "devset", "test": "testset_w_refs"}  # <name>.csv.gz or <name>.csv
HF_NAME = "e2e_nlg"  # datasets.load_dataset: columns meaning_representation, human_reference
HF_SPLITS = {"train": "train", "dev": "validation", "test": "test"}
SOURCES = ("auto", "local", "hf")
PAPER_MODEL = "gpt2"
TOKENIZER_FOLDER = "gpt2_tokenizer"
# the cpu profile's GPT-2, trained from scratch (task.model=null); the vocabulary is always GPT-2's 50,257 tokens
ARCH_DEFAULTS = {"n_layer": 2, "n_embd": 128, "n_head": 2, "n_positions": 256}
# Li et al.'s E2E BLEU at eps = 3 (configs/paper/li.yaml), quoted in data_note
PAPER_BLEU_EPS3 = 61.519
MODEL_HINT = (
    "Set task.model to a local GPT-2 folder (config.json, plus model.safetensors when task.pretrained=true) or to a "
    "hub name with hub access; task.model=null on the cpu profile builds a small GPT-2 from scratch."
)


# --------------------------------------------------------------------------------------------- data


def read_e2e_csv(path: str | os.PathLike) -> tuple[list[str], list[str]]:
    """(MRs, references) from an E2E CSV (gzipped or not) with columns ``mr`` and ``ref``, in file order."""
    path = Path(path)
    raw = path.read_bytes()
    if path.suffix == ".gz":
        raw = gzip.decompress(raw)
    reader = csv.DictReader(io.StringIO(raw.decode("utf-8-sig")))
    fields = {f.strip().lower(): f for f in reader.fieldnames or []}
    if "mr" not in fields or "ref" not in fields:
        raise ValueError(
            f"{path}: expected the E2E columns mr,ref (testset.csv has no references; use testset_w_refs.csv), "
            f"got {reader.fieldnames}"
        )
    mrs, refs = [], []
    for i, row in enumerate(reader):
        mr, ref = row[fields["mr"]], row[fields["ref"]]
        if not mr or not ref or not mr.strip() or not ref.strip():
            raise ValueError(f"{path}: row {i + 2} has an empty mr or ref")
        mrs.append(mr.strip())
        refs.append(ref.strip())
    if not mrs:
        raise ValueError(f"{path}: no rows")
    return mrs, refs


def load_e2e_hf(split: str, name: str = HF_NAME) -> tuple[list[str], list[str]]:
    import datasets

    d = datasets.load_dataset(name, split=HF_SPLITS[split])
    return [m.strip() for m in d["meaning_representation"]], [r.strip() for r in d["human_reference"]]


def load_e2e_split(
    split: str, source: str = "auto", data_dir=None, hf_name: str = HF_NAME
) -> tuple[list[str], list[str], str]:
    """(MRs, references, origin) of one E2E split; FileNotFoundError listing everything tried when none is found."""
    if split not in FILES:
        raise ValueError(f"unknown E2E split {split!r}; valid: {', '.join(FILES)}")
    if source not in SOURCES:
        raise ValueError(f"unknown E2E source {source!r}; valid: {', '.join(SOURCES)}")
    names = [f"{FILES[split]}.csv.gz", f"{FILES[split]}.csv"]
    data, origin, tried = local_or_hub(
        names,
        data_folders(data_dir, FOLDER),
        read_e2e_csv,
        source,
        hf_name,
        lambda: load_e2e_hf(split, hf_name),
        f"hf:{hf_name}[{HF_SPLITS[split]}]",
    )
    if data is not None:
        return (*data, origin)
    raise missing_data(
        f"E2E {split!r} split",
        source,
        tried,
        f"Provide task.data_dir=/path/to/folder holding {names[0]} (the E2E release's CSV, columns mr,ref); the shared "
        f"offline copy lives in {shared_data_dir() / FOLDER} (DP_ADAM_BENCH_DATA sets the data folder); or hub access "
        "for task.source=hf.",
        task="e2e_gpt2",
    )


def group_by_mr(mrs: Sequence[str], refs: Sequence[str]) -> tuple[list[str], list[list[str]], np.ndarray]:
    """(unique MRs in order of first appearance, their references, each row's group index): the multi-reference
    test set (the E2E scorer groups identical MRs; in the release they are consecutive)."""
    index: dict[str, int] = {}
    groups: list[list[str]] = []
    row_group = np.empty(len(mrs), dtype=np.int64)
    for i, (mr, ref) in enumerate(zip(mrs, refs, strict=True)):
        g = index.setdefault(mr, len(index))
        if g == len(groups):
            groups.append([])
        groups[g].append(ref)
        row_group[i] = g
    return list(index), groups, row_group


# --------------------------------------------------------------------------------------------- tokenizer and model


def conv1d_to_linear(model: nn.Module) -> list[str]:
    """Replace every transformers ``Conv1D`` (y = x W + b with W of shape (in, out)) by the ``nn.Linear`` computing
    the same function (weight Wᵀ); returns the replaced modules' names. Opacus has no fast per-sample rule for
    Conv1D; the swap is exact up to float rounding."""
    from transformers.pytorch_utils import Conv1D

    swapped = []
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if not isinstance(child, Conv1D):
                continue
            w = child.weight
            lin = nn.Linear(child.nx, child.nf, bias=child.bias is not None, device=w.device, dtype=w.dtype)
            with torch.no_grad():
                lin.weight.copy_(w.t())
                if child.bias is not None:
                    lin.bias.copy_(child.bias)
            lin.weight.requires_grad_(w.requires_grad)
            if child.bias is not None:
                lin.bias.requires_grad_(child.bias.requires_grad)
            lin.train(child.training)
            setattr(parent, child_name, lin)
            swapped.append(f"{parent_name}.{child_name}" if parent_name else child_name)
    return swapped


def untie_lm_head(lm: nn.Module) -> None:
    """Give the output layer its own parameter holding a copy of the input embedding (Li et al.: untied, the
    embedding cloned into the lm_head); nothing re-ties them afterwards."""
    emb, head = lm.get_input_embeddings(), lm.get_output_embeddings()
    with torch.no_grad():
        if head.weight is emb.weight:
            head.weight = nn.Parameter(emb.weight.detach().clone(), requires_grad=emb.weight.requires_grad)
        else:
            head.weight.copy_(emb.weight)
    for m in lm.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "tie_word_embeddings"):
            cfg.tie_word_embeddings = False
        if hasattr(m, "all_tied_weights_keys"):
            m.all_tied_weights_keys = {}


class GPT2AtTargets(nn.Module):
    """A GPT-2 LM (``self.lm``, a ``GPT2LMHeadModel``) whose output layer runs only at the positions that predict a
    target token: ``forward(input_ids, attention_mask, position_ids, target_positions)`` returns logits of shape
    (B, P, vocab). ``generate`` is the wrapped model's (beam search). Parameter names are ``lm.*``."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm
        self.config = lm.config

    def forward(self, input_ids, attention_mask, position_ids, target_positions):
        extra = {}
        n = prefix_length(self.lm) if hasattr(self.lm, "get_prompt") else 0
        if n:  # peft's prefix-tuning (task.finetune=prefix): its keys and values before the sequence's, as peft does
            b = input_ids.shape[0]
            extra["past_key_values"] = self.lm.get_prompt(batch_size=b)
            attention_mask = torch.cat([attention_mask.new_ones(b, n), attention_mask], 1)
            position_ids = position_ids + n
        hidden = self.lm.transformer(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
            return_dict=True,
            **extra,
        ).last_hidden_state
        at = target_positions.unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
        return self.lm.lm_head(torch.gather(hidden, 1, at))

    def generate(self, *args, **kwargs):
        return self.lm.generate(*args, **kwargs)


def default_tokenizer(profile: str, model_name: str | None) -> str:
    if profile == "paper":
        return model_name or PAPER_MODEL
    return str(shared_data_dir() / TOKENIZER_FOLDER)


# --------------------------------------------------------------------------------------------- task


class E2EGpt2(ModelTask):
    """E2E table-to-text with GPT-2: data, formatting, model, target-only loss, test loss, BLEU and ROUGE-L.

    Config fields: ``profile`` (cpu | paper); ``model`` (folder or hub name; null = cpu: a GPT-2 built from scratch
    with ``n_layer``, ``n_embd``, ``n_head``, ``n_positions``; paper: ``gpt2``), ``pretrained`` (null = cpu false,
    paper true), ``tokenizer`` (null = cpu: shared/data/gpt2_tokenizer, paper: the model's); ``dropout`` (null =
    the config's 0.1), ``attn_implementation`` (sdpa), ``swap_conv1d``; ``source`` (auto | local | hf),
    ``data_dir``, ``hf_name``, ``eval_split`` (test | dev); ``train_subset`` (rows), ``test_subset`` (MRs),
    ``data_seed``; ``max_length``, ``pad_to`` (longest | max_length); ``eval_batch_size``; decoding:
    ``generate_subset`` (MRs decoded; null = all, 0 = never), ``generate_every_eval``, ``num_beams``,
    ``max_new_tokens`` (null = cpu 60, paper 100), ``generate_batch_size``.
    """

    name = "e2e_gpt2"
    trial_dims = 0

    def __init__(self, cfg, *, trials: int, seed: int):
        del trials, seed
        self.profile = task_profile(cfg)
        self._choose_model(cfg)
        self._read_options(cfg)
        eval_split = fields.eval_split(cfg, ("test", "dev"))
        tr_mrs, tr_refs, subsets = self._load_pairs(cfg, eval_split)
        self._load_tokenizer(cfg)
        self._tokenize_pairs(tr_mrs, tr_refs)
        self.last_generations: list[dict] = []
        self.data_note = self._data_note(eval_split, *subsets)
        log.info("e2e_gpt2: train %s, test %s; %s", self.train_source, self.test_source, self.data_note)

    def _choose_model(self, cfg) -> None:
        """``model_name`` and ``pretrained`` (the module docstring's profiles), the architecture of a GPT-2 built
        from scratch, and ``task.pretrain``'s preset when there is one."""
        model = cfg.get("model")
        pretrained = cfg.get("pretrained")
        self.pretrain_preset = cfg.get("pretrain")
        self.pretrain_summary: dict | None = None
        self.arch = {k: int(cfg.get(k, d)) for k, d in ARCH_DEFAULTS.items()}
        if self.pretrain_preset:
            self.model_name, self.pretrained = self._from_pretrain_preset(cfg, pretrained)
        else:
            self.model_name = str(model) if model else (PAPER_MODEL if self.profile == "paper" else None)
            self.pretrained = (self.profile == "paper") if pretrained is None else bool(pretrained)
        if self.pretrained and self.model_name is None:
            raise ValueError(
                "task.pretrained=true needs task.model (a GPT-2 folder with weights or a hub name such as gpt2) or "
                "task.pretrain (a configs/pretrain preset); no pretrained GPT-2 exists offline"
            )

    def _read_options(self, cfg) -> None:
        """The model's, the batches' and the decoding's fields (the class docstring lists them)."""
        self.dropout = cfg.get("dropout")
        if self.dropout is not None and not 0 <= float(self.dropout) < 1:
            raise ValueError(f"task.dropout must be in [0, 1) or null, got {self.dropout}")
        self.attn_implementation = str(cfg.get("attn_implementation") or "sdpa")
        self.swap_conv1d = bool(cfg.get("swap_conv1d", True))
        self.max_length = fields.max_length(cfg)
        self.pad_to = fields.pad_to(cfg, "longest")
        self.eval_batch_size = fields.positive(cfg, "eval_batch_size", 64)
        gs = cfg.get("generate_subset", 100)
        self.generate_subset = None if gs is None else int(gs)
        if self.generate_subset is not None and self.generate_subset < 0:
            raise ValueError(f"task.generate_subset must be >= 0 or null (all), got {gs}")
        self.generate_every_eval = bool(cfg.get("generate_every_eval", False))
        self.num_beams = fields.positive(cfg, "num_beams", 5)
        mnt = cfg.get("max_new_tokens")
        self.max_new_tokens = (100 if self.profile == "paper" else 60) if mnt is None else int(mnt)
        if self.max_new_tokens < 1:
            raise ValueError(f"task.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        self.generate_batch_size = fields.positive(cfg, "generate_batch_size", 16)

    def _load_pairs(self, cfg, eval_split: str) -> tuple[list[str], list[str], tuple[bool, bool]]:
        """The training pairs (MRs, references) after ``train_subset``, and whether each split was subsampled; the
        evaluated MRs with all their references (after ``test_subset``) kept in ``test_mrs`` / ``test_refs``."""
        source = str(cfg.get("source") or "auto")
        hf_name = str(cfg.get("hf_name") or HF_NAME)
        tr_mrs, tr_refs, self.train_source = load_e2e_split("train", source, cfg.get("data_dir"), hf_name)
        te_mrs, te_refs, self.test_source = load_e2e_split(eval_split, source, cfg.get("data_dir"), hf_name)
        self.full_sizes = {"train": len(tr_mrs), eval_split: len(te_mrs)}
        rng = np.random.default_rng(int(cfg.get("data_seed", 0)))
        tr = subset_indices(len(tr_mrs), cfg.get("train_subset"), rng, "train_subset")
        if tr is not None:
            tr_mrs, tr_refs = [tr_mrs[i] for i in tr], [tr_refs[i] for i in tr]
        groups_mr, groups_refs, _ = group_by_mr(te_mrs, te_refs)
        self.full_sizes[f"{eval_split}_mrs"] = len(groups_mr)
        te = subset_indices(len(groups_mr), cfg.get("test_subset"), rng, "test_subset")
        keep = np.arange(len(groups_mr)) if te is None else te
        self.test_mrs = [groups_mr[g] for g in keep]  # one per evaluated MR
        self.test_refs = [groups_refs[g] for g in keep]  # all its references
        return tr_mrs, tr_refs, (tr is not None, te is not None)

    def _load_tokenizer(self, cfg) -> None:
        if self.pretrain_preset and not self.pretrained and not cfg.get("tokenizer"):
            # the control: its build's tokenizer (BPE files + the vocabulary chosen from the public corpus), derived
            # without building the pretrained model
            from dp_adam_bench.pretrain.gpt2_clm import preset_tokenizer, tokenizer_path

            self.tokenizer_name = tokenizer_path(self.pretrain_spec)
            self.tokenizer = preset_tokenizer(self.pretrain_spec)
        else:
            # a pretrained preset's tokenizer is saved beside its weights, in the build's folder
            default = (
                self.model_name if self.pretrain_preset else default_tokenizer(self.profile, self.model_name)
            )
            self.tokenizer_name = str(cfg.get("tokenizer") or default)
            # a folder with compact_vocab.json (a gpt2_clm build with vocab_size) gives GPT-2's BPE over it
            self.tokenizer = compact_vocab.load_tokenizer(self.tokenizer_name)
        self.eos_id = int(self.tokenizer.eos_token_id)

    def _tokenize_pairs(self, tr_mrs: list[str], tr_refs: list[str]) -> None:
        """Token ids of the training pairs and of every evaluated (MR, reference) pair, checked against
        ``max_length``; the ids decoding may not produce."""
        self.train_mr_ids, self.train_mr_of_row, self.train_ref_ids = self._encode(tr_mrs, tr_refs)
        # MR + reference tokens of every training pair: the sort key of micro_batch_order, computed once
        self.train_lengths = self.train_mr_ids.lengths()[self.train_mr_of_row] + self.train_ref_ids.lengths()
        self.test_mr_ids = self._tokenize_spaced(self.test_mrs)
        pairs = [(g, r) for g, refs in enumerate(self.test_refs) for r in refs]
        self.test_mr_of_row = np.asarray([g for g, _ in pairs], dtype=np.int64)
        self.test_ref_ids = self._tokenize_spaced([r for _, r in pairs])
        self._check_prompts_fit()
        self.truncated = {
            "train": self._count_truncated(self.train_mr_ids, self.train_mr_of_row, self.train_ref_ids),
            "test": self._count_truncated(self.test_mr_ids, self.test_mr_of_row, self.test_ref_ids),
        }
        # every vocabulary entry whose text contains a line break (GPT-2: ids 198, 628, 44320)
        vocab = self.tokenizer.get_vocab()
        self.bad_words_ids = sorted(
            [i] for t, i in vocab.items() if "\n" in self.tokenizer.convert_tokens_to_string([t])
        )

    def _data_note(self, eval_split: str, train_subset: bool, test_subset: bool) -> str:
        """What differs from Li et al.'s setting (the model, the subsets, truncation, the text), for the summary."""
        notes = []
        if self.pretrain_preset:
            notes.append(self._pretrain_note())
        elif not self.pretrained:
            a = self.arch
            notes.append(
                f"GPT-2 architecture (n_layer={a['n_layer']}, n_embd={a['n_embd']}, n_head={a['n_head']}) TRAINED FROM "
                "SCRATCH, not pretrained GPT-2 (no GPT-2 weights offline): compare orderings of methods, not BLEU "
                f"(Li et al. fine-tune pretrained GPT-2 124M: BLEU {PAPER_BLEU_EPS3} at eps = 3)"
                if self.model_name is None
                else f"{self.model_name} RANDOMLY INITIALISED (task.pretrained=false): compare orderings, not BLEU"
            )
        if train_subset:
            notes.append(f"{self.dataset_size:,} of the {self.full_sizes['train']:,} training pairs")
        if test_subset or eval_split != "test":
            notes.append(
                f"{len(self.test_mrs)} of the {self.full_sizes[f'{eval_split}_mrs']} {eval_split} MRs"
            )
        n_gen = self.n_generate
        if n_gen < len(self.test_mrs):
            notes.append(
                f"BLEU / ROUGE-L on the first {n_gen} of {len(self.test_mrs)} evaluated MRs (task.generate_subset)"
            )
        if self.truncated["train"] or self.truncated["test"]:
            notes.append(
                f"{self.truncated['train']} train / {self.truncated['test']} test pairs truncated to "
                f"{self.max_length} tokens"
            )
        notes.append(
            "original E2E CSV text (Li et al.: the prefix-tuning re-formatted MRs and tokenised references)"
        )
        return "; ".join(notes)

    def _from_pretrain_preset(self, cfg, pretrained) -> tuple[str | None, bool]:
        """(model folder or None, pretrained) for ``task.pretrain``: the preset's architecture always (so the
        from-scratch control, ``task.pretrained=false``, is the same network); its weights, built once and cached
        by :func:`dp_adam_bench.pretrain.ensure`, when pretrained (the default)."""
        from dp_adam_bench import pretrain
        from dp_adam_bench.pretrain import gpt2_clm

        # task_spec refuses a task.model beside task.pretrain
        spec = pretrain.task_spec(
            cfg, "gpt2_clm", "E2E", "fine-tunes a GPT-2 (a gpt2_clm preset such as gpt2_arxiv)"
        )
        self.arch = gpt2_clm.architecture(spec)
        self.pretrain_spec = spec
        if pretrained is not None and not bool(pretrained):
            return None, False
        folder = pretrain.ensure(spec)
        self.pretrain_summary = pretrain.built_summary(folder)
        return str(folder), True

    def _pretrain_note(self) -> str:
        from dp_adam_bench.pretrain.gpt2_clm import vocab_size_note

        a, spec = self.arch, self.pretrain_spec
        shape = f"GPT-2 architecture (n_layer={a['n_layer']}, n_embd={a['n_embd']}, n_head={a['n_head']})"
        if spec.get("vocab_size") is not None:
            shape += f" with GPT-2's BPE over its {vocab_size_note(spec)}"
        if self.pretrained:
            s = self.pretrain_summary or {}
            return (
                f"{shape} PRETRAINED NON-PRIVATELY by `dp-adam-bench pretrain {spec['name']}`: "
                f"{s.get('parameters', 0) / 1e6:.1f}M parameters, {spec['steps']} steps of {spec['batch_size']} x "
                f"{spec['block_size']} tokens ({s.get('epochs', float('nan')):.2f} epochs) of public arXiv "
                f"abstracts, validation loss {s.get('val_loss', float('nan')):.3f} nats; Li et al. fine-tune GPT-2 "
                f"124M pretrained on WebText (BLEU {PAPER_BLEU_EPS3} at eps = 3)"
            )
        return (
            f"{shape} of the {spec['name']} preset TRAINED FROM SCRATCH (task.pretrained=false): the control"
        )

    # ------------------------------------------------------------------------------------------------- tokens

    def _tokenize_spaced(self, texts: Sequence[str]) -> text.Ragged:
        """BPE ids of ``" " + text`` (GPT-2 marks a word-initial token by its leading space; no special tokens)."""
        return text.tokenize_ragged(self.tokenizer, [" " + t for t in texts], max_length=10**6)[0]

    def _encode(self, mrs: list[str], refs: list[str]):
        """Training pairs: each distinct MR tokenised once (4,862 MRs for 42,061 pairs), references per row."""
        uniq, groups, row_group = group_by_mr(mrs, refs)
        del groups
        return self._tokenize_spaced(uniq), row_group, self._tokenize_spaced(refs)

    def _check_prompts_fit(self) -> None:
        longest = int(max(self.train_mr_ids.lengths().max(), self.test_mr_ids.lengths().max()))
        if longest + 2 > self.max_length:  # the prompt, its bos, at least one target token
            raise ValueError(
                f"an MR has {longest} tokens: task.max_length={self.max_length} leaves no room for its bos and a "
                "target token; raise task.max_length"
            )

    def _count_truncated(self, mr_ids: text.Ragged, mr_of_row: np.ndarray, ref_ids: text.Ragged) -> int:
        n = mr_ids.lengths()[mr_of_row] + ref_ids.lengths() + 2
        return int((n > self.max_length).sum())

    def format_ids(self, mr_ids: np.ndarray, ref_ids: np.ndarray) -> tuple[np.ndarray, int]:
        """``tok(" " + mr) + [eos] + tok(" " + ref) + [eos]`` truncated to ``max_length``, and the prompt length
        (MR + bos): positions >= the prompt length are the target."""
        ids = np.concatenate([mr_ids, [self.eos_id], ref_ids, [self.eos_id]]).astype(np.int64)
        return ids[: self.max_length], len(mr_ids) + 1

    def prompt_ids(self, k: int) -> np.ndarray:
        """The decoding prompt of evaluated MR ``k``: exactly the training prompt, ``tok(" " + mr) + [eos]``."""
        return np.concatenate([self.test_mr_ids[k], [self.eos_id]]).astype(np.int64)

    # ------------------------------------------------------------------------------------------------- sizes

    @property
    def dataset_size(self) -> int:
        return len(self.train_ref_ids)

    @property
    def test_size(self) -> int:
        """Evaluated (MR, reference) pairs: the rows of test_loss."""
        return len(self.test_ref_ids)

    @property
    def n_generate(self) -> int:
        n = len(self.test_mrs)
        return n if self.generate_subset is None else min(n, self.generate_subset)

    # ------------------------------------------------------------------------------------------------- model

    def build_model(self) -> nn.Module:
        from transformers import GPT2Config, GPT2LMHeadModel

        eos = self.eos_id
        if self.model_name is None:
            a = self.arch
            if a["n_embd"] % a["n_head"]:
                raise ValueError(f"task.n_embd={a['n_embd']} must be divisible by task.n_head={a['n_head']}")
            config = GPT2Config(
                vocab_size=len(self.tokenizer),
                bos_token_id=eos,
                eos_token_id=eos,
                tie_word_embeddings=False,
                **a,
            )
        else:
            config = text.load_config(self.model_name, hint=MODEL_HINT)
            if getattr(config, "model_type", None) != "gpt2":
                raise ValueError(
                    f"{self.name} supports GPT-2 checkpoints (model_type 'gpt2'); {self.model_name} has model_type "
                    f"{getattr(config, 'model_type', None)!r}"
                )
            config.tie_word_embeddings = False
        if self.dropout is not None:
            config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = float(self.dropout)
        config._attn_implementation = self.attn_implementation
        if len(self.tokenizer) > config.vocab_size:
            raise ValueError(
                f"the tokenizer has {len(self.tokenizer)} tokens but the model's vocab_size is {config.vocab_size}"
            )
        if self.max_length > config.n_positions:
            raise ValueError(
                f"task.max_length={self.max_length} > the model's n_positions={config.n_positions}"
            )
        if self.pretrained:
            # the checkpoint has no lm_head (GPT-2 ties it); it is filled from the embedding just below
            lm = text.load_pretrained(
                GPT2LMHeadModel,
                self.model_name,
                config=config,
                hint=MODEL_HINT,
                expected_missing=("lm_head.",),
            )
        else:
            lm = GPT2LMHeadModel(config)
        untie_lm_head(lm)
        if self.swap_conv1d:
            conv1d_to_linear(lm)
        return GPT2AtTargets(lm)

    # ------------------------------------------------------------------------------------------------- batches

    def _batch(self, mr_ids: text.Ragged, mr_of_row: np.ndarray, ref_ids: text.Ragged, idx, pad_to: str):
        idx = np.asarray(torch.as_tensor(idx, dtype=torch.long).cpu().numpy()).reshape(-1)
        rows, prompt_lens = [], []
        for i in idx:
            ids, lp = self.format_ids(mr_ids[int(mr_of_row[i])], ref_ids[int(i)])
            rows.append(ids)
            prompt_lens.append(lp)
        out = text.pad_batch(rows, pad_id=self.eos_id, max_length=self.max_length, pad_to=pad_to)
        del out["token_type_ids"]  # GPT-2 has no segments
        mask = out["attention_mask"]
        # right padding: positions 0..n-1 on real tokens; clamped at 0 and flat on padding (never read)
        out["position_ids"] = (mask.cumsum(1) - 1).clamp(min=0).contiguous()
        b, t = mask.shape
        labels = torch.full((b, t), text.IGNORE_INDEX, dtype=torch.long)
        n_targets = [len(r) - lp for r, lp in zip(rows, prompt_lens, strict=True)]
        p = max(8, -(-max(n_targets) // 8) * 8)
        positions = torch.zeros((b, p), dtype=torch.long)
        target_labels = torch.full((b, p), text.IGNORE_INDEX, dtype=torch.long)
        for j, (r, lp, k) in enumerate(zip(rows, prompt_lens, n_targets, strict=True)):
            tgt = torch.from_numpy(r[lp:])
            labels[j, lp : len(r)] = tgt
            # the token at position s is predicted by the output at position s - 1
            positions[j, :k] = torch.arange(lp - 1, len(r) - 1)
            target_labels[j, :k] = tgt
        out["labels"] = labels
        out["target_positions"] = positions
        out["target_labels"] = target_labels
        return out

    def get_batch(self, indices) -> dict[str, torch.Tensor]:
        """``input_ids``, ``attention_mask``, ``position_ids`` (B, T), ``labels`` (B, T; -100 on prompt and padding),
        and the same targets gathered: ``target_positions`` / ``target_labels`` (B, P; label -100 = none)."""
        return self._batch(self.train_mr_ids, self.train_mr_of_row, self.train_ref_ids, indices, self.pad_to)

    def micro_batch_order(self, idx: torch.Tensor) -> torch.Tensor:
        """The examples of a logical batch by length, so that each physical micro-batch pads little (a sum of
        clipped per-example gradients does not depend on the order; measured: ~30 % less padding at B = 256)."""
        key = torch.as_tensor(self.train_lengths[idx.cpu().numpy()], dtype=torch.long)
        return idx[torch.argsort(key, stable=True).to(idx.device)]

    @staticmethod
    def target_logits(forward: Callable[..., torch.Tensor], batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Logits (B, P, vocab) at the positions predicting the target tokens, through ``forward`` only."""
        return forward(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
            target_positions=batch["target_positions"],
        )

    def loss_per_example(
        self, forward: Callable[..., torch.Tensor], batch: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """Mean cross-entropy over each example's target tokens (its reference and final eos), shape (B,)."""
        text.refuse_vmap(batch, self.name)
        y = batch["target_labels"]
        logits = self.target_logits(forward, batch)
        # flat (B * P, vocab) rows: class-dim-1 cross-entropy on (B, vocab, P) copies the logits (~25 % of a step)
        tl = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            y.reshape(-1),
            reduction="none",
            ignore_index=text.IGNORE_INDEX,
        ).view(y.shape)
        return tl.sum(1) / (y != text.IGNORE_INDEX).sum(1).clamp(min=1)

    # ------------------------------------------------------------------------------------------------- evaluation

    @torch.no_grad()
    def test_loss(self, model: nn.Module) -> float:
        """Token-level mean cross-entropy over the target tokens of every evaluated (MR, reference) pair."""
        device = text.model_device(model)
        loss_sum, count = 0.0, 0
        n = self.test_mr_ids.lengths()[self.test_mr_of_row] + self.test_ref_ids.lengths()
        order = np.argsort(n, kind="stable")  # similar lengths together, each batch padded to its longest
        for start in progress.iterate(range(0, self.test_size, self.eval_batch_size), desc="evaluate"):
            idx = order[start : start + self.eval_batch_size]
            batch = self._batch(self.test_mr_ids, self.test_mr_of_row, self.test_ref_ids, idx, "longest")
            batch = {k: v.to(device) for k, v in batch.items()}
            logits = self.target_logits(model, batch).float()
            y = batch["target_labels"]
            valid = y != text.IGNORE_INDEX
            loss_sum += float(F.cross_entropy(logits[valid], y[valid], reduction="sum"))
            count += int(valid.sum())
        return loss_sum / max(count, 1)

    @torch.no_grad()
    def generate(self, model: nn.Module, mrs: Sequence[int] | None = None) -> list[str]:
        """Beam-search outputs for evaluated MRs ``mrs`` (default: the first ``generate_subset``), in that order.

        Prompts of equal length are decoded together (no padding, so batching changes nothing but float rounding);
        each output is cut at its first eos and at any line break, decoded and stripped."""
        mrs = list(range(self.n_generate)) if mrs is None else [int(k) for k in mrs]
        device = text.model_device(model)
        prompts = {k: self.prompt_ids(k) for k in mrs}
        by_len: dict[int, list[int]] = {}
        for k in mrs:
            by_len.setdefault(len(prompts[k]), []).append(k)
        out: dict[int, str] = {}
        size = self.generate_batch_size
        chunks = [ks[i : i + size] for _, ks in sorted(by_len.items()) for i in range(0, len(ks), size)]
        for chunk in progress.iterate(chunks, desc=f"decode ({len(mrs)} MRs)"):
            ids = torch.as_tensor(np.stack([prompts[k] for k in chunk]), device=device)
            gen = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                num_beams=self.num_beams,
                do_sample=False,
                max_new_tokens=self.max_new_tokens,
                bad_words_ids=self.bad_words_ids,
                pad_token_id=self.eos_id,
                eos_token_id=self.eos_id,
                use_cache=True,
            )
            for k, row in zip(chunk, gen[:, ids.shape[1] :].tolist(), strict=True):
                out[k] = self.decode(row)
        return [out[k] for k in mrs]

    def decode(self, new_ids: Sequence[int]) -> str:
        """Generated ids after the prompt -> text: up to the first eos, up to any line break, stripped."""
        new_ids = list(new_ids)
        if self.eos_id in new_ids:
            new_ids = new_ids[: new_ids.index(self.eos_id)]
        s = self.tokenizer.decode(new_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        return s.split("\n", 1)[0].strip()

    @torch.no_grad()
    def evaluate(self, model: nn.Module, final: bool = False) -> dict[str, float]:
        """``test_loss`` always; ``test_bleu`` and ``test_rougeL`` (0-100) when decoding runs: at the final evaluation
        (``final=True``, passed by the trainer) or at every one with ``generate_every_eval``."""
        metrics = {"test_loss": self.test_loss(model)}
        if self.n_generate and (final or self.generate_every_eval):
            hyps = self.generate(model)
            refs = self.test_refs[: len(hyps)]
            metrics["test_bleu"] = e2e_metrics.bleu(hyps, refs)
            metrics["test_rougeL"] = e2e_metrics.rouge_l(hyps, refs)
            self.last_generations = [
                {"mr": mr, "generated": h, "references": r}
                for mr, h, r in zip(self.test_mrs, hyps, refs, strict=False)
            ]
        return metrics
