"""Atomic shard and JSON I/O.

Every write goes to a temporary file in the destination directory and is renamed into place, so a crash
never leaves a half-written file that looks finished. Writes whose bytes equal the existing file's are
skipped, which keeps the file's mtime and so keeps downstream Snakemake jobs valid.
"""

from __future__ import annotations

import io
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable, Mapping

import pyarrow as pa
import pyarrow.parquet as pq

from .contracts import canonical_json


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, skip_if_identical: bool = True) -> bool:
    """Write ``data`` to ``path`` atomically (temp file + fsync + rename).

    Returns True if the file was (re)written, False if it already held exactly ``data`` and
    ``skip_if_identical`` is set (mtime then stays unchanged).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if skip_if_identical and path.is_file() and path.stat().st_size == len(data):
        if path.read_bytes() == data:
            return False
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return True


def write_json(path: str | os.PathLike, obj: Any, *, skip_if_identical: bool = True) -> bool:
    """Atomically write ``obj`` as pretty, key-sorted JSON (deterministic bytes)."""
    text = json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    return atomic_write_bytes(path, text.encode("utf-8"), skip_if_identical=skip_if_identical)


def read_json(path: str | os.PathLike) -> Any:
    """Read a JSON file."""
    with open(path, "r", encoding="utf-8") as fh:
        return json.load(fh)


def table_from_records(records: Iterable[Mapping[str, Any]], schema: pa.Schema) -> pa.Table:
    """Build a table with exactly ``schema`` from dict records (missing nullable fields become null)."""
    rows = list(records)
    cols = {name: [r.get(name) for r in rows] for name in schema.names}
    return pa.Table.from_pydict(cols, schema=schema)


def write_parquet(
    path: str | os.PathLike,
    table: pa.Table,
    *,
    metadata: Mapping[str, Any] | None = None,
    skip_if_identical: bool = True,
) -> bool:
    """Atomically write ``table`` as a zstd Parquet file; ``metadata`` goes to the file's key-value
    metadata as canonical JSON under ``dflash``. Deterministic bytes for equal inputs.

    Returns True if the file was written, False if an identical file was already there.
    """
    if metadata is not None:
        meta = dict(table.schema.metadata or {})
        meta[b"dflash"] = canonical_json(dict(metadata)).encode("utf-8")
        table = table.replace_schema_metadata(meta)
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd", write_statistics=False, store_schema=True)
    return atomic_write_bytes(path, buf.getvalue(), skip_if_identical=skip_if_identical)


def read_parquet(path: str | os.PathLike) -> pa.Table:
    """Read a Parquet shard."""
    return pq.read_table(path)


def read_shard_metadata(path: str | os.PathLike) -> dict:
    """Return the ``dflash`` key-value metadata of a shard written by :func:`write_parquet` ({} if none)."""
    meta = pq.read_schema(path).metadata or {}
    raw = meta.get(b"dflash")
    return json.loads(raw) if raw else {}
