"""The modules of dp_adam_bench/tracking and dp_adam_bench/report import each other without a cycle (imports inside
functions count too: a lazy import hides a cycle, it does not remove it), and no module imports another's private
(underscore) names."""

from __future__ import annotations

import ast
from pathlib import Path

import dp_adam_bench

PACKAGE = Path(dp_adam_bench.__file__).parent
CHECKED = ("dp_adam_bench.tracking", "dp_adam_bench.report")


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imports(path: Path) -> list[tuple[str, list[str]]]:
    """(imported module, names) for every import statement of a file, wherever it is."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, [a.name for a in node.names]))
    return out


def graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    edges: dict[str, set[str]] = {}
    for name, path in files.items():
        if not name.startswith(CHECKED):
            continue
        targets = set()
        for module, names in imports(path):
            # `from pkg import mod` imports the module pkg.mod
            for candidate in [module, *(f"{module}.{n}" for n in names)]:
                if candidate in files and candidate.startswith(CHECKED) and candidate != name:
                    targets.add(candidate)
        edges[name] = targets
    return edges


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_tracking_and_report_have_no_import_cycle():
    edges = graph()
    assert "dp_adam_bench.tracking.sources" in edges["dp_adam_bench.report.context"]
    assert "dp_adam_bench.tracking.wandb_source" not in edges["dp_adam_bench.tracking.run_store"]
    assert find_cycle(edges) is None, " -> ".join(find_cycle(edges))


def test_no_private_name_is_imported_from_another_module_of_the_package():
    bad = []
    for path in PACKAGE.rglob("*.py"):
        if not module_name(path).startswith((*CHECKED, "dp_adam_bench.sweep", "dp_adam_bench.cli")):
            continue
        for module, names in imports(path):
            if module.startswith("dp_adam_bench"):
                bad += [f"{module_name(path)}: {module}.{n}" for n in names if n.startswith("_")]
    assert bad == []
