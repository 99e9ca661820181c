"""Prompt stage: read prompt sources, normalize them to prompt records, dedup, sample and shard them.

Data flow (one source after the other, in config order, streaming)::

    read_records(path)          -> (Locator, raw dict)   .jsonl/.json/.parquet/.arrow, dirs, .gz/.zst, hf: ids
    normalize_record(record)    -> [{role, content}]     system + user turns only
    filters                     -> kept, or dropped with a reason counted in the manifest
    build_prompt_shards(...)    -> {out}/{dataset}/{NNNNN}.parquet + {out}/manifest.json

Every keep decision depends on the record alone and on the records before it, so appending to a source
leaves every full shard unchanged; shards are never deleted. Bad records raise `DataError` in a `strict`
source. Stable sharding, the language filter and the drop reasons: docs/how-to/prompts.md.
"""

from .eval_prompts import EVAL_FORMATS, GSM8K_SUFFIX, HUMANEVAL_TEMPLATE, _eval_format, load_eval_prompts
from .keep import keep_score
from .language import (
    ANY_LANGUAGE,
    LANGUAGE_CODES,
    LANGUAGE_INSTALL,
    LANGUAGE_SAMPLE_CHARS,
    _language_detector,
    _language_identifier,
    _source_languages,
    detect_language,
    language_problems,
    language_sample,
)
from .normalize import (
    _MISSING,
    ALPACA_INPUT_SEPARATOR,
    FORMATS,
    MAPPABLE_FIELDS,
    ROLE_ALIASES,
    MissingField,
    RejectedRecord,
    _normalize,
    _type_error,
    detect_format,
    normalize_record,
    record_metadata,
)
from .readers import (
    COMPRESSION_SUFFIXES,
    HF_PREFIX,
    MAX_EXAMPLES,
    RECORD_SUFFIXES,
    Locator,
    list_source_files,
    read_records,
)
from .sharding import (
    MANIFEST_SCHEMA_VERSION,
    build_prompt_shards,
    list_shards,
    shard_name,
    shard_paths,
    shard_prompts,
)

__all__ = [
    "ALPACA_INPUT_SEPARATOR",
    "ANY_LANGUAGE",
    "COMPRESSION_SUFFIXES",
    "EVAL_FORMATS",
    "FORMATS",
    "GSM8K_SUFFIX",
    "HF_PREFIX",
    "HUMANEVAL_TEMPLATE",
    "LANGUAGE_CODES",
    "LANGUAGE_INSTALL",
    "LANGUAGE_SAMPLE_CHARS",
    "MANIFEST_SCHEMA_VERSION",
    "MAPPABLE_FIELDS",
    "MAX_EXAMPLES",
    "RECORD_SUFFIXES",
    "ROLE_ALIASES",
    "Locator",
    "MissingField",
    "RejectedRecord",
    "build_prompt_shards",
    "detect_format",
    "detect_language",
    "keep_score",
    "language_problems",
    "language_sample",
    "list_shards",
    "list_source_files",
    "load_eval_prompts",
    "normalize_record",
    "read_records",
    "record_metadata",
    "shard_name",
    "shard_paths",
    "shard_prompts",
]
