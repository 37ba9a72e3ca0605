"""The layer configurations of the engine conformance suite (tests/test_conformance.py), as data.

Each :class:`Case` builds one layer (seeded), says how the probe model calls it and what inputs a batch holds, and
whether a per-example gradient exists at all (``undefined``). The grid follows the configurations Opacus' own
grad-sampler tests parametrise over (convolutions with strides, paddings incl. ``same`` / ``valid``, dilations,
groups, bias, every ``padding_mode``; Linear on 2-D to 4-D inputs; embeddings with ``padding_idx`` /
``scale_grad_by_freq``; EmbeddingBag; the norm layers; GPT-2's ``Conv1D``; attention), plus the layers a
transformer user's model holds (``nn.MultiheadAttention`` in its configurations, ``nn.TransformerEncoderLayer`` /
``nn.TransformerEncoder``, Opacus' ``DPMultiheadAttention``) and module reuse and frozen parameters. ``FOLDED``: layers
on a batch folded into rows whose arrangement depends on the data (tests/test_fold_layouts.py).

Inputs hold padding tokens and repeated ids on purpose: those are where rules go wrong.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

B = 5  # examples per batch; sequence lengths differ from B, so a sequence-first input cannot pass for batch-first
T = 4


@dataclass
class Case:
    id: str
    make: Callable[[], nn.Module]  # the layer (called under a fixed seed)
    inputs: Callable[
        [torch.Generator], dict
    ]  # float inputs in float64 on the CPU; cast and moved by the suite
    call: Callable = None  # call(layer, **inputs) -> output tensor; default layer(x)
    undefined: bool = False  # no per-example gradient exists: every engine must refuse
    bk_refuses: bool = False  # bk has no exact rule for this configuration and must say so
    tags: set = field(default_factory=set)


def _x(*shape):
    return lambda g: {"x": torch.randn(B, *shape, generator=g, dtype=torch.float64)}


def _ids(vocab, length=T, pad=None):
    def make(g):
        ids = torch.randint(1, vocab, (B, length), generator=g)
        ids[0, 1] = ids[0, 2]  # a repeated id in one example
        if pad is not None:
            ids[1, 0] = pad  # a padding token in the batch
            ids[2, -1] = pad
        return {"ids": ids}

    return make


def _default_call(layer, x=None, ids=None, **kw):
    return layer(x if x is not None else ids, **kw)


# ------------------------------------------------------------------------------------------------ convolutions

_GEOMETRIES = {
    "plain": dict(kernel_size=3),
    "stride2_pad1": dict(kernel_size=3, stride=2, padding=1),
    "same_dil2_even": dict(kernel_size=2, padding="same", dilation=2),
    "valid": dict(kernel_size=2, padding="valid"),
    "groups2_nobias": dict(kernel_size=3, padding=1, groups=2, bias=False),
    "depthwise_dil2": dict(kernel_size=3, padding=2, dilation=2, groups=4),
}
_SPATIAL = {1: (9,), 2: (7, 6), 3: (5, 5, 4)}
_CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}


def _conv_cases():
    for dim, (geo, kw), mode in itertools.product(
        (1, 2, 3), _GEOMETRIES.items(), ("zeros", "reflect", "replicate", "circular")
    ):
        kw = dict(kw)
        if mode != "zeros" and kw.get("padding", 0) in (0, "valid"):
            kw["padding"] = 1  # a padding mode needs padding to matter
        out = 8 if kw.get("groups") == 4 else 6

        def make(dim=dim, kw=kw, mode=mode, out=out):
            return _CONV[dim](4, out, padding_mode=mode, **kw)

        yield Case(f"conv{dim}d-{geo}-{mode}", make, _x(4, *_SPATIAL[dim]), tags={"conv"})
    yield Case(
        "conv2d-asymmetric",
        lambda: nn.Conv2d(3, 4, (2, 3), stride=(2, 1), padding=(1, 0), dilation=(1, 2)),
        _x(3, 7, 8),
        tags={"conv"},
    )


# ------------------------------------------------------------------------------------------------ linear, Conv1D


def _linear_cases():
    for rank, shape in ((2, (6,)), (3, (T, 6)), (4, (3, T, 6))):
        for bias in (True, False):
            yield Case(
                f"linear-{rank}d-bias{int(bias)}", lambda bias=bias: nn.Linear(6, 5, bias=bias), _x(*shape)
            )

    def gpt2_conv1d():
        from transformers.pytorch_utils import Conv1D

        layer = Conv1D(5, 6)
        nn.init.normal_(layer.bias)  # GPT-2 initialises it to zeros
        return layer

    yield Case("gpt2-conv1d-3d", gpt2_conv1d, _x(T, 6), tags={"transformers"})
    yield Case("gpt2-conv1d-2d", gpt2_conv1d, _x(6), tags={"transformers"})


# ------------------------------------------------------------------------------------------------ embeddings


def _bag_call(layer, ids, w=None):
    return layer(ids, per_sample_weights=w) if w is not None else layer(ids)


def _embedding_cases():
    yield Case("embedding", lambda: nn.Embedding(7, 3), _ids(7))
    yield Case("embedding-padding_idx", lambda: nn.Embedding(7, 3, padding_idx=0), _ids(7, pad=0))
    yield Case("embedding-padding_idx-mid", lambda: nn.Embedding(7, 3, padding_idx=3), _ids(7, pad=3))
    yield Case(
        "embedding-scale_grad_by_freq",
        lambda: nn.Embedding(7, 3, scale_grad_by_freq=True),
        _ids(7),
        undefined=True,
    )
    yield Case("embedding-max_norm", lambda: nn.Embedding(7, 3, max_norm=0.5), _ids(7), undefined=True)
    yield Case("embedding-sparse", lambda: nn.Embedding(7, 3, sparse=True), _ids(7), undefined=True)
    yield Case("embedding_bag-sum", lambda: nn.EmbeddingBag(7, 3, mode="sum"), _ids(7, 5), _bag_call)
    yield Case("embedding_bag-mean", lambda: nn.EmbeddingBag(7, 3, mode="mean"), _ids(7, 5), _bag_call)
    yield Case(
        "embedding_bag-mean-padding_idx",
        lambda: nn.EmbeddingBag(7, 3, mode="mean", padding_idx=0),
        _ids(7, 5, pad=0),
        _bag_call,
    )

    def weighted_ids(g):
        return _ids(7, 5)(g) | {"w": torch.rand(B, 5, generator=g, dtype=torch.float64)}

    yield Case(
        "embedding_bag-sum-per_sample_weights",
        lambda: nn.EmbeddingBag(7, 3, mode="sum"),
        weighted_ids,
        _bag_call,
    )
    yield Case(
        "embedding_bag-max", lambda: nn.EmbeddingBag(7, 3, mode="max"), _ids(7, 5), _bag_call, bk_refuses=True
    )
    yield Case(
        "embedding_bag-scale_grad_by_freq",
        lambda: nn.EmbeddingBag(7, 3, mode="sum", scale_grad_by_freq=True),
        _ids(7, 5),
        _bag_call,
        undefined=True,
    )


# ------------------------------------------------------------------------------------------------ normalisation


def _affine(layer):
    """Non-trivial affine parameters (the defaults 1 and 0 hide a wrong bias rule less well than random ones)."""
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_()
    return layer


def _norm_cases():
    yield Case("layernorm", lambda: _affine(nn.LayerNorm(6)), _x(T, 6))
    yield Case("layernorm-2d-shape", lambda: _affine(nn.LayerNorm((T, 6))), _x(3, T, 6))
    yield Case("layernorm-no_bias", lambda: _affine(nn.LayerNorm(6, bias=False)), _x(T, 6))
    yield Case("rmsnorm", lambda: _affine(nn.RMSNorm(6)), _x(T, 6))
    yield Case("rmsnorm-eps", lambda: _affine(nn.RMSNorm((T, 6), eps=1e-3)), _x(T, 6))
    for groups in (1, 2, 4):
        yield Case(f"groupnorm-{groups}", lambda groups=groups: _affine(nn.GroupNorm(groups, 4)), _x(4, 3, 5))
    for dim, cls in ((1, nn.InstanceNorm1d), (2, nn.InstanceNorm2d), (3, nn.InstanceNorm3d)):
        yield Case(f"instancenorm{dim}d", lambda cls=cls: _affine(cls(4, affine=True)), _x(4, *_SPATIAL[dim]))
    yield Case(
        "instancenorm2d-running_stats",
        lambda: _affine(nn.InstanceNorm2d(4, affine=True, track_running_stats=True)),
        _x(4, 7, 6),
        undefined=True,
    )
    yield Case("batchnorm2d", lambda: _affine(nn.BatchNorm2d(4)), _x(4, 7, 6), undefined=True)
    yield Case(
        "batchnorm1d-no_stats",
        lambda: _affine(nn.BatchNorm1d(6, track_running_stats=False)),
        _x(6),
        undefined=True,
    )


# ------------------------------------------------------------------------------------------------ attention

E = 8


def _causal(kind):
    m = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
    return m if kind == "bool" else torch.zeros(T, T, dtype=torch.float64).masked_fill(m, float("-inf"))


def _kpm(g):
    kpm = torch.zeros(B, T, dtype=torch.bool)
    kpm[1, -1] = kpm[3, -2:] = True  # padded keys in two examples
    return kpm


def _mha_call(mask=None, need_weights=False, padding=False, is_causal=False, cross=False):
    def call(layer, x, kpm=None, mem_k=None, mem_v=None):
        q = x if layer.batch_first else x.transpose(0, 1)
        k = v = q
        if cross:
            k, v = (t if layer.batch_first else t.transpose(0, 1) for t in (mem_k, mem_v))
        attn_mask = (
            None if mask is None else _causal(mask).to(x.device, x.dtype if mask == "float" else torch.bool)
        )
        out, w = layer(
            q,
            k,
            v,
            key_padding_mask=kpm if padding else None,
            need_weights=need_weights,
            attn_mask=attn_mask,
            is_causal=is_causal,
        )
        out = out if layer.batch_first else out.transpose(0, 1)
        return out if w is None else torch.cat([out.flatten(1), w.flatten(1)], 1)

    return call


def _attention_inputs(cross=False, memory_dim=None):
    def make(g):
        d = {"x": torch.randn(B, T, E, generator=g, dtype=torch.float64), "kpm": _kpm(g)}
        if cross:
            d |= {
                "mem_k": torch.randn(B, T + 2, memory_dim or 3, generator=g, dtype=torch.float64),
                "mem_v": torch.randn(B, T + 2, memory_dim or 5, generator=g, dtype=torch.float64),
            }
        return d

    return make


def _mha(**kw):
    def make():
        layer = nn.MultiheadAttention(E, 2, **kw)
        with torch.no_grad():  # torch initialises the biases to zeros: random ones test their rule
            for name, p in layer.named_parameters():
                if "bias" in name:
                    p.normal_()
        return layer

    return make


def _attention_cases():
    mha = {
        "mha-batch_first": (dict(batch_first=True), {}),
        "mha-seq_first": (dict(batch_first=False), {}),
        "mha-no_bias": (dict(batch_first=True, bias=False), {}),
        "mha-add_bias_kv": (dict(batch_first=True, add_bias_kv=True), dict(padding=True, mask="bool")),
        "mha-add_zero_attn": (dict(batch_first=False, add_zero_attn=True), dict(mask="float")),
        "mha-need_weights": (dict(batch_first=True), dict(need_weights=True, padding=True)),
        "mha-key_padding": (dict(batch_first=False), dict(padding=True)),
        "mha-causal_bool": (dict(batch_first=True), dict(mask="bool")),
        "mha-is_causal": (dict(batch_first=True), dict(mask="bool", is_causal=True)),
        "mha-kv_bias_zero_attn_weights": (
            dict(batch_first=True, add_bias_kv=True, add_zero_attn=True),
            dict(need_weights=True, mask="float", padding=True),
        ),
    }
    for name, (kw, call_kw) in mha.items():
        yield Case(name, _mha(**kw), _attention_inputs(), _mha_call(**call_kw), tags={"attention"})
    yield Case(
        "mha-kdim_vdim",
        _mha(batch_first=True, kdim=3, vdim=5),
        _attention_inputs(cross=True),
        _mha_call(cross=True),
        tags={"attention"},
    )

    def encoder_call(batch_first, padding):
        def call(layer, x, kpm=None):
            src = x if batch_first else x.transpose(0, 1)
            out = layer(src, src_key_padding_mask=kpm if padding else None)
            return out if batch_first else out.transpose(0, 1)

        return call

    for batch_first, norm_first in itertools.product((True, False), (False, True)):
        yield Case(
            f"transformer_encoder_layer-bf{int(batch_first)}-nf{int(norm_first)}",
            lambda batch_first=batch_first, norm_first=norm_first: nn.TransformerEncoderLayer(
                E, 2, 12, dropout=0.0, batch_first=batch_first, norm_first=norm_first, activation="gelu"
            ),
            _attention_inputs(),
            encoder_call(batch_first, padding=norm_first),
            tags={"attention"},
        )
    yield Case(
        "transformer_encoder-2_layers",
        lambda: nn.TransformerEncoder(
            nn.TransformerEncoderLayer(E, 2, 12, dropout=0.0, batch_first=True), 2, enable_nested_tensor=False
        ),
        _attention_inputs(),
        encoder_call(True, padding=True),
        tags={"attention"},
    )

    def decoder_call(layer, x, kpm=None, mem_k=None, mem_v=None):
        first = layer.self_attn.batch_first
        tgt, memory = (x, mem_v) if first else (x.transpose(0, 1), mem_v.transpose(0, 1))
        out = layer(tgt, memory, tgt_mask=_causal("bool").to(x.device), tgt_key_padding_mask=kpm)
        return out if first else out.transpose(0, 1)

    for batch_first in (True, False):
        yield Case(
            f"transformer_decoder_layer-bf{int(batch_first)}",
            lambda batch_first=batch_first: nn.TransformerDecoderLayer(
                E, 2, 12, dropout=0.0, batch_first=batch_first
            ),
            _attention_inputs(cross=True, memory_dim=E),
            decoder_call,
            tags={"attention"},
        )

    def dp_mha(**kw):
        def make():
            from opacus.layers import DPMultiheadAttention

            return DPMultiheadAttention(E, 2, batch_first=True, **kw)

        return make

    yield Case("opacus_dp_mha", dp_mha(), _attention_inputs(), _mha_call(), tags={"attention"})
    yield Case(
        "opacus_dp_mha-add_bias_kv",
        dp_mha(add_bias_kv=True),
        _attention_inputs(),
        _mha_call(),
        # its SequenceBias has no rule and acts sequence-first: the generic rule's recomputation does not reproduce
        # it per example, so it is refused (nn.MultiheadAttention(add_bias_kv=True) has a rule)
        bk_refuses=True,
        tags={"attention"},
    )


# ------------------------------------------------------------------------------------------------ composition


class _Reused(nn.Module):
    """One Linear applied twice (module reuse: its per-example gradient sums both calls)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x):
        return self.fc(torch.tanh(self.fc(x)))


class _Scale(nn.Module):
    """A parameter used directly in a forward (no library rule can know it)."""

    def __init__(self):
        super().__init__()
        self.s = nn.Parameter(torch.linspace(0.5, 1.5, 6))

    def forward(self, x):
        return x * self.s


def _frozen_bias_conv():
    layer = nn.Conv2d(4, 6, 3)
    layer.bias.requires_grad_(False)
    return layer


def _composition_cases():
    yield Case("linear-reused", _Reused, _x(T, 6))
    yield Case("conv2d-frozen_bias", _frozen_bias_conv, _x(4, 7, 6), tags={"conv"})
    yield Case("prelu", lambda: nn.PReLU(4), _x(4, 5))  # no rule of its own: bk's generic rule
    yield Case("custom_parameter", _Scale, _x(T, 6))


# ------------------------------------------------------------------------------------------------ folded batches

#: real tokens per example in the folded cases' batch (of T positions); tests/test_fold_layouts.py also runs them
#: after a batch whose examples all have T (the same shapes and B·T rows, in another arrangement)
PACKED_LENGTHS = (4, 2, 3, 4, 1)


def _packed_inputs(lengths):
    def make(g):
        x = torch.randn(B, T, 6, generator=g, dtype=torch.float64)
        mask = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).long()
        return {"x": x, "mask": mask}

    return make


def _packed_call(layer, x, mask):
    """The layer on every example's real tokens first, in example order, then the padding positions (whose
    outputs are dropped): one (B·T, d) matrix of rows whose arrangement depends on each example's length, as
    FlashAttention's ``unpad_input`` packs a batch, in a static shape (``torch.func.vmap`` runs it per example).
    The rows go back to their places after the layer."""
    d = x.shape[-1]
    keep = mask.reshape(-1) > 0
    order = torch.argsort((~keep).long(), stable=True)
    rows = layer(x.reshape(-1, d)[order]) * keep[order, None].to(x.dtype)
    return rows[torch.argsort(order)].reshape(*x.shape[:-1], -1)


def _folded_cases():
    yield Case(
        "packed-linear", lambda: nn.Linear(6, 5), _packed_inputs(PACKED_LENGTHS), _packed_call, tags={"fold"}
    )
    yield Case(
        "packed-layernorm",
        lambda: _affine(nn.LayerNorm(6)),
        _packed_inputs(PACKED_LENGTHS),
        _packed_call,
        tags={"fold"},
    )


CASES: list[Case] = [
    *_conv_cases(),
    *_linear_cases(),
    *_embedding_cases(),
    *_norm_cases(),
    *_attention_cases(),
    *_composition_cases(),
]

#: layers on a batch folded into rows with a data-dependent arrangement; run by tests/test_fold_layouts.py, alone
#: and after a batch of the same shapes arranged otherwise, not by the grid of tests/test_conformance.py: Opacus'
#: hooks and ghost take each row for an example there (a RuntimeError, not a refusal naming the layer)
FOLDED: list[Case] = list(_folded_cases())
