"""Which command wrote each CSV: ``results_provenance.json``, and the README line that names it.

``run_all.py`` records every successful run (command, BENCH_THREADS, finish time, wall time, sha256 of the CSV).
The README trusts an entry only while the CSV's sha256 still matches; otherwise it says the command was not
recorded and dates the CSV by its rows (or the file's mtime).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
from pathlib import Path

import pandas as pd

PROVENANCE = "results_provenance.json"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def load_provenance(bench_dir: Path) -> dict:
    f = bench_dir / PROVENANCE
    try:
        return json.loads(f.read_text()) if f.is_file() else {}
    except (OSError, json.JSONDecodeError):
        return {}


def record_provenance(bench_dir: Path, csv: str, command: str, wall_s: float, via: str = "") -> None:
    prov = load_provenance(bench_dir)
    path = bench_dir / csv
    prov[csv] = {
        "command": command,
        "via": via,
        "bench_threads": os.environ.get("BENCH_THREADS", "2 (default)"),
        "finished": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "wall_s": round(wall_s, 1),
        "sha256": sha256(path) if path.is_file() else None,
    }
    (bench_dir / PROVENANCE).write_text(json.dumps(prov, indent=2, sort_keys=True) + "\n")


def provenance_line(
    bench_dir: Path, csv: str, prov: dict, df: pd.DataFrame | None, default_command: str
) -> str:
    """The README's line above a CSV's table: the recorded command, or when the rows are from and
    ``default_command``."""
    path = bench_dir / csv
    entry = prov.get(csv)
    if entry and path.is_file() and entry.get("sha256") == sha256(path):
        return (
            f"Produced by `{entry['command']}`"
            + (f" (run by `{entry['via']}`)" if entry.get("via") else "")
            + f", BENCH_THREADS={entry['bench_threads']}, finished "
            f"{entry['finished']}, took {entry['wall_s']:.0f} s."
        )
    mtime = dt.datetime.fromtimestamp(path.stat().st_mtime).astimezone().isoformat(timespec="seconds")
    when = f"file last modified {mtime}"
    if df is not None and "date" in df.columns and df["date"].notna().any():
        when = f"rows dated {', '.join(sorted(set(map(str, df['date'].dropna()))))}"
    return (
        f"Command not recorded (the CSV was not written by `run_all.py`, or changed since); {when}. "
        f"Default command: `{default_command}`."
    )
