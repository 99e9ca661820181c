"""The drafter's configuration, `DFlashConfig`: the only reader and writer of a drafter checkpoint's
`config.json` (reference/dflash.md §8.2).

A strict dataclass config extending `Qwen3Config` (SGLang/vLLM load the checkpoint as `model_type: qwen3`
with the DFlash fields beside it): `block_size` B (slot 0 the bonus token, B − 1 drafts),
`num_target_layers`, and `dflash_config` `{"target_layer_ids": [...], "mask_token_id": int}`. Written
beside them: `eagle_aux_hidden_state_layer_ids` (`engine_layer_ids`), `dtype`, and the pipeline's
`dflash_pipeline` block (`contracts.CheckpointMeta`, read back by `checkpoint_meta`).
"""

# no `from __future__ import annotations`: @strict validates the fields against their (evaluated) types
import json
from pathlib import Path
from typing import Optional

from huggingface_hub.dataclasses import strict
from huggingface_hub.errors import StrictDataclassError
from transformers import Qwen3Config

from dflash_pipeline.core.contracts import CHECKPOINT_FORMAT_VERSION, CheckpointMeta
from dflash_pipeline.core.shards import atomic_write_bytes
from dflash_pipeline.drafter.rope import drafter_rope_parameters
from dflash_pipeline.target.layer_ids import hf_hidden_state_index

#: `architectures` of every drafter checkpoint (the engines dispatch on it).
ARCHITECTURE = "DFlashDraftModel"
#: The checkpoint's config file (beside `model.safetensors`).
CONFIG_FILE = "config.json"
#: The pipeline's own block in `config.json` (`CheckpointMeta`); never passed to the config class.
META_KEY = "dflash_pipeline"
#: The Open Spec Config version the export speaks (speculators' `open_spec_config_version`; the vendored
#: schema tests/data/open_spec_config/dflash.schema.json validates exactly this one).
OPEN_SPEC_CONFIG_VERSION = "0.0.0"
#: Written by the export, never read back as config fields (the config class derives them).
DERIVED_KEYS = ("open_spec_config_version", "speculative_config")


@strict
class DFlashConfig(Qwen3Config):
    """A DFlash drafter's config: the Qwen3 fields of its layers plus `block_size`,
    `num_target_layers` and `dflash_config` (module docstring). Build one with `from_target`,
    read one with `from_checkpoint`, write one with `save`."""

    block_size: int = 16
    num_target_layers: int | None = None
    dflash_config: dict | None = None

    # The served identity of the family this config class belongs to (class attributes, not config fields;
    # a family's config class overrides them): `architectures` the engines dispatch on, vLLM's
    # `speculative_config.method`, whether slot 0 already drafts (B drafts per block instead of B − 1) and
    # whether sliding layers see the whole block.
    architecture = ARCHITECTURE
    speculative_method = "dflash"
    drafts_from_anchor = False
    sliding_window_non_causal = False

    @property
    def target_layer_ids(self) -> list[int]:
        """Canonical target layer ids, in the order their features are concatenated (K of them)."""
        return [int(i) for i in self.dflash_config["target_layer_ids"]]

    @property
    def mask_token_id(self) -> int:
        """Token id of the block's mask slots (dflash.md §2.4)."""
        return int(self.dflash_config["mask_token_id"])

    @property
    def engine_layer_ids(self) -> list[int]:
        """The layer ids SGLang/vLLM capture as aux hidden states (`eagle_aux_hidden_state_layer_ids`): the HF
        `output_hidden_states` index of each canonical id."""
        return [hf_hidden_state_index(i) for i in self.target_layer_ids]

    @classmethod
    def from_target(
        cls,
        target_config,
        *,
        block_size: int,
        num_draft_layers: int,
        target_layer_ids: list[int],
        mask_token_id: int,
        layer_types: Optional[list[str]] = None,
        sliding_window: Optional[int] = None,
    ) -> "DFlashConfig":
        """The drafter's config from the target's text config (dflash.md §2.1, §8.2).

        Hidden size, heads, head_dim, vocab and rope equal the target's (the drafter reuses its embedding
        and LM head); `num_hidden_layers` is the number of *draft* layers. `layer_types`
        (`full_attention`/`sliding_attention` per draft layer) with `sliding_window` (tokens) makes
        sliding-window draft layers (dflash.md §2.3, e.g. Qwen3.6-27B: 4 sliding + 1 full).

        Raises:
            ValueError: `layer_types` of the wrong length, or sliding layers without `sliding_window`.
        """
        if layer_types is not None and len(layer_types) != num_draft_layers:
            raise ValueError(f"drafter.layer_types has {len(layer_types)} entries for {num_draft_layers} draft layers")
        sliding = bool(layer_types and "sliding_attention" in layer_types)
        if sliding and not sliding_window:
            raise ValueError("drafter.layer_types has sliding_attention layers: set drafter.sliding_window (tokens)")
        t = target_config
        heads = _target_attr(t, "num_attention_heads")  # a per-layer count (dots3): its global value
        head_dim = _target_attr(t, "head_dim") or t.hidden_size // heads
        # the rotary vLLM serves (drafter.rope: partial rotary kept, M-RoPE sections dropped)
        rope = drafter_rope_parameters(
            _target_attr(t, "rope_parameters") or _target_attr(t, "rope_scaling"),
            rope_theta=_target_attr(t, "rope_theta", 1_000_000.0),
            partial_rotary_factor=_target_attr(t, "partial_rotary_factor"),
            rotary_dim=_target_attr(t, "rotary_dim"),
            head_dim=head_dim,
        )
        cfg = cls(
            vocab_size=t.vocab_size,
            hidden_size=t.hidden_size,
            intermediate_size=_target_attr(t, "intermediate_size", 4 * t.hidden_size),
            num_hidden_layers=num_draft_layers,
            num_attention_heads=heads,
            num_key_value_heads=_target_attr(t, "num_key_value_heads", heads),
            head_dim=head_dim,
            hidden_act="silu",
            max_position_embeddings=target_context_length(t),
            rms_norm_eps=_target_attr(t, "rms_norm_eps", 1e-6),
            rope_parameters=rope,
            attention_bias=False,
            tie_word_embeddings=False,
            layer_types=list(layer_types or ["full_attention"] * num_draft_layers),
            sliding_window=sliding_window,
            use_sliding_window=sliding,
            block_size=int(block_size),
            num_target_layers=int(t.num_hidden_layers),
            dflash_config={"mask_token_id": int(mask_token_id), "target_layer_ids": [int(i) for i in target_layer_ids]},
        )
        cfg.architectures = [ARCHITECTURE]
        return cfg

    def to_checkpoint_dict(self, *, dtype: str, meta: Optional[dict] = None) -> dict:
        """The `config.json` content (dflash.md §8.2): this config's fields, `architectures` `[DFlashDraftModel]`,
        `model_type` `qwen3`, `eagle_aux_hidden_state_layer_ids` (`engine_layer_ids`), `dtype`, untied embeddings, and
        the `dflash_pipeline` block: `format_version` plus `meta` (`CheckpointMeta` keys: `train_steps`,
        `zero_target_features`)."""
        cfg = self.to_dict()
        cfg["architectures"] = list(getattr(self, "architectures", None) or [self.architecture])
        cfg["model_type"] = "qwen3"
        cfg["block_size"] = self.block_size
        cfg["num_target_layers"] = self.num_target_layers
        cfg["dflash_config"] = dict(self.dflash_config)
        cfg["eagle_aux_hidden_state_layer_ids"] = self.engine_layer_ids
        cfg["dtype"] = dtype
        cfg["tie_word_embeddings"] = False
        cfg[META_KEY] = {"format_version": CHECKPOINT_FORMAT_VERSION, **(meta or {})}
        cfg["open_spec_config_version"] = OPEN_SPEC_CONFIG_VERSION
        cfg["speculative_config"] = self.open_spec_speculative_config()
        cfg.pop("auto_map", None)
        return cfg

    def open_spec_speculative_config(self) -> dict:
        """`speculative_config` of speculators' Open Spec Config: `method`; `speculative_tokens` (drafts per block: B
        − 1, or B when slot 0 drafts); `target_layer_ids`; `sample_from_anchor`; `mask_token_id`;
        `sliding_window_non_causal`. The engines read none of it (they read `dflash_config`)."""
        drafts = int(self.block_size) - (0 if self.drafts_from_anchor else 1)
        return {
            "method": self.speculative_method,
            "speculative_tokens": drafts,
            "target_layer_ids": self.target_layer_ids,
            "target_layer_start_idx": 0,
            "sample_from_anchor": bool(self.drafts_from_anchor),
            "mask_token_id": self.mask_token_id,
            "sliding_window_non_causal": bool(self.sliding_window_non_causal),
        }

    def save(self, out_dir: str | Path, *, dtype: str, meta: Optional[dict] = None) -> Path:
        """Write `<out_dir>/config.json` (`to_checkpoint_dict`; sorted keys, 2-space indent, one
        trailing newline), atomically; returns its path."""
        path = Path(out_dir) / CONFIG_FILE
        text = json.dumps(self.to_checkpoint_dict(dtype=dtype, meta=meta), indent=2, sort_keys=True) + "\n"
        atomic_write_bytes(path, text.encode("utf-8"), skip_if_identical=False)
        return path

    @classmethod
    def from_checkpoint(cls, ckpt_dir: str | Path) -> "DFlashConfig":
        """The config of the drafter checkpoint at `ckpt_dir` (written by `save`, or any DFlash checkpoint in the
        served layout: `block_size` and `dflash_config` at the top level), as this class.

        Raises:
            FileNotFoundError: no `config.json` in `ckpt_dir`.
            ValueError: not a JSON object, or a DFlash field missing or malformed (naming file and field).
        """
        path, raw = _read_config_json(ckpt_dir)
        fields = {k: v for k, v in raw.items() if k != META_KEY and k not in DERIVED_KEYS}
        try:
            return cls(**fields)
        except (StrictDataclassError, TypeError, ValueError) as exc:  # a field of the wrong type (@strict)
            raise ValueError(f"{path}: {' '.join(str(exc).split())}") from exc


def checkpoint_meta(ckpt_dir: str | Path) -> CheckpointMeta:
    """The `dflash_pipeline` block of the checkpoint at `ckpt_dir` (`CheckpointMeta`):
    `format_version` and what the trainer recorded (`train_steps`, `zero_target_features`). A
    checkpoint from elsewhere (no block) gives `{}`.

    Raises:
        FileNotFoundError / ValueError: as `DFlashConfig.from_checkpoint`.
    """
    path, raw = _read_config_json(ckpt_dir)
    meta = raw.get(META_KEY) or {}
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: `{META_KEY}` is {type(meta).__name__}, expected an object")
    return CheckpointMeta(**meta)


def _read_config_json(ckpt_dir: str | Path) -> tuple[Path, dict]:
    """`(path, dict)` of `<ckpt_dir>/config.json`, its DFlash fields checked (dflash.md §8.2)."""
    path = Path(ckpt_dir) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: not found; a drafter checkpoint directory holds config.json and "
            "model.safetensors (the train stage's final/ or step_<N>/)"
        )
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    dc = raw.get("dflash_config")
    if not isinstance(raw.get("block_size"), int) or not isinstance(dc, dict):
        raise ValueError(
            f"{path}: not a DFlash drafter config (needs an integer `block_size` and a `dflash_config` object)"
        )
    for key in ("target_layer_ids", "mask_token_id"):
        if key not in dc:
            raise ValueError(f"{path}: `dflash_config.{key}` is missing")
    return path, raw


def target_context_length(config) -> int:
    """The target's context length in tokens: `max_position_embeddings`, or the field of the same meaning
    its family names otherwise (MPT's `max_seq_len`, GPT-2's `n_positions` …,
    `core.contracts.CONTEXT_LENGTH_KEYS`).

    Raises:
        ValueError: the config states none, or a bound ≤ 0.
    """
    from dflash_pipeline.core.contracts import CONTEXT_LENGTH_KEYS

    for key in CONTEXT_LENGTH_KEYS:
        value = _target_attr(config, key)
        if isinstance(value, int) and value > 0:  # XLNet's -1: no bound
            return value
    raise ValueError(f"{type(config).__name__} states no context length ({', '.join(CONTEXT_LENGTH_KEYS)})")


def _target_attr(config, name: str, default=None):
    """`config.name` (`default` when missing/None); a per-layer attribute of a heterogeneous config
    (gemma-4's `head_dim`) is read from its serialized global value."""
    try:
        value = getattr(config, name, None)
    except Exception:  # noqa: BLE001 - transformers' AmbiguousGlobalPerLayerAttributeError
        value = config.to_dict().get(name)
    return default if value is None else value
