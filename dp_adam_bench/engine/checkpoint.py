"""Checkpoints: everything a run needs to continue bit-identically after a kill.

Saved: step, model parameters, optimizer-variant state, the privatizer's noise-mechanism streaming state
(generators and BandMF/BLT buffers), the sampler state, the privacy ledger, the diagnostics' shadow state, torch's
global RNG state, and a fingerprint of the run config. Written atomically (tmp file + rename), so a kill during a
save leaves the previous checkpoint intact.

A checkpoint that cannot be read, or that was written by a different config, is refused with a message — never
silently replaced by a fresh start.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

FILENAME = "checkpoint.pt"


class CheckpointError(RuntimeError):
    """A checkpoint exists but cannot be used."""


def fingerprint(cfg: dict) -> str:
    """Hash of what determines the run's result (the same identity that names its folder)."""
    from dp_adam_bench.tracking.run_store import identity_hash

    return identity_hash(cfg)


def save(folder: Path, payload: dict) -> Path:
    path = Path(folder) / FILENAME
    tmp = path.with_suffix(".pt.tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)
    return path


def load(folder: Path, expected_fingerprint: str, device: str | torch.device = "cpu") -> dict | None:
    """The checkpoint in ``folder`` (tensors on ``device``), None if there is none; CheckpointError if unusable."""
    path = Path(folder) / FILENAME
    if not path.exists():
        return None
    try:
        payload = torch.load(path, map_location=device, weights_only=False)
    except Exception as err:  # noqa: BLE001 - any unpickling failure means the file is unusable
        raise CheckpointError(
            f"checkpoint {path} is corrupt or unreadable ({type(err).__name__}: {err}); "
            "delete it to restart the run from scratch, or restore a good copy"
        ) from err
    if not isinstance(payload, dict) or "fingerprint" not in payload or "step" not in payload:
        raise CheckpointError(f"checkpoint {path} is not a dp-adam-bench checkpoint (missing fields)")
    if payload["fingerprint"] != expected_fingerprint:
        raise CheckpointError(
            f"checkpoint {path} was written by a different configuration (fingerprint "
            f"{payload['fingerprint'][:8]} != {expected_fingerprint[:8]}); refusing to resume. Delete it to restart, "
            "or run with the configuration that wrote it"
        )
    return payload
