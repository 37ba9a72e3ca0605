"""Checkpoints: everything a run needs to continue bit-identically after a kill.

Saved: step, model parameters, optimizer-variant state, the privatizer's noise-mechanism streaming state
(generators and BandMF/BLT buffers), the sampler state, the privacy ledger, the participation ledger, the
diagnostics' shadow state, torch's global RNG state (every rank's), the side-information generator, the engine
watch's state (its check-examples generator), the task's own generators (every rank's; e.g. cifar10_cnn's
augmentation, ``tasks/base.py``), a digest of every one of those generators taken from the live objects (compared
with the restored ones on resume: :func:`dp_adam_bench.engine.session.verify_restored_generators`), and a
fingerprint of the run config. Written atomically and durably: a tmp file, fsynced, renamed over the checkpoint,
then the folder fsynced (where the OS allows opening a directory), so neither a kill during a save nor a crash of
the machine after it leaves a truncated or half-written checkpoint behind the name; at worst the previous one.

Loading never runs code from the file: it unpickles with ``torch.load(weights_only=True)``, which rebuilds only
tensors, torch dtypes / sizes / devices and plain containers and scalars (dict, list, tuple, str, int, float, bool,
None), plus the numpy types in :data:`SAFE_GLOBALS`. All of the above is what a checkpoint holds: generator and RNG
states are uint8 tensors, the ledger is a dict of floats, the mechanisms' buffers are tensors and lists of floats.
A checkpoint that names any other class or function (a file planted in a shared run folder, whose pickle could
call ``os.system``) is refused, and :func:`save` refuses to write one, so a new kind of state is caught when the
first checkpoint is written rather than when a run tries to resume.

A checkpoint that cannot be read, or that was written by a different config, is refused with a message — never
silently replaced by a fresh start.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from torch.serialization import get_unsafe_globals_in_checkpoint, safe_globals

FILENAME = "checkpoint.pt"

#: Allowed beyond ``weights_only``'s built-in list: numpy scalars, dtypes and numeric arrays (numpy-computed
#: floats and coefficient arrays in mechanism state); no object arrays. Taken from the objects' own pickle
#: reductions, so the entries are whatever this numpy version writes (``numpy._core.multiarray.scalar``,
#: ``_reconstruct``, ``numpy.dtypes.Float64DType``, ...).
_NUMPY_DTYPES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
_NUMPY_DTYPES += ("float16", "float32", "float64", "complex64", "complex128")
SAFE_GLOBALS: list = [
    np.float64(0).__reduce__()[0],
    np.zeros(1).__reduce__()[0],
    np.dtype,
    np.ndarray,
    *(type(np.dtype(t)) for t in _NUMPY_DTYPES),
]


class CheckpointError(RuntimeError):
    """A checkpoint exists but cannot be used."""


def fingerprint(cfg: dict) -> str:
    """Hash of what determines the run's result (the same identity that names its folder)."""
    from dp_adam_bench.tracking.run_store import identity_hash

    return identity_hash(cfg)


def unsafe_globals(path: Path) -> list[str]:
    """The classes and functions the pickle in ``path`` names outside the allow-list (read statically, nothing
    is unpickled); empty for a good checkpoint. ValueError if ``path`` is not a ``torch.save`` zip file."""
    with safe_globals(SAFE_GLOBALS):
        return sorted(get_unsafe_globals_in_checkpoint(path))


def _reason(err: Exception) -> str:
    """One line of why torch.load failed (torch's weights_only message is a page long, and advises
    ``weights_only=False``, which is what this module exists to avoid)."""
    text = str(err)
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1].split("Check the documentation")[0]
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return f"{type(err).__name__}: {lines[0] if lines else 'no message'}"


def save(folder: Path, payload: dict) -> Path:
    """Write ``payload`` as the checkpoint of ``folder``, atomically and durably (the module docstring); refuses,
    keeping the previous checkpoint, what :func:`load` would refuse to read."""
    path = Path(folder) / FILENAME
    tmp = path.with_suffix(".pt.tmp")
    torch.save(payload, tmp)
    try:  # the loader's own check; mmap: the tensors' bytes are not read
        with safe_globals(SAFE_GLOBALS):
            torch.load(tmp, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:
        unsafe = unsafe_globals(tmp)
        tmp.unlink()
        raise CheckpointError(
            f"refusing to write checkpoint {path}: it would hold {', '.join(unsafe) or _reason(err)}, which load() "
            "refuses "
            "(weights_only). Save such state as tensors, lists or Python scalars, or, if it is plain data, add the "
            "type to dp_adam_bench.engine.checkpoint.SAFE_GLOBALS"
        ) from err
    _fsync(tmp)  # the bytes on disk before the name points at them
    os.replace(tmp, path)
    _fsync(path.parent, directory=True)  # the rename itself
    return path


def _fsync(path: Path, directory: bool = False) -> None:
    """Flush ``path`` to disk. A directory is fsynced where the OS lets one open and fsync it (POSIX; not Windows,
    nor a file system that refuses with EINVAL): elsewhere the rename is as durable as the OS makes it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        if not directory:
            raise
        return
    try:
        os.fsync(fd)
    except OSError:
        if not directory:
            raise
    finally:
        os.close(fd)


def peek(folder: Path, expected_fingerprint: str, key: str) -> tuple[int, object] | None:
    """``(step, payload[key])`` of the checkpoint in ``folder`` without reading its tensors (memory-mapped, with the
    same ``weights_only`` loader as :func:`load`); None when there is none, when it cannot be read or lacks ``key``,
    or when another configuration wrote it (:func:`load` says why when the run tries to resume from it)."""
    path = Path(folder) / FILENAME
    if not path.is_file():
        return None
    try:
        with safe_globals(SAFE_GLOBALS):
            payload = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - unusable: load() refuses it with the reason
        return None
    if (
        not isinstance(payload, dict)
        or payload.get("fingerprint") != expected_fingerprint
        or key not in payload
    ):
        return None
    return int(payload["step"]), payload[key]


def load(folder: Path, expected_fingerprint: str, device: str | torch.device = "cpu") -> dict | None:
    """The checkpoint in ``folder`` (tensors on ``device``), None if there is none; CheckpointError if unusable
    or if it holds anything but tensors, plain data and :data:`SAFE_GLOBALS`."""
    path = Path(folder) / FILENAME
    if not path.exists():
        return None
    try:
        with safe_globals(SAFE_GLOBALS):
            payload = torch.load(path, map_location=device, weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unpickling failure means the file is unusable
        try:
            unsafe = unsafe_globals(path)
        except Exception:  # noqa: BLE001 - not even a torch.save zip: reported as corrupt below
            unsafe = []
        if unsafe:
            raise CheckpointError(
                f"checkpoint {path} names {', '.join(unsafe)}, which no dp-adam-bench checkpoint holds; refusing "
                "to load it (unpickling it could run arbitrary code). If you did not put it there, treat the run "
                "folder as tampered with; delete the file to restart the run from scratch"
            ) from None
        raise CheckpointError(
            f"checkpoint {path} is corrupt or unreadable ({_reason(err)}); "
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
