"""Sharding: every prompt source through normalization and the keep decisions (fraction, dedup, language,
length) into stable shards `{out}/{dataset}/{NNNNN}.parquet` and the manifest.

Each source is one `_shard_source` call: records are normalized and kept or dropped one by one
(`.keep._drop_reason`), written by a `_ShardWriter`, and counted in a `_SourceTally` (the source's
manifest entry); `_manifest` assembles the manifest.
"""

from __future__ import annotations

import collections
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_pipeline.core import shards
from dflash_pipeline.core.config import schema_defaults
from dflash_pipeline.core.contracts import MANIFEST_SCHEMA_VERSION, PROMPT_SCHEMA_VERSION, prompt_id, prompt_schema
from dflash_pipeline.core.errors import ConfigError, DataError

from .keep import _checked_filters, _drop_reason, _Filters
from .language import (
    ANY_LANGUAGE,
    _language_detector,
)
from .normalize import FORMATS, MissingField, RejectedRecord, _normalize, record_metadata, record_tools
from .readers import HF_PREFIX, MAX_EXAMPLES, Locator, read_records

log = logging.getLogger(__package__)  # one logger for the whole prompts stage

_SHARD_RE = re.compile(r"^(\d{5})\.parquet$")


def shard_name(index: int) -> str:
    """File stem of shard `index` (`00000`)."""
    return f"{index:05d}"


def _write_shard(path: Path, rows: list[dict], meta: dict) -> bool:
    """Write a shard unless an existing file already holds the same rows and metadata (mtime kept). Schema:
    `contracts.prompt_schema` of the rows (the tools schema only when a row has tools)."""
    schema = prompt_schema(rows)
    table = shards.table_from_records(rows, schema)
    if path.is_file():
        try:
            old = pq.read_table(path)
            if (
                old.schema.remove_metadata().equals(schema)
                and old.equals(table)
                and shards.read_shard_metadata(path) == meta
            ):
                return False
        except pa.ArrowException:
            pass  # unreadable: rewrite
    return shards.write_parquet(path, table, metadata=meta)


def _inactive_shards(ds_dir: Path, active: int) -> list[str]:
    """Names (`00003`) of the shard files in `ds_dir` numbered `active` or above: shards no longer in
    the mix. They are never deleted: their completions stay valid if the shards come back unchanged."""
    if not ds_dir.is_dir():
        return []
    return sorted(m.group(1) for f in ds_dir.iterdir() if (m := _SHARD_RE.match(f.name)) and int(m.group(1)) >= active)


_LEFT_ON_DISK = "no longer in the mix; left on disk so their completions stay valid if they come back"


def _source_ref(root: Path, loc: Locator, rel_cache: dict[str, str]) -> dict:
    rel = rel_cache.get(loc.file)
    if rel is None:
        if loc.file.startswith(HF_PREFIX) or root.is_file():
            # a single-file source: "" (the manifest's config.path names the file). Filling in its name would
            # change the bytes of every existing prompt shard, and so regenerate all their completions.
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


@dataclass
class _SourceTally:
    """Running totals of one source while it is read: what its manifest entry reports."""

    read: int = 0  # records the reader yielded (malformed ones it skipped are in `skipped`)
    kept: int = 0
    stopped: bool = False  # reading stopped at max_prompts
    dropped: collections.Counter = field(default_factory=collections.Counter)
    skipped: dict[str, int] = field(default_factory=dict)  # malformed records the reader skipped (strict: false)
    examples: list[str] = field(default_factory=list)
    shown_per_reason: collections.Counter = field(default_factory=collections.Counter)  # examples of build-time drops
    first_no_field: tuple[Locator, list[str]] | None = None
    dropped_langs: collections.Counter = field(default_factory=collections.Counter)
    special_kept: int = 0  # prompts with special-token text kept (prompts.special_token_text: keep)

    def drop(self, reason: str, example: str | None = None) -> None:
        """Count a dropped record; keep `example` among the first `MAX_EXAMPLES` of its reason."""
        self.dropped[reason] += 1
        if example is not None and self.shown_per_reason[reason] < MAX_EXAMPLES:
            self.shown_per_reason[reason] += 1
            self.examples.append(example)

    @property
    def read_total(self) -> int:
        """Records read, the malformed ones the reader skipped included (an empty file is no record)."""
        return self.read + sum(n for r, n in self.skipped.items() if r != "empty_file")


@dataclass
class _ShardWriter:
    """Writes a source's kept rows into shards of `shard_size` (`{out}/{name}/{NNNNN}.parquet`)."""

    out: Path
    name: str
    shard_size: int
    rows: list[dict] = field(default_factory=list)
    shard_list: list[dict] = field(default_factory=list)  # the manifest's `shards` entries

    def add(self, row: dict) -> None:
        self.rows.append(row)
        if len(self.rows) == self.shard_size:
            self.flush()

    def flush(self) -> None:
        """Write the rows held (if any) as the next shard."""
        if not self.rows:
            return
        rows, name = self.rows, self.name
        sname = shard_name(len(self.shard_list))
        meta = {"schema_version": PROMPT_SCHEMA_VERSION, "dataset": name, "shard": sname}
        _write_shard(self.out / name / f"{sname}.parquet", rows, meta)
        self.shard_list.append(
            {
                "name": sname,
                "path": f"{name}/{sname}.parquet",
                "rows": len(rows),
                "first_prompt_id": rows[0]["prompt_id"],
                "last_prompt_id": rows[-1]["prompt_id"],
            }
        )
        self.rows = []


def _source_config(name: str, raw_cfg: Mapping[str, Any]) -> dict:
    """`datasets.<name>` with the keys it leaves out (or sets to null) taken from the schema's defaults;
    raises ConfigError for a bad fraction or format."""
    cfg = schema_defaults("datasets", "*")
    cfg.update({k: v for k, v in raw_cfg.items() if v is not None or k == "max_prompts"})
    fraction = float(cfg["fraction"])
    if not 0.0 < fraction <= 1.0:
        raise ConfigError(f"datasets.{name}.fraction must be in (0, 1], got {fraction}")
    if cfg["format"] not in FORMATS:
        raise ConfigError(f"datasets.{name}.format: unknown format {cfg['format']!r}; use one of {FORMATS}")
    return cfg


def _normalized(
    rec: dict, loc: Locator, name: str, cfg: dict, root: Path, rel_cache: dict, tally: _SourceTally
) -> tuple[list[dict], str, str, str | None] | None:
    """`(messages, prompt_id, metadata, tools)` of a raw record (`tools`: JSON text, None without), or None
    when it is dropped (counted in `tally`). Raises DataError for a bad record in a `strict` source."""
    try:
        messages, used_fmt = _normalize(rec, cfg["format"], cfg["mapping"])
        tools = record_tools(rec, mapping=cfg["mapping"])
        pid = prompt_id(messages, tools)
        metadata = record_metadata(rec, used_fmt, cfg["mapping"], _source_ref(root, loc, rel_cache))
        metadata.encode("utf-8")
    except RejectedRecord as rej:
        if rej.reason == "no_prompt_field" and tally.first_no_field is None:
            tally.first_no_field = (loc, sorted(map(str, rec))[:20])
        tally.drop(rej.reason, f"{loc}: {rej}")
        return None
    except (DataError, UnicodeEncodeError) as exc:
        reason = "invalid_utf8" if isinstance(exc, UnicodeEncodeError) else "wrong_type"
        msg = f"{loc}: {exc if reason == 'wrong_type' else 'text is not valid Unicode (lone surrogate)'}"
        if cfg["strict"]:
            fix = (
                f"name the field with `datasets.{name}.mapping` or `format` (or fix the record)"
                if isinstance(exc, MissingField)
                else "fix the record"
            )
            raise DataError(f"{msg}; {fix}, or set `datasets.{name}.strict: false`") from None
        log.warning("skipped %s", msg)
        tally.drop(reason, msg)
        return None
    return messages, pid, metadata, tools


def _check_prompt_field(name: str, cfg: dict, tally: _SourceTally) -> bool:
    """Whether no record of the source has a prompt field (every record `no_prompt_field`): an error
    in a `strict` source (DataError naming the fix), else a warning."""
    if tally.first_no_field is None or tally.dropped["no_prompt_field"] != tally.read:
        return False
    loc, fields = tally.first_no_field
    looked_for = (
        "prompt/question/problem"
        if cfg["format"] == "prompt"
        else "conversations/messages/turns/instruction/prompt/question/problem"
    )
    msg = (
        f"datasets.{name} ({cfg['path']}): none of the {tally.read} records read has a prompt field ({looked_for}"
        + (f", after mapping {dict(cfg['mapping'])}" if cfg["mapping"] else "")
        + f"); the first ({loc}) has fields {fields}"
    )
    if cfg["strict"]:
        raise DataError(
            f"{msg}. Name the prompt field with `datasets.{name}.mapping` (e.g. `mapping: "
            f"{{prompt: <field>}}`) or set `datasets.{name}.format` ({', '.join(FORMATS)}), or set "
            f"`datasets.{name}.strict: false` to count them as no_prompt_field and go on"
        )
    log.warning("%s; all dropped as no_prompt_field (strict: false)", msg)
    return True


def _source_entry(
    name: str, cfg: dict, tally: _SourceTally, writer: _ShardWriter, lang_filter: tuple[frozenset, float] | None
) -> dict:
    """The source's manifest entry (`datasets.<name>`; see `build_prompt_shards`)."""
    inactive = _inactive_shards(writer.out / name, len(writer.shard_list))
    if inactive:
        log.info("%s: shards %s %s", name, inactive, _LEFT_ON_DISK)
    entry = {
        "config": {
            k: cfg[k]
            for k in ("path", "format", "max_prompts", "fraction", "strict", "mapping")
            + tuple(k for k in ("split", "subset") if cfg[k] is not None)
        },
        "read": tally.read_total,  # incl. skipped malformed
        "kept": tally.kept,
        "dropped": dict(sorted(tally.dropped.items())),
        "skipped_examples": tally.examples,
        "stopped_at_max_prompts": tally.stopped,
        "shards": writer.shard_list,
        "inactive_shards": inactive,
    }
    if tally.special_kept:
        entry["kept_with_special_token_text"] = tally.special_kept
    if lang_filter is not None:
        entry["config"].update(languages=sorted(lang_filter[0]), min_language_confidence=lang_filter[1])
        entry["dropped_languages"] = dict(sorted(tally.dropped_langs.items()))
    elif cfg.get("languages") == ANY_LANGUAGE:  # filter configured for the stage, switched off here
        entry["config"]["languages"] = ANY_LANGUAGE
    from dflash_pipeline.core.console import console

    console(
        "%s: read %d, kept %d in %d shards, dropped %s",
        name,
        entry["read"],
        tally.kept,
        len(writer.shard_list),
        dict(sorted(tally.dropped.items())) or "none",
    )
    return entry


def _shard_source(
    name: str,
    raw_cfg: Mapping[str, Any],
    out: Path,
    shard_size: int,
    filters: _Filters,
    lang_filter: tuple[frozenset, float] | None,
) -> dict:
    """Read, filter and shard one source; returns its manifest entry."""
    cfg = _source_config(name, raw_cfg)
    fraction, cap = float(cfg["fraction"]), cfg["max_prompts"]
    hub = str(cfg["path"]).startswith(HF_PREFIX)
    root = Path(cfg["path"])
    tally = _SourceTally()
    writer = _ShardWriter(out, name, shard_size)
    rel_cache: dict[str, str] = {}
    for loc, rec in read_records(
        str(cfg["path"]) if hub else root,
        strict=cfg["strict"],
        counts=tally.skipped,
        examples=tally.examples,
        split=cfg["split"],
        subset=cfg["subset"],
        source=name,
    ):
        tally.read += 1
        normalized = _normalized(rec, loc, name, cfg, root, rel_cache, tally)
        if normalized is None:
            continue
        messages, pid, metadata, tools = normalized
        why = _drop_reason(messages, pid, fraction, lang_filter, filters, tally)
        if why is not None:
            tally.drop(why[0], f"{loc}: prompt {pid}: {why[1]}")
            continue
        filters.seen[pid] = name
        row = {"prompt_id": pid, "dataset": name, "messages": messages, "metadata": metadata}
        if tools is not None:
            row["tools"] = tools
        writer.add(row)
        tally.kept += 1
        if cap is not None and tally.kept >= cap:
            tally.stopped = True
            break
    writer.flush()
    no_field = _check_prompt_field(name, cfg, tally)
    tally.dropped.update(tally.skipped)
    if tally.kept == 0 and not no_field:
        log.warning(
            "%s: kept no prompt (read %d, dropped %s)", name, tally.read_total, dict(sorted(tally.dropped.items()))
        )
    return _source_entry(name, cfg, tally, writer, lang_filter)


def _inactive_datasets(out: Path, active: Mapping[str, Any]) -> dict[str, list[str]]:
    """Shards of sources that left the config, found on disk."""
    inactive = {}
    for d in sorted(out.iterdir()) if out.is_dir() else []:
        if d.is_dir() and d.name not in active and (left := _inactive_shards(d, 0)):
            inactive[d.name] = left
            log.info("%s: shards %s %s", d.name, left, _LEFT_ON_DISK)
    return inactive


def _manifest(
    filters: _Filters,
    ds_out: dict[str, dict],
    inactive_datasets: dict[str, list[str]],
    *,
    shard_size: int,
    languages: Sequence[str] | None,
    min_language_confidence: float,
) -> dict:
    """The manifest (`contracts.PromptManifest`) of the sources' entries `ds_out`. Raises
    DataError when no source kept a prompt."""
    total = sum(d["kept"] for d in ds_out.values())
    if total == 0:
        summary = {n: d["dropped"] for n, d in ds_out.items()}
        raise DataError(f"no prompt kept from any source (drops per source: {summary}); check `datasets` in the config")
    return {
        "schema_version": MANIFEST_SCHEMA_VERSION,
        "prompt_schema_version": PROMPT_SCHEMA_VERSION,
        "seed": filters.seed,
        "shard_size": shard_size,
        "max_prompt_tokens": filters.max_prompt_tokens,
        **({"special_token_text": filters.special_token_text} if filters.special_token_text is not None else {}),
        "tokenizer": getattr(filters.tokenizer, "name_or_path", None) if filters.tokenizer is not None else None,
        "languages": list(languages) if languages else None,
        "min_language_confidence": min_language_confidence,
        "language_detector": _language_detector() if filters.identifier is not None else None,
        "total_prompts": total,
        "datasets": ds_out,
        "inactive_datasets": inactive_datasets,
    }


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
    special_token_text: str | None = None,
) -> dict:
    """Normalize, filter, dedup and shard every prompt source; write shards and the manifest.

    Args:
        datasets: validated `config["datasets"]`, processed in mapping order: name -> `{path, format,
            max_prompts, fraction, strict, mapping, languages, min_language_confidence}`; a source's
            `languages` (a list, or `"any"`) and `min_language_confidence` override the arguments below.
        out_dir: shards go to `{out_dir}/{name}/{NNNNN}.parquet` (`contracts.PROMPT_SCHEMA`).
        shard_size: prompts per shard (the last shard of a source may be smaller).
        seed: seed of the per-record `fraction` decision.
        tokenizer: has `encode(text, add_special_tokens=False)`; needed for `max_prompt_tokens` (length =
            the message contents' token counts, no template) and `special_token_text`.
        max_prompt_tokens: drop longer prompts (`too_long`).
        languages: language allow-list (`LANGUAGE_CODES`) for every source; None = no filter.
        min_language_confidence: also drop prompts whose top language is less likely
            (`low_language_confidence`).
        manifest_path: default `{out_dir}/manifest.json`.
        special_token_text: `drop` drops prompts whose system/user text holds a special-token string of the
            target tokenizer (`special_token_text`); `keep` counts them; None = no check.

    Returns:
        The manifest (`contracts.PromptManifest`), also written as key-sorted JSON. Unchanged shard files
        are not rewritten, and none is ever deleted (inactive ones are listed).

    Raises:
        DataError: malformed input in a `strict` source (names file, line/record and field), a `strict`
            source none of whose records has a prompt field, or no prompt kept at all.
        ConfigError: a bad option, `fraction` or `format`."""
    filters, lang_filters = _checked_filters(
        datasets,
        shard_size=shard_size,
        seed=seed,
        tokenizer=tokenizer,
        max_prompt_tokens=max_prompt_tokens,
        languages=languages,
        min_language_confidence=min_language_confidence,
        special_token_text=special_token_text,
    )
    out = Path(out_dir)
    manifest_file = Path(manifest_path) if manifest_path is not None else out / "manifest.json"
    ds_out = {
        name: _shard_source(name, raw_cfg, out, shard_size, filters, lang_filters[name])
        for name, raw_cfg in datasets.items()
    }
    manifest = _manifest(
        filters,
        ds_out,
        _inactive_datasets(out, ds_out),
        shard_size=shard_size,
        languages=languages,
        min_language_confidence=min_language_confidence,
    )
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
    """The `shard_prompts` rule: `build_prompt_shards` with the validated `prompts` config section.

    The target tokenizer (`target_dir`) is loaded only when `prompts.max_prompt_tokens` is set or
    `prompts.special_token_text` is `drop` (the default): the rule depends on the target only then.
    `prompts.languages` / `prompts.min_language_confidence` are every source's default language filter.

    Raises:
        ConfigError: `max_prompt_tokens` set but no `target_dir`; see `build_prompt_shards`."""
    prompts_cfg = {**schema_defaults("prompts"), **prompts_cfg}  # a partial section (tests) takes the defaults
    max_tokens = prompts_cfg["max_prompt_tokens"]
    # `keep` needs no tokenizer (nothing is checked), so the target is then no input of the checkpoint
    special = "drop" if prompts_cfg["special_token_text"] == "drop" else None
    tokenizer = None
    if max_tokens is not None or special is not None:
        if target_dir is None:
            raise ConfigError(
                "prompts.max_prompt_tokens / prompts.special_token_text: drop need the target's "
                "tokenizer, but no target directory was given"
            )
        from dflash_pipeline.target.chat import load_tokenizer

        tokenizer = load_tokenizer(target_dir, trust_remote_code=trust_remote_code, chat_template=chat_template)
    same_named = ("shard_size", "seed", "languages", "min_language_confidence")  # keys named as its arguments
    return build_prompt_shards(
        datasets,
        out_dir,
        tokenizer=tokenizer,
        max_prompt_tokens=max_tokens,
        special_token_text=special,
        **{key: prompts_cfg[key] for key in same_named},
    )


def shard_paths(manifest: Mapping[str, Any], out_dir: str | os.PathLike) -> dict[str, list[str]]:
    """Shard file paths per dataset (`{out_dir}/{name}/{NNNNN}.parquet`) in manifest order."""
    return {name: [str(Path(out_dir) / s["path"]) for s in ds["shards"]] for name, ds in manifest["datasets"].items()}


def list_shards(manifest_path: str | os.PathLike) -> list[tuple[str, str]]:
    """`(dataset, shard)` pairs of a written manifest, e.g. `[("gsm8k", "00000"), ...]` — what the
    Snakefile expands downstream rules over after the checkpoint."""
    manifest = shards.read_json(manifest_path)
    return [(name, s["name"]) for name, ds in manifest["datasets"].items() for s in ds["shards"]]
