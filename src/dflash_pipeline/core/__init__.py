"""The core every stage builds on: config and schemas, record contracts, atomic shard I/O, errors, the console, where vLLM lives. It imports no other package of dflash_pipeline.

The public face: each name is loaded lazily from the module that owns it (listed in ``_OWNERS``), so
importing the package costs nothing until a name is used."""

import importlib

_OWNERS = {
    "SCHEMA_PATH": "config",
    "load_schema": "config",
    "schema_problems": "config",
    "normalize_numbers": "config",
    "validate_config": "config",
    "fill_defaults": "config",
    "load_config": "config",
    "deep_merge": "config",
    "schema_default": "config",
    "schema_defaults": "config",
    "generation_problems": "config",
    "resolve_path": "config",
    "CONSOLE_LOGGER": "console",
    "CONSOLE_PREFIXES": "console",
    "console": "console",
    "PROBE_SCHEMA_VERSION": "contracts",
    "PROMPT_SCHEMA_VERSION": "contracts",
    "COMPLETION_SCHEMA_VERSION": "contracts",
    "TOKEN_SCHEMA_VERSION": "contracts",
    "EVAL_SCHEMA_VERSION": "contracts",
    "CHECKPOINT_FORMAT_VERSION": "contracts",
    "FEATURE_SCHEMA_VERSION": "contracts",
    "PROMPT_ROLES": "contracts",
    "CONVERSATION_ROLES": "contracts",
    "MESSAGE_TYPE": "contracts",
    "PROMPT_SCHEMA": "contracts",
    "CONV_MESSAGE_TYPE": "contracts",
    "TURN_TYPE": "contracts",
    "COMPLETION_SCHEMA": "contracts",
    "COMPLETION_STATUSES": "contracts",
    "THINKING_MODES": "contracts",
    "TOKEN_SCHEMA": "contracts",
    "canonical_json": "contracts",
    "prompt_id": "contracts",
    "sha256_text": "contracts",
    "MANIFEST_SCHEMA_VERSION": "contracts",
    "COMPLETION_STATS_VERSION": "contracts",
    "ManifestShard": "contracts",
    "ManifestSource": "contracts",
    "PromptManifest": "contracts",
    "RunStats": "contracts",
    "CompletionStats": "contracts",
    "STATS_V1_RUN_KEYS": "contracts",
    "run_stats": "contracts",
    "EvalSetStats": "contracts",
    "EvalDrafter": "contracts",
    "EvalRecord": "contracts",
    "CheckpointMeta": "contracts",
    "strip_url_credentials": "errors",
    "PipelineError": "errors",
    "ConfigError": "errors",
    "ProbeError": "errors",
    "DataError": "errors",
    "GenerationError": "errors",
    "TokenizationError": "errors",
    "atomic_write_bytes": "shards",
    "replace_dir": "shards",
    "write_tsv": "shards",
    "write_json": "shards",
    "read_json": "shards",
    "table_from_records": "shards",
    "write_parquet": "shards",
    "read_parquet": "shards",
    "read_shard_metadata": "shards",
    "ParquetStreamWriter": "shards",
    "VLLM_PYTHON_ENV": "vllm_env",
    "VLLMNotFound": "vllm_env",
    "find_vllm_python": "vllm_env",
    "require_vllm_python": "vllm_env",
}

__all__ = sorted(_OWNERS)


def __getattr__(name):
    owner = _OWNERS.get(name)
    if owner is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{owner}"), name)


def __dir__():
    return sorted(set(globals()) | set(_OWNERS))
