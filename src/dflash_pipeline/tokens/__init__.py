"""Stage 4, tokens: completion shards -> token shards with the target's chat template and assistant-only loss masks. Names load on first use
(``_OWNERS``: :func:`dflash_pipeline.core.faces.lazy_face`)."""

from dflash_pipeline.core.faces import lazy_face

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

__getattr__, __dir__ = lazy_face(__name__, _OWNERS, globals)
