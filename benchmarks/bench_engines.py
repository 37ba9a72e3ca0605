"""Cost of one full DP training step per clipping engine, against a non-private step (time and peak memory).

One *step* is everything the trainer does for one logical batch:

* ``nonprivate`` — forward, backward of the mean loss, ``torch.optim.Adam.step()`` (the baseline);
* ``ghost`` / ``hooks`` / ``functorch`` — Opacus ghost clipping, Opacus per-example hooks, ``torch.func``;
  ``bk`` — our book-keeping engine (``dp_adam_bench/engine/bk.py``): for each physical micro-batch the engine's
  sum of clipped per-example gradients (flat clipping, C = 1), then independent Gaussian noise (sigma = 1) and the
  harness' ``adam`` variant update (:class:`dp_adam_bench.engine.privatizer.Privatizer`, ``dp_adam_bench.optim``);
* ``stp`` — scale-then-privatize (``stp`` variant): the per-coordinate scale ``variant.scale(state)`` is computed,
  per-example gradients are clipped in the scaled geometry, noised and unscaled. Engine: ``--stp-engines``
  (default ``bk``, which supports the scale; ``hooks`` / ``functorch`` for comparison, ``auto`` = whichever of
  those had the lowest flat median step time at the same (model, B) in this run). One ``stp`` row per engine
  given; the ``engine`` column tells them apart.

Models (``MODELS``): ``cnn5`` (Tang & Lecuyer's CIFAR-10 CNN), ``bert_tiny`` (BERT-tiny classifier, T = 128;
``bert_base``: the same at BERT-base's shape, for the GPU benchmark ``bench_gpu.py``),
``bert_tiny_mlm`` (BERT-tiny masked LM as the ``arxiv_mlm`` task builds it: untied decoder, predictions only at
the ~15 % chosen positions, T = 128) and ``gpt2_small`` (GPT-2 124M shape as the ``e2e_gpt2`` task builds it:
random init, untied lm_head, Conv1D -> Linear, output layer only at the target half of the sequence, T = 128).
Modes a model cannot run are skipped with a message, not failed (``UNSUPPORTED``: functorch's vmap breaks inside
transformers' attention-mask code, and the LM tasks pass a mask).

Inputs are random (fixed before timing, so data generation is not timed). Each (model, batch size, mode) runs in
its own subprocess, timed under glibc's default allocator settings, and its memory measured in a second one:
``peak_rss_gib`` is that child's peak resident memory (``ru_maxrss``: the whole process, interpreter, torch,
opacus and the step) over 1 + :data:`HELD_STEPS` steps with glibc's mmap threshold fixed from its start
(``MALLOC_MMAP_THRESHOLD_`` = :data:`MMAP_THRESHOLD`, recorded in ``malloc_mmap_threshold``): a freed tensor of
1 MiB or more then goes back to the system, so the peak is the memory a step holds. ``peak_rss_default_gib`` is
the timing child's peak under glibc's default, whose threshold grows to 32 MiB after the first large free so that
the heap keeps freed tensors, by an amount that varies from run to run: BERT-tiny B = 256 measured 1.64 GiB
non-private vs 2.01 GiB bk (1.23x) that way in one run and 1.76 vs 1.93 (1.10x) in another, while the live
tensors between steps were 0.07 and 0.05 GiB and ``malloc_trim`` brought both processes to 0.4 GiB. The threshold
is not fixed in the timing child because every large allocation would then pay its page faults (CNN5 B = 256's
non-private step: 0.21 -> 0.35 s), nor switched after the timed steps (``mallopt`` + ``malloc_trim`` left bk's
heap at its default size there). Rows without ``malloc_mmap_threshold`` predate this and hold the default peak in
``peak_rss_gib``. ``rss_before_steps_gib`` is the timing child's resident memory after imports and set-up.
Every child imports opacus (and transformers for the language models), whatever its mode, so baselines are
comparable. DP modes process a logical batch larger than ``--physical-batch-size`` (default 256, the trainer's
default) in micro-batches of that size, the non-private step never does; the ``physical_batch_size`` column
records what was done.

    .venv/bin/python benchmarks/bench_engines.py                   # CNN5, B = 256 and 2048, all modes
    .venv/bin/python benchmarks/bench_engines.py --quick           # B = 16, 1 warm-up + 2 steps (tests / CI)
    .venv/bin/python benchmarks/bench_engines.py --quick --models gpt2_small bert_tiny_mlm   # tiny shapes
    .venv/bin/python benchmarks/bench_engines.py --models bert_tiny --batch-sizes 256 --merge
    .venv/bin/python benchmarks/bench_engines.py --models gpt2_small --batch-sizes 8 --stp-engines bk hooks --merge
    BENCH_THREADS=1 .venv/bin/python benchmarks/bench_engines.py --modes nonprivate ghost

``--quick`` also shrinks the language models (T = 16; GPT-2 with 2 layers of width 64): it tests the code
paths, its numbers mean nothing. Threads: ``torch.set_num_threads`` (and OMP/MKL variables of the child) from
``BENCH_THREADS`` (default 2). Run one benchmark at a time: two torch jobs on a 2-core machine slow each other by
up to 18x (docs/pitfalls.md). Adding a model: a builder returning a :class:`BenchModel`, one entry in ``MODELS``.
Where a step's time goes: ``benchmarks/profile_step.py`` (torch.profiler) runs the same step (:func:`build_step`)
with ``record_function`` labels around its phases.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script from a checkout without installing the package
    sys.path.insert(0, str(REPO_ROOT))

OUT = Path(__file__).resolve().parent / "results_engines.csv"
MODES = ("nonprivate", "ghost", "bk", "hooks", "functorch", "stp")
FLAT_ENGINES = ("ghost", "bk", "hooks", "functorch")
#: engines that can clip per-coordinate scaled gradients (scale-then-privatize)
STP_ENGINES = ("bk", "hooks", "functorch")
DEFAULT_STP_ENGINE = "bk"
DEFAULT_BATCH_SIZES = (256, 2048)
QUICK_BATCH_SIZE = 16
CLIP, SIGMA, LR = 1.0, 1.0, 1e-3
COLUMNS = [
    "model",
    "batch_size",
    "mode",
    "engine",
    "median_step_s",
    "ratio_to_nonprivate",
    "peak_rss_gib",
    "ratio_mem_to_nonprivate",
    "threads",
    "torch_version",
    "opacus_version",
    "cpu",
    "date",
    # extra columns: how the numbers were obtained
    "min_step_s",
    "rss_before_steps_gib",
    "physical_batch_size",
    "warmup",
    "steps",
    "params",
    "seq_len",
    "transformers_version",
    "malloc_mmap_threshold",
    "peak_rss_default_gib",
    "ratio_mem_default_to_nonprivate",
    "notes",
]


# --------------------------------------------------------------------------------------------- models


@dataclass
class BenchModel:
    """What a benchmark needs from a model: the module, the per-example loss and a random batch maker.

    ``loss_per_example(forward, batch)`` returns one loss per example (shape (B,)), calling the model only
    through ``forward`` (the engines pass a wrapped module); ``make_batch(b, generator)`` returns a dict of
    tensors with the examples along dim 0.
    """

    model: object  # torch.nn.Module (typed loosely so that this module imports without torch)
    loss_per_example: Callable
    make_batch: Callable
    description: str
    seq_len: int | None = None  # tokens per example (language models)


def build_cnn5(quick: bool = False) -> BenchModel:
    import torch
    from torch.nn import functional as F

    from dp_adam_bench.tasks.cifar10_cnn import CNN5

    def make_batch(b: int, g: torch.Generator) -> dict:
        return {"x": torch.randn(b, 3, 32, 32, generator=g), "y": torch.randint(0, 10, (b,), generator=g)}

    def loss_per_example(forward, batch):
        return F.cross_entropy(forward(batch["x"]), batch["y"], reduction="none")

    return BenchModel(
        CNN5(), loss_per_example, make_batch, "Tang & Lecuyer CNN5, random 3x32x32 inputs, 10 classes"
    )


BERT_SEQ_LEN = 128
GPT2_SEQ_LEN = 128
QUICK_SEQ_LEN = 16


def _bert_tiny_config(**overrides):
    """BERT-tiny's config (L = 2, H = 128, A = 2, vocab 30522) from the offline ``shared/data/bert_tiny`` folder the
    ``arxiv_mlm`` task uses, or the same numbers when that folder is missing."""
    from transformers import BertConfig

    from dp_adam_bench.tasks import arxiv_mlm, text

    try:
        cfg = text.load_config(arxiv_mlm.default_model("cpu"), **overrides)
    except FileNotFoundError:
        cfg = BertConfig(
            vocab_size=30522,
            hidden_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=512,
            **overrides,
        )
    text.check_bert(cfg, "bench_engines")
    return cfg


def _without_padding_idx(model) -> None:
    """Timing only: the Opacus engines refuse BERT's word embeddings (padding_idx = 0), on which Opacus' rule is
    wrong (docs/pitfalls.md); the step costs the same without it, so their rows time the model with padding_idx
    cleared. Training with them is refused (engine/support.py)."""
    from torch import nn

    for m in model.modules():
        if isinstance(m, nn.Embedding):
            m.padding_idx = None


BERT_TINY = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512)
BERT_BASE = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)


def _bert_classifier(arch: dict, name: str, quick: bool) -> BenchModel:
    """A BERT classifier of shape ``arch`` (vocab 30522, 2 labels, random init), T = 128 random tokens, no mask.

    position_ids and token_type_ids are passed with shape (B, T): with transformers' default (1, T) Opacus'
    per-example gradient of the position embedding is silently wrong (docs/pitfalls.md). No attention mask: torch.func
    per-example gradients break inside transformers' mask code.
    """
    import torch
    from torch.nn import functional as F
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(vocab_size=30522, num_labels=2, **arch)
    model = BertForSequenceClassification(cfg)
    t = QUICK_SEQ_LEN if quick else BERT_SEQ_LEN

    def make_batch(b: int, g: torch.Generator) -> dict:
        return {
            "input_ids": torch.randint(0, cfg.vocab_size, (b, t), generator=g),
            "position_ids": torch.arange(t).repeat(b, 1),
            "token_type_ids": torch.zeros(b, t, dtype=torch.long),
            "y": torch.randint(0, cfg.num_labels, (b,), generator=g),
        }

    def loss_per_example(forward, batch):
        out = forward(
            input_ids=batch["input_ids"],
            position_ids=batch["position_ids"],
            token_type_ids=batch["token_type_ids"],
        )
        return F.cross_entropy(out.logits, batch["y"], reduction="none")

    shape = f"L={arch['num_hidden_layers']}, H={arch['hidden_size']}, A={arch['num_attention_heads']}"
    return BenchModel(model, loss_per_example, make_batch, f"{name} classifier ({shape}), T={t}", seq_len=t)


def build_bert_tiny(quick: bool = False) -> BenchModel:
    """BERT-tiny classifier (L = 2, H = 128, A = 2), T = 128: :func:`_bert_classifier`."""
    return _bert_classifier(BERT_TINY, "BERT-tiny", quick)


def build_bert_base(quick: bool = False) -> BenchModel:
    """BERT-base classifier (L = 12, H = 768, A = 12, FFN 3072), T = 128 (the GPU benchmark's row); ``--quick``:
    BERT-tiny's shape at T = 16."""
    return _bert_classifier(BERT_TINY if quick else BERT_BASE, "BERT-tiny" if quick else "BERT-base", quick)


def build_bert_tiny_mlm(quick: bool = False) -> BenchModel:
    """BERT-tiny masked LM, random init, built as ``arxiv_mlm`` builds it: ``BertForMaskedLM`` from the
    ``shared/data/bert_tiny`` config, :func:`prepare_bert_for_dp` (decoder untied from the word embeddings, one
    decoder bias), wrapped in :class:`MaskedLMAtPositions` (the 30522-way head runs only at the chosen positions).

    Batch: T = 128 random non-special tokens under a full attention mask, (B, T) position and token-type ids, and
    ``max_predictions`` = round(15 % of the T - 2 maskable tokens) = 19 distinct chosen positions per example with
    random labels; loss: the task's mean cross-entropy over an example's chosen positions.
    """
    import torch
    from transformers import BertForMaskedLM

    from dp_adam_bench.tasks import text
    from dp_adam_bench.tasks.arxiv_mlm import ArxivMLM, MaskedLMAtPositions

    cfg = _bert_tiny_config()
    mlm = BertForMaskedLM(cfg)
    text.prepare_bert_for_dp(mlm, untie=True)
    model = MaskedLMAtPositions(mlm)
    t = QUICK_SEQ_LEN if quick else BERT_SEQ_LEN
    n_pred = text.num_to_mask(t - 2, 0.15)  # the task's max_predictions for max_length = t
    lo = 1000  # ids below this are [PAD], [unused*], [UNK], [CLS], [SEP], [MASK] in BERT's vocabulary

    def make_batch(b: int, g: torch.Generator) -> dict:
        # distinct positions among 1..t-2 ([CLS] and [SEP] are never chosen), sorted as the task sorts them
        pos = torch.rand(b, t - 2, generator=g).argsort(1)[:, :n_pred].sort(1).values + 1
        return {
            "input_ids": torch.randint(lo, cfg.vocab_size, (b, t), generator=g),
            "attention_mask": torch.ones(b, t, dtype=torch.long),
            "token_type_ids": torch.zeros(b, t, dtype=torch.long),
            "position_ids": torch.arange(t).repeat(b, 1),
            "mlm_positions": pos,
            "mlm_labels": torch.randint(lo, cfg.vocab_size, (b, n_pred), generator=g),
        }

    def loss_per_example(forward, batch):
        tl = ArxivMLM.token_losses(forward, batch)  # (B, P), the task's forward and cross-entropy
        count = (batch["mlm_labels"] != text.IGNORE_INDEX).sum(1).clamp(min=1)
        return tl.sum(1) / count

    return BenchModel(
        model,
        loss_per_example,
        make_batch,
        f"BERT-tiny masked LM (untied decoder, head at {n_pred} of T={t} positions)",
        seq_len=t,
    )


GPT2_SMALL = {"n_layer": 12, "n_embd": 768, "n_head": 12}
GPT2_QUICK = {"n_layer": 2, "n_embd": 64, "n_head": 2}
GPT2_VOCAB = 50257


def build_gpt2_small(quick: bool = False) -> BenchModel:
    """GPT-2 124M shape (12 layers, width 768, 12 heads, vocab 50257), random init, built as ``e2e_gpt2`` builds
    it: ``tie_word_embeddings=False`` with the embedding cloned into the lm_head (:func:`untie_lm_head`), every
    ``Conv1D`` swapped for the equal ``nn.Linear`` (:func:`conv1d_to_linear`), sdpa attention, dropout 0.1 in train
    mode, and :class:`GPT2AtTargets` (the output layer only at the positions that predict a target token).

    Batch: T = 128 random tokens under a full attention mask, (B, T) position ids; the second half is the target:
    positions T/2 - 1 .. T - 2 predict tokens T/2 .. T - 1. Loss: the task's mean cross-entropy over an example's
    target tokens. ``--quick``: 2 layers of width 64, T = 16 (the vocabulary stays 50257).
    """
    import torch
    from torch.nn import functional as F
    from transformers import GPT2Config, GPT2LMHeadModel

    from dp_adam_bench.tasks import text
    from dp_adam_bench.tasks.e2e_gpt2 import E2EGpt2, GPT2AtTargets, conv1d_to_linear, untie_lm_head

    arch = GPT2_QUICK if quick else GPT2_SMALL
    eos = GPT2_VOCAB - 1
    config = GPT2Config(
        vocab_size=GPT2_VOCAB,
        n_positions=1024,
        bos_token_id=eos,
        eos_token_id=eos,
        tie_word_embeddings=False,
        **arch,
    )
    config._attn_implementation = "sdpa"  # the task's default (attn_implementation)
    lm = GPT2LMHeadModel(config)
    untie_lm_head(lm)
    conv1d_to_linear(lm)
    model = GPT2AtTargets(lm)
    t = QUICK_SEQ_LEN if quick else GPT2_SEQ_LEN
    prompt = t // 2

    def make_batch(b: int, g: torch.Generator) -> dict:
        ids = torch.randint(0, GPT2_VOCAB, (b, t), generator=g)
        return {
            "input_ids": ids,
            "attention_mask": torch.ones(b, t, dtype=torch.long),
            "position_ids": torch.arange(t).repeat(b, 1),
            # the token at position s is predicted by the output at position s - 1
            "target_positions": torch.arange(prompt - 1, t - 1).repeat(b, 1),
            "target_labels": ids[:, prompt:].clone(),
        }

    def loss_per_example(forward, batch):
        y = batch["target_labels"]
        tl = F.cross_entropy(
            E2EGpt2.target_logits(forward, batch).transpose(1, 2),
            y,
            reduction="none",
            ignore_index=text.IGNORE_INDEX,
        )
        return tl.sum(1) / (y != text.IGNORE_INDEX).sum(1).clamp(min=1)

    shape = ", ".join(f"{k}={v}" for k, v in arch.items())
    return BenchModel(
        model,
        loss_per_example,
        make_batch,
        f"GPT-2 ({shape}, vocab {GPT2_VOCAB}), untied lm_head, Linear, loss on {t - prompt} of T={t}",
        seq_len=t,
    )


def build_gpt2_small_lora(quick: bool = False) -> BenchModel:
    """:func:`build_gpt2_small` fine-tuned with LoRA (``task.finetune=lora``: peft's adapters on ``c_attn``, r = 4,
    alpha = 32, every other parameter frozen; :mod:`dp_adam_bench.finetune.adapters`): the cost of a LoRA step
    against the full fine-tuning rows of ``gpt2_small`` (issue 45)."""
    from dp_adam_bench.finetune import apply

    bm = build_gpt2_small(quick)
    tuned = apply(bm.model, "lora")
    bm.model = tuned.model
    n = tuned.summary["trainable_params"]
    bm.description = f"{bm.description}; LoRA r = 4 on c_attn ({n:,} trainable)"
    return bm


#: model name -> builder (``builder(quick)``; quick = tiny shapes for smoke tests)
MODELS: dict[str, Callable[..., BenchModel]] = {
    "cnn5": build_cnn5,
    "bert_tiny": build_bert_tiny,
    "bert_base": build_bert_base,
    "bert_tiny_mlm": build_bert_tiny_mlm,
    "gpt2_small": build_gpt2_small,
    "gpt2_small_lora": build_gpt2_small_lora,
}
_NO_VMAP = "torch.func.vmap fails inside transformers' attention-mask code (docs/pitfalls.md); the task passes a mask"
#: model -> {mode: why it is not run}; such rows are skipped, not failed
UNSUPPORTED: dict[str, dict[str, str]] = {
    "bert_tiny_mlm": {"functorch": _NO_VMAP},
    "gpt2_small": {"functorch": _NO_VMAP},
    "gpt2_small_lora": {"functorch": _NO_VMAP},
}
#: models run when --models is not given (the language models are slow on 2 CPU threads: opt in with --models)
DEFAULT_MODELS = ("cnn5",)


# --------------------------------------------------------------------------------------------- one configuration


def _threads() -> int:
    return int(os.environ.get("BENCH_THREADS", "2"))


def _rss_now_gib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2**20  # KiB -> GiB
    return float("nan")


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _split(batch: dict, size: int) -> list[dict]:
    n = next(iter(batch.values())).shape[0]
    return [{k: v[i : i + size] for k, v in batch.items()} for i in range(0, n, size)]


def no_label(name: str):
    """The label factory of timed runs: no profiler ranges (``profile_step.py`` passes ``record_function``)."""
    del name
    return contextlib.nullcontext()


@dataclass
class Step:
    """One configuration, set up and ready to run: ``run()`` is one full step; ``close()`` removes hooks."""

    run: Callable[[], None]
    close: Callable[[], None] | None
    engine: str  # "torch.optim.Adam" for the non-private step
    physical_batch_size: int
    params: int
    seq_len: int | None
    description: str
    engine_obj: object = None  # the clipping engine (DP modes), for profilers to instrument


#: phase labels (``record_function`` names when profiling); ``profile_step.py`` attributes time by them
PHASE_PREFIX = "phase:"


def build_step(spec: dict, label: Callable = no_label) -> Step:
    """Build the model, a fixed random batch and one full training step of ``spec["mode"]``.

    ``label(name)`` returns a context manager entered around each phase of the step (``forward``, ``backward``,
    ``optimizer``, ``zero_grad`` for the non-private step; ``scale``, ``clip_engine`` (one micro-batch through the
    clipping engine, with ``forward`` inside it), ``accumulate``, ``noise`` and ``optimizer`` for DP modes): the
    timed runs pass :func:`no_label`, ``profile_step.py`` a ``torch.profiler.record_function`` factory."""
    import torch

    torch.manual_seed(0)
    device = torch.device(spec.get("device") or "cpu")
    bm = MODELS[spec["model"]](quick=bool(spec.get("quick")))
    model, raw_loss = bm.model.to(device), bm.loss_per_example
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    batch = {
        k: v.to(device)
        for k, v in bm.make_batch(int(spec["batch_size"]), torch.Generator().manual_seed(1)).items()
    }
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=spec.get("precision") == "bf16")

    def L(name):  # noqa: N802  (short: used on every phase)
        return label(PHASE_PREFIX + name)

    def loss_fn(forward, batch):
        with L("forward"), autocast:  # bf16: the model under autocast, as train.precision=bf16 runs it
            return raw_loss(forward, batch)

    common = {"params": sum(p.numel() for p in params), "seq_len": bm.seq_len, "description": bm.description}
    if spec["mode"] == "nonprivate":
        return _nonprivate_step(spec, model, params, batch, loss_fn, L, common)
    return _dp_step(spec, model, params, batch, loss_fn, L, common)


def _nonprivate_step(spec: dict, model, params: list, batch: dict, loss_fn, L, common: dict) -> Step:
    """torch.optim.Adam on the whole batch, or in micro-batches where the spec asks for gradient accumulation
    (the GPU benchmark's micro-batched rows)."""
    import torch

    b = int(spec["batch_size"])
    opt = torch.optim.Adam(params, lr=LR)
    phys = min(b, int(spec.get("nonprivate_physical_batch_size") or b))
    parts = _split(batch, phys)

    def step():
        with L("zero_grad"):
            opt.zero_grad(set_to_none=True)
        for part in parts:
            loss = loss_fn(model, part).sum() / b
            with L("backward"):
                loss.backward()
        with L("optimizer"):
            opt.step()

    return Step(step, None, "torch.optim.Adam", phys, **common)


def _dp_step(spec: dict, model, params: list, batch: dict, loss_fn, L, common: dict) -> Step:
    """A DP step as the trainer runs it: each micro-batch through the clipping engine, the clipped sums added, the
    noise, the optimizer (Adam, or stp's with its scale)."""
    import torch

    from dp_adam_bench.engine.engines import build_engine
    from dp_adam_bench.engine.privatizer import Privatizer
    from dp_adam_bench.optim.registry import build_variant
    from dp_adam_bench.privacy.mechanisms import IndependentMechanism

    b, mode, engine_name = int(spec["batch_size"]), spec["mode"], spec.get("engine") or ""
    if mode != "stp" and engine_name != mode:
        raise ValueError(f"mode {mode!r} runs engine {mode!r}, got engine {engine_name!r}")
    phys = int(spec.get("physical_batch_size") or 0) or b
    phys = min(phys, b)
    chunks = _split(batch, phys)
    if engine_name in ("hooks", "ghost"):
        _without_padding_idx(model)
    engine = build_engine(engine_name, model, loss_fn)
    variant = build_variant("stp" if mode == "stp" else "adam", lr=LR)
    state = variant.init(params)
    mech = IndependentMechanism().reset(
        [p.shape for p in params],
        seed=0,
        dtype=params[0].dtype,
        device=torch.device(spec.get("device") or "cpu"),
    )
    privatizer = Privatizer(clip=CLIP, sigma=SIGMA, expected_batch_size=b, mechanisms=[mech])

    def step():
        with L("scale"):
            scale = variant.scale(state)  # None except for stp
        summed = None  # as the trainer (engine/backends.py): the first micro-batch's sums, the others added
        for chunk in chunks:
            with L("clip_engine"):
                cs = engine.clipped_sum(chunk, CLIP, scale)
            with L("accumulate"):
                if summed is None:
                    summed = cs.summed
                else:
                    for acc, s in zip(summed, cs.summed, strict=True):
                        acc.add_(s)
            cs = None
        with L("noise"):
            ctx = privatizer.release_sum(summed, scale).ctx
        with L("optimizer"), torch.no_grad():
            variant.update(params, state, ctx)

    return Step(step, engine.close, engine_name, phys, engine_obj=engine, **common)


def versions() -> dict:
    """torch, opacus and transformers versions (transformers' from its metadata: importing it costs memory)."""
    from importlib import metadata

    import opacus
    import torch

    try:
        tf = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        tf = ""
    return {
        "torch_version": torch.__version__,
        "opacus_version": opacus.__version__,
        "transformers_version": tf,
    }


def run_one(spec: dict) -> dict:
    """Time one (model, batch size, mode) in this process; called in a subprocess by :func:`main`. With
    ``spec["memory"]``: only its peak resident memory over 1 + HELD_STEPS steps (:func:`_memory_child`)."""
    import opacus  # noqa: F401  (imported in every mode so that the RSS baselines match)
    import torch

    threads = _threads()
    torch.set_num_threads(threads)
    st = build_step(spec)
    if spec.get("memory"):
        for _ in range(1 + HELD_STEPS):
            st.run()
        # Linux reports ru_maxrss in KiB
        return {"peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    rss_before = _rss_now_gib()
    times = []
    for i in range(spec["warmup"] + spec["steps"]):
        start = time.perf_counter()
        st.run()
        elapsed = time.perf_counter() - start
        if i >= spec["warmup"]:
            times.append(elapsed)
    default_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    if st.close is not None:
        st.close()
    return {
        "model": spec["model"],
        "batch_size": int(spec["batch_size"]),
        "mode": spec["mode"],
        "engine": st.engine,
        "median_step_s": statistics.median(times),
        "min_step_s": min(times),
        "peak_rss_default_gib": default_peak,
        "rss_before_steps_gib": rss_before,
        "physical_batch_size": st.physical_batch_size,
        "warmup": spec["warmup"],
        "steps": spec["steps"],
        "params": st.params,
        "seq_len": st.seq_len,
        "threads": threads,
        **versions(),
    }


#: glibc's mmap threshold while a child measures the memory a step holds (bytes; see the module docstring)
MMAP_THRESHOLD = 1 << 20
#: steps after the first in the memory child
HELD_STEPS = 2


def _memory_child(spec: dict, timeout: float | None) -> dict:
    """``peak_rss_gib`` and ``malloc_mmap_threshold`` from a child with glibc's mmap threshold fixed from its
    start (see the module docstring); an ``error`` if that child failed."""
    env = {**child_env(), "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}
    res = _child({**spec, "memory": True}, timeout, env)
    if "error" in res:
        return {"error": "memory " + res["error"]}
    return {"peak_rss_gib": res["peak_rss_gib"], "malloc_mmap_threshold": MMAP_THRESHOLD}


def child_env() -> dict:
    """Environment of a benchmark child: BENCH_THREADS threads for torch, OpenMP and MKL; offline hub."""
    threads = str(_threads())
    env = dict(os.environ, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, TOKENIZERS_PARALLELISM="false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def _child(spec: dict, timeout: float | None, env: dict | None = None) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", json.dumps(spec)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env or child_env(), timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:g} s"}
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-15:]
        print("\n".join("    " + ln for ln in tail), file=sys.stderr)
        last = tail[-1] if tail else ""
        why = " (killed: out of memory?)" if done.returncode in (-9, 137) else ""
        return {"error": f"failed (exit {done.returncode}){why}: {last}"[:300]}
    return json.loads(done.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------------------------- the whole run


def add_ratios(df):
    """ratio_to_nonprivate / ratio_mem_to_nonprivate (and ..._default_...) against the nonprivate row of the same
    model and batch."""
    base = df[df["mode"] == "nonprivate"].drop_duplicates(["model", "batch_size"], keep="last")
    base = base.set_index(["model", "batch_size"])
    key = list(zip(df["model"], df["batch_size"], strict=True))
    t0 = [base["median_step_s"].get(k, float("nan")) for k in key]
    m0 = [base["peak_rss_gib"].get(k, float("nan")) for k in key]
    df["ratio_to_nonprivate"] = df["median_step_s"] / t0
    df["ratio_mem_to_nonprivate"] = df["peak_rss_gib"] / m0
    if "peak_rss_default_gib" in df:
        d0 = [base["peak_rss_default_gib"].get(k, float("nan")) for k in key]
        df["ratio_mem_default_to_nonprivate"] = df["peak_rss_default_gib"] / d0
    return df


def markdown(df) -> str:
    lines = [
        "| model | B | mode | engine | phys. batch | median step, s | x non-private | peak RSS, GiB | x mem | notes |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for _, r in df.iterrows():

        def f(x, fmt):
            return "" if x != x else format(x, fmt)  # NaN -> empty

        lines.append(
            f"| {r.model} | {r.batch_size} | {r['mode']} | {r.engine} | {f(r.physical_batch_size, '.0f')} "
            f"| {f(r.median_step_s, '.3f')} | {f(r.ratio_to_nonprivate, '.2f')} | {f(r.peak_rss_gib, '.2f')} "
            f"| {f(r.ratio_mem_to_nonprivate, '.2f')} | {r.notes} |"
        )
    return "\n".join(lines)


def _stp_engine(choice: str, rows: list[dict], model: str, b: int) -> tuple[str, str]:
    """The engine of an stp row: ``choice`` itself, or for ``auto`` the STP_ENGINES member with the lowest flat
    median step time measured at (model, b) in ``rows``."""
    if choice != "auto":
        return choice, "engine given by --stp-engines"
    measured = {
        r["mode"]: r["median_step_s"]
        for r in rows
        if r["model"] == model and r["batch_size"] == b and r["mode"] in STP_ENGINES and "error" not in r
    }
    if not measured:
        return DEFAULT_STP_ENGINE, f"no flat engine measured in this run: {DEFAULT_STP_ENGINE} by default"
    best = min(measured, key=measured.get)
    timings = ", ".join(f"{k} {v:.3f} s" for k, v in sorted(measured.items()))
    return best, f"fastest flat engine at this B ({timings})"


def plan(models, batch_sizes, modes, stp_engines) -> list[tuple[str, int, str, str | None]]:
    """(model, B, mode, engine choice) in run order; stp once per ``stp_engines`` entry, after the flat modes
    (``auto`` needs their timings). Modes in ``UNSUPPORTED`` for a model are left out."""
    out = []
    for model in models:
        skip = UNSUPPORTED.get(model, {})
        for b in batch_sizes:
            for mode in modes:
                if mode in skip:
                    continue
                if mode == "stp":
                    out += [(model, b, mode, choice) for choice in stp_engines]
                else:
                    out.append((model, b, mode, None if mode == "nonprivate" else mode))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(json.loads(args.one))))
        return
    warmup, steps, batch_sizes = _sizes(parser, args)
    models = list(dict.fromkeys(args.models or DEFAULT_MODELS))
    modes = [
        m for m in MODES if m in (args.modes or MODES)
    ]  # stp after the flat modes: auto picks the faster
    stp_engines = list(dict.fromkeys(args.stp_engines))
    for model in models:
        for mode, why in UNSUPPORTED.get(model, {}).items():
            if mode in modes:
                print(f"{model}: {mode} not run: {why}", flush=True)

    cpu, date = cpu_name(), dt.datetime.now().astimezone().isoformat(timespec="seconds")
    rows: list[dict] = []
    t_start = time.perf_counter()
    for model, b, mode, choice in plan(models, batch_sizes, modes, stp_engines):
        engine, notes = _engine_and_notes(mode, choice, rows, model, b)
        spec = {
            "model": model,
            "batch_size": b,
            "mode": mode,
            "engine": engine,
            "physical_batch_size": args.physical_batch_size,
            "warmup": warmup,
            "steps": steps,
            "quick": args.quick,
        }
        if args.quick and model != "cnn5":
            notes.append("quick: tiny shapes")
        t0 = time.perf_counter()
        res = _measured(spec, args.timeout, notes) | {"cpu": cpu, "date": date, "notes": "; ".join(notes)}
        rows.append(res)
        _print_progress(res, spec, time.perf_counter() - t_start, time.perf_counter() - t0)

    df = _table(rows, args.out if args.merge else None)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(args.out, index=False)
    print()
    print(markdown(df))
    print(
        f"\nthreads={_threads()}, {warmup} warm-up + {steps} timed steps, cpu: {cpu}; "
        f"total {time.perf_counter() - t_start:.1f} s; wrote {args.out}"
    )
    if any("error" in r for r in rows):
        sys.exit(1)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="\n".join(__doc__.splitlines()[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"B = {QUICK_BATCH_SIZE}, 1 warm-up + 2 timed steps, tiny language models (tests / CI)",
    )
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=None)
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=None)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=None)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="timed steps (the median is reported)")
    parser.add_argument("--physical-batch-size", type=int, default=256, help="DP micro-batch size; 0 = whole")
    parser.add_argument(
        "--stp-engines",
        "--stp-engine",
        nargs="+",
        choices=("auto", *STP_ENGINES),
        default=[DEFAULT_STP_ENGINE],
        help=f"engine(s) of the stp rows, one row each (default {DEFAULT_STP_ENGINE}; e.g. bk hooks to compare)",
    )
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per configuration")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep rows of --out for other (model, B, mode, engine) instead of replacing",
    )
    parser.add_argument("--one", help=argparse.SUPPRESS)
    return parser


def _sizes(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[int, int, list[int]]:
    """Warm-up steps, timed steps and the batch sizes (each once): --quick's, or the arguments' (refused below
    the minimum of a full run)."""
    if args.quick:
        warmup, steps, batch_sizes = 1, 2, args.batch_sizes or [QUICK_BATCH_SIZE]
    else:
        warmup, steps, batch_sizes = args.warmup, args.steps, args.batch_sizes or list(DEFAULT_BATCH_SIZES)
        if warmup < 2 or steps < 5:
            parser.error("need --warmup >= 2 and --steps >= 5 (use --quick for a smoke test)")
    if any(b < 1 for b in batch_sizes):
        parser.error("batch sizes must be >= 1")
    return warmup, steps, list(dict.fromkeys(batch_sizes))


def _engine_and_notes(
    mode: str, choice: str | None, rows: list[dict], model: str, b: int
) -> tuple[str, list]:
    """The engine a row runs (none for the non-private step, the mode's own, or stp's chosen one) and its first
    notes (why ``auto`` chose it)."""
    if mode == "nonprivate":
        return "", []
    if mode != "stp":
        return mode, []
    engine, why = _stp_engine(choice, rows, model, b)
    return engine, [f"stp via {engine}: {why}"] if choice == "auto" else []


def _measured(spec: dict, timeout: float, notes: list[str]) -> dict:
    """One configuration's timing child, then its memory child: the row's measurements (a failed timing: only
    the row's keys and ``error``), their errors and the micro-batch count added to ``notes``."""
    res = _child(spec, timeout)
    if "error" not in res:
        mem = _memory_child(spec, timeout)
        if "error" in mem:  # the timing stands; the memory is missing, with why
            notes.append(mem["error"])
            mem = {"peak_rss_gib": float("nan")}
        res |= mem
    if "error" in res:
        notes.append(res["error"])
        res = {k: spec[k] for k in ("model", "batch_size", "mode", "engine")} | {"error": 1}
        res["engine"] = res["engine"] or "torch.optim.Adam"
    elif spec["mode"] != "nonprivate" and res["physical_batch_size"] < spec["batch_size"]:
        notes.append(f"{-(-spec['batch_size'] // res['physical_batch_size'])} micro-batches")
    return res


def _print_progress(res: dict, spec: dict, elapsed: float, child_s: float) -> None:
    msg = (
        f"median {res['median_step_s']:.3f} s/step, peak RSS {res['peak_rss_gib']:.2f} GiB"
        if "median_step_s" in res
        else res["notes"]
    )
    engine, mode = spec["engine"], spec["mode"]
    print(
        f"[{elapsed:7.1f} s] {spec['model']} B={spec['batch_size']} {mode}"
        f"{f' ({engine})' if engine and engine != mode else ''}: {msg} "
        f"(child {child_s:.1f} s)",
        flush=True,
    )


def _table(rows: list[dict], merge_into: Path | None):
    """The CSV's table: these rows, after the rows of ``merge_into`` (if given and there) for other (model, B,
    mode, engine), every column of :data:`COLUMNS`, with the ratios."""
    import pandas as pd

    df = pd.DataFrame([{k: v for k, v in r.items() if k != "error"} for r in rows])
    if merge_into is not None and merge_into.is_file():
        old = pd.read_csv(merge_into, keep_default_na=False, na_values=[""])
        cols = ["model", "batch_size", "mode", "engine"]
        keys = set(zip(*(df[c] for c in cols), strict=True))
        keep = [k not in keys for k in zip(*(old[c] for c in cols), strict=True)]
        df = pd.concat([old[keep], df], ignore_index=True)
    for c in COLUMNS:
        if c not in df.columns:
            df[c] = float("nan") if c != "notes" else ""
    df["notes"] = df["notes"].fillna("")
    return add_ratios(df)[COLUMNS]


if __name__ == "__main__":
    main()
