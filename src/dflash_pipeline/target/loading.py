"""The frozen target, loaded the same way for every family by `load_target` (train, eval, completions).

Three policies live here and nowhere else:

* **dtype** (`resolve_dtype`): `auto` → float32 on CPU, bfloat16 on CUDA. The drafter computes in its
  parameter dtype (`to_drafter_dtype`), meets the LM head in the head's dtype (`lm_head_logits`), and the
  loss is float32 cross-entropy; in eval the drafter takes the target's dtype (`drafter_dtype`).
* **model class** (`causal_lm_class`): the class `config.architectures` names when transformers ships it,
  else `AutoModelForCausalLM`, else `AutoModelForImageTextToText` for nested `text_config` targets;
  a `model_type` transformers does not know whose `architectures` it ships (`kimi_k2`) is read with that
  class's config, as vLLM and SGLang do.
* **accessors**: `input_embeddings`, `lm_head`, `num_decoder_layers`, `hidden_states_of`.

`check_loadable` resolves class and config without weights, for the probe at plan time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from dflash_pipeline.core.errors import ProbeRefusal

#: `target.dtype` / `--target-dtype` values.
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")


class TargetLoadError(ProbeRefusal):
    """The target cannot be loaded as a causal LM (the message says why and what to set); a
    `ProbeRefusal` with `reason` `"not loadable"` unless given another."""

    def __init__(self, message: str, reason: str = "not loadable"):
        super().__init__(reason, message)


# --- dtype policy


def resolve_dtype(spec: str | torch.dtype, device: str | torch.device = "cpu") -> torch.dtype:
    """The target dtype for `spec` on `device`: `auto` → float32 on CPU, bfloat16 on CUDA.

    Raises:
        ValueError: unknown `spec` (names the valid choices).
    """
    if isinstance(spec, torch.dtype):
        return spec
    if spec == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if spec not in DTYPE_CHOICES:
        raise ValueError(f"target dtype {spec!r}: use one of {', '.join(DTYPE_CHOICES)}")
    return getattr(torch, spec)


def module_dtype(module: torch.nn.Module) -> torch.dtype:
    """dtype of the first floating-point parameter of `module` (float32 when it has none)."""
    for p in module.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def drafter_dtype(target: torch.nn.Module) -> torch.dtype:
    """dtype the drafter runs in at inference beside `target`: the target's own (bf16 beside bf16)."""
    return module_dtype(target)


def to_drafter_dtype(drafter: torch.nn.Module, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Cast drafter inputs (target embeddings, target features) to the drafter's parameter dtype."""
    core = getattr(drafter, "module", drafter)
    dt = module_dtype(core)
    return tuple(t.to(dt) for t in tensors)


def lm_head_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Logits [..., V] float32 of drafter output `hidden` [..., H] through the target LM head
    `weight` [V, H]: the matmul runs in the head's dtype (bf16 head → bf16 matmul, as the serving
    engines do), the result is upcast for the softmax/cross-entropy."""
    return torch.nn.functional.linear(hidden.to(weight.dtype), weight).float()


# --- config and class resolution


def _raw_config(target_dir: Path) -> dict:
    path = target_dir / "config.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TargetLoadError(f"{path}: cannot read the target config ({exc})") from None


def _native_class(name: Optional[str]):
    import transformers

    if not name:
        return None
    cls = getattr(transformers, name, None)
    if cls is None:  # e.g. "KimiK25ForConditionalGeneration" ships as "Kimi_K25ForConditionalGeneration"
        low = name.replace("_", "").lower()
        for attr in dir(transformers):
            if attr.replace("_", "").lower() == low and attr[0].isupper():
                cls = getattr(transformers, attr)
                break
    return cls if cls is not None and hasattr(cls, "from_pretrained") and hasattr(cls, "config_class") else None


def load_target_config(target_dir: str | Path, *, trust_remote_code: bool = False):
    """The target's `PretrainedConfig`: `AutoConfig` (offline), else the config class of the natively
    shipped class `config.architectures` names (for unknown/remote `model_type` such as `kimi_k2`).

    Raises:
        TargetLoadError: neither works (the message carries AutoConfig's reason).
    """
    from transformers import CONFIG_MAPPING, AutoConfig

    target_dir = Path(target_dir)
    raw = _raw_config(target_dir)
    reason = f"model_type {raw.get('model_type')!r} is not one transformers ships"
    if (
        trust_remote_code or raw.get("model_type") in CONFIG_MAPPING
    ):  # never AutoConfig's interactive remote-code prompt
        try:
            return AutoConfig.from_pretrained(
                str(target_dir), trust_remote_code=trust_remote_code, local_files_only=True
            )
        except Exception as exc:  # noqa: BLE001 - fall back to the native architecture, else report why
            reason = " ".join(str(exc).split())[:300]
    for arch in raw.get("architectures") or []:
        cls = _native_class(arch)
        if cls is not None:
            fields = {k: v for k, v in raw.items() if k not in ("model_type", "auto_map", "architectures")}
            cfg = cls.config_class(**fields)
            cfg.architectures = [cls.__name__]
            return cfg
    hint = (
        ""
        if trust_remote_code
        else " (if the model ships its own code, review it and set `target.trust_remote_code: true`)"
    )
    raise TargetLoadError(
        f"{target_dir}/config.json: transformers cannot load model_type {raw.get('model_type')!r} and no class in "
        f"`architectures` {raw.get('architectures')} ships with transformers: {reason}{hint}"
    )


def causal_lm_class(config, *, trust_remote_code: bool = False):
    """The class that loads `config` as a causal LM with logits over the vocabulary (see module docstring).

    Raises:
        TargetLoadError: no such class (names the model type and what was tried).
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    auto_map = getattr(config, "auto_map", None) or {}
    if trust_remote_code and "AutoModelForCausalLM" in auto_map:
        return AutoModelForCausalLM
    for arch in getattr(config, "architectures", None) or []:
        cls = _native_class(arch)
        if cls is not None and isinstance(config, cls.config_class):
            return cls
    mt = getattr(config, "model_type", None)
    if mt in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return AutoModelForCausalLM
    if mt in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return AutoModelForImageTextToText
    raise TargetLoadError(
        f"model_type {mt!r} (architectures {getattr(config, 'architectures', None)}) has no causal-LM class in "
        "transformers (AutoModelForCausalLM, AutoModelForImageTextToText, the named architecture)"
        + ("" if trust_remote_code else "; if it ships its own modeling code, set `target.trust_remote_code: true`")
    )


def text_config(config):
    """The decoder's config (`text_config` of a multimodal target, else `config` itself)."""
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if get is not None else config


def check_loadable(target_dir: str | Path, *, trust_remote_code: bool = False) -> dict:
    """Resolve the config and model class without reading weights (plan/probe time).

    Returns `{"class": name, "config_class": name, "num_hidden_layers": L}`.

    Raises:
        TargetLoadError: the family cannot be loaded (the reason is in the message).
    """
    cfg = load_target_config(target_dir, trust_remote_code=trust_remote_code)
    cls = causal_lm_class(cfg, trust_remote_code=trust_remote_code)
    tc = text_config(cfg)
    layers = getattr(tc, "num_hidden_layers", None)
    if not isinstance(layers, int):  # e.g. PI0: the language model sits in a sub-config transformers does not return
        raise TargetLoadError(
            f"{target_dir}/config.json: {type(cfg).__name__} gives no decoder with num_hidden_layers "
            f"(get_text_config() is {type(tc).__name__}); the drafter needs one decoder whose layers see "
            "every token",
            reason="no language-model config",
        )
    return {"class": cls.__name__, "config_class": type(cfg).__name__, "num_hidden_layers": layers}


# --- loading


def load_target(
    target_dir: str | Path,
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
    frozen: bool = True,
    device_map: Optional[str] = None,
):
    """Load the target (eval mode; `frozen`: `requires_grad=False`) in `resolve_dtype` `dtype`.

    `device_map` (e.g. `"auto"`): spread the layers over the visible GPUs instead of moving the whole model to
    `device`; `device` then only picks the dtype.

    Raises:
        TargetLoadError: the config or class cannot be resolved (see `check_loadable`).
    """
    dev = torch.device(device)
    cfg = load_target_config(target_dir, trust_remote_code=trust_remote_code)
    cls = causal_lm_class(cfg, trust_remote_code=trust_remote_code)
    kw: dict[str, Any] = {"trust_remote_code": trust_remote_code} if trust_remote_code else {}
    if device_map is not None:
        kw["device_map"] = device_map
    model = cls.from_pretrained(str(target_dir), config=cfg, dtype=resolve_dtype(dtype, dev), **kw)
    if device_map is None:
        model.to(dev)
    model.eval()
    if frozen:
        model.requires_grad_(False)
    return model


class BareEmbedding(torch.nn.Module):
    """The bare lookup `weight[ids]` of an embedding module, whatever scaling its forward adds.

    `weight` is the source module's own tensor (not a copy, not registered as a parameter here).
    """

    def __init__(self, source: torch.nn.Module):
        super().__init__()
        object.__setattr__(self, "source", source)  # not a submodule: the target owns it

    @property
    def weight(self) -> torch.Tensor:
        return self.source.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(input_ids, self.source.weight, getattr(self.source, "padding_idx", None))


def input_embeddings(target) -> torch.nn.Module:
    """The drafter's token embedding: the target's embedding table looked up *bare* (ids → [b, S, H]), on every
    path, as vLLM serves it (its DFlash `embed_input_ids` is the shared `embed_tokens` alone,
    `vllm/model_executor/models/qwen3_dflash.py`; Gemma's √H normaliser stays outside, `gemma3.py`). A plain
    `nn.Embedding` is returned as is."""
    emb = target.get_input_embeddings()
    return emb if type(emb) is torch.nn.Embedding else BareEmbedding(emb)


def final_logit_softcap(config) -> Optional[float]:
    """The target's `final_logit_softcapping` (its text config's; gemma-2/3/4: 30.0), or None."""
    cap = getattr(text_config(config), "final_logit_softcapping", None)
    return float(cap) if cap else None


def lm_head(target) -> torch.nn.Module:
    """The target's LM head (`weight` [V, H])."""
    head = target.get_output_embeddings()
    if head is None:
        raise TargetLoadError(f"{type(target).__name__} has no output embeddings (LM head)")
    return head


def num_decoder_layers(target) -> int:
    """Number of decoder layers L (HF `hidden_states` has L + 1 entries)."""
    return int(text_config(target.config).num_hidden_layers)


def hidden_states_of(
    target, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None, *, need_logits: bool = False, **kw
):
    """Forward the target with `output_hidden_states`; returns the model output, whose `hidden_states` is the
    (L + 1)-tuple of [b, S, H] (index 0 the embeddings, index L after the final norm; `[b, S, n, H]`
    parallel streams collapsed by `collapse_streams`) and `logits` [b, S, V] with `need_logits`, else at most [b, 1, V]
    (`logits_to_keep=1`: training never materialises full-vocabulary logits)."""
    if not need_logits and "logits_to_keep" in _forward_params(target):
        kw.setdefault("logits_to_keep", 1)
    out = target(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, **kw)
    hs = out.hidden_states
    if hs is None or len(hs) != num_decoder_layers(target) + 1:
        n = None if hs is None else len(hs)
        raise TargetLoadError(
            f"{type(target).__name__} returned {n} hidden states for {num_decoder_layers(target)} decoder layers "
            "(expected L + 1)"
        )
    if any(h.dim() == 4 for h in hs):
        out.hidden_states = tuple(collapse_streams(target, h) for h in hs)
    return out


def stream_head(target) -> Optional[torch.nn.Module]:
    """The module that collapses a hyper-connection target's parallel residual streams into one hidden state
    before its final norm (DeepSeek-V4's `hc_head`), None for a target without one."""
    decoder = target.get_decoder() if hasattr(target, "get_decoder") else None
    for owner in (decoder, getattr(target, "model", None), target):
        head = getattr(owner, "hc_head", None) if owner is not None else None
        if isinstance(head, torch.nn.Module):
            return head
    return None


def collapse_streams(target, hidden: torch.Tensor) -> torch.Tensor:
    """One hidden state `[b, S, H]` from a layer output: `hidden` itself when it is `[b, S, H]`; for a
    hyper-connection target with `n` parallel residual streams `[b, S, n, H]` (DeepSeek-V4's mHC), the
    target's own learned stream collapse (`stream_head`, what its final norm and LM head read), without the
    final norm, in `hidden`'s dtype.

    Raises:
        TargetLoadError: `hidden` has parallel streams but the target has no stream collapse."""
    if hidden.dim() != 4:
        return hidden
    head = stream_head(target)
    if head is None:
        raise TargetLoadError(
            f"{type(target).__name__} returns hidden states of shape {tuple(hidden.shape)} ([b, S, streams, H]) "
            "and has no stream collapse (hc_head) to reduce them to one hidden state per token"
        )
    return head(hidden).to(hidden.dtype)


def _forward_params(target) -> frozenset:
    import inspect

    try:
        return frozenset(inspect.signature(target.forward).parameters)
    except (TypeError, ValueError):
        return frozenset()


def select_layers(hidden_states: Sequence[torch.Tensor], layer_ids: Sequence[int]) -> torch.Tensor:
    """Concatenate the outputs of canonical layers `layer_ids` (HF index id + 1) → [b, S, K·H]."""
    from dflash_pipeline.target.layer_ids import hf_hidden_state_index

    return torch.cat([hidden_states[hf_hidden_state_index(i)] for i in layer_ids], dim=-1)
