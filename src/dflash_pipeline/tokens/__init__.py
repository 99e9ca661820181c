"""Stage 4, tokens: completion shards -> token shards with the target's chat template and assistant-only loss masks.

The public face: each name is loaded lazily from the module that owns it (listed in ``_OWNERS``), so
importing the package costs nothing until a name is used."""

import importlib

_OWNERS = {
    "mask_from_offsets": "loss_masks",
    "span_token_ranges": "loss_masks",
    "plain_text_tokenizer": "loss_masks",
    "tokenize_sequences": "loss_masks",
    "server_ids_sequence": "loss_masks",
    "log": "shard",
    "DROP_REASONS": "shard",
    "tokenizer_hash": "shard",
    "generated_texts": "shard",
    "tokenize_records": "shard",
    "tokenize_shard": "shard",
}

__all__ = sorted(_OWNERS)


def __getattr__(name):
    owner = _OWNERS.get(name)
    if owner is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{owner}"), name)


def __dir__():
    return sorted(set(globals()) | set(_OWNERS))
