"""The Snakemake side: params policy (what reruns a job), GPUs, accelerate launch topology, job logs, and the
plan-time config problems of every stage (`.problems`). Names load on first use
(`_OWNERS`: `core.faces.lazy_face`)."""

from dflash_pipeline.core.faces import lazy_face

_OWNERS = {
    "policy": (
        "accelerate_launch_args job_label first_slurm_host LaunchTopology launch_topology run_accelerate log_to"
        " tee_log GPU_RULES job_gpus claim_gpus run_with_gpus GENERATION_OUTPUT_KEYS BASELINE_TRAIN_FLAGS"
        " canonical as_json generation_output_params baseline_runs baseline_train_flags TOKENIZATION_REVISION"
        " LEFT_OUT_AT_DEFAULT without_new_defaults"
    ),
    "problems": "problems cross_field_problems training_problems language_block_problems",
    "keyed_paths": (
        "DEMO_TARGET_DIR params_digest recorded_demo_params demo_target_dir embedded_demo_settings probe_matches"
        " probe_record_path"
    ),
}

__getattr__, __dir__, __all__ = lazy_face(__name__, _OWNERS, globals)
