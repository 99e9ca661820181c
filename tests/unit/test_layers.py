"""The import layers of src/dflash_pipeline (README "Layout"; pyproject.toml [tool.importlinter]).

Four layers, top to bottom: workflow / report / demo (and the tests' zoo above them), the stages, drafter and
target, core. `lint-imports` checks the contracts (no upward import, the first stages independent, no cycle
between siblings at any depth); the graph checks below add what the contracts cannot see: the lazy public
faces (`_OWNERS` in a package `__init__`, loaded with importlib) count as imports of their modules, so no
module cycle hides behind one, and one stage reaches another only through that stage's public face.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import grimp

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src"
STAGES = ("probe", "prompts", "completions", "tokens", "features", "train", "evaluate")


def lint_imports(src: Path) -> subprocess.CompletedProcess:
    """`lint-imports` (import-linter, the test extra) on the package under ``src`` with this repo's contracts."""
    exe = Path(sys.executable).parent / "lint-imports"
    exe = str(exe) if exe.exists() else shutil.which("lint-imports")
    assert exe, "lint-imports not found: install the test extra (pip install -e '.[test]')"
    env = {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run(
        [exe, "--no-cache", "--config", str(REPO / "pyproject.toml")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_import_contracts_are_kept():
    proc = lint_imports(SRC)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert "3 kept, 0 broken" in proc.stdout, proc.stdout[-3000:]


def test_an_upward_import_breaks_the_layers(tmp_path):
    """The contracts are not vacuous: core importing a stage, and a cycle through it, are both reported."""
    shutil.copytree(SRC / "dflash_pipeline", tmp_path / "dflash_pipeline", ignore=shutil.ignore_patterns("__pycache__"))
    errors = tmp_path / "dflash_pipeline" / "core" / "errors.py"
    errors.write_text(errors.read_text() + "\n\ndef _upward():\n    from dflash_pipeline.train import run  # noqa\n")
    proc = lint_imports(tmp_path)
    assert proc.returncode != 0
    assert "dflash_pipeline.core is not allowed to import dflash_pipeline.train" in proc.stdout, proc.stdout[-3000:]
    assert "No cycles are allowed in dflash_pipeline." in proc.stdout, proc.stdout[-3000:]


def _graph() -> grimp.ImportGraph:
    """The import graph (type-checking imports aside) plus an edge from each lazy face to its owner modules."""
    graph = grimp.build_graph("dflash_pipeline", exclude_type_checking_imports=True, cache_dir=None)
    for init in (SRC / "dflash_pipeline").rglob("__init__.py"):
        package = ".".join(init.parent.relative_to(SRC).parts)
        for node in ast.walk(ast.parse(init.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_OWNERS" for t in node.targets):
                for owner in ast.literal_eval(node.value):  # face table: module -> names
                    graph.add_import(importer=package, imported=f"{package}.{owner}")
    return graph


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_module_cycle_even_through_lazy_faces():
    graph = _graph()
    assert _cycles(graph) == []
    graph.add_import(importer="dflash_pipeline.core.config", imported="dflash_pipeline.prompts")  # the old cycle
    assert any("dflash_pipeline.core.config" in c and "dflash_pipeline.prompts.sharding" in c for c in _cycles(graph))


def test_stages_import_each_other_through_their_public_face():
    graph = _graph()
    inner = []
    for module in sorted(graph.modules):
        parts = module.split(".")
        if len(parts) < 2 or parts[1] not in STAGES:
            continue
        for imported in graph.find_modules_directly_imported_by(module):
            other = imported.split(".")
            if len(other) > 2 and other[1] in STAGES and other[1] != parts[1]:
                inner.append(f"{module} -> {imported}")
    assert inner == [], "import the other stage's package (its __init__ is the public face):\n" + "\n".join(inner)
