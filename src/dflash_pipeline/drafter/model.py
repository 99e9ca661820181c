"""The DFlash drafter: Qwen3-style layers with KV injection of fused target features.

Read top to bottom like a Hugging Face `modeling_*.py`: builders → attention with KV injection → decoder
layer → drafter → export/load in the format SGLang and vLLM serve. The training side (`.blocks`,
`.attention_masks`) is re-exported here.

Method: `reference/dflash.md` (DFlash, arXiv 2602.06036): §2 architecture, §2.5 inference loop, §3 target
layers, §4 training objective, §8 checkpoint format. Notation: H hidden size, K fused target layers,
B block size, S sequence length, N anchors per sequence, V vocabulary.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
)

from dflash_pipeline.drafter.attention_masks import (  # noqa: F401 - re-exported, as above
    build_block_mask,
    build_flex_block_mask,
    build_inference_sliding_mask,
    build_training_masks,
    masks_per_layer_type,
)
from dflash_pipeline.drafter.blocks import (  # noqa: F401 - re-exported: the training side, imported as M.* across the package
    AnchorBatch,
    block_inputs_and_labels,
    cosine_with_warmup,
    decayed_cross_entropy,
    expected_acceptance_length,
    loss_decay_gamma,
    loss_normalizer,
    sample_anchors,
    slot_accuracy,
)
from dflash_pipeline.drafter.config import ARCHITECTURE, DFlashConfig
from dflash_pipeline.drafter.rope import DFlashRotaryEmbedding, apply_rope
from dflash_pipeline.target.loading import module_dtype

# --- Config (the class and the checkpoint's config.json: dflash_pipeline.drafter.config)


def drafter_config_from_target(target_config, **sizes) -> DFlashConfig:
    """The drafter's config from the target's text config: `DFlashConfig.from_target`, the name tests and benches build
    drafters with."""
    return DFlashConfig.from_target(target_config, **sizes)


# --- Attention with KV injection (dflash.md §2.2)


class DraftContextCache:
    """Per-layer keys/values of the injected context, for the inference loop (dflash.md §2.5).

    Only context K/V are cached, so "crop to start" is implicit. `keys[i]`/`values[i]`: [batch, kv_heads, C, head_dim].
    """

    def __init__(self, num_layers: int):
        self.keys: list[Optional[torch.Tensor]] = [None] * num_layers
        self.values: list[Optional[torch.Tensor]] = [None] * num_layers

    @property
    def length(self) -> int:
        """Number of context positions cached (tokens)."""
        return 0 if self.keys[0] is None else int(self.keys[0].shape[-2])

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append new context K/V [b, kv_heads, C_new, head_dim] of `layer`; return the full cached K/V."""
        if self.keys[layer] is not None:
            k = torch.cat([self.keys[layer], k], dim=-2)
            v = torch.cat([self.values[layer], v], dim=-2)
        self.keys[layer], self.values[layer] = k, v
        return k, v


class DFlashAttention(nn.Module):
    """Qwen3 GQA attention whose keys/values are [context ‖ block] and whose queries are the block.

    Context and block K/V use the same `k_proj`/`v_proj`; `k_norm` applies to both; RoPE uses the
    absolute positions of each part. Attention is non-causal: visibility comes only from the mask.
    """

    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=config.attention_bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, n, self.head_dim).transpose(1, 2)  # [b, n, t, head_dim]

    def forward(
        self,
        hidden: torch.Tensor,  # [b, Q, H] block stream (after input_layernorm)
        context: torch.Tensor,  # [b, C, H] fused target features (shared by all layers)
        ctx_rope: tuple[torch.Tensor, torch.Tensor],  # cos/sin [b, C, rotary_dim]
        block_rope: tuple[torch.Tensor, torch.Tensor],  # cos/sin [b, Q, rotary_dim]
        attn_mask: Optional[torch.Tensor] = None,  # bool [b, 1, Q, C(+cached)+Q], True = attend
        cache: Optional[DraftContextCache] = None,
    ) -> torch.Tensor:
        q = self.q_norm(self._heads(self.q_proj(hidden), self.num_heads))  # [b, h, Q, d]
        k_blk = self.k_norm(self._heads(self.k_proj(hidden), self.num_kv_heads))  # [b, kv, Q, d]
        v_blk = self._heads(self.v_proj(hidden), self.num_kv_heads)
        q, k_blk = apply_rope(q, *block_rope), apply_rope(k_blk, *block_rope)
        k_ctx = self.k_norm(self._heads(self.k_proj(context), self.num_kv_heads))  # [b, kv, C, d]
        v_ctx = self._heads(self.v_proj(context), self.num_kv_heads)
        k_ctx = apply_rope(k_ctx, *ctx_rope)
        if cache is not None:
            k_ctx, v_ctx = cache.append(self.layer_idx, k_ctx, v_ctx)
        k = torch.cat([k_ctx, k_blk], dim=-2)  # [b, kv, C+Q, d]
        v = torch.cat([v_ctx, v_blk], dim=-2)
        gqa = self.num_heads != self.num_kv_heads
        if _is_block_mask(attn_mask):  # FlexAttention path (GPU training)
            out = _flex_attention()(q, k, v, block_mask=attn_mask, scale=self.scaling, enable_gqa=gqa)
        else:  # dense bool mask (CPU training) or None (inference: see everything)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=attn_mask, is_causal=False, scale=self.scaling, enable_gqa=gqa
            )
        # out: [b, h, Q, d]
        b, _, t, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


def _is_block_mask(mask) -> bool:
    return mask is not None and type(mask).__name__ == "BlockMask"


_FLEX = None


def _flex_attention():
    """`flex_attention`, compiled once on CUDA (eager elsewhere: correct but unfused, for tests)."""
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX = torch.compile(flex_attention, dynamic=True) if torch.cuda.is_available() else flex_attention
    return _FLEX


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class DFlashDecoderLayer(nn.Module):
    """Pre-norm Qwen3 decoder layer with `DFlashAttention` (dflash.md §2.1)."""

    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.attention_type = (getattr(config, "layer_types", None) or ["full_attention"] * (layer_idx + 1))[layer_idx]
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = DFlashAttention(config, layer_idx)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = Qwen3MLP(config)

    def forward(self, x, context, ctx_rope, block_rope, attn_mask=None, cache=None):
        if isinstance(attn_mask, dict):  # per layer type: {"full_attention": m, "sliding_attention": m}
            attn_mask = attn_mask[self.attention_type]
        x = x + self.self_attn(self.input_layernorm(x), context, ctx_rope, block_rope, attn_mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


# --- The drafter


class DFlashDrafter(nn.Module):
    """DFlash drafter: `fc` + `hidden_norm` fuse K target layers; L KV-injected layers; final `norm`.

    Owns no embedding and no LM head: callers pass target embeddings in and apply the target's
    `lm_head` to `forward`'s output (dflash.md §2.1). Parameter names match the served format
    (`fc`, `hidden_norm`, `norm`, `layers.N.*`; §8.3).
    """

    #: The architecture vLLM loads (the family, `drafter.families`, knows the rest).
    architecture = ARCHITECTURE
    #: Sliding layers are causal inside the block (SpecForge/vLLM DFlash semantics, dflash.md §2.3).
    sliding_block_causal = True
    #: `train.gradient_checkpointing`: in training, each draft layer keeps only its input and recomputes its
    #: activations in backward (same values, bit for bit: the layers draw no random numbers).
    gradient_checkpointing = False

    def __init__(self, config: DFlashConfig, layer_cls: type = None):
        super().__init__()
        self.config = config
        layer_cls = layer_cls or DFlashDecoderLayer
        k = len(config.target_layer_ids)
        h = config.hidden_size
        self.block_size = int(config.block_size)
        self.mask_token_id = config.mask_token_id
        self.target_layer_ids = config.target_layer_ids
        self.layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)
        self.sliding_window = (
            getattr(config, "sliding_window", None) if "sliding_attention" in self.layer_types else None
        )
        self.fc = nn.Linear(k * h, h, bias=False)
        self.hidden_norm = Qwen3RMSNorm(h, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(layer_cls(config, i) for i in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(h, eps=config.rms_norm_eps)
        self.rotary_emb = DFlashRotaryEmbedding(config)  # partial rotary as vLLM's get_rope (drafter.rope)
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        std = getattr(self.config, "initializer_range", 0.02)
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(
        self,
        noise_embedding: torch.Tensor,  # [b, Q, H] target embeddings of the block tokens
        target_hidden: torch.Tensor,  # [b, C, K*H] concatenated target features (new context)
        ctx_position_ids: torch.Tensor,  # [b, C] absolute positions of the context tokens
        block_position_ids: torch.Tensor,  # [b, Q] absolute positions of the block tokens
        attn_mask=None,  # bool [b, 1, Q, C_total+Q], a BlockMask, a dict of those per layer type, or None
        cache: Optional[DraftContextCache] = None,
    ) -> torch.Tensor:
        """Return the final-normed block hidden states [b, Q, H] (apply the target `lm_head` next)."""
        context = self.hidden_norm(self.fc(target_hidden))  # [b, C, H], computed once for all layers
        ctx_rope = self.rotary_emb(context, ctx_position_ids)
        block_rope = self.rotary_emb(noise_embedding, block_position_ids)
        x = noise_embedding
        recompute = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        for layer in self.layers:
            if recompute:  # keep only each layer's input; its activations are recomputed in backward
                x = torch.utils.checkpoint.checkpoint(
                    layer, x, context, ctx_rope, block_rope, attn_mask, cache, use_reentrant=False
                )
            else:
                x = layer(x, context, ctx_rope, block_rope, attn_mask, cache)
        return self.norm(x)

    @torch.no_grad()
    def block_hidden(
        self,
        embed_tokens: nn.Module,
        bonus_token: torch.Tensor,  # [b] last committed token (block slot 0)
        new_context: torch.Tensor,  # [b, C_new, K*H] target features not yet in the cache
        start: int,  # absolute position of the bonus token
        cache: DraftContextCache,
        block_size: Optional[int] = None,
    ) -> torch.Tensor:
        """Final-normed hidden states [b, B, H] of block [bonus, MASK×(B−1)].

        The block sees every cached context position (< `start`) and itself, bidirectionally (sliding layers: within
        their window). `new_context` covers positions `cache.length .. start-1` and is appended to `cache`.
        """
        bs = block_size or self.block_size
        b = bonus_token.shape[0]
        dev = bonus_token.device
        block = torch.full((b, bs), self.mask_token_id, dtype=torch.long, device=dev)
        block[:, 0] = bonus_token
        c0 = cache.length
        ctx_pos = torch.arange(c0, c0 + new_context.shape[1], device=dev).expand(b, -1)
        if ctx_pos.shape[1] and int(ctx_pos[0, -1]) != start - 1:
            raise ValueError(f"context covers positions up to {int(ctx_pos[0, -1])}, block starts at {start}")
        blk_pos = torch.arange(start, start + bs, device=dev).expand(b, -1)
        dt = module_dtype(self)
        emb, new_context = embed_tokens(block).to(dt), new_context.to(dt)
        mask = None
        if self.sliding_window is not None:  # full layers see everything; sliding layers need a mask
            full = torch.ones((b, 1, bs, start + bs), dtype=torch.bool, device=dev)
            sliding = build_inference_sliding_mask(
                start, bs, self.sliding_window, device=dev, block_causal=self.sliding_block_causal
            ).expand(b, -1, -1, -1)
            mask = {"full_attention": full, "sliding_attention": sliding}
        return self(emb, new_context, ctx_pos, blk_pos, attn_mask=mask, cache=cache)

    @torch.no_grad()
    def draft_block(
        self, embed_tokens, lm_head, bonus_token, new_context, start, cache, block_size=None
    ) -> torch.Tensor:
        """Logits [b, B, V] of `block_hidden`'s block."""
        hidden = self.block_hidden(embed_tokens, bonus_token, new_context, start, cache, block_size)
        return lm_head(hidden.to(lm_head.weight.dtype))

    @torch.no_grad()
    def propose(self, embed_tokens, lm_head, bonus_token, new_context, start, cache, block_size=None):
        """The family's drafts for one verify step: DFlash drafts slots 1..B−1 greedily (dflash.md §2.5).
        Returns `(drafts long [b, B−1], confidence None)`; DSpark also returns its confidence."""
        logits = self.draft_block(embed_tokens, lm_head, bonus_token, new_context, start, cache, block_size)
        return logits[:, 1:].argmax(dim=-1), None


# --- Checkpoint export / load (dflash.md §8)


def save_drafter(
    drafter: DFlashDrafter, out_dir: str | Path, *, dtype: torch.dtype = torch.bfloat16, extra: Optional[dict] = None
) -> None:
    """Write `model.safetensors` + `config.json` in the layout SGLang/vLLM load (dflash.md §8.1–8.3).

    Tensor names are unprefixed (`fc.weight`, `layers.0.self_attn.q_proj.weight`, …); no embedding or LM head (they are
    the target's); tensors in `dtype`. `config.json` is written by `DFlashConfig.save`. Writes into `out_dir` (created);
    callers make the directory atomic.
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {
        k: v.detach().to("cpu", dtype=dtype).contiguous()
        for k, v in drafter.state_dict().items()
        if not k.startswith("rotary_emb.")
    }
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    drafter.config.architectures = [drafter.architecture]  # the family's (dflash_pipeline.drafter.families)
    drafter.config.save(out, dtype=str(dtype).replace("torch.", ""), meta=extra)


def count_parameters(module: nn.Module, trainable_only: bool = True) -> int:
    """Number of (trainable) parameters."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable_only)
