"""Profiles of the missed engine targets: which (model, B, mode) rows ``run_all.py`` profiles with
``profile_step.py``, and the README's list of the profiles in ``profiles/``.

Only ours is profiled (bk, stp via bk): Opacus' modes and stp via other engines are the comparison, not what the
targets are for.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from .engines import DEFAULT_STP, DP_MEM_MAX, DP_TIME_MAX, ISSUE_B, STP_TIME_MAX, in_issue_b

PROFILES = "profiles"  # the folder of the profiles, next to the CSVs


def misses(eng: pd.DataFrame | None, quick: bool = False) -> list[dict]:
    """The (model, B, mode) rows that miss issue B's targets, as profile_step arguments, non-private reference
    first per (model, B). Ours only: bk with time > DP_TIME_MAX or peak memory > DP_MEM_MAX, stp via bk with
    time > STP_TIME_MAX. ``quick``: any batch size (quick runs use B = 16)."""
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
            if r["mode"] == "bk":
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


def _profile_entries(bench_dir: Path) -> list[dict]:
    """One dict per profile (its .json side file, else the summary line of its .txt), sorted by file name."""
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
    """The README section 'Profiles of missed targets'."""
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
        "A file ending in `_bf16` is the same step under bf16 autocast (`profile_step.py --precision bf16`, issue "
        "60: why bk in bf16 is 2-3x a non-private bf16 step on a GPU), against the non-private bf16 step; its "
        "precision breakdown gives each phase's time by operator kind (matmul / conv, cast / copy, other) and input "
        "dtype, which shows that bk's norms and clipped sums run fp32 matmuls on the bf16 captures "
        "(engine/fp32_exact.py) while autocast's forward and backward run bf16 ones. The BERT-base and GPT-2 small "
        "pairs (fp32 and bf16): `for p in fp32 bf16; do for m in 'bert_base 8' 'gpt2_small 4'; do for mode in "
        "nonprivate bk; do BENCH_THREADS=1 python benchmarks/profile_step.py --model ${m% *} --batch-size ${m#* } "
        "--mode $mode --precision $p --physical-batch-size 0; done; done; done` (2026-12-08, one thread, while two "
        "training jobs used the machine's 2 cores: the seconds are inflated, the shares within a file are not).",
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
