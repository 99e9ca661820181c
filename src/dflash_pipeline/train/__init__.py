"""Stage 5, train: the drafter trained with Accelerate from the target's hidden states (online or feature shards).

The public face: each name is loaded lazily from the module that owns it (listed in ``_OWNERS``), so
importing the package costs nothing until a name is used."""

import importlib

_OWNERS = {
    "STEP_EXPORT_PREFIX": "checkpoint",
    "save_state": "checkpoint",
    "resume_state": "checkpoint",
    "export_module": "checkpoint",
    "export_step": "checkpoint",
    "export_drafter": "checkpoint",
    "token_index_path": "data",
    "build_token_index": "data",
    "MappedRecords": "data",
    "collate": "data",
    "TrainingData": "data",
    "ConfigOnly": "data",
    "open_training_data": "data",
    "record_prompt_ids": "data",
    "TRAINING_BYTES_PER_PARAM": "fsdp",
    "WRAP_CLASSES": "fsdp",
    "training_bytes": "fsdp",
    "fsdp_plugin": "fsdp",
    "make_accelerator": "fsdp",
    "full_drafter": "fsdp",
    "AcceptanceCounts": "heldout",
    "block_acceptance": "heldout",
    "deterministic_anchors": "heldout",
    "batch_acceptance": "heldout",
    "heldout_acceptance": "heldout",
    "heldout_mask": "heldout",
    "RunData": "loop",
    "Schedule": "loop",
    "TrainRun": "loop",
    "run_steps": "loop",
    "trace_batch": "loop",
    "LOSSES": "losses",
    "LossOutput": "losses",
    "ce_decay": "losses",
    "slot_cross_entropy": "losses",
    "dpace_weights": "losses",
    "dpace": "losses",
    "teacher_slot_hidden": "losses",
    "kl": "losses",
    "compute_loss": "losses",
    "pack_records": "packing",
    "PackedDataset": "packing",
    "collate_packed": "packing",
    "padded_segments": "packing",
    "anchor_candidates": "packing",
    "sample_packed_anchors": "packing",
    "Blocks": "packing",
    "packed_block_inputs_and_labels": "packing",
    "build_packed_block_mask": "packing",
    "build_packed_flex_block_mask": "packing",
    "build_packed_training_masks": "packing",
    "packed_target_features": "packing",
    "check_target_isolates_records": "packing",
    "load_token_shards": "run",
    "with_schema_defaults": "run",
    "load_target": "run",
    "build_drafter": "run",
    "train": "run",
    "main": "run",
    "StepContext": "step",
    "step_objective": "step",
    "training_step": "step",
    "STATE_VERSION": "rng",
    "RankStreams": "rng",
    "dataloader_config": "rng",
    "TRACKERS": "trackers",
    "resolve_trackers": "trackers",
    "flat_hparams": "trackers",
    "scalars": "trackers",
    "progress_bar": "trackers",
}

__all__ = sorted(_OWNERS)


def __getattr__(name):
    owner = _OWNERS.get(name)
    if owner is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{owner}"), name)


def __dir__():
    return sorted(set(globals()) | set(_OWNERS))
