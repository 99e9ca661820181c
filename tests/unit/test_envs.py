"""Every rule's conda env provides what the rule's code imports.

Conda cannot run here (no binary, no channels: reference/feasibility.md §5), so this is the proof that
`--sdm conda` would work: for each rule, take its script (or the `-m module`s of its shell command),
follow the imports through the `dflash_pipeline` modules it reaches, map the top-level modules to
distributions, and check each is listed in the rule's `envs/*.yaml`.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
PKG = "dflash_pipeline"
PKG_DIR = REPO / "src" / PKG

#: Modules that run only under the vLLM environment's interpreter (dflash_pipeline.core.vllm_env: the vllm
#: features backend and its connector, imported lazily when ``features.backend: vllm``), never under the
#: rule's conda env, so what they import is not the env's business.
ENGINE_SIDE_MODULES = {f"{PKG}.features.vllm_backend", f"{PKG}.features.vllm_connector"}

#: conda-forge names that differ from the import's distribution name.
CONDA_ALIASES = {"pytorch": "torch"}

# Loads the workflow with Snakemake's API (as `snakemake --list-rules` does) and prints each rule's
# env, script and shell command as JSON; a subprocess, since loading changes the working directory.
RULES_PROBE = r"""
import contextlib, io, json, sys
from pathlib import Path
from snakemake.api import SnakemakeApi
from snakemake.settings.types import OutputSettings, ResourceSettings
with SnakemakeApi(OutputSettings()) as api:
    wf = api.workflow(resource_settings=ResourceSettings(cores=1), snakefile=Path("Snakefile").resolve(),
                      workdir=Path(".").resolve())
    with contextlib.redirect_stdout(io.StringIO()):
        wf.list_rules()
    rules = [{"name": r.name, "snakefile": str(r.snakefile), "conda": r.conda_env, "script": r.script,
              "shell": r.shellcmd} for r in wf._workflow.rules]
print("RULES=" + json.dumps(rules))
"""


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def workflow_rules(workdir: Path) -> list[dict]:
    for name in ("Snakefile", "rules", "scripts", "envs", "config", "data"):
        (workdir / name).symlink_to(REPO / name)
    out = subprocess.run([sys.executable, "-c", RULES_PROBE], cwd=workdir, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(l for l in out.stdout.splitlines() if l.startswith("RULES="))
    return json.loads(line[len("RULES=") :])


def _under_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _guards_import_error(node: ast.Try) -> bool:
    names = set()
    for h in node.handlers:
        for t in [h.type] if not isinstance(h.type, ast.Tuple) else h.type.elts:
            if isinstance(t, ast.Name):
                names.add(t.id)
    return bool(names & {"ImportError", "ModuleNotFoundError"})


def imports_of(path: Path, module: str | None = None) -> set[str]:
    """Absolute module names imported anywhere in ``path``: lazy imports in functions count; optional
    ones (in a ``try`` whose ``except`` catches ImportError) and ``if TYPE_CHECKING:`` blocks do not.
    ``module`` is the file's dotted name, for relative imports."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _under_type_checking(node):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
        elif isinstance(node, ast.Try) and _guards_import_error(node):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    found: set[str] = set()
    package = (module if path.name == "__init__.py" else module.rpartition(".")[0]) if module else ""
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            found.add(mod)
            # `from pkg import sub` may name a submodule
            found.update(f"{mod}.{a.name}" for a in node.names if mod.split(".")[0] == PKG)
    return found


def package_module_file(name: str) -> Path | None:
    if name == PKG:
        return PKG_DIR / "__init__.py"
    rel = Path(*name.split(".")[1:])
    for cand in (PKG_DIR / rel.with_suffix(".py"), PKG_DIR / rel / "__init__.py"):
        if cand.is_file():
            return cand
    return None


def reached_imports(entry_files: list[Path], entry_modules: list[str]) -> tuple[set[str], set[str]]:
    """(top-level third-party/stdlib modules, dflash_pipeline modules) reached from the entry points."""
    external: set[str] = set()
    seen: set[str] = set()
    todo: list[str] = []

    def add(names: set[str]) -> None:
        for n in names:
            if n.split(".")[0] == PKG:
                parts = n.split(".")
                for i in range(1, len(parts) + 1):  # importing a.b.c runs a/__init__ and a/b/__init__
                    todo.append(".".join(parts[:i]))
            elif n:
                external.add(n.split(".")[0])

    for f in entry_files:
        add(imports_of(f))
    add(set(entry_modules))
    # `python -m pkg` runs pkg/__main__.py (a package's __init__ is a lazy public face)
    add({f"{m}.__main__" for m in entry_modules if (PKG_DIR / Path(*m.split(".")[1:]) / "__main__.py").is_file()})
    while todo:
        name = todo.pop()
        if name in seen or name in ENGINE_SIDE_MODULES:
            continue
        seen.add(name)
        f = package_module_file(name)
        if f is not None:
            add(imports_of(f, name))
    return external, {m for m in seen if package_module_file(m)}


def shell_modules(cmd: str) -> list[str]:
    """Modules a shell command runs with ``-m`` (``python -m accelerate.commands.launch … -m pkg.train``)."""
    return re.findall(r"(?:^|\s)-m\s+([A-Za-z_][\w.]*)", cmd)


def env_packages(env_file: Path) -> tuple[set[str], bool]:
    """(normalized package names listed in the env, whether it installs this repo's package)."""
    env = yaml.safe_load(env_file.read_text())
    names: set[str] = set()
    installs_self = False

    def add(spec: str) -> None:
        name = re.split(r"[\s<>=!~\[;]", spec.strip(), maxsplit=1)[0]
        name = name.split("::")[-1]  # channel::package
        names.add(normalize(CONDA_ALIASES.get(name, name)))

    for dep in env.get("dependencies", []):
        if isinstance(dep, dict):
            for spec in dep.get("pip", []):
                if spec.startswith(("-e ", "--editable")) or spec.strip() in ("..", "-e .."):
                    installs_self = True
                elif not spec.startswith("-"):
                    add(spec)
        else:
            add(dep)
    return names, installs_self


def distributions_of(top_module: str) -> set[str]:
    dists = importlib.metadata.packages_distributions().get(top_module, [])
    return {normalize(d) for d in dists}


@pytest.fixture(scope="module")
def rules(tmp_path_factory) -> list[dict]:
    return workflow_rules(tmp_path_factory.mktemp("envs-wd"))


def test_imports_are_found_through_the_package(rules):
    """Guards the analysis itself: the training rule reaches torch through dflash_pipeline.train.run."""
    train = next(r for r in rules if r["name"] == "train_drafter")
    external, modules = reached_imports([], shell_modules(train["shell"]))
    assert {"torch", "accelerate", "safetensors"} <= external
    assert {"dflash_pipeline.train.run", "dflash_pipeline.drafter.model"} <= modules
    assert imports_of(PKG_DIR / "train" / "run.py", "dflash_pipeline.train.run") >= {"torch"}


def test_every_rule_with_code_has_an_env(rules):
    for r in rules:
        if r["script"] or r["shell"]:
            assert r["conda"], f"rule {r['name']} ({r['snakefile']}) has no `conda:` env"
            env = (Path(r["snakefile"]).parent / r["conda"]).resolve()
            assert env.is_file() and env.parent == REPO / "envs", f"rule {r['name']}: env {env} not in envs/"


def test_each_env_provides_what_its_rule_imports(rules):
    stdlib = set(sys.stdlib_module_names)
    problems: list[str] = []
    checked = 0
    for r in rules:
        if not (r["script"] or r["shell"]):
            continue
        rule_dir = Path(r["snakefile"]).parent
        scripts = [(rule_dir / r["script"]).resolve()] if r["script"] else []
        modules = shell_modules(r["shell"]) if r["shell"] else []
        external, pkg_modules = reached_imports(scripts, modules)
        env_file = (rule_dir / r["conda"]).resolve()
        listed, installs_self = env_packages(env_file)
        env_name = env_file.relative_to(REPO)
        if pkg_modules and not installs_self:
            problems.append(
                f"rule {r['name']}: reaches {PKG} but {env_name} does not install it (`- -e ..` under pip:)"
            )
        for top in sorted(external - stdlib - {PKG}):
            dists = distributions_of(top)
            if not dists:
                problems.append(f"rule {r['name']}: imports `{top}`, which no installed distribution provides")
            elif not dists & listed:
                problems.append(
                    f"rule {r['name']}: imports `{top}` (distribution {'/'.join(sorted(dists))}) "
                    f"but {env_name} does not list it; add it under pip:"
                )
        checked += 1
    assert checked >= 6
    assert not problems, "\n".join(problems)


def test_env_files_are_pinned_conda_envs():
    """Each env: conda-forge without defaults, python + pip, lower bounds on every pip package."""
    for env_file in sorted((REPO / "envs").glob("*.yaml")):
        env = yaml.safe_load(env_file.read_text())
        assert "conda-forge" in env["channels"] and "nodefaults" in env["channels"], env_file.name
        deps = env["dependencies"]
        assert any(isinstance(d, str) and d.startswith("python") for d in deps), env_file.name
        pip = next(d["pip"] for d in deps if isinstance(d, dict) and "pip" in d)
        for spec in pip:
            if not spec.startswith("-"):
                assert re.search(r">=|==|~=", spec), f"{env_file.name}: `{spec}` has no version bound"
