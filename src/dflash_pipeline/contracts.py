"""Record contracts between stages: one place for every schema (see DESIGN.md §2).

Each shard is a Parquet file whose Arrow schema is defined here, and whose file-level metadata carries
``schema_version`` plus stage-specific provenance (tokenizer hash, template hash, ...).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Iterable

import pyarrow as pa

PROBE_SCHEMA_VERSION = 1
PROMPT_SCHEMA_VERSION = 1
COMPLETION_SCHEMA_VERSION = 1
TOKEN_SCHEMA_VERSION = 2  # 2: + turn
EVAL_SCHEMA_VERSION = 1
CHECKPOINT_FORMAT_VERSION = 1
#: Feature shards (``results/features/{dataset}/{shard}.safetensors``): a safetensors file per token shard with
#: an offsets index, memory-mapped on read; tensors, dtypes and metadata in :mod:`dflash_pipeline.features.format`.
FEATURE_SCHEMA_VERSION = 1

#: Roles allowed in a normalized prompt conversation.
PROMPT_ROLES = ("system", "user")
#: Roles allowed in a completed conversation.
CONVERSATION_ROLES = ("system", "user", "assistant")

MESSAGE_TYPE = pa.struct([("role", pa.string()), ("content", pa.string())])

#: Prompt record: ``prompt_id`` (stable hash of the normalized messages, see :func:`prompt_id`),
#: ``dataset`` (config name of the source), ``messages`` (system + user turns only; assistant turns are
#: regenerated), ``metadata`` (JSON string of the source record's other fields).
PROMPT_SCHEMA = pa.schema(
    [
        ("prompt_id", pa.string()),
        ("dataset", pa.string()),
        ("messages", pa.list_(MESSAGE_TYPE)),
        ("metadata", pa.string()),
    ]
)

CONV_MESSAGE_TYPE = pa.struct(
    [("role", pa.string()), ("content", pa.string()), ("reasoning_content", pa.string())]
)
TURN_TYPE = pa.struct(
    [
        ("finish_reason", pa.string()),
        ("prompt_tokens", pa.int32()),
        ("completion_tokens", pa.int32()),
        ("prompt_token_ids", pa.list_(pa.int32())),
        ("output_token_ids", pa.list_(pa.int32())),
        ("latency_s", pa.float64()),
        ("endpoint", pa.string()),
    ]
)

#: Completion record: the regenerated conversation (``messages``: system/user as given, every assistant
#: turn produced by the target against the regenerated history), per assistant turn generation facts
#: (``turns``, same order as the assistant messages), the ``model`` name, ``sampling`` (JSON of the
#: sampling parameters), ``thinking`` mode (``none|save|disable``), ``status`` (``ok|truncated|error``)
#: and ``error`` (message, null unless status is error).
COMPLETION_SCHEMA = pa.schema(
    [
        ("prompt_id", pa.string()),
        ("dataset", pa.string()),
        ("messages", pa.list_(CONV_MESSAGE_TYPE)),
        ("turns", pa.list_(TURN_TYPE)),
        ("model", pa.string()),
        ("sampling", pa.string()),
        ("thinking", pa.string()),
        ("status", pa.string()),
        ("error", pa.string()),
    ]
)

COMPLETION_STATUSES = ("ok", "truncated", "error")
THINKING_MODES = ("none", "save", "disable")

#: Token record: ``input_ids`` int32 [num_tokens], ``loss_mask`` uint8 [num_tokens] (1 on tokens the
#: target generated incl. end-of-turn, 0 elsewhere), counts and the truncation flag. ``turn``: 0-based index
#: (among the conversation's assistant turns) of the last turn the row supervises; a conversation split into
#: several rows (templates that rewrite earlier turns, server token ids) has one row per distinct ``turn``,
#: in turn order.
TOKEN_SCHEMA = pa.schema(
    [
        ("prompt_id", pa.string()),
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.uint8())),
        ("num_tokens", pa.int32()),
        ("num_loss_tokens", pa.int32()),
        ("truncated", pa.bool_()),
        ("turn", pa.int32()),
    ]
)


def canonical_json(obj: Any) -> str:
    """Serialize ``obj`` deterministically (sorted keys, no whitespace, UTF-8 kept)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def prompt_id(messages: Iterable[dict]) -> str:
    """Stable id of a normalized conversation: sha256 over the canonical JSON of ``[{role, content}]``.

    Returns the first 24 hex chars (96 bits). The dataset name is *not* part of the hash, so the same
    prompt in two sources dedups to one record.
    """
    norm = [{"role": m["role"], "content": m["content"]} for m in messages]
    return hashlib.sha256(canonical_json(norm).encode("utf-8")).hexdigest()[:24]


def sha256_text(text: str) -> str:
    """Hex sha256 of a UTF-8 string (used for template and tokenizer hashes)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
