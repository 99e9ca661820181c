"""Config probe: what the drafter needs to know about a target, read from its metadata only.

:func:`probe_target` reads ``config.json`` (raw JSON, cross-checked with ``AutoConfig`` when it can load
it), the tokenizer files (``AutoTokenizer``) and ``generation_config.json``, and never loads weights; the
only bytes it reads from a weight file are the safetensors JSON header that states the embedding's shape.
The result is the probe record of DESIGN.md §2 (``results/probe/target.json``), validated against
``schemas/probe.schema.json``.

Layer ids. Canonical ids are 0-based indices of the target decoder layer whose *output* feeds the
drafter (``dflash_config.target_layer_ids``). The Hugging Face ``output_hidden_states`` tuple has the
embedding output at index 0, so the output of layer ``l`` is index ``l + 1``. :func:`hf_hidden_state_index`
is the one place that converts; every other module calls it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import struct
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from .contracts import PROBE_SCHEMA_VERSION
from .chat import TOKENIZER_FILES, _tokenizer_auto_map, tokenizer_files_missing  # noqa: F401  (re-exported)
from .layer_ids import build_target_layer_ids, hf_hidden_state_index, validate_target_layer_ids  # noqa: F401
from .errors import ConfigError, ProbeError
from .shards import write_json

SCHEMA_PATH = Path(__file__).parent / "schemas" / "probe.schema.json"

#: Keys under which multimodal / wrapper configs keep the language model's config, in search order.
TEXT_CONFIG_KEYS = ("text_config", "language_config", "llm_config", "thinker_config", "language_model",
                    "text_model", "lm_config", "decoder", "decoder_config", "model_config")
#: Sub-config keys never searched for the text model (they carry their own hidden_size / layer counts).
_NON_TEXT_HINTS = ("vision", "visual", "audio", "speech", "image", "video", "quantization", "encoder",
                   "talker", "code2wav", "projector", "rope_scaling", "rope_parameters")

_ALIASES = {
    "hidden_size": ("hidden_size", "n_embd", "d_model", "dim"),
    "num_hidden_layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
    "num_attention_heads": ("num_attention_heads", "n_head", "num_heads", "n_heads"),
    "num_key_value_heads": ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num"),
    "max_position_embeddings": ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"),
}
#: MoE expert-count keys seen in the wild → normalized ``num_experts``.
EXPERT_COUNT_KEYS = ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts", "n_experts")
#: MoE routing top-k keys → normalized ``num_experts_per_tok``.
EXPERTS_PER_TOKEN_KEYS = ("num_experts_per_tok", "experts_per_token", "top_k_experts", "moe_topk",
                          "moe_k", "num_selected_experts")
THINK_MARKERS = ("<think>", "</think>")
#: conda env of the probe rule (named in "install X" errors).
PROBE_ENV_FILE = "envs/probe.yaml"


# --------------------------------------------------------------------------------------------------
# config.json


def _find_text_config(cfg: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]]:
    """Return ``(path, sub_config)`` of the language model's config: ``""`` for the top level, else a
    dotted key path such as ``"text_config"`` or ``"thinker_config.text_config"``."""

    def has_core(d: Mapping[str, Any]) -> bool:
        return _first(d, _ALIASES["hidden_size"]) is not None and _first(d, _ALIASES["num_hidden_layers"]) is not None

    if has_core(cfg):
        return "", cfg
    frontier: list[tuple[str, Mapping[str, Any]]] = [("", cfg)]
    for _depth in range(3):
        nxt: list[tuple[str, Mapping[str, Any]]] = []
        for prefix, d in frontier:
            keys = [k for k in TEXT_CONFIG_KEYS if isinstance(d.get(k), Mapping)]
            keys += [k for k, v in d.items() if isinstance(v, Mapping) and k not in keys
                     and not any(h in k.lower() for h in _NON_TEXT_HINTS)]
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
    """``(config, None)`` when ``AutoConfig`` loads the directory offline, else ``(None, reason)``."""
    try:
        from transformers import AutoConfig
        from transformers.utils import logging as hf_logging

        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        try:
            cfg = AutoConfig.from_pretrained(str(target_dir), trust_remote_code=trust_remote_code,
                                             local_files_only=True)
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
        return (["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)],
                "derived from config.full_attention_interval")
    auto_lt = getattr(auto_text, "layer_types", None) if auto_text is not None else None
    if isinstance(auto_lt, list) and auto_lt:
        return [str(x) for x in auto_lt], "AutoConfig.layer_types"
    return None, None


def _read_config_json(path: Path) -> dict:
    """``config.json`` as a dict; ProbeError (naming the file and the fix) when missing or not an object."""
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
    """``(attention record, head_dim, head_dim source)``: MLA (kv_lora_rank), else MHA/GQA, plus the
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
    """``{theta, type, scaling, parameters}``; theta per layer type when the config has one per type (Gemma)."""
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
    """``(tie_word_embeddings, source)`` from the text config, the top level, else AutoConfig's default."""
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


def _probe_config(target_dir: Path, trust_remote_code: bool) -> tuple[dict, list[str], Any]:
    """The config part of the record, warnings, and the ``AutoConfig`` object (None when it could not
    load). Raises ProbeError on a missing/unusable config."""
    path = target_dir / "config.json"
    raw = _read_config_json(path)
    warnings: list[str] = []
    text_path, text = _find_text_config(raw)
    auto_cfg, auto_err = _try_autoconfig(target_dir, trust_remote_code)
    auto_text = _auto_text_config(auto_cfg)

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

    hidden, _ = pick("hidden_size")
    n_layers, _ = pick("num_hidden_layers")
    vocab, _ = pick("vocab_size", top_fallback=True)
    if vocab is None:
        raise ProbeError(f"{path}: no vocab_size at {text_path or 'the top level'}; the config is unusable")
    heads, _ = pick("num_attention_heads")
    kv_heads, kv_src = pick("num_key_value_heads")
    if kv_heads is None and heads is not None:
        kv_heads, kv_src = heads, "default (= num_attention_heads)"
    attention, head_dim, head_dim_src = _attention_facts(text, pick, hidden, heads, kv_heads)
    layer_types, lt_src = _derive_layer_types(text, int(n_layers or 0), auto_text)
    if layer_types is not None and n_layers is not None and len(layer_types) != n_layers:
        warnings.append(f"layer types list has {len(layer_types)} entries for {n_layers} layers")
    tie, tie_src = _tie_facts(raw, text_path, text, auto_cfg)
    if not isinstance(n_layers, int) or not isinstance(hidden, int):
        raise ProbeError(f"{path}: hidden_size / num_hidden_layers are not integers at {text_path or 'top level'}")

    record = {
        "config_source": {
            "file": "config.json",
            "loader": "AutoConfig" if auto_cfg is not None else "raw_json",
            "autoconfig_error": auto_err,
            "autoconfig_class": type(auto_cfg).__name__ if auto_cfg is not None else None,
        },
        "model_type": raw.get("model_type"),
        "architectures": raw.get("architectures"),
        "text_config_path": text_path,
        "text_model_type": text.get("model_type"),
        "text_architectures": text.get("architectures"),
        "hidden_size": hidden,
        "num_hidden_layers": n_layers,
        "vocab_size": int(vocab),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "num_key_value_heads_source": kv_src,
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


def _probe_loader(target_dir: Path, trust_remote_code: bool, *, strict: bool, warnings: list[str]) -> dict:
    """How train/eval/completions will load the target (:func:`dflash_pipeline.target.check_loadable`,
    no weights read): ``{class, config_class, error}``. A target that cannot load is refused here, at plan
    time, with the reason (strict), or recorded with a warning (CLI)."""
    from .target import TargetLoadError, check_loadable

    try:
        info = check_loadable(target_dir, trust_remote_code=trust_remote_code)
        return {"class": info["class"], "config_class": info["config_class"], "error": None}
    except TargetLoadError as exc:
        if strict:
            raise
        warnings.append(f"the target cannot be loaded as a causal LM: {exc}")
        return {"class": None, "config_class": None, "error": str(exc)}


def _check_drafter_config(target_dir: Path, trust_remote_code: bool, block_size: int, num_draft_layers: int,
                          ids: Sequence[int], mask_token_id: int | None) -> None:
    """Build the drafter config train will build from this target's config (no weights), so a target the
    drafter cannot be sized from fails here with the reason, not at training step 1.

    Raises:
        ProbeError: naming the target and transformers' / the drafter's complaint.
    """
    from .model import drafter_config_from_target
    from .target import load_target_config, text_config

    try:
        drafter_config_from_target(
            text_config(load_target_config(target_dir, trust_remote_code=trust_remote_code)),
            block_size=block_size, num_draft_layers=num_draft_layers, target_layer_ids=list(ids),
            mask_token_id=mask_token_id if mask_token_id is not None else 0)
    except Exception as exc:  # noqa: BLE001 - any failure here would otherwise surface at training step 1
        raise ProbeError(f"{target_dir}: the drafter cannot be sized from this target's config: "
                         f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}") from exc


def _embedding_rows(target_dir: Path, vocab_size: int) -> tuple[int, str]:
    """Rows of the input embedding: from the safetensors header when weights are present (reads only
    the header, never tensor data), else ``vocab_size``."""
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


# --------------------------------------------------------------------------------------------------
# tokenizer


def _tokenizer_error(target_dir: Path, exc: Exception, trust_remote_code: bool) -> ProbeError:
    msg = " ".join(str(exc).split())
    low = msg.lower()
    if isinstance(exc, ImportError) or "no module named" in low or ("requires the" in low and "librar" in low):
        missing = getattr(exc, "name", None) or ("tiktoken" if "tiktoken" in low else
                                                 "sentencepiece" if "sentencepiece" in low else None)
        pkg = missing or "the missing package"
        return ProbeError(
            f"{target_dir}: loading the tokenizer needs the Python package `{pkg}` ({msg[:200]}); "
            f"install it (`pip install {pkg}`, or `pip install dflash-pipeline[tiktoken]`) and add it to "
            f"{PROBE_ENV_FILE}"
        )
    if "trust_remote_code" in low and not trust_remote_code:
        return ProbeError(
            f"{target_dir}: the tokenizer is defined by code shipped with the model (auto_map in "
            "tokenizer_config.json); review it and set `target.trust_remote_code: true` "
            f"(CLI: --trust-remote-code) to allow it ({msg[:200]})"
        )
    return ProbeError(f"{target_dir}: AutoTokenizer failed: {type(exc).__name__}: {msg[:400]}")


def _generation_eos(target_dir: Path) -> list[int]:
    """eos ids listed in ``generation_config.json`` (int or list), [] when absent or unreadable."""
    path = target_dir / "generation_config.json"
    try:
        g = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id") if path.is_file() else None
        return [int(x) for x in (g if isinstance(g, list) else [g])] if g is not None else []
    except (OSError, ValueError, TypeError, AttributeError):
        return []


def _vocab_file_kind(path: Path) -> str | None:
    """``"tiktoken"`` for a tiktoken BPE ranks file (lines ``<base64 token> <rank>``), ``"sentencepiece"``
    for a binary sentencepiece model (a protobuf), None when unreadable. Both are often named ``*.model``."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(4096)
    except OSError:
        return None
    if not head:
        return None
    first = head.split(b"\n", 1)[0]
    if re.fullmatch(rb"[A-Za-z0-9+/=]+ \d+\r?", first):
        return "tiktoken"
    return "sentencepiece"


def _vocab_file(tok: Any, target_dir: Path) -> Path | None:
    """The file the tokenizer's vocabulary came from: ``tokenizer.json`` when present, else the class's
    ``vocab_file`` (``tokenizer.model``, ``tiktoken.model``, ``vocab.json`` ...)."""
    if (target_dir / "tokenizer.json").is_file():
        return target_dir / "tokenizer.json"
    vf = getattr(tok, "vocab_file", None) or (getattr(tok, "init_kwargs", None) or {}).get("vocab_file")
    if isinstance(vf, (str, os.PathLike)) and Path(vf).is_file():
        return Path(vf)
    return None


def _backend(tok: Any, vocab_file: Path | None) -> str:
    """Where the tokenization rules come from: ``tiktoken`` (a tiktoken BPE ranks file, run by tiktoken in
    remote code, or converted), ``sentencepiece`` (a sentencepiece model: a slow ``sp_model`` tokenizer, or
    transformers' conversion of ``tokenizer.model`` into a fast tokenizer), ``fast`` (``tokenizer.json``),
    ``python`` (any other slow tokenizer)."""
    mods = type(tok).__module__ + " " + " ".join(type(v).__module__ for v in vars(tok).values() if v is not None)
    if "tiktoken" in mods:
        return "tiktoken"
    if getattr(tok, "sp_model", None) is not None or "sentencepiece" in mods:
        return "sentencepiece"
    if vocab_file is not None and vocab_file.name != "tokenizer.json" and vocab_file.suffix in (".model", ".tiktoken"):
        kind = _vocab_file_kind(vocab_file)
        if kind is not None:
            return kind
    return "fast" if getattr(tok, "is_fast", False) else "python"


def _check_sentencepiece_deps(target_dir: Path) -> None:
    """A sentencepiece ``tokenizer.model`` without ``tokenizer.json`` is converted by transformers, which
    needs ``sentencepiece`` and ``protobuf``; without them it silently falls back to a tiktoken parser and
    fails with an unrelated message. Say what to install instead."""
    if (target_dir / "tokenizer.json").is_file() or _tokenizer_auto_map(target_dir):
        return
    model = next((target_dir / n for n in ("tokenizer.model", "spiece.model", "sentencepiece.bpe.model")
                  if (target_dir / n).is_file()), None)
    if model is None or _vocab_file_kind(model) != "sentencepiece":
        return
    missing = []
    for module, pkg in (("sentencepiece", "sentencepiece"), ("google.protobuf", "protobuf")):
        try:
            __import__(module)
        except ImportError:
            missing.append(pkg)
    if missing:
        pkgs = " ".join(missing)
        raise ProbeError(
            f"{model}: a sentencepiece model without tokenizer.json; loading it needs the Python package(s) "
            f"{', '.join(f'`{m}`' for m in missing)}; install them (`pip install {pkgs}`, or "
            f"`pip install dflash-pipeline[sentencepiece]`) and add them to {PROBE_ENV_FILE}"
        )


def _probe_tokenizer(target_dir: Path, *, trust_remote_code: bool, chat_template: str | os.PathLike | None,
                     config: Any = None) -> dict:
    """Tokenizer facts; raises ProbeError (what to install / set) when the files exist but cannot load.

    ``config`` is the ``AutoConfig`` the probe already loaded (None when it could not): it is handed to
    ``AutoTokenizer`` so that a config whose own remote code is absent (a directory with only config.json
    and the tokenizer files, as often copied around) does not stop the tokenizer from loading."""
    auto_map = _tokenizer_auto_map(target_dir)
    if auto_map and not trust_remote_code:
        # transformers 5 does not refuse here: it silently builds an empty tokenizer instead
        raise ProbeError(
            f"{target_dir}: the tokenizer is defined by code shipped with the model (tokenizer_config.json "
            f"auto_map AutoTokenizer={auto_map}); review that code and set `target.trust_remote_code: true` "
            "(CLI: --trust-remote-code) to allow it"
        )
    _check_sentencepiece_deps(target_dir)
    try:
        from transformers import AutoTokenizer, PretrainedConfig

        tok = AutoTokenizer.from_pretrained(str(target_dir), trust_remote_code=trust_remote_code,
                                            local_files_only=True,
                                            config=config if config is not None else PretrainedConfig())
    except Exception as exc:  # noqa: BLE001 - translated into a message that names the fix
        raise _tokenizer_error(target_dir, exc, trust_remote_code) from exc
    if len(tok) < 16:
        raise ProbeError(
            f"{target_dir}: AutoTokenizer built a tokenizer with only {len(tok)} tokens — the tokenizer files are "
            "incomplete (copy tokenizer.json or the vocabulary file from the model repository)"
        )
    cls = type(tok)
    remote = not cls.__module__.startswith("transformers.")
    template, template_src = getattr(tok, "chat_template", None), "tokenizer" if getattr(tok, "chat_template", None) else None
    if chat_template is not None:
        template, template_src = Path(chat_template).read_text(encoding="utf-8"), f"override ({chat_template})"
    vocab = tok.get_vocab()
    vocab_file = _vocab_file(tok, target_dir)

    def tid(token: str | None) -> int | None:
        return None if token is None else vocab.get(str(token))

    eos_tok = [tok.eos_token_id] if tok.eos_token_id is not None else []
    markers = {}
    for name, m in zip(("open", "close"), THINK_MARKERS):
        markers[name] = {"token": m, "id": vocab.get(m)}
    thinking = markers if any(v["id"] is not None for v in markers.values()) else None
    return {
        "present": True,
        "missing_reason": None,
        "class": cls.__name__,
        "module": cls.__module__,
        "backend": _backend(tok, vocab_file),
        "runtime": "tokenizers" if getattr(tok, "is_fast", False) else "python",
        "vocab_file": vocab_file.name if vocab_file is not None else None,
        "len": len(tok),
        "base_vocab_size": getattr(tok, "vocab_size", None),
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "eos_token_ids_tokenizer": eos_tok,
        "pad_token_id": tok.pad_token_id,
        "unk_token_id": tok.unk_token_id,
        "mask_token": tok.mask_token if getattr(tok, "mask_token", None) else None,
        "mask_token_id": tid(tok.mask_token) if getattr(tok, "mask_token", None) else None,
        "chat_template": template is not None,
        "chat_template_source": template_src,
        "template_uses_thinking": bool(template and ("enable_thinking" in template or "<think>" in template)),
        "thinking_markers": thinking,
        "remote_code": remote,
        "trust_remote_code_used": bool(trust_remote_code and remote),
        "model_max_length": (int(tok.model_max_length) if getattr(tok, "model_max_length", None)
                             and tok.model_max_length < 1e12 else None),
    }




# --------------------------------------------------------------------------------------------------
# mask token


def resolve_mask_token_id(
    *, explicit: int | None, tokenizer: Mapping[str, Any], embedding_rows: int
) -> tuple[int, str]:
    """Choose the drafter's mask token id (reference/dflash.md §4.7, pitfall §4.8.6).

    Order: ``explicit`` (``drafter.mask_token_id``) → the tokenizer's mask token → the first embedding
    row past the real tokens (``len(tokenizer)``, when ``embedding_rows > len(tokenizer)``) → error.
    The id always indexes an existing row of the target embedding (``0 <= id < embedding_rows``).

    Returns ``(mask_token_id, explanation)``.

    Raises:
        ConfigError: an explicit id outside the embedding (names ``drafter.mask_token_id``).
        ProbeError: no tokenizer to decide from, or no free row and no mask token (names the key to set).
    """
    if explicit is not None:
        if not 0 <= explicit < embedding_rows:
            raise ConfigError(
                f"drafter.mask_token_id={explicit} is outside the target embedding (rows 0..{embedding_rows - 1})"
            )
        return explicit, "explicit (drafter.mask_token_id)"
    if not tokenizer.get("present"):
        raise ProbeError(
            f"cannot choose mask_token_id: {tokenizer.get('missing_reason')}; add the tokenizer files to the "
            "target directory or set `drafter.mask_token_id`"
        )
    mid = tokenizer.get("mask_token_id")
    if mid is not None and 0 <= mid < embedding_rows:
        return int(mid), f"tokenizer mask token {tokenizer.get('mask_token')!r}"
    n = int(tokenizer["len"])
    if embedding_rows > n:
        return n, (f"first embedding row past the real tokens: len(tokenizer)={n} < {embedding_rows} rows "
                   "(an untrained padding row of the frozen embedding)")
    raise ProbeError(
        f"cannot choose mask_token_id: the tokenizer has no mask token and all {embedding_rows} embedding rows "
        f"are real tokens (len(tokenizer)={n}); set `drafter.mask_token_id` to an unused token id "
        f"(e.g. a reserved special token) in 0..{embedding_rows - 1}"
    )


# --------------------------------------------------------------------------------------------------
# the probe


def probe_target(
    target_dir: str | os.PathLike,
    *,
    block_size: int,
    num_draft_layers: int,
    num_target_features: int | None = None,
    target_layer_ids: Sequence[int] | None = None,
    mask_token_id: int | None = None,
    trust_remote_code: bool = False,
    chat_template: str | os.PathLike | None = None,
    strict: bool = True,
) -> dict:
    """Probe a target model directory and return the probe record (DESIGN.md §2, probe.schema.json).

    Args:
        target_dir: directory with ``config.json`` and (normally) tokenizer files; weights optional.
        block_size: drafter block size B (≥ 2).
        num_draft_layers: drafter decoder layers L (≥ 1).
        num_target_features: K target layers fused by the drafter (default L, as the reference).
        target_layer_ids: canonical (0-based, layer-output) ids overriding the formula.
        mask_token_id: explicit mask token id (see :func:`resolve_mask_token_id`).
        trust_remote_code: allow the target's own tokenizer/config code (``target.trust_remote_code``).
        chat_template: a .jinja file overriding the tokenizer's chat template.
        strict: True (the pipeline rule): a missing tokenizer or chat template is an error. False (the
            CLI, inspecting config-only directories): a missing tokenizer gives ``tokenizer.present =
            false`` and, unless ``mask_token_id`` is given, ``drafter.mask_token_id = null`` with the
            reason in ``mask_token_source``; a missing chat template is a warning.

    Raises:
        ProbeError: missing/unusable config.json, tokenizer that cannot load (message says which package
            to install or which key to set), missing tokenizer (strict).
        ConfigError: no chat template and no ``chat_template`` override (strict; names
            ``target.chat_template``).
        ConfigError: bad drafter settings (layer ids out of range or repeated, mask id outside the
            embedding, block_size < 2, ...), naming the ``drafter.*`` key.
    """
    t0 = time.perf_counter()
    target_dir = Path(target_dir)
    if not target_dir.is_dir():
        raise ProbeError(f"target directory {target_dir} does not exist; check `target.path`")
    if block_size < 2:
        raise ConfigError(f"drafter.block_size must be >= 2, got {block_size}")
    if num_draft_layers < 1:
        raise ConfigError(f"drafter.num_draft_layers must be >= 1, got {num_draft_layers}")

    cfg, warnings, auto_cfg = _probe_config(target_dir, trust_remote_code)
    cfg["target_loader"] = _probe_loader(target_dir, trust_remote_code, strict=strict, warnings=warnings)
    rows, rows_src = _embedding_rows(target_dir, cfg["vocab_size"])
    cfg["embedding_rows"], cfg["embedding_rows_source"] = rows, rows_src
    if rows != cfg["vocab_size"]:
        warnings.append(f"embedding has {rows} rows but config vocab_size is {cfg['vocab_size']}")

    missing = tokenizer_files_missing(target_dir)
    if missing is None:
        tok = _probe_tokenizer(target_dir, trust_remote_code=trust_remote_code, chat_template=chat_template,
                               config=auto_cfg)
        if not tok["chat_template"]:
            msg = f"{target_dir}: the tokenizer has no chat template; set `target.chat_template` to a .jinja file"
            if strict:
                raise ConfigError(msg)
            warnings.append(msg)
        if tok["len"] > rows:
            warnings.append(f"len(tokenizer)={tok['len']} exceeds the {rows} embedding rows")
    elif not strict:
        tok = {"present": False, "missing_reason": missing}
        warnings.append(missing)
    else:
        raise ProbeError(
            f"{missing}; the pipeline renders chat templates and picks the mask token with the target's "
            "tokenizer — copy the tokenizer files into the target directory"
        )

    gen_eos = _generation_eos(target_dir)
    eos_ids: list[int] = []
    for src in (tok.get("eos_token_ids_tokenizer", []), gen_eos, cfg["config_eos_token_ids"]):
        eos_ids += [i for i in src if i not in eos_ids]

    n_layers = cfg["num_hidden_layers"]
    k = num_target_features if num_target_features is not None else num_draft_layers
    if target_layer_ids is not None:
        ids = validate_target_layer_ids(target_layer_ids, n_layers)
        ids_src = "explicit (drafter.target_layer_ids)"
        if num_target_features is not None and num_target_features != len(ids):
            raise ConfigError(
                f"drafter.num_target_features={num_target_features} but drafter.target_layer_ids has {len(ids)} ids"
            )
    else:
        ids = build_target_layer_ids(n_layers, k)
        ids_src = f"reference formula (N={n_layers}, K={k}), reference/dflash.md §3.1"

    if tok.get("present") or mask_token_id is not None:
        mid, mid_src = resolve_mask_token_id(explicit=mask_token_id, tokenizer=tok, embedding_rows=rows)
    else:
        mid, mid_src = None, f"unresolved: {tok['missing_reason']}; set `drafter.mask_token_id` or add the tokenizer"
    if cfg["target_loader"]["error"] is None:
        _check_drafter_config(target_dir, trust_remote_code, block_size, num_draft_layers, ids, mid)

    record = {
        "schema_version": PROBE_SCHEMA_VERSION,
        "target_dir": str(target_dir),
        **cfg,
        "generation_config_eos_token_ids": gen_eos,
        "eos_token_ids": eos_ids,
        "tokenizer": tok,
        "trust_remote_code": bool(trust_remote_code),
        "drafter": {
            "block_size": int(block_size),
            "num_draft_layers": int(num_draft_layers),
            "num_target_features": len(ids),
            "target_layer_ids": ids,
            "target_layer_ids_source": ids_src,
            "hf_hidden_state_indices": [hf_hidden_state_index(i) for i in ids],
            "mask_token_id": mid,
            "mask_token_source": mid_src,
        },
        "warnings": warnings,
        "probe_seconds": round(time.perf_counter() - t0, 3),
    }
    return record


def write_probe(record: Mapping[str, Any], path: str | os.PathLike) -> bool:
    """Validate ``record`` against the probe schema and write it atomically (see shards.write_json).

    ``probe_seconds`` is dropped from the file so equal targets give byte-identical files (and the
    Snakemake output keeps its mtime). Returns True when the file was (re)written.
    """
    rec = {k: v for k, v in record.items() if k != "probe_seconds"}
    validate_probe(rec)
    return write_json(path, rec)


def load_probe_schema() -> dict:
    """The probe record's JSON Schema (``schemas/probe.schema.json``)."""
    return json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))


def validate_probe(record: Mapping[str, Any]) -> None:
    """Raise ProbeError when ``record`` does not match the probe schema (names the field)."""
    import jsonschema

    validator = jsonschema.Draft202012Validator(load_probe_schema())
    errors = sorted(validator.iter_errors(record), key=lambda e: list(e.absolute_path))
    if errors:
        e = errors[0]
        where = ".".join(str(p) for p in e.absolute_path) or "<top level>"
        raise ProbeError(f"probe record field `{where}`: {e.message} (schema {SCHEMA_PATH.name})")


def summary(record: Mapping[str, Any]) -> str:
    """A readable multi-line summary of a probe record."""
    a, moe, tok, d = record["attention"], record.get("moe"), record["tokenizer"], record["drafter"]
    lines = [
        f"target       {record['target_dir']}",
        f"model        {record.get('model_type')} {record.get('architectures')}"
        + (f"  → text config at `{record['text_config_path']}` ({record.get('text_model_type')})"
           if record["text_config_path"] else ""),
        f"config       loaded by {record['config_source']['loader']}",
        f"size         hidden {record['hidden_size']}, {record['num_hidden_layers']} layers, vocab "
        f"{record['vocab_size']} ({record['embedding_rows']} embedding rows), max pos "
        f"{record.get('max_position_embeddings')}, dtype {record.get('dtype')}, tied {record.get('tie_word_embeddings')}",
        f"attention    {a['kind']}: {record.get('num_attention_heads')} heads, {record.get('num_key_value_heads')} KV "
        f"heads, head_dim {record.get('head_dim')}"
        + (f", kv_lora_rank {a.get('kv_lora_rank')}, q_lora_rank {a.get('q_lora_rank')}" if a["kind"] == "MLA" else ""),
        f"moe          " + (f"{moe['num_experts']} experts ({moe['num_experts_source']}), "
                            f"{moe['num_experts_per_tok']} per token" if moe else "dense"),
    ]
    if record.get("layer_type_counts"):
        lines.append(f"layer types  {record['layer_type_counts']} ({record['layer_types_source']})")
    if tok.get("present"):
        th = tok.get("thinking_markers") or {}
        lines.append(
            f"tokenizer    {tok['class']} (backend {tok['backend']}"
            + (f", from {tok['vocab_file']}" if tok.get("vocab_file") else "")
            + f"), len {tok['len']}, bos {tok['bos_token_id']}, "
            f"eos {record['eos_token_ids']}, pad {tok['pad_token_id']}, chat template "
            f"{'yes' if tok['chat_template'] else 'NO'}, think "
            + (f"{th['open']['id']}/{th['close']['id']}" if th else "none")
            + (", remote code" if tok.get("remote_code") else "")
        )
    else:
        lines.append(f"tokenizer    MISSING: {tok['missing_reason']}")
    lines += [
        f"drafter      block {d['block_size']}, {d['num_draft_layers']} layers, target layers "
        f"{d['target_layer_ids']} (HF hidden_states {d['hf_hidden_state_indices']})",
        f"mask token   {d['mask_token_id']}: {d['mask_token_source']}",
    ]
    lines += [f"warning      {w}" for w in record.get("warnings", [])]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI ``dflash-probe DIR``: print a readable summary, then the record as JSON (or write it with -o)."""
    ap = argparse.ArgumentParser(prog="dflash-probe", description="Probe a target model directory for DFlash.")
    ap.add_argument("target_dir")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-draft-layers", type=int, default=5)
    ap.add_argument("--num-target-features", type=int, default=None)
    ap.add_argument("--target-layer-ids", type=lambda s: [int(x) for x in s.split(",")], default=None,
                    help="comma-separated canonical ids, e.g. 1,9,17,25,33")
    ap.add_argument("--mask-token-id", type=int, default=None)
    ap.add_argument("--trust-remote-code", action="store_true")
    ap.add_argument("--chat-template", default=None)
    ap.add_argument("-o", "--output", default=None, help="write the JSON record here instead of stdout")
    ap.add_argument("--json", action="store_true", help="print only the JSON record")
    args = ap.parse_args(argv)
    try:
        rec = probe_target(
            args.target_dir,
            block_size=args.block_size,
            num_draft_layers=args.num_draft_layers,
            num_target_features=args.num_target_features,
            target_layer_ids=args.target_layer_ids,
            mask_token_id=args.mask_token_id,
            trust_remote_code=args.trust_remote_code,
            chat_template=args.chat_template,
            strict=False,
        )
    except (ProbeError, ConfigError) as exc:
        print(f"dflash-probe: error: {exc}", file=sys.stderr)
        return 2
    if not args.json:
        print(summary(rec), file=sys.stderr if args.output is None else sys.stdout)
    if args.output:
        write_probe(rec, args.output)
    else:
        print(json.dumps(rec, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
