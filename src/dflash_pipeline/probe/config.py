"""config.json normalisation: the text model's sizes, attention (MHA/GQA/MLA), MoE, layer types, rope.

`_probe_config` finds the text config (top level or nested: `text_config`, `thinker_config.text_config`
…), reads each field under its several names (then the top level, then `AutoConfig`'s default) and
records where each value came from. Also the embedding's rows from the safetensors header and the eos ids
of `generation_config.json`.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from dflash_pipeline.core.errors import ProbeError
from dflash_pipeline.probe.checks import CONTEXT_LENGTH_KEYS, architecture_refusal, block_type_count

#: Keys under which multimodal / wrapper configs keep the language model's config, in search order.
TEXT_CONFIG_KEYS = (
    "text_config",
    "language_config",
    "llm_config",
    "thinker_config",
    "language_model",
    "text_model",
    "lm_config",
    "decoder",
    "decoder_config",
    "model_config",
)
#: Sub-config keys never searched for the text model (they carry their own hidden_size / layer counts).
_NON_TEXT_HINTS = (
    "vision",
    "visual",
    "audio",
    "speech",
    "image",
    "video",
    "quantization",
    "encoder",
    "talker",
    "code2wav",
    "projector",
    "rope_scaling",
    "rope_parameters",
)

_ALIASES = {
    "hidden_size": ("hidden_size", "n_embd", "d_model", "dim", "embed_dim"),
    "num_hidden_layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "layers"),
    "num_attention_heads": ("num_attention_heads", "n_head", "num_heads", "n_heads", "attention_heads"),
    "num_key_value_heads": ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num"),
    "max_position_embeddings": CONTEXT_LENGTH_KEYS,
}
#: MoE expert-count keys seen in the wild → normalized `num_experts`.
EXPERT_COUNT_KEYS = ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts", "n_experts")
#: MoE routing top-k keys → normalized `num_experts_per_tok`.
EXPERTS_PER_TOKEN_KEYS = (
    "num_experts_per_tok",
    "experts_per_token",
    "top_k_experts",
    "moe_topk",
    "moe_k",
    "num_selected_experts",
)


# --- config.json


def _find_text_config(cfg: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]]:
    """Return `(path, sub_config)` of the language model's config: `""` for the top level, else a
    dotted key path such as `"text_config"` or `"thinker_config.text_config"`."""

    def has_core(d: Mapping[str, Any]) -> bool:
        layers = _first(d, _ALIASES["num_hidden_layers"]) if block_type_count(d)[1] is None else True
        return _first(d, _ALIASES["hidden_size"]) is not None and layers is not None

    if has_core(cfg):
        return "", cfg
    frontier: list[tuple[str, Mapping[str, Any]]] = [("", cfg)]
    for _depth in range(3):
        nxt: list[tuple[str, Mapping[str, Any]]] = []
        for prefix, d in frontier:
            keys = [k for k in TEXT_CONFIG_KEYS if isinstance(d.get(k), Mapping)]
            keys += [
                k
                for k, v in d.items()
                if isinstance(v, Mapping) and k not in keys and not any(h in k.lower() for h in _NON_TEXT_HINTS)
            ]
            for k in keys:
                path = f"{prefix}.{k}" if prefix else k
                if has_core(d[k]):
                    return path, d[k]
                nxt.append((path, d[k]))
        frontier = nxt
    raise ProbeError(
        "config.json has no language-model config: looked for hidden_size and num_hidden_layers at the top "
        f"level and under {', '.join(TEXT_CONFIG_KEYS)} (and other non-vision sub-configs)"
    )


def _first(d: Mapping[str, Any], keys: Sequence[str]) -> Any:
    for k in keys:
        if d.get(k) is not None:
            return d[k]
    return None


def _first_key(d: Mapping[str, Any], keys: Sequence[str]) -> tuple[str | None, Any]:
    for k in keys:
        if d.get(k) is not None:
            return k, d[k]
    return None, None


def _try_autoconfig(target_dir: Path, trust_remote_code: bool) -> tuple[Any, str | None]:
    """`(config, None)` when `AutoConfig` loads the directory offline, else `(None, reason)`."""
    try:
        from transformers import AutoConfig
        from transformers.utils import logging as hf_logging

        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        try:
            cfg = AutoConfig.from_pretrained(
                str(target_dir), trust_remote_code=trust_remote_code, local_files_only=True
            )
        finally:
            hf_logging.set_verbosity(verbosity)
        return cfg, None
    except Exception as exc:  # noqa: BLE001 - any failure means "use the raw JSON"
        msg = " ".join(str(exc).split())
        return None, f"{type(exc).__name__}: {msg[:300]}"


def _auto_text_config(auto_cfg: Any) -> Any:
    if auto_cfg is None:
        return None
    try:
        return auto_cfg.get_text_config()
    except Exception:  # noqa: BLE001
        return auto_cfg


def _derive_layer_types(text: Mapping[str, Any], n_layers: int, auto_text: Any) -> tuple[list[str] | None, str | None]:
    lt = text.get("layer_types")
    if isinstance(lt, list) and lt:
        return [str(x) for x in lt], "config.layer_types"
    atl = text.get("attn_type_list")
    if isinstance(atl, list) and atl:  # MiniMax: 1 = softmax (full) attention, 0 = linear (lightning)
        return ["full_attention" if int(x) == 1 else "linear_attention" for x in atl], "config.attn_type_list"
    interval = text.get("full_attention_interval")
    if isinstance(interval, int) and interval > 0:  # Qwen3-Next: every interval-th layer is full attention
        return (
            ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)],
            "derived from config.full_attention_interval",
        )
    auto_lt = getattr(auto_text, "layer_types", None) if auto_text is not None else None
    if isinstance(auto_lt, list) and auto_lt:
        return [str(x) for x in auto_lt], "AutoConfig.layer_types"
    return None, None


def text_hidden_size(target_dir: str | Path) -> int:
    """Hidden size H of the target's language model from `<target_dir>/config.json`, read as the probe reads it:
    plan-time sizing before the probe record exists (the features stage's disk check).

    Raises:
        ProbeError: no `config.json`, or no language-model config in it.
    """
    raw = _read_config_json(Path(target_dir) / "config.json")
    return int(_first(_find_text_config(raw)[1], _ALIASES["hidden_size"]))


def _read_config_json(path: Path) -> dict:
    """`config.json` as a dict; ProbeError (naming the file and the fix) when missing or not an object."""
    if not path.is_file():
        raise ProbeError(f"{path}: not found; `target.path` must be a model directory with config.json")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ProbeError(f"{path}: not readable JSON ({exc}); fix or replace the file") from None
    if not isinstance(raw, dict):
        raise ProbeError(f"{path}: top level is {type(raw).__name__}, expected a JSON object")
    return raw


def _attention_facts(text: Mapping[str, Any], pick, hidden: Any, heads: Any, kv_heads: Any) -> tuple[dict, Any, Any]:
    """`(attention record, head_dim, head_dim source)`: MLA (kv_lora_rank), else MHA/GQA, plus the
    sliding-window / bias / output-gate / partial-rotary fields the config states."""
    kv_lora = text.get("kv_lora_rank")
    if kv_lora is not None:
        nope, rope_d = text.get("qk_nope_head_dim"), text.get("qk_rope_head_dim")
        attention = {
            "kind": "MLA",
            "kv_lora_rank": kv_lora,
            "q_lora_rank": text.get("q_lora_rank"),
            "qk_nope_head_dim": nope,
            "qk_rope_head_dim": rope_d,
            "v_head_dim": text.get("v_head_dim"),
        }
        head_dim = (nope or 0) + (rope_d or 0) or None
        head_dim_src = "qk_nope_head_dim + qk_rope_head_dim (MLA query/key head dim)"
    else:
        attention = {"kind": "MHA" if kv_heads == heads else "GQA"}
        head_dim, head_dim_src = pick("head_dim")
        if head_dim is None and hidden and heads:
            head_dim, head_dim_src = hidden // heads, "hidden_size // num_attention_heads"
    for key in ("sliding_window", "attention_bias", "attn_output_gate", "partial_rotary_factor"):
        if text.get(key) is not None:
            attention[key] = text[key]
    return attention, head_dim, head_dim_src


def _moe_facts(text: Mapping[str, Any]) -> dict | None:
    """Normalized MoE fields (expert count, top-k, shared experts …), None for a dense model."""
    ek, n_exp = _first_key(text, EXPERT_COUNT_KEYS)
    tk, topk = _first_key(text, EXPERTS_PER_TOKEN_KEYS)
    if not (isinstance(n_exp, int) and n_exp > 1):
        return None
    moe = {
        "num_experts": n_exp,
        "num_experts_source": ek,
        "num_experts_per_tok": topk,
        "num_experts_per_tok_source": tk,
        "num_shared_experts": text.get("n_shared_experts"),
        "moe_intermediate_size": text.get("moe_intermediate_size"),
        "first_k_dense_replace": text.get("first_k_dense_replace"),
    }
    if text.get("shared_expert_intermediate_size"):
        moe["shared_expert_intermediate_size"] = text["shared_expert_intermediate_size"]
    return moe


def _rope_facts(text: Mapping[str, Any]) -> dict:
    """`{theta, type, scaling, parameters}`; theta per layer type when the config has one per type (Gemma)."""
    rope_params = text.get("rope_parameters")
    rope_scaling = text.get("rope_scaling")
    theta = text.get("rope_theta")
    rope_type = None
    if isinstance(rope_params, Mapping):
        if theta is None and "rope_theta" in rope_params:
            theta = rope_params["rope_theta"]
        elif theta is None and all(isinstance(v, Mapping) for v in rope_params.values()):
            theta = {k: v.get("rope_theta") for k, v in rope_params.items()}  # per layer type (Gemma)
        rope_type = rope_params.get("rope_type") if isinstance(rope_params.get("rope_type"), str) else None
    if isinstance(rope_scaling, Mapping):
        rope_type = rope_scaling.get("rope_type") or rope_scaling.get("type") or rope_type
    return {"theta": theta, "type": rope_type or "default", "scaling": rope_scaling, "parameters": rope_params}


def _tie_facts(raw: Mapping[str, Any], text_path: str, text: Mapping[str, Any], auto_cfg: Any) -> tuple[Any, Any]:
    """`(tie_word_embeddings, source)` from the text config, the top level, else AutoConfig's default."""
    for where, d in ((text_path, text), ("", raw)):
        if d.get("tie_word_embeddings") is not None:
            return bool(d["tie_word_embeddings"]), (f"{where}.tie_word_embeddings" if where else "tie_word_embeddings")
    if auto_cfg is not None:
        return bool(getattr(auto_cfg, "tie_word_embeddings", False)), "AutoConfig default"
    return None, None


def _eos_list(v: Any) -> list[int]:
    if v is None:
        return []
    return [int(x) for x in (v if isinstance(v, list) else [v])]


#: `pick(name, keys=None, *, top_fallback=True) -> (value, source)`: see `_picker`.
Picker = Callable[..., "tuple[Any, str | None]"]


def _picker(raw: Mapping[str, Any], text_path: str, text: Mapping[str, Any], auto_text: Any) -> Picker:
    """A lookup of one config field by its aliases: the text config first, then (`top_fallback`, for a
    nested text config) the top level, then `AutoConfig`'s default. `pick` returns `(value, source)`,
    the source a key path (`"text_config.num_experts"`) or `"AutoConfig default (name)"`; `(None,
    None)` when nothing states the field."""

    def pick(name: str, keys: Sequence[str] | None = None, *, top_fallback: bool = True) -> tuple[Any, str | None]:
        keys = keys or _ALIASES.get(name, (name,))
        k, v = _first_key(text, keys)
        if v is not None:
            return v, f"{text_path + '.' if text_path else ''}{k}"
        if top_fallback and text_path:
            k, v = _first_key(raw, keys)
            if v is not None:
                return v, k
        if auto_text is not None and getattr(auto_text, name, None) is not None:
            return getattr(auto_text, name), f"AutoConfig default ({name})"
        return None, None

    return pick


def _size_facts(
    path: Path, text_path: str, text: Mapping[str, Any], pick: Picker, auto_text: Any, warnings: list[str]
) -> dict:
    """`hidden_size`, `num_hidden_layers`, `vocab_size` (as the config states it), the attention heads and KV heads
    with the KV heads' source, in the record's key order.

    `num_hidden_layers` is the number of decoder layers transformers builds: the config's count, else the length of its
    per-layer block list; when `AutoConfig` (`auto_text`) builds a different number, its count, with a warning appended
    to `warnings`.

    Raises:
        ProbeError: no `vocab_size` (names the file and where it looked).
    """
    hidden, _ = pick("hidden_size")
    n_layers, n_layers_src = pick("num_hidden_layers")
    if n_layers is None or (n_layers_src or "").startswith("AutoConfig"):
        src, count = block_type_count(text)
        n_layers, n_layers_src = (count, src) if count is not None else (n_layers, n_layers_src)
    built = getattr(auto_text, "num_hidden_layers", None) if auto_text is not None else None
    if isinstance(built, int) and isinstance(n_layers, int) and built != n_layers:
        # the layers transformers builds (Dory's config.json counts attention and MLP blocks as layers)
        warnings.append(
            f"config.json states {n_layers} layers ({n_layers_src}), transformers builds {built} "
            f"({type(auto_text).__name__}.num_hidden_layers): using {built}"
        )
        n_layers, n_layers_src = built, f"AutoConfig ({type(auto_text).__name__}.num_hidden_layers)"
    vocab, _ = pick("vocab_size", top_fallback=True)
    if vocab is None:
        raise ProbeError(f"{path}: no vocab_size at {text_path or 'the top level'}; the config is unusable")
    heads, _ = pick("num_attention_heads")
    kv_heads, kv_src = pick("num_key_value_heads")
    if kv_heads is None and heads is not None:
        kv_heads, kv_src = heads, "default (= num_attention_heads)"
    return {
        "hidden_size": hidden,
        "num_hidden_layers": n_layers,
        "vocab_size": vocab,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "num_key_value_heads_source": kv_src,
    }


def _config_source(auto_cfg: Any, auto_err: str | None) -> dict:
    """`{file, loader, autoconfig_error, autoconfig_class}`: whether `AutoConfig` or the raw JSON was read."""
    return {
        "file": "config.json",
        "loader": "AutoConfig" if auto_cfg is not None else "raw_json",
        "autoconfig_error": auto_err,
        "autoconfig_class": type(auto_cfg).__name__ if auto_cfg is not None else None,
    }


def _probe_config(target_dir: Path, trust_remote_code: bool) -> tuple[dict, list[str], Any]:
    """The config part of the record, warnings, and the `AutoConfig` object (None when it could not
    load).

    Raises:
        ProbeRefusal: an architecture the drafter cannot be built for
            (`architecture_refusal`, with the reason).
        ProbeError: a missing/unusable config.
    """
    path = target_dir / "config.json"
    raw = _read_config_json(path)
    refusal = architecture_refusal(raw, str(path))
    if refusal is not None:
        raise refusal
    warnings: list[str] = []
    text_path, text = _find_text_config(raw)
    auto_cfg, auto_err = _try_autoconfig(target_dir, trust_remote_code)
    auto_text = _auto_text_config(auto_cfg)
    pick = _picker(raw, text_path, text, auto_text)

    size = _size_facts(path, text_path, text, pick, auto_text, warnings)
    hidden, n_layers = size["hidden_size"], size["num_hidden_layers"]
    attention, head_dim, head_dim_src = _attention_facts(
        text, pick, hidden, size["num_attention_heads"], size["num_key_value_heads"]
    )
    layer_types, lt_src = _derive_layer_types(text, int(n_layers or 0), auto_text)
    if layer_types is not None and n_layers is not None and len(layer_types) != n_layers:
        warnings.append(f"layer types list has {len(layer_types)} entries for {n_layers} layers")
    tie, tie_src = _tie_facts(raw, text_path, text, auto_cfg)
    if not isinstance(n_layers, int) or not isinstance(hidden, int):
        raise ProbeError(f"{path}: hidden_size / num_hidden_layers are not integers at {text_path or 'top level'}")
    size["vocab_size"] = int(size["vocab_size"])

    record = {
        "config_source": _config_source(auto_cfg, auto_err),
        "model_type": raw.get("model_type"),
        "architectures": raw.get("architectures"),
        "text_config_path": text_path,
        "text_model_type": text.get("model_type"),
        "text_architectures": text.get("architectures"),
        **size,
        "head_dim": head_dim,
        "head_dim_source": head_dim_src,
        "attention": attention,
        "moe": _moe_facts(text),
        "layer_types": layer_types,
        "layer_types_source": lt_src,
        "layer_type_counts": ({t: layer_types.count(t) for t in sorted(set(layer_types))} if layer_types else None),
        "max_position_embeddings": pick("max_position_embeddings")[0],
        "rope": _rope_facts(text),
        "tie_word_embeddings": tie,
        "tie_word_embeddings_source": tie_src,
        "dtype": _first(text, ("dtype", "torch_dtype")) or _first(raw, ("dtype", "torch_dtype")),
        "config_eos_token_ids": _eos_list(text.get("eos_token_id")) or _eos_list(raw.get("eos_token_id")),
        "auto_map": sorted(raw.get("auto_map", {})) if isinstance(raw.get("auto_map"), Mapping) else None,
    }
    if auto_cfg is None and auto_err:
        warnings.append(f"AutoConfig could not load config.json, read the raw JSON instead ({auto_err[:160]})")
    return record, warnings, auto_cfg


# --- the embedding and generation_config.json


def _embedding_rows(target_dir: Path, vocab_size: int) -> tuple[int, str]:
    """Rows of the input embedding: from the safetensors header when weights are present (reads only
    the header, never tensor data), else `vocab_size`."""
    index = target_dir / "model.safetensors.index.json"
    candidates: list[tuple[Path, str | None]] = []
    try:
        if index.is_file():
            wmap = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
            names = sorted((n for n in wmap if n.endswith("embed_tokens.weight")), key=len)
            if names:
                candidates.append((target_dir / wmap[names[0]], names[0]))
        elif (target_dir / "model.safetensors").is_file():
            candidates.append((target_dir / "model.safetensors", None))
        for file, name in candidates:
            with open(file, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                if n > 100_000_000:
                    break
                header = json.loads(fh.read(n))
            keys = [name] if name else sorted((k for k in header if k.endswith("embed_tokens.weight")), key=len)
            for k in keys:
                if k in header:
                    return int(header[k]["shape"][0]), f"safetensors header ({file.name}: {k})"
    except (OSError, ValueError, KeyError, struct.error):
        pass
    return vocab_size, "config vocab_size (no readable safetensors header)"


def _generation_eos(target_dir: Path) -> list[int]:
    """eos ids listed in `generation_config.json` (int or list), [] when absent or unreadable."""
    path = target_dir / "generation_config.json"
    try:
        g = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id") if path.is_file() else None
        return [int(x) for x in (g if isinstance(g, list) else [g])] if g is not None else []
    except (OSError, ValueError, TypeError, AttributeError):
        return []


def _embedding_facts(target_dir: Path, vocab_size: int, warnings: list[str]) -> dict:
    """`{embedding_rows, embedding_rows_source}` (`_embedding_rows`); appends a warning to
    `warnings` when the rows differ from the config's `vocab_size`."""
    rows, rows_src = _embedding_rows(target_dir, vocab_size)
    if rows != vocab_size:
        warnings.append(f"embedding has {rows} rows but config vocab_size is {vocab_size}")
    return {"embedding_rows": rows, "embedding_rows_source": rows_src}
