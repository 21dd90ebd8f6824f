"""No function of ``lightning_pipe`` runs over 80 lines of code without saying why.

Code lines are counted from the first statement after the docstring to the function's last line (a
long docstring is not a long function). A function over the limit states its reason in its docstring
as a sentence starting ``About N lines:``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_pipe"
LIMIT = 80
REASON = re.compile(r"About \d+ lines:")


def _long_functions_without_reason(source: str, name: str) -> list[str]:
    """``name:line function (N lines)`` for each function of ``source`` over the limit with no reason."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        docstring = ast.get_docstring(node)
        body = node.body[1:] if docstring is not None and len(node.body) > 1 else node.body
        lines = node.end_lineno - body[0].lineno + 1
        if lines > LIMIT and not REASON.search(docstring or ""):
            found.append(f"{name}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_long_functions_say_why():
    """Every function over the limit is shortened or states why it is long."""
    found = [
        entry
        for path in sorted(PACKAGE.rglob("*.py"))
        for entry in _long_functions_without_reason(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    ]
    assert not found, "split these functions or say why they are long ('About N lines: ...'):\n" + "\n".join(found)


def test_the_check_finds_a_long_function_and_accepts_its_reason():
    statements = "\n".join(f"    x{i} = {i}" for i in range(LIMIT + 1))
    long_source = f'def f():\n    """Docstring."""\n{statements}\n'
    assert _long_functions_without_reason(long_source, "m.py") == [f"m.py:1 f ({LIMIT + 1} lines)"]
    explained = long_source.replace('"""Docstring."""', '"""Docstring.\n\n    About 81 lines: a table."""')
    assert _long_functions_without_reason(explained, "m.py") == []
    short = f'def g():\n    """{"x" * 10}\n' + "\n" * 100 + '    """\n    return 1\n'
    assert _long_functions_without_reason(short, "m.py") == []
