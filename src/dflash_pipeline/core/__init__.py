"""The core every stage builds on: config and schemas, record contracts, atomic shard I/O, errors, the console, where
vLLM lives. It imports no other package of dflash_pipeline. Names load on first use
(`_OWNERS`: `core.faces.lazy_face`)."""

from dflash_pipeline.core.faces import lazy_face

_OWNERS = {
    "config": (
        "SCHEMA_PATH load_schema schema_problems normalize_numbers validate_config fill_defaults load_config"
        " deep_merge schema_default schema_defaults generation_problems resolve_path"
    ),
    "console": "CONSOLE_LOGGER CONSOLE_PREFIXES console",
    "contracts": (
        "PROBE_SCHEMA_VERSION PROMPT_SCHEMA_VERSION COMPLETION_SCHEMA_VERSION TOKEN_SCHEMA_VERSION"
        " EVAL_SCHEMA_VERSION CHECKPOINT_FORMAT_VERSION FEATURE_SCHEMA_VERSION PROMPT_ROLES CONVERSATION_ROLES"
        " MESSAGE_TYPE PROMPT_SCHEMA CONV_MESSAGE_TYPE TURN_TYPE COMPLETION_SCHEMA COMPLETION_STATUSES"
        " THINKING_MODES TOKEN_SCHEMA canonical_json prompt_id sha256_text MANIFEST_SCHEMA_VERSION"
        " COMPLETION_STATS_VERSION ManifestShard ManifestSource PromptManifest RunStats CompletionStats"
        " STATS_V1_RUN_KEYS run_stats EvalSetStats EvalDrafter EvalRecord CheckpointMeta PROMPT_TOOL_ROLES"
        " PROMPT_TOOL_MESSAGE_TYPE PROMPT_TOOLS_SCHEMA has_tools prompt_schema CONV_TOOL_MESSAGE_TYPE"
        " COMPLETION_TOOLS_SCHEMA TOOL_CALL_DIVERGED completion_schema TOOL_MESSAGE_FIELDS"
    ),
    "errors": "strip_url_credentials PipelineError ConfigError ProbeError ProbeRefusal DataError GenerationError TokenizationError",
    "procs": "die_with_parent free_port",
    "shards": (
        "atomic_write_bytes replace_dir write_tsv write_json read_json table_from_records write_parquet"
        " read_parquet read_shard_metadata ParquetStreamWriter"
    ),
    "vllm_env": "VLLM_PYTHON_ENV VLLMNotFound find_vllm_python require_vllm_python",
}

__getattr__, __dir__, __all__ = lazy_face(__name__, _OWNERS, globals)
