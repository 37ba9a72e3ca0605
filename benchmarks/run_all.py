"""Run every benchmark, one torch job at a time, then regenerate ``benchmarks/README.md`` from the CSVs.

    make bench                                        # = .venv/bin/python benchmarks/run_all.py
    .venv/bin/python benchmarks/run_all.py --quick    # smoke test: small sizes, numbers not representative
    .venv/bin/python benchmarks/run_all.py --only engines
    .venv/bin/python benchmarks/run_all.py --readme-only

The scripts run sequentially (two torch jobs at once on a 2-core machine slow each other by up to 18x). Each
successful run is recorded in ``results_provenance.json`` (command, BENCH_THREADS, finish time, wall time, sha256
of the CSV); the README names the command and time of each table from it, or says that they were not recorded
when the CSV was written some other way. Every number in the README comes from the CSVs; the only constants here
are the targets (the issue's and PITFALLS.md's numbers to beat).
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
PROVENANCE = "results_provenance.json"


@dataclass(frozen=True)
class Bench:
    script: str
    csv: str
    title: str
    what: str
    quick_args: tuple[str, ...]
    # further invocations of the same script in a full run, merged into the same CSV
    extra_runs: tuple[tuple[str, ...], ...] = ()


BENCHES = {
    "accounting": Bench(
        "bench_accounting.py",
        "results_accounting.csv",
        "Sigma calibration (accounting)",
        "wall time of calibrating sigma for eps = 8, delta = 1e-5 per accountant and setting, with cold caches "
        "(median and min over repeats), and of one epsilon evaluation at the calibrated sigma",
        ("--repeats", "1"),
    ),
    "noise": Bench(
        "bench_noise.py",
        "results_noise.csv",
        "Noise generation per step",
        "median wall time of one step of noise (independent, BandMF b = 128, BLT with 4 buffers) for d = 4.4M "
        "(TinyBERT-sized) and d = 124M (GPT-2-sized), and the peak RSS of a process doing only that",
        ("--warmup", "1", "--repeats", "5"),
    ),
    "engines": Bench(
        "bench_engines.py",
        "results_engines.csv",
        "Training step per clipping engine",
        "median wall time and peak RSS of one full training step (forward, per-example clipping, sum, noise, "
        "optimizer update) per clipping engine and for scale-then-privatize, against a non-private "
        "forward/backward/torch.optim.Adam step, each configuration in its own process",
        ("--quick",),
        # BERT-tiny (4.4M parameters) at B = 32: the model the noise-share targets are measured against
        (("--models", "bert_tiny", "--batch-sizes", "32", "--merge"),),
    ),
}

# ----------------------------------------------------------------------------------------------- targets
#: the issue's targets (upper limits)
DP_TIME_MAX = 1.5  # DP step / non-private step, flat clipping
DP_MEM_MAX = 1.2  # peak memory, DP / non-private
STP_TIME_MAX = 3.0  # scale-then-privatize step / non-private step
BANDMF_FRACTION_MAX = 0.10  # BandMF b = 128 noise per step / DP step at d = 4.4M
BLT_FRACTION_MAX = 0.02  # BLT noise per step / DP step at d = 4.4M
CALIBRATION_MAX_S = 1.0  # sigma calibration, seconds
#: PITFALLS.md, "Measured cost on this CPU (2 threads)", small CNN, B = 32-256: (low, high) ratios to beat
PITFALLS_CNN = {
    ("ghost", "time"): (2.2, 2.3),
    ("ghost", "memory"): (1.3, 1.4),
    ("hooks", "time"): (3.4, 4.2),
    ("hooks", "memory"): (None, 3.0),
}
FLAT = ("ghost", "bk", "hooks", "functorch")
CNN_MODEL = "cnn5"
D44_MODEL = "bert_tiny"  # the d = 4.4M model of the noise targets
D44_NOISE_MODEL = "tinybert_4.4M"


# ----------------------------------------------------------------------------------------------- provenance


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def load_provenance(bench_dir: Path) -> dict:
    f = bench_dir / PROVENANCE
    try:
        return json.loads(f.read_text()) if f.is_file() else {}
    except (OSError, json.JSONDecodeError):
        return {}


def record_provenance(bench_dir: Path, csv: str, command: str, wall_s: float, via: str = "") -> None:
    prov = load_provenance(bench_dir)
    path = bench_dir / csv
    prov[csv] = {
        "command": command,
        "via": via,
        "bench_threads": os.environ.get("BENCH_THREADS", "2 (default)"),
        "finished": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "wall_s": round(wall_s, 1),
        "sha256": _sha256(path) if path.is_file() else None,
    }
    (bench_dir / PROVENANCE).write_text(json.dumps(prov, indent=2, sort_keys=True) + "\n")


def provenance_line(bench_dir: Path, csv: str, prov: dict, df: pd.DataFrame | None) -> str:
    path = bench_dir / csv
    entry = prov.get(csv)
    if entry and path.is_file() and entry.get("sha256") == _sha256(path):
        return (
            f"Produced by `{entry['command']}`"
            + (f" (run by `{entry['via']}`)" if entry.get("via") else "")
            + f", BENCH_THREADS={entry['bench_threads']}, finished "
            f"{entry['finished']}, took {entry['wall_s']:.0f} s."
        )
    mtime = dt.datetime.fromtimestamp(path.stat().st_mtime).astimezone().isoformat(timespec="seconds")
    when = f"file last modified {mtime}"
    if df is not None and "date" in df.columns and df["date"].notna().any():
        when = f"rows dated {', '.join(sorted(set(map(str, df['date'].dropna()))))}"
    return (
        f"Command not recorded (the CSV was not written by `run_all.py`, or changed since); {when}. "
        f"Default command: `python benchmarks/{_bench_for(csv).script}`."
    )


def _bench_for(csv: str) -> Bench:
    return next(b for b in BENCHES.values() if b.csv == csv)


# ----------------------------------------------------------------------------------------------- tables


def _fmt(x) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return ""
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        if x == int(x) and abs(x) < 1e15:
            return str(int(x))
        if abs(x) >= 1000:
            return f"{x:.0f}"
        return f"{x:.4g}"
    return str(x).replace("|", "\\|")


def _present(v) -> bool:
    return not (v is None or (isinstance(v, float) and math.isnan(v)) or v == "")


#: columns that identify a row: shown even when every row has the same value
KEY_COLUMNS = {"model", "batch_size", "mode", "engine", "mechanism", "setting", "accountant"}


def markdown_table(df: pd.DataFrame) -> tuple[str, str]:
    """(caption of the columns that are the same in every row, markdown table of the others)."""
    df = df.astype(object).where(df.notna(), None)
    cols = [c for c in df.columns if any(_present(v) for v in df[c])]  # drop all-empty columns
    constant = {}
    if len(df) > 1:
        for c in cols:
            if c in KEY_COLUMNS:
                continue
            vals = {_fmt(v) for v in df[c]}
            if len(vals) == 1:
                constant[c] = vals.pop()
    shown = [c for c in cols if c not in constant]
    lines = ["| " + " | ".join(shown) + " |", "|" + "---|" * len(shown)]
    for _, r in df.iterrows():
        lines.append("| " + " | ".join(_fmt(r[c]) for c in shown) + " |")
    caption = "; ".join(f"{c} = {v}" for c, v in constant.items())
    return (f"Same in every row: {caption}." if caption else ""), "\n".join(lines)


# ----------------------------------------------------------------------------------------------- targets


def verdict(value: float, limit: float, unit: str = "x", strict: bool = False) -> str:
    """'met' / 'missed by ...' for value <= limit (value < limit with strict)."""
    if value != value:
        return "not measured yet"
    ok = value < limit if strict else value <= limit
    if ok:
        return f"met ({_num(value, unit)} {'<' if strict else '<='} {_num(limit, unit)})"
    over = value - limit
    pct = 100 * over / limit
    pct_s = f"{pct:.1f}" if pct < 10 else f"{pct:.0f}"
    return f"missed by {_num(over, unit)} ({_num(value, unit)} vs {_num(limit, unit)}, {pct_s} % over)"


def range_verdict(value: float, low: float | None, high: float, unit: str = "x") -> str:
    if value != value:
        return "not measured yet"
    if low is None:
        return verdict(value, high, unit)
    if value < low:
        return f"met: beats the best PITFALLS number ({_num(low, unit)}) by {_num(low - value, unit)}"
    where = (
        "within the PITFALLS range, not beaten" if value <= high else "worse than the whole PITFALLS range"
    )
    return f"missed by {_num(value - low, unit)} ({where})"


def _num(v: float, unit: str) -> str:
    if unit == "x":
        return f"{v:.2f}x"
    if unit == "%":
        return f"{100 * v:.1f} %"
    if unit == "s":
        return f"{v:.4g} s"
    return f"{v:.3g}{unit}"


def _rows(df: pd.DataFrame | None, **eq) -> pd.DataFrame:
    if df is None:
        return pd.DataFrame()
    m = pd.Series(True, index=df.index)
    for k, v in eq.items():
        m &= df[k] == v
    return df[m]


def _quick(row: pd.Series) -> str:
    """A warning prefix for engine rows from --quick runs (fewer than 5 timed steps)."""
    steps = row.get("steps")
    return "QUICK RUN, not representative: " if steps is not None and steps == steps and steps < 5 else ""


def _best_flat(eng: pd.DataFrame, model: str, b: int) -> pd.Series | None:
    rows = eng[(eng["model"] == model) & (eng["batch_size"] == b) & eng["mode"].isin(FLAT)]
    rows = rows[rows["ratio_to_nonprivate"].notna()]
    if rows.empty:
        return None
    return rows.loc[rows["ratio_to_nonprivate"].idxmin()]


def target_rows(dfs: dict[str, pd.DataFrame | None]) -> list[tuple[str, str, str, str]]:
    """(target, where from, measured, verdict) for every target, computed from the CSVs."""
    eng, noise, acc = dfs.get("engines"), dfs.get("noise"), dfs.get("accounting")
    out: list[tuple[str, str, str, str]] = []
    not_yet = "not measured yet"
    pairs = []
    if eng is not None and not eng.empty:
        pairs = sorted({(m, int(b)) for m, b in zip(eng["model"], eng["batch_size"], strict=True)})

    # issue: DP step time, peak memory, stp
    t_dp = f"DP step / non-private <= {DP_TIME_MAX}x (flat clipping)"
    t_mem = f"peak memory DP / non-private <= {DP_MEM_MAX}x"
    t_stp = f"stp step / non-private <= {STP_TIME_MAX}x"
    found = False
    for model, b in pairs:
        best = _best_flat(eng, model, b)
        if best is None:
            continue
        found = True
        where = f"{model}, B={b}"
        out.append(
            (
                t_dp,
                where,
                f"fastest: {best['mode']} {best.ratio_to_nonprivate:.2f}x",
                _quick(best) + verdict(best.ratio_to_nonprivate, DP_TIME_MAX),
            )
        )
        flat = _rows(eng, model=model, batch_size=b)
        flat = flat[flat["mode"].isin(FLAT) & flat["ratio_mem_to_nonprivate"].notna()]
        low = flat.loc[flat["ratio_mem_to_nonprivate"].idxmin()] if not flat.empty else best
        measured = f"{best['mode']} (fastest) {best.ratio_mem_to_nonprivate:.2f}x"
        if low["mode"] != best["mode"]:
            measured += f"; lowest: {low['mode']} {low.ratio_mem_to_nonprivate:.2f}x"
        out.append((t_mem, where, measured, _quick(best) + verdict(best.ratio_mem_to_nonprivate, DP_MEM_MAX)))
    if not found:
        out += [(t_dp, "results_engines.csv", "", not_yet), (t_mem, "results_engines.csv", "", not_yet)]
    stp = _rows(eng, mode="stp") if eng is not None else pd.DataFrame()
    stp = stp[stp["ratio_to_nonprivate"].notna()] if not stp.empty else stp
    for _, r in stp.iterrows():
        out.append(
            (
                t_stp,
                f"{r.model}, B={r.batch_size}",
                f"stp via {r.engine} {r.ratio_to_nonprivate:.2f}x",
                _quick(r) + verdict(r.ratio_to_nonprivate, STP_TIME_MAX),
            )
        )
    if stp.empty:
        out.append((t_stp, "results_engines.csv", "", not_yet))

    # issue: noise cost at d = 4.4M against the DP step of the d = 4.4M model
    for mech, limit, label in (
        ("bandmf_b128", BANDMF_FRACTION_MAX, "BandMF b=128"),
        ("blt_4", BLT_FRACTION_MAX, "BLT (4 buffers)"),
    ):
        name = f"{label} noise per step <= {100 * limit:.0f} % of the DP step at d = 4.4M"
        nrow = _rows(noise, mechanism=mech, model=D44_NOISE_MODEL)
        nrow = nrow[nrow["ms_per_step_median"].notna()] if not nrow.empty else nrow
        steps = []
        if eng is not None and not eng.empty:
            for model, b in pairs:
                if model == D44_MODEL and (best := _best_flat(eng, model, b)) is not None:
                    steps.append((b, best))
        if nrow.empty:
            out.append((name, "results_noise.csv", "", not_yet))
            continue
        ms = float(nrow.iloc[0].ms_per_step_median)
        n_thr = f", {_fmt(nrow.iloc[0].threads)} thread(s)" if "threads" in nrow.columns else ""
        if not steps:
            out.append(
                (
                    name,
                    "results_noise.csv + results_engines.csv",
                    f"noise {ms:.1f} ms/step; no DP step of {D44_MODEL} (d = 4.4M) in results_engines.csv",
                    f"{not_yet} (run `python benchmarks/bench_engines.py --models {D44_MODEL} --merge`)",
                )
            )
            continue
        for b, best in steps:
            frac = ms / 1e3 / best.median_step_s
            out.append(
                (
                    name,
                    f"{D44_MODEL} ({int(best.params)} params), B={b}",
                    f"noise {ms:.1f} ms{n_thr} / DP step {best.median_step_s:.3f} s ({best['mode']}, "
                    f"{_fmt(best.threads)} thread(s)) = {100 * frac:.1f} %",
                    _quick(best) + verdict(frac, limit, "%"),
                )
            )

    # issue: sigma calibration < 1 s (worst setting per accountant)
    name = f"sigma calibration < {CALIBRATION_MAX_S:g} s"
    if acc is None or acc.empty:
        out.append((name, "results_accounting.csv", "", not_yet))
    else:
        for accountant, g in acc.groupby("accountant", sort=False):
            worst = g.loc[g["calibrate_s_median"].idxmax()]
            out.append(
                (
                    name,
                    f"{accountant} (slowest of {len(g)} settings: {worst.setting})",
                    f"{_num(worst.calibrate_s_median, 's')} (median)",
                    verdict(worst.calibrate_s_median, CALIBRATION_MAX_S, "s", strict=True),
                )
            )

    # PITFALLS.md numbers to beat, small CNN
    for (mode, kind), (low, high) in PITFALLS_CNN.items():
        col = "ratio_to_nonprivate" if kind == "time" else "ratio_mem_to_nonprivate"
        rng = f"{low}-{high}x" if low is not None else f"<= {high}x"
        name = f"PITFALLS Opacus {mode} on the small CNN, {kind}: {rng}"
        rows = _rows(eng, model=CNN_MODEL, mode=mode)
        rows = rows[rows[col].notna()] if not rows.empty else rows
        if rows.empty:
            out.append((name, "results_engines.csv", "", not_yet))
        for _, r in rows.iterrows():
            b = int(r.batch_size)
            note = "" if 32 <= b <= 256 else " (PITFALLS measured B = 32-256)"
            out.append(
                (
                    name,
                    f"{CNN_MODEL}, B={b}{note}",
                    f"{r[col]:.2f}x",
                    _quick(r) + range_verdict(r[col], low, high),
                )
            )
    return out


# ----------------------------------------------------------------------------------------------- README


def _read(path: Path) -> pd.DataFrame | None:
    if not path.is_file():
        return None
    try:
        return pd.read_csv(path)
    except (pd.errors.EmptyDataError, pd.errors.ParserError):
        return None


def _machine(eng: pd.DataFrame | None) -> str:
    if eng is not None and "cpu" in eng.columns and eng["cpu"].notna().any():
        cpus = ", ".join(sorted(set(map(str, eng["cpu"].dropna()))))
        return f"{cpus} (from results_engines.csv)"
    sys.path.insert(0, str(BENCH_DIR))
    from bench_engines import cpu_name

    return f"{cpu_name()} (the machine that wrote this README; results_engines.csv not measured yet)"


def render_readme(bench_dir: Path = BENCH_DIR) -> str:
    bench_dir = Path(bench_dir)
    prov = load_provenance(bench_dir)
    dfs = {k: _read(bench_dir / b.csv) for k, b in BENCHES.items()}
    threads = []
    for k, df in dfs.items():
        if df is not None and "threads" in df.columns and df["threads"].notna().any():
            threads.append(
                f"{BENCHES[k].csv}: {', '.join(_fmt(t) for t in sorted(set(df['threads'].dropna())))}"
            )
    quick = any("--quick" in e.get("command", "") for e in prov.values())
    eng = dfs["engines"]
    quick |= eng is not None and "steps" in eng.columns and bool((eng["steps"] < 5).any())
    lines = [
        "# Benchmarks",
        "",
        "<!-- generated by benchmarks/run_all.py from the CSVs in this folder: edit run_all.py, not this file -->",
        "",
        "What is measured, one script and CSV each (all on CPU):",
        "",
    ]
    lines += [f"- `{b.script}` -> `{b.csv}`: {b.what}." for b in BENCHES.values()]
    lines += [
        "",
        f"Machine: {_machine(dfs['engines'])}. Torch threads: `BENCH_THREADS` (default 2); as measured: "
        + ("; ".join(threads) if threads else "not recorded")
        + ". The accounting benchmark is single-process NumPy/SciPy work.",
        "",
        "How to run (one torch job at a time: two at once on a 2-core machine slow each other by up to 18x):",
        "",
        "```bash",
        "make bench                                        # all three benchmarks, full size, then this README",
        "python benchmarks/run_all.py --quick              # smoke test: small sizes, numbers not representative",
        "python benchmarks/run_all.py --only engines       # one benchmark, then this README",
        "python benchmarks/run_all.py --readme-only        # only regenerate this README from the CSVs",
        "python benchmarks/bench_engines.py --models bert_tiny --batch-sizes 256 --merge  # add BERT-tiny rows",
        "```",
        "",
    ]
    if quick:
        lines += [
            "**Some tables below come from `--quick` runs (see the command above each table; engine rows with "
            "fewer than 5 timed steps): their numbers are smoke-test numbers, not measurements to quote.**",
            "",
        ]
    for k, b in BENCHES.items():
        lines += [f"## {b.title}: `{b.csv}`", ""]
        df = dfs[k]
        if df is None:
            lines += [f"Not measured yet: run `python benchmarks/{b.script}` or `make bench`.", ""]
            continue
        lines += [provenance_line(bench_dir, b.csv, prov, df), ""]
        caption, table = markdown_table(df)
        if caption:
            lines += [caption, ""]
        lines += [table, ""]
    lines += [
        "## Targets",
        "",
        "Computed from the CSVs above. Issue targets are upper limits; for the PITFALLS.md numbers (Opacus on this "
        "CPU, 2 threads, small CNN, B = 32-256) 'met' means better than the best of the measured range. Ratios "
        "are DP step / non-private step at the same model and batch size; memory is peak RSS of the whole process "
        "(interpreter, torch and opacus included: see rss_before_steps_gib for that baseline).",
        "",
        "| target | configuration | measured | verdict |",
        "|---|---|---|---|",
    ]
    for row in target_rows(dfs):
        lines.append("| " + " | ".join(_fmt(c) for c in row) + " |")
    lines.append("")
    return "\n".join(lines)


def write_readme(bench_dir: Path = BENCH_DIR, path: Path | None = None) -> Path:
    path = Path(path) if path is not None else Path(bench_dir) / "README.md"
    path.write_text(render_readme(bench_dir))
    return path


# ----------------------------------------------------------------------------------------------- running


def run_bench(name: str, quick: bool) -> bool:
    b = BENCHES[name]
    invocations = [list(b.quick_args)] if quick else [[], *(list(extra) for extra in b.extra_runs)]
    start = time.perf_counter()
    shown_all = []
    for args in invocations:
        cmd = [sys.executable, str(BENCH_DIR / b.script), *args]
        shown = " ".join(["python", f"benchmarks/{b.script}", *args])
        shown_all.append(shown)
        print(f"\n=== {shown}", flush=True)
        rc = subprocess.run(cmd, cwd=REPO_ROOT).returncode
        if rc != 0:
            wall = time.perf_counter() - start
            print(
                f"=== {shown} FAILED (exit {rc}) after {wall:.0f} s; its provenance is not recorded",
                flush=True,
            )
            return False
    wall = time.perf_counter() - start
    shown = " && ".join(shown_all)
    via = f"python benchmarks/run_all.py{' --quick' if quick else ''}"
    record_provenance(BENCH_DIR, b.csv, shown, wall, via)
    print(f"=== done in {wall:.0f} s", flush=True)
    return True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    parser.add_argument("--quick", action="store_true", help="small sizes for a smoke test (passed through)")
    parser.add_argument("--only", nargs="+", choices=list(BENCHES), help="run only these benchmarks")
    parser.add_argument("--readme-only", action="store_true", help="regenerate README.md, run nothing")
    args = parser.parse_args(argv)
    ok = True
    if not args.readme_only:
        if args.quick:
            print("--quick: the CSVs and README are overwritten with smoke-test numbers", flush=True)
        for name in args.only or list(BENCHES):
            ok &= run_bench(name, args.quick)
    print(f"\nwrote {write_readme()}")
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
