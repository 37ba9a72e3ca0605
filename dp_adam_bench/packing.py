"""Packing a local sweep's multiruns onto its workers.

A preset's sweep is one Hydra multirun per entry (:func:`dp_adam_bench.sweep.sweep_commands`). Run one after the
other with N joblib workers each, an entry with fewer pending runs than N leaves workers idle: ganesh_fig3 has 23
entries of 2 runs (2 seeds), so on 8 GPUs three quarters of them would wait; ganesh_fig3_tuning has 27 entries of
1-5 runs. Here the entries run side by side instead, each multirun with as many workers as it has pending runs
(at most the free ones), so that at most N runs train at once. The largest entries start first, while every worker
is free, so a long entry is not left to run on one worker at the end.

Each multirun keeps its own joblib workers (loky reuses them, so a GPU worker initialises CUDA once), and on a GPU
machine each worker still claims a slot of :mod:`dp_adam_bench.placement` for its life: at most N workers are
alive at once, so a worker waits only while a finished multirun's workers exit.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

#: the argument that sets a joblib multirun's worker count (dp_adam_bench.sweep.sweep_commands writes it)
N_JOBS = "hydra.launcher.n_jobs="


@dataclass(frozen=True)
class Entry:
    """One multirun command and how many of its runs are not complete yet."""

    command: tuple[str, ...]
    pending: int


def with_workers(command: Sequence[str], n: int) -> list[str]:
    """The command with ``hydra.launcher.n_jobs=n`` (it must already set n_jobs: a joblib multirun)."""
    if not any(a.startswith(N_JOBS) for a in command):
        raise ValueError(f"not a joblib multirun (no {N_JOBS}...): {' '.join(command)}")
    return [f"{N_JOBS}{n}" if a.startswith(N_JOBS) else a for a in command]


def start_order(entries: Sequence[Entry]) -> list[int]:
    """The order the entries start in (indices into ``entries``): most pending runs first, so that a long entry
    starts while every worker is free; entries with nothing pending are left out."""
    return sorted((i for i, e in enumerate(entries) if e.pending > 0), key=lambda i: -entries[i].pending)


def run_packed(
    entries: Sequence[Entry],
    workers: int,
    start: Callable[[list[str]], subprocess.Popen],
    poll_s: float = 1.0,
) -> int:
    """Run the entries' multiruns side by side with at most ``workers`` runs at once (see the module docstring):
    in :func:`start_order`, each with min(pending runs, free workers) workers as workers free up.
    ``start(command)`` launches one (and says so). Once a multirun fails, no further one starts and those running
    finish. Returns the first non-zero exit code, else 0."""
    if workers < 1:
        raise ValueError(f"workers={workers}: must be >= 1")
    queue = start_order(entries)
    running: list[tuple[subprocess.Popen, int]] = []
    free, failed = workers, 0
    while queue or running:
        while queue and free > 0 and not failed:
            entry = entries[queue.pop(0)]
            n = min(entry.pending, free)
            running.append((start(with_workers(entry.command, n)), n))
            free -= n
        still = []
        for proc, n in running:
            rc = proc.poll()
            if rc is None:
                still.append((proc, n))
                continue
            free += n
            failed = failed or rc
        if failed:
            queue.clear()
        if len(still) == len(running) and (queue or still):  # nothing ended: wait
            time.sleep(poll_s)
        running = still
    return failed
