"""aiolm's modules import one way down: no cycle, counting imports inside functions.

The graph is built from the source with ``ast``: every ``import``/``from ... import``
anywhere in a module (functions included) is an edge, except those under ``if
TYPE_CHECKING:`` and a package ``__init__``'s top-level imports of its own submodules
(re-exports; an ``__init__`` that imports a submodule inside a function is an edge).
``from pkg import name`` is an edge to ``pkg.name`` where that is a module, else to the
module ``pkg/__init__.py`` re-exports ``name`` from, else to ``pkg`` itself.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "aiolm"


def module_files() -> dict[str, Path]:
    mods = {}
    for f in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = list(f.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = f
    return mods


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []

    def walk(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for other in child.orelse:
                    walk(other)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append(child)
            walk(child)

    walk(tree)
    return found


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph() -> dict[str, set[str]]:
    mods = module_files()
    trees = {m: ast.parse(f.read_text(), str(f)) for m, f in mods.items()}
    reexports: dict[str, dict[str, str]] = {}  # package -> name -> module it comes from
    for m, f in mods.items():
        if f.name != "__init__.py":
            continue
        for node in _imports(trees[m]):
            if isinstance(node, ast.ImportFrom):
                src = _absolute(m, True, node)
                if src in mods:
                    for a in node.names:
                        reexports.setdefault(m, {})[a.asname or a.name] = src

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        is_package = f.name == "__init__.py"
        top_level = {id(n) for n in trees[m].body}
        for node in _imports(trees[m]):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                src = _absolute(m, is_package, node)
                for a in node.names:
                    sub = f"{src}.{a.name}"
                    targets.append(sub if sub in mods else reexports.get(src, {}).get(a.name, src))
            for t in targets:
                while t and t not in mods:  # `import aiolm.x.y.z` where z is not a module
                    t = t.rpartition(".")[0]
                if not t or t == m or not t.startswith(PACKAGE):
                    continue
                if is_package and id(node) in top_level and t.startswith(m + "."):
                    continue  # a package's re-export of its own submodule
                graph[m].add(t)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_graph_sees_function_level_imports() -> None:
    tree = ast.parse("def f():\n    from aiolm.a import b\nif TYPE_CHECKING:\n    import aiolm.c\n")
    names = [n.module if isinstance(n, ast.ImportFrom) else n.names[0].name for n in _imports(tree)]
    assert names == ["aiolm.a"]


def test_cycles_are_found() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles among aiolm's modules:\n" + "\n".join(" <-> ".join(c) for c in found)
