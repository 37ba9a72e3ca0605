"""Running the parts: each in its own process group with its own time limit, within the whole budget, the report
rewritten as each part ends (so a part that fails or hangs, or the whole command being killed, loses nothing
measured before)."""

from __future__ import annotations

import os
import signal
import subprocess
import time

from .part import Ctx, Part, PartFailed, Result
from .paths import REPO_ROOT
from .report import write_report

#: the least time a part starts with
MIN_PART_S = 20
#: seconds a part has after SIGINT at its limit (pytest then writes its JUnit XML of the tests run so far)
GRACE_S = 15


def run_parts(parts: list[Part], ctx: Ctx, budget: float, header: dict) -> list[Result]:
    env = part_env(ctx)
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


def part_env(ctx: Ctx) -> dict:
    """The parts' environment: this checkout importable, W&B and the Hub offline, runs, caches and GPU slot files
    in the scratch folder, progress as lines."""
    return {
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
        _run_commands(cmds, res, env, log, start)
    res.seconds = time.perf_counter() - start
    text = log_path.read_text(errors="replace")
    _check(part, ctx, res, text)
    if res.status != "passed":
        tail = "\n".join(text.splitlines()[-3:])
        res.summary += f" | log tail: {tail[-300:]}"
    return res


def _run_commands(cmds: list[list[str]], res: Result, env: dict, log, start: float) -> None:
    """The part's commands in order, each logged first, until one fails or the part's limit is reached."""
    for cmd, shown in zip(cmds, res.commands, strict=True):
        log.write(f"$ {shown}\n")
        log.flush()
        rc = _run(cmd, env, log, res.limit_s - (time.perf_counter() - start))
        if rc is None:
            res.status, res.summary = "TIMED OUT", f"after {res.limit_s:.0f} s: {shown[:200]}"
            return
        if rc != 0:
            res.status, res.summary = "FAILED", f"exit {rc}: {shown[:200]}"
            return


def _default_sigint() -> None:
    """The child takes SIGINT again: a command started in the background (``nohup make gpu-check &``) inherits
    SIGINT ignored, and Python then never raises KeyboardInterrupt, so a part past its limit would not stop on
    SIGINT (nor write what it got done) and would wait the whole grace period for SIGKILL."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _run(cmd: list[str], env: dict, log, timeout: float) -> int | None:
    """Run ``cmd`` in its own process group, output to ``log``; its exit code, or None if it outran ``timeout``
    (then the group gets SIGINT, and SIGKILL :data:`GRACE_S` seconds later if still there)."""
    proc = subprocess.Popen(
        cmd,
        cwd=REPO_ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=_default_sigint,
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


def _check(part: Part, ctx: Ctx, res: Result, log: str) -> None:
    """The part's check of what it left (after a timeout: what it got done, pytest: the tests run so far), into
    ``res``'s status and summary."""
    try:
        summary = part.verify(ctx, log)
        res.summary = summary if res.status == "passed" else f"{res.summary}; {summary}"
    except PartFailed as err:
        _failed(res, str(err))
    except Exception as err:  # a check that cannot read what the part left: its own failure, not the run's
        _failed(res, f"check failed: {type(err).__name__}: {err}")


def _failed(res: Result, why: str) -> None:
    res.status = "FAILED" if res.status == "passed" else res.status
    res.summary = (res.summary + "; " if res.summary else "") + why
