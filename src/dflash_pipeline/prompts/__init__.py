"""Prompt stage: read prompt sources, normalize them to prompt records, dedup, sample and shard them.

Data flow (one source after the other, in config order, streaming; nothing holds a whole source)::

    read_records(path)          -> (Locator, raw dict)          .jsonl/.json/.parquet/.arrow, dirs, .gz/.zst,
                                                                saved datasets (+ DatasetDict split), hf: ids
    normalize_record(record)    -> [{role, content}]            system + user turns only
    filters                     -> kept or dropped with a reason (counted in the manifest, never silent)
    build_prompt_shards(...)    -> {out}/{dataset}/{NNNNN}.parquet + {out}/manifest.json

**Stable sharding.** Generation is the expensive step, so shard contents only ever depend on the records
*before* them in the source. Every keep decision is made per record, in source order:

* `fraction` (per source, default 1.0) keeps a record iff `u(seed, prompt_id) < fraction` where `u` is
  a uniform number in [0, 1) derived from sha256 of the seed and the prompt id. The decision depends on
  that record alone, so appending records never changes which earlier records were kept.
* `max_prompts` then keeps the *first* `max_prompts` surviving records in source order (reading stops
  there). A random "N of the whole file" sample would change whenever the file grows; a prefix of a
  hash-thinned stream does not. For a random subset of a fixed file set `fraction` a bit above
  `N / records` and `max_prompts: N`.
* Dedup is by `contracts.prompt_id` across sources; the first source in config order wins. Adding a
  new source *at the end* of `datasets` therefore never changes existing shards; inserting one earlier,
  or appending records to an earlier source that duplicate a later source's prompts, can shift the later
  source's shards (its `duplicate` count in the manifest shows it).

Shard `i` of a source holds its kept records `[i * shard_size, (i + 1) * shard_size)`; appending
records leaves every full shard byte-identical, only the last partial shard grows. A shard file whose
*content* (rows and `dflash` metadata) equals what would be written is not touched, so its mtime stays
and downstream Snakemake jobs stay valid — even across pyarrow upgrades that change the file bytes.
Shards are never deleted: those of a source that shrank (beyond its new shard count) or left the config stay
on disk, unlisted in the manifest's `shards` (all that downstream reads) and recorded as inactive, so when
the source grows back or returns, identical shards are not rewritten and their completions stay valid.

**Language filter** (off unless `prompts.languages` or a source's `languages` is set): the first
`LANGUAGE_SAMPLE_CHARS` characters of the prompt's user turns joined by newlines (system turns are
not read) are classified with `py3langid` (an offline naive-Bayes model bundled in its wheel); the prompt
is kept iff the top language is in the allow-list and its probability is at least
`min_language_confidence`. The decision depends on the record alone (stable like `fraction`) and is
deterministic for a given py3langid install; only the decision, never the score, reaches the shards.

Drop reasons counted per source in the manifest: `malformed_json`, `invalid_utf8`, `not_an_object`,
`empty_file`, `wrong_type` (the last five only with `strict: false`; otherwise they raise
`DataError`), `empty`, `starts_with_assistant`, `multimodal`, `unsupported_role`, `bad_tool_turns`,
`no_prompt_field`, `sampled_out`, `duplicate`, `language` (top language not allowed),
`low_language_confidence` (allowed, but below `min_language_confidence`), `too_long`; with a
language filter, `dropped_languages` breaks both language reasons down by detected language. For every
reason from `malformed_json` to `no_prompt_field` (bad or rejected records), the manifest's
`skipped_examples` lists the first `MAX_EXAMPLES` records (file, line/record/row, why). A `strict`
source none of whose records has a prompt field (`no_prompt_field` for every record: a wrong field name or
`mapping`) is an error; a source that keeps no prompt is logged as a warning.

**Layout** (one module per concern; this package re-exports every name the stage's callers use):

================  =====================================================================
`readers`       `read_records`, `list_source_files`, `Locator`
`normalize`     `normalize_record`, `detect_format`, `RejectedRecord`
`language`      `detect_language`, `language_problems` (the language block)
`sharding`      `build_prompt_shards`, `shard_prompts`, `list_shards`
`eval_prompts`  `load_eval_prompts` (held-out eval sets)
================  =====================================================================
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
