"""Lazy public faces: a package `__init__` that lists its owning modules and the names each one exports, and
loads a module on the first use of one of its names, so importing a package costs nothing.

The face's table, `_OWNERS`, maps each owning submodule to its names as one whitespace-separated string::

    _OWNERS = {"config": "DFlashConfig checkpoint_meta", "block_size": "BlockSizeError check_block_size"}

It is a literal, so tools read it without importing the package: `face_table` turns it into
`name -> module`.
"""

import importlib
from typing import Callable, Mapping


def face_table(owners: Mapping[str, str]) -> dict[str, str]:
    """`name -> owning submodule` of a face table `{module: "name name ..."}`.

    Raises ValueError naming both modules when a name is listed under two (a name has one owner)."""
    table: dict[str, str] = {}
    for module, names in owners.items():
        for name in names.split():
            if table.setdefault(name, module) != module:
                raise ValueError(f"face table lists {name!r} under both {table[name]!r} and {module!r}")
    return table


def lazy_face(package: str, owners: Mapping[str, str], namespace: Callable[[], dict]):
    """`(__getattr__, __dir__, __all__)` for `package` (its `__name__`) whose face table `owners` maps
    each submodule to the names it defines (`face_table`); `namespace` is the package's `globals`.
    `__getattr__` raises AttributeError for a name the face does not list; `__all__` is the listed names,
    sorted."""
    table = face_table(owners)

    def __getattr__(name: str):
        owner = table.get(name)
        if owner is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{owner}"), name)

    def __dir__() -> list[str]:
        return sorted(set(namespace()) | set(table))

    return __getattr__, __dir__, sorted(table)


def moved_module(old: str, *owners: str):
    """`__getattr__` of a deprecated module `old` (its `__name__`) whose names now live in the modules `owners`,
    looked up in that order; warns with a DeprecationWarning naming them, once, when `old` is imported (call it from the
    module's body). `__getattr__` raises AttributeError for a name none of them has.

    """
    import warnings

    warnings.warn(f"{old} is deprecated; import {' or '.join(owners)}", DeprecationWarning, stacklevel=3)
    modules = [importlib.import_module(m) for m in owners]

    def __getattr__(name: str):
        for module in modules:
            if hasattr(module, name):
                return getattr(module, name)
        raise AttributeError(f"module {old!r} has no attribute {name!r}")

    return __getattr__
