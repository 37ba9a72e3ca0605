"""Hugging Face T5's relative position bias (``T5Attention.compute_bias``; Raffel et al. 2020, arXiv:1910.10683,
Sec. 2.1): an ``nn.Embedding`` looked up with one (query, key) table of position buckets shared by the whole batch,
whose (1, heads, q, k) result is added to every example's attention scores. Its input has no batch dimension, so
no layer-wise rule can tell the examples' gradients apart.

While bk records a batch, :func:`install` wraps the instance's ``compute_bias``: it finds the bucket table the
installed transformers version computes (by calling the original with a stand-in for the embedding that returns
zeros and keeps its input), looks the table up through the real embedding expanded to one copy per example (the
Embedding rule then sees (B, q, k) ids), and returns the (B, heads, q, k) bias. The values equal the original's
for every example, checked against the original method on the first call for each (query, key) length (the table
is then kept for later calls); each example's gradient of the embedding is then its own. Outside a recorded batch
the original runs.
"""

from __future__ import annotations

import torch
from torch import nn

from dp_adam_bench.engine.bk_rules.registry import register_adapter


class _Buckets(nn.Module):
    """Stand-in for ``relative_attention_bias`` that keeps the ids it is called with."""

    def __init__(self, real: nn.Embedding):
        super().__init__()
        self.weight = real.weight.detach()
        self.ids: torch.Tensor | None = None

    def forward(self, ids):
        self.ids = ids
        return self.weight.new_zeros(*ids.shape, self.weight.shape[1])


@register_adapter(
    ("transformers", "T5Attention"), ("transformers", "MT5Attention"), ("transformers", "UMT5Attention")
)
def install(engine, name, module):
    if not getattr(module, "has_relative_attention_bias", False) or not hasattr(module, "compute_bias"):
        return None
    original = module.compute_bias
    checked: dict[
        str, torch.Tensor
    ] = {}  # the bucket table of each (q, k, ...) already checked against original

    def buckets(args, kwargs):
        """The bucket table the original computes, and on a first call for these arguments the check that the
        per-example lookup equals the original's bias."""
        key = repr((args, sorted(kwargs.items())))
        if key in checked:
            return checked[key], None
        real = module.relative_attention_bias
        stand_in = _Buckets(real)
        try:
            with engine.not_recording():  # nothing recorded while the original runs
                module.relative_attention_bias = stand_in
                original(*args, **kwargs)
                module.relative_attention_bias = real
                reference = original(*args, **kwargs)  # (1, heads, q, k)
        finally:
            module.relative_attention_bias = real
        checked[key] = stand_in.ids
        return stand_in.ids, reference

    def compute_bias(*args, **kwargs):
        if not engine.recording():
            return original(*args, **kwargs)
        b = engine.batch_size
        ids, reference = buckets(args, kwargs)
        values = module.relative_attention_bias(ids.expand(b, *ids.shape))  # (B, q, k, heads), captured
        bias = values.permute(0, 3, 1, 2)
        if reference is not None and (
            reference.shape != (1, *bias.shape[1:]) or not torch.equal(bias[:1].detach(), reference.detach())
        ):
            checked.clear()
            raise ValueError(
                f"bk clipping: {name!r} ({type(module).__name__}) computes its relative position bias in a way this "
                "version of bk's T5 adapter does not know; freeze relative_attention_bias (requires_grad_(False)) "
                "or use clipping loop"
            )
        return bias

    module.compute_bias = compute_bias

    def undo():
        del module.compute_bias  # the instance attribute: the class method again

    return undo
