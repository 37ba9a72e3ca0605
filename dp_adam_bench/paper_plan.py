"""``dp-adam-bench sweep <experiment> --profile paper --plan``: what each paper table costs, before anything runs.

Per table: the runs, the steps and examples per step of each, epsilon under every accountant, the trainable
parameters, an estimate of the peak memory per GPU and of the GPU-hours. Nothing is loaded from the hub: the
training-set sizes are the published ones (:data:`PAPER_EXAMPLES`), the models are built from their published
configurations on the ``meta`` device (shapes only), with the task modules' own surgery.

Estimates, stated as such:

* FLOPs of a training step: ``6 x (forward FLOPs per token / 2) x tokens`` for the trained part and ``2 x`` for the
  frozen part below it, i.e. forward 2 FLOPs per parameter per token plus a backward of twice that where gradients
  flow (Kaplan et al. 2020, "Scaling laws for neural language models", arXiv:2001.08361, §2.1), plus attention
  ``2 n_layer T d`` per token; times the clipping engine's overhead (:data:`CLIPPING_OVERHEAD`: book-keeping adds
  the per-example norms to one backward, Bu et al. 2023, arXiv:2210.00038; ghost clipping runs a second backward,
  Li et al. 2022, arXiv:2110.05679 §4). Convolutions: 2 x kernel MACs per output.
* GPU-hours: FLOPs / (device throughput x utilisation), :data:`DEVICE`.
* Peak memory per GPU (one process): float32 weights, gradients, the clipped sum, the optimizer's moments and the
  noise mechanism's buffers for the trained coordinates, plus the activations of one physical micro-batch (the
  ``34 T d + 5 a T^2`` bytes per layer and sequence of Korthikanti et al. 2022, arXiv:2205.05198, eq. 2, doubled
  for float32) and its logits.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

#: Training examples the paper-profile runs sample from (the data loaders keep these many).
#: CIFAR-10 train: 50,000 (Krizhevsky 2009). SNLI train: 550,152 pairs of which 785 have no gold label and are
#: dropped (Bowman et al. 2015), 549,367. E2E train: 42,061 pairs (Novikova et al. 2017). arXiv abstracts: the
#: preset's train_subset (666 x 2,048, Ganesh et al. §5.2).
#: dialog: the utterances of Persona-Chat's train split (configs/experiment/li_dialog.yaml, delta = 1 / (2N))
PAPER_EXAMPLES = {"cifar10_cnn": 50_000, "snli_bert": 549_367, "e2e_gpt2": 42_061, "dialog": 131_438}

#: Device the GPU-hours assume: an NVIDIA A100 (80 GB) in float32 without TF32 (PyTorch's default for matmuls),
#: 19.5 TFLOP/s peak, at 40 % utilisation.
DEVICE = {"name": "A100-80GB fp32", "tflops": 19.5, "utilisation": 0.4, "memory_gb": 80}

#: backward-pass cost of each clipping engine relative to a non-private backward
CLIPPING_OVERHEAD = {"bk": 1.1, "ghost": 2.0, "hooks": 1.5, "functorch": 1.5, "loop": 1.0}


def paper_examples(data: dict) -> int | None:
    """The number of training examples the paper's run samples from (None for tasks without one)."""
    task = data.get("task") or {}
    if task.get("train_subset") is not None:
        return int(task["train_subset"])
    if task.get("name") == "glue_sst2":  # each GLUE task's own training set
        from dp_adam_bench.tasks.glue import SPECS

        return SPECS[str(task.get("glue") or "sst2")].train_size
    return PAPER_EXAMPLES.get(task.get("name"))


#: padded tokens per example the FLOP and memory estimates assume, when batches are padded to their longest row:
#: E2E pairs have at most 121 GPT-2 tokens (Li et al.), SNLI pairs about 40-60 word pieces at the longest in a batch
PADDED_TOKENS = {"e2e_gpt2": 100, "snli_bert": 64, "glue_sst2": 64}


@dataclass
class ModelShape:
    """What the estimates need of a model: parameters (all, trained, of embeddings), layers, width, heads,
    vocabulary, tokens per example; for a CNN the forward FLOPs and activation floats per example."""

    total: int
    trainable: int
    embedding: int = 0
    layers: int = 0
    width: int = 0
    heads: int = 0
    vocab: int = 0
    tokens: int = 1
    trained_layers: int = 0
    cnn_flops: float = 0.0
    cnn_activations: float = 0.0


def _count(model, trainable_only=False) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def model_shape(data: dict) -> ModelShape:
    """The paper model of the run's task, built on the ``meta`` device from its published configuration, with
    the task module's surgery (untied heads, frozen layers)."""
    import torch

    task = data["task"]
    if task["name"] == "cifar10_cnn":
        return _cnn_shape()
    with torch.device("meta"):
        if task["name"] == "e2e_gpt2":
            return _gpt2_shape(task)
        return _bert_shape(task)


def _finetuned(model, task: dict):
    """The model with ``task.finetune`` applied (:mod:`dp_adam_bench.finetune`): what the run trains."""
    from dp_adam_bench import finetune

    return finetune.apply(model, task.get("finetune"), task.get("finetune_args") or {}).model


def _cnn_shape() -> ModelShape:
    """The CNN's parameters, and its forward FLOPs and activation floats per example, counted by hooks on one
    forward pass of a 32 x 32 image (Conv2d: 2 x kernel MACs per output; Linear: 2 x in x out)."""
    import torch

    from dp_adam_bench.tasks.cifar10_cnn import CNN5

    model = CNN5()
    flops, acts = [0.0], [0.0]

    def hook(m, inp, out):
        acts[0] += out.numel()
        if isinstance(m, torch.nn.Conv2d):
            k = m.kernel_size[0] * m.kernel_size[1] * m.in_channels // m.groups
            flops[0] += 2.0 * k * out.numel()
        elif isinstance(m, torch.nn.Linear):
            flops[0] += 2.0 * m.in_features * m.out_features

    handles = [m.register_forward_hook(hook) for m in model.modules() if not list(m.children())]
    with torch.no_grad():
        model(torch.zeros(1, 3, 32, 32))
    for h in handles:
        h.remove()
    n = _count(model)
    return ModelShape(n, n, cnn_flops=flops[0], cnn_activations=acts[0])


def _gpt2_shape(task: dict) -> ModelShape:
    """GPT-2 (124M: 12 layers, width 768, 12 heads) with its output layer untied, as e2e_gpt2 trains it, and its
    ``task.finetune``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from dp_adam_bench.tasks.e2e_gpt2 import GPT2AtTargets, untie_lm_head

    cfg = GPT2Config(tie_word_embeddings=False)
    lm = GPT2LMHeadModel(cfg)
    untie_lm_head(lm)
    lm = _finetuned(GPT2AtTargets(lm), task)
    emb = cfg.vocab_size * cfg.n_embd + cfg.n_positions * cfg.n_embd
    return ModelShape(
        _count(lm),
        _count(lm, True),
        emb,
        cfg.n_layer,
        cfg.n_embd,
        cfg.n_head,
        cfg.vocab_size,
        PADDED_TOKENS["e2e_gpt2"],
        cfg.n_layer,
    )


def _bert_shape(task: dict) -> ModelShape:
    """The BERT of snli_bert or arxiv_mlm (the RoBERTa of glue_sst2), prepared for DP as the task prepares it."""
    from dp_adam_bench.tasks import text

    if task["name"] == "snli_bert":
        model, cfg, trained, tokens = _snli_model(task)
    elif task["name"] == "glue_sst2":
        model, cfg, trained, tokens = _glue_model(task)
    else:  # arxiv_mlm
        model, cfg, trained, tokens = _arxiv_mlm_model(task)
    text.prepare_bert_for_dp(model, untie=bool(task.get("untie_embeddings", True)))
    model = _finetuned(model, task)
    emb = (cfg.vocab_size + cfg.max_position_embeddings + cfg.type_vocab_size) * cfg.hidden_size
    return ModelShape(
        _count(model),
        _count(model, True),
        emb,
        cfg.num_hidden_layers,
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.vocab_size,
        tokens,
        trained,
    )


def _snli_model(task: dict):
    """(model, config, trained layers, tokens per example) of snli_bert: bert-base-cased (12 layers, width 768,
    12 heads) with every layer but its head frozen unless ``freeze_pretrained`` is false."""
    from transformers import BertConfig, BertForSequenceClassification

    from dp_adam_bench.tasks.snli_bert import SnliBert

    cfg = BertConfig(vocab_size=28996, num_labels=3)
    model = BertForSequenceClassification(cfg)
    if task.get("freeze_pretrained", True):
        for p in model.parameters():
            p.requires_grad_(False)
        for m in SnliBert.head_modules(model):
            for p in m.parameters():
                p.requires_grad_(True)
    trained = 1 if task.get("freeze_pretrained", True) else cfg.num_hidden_layers
    tokens = PADDED_TOKENS["snli_bert"] if task.get("pad_to") == "longest" else int(task["max_length"])
    return model, cfg, trained, tokens


#: RoBERTa's published configurations (Liu et al. 2019): what a glue_sst2 paper run fine-tunes
ROBERTA = {
    "roberta-base": dict(
        hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072
    ),
    "roberta-large": dict(
        hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096
    ),
}


def _glue_model(task: dict):
    """(model, config, trained layers, tokens per example) of glue_sst2's paper model (roberta-base unless
    ``task.model`` names roberta-large): every layer trained, the classifier head or the masked-LM head."""
    from transformers import RobertaConfig, RobertaForMaskedLM, RobertaForSequenceClassification

    from dp_adam_bench.tasks.glue import PAPER_MODEL, SPECS

    name = str(task.get("model") or PAPER_MODEL)
    if name not in ROBERTA:
        raise ValueError(f"the plan knows the paper's models {', '.join(ROBERTA)}, not task.model={name!r}")
    classes = len(SPECS[str(task.get("glue") or "sst2")].labels)
    cfg = RobertaConfig(
        vocab_size=50265, max_position_embeddings=514, type_vocab_size=1, pad_token_id=1, num_labels=classes,
        **ROBERTA[name],
    )  # fmt: skip
    infilling = task.get("objective") == "infilling"
    model = RobertaForMaskedLM(cfg) if infilling else RobertaForSequenceClassification(cfg)
    tokens = (
        PADDED_TOKENS["glue_sst2"] if task.get("pad_to", "longest") == "longest" else int(task["max_length"])
    )
    return model, cfg, cfg.num_hidden_layers, tokens


def _arxiv_mlm_model(task: dict):
    """(model, config, trained layers, tokens per example) of arxiv_mlm: every layer trained."""
    from transformers import BertForMaskedLM

    cfg = arxiv_mlm_config(task)
    return BertForMaskedLM(cfg), cfg, cfg.num_hidden_layers, int(task["max_length"])


def arxiv_mlm_config(task: dict):
    """The BERT configuration an arxiv_mlm run trains: its ``task.pretrain`` preset's encoder (the cpu profile:
    MiniLM-L6-H384 from the [minilm] extra, 6 layers, width 384, 12 heads), else a local ``task.model`` folder's
    ``config.json``, else prajjwal1/bert-tiny (Turc et al. 2019: 2 layers, width 128, 2 heads), the paper's.
    Only configurations are read, never weights."""
    from transformers import BertConfig

    if task.get("pretrain"):
        from dp_adam_bench.pretrain import load_spec
        from dp_adam_bench.pretrain.mlm_head import base_folder

        folder = base_folder(load_spec(task["pretrain"], dict(task.get("pretrain_overrides") or {})))
        return BertConfig.from_pretrained(folder)
    model = task.get("model")
    if model and (Path(model) / "config.json").is_file():
        return BertConfig.from_pretrained(model)
    return BertConfig(
        vocab_size=30522, hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512
    )


def step_flops(shape: ModelShape, batch: float, clipping: str) -> float:
    """Estimated FLOPs of one training step of ``batch`` examples (module docstring)."""
    over = CLIPPING_OVERHEAD.get(clipping, 1.5)
    if shape.cnn_flops:
        return batch * shape.cnn_flops * (1 + 2 * over)
    t, d, layers = shape.tokens, shape.width, shape.layers
    dense = shape.total - shape.embedding
    fwd = 2.0 * dense * t + 2.0 * layers * t * t * d
    trained_dense = min(dense, shape.trainable)
    bwd = 2.0 * (2.0 * trained_dense * t + 2.0 * shape.trained_layers * t * t * d) * over
    return batch * (fwd + bwd)


def peak_memory_gb(shape: ModelShape, physical_batch: int, state_floats: float) -> float:
    """float32 weights + ``state_floats`` per trained coordinate + one micro-batch's activations and logits."""
    weights = 4.0 * shape.total + 4.0 * state_floats * shape.trainable
    if shape.cnn_flops:
        acts = physical_batch * shape.cnn_activations * 4.0 * 2
    else:
        t = shape.tokens
        per_layer = t * (34.0 * shape.width + 5.0 * shape.heads * t) * 2  # fp32: twice the fp16 bytes
        acts = physical_batch * (shape.layers * per_layer + 2 * 4.0 * t * shape.vocab)
    return (weights + acts) / 2**30


def smoke_points(experiment: str, profile: str) -> list[dict]:
    """The preset's runs (``SweepSpec.points``) up to seed and tuned values: the first of each group."""
    from dp_adam_bench.sweep import sweep_spec

    spec = sweep_spec(experiment, profile)
    ignored = {"seed", *(spec.selection.tuned if spec.selection else ())}
    out, seen = [], set()
    for point in spec.points():
        key = json.dumps({k: v for k, v in point.items() if k not in ignored}, sort_keys=True, default=str)
        if key not in seen:
            seen.add(key)
            out.append(point)
    return out


def compose_run(experiment: str, profile: str, point: dict, overrides=()) -> dict:
    """The run config of one sweep point, as the training entry point resolves it."""
    from hydra import compose, initialize_config_dir

    from dp_adam_bench.paths import CONFIG_DIR
    from dp_adam_bench.sweep import override_value
    from dp_adam_bench.train import run_config

    args = [f"experiment={experiment}", f"profile={profile}"]
    args += [f"{k}={override_value(v)}" for k, v in point.items()] + list(overrides)
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return run_config(compose("config", overrides=args))


@dataclass
class RunPlan:
    """One group of runs that differ only in seed or tuned values (the same cost and epsilon)."""

    label: str
    runs: int
    steps: int
    batch_size: float
    examples: int
    sampler: str
    sigma: float
    epsilon: dict
    trainable: int
    total: int
    memory_gb: float
    gpu_hours: float  # of all ``runs``


def _state_floats(data: dict, variant, plan) -> float:
    """Per trained coordinate, besides the weight: the gradient, the clipped sum, the optimizer's state tensors
    and the noise mechanism's buffers."""
    n_state = (
        2.0 if "adam" in variant.name or variant.name in ("ime", "bc", "stp", "noiseless_precond") else 1.0
    )
    noise = 0.0
    if plan.noisy and plan.strategy is not None:
        noise = plan.strategy.mechanism().buffer_floats(1) * variant.releases().streams
    return 2.0 + n_state + noise


def table_plan(experiment: str, profile: str = "paper", overrides=()) -> list[RunPlan]:
    """The :class:`RunPlan` of every group of runs of the preset."""
    from omegaconf import OmegaConf

    from dp_adam_bench.engine.plan import build_plan
    from dp_adam_bench.optim.registry import build_variant
    from dp_adam_bench.sweep import sweep_spec

    spec = sweep_spec(experiment, profile)
    ignored = {"seed", *(spec.selection.tuned if spec.selection else ())}
    counts: dict[str, int] = {}
    for point in spec.points():
        key = json.dumps({k: v for k, v in point.items() if k not in ignored}, sort_keys=True, default=str)
        counts[key] = counts.get(key, 0) + 1
    out = []
    for point in smoke_points(experiment, profile):
        key = json.dumps({k: v for k, v in point.items() if k not in ignored}, sort_keys=True, default=str)
        data = compose_run(experiment, profile, point, overrides)
        cfg = OmegaConf.create(data)
        variant = build_variant(cfg.optimizer.name, **{k: v for k, v in cfg.optimizer.items() if k != "name"})
        n = paper_examples(data)
        shape = None
        if n is None:  # a closed-form toy task: cheap to build, its size is its own
            from dp_adam_bench.tasks.registry import build_task

            task = build_task(cfg.task, trials=int(cfg.task.get("trials", 1)), seed=int(cfg.seed))
            n, numel = task.dataset_size, int(task.numel) if hasattr(task, "numel") else 1
        else:
            shape = model_shape(data)
            numel = shape.trainable
        plan = build_plan(cfg, n, variant, numel=numel, sampler_seed=0)
        eps = plan.ledger_after().epsilons_with_errors(plan.delta)[0] if plan.noisy else {}
        batch = float(cfg.train.batch_size)
        label = " ".join(f"{k}={v}" for k, v in point.items() if k not in ignored)
        if shape is not None:
            mem = peak_memory_gb(
                shape, int(cfg.train.physical_batch_size), _state_floats(data, variant, plan)
            )
            hours = counts[key] * plan.steps * step_flops(shape, batch, str(cfg.train.clipping))
            hours /= DEVICE["tflops"] * 1e12 * DEVICE["utilisation"] * 3600
            trainable, total = shape.trainable, shape.total
        else:
            mem, hours, trainable, total = 0.0, 0.0, numel, numel
        out.append(
            RunPlan(
                label,
                counts[key],
                plan.steps,
                batch,
                n,
                cfg.train.sampler,
                plan.sigma,
                eps,
                trainable,
                total,
                mem,
                hours,
            )
        )
    return out


def format_plan(plans: list[RunPlan], experiment: str = "") -> str:
    """The plan as a Markdown table with its totals and the device assumption."""
    accountants = sorted({a for p in plans for a in p.epsilon})
    head = [
        "runs",
        "setting",
        "sampler",
        "N",
        "B",
        "steps",
        "sigma",
        *[f"eps {a}" for a in accountants],
        "trainable",
        "params",
        "peak GB/GPU",
        "GPU-h",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in plans:
        eps = [
            f"{p.epsilon[a]:.3g}" if math.isfinite(p.epsilon.get(a, math.nan)) else "-" for a in accountants
        ]
        lines.append(
            "| "
            + " | ".join(
                [
                    str(p.runs),
                    p.label,
                    p.sampler,
                    f"{p.examples:,}",
                    f"{p.batch_size:g}",
                    str(p.steps),
                    f"{p.sigma:.4g}",
                    *eps,
                    f"{p.trainable:,}",
                    f"{p.total:,}",
                    f"{p.memory_gb:.2f}",
                    f"{p.gpu_hours:.3g}",
                ]
            )
            + " |"
        )
    runs = sum(p.runs for p in plans)
    hours = sum(p.gpu_hours for p in plans)
    lines.append(
        f"\n{experiment + ': ' if experiment else ''}{runs} runs, {hours:.3g} GPU-hours in all, assuming "
        f"{DEVICE['name']} at {DEVICE['tflops']:g} TFLOP/s x {DEVICE['utilisation']:.0%} utilisation; peak memory "
        f"for one process (float32, physical micro-batch); epsilon at delta of the preset over the whole run "
        "(gdp_clt is an approximation, not a bound)."
    )
    return "\n".join(lines)
