"""The repository stands alone: the package, its configs and docs/ cite papers (authors, year, arXiv id, equation)
or pages of docs/, never files outside the repository — the workshop's SPEC / DESIGN / PITFALLS notes or its copies
of the papers ("seed 00x", ``shared/seeds``) — which a reader of this repository does not have.

``test_no_reference_outside_the_repository`` lists every offending file:line at once.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED = (("dp_adam_bench", "*.py"), ("configs", "*.yaml"), ("docs", "*.md"))

# Each pattern, with what it stands for. Upper-case whole words only: "SPECIAL" or "design" are fine.
OUTSIDE = (
    (re.compile(r"\b(SPEC|DESIGN|PITFALLS)\b"), "the workshop's SPEC.md / DESIGN.md / PITFALLS.md"),
    (re.compile(r"\bseeds? 0\d\d\b", re.IGNORECASE), "the workshop's copy of a paper ('seed 00x')"),
    (re.compile(r"shared/seeds|\bseeds/\d"), "the workshop's folder of papers (shared/seeds)"),
)


def outside_references(text: str) -> list[tuple[int, str, str]]:
    """(line number, what it refers to, the line) for every reference to a file outside the repository."""
    hits = []
    for n, line in enumerate(text.splitlines(), start=1):
        for pattern, what in OUTSIDE:
            if pattern.search(line):
                hits.append((n, what, line.strip()))
                break
    return hits


def scanned_files() -> list[Path]:
    files = []
    for folder, glob in SCANNED:
        files += sorted(p for p in (ROOT / folder).rglob(glob) if "__pycache__" not in p.parts)
    return files


@pytest.mark.parametrize(
    "line",
    [
        '"""Optimizer variants (SPEC §1): each consumes ..."""',
        "see shared/PITFALLS.md",
        '(DESIGN.md, "the one pipeline")',
        "We report the SPEC definition.",
        "# (shared/seeds/003). Printed beside ours",
        'source: "Ganesh, McMahan, Thakurta (seed 003)"',
        'source: "Tang & Lecuyer (seeds 002, 004)"',
        "Lecture notes (Seed 001)",
        "the slides in ../shared/seeds/000_3a2b.txt",
        "PITFALLS: (1, T) positions",
    ],
)
def test_the_scanner_flags_each_kind_of_outside_reference(line):
    assert [n for n, _, _ in outside_references(f"x = 1\n{line}\n")] == [2]


@pytest.mark.parametrize(
    "line",
    [
        'SPECIAL = ["[PAD]", "[UNK]"]',
        "the design of the pipeline (docs/design.md), pitfalls in docs/pitfalls.md",
        "Ganesh, McMahan & Thakurta 2025 (arXiv:2507.01129), Fig. 2",
        "data in shared/data/snli_1.0 (DP_ADAM_BENCH_DATA)",
        "seed: 0; seeds: [0, 1]; 30 seeds",
        "DESIGN_MATRIX = np.eye(3)",
    ],
)
def test_the_scanner_leaves_papers_docs_and_data_paths_alone(line):
    assert outside_references(line) == []


def test_the_scan_covers_the_package_and_the_configs():
    files = {p.relative_to(ROOT).as_posix() for p in scanned_files()}
    assert "dp_adam_bench/train.py" in files and "dp_adam_bench/tasks/snli_bert.py" in files
    assert "configs/paper/ganesh.yaml" in files and "configs/experiment/tang_fig1_snli.yaml" in files


def test_no_reference_outside_the_repository():
    offending = [
        f"{path.relative_to(ROOT).as_posix()}:{n}: {what}: {line}"
        for path in scanned_files()
        for n, what, line in outside_references(path.read_text(encoding="utf-8", errors="replace"))
    ]
    assert not offending, (
        f"{len(offending)} reference(s) to files outside the repository; cite the paper (authors, year, arXiv id, "
        "equation / table) or docs/design.md, docs/pitfalls.md, docs/papers.md instead:\n  "
        + "\n  ".join(offending)
    )
