"""The book-keeping engine's per-layer rules, one small module per layer family, registered by module type.

A rule turns what the bk engine captured for one layer during one forward and one backward — each call's inputs
``a`` and the gradient ``g`` of the summed loss with respect to the layer's output — into

* the squared norm of every example's gradient of the layer's own parameters, shape (B,), and
* ``finish(c)``: the sum over examples of ``c_i`` times that gradient, one tensor per parameter (the clipped sum
  once ``c_i = min(1, C / ||g_i||)`` is known from all layers' norms).

A rule is exact for every configuration it accepts; a configuration it cannot compute exactly is refused by its
``refuse`` function, which names what is wrong. Every rule is tested against the loop over batches of size one in
``tests/test_conformance.py``.

* :mod:`.linear`: ``nn.Linear`` (inputs of any rank) and transformers' GPT-2 ``Conv1D``;
* :mod:`.conv`: ``nn.Conv1d`` / ``Conv2d`` / ``Conv3d`` with any stride, padding (``same`` / ``valid``), dilation,
  groups and padding mode;
* :mod:`.embedding`: ``nn.Embedding`` (``padding_idx``), transformers' ``*ScaledWordEmbedding`` (BART, Gemma, ...:
  the lookup times ``embed_scale``) and ``nn.EmbeddingBag`` (2-D ids; ``sum`` / ``mean``; per-sample weights);
* :mod:`.norms`: ``nn.LayerNorm``, ``nn.RMSNorm``, ``nn.GroupNorm``, ``nn.InstanceNorm1d/2d/3d``;
* :mod:`.attention`: ``nn.MultiheadAttention`` (packed or separate in-projections, ``add_bias_kv``,
  ``add_zero_attn``, masks, either layout).

A parameter several layers use in one forward (tied weights) is combined across them by :mod:`.shared` from what
each rule hands in (``shares=True`` at registration): Linear, Embedding, the norms and the generic rule do.

Adding a layer: write ``compute(engine, layer, calls, b) -> (sq, finish)`` in a module here, decorate it with
:func:`register`, import the module below, and add the layer's configurations to the conformance suite.
"""

from dp_adam_bench.engine.bk_rules import attention, conv, embedding, linear, norms, t5  # noqa: F401  (register)
from dp_adam_bench.engine.bk_rules.registry import (
    Rule,
    adapter_for,
    register,
    register_adapter,
    rule_for,
    supported_types,
)

__all__ = ["Rule", "adapter_for", "register", "register_adapter", "rule_for", "supported_types"]
