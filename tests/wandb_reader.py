"""Reads the history rows of an offline W&B run file (``run-*.wandb``), for tests.

The file is a LevelDB-style log (7-byte ':W&B' header, 32 KiB blocks, records with a 7-byte header
checksum/length/type, FULL=1 FIRST=2 MIDDLE=3 LAST=4) of protobuf ``Record`` messages. wandb >= 0.19 no longer
ships a Python reader, so this small one lets a test check what W&B would upload.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32768
HEADER = 7


def records(path: Path):
    data = Path(path).read_bytes()
    ident, _magic, _version = struct.unpack("<4sHB", data[:HEADER])
    assert ident == b":W&B", f"not a W&B run file: {path}"
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - (pos % BLOCK)
        if left < HEADER:  # block trailer padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        pos += HEADER
        chunk = data[pos : pos + length]
        pos += length
        if kind == 0 and length == 0:
            continue
        if kind == 1:
            yield chunk
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            yield pending + chunk
            pending = b""


def history(path: Path) -> list[dict]:
    from wandb.proto import wandb_internal_pb2 as pb

    rows = []
    for raw in records(path):
        rec = pb.Record()
        rec.ParseFromString(raw)
        if rec.WhichOneof("record_type") == "history":
            rows.append(
                {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in rec.history.item
                }
            )
    return rows
