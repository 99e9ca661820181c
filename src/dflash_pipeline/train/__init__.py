"""Stage 5, train: the drafter trained with Accelerate from the target's hidden states (online or feature shards). Names
load on first use
(`_OWNERS`: `core.faces.lazy_face`)."""

from dflash_pipeline.core.faces import lazy_face

_OWNERS = {
    "checkpoint": "STEP_EXPORT_PREFIX save_state resume_state export_module export_step export_drafter",
    "data": (
        "token_index_path build_token_index MappedRecords collate TrainingData ConfigOnly open_training_data"
        " record_prompt_ids"
    ),
    "fsdp": "TRAINING_BYTES_PER_PARAM WRAP_CLASSES training_bytes fsdp_plugin make_accelerator full_drafter",
    "heldout": (
        "AcceptanceCounts block_acceptance deterministic_anchors batch_acceptance heldout_acceptance heldout_mask"
    ),
    "loop": "RunData Schedule TrainRun run_steps trace_batch",
    "losses": "LOSSES LossOutput ce_decay slot_cross_entropy dpace_weights dpace teacher_slot_hidden kl compute_loss",
    "packing": (
        "pack_records PackedDataset collate_packed padded_segments anchor_candidates sample_packed_anchors Blocks"
        " packed_block_inputs_and_labels build_packed_block_mask build_packed_flex_block_mask"
        " build_packed_training_masks packed_target_features check_target_isolates_records"
    ),
    "run": "load_token_shards with_schema_defaults load_target train main",
    "step": "StepContext step_objective training_step",
    "rng": "STATE_VERSION RankStreams dataloader_config",
    "trackers": "TRACKERS resolve_trackers flat_hparams scalars progress_bar",
}

__getattr__, __dir__, __all__ = lazy_face(__name__, _OWNERS, globals)
