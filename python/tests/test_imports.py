"""The modules of the tessera package import each other without a cycle (issue 31, item 8),
counting imports made inside functions (a lazy import is a cycle all the same) and leaving out
those under `if TYPE_CHECKING:` (never run). Checked on the installed package's sources."""

import ast
import pathlib
from typing import Dict, List, Optional, Set

import tessera

PACKAGE = pathlib.Path(tessera.__file__).parent


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported(tree: ast.AST, modules: Set[str]) -> Set[str]:
    """The package's modules that `tree` imports, at any depth but under TYPE_CHECKING."""
    found: Set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module:
                found.add(node.module.split(".")[0])
            elif node.level == 1:
                found.update(a.name for a in node.names if a.name in modules)
            elif node.level == 0 and node.module and node.module.startswith("tessera."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("tessera."):
                    found.add(alias.name.split(".")[1])
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found & modules


def _graph() -> Dict[str, Set[str]]:
    sources = {p.stem: p for p in PACKAGE.glob("*.py")}
    modules = set(sources) - {"__init__"}
    return {name: _imported(ast.parse(path.read_text(), str(path)), modules) - {name}
            for name, path in sources.items() if name != "__init__"}


def _find_cycle(graph: Dict[str, Set[str]]) -> Optional[List[str]]:
    state: Dict[str, int] = {}  # 1: on the current path, 2: done
    path: List[str] = []

    def dfs(node: str) -> Optional[List[str]]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = dfs(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = dfs(node)
            if cycle:
                return cycle
    return None


def test_the_package_modules_import_each_other_without_a_cycle() -> None:
    graph = _graph()
    assert {"_state", "_adapters", "_sharded", "megatron", "_api"} <= set(graph), sorted(graph)
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_finder_finds_a_cycle() -> None:
    # The check above cannot pass by finding nothing: a lazy import inside a function counts.
    tree = ast.parse("def f():\n    from ._b import x\n")
    assert _imported(tree, {"_b"}) == {"_b"}
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import _b\n")
    assert _imported(tree, {"_b"}) == set()
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None
