"""Checkpoints load with ``weights_only=True`` and an explicit allow-list: a planted pickle is refused without
running, plain state round-trips exactly, and nothing outside the allow-list can be written."""

import os
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from dp_adam_bench.engine import checkpoint as ckpt
from dp_adam_bench.engine.checkpoint import FILENAME, CheckpointError


class Planted:
    """Unpickling this calls ``os.system`` (what an attacker's checkpoint in a shared run folder would do)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def payload(**extra):
    gen = torch.Generator().manual_seed(3)
    return {
        "step": 4,
        "fingerprint": "f" * 40,
        "params": [torch.randn(3, 2), torch.randn(2, dtype=torch.float64)],
        "variant": {"m": [torch.zeros(3)], "t": 4, "beta": 0.9, "name": "adam", "none": None},
        "privatizer": {
            "step": 4,
            "mechanisms": [
                {
                    "name": "bandmf",
                    "step": 4,
                    "shapes": [[3, 2]],
                    "dtype": "torch.float32",
                    "generator": gen.get_state(),
                    "buffers": {"coefs": [1.0, 0.5], "ring": [torch.randn(3, 2)]},
                }
            ],
        },
        "sampler": {"kind": "poisson", "generator": gen.get_state()},
        "ledger": {"events": [{"kind": "poisson_gaussian", "sigma": 1.0, "q": 0.25, "count": 4}]},
        "diagnostics": {"t": 4, "m": None, "v": None, "norm_sum": 0.0},
        "torch_rng": torch.get_rng_state(),
        "torch_rng_ranks": [torch.get_rng_state()],
        **extra,
    }


def test_planted_checkpoint_is_refused_and_its_code_does_not_run(tmp_path):
    marker = tmp_path / "pwned"
    torch.save(payload(evil=Planted(marker)), tmp_path / FILENAME)
    with pytest.raises(CheckpointError, match=r"names posix\.system.*refusing to load it.*arbitrary code"):
        ckpt.load(tmp_path, "f" * 40)
    assert not marker.exists()
    # the oracle: the file really is live, an unrestricted load runs it
    torch.load(tmp_path / FILENAME, weights_only=False)
    assert marker.exists()


def test_plain_state_round_trips_exactly(tmp_path):
    want = payload(
        np_scalar=np.float64(0.1), np_array=np.arange(4.0), np_ints=np.array([1, 2], dtype=np.int32)
    )
    ckpt.save(tmp_path, want)
    assert not (tmp_path / "checkpoint.pt.tmp").exists()
    got = ckpt.load(tmp_path, "f" * 40)
    torch.testing.assert_close(got["params"], want["params"], rtol=0, atol=0)
    assert torch.equal(got["sampler"]["generator"], want["sampler"]["generator"])
    assert torch.equal(got["torch_rng"], want["torch_rng"])
    assert got["ledger"] == want["ledger"] and got["diagnostics"] == want["diagnostics"]
    assert got["privatizer"]["mechanisms"][0]["buffers"]["coefs"] == [1.0, 0.5]
    assert type(got["np_scalar"]) is np.float64 and got["np_scalar"] == np.float64(0.1)
    assert got["np_array"].dtype == np.float64 and np.array_equal(got["np_array"], np.arange(4.0))
    assert got["np_ints"].dtype == np.int32


@dataclass
class NotPlainData:
    x: float = 1.0


def test_save_refuses_what_load_would_refuse_and_keeps_the_previous_checkpoint(tmp_path):
    ckpt.save(tmp_path, payload())
    before = (tmp_path / FILENAME).read_bytes()
    with pytest.raises(
        CheckpointError, match=r"refusing to write.*test_checkpoint\.NotPlainData.*SAFE_GLOBALS"
    ):
        ckpt.save(tmp_path, payload(step=6, extra=NotPlainData()))
    assert (tmp_path / FILENAME).read_bytes() == before
    assert not (tmp_path / "checkpoint.pt.tmp").exists()
    assert ckpt.load(tmp_path, "f" * 40)["step"] == 4


def test_corrupt_and_missing_checkpoints(tmp_path):
    assert ckpt.load(tmp_path, "f" * 40) is None
    (tmp_path / FILENAME).write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="corrupt or unreadable.*delete it"):
        ckpt.load(tmp_path, "f" * 40)


def test_save_fsyncs_the_file_before_the_rename_and_the_folder_after(tmp_path, monkeypatch):
    """Durable as well as atomic: the bytes reach the disk before the name points at them, and the rename is
    flushed with the folder, so a machine crash right after a save leaves a whole checkpoint behind the name."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.fstat(fd).st_ino))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", os.stat(src).st_ino))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    path = ckpt.save(tmp_path, payload())
    written = path.stat().st_ino
    assert events == [("fsync", written), ("replace", written), ("fsync", tmp_path.stat().st_ino)]
    assert ckpt.load(tmp_path, "f" * 40)["step"] == 4
