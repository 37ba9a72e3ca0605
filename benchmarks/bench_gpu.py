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
order, with the allocator's cache emptied and its peak reset in between. Each row is appended to the CSV as soon
as it is measured, so a run stopped part-way keeps every row before; any error in a row (out of memory or any
other exception) is that row's note, and the run goes on. Each row carries the device name and the torch, CUDA and
Opacus versions (Opacus is imported only when an Opacus mode is asked for).

Precision flags: every mode runs under the same process-wide fp32 math settings (``--fp32-math``: ``ieee``, full
fp32 for matmuls and cuDNN convolutions, the default; or ``tf32``), set once before the first row and recorded in
each row (``fp32_math``, :func:`dp_adam_bench.engine.fp32_exact.settings`). The engines make their per-example
norms and clipped sums in IEEE fp32 whatever these say (``engine/fp32_exact.py``: bk only its rules, the others
their whole clipped sum), which is part of their cost; before, cuDNN's default TF32 sped up the non-private CNN5
step only, so its ratios partly measured precision. Where bk's memory
goes: its rows add the bytes of inputs and output gradients its layers hold after the backward
(``bk_captured_gib``) and of the per-example gradients it keeps until the clipped sum (``bk_per_example_gib``).

``results_gpu.csv`` is written only by a run on CUDA (``make bench-gpu``). ``--device cpu`` proves the script on a
machine without a GPU (no memory column; its numbers are not the GPU's) and writes only to an ``--out`` elsewhere.

    python benchmarks/bench_gpu.py --device cuda                     # all rows -> benchmarks/results_gpu.csv
    python benchmarks/bench_gpu.py --device cuda --precision fp32 bf16
    python benchmarks/bench_gpu.py --device cuda --rows cnn5_B2048 --modes nonprivate bk
    python benchmarks/bench_gpu.py --device cuda --fp32-math tf32 --append    # TF32 rows after the others
    python benchmarks/bench_gpu.py --device cpu --quick --out /tmp/gpu.csv    # the code paths, tiny shapes
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import gc
import math
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
    # the process's fp32 math settings (fp32_exact.settings()), the same for every mode of the run
    "fp32_math",
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


def device_info(device, modes) -> dict:
    """Device name and versions; Opacus' version only when an Opacus mode runs (it is imported for them only)."""
    import torch

    opacus_version = ""
    if any(m.startswith("opacus_") for m in modes):
        import opacus

        opacus_version = opacus.__version__
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else be.cpu_name()
    return {
        "device": device.type,
        "device_name": name,
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda or "",
        "opacus_version": opacus_version,
    }


def set_fp32_math(kind: str) -> str:
    """Set the process's fp32 math for every mode alike (``ieee``: full fp32 matmuls and convolutions; ``tf32``:
    TF32 on CUDA matmuls and cuDNN; oneDNN on the CPU stays IEEE either way); returns the settings as recorded."""
    import torch

    from dp_adam_bench.engine import fp32_exact

    if fp32_exact.new_api():
        for backend, name in fp32_exact.OPS:
            fast = kind == "tf32" and backend != "mkldnn"
            fp32_exact.op(backend, name).fp32_precision = "tf32" if fast else "ieee"
    else:
        torch.backends.cuda.matmul.allow_tf32 = kind == "tf32"
        torch.backends.cudnn.allow_tf32 = kind == "tf32"
    return "; ".join(f"{k}={v}" for k, v in fp32_exact.settings().items() if k != "clipping")


def error_note(err: BaseException) -> str:
    """One line for a row's note: out of memory, or the exception's type and first line."""
    import torch

    if isinstance(err, torch.cuda.OutOfMemoryError):
        return "out of memory"
    first = (str(err).strip().splitlines() or [""])[0][:200]
    return f"error: {type(err).__name__}: {first}"


class RowWriter:
    """Appends each measured row to the CSV at once (header first when the file is new or not appended to)."""

    def __init__(self, path: Path, append: bool):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        if not (append and path.exists() and path.stat().st_size > 0):
            with open(path, "w", newline="") as fh:
                csv.DictWriter(fh, fieldnames=COLUMNS).writeheader()

    def write(self, row: dict) -> None:
        with open(self.path, "a", newline="") as fh:
            csv.DictWriter(fh, fieldnames=COLUMNS, extrasaction="ignore").writerow(row)
            fh.flush()


def measure(
    row_names,
    modes,
    precisions,
    device_name: str,
    warmup: int,
    steps: int,
    quick: bool,
    fp32_math: str = "",
    writer: RowWriter | None = None,
) -> list[dict]:
    """Every (row, precision, mode) in order; each row gets its ratios to the non-private row measured before it
    (same model, B, micro-batch and precision) and is handed to ``writer`` at once."""
    import torch

    device = torch.device(device_name)
    info = device_info(device, modes)
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
                except Exception as err:  # any error is this row's note; the next rows still run
                    got = {
                        "median_step_ms": float("nan"),
                        "peak_mem_gib": float("nan"),
                        "physical_batch_size": phys,
                    }
                    notes = (notes + "; " if notes else "") + error_note(err)
                    print(f"{name} {mode} {precision}: {error_note(err)}", flush=True)
                    gc.collect()
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                out = {**base, **got, **info, "warmup": warmup, "steps": steps, "notes": notes}
                out["fp32_math"] = fp32_math
                out["date"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
                add_ratios([*rows, out], only=out)
                if writer is not None:
                    writer.write(out)
                print(
                    f"{name} {mode} {precision}: {out['median_step_ms']:.1f} ms, peak {out['peak_mem_gib']:.2f} GiB",
                    flush=True,
                )
                rows.append(out)
    return rows


def add_ratios(rows: list[dict], only: dict | None = None) -> list[dict]:
    """Each row's time and memory over the non-private row of the same (model, B, physical batch, precision);
    ``only``: set that row's ratios only (from the rows before it)."""
    base = {
        (r["model"], r["batch_size"], r["physical_batch_size"], r["precision"]): r
        for r in rows
        if r["mode"] == "nonprivate"
    }
    for r in rows if only is None else [only]:
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
    parser.add_argument(
        "--append",
        action="store_true",
        help="append to --out (a re-run's rows come after, and win in the README)",
    )
    parser.add_argument(
        "--fp32-math",
        choices=("ieee", "tf32"),
        default="ieee",
        help="fp32 math of every mode alike: ieee (full fp32, the default) or tf32 (CUDA matmuls and cuDNN)",
    )
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
    fp32_math = set_fp32_math(args.fp32_math)
    print(f"fp32 math of every mode: {fp32_math}", flush=True)
    writer = RowWriter(args.out, args.append)
    rows = measure(
        args.rows,
        args.modes,
        args.precision,
        args.device,
        args.warmup,
        args.steps,
        args.quick,
        fp32_math=fp32_math,
        writer=writer,
    )
    df = pd.DataFrame(rows, columns=COLUMNS)
    shown = df.drop(columns=["torch_version", "cuda_version", "opacus_version", "date", "fp32_math"])
    print(shown.to_string(index=False))
    print(
        f"{len(df)} rows in {time.perf_counter() - start:.0f} s on {rows[0]['device_name'] if rows else '-'}; "
        f"wrote {args.out}"
    )
    failed = [r for r in rows if isinstance(r["median_step_ms"], float) and math.isnan(r["median_step_ms"])]
    if failed:
        print(f"{len(failed)} row(s) not measured (see their notes)", flush=True)


if __name__ == "__main__":
    main()
