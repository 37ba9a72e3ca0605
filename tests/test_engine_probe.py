"""Nothing gets past the engine checks (issue 32; issue 33's nn.TransformerEncoder): the engine probe
(engine/probe.py) refuses a parameter used outside the module that owns it, with the self-check on or off; the
self-check runs the bf16 autocast path training takes, and in train mode (no eval-only fast path); every engine's
clipped sum runs in IEEE fp32 whatever the TF32 settings (engine/fp32_exact.py), and the summary records them."""

import pytest
import torch
from torch import nn

from dp_adam_bench import make_private
from dp_adam_bench.engine import fp32_exact
from dp_adam_bench.engine.bk import BKEngine
from dp_adam_bench.engine.engines import build_engine
from dp_adam_bench.engine.probe import probe
from dp_adam_bench.engine.self_check import BF16_TOLERANCE
from dp_adam_bench.errors import ConfigError

CE = nn.CrossEntropyLoss(reduction="none")
KW = dict(optimizer="adam", sigma=1.0, clip=0.5, batch_size=8, steps=2, lr=0.01)


class TiedLM(nn.Module):
    """Issue 32's tied weights, written as a use of the embedding's weight in the parent's forward."""

    def __init__(self, vocab=11, d=6):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.fc = nn.Linear(d, d)

    def forward(self, tok):
        h = torch.tanh(self.fc(self.emb(tok).mean(1)))
        return h @ self.emb.weight.T


def _tokens(n=16, vocab=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    tok, y = torch.randint(0, vocab, (n, 3), generator=g), torch.randint(0, vocab, (n,), generator=g)
    return torch.utils.data.TensorDataset(tok, y)


@pytest.mark.parametrize("check", [True, False], ids=["self_check", "no_self_check"])
@pytest.mark.parametrize("engine", ["bk", "hooks", "ghost"])
def test_a_parameter_used_outside_its_module_is_refused_by_name(engine, check):
    """bk and hooks miss the use in their sums, ghost in its norms (its sum comes from a second ordinary
    backward): each is refused in one line naming the parameter and the fix, whether the self-check is on or not."""
    torch.manual_seed(0)
    with pytest.raises(ConfigError) as err:
        make_private(TiedLM(), _tokens(), CE, clipping=engine, self_check=check, **KW)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"engine probe: clipping={engine} misses part of the gradient")
    assert "parameter 'emb.weight'" in msg and "Untie it" in msg and "stopped before any noise" in msg


def test_an_engine_that_differentiates_the_whole_model_passes_the_probe():
    torch.manual_seed(0)
    private = make_private(TiedLM(), _tokens(), CE, clipping="functorch", **KW)
    assert private.self_check["max_rel_error"] < 1e-5
    private.step()
    model = TiedLM()
    eng = build_engine("loop", model, lambda f, b: CE(f(b["tok"]), b["y"]))
    tok, y = _tokens()[:4]
    record = probe(eng, {"tok": tok, "y": y})
    assert record["examples"] == 1 and record["max_rel_error"] < 1e-5 and record["seconds"] > 0
    assert all(p.grad is None for p in model.parameters())


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))


def _pairs(n=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long())


def _plant(monkeypatch, edit):
    real = BKEngine._clipped_sum

    def wrong(self, batch, clip, scale):
        out = real(self, batch, clip, scale)
        edit(out)
        return out

    monkeypatch.setattr(BKEngine, "_clipped_sum", wrong)


def test_the_probe_catches_engine_defects_it_was_not_written_for(monkeypatch):
    """A rule that drops the last layer's bias gradient from the sum is named; norms 20 % too small are found
    from one example's norm. Both with the self-check off, the only other line of defence."""
    _plant(monkeypatch, lambda out: out.summed[3].zero_())
    with pytest.raises(ConfigError, match=r"gradient of parameter '2\.bias'.* by 1 \(relative"):
        make_private(_net(), _pairs(), CE, self_check=False, **KW)
    monkeypatch.undo()
    _plant(monkeypatch, lambda out: out.norms.mul_(0.8))
    with pytest.raises(
        ConfigError, match=r"engine probe: clipping=bk reports a per-example norm .* error 0\.2\)"
    ):
        make_private(_net(), _pairs(), CE, self_check=False, **KW)


class MixUnderAutocast(nn.Module):
    """A defect only on the bf16 path: under autocast the layer mixes the examples of a batch."""

    def forward(self, h):
        return h - 3 * h.mean(0) if torch.is_autocast_enabled(h.device.type) else h


def test_under_bf16_the_self_check_runs_the_autocast_path_at_the_bf16_tolerance():
    private = make_private(_net(), _pairs(), CE, precision="bf16", **KW)
    check = private.self_check
    assert check["precision"] == "bf16" and check["tolerance"] == BF16_TOLERANCE
    # bf16-sized differences (the loop's weight gradients are rounded to bf16): the bf16 path ran, not fp32's
    assert 1e-4 < check["max_rel_error"] < BF16_TOLERANCE

    def mixing():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8), MixUnderAutocast(), nn.Tanh(), nn.Linear(8, 2))

    assert make_private(mixing(), _pairs(), CE, **KW).self_check["max_rel_error"] < 1e-5  # fp32: no mixing
    with pytest.raises(ConfigError, match=r"self-check: clipping=bk .* tolerance 0\.03125"):
        make_private(mixing(), _pairs(), CE, precision="bf16", **KW)


class PaddedEncoder(nn.Module):
    """nn.TransformerEncoder with the nested-tensor fast path on: eval mode with a padding mask takes it."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.1, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 1, enable_nested_tensor=True)
        self.out = nn.Linear(8, 3)

    def forward(self, tok, pad):
        return self.out(self.enc(self.emb(tok), src_key_padding_mask=pad).mean(1))


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("engine", ["functorch", "bk"])
def test_the_checks_take_the_training_path_of_a_transformer_encoder(engine):
    """Issue 33: the self-check in eval mode sent nn.TransformerEncoder down its nested-tensor fast path, where
    functorch crashes (aten::_nested_tensor_from_mask_left_aligned). The checks now run in train mode with dropout
    (here p = 0.1, in modules and in the attention's float attribute) set to 0, and restore both."""
    g = torch.Generator().manual_seed(0)
    tok = torch.randint(0, 20, (16, 6), generator=g)
    pad = torch.arange(6)[None] >= torch.randint(2, 7, (16,), generator=g)[:, None]
    y = torch.randint(0, 3, (16,), generator=g)
    data = [{"tok": tok[i], "pad": pad[i], "y": y[i]} for i in range(16)]
    torch.manual_seed(0)
    model = PaddedEncoder().eval()
    private = make_private(model, data, CE, target_key="y", clipping=engine, **KW)
    assert private.self_check["max_rel_error"] < 1e-5
    assert not model.training and model.enc.layers[0].dropout1.p == 0.1
    assert model.enc.layers[0].self_attn.dropout == 0.1
    private.step()


def test_every_clipped_sum_runs_in_ieee_fp32_and_restores_the_callers_settings(monkeypatch):
    """The kernels that make norms and clipped sums run without TF32 (CUDA) or oneDNN's bf16 fp32 math (CPU),
    whatever the user set (bk: its rules, after a forward and backward at the user's settings; the others: all of
    it); the user's settings are back afterwards, also after an exception."""
    from dp_adam_bench.engine import bk

    if not fp32_exact.new_api():
        pytest.skip("torch < 2.9 has the legacy allow_tf32 flags only")
    ops = fp32_exact.OPS
    user = {("cuda", "matmul"): "tf32", ("cudnn", "conv"): "tf32", ("mkldnn", "matmul"): "bf16"}
    saved = {op: fp32_exact.op(*op).fp32_precision for op in ops}
    seen, in_rules = [], []

    def loss(forward, batch):
        seen.append(fp32_exact.settings())
        return CE(forward(batch["x"]), batch["y"])

    def clip_factors(norms, clip):  # bk calls it between its rules' norms and sums
        in_rules.append(fp32_exact.settings())
        return original(norms, clip)

    original = bk.clip_factors
    monkeypatch.setattr(bk, "clip_factors", clip_factors)

    try:
        for op, value in user.items():
            fp32_exact.op(*op).fp32_precision = value
        before = fp32_exact.settings()
        assert before["cuda.matmul"] == "tf32" and before["mkldnn.matmul"] == "bf16"
        x, y = _pairs()[:4]
        for engine in ("bk", "functorch", "ghost"):
            seen.clear()
            eng = build_engine(engine, _net(), loss)
            eng.clipped_sum({"x": x, "y": y}, 0.5)
            eng.close()
            assert fp32_exact.settings() == before
            assert seen and all(s == (before if engine == "bk" else s) for s in seen)
            if engine != "bk":
                assert all(s[f"{b}.{o}"] == "ieee" for s in seen for b, o in ops)
        assert len(in_rules) == 1 and all(in_rules[0][f"{b}.{o}"] == "ieee" for b, o in ops)
        with pytest.raises(RuntimeError, match="boom"), fp32_exact.ieee_fp32():
            raise RuntimeError("boom")
        assert fp32_exact.settings() == before
    finally:
        for op, value in saved.items():
            fp32_exact.op(*op).fp32_precision = value


def test_a_non_finite_first_example_is_named_as_such_not_as_a_missed_parameter():
    x = torch.randn(4, 6)
    x[0, 0] = float("nan")
    engine = build_engine("bk", _net(), lambda forward, b: CE(forward(b["x"]), b["y"]))
    with pytest.raises(ConfigError, match=r"^engine probe: the gradient of a training example is not finite"):
        probe(engine, {"x": x, "y": torch.zeros(4, dtype=torch.long)})
