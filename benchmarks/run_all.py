"""Run the benchmarks, one torch job at a time, profile the missed targets, then regenerate ``benchmarks/README.md``.

    make bench                                        # = .venv/bin/python benchmarks/run_all.py
    .venv/bin/python benchmarks/run_all.py --quick --out-dir /tmp/bench   # smoke test, committed files untouched
    .venv/bin/python benchmarks/run_all.py --only engines
    .venv/bin/python benchmarks/run_all.py --only engines --presets gpt2_small_B8   # named engine presets, merged
    .venv/bin/python benchmarks/run_all.py --only gpu    # the GPU benchmark (CUDA only; = make bench-gpu + README)
    .venv/bin/python benchmarks/run_all.py --profiles-only   # profile the misses of the current CSV
    .venv/bin/python benchmarks/run_all.py --readme-only

The scripts run sequentially (two torch jobs at once on a 2-core machine slow each other by up to 18x). The
engine benchmark is a list of named presets (``ENGINE_PRESETS``: CNN5, BERT-tiny classifier and MLM at B = 32 and
256, GPT-2-small-shaped at B = 8 and 32), merged into one CSV; after it, ``profile_step.py`` profiles every
(model, B, mode) of the issue's target table that misses its target (``profiles/``, non-private first as the
reference). A full run takes about an hour on 2 idle cores (estimated from single steps; GPT-2 at B = 32 is
about half of it) and needs about 17 GB of free memory at its peak (stp via Opacus hooks on GPT-2, B = 8). The
GPU benchmark (``bench_gpu.py``) is not part of a full run: only ``--only gpu`` runs it.

Each successful run is recorded in ``results_provenance.json`` (command, BENCH_THREADS, finish time, wall time,
sha256 of the CSV); the README names the command and time of each table from it, or says that they were not
recorded when the CSV was written some other way. What is run is listed in ``report/registry.py``; the README is
written by ``report/readme.py`` from the CSVs and the profiles (the targets are in the module of each benchmark).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from report.profiles import PROFILES, misses
from report.provenance import record_provenance
from report.readme import write_readme
from report.registry import BENCH_DIR, BENCHES, ENGINE_PRESETS, REPO_ROOT, default_benches
from report.tables import read_csv


def _shown(script: str, args: list[str]) -> str:
    return " ".join(["python", f"benchmarks/{script}", *args])


def run_bench(name: str, quick: bool, out_dir: Path = BENCH_DIR, presets: list[str] | None = None) -> bool:
    """Run one benchmark (its presets in order, or ``presets`` of them merged into the CSV) into ``out_dir``."""
    b = BENCHES[name]
    if quick:
        invocations = [list(b.quick_args)]
    else:
        chosen = [p for p in b.presets if presets is None or p.name in presets]
        if not chosen:
            return True
        invocations = []
        for i, p in enumerate(chosen):
            merge = b.merges and (i > 0 or presets is not None)
            invocations.append([*p.args, *(["--merge"] if merge else [])])
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    out_args = [] if out_dir.resolve() == BENCH_DIR.resolve() else ["--out", str(out_dir / b.csv)]
    start = time.perf_counter()
    shown_all, failed = [], []
    for args in invocations:
        cmd = [sys.executable, str(BENCH_DIR / b.script), *args, *out_args]
        shown = _shown(b.script, args + out_args)
        shown_all.append(shown)
        print(f"\n=== {shown}", flush=True)
        rc = subprocess.run(cmd, cwd=REPO_ROOT).returncode
        if rc != 0:
            # the later presets still run (bench_engines writes the rows it has, failed ones with a note)
            print(f"=== {shown} FAILED (exit {rc}) after {time.perf_counter() - start:.0f} s", flush=True)
            failed.append(shown)
    wall = time.perf_counter() - start
    if failed:
        print(
            f"=== {len(failed)} invocation(s) failed: the provenance of {b.csv} is not recorded", flush=True
        )
        return False
    shown = " && ".join(shown_all)
    via = f"python benchmarks/run_all.py{' --quick' if quick else ''}"
    record_provenance(out_dir, b.csv, shown, wall, via)
    print(f"=== done in {wall:.0f} s", flush=True)
    return True


def run_profiles(
    out_dir: Path = BENCH_DIR,
    quick: bool = False,
    pairs: set[tuple[str, int]] | None = None,
    timeout: float = 3600,
) -> bool:
    """profile_step.py for every miss of the engines CSV in ``out_dir`` (only ``pairs`` of (model, B) if given).
    The old profiles of every (model, B) in scope are removed first: they describe earlier measurements."""
    out_dir = Path(out_dir)
    eng = read_csv(out_dir / BENCHES["engines"].csv)
    if pairs is None:
        pairs = (
            set()
            if eng is None
            else {(m, int(b)) for m, b in zip(eng["model"], eng["batch_size"], strict=True)}
        )
    folder = out_dir / PROFILES
    for model, b in pairs:
        for old in folder.glob(f"{model}_B{b}_*"):
            old.unlink()
    todo = [m for m in misses(eng, quick) if (m["model"], m["batch_size"]) in pairs]
    if not todo:
        print("\n=== profiles: no missed target to profile", flush=True)
        return True
    sys.path.insert(0, str(BENCH_DIR))
    from bench_engines import child_env

    ok = True
    start = time.perf_counter()
    for m in todo:
        args = ["--model", m["model"], "--batch-size", str(m["batch_size"]), "--mode", m["mode"]]
        if m["engine"]:
            args += ["--engine", m["engine"]]
        args += ["--physical-batch-size", str(m["physical_batch_size"]), "--out-dir", str(folder)]
        args += ["--quick"] if quick else []
        print(f"\n=== {_shown('profile_step.py', args)}  ({m['why']})", flush=True)
        try:
            rc = subprocess.run(
                [sys.executable, str(BENCH_DIR / "profile_step.py"), *args],
                cwd=REPO_ROOT,
                env=child_env(),
                timeout=timeout,
            ).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        if rc != 0:
            print(f"=== profile FAILED ({rc})", flush=True)
            ok = False
    print(f"=== {len(todo)} profiles in {time.perf_counter() - start:.0f} s", flush=True)
    return ok


def _engine_keys(out_dir: Path) -> set:
    df = read_csv(Path(out_dir) / BENCHES["engines"].csv)
    if df is None:
        return set()
    cols = ["model", "batch_size", "mode", "engine", "date"]
    return set(zip(*(df[c].astype(str) for c in cols), strict=True))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__
        + "\nengine presets:\n"
        + "\n".join(f"  {p.name}: {' '.join(p.args) or '(defaults)'}" for p in ENGINE_PRESETS),
    )
    parser.add_argument("--quick", action="store_true", help="small sizes for a smoke test (passed through)")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=list(BENCHES),
        help="run only these benchmarks (default: all but gpu, which only runs when named here)",
    )
    parser.add_argument(
        "--presets",
        nargs="+",
        choices=[p.name for p in ENGINE_PRESETS],
        help="run only these engine presets (merged into the existing CSV; implies --only engines)",
    )
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=BENCH_DIR,
        help="where the CSVs, profiles, provenance and README go (default benchmarks/; /tmp/bench for smoke tests)",
    )
    parser.add_argument("--no-profiles", action="store_true", help="do not profile the missed targets")
    parser.add_argument(
        "--profiles-only", action="store_true", help="profile the misses of the CSV, then README"
    )
    parser.add_argument("--readme-only", action="store_true", help="regenerate README.md, run nothing")
    args = parser.parse_args(argv)
    if args.presets and args.quick:
        parser.error("--presets is for full-size runs (--quick runs its own small configuration)")
    out_dir = args.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    ok = True
    only = ["engines"] if args.presets else (args.only or list(default_benches()))
    if args.profiles_only:
        ok &= run_profiles(out_dir, args.quick)
    elif not args.readme_only:
        if args.quick and out_dir.resolve() == BENCH_DIR.resolve():
            print("--quick: the CSVs and README are overwritten with smoke-test numbers", flush=True)
        for name in only:
            before = _engine_keys(out_dir) if name == "engines" else set()
            ran = run_bench(name, args.quick, out_dir, args.presets)
            ok &= ran
            if name == "engines" and not args.no_profiles:
                # profile the (model, B) pairs measured now (also after a partial failure: their rows are new)
                new = _engine_keys(out_dir) - before
                pairs = {(m, int(b)) for m, b, *_ in new}
                if pairs:
                    ok &= run_profiles(out_dir, args.quick, pairs)
    print(f"\nwrote {write_readme(out_dir)}")
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
