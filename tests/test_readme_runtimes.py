"""One list of runtimes: the README's table of reports shows each report's CPU time as the report registry
(``dp-adam-bench report --list``) states it, and its descriptions do not contradict the presets."""

from __future__ import annotations

import re

from dp_adam_bench.paths import REPO_ROOT
from dp_adam_bench.report import registry

HEADER = "| id | paper | what | CPU time |"


def readme_rows() -> list[tuple[list[str], str, str]]:
    lines = (REPO_ROOT / "README.md").read_text().splitlines()
    start = lines.index(HEADER) + 2
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        rows.append((re.findall(r"`([a-z0-9_]+)`", cells[0]), cells[2], cells[-1]))
    return rows


def test_readme_cpu_times_are_the_registry_runtimes():
    rows = readme_rows()
    assert rows
    seen = set()
    for ids, _, cpu_time in rows:
        assert ids
        for tid in ids:
            assert cpu_time == registry.spec(tid).runtime_cpu, f"README row {tid}: {cpu_time!r}"
            seen.add(tid)
    assert seen == set(registry.GROUPS["all"]), "every report has one README row"


def test_ganesh_fig3_names_its_mechanisms():
    what = {tid: w for ids, w, _ in readme_rows() for tid in ids}["ganesh_fig3"]
    assert "DP-BandMF" in what and what.count("DP-SGD") == 2 and "{DP-SGD, BandMF, DP-SGD}" not in what
    assert "{DP-SGD, BandMF, DP-SGD}" not in registry.spec("ganesh_fig3").shows
