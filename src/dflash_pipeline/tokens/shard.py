"""Tokens stage: completion shard -> token shard (`input_ids` int32, `loss_mask` uint8).

The loss mask marks the tokens the target generated, from differences of renders with the target's own
chat template (`chat.render`) and the generation's thinking mode; a template that rewrites the turn being
trained fails closed with `TokenizationError`, a turn whose markup cannot be told from text without ids
with `MarkupWithoutIdsError`. The steps are in docs/DESIGN.md ("How the loss mask is built").

Layers: `target.spans` (strings: render diffs, supervised spans),
`tokens.loss_masks` (tokens: offsets, server ids), this module (records and shards: drops,
truncation, counts, the Parquet file); the names of both are re-exported here.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dflash_pipeline.core import shards
from dflash_pipeline.core.config import schema_defaults
from dflash_pipeline.core.console import console
from dflash_pipeline.core.contracts import TOKEN_SCHEMA, TOKEN_SCHEMA_VERSION, sha256_text
from dflash_pipeline.core.errors import MarkupWithoutIdsError, TokenizationError
from dflash_pipeline.target import chat
from dflash_pipeline.target.spans import (  # noqa: F401 (the string level; re-exported)
    TrainSequence,
    check_template,
    control_token_strings,
    conversation_sequences,
    render_messages,
    special_token_strings,
    supervised_length,
)
from dflash_pipeline.tokens.loss_masks import (  # noqa: F401 (the token level; re-exported)
    mask_from_offsets,
    plain_text_tokenizer,
    server_ids_sequence,
    span_token_ranges,
    tokenize_sequences,
)

log = logging.getLogger(__name__)

#: Drop reasons counted in the shard metadata and the returned stats.
DROP_REASONS = (
    "status_error",
    "no_assistant_turn",
    "no_loss_tokens",
    "truncated_no_loss",
    "tokenization_error",
    "markup_without_ids",
)


# --- Shard level


def tokenizer_hash(tokenizer) -> str:
    """sha256 of the tokenizer's canonical serialization (backend JSON + added tokens)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return sha256_text(backend.to_str())
    return sha256_text(json.dumps(sorted(tokenizer.get_vocab().items())))


def generated_texts(tokenizer, turns: Sequence[Mapping[str, Any] | None]) -> list[str | None] | None:
    """Per turn, the text of `output_token_ids` (special tokens kept, no space clean-up), or None per turn
    without ids; None when no turn has them (`conversation_sequences` `generated`)."""
    if not any((t or {}).get("output_token_ids") for t in turns):
        return None
    return [
        tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if (ids := (t or {}).get("output_token_ids"))
        else None
        for t in turns
    ]


def _new_stats() -> dict:
    return {
        "records_in": 0,
        "records_out": 0,
        "conversations_kept": 0,
        "split_conversations": 0,
        "turns_supervised": 0,
        "truncated": 0,
        "num_tokens": 0,
        "num_loss_tokens": 0,
        "straddling_tokens": 0,
        "server_ids_used": 0,
        "scaffolding_excluded": 0,
        "render_differs_from_output_ids": 0,
        "output_ids_spliced": 0,
        "control_text_kept": 0,
        "dropped": {r: 0 for r in DROP_REASONS},
    }


def tokenize_records(
    tokenizer,
    records: Iterable[Mapping[str, Any]],
    *,
    max_length: int,
    last_turn_only: bool = False,
    strict: bool = True,
    use_server_token_ids: bool = False,
    stats: dict | None = None,
    batch_size: int = 256,
) -> Iterator[dict]:
    """Completion records -> token records (dicts matching `contracts.TOKEN_SCHEMA`).

    Args:
        tokenizer: the target tokenizer with its chat template.
        records: dicts with `prompt_id, messages, turns, thinking, status`.
        max_length: keep at most this many tokens per sequence (`truncated` set when cut).
        last_turn_only: supervise only the last assistant turn.
        strict: re-raise `TokenizationError`; `False` drops the record and counts it.
        use_server_token_ids: records whose selected turns all carry server token ids become one row per
            turn from exactly those ids (counted in `server_ids_used`).
        stats: dict updated in place (keys: `_new_stats`).
        batch_size: sequences per batched tokenizer call.

    Yields:
        `{prompt_id, turn, input_ids: int32 [n], loss_mask: uint8 [n], num_tokens, num_loss_tokens,
        truncated}` in input order (`turn`: the last assistant turn the row supervises).

    Raises:
        TokenizationError: a conversation cannot be masked exactly and `strict` is set."""
    stats = {} if stats is None else stats
    for key, value in _new_stats().items():
        stats.setdefault(key, value)
    specials = special_token_strings(tokenizer)
    controls = control_token_strings(tokenizer)
    # (prompt_id, sequence to tokenize | ((input_ids, loss_mask), turn) from server ids)
    pending: list[tuple[str, Any]] = []
    for rec in records:
        stats["records_in"] += 1
        pid = rec["prompt_id"]
        if rec.get("status") == "error":
            stats["dropped"]["status_error"] += 1
            continue
        units = _server_id_units(rec, last_turn_only) if use_server_token_ids else None
        if units is not None:
            stats["server_ids_used"] += len(units)  # turns (rows) built from the server's ids
        else:
            units = _rendered_sequences(
                tokenizer,
                rec,
                last_turn_only=last_turn_only,
                strict=strict,
                specials=specials,
                controls=controls,
                stats=stats,
            )
            if not units:  # dropped, and counted
                continue
        stats["conversations_kept"] += 1
        stats["split_conversations"] += int(len(units) > 1)
        pending.extend((pid, u) for u in units)
        if len(pending) >= batch_size:
            yield from _flush(tokenizer, pending, max_length=max_length, stats=stats)
    yield from _flush(tokenizer, pending, max_length=max_length, stats=stats)


def _server_id_units(
    rec: Mapping[str, Any], last_turn_only: bool
) -> list[tuple[tuple[np.ndarray, np.ndarray], int]] | None:
    """`[((input_ids, loss_mask), turn), ...]` from the server token ids of every selected turn
    (`server_ids_sequence`), or None when the record has no turns or one lacks its ids."""
    turns = rec.get("turns") or []
    if not turns:
        return None
    first = len(turns) - 1 if last_turn_only else 0
    exact = [server_ids_sequence(t) for t in turns[first:]]
    if not all(e is not None for e in exact):
        return None
    return [(e, first + j) for j, e in enumerate(exact)]


def _rendered_sequences(
    tokenizer,
    rec: Mapping[str, Any],
    *,
    last_turn_only: bool,
    strict: bool,
    specials: Sequence[str],
    controls: Sequence[str],
    stats: dict,
) -> list[TrainSequence]:
    """The record's training sequences from the chat-template render (`conversation_sequences`); `[]` when it is
    dropped.

    Raises:
        TokenizationError: the conversation cannot be masked exactly and `strict` is set.
    """
    turns = rec.get("turns") or []
    try:
        seqs = conversation_sequences(
            tokenizer,
            rec["messages"],
            thinking=rec.get("thinking") or "none",
            last_turn_only=last_turn_only,
            prompt_id=rec["prompt_id"],
            specials=specials,
            finish_reasons=[(t or {}).get("finish_reason") for t in turns],
            generated=generated_texts(tokenizer, turns),
            counts=stats,
            generated_ids=[(t or {}).get("output_token_ids") for t in turns],
            control_strings=controls,
            tools=chat.tools_of(rec.get("tools")),
        )
    except TokenizationError as exc:
        if strict:
            raise
        stats["dropped"]["markup_without_ids" if isinstance(exc, MarkupWithoutIdsError) else "tokenization_error"] += 1
        return []
    if not seqs:
        stats["dropped"]["no_assistant_turn"] += 1
    return seqs


def _flush(tokenizer, pending: list[tuple[str, Any]], *, max_length: int, stats: dict) -> Iterator[dict]:
    """Tokenize the pending sequences in one batched call and yield their rows in order (`_token_row`);
    `pending` is empty afterwards."""
    seqs = [s for _, s in pending if isinstance(s, TrainSequence)]
    toks = iter(tokenize_sequences(tokenizer, seqs))
    for pid, s in pending:
        if isinstance(s, TrainSequence):
            ids, mask, straddling = next(toks)
            stats["straddling_tokens"] += straddling
            turn, n_turns = max(s.turns), len(s.turns)
        else:
            (ids, mask), turn = s
            n_turns = 1
        row = _token_row(pid, turn, ids, mask, n_turns=n_turns, max_length=max_length, stats=stats)
        if row is not None:
            yield row
    pending.clear()


def _token_row(
    pid: str, turn: int, ids: np.ndarray, mask: np.ndarray, *, n_turns: int, max_length: int, stats: dict
) -> dict | None:
    """The token record of one sequence (int32 `ids` / uint8 `mask` [n]) cut at `max_length`, counted
    in `stats`; None, counted as a drop, when no supervised token is left (`no_loss_tokens`, or
    `truncated_no_loss` when the cut removed them all)."""
    truncated = len(ids) > max_length
    cut_loss = False
    if truncated:
        cut_loss = bool(mask[max_length:].any())
        ids, mask = ids[:max_length], mask[:max_length]
    n_loss = int(mask.sum())
    if n_loss == 0:  # never a supervised token, or the max_length cut removed them all
        stats["dropped"]["truncated_no_loss" if cut_loss else "no_loss_tokens"] += 1
        return None
    stats["records_out"] += 1
    stats["turns_supervised"] += n_turns
    stats["truncated"] += int(truncated)
    stats["num_tokens"] += len(ids)
    stats["num_loss_tokens"] += n_loss
    return {
        "prompt_id": pid,
        "turn": turn,
        "input_ids": ids,
        "loss_mask": mask,
        "num_tokens": len(ids),
        "num_loss_tokens": n_loss,
        "truncated": truncated,
    }


def tokenize_shard(
    completion_shard: str | Path,
    out_path: str | Path,
    *,
    target_dir: str | Path,
    tokens_cfg: Mapping[str, Any],
    chat_template: str | Path | None = None,
    trust_remote_code: bool = False,
    tokenizer=None,
    row_group_size: int = 1024,
) -> dict:
    """Tokenize one completion shard into one token shard (the Snakemake `tokenize_completions` entry).

    Args:
        completion_shard: Parquet file with `contracts.COMPLETION_SCHEMA`.
        out_path: token shard to write (`contracts.TOKEN_SCHEMA`), atomically.
        target_dir: target model directory (tokenizer files).
        tokens_cfg: validated `config["tokens"]` (`max_length`, `last_turn_only`, `strict`,
            `use_server_token_ids`).
        chat_template: optional .jinja file overriding the tokenizer's template.
        trust_remote_code: passed to `AutoTokenizer`.
        tokenizer: an already loaded tokenizer; overrides `target_dir`.
        row_group_size: rows per Parquet row group (written one at a time: bounded memory).

    Returns:
        Stats dict: `records_in, records_out, conversations_kept, split_conversations, turns_supervised,
        truncated, num_tokens, num_loss_tokens, straddling_tokens, dropped{reason: n}`, ... File metadata:
        `schema_version`, `tokenizer_sha256`, `chat_template_sha256`, `thinking`, `max_length`,
        `last_turn_only`, `counts`.

    Raises:
        TokenizationError: a record cannot be masked exactly (names prompt_id and turn; `strict`).
        ConfigError: the tokenizer has no chat template."""
    if tokenizer is None:
        tokenizer = chat.load_tokenizer(target_dir, chat_template=chat_template, trust_remote_code=trust_remote_code)
    tokens_cfg = {**schema_defaults("tokens"), **tokens_cfg}  # a partial section (tests, benches): the schema's
    max_length = int(tokens_cfg["max_length"])
    stats = _new_stats()
    thinking_modes: set[str] = set()
    last_turn_only = bool(tokens_cfg["last_turn_only"])
    rows = tokenize_records(
        tokenizer,
        _completion_records(completion_shard, thinking_modes),
        max_length=max_length,
        last_turn_only=last_turn_only,
        strict=bool(tokens_cfg["strict"]),
        use_server_token_ids=bool(tokens_cfg["use_server_token_ids"]),
        stats=stats,
    )
    _write_token_shard(
        out_path,
        rows,
        row_group_size=row_group_size,
        metadata=lambda: {  # once the rows are done
            "schema_version": TOKEN_SCHEMA_VERSION,
            "tokenizer_sha256": tokenizer_hash(tokenizer),
            "chat_template_sha256": sha256_text(tokenizer.chat_template or ""),
            "thinking": sorted(thinking_modes),
            "max_length": max_length,
            "last_turn_only": last_turn_only,
            "row_group_size": row_group_size,
            "counts": stats,
        },
    )
    _log_summary(out_path, stats, max_length)
    return stats


def _log_summary(out_path: str | Path, stats: dict, max_length: int) -> None:
    """One console line for the job: records in, sequences out, tokens, truncation, drops by reason."""
    dropped = {r: n for r, n in stats["dropped"].items() if n}
    console(
        "%s: %d completion records -> %d sequences (%d turns supervised, %d tokens, %d supervised, %d truncated "
        "at max_length %d); dropped %s; scaffolding excluded in %d turns",
        out_path,
        stats["records_in"],
        stats["records_out"],
        stats["turns_supervised"],
        stats["num_tokens"],
        stats["num_loss_tokens"],
        stats["truncated"],
        max_length,
        dropped or "none",
        stats["scaffolding_excluded"],
    )


def _completion_records(completion_shard: str | Path, thinking_modes: set[str]) -> Iterator[dict]:
    """The records of a completion shard, read in batches of 512 (only the columns tokenization reads);
    adds each record's thinking mode to `thinking_modes`."""
    pf = pq.ParquetFile(str(completion_shard))
    cols = [c for c in ("prompt_id", "messages", "turns", "thinking", "status", "tools") if c in pf.schema_arrow.names]
    for batch in pf.iter_batches(batch_size=512, columns=cols):
        for rec in batch.to_pylist():
            if rec.get("thinking"):
                thinking_modes.add(rec["thinking"])
            yield rec


def _write_token_shard(
    out_path: str | Path, rows: Iterable[dict], *, row_group_size: int, metadata: Callable[[], dict]
) -> None:
    """Stream token rows into a token shard, one row group per `row_group_size` rows, with `metadata()` (called once
    the rows are written) in the footer. Row-group boundaries depend only on the input, so a rerun writes identical
    bytes; the file is renamed into place at the end."""
    with shards.ParquetStreamWriter(out_path, TOKEN_SCHEMA) as writer:
        group: list[dict] = []
        for r in rows:
            group.append(r)
            if len(group) >= row_group_size:
                writer.write_batch(_token_batch(group))
                group.clear()
        if group or writer.rows == 0:
            writer.write_batch(_token_batch(group))
        writer.close(metadata())


def _token_batch(rows: Sequence[dict]) -> pa.RecordBatch:
    """Token rows -> one record batch with exactly `TOKEN_SCHEMA`."""
    return pa.RecordBatch.from_arrays(
        [
            pa.array([r["prompt_id"] for r in rows], pa.string()),
            _list_array([r["input_ids"] for r in rows], pa.int32()),
            _list_array([r["loss_mask"] for r in rows], pa.uint8()),
            pa.array([r["num_tokens"] for r in rows], pa.int32()),
            pa.array([r["num_loss_tokens"] for r in rows], pa.int32()),
            pa.array([r["truncated"] for r in rows], pa.bool_()),
            pa.array([r["turn"] for r in rows], pa.int32()),
        ],
        schema=TOKEN_SCHEMA,
    )


def _list_array(arrays: Sequence[np.ndarray], value_type: pa.DataType) -> pa.ListArray:
    """Concatenate per-record numpy arrays into one Arrow list array (no per-element Python objects)."""
    lengths = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))
    offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    np_type = value_type.to_pandas_dtype()
    values = np.concatenate(arrays).astype(np_type, copy=False) if arrays else np.zeros(0, np_type)
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values, value_type))
