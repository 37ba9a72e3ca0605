"""Decode the shared CIFAR-10 JPEG archive once into the .npz cache, so training runs start warm.

    python scripts/prepare_cifar10.py [--archive PATH] [--cache-dir DIR] [--force]

The archive defaults to ``<shared data>/cifar10/cifar10_jpeg_q75.tar.gz`` (``DP_ADAM_BENCH_DATA`` moves the
data folder); the cache to ``~/.cache/dp_adam_bench/cifar10`` (the task's ``cache_dir`` must match).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from dp_adam_bench.paths import shared_data_dir
from dp_adam_bench.tasks.cifar10_cnn import (
    CLASSES,
    JPEG_ARCHIVE,
    default_cache_dir,
    jpeg_cache_path,
    load_jpeg_tar,
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archive", type=Path, default=shared_data_dir() / "cifar10" / JPEG_ARCHIVE)
    ap.add_argument("--cache-dir", type=Path, default=default_cache_dir())
    ap.add_argument("--force", action="store_true", help="decode again even if the cache file exists")
    args = ap.parse_args(argv)
    if not args.archive.is_file():
        print(f"error: {args.archive} not found (pass --archive or set DP_ADAM_BENCH_DATA)", file=sys.stderr)
        return 1
    t0 = time.perf_counter()
    if args.force:
        jpeg_cache_path(args.archive, args.cache_dir).unlink(missing_ok=True)
    (x_tr, y_tr, x_te, y_te), cache, hit = load_jpeg_tar(args.archive, args.cache_dir)
    dt = time.perf_counter() - t0
    print(f"{'cache already warm' if hit else 'decoded and cached'} in {dt:.1f} s: {cache}")
    if cache.is_file():
        print(f"cache file size: {cache.stat().st_size / 2**20:.1f} MiB")
    else:
        print("warning: the cache could not be written (see the warning above)")
    print(f"train {x_tr.shape} {x_tr.dtype}, test {x_te.shape} {x_te.dtype}")
    print(
        "per-class train/test counts:",
        {c: (int((y_tr == i).sum()), int((y_te == i).sum())) for i, c in enumerate(CLASSES)},
    )
    print("train channel means:", np.round(x_tr.reshape(-1, 3).mean(0) / 255.0, 5))
    return 0


if __name__ == "__main__":
    sys.exit(main())
