"""The Snakemake side: params policy (what reruns a job), GPUs, accelerate launch topology, job logs.

The public face: each name is loaded lazily from the module that owns it (listed in ``_OWNERS``), so
importing the package costs nothing until a name is used."""

import importlib

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


def __getattr__(name):
    owner = _OWNERS.get(name)
    if owner is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{owner}"), name)


def __dir__():
    return sorted(set(globals()) | set(_OWNERS))
