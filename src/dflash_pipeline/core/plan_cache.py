"""The cache of what Snakemake computes each time it reads the workflow (the device-memory plan, the probe's
plan-time gate): JSON values under the user's cache directory, keyed by the digest of everything that decides
them, so a repeated `snakemake -n` reads a file instead of importing torch and transformers.

A key names the installed versions (`installed_version`, read from package metadata: nothing imported) and the
sources that compute the value (`source_digest`, read as files), so a new release or an edited module misses.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
from pathlib import Path
from typing import Any, Callable, Optional

#: The package's root directory (`source_digest` paths are relative to it).
PACKAGE = Path(__file__).resolve().parents[1]


def cache_root() -> Path:
    """`$DFLASH_CACHE_DIR`, else `$XDG_CACHE_HOME/dflash-pipeline` (default `~/.cache/dflash-pipeline`): shared by every
    working directory of the user, so what one planned is never planned again."""
    root = os.environ.get("DFLASH_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dflash-pipeline"


def source_digest(*relative: str) -> str:
    """sha256 (16 hex digits) of the package sources `relative` (paths under `PACKAGE`; a directory stands for its
    `*.py` files), read as files.

    Raises:
        FileNotFoundError: a path that does not exist.
    """
    h = hashlib.sha256()
    for rel in relative:
        path = PACKAGE / rel
        for file in sorted(path.glob("*.py")) if path.is_dir() else [path]:
            h.update(file.relative_to(PACKAGE).as_posix().encode())
            h.update(file.read_bytes())
    return h.hexdigest()[:16]


def installed_version(dist: str) -> Optional[str]:
    """The installed version of the distribution `dist` from its metadata (nothing imported); torch's own
    `__version__` when torch has no metadata (a source build), None for another package without it."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        if dist != "torch":
            return None
        import torch

        return torch.__version__


def target_config_key(target_dir: str | Path, trust_remote_code: bool) -> dict:
    """What a target's config is to transformers, read without it: the sha256 of `config.json`, of the target's
    `*.py` files when its remote code is trusted (they define the config class), and transformers' installed
    version (it fills the config's defaults).

    Raises:
        OSError: `config.json` cannot be read.
    """
    target_dir = Path(target_dir)
    remote = (
        {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(target_dir.glob("*.py"))}
        if trust_remote_code
        else {}
    )
    return {
        "config_json": hashlib.sha256((target_dir / "config.json").read_bytes()).hexdigest(),
        "remote_code": remote,
        "transformers": installed_version("transformers"),
    }


def cached_json(
    cache_dir: Optional[str | Path],
    key: dict,
    compute: Callable[[], Any],
    decode: Optional[Callable[[Any], Any]] = None,
):
    """`decode(compute())` (`compute()` a JSON value; `decode` the identity when None), kept in `cache_dir` under the
    sha256 of `key` (a JSON-able dict; None = no cache). A cache file that does not parse, or whose value `decode`
    refuses (KeyError, TypeError, ValueError), is computed again and rewritten; writes are atomic (temp + rename), so
    concurrent planners each write the same whole value."""
    decode = decode or (lambda value: value)
    if cache_dir is None:
        return decode(compute())
    text = json.dumps(key, sort_keys=True, default=str)
    path = Path(cache_dir) / f"{hashlib.sha256(text.encode()).hexdigest()[:24]}.json"
    if path.is_file():
        try:
            return decode(json.loads(path.read_text())["value"])
        except (ValueError, KeyError, TypeError):
            pass
    value = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"value": value}))
    tmp.replace(path)
    return decode(value)
