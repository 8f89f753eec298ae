"""The code stays readable: no module over 600 lines, no class of 400 or more, and no
function whose body (its docstring aside) runs past 80 lines, in the packages and the
benchmarks. Docstrings are left out of a function's count: the public functions' ``Args``
sections are the API reference."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted([*(ROOT / "packages").glob("*/src/**/*.py"), *(ROOT / "benchmarks").glob("*.py")])
MODULE_LINES = 600
CLASS_LINES = 400
FUNCTION_BODY_LINES = 80


def _body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from the first statement after the docstring to the function's end."""
    body = node.body
    first = body[0]
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        if len(body) == 1:
            return 0
        first = body[1]
    assert node.end_lineno is not None
    return node.end_lineno - first.lineno + 1


def _sizes() -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    modules, classes, functions = {}, {}, {}
    for path in SOURCES:
        text = path.read_text()
        name = str(path.relative_to(ROOT))
        modules[name] = len(text.splitlines())
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                assert node.end_lineno is not None
                classes[f"{name}:{node.name}"] = node.end_lineno - node.lineno + 1
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                functions[f"{name}:{node.lineno}:{node.name}"] = _body_lines(node)
    return modules, classes, functions


@pytest.fixture(scope="module")
def sizes() -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    return _sizes()


def test_the_scan_sees_the_code(sizes: tuple[dict[str, int], ...]) -> None:
    modules, classes, functions = sizes
    assert len(modules) > 100 and len(classes) > 50 and len(functions) > 1000
    assert any(k.endswith(":dedicate_params") for k in functions)


def test_no_module_is_over_600_lines(sizes: tuple[dict[str, int], ...]) -> None:
    over = {k: v for k, v in sizes[0].items() if v > MODULE_LINES}
    assert not over, f"modules over {MODULE_LINES} lines: {over}"


def test_no_class_reaches_400_lines(sizes: tuple[dict[str, int], ...]) -> None:
    over = {k: v for k, v in sizes[1].items() if v >= CLASS_LINES}
    assert not over, f"classes of {CLASS_LINES} lines or more: {over}"


def test_no_function_body_is_over_80_lines(sizes: tuple[dict[str, int], ...]) -> None:
    over = {k: v for k, v in sizes[2].items() if v > FUNCTION_BODY_LINES}
    assert not over, f"function bodies over {FUNCTION_BODY_LINES} lines: {over}"


def test_a_docstring_is_not_counted_but_code_is() -> None:
    tree = ast.parse('def f():\n    """Doc.\n\n    More.\n    """\n    x = 1\n    return x\n')
    node = tree.body[0]
    assert isinstance(node, ast.FunctionDef)
    assert _body_lines(node) == 2
