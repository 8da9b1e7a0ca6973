"""The code keeps its shape: the package's folders are layers, every import pointing
down (no two folders or top-level modules import each other, even through others);
the rules of the fence and the leases import nothing that does I/O; and the fenced
write's path stays short enough to read at a glance: no function on it longer than
30 lines, and the proxy's handler class under 300."""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "fenceproxy"
FENCED_PATH = ["server/proxy.py", "server/turn.py", "fence/write.py", "fence/fencing.py"]


def lengths(path: Path, kinds: tuple[type[ast.AST], ...]) -> dict[str, int]:
    tree = ast.parse(path.read_text())
    return {
        node.name: node.end_lineno - node.lineno + 1  # type: ignore[attr-defined]
        for node in ast.walk(tree)
        if isinstance(node, kinds)
    }


@pytest.mark.parametrize("module", FENCED_PATH)
def test_no_function_on_the_fenced_path_is_over_30_lines(module: str) -> None:
    functions = lengths(PACKAGE / module, (ast.FunctionDef, ast.AsyncFunctionDef))
    assert {name: n for name, n in functions.items() if n > 30} == {}


def test_the_proxy_class_is_under_300_lines() -> None:
    assert lengths(PACKAGE / "server/proxy.py", (ast.ClassDef,))["Proxy"] < 300


def imports(path: Path) -> set[str]:
    """The package modules ``path`` imports, as dotted names under ``fenceproxy``."""
    here = path.relative_to(PACKAGE.parent).with_suffix("").parts
    package = here[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - node.level + 1]
            module = ".".join((*base, node.module)) if node.module else ".".join(base)
            found |= {f"{module}.{a.name}" for a in node.names} if not node.module else {module}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fenceproxy"):
            found.add(node.module or "")
    return found


def room(module: str) -> str:
    """The folder a module is in, or the module itself at the package's top."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and (PACKAGE / parts[1]).is_dir() else module


def rooms() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        mine = room(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts))
        graph.setdefault(mine, set())
        graph[mine] |= {room(m) for m in imports(path)} - {mine, "fenceproxy"}
    return graph


def test_the_folders_are_layers_with_no_import_running_back_up() -> None:
    try:
        order = list(TopologicalSorter(rooms()).static_order())
    except CycleError as cycle:
        pytest.fail(f"these import each other, through one another: {cycle.args[1]}")
    assert order.index("fence") < order.index("http") < order.index("server")


@pytest.mark.parametrize("rules", ["fence", "leases"])
def test_the_rules_import_only_the_bottom_layer(rules: str) -> None:
    bottom = {"fenceproxy.errors", "fenceproxy.hdrs", "fenceproxy.log", "fenceproxy.units"}
    assert rooms()[rules] <= bottom | {"fence"}
