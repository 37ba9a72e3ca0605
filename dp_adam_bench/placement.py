"""How many runs a local sweep runs at once, and on which GPU each one runs.

``dp-adam-bench sweep --jobs N`` (and ``reproduce``) runs a preset's multiruns with Hydra's joblib launcher and N
workers. The default N is the number of visible GPUs when there are any, else the number of cores (one torch thread
per run on the CPU); ``--jobs-per-gpu k`` runs k per GPU (small runs leave a GPU mostly idle).

With GPUs, each worker runs on one GPU: the sweep hands its workers ``DP_ADAM_BENCH_GPU_SLOTS``, one GPU id per
worker slot (``0,1,0,1``: two GPUs, two workers each, spread over the GPUs first), and the training entry point's
first act in a worker is :func:`claim_gpu`: the first free slot, by an exclusive ``flock`` on
``<slot dir>/gpu<id>-<j>.lock`` held for the life of the process, and ``CUDA_VISIBLE_DEVICES`` set to that GPU, so
the runs of that worker see one GPU (``cuda:0``). The slot is the worker's, not the job's: joblib (loky) reuses
its worker processes, and CUDA reads ``CUDA_VISIBLE_DEVICES`` once per process. A worker that dies frees its slot
(the kernel drops the lock). The slot files are shared by this user's sweeps on this machine, so two sweeps side
by side never put more than k runs on one GPU: a worker without a free slot waits for one.

Joblib assigns the jobs; this module only maps workers to GPUs (Hydra's ``submitit_local`` launcher, the other
local engine installed, starts every job of a multirun at once and gives each the same ``CUDA_VISIBLE_DEVICES``:
``range(gpus_per_node)``).
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from dp_adam_bench.errors import ConfigError

log = logging.getLogger(__name__)

ENV_SLOTS = "DP_ADAM_BENCH_GPU_SLOTS"
ENV_SLOT_DIR = "DP_ADAM_BENCH_GPU_SLOT_DIR"
#: torch threads per run of a CPU sweep: two 2-thread jobs on 2 cores slowed a step up to 18x (docs/pitfalls.md)
CPU_THREADS_PER_RUN = 1

_HELD: tuple[object, str] | None = None  # (the open slot file, its GPU id), for the life of this process


@dataclass(frozen=True)
class LocalJobs:
    """A local multirun's parallelism: ``jobs`` joblib workers, ``threads`` torch threads per run, and
    ``gpu_slots``, the GPU of each worker slot (empty: the runs go where ``train.device`` says, the CPU here)."""

    jobs: int
    threads: int
    gpu_slots: tuple[str, ...] = ()

    def env(self) -> dict[str, str]:
        """The environment a multirun command needs for these slots (empty without GPUs)."""
        return {ENV_SLOTS: ",".join(self.gpu_slots)} if self.gpu_slots else {}


def visible_gpus(env: Mapping[str, str] | None = None) -> list[str]:
    """The GPUs a job may be placed on, named as ``CUDA_VISIBLE_DEVICES`` names them: its entries when it is set
    (ids or UUIDs), else ``0 .. n-1`` for the n GPUs torch sees; none without CUDA."""
    env = os.environ if env is None else env
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        names = [x.strip() for x in listed.split(",") if x.strip()]
        return names[:count]
    return [str(i) for i in range(count)]


def _count(value, flag: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{flag} {value!r}: must be a whole number >= 1")
    return value


def plan_local_jobs(
    jobs: int | None, jobs_per_gpu: int | None, gpus: Sequence[str], cores: int | None
) -> LocalJobs:
    """Workers, threads per run and GPU slots of a local sweep.

    With GPUs: ``jobs`` workers (default one per GPU; ``jobs_per_gpu`` k: k per GPU), worker slot i on GPU
    ``gpus[i % len(gpus)]``, and the cores shared among the workers. Without: ``jobs`` workers (default
    ``cores // CPU_THREADS_PER_RUN``), one torch thread each."""
    jobs, jobs_per_gpu = _count(jobs, "--jobs"), _count(jobs_per_gpu, "--jobs-per-gpu")
    if jobs is not None and jobs_per_gpu is not None:
        raise ConfigError(f"--jobs {jobs} and --jobs-per-gpu {jobs_per_gpu}: give one of them")
    cores = max(1, cores or 1)
    gpus = list(gpus)
    if not gpus:
        if jobs_per_gpu is not None:
            raise ConfigError(
                f"--jobs-per-gpu {jobs_per_gpu}: this machine has no visible GPU (CUDA_VISIBLE_DEVICES / torch); "
                "use --jobs N"
            )
        n = jobs if jobs is not None else max(1, cores // CPU_THREADS_PER_RUN)
        return LocalJobs(jobs=n, threads=CPU_THREADS_PER_RUN)
    n = jobs if jobs is not None else len(gpus) * (jobs_per_gpu or 1)
    return LocalJobs(
        jobs=n, threads=max(1, cores // n), gpu_slots=tuple(gpus[i % len(gpus)] for i in range(n))
    )


def slot_dir(env: Mapping[str, str] | None = None) -> Path:
    """Where the slot files live: ``$DP_ADAM_BENCH_GPU_SLOT_DIR``, else one folder per user in the temp dir."""
    env = os.environ if env is None else env
    if env.get(ENV_SLOT_DIR):
        return Path(env[ENV_SLOT_DIR])
    return Path(tempfile.gettempdir()) / f"dp-adam-bench-{os.getuid()}" / "gpu-slots"


def _slot_files(slots: Sequence[str]) -> list[tuple[str, str]]:
    """(GPU id, file name) per slot: the j-th slot of GPU g is ``gpu<g>-<j>.lock``."""
    seen: dict[str, int] = {}
    out = []
    for gpu in slots:
        j = seen.get(gpu, 0)
        seen[gpu] = j + 1
        out.append((gpu, f"gpu{re.sub(r'[^A-Za-z0-9_.-]', '_', gpu)}-{j}.lock"))
    return out


def claim_gpu(env: dict | None = None, poll_s: float = 0.5, timeout_s: float | None = None) -> str | None:
    """In a worker of a GPU sweep (``DP_ADAM_BENCH_GPU_SLOTS`` set): claim a free slot for the life of this
    process, set ``CUDA_VISIBLE_DEVICES`` to its GPU and return the GPU id; waits while every slot is held (at most
    ``timeout_s``, then TimeoutError; None: as long as it takes). Elsewhere: None, and nothing changes. Call it
    before anything touches CUDA."""
    global _HELD
    env = os.environ if env is None else env
    listed = env.get(ENV_SLOTS, "").strip()
    if not listed:
        return None
    if _HELD is not None:
        return _HELD[1]
    slots = [s.strip() for s in listed.split(",") if s.strip()]
    folder = slot_dir(env)
    folder.mkdir(parents=True, exist_ok=True)
    start, said = time.monotonic(), False
    while True:
        for gpu, name in _slot_files(slots):
            fh = open(folder / name, "a+")  # noqa: SIM115 - held for the life of the process
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                fh.close()
                continue
            fh.seek(0)
            fh.truncate()
            fh.write(f"{os.getpid()}\n")
            fh.flush()
            _HELD = (fh, gpu)
            env["CUDA_VISIBLE_DEVICES"] = gpu
            torch = sys.modules.get("torch")
            if torch is not None and torch.cuda.is_initialized():
                log.warning(
                    "CUDA was initialised before the GPU slot was claimed: this job may not run on GPU %s",
                    gpu,
                )
            log.info("this worker runs its jobs on GPU %s (slot %s of %s)", gpu, name, listed)
            return gpu
        if timeout_s is not None and time.monotonic() - start >= timeout_s:
            raise TimeoutError(f"no free GPU slot among {listed} in {folder} after {timeout_s:g} s")
        if not said:
            log.info("every GPU slot of %s is taken (in %s): waiting for one", listed, folder)
            said = True
        time.sleep(poll_s)


def skip_locked_run(err) -> bool:
    """In a job of a Hydra multirun (``-m``): write one line saying the run is skipped because another live process
    holds its folder's lock (a :class:`~dp_adam_bench.tracking.run_store.RunLockedError`), and return True, so
    that the job ends normally and its siblings run (an exit would abort them). Outside a multirun: False.

    Skipped, not waited for: the holder is training this very run (the run id is the config's hash), so waiting
    would only hold a worker (and its GPU) idle for the holder's whole run; launching the sweep again later skips
    the run if the holder completed it and resumes it if the holder was killed."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not (HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN):
        return False
    who = err.holder
    holder = f"pid {who.get('pid')} on host {who.get('host')}" if who else "another process"
    print(
        f"locked, skipped: {err.path} is being trained by {holder}; the rest of this multirun goes on (launch the "
        "sweep again after that process ends: a complete run is skipped, an interrupted one resumes)",
        file=sys.stderr,
        flush=True,
    )
    return True
