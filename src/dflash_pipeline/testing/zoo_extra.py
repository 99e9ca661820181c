"""Zoo twins of architectures the model corpus has no ``config.json`` for, built from transformers' own
config classes (``transformers.JambaConfig(...)`` …): a state-space hybrid (Jamba, Falcon-H1), a
short-convolution hybrid (LFM2), NoPE layers (SmolLM3), sparse-attention MLA (DeepSeek-V3.2), LongCat's
double-attention layers, an image-text wrapper one level deeper (Mistral-3 around Mistral). Each must
either run every zoo stage (train fp32/bf16, eval) or be refused at planning (the probe) with the
reason — never crash mid-run (``tests/unit/testing/test_zoo_extra.py``).

:func:`extra_source_dir` writes a corpus-style directory (``config.json`` from the class, the chat
template of :data:`EXTRA_FAMILIES`' template family) so :func:`dflash_pipeline.testing.zoo.build_twin`
shrinks and builds it like any corpus family.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

#: The tiny multi-head latent attention (low-rank q/kv) and routed-expert sizes the MLA twins share.
_TINY_MLA_MOE = {
    "kv_lora_rank": 16,
    "q_lora_rank": 24,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_routed_experts": 4,
}

#: name → (transformers config class, architecture, kwargs, corpus family whose chat template it renders).
EXTRA_FAMILIES: dict[str, tuple[str, str, dict, str]] = {
    "Jamba-twin": (
        "JambaConfig",
        "JambaForCausalLM",
        {
            "attn_layer_period": 2,
            "attn_layer_offset": 1,
            "expert_layer_period": 2,
            "expert_layer_offset": 1,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "mamba_d_state": 8,
            "mamba_d_conv": 4,
            "mamba_expand": 2,
            "use_mamba_kernels": False,
        },
        "Qwen3-8B",
    ),
    "FalconH1-twin": (
        "FalconH1Config",
        "FalconH1ForCausalLM",
        {
            "mamba_d_ssm": 64,
            "mamba_n_heads": 4,
            "mamba_d_head": 16,
            "mamba_n_groups": 1,
            "mamba_d_state": 8,
            "mamba_d_conv": 4,
            "mamba_chunk_size": 16,
        },
        "Qwen3-8B",
    ),
    "LFM2-twin": (
        "Lfm2Config",
        "Lfm2ForCausalLM",
        {
            "num_hidden_layers": 4,
            "layer_types": ["conv", "full_attention", "conv", "full_attention"],
            "conv_L_cache": 3,
            "tie_word_embeddings": False,
        },
        "Qwen3-8B",
    ),
    "SmolLM3-NoPE": (
        "SmolLM3Config",
        "SmolLM3ForCausalLM",
        {"no_rope_layer_interval": 2, "use_sliding_window": False, "tie_word_embeddings": False},
        "Qwen3-8B",
    ),
    "DeepSeek-V3.2-twin": (
        "DeepseekV32Config",
        "DeepseekV32ForCausalLM",
        {
            "num_hidden_layers": 4,
            **_TINY_MLA_MOE,
            "num_experts_per_tok": 2,
            "n_group": 1,
            "topk_group": 1,
            "first_k_dense_replace": 1,
            "index_n_heads": 2,
            "index_head_dim": 16,
            "index_topk": 8,
        },
        "DeepSeek-V3.1",
    ),
    "LongCat-Flash-twin": (
        "LongcatFlashConfig",
        "LongcatFlashForCausalLM",
        {
            **_TINY_MLA_MOE,
            "moe_topk": 2,
            "zero_expert_num": 2,
            "ffn_hidden_size": 96,
            "expert_ffn_hidden_size": 32,
        },
        "DeepSeek-V3.1",
    ),
    "Mistral3-twin": (
        "Mistral3Config",
        "Mistral3ForConditionalGeneration",
        {
            "text_config": {"model_type": "mistral", "num_hidden_layers": 4, "sliding_window": None},
            "vision_config": {"model_type": "pixtral"},
            "tie_word_embeddings": False,
        },
        "Llama-3.1-8B-Instruct",
    ),
}


#: Weight seed offsets per extra twin (none needed today). The extras untie their embeddings: a tied twin's
#: ×HEAD_SCALE head also scales its input embedding, and its greedy completions are then one whitespace
#: token repeated (no supervised token to train on: a property of the random weights, not the architecture).
TWIN_SEEDS: dict[str, int] = {}


def extra_config(name: str) -> dict:
    """The ``config.json`` dict of extra family ``name``, as its transformers config class writes it (plus
    ``architectures``). Sizes are then shrunk by the zoo like any corpus config.

    Raises:
        KeyError: not an extra family. AttributeError: this transformers has no such config class.
    """
    import transformers

    cls_name, arch, kwargs, _ = EXTRA_FAMILIES[name]
    cfg = getattr(transformers, cls_name)(**json.loads(json.dumps(kwargs)))
    raw = cfg.to_dict()
    raw["architectures"] = [arch]
    for k in ("transformers_version", "_name_or_path"):
        raw.pop(k, None)
    return raw


def extra_source_dir(models_dir: str | Path, name: str, out: str | Path) -> Path:
    """A corpus-style directory ``out/<name>`` for an extra family (config.json + the template family's chat
    template and tokenizer_config.json); returns ``out`` (the ``models_dir`` to build the twin from)."""
    from dflash_pipeline.testing.zoo_templates import family_template_text

    root = Path(out)
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(extra_config(name), indent=1) + "\n", encoding="utf-8")
    tmpl_family = EXTRA_FAMILIES[name][3]
    (d / "chat_template.jinja").write_text(family_template_text(models_dir, tmpl_family), encoding="utf-8")
    tc = Path(models_dir) / tmpl_family / "tokenizer_config.json"
    if tc.is_file():
        shutil.copyfile(tc, d / "tokenizer_config.json")
    return root
