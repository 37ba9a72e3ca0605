"""``results/REPORT.md``: every table's markdown in one document, opening with a summary of all claim checks.

Built only from the ``results/<id>.md`` files the reports wrote (never from runs), so it is regenerated in a
second by ``dp-adam-bench report --document`` and at the end of ``make reproduce-table``. The CPU-profile and exact
tables come first; the paper-profile tables (``results/paper/<id>.md``) follow in a section of their own, each linked
to the logged runs committed under ``results/paper/runs/<experiment>/`` (and their README, which says how they were
made) when that folder exists.
"""

from __future__ import annotations

import re
from pathlib import Path

from dp_adam_bench.paths import results_dir
from dp_adam_bench.report import stats
from dp_adam_bench.report.common import INCOMPLETE, NOT_CHECKED, VERDICTS
from dp_adam_bench.report.registry import GROUPS, results_for, spec

CLAIM = re.compile(
    r"^- (?P<text>.+?): \*\*(?P<verdict>"
    + "|".join(map(re.escape, VERDICTS))
    + r")\*\*(?: \((?P<detail>.*)\))?$"
)


IMAGE = re.compile(r"!\[(.*?)\]\((?!https?:)(.*?)\)")


def claims_of(markdown: str) -> list[tuple[str, str, str]]:
    """(claim, verdict, detail) for each line of the 'Paper claims checked here' section."""
    out, inside = [], False
    for line in markdown.splitlines():
        if line.startswith("## "):
            inside = line.strip() == "## Paper claims checked here"
            continue
        m = CLAIM.match(line) if inside else None
        if m:
            out.append((m["text"], m["verdict"], m["detail"] or ""))
    return out


def _command(markdown: str) -> str:
    m = re.search(r"^Regenerate: `(.+)`$", markdown, flags=re.M)
    return m.group(1) if m else ""


#: REPORT.md's statement of the rule, above its summary
RULE = (
    "Every claim follows one rule (`dp_adam_bench/report/stats.py`). A comparison of our cells over seeds is in one "
    "of five states: *holds* (the paper's direction, Welch's t-test p < 0.05, its degrees of freedom printed), "
    "*agrees, not decided* (the paper's direction, p >= 0.05), *disagrees, not decided* (the other direction, "
    "p >= 0.05), *contradicted* (the other direction, p < 0.05) or *untested* (fewer than 2 seeds a cell); cells "
    "whose hyper-parameters were chosen on the seeds the test reads are at most agreed or disagreed with. An exact "
    "quantity (an accountant's epsilon, a deterministic value, a count of audited rows) *matches* or *differs* "
    "against a tolerance whose reason the claim states. *not checked*: a claim the runs cannot check. Tables "
    "written under earlier rules were re-stated from their own CSVs, their runs not re-run; each says so in its "
    "notes."
)
#: the columns of the count table, in order: the five states, the exact two, then the rest
COUNTED = (*stats.STATES, *stats.EXACT, NOT_CHECKED, INCOMPLETE)


def state_counts(counts: dict[tuple[str, str], dict[str, int]]) -> list[str]:
    """The count table: per table (and profile), how many claims are in each state, and the totals."""
    shown = [v for v in COUNTED if v != INCOMPLETE or any(c[INCOMPLETE] for c in counts.values())]
    lines = [
        "Claims per table and state:",
        "",
        "| table | profile | " + " | ".join(shown) + " |",
        "|---|---|" + "---|" * len(shown),
    ]
    for (tid, label), c in counts.items():
        lines.append(f"| [{tid}](#{tid}-{label}) | {label} | " + " | ".join(str(c[v]) for v in shown) + " |")
    total = {v: sum(c[v] for c in counts.values()) for v in shown}
    lines.append("| **all** | | " + " | ".join(f"**{total[v]}**" for v in shown) + " |")
    lines += ["", "Totals: " + ", ".join(f"{total[v]} {v}" for v in shown if total[v]) + "."]
    return lines


PROFILES = ("cpu", "paper")
RUNS = "runs"  # results/<profile>/runs/<experiment>/: the committed runs a profile's tables were built from


def _runs_link(res: Path, table, profile: str) -> str:
    """`` — runs: <link>`` to ``results/<profile>/runs/<experiment name>/`` of ``table`` (and to its README) when
    that folder exists; "" otherwise."""
    from dp_adam_bench.sweep import sweep_spec

    folder = results_for(profile, res) / RUNS / sweep_spec(table.experiment, profile).name
    if not folder.is_dir():
        return ""
    rel = folder.relative_to(res).as_posix()
    how = f" ([how they were made]({rel}/README.md))" if (folder / "README.md").is_file() else ""
    return f" — runs: [{rel}/]({rel}/){how}"


def build_document(results: Path | None = None) -> Path:
    """Write ``<results>/REPORT.md`` (default: the results folder) from the tables found there."""
    res = Path(results) if results is not None else results_dir()
    out = res / "REPORT.md"
    present, missing = [], []
    for tid in GROUPS["all"]:
        table = spec(tid)
        found = False
        for profile in PROFILES if table.experiment else ("cpu",):
            p = results_for(profile, res) / f"{tid}.md"
            if p.exists():
                found = True
                label = profile if table.experiment else "exact"
                present.append((tid, table, label, p.read_text(), p.relative_to(res)))
        if not found:
            missing.append(tid)
    lines = [
        "# dp-adam-bench — results",
        "",
        "Assembled from `results/<id>.md` by `dp-adam-bench report --document`; each section below says the command "
        "that regenerates it. Numbers come from runs of this repository; paper numbers are printed beside them.",
        "",
        RULE,
        "",
        "## Summary of paper claims",
        "",
    ]
    counts, rows = {}, []
    for tid, _, label, md, _ in present:
        per_table = counts.setdefault((tid, label), dict.fromkeys(VERDICTS, 0))
        for text, verdict, detail in claims_of(md):
            per_table[verdict] += 1
            rows.append(
                f"| [{tid}](#{tid}-{label}) | {label} | {text} | **{verdict}** | {detail.replace('|', '/')} |"
            )
    lines += [
        *state_counts(counts),
        "",
        "Every claim:",
        "",
        "| table | profile | claim | verdict | detail |",
        "|---|---|---|---|---|",
        *rows,
        "",
    ]
    if missing:
        lines += [
            "Not generated yet: " + ", ".join(f"`{t}` (`make reproduce-table TABLE={t}`)" for t in missing),
            "",
        ]
    paper = [entry for entry in present if entry[2] == "paper"]
    if paper:
        lines += [
            "Paper-scale results (the papers' own settings, `--profile paper`, sized for a GPU): "
            + ", ".join(f"[{tid}](#{tid}-paper)" for tid, *_ in paper)
            + "; see [Paper-scale tables](#paper-scale-tables).",
            "",
        ]
    lines += ["## Tables", ""]
    for entry in present:
        if entry[2] != "paper":
            lines += _section(*entry)
    if paper:
        lines += [
            '<a id="paper-scale-tables"></a>',
            "## Paper-scale tables",
            "",
            "The papers' own settings (`--profile paper`: their models, batch sizes, steps and test sets), sized "
            "for a GPU and written to `results/paper/`. Each table is built from logged runs committed under "
            "`results/paper/runs/<experiment>/` (config, metrics and summary of every run, no checkpoints), whose "
            "README says how they were made (hardware, command, commit, cost); "
            "`DP_ADAM_BENCH_RUNS=results/paper/runs dp-adam-bench report <id> --profile paper` rebuilds a table from "
            "them.",
            "",
        ]
        for entry in paper:
            lines += _section(*entry, source=_runs_link(res, entry[1], "paper"))
    out.write_text("\n".join(lines))
    return out


def _section(tid: str, table, label: str, md: str, rel: Path, source: str = "") -> list[str]:
    """The lines of one table's section: its title and profile, paper, command and file (and ``source``: where its
    runs are), then the table's markdown, its headings one level down and its images relative to results/."""
    body = md.split("\n", 1)[1] if md.startswith("# ") else md
    title = md.splitlines()[0].lstrip("# ") if md.startswith("# ") else tid
    lines = [
        f'<a id="{tid}-{label}"></a>',
        f"### {title} ({label})",
        "",
        f"*{table.paper}* — `{_command(md)}` — [{rel}]({rel}){source}",
        "",
    ]
    prefix = "" if rel.parent == Path(".") else f"{rel.parent.as_posix()}/"
    for ln in body.splitlines()[1:]:
        ln = ln.replace("## ", "#### ", 1) if ln.startswith("## ") else ln
        lines.append(IMAGE.sub(lambda m, pre=prefix: f"![{m[1]}]({pre}{m[2]})", ln))
    lines.append("")
    return lines
