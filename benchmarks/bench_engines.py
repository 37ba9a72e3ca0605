"""Cost of one full DP training step per clipping engine, against a non-private step (time and peak memory).

One *step* is everything the trainer does for one logical batch:

* ``nonprivate`` — forward, backward of the mean loss, ``torch.optim.Adam.step()`` (the baseline);
* ``ghost`` / ``hooks`` / ``functorch`` — for each physical micro-batch the engine's sum of clipped per-example
  gradients (flat clipping, C = 1), then independent Gaussian noise (sigma = 1) and the harness' ``adam``
  variant update (:class:`dp_adam_bench.engine.privatizer.Privatizer`, ``dp_adam_bench.optim``);
* ``stp`` — scale-then-privatize (``stp`` variant): the per-coordinate scale ``variant.scale(state)`` is computed,
  per-example gradients are clipped in the scaled geometry, noised and unscaled. It needs a materialising engine:
  hooks or functorch, whichever had the lower median step time at the same (model, batch size) in this run
  (``--stp-engine auto``; the choice and both timings are in the ``notes`` column).

Inputs are random (fixed before timing, so data generation is not timed). Each (model, batch size, mode) runs in
its own subprocess: ``peak_rss_gib`` is that child's ``ru_maxrss`` (the whole process: interpreter, torch, opacus
and the step), and ``rss_before_steps_gib`` its resident memory after imports and set-up, before the first step.
Every child imports opacus (and transformers for BERT), whatever its mode, so baselines are comparable. DP modes
process a logical batch larger than ``--physical-batch-size`` (default 256, the trainer's default) in micro-batches
of that size, the non-private step never does; the ``physical_batch_size`` column records what was done.

    .venv/bin/python benchmarks/bench_engines.py                   # CNN5, B = 256 and 2048, all modes
    .venv/bin/python benchmarks/bench_engines.py --quick           # B = 16, 1 warm-up + 2 steps (tests / CI)
    .venv/bin/python benchmarks/bench_engines.py --models bert_tiny --batch-sizes 256 --merge
    BENCH_THREADS=1 .venv/bin/python benchmarks/bench_engines.py --modes nonprivate ghost

Threads: ``torch.set_num_threads`` (and OMP/MKL variables of the child) from ``BENCH_THREADS`` (default 2).
Run one benchmark at a time: two torch jobs on a 2-core machine slow each other by up to 18x (PITFALLS.md).
Adding a model: a builder returning a :class:`BenchModel`, one entry in ``MODELS``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script from a checkout without installing the package
    sys.path.insert(0, str(REPO_ROOT))

OUT = Path(__file__).resolve().parent / "results_engines.csv"
MODES = ("nonprivate", "ghost", "bk", "hooks", "functorch", "stp")
FLAT_ENGINES = ("ghost", "bk", "hooks", "functorch")
STP_ENGINES = ("hooks", "functorch")
DEFAULT_BATCH_SIZES = (256, 2048)
CLIP, SIGMA, LR = 1.0, 1.0, 1e-3
COLUMNS = [
    "model",
    "batch_size",
    "mode",
    "engine",
    "median_step_s",
    "ratio_to_nonprivate",
    "peak_rss_gib",
    "ratio_mem_to_nonprivate",
    "threads",
    "torch_version",
    "opacus_version",
    "cpu",
    "date",
    # extra columns: how the numbers were obtained
    "min_step_s",
    "rss_before_steps_gib",
    "physical_batch_size",
    "warmup",
    "steps",
    "params",
    "notes",
]


# --------------------------------------------------------------------------------------------- models


@dataclass
class BenchModel:
    """What a benchmark needs from a model: the module, the per-example loss and a random batch maker.

    ``loss_per_example(forward, batch)`` follows the task interface (``forward`` is the model, an Opacus wrapper or
    a functional call); ``make_batch(b, generator)`` returns a dict of batch-first tensors.
    """

    model: object  # torch.nn.Module (typed loosely so that this module imports without torch)
    loss_per_example: Callable
    make_batch: Callable
    description: str


def build_cnn5() -> BenchModel:
    import torch
    from torch.nn import functional as F

    from dp_adam_bench.tasks.cifar10_cnn import CNN5

    def make_batch(b: int, g: torch.Generator) -> dict:
        return {"x": torch.randn(b, 3, 32, 32, generator=g), "y": torch.randint(0, 10, (b,), generator=g)}

    def loss_per_example(forward, batch):
        return F.cross_entropy(forward(batch["x"]), batch["y"], reduction="none")

    return BenchModel(
        CNN5(), loss_per_example, make_batch, "Tang & Lecuyer CNN5, random 3x32x32 inputs, 10 classes"
    )


BERT_SEQ_LEN = 128


def build_bert_tiny() -> BenchModel:
    """BERT-tiny classifier (L = 2, H = 128, A = 2, vocab 30522, random init), T = 128 random tokens, no mask.

    position_ids and token_type_ids are passed with shape (B, T): with transformers' default (1, T) Opacus'
    per-example gradient of the position embedding is silently wrong (PITFALLS.md). No attention mask: torch.func
    per-example gradients break inside transformers' mask code.
    """
    import torch
    from torch.nn import functional as F
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(
        vocab_size=30522,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=512,
        num_labels=2,
    )
    model = BertForSequenceClassification(cfg)
    t = BERT_SEQ_LEN

    def make_batch(b: int, g: torch.Generator) -> dict:
        return {
            "input_ids": torch.randint(0, cfg.vocab_size, (b, t), generator=g),
            "position_ids": torch.arange(t).repeat(b, 1),
            "token_type_ids": torch.zeros(b, t, dtype=torch.long),
            "y": torch.randint(0, cfg.num_labels, (b,), generator=g),
        }

    def loss_per_example(forward, batch):
        out = forward(
            input_ids=batch["input_ids"],
            position_ids=batch["position_ids"],
            token_type_ids=batch["token_type_ids"],
        )
        return F.cross_entropy(out.logits, batch["y"], reduction="none")

    return BenchModel(model, loss_per_example, make_batch, f"BERT-tiny classifier (L=2, H=128, A=2), T={t}")


#: model name -> builder; later: GPT-2-small-shaped LM (untie embeddings, Conv1D -> Linear, see PITFALLS.md)
MODELS: dict[str, Callable[[], BenchModel]] = {"cnn5": build_cnn5, "bert_tiny": build_bert_tiny}
#: models run when --models is not given (BERT-tiny is slow on 2 CPU threads: opt in with --models)
DEFAULT_MODELS = ("cnn5",)


# --------------------------------------------------------------------------------------------- one configuration


def _threads() -> int:
    return int(os.environ.get("BENCH_THREADS", "2"))


def _rss_now_gib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2**20  # KiB -> GiB
    return float("nan")


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _split(batch: dict, size: int) -> list[dict]:
    n = next(iter(batch.values())).shape[0]
    return [{k: v[i : i + size] for k, v in batch.items()} for i in range(0, n, size)]


def run_one(spec: dict) -> dict:
    """Time one (model, batch size, mode) in this process; called in a subprocess by :func:`main`."""
    import opacus  # noqa: F401  (imported in every mode so that the RSS baselines match)
    import torch

    threads = _threads()
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    bm = MODELS[spec["model"]]()
    model, loss_fn = bm.model, bm.loss_per_example
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    b, mode = int(spec["batch_size"]), spec["mode"]
    batch = bm.make_batch(b, torch.Generator().manual_seed(1))
    engine_name = spec.get("engine") or ""

    if mode == "nonprivate":
        phys = b
        opt = torch.optim.Adam(params, lr=LR)

        def step():
            opt.zero_grad(set_to_none=True)
            loss_fn(model, batch).mean().backward()
            opt.step()

        close = None
    else:
        from dp_adam_bench.engine.grads import build_engine
        from dp_adam_bench.engine.privatizer import Privatizer
        from dp_adam_bench.optim.registry import build_variant
        from dp_adam_bench.privacy.mechanisms import IndependentMechanism

        phys = int(spec["physical_batch_size"]) or b
        phys = min(phys, b)
        chunks = _split(batch, phys)
        engine = build_engine(engine_name, model, loss_fn)
        variant = build_variant("stp" if mode == "stp" else "adam", lr=LR)
        state = variant.init(params)
        mech = IndependentMechanism().reset([p.shape for p in params], seed=0, dtype=params[0].dtype)
        privatizer = Privatizer(clip=CLIP, sigma=SIGMA, expected_batch_size=b, mechanisms=[mech])

        def step():
            scale = variant.scale(state)  # None except for stp
            summed = [torch.zeros_like(p) for p in params]
            for chunk in chunks:
                cs = engine.clipped_sum(chunk, CLIP, scale)
                for acc, s in zip(summed, cs.summed, strict=True):
                    acc.add_(s)
            ctx = privatizer.privatize_sum(summed, scale)
            with torch.no_grad():
                variant.update(params, state, ctx)

        close = engine.close

    rss_before = _rss_now_gib()
    times = []
    for i in range(spec["warmup"] + spec["steps"]):
        start = time.perf_counter()
        step()
        elapsed = time.perf_counter() - start
        if i >= spec["warmup"]:
            times.append(elapsed)
    if close is not None:
        close()
    import opacus as _opacus

    return {
        "model": spec["model"],
        "batch_size": b,
        "mode": mode,
        "engine": "torch.optim.Adam" if mode == "nonprivate" else engine_name,
        "median_step_s": statistics.median(times),
        "min_step_s": min(times),
        # Linux reports ru_maxrss in KiB
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "rss_before_steps_gib": rss_before,
        "physical_batch_size": phys,
        "warmup": spec["warmup"],
        "steps": spec["steps"],
        "params": sum(p.numel() for p in params),
        "threads": threads,
        "torch_version": torch.__version__,
        "opacus_version": _opacus.__version__,
    }


def _child(spec: dict, timeout: float | None) -> dict:
    threads = str(_threads())
    env = dict(os.environ, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, TOKENIZERS_PARALLELISM="false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", json.dumps(spec)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:g} s"}
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-15:]
        print("\n".join("    " + ln for ln in tail), file=sys.stderr)
        last = tail[-1] if tail else ""
        return {"error": f"failed (exit {done.returncode}): {last}"[:300]}
    return json.loads(done.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------------------------- the whole run


def add_ratios(df):
    """ratio_to_nonprivate / ratio_mem_to_nonprivate against the nonprivate row of the same model and batch."""
    base = df[df["mode"] == "nonprivate"].set_index(["model", "batch_size"])
    key = list(zip(df["model"], df["batch_size"], strict=True))
    t0 = [base["median_step_s"].get(k, float("nan")) for k in key]
    m0 = [base["peak_rss_gib"].get(k, float("nan")) for k in key]
    df["ratio_to_nonprivate"] = df["median_step_s"] / t0
    df["ratio_mem_to_nonprivate"] = df["peak_rss_gib"] / m0
    return df


def markdown(df) -> str:
    lines = [
        "| model | B | mode | engine | phys. batch | median step, s | x non-private | peak RSS, GiB | x mem | notes |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for _, r in df.iterrows():

        def f(x, fmt):
            return "" if x != x else format(x, fmt)  # NaN -> empty

        lines.append(
            f"| {r.model} | {r.batch_size} | {r['mode']} | {r.engine} | {f(r.physical_batch_size, '.0f')} "
            f"| {f(r.median_step_s, '.3f')} | {f(r.ratio_to_nonprivate, '.2f')} | {f(r.peak_rss_gib, '.2f')} "
            f"| {f(r.ratio_mem_to_nonprivate, '.2f')} | {r.notes} |"
        )
    return "\n".join(lines)


def _stp_engine(choice: str, rows: list[dict], model: str, b: int) -> tuple[str, str]:
    if choice != "auto":
        return choice, "engine given by --stp-engine"
    measured = {
        r["mode"]: r["median_step_s"]
        for r in rows
        if r["model"] == model and r["batch_size"] == b and r["mode"] in STP_ENGINES and "error" not in r
    }
    if not measured:
        return "functorch", "hooks/functorch not measured in this run: functorch by default"
    best = min(measured, key=measured.get)
    timings = ", ".join(f"{k} {v:.3f} s" for k, v in sorted(measured.items()))
    return best, f"faster flat engine at this B ({timings})"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="\n".join(__doc__.splitlines()[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="B = 16, 1 warm-up + 2 timed steps (tests / CI)")
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=None)
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=None)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=None)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="timed steps (the median is reported)")
    parser.add_argument("--physical-batch-size", type=int, default=256, help="DP micro-batch size; 0 = whole")
    parser.add_argument("--stp-engine", choices=("auto", *STP_ENGINES), default="auto")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per configuration")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep rows of --out for other (model, B, mode) instead of replacing",
    )
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(json.loads(args.one))))
        return

    if args.quick:
        warmup, steps, batch_sizes = 1, 2, args.batch_sizes or [16]
    else:
        warmup, steps, batch_sizes = args.warmup, args.steps, args.batch_sizes or list(DEFAULT_BATCH_SIZES)
        if warmup < 2 or steps < 5:
            parser.error("need --warmup >= 2 and --steps >= 5 (use --quick for a smoke test)")
    if any(b < 1 for b in batch_sizes):
        parser.error("batch sizes must be >= 1")
    batch_sizes = list(dict.fromkeys(batch_sizes))
    models = list(dict.fromkeys(args.models or DEFAULT_MODELS))
    modes = [m for m in MODES if m in (args.modes or MODES)]  # stp after hooks/functorch: it picks the faster

    import pandas as pd

    cpu, date = cpu_name(), dt.datetime.now().astimezone().isoformat(timespec="seconds")
    rows: list[dict] = []
    t_start = time.perf_counter()
    for model in models:
        for b in batch_sizes:
            for mode in modes:
                notes = []
                if mode == "nonprivate":
                    engine = ""
                elif mode == "stp":
                    engine, why = _stp_engine(args.stp_engine, rows, model, b)
                    notes.append(f"stp via {engine}: {why}")
                else:
                    engine = mode
                spec = {
                    "model": model,
                    "batch_size": b,
                    "mode": mode,
                    "engine": engine,
                    "physical_batch_size": args.physical_batch_size,
                    "warmup": warmup,
                    "steps": steps,
                }
                t0 = time.perf_counter()
                res = _child(spec, args.timeout)
                if "error" in res:
                    notes.append(res["error"])
                    res = {k: spec[k] for k in ("model", "batch_size", "mode", "engine")} | {"error": 1}
                    res["engine"] = res["engine"] or "torch.optim.Adam"
                elif mode != "nonprivate" and res["physical_batch_size"] < b:
                    notes.append(f"{-(-b // res['physical_batch_size'])} micro-batches")
                res |= {"cpu": cpu, "date": date, "notes": "; ".join(notes)}
                rows.append(res)
                msg = (
                    f"median {res['median_step_s']:.3f} s/step, peak RSS {res['peak_rss_gib']:.2f} GiB"
                    if "median_step_s" in res
                    else res["notes"]
                )
                print(
                    f"[{time.perf_counter() - t_start:7.1f} s] {model} B={b} {mode}"
                    f"{f' ({engine})' if engine and engine != mode else ''}: {msg} "
                    f"(child {time.perf_counter() - t0:.1f} s)",
                    flush=True,
                )

    df = pd.DataFrame([{k: v for k, v in r.items() if k != "error"} for r in rows])
    if args.merge and args.out.is_file():
        old = pd.read_csv(args.out, keep_default_na=False, na_values=[""])
        keys = set(zip(df["model"], df["batch_size"], df["mode"], strict=True))
        keep = [k not in keys for k in zip(old["model"], old["batch_size"], old["mode"], strict=True)]
        df = pd.concat([old[keep], df], ignore_index=True)
    for c in COLUMNS:
        if c not in df.columns:
            df[c] = float("nan") if c != "notes" else ""
    df["notes"] = df["notes"].fillna("")
    df = add_ratios(df)[COLUMNS]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(args.out, index=False)
    print()
    print(markdown(df))
    print(
        f"\nthreads={_threads()}, {warmup} warm-up + {steps} timed steps, cpu: {cpu}; "
        f"total {time.perf_counter() - t_start:.1f} s; wrote {args.out}"
    )
    if any("error" in r for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
