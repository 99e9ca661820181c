"""The target model as the pipeline uses it: loading and dtype policy, chat templates and assistant spans, layer ids, the tapped hidden states.

The public face: each name is loaded lazily from the module that owns it (listed in ``_OWNERS``), so
importing the package costs nothing until a name is used."""

import importlib

_OWNERS = {
    "TOKENIZER_FILES": "chat",
    "tokenizer_files_missing": "chat",
    "THINKING_TEMPLATE_KWARGS": "chat",
    "template_kwargs": "chat",
    "template_messages": "chat",
    "load_tokenizer": "chat",
    "render_many": "chat",
    "render": "chat",
    "target_features": "hidden",
    "build_target_layer_ids": "layer_ids",
    "hf_hidden_state_index": "layer_ids",
    "validate_target_layer_ids": "layer_ids",
    "DTYPE_CHOICES": "loading",
    "TargetLoadError": "loading",
    "resolve_dtype": "loading",
    "module_dtype": "loading",
    "drafter_dtype": "loading",
    "to_drafter_dtype": "loading",
    "lm_head_logits": "loading",
    "load_target_config": "loading",
    "causal_lm_class": "loading",
    "text_config": "loading",
    "check_loadable": "loading",
    "load_target": "loading",
    "input_embeddings": "loading",
    "lm_head": "loading",
    "final_logit_softcap": "loading",
    "BareEmbedding": "loading",
    "num_decoder_layers": "loading",
    "hidden_states_of": "loading",
    "select_layers": "loading",
    "TrainSequence": "spans",
    "special_token_strings": "spans",
    "control_token_strings": "spans",
    "find_control_strings": "spans",
    "supervised_length": "spans",
    "render_messages": "spans",
    "conversation_sequences": "spans",
    "check_template": "spans",
}

__all__ = sorted(_OWNERS)


def __getattr__(name):
    owner = _OWNERS.get(name)
    if owner is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{owner}"), name)


def __dir__():
    return sorted(set(globals()) | set(_OWNERS))
