"""The lazy public faces (core/faces.py): the face table's form, and every listed name defined by its owner."""

import ast
from pathlib import Path

import pytest

from dflash_pipeline.core.faces import face_table, lazy_face

PKG = Path(__file__).resolve().parents[3] / "src" / "dflash_pipeline"


def test_face_table_inverts_and_refuses_a_name_with_two_owners():
    assert face_table({"config": "A b", "blocks": " c\n d "}) == {
        "A": "config",
        "b": "config",
        "c": "blocks",
        "d": "blocks",
    }
    with pytest.raises(ValueError, match="'b' under both 'config' and 'blocks'"):
        face_table({"config": "A b", "blocks": "b"})


def test_lazy_face_loads_the_owner_on_first_use():
    getattr_, dir_, all_ = lazy_face("dflash_pipeline.core", {"errors": "ConfigError", "shards": "write_json"}, dict)
    from dflash_pipeline.core.errors import ConfigError

    assert getattr_("ConfigError") is ConfigError
    assert all_ == ["ConfigError", "write_json"] == dir_()
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        getattr_("nope")


def _defined(module: Path) -> set[str]:
    """Top-level names a module binds (defs, classes, assignments, imports)."""
    names = set()
    for node in ast.parse(module.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def _faces():
    for init in sorted(PKG.rglob("__init__.py")):
        for node in ast.parse(init.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_OWNERS" for t in node.targets):
                yield init.parent, ast.literal_eval(node.value)


def test_every_face_name_is_defined_by_its_owner_module():
    faces = list(_faces())
    assert len(faces) >= 9
    missing = [
        f"{package.name}.{module}: {name}"
        for package, owners in faces
        for name, module in face_table(owners).items()
        if name not in _defined(package / f"{module}.py")
    ]
    assert not missing, missing


def test_moved_module_warns_and_finds_names_in_every_new_home(monkeypatch):
    """The old ``dflash_pipeline.evaluate_engine`` path keeps serving the names that moved to two modules."""
    import importlib
    import sys

    from dflash_pipeline.evaluate import engine_acceptance, engine_vs_loop

    monkeypatch.delitem(sys.modules, "dflash_pipeline.evaluate_engine", raising=False)
    with pytest.warns(
        DeprecationWarning, match="dflash_pipeline.evaluate_engine is deprecated; import .*engine_vs_loop"
    ):
        old = importlib.import_module("dflash_pipeline.evaluate_engine")
    assert old.server_acceptance is engine_acceptance.server_acceptance
    assert old.attach_engine_tau is engine_vs_loop.attach_engine_tau and old.DISAGREEMENT_Z == 3.0
    with pytest.raises(AttributeError, match="'dflash_pipeline.evaluate_engine' has no attribute 'nope'"):
        _ = old.nope


@pytest.mark.parametrize(
    "old, new, name",
    [
        ("dflash_pipeline.model", "dflash_pipeline.drafter.model", "DFlashDrafter"),
        ("dflash_pipeline.engine", "dflash_pipeline.evaluate.vllm_server", "VLLMServer"),
        ("dflash_pipeline.chat", "dflash_pipeline.target.chat", "load_tokenizer"),
    ],
)
def test_old_flat_module_paths_warn_and_forward(monkeypatch, old, new, name):
    """The other flat modules of the last release keep working for one release: each warns when imported,
    naming its new home, and gives the moved module's own object."""
    import importlib
    import sys

    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(DeprecationWarning, match=rf"{old} is deprecated; import {new}"):
        module = importlib.import_module(old)
    assert getattr(module, name) is getattr(importlib.import_module(new), name)


def test_console_scripts_are_installed():
    """``dflash-train`` (the train rule's entry point) and ``dflash-eval`` run from the environment's bin."""
    import subprocess
    import sys

    bindir = Path(sys.executable).parent
    for script, expect in (("dflash-train", "--train-config"), ("dflash-eval", "--drafter")):
        proc = subprocess.run([str(bindir / script), "--help"], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and expect in proc.stdout, (script, proc.stdout[-2000:], proc.stderr[-2000:])
