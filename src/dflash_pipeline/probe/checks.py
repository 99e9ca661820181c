"""Plan-time checks of the probe: the target loads as a causal LM, the drafter can be sized from its
config, and the tokenizer has a chat template and fits the embedding. Each reads metadata only (no
weights), so a target the pipeline cannot use is refused when the workflow is planned, with the reason.

`architecture_refusal` reads only the JSON config and returns a `ProbeRefusal` whose `reason` is one of
`REASONS` when an assumption of a DFlash drafter does not hold (it reads the outputs of single target
decoder layers, attends with attention sized like the target's, embeds with the target's H-wide
embedding): `encoder-decoder`, `not a causal LM`, `looped layers`, `attention-free`, `per-layer values`,
`no context length`, `embedding width`, `no language-model config` (each explained, with examples, in
docs/reference/model-types.md). The reasons that show only through the config class (`sublayer count`,
`drafter cannot be sized`, `rotary not servable`, `not loadable`) come from `_check_drafter_config` and
`_probe_loader`; the plan-time gate runs both (`workflow.problems.probe_gate_problems`).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any, Mapping, Sequence

from dflash_pipeline.core.errors import ConfigError, ProbeError, ProbeRefusal

# --- architectures refused from config.json alone

ENCODER_DECODER = "encoder-decoder"
NOT_CAUSAL = "not a causal LM"
LOOPED_LAYERS = "looped layers"
ATTENTION_FREE = "attention-free"
PER_LAYER_VALUES = "per-layer values"
NO_CONTEXT_LENGTH = "no context length"
NO_TEXT_CONFIG = "no language-model config"
EMBEDDING_WIDTH = "embedding width"
SUBLAYERS = "sublayer count"
UNSIZABLE = "drafter cannot be sized"
NOT_SERVABLE = "rotary not servable"
NOT_LOADABLE = "not loadable"
#: Every `ProbeRefusal.reason` the probe gives: up to `embedding width` from config.json alone
#: (`architecture_refusal`), the others through the config class (`sublayer count`: LongCat-Flash's
#: config class counts two attention sublayers per decoder layer, which config.json does not show).
REASONS = (
    ENCODER_DECODER,
    NOT_CAUSAL,
    LOOPED_LAYERS,
    ATTENTION_FREE,
    PER_LAYER_VALUES,
    NO_CONTEXT_LENGTH,
    NO_TEXT_CONFIG,
    EMBEDDING_WIDTH,
    SUBLAYERS,
    UNSIZABLE,
    NOT_SERVABLE,
    NOT_LOADABLE,
)

from dflash_pipeline.core.contracts import CONTEXT_LENGTH_KEYS  # noqa: E402 - re-exported: probe.config reads it here

#: Fields that run a stack of layers more than once per token.
LOOP_KEYS = ("n_recurrent_loops", "num_recurrent_loops", "num_loops", "n_loops")
#: Attention-head counts of attention models (`num_heads` is also a state-space head count: see below).
ATTENTION_HEAD_KEYS = ("num_attention_heads", "n_head", "n_heads", "attention_heads", "decoder_attention_heads")
#: Fields only state-space / recurrent mixers have (Mamba's `state_size`, RWKV's `attention_hidden_size`,
#: xLSTM's `qk_dim_factor` …): with them, `num_heads` counts SSM heads, not attention heads.
RECURRENT_KEYS = ("state_size", "ssm_state_size", "time_step_rank", "attention_hidden_size", "qk_dim_factor")
#: Widths of a factorized token embedding (ALBERT / ELECTRA `embedding_size`, OPT's `word_embed_proj_dim`).
EMBEDDING_WIDTH_KEYS = ("embedding_size", "word_embed_proj_dim", "embedding_dim")
#: Sizes the drafter copies from the target: one value each, never a per-layer list.
COPIED_SIZES = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")


def _first(d: Mapping[str, Any], keys) -> tuple[str | None, Any]:
    for k in keys:
        if d.get(k) is not None:
            return k, d[k]
    return None, None


def context_length(d: Mapping[str, Any]) -> tuple[str | None, Any]:
    """`(key, tokens)` of the context length `d` states (`CONTEXT_LENGTH_KEYS`), `(None, None)`
    when it states none."""
    return _first(d, CONTEXT_LENGTH_KEYS)


def attention_heads(d: Mapping[str, Any]) -> tuple[str | None, Any]:
    """`(key, count)` of the attention heads `d` states; `num_heads` counts only without
    `RECURRENT_KEYS` (Mamba-2's and xLSTM's `num_heads` are their mixers' heads)."""
    k, v = _first(d, ATTENTION_HEAD_KEYS)
    if v is None and d.get("num_heads") is not None and not any(r in d for r in RECURRENT_KEYS):
        return "num_heads", d["num_heads"]
    return k, v


def block_type_count(d: Mapping[str, Any]) -> tuple[str | None, int | None]:
    """`(source, layers)` from a per-layer block list when the config states no layer count."""
    if isinstance(d.get("layers_block_type"), list) and d["layers_block_type"]:
        return "len(layers_block_type)", len(d["layers_block_type"])
    if isinstance(d.get("hybrid_override_pattern"), str) and d["hybrid_override_pattern"]:
        return "len(hybrid_override_pattern)", len(d["hybrid_override_pattern"])
    return None, None


def architecture_refusal(raw: Mapping[str, Any], where: str = "config.json") -> ProbeRefusal | None:
    """The `ProbeRefusal` for a target whose `config.json` (`raw`) shows an architecture the drafter cannot be built
    for, None when none shows. `where` names the file in the message. Reads only `raw`; never raises."""
    # the config reader imports this module's checks, so it is looked up when a check runs, not at import
    _find_text_config = importlib.import_module("dflash_pipeline.probe.config")._find_text_config

    def refuse(reason: str, why: str, fix: str = "not supported") -> ProbeRefusal:
        return ProbeRefusal(reason, f"{where}: {reason} ({raw.get('model_type')!r}): {why}; {fix}")

    try:
        path, text = _find_text_config(raw)
    except ProbeError:
        path, text = None, None
    t = text if text is not None else raw
    at = f"`{path}.`" if path else "`"
    if raw.get("is_encoder_decoder") is True or (
        "decoder_layers" in t and _first(t, ("num_hidden_layers", "n_layer", "num_layers", "n_layers"))[1] is None
    ):
        return refuse(
            ENCODER_DECODER,
            "its causal-LM class is the decoder of an encoder-decoder model (is_encoder_decoder / "
            "decoder_layers), which cross-attends to an encoder output the pipeline never computes",
        )
    if t.get("causal") is False or t.get("is_encoder") is True:
        return refuse(NOT_CAUSAL, f"{at}causal` is false: a masked language model, not a left-to-right decoder")
    for k in LOOP_KEYS:
        if isinstance(t.get(k), int) and t[k] > 1:
            return refuse(
                LOOPED_LAYERS,
                f"{at}{k}` = {t[k]}: its recurrent layers run {t[k]} times per token, so a decoder layer's "
                "output is not one hidden state, the target's hidden states do not line up with its layers, "
                "and serving engines tap each layer once",
                f"not supported (with {k}: 1 it is an ordinary decoder)",
            )
    if text is not None and isinstance(raw.get("patcher_config"), Mapping):
        text = None  # BLT: its decoder_config is the local byte decoder, not the model
    if text is None:
        subs = sorted(k for k, v in raw.items() if isinstance(v, Mapping) and "hidden_size" in v)
        return refuse(
            NO_TEXT_CONFIG,
            "no decoder with hidden_size and num_hidden_layers at the top level or in a text sub-config"
            + (f" (sub-models: {', '.join(subs)}: not one decoder whose layers see every token)" if subs else ""),
        )
    if attention_heads(t)[1] is None:
        return refuse(
            ATTENTION_FREE,
            "no attention heads (num_attention_heads, n_head, n_heads): a state-space / recurrent model; "
            "the drafter's attention is sized from the target's heads and head_dim",
            "not supported (hybrids with attention layers, e.g. Jamba, Falcon-H1, Nemotron-H, are)",
        )
    hidden = _first(t, ("hidden_size", "n_embd", "d_model"))[1]
    for k in EMBEDDING_WIDTH_KEYS:
        if isinstance(t.get(k), int) and isinstance(hidden, int) and t[k] != hidden:
            return refuse(
                EMBEDDING_WIDTH,
                f"{at}{k}` {t[k]} differs from the hidden size {hidden}: a factorized embedding projected up to "
                "the layers; the drafter looks its noise tokens up in the target's embedding and needs them "
                "hidden-size wide",
            )
    listed = [k for k in COPIED_SIZES if isinstance(t.get(k), (list, Mapping))]
    if listed:
        return refuse(
            PER_LAYER_VALUES,
            f"{at}{listed[0]}` is one value per layer; the drafter copies one {listed[0]} from the target",
        )
    # a config.json transformers wrote states every field of its class: none of these is none at all (a
    # hand-written one may leave the class default to AutoConfig, which the probe's drafter check reads)
    if "transformers_version" in raw and context_length(t)[1] is None and context_length(raw)[1] is None:
        return refuse(
            NO_CONTEXT_LENGTH,
            f"no context length ({', '.join(CONTEXT_LENGTH_KEYS)}); the drafter's config states the context it serves",
            "add max_position_embeddings (tokens) to config.json if the model has one",
        )
    return None


def raw_config_refusal(target_dir: str | Path) -> ProbeRefusal | None:
    """`architecture_refusal` of `<target_dir>/config.json`; None when the file is missing or not a
    JSON object (other checks name those)."""
    path = Path(target_dir) / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return architecture_refusal(raw, str(path)) if isinstance(raw, dict) else None


# --- the tokenizer, the loader and the drafter


def _preflight_tokenizer(
    target_dir: Path, tok: Mapping[str, Any], embedding_rows: int, *, strict: bool, warnings: list[str]
) -> None:
    """A present tokenizer has a chat template (`strict`: else an error; lenient: a warning) and its
    `len` fits the embedding (else a warning). A missing tokenizer is left alone.

    Raises:
        ConfigError: no chat template and no override (`strict`; names `target.chat_template`).
    """
    if not tok.get("present"):
        return
    if not tok["chat_template"]:
        msg = f"{target_dir}: the tokenizer has no chat template; set `target.chat_template` to a .jinja file"
        if strict:
            raise ConfigError(msg)
        warnings.append(msg)
    if tok["len"] > embedding_rows:
        warnings.append(f"len(tokenizer)={tok['len']} exceeds the {embedding_rows} embedding rows")


def _probe_loader(target_dir: Path, trust_remote_code: bool, *, strict: bool, warnings: list[str]) -> dict:
    """How train/eval/completions will load the target: `{class, config_class, error}`. A target that cannot load is
    refused here, at plan time, with the reason (strict), or recorded with a warning (CLI)."""
    from dflash_pipeline.target.loading import TargetLoadError, check_loadable

    try:
        info = check_loadable(target_dir, trust_remote_code=trust_remote_code)
        return {"class": info["class"], "config_class": info["config_class"], "error": None}
    except TargetLoadError as exc:
        if strict:
            raise
        warnings.append(f"the target cannot be loaded as a causal LM: {exc}")
        return {"class": None, "config_class": None, "error": str(exc)}


def _check_drafter_config(
    target_dir: Path,
    trust_remote_code: bool,
    block_size: int,
    num_draft_layers: int,
    ids: Sequence[int],
    mask_token_id: int | None,
) -> None:
    """Build the drafter config train will build from this target's config (no weights), so a target the
    drafter cannot be sized from fails here with the reason, not at training step 1.

    Raises:
        ProbeRefusal: naming the target and transformers' / the drafter's complaint.
    """
    from dflash_pipeline.drafter.config import DFlashConfig
    from dflash_pipeline.drafter.rope import DFlashRotaryEmbedding, servable_rope_problems
    from dflash_pipeline.target.loading import load_target_config, text_config

    tc = text_config(load_target_config(target_dir, trust_remote_code=trust_remote_code))
    depth = getattr(tc, "num_layers", None)
    if isinstance(depth, int) and depth != tc.num_hidden_layers:  # LongCat-Flash: two attention sublayers a layer
        raise ProbeRefusal(
            SUBLAYERS,
            f"{target_dir}: config num_hidden_layers {tc.num_hidden_layers} counts sublayers of "
            f"{depth} decoder layers (num_layers; {tc.model_type}'s double-attention layers); the target "
            "returns one hidden state per decoder layer, so canonical target_layer_ids cannot be "
            "placed: not supported",
        )
    from dflash_pipeline.drafter.config import target_context_length

    try:
        target_context_length(tc)
    except ValueError as exc:
        raise ProbeRefusal(
            NO_CONTEXT_LENGTH, f"{target_dir}: {NO_CONTEXT_LENGTH} ({tc.model_type!r}): {exc}; not supported"
        ) from None
    try:
        cfg = DFlashConfig.from_target(
            tc,
            block_size=block_size,
            num_draft_layers=num_draft_layers,
            target_layer_ids=list(ids),
            mask_token_id=mask_token_id if mask_token_id is not None else 0,
        )
        problems = servable_rope_problems(cfg.rope_parameters, int(cfg.head_dim))
        if not problems:
            DFlashRotaryEmbedding(cfg)  # the rotary training builds (rope init formulas)
    except Exception as exc:  # noqa: BLE001 - any failure here would otherwise surface at training step 1
        raise ProbeRefusal(
            UNSIZABLE,
            f"{target_dir}: the drafter cannot be sized from this target's config: "
            f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}",
        ) from exc
    if problems:  # what vLLM's DFlash drafter would refuse or serve differently (dflash_pipeline.drafter.rope)
        raise ProbeRefusal(
            NOT_SERVABLE,
            f"{target_dir}: vLLM cannot serve the drafter this target gets: {'; '.join(problems)}; "
            f"rope_parameters {cfg.rope_parameters}",
        )
