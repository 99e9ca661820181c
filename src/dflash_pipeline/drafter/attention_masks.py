"""Attention masks of the DFlash drafter: training block masks (dense and FlexAttention) and the sliding
layers' inference mask (dflash.md §2.3, §4.4).

KV layout in training: [context (S) ‖ block_0 (B) ‖ … ‖ block_{N−1} (B)], queries the N·B block slots; True = attend.
`masks_per_layer_type` is the one place that turns a builder into one mask per layer type the drafter has (full /
sliding); packed rows reuse it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from dflash_pipeline.drafter.model import DFlashDrafter


#: The smallest head dimension FlexAttention's compiled kernels take (torch 2.11 inductor: "embedding dimension of
#: the query, key, and value must be at least 16"); seen on an H200 with a tiny target's head_dim 8.
FLEX_MIN_HEAD_DIM = 16


def training_attention_backend(setting: str, device_type: str, head_dim: Optional[int] = None) -> str:
    """`train.attention_backend` as a run uses it: an explicit `sdpa` or `flex` stays; `auto` is `flex` on CUDA
    when the drafter's `head_dim` (None: unknown, taken as large enough) is at least `FLEX_MIN_HEAD_DIM`, else
    `sdpa` (CPU, where FlexAttention has no backward, and tiny heads)."""
    if setting != "auto":
        return setting
    small = head_dim is not None and head_dim < FLEX_MIN_HEAD_DIM
    return "flex" if device_type == "cuda" and not small else "sdpa"


def build_block_mask(
    anchors: torch.Tensor,
    seq_len: int,
    block_size: int,
    *,
    sliding_window: Optional[int] = None,
    block_causal: bool = True,
) -> torch.Tensor:
    """Dense training attention mask (dflash.md §4.4), True = attend.

    KV layout [context (S) ‖ block_0 (B) ‖ … ‖ block_{N−1} (B)]; queries are the N·B block slots. Slot q of
    block n = q // B sees context key j iff j < anchors[n] (by position, so overlapping anchors never leak)
    and every key of its own block, never other blocks.

    `sliding_window` (dflash.md §2.3, SpecForge semantics) also limits the context to
    `query_position − j < sliding_window`, and the block to slots at or before the query (`block_causal=False`:
    the whole block, DFlash2).

    Args:
        anchors: long [b, N].
    Returns:
        bool [b, 1, N·B, S + N·B]."""
    b, n = anchors.shape
    dev = anchors.device
    q_block = torch.arange(n * block_size, device=dev) // block_size  # [Q]
    q_off = torch.arange(n * block_size, device=dev) % block_size  # [Q]
    q_anchor = anchors[:, q_block]  # [b, Q]
    j = torch.arange(seq_len, device=dev).view(1, 1, -1)
    ctx = j < q_anchor.unsqueeze(-1)  # [b, Q, S]
    own = q_block.view(-1, 1) == q_block.view(1, -1)  # [Q, N·B]
    if sliding_window is not None:
        q_pos = (q_anchor + q_off).unsqueeze(-1)  # [b, Q, 1]
        ctx = ctx & (q_pos - j < sliding_window)
        if block_causal:
            own = own & (q_off.view(1, -1) <= q_off.view(-1, 1))
    own = own.unsqueeze(0).expand(b, -1, -1)
    return torch.cat([ctx, own], dim=-1).unsqueeze(1)


def build_flex_block_mask(
    anchors: torch.Tensor,
    seq_len: int,
    block_size: int,
    *,
    sliding_window: Optional[int] = None,
    segment_ids: Optional[torch.Tensor] = None,
    block_causal: bool = True,
):
    """The same predicate as `build_block_mask` as a FlexAttention `BlockMask` (no dense [b, Q, S+Q] tensor;
    dflash.md §4.4).

    `segment_ids` long [b, S] (packed rows, `train.packing`): context key j is visible
    only when it lies in the anchor's record as well."""
    from torch.nn.attention.flex_attention import create_block_mask

    b, n = anchors.shape
    q_len = n * block_size

    def mask_mod(bi, hi, q, kv):
        blk = torch.clamp(q // block_size, max=n - 1)
        anchor = anchors[bi, blk]
        in_ctx = (kv < seq_len) & (kv < anchor)
        if segment_ids is not None:
            in_ctx = in_ctx & (segment_ids[bi, torch.clamp(kv, max=seq_len - 1)] == segment_ids[bi, anchor])
        kv_blk = torch.clamp(kv - seq_len, min=0) // block_size
        in_own = (kv >= seq_len) & (kv_blk == blk)
        if sliding_window is not None:
            q_off = q % block_size
            in_ctx = in_ctx & (anchor + q_off - kv < sliding_window)
            if block_causal:
                in_own = in_own & ((kv - seq_len) % block_size <= q_off)
        return in_ctx | in_own

    return create_block_mask(mask_mod, B=b, H=None, Q_LEN=q_len, KV_LEN=seq_len + q_len, device=anchors.device)


def build_training_masks(drafter: "DFlashDrafter", anchors: torch.Tensor, seq_len: int, backend: str = "sdpa"):
    """Masks for every layer type the drafter has: one mask, or `{layer_type: mask}` when it mixes
    full and sliding layers. `backend`: `sdpa` (dense bool) or `flex` (BlockMask)."""
    build = build_flex_block_mask if backend == "flex" else build_block_mask
    return masks_per_layer_type(drafter, lambda **kw: build(anchors, seq_len, drafter.block_size, **kw))


def masks_per_layer_type(drafter: "DFlashDrafter", build):
    """`build()` for full-attention layers and `build(sliding_window=W)` for sliding ones: one mask when
    the drafter has one layer type, else `{layer_type: mask}`."""
    types = set(drafter.layer_types)
    masks = {}
    if "full_attention" in types:
        masks["full_attention"] = build()
    if "sliding_attention" in types:
        masks["sliding_attention"] = build(
            sliding_window=drafter.sliding_window, block_causal=getattr(drafter, "sliding_block_causal", True)
        )
    return next(iter(masks.values())) if len(masks) == 1 else masks


def build_inference_sliding_mask(
    start: int, block_size: int, sliding_window: int, device=None, block_causal: bool = True
) -> torch.Tensor:
    """Inference mask of a sliding layer: block slot k (position start+k) sees context j with
    start+k−j < window, and block slots ≤ k (every slot when not `block_causal`). bool [1, 1, B, start + B]."""
    k = torch.arange(block_size, device=device).view(-1, 1)
    j = torch.arange(start, device=device).view(1, -1)
    ctx = (start + k) - j < sliding_window
    own = torch.arange(block_size, device=device).view(1, -1) <= k
    if not block_causal:
        own = torch.ones_like(own)
    return torch.cat([ctx, own], dim=-1).view(1, 1, block_size, start + block_size)
