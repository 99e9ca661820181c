"""Readers of prompt sources: files (`.jsonl`, `.json` arrays, `.parquet`, `.arrow`; `.gz`/`.zst`
compressed), directories of them, saved Hugging Face datasets (+ DatasetDict split) and `hf:` Hub ids.
`read_records` streams `(Locator, raw dict)` pairs; malformed records raise DataError in a
`strict` read or are counted and skipped (with located examples) otherwise."""

from __future__ import annotations

import codecs
import collections
import gzip
import io
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Iterator, MutableMapping

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_pipeline.core.errors import ConfigError, DataError

log = logging.getLogger(__package__)  # one logger for the whole prompts stage

#: File suffixes read as records (after removing a `.gz`/`.zst` compression suffix).
RECORD_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow")
COMPRESSION_SUFFIXES = (".gz", ".zst")
_SURROGATES = re.compile("[\udc80-\udcff]")
_READ_CHUNK = 1 << 20  # bytes per read of a JSON array
#: `path` prefix of a Hugging Face Hub dataset id (read through the optional `datasets` library).
HF_PREFIX = "hf:"
#: Examples per drop reason kept in the manifest's `skipped_examples` (malformed and rejected records).
MAX_EXAMPLES = 5


@dataclass(frozen=True)
class Locator:
    """Where a record came from: `file` (as given/found), 1-based `line` (jsonl; JSON arrays: the line
    the record starts on) and 0-based `index` (record/row number within the file)."""

    file: str
    index: int
    line: int | None = None
    kind: str = "line"  # line (jsonl) | record (JSON array) | row (parquet/arrow)

    def __str__(self) -> str:
        if self.kind == "line":
            return f"{self.file}: line {self.line}"
        if self.kind == "record":
            return f"{self.file}: record {self.index} (line {self.line})"
        return f"{self.file}: row {self.index}"


class _Skip(Exception):
    """Internal: a malformed record in a non-strict read (reason + message)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def _strip_compression(name: str) -> tuple[str, str | None]:
    for suf in COMPRESSION_SUFFIXES:
        if name.endswith(suf):
            return name[: -len(suf)], suf
    return name, None


def _record_kind(path: Path) -> str | None:
    base, _ = _strip_compression(path.name)
    for suf in RECORD_SUFFIXES:
        if base.endswith(suf):
            return suf
    return None


def list_source_files(path: str | os.PathLike, split: str | None = None) -> list[Path]:
    """Files of a source, in the order they are read: a file as is; a directory's supported files
    (recursively, hidden ones skipped) sorted by relative POSIX path; a `save_to_disk` directory's `.arrow`
    files; a saved `DatasetDict`'s files of `split` (default `train`, or its only split).

    Raises:
        DataError: the path does not exist, has an unsupported suffix, holds no supported file, or a
            DatasetDict has no such split (lists its splits).
        ConfigError: `split` given for a source that is not a saved DatasetDict."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"{p}: no such file or directory (check `datasets.<name>.path` / `eval.sets.<name>.path`)")
    if (p / "dataset_dict.json").is_file():
        try:
            splits = list(json.loads((p / "dataset_dict.json").read_text(encoding="utf-8"))["splits"])
        except (OSError, ValueError, KeyError, TypeError):
            splits = sorted(d.name for d in p.iterdir() if d.is_dir() and not d.name.startswith("."))
        chosen = split or ("train" if "train" in splits else splits[0] if len(splits) == 1 else None)
        if chosen is None or chosen not in splits or not (p / chosen).is_dir():
            raise DataError(
                f"{p}: a saved DatasetDict with splits {splits}; "
                + (f"it has no split {chosen!r}; " if chosen else "")
                + "set `split` on the source to one of them"
            )
        return list_source_files(p / chosen)
    if split is not None:
        raise ConfigError(f"{p}: `split: {split}` is only for a saved DatasetDict directory or an `hf:` dataset id")
    if p.is_file():
        if _record_kind(p) is None:
            raise DataError(
                f"{p}: unsupported file type; use one of {', '.join(RECORD_SUFFIXES)} "
                f"(optionally compressed {', '.join(COMPRESSION_SUFFIXES)})"
            )
        return [p]
    files = []
    for f in p.rglob("*"):
        rel = f.relative_to(p)
        if any(part.startswith(".") for part in rel.parts) or not f.is_file():
            continue
        if _record_kind(f) is not None:
            files.append(f)
    if (p / "state.json").is_file() and any(_record_kind(f) == ".arrow" for f in files):
        files = [f for f in files if _record_kind(f) == ".arrow"]
    files.sort(key=lambda f: f.relative_to(p).as_posix())
    if not files:
        raise DataError(f"{p}: directory holds no {'/'.join(RECORD_SUFFIXES)} files")
    return files


def _open_binary(path: Path) -> BinaryIO:
    _, comp = _strip_compression(path.name)
    if comp == ".gz":
        return gzip.open(path, "rb")
    if comp == ".zst":
        try:
            import zstandard  # type: ignore
        except ImportError:
            zstandard = None
        if zstandard is not None:
            # buffered like the other readers: line iteration and peeking need more than the raw stream gives
            return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True))
        try:  # pyarrow ships a zstd codec; use it when the `zstandard` package is absent
            return io.BufferedReader(_ArrowRaw(pa.CompressedInputStream(pa.OSFile(str(path), "rb"), "zstd")))
        except (pa.ArrowNotImplementedError, pa.ArrowInvalid) as exc:
            raise DataError(
                f"{path}: cannot read .zst: install the `zstandard` package (pip install zstandard) ({exc})"
            ) from None
    return open(path, "rb")


class _ArrowRaw(io.RawIOBase):
    """File-like view of a pyarrow input stream (line iteration, context manager)."""

    def __init__(self, stream):
        self._stream = stream

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        data = self._stream.read(len(b))
        b[: len(data)] = data
        return len(data)

    def close(self) -> None:
        self._stream.close()
        super().close()


def read_records(
    path: str | os.PathLike,
    *,
    strict: bool = True,
    counts: MutableMapping[str, int] | None = None,
    examples: list[str] | None = None,
    max_examples: int = MAX_EXAMPLES,
    split: str | None = None,
    subset: str | None = None,
    source: str | None = None,
) -> Iterator[tuple[Locator, dict]]:
    """Stream `(locator, record)` pairs from a source file or directory (`list_source_files`), or from a
    Hugging Face Hub dataset `hf:owner/name` (`split`, default `train`; `subset`) through `datasets`.

    Formats: `.jsonl`, `.json` (one array, parsed incrementally), `.parquet` and `.arrow` (in batches), each
    optionally `.gz` or `.zst`. Memory: one record or one batch of 1024 rows at a time plus a 1 MiB buffer.

    Args:
        source: the source's name in `datasets`, for the config key named in errors.
        strict: True raises on the first malformed record; False skips it and counts it in `counts`
            (`malformed_json`, `invalid_utf8`, `not_an_object`, `empty_file`).
        counts: receives skip counts (only with `strict=False`).
        examples: receives the first `max_examples` skip messages of each reason, in file order.

    Raises:
        DataError: naming file, line/record and what is wrong (invalid JSON or UTF-8, not an object, an empty
            or corrupt file). An invalid JSON array raises even with `strict=False` (no resynchronizing)."""
    if isinstance(path, str) and path.startswith(HF_PREFIX):
        yield from _read_hf_dataset(path[len(HF_PREFIX) :], split=split, subset=subset)
        return
    strict_key = f"`datasets.{source}.strict: false`" if source else "`strict: false` on the source"
    shown_per_reason: collections.Counter = collections.Counter()
    root = Path(path)
    files = list_source_files(root, split)
    for f in files:
        shown = str(f)
        kind = _record_kind(f)
        reader = {".jsonl": _read_jsonl, ".json": _read_json_array, ".parquet": _read_parquet, ".arrow": _read_arrow}[
            kind
        ]
        n = skips = 0
        try:
            items = reader(f, shown)
            for item in items:
                if isinstance(item, _Skip):
                    if strict:  # every malformed record of the file in one error, not one per rerun
                        raise DataError(_all_malformed(item, items, strict_key)) from None
                    skips += 1
                    _count_skip(item, counts, examples, max_examples, shown_per_reason)
                    continue
                n += 1
                yield item
            if n == 0 and skips == 0:
                raise _Skip("empty_file", f"{shown}: empty file (no records)")
        except _Skip as skip:
            if strict:
                raise DataError(f"{skip}; remove the file or set {strict_key}") from None
            _count_skip(skip, counts, examples, max_examples, shown_per_reason)
        except (OSError, EOFError, gzip.BadGzipFile, pa.ArrowException) as exc:
            raise DataError(f"{shown}: cannot read ({type(exc).__name__}: {exc})") from None


#: Malformed records listed in one strict-mode error (the rest are counted).
MAX_LISTED_MALFORMED = 20


def _all_malformed(first: "_Skip", rest, strict_key: str) -> str:
    """The strict-mode error for a file: `first` and every further malformed record of the file."""
    found = [str(first)]
    total = 1
    try:
        for item in rest:
            if isinstance(item, _Skip):
                total += 1
                if len(found) < MAX_LISTED_MALFORMED:
                    found.append(str(item))
    except DataError as exc:  # a JSON array cannot be read past a syntax error
        found.append(str(exc))
    if total == 1:
        return f"{first}; fix it or set {strict_key} to skip and count it"
    more = f"\n  ... and {total - len(found)} more" if total > len(found) else ""
    head = f"{total} malformed records" + (f" (first {len(found)} listed)" if more else "")
    return f"{head}; fix them or set {strict_key} to skip and count them:\n  " + "\n  ".join(found) + more


def _read_hf_dataset(dataset_id: str, *, split: str | None, subset: str | None):
    """Rows of a Hub dataset, streamed (`datasets.load_dataset(..., streaming=True)`): nothing is
    downloaded whole, and rows come in the dataset's own order."""
    shown = f"{HF_PREFIX}{dataset_id}"
    try:
        import datasets  # optional: pip install 'dflash-pipeline[datasets]'
    except ImportError:
        raise DataError(
            f"{shown}: Hugging Face dataset ids need the `datasets` package; install it (`pip install "
            "'dflash-pipeline[datasets]'`, it is in envs/data.yaml), or save the dataset with "
            "`save_to_disk(DIR)` on a machine that has it and set `path: DIR`"
        ) from None
    try:
        ds = datasets.load_dataset(dataset_id, subset, split=split or "train", streaming=True)
        rows = iter(ds)
        first = next(rows, None)
    except Exception as exc:  # noqa: BLE001 - offline, unknown id, missing split ...: one message naming the fix
        msg = " ".join(str(exc).split())[:300]
        raise DataError(
            f"{shown}: cannot load the Hugging Face dataset (split {split or 'train'!r}"
            + (f", subset {subset!r}" if subset else "")
            + f"): {type(exc).__name__}: {msg}. Without network "
            "access (HF_DATASETS_OFFLINE / HF_HUB_OFFLINE, or no route to the Hub) download it elsewhere with "
            "`datasets.load_dataset(...).save_to_disk(DIR)` and set `path: DIR`"
        ) from None
    if first is None:
        return
    yield Locator(shown, 0, None, "row"), dict(first)
    for index, row in enumerate(rows, start=1):
        yield Locator(shown, index, None, "row"), dict(row)


def _count_skip(skip: _Skip, counts, examples, max_examples, shown_per_reason: collections.Counter) -> None:
    if counts is not None:
        counts[skip.reason] = counts.get(skip.reason, 0) + 1
    if examples is not None and shown_per_reason[skip.reason] < max_examples:
        shown_per_reason[skip.reason] += 1
        examples.append(str(skip))
    log.warning("skipped %s", skip)


def _object(loc: Locator, rec):
    """`(loc, rec)` when the parsed record is a JSON object, else the `not_an_object` skip."""
    if not isinstance(rec, dict):
        return _Skip("not_an_object", f"{loc}: expected a JSON object, got {type(rec).__name__}")
    return loc, rec


def _read_jsonl(path: Path, shown: str):
    with _open_binary(path) as fh:
        index = 0
        for lineno, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            raw = raw.rstrip(b"\r\n")  # the terminator is not JSON text (an open string would report it)
            try:
                text = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                yield _Skip("invalid_utf8", f"{shown}: line {lineno}: invalid UTF-8 at byte {exc.start} of the line")
                index += 1
                continue
            loc = Locator(shown, index, lineno, "line")
            index += 1
            try:
                rec = json.loads(text)
            except json.JSONDecodeError as exc:
                yield _Skip(
                    "malformed_json", f"{loc}: invalid JSON ({exc.msg.removesuffix(' at')} at column {exc.colno})"
                )
                continue
            yield _object(loc, rec)


class _ArrayScanner:
    """Incremental scanner over one top-level JSON array in a binary file: reads `_READ_CHUNK` characters at a time,
    forgets consumed text, and keeps the 1-based line of each element."""

    def __init__(self, fh: BinaryIO, shown: str):
        self.fh, self.shown = fh, shown
        self.decoder = json.JSONDecoder()
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="surrogateescape")
        self.buf, self.pos, self.eof = "", 0, False
        self.mark, self.newlines = 0, 0  # newlines in the file before buf[mark]
        self.want = _READ_CHUNK

    def more(self) -> bool:
        """Append the next chunk; False at end of file."""
        if self.eof:
            return False
        data = self.fh.read(self.want)
        if not data:
            self.eof = True
        self.buf += self.utf8.decode(data or b"", final=not data)
        return True

    def skip_ws(self) -> bool:
        """Move past white space (reading on); False at end of file."""
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in " \t\r\n\ufeff":
                self.pos += 1
            if self.pos < len(self.buf):
                return True
            self.drop()
            if not self.more():
                return False

    def line_at(self, p: int) -> int:
        """1-based line of `buf[p]`, `p >= mark`."""
        self.newlines += self.buf.count("\n", self.mark, p)
        self.mark = p
        return self.newlines + 1

    def drop(self) -> None:
        """Forget consumed text (keeps line numbers right)."""
        self.line_at(self.pos)
        self.buf, self.pos, self.mark = self.buf[self.pos :], 0, 0

    def fail(self, msg: str):
        raise DataError(
            f"{self.shown}: line {self.line_at(self.pos)}: {msg} (a broken JSON array cannot be skipped even "
            f"with `strict: false`; fix it or convert the file to .jsonl)"
        )

    def open_array(self) -> None:
        """Move past the opening `[`. Raises _Skip (empty file) or DataError (not an array)."""
        if not self.skip_ws():
            raise _Skip("empty_file", f"{self.shown}: empty file")
        if self.buf[self.pos] != "[":
            self.fail(f"expected a JSON array '[' at the top level, got {self.buf[self.pos]!r}")
        self.pos += 1

    def next_element(self, index: int) -> tuple[Any, str, int] | None:
        """`(value, its raw text, its line)` of element `index`, or None after the closing `]`."""
        if not self.skip_ws():
            self.fail("unexpected end of file inside the array")
        if self.buf[self.pos] == "]":
            self.pos += 1
            return None
        if index > 0:
            if self.buf[self.pos] != ",":
                self.fail(f"expected ',' or ']' after record {index - 1}, got {self.buf[self.pos]!r}")
            self.pos += 1
            if not self.skip_ws():
                self.fail("unexpected end of file inside the array")
        if self.pos > _READ_CHUNK:
            self.drop()
        rec, end = self._decode(index)
        self.want = _READ_CHUNK
        line = self.line_at(self.pos)
        raw_text, self.pos = self.buf[self.pos : end], end
        return rec, raw_text, line

    def _decode(self, index: int) -> tuple[Any, int]:
        while True:
            try:
                rec, end = self.decoder.raw_decode(self.buf, self.pos)
                if end == len(self.buf) and not self.eof and not isinstance(rec, (dict, list, str)):
                    raise json.JSONDecodeError("number/literal may continue", self.buf, end)
                return rec, end
            except json.JSONDecodeError as exc:
                if not self.more():
                    self.pos = exc.pos
                    self.fail(f"invalid JSON in record {index} ({exc.msg})")
                self.want = min(self.want * 2, 1 << 28)

    def expect_end(self) -> None:
        """Nothing but white space may follow the closing `]`."""
        if self.skip_ws():
            self.fail(f"unexpected data after the closing ']': {self.buf[self.pos : self.pos + 20]!r}")


def _read_json_array(path: Path, shown: str):
    """Incremental parser for one top-level JSON array: one element in memory at a time."""
    with _open_binary(path) as fh:
        scan = _ArrayScanner(fh, shown)
        scan.open_array()
        index = 0
        while (element := scan.next_element(index)) is not None:
            rec, raw_text, line = element
            loc = Locator(shown, index, line, "record")
            index += 1
            if _SURROGATES.search(raw_text):
                yield _Skip("invalid_utf8", f"{loc}: invalid UTF-8 bytes")
                continue
            yield _object(loc, rec)
        scan.expect_end()


def _iter_batches(batches, shown: str):
    index = 0
    for batch in batches:
        for row in batch.to_pylist():
            yield Locator(shown, index, None, "row"), row
            index += 1


def _read_parquet(path: Path, shown: str):
    if _strip_compression(path.name)[1]:
        with _open_binary(path) as fh:
            data = fh.read()
        if not data:
            raise _Skip("empty_file", f"{shown}: empty file")
        source = pa.BufferReader(data)
    else:
        if path.stat().st_size == 0:
            raise _Skip("empty_file", f"{shown}: empty file")
        source = str(path)
    pf = pq.ParquetFile(source)
    yield from _iter_batches(pf.iter_batches(batch_size=1024), shown)


def _read_arrow(path: Path, shown: str):
    """Arrow IPC stream (what `datasets.save_to_disk` writes) or IPC file."""
    with _open_binary(path) as fh:
        data = fh.read()
    if not data:
        raise _Skip("empty_file", f"{shown}: empty file")
    try:
        reader = pa.ipc.open_stream(pa.BufferReader(data))
    except pa.ArrowInvalid:
        reader = pa.ipc.open_file(pa.BufferReader(data))
        yield from _iter_batches((reader.get_batch(i) for i in range(reader.num_record_batches)), shown)
        return
    yield from _iter_batches(reader, shown)
