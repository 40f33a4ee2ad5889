"""The size limits a newcomer can read in one sitting (issue 31), checked statically with `ast`.

No class has more than 20 methods (every `def` in its body, properties included) and no function
is longer than 80 lines (its `def` line to its last line), in the product's code and its scripts.
A class or function that grows past them is a sign that it does more than one job: split it along
its responsibilities (docs/architecture.md maps where each one lives), don't raise the limit.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CODE = ("shared", "models", "cloud_server", "edge_client", "scripts")
MAX_METHODS = 20
MAX_LINES = 80


def _nodes() -> list[tuple[str, ast.AST]]:
    out: list[tuple[str, ast.AST]] = []
    for top in CODE:
        for f in sorted((ROOT / top).rglob("*.py")):
            out += [(str(f.relative_to(ROOT)), n) for n in ast.walk(ast.parse(f.read_text(), str(f)))]
    return out


def big_classes(nodes: list[tuple[str, ast.AST]]) -> list[str]:
    return [
        f"{where}:{n.lineno} {n.name}: {k} methods"
        for where, n in nodes
        if isinstance(n, ast.ClassDef)
        and (k := sum(isinstance(x, (ast.FunctionDef, ast.AsyncFunctionDef)) for x in n.body)) > MAX_METHODS
    ]


def long_functions(nodes: list[tuple[str, ast.AST]]) -> list[str]:
    return [
        f"{where}:{n.lineno} {n.name}: {k} lines"
        for where, n in nodes
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
        and (k := (n.end_lineno or n.lineno) - n.lineno + 1) > MAX_LINES
    ]


def test_no_class_has_more_than_20_methods():
    big = big_classes(_nodes())
    assert not big, f"classes over {MAX_METHODS} methods (split them by responsibility):\n" + "\n".join(big)


def test_no_function_is_longer_than_80_lines():
    long = long_functions(_nodes())
    assert not long, f"functions over {MAX_LINES} lines (split them by what each part does):\n" + "\n".join(long)


def test_the_checks_catch_a_big_class_and_a_long_function():
    """The checks can fail: a class of 21 methods and a function of 81 lines are caught, 20 and 80 pass."""

    def parsed(n_methods: int, n_lines: int) -> list[tuple[str, ast.AST]]:
        src = "class C:\n" + "".join(f"    def m{i}(self): pass\n" for i in range(n_methods))
        src += "def f():\n" + "    x = 1\n" * (n_lines - 1)
        return [("x.py", n) for n in ast.walk(ast.parse(src))]

    assert big_classes(parsed(21, 80)) == ["x.py:1 C: 21 methods"] and not long_functions(parsed(21, 80))
    assert long_functions(parsed(20, 81)) == ["x.py:22 f: 81 lines"] and not big_classes(parsed(20, 81))
