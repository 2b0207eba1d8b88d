"""The house drawn from the imports has no circle: no module reaches itself through the imports of others.

import-linter's contracts (pyproject.toml) check layers between packages and cycles between sibling subpackages;
this checks every module, the imports made only for type annotations (`if TYPE_CHECKING:`) and inside functions
included, since a reader follows those arrows too (engine/batcher.py and engine/engine.py once imported each
other that way).
"""

from __future__ import annotations

import grimp
import pytest

PACKAGES = ("mint_core", "mint_app", "flows", "tasks")


def circles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    edges = {
        m: sorted(graph.find_modules_directly_imported_by(m) & graph.modules) for m in sorted(graph.modules)
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in edges:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            if i < len(edges[node]):
                work.append((node, i + 1))
                nxt = edges[node][i]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            if low[node] == index[node]:
                component = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    component.append(m)
                    if m == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return found


def test_circles_finds_a_circle() -> None:
    graph = grimp.ImportGraph()
    for a, b in (("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"), ("p.c", "p.d"), ("p.d", "p.e")):
        graph.add_import(importer=a, imported=b)
    assert circles(graph) == [["p.a", "p.b", "p.c"]]


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_circle(package: str) -> None:
    graph = grimp.build_graph(package, cache_dir=None)  # annotation-only imports count: an arrow all the same
    found = circles(graph)
    assert not found, f"modules of {package} import each other in a circle: " + "; ".join(
        " <-> ".join(c) for c in found
    )
