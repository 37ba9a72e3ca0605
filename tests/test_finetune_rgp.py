"""RGP (Yu, Zhang, Chen, Yin & Liu, ICML 2021, arXiv 2106.09352; dp_adam_bench/finetune/rgp.py) against oracles:
the original layer's output, a reference written from the paper's equations (per-example weight gradients from
autograd on the original model, projected on the carriers, clipped, noised, rebuilt with Eq. 3, plain SGD, the
power iteration redone), the explicit orthogonal projection, torch.optim.SGD at full rank, and a resumed run."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import dp_adam_bench as dab
from dp_adam_bench.engine.engines import build_engine
from dp_adam_bench.errors import ConfigError
from dp_adam_bench.finetune.rgp import (
    RGPLinear,
    RGPVariant,
    decompose,
    power_start,
    reconstruct,
    reparametrize,
    rgp_layers,
)
from dp_adam_bench.optim.adam import Adam, AdamBC
from dp_adam_bench.optim.base import StepContext
from dp_adam_bench.optim.sgd import SGD

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CE = nn.CrossEntropyLoss(reduction="none")


def mlp(seed: int = 0, dims=(4, 5, 5, 3), device=DEVICE) -> nn.Sequential:
    """Two hidden nn.Linear layers and a head: RGP reparametrizes the two and trains the head as it is."""
    torch.manual_seed(seed)
    a, b, c, d = dims
    return nn.Sequential(nn.Linear(a, b), nn.Tanh(), nn.Linear(b, c), nn.Tanh(), nn.Linear(c, d)).to(device)


def data(n: int = 6, d_in: int = 4, classes: int = 3, seed: int = 1, device=DEVICE) -> dict:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    return {"x": x.to(device), "y": y.to(device)}


def loss_per_example(forward, batch):
    return CE(forward(batch["x"]), batch["y"])


def trainable(model: nn.Module) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


# --- the reparametrized layer ---------------------------------------------------------------------------------------
def layer_bias(layer: nn.Module) -> torch.Tensor:
    return layer.bias.detach() if layer.bias is not None else torch.zeros((), device=layer.weight.device)


def assert_within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> None:
    """|got - want| <= bound elementwise, naming the worst element."""
    excess = ((got - want).abs() - bound).detach()
    i = int(excess.argmax())
    assert float(excess.reshape(-1)[i]) <= 0, (
        f"{int((excess > 0).sum())} of {excess.numel()} elements beyond the rounding bound; worst: "
        f"{float(got.reshape(-1)[i])} against {float(want.reshape(-1)[i])}, bound {float(bound.reshape(-1)[i]):.3g}"
    )


def test_rgp_linear_computes_the_original_linear_and_conv1d():
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    linear = nn.Linear(7, 5).to(DEVICE)
    conv = Conv1D(5, 7).to(DEVICE)  # GPT-2's: y = x W + b, W of shape (7, 5)
    nn.init.normal_(conv.weight)
    nn.init.normal_(conv.bias)
    for layer, weight in ((linear, linear.weight), (conv, conv.weight.T)):
        x = torch.randn(4, 3, 7, device=weight.device)
        rgp = RGPLinear(layer, rank=3)
        L, R, W_res = rgp.carrier_L.weight, rgp.carrier_R.weight, rgp.residual.weight
        # A bound from float32 rounding, not a fixed atol (1e-6 failed on one CPU: 1.9e-6 on outputs of scale 12).
        # W~ = W - L R rounds each weight once; x W~^T, (x R^T) L^T and the reference x W^T sum at most d_in + rank
        # products, each within gamma_n |a||b| <= n (eps / 2) |a||b| of exact in any summation order (Higham,
        # Accuracy and Stability of Numerical Algorithms, Sec. 3.1), with |W| <= |W~| + |L||R|. So the two sides
        # differ by less than (d_in + rank + 2) eps (|x||W~|^T + |x||R|^T|L|^T + |b|) on every CPU and BLAS, while a
        # wrong residual or carrier is off by O(|x||W|).
        n = x.shape[-1] + rgp.rank + 2
        eps = torch.finfo(x.dtype).eps
        scale = x.abs() @ W_res.abs().T + (x.abs() @ R.abs().T) @ L.abs().T + layer_bias(layer).abs()
        assert_within(rgp(x), layer(x), n * eps * scale)
        assert_within(rgp.weight(), weight, (rgp.rank + 2) * eps * (W_res.abs() + L.abs() @ R.abs()))
        eye = torch.eye(3, device=weight.device)
        torch.testing.assert_close(L.T @ L, eye, atol=1e-5, rtol=0)  # Algorithm 2: orthonormal carriers
        torch.testing.assert_close(R @ R.T, eye, atol=1e-5, rtol=0)
        assert not rgp.residual.weight.requires_grad and not rgp.residual.bias.requires_grad
        assert rgp.carrier_L.weight.shape == (5, 3) and rgp.carrier_R.weight.shape == (3, 7)


def test_reparametrize_targets_all_but_the_head_and_trains_carriers_and_head():
    model = mlp()
    summary = reparametrize(model, {"rank": 2})
    assert summary["layers"] == ["0", "2"] and summary["heads"] == ["4"]
    assert summary["rank"] == 2 and summary["power_iters"] == 1
    assert summary["carrier_params"] == 2 * (4 + 5) + 2 * (5 + 5)
    assert summary["reparametrized_params"] == 5 * 4 + 5 * 5
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names == [
        "0.carrier_R.weight",
        "0.carrier_L.weight",
        "2.carrier_R.weight",
        "2.carrier_L.weight",
        "4.weight",
        "4.bias",
    ]


def test_reparametrize_finds_gpt2_blocks_and_leaves_the_lm_head_frozen():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_embd=8, n_head=2, n_positions=16, vocab_size=20)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg).eval().to(DEVICE)
    ref = copy.deepcopy(model)
    summary = reparametrize(model, {})
    per_block = ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"]
    assert summary["layers"] == [f"transformer.h.{i}.{n}" for i in range(2) for n in per_block]
    assert summary["rank"] == 1 and summary["heads"] == []
    assert all("carrier_" in n for n, p in model.named_parameters() if p.requires_grad)
    ids = torch.randint(0, 20, (2, 5), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    torch.testing.assert_close(model(ids).logits, ref(ids).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_reparametrize_bert_trains_the_classifier_made_for_the_task(family):
    """BERT / RoBERTa for sequence classification: the six linear layers of every block reparametrized, the task's
    classifier trained as it is (RoBERTa's has two layers), the pooler, embeddings, norms and biases frozen; the
    bk engine's per-example norms of the carriers and classifier equal the size-one loop's."""
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        RobertaConfig,
        RobertaForSequenceClassification,
    )

    config, cls = {
        "bert": (BertConfig, BertForSequenceClassification),
        "roberta": (RobertaConfig, RobertaForSequenceClassification),
    }[family]
    cfg = config(
        vocab_size=30, hidden_size=8, num_hidden_layers=2, num_attention_heads=2, intermediate_size=16,
        max_position_embeddings=32, num_labels=3,
    )  # fmt: skip
    torch.manual_seed(0)
    model = cls(cfg).eval().to(DEVICE)
    ref = copy.deepcopy(model)
    summary = reparametrize(model, {"rank": 2})
    assert len(summary["layers"]) == 12 and summary["heads"] == ["classifier"]
    others = [n for n, p in model.named_parameters() if p.requires_grad and "carrier_" not in n]
    assert others and all(n.startswith("classifier.") for n in others)
    ids = torch.randint(3, 30, (5, 7), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, atol=1e-5, rtol=1e-5)

    def loss(forward, batch):
        return CE(forward(input_ids=batch["ids"]).logits, batch["y"])

    batch = {"ids": ids, "y": torch.tensor([0, 1, 2, 0, 1], device=DEVICE)}
    norms = {}
    for name in ("bk", "loop"):
        engine = build_engine(name, model, loss)
        norms[name] = engine.clipped_sum(batch, 1.0).norms
        engine.close()
    torch.testing.assert_close(norms["bk"], norms["loop"], rtol=1e-4, atol=1e-7)


# --- Eq. 3 on its own -----------------------------------------------------------------------------------------------
def carriers(d_out: int, d_in: int, r: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    delta = torch.randn(d_out, d_in, generator=g, dtype=torch.float64)
    return decompose(delta, r, 2, torch.randn(d_in, r, generator=g, dtype=torch.float64))


def test_reconstruction_returns_a_gradient_in_the_carriers_span_exactly():
    L, R = carriers(6, 5, 2)
    M = torch.randn(2, 2, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    G = L @ M @ R
    torch.testing.assert_close(reconstruct(G @ R.T, L.T @ G, L, R), G, atol=1e-12, rtol=0)


def test_reconstruction_is_the_orthogonal_projection_on_LA_plus_BR():
    """Eq. 3 from dL = G R^T and dR = L^T G equals the least-squares projection of G on {L A + B R} (a spanning set
    of vec(L E_ab) and vec(E_cd R), pseudo-inverse), for G not in it; the sign of the L L^T (dL) R term matters."""
    d_out, d_in, r = 6, 5, 2
    L, R = carriers(d_out, d_in, r)
    G = torch.randn(d_out, d_in, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    span = []
    for a in range(r):
        for b in range(d_in):
            e = torch.zeros(r, d_in, dtype=torch.float64)
            e[a, b] = 1
            span.append((L @ e).flatten())
    for c in range(d_out):
        for d in range(r):
            e = torch.zeros(d_out, r, dtype=torch.float64)
            e[c, d] = 1
            span.append((e @ R).flatten())
    basis = torch.stack(span, dim=1)
    projection = (basis @ torch.linalg.pinv(basis) @ G.flatten()).reshape(d_out, d_in)
    rebuilt = reconstruct(G @ R.T, L.T @ G, L, R)
    torch.testing.assert_close(rebuilt, projection, atol=1e-10, rtol=0)
    plus = (G @ R.T) @ R + L @ (L.T @ G) + L @ L.T @ (G @ R.T) @ R
    assert (plus - projection).abs().max() > 1e-3


# --- against a reference written from the paper ---------------------------------------------------------------------
def forward64(x, weights, biases, head):
    h = x
    for w, b in zip(weights, biases, strict=True):
        h = torch.tanh(h @ w.T + b)
    return h @ head[0].T + head[1]


def gram_schmidt(m: torch.Tensor) -> torch.Tensor:
    """Algorithm 2's orthonormalization, column by column (the authors' ``orthogonalize``)."""
    m = m.clone()
    for i in range(m.shape[1]):
        m[:, i] /= m[:, i].norm()
        m[:, i + 1 :] -= m[:, i : i + 1] * (m[:, i : i + 1] * m[:, i + 1 :]).sum(0)
    return m


def power_method(delta: torch.Tensor, start: torch.Tensor, iters: int = 1):
    right = start
    for _ in range(iters):
        left = gram_schmidt(delta @ right)
        right = gram_schmidt(delta.T @ left)
    return left, right.T


class Reference:
    """RGP as the paper writes it, in float64, on the original (not reparametrized) MLP, with plain SGD."""

    def __init__(self, model: nn.Sequential, rank: int, seed: int, lr: float, clip: float | None):
        def grab(t):
            return t.detach().to(torch.float64).clone()

        self.W = [grab(model[i].weight) for i in (0, 2)]
        self.b = [grab(model[i].bias) for i in (0, 2)]
        self.head = [grab(model[4].weight), grab(model[4].bias)]
        self.rank, self.seed, self.lr, self.clip = rank, seed, lr, clip
        # the first carriers: the power iteration on W_0 from reparametrize's start (seed 0, step 1)
        self.LR = [self._carriers(W, 0, 1, k) for k, W in enumerate(self.W)]

    def _carriers(self, W, seed, step, k):
        start = power_start(W.shape[1], self.rank, seed, step, k).to(W)
        return power_method(W, start)

    def step(self, t: int, batch: dict, noise: list[torch.Tensor] | None, sigma: float, B: float) -> None:
        device = self.W[0].device
        x, y = batch["x"].to(device, torch.float64), batch["y"].to(device)
        flat = []
        for i in range(len(y)):  # each example's gradient from autograd on the original model
            Ws = [W.clone().requires_grad_(True) for W in self.W]
            head = [h.clone().requires_grad_(True) for h in self.head]
            loss = nn.functional.cross_entropy(forward64(x[i : i + 1], Ws, self.b, head), y[i : i + 1])
            gW = torch.autograd.grad(loss, Ws + head)
            parts = []
            for (L, R), G in zip(self.LR, gW[:2], strict=True):
                # Eq. 2: dR_i and dL_i, in the model's order (carrier_R, then carrier_L)
                parts += [L.T @ G, G @ R.T]
            parts += list(gW[2:])
            norm = torch.sqrt(sum((p * p).sum() for p in parts))
            factor = 1.0 if self.clip is None else min(1.0, self.clip / float(norm))
            flat.append([p * factor for p in parts])
        summed = [sum(ps) for ps in zip(*flat, strict=True)]
        if noise is not None:
            summed = [s + sigma * self.clip * z.to(torch.float64) for s, z in zip(summed, noise, strict=True)]
        noisy = [s / B for s in summed]
        for k, (L, R) in enumerate(self.LR):
            dR, dL = noisy[2 * k], noisy[2 * k + 1]
            dW = dL @ R + L @ dR - L @ L.T @ dL @ R  # Eq. 3, literally
            self.W[k] = self.W[k] - self.lr * dW
        self.head = [h - self.lr * g for h, g in zip(self.head, noisy[4:], strict=True)]
        self.LR = [self._carriers(W, self.seed, t + 1, k) for k, W in enumerate(self.W)]


def test_harness_matches_the_paper_reference_with_clipping_and_noise():
    """The bk engine's clipped sum of per-example carrier gradients and RGPVariant(SGD) against the reference, three
    steps (so the power-iteration refresh is checked twice), the same noise tensors added to both; C small enough
    that examples are clipped."""
    model = mlp()
    ref = Reference(model, rank=2, seed=7, lr=0.5, clip=0.3)
    reparametrize(model, {"rank": 2})
    engine = build_engine("bk", model, loss_per_example)
    variant = RGPVariant(SGD(lr=0.5), model, seed=7)
    params = trainable(model)
    state = variant.init(params)
    sigma, B = 0.7, 6.0
    g = torch.Generator().manual_seed(3)
    clipped = 0
    for t in (1, 2, 3):
        batch = data(seed=10 + t)
        noise = [torch.randn(p.shape, generator=g).to(DEVICE) for p in params]
        cs = engine.clipped_sum(batch, 0.3)
        clipped += int((cs.norms > 0.3).sum())
        noisy = [(s + sigma * 0.3 * z) / B for s, z in zip(cs.summed, noise, strict=True)]
        ctx = StepContext(t, noisy, sigma * 0.3 / B, (sigma * 0.3 / B) ** 2, sigma, 0.3, B)
        with torch.no_grad():
            variant.update(params, state, ctx)
        ref.step(t, batch, noise, sigma, B)
        tensors = dict(variant.trained_tensors())
        for k, name in enumerate(("0", "2")):
            torch.testing.assert_close(tensors[f"{name}.weight"].double(), ref.W[k], rtol=1e-5, atol=1e-6)
            layer = model.get_submodule(name)
            torch.testing.assert_close(layer.carrier_L.weight.double(), ref.LR[k][0], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(layer.carrier_R.weight.double(), ref.LR[k][1], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(layer.weight().double(), ref.W[k], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(tensors["4.weight"].double(), ref.head[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(tensors["4.bias"].double(), ref.head[1], rtol=1e-5, atol=1e-6)
    assert clipped > 0


def test_make_private_rgp_matches_the_paper_reference_without_noise():
    """The same reference against make_private(finetune='rgp', optimizer='sgd', noise='none'): the whole batch of 6
    each step (single_pass), no clipping; the power iteration's starts from the variant's seed."""
    model = mlp()
    batch = data(device="cpu")
    dataset = torch.utils.data.TensorDataset(batch["x"], batch["y"])
    ref_model = copy.deepcopy(model)
    private = dab.make_private(
        model, dataset, CE, optimizer="sgd", noise="none", lr=0.5, sampler="single_pass", batch_size=6, epochs=3,
        finetune="rgp", finetune_args={"rank": 2},
    )  # fmt: skip
    assert [n for n, _ in rgp_layers(model)] == ["0", "2"]
    ref = Reference(ref_model, rank=2, seed=private.variant.seed, lr=0.5, clip=None)
    for t in (1, 2, 3):
        private.step()
        ref.step(t, batch, None, 0.0, 6.0)
        tensors = dict(private.variant.trained_tensors())
        for k, name in enumerate(("0", "2")):
            torch.testing.assert_close(tensors[f"{name}.weight"].double(), ref.W[k], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(tensors["4.weight"].double(), ref.head[0], rtol=1e-5, atol=1e-6)


def test_full_rank_without_noise_or_clipping_is_torch_sgd():
    """r = min(d_in, d_out) for every target: L (or R) is square and orthogonal, so {L A + B R} is every matrix and
    Eq. 3 returns the gradient itself; without noise and clipping the rebuilt gradient of W is the mean gradient of
    the original model's loss, and W~ + L R = W keeps the forward pass the original one. So RGP with SGD (momentum
    too) must be torch.optim.SGD on the original model's reparametrized weights and head (the targets' biases are
    frozen by RGP, and in the reference), up to float rounding."""
    model = mlp(dims=(4, 6, 4, 3))  # 6 x 4 and 4 x 6: rank 4 is full for both
    ref = copy.deepcopy(model)
    batch = data(n=8, device="cpu")
    dataset = torch.utils.data.TensorDataset(batch["x"], batch["y"])
    private = dab.make_private(
        model, dataset, CE, optimizer="sgd", noise="none", lr=0.3, optimizer_args={"momentum": 0.9},
        sampler="single_pass", batch_size=8, epochs=4, finetune="rgp", finetune_args={"rank": 4},
    )  # fmt: skip
    for i in (0, 2):
        ref[i].bias.requires_grad_(False)
    opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.3, momentum=0.9)
    x, y = batch["x"].to(DEVICE), batch["y"].to(DEVICE)
    for _ in range(4):
        private.step()
        opt.zero_grad()
        nn.functional.cross_entropy(ref(x), y).backward()
        opt.step()
    tensors = dict(private.variant.trained_tensors())
    for i in (0, 2):
        torch.testing.assert_close(tensors[f"{i}.weight"], ref[i].weight.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(model[i].weight(), ref[i].weight.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model[i].residual.bias, ref[i].bias.detach(), rtol=0, atol=0)
    torch.testing.assert_close(model[4].weight, ref[4].weight, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model[4].bias, ref[4].bias, rtol=1e-5, atol=1e-6)


# --- refusals -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args, says",
    [
        ({"rank": 0}, "rank=0"),
        ({"rank": 1.5}, "rank=1.5"),
        ({"rank": 6}, "rank=6 (rgp) exceeds min(d_in, d_out) = 4"),
        ({"power_iters": 0}, "power_iters=0"),
        ({"targets": ["nope"]}, "'nope'"),
        ({"ranks": 2}, "finetune_args.ranks"),
    ],
)
def test_bad_settings_are_one_line_errors_and_leave_the_model_alone(args, says):
    model = mlp(dims=(4, 6, 4, 3))
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ConfigError) as err:
        reparametrize(model, args)
    assert says in str(err.value) and "\n" not in str(err.value)
    assert not rgp_layers(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_model_without_a_layer_to_reparametrize_is_refused_naming_it():
    class OnlyConv(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv1d(2, 3, 2)

    class JustAHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 2)

    for model in (OnlyConv(), JustAHead()):
        with pytest.raises(ConfigError, match=f"{type(model).__name__} has no nn.Linear") as err:
            reparametrize(model, {})
        assert "\n" not in str(err.value)


def test_variants_that_need_isotropic_noise_on_their_tensors_are_refused():
    model = mlp()
    reparametrize(model, {"rank": 2})
    with pytest.raises(ConfigError) as err:
        RGPVariant(AdamBC(lr=0.1), model, seed=0)
    text = str(err.value)
    assert "optimizer.name='adambc'" in text and "noise variance" in text and "\n" not in text
    assert "RGP works with adagrad_pp, adam, adamw, sgd" in text
    for name in ("ime", "stp", "noiseless_precond", "side_info", "bc"):
        from dp_adam_bench.optim.registry import build_variant

        with pytest.raises(ConfigError, match=f"optimizer.name='{name}'"):
            RGPVariant(build_variant(name, lr=0.1), model, seed=0)


# --- checkpoints ----------------------------------------------------------------------------------------------------
def run_steps(model, variant, state, steps, clip=0.5, sigma=1.0, B=6.0):
    engine = build_engine("bk", model, loss_per_example)
    params = trainable(model)
    for t in steps:
        if variant.scale(state) is not None:  # as the session: once per step, before the forward pass
            raise AssertionError("RGP wraps no scale-then-privatize variant")
        g = torch.Generator().manual_seed(100 + t)
        cs = engine.clipped_sum(data(seed=t, device="cpu"), clip)
        noisy = [(s + sigma * clip * torch.randn(s.shape, generator=g)) / B for s in cs.summed]
        with torch.no_grad():
            variant.update(params, state, StepContext(t, noisy, sigma * clip / B, 0.0, sigma, clip, B))
    engine.close()


def fresh(seed_model=0):
    model = mlp(seed_model, device="cpu")
    reparametrize(model, {"rank": 2, "warmup_steps": 1})  # W_t - W_0 from step 2: "origin" is in the state
    variant = RGPVariant(Adam(lr=0.05), model, seed=11)
    return model, variant, variant.init(trainable(model))


def test_a_resumed_run_continues_bit_for_bit(tmp_path):
    """Two steps, the carriers (the checkpoint's parameters) and the variant state through torch.save and a
    weights_only load, into a fresh model and variant, two more steps == four uninterrupted steps, bit for bit
    (CPU): the reparametrized weights W, the residuals W~, the carriers and Adam's moments."""
    straight, v1, s1 = fresh()
    run_steps(straight, v1, s1, (1, 2, 3, 4))

    first, v2, s2 = fresh()
    run_steps(first, v2, s2, (1, 2))
    saved = {"params": [p.detach().clone() for p in trainable(first)], "variant": s2}
    torch.save(saved, tmp_path / "state.pt")
    loaded = torch.load(tmp_path / "state.pt", weights_only=True)
    assert set(loaded["variant"]) == {"weight", "inner", "step", "origin"} and loaded["variant"]["step"] == 2

    resumed, v3, _ = fresh()
    with torch.no_grad():
        for p, q in zip(trainable(resumed), loaded["params"], strict=True):
            p.copy_(q)
    state = loaded["variant"]
    run_steps(resumed, v3, state, (3, 4))  # scale(state) writes W~ = W - L R before the first forward pass

    for a, b in zip(straight.state_dict().values(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    for (n, a), (_, b) in zip(v1.trained_tensors(), v3.trained_tensors(), strict=True):
        assert torch.equal(a, b), n
    for a, b in zip(s1["inner"]["v"], state["inner"]["v"], strict=True):
        assert torch.equal(a, b)


def test_decay_mask_of_the_trained_tensors_maps_to_weights_and_head():
    """The trainer sets the mask (over carriers and head) on the variant it builds, before wrapping it: a weight W
    decays with its carriers, the head's bias keeps its own (bias_and_norm) entry."""
    from dp_adam_bench.optim.decay import decay_mask

    model = mlp(device="cpu")
    reparametrize(model, {"rank": 2})
    inner = SGD(lr=0.1, weight_decay=0.5, weight_decay_mode="decoupled")
    inner.decay_mask = decay_mask(model, trainable(model), "bias_and_norm")
    variant = RGPVariant(inner, model, seed=0)
    assert variant.decay_mask == [True, True, True, True, True, False]
    state = variant.init(trainable(model))
    bias = model[4].bias.detach().clone()
    zeros = [torch.zeros_like(p) for p in trainable(model)]
    weights = [w.clone() for w in state["weight"]]
    with torch.no_grad():
        variant.update(trainable(model), state, StepContext(1, zeros, 0.0, 0.0, 0.0, None, 6.0))
    assert inner.decay_mask == [True, True, True, False]
    for w, w0 in zip(state["weight"], weights, strict=True):
        torch.testing.assert_close(w, w0 * (1 - 0.1 * 0.5))
    assert torch.equal(model[4].bias, bias)


def test_make_private_state_dict_resume_is_exact(tmp_path):
    """The session's own checkpoint state (parameters = carriers and head, the variant's state with the weights W):
    2 steps, torch.save, a weights_only load into a fresh model and make_private, 2 more steps == 4 uninterrupted
    steps, bit for bit on the CPU, Adam with warm-up history switching to W_t - W_0, noise and clipping on."""
    g = torch.Generator().manual_seed(5)
    dataset = torch.utils.data.TensorDataset(
        torch.randn(24, 4, generator=g), torch.randint(0, 3, (24,), generator=g)
    )
    args = dict(
        optimizer="adam", lr=0.05, noise="independent", sigma=1.0, clip=0.5, batch_size=8, steps=4,
        finetune="rgp", finetune_args={"rank": 2, "warmup_steps": 2},
    )  # fmt: skip
    straight_model = mlp(device="cpu")
    straight = dab.make_private(straight_model, dataset, CE, **args)
    for _ in range(4):
        straight.step()

    first = dab.make_private(mlp(device="cpu"), dataset, CE, **args)
    for _ in range(2):
        first.step()
    torch.save(first.state_dict(), tmp_path / "state.pt")
    resumed_model = mlp(device="cpu")
    resumed = dab.make_private(resumed_model, dataset, CE, **args)
    resumed.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    while not resumed.done:
        resumed.step()
    for (n, a), (_, b) in zip(
        straight_model.state_dict().items(), resumed_model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), n
    for (n, a), (_, b) in zip(
        straight.variant.trained_tensors(), resumed.variant.trained_tensors(), strict=True
    ):
        assert torch.equal(a, b), n
