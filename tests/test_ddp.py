"""Data-parallel training (torch.distributed): two ranks train the model one process trains. The ranks run with
train.device=auto, so they take gloo on the CPU unless the machine has a GPU for each of them (then NCCL); the
one-process reference runs on the device the ranks pick (``RANKS_DEVICE``), where it draws the same noise.

Each test starts its ranks as plain processes with the environment torchrun gives them (RANK, WORLD_SIZE,
MASTER_ADDR/PORT), which is what ``dp_adam_bench.engine.distributed.setup`` reads — without torchrun's agent
process, which would double the start-up cost on a small CPU box.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dp_adam_bench.engine import distributed
from dp_adam_bench.engine.checkpoint import FILENAME
from dp_adam_bench.engine.distributed import DistContext, SharedNoise, _buckets, _rank_device, setup
from dp_adam_bench.privacy.mechanisms import IndependentMechanism
from dp_adam_bench.tasks import registry
from dp_adam_bench.tracking.run_store import read_metrics
from dp_adam_bench.train import train

from helpers import compose_cfg, tiny_poisson

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with gloo is not available",
)

STEPS = 6
BASE = tiny_poisson("ddp", STEPS, "train.log_every=1", "train.clipping=bk")
# where two ranks of train.device=auto train on this machine (the library's rule): the one-process reference runs
# there too, since a CUDA noise generator draws other numbers than the CPU one
RANKS_DEVICE = f"train.device={_rank_device('auto', 0, 2).type}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int, **extra: str) -> dict:
    """The environment torchrun gives rank ``rank`` of ``world``."""
    return {
        **os.environ,
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "WANDB_MODE": "disabled",
        **extra,
    }


def start_ranks(argv: list[str], world: int, **extra: str) -> list[subprocess.Popen]:
    port = free_port()
    return [
        subprocess.Popen(
            argv,
            env=rank_env(rank, world, port, **extra),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world)
    ]


def launch(overrides: list[str], runs: Path, out: Path, world: int = 2, timeout: float = 120) -> list[dict]:
    """Run ``tests/ddp_worker.py`` as ``world`` ranks; their reports (noise draws, summary), in rank order."""
    out.mkdir(parents=True, exist_ok=True)
    procs = start_ranks(
        [sys.executable, str(TESTS / "ddp_worker.py"), *overrides],
        world,
        DP_ADAM_BENCH_RUNS=str(runs),
        DDP_TEST_OUT=str(out),
    )
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:  # a rank that failed leaves the others waiting in a collective
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (p, text) in enumerate(zip(procs, logs, strict=True)):
        assert p.returncode == 0, f"rank {rank} exited with {p.returncode}:\n{text[-4000:]}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def the_folder(runs: Path) -> Path:
    folders = [p for p in (runs / "ddp").iterdir() if p.is_dir()]
    assert len(folders) == 1, folders  # one run folder, written by rank 0
    return folders[0]


def metrics(folder: Path) -> list[dict]:
    """The logged rows, ``diag/`` keys (private_diagnostics.jsonl) merged back by step."""
    return read_metrics(folder)


@pytest.fixture(scope="module")
def one_and_two(tmp_path_factory):
    """The same config trained by one process (in this one) and by two gloo ranks; with a checkpoint at the last
    step, so the final parameters and the noise stream's state can be compared."""
    tmp = tmp_path_factory.mktemp("ddp")
    overrides = [*BASE, f"train.checkpoint_every={STEPS}"]
    draws = {"count": 0}
    original = IndependentMechanism.next

    def counting(self):
        draws["count"] += 1
        return original(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(registry.TASKS, "tiny", "tiny_task:TinyTask")
        mp.setattr(IndependentMechanism, "next", counting)
        mp.delenv("WORLD_SIZE", raising=False)
        mp.setenv("DP_ADAM_BENCH_RUNS", str(tmp / "one"))
        one = train(compose_cfg([*overrides, RANKS_DEVICE]))
    ranks = launch(overrides, tmp / "two", tmp / "out")
    return {
        "one": one,
        "one_draws": draws["count"],
        "one_folder": the_folder(tmp / "one"),
        "ranks": ranks,
        "two_folder": the_folder(tmp / "two"),
    }


@pytest.mark.slow
def test_two_ranks_train_the_model_one_process_trains(one_and_two):
    one, (rank0, rank1) = one_and_two["one"], one_and_two["ranks"]
    two = rank0["summary"]
    assert rank1["summary"] is None  # rank 1 computes but reports nothing
    # the ranks apply the same all-reduced gradient and the same broadcast noise: bit-identical replicas
    assert rank1["params_sha1"] == rank0["params_sha1"] == two["final_params_sha1"]
    assert two["world_size"] == 2 and one["world_size"] == 1 and two["steps"] == STEPS
    assert two["metrics"]["test_loss"] == pytest.approx(one["metrics"]["test_loss"], rel=1e-6)
    p1 = torch.load(one_and_two["one_folder"] / FILENAME, weights_only=False)["params"]
    p2 = torch.load(one_and_two["two_folder"] / FILENAME, weights_only=False)["params"]
    for a, b in zip(p1, p2, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    # accounting is the global sampler's: the same ledger, the same epsilon
    assert two["ledger"] == one["ledger"] and two["ledger"]["events"][0]["count"] == STEPS
    assert two["epsilon"] == one["epsilon"]
    # one folder (asserted by the_folder), logged once per step by rank 0, with the global batch statistics
    m1, m2 = metrics(one_and_two["one_folder"]), metrics(one_and_two["two_folder"])
    assert [r["step"] for r in m2] == list(range(1, STEPS + 1))
    assert [r["diag/batch_size"] for r in m2] == [r["diag/batch_size"] for r in m1]
    assert [r["diag/frac_clipped"] for r in m2] == pytest.approx([r["diag/frac_clipped"] for r in m1])
    summary = json.loads((one_and_two["two_folder"] / "summary.json").read_text())
    assert summary["status"] == "complete" and summary["world_size"] == 2


@pytest.mark.slow
def test_noise_is_drawn_once_per_logical_step(one_and_two):
    rank0, rank1 = one_and_two["ranks"]
    assert one_and_two["one_draws"] == STEPS
    assert rank0["draws"] == STEPS and rank1["draws"] == 0  # rank 0 draws, rank 1 receives
    s1 = torch.load(one_and_two["one_folder"] / FILENAME, weights_only=False)["privatizer"]
    s2 = torch.load(one_and_two["two_folder"] / FILENAME, weights_only=False)["privatizer"]
    assert s2["step"] == s1["step"] == STEPS
    ((m1,), (m2,)) = s1["mechanisms"], s2["mechanisms"]
    assert m2["step"] == m1["step"] == STEPS
    assert torch.equal(m2["generator"], m1["generator"])  # rank 0's stream advanced exactly as one process's


@pytest.mark.slow
def test_killed_two_rank_run_resumes_on_both_ranks(tmp_path):
    """stp (scale-then-privatize, with its per-step scale from the shared state) killed after step 4 by
    train.stop_after, relaunched: both ranks load the checkpoint and the run ends where one process ends."""
    overrides = [*BASE, "optimizer=stp", "train.checkpoint_every=2"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(registry.TASKS, "tiny", "tiny_task:TinyTask")
        mp.delenv("WORLD_SIZE", raising=False)
        mp.setenv("DP_ADAM_BENCH_RUNS", str(tmp_path / "one"))
        one = train(compose_cfg([*overrides, RANKS_DEVICE]))
    with pytest.raises(AssertionError, match="KeyboardInterrupt"):
        launch([*overrides, "train.stop_after=3"], tmp_path / "two", tmp_path / "killed")
    folder = the_folder(tmp_path / "two")
    assert torch.load(folder / FILENAME, weights_only=False)["step"] == 2
    rank0, rank1 = launch(overrides, tmp_path / "two", tmp_path / "resumed")
    assert rank1["params_sha1"] == rank0["params_sha1"]
    assert rank0["summary"]["metrics"]["test_loss"] == pytest.approx(one["metrics"]["test_loss"], rel=1e-6)
    assert rank0["summary"]["ledger"] == one["ledger"]
    assert [r["step"] for r in metrics(folder)] == list(range(1, STEPS + 1))


LEAVE_GROUP = """
import json, torch
from dp_adam_bench.engine import distributed
ctx = distributed.setup("auto", "cpu")
import opacus  # what building a clipping engine imports after setup; it pulls in torch.distributed.nn
t = torch.ones(3)
ctx.all_reduce_([t])
ctx.gather_objects(torch.get_rng_state())
before = distributed.gloo_threads()
distributed._destroy()  # what atexit runs
print(json.dumps({"sum": t.tolist(), "before": before, "after": distributed.gloo_threads()}))
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc to list threads")
@pytest.mark.slow
def test_leaving_the_group_joins_gloo_threads_before_interpreter_shutdown():
    """Regression: a rank exiting right after a collective aborted ("rank 1 exited with -6", "terminate called
    without an active exception") when gloo's worker threads outlived destroy_process_group, because a module
    imported after init_process_group held the default group (torch.distributed.nn's ``group=group.WORLD``
    defaults). A worker still releasing a finished collective's tensors in interpreter shutdown cannot take the
    GIL and terminates the process. Deterministic check: no gloo thread is left once the group is left."""
    procs = start_ranks([sys.executable, "-c", LEAVE_GROUP], 2)
    outs = [p.communicate(timeout=120)[0] for p in procs]
    for rank, (p, text) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, f"rank {rank} exited with {p.returncode}:\n{text[-4000:]}"
        report = json.loads(text.strip().splitlines()[-1])
        assert report["sum"] == [2.0, 2.0, 2.0]
        assert any("gloo" in name for name in report["before"])  # the check can see the threads
        assert report["after"] == [], (
            f"rank {rank}: gloo threads outlive the process group: {report['after']}"
        )


def test_setup_without_torchrun_is_one_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    ctx = setup("auto", "cpu")
    assert not ctx.active and ctx.is_main and ctx.device is None
    ctx.all_reduce_([torch.ones(3)])  # collectives are no-ops in one process
    assert ctx.broadcast_object("x") == "x" and ctx.gather_objects(1) == [1]


def _gpus(monkeypatch, n: int) -> None:
    """Pretend this machine has ``n`` visible GPUs (the device choice only, nothing is put on them)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


def test_auto_takes_nccl_gpus_only_when_every_rank_has_its_own(monkeypatch, caplog):
    """train.device=auto: a GPU per rank (cuda:LOCAL_RANK, so NCCL) when the node has one for every rank; else every
    rank on the CPU (gloo), said in one log line by local rank 0 only; no GPU at all: the CPU, silently."""
    _gpus(monkeypatch, 2)
    assert [_rank_device("auto", r, 2) for r in range(2)] == [
        torch.device("cuda", 0),
        torch.device("cuda", 1),
    ]
    assert _rank_device("cuda", 1, 2) == torch.device("cuda", 1)
    _gpus(monkeypatch, 1)
    with caplog.at_level("WARNING", logger=distributed.__name__):
        assert [_rank_device("auto", r, 2) for r in range(2)] == [torch.device("cpu")] * 2
    (line,) = [r.getMessage() for r in caplog.records]
    assert "2 ranks on this node but 1 visible GPU(s): every rank runs on the CPU with gloo" in line
    with pytest.raises(
        ValueError, match=r"train.device=cuda with 2 ranks on this node but only 1 CUDA device"
    ):
        _rank_device("cuda", 0, 2)
    caplog.clear()
    _gpus(monkeypatch, 0)
    assert _rank_device("auto", 0, 2) == torch.device("cpu") and not caplog.records


def test_distributed_off_under_torchrun_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="train.distributed=off, but .* WORLD_SIZE=2"):
        setup("off", "cpu")
    with pytest.raises(ValueError, match="train.distributed='yes'; valid: auto, off"):
        setup("yes", "cpu")


def test_buckets_group_by_dtype_and_size(monkeypatch):
    import dp_adam_bench.engine.distributed as d

    monkeypatch.setattr(d, "BUCKET_BYTES", 40)
    ts = [
        torch.zeros(4),
        torch.zeros(4),
        torch.zeros(4),
        torch.zeros(2, dtype=torch.float64),
        torch.zeros(20),
    ]
    assert [[t.numel() for t in b] for b in _buckets(ts)] == [[4, 4], [4], [2], [20]]


def test_shared_noise_of_a_single_process_is_the_mechanism():
    mech = IndependentMechanism().reset([(3,)], seed=5)
    ref = IndependentMechanism().reset([(3,)], seed=5)
    shared = SharedNoise(mech, DistContext(), [(3,)], torch.float32, "cpu")
    assert torch.equal(shared.next()[0], ref.next()[0]) and shared.step == 1
    assert shared.state_dict()["step"] == 1 and shared.variance(0) == 1.0


def test_other_ranks_hold_no_noise_state_but_know_its_variance():
    """Ranks > 0 keep an un-reset mechanism (no generator, no BandMF buffers): variance(t) is the strategy's, and a
    checkpoint tells them only how far rank 0's stream has gone."""
    from omegaconf import OmegaConf

    from dp_adam_bench.paths import CONFIG_DIR
    from dp_adam_bench.privacy.noise_factory import build_mechanisms, build_strategy

    strategy = build_strategy(OmegaConf.load(CONFIG_DIR / "noise" / "bandmf.yaml"), 20)
    (rank0,) = build_mechanisms(strategy, [(3,)], 1, 0, torch.float32)
    rank1 = SharedNoise(strategy.mechanism(), DistContext(rank=1, world=2), [(3,)], torch.float32, "cpu")
    assert rank1._gen is None and rank1.mechanism._gen is None
    assert [rank1.variance(t) for t in range(20)] == [rank0.variance(t) for t in range(20)]
    rank0.next()
    rank0.next()
    rank1.load_state_dict(rank0.state_dict())
    assert rank1.step == 2
    with pytest.raises(RuntimeError, match="only rank 0 holds"):
        rank1.state_dict()
