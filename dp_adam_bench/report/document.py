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
from dp_adam_bench.report.common import VERDICTS
from dp_adam_bench.report.registry import GROUPS, results_for, spec

CLAIM = re.compile(
    r"^- (?P<text>.+?): \*\*(?P<verdict>" + "|".join(VERDICTS) + r")\*\*(?: \((?P<detail>.*)\))?$"
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
        "Every claim about seeds follows one rule (`dp_adam_bench/report/stats.py`): it holds when the means are in "
        "the paper's order, and the seeds decide it when Welch's t-test gives p < 0.05; one they do not decide says "
        "WITHIN SEED NOISE and how many seeds a cell would decide it. Tables written under the earlier rule (> 2 "
        "standard errors) were re-stated from their own CSVs, their runs not re-run; each says so in its notes.",
        "",
        "## Summary of paper claims",
        "",
        "| table | profile | claim | verdict | detail |",
        "|---|---|---|---|---|",
    ]
    n_hold = n_fail = n_incomplete = 0
    for tid, _, label, md, _ in present:
        for text, verdict, detail in claims_of(md):
            n_hold += verdict == "holds"
            n_fail += verdict == "does not hold"
            n_incomplete += verdict == "incomplete"
            lines.append(
                f"| [{tid}](#{tid}-{label}) | {label} | {text} | **{verdict}** | {detail.replace('|', '/')} |"
            )
    counts = f"{n_hold} claims hold, {n_fail} do not" + (
        f", {n_incomplete} are incomplete (runs missing)" if n_incomplete else ""
    )
    lines += ["", counts + ".", ""]
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
