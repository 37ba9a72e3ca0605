"""The checks on every step behind one protocol (issue 59, dp_adam_bench/engine/observers.py): a new check is one
class and one ``add_observer`` call. Oracles: the hooks' order and arguments against the session's own step count
and ledger; a checkpoint round trip of the new check's state beside the run's own checks; a check that stops the
run before its next release, with the ledger showing no step after it."""

from __future__ import annotations

import pytest
import torch

import dp_adam_bench as dab
from dp_adam_bench.engine.observers import StepObserver
from dp_adam_bench.errors import PrivacyMismatch

from helpers import CE, tiny_data, tiny_model

ARGS = dict(optimizer="adam", clip=0.5, sigma=1.0, batch_size=16, steps=6, lr=0.01)


class Recorder(StepObserver):
    """Records every hook call; its state is the number of steps it saw."""

    name = "recorder"

    def __init__(self):
        self.calls: list[tuple] = []
        self.seen = 0

    def before_step(self, session, step):
        self.calls.append(("before_step", step, session.ledger.num_poisson_steps))

    def on_batch(self, session, idx):
        self.calls.append(("on_batch", session.steps_done, int(idx.numel())))

    def after_record(self, session, step):
        self.calls.append(("after_record", step, session.ledger.num_poisson_steps))

    def after_step(self, session, step, seconds):
        self.seen += 1
        self.calls.append(("after_step", step, seconds >= 0))

    def state_dict(self):
        return {"seen": self.seen}

    def load_state_dict(self, state, steps):
        self.seen = state["seen"] if state is not None else -steps


def private(**extra):
    _, dataset = tiny_data()
    return dab.make_private(tiny_model(), dataset, CE, **ARGS, **extra)


def test_a_new_check_sees_every_step_in_order_and_keeps_its_state_in_checkpoints(tmp_path):
    run = private()
    names = [o.name for o in run.observers]
    # the run's own checks, behind the same protocol
    assert names[:2] == ["watch", "participation"] and "noise_check" in names
    rec = Recorder()
    run.add_observer(rec)
    for _ in range(2):
        run.step()
    assert [c[0] for c in rec.calls] == ["before_step", "on_batch", "after_record", "after_step"] * 2
    # before a step nothing of it is recorded; after its record, exactly it is
    assert rec.calls[0] == ("before_step", 0, 0) and rec.calls[2] == ("after_record", 1, 1)
    assert rec.calls[4] == ("before_step", 1, 1) and rec.calls[6] == ("after_record", 2, 2)
    state = run.state_dict()
    assert state["recorder"] == {"seen": 2} and state["participation"] is not None
    torch.save(state, tmp_path / "state.pt")

    resumed = private()
    again = Recorder()
    resumed.add_observer(again)
    resumed.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=False))
    assert again.seen == 2
    older = {k: v for k, v in state.items() if k != "recorder"}  # a checkpoint from before the check existed
    third = private()
    late = Recorder()
    third.add_observer(late)
    third.load_state_dict(older)
    assert late.seen == -2  # told it is None after 2 steps
    with pytest.raises(ValueError, match="an observer named 'recorder' is already registered"):
        third.add_observer(Recorder())
    clash = Recorder()
    clash.name = "ledger"
    with pytest.raises(
        ValueError, match="an observer cannot be named 'ledger': a checkpoint keeps the run's own"
    ):
        third.add_observer(clash)


def test_a_check_that_fails_stops_the_run_before_the_next_release():
    class Stop(StepObserver):
        name = "stop_at_3"

        def after_record(self, session, step):
            if step == 3:
                raise PrivacyMismatch("stop_at_3: planted")

    run = private()
    run.add_observer(Stop())
    run.step()
    run.step()
    with pytest.raises(PrivacyMismatch, match="stop_at_3: planted"):
        run.step()
    assert run.steps_done == 3 and run.ledger.num_poisson_steps == 3
