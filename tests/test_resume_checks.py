"""Resume = run: every generator of a run is checkpointed, and after a resume the live generators are compared with
digests taken from the live generators when the checkpoint was written, so that restore code forgetting a generator
(the planted bugs below) refuses to resume instead of silently redrawing noise it already released."""

from __future__ import annotations

import logging

import pytest
import torch

from dp_adam_bench.engine import checkpoint as ckpt
from dp_adam_bench.engine import session as session_mod
from dp_adam_bench.engine.checkpoint import CheckpointError
from dp_adam_bench.engine.sampling import PoissonSampler
from dp_adam_bench.errors import PrivacyMismatch
from dp_adam_bench.privacy.mechanisms import NoiseMechanism
from dp_adam_bench.tasks import registry
from dp_adam_bench.train import train

from helpers import ON_CPU, compose_cfg, tiny_poisson

STEPS, KILL = 6, 2


@pytest.fixture
def tiny_task(monkeypatch):
    monkeypatch.setitem(registry.TASKS, "tiny", "tiny_task:TinyTask")


def overrides(name: str, *extra: str) -> list[str]:
    return tiny_poisson(name, STEPS, "train.checkpoint_every=1", ON_CPU, *extra)


def killed(name: str) -> list[str]:
    """The overrides of a run killed after step ``KILL`` (its checkpoint is that step's)."""
    base = overrides(name)
    with pytest.raises(KeyboardInterrupt):
        train(compose_cfg([*base, f"train.stop_after={KILL}"]))
    return base


def checkpoint_of(runs, name: str):
    (path,) = (runs / "runs" / name).glob(f"*/{ckpt.FILENAME}")
    return path


def forgetful_load(self, state):
    """``NoiseMechanism.load_state_dict`` with the planted bug: the step and the buffers are restored, the generator
    is not, so it stays the one the resumed process built (the run's noise seed, at step 0)."""
    self.step = int(state["step"])
    self._load_buffers(state["buffers"])


def test_an_honest_resume_passes_the_check_and_ends_where_the_uninterrupted_run_ends(
    isolated_dirs, tiny_task
):
    full = train(compose_cfg(overrides("full")))
    base = killed("killed")
    saved = torch.load(checkpoint_of(isolated_dirs, "killed"), weights_only=False)
    assert saved["step"] == KILL
    # every generator of the run, by name, each a 16-hex-digit digest
    assert set(saved["rng_fingerprints"]) == {
        "noise stream 0",
        "sampler",
        "side information",
        "check examples",
        "rank 0 global (dropout)",
    }
    assert all(len(v) == 16 for v in saved["rng_fingerprints"].values())
    assert saved["task_rng"] == [{}]  # the tiny task keeps no random state of its own
    resumed = train(compose_cfg(base))
    assert resumed["final_params_sha1"] == full["final_params_sha1"]


def test_a_restore_that_forgets_the_noise_generator_refuses_to_resume(isolated_dirs, tiny_task, monkeypatch):
    base = killed("forgot_noise")
    monkeypatch.setattr(NoiseMechanism, "load_state_dict", forgetful_load)
    with pytest.raises(
        PrivacyMismatch,
        match=r"^resume: the noise stream 0 generator after loading is not the one saved at step 2 \(saved "
        r"[0-9a-f]{16}, restored [0-9a-f]{16}\): a resumed run would redraw noise it already released; "
        r"refusing to resume$",
    ):
        train(compose_cfg(base))


def test_without_the_check_the_forgotten_generator_redraws_the_released_noise(
    isolated_dirs, tiny_task, monkeypatch
):
    """The oracle of the test above: the planted bug is real (the resumed run's first noise draw is the run's step-1
    draw again) and, the check switched off, nothing else in the run notices it (it completes, its participation
    ledger consistent)."""
    draws = []
    real_next = NoiseMechanism._draw_z

    def recording(self):
        z = real_next(self)
        draws.append(torch.cat([t.flatten() for t in z]))
        return z

    monkeypatch.setattr(NoiseMechanism, "_draw_z", recording)
    base = killed("redraws")
    assert len(draws) == KILL
    monkeypatch.setattr(NoiseMechanism, "load_state_dict", forgetful_load)
    monkeypatch.setattr(session_mod, "verify_restored_generators", lambda training, state: None)
    resumed = train(compose_cfg(base))
    assert resumed["steps"] == STEPS and resumed["participation"]["verdict"] == "consistent"
    assert len(draws) == STEPS
    # step KILL + 1 released the noise of step 1 again: the difference of the two releases is noise-free
    torch.testing.assert_close(draws[KILL], draws[0], rtol=0, atol=0)
    assert not torch.equal(draws[1], draws[0])


def test_a_restore_that_forgets_the_sampler_refuses_to_resume(isolated_dirs, tiny_task, monkeypatch):
    base = killed("forgot_sampler")
    monkeypatch.setattr(PoissonSampler, "load_state_dict", lambda self, state: None)
    with pytest.raises(
        PrivacyMismatch, match=r"^resume: the sampler generator .* draws; refusing to resume$"
    ):
        train(compose_cfg(base))


def test_a_restore_that_forgets_the_global_rng_refuses_to_resume(isolated_dirs, tiny_task, monkeypatch):
    base = killed("forgot_global")
    monkeypatch.setattr(session_mod, "_seed_global_rng", lambda ddp, seeds, payload: None)
    with pytest.raises(
        CheckpointError,
        match=r"^resume: the rank 0 global \(dropout\) generator after loading is not the one saved at step 2 "
        r".*would not continue as the uninterrupted run; refusing to resume$",
    ):
        train(compose_cfg(base))


def test_a_restore_that_forgets_the_check_examples_generator_refuses_to_resume(
    isolated_dirs, tiny_task, monkeypatch
):
    from dp_adam_bench.engine.watch import EngineWatch

    base = killed("forgot_watch")
    monkeypatch.setattr(EngineWatch, "load_state_dict", lambda self, state: None)
    with pytest.raises(CheckpointError, match=r"^resume: the check examples generator after loading"):
        train(compose_cfg(base))


def test_a_checkpoint_without_fingerprints_still_loads_and_says_so(isolated_dirs, tiny_task, caplog):
    full = train(compose_cfg(overrides("full_old")))
    base = killed("old")
    path = checkpoint_of(isolated_dirs, "old")
    payload = torch.load(path, weights_only=False)
    for key in ("rng_fingerprints", "task_rng", "watch"):  # as written before they existed
        del payload[key]
    torch.save(payload, path)
    with caplog.at_level(logging.WARNING, logger=session_mod.__name__):
        resumed = train(compose_cfg(base))
    assert resumed["final_params_sha1"] == full["final_params_sha1"]
    assert "the restored generators are not verified" in caplog.text


class AugmentingTask:
    """A task with random state of its own (``tasks/base.py``: ``rng_state`` / ``load_rng_state``)."""

    def __init__(self, seed: int):
        self.gen = torch.Generator().manual_seed(seed)
        self.loaded = []

    def rng_state(self):
        return {"augment": self.gen.get_state()}

    def load_rng_state(self, state):
        self.loaded.append(state)
        self.gen.set_state(state["augment"])


def fake_run(world: int, rank: int, task=None):
    from types import SimpleNamespace

    ddp = SimpleNamespace(world=world, rank=rank, is_main=rank == 0)
    return SimpleNamespace(ddp=ddp, task=task if task is not None else AugmentingTask(rank))


def test_each_rank_restores_its_own_task_random_state():
    saved = [fake_run(2, r).task.rng_state() for r in range(2)]
    for rank in range(2):
        run = fake_run(2, rank, AugmentingTask(99))
        assert session_mod._load_task_rng(run, {"task_rng": saved}) == []
        assert torch.equal(run.task.gen.get_state(), saved[rank]["augment"])


def test_another_number_of_ranks_restores_rank_0_and_leaves_the_others_their_stream():
    saved = [fake_run(1, 0).task.rng_state()]
    main, other = fake_run(2, 0, AugmentingTask(99)), fake_run(2, 1, AugmentingTask(99))
    assert session_mod._load_task_rng(main, {"task_rng": saved}) == []
    assert torch.equal(main.task.gen.get_state(), saved[0]["augment"])
    assert session_mod._load_task_rng(other, {"task_rng": saved}) == [] and other.task.loaded == []


def test_a_checkpoint_without_task_random_state_is_named_in_the_warning():
    run = fake_run(1, 0)
    (line,) = session_mod._load_task_rng(run, {})
    assert "no task random state" in line and "augment" in line and run.task.loaded == []
    assert (
        session_mod._load_task_rng(fake_run(1, 0, object()), {}) == []
    )  # a task without random state: silent


def test_a_task_random_state_must_be_tensors():
    class Bad(AugmentingTask):
        def rng_state(self):
            return {"augment": [1, 2]}

    with pytest.raises(TypeError, match=r"Bad\.rng_state\(\) must map names to tensors.*'augment'"):
        session_mod.task_rng_state(fake_run(1, 0, Bad(0)))
