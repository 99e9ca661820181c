"""The Snakemake side: params policy (what reruns a job), GPUs, accelerate launch topology, job logs, and the
plan-time config problems of every stage (:mod:`.problems`). Names load on first use
(``_OWNERS``: :func:`dflash_pipeline.core.faces.lazy_face`)."""

from dflash_pipeline.core.faces import lazy_face

_OWNERS = {
    "accelerate_launch_args": "policy",
    "job_label": "policy",
    "first_slurm_host": "policy",
    "LaunchTopology": "policy",
    "launch_topology": "policy",
    "run_accelerate": "policy",
    "log_to": "policy",
    "tee_log": "policy",
    "GPU_RULES": "policy",
    "job_gpus": "policy",
    "claim_gpus": "policy",
    "run_with_gpus": "policy",
    "GENERATION_OUTPUT_KEYS": "policy",
    "BASELINE_TRAIN_FLAGS": "policy",
    "canonical": "policy",
    "as_json": "policy",
    "generation_output_params": "policy",
    "baseline_runs": "policy",
    "baseline_train_flags": "policy",
    "TOKENIZATION_REVISION": "policy",
    "problems": "problems",
    "cross_field_problems": "problems",
    "training_problems": "problems",
    "language_block_problems": "problems",
    "LEFT_OUT_AT_DEFAULT": "policy",
    "without_new_defaults": "policy",
    "DEMO_TARGET_DIR": "keyed_paths",
    "params_digest": "keyed_paths",
    "recorded_demo_params": "keyed_paths",
    "demo_target_dir": "keyed_paths",
    "embedded_demo_settings": "keyed_paths",
    "probe_matches": "keyed_paths",
    "probe_record_path": "keyed_paths",
}

__all__ = sorted(_OWNERS)

__getattr__, __dir__ = lazy_face(__name__, _OWNERS, globals)
