"""`engine/`'s own import graph, read from the source with `ast` (nothing is imported).

Every import of an engine module by another counts, wherever it is written: at the top, inside
a function (a lazy import still ties the two modules together) or under `TYPE_CHECKING`. The
graph has no cycles, and no module takes another's `_private` names.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "engine"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def engine_modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted((ROOT / PACKAGE).rglob("*.py"))}


def _absolute(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The module a `from ... import` names, relative imports resolved."""
    if not node.level:
        return node.module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> tuple[set[str], list[str]]:
    """The engine modules `name` imports, and its imports of another module's private names."""
    edges: set[str] = set()
    private: list[str] = []
    # Names bound to an engine module here (`from engine import caches`, `import engine.x as y`).
    bound: dict[str, str] = {}
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules:
                    edges.add(alias.name)
                    if alias.asname:
                        bound[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(name, path.name == "__init__.py", node)
            if source != PACKAGE and not source.startswith(PACKAGE + "."):
                continue
            for alias in node.names:
                target = f"{source}.{alias.name}"
                if target in modules:  # a submodule
                    edges.add(target)
                    bound[alias.asname or alias.name] = target
                    continue
                if source in modules:
                    edges.add(source)
                if alias.name.startswith("_"):
                    private.append(f"{name}:{node.lineno}: from {source} import {alias.name}")
    for node in ast.walk(tree):  # `caches._evaluate` through a module bound above
        named = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
        if named and node.attr.startswith("_") and not node.attr.startswith("__"):
            private.append(f"{name}:{node.lineno}: {bound[node.value.id]}.{node.attr}")
    edges.discard(name)
    return edges, private


def import_graph() -> tuple[dict[str, set[str]], list[str]]:
    modules = engine_modules()
    graph: dict[str, set[str]] = {}
    private: list[str] = []
    for name, path in modules.items():
        graph[name], found = imports_of(name, path, modules)
        private += found
    return graph, private


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def cycle_paths(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """For each edge inside a component, the import that closes it (for the failure message)."""
    members = set(component)
    return [f"{a} -> {b}" for a in component for b in sorted(graph[a] & members)]


def test_the_graph_sees_every_module() -> None:
    graph, _ = import_graph()
    assert graph.get("engine.engine"), "the walk found no engine imports"


def test_engine_modules_import_no_cycles() -> None:
    graph, _ = import_graph()
    found = cycles(graph)
    assert not found, "import cycles inside engine/:\n" + "\n".join(f"{c}: {', '.join(cycle_paths(graph, c))}" for c in found)


def test_engine_modules_import_no_private_names() -> None:
    _, private = import_graph()
    assert not private, "private names imported from another engine module:\n" + "\n".join(private)


def test_the_checks_find_a_cycle_and_a_private_import(tmp_path) -> None:
    """The checks above can fail: a two-module cycle is found, and so is a private name taken
    by `from ... import` and through a module bound by an import."""
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    source = tmp_path / "user.py"
    source.write_text("from engine.kv.slots import _grow\nfrom engine.kv import slots\nslots._scatter()\n")
    modules = {"engine.kv.slots": source, "engine.kv": source}
    edges, private = imports_of("engine.user", source, modules)
    assert edges == {"engine.kv.slots"}
    assert [p.split(": ", 1)[1] for p in private] == ["from engine.kv.slots import _grow", "engine.kv.slots._scatter"]
