"""No line of the committed results says "holds" for a claim the seeds do not decide.

Every claim line of results/**/*.md (and every row of REPORT.md's summary) is read back: one that says **holds**
must print its Welch test (t, degrees of freedom, p) with p < 0.05 and no flag that it is undecided, untested or not
an independent test; every verdict is one of the current rule's (dp_adam_bench/report/stats.py). A line outside the
claims that says "holds" may only be the rule's own statement.
"""

import re
from pathlib import Path

import pytest

from dp_adam_bench.paths import REPO_ROOT
from dp_adam_bench.report.common import VERDICTS

RESULTS = REPO_ROOT / "results"
#: a claim line of a table's md, or a row of REPORT.md's summary table
CLAIM_LINE = re.compile(r"^- (?P<text>.+?): \*\*(?P<verdict>[^*]+)\*\*(?: \((?P<detail>.*)\))?$")
SUMMARY_ROW = re.compile(
    r"^\| \[[^]]+\]\([^)]+\) \| \w+ \| (?P<text>.+?) \| \*\*(?P<verdict>[^*]+)\*\* \| (?P<detail>.*) \|$"
)
#: Welch's test as :meth:`dp_adam_bench.report.stats.Gap.test` prints it
WELCH = re.compile(r"\(Welch, df (?P<df>\d+(?:\.\d+)?)\), p = (?P<p>[0-9.e+-]+)")
#: what a decided claim's detail never says
UNDECIDED = ("not decided:", "no test:", "not an independent test", "WITHIN SEED NOISE")
#: the openings of the lines that state the rule itself (a table's rule note, REPORT.md's paragraph) or count its
#: states (REPORT.md's count table and totals)
RULE_STATEMENTS = (
    "- Verdicts (dp_adam_bench/report/stats.py)",
    "Every claim follows one rule",
    "| table | profile | holds | agrees, not decided |",
    "Totals: ",
)
#: a gap's state beside its p, as a table's prose prints it ("p = 0.038, holds")
BESIDE_P = re.compile(r"p = (?P<p>[0-9.e+-]+), holds\b")


def undecided_holds(text: str) -> list[str]:
    """The lines of an md that say "holds" without a decided Welch test, or carry a verdict of no current rule."""
    bad = []
    for line in text.splitlines():
        m = CLAIM_LINE.match(line) or SUMMARY_ROW.match(line)
        if m:
            verdict, detail = m["verdict"], m["detail"] or ""
            if verdict not in VERDICTS:
                bad.append(f"verdict {verdict!r}: {line[:160]}")
            elif verdict == "holds":
                tests = WELCH.findall(detail)
                if not tests or float(tests[0][1]) >= 0.05 or any(w in detail for w in UNDECIDED):
                    bad.append(f"holds, not decided: {line[:160]}")
        elif (
            re.search(r"\bholds\b", line)
            and not line.startswith(RULE_STATEMENTS)
            and not _decided_beside(line)
        ):
            bad.append(f"'holds' outside a claim: {line[:160]}")
    return bad


def _decided_beside(line: str) -> bool:
    """A line outside the claims whose every "holds" is a decided gap's state: a row of a table of gaps whose
    decided column says yes, or prose that prints it beside its p < 0.05."""
    n = len(re.findall(r"\bholds\b", line))
    if line.startswith("|"):
        return n == 1 and "| yes |" in line
    return sum(float(m["p"]) < 0.05 for m in BESIDE_P.finditer(line)) == n


def test_every_holds_in_results_is_decided():
    # the tables and REPORT.md (not the READMEs of committed run folders, results/paper/runs/)
    mds = sorted(p for p in RESULTS.rglob("*.md") if "runs" not in p.relative_to(RESULTS).parts)
    assert len(mds) > 20
    bad = {md.relative_to(RESULTS).as_posix(): undecided_holds(md.read_text()) for md in mds}
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, "\n".join(f"{k}: {line}" for k, v in bad.items() for line in v[:3])


@pytest.mark.parametrize(
    "line,ok",
    [
        (
            "- a > b: **holds** (2.00 vs 1.00, margin +1.00; t = +9.00 (Welch, df 2.0), p = 0.012 over 2 / 2 seeds)",
            True,
        ),
        ("- a > b: **holds** (2.00 vs 1.00; t = +2.00 (Welch, df 2.0), p = 0.18 over 2 / 2 seeds)", False),
        ("- a > b: **holds** (2.00 vs 1.00, margin +1.00; no test: 1 / 1 seeds)", False),
        ("- a > b: **holds** (1 of 1 rows)", False),  # a verdict without its test
        (
            "- a > b: **holds** (t = +9.00 (Welch, df 2.0), p = 0.012; not an independent test: lr chosen on them)",
            False,
        ),
        ("- a > b: **does not hold** (2.00 vs 1.00)", False),  # the old rule's verdict
        ("- a > b: **agrees, not decided** (t = +2.00 (Welch, df 2.0), p = 0.18 over 2 / 2 seeds)", True),
        ("- eps: **matches** (ours 2.678; exact: deterministic accountant)", True),
        ("| [t](#t-cpu) | cpu | a > b | **holds** | 2.00 vs 1.00 |", False),
        ("- A claim holds when the means are in order.", False),  # prose saying 'holds'
        ("- Verdicts (dp_adam_bench/report/stats.py): a comparison *holds* when ...", True),
        (
            "| gap | BandMF - DP-SGD | 96 | -0.1432 | 2 | holds | 0.0198 | -7.2489 | 1.5053 | 0.0378 | yes |  |",
            True,
        ),
        (
            "| gap | BandMF - DP-SGD | 96 | -0.1432 | 2 | holds | 0.0198 | -1.2 | 1.5053 | 0.30 | no | 9 |",
            False,
        ),
        ("What more steps change: gap: 96 steps -0.143 ± 0.020 (p = 0.038, holds)", True),
        ("What more steps change: gap: 96 steps -0.143 ± 0.020 (p = 0.38, holds)", False),
    ],
)
def test_the_scan_reads_each_kind_of_line(line, ok):
    assert (undecided_holds(line) == []) == ok, undecided_holds(line)


def test_the_scan_sees_the_paper_profile_tables_too():
    assert any(p.parent.name == "paper" for p in RESULTS.rglob("*.md"))
    assert Path(RESULTS / "REPORT.md").is_file()
