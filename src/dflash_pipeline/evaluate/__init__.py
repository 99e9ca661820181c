"""Stage 6, eval: acceptance length (tau) from our speculative loop and from the serving engine.

The public face: each name is loaded lazily from the module that owns it (listed in ``_OWNERS``), so
importing the package costs nothing until a name is used."""

import importlib

_OWNERS = {
    "acceptance_stats": "acceptance",
    "checkpoint_info": "acceptance",
    "step_checkpoints": "acceptance",
    "training_prompt_ids": "acceptance",
    "load_eval_sets": "acceptance",
    "run_eval_set": "acceptance",
    "EvalSession": "acceptance",
    "open_session": "acceptance",
    "load_eval_drafter": "acceptance",
    "run_drafters": "acceptance",
    "run_checkpoint_series": "acceptance",
    "evaluate": "acceptance",
    "main": "acceptance",
    "VLLM_DRAFTS": "engine_acceptance",
    "VLLM_DRAFT_TOKENS": "engine_acceptance",
    "VLLM_ACCEPTED": "engine_acceptance",
    "VLLM_ACCEPTED_PER_POS": "engine_acceptance",
    "DISAGREEMENT_Z": "engine_acceptance",
    "EngineComparisonError": "engine_acceptance",
    "parse_prometheus": "engine_acceptance",
    "parse_prometheus_by_label": "engine_acceptance",
    "spec_counters": "engine_acceptance",
    "counters_delta": "engine_acceptance",
    "engine_acceptance_stats": "engine_acceptance",
    "default_metrics_url": "engine_acceptance",
    "server_acceptance": "engine_acceptance",
    "evaluate_engine": "engine_acceptance",
    "attach_engine_tau": "engine_acceptance",
    "compare_tau": "engine_acceptance",
    "SGLANG_NEEDS_URL": "sglang_engine",
    "histogram_acceptance_stats": "sglang_engine",
    "response_acceptance": "sglang_engine",
    "sglang_server_facts": "sglang_engine",
    "EvalComparisonError": "outputs",
    "check_comparable": "outputs",
    "merge_eval_records": "outputs",
    "TABLE_COLUMNS": "outputs",
    "eval_table_rows": "outputs",
    "write_eval_table": "outputs",
    "write_eval_outputs": "outputs",
    "plot_acceptance": "outputs",
    "read_train_log": "outputs",
    "plot_tau_vs_step": "outputs",
    "plot_validation": "outputs",
    "plot_training": "outputs",
    "SpecResult": "speculative",
    "TargetCache": "speculative",
    "speculative_generate": "speculative",
    "EngineError": "vllm_server",
    "dflash_speculative_config": "vllm_server",
    "free_port": "vllm_server",
    "http_get": "vllm_server",
    "VLLMServer": "vllm_server",
    "serve_commands": "vllm_server",
    "write_serve_md": "vllm_server",
    "loop_dtype": "vllm_server",
    "served_dtype_of_log": "vllm_server",
}

__all__ = sorted(_OWNERS)


def __getattr__(name):
    owner = _OWNERS.get(name)
    if owner is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{owner}"), name)


def __dir__():
    return sorted(set(globals()) | set(_OWNERS))
