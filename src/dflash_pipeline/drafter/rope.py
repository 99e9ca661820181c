"""The drafter's rotary position embedding, the one vLLM serves (`get_rope` in
`vllm/model_executor/layers/rotary_embedding/__init__.py`, built by `qwen3_dflash.DFlashQwen3Attention`).

A drafter trained with one rotary and served with another accepts near nothing (speculators #613, vLLM
#46301). vLLM builds the drafter's rotary from `config.json` `rope_parameters` alone:

* `rotary_dim = rope_dim` if set, else `int(head_dim × partial_rotary_factor)`; only those channels are
  rotated (neox style), the rest pass through (`apply_rope`), unlike transformers' `Qwen3RotaryEmbedding`.
* `rope_type` default / yarn / llama3 / linear / dynamic: transformers' `ROPE_INIT_FUNCTIONS`, equal to
  vLLM's (`tests/e2e/test_family_parity.py`).
* `mrope_section` makes the DFlash proposer refuse the drafter (`llm_base_proposer._raise_if_mrope`); for
  text M-RoPE equals the plain rotary, so `drafter_rope_parameters` drops it.

`servable_rope_problems` lists what vLLM cannot serve (the probe refuses it at planning).
"""

from __future__ import annotations

import torch
from torch import nn

#: rope_parameters keys the drafter cannot honour in vLLM's DFlash proposer (see the module docstring).
DROPPED_KEYS = ("mrope_section", "mrope_interleaved")
#: `rope_type` values vLLM's `get_rope` builds and training reproduces (dflash_pipeline.drafter.rope).
SERVABLE_ROPE_TYPES = ("default", "yarn", "llama3", "linear")


def drafter_rope_parameters(
    target_rope: dict | None,
    *,
    rope_theta: float,
    partial_rotary_factor=None,
    rotary_dim: int | None = None,
    head_dim: int | None = None,
) -> dict:
    """The drafter's `rope_parameters` from the target's (its text config's `rope_parameters`).

    `target_rope`: a flat dict, or one per layer type (gemma: the `default`-type entry is used). `partial_rotary_factor`
    / `rotary_dim` apply when the dict has no factor. Drops `DROPPED_KEYS`; `type` is renamed `rope_type`.
    """
    rope = dict(target_rope or {})
    if rope and all(isinstance(v, dict) for v in rope.values()):  # per layer type (gemma): the plain one
        plain = [v for v in rope.values() if v.get("rope_type", "default") == "default"]
        rope = dict(plain[0] if plain else next(iter(rope.values())))
    if "type" in rope:  # legacy name (DeepSeek, Kimi): vLLM and transformers read rope_type
        legacy = rope.pop("type")
        rope.setdefault("rope_type", legacy)
    for k in DROPPED_KEYS:
        rope.pop(k, None)
    rope.setdefault("rope_type", "default")
    rope.setdefault("rope_theta", rope_theta)
    if "partial_rotary_factor" not in rope and "rope_dim" not in rope:
        if partial_rotary_factor is not None and float(partial_rotary_factor) != 1.0:
            rope["partial_rotary_factor"] = float(partial_rotary_factor)
        elif rotary_dim and head_dim and int(rotary_dim) != int(head_dim):
            rope["partial_rotary_factor"] = int(rotary_dim) / int(head_dim)
    return rope


def rotary_dim_of(rope: dict, head_dim: int) -> int:
    """Rotated channels per head, as `get_rope` computes it: `rope_dim` or `int(head_dim × factor)`."""
    if rope.get("rope_dim"):
        return int(rope["rope_dim"])
    return int(head_dim * float(rope.get("partial_rotary_factor", 1.0)))


def servable_rope_problems(rope: dict, head_dim: int) -> list[str]:
    """Why vLLM's DFlash drafter cannot serve these `rope_parameters` (empty: it can)."""
    out = []
    kind = rope.get("rope_type", "default")
    if kind not in SERVABLE_ROPE_TYPES:
        out.append(
            f"rope_type {kind!r} is not one the drafter trains and vLLM serves ({', '.join(SERVABLE_ROPE_TYPES)})"
        )
    if any(k in rope for k in DROPPED_KEYS):
        out.append("M-RoPE (mrope_section): vLLM's DFlash proposer refuses M-RoPE drafters")
    factor = float(rope.get("partial_rotary_factor", 1.0))
    if not 0.0 < factor <= 1.0:
        out.append(f"partial_rotary_factor {factor} outside (0, 1] (vLLM get_rope refuses it)")
    rd = rotary_dim_of(rope, head_dim)
    if rd <= 0 or rd % 2 or rd > head_dim:
        out.append(f"rotary_dim {rd} of head_dim {head_dim}: must be even, > 0 and ≤ head_dim")
    return out


class DFlashRotaryEmbedding(nn.Module):
    """cos/sin [b, T, rotary_dim] for positions [b, T] (float32 math, cast to `x`'s dtype).

    Inverse frequencies over `rotary_dim` channels (`rotary_dim_of`): default rope
    1/θ^(2i/rotary_dim) (vLLM `RotaryEmbedding._compute_inv_freq`); other types from transformers'
    `ROPE_INIT_FUNCTIONS` (yarn's and llama3's formulas, which read `partial_rotary_factor`), their
    attention scaling multiplied into cos/sin like vLLM's `mscale`.
    """

    def __init__(self, config):
        super().__init__()
        rope = dict(config.rope_parameters)
        self.head_dim = int(config.head_dim)
        self.rotary_dim = rotary_dim_of(rope, self.head_dim)
        kind = rope.get("rope_type", "default")
        if kind == "default":
            d = self.rotary_dim
            inv_freq = 1.0 / (float(rope["rope_theta"]) ** (torch.arange(0, d, 2, dtype=torch.float) / d))
            self.attention_scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[kind](config, None)
        if inv_freq.numel() * 2 != self.rotary_dim:
            raise ValueError(f"rope {kind}: {inv_freq.numel()} frequencies for rotary_dim {self.rotary_dim}")
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first `rotary_dim` channels of each head (neox halves), pass the rest through.

    `x` [b, heads, T, head_dim]; `cos`/`sin` [b, T, rotary_dim]. vLLM `RotaryEmbedding.forward_native`: `query_rot =
    query[..., :rotary_dim]`, neox rotation, `cat(query_rot, query_pass)`.
    """
    rd = cos.shape[-1]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    if rd == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    rot, rest = x[..., :rd], x[..., rd:]
    return torch.cat((rot * cos + _rotate_half(rot) * sin, rest), dim=-1)
