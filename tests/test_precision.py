"""train.precision=bf16: the forward and backward under bf16 autocast, the per-example norms, clip factors and
clipped sums in fp32 (bk), against the same engine in fp32 at bf16's tolerance; the trainer path; refusals."""

import pytest
import torch
from torch import nn

from dp_adam_bench.engine.bk import BKEngine
from dp_adam_bench.engine.bk_rules import conv
from dp_adam_bench.errors import ConfigError
from dp_adam_bench.tasks import registry
from dp_adam_bench.train import train

from helpers import compose_cfg, tiny_poisson
from small_models import fresh_model, loss_per_example, make_batch

#: bf16 keeps 8 bits of mantissa: a relative error of 2^-8 ~ 4e-3 per rounding, a few roundings deep
BF16_RTOL = 3e-2


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(11, 16)
        self.enc = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(16, 5)

    def forward(self, x, tok):
        return self.head(self.enc(self.emb(tok)).mean(1))


class Convs(nn.Module):
    """Two convolutions that instantiate per-example gradients under bf16: c1 from patches, c2 (8 input channels,
    reflect padding) by the grouped kernel on a CPU (bk_rules.conv, with its minimum of output positions lowered
    to these 6 x 6 images by the test); then a head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.c1 = nn.Conv2d(2, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 2, 3, padding=1, padding_mode="reflect")
        self.head = nn.Linear(2, 5)

    def forward(self, x, tok):
        return self.head(torch.tanh(self.c2(torch.tanh(self.c1(x)))).mean((2, 3)))


@pytest.mark.parametrize("make", [fresh_model, Encoder, Convs], ids=["smallnet", "transformer", "convs"])
def test_bf16_autocast_matches_fp32_at_bf16_tolerance(make, monkeypatch):
    monkeypatch.setattr(conv, "GROUPED_MIN_POSITIONS", 1)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    batch = {k: v.to(device) for k, v in make_batch(b=8).items()}
    ref = BKEngine(make().to(device), loss_per_example).clipped_sum(batch, 0.5)
    eng = BKEngine(make().to(device), loss_per_example)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        out = eng.clipped_sum(batch, 0.5)
    assert out.norms.dtype == torch.float32 and all(s.dtype == torch.float32 for s in out.summed)
    assert torch.allclose(out.norms, ref.norms, rtol=BF16_RTOL)
    diff = torch.sqrt(sum((a - b).square().sum() for a, b in zip(out.summed, ref.summed, strict=True)))
    size = torch.sqrt(sum(b.square().sum() for b in ref.summed))
    assert float(diff / size) < BF16_RTOL
    assert float(diff) > 0  # autocast was really on: bf16 changes the numbers a little


@pytest.fixture
def tiny_task(monkeypatch):
    monkeypatch.setitem(registry.TASKS, "tiny", "tiny_task:TinyTask")


def test_a_bf16_run_trains_close_to_fp32(isolated_dirs, tiny_task):
    base = tiny_poisson("precision", 3)
    fp32 = train(compose_cfg(base))
    bf16 = train(compose_cfg([*base, "train.precision=bf16"]))
    assert bf16["steps"] == 3 and bf16["final_params_sha1"] != fp32["final_params_sha1"]
    assert bf16["metrics"]["test_loss"] == pytest.approx(fp32["metrics"]["test_loss"], rel=BF16_RTOL)


@pytest.mark.parametrize(
    "override, match",
    [
        ("train.precision=fp16", r"train\.precision='fp16'; valid: fp32, bf16"),
        ("train.clipping=ghost", r"train\.precision=bf16 is implemented for train\.clipping=bk"),
    ],
)
def test_precision_refusals_are_one_line(isolated_dirs, tiny_task, override, match):
    with pytest.raises(ConfigError, match=match):
        train(compose_cfg([*tiny_poisson("precision_bad", 2), "train.precision=bf16", override]))
