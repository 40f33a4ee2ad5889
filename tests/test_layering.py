"""The package layering (issue 14), checked statically with `ast`, no imports executed.

Layers, lowest first: shared < models < cloud_server, edge_client (siblings) < scripts, tests.
- A module never imports a higher layer. cloud_server never imports edge_client; edge_client
  imports cloud_server only in `edge_client/local_cloud.py`, and only `cloud_server.local`
  (the device's one way to start a loopback server).
- No import circles between modules (every import statement counts: module level, inside
  functions, under `if TYPE_CHECKING:`).
- No project import inside a function: lazy imports are for optional heavy third-party packages
  (torch, matplotlib, faster_whisper, ...), never to dodge a project circle.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = {"shared": 0, "models": 1, "cloud_server": 2, "edge_client": 2}
# (importing module, imported module) pairs allowed across the edge_client/cloud_server siblings
SIBLING_GATES = {("edge_client.local_cloud", "cloud_server.local")}


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    line: int
    in_function: bool

    def where(self) -> str:
        return f"{module_path(self.src)}:{self.line} imports {self.dst}"


def project_modules() -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package __init__)."""
    mods: dict[str, tuple[Path, bool]] = {}
    for top in LAYERS:
        for f in sorted((ROOT / top).rglob("*.py")):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            mods[".".join(parts[:-1] if is_pkg else parts)] = (f, is_pkg)
    return mods


MODULES = project_modules()


def module_path(mod: str) -> str:
    if mod in MODULES:
        return str(MODULES[mod][0].relative_to(ROOT))
    return mod.replace(".", "/") + ".py"


def _project_target(name: str) -> str | None:
    """The project module an import of `name` loads last (the longest known prefix), or None."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _imported_names(mod: str, is_pkg: bool, node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:
        base = mod.split(".") if is_pkg else mod.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        prefix = ".".join([*base, *([node.module] if node.module else [])])
    else:
        prefix = node.module or ""
    # `from pkg import name`: name is a submodule or an attribute of pkg
    return [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in MODULES else prefix for a in node.names]


class _Collector(ast.NodeVisitor):
    def __init__(self, mod: str, is_pkg: bool) -> None:
        self.mod, self.is_pkg = mod, is_pkg
        self.depth = 0
        self.edges: list[Edge] = []

    def _scope(self, node: ast.AST) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _scope

    def _record(self, node: ast.Import | ast.ImportFrom) -> None:
        for name in _imported_names(self.mod, self.is_pkg, node):
            dst = _project_target(name)
            edge = Edge(self.mod, dst, node.lineno, self.depth > 0) if dst is not None else None
            if edge is not None and dst != self.mod and edge not in self.edges:
                self.edges.append(edge)

    visit_Import = visit_ImportFrom = _record


def edges_in(mod: str, is_pkg: bool, source: str, filename: str = "<source>") -> list[Edge]:
    """The project imports of one module's source."""
    c = _Collector(mod, is_pkg)
    c.visit(ast.parse(source, filename=filename))
    return c.edges


def import_edges() -> list[Edge]:
    edges: list[Edge] = []
    for mod, (path, is_pkg) in MODULES.items():
        edges += edges_in(mod, is_pkg, path.read_text(), str(path))
    return edges


EDGES = import_edges()


def _top(mod: str) -> str:
    return mod.split(".")[0]


def layer_violation(e: Edge) -> str | None:
    src, dst = _top(e.src), _top(e.dst)
    if src == dst:
        return None
    if LAYERS[dst] > LAYERS[src]:
        return f"{e.where()}: {src} must not import the higher layer {dst}"
    if LAYERS[dst] == LAYERS[src] and (e.src, e.dst) not in SIBLING_GATES:
        gates = ", ".join(f"{a} -> {b}" for a, b in sorted(SIBLING_GATES))
        return f"{e.where()}: {src} must not import its sibling {dst} (only {gates})"
    return None


def find_cycles(edges: list[Edge]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for e in edges:
        graph[e.src].add(e.dst)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    sccs: list[set[str]] = []

    def strong(v: str) -> None:  # recursion depth is bounded by the module count (~100)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.add(w)
                if w == v:
                    break
            if len(scc) > 1:
                sccs.append(scc)

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return [_cycle_in(sorted(scc)[0], scc, graph) for scc in sccs]


def _cycle_in(start: str, scc: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest path start -> ... -> start inside the component (breadth first)."""
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & scc):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")


def _describe(cycle: list[str]) -> str:
    hops = []
    for a, b in zip(cycle, cycle[1:]):
        e = next(e for e in EDGES if e.src == a and e.dst == b)
        hops.append(f"{e.where()}" + (" (in a function)" if e.in_function else ""))
    return " -> ".join(cycle) + "\n    " + "\n    ".join(hops)


def test_modules_are_found() -> None:
    assert {"shared.protocol", "models.registry", "cloud_server.app", "edge_client.cli"} <= MODULES.keys()
    assert any(e.src == "edge_client.cli" and _top(e.dst) == "edge_client" for e in EDGES)


def test_every_kind_of_import_is_read() -> None:
    source = """
import numpy
from typing import TYPE_CHECKING
from . import events
from .. import answer
from ..voice import pipeline
from shared import routing_log
import shared.protocol as proto
if TYPE_CHECKING:
    from cloud_server.engine import CloudEngine
def f():
    import torch
    from models.registry import model_info
"""
    got = {(e.dst, e.in_function) for e in edges_in("edge_client.voice.app", False, source)}
    assert got == {
        ("edge_client.voice.events", False),
        ("edge_client.answer", False),
        ("edge_client.voice.pipeline", False),
        ("shared.routing_log", False),
        ("shared.protocol", False),
        ("cloud_server.engine", False),
        ("models.registry", True),
    }


def test_no_module_imports_a_higher_layer() -> None:
    bad = [msg for e in EDGES if (msg := layer_violation(e))]
    assert not bad, "layering violations:\n  " + "\n  ".join(bad)


def test_no_import_cycles() -> None:
    cycles = find_cycles(EDGES)
    assert not cycles, "import cycles:\n  " + "\n  ".join(_describe(c) for c in cycles)


def test_no_project_imports_inside_functions() -> None:
    bad = [e.where() for e in EDGES if e.in_function]
    assert not bad, (
        "project imports inside functions (import at module level; lazy imports are only for optional heavy "
        "third-party packages):\n  " + "\n  ".join(bad)
    )


def test_checker_catches_violations() -> None:
    """The rules themselves, on made-up edges."""
    assert layer_violation(Edge("shared.router", "models.registry", 1, False))
    assert layer_violation(Edge("cloud_server.app", "edge_client.cli", 1, False))
    assert layer_violation(Edge("edge_client.generator", "cloud_server.local", 1, False))
    assert layer_violation(Edge("edge_client.local_cloud", "cloud_server.app", 1, False))
    assert layer_violation(Edge("edge_client.local_cloud", "cloud_server.local", 1, False)) is None
    assert layer_violation(Edge("edge_client.cli", "shared.protocol", 1, False)) is None
    fake = [
        Edge("shared.router", "shared.policy", 1, False),
        Edge("shared.policy", "shared.sampling", 2, False),
        Edge("shared.sampling", "shared.router", 3, True),
    ]
    assert find_cycles(fake) == [["shared.policy", "shared.sampling", "shared.router", "shared.policy"]]
