"""The package's import graph, read with ``ast`` (function-level and relative imports included): no cycle anywhere
in dp_adam_bench, and no private (underscore) name imported from another module of the package. The old circles
(engine/bk <-> engine/grads, privacy/sensitivity <-> privacy/strategies, tracking/run_store <->
tracking/wandb_source) are the regression cases."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import dp_adam_bench

ROOT = Path(dp_adam_bench.__file__).parent
PACKAGE = "dp_adam_bench"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(tree: ast.AST, here: str, is_package: bool) -> list[tuple[str, list[str]]]:
    """(module, imported names) of every import in ``tree``, relative ones resolved."""
    out = []
    package = here if is_package else here.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            out.append((base, [a.name for a in node.names]))
    return out


def import_graph() -> dict[str, set[str]]:
    files = {module_name(f): f for f in ROOT.rglob("*.py")}
    graph = {}
    for m, f in files.items():
        edges = set()
        for base, names in imports(ast.parse(f.read_text()), m, f.name == "__init__.py"):
            if base in files:
                edges.add(base)
            edges |= {f"{base}.{n}" for n in names if f"{base}.{n}" in files}
        edges.discard(m)
        graph[m] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path [a, b, ..., a], or None (depth-first search, three colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return path[path.index(n) :] + [n]
            if n not in state and (cycle := visit(n)):
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def test_the_cycle_finder_finds_the_old_circles():
    assert find_cycle({"e.bk": {"e.grads"}, "e.grads": {"e.bk"}, "e.trainer": {"e.grads"}}) == [
        "e.bk",
        "e.grads",
        "e.bk",
    ]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_the_graph_sees_function_level_and_relative_imports():
    src = "def f():\n    from dp_adam_bench.engine.bk import BKEngine\nfrom . import grads\nfrom .sampling import x\n"
    found = {m for m, _ in imports(ast.parse(src), "dp_adam_bench.engine.trainer", False)}
    assert found == {"dp_adam_bench.engine.bk", "dp_adam_bench.engine", "dp_adam_bench.engine.sampling"}


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert "dp_adam_bench.engine.grads" in graph["dp_adam_bench.engine.bk"]  # the graph sees real edges
    assert "dp_adam_bench.tracking.wandb_source" not in graph["dp_adam_bench.tracking.run_store"]
    assert "dp_adam_bench.privacy.strategies" not in graph["dp_adam_bench.privacy.sensitivity"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_private_name_is_imported_from_another_module_of_the_package():
    bad = []
    for path in ROOT.rglob("*.py"):
        here = module_name(path)
        for module, names in imports(ast.parse(path.read_text()), here, path.name == "__init__.py"):
            if module.startswith(PACKAGE) and module != here:
                bad += [
                    f"{here}: {module}.{n}" for n in names if n.startswith("_") and not n.startswith("__")
                ]
    assert bad == []


@pytest.mark.parametrize(
    "module",
    [
        "privacy.sensitivity",
        "privacy.strategies",
        "privacy.accounting",
        "engine.bk",
        "engine.grads",
        "tracking.run_store",
        "tracking.wandb_source",
    ],
)
@pytest.mark.slow
def test_module_imports_first_in_a_fresh_interpreter(module):
    name = f"{PACKAGE}.{module}"
    importlib.import_module(name)
    subprocess.run([sys.executable, "-c", f"import {name}"], check=True, cwd=ROOT.parent)
