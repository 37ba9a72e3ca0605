"""Sequence-to-sequence fine-tuning from the tokenizer's own batch: ``input_ids``, ``attention_mask``, ``labels``.

An encoder-decoder (T5, BART, Marian, Pegasus: ``config.is_encoder_decoder``) trained with teacher forcing reads
the target twice: its decoder is fed the labels shifted one position right (``decoder_input_ids``, the decoder's
start token first), and the loss compares its logits with the labels. Hugging Face models build the shifted ids
inside their own forward when they are given ``labels``; the engines do not give them the labels (the per-example
loss is the user's ``loss_fn(output, labels)`` or the task's, so that it is one value per example), and the decoder
would get no input ("You must specify exactly one of input_ids or inputs_embeds").

:func:`with_decoder_inputs` builds ``decoder_input_ids`` from the labels as the model itself would, with its own
``prepare_decoder_input_ids_from_labels`` (T5's ``_shift_right``, BART's ``shift_tokens_right``: ``-100`` becomes
the pad id), or, for a model without that method, transformers' ``shift_tokens_right`` with its config's
``decoder_start_token_id`` and ``pad_token_id``. Each example's decoder inputs are its own labels shifted, so
per-example gradients stay per example. Labels that are not token ids per position (a classifier's (B,) labels;
``BartForSequenceClassification`` feeds its decoder from ``input_ids`` itself), or a batch that already has
decoder inputs, are left alone.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from dp_adam_bench.errors import ConfigError

#: the batch keys that already feed an encoder-decoder's decoder
DECODER_KEYS = ("decoder_input_ids", "decoder_inputs_embeds")
IGNORE_INDEX = -100


def _base(model: nn.Module) -> nn.Module:
    """The model whose config and methods say how its decoder is fed (a PEFT model's base model)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def needs_decoder_inputs(model: nn.Module, inputs: Mapping, labels) -> bool:
    """Whether ``model`` is an encoder-decoder whose batch ``inputs`` has no decoder inputs while ``labels`` are
    token ids per position (B, T)."""
    config = getattr(_base(model), "config", None)
    return bool(
        getattr(config, "is_encoder_decoder", False)
        and not any(k in inputs for k in DECODER_KEYS)
        and isinstance(labels, torch.Tensor)
        and labels.dim() == 2
        and not labels.is_floating_point()
    )


def decoder_input_ids(model: nn.Module, labels: torch.Tensor) -> torch.Tensor:
    """The ``decoder_input_ids`` ``model`` builds from ``labels`` in its own forward (module docstring)."""
    base = _base(model)
    prepare = getattr(base, "prepare_decoder_input_ids_from_labels", None)
    if prepare is not None:
        return prepare(labels=labels)
    config = base.config
    start = getattr(config, "decoder_start_token_id", None)
    pad = getattr(config, "pad_token_id", None)
    if start is None or pad is None:
        raise ConfigError(
            f"{type(base).__name__} is an encoder-decoder whose batch has labels but no decoder_input_ids, and its "
            "config has no decoder_start_token_id / pad_token_id to shift the labels with: set them in the config "
            "or put decoder_input_ids in the batch"
        )
    # transformers' own shift (BART's module holds the generic one that Marian, Pegasus and mBART copy)
    from transformers.models.bart.modeling_bart import shift_tokens_right

    return shift_tokens_right(labels, int(pad), int(start))


def with_decoder_inputs(model: nn.Module, inputs: dict, labels) -> dict:
    """``inputs`` with ``decoder_input_ids`` built from ``labels`` where ``model`` needs them
    (:func:`needs_decoder_inputs`), else ``inputs`` unchanged."""
    if not needs_decoder_inputs(model, inputs, labels):
        return inputs
    return {**inputs, "decoder_input_ids": decoder_input_ids(model, labels)}
