"""``report.md`` and ``results.json`` of the GPU check: the header (device, torch, commit, command, time) and one
row per part, an earlier run's rows kept for the parts a ``--parts`` rerun did not run."""

from __future__ import annotations

import json
import subprocess

from .part import Ctx, Result
from .paths import OUT, REPO_ROOT
from .registry import PARTS


def header(ctx: Ctx, argv: list[str], budget: float, started: str) -> dict:
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
    lines += _run_again(ctx, results)
    if header.get("earlier"):
        lines += ["", "Parts not rerun by this command keep an earlier run's result (its `results.json`)."]
    lines += [
        "",
        "Raw files beside this one: `results.json`, one `<part>.log` per part (its commands first), `suite.xml` / "
        "`conformance.xml` (JUnit), `env.json`, `tf32.json`, `grid.json`, `nccl.json`, `bench_gpu.csv` (a CUDA "
        "run's copy of `benchmarks/results_gpu.csv`).",
    ]
    (ctx.out / "report.md").write_text("\n".join(lines) + "\n")


def _merged(results: list[Result], earlier: list[dict]) -> list[Result]:
    """This run's results, with an earlier run's (``--parts``: a rerun of some parts) for the parts not rerun, in
    the order of :data:`PARTS`."""
    now = {r.name: r for r in results}
    before = {d["name"]: Result(**d) for d in earlier if d["name"] not in now}
    order = [p.name for p in PARTS] + [n for n in [*now, *before] if n not in {p.name for p in PARTS}]
    return [now.get(n) or before[n] for n in order if n in now or n in before]


def _run_again(ctx: Ctx, results: list[Result]) -> list[str]:
    """The command that reruns the parts not passed, keeping the others' results."""
    again = [r.name for r in results if r.status != "passed"]
    if not again:
        return []
    quick = " --quick" if ctx.quick else ""
    return [
        "",
        f"Not passed: {', '.join(again)}. Again, keeping the other parts' results here: `python "
        f"benchmarks/gpu_check.py --device {ctx.device}{quick} --parts {' '.join(again)}`"
        + ("" if ctx.out.resolve() == OUT.resolve() else f" `--out {ctx.out}`")
        + ".",
    ]
