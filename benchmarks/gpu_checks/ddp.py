"""The data-parallel parts. ``ddp_nccl``: NCCL collectives of the library's data-parallel context on one GPU (one
rank: ``WORLD_SIZE=1`` takes the single-process path in training, so the process group is made here and its
collectives forced on; gloo on a CPU; in-process: ``gpu_check.py nccl``), then a training run launched by
``torchrun --nproc_per_node=1`` on the GPU. ``ddp_gloo``: data-parallel training on the CPU with gloo, 2 ranks
(the fallback when ranks outnumber GPUs)."""

from __future__ import annotations

import os

from .commands import cifar_small, subcommand, train, verify_json, verify_runs
from .part import Ctx


def torchrun(ctx: Ctx, ranks: int, *overrides: str) -> list[str]:
    launch = [ctx.py, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    return launch + train(ctx, *overrides)[1:]


def ddp_nccl_commands(ctx: Ctx) -> list[list[str]]:
    return [
        subcommand(ctx, "nccl"),
        torchrun(ctx, 1, *cifar_small(ctx, "gpu_check_torchrun1"), f"train.device={ctx.device}"),
    ]


def verify_nccl(ctx: Ctx, log: str) -> str:
    first = verify_json("nccl.json")(ctx, log)
    return first + "; " + verify_runs(lambda c: ["gpu_check_torchrun1"])(ctx, log)


def ddp_gloo_commands(ctx: Ctx) -> list[list[str]]:
    return [torchrun(ctx, 2, *cifar_small(ctx, "gpu_check_gloo2"), "train.device=cpu")]


def cmd_nccl(args) -> dict:
    """NCCL through the library's data-parallel context, one rank on one GPU. A context of one rank skips its
    collectives (``DistContext.active`` is ``world > 1``), so this one is made active: every collective the
    two-rank path runs (bucketed all-reduce, broadcast, object broadcast and gather, the shared noise) goes
    through NCCL, with one rank."""
    import torch
    import torch.distributed as dist

    cuda = args.device == "cuda"
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    backend = "nccl" if cuda else "gloo"  # gloo: the same code proven on a CPU
    if cuda:
        torch.cuda.set_device(dev)
    _one_rank_env()
    dist.init_process_group(backend)
    try:
        ok = _collectives_on_one_rank(dev, backend)
        return {
            "ok": ok,
            "summary": f"{backend} {'.'.join(map(str, torch.cuda.nccl.version())) if cuda else ''} one rank: "
            f"all_reduce (bucketed), broadcast, broadcast_object, gather_objects and SharedNoise "
            f"{'as one process' if ok else 'WRONG'}",
        }
    finally:
        dist.destroy_process_group()


def _one_rank_env() -> None:
    """The environment of rank 0 of a world of one, on a free local port."""
    with __import__("socket").socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})


def _collectives_on_one_rank(dev, backend: str) -> bool:
    """Every collective of the multi-rank path on one rank: whether each gave what one process would."""
    import torch

    from dp_adam_bench.engine.distributed import DistContext, SharedNoise
    from dp_adam_bench.privacy.mechanisms import IndependentMechanism

    class OneRank(DistContext):
        active = True  # the collectives of a multi-rank run, on one rank

    ctx = OneRank(rank=0, world=1, local_rank=0, device=dev, backend=backend)
    t = torch.arange(5.0, device=dev)
    two = [torch.ones(3, device=dev), torch.full((2, 2), 2.0, device=dev)]
    ctx.all_reduce_([t])
    ctx.all_reduce_(two)  # two tensors: one flat bucket
    ctx.broadcast_(two)
    obj = ctx.broadcast_object({"a": 1})
    gathered = ctx.gather_objects(3)
    # on the device, as a run builds its mechanisms on its parameters' device: NCCL broadcasts no CPU tensor
    mech = IndependentMechanism().reset([(4,)], seed=1, device=dev)
    ref = IndependentMechanism().reset([(4,)], seed=1, device=dev)
    noise = SharedNoise(mech, ctx, [(4,)], torch.float32, dev)
    same = torch.equal(noise.next()[0].cpu(), ref.next()[0].cpu())
    ok = torch.equal(t.cpu(), torch.arange(5.0)) and obj == {"a": 1} and gathered == [3] and same
    return ok and float(two[0].sum()) == 3.0 and float(two[1].sum()) == 8.0
