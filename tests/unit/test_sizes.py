"""Size limits of the source (STYLE.md): no module in src/ over 600 lines, no function over 80
(docstring included: the whole ``def`` to its last line, as :mod:`ast` spans it)."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80


def _oversized(path: Path, text: str) -> list[str]:
    """``path``'s module when it has more than :data:`MAX_MODULE_LINES` lines, and each function (methods and
    nested functions too) longer than :data:`MAX_FUNCTION_LINES`."""
    found = []
    if len(text.splitlines()) > MAX_MODULE_LINES:
        found.append(f"{path}: {len(text.splitlines())} lines")
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = node.end_lineno - node.lineno + 1
            if n > MAX_FUNCTION_LINES:
                found.append(f"{path}:{node.lineno} {node.name}: {n} lines")
    return found


def test_the_limits_are_measured():
    """A function of 81 lines and a module of 601 are caught, one of 80 and 600 are not."""
    def_80 = "def f():\n" + "    x = 1\n" * 79
    assert _oversized(Path("m.py"), def_80) == []
    assert _oversized(Path("m.py"), def_80 + "    x = 2\n") == ["m.py:1 f: 81 lines"]
    assert _oversized(Path("m.py"), "x = 1\n" * 600) == []
    assert _oversized(Path("m.py"), "x = 1\n" * 601) == ["m.py: 601 lines"]


def test_no_module_over_600_lines_and_no_function_over_80():
    files = sorted(SRC.rglob("*.py"))
    assert len(files) > 100
    found = [f for path in files for f in _oversized(path.relative_to(SRC), path.read_text(encoding="utf-8"))]
    assert not found, "split along a real seam:\n" + "\n".join(found)
