"""Cost of one full DP training step on a GPU per mode, against a non-private step on the same card (issue 26).

The rows (``ROWS``) are the configurations the first GPU measurement of this project used: CNN5 (Tang & Lécuyer)
at B = 2048, whole and in micro-batches of 512; a BERT-base classifier at T = 128, B = 64; GPT-2 small (untied,
the ``e2e_gpt2`` task's model) at T = 128, B = 32 and 64. Modes (``MODES``), all fp32 unless ``--precision``:

* ``nonprivate``: forward, backward of the mean loss, ``torch.optim.Adam.step()``;
* ``bk`` / ``ghost``: ours, as the trainer runs them (:func:`bench_engines.build_step`): the engine's clipped sum
  per micro-batch (C = 1), Gaussian noise (sigma = 1) and the harness' Adam update;
* ``opacus_ghost`` / ``opacus_hooks``: Opacus' own DP step, the way an Opacus user writes it: a
  ``GradSampleModuleFastGradientClipping`` / ``GradSampleModule`` with Opacus' DP optimizer around ``torch.optim.Adam``
  (its clipping, noise and step), ``loss.backward()`` through Opacus' ghost-clipping loss wrapper for ghost.

``--precision bf16`` runs the model under bf16 autocast (``train.precision=bf16``), for ``nonprivate`` and ``bk``
(the only engine that keeps norms, clip factors and sums in fp32 from bf16 activations; others are skipped).

Timing: ``--warmup`` steps, then each of ``--steps`` steps timed between two ``torch.cuda.synchronize()`` calls;
the median is reported. Memory: ``torch.cuda.max_memory_allocated`` over the warm-up and timed steps, after the
model, optimizer and batch are on the card (so it includes them). Every configuration runs in this one process, in
order, with the allocator's cache emptied and its peak reset in between; an out-of-memory error is a row with a
note, not a failure. Each row carries the device name and the torch, CUDA and Opacus versions. Where bk's memory
goes: its rows add the bytes of inputs and output gradients its layers hold after the backward
(``bk_captured_gib``) and of the per-example gradients it keeps until the clipped sum (``bk_per_example_gib``).

``results_gpu.csv`` is written only by a run on CUDA (``make bench-gpu``). ``--device cpu`` proves the script on a
machine without a GPU (no memory column; its numbers are not the GPU's) and writes only to an ``--out`` elsewhere.

    python benchmarks/bench_gpu.py --device cuda                     # all rows -> benchmarks/results_gpu.csv
    python benchmarks/bench_gpu.py --device cuda --precision fp32 bf16
    python benchmarks/bench_gpu.py --device cuda --rows cnn5_B2048 --modes nonprivate bk
    python benchmarks/bench_gpu.py --device cpu --quick --out /tmp/gpu.csv    # the code paths, tiny shapes
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
if str(BENCH_DIR) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR))

import bench_engines as be  # noqa: E402

OUT = BENCH_DIR / "results_gpu.csv"
MODES = ("nonprivate", "bk", "ghost", "opacus_ghost", "opacus_hooks")
OURS = {"bk", "ghost"}
BF16_MODES = {"nonprivate", "bk"}
COLUMNS = [
    "model",
    "batch_size",
    "physical_batch_size",
    "mode",
    "precision",
    "median_step_ms",
    "ratio_to_nonprivate",
    "peak_mem_gib",
    "ratio_mem_to_nonprivate",
    "device",
    "device_name",
    "torch_version",
    "cuda_version",
    "opacus_version",
    "date",
    "warmup",
    "steps",
    "notes",
    # bk rows: where its extra memory goes (BKEngine.memory, last micro-batch): the inputs and output gradients
    # its layers hold after the backward, and the per-example gradients it keeps until the clipped sum
    "bk_captured_gib",
    "bk_per_example_gib",
]


@dataclass(frozen=True)
class Row:
    model: str  # a bench_engines.MODELS name
    batch_size: int
    physical_batch_size: int  # micro-batches of every mode, non-private included; = batch_size: whole
    quick: tuple[int, int]  # (batch size, physical batch size) under --quick, with the models' tiny shapes

    def sizes(self, quick: bool) -> tuple[int, int]:
        return self.quick if quick else (self.batch_size, self.physical_batch_size)


ROWS = {
    "cnn5_B2048": Row("cnn5", 2048, 2048, (16, 16)),
    "cnn5_B2048_micro512": Row("cnn5", 2048, 512, (16, 4)),
    "bert_base_B64": Row("bert_base", 64, 64, (8, 8)),
    "gpt2_small_B32": Row("gpt2_small", 32, 32, (4, 4)),
    "gpt2_small_B64": Row("gpt2_small", 64, 64, (8, 8)),
}


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def opacus_step(spec: dict):
    """Opacus' own DP step for ``spec`` (mode ``opacus_ghost`` / ``opacus_hooks``): returns ``step()``."""
    import torch
    from opacus.grad_sample import GradSampleModule, GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizer, DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPTensorFastGradientClipping

    torch.manual_seed(0)
    device = torch.device(spec["device"])
    bm = be.MODELS[spec["model"]](quick=bool(spec.get("quick")))
    model = bm.model.to(device).train()
    be._without_padding_idx(
        model
    )  # Opacus' rule is wrong with padding_idx; same cost without (bench_engines)
    b, phys = spec["batch_size"], spec["physical_batch_size"]
    batch = {k: v.to(device) for k, v in bm.make_batch(b, torch.Generator().manual_seed(1)).items()}
    chunks = be._split(batch, phys)
    adam = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=be.LR)
    kw = dict(noise_multiplier=be.SIGMA, max_grad_norm=be.CLIP, expected_batch_size=b, loss_reduction="sum")
    if spec["mode"] == "opacus_ghost":
        gsm = GradSampleModuleFastGradientClipping(
            model, batch_first=True, loss_reduction="sum", max_grad_norm=be.CLIP, use_ghost_clipping=True
        )
        opt = DPOptimizerFastGradientClipping(adam, **kw)
    else:
        gsm = GradSampleModule(model, batch_first=True, loss_reduction="sum")
        opt = DPOptimizer(adam, **kw)

    def step():
        for i, chunk in enumerate(chunks):
            losses = bm.loss_per_example(gsm, chunk)
            if spec["mode"] == "opacus_ghost":
                DPTensorFastGradientClipping(gsm, opt, losses, "sum").backward()
            else:
                losses.sum().backward()
            # Opacus' accumulation over micro-batches (as its BatchMemoryManager does): each micro-batch's clipped
            # sum is added to summed_grad by a skipped step; the last step adds the noise and updates
            opt.signal_skip_step(do_skip=i < len(chunks) - 1)
            opt.step()
            opt.zero_grad(set_to_none=True)

    return step


def run_config(spec: dict) -> dict:
    """Time one (row, mode, precision) in this process."""
    import torch

    device = torch.device(spec["device"])
    phys = spec["physical_batch_size"]
    engine = None
    if spec["mode"].startswith("opacus_"):
        run, close = opacus_step(spec), None
    else:
        mode = spec["mode"]
        st = be.build_step(
            {**spec, "engine": None if mode == "nonprivate" else mode, "nonprivate_physical_batch_size": phys}
        )
        run, close, engine = st.run, st.close, st.engine_obj
    times = []
    try:
        for i in range(spec["warmup"] + spec["steps"]):
            _sync(device)
            start = time.perf_counter()
            run()
            _sync(device)
            if i >= spec["warmup"]:
                times.append(time.perf_counter() - start)
    finally:
        if close is not None:
            close()
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    out = {
        "median_step_ms": statistics.median(times) * 1e3,
        "peak_mem_gib": peak,
        "physical_batch_size": phys,
    }
    memory = getattr(engine, "memory", None)  # bk's diagnostic
    if memory is not None:
        out["bk_captured_gib"] = memory["captured_bytes"] / 2**30
        out["bk_per_example_gib"] = memory["per_example_bytes"] / 2**30
    return out


def device_info(device) -> dict:
    import opacus
    import torch

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else be.cpu_name()
    return {
        "device": device.type,
        "device_name": name,
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda or "",
        "opacus_version": opacus.__version__,
    }


def measure(
    row_names, modes, precisions, device_name: str, warmup: int, steps: int, quick: bool
) -> list[dict]:
    import torch

    device = torch.device(device_name)
    info = device_info(device)
    rows = []
    for name in row_names:
        row = ROWS[name]
        b, phys = row.sizes(quick)
        for precision in precisions:
            for mode in modes:
                base = {"model": row.model, "batch_size": b, "mode": mode, "precision": precision}
                if precision != "fp32" and mode not in BF16_MODES:
                    print(f"skip {name} {mode} {precision}: bf16 is bk-only (and non-private)", flush=True)
                    continue
                spec = {
                    **base,
                    "device": device_name,
                    "physical_batch_size": phys,
                    "quick": quick,
                    "warmup": warmup,
                    "steps": steps,
                }
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats(device)
                notes = "" if phys == b else f"{-(-b // phys)} micro-batches"
                try:
                    got = run_config(spec)
                except torch.cuda.OutOfMemoryError:
                    got = {
                        "median_step_ms": float("nan"),
                        "peak_mem_gib": float("nan"),
                        "physical_batch_size": phys,
                    }
                    notes = (notes + "; " if notes else "") + "out of memory"
                out = {**base, **got, **info, "warmup": warmup, "steps": steps, "notes": notes}
                out["date"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
                print(
                    f"{name} {mode} {precision}: {out['median_step_ms']:.1f} ms, peak {out['peak_mem_gib']:.2f} GiB",
                    flush=True,
                )
                rows.append(out)
    return rows


def add_ratios(rows: list[dict]) -> list[dict]:
    """Each row's time and memory over the non-private row of the same (model, B, physical batch, precision)."""
    base = {
        (r["model"], r["batch_size"], r["physical_batch_size"], r["precision"]): r
        for r in rows
        if r["mode"] == "nonprivate"
    }
    for r in rows:
        ref = base.get((r["model"], r["batch_size"], r["physical_batch_size"], r["precision"]))
        r["ratio_to_nonprivate"] = r["median_step_ms"] / ref["median_step_ms"] if ref else float("nan")
        r["ratio_mem_to_nonprivate"] = r["peak_mem_gib"] / ref["peak_mem_gib"] if ref else float("nan")
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", required=True, help="cuda (or cuda:N), or cpu to prove the script")
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--precision", nargs="+", choices=("fp32", "bf16"), default=["fp32"])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="timed steps (the median is reported)")
    parser.add_argument("--quick", action="store_true", help="B <= 16 and tiny models: the code paths only")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)

    import pandas as pd
    import torch

    try:
        device = torch.device(args.device)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cuda", "cpu"):
        parser.error(f"--device {args.device!r}: valid: cuda, cuda:N (a visible GPU) or cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(
            f"--device {args.device}: torch {torch.__version__} sees no CUDA GPU here; use --device cpu"
        )
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        parser.error(f"--device {args.device}: only {torch.cuda.device_count()} GPU(s) visible (cuda:0 ...)")
    if device.type != "cuda" and args.out.resolve() == OUT.resolve():
        parser.error(f"--device {args.device} writes {OUT.name} only from a CUDA run; pass --out elsewhere")
    if args.warmup < 0 or args.steps < 1:
        parser.error(f"--warmup {args.warmup} / --steps {args.steps}: need warmup >= 0 and steps >= 1")
    if "nonprivate" not in args.modes:
        print("note: without --modes nonprivate the ratio columns are empty", flush=True)
    if device.type == "cpu":
        torch.set_num_threads(be._threads())
    start = time.perf_counter()
    rows = add_ratios(
        measure(args.rows, args.modes, args.precision, args.device, args.warmup, args.steps, args.quick)
    )
    df = pd.DataFrame(rows, columns=COLUMNS)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(args.out, index=False)
    print(df.drop(columns=["torch_version", "cuda_version", "opacus_version", "date"]).to_string(index=False))
    print(
        f"{len(df)} rows in {time.perf_counter() - start:.0f} s on {rows[0]['device_name'] if rows else '-'}; "
        f"wrote {args.out}"
    )


if __name__ == "__main__":
    main()
