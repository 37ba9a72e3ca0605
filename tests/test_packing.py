"""A local sweep's multiruns packed onto its workers: never more runs at once than workers, every entry with
pending runs started once, the largest first, and a failure stops what has not started."""

from __future__ import annotations

import math

import pytest

from dp_adam_bench import packing
from dp_adam_bench.packing import Entry, run_packed, start_order, with_workers


class Clock:
    """Time in poll rounds: a fake multirun with r runs on n workers ends after ceil(r / n) rounds."""

    def __init__(self):
        self.now = 0
        self.busy = 0  # workers held by the multiruns running now
        self.most = 0
        self.started: list[tuple[str, int, int]] = []  # (entry name, workers, round)

    def sleep(self, _s):
        self.now += 1
        if self.now > 1000:  # a scheduler that never frees its workers would wait for ever
            raise RuntimeError("the sweep never ended")


class FakeRun:
    def __init__(self, clock, name, runs, workers, rc):
        self.clock, self.workers, self.rc = clock, workers, rc
        self.ends = clock.now + math.ceil(runs / workers)
        clock.busy += workers
        clock.most = max(clock.most, clock.busy)
        clock.started.append((name, workers, clock.now))
        self.done = False

    def poll(self):
        if self.clock.now < self.ends:
            return None
        if not self.done:
            self.done = True
            self.clock.busy -= self.workers
        return self.rc


def _sweep(monkeypatch, pending, workers, fail=()):
    clock = Clock()
    monkeypatch.setattr(packing.time, "sleep", clock.sleep)
    entries = [Entry(("train", f"entry={i}", "hydra.launcher.n_jobs=9"), n) for i, n in enumerate(pending)]

    def start(command):
        name = command[1]
        n = int(command[2].split("=")[1])
        return FakeRun(clock, name, pending[int(name.split("=")[1])], n, 3 if name in fail else 0)

    return run_packed(entries, workers, start, poll_s=0), clock


def test_entries_run_side_by_side_never_over_the_workers(monkeypatch):
    # ganesh_fig3's shape: many entries of 2 runs (2 seeds); one after the other on 8 workers would take 12 rounds
    rc, clock = _sweep(monkeypatch, [2] * 12, workers=8)
    assert rc == 0 and clock.most == 8
    assert sorted(name for name, _, _ in clock.started) == sorted(f"entry={i}" for i in range(12))
    assert all(n == 2 for _, n, _ in clock.started)  # each gets what it can use
    assert clock.now <= 3  # 24 runs on 8 workers: 3 rounds


def test_the_largest_entry_starts_first_and_complete_entries_never_start(monkeypatch):
    rc, clock = _sweep(monkeypatch, [1, 0, 5, 2, 0, 1], workers=2)
    assert rc == 0 and clock.most <= 2
    assert clock.started[0] == ("entry=2", 2, 0)  # 5 pending: both workers while both are free
    assert {name for name, _, _ in clock.started} == {"entry=0", "entry=2", "entry=3", "entry=5"}
    assert all(n <= 2 for _, n, _ in clock.started)


def test_a_failed_multirun_stops_the_ones_not_started_and_lets_the_running_finish(monkeypatch):
    rc, clock = _sweep(monkeypatch, [3, 1, 1, 1, 1], workers=2, fail={"entry=1"})
    assert rc == 3
    # entry=0 (3 runs) on both workers for 2 rounds, then entry=1 and entry=2 side by side; entry=1 fails, so
    # entry=3 and entry=4 never start, and entry=2 finishes
    assert [name for name, _, _ in clock.started] == ["entry=0", "entry=1", "entry=2"]
    assert clock.busy == 0  # every started multirun was waited for


def test_start_order_and_worker_count_in_the_command():
    entries = [Entry(("a",), 1), Entry(("b",), 0), Entry(("c",), 4)]
    assert start_order(entries) == [2, 0]
    assert with_workers(["x", "hydra.launcher.n_jobs=8", "y"], 3) == ["x", "hydra.launcher.n_jobs=3", "y"]
    with pytest.raises(ValueError, match="not a joblib multirun"):
        with_workers(["x", "y"], 3)
    with pytest.raises(ValueError, match="workers=0"):
        run_packed(entries, 0, lambda c: None)
