"""The fenced write's path stays short enough to read at a glance: no function on it
longer than 30 lines, and the proxy's handler class under 300."""

from __future__ import annotations

import ast
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
