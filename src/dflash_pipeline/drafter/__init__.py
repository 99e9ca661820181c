"""The DFlash drafter: model, blocks (anchors, labels, decayed CE) and attention masks; the drafter families
(`drafter.family`: `.dflash`, `.dflash2`, `.dspark`, asked through the registry `.families`; the models of the
last two in `.dflash2_model`, `.dspark_model`). Names load
on first use
(`_OWNERS`: `core.faces.lazy_face`)."""

from dflash_pipeline.core.faces import lazy_face

_OWNERS = {
    "attention_masks": (
        "build_block_mask build_flex_block_mask build_training_masks masks_per_layer_type build_inference_sliding_mask"
    ),
    "blocks": (
        "LossOutput AnchorBatch sample_anchors loss_decay_gamma block_inputs_and_labels decayed_cross_entropy"
        " loss_normalizer slot_accuracy expected_acceptance_length cosine_with_warmup"
    ),
    "config": "ARCHITECTURE DFlashConfig checkpoint_meta",
    "block_size": "BlockSizeError check_block_size resolve_block_size",
    "build": "build_drafter load_drafter",
    "model": (
        "drafter_config_from_target DraftContextCache DFlashAttention DFlashDecoderLayer DFlashDrafter"
        " save_drafter count_parameters"
    ),
    "families": "register get of_drafter of_config of_checkpoint load_config",
    "dflash": "DFlashFamily",
    "dflash2": "DFlash2Family",
    "dflash2_model": "DFlash2Drafter DFlash2Config",
    "dspark": "DSparkFamily",
    "dspark_model": "DSparkDrafter DSparkConfig",
}

__getattr__, __dir__, __all__ = lazy_face(__name__, _OWNERS, globals)
