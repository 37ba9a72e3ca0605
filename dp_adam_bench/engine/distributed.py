"""Data-parallel training over ``torch.distributed``: noise drawn once per logical step (``docs/design.md``).

Launched as ``torchrun --nproc_per_node=N -m dp_adam_bench.train ...``: torchrun sets ``WORLD_SIZE``, ``RANK``,
``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``, and :func:`setup` joins the process group. Backend: NCCL only
when every rank gets a GPU of its own (``cuda:LOCAL_RANK``); with ``train.device=auto`` and fewer visible GPUs than
ranks on the node, every rank runs on the CPU with gloo, and rank 0 says so in one log line (NCCL cannot put two
ranks on one GPU). What each rank does (the trainer's side of it):

* every rank holds the whole model and draws the same logical batch (the sampler is seeded, not sharded: the
  accountant's Poisson q is that of the *global* batch); rank r clips the examples ``idx[r::world]``;
* the per-rank sums of clipped per-example gradients are all-reduced (SUM): every rank then holds exactly the sum
  one process would compute, up to the order of float additions;
* the noise is drawn ONCE per logical step, by rank 0's mechanism, and broadcast (:class:`SharedNoise`); noise
  drawn on each rank and all-reduced would have world-size times the variance the run is calibrated for (a worse
  model for no privacy the accountant counts), and per-rank noise without a reduction would desynchronise the
  replicas. Rank 0's mechanism advances exactly as in a one-process run with the same seed, so both runs add the
  same noise;
* every rank applies the same update to the same parameters, so they stay identical without a parameter sync;
* the global torch RNG (dropout) is rank 0's one-process stream on rank 0 and a stream of its own on each other
  rank (see ``trainer._seed_global_rng``).

Everything here is a no-op in a one-process run (``world == 1``), so the single-process trainer path is unchanged.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

MODES = ("auto", "off")
# rank 0 evaluates (and writes checkpoints) alone while the other ranks wait in their next collective; torch's
# default NCCL timeout (10 min) is shorter than a full decode of e2e_gpt2's test set
DEFAULT_TIMEOUT = datetime.timedelta(hours=2)
BUCKET_BYTES = 64 * 2**20  # tensors are flattened into buckets of this size: one collective per bucket


@dataclass(frozen=True)
class DistContext:
    """Where this process stands: ``rank`` of ``world`` processes, its ``device`` (None: the trainer decides)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device | None = None
    backend: str | None = None

    @property
    def is_main(self) -> bool:
        """Rank 0: the only process that writes the run folder, logs, evaluates and checkpoints."""
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1

    # --- collectives (no-ops in one process) ---------------------------------------------------------------------
    def all_reduce_(self, tensors: Sequence[torch.Tensor]) -> None:
        """Sum each tensor over the ranks, in place."""
        if self.active:
            for bucket in _buckets(tensors):
                _collective(bucket, dist.all_reduce)

    def broadcast_(self, tensors: Sequence[torch.Tensor], src: int = 0) -> None:
        """Overwrite each tensor with rank ``src``'s, in place."""
        if self.active:
            for bucket in _buckets(tensors):
                _collective(bucket, lambda t: dist.broadcast(t, src=src))

    def broadcast_object(self, obj, src: int = 0):
        """Rank ``src``'s picklable ``obj`` on every rank (decisions that must be unanimous)."""
        if not self.active:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def gather_objects(self, obj) -> list:
        """Every rank's ``obj``, in rank order, on every rank."""
        if not self.active:
            return [obj]
        out: list = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.active:
            dist.barrier()


_CONTEXT: DistContext | None = None


def setup(mode: str | None = "auto", device: str | None = "auto") -> DistContext:
    """Join the process group when launched with ``WORLD_SIZE > 1`` (and ``mode`` is ``auto``); idempotent, so the
    entry point and the trainer may both call it. ``device`` is ``train.device``: on CUDA each rank takes
    ``cuda:LOCAL_RANK`` and the backend is NCCL; on CPU the backend is gloo (``auto`` picks the CPU when the node
    has fewer GPUs than ranks: :func:`_rank_device`)."""
    global _CONTEXT
    mode = mode or "auto"
    if mode not in MODES:
        raise ValueError(f"train.distributed={mode!r}; valid: {', '.join(MODES)}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if mode == "off" or world <= 1:
        if world > 1:  # every torchrun rank would train the whole run and write the same run folder
            raise ValueError(
                f"train.distributed=off, but this process was launched as one of WORLD_SIZE={world} ranks "
                "(torchrun): launch a single process, or set train.distributed=auto"
            )
        return DistContext()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))  # torchrun sets it; else one node
    dev = _rank_device(device, local_rank, local_world)
    if _CONTEXT is not None:  # one process group per process: its backend was chosen for the first device
        if dev != _CONTEXT.device:
            raise ValueError(
                f"train.device resolves to {dev} but this process joined the process group on {_CONTEXT.device}"
            )
        return _CONTEXT
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if dev.type == "cuda":
        torch.cuda.set_device(dev)  # NCCL and the object collectives use the current device
    if not dist.is_initialized():
        _import_default_group_users()
        dist.init_process_group(backend=backend, timeout=DEFAULT_TIMEOUT)
        atexit.register(_destroy)
    _CONTEXT = DistContext(rank=rank, world=world, local_rank=local_rank, device=dev, backend=backend)
    return _CONTEXT


def _rank_device(name: str | None, local_rank: int, local_world: int = 1) -> torch.device:
    """This rank's device; ``local_world`` is the number of ranks on this node (torchrun's ``LOCAL_WORLD_SIZE``).

    ``auto``: this rank's own GPU (``cuda:LOCAL_RANK``) when the node has a GPU for every one of its ranks, else the
    CPU (gloo) for every rank, said once by local rank 0: NCCL refuses two ranks on one GPU, and a mix of CPU and
    GPU ranks cannot share a backend. ``cuda``: a GPU per rank or a one-line refusal; ``cpu``: the CPU. An explicit
    ``cuda:i`` is refused: every rank would put its replica on the same GPU."""
    if name in (None, "auto"):
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus >= local_world:
            return torch.device("cuda", local_rank)
        if gpus and local_rank == 0:
            log.warning(
                "train.device=auto with %d ranks on this node but %d visible GPU(s): every rank runs on the CPU "
                "with gloo (NCCL needs a GPU per rank; launch at most %d ranks per node to use the GPUs)",
                local_world,
                gpus,
                gpus,
            )
        return torch.device("cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name != "cuda":
        raise ValueError(
            f"train.device={name!r} with data-parallel training: use train.device=auto or cuda (each rank takes "
            "cuda:LOCAL_RANK), or cpu"
        )
    if not torch.cuda.is_available():
        raise ValueError("train.device=cuda but no CUDA device is available; use train.device=cpu or auto")
    if local_world > torch.cuda.device_count():
        raise ValueError(
            f"train.device=cuda with {local_world} ranks on this node but only {torch.cuda.device_count()} CUDA "
            "device(s) visible: launch at most that many processes per node, or use train.device=auto (gloo on "
            "the CPU)"
        )
    return torch.device("cuda", local_rank)


def _import_default_group_users() -> None:
    """Import, before the process group exists, the torch modules that take the default group as a default
    argument (``torch.distributed.nn.functional``: ``group=group.WORLD``, evaluated at import).

    Imported after ``init_process_group`` (Opacus imports them through ``torch._dynamo`` when the first clipping
    engine is built), they hold the group for the life of the process: :func:`_destroy` then cannot free it, and
    gloo's worker threads outlive ``destroy_process_group`` into interpreter shutdown. A worker that drops its
    reference to a finished collective (whose tensors are Python-owned) after the main thread has begun shutting
    down must take the GIL to release them, and is killed there: "terminate called without an active exception",
    SIGABRT. A rank that exits right after its last collective (every rank but 0, which still evaluates and
    writes) loses that race now and then, more often on a busy CPU. Imported first, these defaults are None."""
    import torch.distributed.nn  # noqa: F401


def gloo_threads() -> list[str]:
    """Names of this process's live gloo threads (Linux: ``/proc/self/task``; empty elsewhere)."""
    names = []
    for comm in Path("/proc/self/task").glob("*/comm"):
        try:
            name = comm.read_text().strip()
        except OSError:  # the thread ended while we looked
            continue
        if "gloo" in name:
            names.append(name)
    return sorted(names)


def _destroy() -> None:
    """Leave the process group while the interpreter is fully alive, so that its worker threads are joined here
    and not left running into shutdown (see :func:`_import_default_group_users`)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def _buckets(tensors: Sequence[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    """Consecutive runs of tensors with one dtype and device, each at most ``BUCKET_BYTES`` (or one tensor)."""
    bucket: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if bucket and (
            t.dtype != bucket[0].dtype or t.device != bucket[0].device or size + nbytes > BUCKET_BYTES
        ):
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += nbytes
    if bucket:
        yield bucket


def _collective(bucket: list[torch.Tensor], op) -> None:
    """Run the in-place ``op`` on one flat copy of the bucket (one message instead of one per tensor), then copy
    the result back; a single contiguous tensor is handled in place."""
    if len(bucket) == 1 and bucket[0].is_contiguous():
        op(bucket[0])
        return
    flat = torch.cat([t.reshape(-1) for t in bucket])
    op(flat)
    offset = 0
    for t in bucket:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n


class SharedNoise:
    """One noise mechanism shared by all ranks: rank 0's draws, the others receive its draw.

    Wraps a :class:`~dp_adam_bench.privacy.mechanisms.NoiseMechanism` for the privatizer. On rank 0 it is the
    mechanism, reset with the run's seed (so its generator and streaming buffers advance exactly as in one
    process); on the other ranks the mechanism is never reset — no generator, no BandMF/BLT buffers (``b`` model
    copies saved per GPU) — and is kept only for ``variance(t)``, a function of the strategy alone. ``next()`` is a
    collective: every rank calls it in the same order (the privatizer once per step, IME-style variants once per
    extra stream), which the shared step loop guarantees.
    """

    def __init__(self, mechanism, ctx: DistContext, shapes, dtype: torch.dtype, device: torch.device):
        self.mechanism = mechanism
        self.ctx = ctx
        self.shapes = [torch.Size(s) for s in shapes]
        self.dtype, self.device = dtype, torch.device(device)
        self.received = 0  # draws received from rank 0 (ranks > 0)

    @property
    def name(self) -> str:
        return self.mechanism.name

    @property
    def step(self) -> int:
        return self.mechanism.step if self.ctx.is_main else self.received

    @property
    def _gen(self):  # the privatizer checkpoints only mechanisms that hold a generator: rank 0's
        return self.mechanism._gen if self.ctx.is_main else None

    def next(self) -> list[torch.Tensor]:
        if self.ctx.is_main:
            w = self.mechanism.next()
        else:
            w = [torch.empty(s, dtype=self.dtype, device=self.device) for s in self.shapes]
            self.received += 1
        self.ctx.broadcast_(w, src=0)
        return w

    def variance(self, t: int) -> float:
        return self.mechanism.variance(t)

    def state_dict(self) -> dict:
        if not self.ctx.is_main:
            raise RuntimeError("only rank 0 holds the noise stream's state (it alone draws the noise)")
        return self.mechanism.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Rank 0 restores the stream; the others only need to know how far it has gone."""
        if self.ctx.is_main:
            self.mechanism.load_state_dict(state)
        else:
            if state.get("name") != self.name:
                raise ValueError(
                    f"checkpoint holds noise state of mechanism {state.get('name')!r}, but this run uses {self.name!r}"
                )
            self.received = int(state["step"])
