"""No module outside the family registry and the family modules tells families apart by name: every other module
asks the registry (dflash_pipeline.drafter.families) or the family object. Checked on the syntax tree of every
module under src/: a comparison (``==``, ``!=``, ``in``, ``not in``, ``is``) with a family's name, a ``match`` case
on one, or ``getattr(x, "family", ...)``."""

from __future__ import annotations

import ast
from pathlib import Path

from dflash_pipeline.drafter import families as FR

SRC = Path(__file__).resolve().parents[3] / "src"
#: The registry and the modules of the families this package ships: the only places a family's name is compared.
ALLOWED = {
    "dflash_pipeline/drafter/families.py",
    "dflash_pipeline/drafter/dflash.py",
    "dflash_pipeline/drafter/dflash2.py",
    "dflash_pipeline/drafter/dspark.py",
}
NAMES = {"dflash", "dflash2", "dspark", *FR.names()}


def _is_name(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value in NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_is_name(e) for e in node.elts)
    return False


def name_comparisons(source: str) -> list[tuple[int, str]]:
    """``(line, what)`` of every family-name comparison in ``source`` (module docstring)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(_is_name(x) for x in [node.left, *node.comparators]):
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.match_case) and any(
            isinstance(p, ast.MatchValue) and _is_name(p.value) for p in ast.walk(node.pattern)
        ):
            found.append((node.pattern.lineno, f"case {ast.unparse(node.pattern)}"))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "getattr"
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value == "family"
        ):
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_no_family_name_is_compared_outside_the_registry():
    offences = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel in ALLOWED:
            continue
        offences += [f"{rel}:{line}: {what}" for line, what in name_comparisons(path.read_text(encoding="utf-8"))]
    assert not offences, "ask dflash_pipeline.drafter.families or the family object instead:\n" + "\n".join(offences)


def test_the_check_sees_each_kind_of_comparison():
    src = """
if family == "dspark":
    pass
if core.family != 'dflash':
    pass
x = f in ("dflash2", "other")
y = getattr(core, "family", None)
match family:
    case "dflash2":
        pass
ok = family == "dflashy" or name in ("a", "b")
"""
    found = name_comparisons(src)
    assert [line for line, _ in found] == [2, 4, 6, 7, 9]
