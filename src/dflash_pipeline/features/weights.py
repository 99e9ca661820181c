"""The target's embedding and LM head (and final norm), read from its safetensors without instantiating the
target: with `train.target_features: shards` the drafter still needs them (dflash.md §4.3), and a
1T-parameter MoE cannot be loaded for that. Tied embeddings use the embedding for both.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

#: Suffixes of input-embedding keys, in preference order.
EMBED_SUFFIXES = ("embed_tokens.weight", "tok_embeddings.weight", "word_embeddings.weight", "wte.weight")
#: LM-head keys (suffix match), in preference order.
HEAD_SUFFIXES = ("lm_head.weight", "output.weight", "embed_out.weight")
#: Key fragments of non-text towers and multi-token-prediction heads, never the text model's tensors.
_SKIP = ("vision", "visual", "audio", "image", "mtp", "speech", "talker", "draft")


def weight_map(target_dir: str | Path) -> dict[str, str]:
    """Tensor name → file name of a target checkpoint.

    Raises:
        FileNotFoundError: no safetensors weights in `target_dir`.
    """
    d = Path(target_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        return dict(json.loads(index.read_text(encoding="utf-8"))["weight_map"])
    from safetensors import safe_open

    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "np") as fh:
            out.update({k: f.name for k in fh.keys()})
    if not out:
        raise FileNotFoundError(
            f"{d}: no model.safetensors.index.json and no *.safetensors file; train.target_features: "
            "shards reads the embedding and LM head from the target's safetensors weights"
        )
    return out


def _pick(keys, suffixes) -> Optional[str]:
    cands = [k for k in keys if not any(s in k.lower() for s in _SKIP)]
    for suf in suffixes:
        hits = sorted((k for k in cands if k == suf or k.endswith("." + suf)), key=lambda k: (k.count("."), k))
        if hits:
            return hits[0]
    return None


def find_embed_and_head_keys(
    target_dir: str | Path, tie_word_embeddings: Optional[bool] = None
) -> tuple[str, Optional[str]]:
    """`(embedding key, LM-head key or None when tied)` of the target's checkpoint.

    `tie_word_embeddings` (the probe's value) forces the tied answer; None = tied when there is no head tensor.

    Raises:
        KeyError: no embedding tensor found (the message lists the suffixes tried).
    """
    wmap = weight_map(target_dir)
    emb = _pick(wmap, EMBED_SUFFIXES)
    if emb is None:
        raise KeyError(
            f"{target_dir}: no input-embedding tensor (looked for keys ending in {', '.join(EMBED_SUFFIXES)})"
        )
    head = None if tie_word_embeddings else _pick(wmap, HEAD_SUFFIXES)
    return emb, head


def load_embed_and_head(
    target_dir: str | Path, *, tie_word_embeddings: Optional[bool] = None, dtype=None, device="cpu"
):
    """`(embed nn.Embedding [V, H], lm_head nn.Linear H→V without bias)`, frozen, from the target's weights.

    `dtype`: torch dtype to cast to (None keeps the checkpoint's). Tied targets share one tensor.

    Raises:
        KeyError: no embedding tensor; ValueError: a quantized (integer / fp8) embedding or head, or the two
        shapes disagree.
    """
    import torch
    from safetensors import safe_open

    emb_key, head_key = find_embed_and_head_keys(target_dir, tie_word_embeddings)
    wmap = weight_map(target_dir)

    def get(key):
        with safe_open(str(Path(target_dir) / wmap[key]), "pt") as fh:
            t = fh.get_tensor(key)
        if not t.is_floating_point() or t.element_size() < 2:
            raise ValueError(
                f"{target_dir}: tensor {key} is {t.dtype}; a quantized embedding/LM head cannot be used "
                "as is (dequantize those two tensors, or use train.target_features: online)"
            )
        return t.to(dtype=dtype or t.dtype, device=device)

    w = get(emb_key)
    embed = torch.nn.Embedding(w.shape[0], w.shape[1], _weight=w, _freeze=True, device=device, dtype=w.dtype)
    head_w = get(head_key) if head_key else embed.weight
    if head_w.shape[1] != w.shape[1]:
        raise ValueError(
            f"{target_dir}: {head_key} {tuple(head_w.shape)} and {emb_key} {tuple(w.shape)} disagree on hidden size"
        )
    lm_head = torch.nn.Linear(head_w.shape[1], head_w.shape[0], bias=False, device="meta")
    lm_head.weight = (
        head_w if isinstance(head_w, torch.nn.Parameter) else torch.nn.Parameter(head_w, requires_grad=False)
    )
    embed.requires_grad_(False)
    lm_head.requires_grad_(False)
    return embed, lm_head


#: Attribute names of a decoder's final norm (the LM head's input norm), in preference order.
FINAL_NORM_ATTRS = ("norm", "final_layernorm", "ln_f", "final_norm")


def final_norm_module(model):
    """`(qualified name, module)` of the final norm of `model`'s decoder (`get_decoder()`'s `norm` /
    `final_layernorm` / `ln_f` / `final_norm`). Raises ValueError (names the class) when it has none."""
    dec = model.get_decoder() if hasattr(model, "get_decoder") else model
    norm = next((getattr(dec, a) for a in FINAL_NORM_ATTRS if getattr(dec, a, None) is not None), None)
    name = next((n for n, m in model.named_modules() if m is norm), None) if norm is not None else None
    if name is None:
        raise ValueError(
            f"{type(model).__name__}: no final norm on its decoder (looked for {', '.join(FINAL_NORM_ATTRS)}); "
            "train.loss: kl without the target needs it"
        )
    return name, norm


def load_final_norm(target_dir: str | Path, config, *, dtype=None, device="cpu"):
    """The target's final norm (frozen), built from its own class on the meta device and read from its
    safetensors without instantiating the target.

    `kl` with `shards` / `stream` needs it: feature shards and servers carry the last decoder layer's output
    before the final norm (vLLM: aux layer `num_hidden_layers`, `Qwen2Model.forward` in vLLM 0.32), while the
    teacher's logits are `lm_head(norm(h))`. The norm's own class keeps details exact (Gemma's `1 + weight`).

    `config`: the target's config (`load_target_config`). Returns the module: `[..., H]` → `[..., H]` in
    `dtype` (None keeps the checkpoint's).

    Raises:
        ValueError: no final norm on the decoder; KeyError: a norm tensor is not in the checkpoint."""
    import torch
    from safetensors import safe_open

    with torch.device("meta"):
        model = _meta_model(config)
    name, norm = final_norm_module(model)
    wmap = weight_map(target_dir)
    tail = name.split(".")
    norm = norm.to_empty(device=device)
    for pname, p in list(norm.named_parameters()) + list(norm.named_buffers()):
        key = _norm_key(wmap, tail, pname)
        if key is None:
            raise KeyError(f"{target_dir}: no tensor for the final norm's {name}.{pname} in the checkpoint")
        with safe_open(str(Path(target_dir) / wmap[key]), "pt") as fh:
            t = fh.get_tensor(key)
        p.data = t.to(dtype=dtype or t.dtype, device=device)
    norm.requires_grad_(False)
    return norm.eval()


def _meta_model(config):
    """The target's causal-LM class built from `config` (under a meta-device context: no memory)."""
    from dflash_pipeline.target.loading import causal_lm_class

    cls = causal_lm_class(config)
    return cls._from_config(config) if hasattr(cls, "_from_config") else cls.from_config(config)


def _norm_key(wmap, tail: list[str], pname: str) -> Optional[str]:
    """The checkpoint key of the norm's `pname`: its module path, else the longest suffix of it that one
    non-layer key ends with (`model.norm` ↔ `model.language_model.norm`)."""
    for i in range(len(tail)):
        suf = ".".join(tail[i:] + [pname])
        hits = sorted(k for k in wmap if (k == suf or k.endswith("." + suf)) and ".layers." not in k)
        if hits:
            return min(hits, key=lambda k: (k.count("."), k))
    return None
