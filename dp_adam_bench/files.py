"""Writing files that other processes read: all at once or not at all."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def write_atomic(path: Path, data: bytes | Callable[[BinaryIO], None]) -> None:
    """Write ``data`` (bytes, or a function writing to a binary file) through a temporary file in the same folder,
    then rename it: a failed or killed writer never leaves half a file, and concurrent readers (two runs sharing a
    cache) see the old file or the whole new one. Mode 0644: what is written here is public (data, caches)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
