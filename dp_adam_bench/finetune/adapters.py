"""LoRA and prefix-tuning, from peft (Hugging Face's implementations; none of ours).

* ``lora`` (Hu et al. 2021, arXiv 2106.09685): ``peft.inject_adapter_in_model`` puts a rank-r update
  B A x (alpha / r) beside each target linear layer, B = 0 at the start. Targets by default: GPT-2's fused query-key-
  value projection ``c_attn``, as Li et al.'s code does (private-transformers' ``convert_gpt2_attention_to_lora``);
  BERT / RoBERTa's ``query`` and ``value``, ``q_proj`` / ``v_proj`` in models that name them so (Llama, OPT,
  BART), DistilBERT's ``q_lin`` / ``v_lin`` and T5's ``q`` / ``v`` (Hu et al.'s choice of W_q and W_v). Settings
  (``task.finetune_args``): ``r``, ``alpha``, ``dropout``, ``targets``. Defaults: Hu et al.'s hyper-parameters in
  their appendix, GPT-2 on E2E: r = 4, alpha = 32, dropout 0.1; RoBERTa-base on GLUE: r = 8, alpha = 8, dropout
  0.1. Li et al. do not print theirs.
* ``prefix`` (Li & Liang 2021, arXiv 2101.00190): ``peft.get_peft_model`` with ``PrefixTuningConfig``: a prefix of
  ``length`` virtual tokens, reparametrized by an MLP of width ``mid_dim`` (``prefix_projection``), gives every
  layer's keys and values (Li et al.'s ``PrefixTuner`` in private-transformers builds the same net). Defaults: 10
  tokens (Li & Liang: table-to-text performance levels off at 10) and width 512 (their code's default). peft
  supports it on decoder-only and encoder-decoder models; an encoder (BERT) is refused by peft, in one line here.

Per-example gradients: LoRA's factors are ``nn.Linear`` layers and the prefix net an ``nn.Embedding`` of the
virtual-token ids expanded over the batch and two ``nn.Linear``, so every engine's rule for those layers applies;
each example's prefix is its own rows of the expanded input, and the engine probe checks that nothing is missed.
"""

from __future__ import annotations

import warnings

from torch import nn

from dp_adam_bench.errors import ConfigError
from dp_adam_bench.finetune.common import (
    Finetuned,
    float_arg,
    freeze_all_but,
    int_arg,
    is_task_head,
    refuse_unknown,
)

#: (a module name the model has, LoRA's default targets, r, alpha)
LORA_FAMILIES = (
    ("c_attn", ["c_attn"], 4, 32.0),
    ("query", ["query", "value"], 8, 8.0),
    ("q_proj", ["q_proj", "v_proj"], 8, 8.0),
    ("q_lin", ["q_lin", "v_lin"], 8, 8.0),  # DistilBERT
    ("q", ["q", "v"], 8, 8.0),  # T5, mT5
)
LORA_DROPOUT = 0.1
PREFIX_LENGTH = 10
PREFIX_MID_DIM = 512


def lora(model: nn.Module, args: dict) -> Finetuned:
    import peft

    refuse_unknown(args, ("r", "alpha", "dropout", "targets"), "lora")
    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    family = next((f for f in LORA_FAMILIES if f[0] in names), None)
    targets = args.get("targets")
    if targets is None:
        if family is None:
            raise ConfigError(
                f"task.finetune=lora: no default target layers for {type(model).__name__} (none named "
                f"{', '.join(f[0] for f in LORA_FAMILIES)}); set task.finetune_args.targets=[<module names>]"
            )
        targets = family[1]
    targets = [str(t) for t in targets]
    missing = [t for t in targets if t not in names]
    if missing:
        raise ConfigError(
            f"task.finetune_args.targets: {type(model).__name__} has no module named {missing[0]!r}"
        )
    r = int_arg(args, "r", family[2] if family else 8, "lora")
    alpha = float_arg(args, "alpha", family[3] if family else float(r), "lora", low=1e-12)
    dropout = float_arg(args, "dropout", LORA_DROPOUT, "lora", high=1.0)
    config = peft.LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, bias="none")
    with warnings.catch_warnings():  # GPT-2's Conv1D: peft sets fan_in_fan_out itself and says so
        warnings.filterwarnings("ignore", message="fan_in_fan_out")
        peft.inject_adapter_in_model(config, model)
    freeze_all_but(model, lambda n: "lora_" in n or is_task_head(n))
    layers = sum(1 for n, _ in model.named_modules() if n.rsplit(".", 1)[-1] in targets)
    return Finetuned(
        model, {"r": r, "alpha": alpha, "dropout": dropout, "targets": targets, "layers": layers}
    )


def prefix(model: nn.Module, args: dict) -> Finetuned:
    import peft

    refuse_unknown(args, ("length", "mid_dim"), "prefix")
    length = int_arg(args, "length", PREFIX_LENGTH, "prefix")
    mid = int_arg(args, "mid_dim", PREFIX_MID_DIM, "prefix")
    parent, attr, lm = _language_model(model)
    config = peft.PrefixTuningConfig(
        task_type="SEQ_2_SEQ_LM" if getattr(lm.config, "is_encoder_decoder", False) else "CAUSAL_LM",
        num_virtual_tokens=length,
        prefix_projection=True,
        encoder_hidden_size=mid,
    )
    try:
        wrapped = peft.get_peft_model(lm, config)
    except Exception as err:  # noqa: BLE001 - peft's refusal of an architecture, in one line
        raise ConfigError(
            f"task.finetune=prefix: peft cannot prefix-tune {type(lm).__name__} "
            f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); use lora or top<k>"
        ) from err
    if parent is None:
        model = wrapped
    else:
        setattr(parent, attr, wrapped)
    freeze_all_but(model, lambda n: "prompt_encoder" in n or is_task_head(n))
    # peft feeds the prefix embedding expanded (strided) ids, which Opacus' ghost rule views: make them contiguous
    for m in wrapped.prompt_encoder.modules():
        if isinstance(m, nn.Embedding):
            m.register_forward_pre_hook(lambda _m, inputs: (inputs[0].contiguous(), *inputs[1:]))
    return Finetuned(model, {"length": length, "mid_dim": mid})


def prefix_length(lm: nn.Module) -> int:
    """The number of virtual tokens of a prefix-tuned peft model, 0 for any other model."""
    import peft

    if not isinstance(lm, peft.PeftModel):
        return 0
    config = lm.peft_config[lm.active_adapter]
    return int(config.num_virtual_tokens) if config.peft_type == peft.PeftType.PREFIX_TUNING else 0


def _language_model(model: nn.Module):
    """(parent, attribute, the Hugging Face model) — the model itself (parent None) or its first submodule that is
    a ``transformers.PreTrainedModel`` (a task's wrapper such as e2e_gpt2's ``GPT2AtTargets.lm``)."""
    from transformers import PreTrainedModel

    if isinstance(model, PreTrainedModel):
        return None, None, model
    for parent in model.modules():
        for attr, child in parent.named_children():
            if isinstance(child, PreTrainedModel):
                return parent, attr, child
    raise ConfigError(
        f"task.finetune=prefix: {type(model).__name__} holds no Hugging Face model (transformers.PreTrainedModel) "
        "to prefix-tune"
    )
