"""Record contracts between stages: one place for every schema (see DESIGN.md §2).

Each shard is a Parquet file whose Arrow schema is defined here, and whose file-level metadata carries
`schema_version` plus stage-specific provenance (tokenizer hash, template hash, ...).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Iterable, Mapping

import pyarrow as pa

PROBE_SCHEMA_VERSION = 1
PROMPT_SCHEMA_VERSION = 1
COMPLETION_SCHEMA_VERSION = 1
TOKEN_SCHEMA_VERSION = 2  # 2: + turn
EVAL_SCHEMA_VERSION = 1
CHECKPOINT_FORMAT_VERSION = 1
#: Feature shards (`results/features/{dataset}/{shard}.safetensors`): a safetensors file per token shard with
#: an offsets index, memory-mapped on read; tensors, dtypes and metadata in `features.format`.
FEATURE_SCHEMA_VERSION = 2  # 2: fp8 feature_scale per token per layer [N, K] (1: per token [N], still read)

#: Roles allowed in a normalized prompt conversation.
PROMPT_ROLES = ("system", "user")
#: Roles allowed in a normalized prompt conversation with tool calls: `assistant` only for a source turn that
#: called tools, `tool` for the tool results.
PROMPT_TOOL_ROLES = ("system", "user", "assistant", "tool")
#: Roles allowed in a completed conversation.
CONVERSATION_ROLES = ("system", "user", "assistant")

MESSAGE_TYPE = pa.struct([("role", pa.string()), ("content", pa.string())])

#: Prompt record: `prompt_id` (stable hash of the normalized messages, see `prompt_id`),
#: `dataset` (config name of the source), `messages` (system + user turns only; assistant turns are
#: regenerated), `metadata` (JSON string of the source record's other fields).
PROMPT_SCHEMA = pa.schema(
    [
        ("prompt_id", pa.string()),
        ("dataset", pa.string()),
        ("messages", pa.list_(MESSAGE_TYPE)),
        ("metadata", pa.string()),
    ]
)

#: The fields a message of a conversation with tool calls adds: `tool_calls` (JSON text of the OpenAI list
#: `[{id, type, function: {name, arguments}}]`, on assistant turns that called tools), `tool_call_id` and
#: `name` (on `tool` results).
TOOL_MESSAGE_FIELDS = (
    pa.field("tool_calls", pa.string()),
    pa.field("tool_call_id", pa.string()),
    pa.field("name", pa.string()),
)


def _with_tools(schema: pa.Schema, message_type: pa.StructType, *extra: pa.Field) -> pa.Schema:
    """`schema` with `messages` of `message_type` and the `extra` fields appended (the tool variants of a
    shard schema: the same columns in the same order, so a change to the base schema reaches both)."""
    i = schema.get_field_index("messages")
    out = schema.set(i, pa.field("messages", pa.list_(message_type)))
    for f in extra:
        out = out.append(f)
    return out


#: Prompt messages of a conversation with tool calls: `MESSAGE_TYPE` and `TOOL_MESSAGE_FIELDS`.
PROMPT_TOOL_MESSAGE_TYPE = pa.struct([*MESSAGE_TYPE, *TOOL_MESSAGE_FIELDS])
#: `PROMPT_SCHEMA` of a shard with tools or tool calls: messages of `PROMPT_TOOL_MESSAGE_TYPE` and `tools`
#: (canonical JSON text of the OpenAI `tools` list, null when none). Other shards keep `PROMPT_SCHEMA`.
PROMPT_TOOLS_SCHEMA = _with_tools(PROMPT_SCHEMA, PROMPT_TOOL_MESSAGE_TYPE, pa.field("tools", pa.string()))


def has_tools(record: Mapping[str, Any]) -> bool:
    """Whether a prompt or completion record offers tools or has a message with tool fields (a `tool` result,
    `tool_calls`, a `tool_call_id`)."""
    return bool(record.get("tools")) or any(
        m.get("tool_calls") or m.get("tool_call_id") or m.get("role") == "tool" for m in record.get("messages") or []
    )


def prompt_schema(records: Iterable[Mapping[str, Any]]) -> pa.Schema:
    """`PROMPT_TOOLS_SCHEMA` when a record has tools (`has_tools`), else `PROMPT_SCHEMA`."""
    return PROMPT_TOOLS_SCHEMA if any(has_tools(r) for r in records) else PROMPT_SCHEMA


CONV_MESSAGE_TYPE = pa.struct([("role", pa.string()), ("content", pa.string()), ("reasoning_content", pa.string())])
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

#: Completion record: the regenerated conversation (`messages`: system/user as given, every assistant
#: turn produced by the target against the regenerated history), per assistant turn generation facts
#: (`turns`, same order as the assistant messages), the `model` name, `sampling` (JSON of the
#: sampling parameters), `thinking` mode (`none|save|disable`), `status` (`ok|truncated|error`)
#: and `error` (message, null unless status is error).
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

#: Completion messages of a conversation with tool calls: `CONV_MESSAGE_TYPE` and `TOOL_MESSAGE_FIELDS`.
CONV_TOOL_MESSAGE_TYPE = pa.struct([*CONV_MESSAGE_TYPE, *TOOL_MESSAGE_FIELDS])
#: `COMPLETION_SCHEMA` of a shard that holds tool calls: messages of `CONV_TOOL_MESSAGE_TYPE`, `tools` (JSON
#: text of the function schemas, null when none) and `end_reason` (`tool_call_diverged`, or null;
#: docs/how-to/tool-calls.md). Shards without tool calls keep `COMPLETION_SCHEMA`, so their bytes never change.
COMPLETION_TOOLS_SCHEMA = _with_tools(
    COMPLETION_SCHEMA, CONV_TOOL_MESSAGE_TYPE, pa.field("tools", pa.string()), pa.field("end_reason", pa.string())
)
#: `end_reason` of a conversation that ends at a regenerated turn whose tool calls differ from the source's.
TOOL_CALL_DIVERGED = "tool_call_diverged"


def completion_schema(records: Iterable[dict]) -> pa.Schema:
    """`COMPLETION_TOOLS_SCHEMA` when a record offers tools or has a message with tool fields
    (`has_tools`), else `COMPLETION_SCHEMA`."""
    return COMPLETION_TOOLS_SCHEMA if any(has_tools(r) for r in records) else COMPLETION_SCHEMA


COMPLETION_STATUSES = ("ok", "truncated", "error")
THINKING_MODES = ("none", "save", "disable")

#: Token record: `input_ids` int32 [num_tokens], `loss_mask` uint8 [num_tokens] (1 on tokens the
#: target generated incl. end-of-turn, 0 elsewhere), counts and the truncation flag. `turn`: 0-based index
#: (among the conversation's assistant turns) of the last turn the row supervises; a conversation split into
#: several rows (templates that rewrite earlier turns, server token ids) has one row per distinct `turn`,
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
    """Serialize `obj` deterministically (sorted keys, no whitespace, UTF-8 kept)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


#: Message fields of a conversation with tool calls that enter `prompt_id` (when not null).
TOOL_MESSAGE_FIELDS = ("tool_calls", "tool_call_id", "name")


def prompt_id(messages: Iterable[Mapping[str, Any]], tools: str | None = None) -> str:
    """Stable id of a normalized conversation: sha256 over the canonical JSON of `[{role, content}]`, each
    message with its `TOOL_MESSAGE_FIELDS` that are not null, and with `tools` (the record's JSON text)
    `{"messages": [...], "tools": tools}`. A conversation without tools hashes as `[{role, content}]` alone.

    Returns the first 24 hex chars (96 bits). The dataset name is *not* part of the hash, so the same
    prompt in two sources dedups to one record.
    """
    norm = [
        {"role": m["role"], "content": m["content"], **{k: m[k] for k in TOOL_MESSAGE_FIELDS if m.get(k) is not None}}
        for m in messages
    ]
    payload: Any = {"messages": norm, "tools": tools} if tools else norm
    return hashlib.sha256(canonical_json(payload).encode("utf-8")).hexdigest()[:24]


def sha256_text(text: str) -> str:
    """Hex sha256 of a UTF-8 string (used for template and tokenizer hashes)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# --- end of the token-shard contract: what is above decides the bytes of a token shard (a change there
# that alters them bumps dflash_pipeline.workflow.policy.TOKENIZATION_REVISION, which re-tokenizes and retrains
# every workdir); the record shapes below decide none.
#
# The JSON records the stages write, typed, each with its `schema_version`.

from typing import Literal, TypedDict  # noqa: E402

# Keys only some records carry are declared in a `total=False` base class (`NotRequired` is 3.11+).

#: `results/prompts/manifest.json` (`PromptManifest`).
MANIFEST_SCHEMA_VERSION = 1
#: `results/completions/<dataset>/<shard>.stats.json` (`CompletionStats`). 2: the whole shard's counts at the
#: top level, this run's in `run`; 1 (no `stats_version`): this run's figures at the top level. Read `run` of
#: either with `run_stats`.
COMPLETION_STATS_VERSION = 2


class ManifestShard(TypedDict):
    """One prompt shard in the manifest (`path` relative to the manifest's directory)."""

    name: str  # "00000"
    path: str  # "<dataset>/00000.parquet"
    rows: int
    first_prompt_id: str
    last_prompt_id: str


class _ManifestSourceOptional(TypedDict, total=False):
    dropped_languages: dict[str, int]  # with a language filter: detected language -> count
    kept_with_special_token_text: int  # prompts.special_token_text: keep, when any was kept


class ManifestSource(_ManifestSourceOptional):
    """One prompt source (`datasets.<name>`) in the manifest."""

    config: dict  # path, format, max_prompts, fraction, strict, mapping (+ split, subset, languages, ...)
    read: int  # records read, malformed ones skipped with strict: false included
    kept: int
    dropped: dict[str, int]  # drop reason -> count
    skipped_examples: list[str]  # located examples, at most prompts.MAX_EXAMPLES per reason
    stopped_at_max_prompts: bool
    shards: list[ManifestShard]
    inactive_shards: list[str]  # shard files beyond the current count: on disk, not read downstream


class _PromptManifestOptional(TypedDict, total=False):
    special_token_text: str  # prompts.special_token_text when checked (drop | keep)


class PromptManifest(_PromptManifestOptional):
    """`results/prompts/manifest.json`, written by `prompts.build_prompt_shards`.

    Per source (`ManifestSource`), `skipped_examples` holds up to `prompts.MAX_EXAMPLES` located messages per drop
    reason; `inactive_shards` are its shard files beyond its current shard count, `inactive_datasets` the shard files of
    sources no longer configured: on disk, in no `shards` list. A source with a language filter also has
    `config.languages`, `config.min_language_confidence` and `dropped_languages`; `language_detector` is `"py3langid
    <version>"` when any source used it.
    """

    schema_version: int  # MANIFEST_SCHEMA_VERSION
    prompt_schema_version: int  # PROMPT_SCHEMA_VERSION of the shards
    seed: int
    shard_size: int
    max_prompt_tokens: int | None
    tokenizer: str | None
    languages: list[str] | None
    min_language_confidence: float
    language_detector: str | None  # "py3langid <version>" when a source used it
    total_prompts: int
    datasets: dict[str, ManifestSource]
    inactive_datasets: dict[str, list[str]]  # sources no longer configured -> their shard names on disk


class _RunStatsOptional(TypedDict, total=False):
    rate_limited: int  # openai: 429 answers
    endpoints: dict[str, dict[str, int]]  # openai: url -> attempts, failures, taken_out
    client_processes: int  # openai


class RunStats(_RunStatsOptional):
    """`run` of `CompletionStats`: the shard's last run. Conversations taken from the progress file (`resumed`) and
    sent (`generated`); the turns and tokens of those sent; `wall_s` (seconds of the call) and the rates; the backend's
    request counters of this run."""

    resumed: int
    generated: int
    turns: int
    prompt_tokens: int
    completion_tokens: int
    wall_s: float
    conversations_per_s: float | None
    requests_per_s: float | None
    output_tokens_per_s: float | None
    requests: int  # conversation turns sent (attempts less retries)
    attempts: int
    retries: int


class _CompletionStatsOptional(TypedDict, total=False):
    skipped: dict[str, int]  # reason (too_long) -> prompts never sent, not in the shard
    skipped_examples: dict[str, list[dict]]  # reason -> the first examples
    # only in the stats of a shard with tool conversations:
    tool_conversations: int
    ended_early: dict[str, int]  # reason (tool_call_diverged) -> conversations ended before the source's last turn
    ended_early_examples: dict[str, list[dict]]  # reason -> the first {prompt_id, turn}


class CompletionStats(_CompletionStatsOptional):
    """`<shard>.stats.json` (`stats_version` `COMPLETION_STATS_VERSION`), written by
    `completions.generate_shard`. Top level: the whole shard: prompts, status counts, turns, tokens,
    skips. `run`: the last run's figures (`RunStats`)."""

    stats_version: int  # COMPLETION_STATS_VERSION
    schema_version: int  # COMPLETION_SCHEMA_VERSION of the shard
    shard: str
    backend: Literal["transformers", "openai"]
    model: str | None
    prompts: int
    ok: int
    truncated: int
    error: int
    turns: int
    prompt_tokens: int
    completion_tokens: int
    run: RunStats


#: This run's keys a version-1 stats file holds at its top level (its `run` repeats some of them).
STATS_V1_RUN_KEYS = (
    "resumed",
    "generated",
    "wall_s",
    "conversations_per_s",
    "requests_per_s",
    "output_tokens_per_s",
    "requests",
    "attempts",
    "retries",
    "rate_limited",
    "endpoints",
    "client_processes",
)


def run_stats(stats: Mapping[str, Any]) -> dict:
    """The last run's figures (`RunStats` keys) of a completion stats file of any version: `run` of version 2; of
    version 1 its `run` with the `STATS_V1_RUN_KEYS` of its top level; of a file without a `run` block its top
    level. Keys a file lacks are absent ({} for `{}`, no stats file)."""
    if stats.get("stats_version", 1) >= 2:
        return dict(stats["run"])
    run = stats.get("run")
    keys = STATS_V1_RUN_KEYS if run is not None else STATS_V1_RUN_KEYS + ("turns", "prompt_tokens", "completion_tokens")
    return {**{k: stats[k] for k in keys if k in stats}, **(run or {})}


class EvalSetStats(TypedDict, total=False):
    """τ of one drafter on one eval set (`drafters.<label>.sets.<set>` of `EvalRecord`)."""

    tau: float  # mean acceptance length per response (reference/dflash.md §7)
    num_responses: int
    num_steps: int
    tokens_per_step: float
    tokens_per_target_forward: float
    histogram: list[int]  # counts of a+1 = 1..block_size
    num_conversations: int


class EvalDrafter(TypedDict, total=False):
    """One evaluated drafter (`trained`, a baseline label, or `untrained`)."""

    checkpoint: str | None
    train_steps: int
    zero_target_features: bool
    sets: dict[str, EvalSetStats]


class EvalRecord(TypedDict, total=False):
    """`results/eval/<run>/acceptance.json` (version `EVAL_SCHEMA_VERSION`), written by
    `evaluate.acceptance.evaluate`."""

    schema_version: int
    target: dict  # path, model_type, architectures
    settings: dict  # block_size, trained_block_size, max_new_tokens, temperature, thinking, seed, device, ...
    sets: dict[str, dict]  # per set: num_prompts, num_turns, excluded_training_prompts, ...
    drafters: dict[str, EvalDrafter]
    tau: dict[str, dict[str, float]]  # label -> set -> τ
    tau_over_untrained: dict[str, dict[str, float]]
    provenance: dict  # software, kernels, device, dtype, target digest (dflash_pipeline.core.provenance)


class CheckpointMeta(TypedDict, total=False):
    """`dflash_pipeline` block of a drafter checkpoint's `config.json` (format `CHECKPOINT_FORMAT_VERSION`, written
    by `drafter.model.save_drafter`."""

    format_version: int  # always written
    train_steps: int
    zero_target_features: bool


#: Fields of a target's `config.json` that state its context length in tokens, under the names families give it
#: (same meaning): the probe, the drafter's config and the feature server read the first one present.
CONTEXT_LENGTH_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "max_sequence_length",
    "model_max_length",
)
