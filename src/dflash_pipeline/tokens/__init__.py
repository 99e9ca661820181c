"""Stage 4, tokens: completion shards -> token shards with the target's chat template and assistant-only loss masks.
Names load on first use
(`_OWNERS`: `core.faces.lazy_face`)."""

from dflash_pipeline.core.faces import lazy_face

_OWNERS = {
    "loss_masks": "mask_from_offsets span_token_ranges plain_text_tokenizer tokenize_sequences server_ids_sequence",
    "shard": "log DROP_REASONS tokenizer_hash generated_texts tokenize_records tokenize_shard",
}

__getattr__, __dir__, __all__ = lazy_face(__name__, _OWNERS, globals)
