"""The DFlash drafter: model, blocks (anchors, labels, decayed CE) and attention masks; the DFlash2 and
DSpark families (``drafter.family``, :mod:`.families`). Names load on first use
(``_OWNERS``: :func:`dflash_pipeline.core.faces.lazy_face`)."""

from dflash_pipeline.core.faces import lazy_face

_OWNERS = {
    "build_block_mask": "attention_masks",
    "build_flex_block_mask": "attention_masks",
    "build_training_masks": "attention_masks",
    "masks_per_layer_type": "attention_masks",
    "build_inference_sliding_mask": "attention_masks",
    "AnchorBatch": "blocks",
    "sample_anchors": "blocks",
    "loss_decay_gamma": "blocks",
    "block_inputs_and_labels": "blocks",
    "decayed_cross_entropy": "blocks",
    "loss_normalizer": "blocks",
    "slot_accuracy": "blocks",
    "expected_acceptance_length": "blocks",
    "cosine_with_warmup": "blocks",
    "ARCHITECTURE": "config",
    "DFlashConfig": "config",
    "checkpoint_meta": "config",
    "BlockSizeError": "block_size",
    "check_block_size": "block_size",
    "resolve_block_size": "block_size",
    "build_drafter": "build",
    "drafter_config_from_target": "model",
    "DraftContextCache": "model",
    "DFlashAttention": "model",
    "DFlashDecoderLayer": "model",
    "DFlashDrafter": "model",
    "save_drafter": "model",
    "load_drafter": "build",
    "count_parameters": "model",
    "FAMILIES": "families",
    "drafter_class": "families",
    "family_of": "families",
    "apply_family": "families",
    "DFlash2Drafter": "dflash2",
    "DSparkDrafter": "dspark",
}

__all__ = sorted(_OWNERS)

__getattr__, __dir__ = lazy_face(__name__, _OWNERS, globals)
