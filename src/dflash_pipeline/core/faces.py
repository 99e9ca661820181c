"""Lazy public faces: a package ``__init__`` that lists ``name -> owning module`` and loads each on first use.

Every stage package's ``__init__`` is its public face (README "Layout"): other packages import a stage's
names from the package, and the package imports the owning module only when a name is first used, so
importing a package costs nothing (Snakemake's planning imports several).
"""

import importlib
from typing import Callable, Mapping


def lazy_face(package: str, owners: Mapping[str, str], namespace: Callable[[], dict]):
    """``(__getattr__, __dir__)`` for ``package`` (its ``__name__``) whose names ``owners`` maps to the
    submodule that defines each (``{"DFlashConfig": "config"}``); ``namespace`` is the package's
    ``globals``. ``__getattr__`` raises AttributeError for a name the face does not list."""

    def __getattr__(name: str):
        owner = owners.get(name)
        if owner is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{owner}"), name)

    def __dir__() -> list[str]:
        return sorted(set(namespace()) | set(owners))

    return __getattr__, __dir__
