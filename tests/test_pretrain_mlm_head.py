"""The bert_mlm_head pretraining kind (dp_adam_bench/pretrain/mlm_head.py) on a tiny arXiv file: the encoder stays the
pretrained MiniLM, only the head moves and lowers the held-out masked-token loss, a killed build resumes to the same
weights, and the arxiv_mlm task starts from the result (and refuses presets and splits that do not fit it)."""

import json

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from dp_adam_bench import pretrain
from dp_adam_bench.paths import CONFIG_DIR, shared_data_dir
from dp_adam_bench.tasks import text

from helpers import first_abstracts

ABSTRACTS = shared_data_dir() / "arxiv_abstracts" / "arxiv_abstracts.jsonl.gz"
MINILM = text.minilm_folder()
pytestmark = pytest.mark.skipif(
    MINILM is None or not ABSTRACTS.is_file(),
    reason="needs the [minilm] extra and the offline arXiv abstracts",
)
torch.set_num_threads(1)

SPLIT = {"split_seed": 0, "val_fraction": 0.3, "test_fraction": 0.2}
TINY = {
    **SPLIT,
    "max_length": 32,
    "corruptions": 2,
    "heldout_fraction": 0.25,
    "batch_size": 32,
    "steps": 8,
    "lr": 1.0e-2,
    "log_every": 2,
    "checkpoint_every": 0,
    "wandb": {"mode": "disabled"},
}


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    monkeypatch.setenv("DP_ADAM_BENCH_CACHE", str(tmp_path / "cache"))
    data = first_abstracts(tmp_path / "abstracts.jsonl.gz", 80)
    return {**TINY, "data_dir": str(data)}


def test_fits_the_head_only_and_lowers_the_heldout_loss(tiny):
    model_dir = pretrain.ensure(pretrain.load_spec("minilm_mlm_head", tiny))
    summary = json.loads((model_dir.parent / pretrain.SUMMARY).read_text())
    assert summary["heldout_loss"] < summary["heldout_loss_before"]
    assert (
        summary["trainable_parameters"] == 384 * 384 + 384 + 2 * 384 + 30522
    )  # dense, LayerNorm, decoder bias
    rows = [json.loads(r) for r in (model_dir.parent / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4, 6, 8]
    saved, base = (
        load_file(str(model_dir / "model.safetensors")),
        load_file(str(MINILM / "model.safetensors")),
    )
    for k, v in base.items():  # every encoder weight is MiniLM's
        key = k if k.startswith("bert.") else f"bert.{k}"
        if key in saved:
            assert torch.equal(saved[key], v), key
    assert "cls.predictions.transform.dense.weight" in saved


@pytest.mark.slow
def test_a_killed_build_resumes_to_the_same_head(tiny, tmp_path, monkeypatch):
    spec = pretrain.load_spec("minilm_mlm_head", {**tiny, "checkpoint_every": 2})
    straight = load_file(str(pretrain.ensure(spec) / "model.safetensors"))
    monkeypatch.setenv("DP_ADAM_BENCH_CACHE", str(tmp_path / "cache2"))
    with pytest.raises(pretrain.Interrupted):
        pretrain.ensure(spec, stop_after=5)
    resumed = load_file(str(pretrain.ensure(spec) / "model.safetensors"))
    assert json.loads((pretrain.folder_for(spec) / pretrain.SUMMARY).read_text())["resumed_from_step"] == 5
    for k in straight:
        assert torch.equal(straight[k], resumed[k]), k


def test_arxiv_mlm_task_starts_from_the_fitted_model(tiny):
    from dp_adam_bench.tasks.registry import build_task

    cfg = OmegaConf.load(CONFIG_DIR / "task" / "arxiv_mlm.yaml")
    cfg.profile = "cpu"
    cfg.update(SPLIT)
    cfg.data_dir, cfg.max_length, cfg.test_subset = tiny["data_dir"], 32, 6
    cfg.pretrain, cfg.pretrain_overrides = "minilm_mlm_head", tiny
    task = build_task(cfg, trials=1, seed=0)
    assert task.pretrained and "masked-LM head fitted NON-PRIVATELY" in task.data_note
    summary = json.loads(
        (pretrain.folder_for(pretrain.load_spec("minilm_mlm_head", tiny)) / "summary.json").read_text()
    )
    model = task.build_model()
    saved = load_file(
        str(pretrain.folder_for(pretrain.load_spec("minilm_mlm_head", tiny)) / "model" / "model.safetensors")
    )
    assert torch.equal(
        model.cls.predictions.transform.dense.weight, saved["cls.predictions.transform.dense.weight"]
    )
    assert (
        model.cls.predictions.decoder.weight is not model.bert.embeddings.word_embeddings.weight
    )  # untied for DP
    assert task.evaluate(model)["test_loss"] < summary["heldout_loss_before"]

    with pytest.raises(ValueError, match="task.val_fraction=0.05 differs from the minilm_mlm_head preset's"):
        build_task(OmegaConf.merge(cfg, {"val_fraction": 0.05}), trials=1, seed=0)
    other = OmegaConf.create(OmegaConf.to_container(cfg))
    other.pretrain, other.pretrain_overrides = "gpt2_arxiv", {}
    with pytest.raises(
        ValueError, match="'gpt2_arxiv' is a gpt2_clm preset; the arxiv_mlm task needs a bert_mlm_head"
    ):
        build_task(other, trials=1, seed=0)
    with pytest.raises(ValueError, match="task.pretrained=false contradicts it"):
        build_task(OmegaConf.merge(cfg, {"pretrained": False}), trials=1, seed=0)
