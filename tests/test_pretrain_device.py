"""Pretraining's device (dp_adam_bench/pretrain/): ``device`` as ``train.device`` reads it (auto = CUDA when available,
else CPU), bad values refused in one line naming the field, inputs moved to the model's device, the device recorded in
the build's provenance, and progress lines off a terminal as a training run writes them. Checked on CPU; the CUDA
path is the same code with another device."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from test_pretrain import ABSTRACTS, TOKENIZER
from test_pretrain import TINY as TINY_PRETRAIN

from dp_adam_bench import pretrain
from dp_adam_bench.errors import ConfigError
from dp_adam_bench.paths import REPO_ROOT
from dp_adam_bench.pretrain import gpt2_clm, mlm_head
from dp_adam_bench.pretrain.common import resolve_device

from helpers import first_abstracts

needs_data = pytest.mark.skipif(
    not (ABSTRACTS.is_file() and TOKENIZER.is_dir()),
    reason="needs the offline arXiv abstracts and GPT-2 tokenizer",
)
TINY = TINY_PRETRAIN | {"log_every": 2, "eval_every": 0, "checkpoint_every": 0}
AUTO = "cuda:0" if torch.cuda.is_available() else "cpu"


def test_auto_is_cuda_when_available_else_cpu_and_cpu_is_cpu():
    assert resolve_device({"name": "p", "device": "cpu"}) == torch.device("cpu")
    assert resolve_device({"name": "p"}) == resolve_device({"name": "p", "device": "auto"})
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device({"name": "p", "device": "auto"}).type == expected
    for name in ("gpt2_arxiv", "minilm_mlm_head"):  # the presets say auto
        assert pretrain.load_spec(name)["device"] == "auto"


@pytest.mark.parametrize("value", ["meta", "gpu", "cuda:x", "cpu:0", "", 0, None])
def test_a_bad_device_is_refused_in_one_line_naming_the_field(value):
    with pytest.raises(ConfigError) as err:
        pretrain.load_spec("gpt2_arxiv", {"device": value})
    assert str(err.value) == (
        f"pretrain gpt2_arxiv: device must be one of auto, cpu, cuda, cuda:<index>, got {value!r}"
    )


def test_cuda_without_a_gpu_is_refused_naming_the_field(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(
        ConfigError, match=r"^pretrain minilm_mlm_head: device='cuda:1' but no CUDA device is "
    ):
        pretrain.load_spec("minilm_mlm_head", {"device": "cuda:1"})


def test_the_cli_refuses_a_bad_device_in_one_line(capsys):
    from dp_adam_bench.cli import main

    assert main(["pretrain", "gpt2_arxiv", "device=meta"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "error: pretrain gpt2_arxiv: device must be one of auto, cpu, cuda, cuda:<index>, got 'meta'\n"
    )


def test_the_device_is_not_part_of_the_cache_key():
    """Builds made before the field existed (no device key) are still found, and a GPU build is the same folder."""
    spec = pretrain.load_spec("gpt2_arxiv")
    older = {k: v for k, v in spec.items() if k != "device"}
    assert pretrain.spec_hash(older) == pretrain.spec_hash(spec)
    assert pretrain.folder_for({**spec, "device": "cpu"}) == pretrain.folder_for(spec)


class _Recorder(torch.nn.Module):
    """A model whose one parameter is on ``meta``: records the device of every input it is called with."""

    def __init__(self, hidden: int = 3):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1, device="meta"))
        self.hidden, self.seen = hidden, []

    def forward(self, input_ids, labels=None, **inputs):
        tensors = (input_ids, labels, *inputs.values())
        self.seen += [t.device.type for t in tensors if isinstance(t, torch.Tensor)]
        shape = (*input_ids.shape, self.hidden)
        return SimpleNamespace(
            loss=torch.tensor(2.0), last_hidden_state=torch.zeros(shape, device=input_ids.device)
        )


def test_evaluation_batches_follow_the_model_device():
    model = _Recorder()
    assert gpt2_clm.mean_loss(model, torch.zeros(5, 4, dtype=torch.long), batch_size=2) == 2.0
    assert model.seen == ["meta"] * 6  # three batches, ids and labels each on the model's device


def test_the_frozen_encoder_gets_its_inputs_on_its_device():
    import numpy as np

    encoder = _Recorder(hidden=3)
    examples = [
        (np.array([1, 2, 3]), np.array([0, 2]), np.array([7, 8])),
        (np.array([4, 5]), np.array([1]), np.array([9])),
    ]
    feats, labels = mlm_head.encode(encoder, examples, pad_id=0, batch_size=2)
    assert set(encoder.seen) == {"meta"} and len(encoder.seen) == 4  # the four BERT inputs
    assert feats.device.type == labels.device.type == "meta" and feats.shape == (3, 3)


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    monkeypatch.setenv("DP_ADAM_BENCH_CACHE", str(tmp_path / "cache"))
    return {**TINY, "data_dir": str(first_abstracts(tmp_path / "abstracts.jsonl.gz", 300))}


@needs_data
@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_a_build_runs_on_its_device_and_records_it(tiny, device):
    model_dir = pretrain.ensure(pretrain.load_spec("gpt2_arxiv", {**tiny, "device": device}))
    summary = json.loads((model_dir.parent / pretrain.SUMMARY).read_text())
    about = summary["provenance"]
    assert about["device"] == ("cpu" if device == "cpu" else AUTO)
    assert about["torch_version"] == torch.__version__ and about["cuda_version"] == torch.version.cuda
    assert summary["git_commit"] == about["git_commit"] and summary["val_loss"] > 0
    from safetensors.torch import load_file

    weights = load_file(str(model_dir / "model.safetensors"))  # saved from CPU tensors whatever the device
    assert {t.device.type for t in weights.values()} == {"cpu"}


@needs_data
@pytest.mark.slow
def test_the_cli_build_writes_progress_lines_off_a_terminal(tmp_path):
    """``dp-adam-bench pretrain`` off a terminal: a line per logged step on stderr, as a training run's (the CLI
    configures no logging: the lines must still show)."""
    data = first_abstracts(tmp_path / "abstracts.jsonl.gz", 300)
    over = [f"{k}={json.dumps(v)}" for k, v in {**TINY, "data_dir": str(data), "device": "cpu"}.items()]
    env = {**os.environ, "DP_ADAM_BENCH_CACHE": str(tmp_path / "cache"), "DP_ADAM_BENCH_PROGRESS": "lines"}
    out = subprocess.run(
        [sys.executable, "-m", "dp_adam_bench.cli", "pretrain", "gpt2_arxiv", *over],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [ln for ln in out.stderr.splitlines() if "pretrain gpt2_arxiv step " in ln]
    steps = [ln.split("pretrain gpt2_arxiv step ", 1)[1].split()[0].rstrip(":") for ln in lines]
    assert {"2/6", "4/6", "6/6"} <= set(steps), out.stderr[-2000:]
    assert any("train_loss=" in ln and "ETA" in ln for ln in lines)
    assert "pretraining gpt2_arxiv on cpu" in out.stderr
