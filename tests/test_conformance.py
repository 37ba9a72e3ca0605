"""Engine conformance: every engine, on every layer configuration of tests/conformance_cases.py, either computes each
example's gradient norm and the clipped sum exactly — against the loop over batches of size one — or refuses the
layer with a message naming it; never a silent mismatch, never a crash.

Privacy rests on each example's contribution having norm at most C, which holds only if the engine's per-example
norms are exact: an engine that is silently wrong on a layer voids the run's epsilon. Each cell runs in float64
(squared-error and cross-entropy heads, tight tolerance) and float32 (cross-entropy, float32's tolerance), with a
clip at the median norm so that some examples are clipped and some are not, and checks the empty batch.

Expectations beyond "match or refuse": a layer with no per-example gradient is refused by every engine ("no engine
can"); loop, functorch and bk (in each of its paths) match every other configuration, except the few bk refuses by
design (``Case.bk_refuses``). The Opacus engines (hooks, ghost) may refuse; :mod:`dp_adam_bench.engine.support`
holds what they are allowed, and this suite is what proves it.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from conformance_cases import CASES, Case, _default_call
from torch import nn
from torch.nn import functional as F

from dp_adam_bench.engine.bk import BKEngine
from dp_adam_bench.engine.bk_rules import conv, dense
from dp_adam_bench.engine.engines import build_engine
from dp_adam_bench.engine.fp32_exact import ieee_fp32
from dp_adam_bench.engine.grads import batch_len, clip_factors, loop_grads
from dp_adam_bench.errors import ConfigError

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# bk:chunked is bk (auto) with one example per chunk of its norm computations (bk_rules.dense._GRAM_CHUNK);
# bk:grouped instantiates convolutions' per-example gradients with the grouped kernel (bk_rules.conv), whatever
# the channels and device
BK_PATHS = ["bk", "bk:gram", "bk:instantiate", "bk:chunked", "bk:grouped"]
ENGINES = ["loop", "functorch", *BK_PATHS, "hooks", "ghost"]
EXACT = {"loop", "functorch", *BK_PATHS}  # must match every defined configuration
SETTINGS = {  # name: (dtype, loss, rtol)
    "f64-mse": (torch.float64, "mse", 1e-8),
    "f64-ce": (torch.float64, "ce", 1e-8),
    "f32-ce": (torch.float32, "ce", 2e-4),
}
K = 3  # outputs of the probe's head


class Probe(nn.Module):
    """The layer under test, then tanh and a fixed (non-trainable) projection to K outputs: the loss depends on
    the layer's output non-linearly, and no other parameter enters the per-example gradient."""

    def __init__(self, case: Case):
        super().__init__()
        torch.manual_seed(0)
        self.layer = case.make()
        self.call = case.call or _default_call

    def forward(self, **inputs):
        out = torch.tanh(self.call(self.layer, **inputs)).flatten(1)
        # deterministic, not drawn: torch.func.vmap draws different random numbers per example
        rows = torch.arange(out.shape[1], device=out.device, dtype=out.dtype)[:, None]
        proj = torch.cos(rows * torch.tensor([0.7, 1.3, 2.1], device=out.device, dtype=out.dtype) + 0.5)
        return out @ proj


def loss_fn(kind):
    def loss(forward, batch):
        inputs = {k: v for k, v in batch.items() if k not in ("y", "label")}
        z = forward(**inputs)
        if kind == "mse":
            return (z - batch["y"]).square().sum(1)
        return F.cross_entropy(z, batch["label"], reduction="none")

    return loss


def make_model(case, dtype):
    return Probe(case).to(DEVICE, dtype)


def make_batch(case, dtype):
    g = torch.Generator().manual_seed(7)
    batch = case.inputs(g)
    n = batch_len(batch)
    batch |= {
        "y": torch.randn(n, K, generator=g, dtype=torch.float64),
        "label": torch.randint(0, K, (n,), generator=g),
    }
    return {k: (v.to(DEVICE, dtype) if v.is_floating_point() else v.to(DEVICE)) for k, v in batch.items()}


def build(engine, model, loss):
    name, _, mode = engine.partition(":")
    if mode == "chunked":
        return BKEngine(model, loss)
    if mode == "grouped":
        return BKEngine(model, loss, mode="instantiate")
    if mode:
        return BKEngine(model, loss, mode=mode)
    return build_engine(name, model, loss)


_ORACLE: dict = {}


def oracle(case, setting):
    """(norms, clip, clipped sum) from the loop over batches of size one, on a fresh model, in IEEE fp32 math."""
    key = (case.id, setting)
    if key not in _ORACLE:
        dtype, kind, _ = SETTINGS[setting]
        model = make_model(case, dtype)
        params = [p for p in model.parameters() if p.requires_grad]
        with ieee_fp32():  # as the engines clip: cuDNN's default convolutions on CUDA are TF32 (~5e-4 off)
            per_ex = loop_grads(model, loss_fn(kind), params, make_batch(case, dtype))
        b = per_ex[0].shape[0]
        norms = torch.sqrt(sum(g.reshape(b, -1).square().sum(1) for g in per_ex))
        clip = float(norms.median())
        f = clip_factors(norms, clip)
        _ORACLE[key] = norms, clip, [torch.einsum("b,b...->...", f, g) for g in per_ex]
    return _ORACLE[key]


def assert_names_the_layer(err: Exception, case: Case, engine: str):
    msg = str(err)
    assert "'layer" in msg, f"{engine} on {case.id}: a refusal must name the layer: {msg}"
    assert "\n" not in msg.strip(), f"{engine} on {case.id}: one line, got: {msg}"


def run_cell(case: Case, engine: str, setting: str) -> str:
    """'match' or 'refused' (with a message naming the layer); fails on a mismatch or any other exception."""
    if engine == "bk:chunked":
        with mock.patch.object(dense, "_GRAM_CHUNK", 1):
            return _run_cell(case, engine, setting)
    if engine == "bk:grouped":
        with mock.patch.object(conv, "grouped_kernel", lambda *_: True):
            return _run_cell(case, engine, setting)
    return _run_cell(case, engine, setting)


def _run_cell(case: Case, engine: str, setting: str) -> str:
    dtype, kind, rtol = SETTINGS[setting]
    loss = loss_fn(kind)
    try:
        eng = build(engine, make_model(case, dtype), loss)
    except ConfigError as err:
        assert_names_the_layer(err, case, engine)
        return "refused"
    try:
        batch = make_batch(case, dtype)
        norms, clip, summed = oracle(case, setting)
        try:
            # the engines' algebra in one precision; TF32 convolutions (CUDA's default) are the GPU check's tf32 part
            with ieee_fp32():
                out = eng.clipped_sum(batch, clip)
        except ValueError as err:  # a refusal that depends on the inputs (e.g. ghost: a Linear on 4-D inputs)
            assert_names_the_layer(err, case, engine)
            return "refused"
        scale = float(norms.max())
        assert torch.allclose(out.norms, norms, rtol=rtol, atol=rtol * scale), (
            f"{engine} on {case.id} ({setting}): per-example norms {out.norms.tolist()} != loop {norms.tolist()}"
        )
        assert len(out.summed) == len(summed)
        size = max(
            float(r.abs().max()) for r in summed
        )  # a parameter whose sum is ~0 is compared at this scale
        for s, r in zip(out.summed, summed, strict=True):
            assert s.shape == r.shape
            assert torch.allclose(s, r, rtol=rtol, atol=rtol * size), (
                f"{engine} on {case.id} ({setting}): clipped sum off by {float((s - r).abs().max()):.3g}"
            )
        empty = eng.clipped_sum({k: v[:0] for k, v in batch.items()}, clip)
        assert empty.count == 0 and empty.norms.numel() == 0
        assert all(
            bool((s == 0).all()) and s.shape == p.shape for s, p in zip(empty.summed, eng.params, strict=True)
        )
    finally:
        eng.close()
    return "match"


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_every_engine_matches_the_loop_or_refuses(case, setting):
    if "transformers" in case.tags:
        pytest.importorskip("transformers")
    outcome = {engine: run_cell(case, engine, setting) for engine in ENGINES}
    if case.undefined:
        assert set(outcome.values()) == {"refused"}, f"{case.id} has no per-example gradient: {outcome}"
        return
    for engine in EXACT:
        want = "refused" if case.bk_refuses and engine.startswith("bk") else "match"
        assert outcome[engine] == want, f"{engine} on {case.id}: {outcome[engine]}, want {want}"


def test_the_grid_covers_the_issue_configurations():
    """At least the configurations the conformance issue lists, so that trimming the grid is noticed."""
    ids = {c.id for c in CASES}
    for dim in (1, 2, 3):
        for mode in ("zeros", "reflect", "replicate", "circular"):
            assert any(i.startswith(f"conv{dim}d-") and i.endswith(mode) for i in ids)
    assert {"linear-2d-bias1", "linear-3d-bias1", "linear-4d-bias1", "embedding-padding_idx"} <= ids
    assert {"embedding-scale_grad_by_freq", "embedding_bag-sum", "layernorm-no_bias", "rmsnorm"} <= ids
    assert {
        "groupnorm-2",
        "instancenorm2d",
        "gpt2-conv1d-3d",
        "mha-batch_first",
        "opacus_dp_mha-add_bias_kv",
    } <= ids
    assert any(i.startswith("transformer_encoder_layer") for i in ids)
    assert len(CASES) >= 100


def test_a_refusal_names_the_layer_and_the_engines_that_can():
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1, padding_mode="reflect"), nn.Flatten(), nn.Linear(3 * 9, 2)
    )
    with pytest.raises(ConfigError) as err:
        build_engine("hooks", model, None)
    msg = str(err.value)
    assert "train.clipping=hooks" in msg and "'0': Conv2d(padding_mode='reflect')" in msg
    assert "use train.clipping=bk or train.clipping=functorch or train.clipping=loop" in msg
    assert "'2'" not in msg  # the Linear is fine


def test_bk_trains_a_transformer_encoder_through_make_private():
    """nn.TransformerEncoderLayer (built on nn.MultiheadAttention) trains privately with bk, the default engine,
    and three private steps end where functorch's do (same seed: same batches, same noise)."""
    from dp_adam_bench import make_private

    class Tagger(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(11, 8)
            self.enc = nn.TransformerEncoder(
                nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True),
                1,
                enable_nested_tensor=False,
            )
            self.head = nn.Linear(8, 3)

        def forward(self, ids):
            return self.head(self.enc(self.emb(ids)).mean(1))

    g = torch.Generator().manual_seed(0)
    data = [
        {"ids": torch.randint(0, 11, (6,), generator=g), "labels": torch.randint(0, 3, (), generator=g)}
        for _ in range(32)
    ]

    def loss(logits, labels):
        return F.cross_entropy(logits, labels, reduction="none")

    finals = {}
    for engine in ("bk", "functorch"):
        torch.manual_seed(0)
        model = Tagger().to(DEVICE)
        before = [p.detach().clone() for p in model.parameters()]
        private = make_private(
            model,
            data,
            loss,
            optimizer="adam",
            sigma=1.0,
            clip=0.1,
            batch_size=8,
            steps=3,
            clipping=engine,
            lr=1e-2,
        )
        assert private.self_check["max_rel_error"] < 1e-4
        while not private.done:
            private.step()
        assert private.epsilon()  # accounted
        # every parameter, the attention's packed in-projection included, was updated
        assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
        finals[engine] = [p.detach() for p in model.parameters()]
    for a, b in zip(finals["bk"], finals["functorch"], strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)


def test_bk_gives_back_a_plain_model_when_closed():
    """bk swaps the forward of attention and of sequence-first transformer layers while it is attached; close()
    restores them, and outside a recorded batch the model computes what it computed before."""
    model = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(8, 2, 12, dropout=0.0, batch_first=False), 2, enable_nested_tensor=False
    )
    x = torch.randn(4, 3, 8)
    before = model(x)
    eng = BKEngine(model, lambda forward, batch: forward(batch["x"].transpose(0, 1)).sum((0, 2)))
    assert all("forward" in m.__dict__ for m in model.modules() if isinstance(m, nn.MultiheadAttention))
    assert torch.equal(model(x), before)  # not recording: the module's own forward
    eng.close()
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert torch.equal(model(x), before)
