"""The registry of drafter families (config `drafter.family`): every other module asks it, or the family
object it returns, what differs per family; no other module compares a family's name.

A family is a `DFlashFamily` subclass that registers itself with `@register` when its module is imported;
`BUILTIN` families are imported on the first question (docs/how-to/add-a-drafter-family.md). A family module
imports neither torch nor transformers: Snakemake asks the families its checks and params each time it parses
the workflow (every `snakemake -n`), so the family names its config and drafter classes by `LazyClass`. Lookups:
`get` (by name), `names`, `of_drafter` (unwrapping DDP/FSDP), `of_config` / `of_checkpoint` (from
`architectures`, what the engines dispatch on).
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:  # pragma: no cover
    from dflash_pipeline.drafter.dflash import DFlashFamily

#: Modules of the families this package ships (each registers its family when imported).
BUILTIN = ("dflash_pipeline.drafter.dflash", "dflash_pipeline.drafter.dflash2", "dflash_pipeline.drafter.dspark")
#: `drafter.family` when a config does not say.
DEFAULT = "dflash"

_FAMILIES: dict[str, "DFlashFamily"] = {}
_loaded = False


class UnknownFamily(ValueError):
    """A family name, architecture or drafter class no registered family owns."""


class LazyClass:
    """A family's class attribute that names a class as ``"module:attribute"`` and imports it when first read, so
    the family's module (read at planning) does not import the model code (torch, transformers).

    Raises (when read):
        ImportError / AttributeError: the module or attribute does not exist.
    """

    def __init__(self, spec: str):
        self.spec = spec

    def __get__(self, obj, owner=None):
        module, _, attr = self.spec.partition(":")
        return getattr(importlib.import_module(module), attr)

    def __repr__(self) -> str:
        return f"LazyClass({self.spec!r})"


def register(cls):
    """Class decorator: register an instance of family class `cls` under `cls.name`; returns `cls`. Two families
    with one architecture are refused when an architecture is looked up (`find_by_architectures`): reading it here
    would import every family's config class at planning.

    Raises:
        ValueError: another class already registered under the same name.
    """
    fam = cls()
    for other in _FAMILIES.values():
        if type(other) is not cls and other.name == fam.name:
            raise ValueError(
                f"drafter family {cls.__qualname__}: name {fam.name!r} already registered by {type(other).__qualname__}"
            )
    _FAMILIES[fam.name] = fam
    return cls


def unregister(name: str) -> None:
    """Remove the family `name` (a test's own family, after the test); built-in families stay."""
    _load_builtin()
    if name == DEFAULT or type(_FAMILIES.get(name)).__module__ in BUILTIN:
        raise ValueError(f"drafter family {name!r} is built in; it cannot be unregistered")
    _FAMILIES.pop(name, None)


def _load_builtin() -> None:
    """Import the `BUILTIN` family modules once (each registers its family). By name, as a plugin registry
    loads its plugins: the family modules import the registry, never the other way round."""
    global _loaded
    if not _loaded:
        _loaded = True
        for module in BUILTIN:
            importlib.import_module(module)


def names() -> tuple[str, ...]:
    """Names of the registered families, the default first."""
    _load_builtin()
    return (DEFAULT, *sorted(n for n in _FAMILIES if n != DEFAULT))


def get(name: Optional[str] = None) -> "DFlashFamily":
    """The family registered as `name` (None: the default).

    Raises:
        UnknownFamily: no family of that name.
    """
    _load_builtin()
    key = DEFAULT if name is None else name
    if key not in _FAMILIES:
        raise UnknownFamily(f"drafter.family: unknown family {name!r}; expected one of {', '.join(names())}")
    return _FAMILIES[key]


def default() -> "DFlashFamily":
    """The default family (`DEFAULT`)."""
    return get(DEFAULT)


def of_drafter(drafter) -> "DFlashFamily":
    """The family of `drafter` (a drafter module, or a DDP/FSDP wrapper with `.module`): the registered family
    whose drafter class is the closest base of its type.

    Raises:
        UnknownFamily: a module no family's drafter class is a base of.
    """
    _load_builtin()
    core = getattr(drafter, "module", drafter)
    by_class = {f.drafter_class: f for f in _FAMILIES.values()}
    for klass in type(core).__mro__:
        if klass in by_class:
            return by_class[klass]
    raise UnknownFamily(f"{type(core).__qualname__}: not the drafter of a registered family ({', '.join(names())})")


def find_by_architectures(archs) -> Optional["DFlashFamily"]:
    """The family whose architecture is first in `archs` (a `config.json` `architectures` list), None when
    none is.

    Raises:
        ValueError: two registered families claim one architecture.
    """
    _load_builtin()
    by_arch: dict[str, "DFlashFamily"] = {}
    for fam in _FAMILIES.values():
        other = by_arch.setdefault(fam.architecture, fam)
        if other is not fam:
            raise ValueError(
                f"drafter families {other.name!r} and {fam.name!r} both claim architecture {fam.architecture!r}"
            )
    return next((by_arch[a] for a in archs or () if a in by_arch), None)


def of_config(config) -> "DFlashFamily":
    """The family of a drafter config (a config object or a `config.json` dict), from its `architectures`
    (none: the default family).

    Raises:
        UnknownFamily: an `architectures` list no family serves.
    """
    archs = config.get("architectures") if isinstance(config, Mapping) else getattr(config, "architectures", None)
    if not archs:
        return default()
    fam = find_by_architectures(archs)
    if fam is None:
        raise UnknownFamily(
            f"config.json architectures {archs}: not a drafter family this pipeline trains "
            f"({', '.join(get(n).architecture for n in names())})"
        )
    return fam


def of_checkpoint(ckpt_dir: Optional[str | Path]) -> "DFlashFamily":
    """The family of the export in `ckpt_dir` (the default family when there is none or no `config.json`).

    Raises:
        UnknownFamily: as `of_config`; json.JSONDecodeError: a malformed `config.json`.
    """
    cfg = Path(ckpt_dir or "") / "config.json"
    if not ckpt_dir or not cfg.is_file():
        return default()
    return of_config(json.loads(cfg.read_text(encoding="utf-8")))


def load_config(ckpt_dir: str | Path):
    """The config of the export in `ckpt_dir` as its family's config class (`of_checkpoint`,
    `config_class.from_checkpoint`).

    Raises:
        FileNotFoundError / ValueError: no or a malformed `config.json` (naming file and field); UnknownFamily.
    """
    from dflash_pipeline.drafter.config import DFlashConfig

    path = Path(ckpt_dir) / "config.json"
    if not path.is_file():
        return DFlashConfig.from_checkpoint(ckpt_dir)  # its FileNotFoundError names what a checkpoint holds
    try:
        family = of_checkpoint(ckpt_dir)
    except json.JSONDecodeError:
        return DFlashConfig.from_checkpoint(ckpt_dir)  # its ValueError names the file
    return family.config_class.from_checkpoint(ckpt_dir)


# --- Planning and the Snakemake params (asked of the configured family)


def of_settings(drafter: Mapping[str, Any]) -> "DFlashFamily":
    """The family a config's validated `drafter` section names (`drafter.family`, default `DEFAULT`)."""
    return get(drafter.get("family", DEFAULT))


def config_problems(cfg: Mapping[str, Any]) -> list[str]:
    """Family × setting combinations refused at planning, one line each (`cfg` validated, defaults filled):
    the configured family's `config_problems`."""
    return of_settings(cfg["drafter"]).config_problems(cfg)


def section_keys() -> tuple[str, ...]:
    """The `drafter.*` keys that belong to families (`family` and one section per non-default family)."""
    return ("family", *(n for n in names() if n != DEFAULT))


def family_train_keys() -> tuple[str, ...]:
    """`train.*` keys some family reads (each family's `train_keys`, in registration order)."""
    out: list[str] = []
    for n in names():
        out += [k for k in get(n).train_keys if k not in out]
    return tuple(out)


def probe_params(drafter: Mapping[str, Any]) -> dict:
    """`drafter` without the family keys: the probe does not depend on the family."""
    drop = set(section_keys())
    return {k: v for k, v in drafter.items() if k not in drop}


def arch_params(drafter: Mapping[str, Any]) -> dict:
    """The train rule's `arch` param (the configured family's `arch_params`)."""
    return of_settings(drafter).arch_params(drafter)


def train_params(train: Mapping[str, Any], family: str) -> dict:
    """The train rule's `train` param for `family` (its `train_params`)."""
    return get(family).train_params(train)


def eval_params(ev: Mapping[str, Any]) -> dict:
    """`eval` without `confidence_threshold` at its default 0, so the default leaves the params unchanged."""
    return {k: v for k, v in ev.items() if not (k == "confidence_threshold" and not v)}
