"""GPU proof in one command (issue 34): what a GPU user leans on, checked on one lent GPU in at most 8 minutes.

    python benchmarks/gpu_check.py --device cuda                    # = make gpu-check; writes benchmarks/gpu_check/
    python benchmarks/gpu_check.py --device cuda --parts suite bench_gpu   # only these parts
    python benchmarks/gpu_check.py --device cpu --quick --out /tmp/gc      # the same code paths on a CPU, tiny sizes

Each part runs in its own process with its own time limit, and its result (passed / FAILED / TIMED OUT / skipped,
seconds, a one-line summary and its log) is written to ``report.md`` and ``results.json`` as soon as it ends, so a
part that fails or hangs, or the whole command being killed, loses nothing measured before. The parts, in order
(``PARTS``):

* ``env``: device, driver, torch / CUDA / cuDNN / NCCL / Opacus versions, the fp32 math settings, cores, xdist;
* ``suite``: the whole test suite on this device, ``pytest -n <cores>`` (pytest-xdist), pass / fail counts from
  its JUnit XML (``suite.xml``) and the failing tests' names;
* ``bench_gpu``: ``bench_gpu.py``, every row and mode in fp32 and bf16, rows appended as measured (CUDA:
  ``benchmarks/results_gpu.csv``; a CPU run never writes that file);
* ``tf32_conv``: TF32 on (cuDNN convolutions and CUDA matmuls, as a user may set it), CNN5 through bk, ghost and
  hooks one example at a time with every example clipped: each clipped contribution's norm must be <= C up to
  fp32 rounding; the same with the engines' IEEE guard (``engine/fp32_exact.py``) switched off is reported as the
  control, which shows whether TF32 would have broken the bound on this card;
* ``grid_bf16``: the conformance grid's layer cases through bk (auto, Gram, instantiate) under bf16 autocast, and
  the engine self-check on the benchmark models (CNN5, BERT-base, GPT-2 small) in fp32 and bf16;
* ``conformance``: the fp32 / fp64 conformance grid (``tests/test_conformance.py``) on this device: its counts
  read from the suite's JUnit XML when the suite ran it, else its own pytest run;
* ``paper_cifar10``: a short paper-profile run of each CIFAR-10 table (B = 2048, ghost clipping, a few dozen
  steps, the run's self-check and summary);
* ``pretrain``: pretraining ``gpt2_arxiv`` on this device for a few steps;
* ``ddp_nccl``: NCCL collectives of the library's data-parallel context on one GPU (one rank: ``WORLD_SIZE=1``
  takes the single-process path in training, so the process group is made here and its collectives forced on;
  gloo on a CPU), then a training run launched by ``torchrun --nproc_per_node=1`` on the GPU;
* ``ddp_gloo``: data-parallel training on the CPU with gloo, 2 ranks (the fallback when ranks outnumber GPUs);
* ``sweep_jobs``: ``dp-adam-bench sweep --jobs 2`` placing two joblib workers on the one GPU (their slot files
  and every run's summary are checked).

``--budget`` (seconds, default 450) bounds the whole: a part starts only with at least ``MIN_PART_S`` left and
runs at most min(its limit, what is left); the parts not started are reported as skipped for time, to run next
with ``--parts`` (which keeps the other parts' results in the report folder). At its limit a part gets SIGINT
(pytest then writes the JUnit XML of the tests it ran), then SIGKILL ``GRACE_S`` later. Without CUDA a part marked
``cuda_only`` is reported as "skipped: no CUDA" (none is: on a CPU, NCCL's part runs gloo); ``--quick`` shrinks
the sizes (tiny models, a few steps, one test file for the suite) and runs the sweep as ``--dry-run``. Every part
at quick sizes took about 90 s on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
TESTS = REPO_ROOT / "tests"
OUT = BENCH_DIR / "gpu_check"
RESULTS_GPU = BENCH_DIR / "results_gpu.csv"
BUDGET_S = 450  # 7.5 min: with the wheels' install (~30 s) inside the 8 minutes of issue 34
MIN_PART_S = 20
#: the TF32 check's allowance over C: fp32 rounding of a norm and a sum (~1e-6 relative); TF32 errs ~1e-3
TF32_SLACK = 1e-5
#: cases of the conformance grid under --quick (the first ones: linear, conv), and the self-check's examples
QUICK_CASES = 4


class PartFailed(Exception):
    """A part ran but its result is wrong: the message is the report's one-line summary."""


@dataclass
class Ctx:
    device: str  # "cuda" or "cpu"
    quick: bool
    out: Path  # the report folder
    work: Path  # scratch: run store, caches, slot files (not part of the report)
    cores: int
    xdist: bool
    py: str = sys.executable

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"


@dataclass
class Part:
    name: str
    what: str
    limit_s: int
    commands: Callable[[Ctx], list[list[str]]]
    verify: Callable[[Ctx, str], str]  # (ctx, the log) -> summary; raises PartFailed
    cuda_only: bool = False


@dataclass
class Result:
    name: str
    what: str
    status: str  # passed, FAILED, TIMED OUT, skipped: ...
    seconds: float = 0.0
    limit_s: float = 0.0
    summary: str = ""
    commands: list[str] = field(default_factory=list)


# ---------------------------------------------------------------- the parts' commands and checks


def _train(ctx: Ctx, *overrides: str) -> list[str]:
    return [ctx.py, "-m", "dp_adam_bench.train", *overrides, "logger.wandb.mode=disabled"]


def _cifar_small(ctx: Ctx, name: str) -> list[str]:
    """A short private CIFAR-10 CNN5 run (the data-parallel and torchrun parts)."""
    size = ["train.batch_size=32", "train.physical_batch_size=16", "task.train_subset=256"]
    if not ctx.quick:
        size = ["train.batch_size=256", "train.physical_batch_size=128", "task.train_subset=4096"]
    return [
        "task=cifar10_cnn",
        "optimizer=adam",
        "optimizer.lr=0.001",
        "noise=independent",
        "privacy.sigma=1.0",
        "privacy.clip=1.0",
        "train.sampler=poisson",
        "train.steps=4",
        "task.test_subset=200",
        *size,
        f"experiment_name={name}",
    ]


def _summaries(ctx: Ctx, experiment: str) -> list[dict]:
    root = ctx.work / "runs" / experiment
    return [json.loads(p.read_text()) for p in sorted(root.glob("*/summary.json"))] if root.is_dir() else []


def _pytest(ctx: Ctx, xml: str, *args: str) -> list[str]:
    par = ["-n", str(ctx.cores)] if ctx.xdist else []
    return [
        ctx.py,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        *par,
        f"--junitxml={ctx.out / xml}",
        *args,
    ]


def junit_counts(path: Path, module: str | None = None) -> dict:
    """Counts and failing test ids from a JUnit XML file (pytest's), of the tests of ``module`` only if given."""
    counts = {"tests": 0, "passed": 0, "failures": 0, "errors": 0, "skipped": 0, "failing": []}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        if module is not None and module not in str(case.get("classname")):
            continue
        counts["tests"] += 1
        kind = next((k for k in ("error", "failure", "skipped") if case.find(k) is not None), None)
        counts[{"error": "errors", "failure": "failures", "skipped": "skipped", None: "passed"}[kind]] += 1
        if kind in ("error", "failure"):
            counts["failing"].append(name)
    return counts


def _verify_junit(xml: str, module: str | None = None) -> Callable[[Ctx, str], str]:
    def verify(ctx: Ctx, log: str) -> str:
        path = ctx.out / xml
        if module is not None and not path.is_file():  # the suite's run of the module's tests
            path, xml_used = ctx.out / "suite.xml", "suite.xml"
        else:
            xml_used = xml
        if not path.is_file():
            raise PartFailed(f"no {xml} (pytest did not finish)")
        c = junit_counts(path, module)
        line = (
            f"{c['passed']} passed, {c['failures']} failed, {c['errors']} errors, {c['skipped']} skipped "
            f"of {c['tests']}" + ("" if ctx.xdist else " (pytest-xdist missing: serial)")
        )
        if xml_used != xml:
            line += f" (from {xml_used})"
        if c["failures"] or c["errors"] or not c["tests"]:
            shown = ", ".join(c["failing"][:20]) + (" ..." if len(c["failing"]) > 20 else "")
            raise PartFailed(f"{line}: {shown}")
        return line

    return verify


def _suite(ctx: Ctx) -> list[list[str]]:
    if ctx.quick:  # one small test file: the same pytest invocation and JUnit counting
        return [_pytest(ctx, "suite.xml", "tests/test_lr_schedule.py")]
    return [_pytest(ctx, "suite.xml", "tests")]


def _conformance(ctx: Ctx) -> list[list[str]]:
    """The grid's own pytest run, unless the suite's JUnit XML already holds its tests (then its counts are read
    from there: the suite ran them on this device)."""
    suite = ctx.out / "suite.xml"
    if suite.is_file() and junit_counts(suite, "test_conformance")["tests"]:
        return []
    pick = ["-k", "linear-2d"] if ctx.quick else []
    return [_pytest(ctx, "conformance.xml", "tests/test_conformance.py", *pick)]


def _self(ctx: Ctx, sub: str, *args: str) -> list[str]:
    quick = ["--quick"] if ctx.quick else []
    return [ctx.py, str(Path(__file__)), sub, "--device", ctx.device, *quick, *args]


def _verify_json(name: str, key: str = "ok") -> Callable[[Ctx, str], str]:
    def verify(ctx: Ctx, log: str) -> str:
        path = ctx.out / name
        if not path.is_file():
            raise PartFailed(f"no {name} written")
        got = json.loads(path.read_text())
        if not got.get(key):
            raise PartFailed(got.get("summary", "failed"))
        return got.get("summary", "")

    return verify


def _bench_csv(ctx: Ctx) -> Path:
    return RESULTS_GPU if ctx.cuda else ctx.out / "bench_gpu_cpu.csv"


def _bench(ctx: Ctx) -> list[list[str]]:
    args = ["--precision", "fp32", "bf16", "--out", str(_bench_csv(ctx))]
    if ctx.quick:
        args += ["--quick", "--rows", "cnn5_B2048_micro512", "--warmup", "0", "--steps", "1"]
    else:
        args += ["--warmup", "2", "--steps", "5"]
    return [[ctx.py, str(BENCH_DIR / "bench_gpu.py"), "--device", ctx.device, *args]]


def _verify_bench(ctx: Ctx, log: str) -> str:
    import pandas as pd

    path = _bench_csv(ctx)
    if not path.is_file():
        raise PartFailed(f"{path.name} not written")
    df = pd.read_csv(path)
    if ctx.cuda:
        shutil.copy(path, ctx.out / "bench_gpu.csv")
    bad = df[df["median_step_ms"].isna()]
    line = f"{len(df)} rows ({', '.join(sorted(set(df['precision'])))}), fp32 math: {df['fp32_math'].iloc[0]}"
    if len(bad):
        notes = "; ".join(
            f"{r.model} B={r.batch_size} {r['mode']} {r.precision}: {r.notes}" for _, r in bad.iterrows()
        )
        raise PartFailed(f"{line}; {len(bad)} not measured: {notes}")
    return line


def _paper(ctx: Ctx) -> list[list[str]]:
    steps = 2 if ctx.quick else 30
    size = (
        [
            "train.batch_size=32",
            "train.physical_batch_size=16",
            "task.train_subset=256",
            "task.test_subset=200",
        ]
        if ctx.quick
        else ["task.test_subset=2000"]  # the paper's B = 2048 in micro-batches of 512
    )
    device = "cuda" if ctx.cuda else "cpu"
    return [
        _train(
            ctx,
            f"experiment={table}",
            "profile=paper",
            "optimizer=adambc",
            "optimizer.lr=0.001",
            "privacy.target_epsilon=null",
            f"train.steps={steps}",
            "train.eval_every=0",
            "train.checkpoint_every=0",
            f"train.device={device}",
            *size,
            f"experiment_name=gpu_check_{table}",
        )
        for table in ("tang_fig1_cifar10", "tang_fig3_cifar10")
    ]


def _verify_runs(experiments: Callable[[Ctx], list[str]], world: int = 1) -> Callable[[Ctx, str], str]:
    def verify(ctx: Ctx, log: str) -> str:
        lines = []
        for exp in experiments(ctx):
            found = _summaries(ctx, exp)
            if not found:
                raise PartFailed(f"{exp}: no run summary")
            for s in found:
                check = s.get("self_check") or {}
                lines.append(
                    f"{exp}: {s['steps']} steps, {s.get('clipping')}, world {s.get('world_size')}, "
                    f"test_accuracy {s['metrics'].get('test_accuracy', float('nan')):.1f}, self-check "
                    f"{check.get('max_rel_error', float('nan')):.2g}"
                )
                if s.get("world_size") != world or s["steps"] < 1:
                    raise PartFailed(f"{lines[-1]}: want world {world}")
        return "; ".join(lines)

    return verify


def _pretrain(ctx: Ctx) -> list[list[str]]:
    over = {
        "steps": 6,
        "warmup_steps": 1,
        "eval_every": 0,
        "checkpoint_every": 0,
        "log_every": 2,
        "val_blocks": 4,
    }
    if ctx.quick:
        over |= {
            "n_layer": 1,
            "n_embd": 16,
            "n_head": 2,
            "n_positions": 64,
            "block_size": 16,
            "batch_size": 4,
        }
        over["data_dir"] = str(ctx.work / "abstracts.jsonl.gz")
    over |= {"device": "cuda" if ctx.cuda else "cpu", "wandb": {"mode": "disabled"}}
    args = [f"{k}={json.dumps(v)}" for k, v in over.items()]
    cmds = [[ctx.py, "-m", "dp_adam_bench.cli", "pretrain", "gpt2_arxiv", *args]]
    if ctx.quick:  # 300 abstracts, not 19,834: the tokenizer's time
        make = f"import sys; sys.path.insert(0, {str(TESTS)!r}); from helpers import first_abstracts; "
        make += f"first_abstracts({over['data_dir']!r}, 300)"
        cmds.insert(0, [ctx.py, "-c", make])
    return cmds


def _verify_pretrain(ctx: Ctx, log: str) -> str:
    found = sorted((ctx.work / "cache").rglob("summary.json"))
    if not found:
        raise PartFailed("no pretraining summary")
    s = json.loads(found[-1].read_text())
    dev = s.get("provenance", {}).get("device")
    want = "cuda" if ctx.cuda else "cpu"
    line = f"gpt2_arxiv on {dev}: val_loss {s.get('val_loss', float('nan')):.3f}"
    if not str(dev).startswith(want):
        raise PartFailed(f"{line}; want {want}")
    return line


def _torchrun(ctx: Ctx, ranks: int, *overrides: str) -> list[str]:
    return [
        ctx.py,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={ranks}",
        "-m",
        "dp_adam_bench.train",
        *overrides,
        "logger.wandb.mode=disabled",
    ]


def _ddp_nccl(ctx: Ctx) -> list[list[str]]:
    return [
        _self(ctx, "nccl", "--out", str(ctx.out / "nccl.json")),
        _torchrun(ctx, 1, *_cifar_small(ctx, "gpu_check_torchrun1"), f"train.device={ctx.device}"),
    ]


def _verify_nccl(ctx: Ctx, log: str) -> str:
    first = _verify_json("nccl.json")(ctx, log)
    return first + "; " + _verify_runs(lambda c: ["gpu_check_torchrun1"])(ctx, log)


def _ddp_gloo(ctx: Ctx) -> list[list[str]]:
    return [_torchrun(ctx, 2, *_cifar_small(ctx, "gpu_check_gloo2"), "train.device=cpu")]


SWEEP_OVER = ["train.steps=3", "task.test_subset=500", "train.eval_every=0", "train.checkpoint_every=0"]


def _sweep(ctx: Ctx) -> list[list[str]]:
    cmd = [ctx.py, "-m", "dp_adam_bench", "sweep", "tang_fig1_cifar10", "--profile", "cpu", "--jobs", "2"]
    return [cmd + SWEEP_OVER + (["--dry-run"] if ctx.quick else [])]


def _verify_sweep(ctx: Ctx, log: str) -> str:
    if ctx.quick:  # the dry run: the commands the sweep would launch
        launches = [ln for ln in log.splitlines() if ln.startswith("+ ") and "hydra.launcher.n_jobs=2" in ln]
        if not launches:
            raise PartFailed("the dry run printed no joblib command with 2 workers")
        return f"dry run: {len(launches)} multirun commands with 2 joblib workers"
    slots = sorted((ctx.work / "slots").glob("gpu*.lock"))
    pids = {p.read_text().strip() for p in slots}
    runs = _summaries(ctx, "tang_fig1_cifar10_cpu")
    line = f"{len(runs)} runs complete; GPU slots {[p.name for p in slots]} held by {len(pids)} worker(s)"
    if len(slots) != 2 or len(pids) != 2 or len(runs) != 9:
        raise PartFailed(f"{line}; want 9 runs and 2 slots on GPU 0 held by 2 workers")
    return line


def _env(ctx: Ctx) -> list[list[str]]:
    return [_self(ctx, "env", "--out", str(ctx.out / "env.json"))]


PARTS = [
    Part("env", "device, versions, fp32 math", 60, _env, _verify_json("env.json")),
    Part("suite", "the test suite on this device (pytest -n)", 180, _suite, _verify_junit("suite.xml")),
    Part("bench_gpu", "bench_gpu.py: every row and mode, fp32 and bf16", 150, _bench, _verify_bench),
    Part(
        "tf32_conv",
        "TF32 on: clipped contributions' norms <= C (CNN5, bk / ghost / hooks)",
        60,
        lambda c: [_self(c, "tf32", "--out", str(c.out / "tf32.json"))],
        _verify_json("tf32.json"),
    ),
    Part(
        "grid_bf16",
        "conformance cases through bk under bf16 autocast; self-check on the benchmark models",
        90,
        lambda c: [_self(c, "grid", "--out", str(c.out / "grid.json"))],
        _verify_json("grid.json"),
    ),
    Part(
        "conformance",
        "conformance grid fp32 / fp64 (tests/test_conformance.py)",
        90,
        _conformance,
        _verify_junit("conformance.xml", "test_conformance"),
    ),  # fmt: skip
    Part(
        "paper_cifar10",
        "paper profile of each CIFAR-10 table, a few dozen steps",
        120,
        _paper,
        _verify_runs(lambda c: ["gpu_check_tang_fig1_cifar10", "gpu_check_tang_fig3_cifar10"]),
    ),
    Part("pretrain", "pretraining gpt2_arxiv for a few steps", 90, _pretrain, _verify_pretrain),
    Part(
        "ddp_nccl",
        "NCCL on one GPU (1 rank; gloo on a CPU), torchrun 1 process",
        90,
        _ddp_nccl,
        _verify_nccl,
    ),
    Part(
        "ddp_gloo",
        "data-parallel on the CPU, gloo, 2 ranks",
        90,
        _ddp_gloo,
        _verify_runs(lambda c: ["gpu_check_gloo2"], world=2),
    ),  # fmt: skip
    Part("sweep_jobs", "sweep --jobs 2 placing two workers on the GPU", 120, _sweep, _verify_sweep),
]


# ---------------------------------------------------------------- running the parts


#: seconds a part has after SIGINT at its limit (pytest then writes its JUnit XML of the tests run so far)
GRACE_S = 15


def _run(cmd: list[str], env: dict, log, timeout: float) -> int | None:
    """Run ``cmd`` in its own process group, output to ``log``; its exit code, or None if it outran ``timeout``
    (then the group gets SIGINT, and SIGKILL :data:`GRACE_S` seconds later if still there)."""
    proc = subprocess.Popen(
        cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        return proc.wait(timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        return None


def run_part(part: Part, ctx: Ctx, env: dict, left: float) -> Result:
    res = Result(part.name, part.what, "passed", limit_s=min(part.limit_s, left))
    if part.cuda_only and not ctx.cuda:
        res.status = "skipped: no CUDA"
        return res
    if left < MIN_PART_S:
        res.status = f"skipped: time budget spent ({left:.0f} s left)"
        return res
    cmds = part.commands(ctx)
    res.commands = [" ".join(map(str, c)).replace(str(REPO_ROOT) + "/", "") for c in cmds]
    log_path = ctx.out / f"{part.name}.log"
    start = time.perf_counter()
    with open(log_path, "w") as log:
        for cmd, shown in zip(cmds, res.commands, strict=True):
            log.write(f"$ {shown}\n")
            log.flush()
            rc = _run(cmd, env, log, res.limit_s - (time.perf_counter() - start))
            if rc is None:
                res.status, res.summary = "TIMED OUT", f"after {res.limit_s:.0f} s: {shown[:200]}"
                break
            if rc != 0:
                res.status, res.summary = "FAILED", f"exit {rc}: {shown[:200]}"
                break
    res.seconds = time.perf_counter() - start
    text = log_path.read_text(errors="replace")
    try:
        summary = part.verify(ctx, text)  # after a timeout: what it got done (pytest: the tests run so far)
        res.summary = summary if res.status == "passed" else f"{res.summary}; {summary}"
    except PartFailed as err:
        res.status = "FAILED" if res.status == "passed" else res.status
        res.summary = (res.summary + "; " if res.summary else "") + str(err)
    except Exception as err:  # a check that cannot read what the part left: its own failure, not the run's
        res.status = "FAILED" if res.status == "passed" else res.status
        res.summary = (
            res.summary + "; " if res.summary else ""
        ) + f"check failed: {type(err).__name__}: {err}"
    if res.status != "passed":
        tail = "\n".join(text.splitlines()[-3:])
        res.summary += f" | log tail: {tail[-300:]}"
    return res


def _merged(results: list[Result], earlier: list[dict]) -> list[Result]:
    """This run's results, with an earlier run's (``--parts``: a rerun of some parts) for the parts not rerun, in
    the order of :data:`PARTS`."""
    now = {r.name: r for r in results}
    before = {d["name"]: Result(**d) for d in earlier if d["name"] not in now}
    order = [p.name for p in PARTS] + [n for n in [*now, *before] if n not in {p.name for p in PARTS}]
    return [now.get(n) or before[n] for n in order if n in now or n in before]


def write_report(ctx: Ctx, results: list[Result], header: dict) -> None:
    results = _merged(results, header.get("earlier", []))
    shown = {k: v for k, v in header.items() if k != "earlier"}
    (ctx.out / "results.json").write_text(
        json.dumps({**shown, "parts": [r.__dict__ for r in results]}, indent=1)
    )
    lines = [
        "# GPU check (issue 34)",
        "",
        f"Device: {header['device_name']} ({ctx.device}{', quick' if ctx.quick else ''}); torch "
        f"{header['torch']}; commit {header['commit']}; started {header['started']}; "
        f"{header['elapsed_s']:.0f} s of a {header['budget_s']} s budget. Command: `{header['command']}`.",
        "",
        "| part | what | status | s | limit s | summary |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        summary = r.summary.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {r.name} | {r.what} | {r.status} | {r.seconds:.0f} | {r.limit_s:.0f} | {summary} |")
    again = [r.name for r in results if r.status != "passed"]
    if again:
        quick = " --quick" if ctx.quick else ""
        lines += [
            "",
            f"Not passed: {', '.join(again)}. Again, keeping the other parts' results here: `python "
            f"benchmarks/gpu_check.py --device {ctx.device}{quick} --parts {' '.join(again)}`"
            + ("" if ctx.out.resolve() == OUT.resolve() else f" `--out {ctx.out}`")
            + ".",
        ]
    if header.get("earlier"):
        lines += ["", "Parts not rerun by this command keep an earlier run's result (its `results.json`)."]
    lines += [
        "",
        "Raw files beside this one: `results.json`, one `<part>.log` per part (its commands first), `suite.xml` / "
        "`conformance.xml` (JUnit), `env.json`, `tf32.json`, `grid.json`, `nccl.json`, `bench_gpu.csv` (a CUDA "
        "run's copy of `benchmarks/results_gpu.csv`).",
    ]
    (ctx.out / "report.md").write_text("\n".join(lines) + "\n")


def _header(ctx: Ctx, argv: list[str], budget: float, started: str) -> dict:
    import torch

    try:  # a copied working tree (a lent machine) may have no .git, or no git
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True
        )
        commit = done.stdout.strip()
    except OSError:
        commit = ""
    name = torch.cuda.get_device_name(0) if ctx.cuda else "CPU"
    return {
        "device_name": name,
        "torch": torch.__version__,
        "commit": commit or "unknown (no git here)",
        "started": started,
        "budget_s": budget,
        "elapsed_s": 0.0,
        "command": " ".join(["python", "benchmarks/gpu_check.py", *argv]),
    }


def run_parts(parts: list[Part], ctx: Ctx, budget: float, header: dict) -> list[Result]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])),
        "PYTHONUNBUFFERED": "1",
        "WANDB_MODE": "disabled",
        "HF_HUB_OFFLINE": "1",
        "DP_ADAM_BENCH_RUNS": str(ctx.work / "runs"),
        "DP_ADAM_BENCH_CACHE": str(ctx.work / "cache"),
        "DP_ADAM_BENCH_GPU_SLOT_DIR": str(ctx.work / "slots"),
        "DP_ADAM_BENCH_PROGRESS": "lines",
    }
    start = time.perf_counter()
    results: list[Result] = []
    for part in parts:
        left = budget - (time.perf_counter() - start)
        res = run_part(part, ctx, env, left)
        results.append(res)
        print(f"[gpu-check] {res.name}: {res.status} ({res.seconds:.0f} s) {res.summary[:300]}", flush=True)
        header["elapsed_s"] = time.perf_counter() - start
        write_report(ctx, results, header)
    return results


# ---------------------------------------------------------------- the in-process checks (subcommands)


def _device(name: str):
    import torch

    return torch.device(name)


def cmd_env(args) -> dict:
    import torch

    from dp_adam_bench.engine import fp32_exact

    dev = _device(args.device)
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


def _cnn5(device):
    import torch

    from dp_adam_bench.tasks.cifar10_cnn import CNN5

    torch.manual_seed(0)
    return CNN5().to(device)


def cmd_tf32(args) -> dict:
    """Each example's clipped contribution, one example at a time, with TF32 on for the user's code."""
    from contextlib import nullcontext
    from unittest import mock

    import torch
    from torch.nn import functional as F

    from dp_adam_bench.engine import bk, fp32_exact, grads
    from dp_adam_bench.engine.engines import build_engine

    dev = _device(args.device)
    if fp32_exact.new_api():  # and oneDNN's bf16 fp32 math, the CPU's counterpart (where the CPU has it)
        for b, o in (("cuda", "matmul"), ("cudnn", "conv")):
            fp32_exact.op(b, o).fp32_precision = "tf32"
        for o in ("matmul", "conv"):
            fp32_exact.op("mkldnn", o).fp32_precision = "bf16"
    else:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    n = 4 if args.quick else 16
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, 32, 32, generator=g).to(dev)
    y = torch.randint(0, 10, (n,), generator=g).to(dev)

    def loss(forward, batch):
        return F.cross_entropy(forward(x=batch["x"]), batch["y"], reduction="none")

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = _cnn5(dev)

        def forward(self, x):
            return self.net(x)

    clip = 1e-3  # far below every example's norm: every example is clipped, each contribution is exactly C
    out = {"settings": fp32_exact.settings(), "clip": clip, "examples": n, "engines": {}}
    for guarded in (True, False):
        guard = nullcontext() if guarded else _no_guard(mock, bk, grads, nullcontext)
        with guard:
            for name in ("bk", "ghost", "hooks"):
                eng = build_engine(name, Net(), loss)
                try:
                    excess = []
                    for i in range(n):
                        got = eng.clipped_sum({"x": x[i : i + 1], "y": y[i : i + 1]}, clip)
                        norm = torch.sqrt(sum(s.double().square().sum() for s in got.summed))
                        excess.append(float(norm) / clip - 1)
                finally:
                    eng.close()
                key = name if guarded else f"{name}_control_guard_off"
                out["engines"][key] = {"max_excess": max(excess), "min_excess": min(excess)}
    worst = max(v["max_excess"] for k, v in out["engines"].items() if "control" not in k)
    control = max(v["max_excess"] for k, v in out["engines"].items() if "control" in k)
    out["ok"] = worst <= TF32_SLACK
    out["summary"] = (
        f"TF32 on ({'; '.join(f'{k}={v}' for k, v in out['settings'].items() if k != 'clipping')}): largest "
        f"||clipped contribution|| / C - 1 = {worst:.2g} (allowed {TF32_SLACK:g}) over bk, ghost, hooks x {n} "
        f"examples; control with the engines' IEEE guard off: {control:.2g}"
        + (
            " (TF32 would have broken the bound here)"
            if control > TF32_SLACK
            else " (no TF32 effect seen here)"
        )
    )
    return out


def _no_guard(mock, bk, grads, nullcontext):
    """The control: the engines' IEEE fp32 guard replaced by a no-op (as before engine/fp32_exact.py)."""
    from contextlib import ExitStack

    stack = ExitStack()
    stack.enter_context(mock.patch.object(bk, "ieee_fp32", nullcontext))
    stack.enter_context(mock.patch.object(grads, "ieee_fp32", nullcontext))
    return stack


def _rel_error(got, norms, summed) -> float:
    """The self-check's measure: the larger of the worst relative norm error and the clipped sum's relative error."""
    from dp_adam_bench.engine.self_check import relative_errors

    return max(relative_errors(got, norms.float(), summed))


def cmd_grid(args) -> dict:
    """Conformance cases through bk's paths under bf16 autocast, and the self-check on the benchmark models in fp32
    and bf16.

    A cell's bk (bf16 autocast, the path and IEEE settings the self-check uses) is compared with two references at
    the self-check's bf16 tolerance: the loop under the same bf16 autocast (the self-check's own reference) and the
    fp32 loop (``tests/test_conformance.py``'s oracle). It matches when either agrees. The fp32 loop is the weaker
    reference: bf16 autocast changes the probes' own gradients (on a CPU, a conv1d probe's per-example norms moved
    up to 38 %, bk and the bf16 loop alike), so most cells match only the bf16 loop. A cell that matches only the
    fp32 loop is listed as one where the bf16 self-check would stop a run on a correct engine (on a CPU:
    nn.MultiheadAttention with add_bias_kv and add_zero_attn, the size-one bf16 loop 8 % off bk's batched bf16,
    5.8 % off the fp32 norms where bk is 0.7 % off). Planted bug: bk's clip factors 10 % too large fail every cell
    against both references."""
    import torch

    sys.path.insert(0, str(TESTS))
    import bench_engines as be
    import test_conformance as tc

    from dp_adam_bench.engine.fp32_exact import ieee_fp32
    from dp_adam_bench.engine.grads import loop_grads
    from dp_adam_bench.engine.probe import neutral
    from dp_adam_bench.engine.self_check import BF16_TOLERANCE, DEFAULT_TOLERANCE, loop_reference, self_check
    from dp_adam_bench.errors import ConfigError

    dev = tc.DEVICE
    if dev.type != args.device:
        raise SystemExit(f"grid: the conformance suite picked {dev}, not {args.device}")

    def autocast():
        return torch.autocast(dev.type, dtype=torch.bfloat16)

    cases = [c for c in tc.CASES if not c.undefined]
    if args.quick:
        cases = cases[:QUICK_CASES]
    rows, bad, false_alarms = [], [], []
    for case in cases:
        if "transformers" in case.tags:
            try:
                import transformers  # noqa: F401
            except ImportError:
                continue
        norms_ref, clip, summed_ref = tc.oracle(case, "f32-ce")
        for engine in ("bk", "bk:gram", "bk:instantiate"):
            want = "refused" if case.bk_refuses else "match"
            row = {"case": case.id, "engine": engine}
            try:
                eng = tc.build(engine, tc.make_model(case, torch.float32), tc.loss_fn("ce"))
            except ConfigError:
                rows.append(row | {"outcome": "refused"})
                bad += [] if want == "refused" else [f"{case.id} {engine}: refused"]
                continue
            batch = tc.make_batch(case, torch.float32)
            try:
                with neutral(eng.model), ieee_fp32():
                    with autocast():
                        got = eng.clipped_sum(batch, clip)
                    eng._hooks(False)
                    try:
                        with autocast():
                            per_ex = loop_grads(eng.model, eng.loss_per_example, eng.params, batch)
                    finally:
                        eng._hooks(True)
            except (ConfigError, ValueError) as e:
                rows.append(row | {"outcome": "refused", "error": str(e)[:200]})
                bad += [] if want == "refused" else [f"{case.id} {engine}: refused ({str(e)[:100]})"]
                continue
            finally:
                eng.close()
            norms, summed = loop_reference([g.float() for g in per_ex], clip)
            row |= {"error_vs_fp32_loop": _rel_error(got, norms_ref, summed_ref)}
            row |= {"error_vs_bf16_loop": _rel_error(got, norms, summed)}
            ok = min(row["error_vs_fp32_loop"], row["error_vs_bf16_loop"]) <= BF16_TOLERANCE
            row["outcome"] = "match" if ok else "mismatch"
            rows.append(row)
            if row["outcome"] != want:
                bad.append(f"{case.id} {engine}: {row['outcome']} (vs fp32 loop {row['error_vs_fp32_loop']:.3g}, "
                           f"vs bf16 loop {row['error_vs_bf16_loop']:.3g})")  # fmt: skip
            elif ok and row["error_vs_bf16_loop"] > BF16_TOLERANCE:
                false_alarms.append(f"{case.id} {engine} ({row['error_vs_bf16_loop']:.2g})")
    models = []
    for name in ("cnn5", "bert_base", "gpt2_small"):
        bm = be.MODELS[name](quick=args.quick)
        model = bm.model.to(dev).train()
        batch = {k: v.to(dev) for k, v in bm.make_batch(4, torch.Generator().manual_seed(1)).items()}
        from dp_adam_bench.engine.bk import BKEngine

        for precision in ("fp32", "bf16"):
            eng = BKEngine(model, bm.loss_per_example)
            try:
                tol = BF16_TOLERANCE if precision == "bf16" else DEFAULT_TOLERANCE
                ctx = autocast if precision == "bf16" else None
                rec = self_check(eng, batch, 1.0, tol, ctx) if ctx else self_check(eng, batch, 1.0, tol)
                models.append({"model": name, "precision": precision, "max_rel_error": rec["max_rel_error"]})
            except ConfigError as e:
                models.append({"model": name, "precision": precision, "error": str(e)[:200]})
                bad.append(f"self-check {name} {precision}: {str(e)[:120]}")
            finally:
                eng.close()
        del model
    matched = sum(r["outcome"] == "match" for r in rows)
    worst = max(
        (min(r["error_vs_fp32_loop"], r["error_vs_bf16_loop"]) for r in rows if r["outcome"] == "match"),
        default=float("nan"),
    )
    return {
        "ok": not bad,
        "cells": rows,
        "self_check_false_alarms": false_alarms,
        "models": models,
        "summary": (
            f"bf16 grid: {matched} of {len(rows)} (case, bk path) cells match the fp32 or the bf16 loop (worst "
            f"{worst:.2g}, tolerance {BF16_TOLERANCE:g}; the rest refused as expected); the bf16 loop (the "
            f"self-check's reference) off on {len(false_alarms)}: {', '.join(false_alarms[:6]) or '-'}; self-check on "
            + ", ".join(
                f"{m['model']} {m['precision']} {m.get('max_rel_error', float('nan')):.2g}" for m in models
            )
            + (f"; WRONG: {'; '.join(bad[:10])}" if bad else "")
        ),
    }


def cmd_nccl(args) -> dict:
    """NCCL through the library's data-parallel context, one rank on one GPU. A context of one rank skips its
    collectives (``DistContext.active`` is ``world > 1``), so this one is made active: every collective the
    two-rank path runs (bucketed all-reduce, broadcast, object broadcast and gather, the shared noise) goes
    through NCCL, with one rank."""
    import torch
    import torch.distributed as dist

    from dp_adam_bench.engine.distributed import DistContext, SharedNoise
    from dp_adam_bench.privacy.mechanisms import IndependentMechanism

    cuda = args.device == "cuda"
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    backend = "nccl" if cuda else "gloo"  # gloo: the same code proven on a CPU
    if cuda:
        torch.cuda.set_device(dev)
    with __import__("socket").socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    dist.init_process_group(backend)
    try:

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
        ok = ok and float(two[0].sum()) == 3.0 and float(two[1].sum()) == 8.0
        return {
            "ok": ok,
            "summary": f"{backend} {'.'.join(map(str, torch.cuda.nccl.version())) if cuda else ''} one rank: "
            f"all_reduce (bucketed), broadcast, broadcast_object, gather_objects and SharedNoise "
            f"{'as one process' if ok else 'WRONG'}",
        }
    finally:
        dist.destroy_process_group()


SUBCOMMANDS = {"env": cmd_env, "tf32": cmd_tf32, "grid": cmd_grid, "nccl": cmd_nccl}


def _sub(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog=f"gpu_check.py {argv[0]}")
    parser.add_argument("--device", required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv[1:])
    got = SUBCOMMANDS[argv[0]](args)
    args.out.write_text(json.dumps(got, indent=1, default=str))
    print(got["summary"], flush=True)
    return 0 if got["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        return _sub(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", required=True, choices=("cuda", "cpu"), help="cuda, or cpu to prove it")
    parser.add_argument(
        "--quick", action="store_true", help="tiny sizes, one test file, the sweep as --dry-run"
    )
    parser.add_argument("--out", type=Path, default=OUT, help=f"the report folder (default {OUT})")
    parser.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for all the parts together")
    parser.add_argument("--parts", nargs="+", choices=[p.name for p in PARTS], default=None)
    parser.add_argument("--cores", type=int, default=None, help="pytest -n (default: every core)")
    args = parser.parse_args(argv)

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(
            f"--device cuda: torch {torch.__version__} sees no CUDA GPU here; use --device cpu --quick"
        )
    if args.device != "cuda" and args.out.resolve() == OUT.resolve():
        parser.error(
            f"--device {args.device} writes {OUT.relative_to(REPO_ROOT)} only from a CUDA run; pass --out"
        )
    if args.budget < MIN_PART_S:
        parser.error(f"--budget {args.budget:g}: need at least {MIN_PART_S} s")
    try:
        import xdist  # noqa: F401

        xdist_ok = True
    except ImportError:
        xdist_ok = False
    earlier = []
    if (
        args.parts is not None and (args.out / "results.json").is_file()
    ):  # a rerun of some parts: keep the rest
        earlier = json.loads((args.out / "results.json").read_text()).get("parts", [])
    elif args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="gpu_check_"))
    work.mkdir(parents=True, exist_ok=True)
    ctx = Ctx(
        args.device,
        args.quick,
        args.out.resolve(),
        work.resolve(),
        args.cores or os.cpu_count() or 1,
        xdist_ok,
    )
    parts = [p for p in PARTS if args.parts is None or p.name in args.parts]
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    header = _header(ctx, argv, args.budget, started) | {"earlier": earlier}
    results = run_parts(parts, ctx, args.budget, header)
    failed = [r.name for r in results if r.status in ("FAILED", "TIMED OUT")]
    print(f"[gpu-check] report: {ctx.out / 'report.md'}; {len(failed)} part(s) failed: {failed}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
