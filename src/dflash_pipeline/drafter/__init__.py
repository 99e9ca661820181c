"""The DFlash drafter: model, blocks (anchors, labels, decayed CE) and attention masks; the DFlash2 and
DSpark families (``drafter.family``, :mod:`.families`).

The public face: each name is loaded lazily from the module that owns it (listed in ``_OWNERS``), so
importing the package costs nothing until a name is used."""

import importlib

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
    "ARCHITECTURE": "model",
    "drafter_config_from_target": "model",
    "DraftContextCache": "model",
    "DFlashAttention": "model",
    "DFlashDecoderLayer": "model",
    "DFlashDrafter": "model",
    "save_drafter": "model",
    "load_drafter": "model",
    "count_parameters": "model",
    "FAMILIES": "families",
    "drafter_class": "families",
    "family_of": "families",
    "apply_family": "families",
    "DFlash2Drafter": "dflash2",
    "DSparkDrafter": "dspark",
}

__all__ = sorted(_OWNERS)


def __getattr__(name):
    owner = _OWNERS.get(name)
    if owner is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{owner}"), name)


def __dir__():
    return sorted(set(globals()) | set(_OWNERS))
