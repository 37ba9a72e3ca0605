"""The engine package's import graph, read with ``ast``: no cycle (not even through a function-level import), and
no private (underscore) name imported from another module."""

import ast
from pathlib import Path

import dp_adam_bench.engine

PACKAGE = "dp_adam_bench.engine"
ROOT = Path(dp_adam_bench.engine.__file__).parent


def module_name(path: Path) -> str:
    return PACKAGE if path.name == "__init__.py" else f"{PACKAGE}.{path.stem}"


def imported(tree: ast.AST, here: str, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that ``tree`` (module ``here``) imports, anywhere in its body."""
    out = set()
    package = here if here == PACKAGE else here.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            if base in modules:
                out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules}
    out.discard(here)
    return out


def import_graph() -> dict[str, set[str]]:
    files = {module_name(f): f for f in ROOT.glob("*.py")}
    return {m: imported(ast.parse(f.read_text()), m, set(files)) for m, f in files.items()}


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


def test_the_cycle_finder_finds_the_old_bk_grads_circle():
    old = {"e.bk": {"e.grads"}, "e.grads": {"e.bk"}, "e.trainer": {"e.grads"}}
    assert find_cycle(old) == ["e.bk", "e.grads", "e.bk"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_the_graph_sees_function_level_and_relative_imports():
    src = "def f():\n    from dp_adam_bench.engine.bk import BKEngine\nfrom . import grads\nfrom .sampling import x\n"
    modules = {f"{PACKAGE}.bk", f"{PACKAGE}.grads", f"{PACKAGE}.sampling", f"{PACKAGE}.trainer"}
    assert imported(ast.parse(src), f"{PACKAGE}.trainer", modules) == modules - {f"{PACKAGE}.trainer"}


def test_engine_package_has_no_import_cycle():
    graph = import_graph()
    assert f"{PACKAGE}.grads" in graph[f"{PACKAGE}.bk"]  # the graph is really read
    assert f"{PACKAGE}.engines" in graph[f"{PACKAGE}.backends"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_private_name_is_imported_across_modules():
    bad = []
    for f in sorted(ROOT.glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dp_adam_bench"):
                bad += [
                    f"{f.name}: from {node.module} import {a.name}" for a in node.names if a.name[0] == "_"
                ]
    assert not bad, bad
