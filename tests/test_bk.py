"""The book-keeping (bk) engine: norms and clipped sums against the loop oracle and Opacus ghost, on both per-layer
paths (Gram / instantiated), through the trainer, and its refusals."""

import pytest
import torch
from torch import nn

from dp_adam_bench.engine.bk import BKEngine, use_gram
from dp_adam_bench.engine.engines import build_engine
from dp_adam_bench.engine.grads import clip_factors
from dp_adam_bench.errors import ConfigError
from dp_adam_bench.tasks import registry
from dp_adam_bench.tasks.cifar10_cnn import CNN5
from dp_adam_bench.train import train

from helpers import compose_cfg, tiny_poisson
from small_models import fresh_model, loss_per_example, make_batch

MODES = ["auto", "gram", "instantiate"]


def reference(make_model, loss, batch, clip):
    """(norms, clipped sum) from the loop engine's materialised per-example gradients."""
    per_ex = build_engine("loop", make_model(), loss).per_example_grads(batch)
    b = per_ex[0].shape[0]
    norms = torch.sqrt(sum(g.reshape(b, -1).pow(2).sum(1) for g in per_ex))
    f = clip_factors(norms, clip)
    return norms, [torch.einsum("b,b...->...", f, g) for g in per_ex]


def assert_matches(out, norms, summed, atol=1e-5):
    assert torch.allclose(out.norms, norms, rtol=1e-4)
    assert len(out.summed) == len(summed)
    for s, r in zip(out.summed, summed, strict=True):
        assert s.shape == r.shape
        assert torch.allclose(s, r, atol=atol, rtol=1e-4)


def run_bk(make_model, loss, batch, clip, mode="auto"):
    model = make_model()
    eng = BKEngine(model, loss, mode=mode)
    out = eng.clipped_sum(batch, clip)
    eng.close()
    assert all(p.grad is None for p in model.parameters())  # one backward, and no non-clipped .grad left
    return out, eng


# ------------------------------------------------------------------------------------------ SmallNet, CNN5


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("clip", [None, 0.5])
def test_smallnet_matches_loop(mode, clip):
    norms, summed = reference(fresh_model, loss_per_example, make_batch(), clip)
    out, eng = run_bk(fresh_model, loss_per_example, make_batch(), clip, mode)
    assert_matches(out, norms, summed)
    if clip is not None:
        assert bool((norms > clip).any())
    if mode != "auto":
        assert set(eng.choices.values()) == {mode}


#: bk's choices on CNN5 (auto)
CNN5_AUTO = dict(conv1="instantiate", conv2="instantiate", conv3="gram", conv4="gram", conv5="gram")


def cnn5():
    torch.manual_seed(0)
    return CNN5()


def cnn5_loss(forward, batch):
    return nn.functional.cross_entropy(forward(batch["x"]), batch["y"], reduction="none")


@pytest.fixture(scope="module")
def cnn5_case():
    g = torch.Generator().manual_seed(1)
    batch = {"x": torch.randn(4, 3, 32, 32, generator=g), "y": torch.randint(0, 10, (4,), generator=g)}
    norms, _ = reference(cnn5, cnn5_loss, batch, None)
    clip = float(norms.median())  # clips about half of the examples
    return batch, clip, reference(cnn5, cnn5_loss, batch, clip)


@pytest.mark.parametrize("mode", MODES)
def test_cnn5_matches_loop(mode, cnn5_case):
    batch, clip, (norms, summed) = cnn5_case
    out, eng = run_bk(cnn5, cnn5_loss, batch, clip, mode)
    assert_matches(out, norms, summed)
    if mode == "auto":  # the cost model: the first two (many output pixels) instantiate, the rest Gram
        assert eng.choices == CNN5_AUTO


@pytest.mark.parametrize(
    "make_model, loss, batch",
    [
        (fresh_model, loss_per_example, make_batch()),
        (cnn5, cnn5_loss, {"x": torch.randn(4, 3, 32, 32), "y": torch.tensor([0, 3, 3, 9])}),
    ],
    ids=["smallnet", "cnn5"],
)
def test_matches_opacus_ghost(make_model, loss, batch):
    ghost = build_engine("ghost", make_model(), loss)
    ref = ghost.clipped_sum(batch, 0.5)
    ghost.close()
    out, _ = run_bk(make_model, loss, batch, 0.5)
    assert_matches(out, ref.norms, ref.summed)


def test_use_gram_cost_model():
    assert use_gram(1, 100, 100)  # a Linear on (B, d): ||a||^2 ||g||^2
    assert use_gram(9, 1152, 256)  # CNN5 conv4
    assert not use_gram(900, 27, 32)  # CNN5 conv1: many pixels, small weight
    assert use_gram(49, 576, 128)  # CNN5 conv3: 37 ms vs 63 ms instantiated (B = 256, one thread)
    assert not use_gram(225, 288, 64)  # CNN5 conv2: 211 ms Gram vs 29 ms
    assert use_gram(128, 768, 3072) and not use_gram(128, 768, 768)  # GPT-2 at T = 128: MLP in, attention
    assert not use_gram(128, 128, 512)  # BERT-tiny's FFN at T = 128
    assert use_gram(64, 768, 50257) and use_gram(19, 128, 30522)  # LM heads (GPT-2, BERT-tiny MLM)


# ------------------------------------------------------------------------------------------ sequence models


class TinySeqClassifier(nn.Module):
    """A 1-layer BERT (Embedding, LayerNorm, Linear on (B, T, d)) or GPT-2 (+ Conv1D) with a linear head."""

    def __init__(self, kind):
        super().__init__()
        import transformers as tf

        self.kind = kind
        if kind == "bert":
            cfg = tf.BertConfig(
                vocab_size=30,
                hidden_size=16,
                num_hidden_layers=1,
                num_attention_heads=2,
                intermediate_size=24,
                max_position_embeddings=16,
                hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
            )
            self.body = tf.BertModel(cfg, add_pooling_layer=False)
        else:
            cfg = tf.GPT2Config(
                vocab_size=30,
                n_embd=16,
                n_layer=1,
                n_head=2,
                n_positions=16,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
                bos_token_id=0,
                eos_token_id=0,
            )
            self.body = tf.GPT2Model(cfg)
        self.head = nn.Linear(16, 3)

    def forward(self, ids):
        b, t = ids.shape
        kw = {"position_ids": torch.arange(t).repeat(b, 1)}  # (B, T): bk needs the examples along dim 0
        if self.kind == "bert":
            kw["token_type_ids"] = torch.zeros_like(ids)
        return self.head(self.body(input_ids=ids, **kw).last_hidden_state[:, -1])


def seq_loss(forward, batch):
    return nn.functional.cross_entropy(forward(batch["ids"]), batch["y"], reduction="none")


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
def test_tiny_transformers_match_loop_and_ghost(kind):
    pytest.importorskip("transformers")

    def make():
        torch.manual_seed(0)
        return TinySeqClassifier(kind)

    g = torch.Generator().manual_seed(2)
    batch = {"ids": torch.randint(0, 30, (3, 7), generator=g), "y": torch.randint(0, 3, (3,), generator=g)}
    batch["ids"][1, 2] = batch["ids"][1, 5]  # a repeated token: the embedding rows must be summed per example
    norms, summed = reference(make, seq_loss, batch, 1.0)
    assert bool((norms > 1.0).any())
    for mode in MODES:
        out, eng = run_bk(make, seq_loss, batch, 1.0, mode)
        assert_matches(out, norms, summed)
    kinds = {layer.kind for layer in eng.layers}
    assert kinds == {"embedding", "layernorm", "linear"}
    if kind == "bert":  # BERT's word embeddings have padding_idx = 0, on which Opacus' rule is wrong
        with pytest.raises(
            ConfigError, match=r"'body\.embeddings\.word_embeddings': Embedding\(padding_idx=0\)"
        ):
            build_engine("ghost", make(), seq_loss)
        return
    ghost = build_engine("ghost", make(), seq_loss)
    ref = ghost.clipped_sum(batch, 1.0)
    ghost.close()
    assert torch.allclose(out.norms, ref.norms, rtol=1e-4)


# ------------------------------------------------------------------------------------------ layer variants


class Zoo(nn.Module):
    """Strided / dilated / reflect-padded / 'same' convolutions, GroupNorm, a grouped convolution, an embedding with
    padding_idx, and a Linear module applied twice (module reuse)."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(2, 3, 3, stride=2, padding=1)
        self.c2 = nn.Conv2d(3, 4, (2, 3), dilation=(1, 2), padding="same", padding_mode="reflect")
        self.gn = nn.GroupNorm(2, 4)
        self.c3 = nn.Conv2d(4, 4, 3, groups=2, padding=1, bias=False)
        self.emb = nn.Embedding(9, 5, padding_idx=0)
        self.shared = nn.Linear(5, 5)
        self.out = nn.Linear(4 * 4 * 4 + 5, 3)

    def forward(self, x, tok):
        h = self.c3(torch.tanh(self.gn(self.c2(torch.tanh(self.c1(x)))))).flatten(1)
        e = self.shared(torch.tanh(self.shared(self.emb(tok)))).mean(1)
        return self.out(torch.cat([h, e], 1))


def zoo_loss(forward, batch):
    return nn.functional.cross_entropy(forward(batch["x"], batch["tok"]), batch["y"], reduction="none")


@pytest.mark.parametrize("mode", MODES)
def test_layer_variants_fallbacks_and_module_reuse_match_loop(mode):
    def make():
        torch.manual_seed(0)
        return Zoo()

    g = torch.Generator().manual_seed(3)
    batch = {
        "x": torch.randn(5, 2, 8, 8, generator=g),
        "tok": torch.randint(0, 9, (5, 4), generator=g),
        "y": torch.randint(0, 3, (5,), generator=g),
    }
    batch["tok"][0, :2] = 0  # padding tokens get no gradient
    norms, summed = reference(make, zoo_loss, batch, 1.0)
    assert bool((norms > 1.0).any())
    out, eng = run_bk(make, zoo_loss, batch, 1.0, mode)
    assert_matches(out, norms, summed)
    assert {layer.name: layer.kind for layer in eng.layers} == {
        "c1": "conv",
        "c2": "conv",
        "gn": "groupnorm",
        "c3": "conv",
        "emb": "embedding",
        "shared": "linear",
        "out": "linear",
    }


def test_mean_grad_and_close_leave_a_plain_model():
    model = fresh_model()
    eng = BKEngine(model, loss_per_example)
    got = eng.mean_grad(make_batch())
    ref = torch.autograd.grad(loss_per_example(model, make_batch()).mean(), list(model.parameters()))
    for a, b in zip(got, ref, strict=True):
        assert torch.allclose(a, b, atol=1e-6)
    assert all(not layer.calls for layer in eng.layers)  # hooks record only inside clipped_sum
    eng.close()
    assert all(not m._forward_hooks for m in model.modules())


# ------------------------------------------------------------------------------------------ refusals


def test_tied_parameters_used_by_both_modules_are_exact_and_fix_model_keeps_them():
    """Issue 46: the per-example gradient of a weight two Linear layers share is the sum of theirs, cross terms
    included (bk_rules/shared.py; tests/test_bk_shared.py has the other pairs); fix_model no longer unties it."""
    from dp_adam_bench.engine.fix_model import fix_model

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    model[2].weight = model[0].weight
    loss = lambda forward, batch: forward(batch["x"]).sum(1)  # noqa: E731
    _loop_check(model, loss, {"x": torch.randn(3, 4)})
    model, changes = fix_model(model, verbose=False)
    assert changes == [] and model[2].weight is model[0].weight


def test_a_tied_parameter_only_one_of_whose_modules_runs_is_exact():
    class Unused(nn.Module):  # T5: `shared` and `encoder.embed_tokens` are one weight; only the latter runs
        def __init__(self):
            super().__init__()
            self.shared = nn.Embedding(6, 3)
            self.embed = nn.Embedding(6, 3)
            self.embed.weight = self.shared.weight
            self.fc = nn.Linear(3, 2)

        def forward(self, ids):
            return self.fc(self.embed(ids))

    torch.manual_seed(0)
    batch = {"ids": torch.randint(0, 6, (3, 4))}
    _loop_check(Unused(), lambda forward, b: forward(b["ids"]).sum((1, 2)), batch)


class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.s = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return x * self.s


def _loop_check(model, loss, batch, clip=1.0):
    """bk's norms and clipped sum against the loop over batches of size one."""
    from dp_adam_bench.engine.grads import loop_grads

    eng = BKEngine(model, loss)
    got = eng.clipped_sum(batch, clip)
    eng.close()
    per_ex = loop_grads(model, loss, [p for p in model.parameters() if p.requires_grad], batch)
    b = got.count
    norms = torch.sqrt(sum(g.reshape(b, -1).square().sum(1) for g in per_ex))
    torch.testing.assert_close(got.norms, norms)
    f = clip_factors(norms, clip)
    for s, g in zip(got.summed, per_ex, strict=True):
        torch.testing.assert_close(s, torch.einsum("b,b...->...", f, g))
    return eng


def test_a_layer_without_rule_takes_the_generic_rule_and_undefined_ones_are_listed():
    model = nn.Sequential(nn.Linear(4, 4), Scale(), nn.Embedding(5, 4, scale_grad_by_freq=True))
    with pytest.raises(
        ConfigError,
        match=r"train\.clipping=bk .*'2': Embedding\(scale_grad_by_freq=True\) "
        r".*\[its parameters: weight\] \(no engine can",
    ) as err:
        BKEngine(model, None)
    assert "'1'" not in str(err.value)  # Scale: the generic rule
    eng = _loop_check(
        nn.Sequential(nn.Linear(4, 4), Scale()), lambda f, b: f(b["x"]).sum(1), {"x": torch.randn(3, 4)}
    )
    assert eng.choices["1"] == "generic:vmap"


def test_an_input_broadcast_over_the_batch_is_expanded_exactly():
    class PosEmb(
        nn.Module
    ):  # positions of shape (1, T), broadcast over the batch: Hugging Face's position_ids
        def __init__(self):
            super().__init__()
            self.pos = nn.Embedding(8, 3)
            self.fc = nn.Linear(3, 2)

        def forward(self, x):
            return self.fc(x + self.pos(torch.arange(x.shape[1])[None]))

    torch.manual_seed(0)
    _loop_check(PosEmb(), lambda forward, batch: forward(batch["x"]).sum((1, 2)), {"x": torch.randn(2, 5, 3)})


def test_an_input_shared_by_the_batch_without_a_batch_dim_is_refused():
    class Shared(nn.Module):  # a (T, T) table of ids for all examples (T = 5 != B)
        def __init__(self):
            super().__init__()
            self.pos = nn.Embedding(8, 1)

        def forward(self, x):
            return x + self.pos(torch.arange(x.shape[1]).repeat(x.shape[1], 1)).squeeze(-1)

    eng = BKEngine(Shared(), lambda forward, batch: forward(batch["x"]).sum((1, 2)))
    # issue 46: a folded input is placed row by row (engine/folds.py); these rows carry every example's loss
    with pytest.raises(
        ValueError, match=r"'pos' \(Embedding\) sees 5 rows for a batch of 2 examples, and a row carries"
    ):
        eng.clipped_sum({"x": torch.randn(2, 5, 5)}, 1.0)


def test_in_place_op_on_a_hooked_output_runs_on_copies_exactly():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(inplace=True), nn.Linear(4, 2))
    eng = _loop_check(model, lambda forward, batch: forward(batch["x"]).sum(1), {"x": torch.randn(2, 3)})
    assert eng._clone  # the first forward met the in-place op; the captures are copies from then on


@pytest.mark.parametrize(
    "text",
    [
        "Output 0 of _Capture is a view and is being modified inplace. This view was created inside a custom Function",
        "Output 0 of _CaptureBackward is a view and is being modified inplace.",  # torch 2.11's wording
        "one of the variables needed for gradient computation has been modified by an inplace operation: "
        "[torch.cuda.FloatTensor [2, 4]], which is output 0 of _CaptureBackward, is at version 1",
    ],
)
def test_every_wording_of_the_in_place_error_gets_the_clear_refusal(text):
    from dp_adam_bench.engine.bk import _refuse_in_place

    with pytest.raises(ValueError, match="modified in place"):
        _refuse_in_place(RuntimeError(text))
    _refuse_in_place(RuntimeError("some other error"))  # anything else is left to the caller to re-raise


def scales_for(model, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(p.shape, generator=g) * 2 + 0.1 for p in model.parameters() if p.requires_grad]


def reference_scaled(make_model, loss, batch, clip, scale):
    """Scale-then-privatize oracle: clip(s * g_i) summed, from the loop engine."""
    per_ex = build_engine("loop", make_model(), loss).per_example_grads(batch)
    per_ex = [g * s for g, s in zip(per_ex, scale, strict=True)]
    b = per_ex[0].shape[0]
    norms = torch.sqrt(sum(g.reshape(b, -1).pow(2).sum(1) for g in per_ex))
    f = clip_factors(norms, clip)
    return norms, [torch.einsum("b,b...->...", f, g) for g in per_ex]


@pytest.mark.parametrize("case", ["smallnet", "cnn5", "zoo", "bert", "gpt2"])
def test_scale_then_privatize_matches_loop(case, monkeypatch):
    monkeypatch.setattr(
        "dp_adam_bench.engine.bk_rules.dense._GRAM_CHUNK", 64
    )  # several chunks of examples per layer
    # scaled gradients: one example per chunk; CNN5's conv4 (256 x 1152) two, so its last chunk (of 3) is partial
    chunk = 2 * 256 * 1152 if case == "cnn5" else 64
    monkeypatch.setattr("dp_adam_bench.engine.bk_rules.dense._SCALED_CHUNK", chunk)
    g = torch.Generator().manual_seed(4)
    if case == "smallnet":
        make, loss, batch = fresh_model, loss_per_example, make_batch()
    elif case == "cnn5":
        make, loss = cnn5, cnn5_loss
        batch = {"x": torch.randn(3, 3, 32, 32, generator=g), "y": torch.tensor([0, 3, 9])}
    elif case == "zoo":

        def make():
            torch.manual_seed(0)
            return Zoo()

        loss = zoo_loss
        batch = {
            "x": torch.randn(4, 2, 8, 8, generator=g),
            "tok": torch.randint(0, 9, (4, 4), generator=g),
            "y": torch.randint(0, 3, (4,), generator=g),
        }
        batch["tok"][0, :2] = 0
    else:
        pytest.importorskip("transformers")

        def make():
            torch.manual_seed(0)
            return TinySeqClassifier(case)

        loss = seq_loss
        batch = {
            "ids": torch.randint(0, 30, (3, 7), generator=g),
            "y": torch.randint(0, 3, (3,), generator=g),
        }
        batch["ids"][1, 2] = batch["ids"][1, 5]
    scale = scales_for(make())
    norms, _ = reference_scaled(make, loss, batch, None, scale)
    clip = float(norms.median())
    norms, summed = reference_scaled(make, loss, batch, clip, scale)
    model = make()
    eng = BKEngine(model, loss)
    out = eng.clipped_sum(batch, clip, scale)
    assert all(p.grad is None for p in model.parameters())
    assert_matches(out, norms, summed)
    plain = eng.clipped_sum(batch, clip)  # the scale does not stick to the engine
    ref_norms, _ = reference(make, loss, batch, clip)
    assert torch.allclose(plain.norms, ref_norms, rtol=1e-4)
    eng.close()


def test_scale_of_the_wrong_shape_is_refused():
    eng = build_engine("bk", fresh_model(), loss_per_example)
    with pytest.raises(ValueError, match="one tensor of each trainable parameter's shape"):
        eng.clipped_sum(make_batch(), 1.0, [torch.ones(3)])
    eng.close()


# ------------------------------------------------------------------------------------------ through the trainer

BASE = tiny_poisson("bk", 3)


@pytest.fixture
def tiny_task(monkeypatch):
    monkeypatch.setitem(registry.TASKS, "tiny", "tiny_task:TinyTask")


def test_training_with_bk_equals_ghost(isolated_dirs, tiny_task):
    ghost = train(compose_cfg([*BASE, "train.clipping=ghost"]))
    bk = train(compose_cfg([*BASE, "train.clipping=bk", "experiment_name=bk2"]))
    assert bk["clipping"] == "bk" and bk["steps"] == ghost["steps"] == 3
    assert bk["metrics"]["test_loss"] == pytest.approx(ghost["metrics"]["test_loss"], rel=1e-5)
    assert bk["metrics"]["test_accuracy"] == ghost["metrics"]["test_accuracy"]


def test_stp_with_bk_through_the_trainer_equals_hooks(isolated_dirs, tiny_task):
    stp = [*BASE, "optimizer=stp", "optimizer.lr=0.001"]
    hooks = train(compose_cfg([*stp, "train.clipping=hooks"]))
    bk = train(compose_cfg([*stp, "train.clipping=bk", "experiment_name=bk2"]))
    assert bk["clipping"] == "bk" and bk["steps"] == hooks["steps"] == 3
    assert bk["metrics"]["test_loss"] == pytest.approx(hooks["metrics"]["test_loss"], rel=1e-5)


# ------------------------------------------------------------------------------------------------ memory (issue 26)


def test_per_example_gradients_are_kept_only_where_they_fit():
    """CNN5: conv1 and conv2 instantiate (cheaper, and no larger than their captures), the rest take the Gram
    form; only conv1's and conv2's per-example gradients are kept. A 1024 x 1024 Linear at T = 128, which the
    cost rule alone would instantiate, takes the Gram form: its per-example gradient (4 MiB) is larger than its
    captures (1 MiB per example)."""
    torch.manual_seed(0)
    batch = {"x": torch.randn(3, 3, 32, 32), "y": torch.tensor([0, 3, 9])}
    eng = BKEngine(cnn5(), cnn5_loss)
    eng.clipped_sum(batch, 1.0)
    assert eng.choices == CNN5_AUTO
    assert eng.memory["per_example_bytes"] == 3 * (32 * 3 * 9 + 64 * 32 * 9) * 4
    assert eng.memory["captured_bytes"] > 0
    eng.close()

    assert not use_gram(128, 1024, 1024)  # by cost alone: instantiate
    lin = nn.Linear(1024, 1024)

    def loss(forward, b):
        return forward(b["x"]).square().mean((1, 2))

    x = {"x": torch.randn(2, 128, 1024)}
    eng = BKEngine(lin, loss)
    out = eng.clipped_sum(x, 1e-3)
    assert eng.choices == {"<root>": "gram"} and eng.memory["per_example_bytes"] == 0
    eng.close()
    ref = build_engine("loop", lin, loss).clipped_sum(x, 1e-3)
    assert torch.allclose(out.norms, ref.norms, rtol=1e-4)
    assert all(
        torch.allclose(a, b, rtol=1e-4, atol=1e-9) for a, b in zip(out.summed, ref.summed, strict=True)
    )


class _ScaleThenDropout(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.s = nn.Parameter(torch.linspace(0.5, 1.5, 4))
        self.drop = nn.Dropout(p)

    def forward(self, x):
        return self.drop(x * self.s)


def test_generic_rule_is_exact_with_zero_dropout_and_refuses_random_or_mixing_forwards():
    torch.manual_seed(0)
    loss = lambda forward, batch: forward(batch["x"]).square().sum(1)  # noqa: E731
    batch = {"x": torch.randn(3, 4)}
    _loop_check(nn.Sequential(nn.Linear(4, 4), _ScaleThenDropout(0.0)), loss, batch)
    eng = BKEngine(nn.Sequential(nn.Linear(4, 4), _ScaleThenDropout(0.5)), loss)
    with pytest.raises(ValueError, match=r"module '1' \(_ScaleThenDropout, parameters s\).*not reproducible"):
        eng.clipped_sum(batch, 1.0)

    # examples mixed inside a module without a rule: a privacy bug the check must see
    class Mixing(nn.Module):
        def __init__(self):
            super().__init__()
            self.s = nn.Parameter(torch.ones(4))

        def forward(self, x):
            return x * self.s - x.mean(0)

    eng = BKEngine(nn.Sequential(nn.Linear(4, 4), Mixing()), loss)
    with pytest.raises(ValueError, match=r"module '1' \(Mixing.*recomputed output differs"):
        eng.clipped_sum(batch, 1.0)


def test_generic_rule_loops_over_examples_where_vmap_cannot_and_keeps_looping():
    class Branchy(nn.Module):  # control flow on a tensor: vmap (of grad) refuses it, the loop is exact
        def __init__(self):
            super().__init__()
            self.s = nn.Parameter(torch.linspace(0.5, 1.5, 4))

        def forward(self, x):
            return x * self.s if bool(x.abs().max() > 0) else x * self.s.square()  # always the first

    torch.manual_seed(0)
    loss = lambda forward, batch: forward(batch["x"]).square().sum(1)  # noqa: E731
    model = nn.Sequential(nn.Linear(4, 4), Branchy())
    eng = _loop_check(model, loss, {"x": torch.randn(3, 4)})
    assert eng.choices["1"] == "generic:loop"
    eng = BKEngine(model, loss)
    eng.choices["1"] = "generic:loop"  # as after a first batch: no second vmap attempt
    got = eng.clipped_sum({"x": torch.randn(3, 4)}, 1.0)
    assert eng.choices["1"] == "generic:loop" and torch.isfinite(got.norms).all()
