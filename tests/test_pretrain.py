"""The GPT-2 pretraining stage (dp_adam_bench/pretrain/): builds once into the cache, resumes exactly after a kill,
loads with from_pretrained, refuses bad presets, and the E2E task fine-tunes it (or its architecture from scratch)."""

import json

import pytest
import torch
from safetensors.torch import load_file

from dp_adam_bench import pretrain
from dp_adam_bench.errors import ConfigError
from dp_adam_bench.paths import shared_data_dir
from dp_adam_bench.tasks.compact_vocab import CompactTokenizer, load_tokenizer

from helpers import first_abstracts

ABSTRACTS = shared_data_dir() / "arxiv_abstracts" / "arxiv_abstracts.jsonl.gz"
TOKENIZER = shared_data_dir() / "gpt2_tokenizer"
pytestmark = pytest.mark.skipif(
    not (ABSTRACTS.is_file() and TOKENIZER.is_dir()),
    reason="needs the offline arXiv abstracts and GPT-2 tokenizer",
)

TINY = {
    "n_layer": 1,
    "n_embd": 16,
    "n_head": 2,
    "n_positions": 256,
    "block_size": 16,
    "batch_size": 4,
    "steps": 6,
    "warmup_steps": 1,
    "log_every": 1,
    "eval_every": 2,
    "checkpoint_every": 2,
    "val_blocks": 4,
    "wandb": {"mode": "disabled"},
}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A cache folder and a 300-abstract data file (the first abstracts of the offline file)."""
    monkeypatch.setenv("DP_ADAM_BENCH_CACHE", str(tmp_path / "cache"))
    data = first_abstracts(tmp_path / "abstracts.jsonl.gz", 300)
    return tmp_path, {**TINY, "data_dir": str(data)}


def _weights(model_dir):
    return load_file(str(model_dir / "model.safetensors"))


def test_builds_once_and_loads_with_from_pretrained(cache):
    from transformers import GPT2LMHeadModel

    _, over = cache
    spec = pretrain.load_spec("gpt2_arxiv", over)
    model_dir = pretrain.ensure(spec)
    summary = json.loads((model_dir.parent / pretrain.SUMMARY).read_text())
    assert summary["status"] == "complete" and summary["tokens_seen"] == 6 * 4 * 16
    assert 0 < summary["val_loss"] < 9.5  # ln(8192) = 9.0 at random; finite
    assert not (model_dir.parent / pretrain.CHECKPOINT).exists()
    rows = [json.loads(r) for r in (model_dir.parent / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train_loss" in r] == [1, 2, 3, 4, 5, 6]
    lm = GPT2LMHeadModel.from_pretrained(str(model_dir))
    assert lm.config.n_layer == 1 and lm.config.vocab_size == 8192  # the preset's compact vocabulary
    assert load_tokenizer(model_dir).vocab.gpt2_ids[-1] == 50256  # saved beside the weights
    assert lm.lm_head.weight is lm.transformer.wte.weight  # tied, as GPT-2
    mtime = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert pretrain.ensure(pretrain.load_spec("gpt2_arxiv", over)) == model_dir  # cached: not trained again
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == mtime
    # watching keys do not change the model, so not the cache folder; a training key does
    assert pretrain.folder_for(pretrain.load_spec("gpt2_arxiv", {**over, "log_every": 3})) == model_dir.parent
    assert pretrain.folder_for(pretrain.load_spec("gpt2_arxiv", {**over, "seed": 1})) != model_dir.parent


def test_a_killed_build_resumes_to_the_same_weights(cache, tmp_path, monkeypatch):
    _, over = cache
    spec = pretrain.load_spec("gpt2_arxiv", {**over, "checkpoint_every": 0})
    straight = _weights(pretrain.ensure(spec))
    monkeypatch.setenv("DP_ADAM_BENCH_CACHE", str(tmp_path / "cache2"))
    with pytest.raises(pretrain.Interrupted):
        pretrain.ensure(spec, stop_after=3)  # killed after step 3 (its checkpoint written)
    folder = pretrain.folder_for(spec)
    assert (folder / pretrain.CHECKPOINT).is_file() and not pretrain.is_complete(folder)
    resumed_dir = pretrain.ensure(spec)
    summary = json.loads((folder / pretrain.SUMMARY).read_text())
    assert summary["resumed_from_step"] == 3
    resumed = _weights(resumed_dir)
    assert resumed.keys() == straight.keys()
    for k in straight:
        assert torch.equal(straight[k], resumed[k]), k
    steps = [json.loads(r)["step"] for r in (folder / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps) and steps.count(3) == 1  # the resumed run does not log step 3 twice


def test_a_corrupt_checkpoint_is_named(cache):
    _, over = cache
    spec = pretrain.load_spec("gpt2_arxiv", over)
    folder = pretrain.folder_for(spec)
    folder.mkdir(parents=True)
    (folder / pretrain.CHECKPOINT).write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match="checkpoint.pt cannot be read.*delete it"):
        pretrain.ensure(spec)


@pytest.mark.parametrize(
    "over, match",
    [
        ({"lr": float("nan")}, "lr must be a finite number > 0, got nan"),
        ({"lr": -1.0}, "lr must be a finite number > 0, got -1.0"),
        ({"steps": 0}, "steps must be an integer >= 1, got 0"),
        ({"n_head": 3}, "n_embd=16 must be divisible by n_head=3"),
        ({"block_size": 512}, "block_size=512 > n_positions=256"),
        ({"dropout": 1.5}, "dropout must be in \\[0, 1\\], got 1.5"),
        ({"warmup_steps": 6}, "warmup_steps=6 must be < steps=6"),
        ({"nlayers": 2}, "unknown key 'nlayers'; valid: "),
        ({"weight_decay": float("nan")}, "weight_decay must be in \\[0, 1\\], got nan"),
        ({"vocab_size": 256}, "vocab_size must be null .* or an integer >= 512"),
        ({"vocab_size": "8k"}, "vocab_size must be null"),
    ],
)
def test_bad_presets_are_refused_naming_the_value(over, match):
    with pytest.raises(ConfigError, match=match):
        pretrain.load_spec("gpt2_arxiv", {**TINY, **over})


def test_unknown_preset_lists_the_valid_ones():
    with pytest.raises(
        ConfigError, match="unknown pretraining preset 'gpt3'; valid: gpt2_arxiv, minilm_mlm_head"
    ):
        pretrain.load_spec("gpt3")


def test_the_from_scratch_control_does_not_build_the_pretrained_model(cache):
    """The control needs the build's vocabulary, not its weights: it derives it from the public corpus."""
    from omegaconf import OmegaConf

    from dp_adam_bench.tasks.registry import build_task

    tmp, over = cache
    base = OmegaConf.load(pretrain.PRESET_DIR.parent / "task" / "e2e_gpt2.yaml")
    base.profile = "cpu"
    base.train_subset, base.test_subset = 64, 4
    base.pretrain, base.pretrain_overrides, base.pretrained = "gpt2_arxiv", over, False
    scratch = build_task(base, trials=1, seed=0)
    assert isinstance(scratch.tokenizer, CompactTokenizer) and len(scratch.tokenizer) == 8192
    assert not (tmp / "cache" / "pretrained").exists()


@pytest.mark.slow
def test_e2e_task_fine_tunes_the_pretrained_model_or_its_architecture_from_scratch(cache):
    from omegaconf import OmegaConf

    from dp_adam_bench.tasks.registry import build_task

    _, over = cache
    base = OmegaConf.load(pretrain.PRESET_DIR.parent / "task" / "e2e_gpt2.yaml")
    base.profile = "cpu"
    base.train_subset, base.test_subset = 64, 4
    base.pretrain, base.pretrain_overrides = "gpt2_arxiv", over
    task = build_task(base, trials=1, seed=0)
    assert task.pretrained and "PRETRAINED NON-PRIVATELY" in task.data_note
    model = task.build_model()
    saved = _weights(pretrain.ensure(pretrain.load_spec("gpt2_arxiv", over)))
    wte = saved["transformer.wte.weight"]
    assert torch.equal(model.lm.transformer.wte.weight, wte)
    assert torch.equal(
        model.lm.lm_head.weight, wte
    )  # untied for DP, initialised from the embedding (Li et al.)
    assert model.lm.lm_head.weight is not model.lm.transformer.wte.weight

    base.pretrained = False
    scratch = build_task(base, trials=1, seed=0)
    assert not scratch.pretrained and "TRAINED FROM SCRATCH" in scratch.data_note
    sm = scratch.build_model()
    assert sm.lm.config.n_layer == 1 and sm.lm.config.n_embd == 16  # the preset's architecture
    assert not torch.equal(sm.lm.transformer.wte.weight, wte)
    # the preset's compact vocabulary (vocab_size), chosen by the build: the control has the same one
    for t, m in ((task, model), (scratch, sm)):
        assert isinstance(t.tokenizer, CompactTokenizer) and len(t.tokenizer) == 8192
        assert m.lm.config.vocab_size == 8192 and t.eos_id == 8191
    assert scratch.tokenizer.vocab.gpt2_ids == task.tokenizer.vocab.gpt2_ids
    mr = task.test_mrs[0]
    assert task.tokenizer.decode(task.test_mr_ids[0], clean_up_tokenization_spaces=False) == " " + mr

    mlm = OmegaConf.create(OmegaConf.to_container(base))
    mlm.pretrain, mlm.pretrain_overrides = "minilm_mlm_head", {}
    with pytest.raises(ValueError, match="is a bert_mlm_head preset; the E2E task fine-tunes a GPT-2"):
        build_task(mlm, trials=1, seed=0)

    base.model = "/somewhere"
    with pytest.raises(ValueError, match="task.model='/somewhere' and task.pretrain='gpt2_arxiv' both name"):
        build_task(base, trials=1, seed=0)


def test_cli_builds_reports_cached_and_refuses_bad_keys(cache, capsys):
    from dp_adam_bench.cli import main

    _, over = cache
    args = ["pretrain", "gpt2_arxiv", *(f"{k}={json.dumps(v)}" for k, v in over.items())]
    assert main(args) == 0
    assert "built: " in capsys.readouterr().out
    assert main(args) == 0
    assert "already built: " in capsys.readouterr().out
    assert main(["pretrain", "gpt2_arxiv", "lr=nan"]) == 2
    assert "lr must be a finite number > 0, got 'nan'" in capsys.readouterr().err
    assert main(["pretrain", "gpt2_arxiv", "lr"]) == 2
    assert "expected key=value, got 'lr'" in capsys.readouterr().err


def test_a_preset_without_a_known_kind_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(pretrain, "PRESET_DIR", tmp_path)
    (tmp_path / "nokind.yaml").write_text("name: nokind\nsteps: 3\n")
    with pytest.raises(
        ConfigError, match="pretrain nokind: kind must be one of gpt2_clm, bert_mlm_head, got None"
    ):
        pretrain.load_spec("nokind")
