"""Prompt stage: read prompt sources, normalize them to prompt records, dedup, sample and shard them.

Data flow (one source after the other, in config order, streaming; nothing holds a whole source)::

    read_records(path)          -> (Locator, raw dict)          .jsonl/.json/.parquet/.arrow, dirs, .gz/.zst,
                                                                saved datasets (+ DatasetDict split), hf: ids
    normalize_record(record)    -> [{role, content}]            system + user turns only
    filters                     -> kept or dropped with a reason (counted in the manifest, never silent)
    build_prompt_shards(...)    -> {out}/{dataset}/{NNNNN}.parquet + {out}/manifest.json

**Stable sharding.** Generation is the expensive step, so shard contents only ever depend on the records
*before* them in the source. Every keep decision is made per record, in source order:

* ``fraction`` (per source, default 1.0) keeps a record iff ``u(seed, prompt_id) < fraction`` where ``u`` is
  a uniform number in [0, 1) derived from sha256 of the seed and the prompt id. The decision depends on
  that record alone, so appending records never changes which earlier records were kept.
* ``max_prompts`` then keeps the *first* ``max_prompts`` surviving records in source order (reading stops
  there). A random "N of the whole file" sample would change whenever the file grows; a prefix of a
  hash-thinned stream does not. For a random subset of a fixed file set ``fraction`` a bit above
  ``N / records`` and ``max_prompts: N``.
* Dedup is by :func:`contracts.prompt_id` across sources; the first source in config order wins. Adding a
  new source *at the end* of ``datasets`` therefore never changes existing shards; inserting one earlier,
  or appending records to an earlier source that duplicate a later source's prompts, can shift the later
  source's shards (its ``duplicate`` count in the manifest shows it).

Shard ``i`` of a source holds its kept records ``[i * shard_size, (i + 1) * shard_size)``; appending
records leaves every full shard byte-identical, only the last partial shard grows. A shard file whose
*content* (rows and ``dflash`` metadata) equals what would be written is not touched, so its mtime stays
and downstream Snakemake jobs stay valid — even across pyarrow upgrades that change the file bytes.
Shards are never deleted: those of a source that shrank (beyond its new shard count) or left the config stay
on disk, unlisted in the manifest's ``shards`` (all that downstream reads) and recorded as inactive, so when
the source grows back or returns, identical shards are not rewritten and their completions stay valid.

**Language filter** (off unless ``prompts.languages`` or a source's ``languages`` is set): the first
:data:`LANGUAGE_SAMPLE_CHARS` characters of the prompt's user turns joined by newlines (system turns are
not read) are classified with `py3langid` (an offline naive-Bayes model bundled in its wheel); the prompt
is kept iff the top language is in the allow-list and its probability is at least
``min_language_confidence``. The decision depends on the record alone (stable like ``fraction``) and is
deterministic for a given py3langid install; only the decision, never the score, reaches the shards.

Drop reasons counted per source in the manifest: ``malformed_json``, ``invalid_utf8``, ``not_an_object``,
``empty_file``, ``wrong_type`` (the last five only with ``strict: false``; otherwise they raise
:class:`DataError`), ``empty``, ``starts_with_assistant``, ``multimodal``, ``unsupported_role``,
``no_prompt_field``, ``sampled_out``, ``duplicate``, ``language`` (top language not allowed),
``low_language_confidence`` (allowed, but below ``min_language_confidence``), ``too_long``; with a
language filter, ``dropped_languages`` breaks both language reasons down by detected language. For every
reason from ``malformed_json`` to ``no_prompt_field`` (bad or rejected records), the manifest's
``skipped_examples`` lists the first :data:`MAX_EXAMPLES` records (file, line/record/row, why). A ``strict``
source none of whose records has a prompt field (``no_prompt_field`` for every record: a wrong field name or
``mapping``) is an error; a source that keeps no prompt is logged as a warning.
"""

from __future__ import annotations

import codecs
import collections
import gzip
import hashlib
import io
import json
import logging
import os
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Iterator, Mapping, MutableMapping, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from . import shards
from .contracts import PROMPT_SCHEMA, PROMPT_SCHEMA_VERSION, prompt_id
from .errors import ConfigError, DataError

log = logging.getLogger(__name__)

MANIFEST_SCHEMA_VERSION = 1
#: File suffixes read as records (after removing a ``.gz``/``.zst`` compression suffix).
RECORD_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow")
COMPRESSION_SUFFIXES = (".gz", ".zst")
#: Record formats understood by :func:`normalize_record` (``auto`` detects per record).
FORMATS = ("auto", "sharegpt", "openai", "alpaca", "prompt", "mt_bench")
#: Extra formats only :func:`load_eval_prompts` understands (the DFlash authors' eval prompt formats).
EVAL_FORMATS = FORMATS + ("gsm8k", "humaneval")

#: DFlash eval prompt formats (reference/dflash.md §7.2).
GSM8K_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL_TEMPLATE = (
    "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{prompt}\n```"
)
#: Separator between an Alpaca instruction and its non-empty input (as the DFlash authors' alpaca eval).
ALPACA_INPUT_SEPARATOR = "\n\nInput:\n"

#: Source role names -> normalized role (ShareGPT ``from`` and OpenAI ``role`` values, lower-cased).
ROLE_ALIASES = {
    "system": "system",
    "developer": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
    "bot": "assistant",
}
#: Canonical field names a per-source ``mapping`` may redirect to other source fields.
MAPPABLE_FIELDS = (
    "conversations", "messages", "turns", "instruction", "input", "prompt", "question", "problem",
    "system", "from", "value", "role", "content",
)
_SHARD_RE = re.compile(r"^(\d{5})\.parquet$")
_SURROGATES = re.compile("[\udc80-\udcff]")
_READ_CHUNK = 1 << 20  # bytes per read of a JSON array
#: ``path`` prefix of a Hugging Face Hub dataset id (read through the optional `datasets` library).
HF_PREFIX = "hf:"
#: Examples per drop reason kept in the manifest's ``skipped_examples`` (malformed and rejected records).
MAX_EXAMPLES = 5
#: Stands for an absent field in type checks (an absent field is reported as missing, not as null).
_MISSING = object()


# --------------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Locator:
    """Where a record came from: ``file`` (as given/found), 1-based ``line`` (jsonl; JSON arrays: the line
    the record starts on) and 0-based ``index`` (record/row number within the file)."""

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


class RejectedRecord(DataError):
    """A well-formed record that the prompt policy rejects (``reason`` is the manifest's drop reason).

    :func:`build_prompt_shards` counts these instead of failing, whatever ``strict`` says.
    """

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class MissingField(DataError):
    """A field the record's format needs is absent (the message names the field and the fields present)."""


def _type_error(where: str, value: Any, expected: str, container: Mapping[str, Any] | None = None,
                what: str = "record") -> DataError:
    """The error for field ``where`` holding ``value`` instead of ``expected``: :class:`MissingField`
    when ``value`` is :data:`_MISSING` (listing the fields ``container``, a ``what``, does have)."""
    if value is _MISSING:
        have = f" (the {what} has fields {sorted(map(str, container))[:20]})" if container is not None else ""
        return MissingField(f"field `{where}` is missing{have}; expected {expected}")
    return DataError(f"field `{where}`: expected {expected}, got {'null' if value is None else type(value).__name__}")


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
    """Files of a source, in the order they are read.

    A file is returned as is. A directory yields every supported file below it (recursively, hidden
    files and folders skipped) sorted by relative POSIX path, so ``part-00010`` after ``part-00009`` with
    zero-padded names. A Hugging Face ``save_to_disk`` directory (``state.json`` + ``*.arrow``) yields only
    its ``.arrow`` files (read with pyarrow: no `datasets` install needed). A saved ``DatasetDict``
    (``dataset_dict.json`` + one directory per split) yields the files of ``split`` (default ``train``,
    or its only split).

    Raises:
        DataError: the path does not exist, has an unsupported suffix, the directory holds no supported
            file, or a DatasetDict has no such split (the message lists its splits).
        ConfigError: ``split`` given for a source that is not a saved DatasetDict.
    """
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
            return zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True)
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
    """Stream ``(locator, record)`` pairs from a source file or directory (see :func:`list_source_files`),
    or from a Hugging Face Hub dataset id ``hf:owner/name`` (``split``, default ``train``; ``subset`` = the
    dataset's config name) streamed through the optional `datasets` library.

    Formats: ``.jsonl`` (one JSON object a line; blank lines ignored), ``.json`` (one JSON array of
    objects, parsed incrementally), ``.parquet`` and ``.arrow`` (rows as dicts, read in batches), each
    optionally ``.gz`` or ``.zst`` compressed (``.zst`` through the ``zstandard`` package, or pyarrow's
    zstd codec when that is missing). Memory: one record (JSON) or one batch of 1024 rows (Parquet/Arrow)
    at a time plus a 1 MiB read buffer.

    Args:
        source: the source's name in ``datasets``, for the config key named in errors.
        strict: True raises on the first malformed record; False skips it and counts it in ``counts``
            under ``malformed_json``, ``invalid_utf8``, ``not_an_object`` or ``empty_file``.
        counts: receives skip counts (only with ``strict=False``).
        examples: receives the first ``max_examples`` skip messages of each reason (appended, in file order).

    Raises:
        DataError: naming file, line/record and what is wrong: invalid JSON, invalid UTF-8, a record that
            is not an object, an empty file, an unreadable/corrupt file. A JSON array that is not valid
            JSON raises even with ``strict=False`` (it cannot be resynchronized; fix or convert to jsonl).
    """
    if isinstance(path, str) and path.startswith(HF_PREFIX):
        yield from _read_hf_dataset(path[len(HF_PREFIX):], split=split, subset=subset)
        return
    strict_key = f"`datasets.{source}.strict: false`" if source else "`strict: false` on the source"
    shown_per_reason: collections.Counter = collections.Counter()
    root = Path(path)
    files = list_source_files(root, split)
    for f in files:
        shown = str(f)
        kind = _record_kind(f)
        reader = {".jsonl": _read_jsonl, ".json": _read_json_array, ".parquet": _read_parquet, ".arrow": _read_arrow}[kind]
        n = skips = 0
        try:
            for item in reader(f, shown):
                if isinstance(item, _Skip):
                    if strict:
                        raise DataError(f"{item}; fix it or set {strict_key} to skip and count it")
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


def _read_hf_dataset(dataset_id: str, *, split: str | None, subset: str | None):
    """Rows of a Hub dataset, streamed (``datasets.load_dataset(..., streaming=True)``): nothing is
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
            + (f", subset {subset!r}" if subset else "") + f"): {type(exc).__name__}: {msg}. Without network "
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
                yield _Skip("malformed_json", f"{loc}: invalid JSON ({exc.msg.removesuffix(' at')} at column {exc.colno})")
                continue
            if not isinstance(rec, dict):
                yield _Skip("not_an_object", f"{loc}: expected a JSON object, got {type(rec).__name__}")
                continue
            yield loc, rec


def _read_json_array(path: Path, shown: str):
    """Incremental parser for one top-level JSON array: one element in memory at a time."""
    decoder = json.JSONDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="surrogateescape")
    with _open_binary(path) as fh:
        buf, pos, eof = "", 0, False
        mark, newlines = 0, 0  # newlines in the file before buf[mark]
        want = _READ_CHUNK

        def more() -> bool:  # append the next chunk; False at end of file
            nonlocal buf, eof
            if eof:
                return False
            data = fh.read(want)
            if not data:
                eof = True
            buf += utf8.decode(data or b"", final=not data)
            return True

        def skip_ws() -> bool:
            nonlocal pos
            while True:
                while pos < len(buf) and buf[pos] in " \t\r\n\ufeff":
                    pos += 1
                if pos < len(buf):
                    return True
                drop()
                if not more():
                    return False

        def line_at(p: int) -> int:  # 1-based line of buf[p], p >= mark; counts each char once
            nonlocal mark, newlines
            newlines += buf.count("\n", mark, p)
            mark = p
            return newlines + 1

        def drop() -> None:  # forget consumed text (keeps line numbers right)
            nonlocal buf, pos, mark
            line_at(pos)
            buf, pos, mark = buf[pos:], 0, 0

        def fail(msg: str):
            line = line_at(pos)
            raise DataError(
                f"{shown}: line {line}: {msg} (a broken JSON array cannot be skipped even with `strict: false`;"
                " fix it or convert the file to .jsonl)"
            )

        if not skip_ws():
            raise _Skip("empty_file", f"{shown}: empty file")
        if buf[pos] != "[":
            fail(f"expected a JSON array '[' at the top level, got {buf[pos]!r}")
        pos += 1
        index = 0
        while True:
            if not skip_ws():
                fail("unexpected end of file inside the array")
            if buf[pos] == "]":
                pos += 1
                break
            if index > 0:
                if buf[pos] != ",":
                    fail(f"expected ',' or ']' after record {index - 1}, got {buf[pos]!r}")
                pos += 1
                if not skip_ws():
                    fail("unexpected end of file inside the array")
            if pos > _READ_CHUNK:
                drop()
            while True:
                try:
                    rec, end = decoder.raw_decode(buf, pos)
                    if end == len(buf) and not eof and not isinstance(rec, (dict, list, str)):
                        raise json.JSONDecodeError("number/literal may continue", buf, end)
                    break
                except json.JSONDecodeError as exc:
                    if not more():
                        pos = exc.pos
                        fail(f"invalid JSON in record {index} ({exc.msg})")
                    want = min(want * 2, 1 << 28)
            want = _READ_CHUNK
            line = line_at(pos)
            raw_text = buf[pos:end]
            pos = end
            loc = Locator(shown, index, line, "record")
            index += 1
            if _SURROGATES.search(raw_text):
                yield _Skip("invalid_utf8", f"{loc}: invalid UTF-8 bytes")
                continue
            if not isinstance(rec, dict):
                yield _Skip("not_an_object", f"{loc}: expected a JSON object, got {type(rec).__name__}")
                continue
            yield loc, rec
        if skip_ws():
            fail(f"unexpected data after the closing ']': {buf[pos:pos + 20]!r}")


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
    """Arrow IPC stream (what ``datasets.save_to_disk`` writes) or IPC file."""
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


# --------------------------------------------------------------------------------------------------
# Normalization
# --------------------------------------------------------------------------------------------------


def _field(mapping: Mapping[str, str] | None, name: str) -> str:
    return (mapping or {}).get(name, name)


def detect_format(record: Mapping[str, Any], mapping: Mapping[str, str] | None = None) -> str:
    """Record shape by its fields, first match wins: ``conversations`` -> sharegpt, ``messages`` -> openai,
    ``turns`` -> mt_bench, ``instruction`` -> alpaca, ``prompt``/``question``/``problem`` -> prompt.

    Raises:
        RejectedRecord: ``no_prompt_field`` when none of them is present (set ``format``/``mapping``).
    """
    for name, fmt in (
        ("conversations", "sharegpt"),
        ("messages", "openai"),
        ("turns", "mt_bench"),
        ("instruction", "alpaca"),
        ("prompt", "prompt"),
        ("question", "prompt"),
        ("problem", "prompt"),
    ):
        if _field(mapping, name) in record:
            return fmt
    raise RejectedRecord(
        "no_prompt_field",
        f"none of the fields conversations/messages/turns/instruction/prompt/question/problem is present "
        f"(fields: {sorted(record)[:10]}); set the source's `format` and `mapping`",
    )


def _consumed_fields(record: Mapping[str, Any], fmt: str, mapping) -> set[str]:
    names = {"sharegpt": ["conversations"], "openai": ["messages"], "mt_bench": ["turns"],
             "alpaca": ["instruction", "input"]}.get(fmt)
    if names is None:  # prompt
        names = [next(n for n in ("prompt", "question", "problem") if _field(mapping, n) in record)]
    return {_field(mapping, n) for n in names + ["system"]}


def _text_content(value: Any, where: str) -> str:
    """Content of one message as a string; OpenAI text-part lists are concatenated without separator
    (what chat templates such as Qwen3's do with them)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for i, part in enumerate(value):
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                ptype = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RejectedRecord("multimodal", f"`{where}[{i}]` is a {ptype!r} part (only text is supported)")
        return "".join(parts)
    if isinstance(value, dict):
        raise RejectedRecord("multimodal", f"`{where}` is an object ({sorted(value)[:5]}), not text")
    raise _type_error(where, value, "a string")


def _chat_messages(turns: Any, list_field: str, role_key: str, content_key: str, role_map,
                   record: Mapping[str, Any]) -> list[dict]:
    if not isinstance(turns, list):
        raise _type_error(list_field, turns, "a list of messages", record)
    out: list[dict] = []
    seen_user = False
    for i, msg in enumerate(turns):
        where = f"{list_field}[{i}]"
        if not isinstance(msg, dict):
            raise DataError(f"field `{where}`: expected an object with `{role_key}`/`{content_key}`, got {type(msg).__name__}")
        raw_role = msg.get(role_key, _MISSING)
        if not isinstance(raw_role, str):
            raise _type_error(f"{where}.{role_key}", raw_role, "a role string", msg, "message")
        role = role_map.get(raw_role, ROLE_ALIASES.get(raw_role.lower()))
        if role is None:
            raise RejectedRecord("unsupported_role", f"`{where}.{role_key}` is {raw_role!r} (tool/function turns "
                                 "cannot be regenerated from user turns; map it with `mapping.roles`)")
        if role == "assistant":
            if not seen_user:
                raise RejectedRecord("starts_with_assistant", f"`{where}` is an assistant turn before any user turn")
            continue  # regenerated by the target
        if content_key not in msg:
            raise _type_error(f"{where}.{content_key}", _MISSING, "a string", msg, "message")
        content = _text_content(msg[content_key], f"{where}.{content_key}")
        if role == "system" and not content.strip():
            continue  # an empty system slot carries nothing the user wrote
        seen_user = seen_user or role == "user"
        out.append({"role": role, "content": content})
    return out


def normalize_record(
    record: Mapping[str, Any], *, fmt: str = "auto", mapping: Mapping[str, Any] | None = None
) -> list[dict]:
    """Normalize one source record to prompt messages ``[{role, content}]`` (system and user turns only).

    Formats (``fmt``; ``auto`` uses :func:`detect_format`):
        * ``sharegpt``: ``conversations`` of ``{from, value}`` (``human``/``gpt``/``system`` and aliases;
          ``{role, content}`` items are accepted too).
        * ``openai``: ``messages`` of ``{role, content}``; ``content`` may be a list of text parts.
        * ``mt_bench``: ``turns``, a list of user strings.
        * ``alpaca``: ``instruction`` plus, when non-empty, ``"\\n\\nInput:\\n" + input``.
        * ``prompt``: one user turn from ``prompt``, ``question`` or ``problem`` (first present);
          a ``prompt`` that is a list of messages is read as ``openai``.
        A top-level ``system`` string becomes a leading system message in every format.

    ``mapping`` redirects canonical field names to the source's (e.g. ``{"prompt": "query"}``, or
    ``{"messages": "dialog", "role": "speaker", "content": "text"}``); ``mapping["roles"]`` maps source role
    values to ``system``/``user``/``assistant``. Text is never stripped or rewritten; assistant turns are
    dropped (the target regenerates them); empty system messages are dropped.

    Raises:
        RejectedRecord: policy drops, with ``.reason``: ``empty`` (no user turn, or a blank user turn),
            ``starts_with_assistant``, ``multimodal`` (a non-text content part, an image field),
            ``unsupported_role`` (tool/function/unknown roles), ``no_prompt_field``.
        DataError: a field has the wrong type (message names the field, e.g. ``conversations[2].value``);
            :class:`MissingField` when a field the format needs is absent (names it and the fields present).
    """
    return _normalize(record, fmt, mapping)[0]


def _normalize(record: Mapping[str, Any], fmt: str, mapping: Mapping[str, Any] | None) -> tuple[list[dict], str]:
    """:func:`normalize_record` that also returns the format used (after ``auto`` detection)."""
    if fmt not in FORMATS:
        raise ConfigError(f"unknown prompt format {fmt!r}; use one of {FORMATS}")
    mapping = dict(mapping or {})
    role_map = {k: v for k, v in (mapping.pop("roles", None) or {}).items()}
    if fmt == "auto":
        fmt = detect_format(record, mapping)
    for key in ("image", "images", "audio", "video"):
        if record.get(key):
            raise RejectedRecord("multimodal", f"record has a non-empty `{key}` field")

    if fmt == "sharegpt":
        name = _field(mapping, "conversations")
        conv = record.get(name, _MISSING)
        role_key, content_key = _field(mapping, "from"), _field(mapping, "value")
        if isinstance(conv, list) and conv and isinstance(conv[0], dict) and role_key not in conv[0] and "role" in conv[0]:
            role_key, content_key = "role", "content"
        messages = _chat_messages(conv, name, role_key, content_key, role_map, record)
    elif fmt == "openai" or (fmt == "prompt" and isinstance(record.get(_field(mapping, "prompt")), list)):
        name = _field(mapping, "messages") if fmt == "openai" else _field(mapping, "prompt")
        messages = _chat_messages(record.get(name, _MISSING), name, _field(mapping, "role"), _field(mapping, "content"),
                                  role_map, record)
    elif fmt == "mt_bench":
        name = _field(mapping, "turns")
        turns = record.get(name, _MISSING)
        if not isinstance(turns, list):
            raise _type_error(name, turns, "a list of user strings", record)
        messages = [{"role": "user", "content": _text_content(t, f"{name}[{i}]")} for i, t in enumerate(turns)]
    elif fmt == "alpaca":
        iname, xname = _field(mapping, "instruction"), _field(mapping, "input")
        instruction = record.get(iname, _MISSING)
        if not isinstance(instruction, str):
            raise _type_error(iname, instruction, "a string", record)
        extra = record.get(xname)
        if extra is not None and not isinstance(extra, str):
            raise _type_error(xname, extra, "a string")
        text = instruction + (ALPACA_INPUT_SEPARATOR + extra if extra and extra.strip() else "")
        messages = [{"role": "user", "content": text}]
    else:  # prompt
        for candidate in ("prompt", "question", "problem"):
            name = _field(mapping, candidate)
            if name in record:
                break
        else:
            raise RejectedRecord("no_prompt_field", "none of prompt/question/problem is present; set `mapping`")
        messages = [{"role": "user", "content": _text_content(record[name], name)}]

    sname = _field(mapping, "system")
    system = record.get(sname)
    if system is not None and fmt in ("alpaca", "prompt", "mt_bench", "sharegpt", "openai"):
        if not isinstance(system, str):
            raise _type_error(sname, system, "a string")
        if system.strip() and not any(m["role"] == "system" for m in messages):
            messages.insert(0, {"role": "system", "content": system})

    users = [m for m in messages if m["role"] == "user"]
    if not users:
        raise RejectedRecord("empty", "no user turn")
    for i, m in enumerate(users):
        if not m["content"].strip():
            raise RejectedRecord("empty", f"user turn {i} is blank")
    return messages, fmt


def record_metadata(record: Mapping[str, Any], fmt: str, mapping: Mapping[str, Any] | None, source: dict) -> str:
    """JSON string of the record's fields that did not become messages, plus ``_source`` (file relative to
    the source path, and line/record/row number). Deterministic (sorted keys); non-JSON values via str()."""
    mapping = {k: v for k, v in (mapping or {}).items() if k != "roles"}
    if fmt == "auto":
        fmt = detect_format(record, mapping)
    consumed = _consumed_fields(record, fmt, mapping)
    meta = {k: v for k, v in record.items() if k not in consumed}
    meta["_source"] = source
    return json.dumps(meta, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


# --------------------------------------------------------------------------------------------------
# Language filter
# --------------------------------------------------------------------------------------------------

#: Characters of a prompt's user text that the language filter classifies (see :func:`language_sample`).
#: py3langid walks the UTF-8 bytes one by one in Python (~0.4 ms for 500 English characters on the 2-core
#: dev machine), so the sample is bounded; 500 characters identify a language reliably.
LANGUAGE_SAMPLE_CHARS = 500
#: Labels the model bundled with py3langid 0.4 returns: ISO 639-1 where one exists, else ISO 639-3
#: (e.g. ``yue``), and ``zxx`` (no linguistic content). ``languages`` entries are checked against this
#: list at config time, without loading the model.
LANGUAGE_CODES = frozenset(
    "ace af am an ar ary arz as az ba bcl be bg bn br bs ca crh cs cy da de dz el en eo es et eu ext fa fi fo "
    "fr fuv fy ga gcf gcr gd gl gom grc gu gug guw ha hbo he hi hr ht hu hy id ig is it ja jv ka kab kik kk km "
    "kn ko ku ky la lb lg lij ln lo lt ltg lv mg mk ml mn mr ms mt my ne nl nn no nso oc om or pa pcm pl ps pt "
    "qu ro ru rw sa sdh se si sk sl sn so sq sr st sv sw ta te tg th tk tl tr tt ug uk ur uz uzs vec vi vo wa "
    "wuu xh yo yue zh zu zxx".split()
)
#: How to install the language filter's dependency (named in errors).
LANGUAGE_INSTALL = "pip install 'dflash-pipeline[lang]' (or: pip install 'py3langid>=0.4')"
#: ``datasets.<name>.languages`` value that turns off a language filter set in ``prompts.languages``.
ANY_LANGUAGE = "any"

_LANGUAGE_IDENTIFIER = None  # loaded once per process (~1 s), only when a language filter is configured


def language_sample(messages: Sequence[Mapping[str, str]]) -> str:
    """The text the language filter classifies: the user turns' contents joined by newlines, cut to the
    first :data:`LANGUAGE_SAMPLE_CHARS` characters (system turns are often boilerplate in another
    language than the user's, so they are left out)."""
    return "\n".join(m["content"] for m in messages if m["role"] == "user")[:LANGUAGE_SAMPLE_CHARS]


def _language_identifier(key: str):
    """The py3langid identifier (probabilities normalized, all languages), loaded on first use.

    Raises:
        ConfigError: py3langid is not installed (names ``key`` and the install command).
    """
    global _LANGUAGE_IDENTIFIER
    if _LANGUAGE_IDENTIFIER is None:
        try:
            from py3langid.langid import MODEL_FILE, LanguageIdentifier
        except ImportError:
            raise ConfigError(f"{key} needs the `py3langid` package for language identification: {LANGUAGE_INSTALL}") from None
        # an identifier of our own: py3langid's module-level one can be restricted by other code (set_languages)
        _LANGUAGE_IDENTIFIER = LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)
    return _LANGUAGE_IDENTIFIER


def _language_detector() -> str:
    """``"py3langid <version>"``, recorded in the manifest (the model ships in the wheel: version = model)."""
    import importlib.metadata

    try:
        return f"py3langid {importlib.metadata.version('py3langid')}"
    except importlib.metadata.PackageNotFoundError:
        return "py3langid"


def detect_language(text: str, *, key: str = "prompts.languages") -> tuple[str, float]:
    """Most likely language of ``text`` and its probability in [0, 1], by py3langid's bundled model
    (e.g. ``("fr", 0.99)``; text without letters tends to ``zxx``). Deterministic for a given install.

    Args:
        key: config key named in the error when py3langid is missing.

    Raises:
        ConfigError: py3langid is not installed.
    """
    lang, prob = _language_identifier(key).classify(text)
    return lang, prob


def language_problems(prompts_cfg: Mapping[str, Any], datasets: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Problems with the language-filter settings, each naming its config key (empty when fine): unknown
    language codes (not in :data:`LANGUAGE_CODES`), an empty list, a confidence outside [0, 1], or a
    source's ``min_language_confidence`` with no language filter applying to that source. Does not need
    py3langid, so the Snakefile checks this at planning time."""
    problems: list[str] = []

    def check_codes(key: str, value: Any, allow_any: bool) -> None:
        if value is None or (allow_any and value == ANY_LANGUAGE):
            return
        if isinstance(value, str) or not isinstance(value, Sequence) or not value:
            problems.append(f"{key}: expected a non-empty list of language codes such as [en, zh]"
                            + (f" (or `{ANY_LANGUAGE}` for no filter on this source)" if allow_any else "")
                            + f", got {value!r}")
            return
        unknown = [c for c in value if c not in LANGUAGE_CODES]
        if unknown:
            problems.append(f"{key}: unknown language code(s) {unknown}; py3langid knows ISO 639-1 codes such as "
                            f"en, zh, fr, de, es, ja, ru (full list: dflash_pipeline.prompts.LANGUAGE_CODES)")

    def check_conf(key: str, value: Any) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1):
            problems.append(f"{key}: expected a probability in [0, 1], got {value!r}")

    check_codes("prompts.languages", prompts_cfg.get("languages"), allow_any=False)
    check_conf("prompts.min_language_confidence", prompts_cfg.get("min_language_confidence"))
    for name, src in datasets.items():
        check_codes(f"datasets.{name}.languages", src.get("languages"), allow_any=True)
        check_conf(f"datasets.{name}.min_language_confidence", src.get("min_language_confidence"))
        if src.get("min_language_confidence") is not None and _source_languages(prompts_cfg.get("languages"), name, src)[0] is None:
            problems.append(f"datasets.{name}.min_language_confidence: set, but no language filter applies to this "
                            f"source (set `datasets.{name}.languages` or `prompts.languages`)")
    return problems


def _source_languages(default: Sequence[str] | None, name: str, src: Mapping[str, Any]) -> tuple[list[str] | None, str]:
    """(effective allow-list of source ``name`` or None for no filter, the config key it comes from)."""
    own = src.get("languages")
    if own == ANY_LANGUAGE:
        return None, f"datasets.{name}.languages"
    if own is not None:
        return list(own), f"datasets.{name}.languages"
    return (list(default) if default else None), "prompts.languages"


# --------------------------------------------------------------------------------------------------
# Sharding
# --------------------------------------------------------------------------------------------------


def keep_score(seed: int, pid: str) -> float:
    """Uniform number in [0, 1) for the per-record ``fraction`` decision: sha256 of ``"{seed}:{pid}"``."""
    digest = hashlib.sha256(f"{seed}:{pid}".encode("ascii")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def _count_tokens(tokenizer, messages: Sequence[dict]) -> int:
    total = 0
    for m in messages:
        try:
            ids = tokenizer.encode(m["content"], add_special_tokens=False)
        except TypeError:
            ids = tokenizer.encode(m["content"])
        total += len(ids)
    return total


def shard_name(index: int) -> str:
    """File stem of shard ``index`` (``00000``)."""
    return f"{index:05d}"


def _write_shard(path: Path, rows: list[dict], meta: dict) -> bool:
    """Write a shard unless an existing file already holds the same rows and metadata (mtime kept)."""
    table = shards.table_from_records(rows, PROMPT_SCHEMA)
    if path.is_file():
        try:
            old = pq.read_table(path)
            if old.schema.remove_metadata().equals(PROMPT_SCHEMA) and old.equals(table) \
                    and shards.read_shard_metadata(path) == meta:
                return False
        except pa.ArrowException:
            pass  # unreadable: rewrite
    return shards.write_parquet(path, table, metadata=meta)


def _inactive_shards(ds_dir: Path, active: int) -> list[str]:
    """Names (``00003``) of the shard files in ``ds_dir`` numbered ``active`` or above: shards no longer in
    the mix. They are never deleted: their completions stay valid if the shards come back unchanged."""
    if not ds_dir.is_dir():
        return []
    return sorted(m.group(1) for f in ds_dir.iterdir() if (m := _SHARD_RE.match(f.name)) and int(m.group(1)) >= active)


_LEFT_ON_DISK = "no longer in the mix; left on disk so their completions stay valid if they come back"


def _source_ref(root: Path, loc: Locator, rel_cache: dict[str, str]) -> dict:
    rel = rel_cache.get(loc.file)
    if rel is None:
        if loc.file.startswith(HF_PREFIX) or root.is_file():
            rel = ""
        else:
            try:
                rel = Path(loc.file).relative_to(root).as_posix()
            except ValueError:  # a DatasetDict split's files
                rel = Path(loc.file).as_posix()
        rel_cache[loc.file] = rel
    ref: dict[str, Any] = {"file": rel}
    if loc.kind == "line":
        ref["line"] = loc.line
    else:
        ref[loc.kind] = loc.index
    return ref


def build_prompt_shards(
    datasets: Mapping[str, Mapping[str, Any]],
    out_dir: str | os.PathLike,
    *,
    shard_size: int,
    seed: int,
    tokenizer=None,
    max_prompt_tokens: int | None = None,
    languages: Sequence[str] | None = None,
    min_language_confidence: float = 0.0,
    manifest_path: str | os.PathLike | None = None,
) -> dict:
    """Normalize, filter, dedup and shard every prompt source; write shards and the manifest.

    Args:
        datasets: validated ``config["datasets"]``: name -> ``{path, format, max_prompts, fraction, strict,
            mapping, languages, min_language_confidence}`` (missing optional keys take the schema defaults).
            Processed in mapping order. A source's ``languages`` (a list, or ``"any"`` for no filter) and
            ``min_language_confidence`` override the two arguments below when not None.
        out_dir: shards go to ``{out_dir}/{name}/{NNNNN}.parquet`` (schema :data:`contracts.PROMPT_SCHEMA`,
            ``dflash`` metadata ``{schema_version, dataset, shard}``).
        shard_size: prompts per shard (the last shard of a source may be smaller).
        seed: seed of the per-record ``fraction`` decision (see module docstring).
        tokenizer: object with ``encode(text, add_special_tokens=False)``; needed when ``max_prompt_tokens``
            is set. Length = sum of the message contents' token counts (no chat template scaffolding).
        max_prompt_tokens: drop prompts longer than this (counted as ``too_long``).
        languages: language allow-list (py3langid codes, :data:`LANGUAGE_CODES`) for every source; None =
            no language filter. See the module docstring for what is classified.
        min_language_confidence: with a language filter, also drop prompts whose top language has a lower
            probability than this (counted as ``low_language_confidence``).
        manifest_path: default ``{out_dir}/manifest.json``.

    Returns:
        The manifest (also written, key-sorted JSON): ``{schema_version, seed, shard_size,
        max_prompt_tokens, languages, min_language_confidence, language_detector, total_prompts,
        datasets: {name: {config, read, kept, dropped: {reason: n}, skipped_examples, stopped_at_max_prompts,
        shards: [{name, path, rows, first_prompt_id, last_prompt_id}], inactive_shards: [name]}},
        inactive_datasets: {name: [shard name]}}``; shard ``path`` is relative to ``out_dir``.
        ``skipped_examples`` holds up to :data:`MAX_EXAMPLES` located messages per drop reason (malformed
        and rejected records, in file order). ``inactive_shards`` are shard files of the source beyond its
        current shard count, ``inactive_datasets`` the shard files of sources no longer in ``datasets``:
        on disk, not in any ``shards`` list. A source with a language filter also has ``config.languages``,
        ``config.min_language_confidence`` and ``dropped_languages: {detected language: n}``;
        ``language_detector`` is ``"py3langid <version>"`` when any source used it, else None.

    Side effects: shard files whose content is unchanged are not rewritten (mtime kept); no shard file is
    ever deleted (inactive ones are listed, logged at INFO). A source that keeps no prompt is logged as a
    WARNING with its drop counts.

    Raises:
        DataError: malformed input in a ``strict`` source (names file, line/record and field), a ``strict``
            source none of whose records has a prompt field (names the source, its file, the first record's
            fields and the fix), or no prompt kept at all.
        ConfigError: bad ``shard_size``/``fraction``/``format``, ``max_prompt_tokens`` without tokenizer,
            bad language settings (every problem, by config key: :func:`language_problems`), or a language
            filter without py3langid installed — all raised before any source is read.
    """
    if shard_size < 1:
        raise ConfigError(f"prompts.shard_size must be >= 1, got {shard_size}")
    if max_prompt_tokens is not None and tokenizer is None:
        raise ConfigError("prompts.max_prompt_tokens is set but no tokenizer was given (the probe's target tokenizer)")
    problems = language_problems({"languages": languages, "min_language_confidence": min_language_confidence}, datasets)
    if problems:
        raise ConfigError("language filter: " + "; ".join(problems))
    lang_filters: dict[str, tuple[frozenset, float] | None] = {}
    identifier = None
    for name, raw_cfg in datasets.items():
        allowed, lang_key = _source_languages(languages, name, raw_cfg)
        if allowed is None:
            lang_filters[name] = None
            continue
        identifier = identifier or _language_identifier(lang_key)
        missing = sorted(set(allowed) - set(identifier.labels))
        if missing:  # a py3langid whose model differs from LANGUAGE_CODES
            raise ConfigError(f"{lang_key}: the installed py3langid model does not know {missing}")
        own_conf = raw_cfg.get("min_language_confidence")
        lang_filters[name] = (frozenset(allowed), float(min_language_confidence if own_conf is None else own_conf))
    out = Path(out_dir)
    manifest_file = Path(manifest_path) if manifest_path is not None else out / "manifest.json"

    seen: set[str] = set()
    ds_out: dict[str, dict] = {}
    total = 0
    for name, raw_cfg in datasets.items():
        cfg = {"format": "auto", "max_prompts": None, "fraction": 1.0, "strict": True, "mapping": {},
               "split": None, "subset": None}
        cfg.update({k: v for k, v in raw_cfg.items() if v is not None or k == "max_prompts"})
        fmt, fraction, cap = cfg["format"], float(cfg["fraction"]), cfg["max_prompts"]
        if not 0.0 < fraction <= 1.0:
            raise ConfigError(f"datasets.{name}.fraction must be in (0, 1], got {fraction}")
        if fmt not in FORMATS:
            raise ConfigError(f"datasets.{name}.format: unknown format {fmt!r}; use one of {FORMATS}")
        hub = str(cfg["path"]).startswith(HF_PREFIX)
        root = Path(cfg["path"])
        dropped: collections.Counter = collections.Counter()
        skipped: dict[str, int] = {}  # malformed records the reader skipped (strict: false)
        rel_cache: dict[str, str] = {}
        examples: list[str] = []
        shown_per_reason: collections.Counter = collections.Counter()  # examples of build-time drops
        first_no_field: tuple[Locator, list[str]] | None = None
        read = kept = 0
        stopped = False
        rows: list[dict] = []
        shard_list: list[dict] = []
        ds_dir = out / name
        lang_filter = lang_filters[name]
        dropped_langs: collections.Counter = collections.Counter()

        def flush() -> None:
            sname = shard_name(len(shard_list))
            path = ds_dir / f"{sname}.parquet"
            meta = {"schema_version": PROMPT_SCHEMA_VERSION, "dataset": name, "shard": sname}
            _write_shard(path, rows, meta)
            shard_list.append({"name": sname, "path": f"{name}/{sname}.parquet", "rows": len(rows),
                               "first_prompt_id": rows[0]["prompt_id"], "last_prompt_id": rows[-1]["prompt_id"]})
            rows.clear()

        for loc, rec in read_records(str(cfg["path"]) if hub else root, strict=cfg["strict"], counts=skipped,
                                     examples=examples, split=cfg["split"], subset=cfg["subset"], source=name):
            read += 1
            try:
                messages, used_fmt = _normalize(rec, fmt, cfg["mapping"])
                pid = prompt_id(messages)
                metadata = record_metadata(rec, used_fmt, cfg["mapping"], _source_ref(root, loc, rel_cache))
                metadata.encode("utf-8")
            except RejectedRecord as rej:
                dropped[rej.reason] += 1
                if rej.reason == "no_prompt_field" and first_no_field is None:
                    first_no_field = (loc, sorted(map(str, rec))[:20])
                if shown_per_reason[rej.reason] < MAX_EXAMPLES:
                    shown_per_reason[rej.reason] += 1
                    examples.append(f"{loc}: {rej}")
                continue
            except (DataError, UnicodeEncodeError) as exc:
                reason = "invalid_utf8" if isinstance(exc, UnicodeEncodeError) else "wrong_type"
                msg = f"{loc}: {exc if reason == 'wrong_type' else 'text is not valid Unicode (lone surrogate)'}"
                if cfg["strict"]:
                    fix = (f"name the field with `datasets.{name}.mapping` or `format` (or fix the record)"
                           if isinstance(exc, MissingField) else "fix the record")
                    raise DataError(f"{msg}; {fix}, or set `datasets.{name}.strict: false`") from None
                dropped[reason] += 1
                log.warning("skipped %s", msg)
                if shown_per_reason[reason] < MAX_EXAMPLES:
                    shown_per_reason[reason] += 1
                    examples.append(msg)
                continue
            if fraction < 1.0 and keep_score(seed, pid) >= fraction:
                dropped["sampled_out"] += 1
                continue
            if pid in seen:
                dropped["duplicate"] += 1
                continue
            if lang_filter is not None:
                lang, prob = identifier.classify(language_sample(messages))
                if lang not in lang_filter[0]:
                    dropped["language"] += 1
                    dropped_langs[lang] += 1
                    continue
                if prob < lang_filter[1]:
                    dropped["low_language_confidence"] += 1
                    dropped_langs[lang] += 1
                    continue
            if max_prompt_tokens is not None and _count_tokens(tokenizer, messages) > max_prompt_tokens:
                dropped["too_long"] += 1
                continue
            seen.add(pid)
            rows.append({"prompt_id": pid, "dataset": name, "messages": messages, "metadata": metadata})
            kept += 1
            if len(rows) == shard_size:
                flush()
            if cap is not None and kept >= cap:
                stopped = True
                break
        if rows:
            flush()
        no_field = first_no_field is not None and dropped["no_prompt_field"] == read  # no record has a prompt field
        if no_field:
            loc, fields = first_no_field
            looked_for = "prompt/question/problem" if fmt == "prompt" else \
                "conversations/messages/turns/instruction/prompt/question/problem"
            msg = (f"datasets.{name} ({cfg['path']}): none of the {read} records read has a prompt field ({looked_for}"
                   + (f", after mapping {dict(cfg['mapping'])}" if cfg["mapping"] else "")
                   + f"); the first ({loc}) has fields {fields}")
            if cfg["strict"]:
                raise DataError(f"{msg}. Name the prompt field with `datasets.{name}.mapping` (e.g. `mapping: "
                                f"{{prompt: <field>}}`) or set `datasets.{name}.format` ({', '.join(FORMATS)}), or set "
                                f"`datasets.{name}.strict: false` to count them as no_prompt_field and go on")
            log.warning("%s; all dropped as no_prompt_field (strict: false)", msg)
        dropped.update(skipped)
        if kept == 0 and not no_field:
            log.warning("%s: kept no prompt (read %d, dropped %s)", name,
                        read + sum(n for r, n in skipped.items() if r != "empty_file"), dict(sorted(dropped.items())))
        inactive = _inactive_shards(ds_dir, len(shard_list))
        if inactive:
            log.info("%s: shards %s %s", name, inactive, _LEFT_ON_DISK)
        total += kept
        ds_out[name] = {
            "config": {k: cfg[k] for k in ("path", "format", "max_prompts", "fraction", "strict", "mapping")
                       + tuple(k for k in ("split", "subset") if cfg[k] is not None)},
            "read": read + sum(n for r, n in skipped.items() if r != "empty_file"),  # incl. skipped malformed
            "kept": kept,
            "dropped": dict(sorted(dropped.items())),
            "skipped_examples": examples,
            "stopped_at_max_prompts": stopped,
            "shards": shard_list,
            "inactive_shards": inactive,
        }
        if lang_filter is not None:
            ds_out[name]["config"].update(languages=sorted(lang_filter[0]), min_language_confidence=lang_filter[1])
            ds_out[name]["dropped_languages"] = dict(sorted(dropped_langs.items()))
        elif cfg.get("languages") == ANY_LANGUAGE:  # filter configured for the stage, switched off here
            ds_out[name]["config"]["languages"] = ANY_LANGUAGE
        log.info("%s: read %d, kept %d in %d shards, dropped %s", name, ds_out[name]["read"], kept,
                 len(shard_list), dict(dropped))

    # shards of sources that left the config, found on disk (inside the workflow Snakemake deletes the
    # checkpoint's manifest before the job runs, so the previous one is often absent)
    inactive_datasets = {}
    for d in sorted(out.iterdir()) if out.is_dir() else []:
        if d.is_dir() and d.name not in ds_out and (left := _inactive_shards(d, 0)):
            inactive_datasets[d.name] = left
            log.info("%s: shards %s %s", d.name, left, _LEFT_ON_DISK)
    if total == 0:
        summary = {n: d["dropped"] for n, d in ds_out.items()}
        raise DataError(f"no prompt kept from any source (drops per source: {summary}); check `datasets` in the config")
    manifest = {
        "schema_version": MANIFEST_SCHEMA_VERSION,
        "prompt_schema_version": PROMPT_SCHEMA_VERSION,
        "seed": seed,
        "shard_size": shard_size,
        "max_prompt_tokens": max_prompt_tokens,
        "tokenizer": getattr(tokenizer, "name_or_path", None) if tokenizer is not None else None,
        "languages": list(languages) if languages else None,
        "min_language_confidence": min_language_confidence,
        "language_detector": _language_detector() if identifier is not None else None,
        "total_prompts": total,
        "datasets": ds_out,
        "inactive_datasets": inactive_datasets,
    }
    shards.write_json(manifest_file, manifest)
    return manifest


def shard_prompts(
    datasets: Mapping[str, Mapping[str, Any]],
    out_dir: str | os.PathLike,
    prompts_cfg: Mapping[str, Any],
    *,
    target_dir: str | os.PathLike | None = None,
    trust_remote_code: bool = False,
    chat_template: str | os.PathLike | None = None,
) -> dict:
    """The ``shard_prompts`` rule: :func:`build_prompt_shards` with the validated ``prompts`` config section.

    The target tokenizer is loaded (from ``target_dir``, :func:`chat.load_tokenizer`) only when
    ``prompts.max_prompt_tokens`` is set — the rule depends on the target only then, so the common case
    does not re-shard when the target changes. ``prompts.languages`` / ``prompts.min_language_confidence``
    are the default language filter of every source (py3langid is imported only when one applies).

    Raises:
        ConfigError: ``max_prompt_tokens`` set but no ``target_dir``; see :func:`build_prompt_shards`.
    """
    max_tokens = prompts_cfg.get("max_prompt_tokens")
    tokenizer = None
    if max_tokens is not None:
        if target_dir is None:
            raise ConfigError("prompts.max_prompt_tokens is set but no target directory was given for its tokenizer")
        from .chat import load_tokenizer

        tokenizer = load_tokenizer(target_dir, trust_remote_code=trust_remote_code, chat_template=chat_template)
    min_conf = prompts_cfg.get("min_language_confidence")
    return build_prompt_shards(datasets, out_dir, shard_size=prompts_cfg["shard_size"], seed=prompts_cfg["seed"],
                               tokenizer=tokenizer, max_prompt_tokens=max_tokens, languages=prompts_cfg.get("languages"),
                               min_language_confidence=0.0 if min_conf is None else min_conf)


def shard_paths(manifest: Mapping[str, Any], out_dir: str | os.PathLike) -> dict[str, list[str]]:
    """Shard file paths per dataset (``{out_dir}/{name}/{NNNNN}.parquet``) in manifest order."""
    return {name: [str(Path(out_dir) / s["path"]) for s in ds["shards"]] for name, ds in manifest["datasets"].items()}


def list_shards(manifest_path: str | os.PathLike) -> list[tuple[str, str]]:
    """``(dataset, shard)`` pairs of a written manifest, e.g. ``[("gsm8k", "00000"), ...]`` — what the
    Snakefile expands downstream rules over after the checkpoint."""
    manifest = shards.read_json(manifest_path)
    return [(name, s["name"]) for name, ds in manifest["datasets"].items() for s in ds["shards"]]


# --------------------------------------------------------------------------------------------------
# Eval prompts
# --------------------------------------------------------------------------------------------------


def _eval_format(record: Mapping[str, Any]) -> str:
    if isinstance(record.get("prompt"), str) and "entry_point" in record and "task_id" in record:
        return "humaneval"
    if isinstance(record.get("question"), str) and isinstance(record.get("answer"), str) and "####" in record["answer"]:
        return "gsm8k"
    return "auto"


def load_eval_prompts(path: str | os.PathLike, *, fmt: str = "auto", num_samples: int, seed: int) -> list[dict]:
    """Held-out eval prompts in the DFlash authors' formats (reference/dflash.md §7.2).

    Formats: ``gsm8k`` -> ``question + GSM8K_SUFFIX``; ``humaneval`` -> :data:`HUMANEVAL_TEMPLATE`;
    ``mt_bench`` -> its ``turns`` (multi-turn); any :data:`FORMATS` entry -> the user turns of
    :func:`normalize_record`. ``auto`` recognizes HumanEval (``task_id`` + ``entry_point`` + ``prompt``) and
    GSM8K (``question`` + an ``answer`` containing ``####``) records, else defers to normalize_record.

    Returns:
        ``num_samples`` records (all when fewer exist) ``{prompt_id, turns: [user strings], system: str |
        None}``, chosen by ``random.Random(seed).shuffle`` of the file-ordered records: deterministic for a
        given file, seed and count. ``prompt_id`` hashes the user messages as sent.

    Raises:
        DataError: unreadable/malformed file (strict), or a record without the format's field.
        ConfigError: unknown ``fmt`` or ``num_samples < 1``.
    """
    if fmt not in EVAL_FORMATS:
        raise ConfigError(f"eval set format {fmt!r} unknown; use one of {EVAL_FORMATS}")
    if num_samples < 1:
        raise ConfigError(f"eval.sets.*.num_samples must be >= 1, got {num_samples}")
    items: list[dict] = []
    for loc, rec in read_records(path, strict=True):
        kind = _eval_format(rec) if fmt == "auto" else fmt
        system = None
        try:
            if kind == "gsm8k":
                q = rec.get("question", _MISSING)
                if not isinstance(q, str):
                    raise _type_error("question", q, "a string", rec)
                turns = [q + GSM8K_SUFFIX]
            elif kind == "humaneval":
                p = rec.get("prompt", _MISSING)
                if not isinstance(p, str):
                    raise _type_error("prompt", p, "a string", rec)
                turns = [HUMANEVAL_TEMPLATE.format(prompt=p)]
            else:
                messages = normalize_record(rec, fmt=kind)
                turns = [m["content"] for m in messages if m["role"] == "user"]
                systems = [m["content"] for m in messages if m["role"] == "system"]
                system = "\n\n".join(systems) if systems else None
        except RejectedRecord as rej:
            log.warning("%s: eval record skipped (%s)", loc, rej)
            continue
        except DataError as exc:
            raise DataError(f"{loc}: {exc}") from None
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": t} for t in turns]
        items.append({"prompt_id": prompt_id(msgs), "turns": turns, "system": system})
    random.Random(seed).shuffle(items)
    return items[:num_samples]
