"""Atomic shard and JSON I/O.

Every write goes to a temporary file in the destination directory and is renamed into place, so a crash
never leaves a half-written file that looks finished. Writes whose bytes equal the existing file's are
skipped, which keeps the file's mtime and so keeps downstream Snakemake jobs valid.
"""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_pipeline.core.contracts import canonical_json


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, skip_if_identical: bool = True) -> bool:
    """Write `data` to `path` atomically (temp file + fsync + rename).

    Returns True if the file was (re)written, False if it already held exactly `data` and
    `skip_if_identical` is set (mtime then stays unchanged).
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


def replace_dir(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Move the finished directory `src` to `dst` atomically: a reader sees the old `dst` or the new
    one, never a half-written one. An existing `dst` is renamed aside first and removed afterwards.

    `src` and `dst` must be on one filesystem (`os.replace`); `src` is typically `dst` + `.tmp`.
    """
    src, dst = Path(src), Path(dst)
    old = None
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(dst, old)
    os.replace(src, dst)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_tsv(path: str | os.PathLike, columns: Sequence[str], rows: Iterable[Mapping[str, Any]]) -> None:
    """Write `rows` as a tab-separated table with a header of `columns`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.StringIO(newline="")
    w = csv.DictWriter(buf, fieldnames=list(columns), delimiter="\t", extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({c: ("" if r.get(c) is None else r.get(c)) for c in columns})
    atomic_write_bytes(path, buf.getvalue().encode("utf-8"), skip_if_identical=False)


def write_json(path: str | os.PathLike, obj: Any, *, skip_if_identical: bool = True) -> bool:
    """Atomically write `obj` as pretty, key-sorted JSON (deterministic bytes)."""
    text = json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    return atomic_write_bytes(path, text.encode("utf-8"), skip_if_identical=skip_if_identical)


def read_json(path: str | os.PathLike) -> Any:
    """Read a JSON file."""
    with open(path, "r", encoding="utf-8") as fh:
        return json.load(fh)


def table_from_records(records: Iterable[Mapping[str, Any]], schema: pa.Schema) -> pa.Table:
    """Build a table with exactly `schema` from dict records (missing nullable fields become null)."""
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
    """Atomically write `table` as a zstd Parquet file; `metadata` goes to the file's key-value
    metadata as canonical JSON under `dflash`. Deterministic bytes for equal inputs.

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
    """Return the `dflash` key-value metadata of a shard written by `write_parquet` or
    `ParquetStreamWriter` ({} if none)."""
    meta = pq.read_metadata(path).metadata or {}  # the footer's key-value metadata (both writers)
    raw = meta.get(b"dflash")
    return json.loads(raw) if raw else {}


def _same_file_bytes(a: Path, b: Path, chunk: int = 1 << 20) -> bool:
    if not a.is_file() or not b.is_file() or a.stat().st_size != b.stat().st_size:
        return False
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            x, y = fa.read(chunk), fb.read(chunk)
            if x != y:
                return False
            if not x:
                return True


class ParquetStreamWriter:
    """Write a Parquet shard one record batch (= one row group) at a time, with bounded memory.

    Same file format as `write_parquet`. Rows go to a temporary file in the destination directory that is fsynced and
    renamed into place on `close`; an exception inside the `with` block removes it.
    Equal rows, batch boundaries and metadata give equal bytes, and an identical existing file is kept (mtime
    unchanged).
    """

    def __init__(self, path: str | os.PathLike, schema: pa.Schema):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.schema = schema
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
        os.close(fd)
        self.tmp = Path(tmp)
        self._writer = pq.ParquetWriter(
            str(self.tmp), schema, compression="zstd", write_statistics=False, store_schema=True
        )
        self.rows = 0

    def write_batch(self, batch: pa.RecordBatch | pa.Table) -> None:
        """Append rows (one row group)."""
        if batch.num_rows:
            self._writer.write(batch)
            self.rows += batch.num_rows

    def close(self, metadata: Mapping[str, Any] | None = None, *, skip_if_identical: bool = True) -> bool:
        """Finish the file (with `metadata`) and move it into place. Returns False if an identical file
        was already there (kept, the temporary file removed)."""
        if metadata is not None:
            self._writer.add_key_value_metadata({"dflash": canonical_json(dict(metadata))})
        self._writer.close()
        with open(self.tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        if skip_if_identical and _same_file_bytes(self.tmp, self.path):
            self.tmp.unlink()
            return False
        os.chmod(self.tmp, 0o644)
        os.replace(self.tmp, self.path)
        return True

    def abort(self) -> None:
        """Drop the temporary file (the destination is untouched)."""
        try:
            self._writer.close()
        finally:
            self.tmp.unlink(missing_ok=True)

    def __enter__(self) -> "ParquetStreamWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None and self.tmp.exists():
            self.abort()
