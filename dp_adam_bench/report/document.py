"""``results/REPORT.md``: every table's markdown in one document, opening with a summary of all claim checks.

Built only from the ``results/<id>.md`` files the reports wrote (never from runs), so it is regenerated in a
second by ``dp-adam-bench report --document`` and at the end of ``make reproduce-table``.
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
    lines += ["## Tables", ""]
    for tid, table, label, md, rel in present:
        body = md.split("\n", 1)[1] if md.startswith("# ") else md
        title = md.splitlines()[0].lstrip("# ") if md.startswith("# ") else tid
        lines += [
            f'<a id="{tid}-{label}"></a>',
            f"### {title} ({label})",
            "",
            f"*{table.paper}* — `{_command(md)}` — [{rel}]({rel})",
            "",
        ]
        prefix = "" if rel.parent == Path(".") else f"{rel.parent.as_posix()}/"
        for ln in body.splitlines()[1:]:
            ln = ln.replace("## ", "#### ", 1) if ln.startswith("## ") else ln
            lines.append(IMAGE.sub(lambda m, pre=prefix: f"![{m[1]}]({pre}{m[2]})", ln))
        lines.append("")
    out.write_text("\n".join(lines))
    return out
