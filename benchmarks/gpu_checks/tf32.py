"""The ``tf32_conv`` part (in-process: ``gpu_check.py tf32``): TF32 on (cuDNN convolutions and CUDA matmuls, as a
user may set it), CNN5 through bk, ghost and hooks one example at a time with every example clipped: each clipped
contribution's norm must be <= C up to fp32 rounding. The same with the engines' IEEE guard
(``engine/fp32_exact.py``) switched off is reported as the control, which shows whether TF32 would have broken
the bound on this card."""

from __future__ import annotations

from contextlib import nullcontext

#: the TF32 check's allowance over C: fp32 rounding of a norm and a sum (~1e-6 relative); TF32 errs ~1e-3
TF32_SLACK = 1e-5
ENGINES = ("bk", "ghost", "hooks")


def cmd_tf32(args) -> dict:
    """Each example's clipped contribution, one example at a time, with TF32 on for the user's code."""
    import torch

    from dp_adam_bench.engine import fp32_exact

    dev = torch.device(args.device)
    _tf32_on()
    n = 4 if args.quick else 16
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, 32, 32, generator=g).to(dev)
    y = torch.randint(0, 10, (n,), generator=g).to(dev)
    clip = 1e-3  # far below every example's norm: every example is clipped, each contribution is exactly C
    out = {"settings": fp32_exact.settings(), "clip": clip, "examples": n, "engines": {}}
    for guarded in (True, False):
        with nullcontext() if guarded else _no_guard():
            for name in ENGINES:
                key = name if guarded else f"{name}_control_guard_off"
                out["engines"][key] = _excess_over_clip(name, dev, x, y, clip)
    return out | _verdict(out["settings"], out["engines"], n)


def _tf32_on() -> None:
    """TF32 for CUDA matmuls and cuDNN convolutions, and oneDNN's bf16 fp32 math, the CPU's counterpart (where
    the CPU has it)."""
    import torch

    from dp_adam_bench.engine import fp32_exact

    if fp32_exact.new_api():
        for b, o in (("cuda", "matmul"), ("cudnn", "conv")):
            fp32_exact.op(b, o).fp32_precision = "tf32"
        for o in ("matmul", "conv"):
            fp32_exact.op("mkldnn", o).fp32_precision = "bf16"
    else:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True


def _cnn5(dev):
    """CNN5 (seed 0) behind a ``forward(x)``, the name the loss passes its input by."""
    import torch

    from dp_adam_bench.tasks.cifar10_cnn import CNN5

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = CNN5().to(dev)

        def forward(self, x):
            return self.net(x)

    return Net()


def _excess_over_clip(engine: str, dev, x, y, clip: float) -> dict:
    """||clipped contribution|| / C - 1 of each example through ``engine``, one example at a time: its extremes."""
    import torch
    from torch.nn import functional as F

    from dp_adam_bench.engine.engines import build_engine

    def loss(forward, batch):
        return F.cross_entropy(forward(x=batch["x"]), batch["y"], reduction="none")

    eng = build_engine(engine, _cnn5(dev), loss)
    try:
        excess = []
        for i in range(len(x)):
            got = eng.clipped_sum({"x": x[i : i + 1], "y": y[i : i + 1]}, clip)
            norm = torch.sqrt(sum(s.double().square().sum() for s in got.summed))
            excess.append(float(norm) / clip - 1)
    finally:
        eng.close()
    return {"max_excess": max(excess), "min_excess": min(excess)}


def _no_guard():
    """The control: the engines' IEEE fp32 guard replaced by a no-op (as before engine/fp32_exact.py)."""
    from contextlib import ExitStack
    from unittest import mock

    from dp_adam_bench.engine import bk, grads

    stack = ExitStack()
    stack.enter_context(mock.patch.object(bk, "ieee_fp32", nullcontext))
    stack.enter_context(mock.patch.object(grads, "ieee_fp32", nullcontext))
    return stack


def _verdict(settings: dict, engines: dict, n: int) -> dict:
    worst = max(v["max_excess"] for k, v in engines.items() if "control" not in k)
    control = max(v["max_excess"] for k, v in engines.items() if "control" in k)
    return {
        "ok": worst <= TF32_SLACK,
        "summary": (
            f"TF32 on ({'; '.join(f'{k}={v}' for k, v in settings.items() if k != 'clipping')}): largest "
            f"||clipped contribution|| / C - 1 = {worst:.2g} (allowed {TF32_SLACK:g}) over bk, ghost, hooks x "
            f"{n} examples; control with the engines' IEEE guard off: {control:.2g}"
            + (
                " (TF32 would have broken the bound here)"
                if control > TF32_SLACK
                else " (no TF32 effect seen here)"
            )
        ),
    }
