"""The package's import graph has no circles: a lower module never imports a higher one, not even inside a
function or for type checking only (what `settings` checks against is handed to it from above: the policy table
registers itself) — neither between modules nor between the package's rooms (its top-level modules and folders),
so the rooms stand on floors, every arrow running down. And no module passes 500 lines: one idea a file."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "specquant_cli"


def _module_of(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def _graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports anywhere in its file (functions and `if TYPE_CHECKING:` blocks
    included: a reader sees an arrow either way), by file: `from a.b import c` reaches a.b.c when that is a module,
    else a.b."""
    files = {_module_of(p): p for p in PKG.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else node.module
                           for a in node.names]
            for t in targets:
                if t in files and t != mod:
                    graph[mod].add(t)
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_import_graph_has_no_circles():
    assert _circles(_graph()) == []


def _rooms(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph between the package's rooms: a top-level module, or a folder with everything in it."""
    def room(m: str) -> str:
        return m.split(".")[1] if "." in m else m

    out: dict[str, set[str]] = {room(m): set() for m in graph}
    for a, bs in graph.items():
        out[room(a)] |= {room(b) for b in bs} - {room(a)}
    return out


def test_the_rooms_stand_on_floors():
    """No two rooms import each other, however far round: every arrow between folders runs down."""
    assert _circles(_rooms(_graph())) == []


def test_settings_imports_nothing_above_it():
    graph = _graph()
    for mod in (m for m in graph if m == "specquant_cli.settings" or m.startswith("specquant_cli.settings.")):
        assert {m for m in graph[mod] if not m.startswith("specquant_cli.settings")} <= \
            {"specquant_cli.errors", "specquant_cli.inputs"}, mod


def test_a_circle_is_found():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


LONG = 500  # lines: a module past this holds more than one idea; split it by idea


def test_no_module_is_longer_than_one_idea():
    long = []
    for path in PKG.rglob("*.py"):
        if path.read_text(encoding="utf-8").count("\n") > LONG:
            long.append(path.relative_to(PKG.parent).as_posix())
    assert long == []


def test_a_room_circle_is_found():
    assert _circles(_rooms({"p.a.x": {"p.b.y"}, "p.b.y": {"p.a.z"}, "p.a.z": set()})) == [["a", "b"]]
