"""The ``env`` part: device, driver, torch / CUDA / cuDNN / NCCL / Opacus versions, the fp32 math settings, cores,
xdist (in-process: ``gpu_check.py env``)."""

from __future__ import annotations

import os
import sys


def cmd_env(args) -> dict:
    import torch

    from dp_adam_bench.engine import fp32_exact

    dev = torch.device(args.device)
    info = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "fp32_math": fp32_exact.settings(),
        "cores": os.cpu_count(),
        "python": sys.version.split()[0],
    }
    if dev.type == "cuda":
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        info["memory_gib"] = torch.cuda.get_device_properties(dev).total_memory / 2**30
    for mod in ("opacus", "transformers", "hydra", "xdist"):
        try:
            info[mod] = getattr(__import__(mod), "__version__", "present")
        except ImportError:
            info[mod] = None
    missing = [m for m in ("opacus", "transformers", "hydra") if info[m] is None]
    info["ok"] = not missing
    info["summary"] = (
        f"{info['device']}, torch {info['torch']}, CUDA {info['cuda']}, cuDNN {info['cudnn']}, "
        f"NCCL {info.get('nccl')}, opacus {info['opacus']}, xdist {info['xdist']}, {info['cores']} cores"
        + (f"; missing: {missing}" if missing else "")
    )
    return info
