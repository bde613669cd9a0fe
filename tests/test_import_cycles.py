"""No import circles: no two modules of gossiptrain, peers and topologies import each other, directly or through others.

The graph is grimp's (import-linter's library): a node per module, an edge
per module another one imports, whether the import statement is at module
level, inside a function or under ``if TYPE_CHECKING`` (each is a dependency
a reader follows, and a function-level or TYPE_CHECKING import that breaks a
circle at runtime only hides it: it comes back the day it moves up). A circle
is a strongly connected component (Tarjan's search) of more than one module,
or a module that imports itself; the failure names each one as a path in
which every module imports the next, with the import statement's line.

What counts as an edge is what grimp reports for a statement, and that
decides what a package's ``__init__`` takes part in:

- ``import pkg.mod``, ``from pkg.mod import name`` and ``from pkg import mod``
  (``mod`` a submodule): an edge to ``pkg.mod``.
- ``from pkg import name`` with ``name`` defined or re-exported by
  ``pkg/__init__.py``: an edge to the package module ``pkg`` (grimp does not
  follow a re-export to the module that defines the name); ``pkg``'s own
  edges are its ``__init__``'s imports.
- Python's implicit run of the parent packages' ``__init__`` (importing
  ``gossiptrain.sim.cluster`` runs ``gossiptrain/__init__.py`` and
  ``gossiptrain/sim/__init__.py`` first) is no edge. It is no import
  statement, and counting it would make every ``__init__`` that imports one
  of its submodules (``gossiptrain/__init__.py``'s lazy names are TYPE_CHECKING
  imports of its layers) a circle with all the modules below it: a package
  importing its own parts is how it is made of them, not a dependency.

So an ``__init__`` importing its submodules is fine, and so are submodules
importing each other in one direction. A submodule that imports its own
package by name (``from gossiptrain.net.transport import listen`` inside a
module that ``gossiptrain/net/transport/__init__.py`` imports) is a circle,
and a real one: each needs the other to have finished running first.

import-linter (2.17) has an ``acyclic_siblings`` contract, in pyproject.toml
beside this test: it forbids circles between the children of each package,
each child taken with everything under it, which is stricter across packages
(a circle between two subpackages through different modules) but blind to a
package's ``__init__`` in a circle with its own submodules. This test states
the rule itself, module by module, and names whole circles where the contract
names imports to remove.
"""

from __future__ import annotations

from collections import deque

import grimp
import pytest

PACKAGES = ("gossiptrain", "peers", "topologies")


def strongly_connected(edges: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of the graph ``edges`` (module -> modules it imports), by Tarjan's search."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:  # depth bounded by the module count: a few hundred, far from the recursion limit
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            components.append(component)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return components


def shortest_circle(start: str, within: set[str], edges: dict[str, set[str]]) -> list[str]:
    """A shortest path from ``start`` back to itself through modules of ``within`` (its component): [start, ..., start]."""
    came_from: dict[str, str] = {}  # the breadth-first tree: module -> the module it was reached from
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(edges.get(v, set()) & within):
            if w == start:  # back at the start from v: the tree's path to v, closed
                path = [v]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return [*reversed(path), start]
            if w not in came_from:
                came_from[w] = v
                queue.append(w)
    raise AssertionError(f"{start} is in no circle of {sorted(within)}")


def import_circles(graph: grimp.ImportGraph) -> list[tuple[list[str], set[str]]]:
    """Each import circle of ``graph``: a shortest path through its first module, and all the modules in it."""
    edges = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    circles = []
    for component in strongly_connected(edges):
        first = min(component)
        if len(component) > 1 or first in edges[first]:
            circles.append((shortest_circle(first, component, edges), component))
    return sorted(circles, key=lambda c: c[0])


def describe(graph: grimp.ImportGraph, circles: list[tuple[list[str], set[str]]]) -> str:
    """The circles as the failure names them: each path, its imports with their lines, any other modules in it."""
    lines = [f"{len(circles)} import circle(s); break each, e.g. by moving what both sides need into a module below them:"]
    for path, component in circles:
        lines.append("  " + " -> ".join(path))
        for importer, imported in zip(path, path[1:]):
            for detail in graph.get_import_details(importer=importer, imported=imported):
                lines.append(f"    {importer}:{detail['line_number']}  {detail['line_contents']}")
        if others := sorted(component - set(path)):
            lines.append(f"    (and, in the same circle: {', '.join(others)})")
    return "\n".join(lines)


def test_no_module_imports_itself_through_others() -> None:
    graph = grimp.build_graph(*PACKAGES, exclude_type_checking_imports=False, cache_dir=None)  # ~0.3 s, no cache file
    circles = import_circles(graph)
    if circles:
        pytest.fail(describe(graph, circles), pytrace=False)


def test_the_search_names_a_planted_circle_and_only_circles() -> None:
    graph = grimp.ImportGraph()
    planted = [
        ("pkg", "pkg.a"),  # a package's __init__ importing its submodules: no circle
        ("pkg", "pkg.b"),
        ("pkg.a", "pkg.b"),  # a -> b -> c -> a, with a shortcut a -> c: the shortest path is named
        ("pkg.a", "pkg.c"),
        ("pkg.b", "pkg.c"),
        ("pkg.c", "pkg.a"),
        ("pkg.d", "pkg.a"),  # into the circle, not in it
        ("pkg.e", "pkg"),  # a submodule importing its package's re-exports, which do not import it: no circle
        ("pkg.sub", "pkg.sub.x"),  # ...and one that the package imports back: a circle
        ("pkg.sub.x", "pkg.sub"),
    ]
    for number, (importer, imported) in enumerate(planted, start=1):
        graph.add_import(importer=importer, imported=imported, line_number=number, line_contents=f"import {imported}")
    circles = import_circles(graph)
    assert [(path, sorted(component)) for path, component in circles] == [
        (["pkg.a", "pkg.c", "pkg.a"], ["pkg.a", "pkg.b", "pkg.c"]),
        (["pkg.sub", "pkg.sub.x", "pkg.sub"], ["pkg.sub", "pkg.sub.x"]),
    ]
    message = describe(graph, circles)
    assert "pkg.a -> pkg.c -> pkg.a" in message and "pkg.c:6  import pkg.a" in message
    assert "(and, in the same circle: pkg.b)" in message
    graph.add_import(importer="pkg.e", imported="pkg.e", line_number=11, line_contents="import pkg.e")
    assert ["pkg.e", "pkg.e"] in [path for path, _ in import_circles(graph)]  # a module importing itself
