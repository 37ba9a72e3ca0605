"""The run folder lock: a second launch of the same run refuses, naming the holder; a dead holder frees it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from dp_adam_bench.tracking.run_store import LOCK_FILE, RunFolder, RunLock, RunLockedError, run_id

CFG = {"optimizer": {"name": "adam", "lr": 0.1}, "noise": {"kind": "none"}, "seed": 0, "experiment_name": "x"}

HOLD = """
import sys, time
from dp_adam_bench.tracking.run_store import RunFolder
lock = RunFolder.acquire(sys.argv[1], "x", sys.argv[2])
print("locked", flush=True)
time.sleep(60)
"""


def test_a_second_open_of_the_same_run_is_refused_with_the_holder(tmp_path):
    rid = run_id(CFG)
    folder = RunFolder.create(tmp_path, "x", CFG)
    assert folder.path == tmp_path / "x" / rid and folder.lock.held
    holder = json.loads((folder.path / LOCK_FILE).read_text())
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    # another open file description, as a second process would have: refused before anything is written
    (folder.path / "config.yaml").unlink()
    with pytest.raises(RunLockedError, match=rf"locked by pid {os.getpid()} on host .*, started 20") as err:
        RunFolder.create(tmp_path, "x", CFG)
    assert isinstance(err.value, RuntimeError) and err.value.holder["pid"] == os.getpid()
    assert not (folder.path / "config.yaml").exists()
    with pytest.raises(RunLockedError):
        RunFolder.acquire(tmp_path, "x", rid)
    folder.log(1, {"loss": 1.0})
    folder.finish({"metrics": {"loss": 1.0}}, seed=0)  # releases
    assert not folder.lock.held
    again = RunFolder.create(tmp_path, "x", CFG)
    again.close()


def test_acquire_then_create_under_the_same_lock(tmp_path):
    lock = RunFolder.acquire(tmp_path, "x", run_id(CFG))
    assert not (lock.path / "config.yaml").exists()  # nothing written but the lock
    folder = RunFolder.create(tmp_path, "x", CFG, lock=lock)
    assert folder.lock is lock and (folder.path / "config.yaml").exists()
    with pytest.raises(ValueError, match="not for the run folder"):
        RunFolder.create(tmp_path, "y", CFG, lock=lock)
    folder.close()
    with RunLock.acquire(lock.path) as relock:
        assert relock.held
    assert not relock.held


def test_another_process_holds_the_lock_until_it_dies(tmp_path):
    rid = run_id(CFG)
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path), rid], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout.readline().strip() == "locked"
        with pytest.raises(RunLockedError, match=rf"locked by pid {proc.pid} on host "):
            RunFolder.create(tmp_path, "x", CFG)
    finally:
        proc.send_signal(signal.SIGKILL)  # killed: no clean-up runs, the kernel drops the flock
        proc.wait()
    deadline = time.time() + 10
    while True:
        try:
            folder = RunFolder.create(tmp_path, "x", CFG)  # a killed run can be resumed
            break
        except RunLockedError:
            if time.time() > deadline:
                raise
            time.sleep(0.05)
    assert json.loads((folder.path / LOCK_FILE).read_text())["pid"] == os.getpid()
    folder.close()
