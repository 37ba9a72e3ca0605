"""The ``suite`` and ``conformance`` parts: pytest on this device (``-n <cores>`` with pytest-xdist), its pass /
fail counts and failing tests read from its JUnit XML."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

from .part import Ctx, PartFailed


def pytest_command(ctx: Ctx, xml: str, *args: str) -> list[str]:
    par = ["-n", str(ctx.cores)] if ctx.xdist else []
    return [
        ctx.py,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        *par,
        f"--junitxml={ctx.out / xml}",
        *args,
    ]


def junit_counts(path: Path, module: str | None = None) -> dict:
    """Counts and failing test ids from a JUnit XML file (pytest's), of the tests of ``module`` only if given."""
    counts = {"tests": 0, "passed": 0, "failures": 0, "errors": 0, "skipped": 0, "failing": []}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        if module is not None and module not in str(case.get("classname")):
            continue
        counts["tests"] += 1
        kind = next((k for k in ("error", "failure", "skipped") if case.find(k) is not None), None)
        counts[{"error": "errors", "failure": "failures", "skipped": "skipped", None: "passed"}[kind]] += 1
        if kind in ("error", "failure"):
            counts["failing"].append(name)
    return counts


def verify_junit(xml: str, module: str | None = None) -> Callable[[Ctx, str], str]:
    def verify(ctx: Ctx, log: str) -> str:
        path = ctx.out / xml
        if module is not None and not path.is_file():  # the suite's run of the module's tests
            path, xml_used = ctx.out / "suite.xml", "suite.xml"
        else:
            xml_used = xml
        if not path.is_file():
            raise PartFailed(f"no {xml} (pytest did not finish)")
        c = junit_counts(path, module)
        line = (
            f"{c['passed']} passed, {c['failures']} failed, {c['errors']} errors, {c['skipped']} skipped "
            f"of {c['tests']}" + ("" if ctx.xdist else " (pytest-xdist missing: serial)")
        )
        if xml_used != xml:
            line += f" (from {xml_used})"
        if c["failures"] or c["errors"] or not c["tests"]:
            shown = ", ".join(c["failing"][:20]) + (" ..." if len(c["failing"]) > 20 else "")
            raise PartFailed(f"{line}: {shown}")
        return line

    return verify


def suite_commands(ctx: Ctx) -> list[list[str]]:
    """``make test``'s tier (the tests not marked slow) on this device."""
    if ctx.quick:  # one small test file: the same pytest invocation and JUnit counting
        return [pytest_command(ctx, "suite.xml", "tests/test_lr_schedule.py")]
    return [pytest_command(ctx, "suite.xml", "-m", "not slow", "tests")]


def suite_slow_commands(ctx: Ctx) -> list[list[str]]:
    """``make test-slow``'s tier (the end-to-end tests: every paper table's smoke among them) on this device; the
    last part, so a call short of time skips it (``--parts suite_slow``: in a call of its own)."""
    if ctx.quick:
        return [pytest_command(ctx, "suite_slow.xml", "-m", "slow", "tests/test_hub_offline.py")]
    return [pytest_command(ctx, "suite_slow.xml", "-m", "slow", "tests")]


def conformance_commands(ctx: Ctx) -> list[list[str]]:
    """The grid's own pytest run, unless the suite's JUnit XML already holds its tests (then its counts are read
    from there: the suite ran them on this device)."""
    suite = ctx.out / "suite.xml"
    if suite.is_file() and junit_counts(suite, "test_conformance")["tests"]:
        return []
    pick = ["-k", "linear-2d"] if ctx.quick else []
    return [pytest_command(ctx, "conformance.xml", "tests/test_conformance.py", *pick)]
