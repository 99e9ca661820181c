"""Shrinking a family's config to its twin's (`shrink_config`): the text decoder to `HIDDEN` wide and a
few layers, keeping what makes the family distinct (layer types, sliding windows of `SLIDING_WINDOW`
tokens, MoE, MLA, rope sections), and a vision tower to its smallest sizes. Used by
`testing.zoo.build_twin`."""

from __future__ import annotations

import copy
from typing import Optional

#: Width of every twin's decoder (heads × head_dim = 4 × 16).
HIDDEN = 64


#: Sliding window of twins with sliding layers (tokens): short, so eval prompts cross it.
SLIDING_WINDOW = 8


def _shrunk_layer_types(types: list[str]) -> list[str]:
    """Smallest prefix of `types` that repeats the family's pattern with every layer type in it,
    at least 4 layers (the target_layer_ids formula's minimum)."""
    kinds = set(types)
    n = next((i + 1 for i in range(len(types)) if set(types[: i + 1]) == kinds), len(types))
    n = max(n, 2)
    out = (types[:n] * (4 // n + 1))[: max(4, n)]
    return out


def _scale_sections(sections: list[int], total: int) -> list[int]:
    """Scale mrope sections to sum to `total` (each ≥ 0), remainder on the first."""
    s = sum(sections) or 1
    out = [int(x * total // s) for x in sections]
    out[0] += total - sum(out)
    return out


def shrink_text(t: dict) -> dict:
    """Shrink a decoder config dict in place of its sizes, keeping its structure (see module docstring)."""
    t = dict(t)
    t.pop("quantization_config", None)
    heads = t.get("num_attention_heads") or 4
    mha = t.get("num_key_value_heads") in (None, heads)
    t.update(hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=4 if mha else 2)
    if "head_dim" in t or "kv_lora_rank" not in t:
        t["head_dim"] = 16
    for k, v in (
        ("intermediate_size", 96),
        ("moe_intermediate_size", 32),
        ("shared_expert_intermediate_size", 32),
        ("global_head_dim", 32),
        ("num_global_key_value_heads", 1),
    ):
        if t.get(k):
            t[k] = v
    if t.get("shared_intermediate_size"):
        t["shared_intermediate_size"] = 32
    for k in ("n_routed_experts", "num_experts", "num_local_experts"):
        if isinstance(t.get(k), int) and t[k] > 1:
            t[k] = 4
    for k in ("num_experts_per_tok", "top_k_experts", "experts_per_token"):
        if isinstance(t.get(k), int):
            t[k] = min(t[k], 2)
    if "n_group" in t:
        t["n_group"], t["topk_group"] = 1, 1
    if t.get("first_k_dense_replace"):
        t["first_k_dense_replace"] = 1
    if "kv_lora_rank" in t:  # MLA
        t.update(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16)
        if t.get("q_lora_rank"):
            t["q_lora_rank"] = 24
        if "head_dim" in t and t.get("model_type") == "longcat_flash":  # its rotary reads head_dim: the rope part
            t["head_dim"] = t["qk_rope_head_dim"]
        else:
            t.pop("head_dim", None)
    for k, v in (
        ("linear_num_key_heads", 2),
        ("linear_num_value_heads", 4),
        ("linear_key_head_dim", 8),
        ("linear_value_head_dim", 8),
    ):
        if k in t:
            t[k] = v
    if t.get("rotary_dim"):  # MiniMax partial rotary: keep the fraction of head_dim
        t["rotary_dim"] = max(2, int(16 * t["rotary_dim"] / max(1, t.get("head_dim_orig", 128))) // 2 * 2)
    if t.get("sliding_window"):
        t["sliding_window"] = SLIDING_WINDOW
    for k in ("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_modules", "mtp_transformer_layers"):
        if k in t:
            t[k] = 0
    t.pop("use_mtp", None)
    if isinstance(t.get("mlp_only_layers"), list):
        t["mlp_only_layers"] = []
    n = 4
    if isinstance(t.get("layer_types"), list) and t["layer_types"]:
        t["layer_types"] = _shrunk_layer_types(t["layer_types"])
        n = len(t["layer_types"])
    elif isinstance(t.get("attn_type_list"), list):
        t["attn_type_list"] = _shrunk_layer_types([str(x) for x in t["attn_type_list"]])
        t["attn_type_list"] = [int(x) for x in t["attn_type_list"]]
        n = len(t["attn_type_list"])
    elif isinstance(t.get("full_attention_interval"), int):
        n = max(4, t["full_attention_interval"])
    t["num_hidden_layers"] = n
    if "max_window_layers" in t:
        t["max_window_layers"] = n
    rp = t.get("rope_parameters") or t.get("rope_scaling")
    if isinstance(rp, dict) and rp.get("mrope_section"):
        frac = rp.get("partial_rotary_factor") or t.get("partial_rotary_factor") or 1.0
        rp = dict(rp, mrope_section=_scale_sections(rp["mrope_section"], int(16 * frac) // 2))
        t["rope_parameters" if t.get("rope_parameters") else "rope_scaling"] = rp
    return t


_VISION_SIZES = {
    "depth": 1,
    "num_hidden_layers": 1,
    "vt_num_hidden_layers": 1,
    "hidden_size": 32,
    "vt_hidden_size": 32,
    "mm_hidden_size": 32,
    "intermediate_size": 64,
    "vt_intermediate_size": 64,
    "num_heads": 2,
    "num_attention_heads": 2,
    "vt_num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "global_head_dim": 16,
    "out_hidden_size": HIDDEN,
    "text_hidden_size": HIDDEN,
}


def shrink_vision(v: dict) -> dict:
    """Shrink a vision/audio tower config to one tiny layer (its projector maps to the twin's width)."""
    v = dict(v)
    v.pop("_attn_implementation", None)  # e.g. flash_attention_2: not on a CPU box
    for k, size in _VISION_SIZES.items():
        if isinstance(v.get(k), int):
            v[k] = size
    if any(k.startswith("vt_") for k in v):  # Kimi-K2.5 names: its config class reads the plain names
        v.update(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_hidden_layers=1)
    if isinstance(v.get("deepstack_visual_indexes"), list):
        v["deepstack_visual_indexes"] = [0] if v["deepstack_visual_indexes"] else []
    return v


def shrink_config(raw: dict, vocab_size: int, *, bos_id: Optional[int], eos_id: int, pad_id: Optional[int]) -> dict:
    """The twin's `config.json` dict from the real one (structure kept, sizes shrunk, vocab replaced)."""
    raw = copy.deepcopy(raw)
    raw.pop("quantization_config", None)
    ids = {"bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": pad_id}
    nested = isinstance(raw.get("text_config"), dict)
    for key in list(raw):
        if isinstance(raw[key], dict) and any(h in key for h in ("vision", "audio")):
            raw[key] = shrink_vision(raw[key])
    if nested:
        t = raw["text_config"]
        t["head_dim_orig"] = t.get("head_dim") or 128
        raw["text_config"] = shrink_text(t)
        raw["text_config"].pop("head_dim_orig", None)
        raw["text_config"].update(vocab_size=vocab_size, **ids)
        if "vocab_size_per_layer_input" in raw["text_config"]:
            raw["text_config"]["vocab_size_per_layer_input"] = vocab_size
        for k in (
            "image_token_id",
            "video_token_id",
            "audio_token_id",
            "vision_start_token_id",
            "vision_end_token_id",
            "boi_token_id",
            "eoi_token_id",
            "boa_token_id",
            "eoa_token_id",
            "eoa_token_index",
            "media_placeholder_token_id",
            "image_token_index",
        ):
            if isinstance(raw.get(k), int):
                raw[k] = vocab_size - 1  # never produced by the text tokenizer
        raw.update({k: v for k, v in ids.items() if k in raw})
    else:
        raw["head_dim_orig"] = raw.get("head_dim") or 128
        raw = shrink_text(raw)
        raw.pop("head_dim_orig", None)
        raw.update(vocab_size=vocab_size, **ids)
    return raw
