"""Every rule's conda env provides what the rule's code imports.

Conda cannot run here (no binary, no channels: reference/feasibility.md §5), so this is the proof that
`--sdm conda` would work: for each rule, take its script (or the `-m module`s of its shell command),
follow the imports through the `dflash_pipeline` modules it reaches, map the top-level modules to
distributions, and check each is listed in the rule's `envs/*.yaml`.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dflash_pipeline.core.faces import face_table

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


def import_statements(path: Path, module: str | None = None, *, top_level_only: bool = False):
    """Cached :func:`_import_statements` (every rule reaches the same modules)."""
    return _import_statements(path, module, top_level_only)


@functools.cache
def _import_statements(path: Path, module: str | None, top_level_only: bool) -> tuple:
    return tuple(_parse_imports(path, module, top_level_only=top_level_only))


def _parse_imports(path: Path, module: str | None = None, *, top_level_only: bool = False):
    """``(module, names)`` for each absolute import in ``path`` (``names`` is None for ``import a.b``, the
    imported names for ``from a.b import x, y``). Lazy imports in functions count unless ``top_level_only``
    (what importing the module runs); optional ones (in a ``try`` whose ``except`` catches ImportError) and
    ``if TYPE_CHECKING:`` blocks never do. ``module`` is the file's dotted name, for relative imports."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _under_type_checking(node):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
        elif isinstance(node, ast.Try) and _guards_import_error(node):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
        elif top_level_only and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            skip.update(id(n) for n in ast.walk(node))
    package = (module if path.name == "__init__.py" else module.rpartition(".")[0]) if module else ""
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, None
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            yield mod, tuple(a.name for a in node.names)


def imports_of(path: Path, module: str | None = None) -> set[str]:
    """Absolute module names imported anywhere in ``path`` (see :func:`import_statements`)."""
    return {mod for mod, _ in import_statements(path, module)}


def package_module_file(name: str) -> Path | None:
    if name == PKG:
        return PKG_DIR / "__init__.py"
    rel = Path(*name.split(".")[1:])
    for cand in (PKG_DIR / rel.with_suffix(".py"), PKG_DIR / rel / "__init__.py"):
        if cand.is_file():
            return cand
    return None


def face_owner(package: str, name: str) -> str | None:
    """The module that defines ``name`` of a package's public face: ``_OWNERS`` (loaded on first use) or the
    face's own ``from .module import name``; None where the ``__init__`` defines it (core/faces.lazy_face)."""
    init = package_module_file(package)
    if init is None or init.name != "__init__.py":
        return None
    tree = ast.parse(init.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_OWNERS" for t in node.targets):
            owner = face_table(ast.literal_eval(node.value)).get(name)
            if owner:
                return f"{package}.{owner}"
    for mod, names in import_statements(init, package, top_level_only=True):
        if names and name in names and mod.startswith(f"{package}."):
            return mod
    return None


def reached_imports(entry_files: list[Path], entry_modules: list[str]) -> tuple[set[str], set[str]]:
    """(top-level third-party/stdlib modules, dflash_pipeline modules) reached from the entry points.

    A module whose names the code uses counts with every import in it, lazy ones too (its functions may
    run); a module only loaded on the way (a package ``__init__``, a public face's eager imports) counts
    with what importing it runs. ``from pkg import name`` uses the module that owns ``name`` (:func:`face_owner`)."""
    external: set[str] = set()
    done: dict[str, bool] = {}  # module -> processed with its lazy imports
    todo: list[tuple[str, bool]] = []

    def enter(mod: str, names: tuple[str, ...] | None, used: bool) -> None:
        if not mod:
            return
        parts = mod.split(".")
        if parts[0] != PKG:
            external.add(parts[0])
            return
        for i in range(1, len(parts)):  # importing a.b.c runs a/__init__ and a/b/__init__
            todo.append((".".join(parts[:i]), False))
        if not names:
            todo.append((mod, used))
            return
        is_package = (f := package_module_file(mod)) is not None and f.name == "__init__.py"
        todo.append((mod, used and not is_package))
        for n in names:
            sub = f"{mod}.{n}"
            if package_module_file(sub) is not None:  # `from pkg import submodule`
                todo.append((sub, used))
            elif is_package:
                todo.append((face_owner(mod, n) or mod, used))

    for f in entry_files:
        for mod, names in import_statements(f):
            enter(mod, names, True)
    for m in entry_modules:
        enter(m, None, True)
        # `python -m pkg` runs pkg/__main__.py
        if (PKG_DIR / Path(*m.split(".")[1:]) / "__main__.py").is_file():
            enter(f"{m}.__main__", None, True)
    while todo:
        name, used = todo.pop()
        if name in ENGINE_SIDE_MODULES or done.get(name) is True or (name in done and not used):
            continue
        done[name] = used
        f = package_module_file(name)
        if f is not None:
            for mod, names in import_statements(f, name, top_level_only=not used):
                enter(mod, names, used)
    return external, {m for m in done if package_module_file(m)}


def console_scripts() -> dict[str, str]:
    """This package's console scripts (``[project.scripts]`` of pyproject.toml, as installed): command -> module."""
    eps = importlib.metadata.entry_points(group="console_scripts")
    return {ep.name: ep.module for ep in eps if ep.module.split(".")[0] == PKG}


def shell_modules(cmd: str) -> list[str]:
    """Modules a shell command runs: ``-m``s (``python -m accelerate.commands.launch … -m pkg.train``) and
    this package's console scripts (``… --no_python dflash-train``)."""
    found = re.findall(r"(?:^|\s)-m\s+([A-Za-z_][\w.]*)", cmd)
    words = set(re.split(r"[\s;|&()'\"]+", cmd))
    return found + [module for script, module in console_scripts().items() if script in words]


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


@functools.cache
def _packages_distributions() -> dict:
    return importlib.metadata.packages_distributions()  # reads every installed RECORD: once per run


def distributions_of(top_module: str) -> set[str]:
    dists = _packages_distributions().get(top_module, [])
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


# ---------------------------------------------------------------------------------------------------------
# The lock (requirements/lock.txt, requirements/make-lock.sh)
# ---------------------------------------------------------------------------------------------------------

LOCK = REPO / "requirements" / "lock.txt"


def _pin_envs():
    spec = importlib.util.spec_from_file_location("pin_envs", REPO / "requirements" / "pin_envs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_env_pins_the_locks_versions():
    """envs/*.yaml name each pip package at the lock's version (requirements/make-lock.sh writes both)."""
    pin = _pin_envs()
    lock = pin.read_lock(LOCK)
    for env in sorted((REPO / "envs").glob("*.yaml")):
        text = env.read_text()
        pinned, problems = pin.pin_env(text, lock, env=env.name)
        assert not problems and pinned == text, (env.name, problems)
        reqs = [d for d in yaml.safe_load(text)["dependencies"] if isinstance(d, dict)][0]["pip"]
        assert all("==" in r for r in reqs if not r.startswith("-e")), (env.name, reqs)


def test_pin_env_pins_and_names_what_the_lock_lacks(tmp_path):
    pin = _pin_envs()
    text = (
        "dependencies:\n  - python>=3.10\n  - pip:\n      - torch>=2.4\n      - foo_bar[x]>=1  # why\n      - -e ..\n"
    )
    out, problems = pin.pin_env(text, {"torch": "2.13.0"}, env="e.yaml")
    assert "      - torch==2.13.0\n" in out and "  - python>=3.10\n" in out and "      - -e ..\n" in out
    assert problems == ["e.yaml: foo_bar is not in the lock"]
    bad = tmp_path / "lock.txt"
    bad.write_text("# header\na==1\nb>=2\n")
    with pytest.raises(ValueError, match=r"lock.txt:3: not a name==version pin: 'b>=2'"):
        pin.read_lock(bad)


def test_the_lock_satisfies_pyproject_and_covers_every_dependency():
    """Every direct dependency of the README install (pyproject's dependencies and the locked extras) is in the
    lock at a version its range admits; every line is a name==version pin."""
    import tomllib
    from packaging.requirements import Requirement

    lock = _pin_envs().read_lock(LOCK)
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = (
        re.search(r"DFLASH_LOCK_EXTRAS:-([a-z,]+)\}", (REPO / "requirements" / "make-lock.sh").read_text())
        .group(1)
        .split(",")
    )
    reqs = [Requirement(r) for r in project["dependencies"]]
    reqs += [Requirement(r) for e in extras for r in project["optional-dependencies"][e]]
    for r in reqs:
        name = normalize(r.name)
        assert name in lock, f"{r.name} is not in requirements/lock.txt: run requirements/make-lock.sh"
        assert r.specifier.contains(lock[name], prereleases=True), f"lock {r.name}=={lock[name]} outside {r.specifier}"


def test_installed_versions_equal_the_lock():
    """The environment this suite runs in is the locked one (`.ci/run` and the README install from the lock):
    every installed distribution the lock names has the lock's version (a local build label such as +cpu
    aside). `.ci/run latest` and `.ci/run lowest` deselect this test: there other releases are the point."""
    from packaging.version import Version

    lock = _pin_envs().read_lock(LOCK)
    differ = {}
    for dist in importlib.metadata.distributions():
        name = normalize(dist.metadata["Name"])
        if name in lock and Version(dist.version).public != Version(lock[name]).public:
            differ[name] = (dist.version, lock[name])
    assert not differ, f"installed != requirements/lock.txt (installed, locked): {differ}"
