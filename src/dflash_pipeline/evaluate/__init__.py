"""Stage 6, eval: acceptance length (tau) from our speculative loop and from the serving engine. Names load on first use
(`_OWNERS`: `core.faces.lazy_face`)."""

from dflash_pipeline.core.faces import lazy_face

_OWNERS = {
    "acceptance": (
        "acceptance_stats answer_eval_set eval_set_stats checkpoint_info step_checkpoints run_eval_set EvalSession"
        " open_session load_eval_drafter run_drafters run_checkpoint_series evaluate main"
    ),
    "eval_sets": "training_prompt_ids load_eval_sets long_set_token_counter",
    "context_length": "bucket_labels bucket_ranges length_buckets_of tau_by_context_length",
    "long_conversations": "build_long_conversations load_long_conversations",
    "engine_metrics": (
        "VLLM_DRAFTS VLLM_DRAFT_TOKENS VLLM_ACCEPTED VLLM_ACCEPTED_PER_POS EngineComparisonError parse_prometheus"
        " parse_prometheus_by_label spec_counters counters_delta engine_acceptance_stats"
    ),
    "engine_acceptance": "default_metrics_url server_acceptance evaluate_engine",
    "engine_vs_loop": "DISAGREEMENT_Z attach_engine_tau compare_tau",
    "sglang_engine": "SGLANG_NEEDS_URL histogram_acceptance_stats response_acceptance sglang_server_facts",
    "outputs": (
        "EvalComparisonError check_comparable merge_eval_records TABLE_COLUMNS eval_table_rows write_eval_table"
        " write_eval_outputs plot_acceptance read_train_log plot_tau_vs_step plot_validation plot_training"
    ),
    "speculative": "SpecResult TargetCache speculative_generate",
    "vllm_server": (
        "EngineError dflash_speculative_config free_port http_get VLLMServer serve_commands write_serve_md"
        " loop_dtype served_dtype_of_log"
    ),
}

__getattr__, __dir__, __all__ = lazy_face(__name__, _OWNERS, globals)
