"""The modules of dp_adam_bench.privacy import each other without a circle (every import counts, also those
inside functions), and each imports on its own."""

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import dp_adam_bench.privacy

PACKAGE = "dp_adam_bench.privacy"
ROOT = Path(dp_adam_bench.privacy.__file__).parent


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join((PACKAGE, *parts)) if parts else PACKAGE] = path
    return out


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """Modules of the package that ``path`` imports anywhere in its body (the most specific module named)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
                break
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(p, modules) - {m} for m, p in modules.items()}


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for dep in sorted(graph.get(m, ())):
            if state.get(dep) == 1:
                return stack[stack.index(dep) :] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_privacy_module_graph_has_no_cycle():
    graph = _graph()
    assert f"{PACKAGE}.sensitivity" in graph[f"{PACKAGE}.strategies"]  # the graph sees real edges
    assert _find_cycle(graph) is None, " -> ".join(_find_cycle(graph))


@pytest.mark.parametrize("module", ["sensitivity", "strategies", "toeplitz", "accounting", "bandmf"])
def test_module_imports_first_in_a_fresh_interpreter(module):
    name = f"{PACKAGE}.{module}"
    importlib.import_module(name)
    subprocess.run([sys.executable, "-c", f"import {name}"], check=True, cwd=ROOT.parents[1])
