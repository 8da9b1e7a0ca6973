"""The code keeps its shape: the package's folders are layers, every import pointing
down (no two folders or top-level modules import each other, even through others);
within a folder, files may import each other, but never in a circle, even through
others; the rules of the fence and the leases import nothing that does I/O; the data
plane (``http/``) imports neither the config's schema nor aiohttp, so it is used and
tested without either; and the fenced write's path stays short enough to read at a
glance: no function on it longer than 30 lines, and the proxy's handler class under
300."""

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


def file_of(module: str) -> Path | None:
    """The file that defines ``module``, or the nearest module above it (for a name
    imported from a module); None outside the package."""
    parts = module.split(".")
    while len(parts) > 1:
        base = PACKAGE.parent.joinpath(*parts)
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
        parts.pop()
    return None


def folders() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*") if p.is_dir() and (p / "__init__.py").is_file())


@pytest.mark.parametrize("folder", [p.relative_to(PACKAGE).as_posix() for p in folders()])
def test_no_files_of_a_folder_import_each_other_in_a_circle(folder: str) -> None:
    """Within a folder, files may import each other, but never in a circle, even
    through others (an import read only by the type checker included): a circle
    leaves no file that can be read, or used, without the others."""
    here = PACKAGE / folder
    graph: dict[str, set[str]] = {}
    for path in sorted(here.glob("*.py")):
        inside = {file_of(m) for m in imports(path)} - {None, path}
        graph[path.name] = {f.name for f in inside if f is not None and f.parent == here}
    try:
        list(TopologicalSorter(graph).static_order())
    except CycleError as cycle:
        circle = " -> ".join(reversed(cycle.args[1]))  # each file imports the next
        pytest.fail(f"these files of {folder}/ import each other: {circle}")


def foreign(path: Path) -> set[str]:
    """The top-level names of the libraries ``path`` imports (absolute imports)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found


@pytest.mark.parametrize("path", sorted((PACKAGE / "http").glob("*.py")), ids=lambda p: p.name)
def test_the_data_plane_imports_neither_the_config_nor_aiohttp(path: Path) -> None:
    """``http/`` is a lower layer than the config: what it needs of a route or of the
    limits is its own (``Route`` compiled from a ``RouteSource``, ``Limits``), so it is
    used and tested without the YAML schema; and it speaks HTTP on llhttp, never on
    aiohttp (the admin listener's)."""
    config = {
        m for m in imports(path) if m == "fenceproxy.config" or m.startswith("fenceproxy.config.")
    }
    assert config == set()
    assert "aiohttp" not in foreign(path)


def _narrows(node: ast.Assert, after: list[ast.stmt]) -> bool:
    """``assert X is not None`` or ``assert isinstance(X, T)``, without a message, X a
    name or an attribute of one, and X read again in the statements after it in its
    block: it only tells the type checker what the code just made so."""
    test = node.test
    if isinstance(test, ast.Compare) and [type(op) for op in test.ops] == [ast.IsNot]:
        subject, none = test.left, test.comparators[0]
        narrowing = isinstance(none, ast.Constant) and none.value is None
    elif isinstance(test, ast.Call) and isinstance(test.func, ast.Name) and len(test.args) == 2:
        subject, narrowing = test.args[0], test.func.id == "isinstance"
    else:
        return False
    chain = subject
    while isinstance(chain, ast.Attribute):
        chain = chain.value
    if node.msg is not None or not narrowing or not isinstance(chain, ast.Name):
        return False
    read = ast.dump(subject)
    return any(ast.dump(n) == read for stmt in after for n in ast.walk(stmt))


def test_the_package_asserts_only_to_narrow_types() -> None:
    """``python -O`` strips ``assert``: a rule the code holds is raised
    (InvariantError and its kind), never asserted. The one assert left is a type
    narrowing (``_narrows``): under -O the value's next use fails all the same."""
    guards = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for block in ast.walk(ast.parse(path.read_text())):
            for field in ("body", "orelse", "finalbody"):
                statements = getattr(block, field, None)
                if not isinstance(statements, list):
                    continue
                for n, stmt in enumerate(statements):
                    if isinstance(stmt, ast.Assert) and not _narrows(stmt, statements[n + 1 :]):
                        guards.append(f"{path.relative_to(PACKAGE)}:{stmt.lineno}")
    assert not guards, f"asserts that guard behaviour, to raise instead: {', '.join(guards)}"
