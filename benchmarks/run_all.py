"""Run every benchmark, one torch job at a time, profile the missed targets, then regenerate ``benchmarks/README.md``.

    make bench                                        # = .venv/bin/python benchmarks/run_all.py
    .venv/bin/python benchmarks/run_all.py --quick --out-dir /tmp/bench   # smoke test, committed files untouched
    .venv/bin/python benchmarks/run_all.py --only engines
    .venv/bin/python benchmarks/run_all.py --only engines --presets gpt2_small_B8   # named engine presets, merged
    .venv/bin/python benchmarks/run_all.py --profiles-only   # profile the misses of the current CSV
    .venv/bin/python benchmarks/run_all.py --readme-only

The scripts run sequentially (two torch jobs at once on a 2-core machine slow each other by up to 18x). The
engine benchmark is a list of named presets (``ENGINE_PRESETS``: CNN5, BERT-tiny classifier and MLM at B = 32 and
256, GPT-2-small-shaped at B = 8 and 32), merged into one CSV; after it, ``profile_step.py`` profiles every
(model, B, mode) of the issue's target table that misses its target (``profiles/``, non-private first as the
reference). A full run takes about an hour on 2 idle cores (estimated from single steps; GPT-2 at B = 32 is
about half of it) and needs about 17 GB of free memory at its peak (stp via Opacus hooks on GPT-2, B = 8).

Each successful run is recorded in ``results_provenance.json`` (command, BENCH_THREADS, finish time, wall time,
sha256 of the CSV); the README names the command and time of each table from it, or says that they were not
recorded when the CSV was written some other way. Every number in the README comes from the CSVs and the
profiles; the only constants here are the targets (the issue's and docs/pitfalls.md's numbers to beat).
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
class Preset:
    """One named invocation of a benchmark script (arguments after the script name)."""

    name: str
    args: tuple[str, ...]
    why: str = ""


@dataclass(frozen=True)
class Bench:
    script: str
    csv: str
    title: str
    what: str
    quick_args: tuple[str, ...]
    # the invocations of a full run, in order; the first replaces the CSV, the others are merged into it
    presets: tuple[Preset, ...] = (Preset("default", ()),)
    merges: bool = False  # whether the script takes --merge (needed by every preset after the first)


_LM = ("bert_tiny", "bert_tiny_mlm", "gpt2_small")
#: the engine benchmark of a full run (``--presets NAME ...`` runs some of them, merged into the existing CSV)
ENGINE_PRESETS = (
    Preset(
        "cnn5", ("--stp-engines", "bk", "hooks"), "CNN5 at B = 256 and 2048, every mode, stp via bk and hooks"
    ),
    Preset(
        "bert_tiny",
        ("--models", "bert_tiny", "--batch-sizes", "32", "256", "--stp-engines", "bk", "hooks"),
        "BERT-tiny classifier, T = 128, B = 32 and 256, every mode, stp via bk and hooks",
    ),
    Preset(
        "bert_tiny_mlm",
        ("--models", "bert_tiny_mlm", "--batch-sizes", "32", "256"),
        "BERT-tiny MLM, T = 128, B = 32 and 256, every mode it runs (no functorch), stp via bk",
    ),
    Preset(
        "bert_tiny_mlm_stp_hooks",
        ("--models", "bert_tiny_mlm", "--batch-sizes", "32", "--modes", "stp", "--stp-engines", "hooks"),
        "stp via Opacus hooks for comparison, B = 32 only (at B = 256 the per-example gradients and their scaled "
        "copy take about 17 GB)",
    ),
    Preset(
        "gpt2_small_B8",
        ("--models", "gpt2_small", "--batch-sizes", "8"),
        "GPT-2-small-shaped, T = 128, B = 8 (the issue's target), every mode it runs (no functorch), stp via bk",
    ),
    Preset(
        "gpt2_small_B8_stp_hooks",
        ("--models", "gpt2_small", "--batch-sizes", "8", "--modes", "stp", "--stp-engines", "hooks"),
        "stp via Opacus hooks for comparison (about 17 GB peak: 8 x 163M per-example gradients and their scaled "
        "copy)",
    ),
    Preset(
        "gpt2_small_B32",
        ("--models", "gpt2_small", "--batch-sizes", "32", "--modes", "nonprivate", "ghost", "stp"),
        "GPT-2-small-shaped, B = 32 (issue A), whole batch: non-private, Opacus ghost, stp via bk",
    ),
    Preset(
        "gpt2_small_B32_micro8",
        (
            *("--models", "gpt2_small", "--batch-sizes", "32", "--modes", "bk", "hooks"),
            *("--physical-batch-size", "8"),
        ),
        "GPT-2-small-shaped, B = 32 in 4 micro-batches of 8 for bk and Opacus hooks: on the whole batch they would "
        "hold per-example gradients of 32 x 124M (bk: every Linear layer, kept until the clip factors are known) "
        "or 32 x 163M (hooks) floats, 16-21 GB, more than this machine's 23 GB with the rest of the step",
    ),
)

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
    "fig2": Bench(
        "bench_fig2.py",
        "results_fig2.csv",
        "Fig. 2 table end to end",
        "wall time of the whole Ganesh et al. Fig. 2 table (the 91-run sweep and its report, 30 vectorised trials "
        "per run) in a fresh run store, with W&B disabled and offline",
        ("--quick",),
    ),
    "engines": Bench(
        "bench_engines.py",
        "results_engines.csv",
        "Training step per clipping engine",
        "median wall time and peak RSS of one full training step (forward, per-example clipping, sum, noise, "
        "optimizer update) per clipping engine and for scale-then-privatize, against a non-private "
        "forward/backward/torch.optim.Adam step, each configuration in its own process",
        ("--quick", "--models", "cnn5", *_LM, "--stp-engines", "bk", "hooks"),
        ENGINE_PRESETS,
        merges=True,
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
FIG2_MAX_S = 15.0  # the 1-D logistic Fig. 2 table end to end, seconds
#: docs/pitfalls.md, "Measured cost on CPU (2 threads)", small CNN, B = 32-256: (low, high) ratios to beat
PITFALLS_CNN = {
    ("ghost", "time"): (2.2, 2.3),
    ("ghost", "memory"): (1.3, 1.4),
    ("hooks", "time"): (3.4, 4.2),
    ("hooks", "memory"): (None, 3.0),
}
FLAT = ("ghost", "bk", "hooks", "functorch")
DEFAULT_STP = "bk"  # the engine of our stp rows (bench_engines.DEFAULT_STP_ENGINE); others are comparisons
CNN_MODEL = "cnn5"
#: issue B's table: model -> (smallest, largest) batch size its DP-time / memory / stp targets are stated for
ISSUE_B = {"cnn5": (256, 256), "bert_tiny": (32, 256), "bert_tiny_mlm": (32, 256), "gpt2_small": (8, 8)}
MODEL_NAMES = {
    "cnn5": "CNN5",
    "bert_tiny": "BERT-tiny classifier",
    "bert_tiny_mlm": "BERT-tiny MLM",
    "gpt2_small": "GPT-2-small-shaped",
}
PROFILES = "profiles"
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


def in_issue_b(model: str, b: int) -> bool:
    """Whether issue B states its DP-time / memory / stp targets for this model and batch size."""
    lo_hi = ISSUE_B.get(model)
    return lo_hi is not None and lo_hi[0] <= b <= lo_hi[1]


def factor_verdict(value: float, limit: float) -> str:
    """'met (1.22x <= 1.50x)' or 'MISSED x1.41 (2.12x vs 1.50x)': the miss factor is measured / target."""
    if value != value:
        return "not measured"
    if value <= limit:
        return f"met ({value:.2f}x <= {limit:.2f}x)"
    return f"MISSED x{value / limit:.2f} ({value:.2f}x vs {limit:.2f}x)"


def _stp_engines(eng: pd.DataFrame) -> list[str]:
    found = set(eng.loc[eng["mode"] == "stp", "engine"].dropna().astype(str))
    order = ["bk", "hooks", "functorch"]
    return [e for e in order if e in found] + sorted(found - set(order))


def ratio_table(eng: pd.DataFrame | None) -> list[str]:
    """The per-(model, B) table: each mode's time / memory ratio against non-private, and issue B's verdicts."""
    if eng is None or eng.empty:
        return ["No engine rows yet (`python benchmarks/run_all.py --only engines`).", ""]
    stp_engines = _stp_engines(eng)
    flat = [m for m in FLAT if (eng["mode"] == m).any()]
    head = (
        ["model", "B", "T", "non-private s/step, GiB"]
        + [f"{m} x time / x mem" for m in flat]
        + [f"stp ({e}) x time / x mem" for e in stp_engines]
        + [f"flat time <= {DP_TIME_MAX}x", f"flat memory <= {DP_MEM_MAX}x", f"stp <= {STP_TIME_MAX}x"]
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    order = {m: i for i, m in enumerate(ISSUE_B)}
    pairs = sorted(
        {(m, int(b)) for m, b in zip(eng["model"], eng["batch_size"], strict=True)},
        key=lambda mb: (order.get(mb[0], len(order)), mb[0], mb[1]),
    )

    def cell(r: pd.Series | None) -> str:
        if r is None:
            return ""
        if r.ratio_to_nonprivate != r.ratio_to_nonprivate:
            return "failed" if r.median_step_s != r.median_step_s else "no baseline"
        micro = ""
        if r.physical_batch_size == r.physical_batch_size and r.physical_batch_size < r.batch_size:
            micro = f" ({-(-int(r.batch_size) // int(r.physical_batch_size))} micro-batches)"
        return f"{r.ratio_to_nonprivate:.2f}x / {r.ratio_mem_to_nonprivate:.2f}x{micro}"

    def one(model, b, **eq) -> pd.Series | None:
        rows = _rows(eng, model=model, batch_size=b, **eq)
        return None if rows.empty else rows.iloc[-1]

    for model, b in pairs:
        base = one(model, b, mode="nonprivate")
        t = ""
        if base is not None and "seq_len" in base.index and base.seq_len == base.seq_len:
            t = str(int(base.seq_len))
        np_cell = "" if base is None else f"{base.median_step_s:.3g} s, {base.peak_rss_gib:.2f} GiB"
        cells = [MODEL_NAMES.get(model, model) + f" (`{model}`)", str(b), t, np_cell]
        cells += [cell(one(model, b, mode=m)) for m in flat]
        stp_rows = {e: one(model, b, mode="stp", engine=e) for e in stp_engines}
        cells += [cell(stp_rows[e]) for e in stp_engines]
        quick = _quick(base) if base is not None else ""
        if not in_issue_b(model, b):
            lo, hi = ISSUE_B.get(model, (None, None))
            stated = f"B = {lo}" + (f"-{hi}" if hi != lo else "") if lo else "not this model"
            cells += [f"no target (issue B: {stated})"] * 3
        else:
            best = _best_flat(eng, model, b)
            if best is None:
                cells += ["not measured", "not measured"]
            else:
                cells.append(
                    quick + f"{best['mode']}: " + factor_verdict(best.ratio_to_nonprivate, DP_TIME_MAX)
                )
                cells.append(
                    quick
                    + f"{best['mode']} (fastest): "
                    + factor_verdict(best.ratio_mem_to_nonprivate, DP_MEM_MAX)
                )
            ours = stp_rows.get(DEFAULT_STP)
            measured = [
                r
                for r in stp_rows.values()
                if r is not None and r.ratio_to_nonprivate == r.ratio_to_nonprivate
            ]
            if ours is None or ours.ratio_to_nonprivate != ours.ratio_to_nonprivate:
                ours = min(measured, key=lambda r: r.ratio_to_nonprivate) if measured else None
            cells.append(
                "not measured"
                if ours is None
                else quick + f"via {ours.engine}: " + factor_verdict(ours.ratio_to_nonprivate, STP_TIME_MAX)
            )
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return lines + [""]


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
        where = f"{model}, B={b}" + ("" if in_issue_b(model, b) else " (outside the issue's table)")
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
                f"{r.model}, B={r.batch_size}"
                + ("" if in_issue_b(r.model, int(r.batch_size)) else " (outside the issue's table)"),
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

    # issue: the Fig. 2 table end to end
    name = f"1-D logistic Fig. 2 table end to end < {FIG2_MAX_S:g} s"
    fig2 = dfs.get("fig2")
    if fig2 is None or fig2.empty:
        out.append((name, "results_fig2.csv", "", not_yet))
    else:
        for _, r in fig2.iterrows():
            out.append(
                (
                    name,
                    f"W&B {r.wandb_mode}, {int(r.runs)} runs",
                    f"{r.total_s:.1f} s ({r.s_per_run:.2f} s a run)",
                    verdict(r.total_s, FIG2_MAX_S, "s", strict=True),
                )
            )

    # docs/pitfalls.md numbers to beat, small CNN
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


def gpt2_b256_note(eng: pd.DataFrame | None) -> str:
    """Why GPT-2-small-shaped at B = 256 (issue A) is not run, with the measured B = 32 step where there is one."""
    row = _rows(eng, model="gpt2_small", mode="nonprivate") if eng is not None else pd.DataFrame()
    row = row[row["median_step_s"].notna()] if not row.empty else row
    measured = ""
    if not row.empty:
        r = row.loc[row["batch_size"].idxmax()]
        measured = (
            f" (measured here: {r.median_step_s:.3g} s per non-private step at B = {int(r.batch_size)}, so about "
            f"{r.median_step_s * 256 / r.batch_size:.0f} s at B = 256 before any DP overhead)"
        )
    return (
        "GPT-2-small-shaped at B = 256 (issue A) is not run: a step costs about 8x the B = 32 step"
        + measured
        + ", so 7 steps of each of 5 modes would take hours on 2 CPU threads; and per-example gradients of its "
        "163M trainable parameters (124M plus the untied lm_head) take 256 x 163M x 4 B = 167 GB with Opacus hooks "
        "(bk instantiates those of its Linear layers too: 127 GB), so on this 23 GB machine B = 256 would be the "
        "B = 32 configuration's micro-batches 8 times over."
    )


def _profile_entries(bench_dir: Path) -> list[dict]:
    out = []
    folder = Path(bench_dir) / PROFILES
    for txt in sorted(folder.glob("*.txt")) if folder.is_dir() else []:
        info: dict = {}
        side = txt.with_suffix(".json")
        if side.is_file():
            try:
                info = json.loads(side.read_text())
            except json.JSONDecodeError:
                info = {}
        if not info.get("summary"):
            first = [ln for ln in txt.read_text().splitlines() if ln.startswith("Summary: ")]
            info["summary"] = first[0][len("Summary: ") :] if first else "(no summary line)"
        info["file"] = f"{PROFILES}/{txt.name}"
        out.append(info)
    return out


def profiles_section(bench_dir: Path) -> list[str]:
    entries = _profile_entries(bench_dir)
    lines = [
        "## Profiles of missed targets: `profiles/`",
        "",
        "Written by `python benchmarks/profile_step.py` (run by `run_all.py` for every (model, B, mode) of issue "
        "B's table whose ratio misses its target, after the engine benchmark; the non-private step of the same "
        "(model, B) first, as the reference). torch.profiler on CPU, 3 steps after 1 warm-up; each file has the "
        "per-phase breakdown (forward / backward / per-example gradients / norms / clipped sum / noise / optimizer, "
        "from `record_function` labels) and the top operators by self CPU time. The summaries below say where the "
        "time goes (against the non-private step where its profile exists: where the extra time of the DP step "
        "goes).",
        "",
    ]
    if not entries:
        return lines + [
            "No profiles yet: `python benchmarks/run_all.py --profiles-only` profiles the misses of "
            "results_engines.csv.",
            "",
        ]
    for e in entries:
        flag = " (QUICK: tiny shapes, not representative)" if e.get("quick") else ""
        date = f" [{e['date']}]" if e.get("date") else ""
        lines.append(f"- [`{e['file']}`]({e['file']}){flag}: {e['summary']}{date}")
    return lines + [""]


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
    quick = any("--quick" in e.get("command", "") for e in prov.values() if isinstance(e, dict))
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
        "- `profile_step.py` -> `profiles/<model>_B<b>_<mode>.txt`: where the time of one step goes "
        "(torch.profiler), for the configurations that miss a target.",
        "",
        f"Machine: {_machine(dfs['engines'])}. Torch threads: `BENCH_THREADS` (default 2); as measured: "
        + ("; ".join(threads) if threads else "not recorded")
        + ". The accounting benchmark is single-process NumPy/SciPy work. Versions (torch, opacus, transformers) "
        "are columns of results_engines.csv.",
        "",
        "How to run (one torch job at a time: two at once on a 2-core machine slow each other by up to 18x):",
        "",
        "```bash",
        "make bench                                        # everything, full size, profiles of misses, this README",
        "python benchmarks/run_all.py --quick --out-dir /tmp/bench  # smoke test into /tmp (numbers meaningless)",
        "python benchmarks/run_all.py --only engines       # one benchmark (+ profiles), then this README",
        "python benchmarks/run_all.py --only engines --presets gpt2_small_B8  # named presets, merged into the CSV",
        "python benchmarks/run_all.py --profiles-only      # profile the misses of the current CSV",
        "python benchmarks/run_all.py --readme-only        # only regenerate this README from the CSVs",
        "python benchmarks/bench_engines.py --models bert_tiny --batch-sizes 256 --merge  # add rows by hand",
        "python benchmarks/profile_step.py --model gpt2_small --batch-size 8 --mode ghost  # one profile",
        "```",
        "",
        "A full run takes about an hour on 2 idle cores (GPT-2 at B = 32 about half of it) and needs about 17 GB "
        "of free memory at its peak. Engine presets of a full run (`--presets`): "
        + "; ".join(f"`{p.name}`: {p.why}" for p in ENGINE_PRESETS)
        + ".",
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
        "## DP step against non-private, per model and batch size",
        "",
        "From results_engines.csv: each cell is DP step time / non-private step time and DP peak RSS / non-private "
        "peak RSS at the same (model, B) (ghost and hooks are Opacus, bk is ours, stp is scale-then-privatize; the "
        "engine in brackets). Issue B's targets, for the configurations of its table (CNN5 B = 256; BERT-tiny "
        "classifier and MLM, T = 128, B = 32-256; GPT-2-small-shaped B = 8): the fastest flat-clipping engine's "
        f"step <= {DP_TIME_MAX}x and its peak memory <= {DP_MEM_MAX}x; stp (via bk, ours) <= {STP_TIME_MAX}x. "
        "'MISSED xF' gives the miss factor F = measured / target. Memory is the peak RSS of the whole process "
        "(interpreter, torch, opacus and transformers included).",
        "",
        gpt2_b256_note(eng),
        "",
    ]
    lines += ratio_table(eng)
    lines += profiles_section(bench_dir)
    lines += [
        "## Targets",
        "",
        "Computed from the CSVs above. Issue targets are upper limits; for the docs/pitfalls.md numbers (Opacus on "
        "this CPU, 2 threads, small CNN, B = 32-256) 'met' means better than the best of the measured range. Ratios "
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


def misses(eng: pd.DataFrame | None, quick: bool = False) -> list[dict]:
    """The (model, B, mode) rows that miss issue B's targets, as profile_step arguments, non-private reference
    first per (model, B). Ours only: bk with time > DP_TIME_MAX or peak memory > DP_MEM_MAX, stp via bk with
    time > STP_TIME_MAX (Opacus' modes and stp via other engines are comparisons, not the targets' subject).
    ``quick``: any batch size (quick runs use B = 16)."""
    out: list[dict] = []
    if eng is None or eng.empty:
        return out
    for (model, b), g in eng.groupby(["model", "batch_size"], sort=False):
        b = int(b)
        if model not in ISSUE_B or not (quick or in_issue_b(model, b)):
            continue
        found = []
        for _, r in g.iterrows():
            t, m = r.ratio_to_nonprivate, r.ratio_mem_to_nonprivate
            if t != t:
                continue
            why = []
            if r["mode"] == "bk":  # ours: Opacus' modes are the comparison, not what the targets are for
                if t > DP_TIME_MAX:
                    why.append(f"time {t:.2f}x > {DP_TIME_MAX}x")
                if m == m and m > DP_MEM_MAX:
                    why.append(f"memory {m:.2f}x > {DP_MEM_MAX}x")
            elif r["mode"] == "stp" and r.engine == DEFAULT_STP and t > STP_TIME_MAX:
                why.append(f"time {t:.2f}x > {STP_TIME_MAX}x")
            if why:
                phys = r.physical_batch_size
                found.append(
                    {
                        "model": model,
                        "batch_size": b,
                        "mode": r["mode"],
                        "engine": r.engine if r["mode"] == "stp" else None,
                        "physical_batch_size": int(phys) if phys == phys else b,
                        "why": "; ".join(why),
                    }
                )
        if found:
            ref = {"model": model, "batch_size": b, "mode": "nonprivate", "engine": None}
            out += [ref | {"physical_batch_size": b, "why": "reference"}, *found]
    return out


def run_profiles(
    out_dir: Path = BENCH_DIR,
    quick: bool = False,
    pairs: set[tuple[str, int]] | None = None,
    timeout: float = 3600,
) -> bool:
    """profile_step.py for every miss of the engines CSV in ``out_dir`` (only ``pairs`` of (model, B) if given).
    The old profiles of every (model, B) in scope are removed first: they describe earlier measurements."""
    out_dir = Path(out_dir)
    eng = _read(out_dir / BENCHES["engines"].csv)
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
    df = _read(Path(out_dir) / BENCHES["engines"].csv)
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
    parser.add_argument("--only", nargs="+", choices=list(BENCHES), help="run only these benchmarks")
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
    only = ["engines"] if args.presets else (args.only or list(BENCHES))
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
