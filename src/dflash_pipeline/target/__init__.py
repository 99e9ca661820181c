"""The target model as the pipeline uses it: loading and dtype policy, chat templates and assistant spans, layer ids,
the tapped hidden states. Names load on first use
(`_OWNERS`: `core.faces.lazy_face`)."""

from dflash_pipeline.core.faces import lazy_face

_OWNERS = {
    "chat": (
        "TOKENIZER_FILES tokenizer_files_missing THINKING_TEMPLATE_KWARGS template_kwargs template_messages"
        " load_tokenizer render_many render"
    ),
    "hidden": "target_features",
    "layer_ids": "aux_hidden_state_ids build_target_layer_ids hf_hidden_state_index validate_target_layer_ids",
    "loading": (
        "DTYPE_CHOICES TargetLoadError resolve_dtype module_dtype drafter_dtype to_drafter_dtype lm_head_logits"
        " load_target_config causal_lm_class text_config check_loadable load_target input_embeddings lm_head"
        " final_logit_softcap BareEmbedding num_decoder_layers hidden_states_of select_layers stream_head collapse_streams"
    ),
    "spans": (
        "TrainSequence special_token_strings control_token_strings find_control_strings supervised_length"
        " render_messages conversation_sequences check_template"
    ),
}

__getattr__, __dir__, __all__ = lazy_face(__name__, _OWNERS, globals)
