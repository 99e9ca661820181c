"""DFlash training blocks and their base loss (dflash.md §4): anchors, block inputs with same-position
labels and decayed weights, the chunked decayed cross-entropy with its global normaliser, per-slot
accuracy and the EAL proxy, the LR schedule. Notation as in `.model`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from dflash_pipeline.target.loading import lm_head_logits


@dataclass
class LossOutput:
    """One micro-batch's objective on one rank.

    `total`: float32 scalar with grad, Σ of the per-slot terms (not normalised).
    `normalizer`: float32 scalar, this micro-batch's share of the denominator (Σ slot weights for
    `ce_decay`/`kl`; the number of sequences for `dpace`). The loss to report is
    Σ total / Σ normalizer over every rank and micro-step; `local` is this micro-batch's alone.
    `stats`: `num_slots` (supervised slots), `correct` bool [num_slots] (argmax == label) and
    `index` long [num_slots] (flat slot index into [b·Q]).
    """

    total: torch.Tensor
    normalizer: torch.Tensor
    stats: dict = field(default_factory=dict)

    def local(self) -> torch.Tensor:
        """`total / normalizer` (0 when nothing is supervised)."""
        return self.total / self.normalizer.clamp(min=1e-12)


@dataclass
class AnchorBatch:
    """Sampled anchors for a batch. `anchors` long [b, N] (sorted per row), `keep` bool [b, N]."""

    anchors: torch.Tensor
    keep: torch.Tensor


def sample_anchors(
    loss_mask: torch.Tensor, num_anchors: int, generator: Optional[torch.Generator] = None
) -> AnchorBatch:
    """Draw up to `num_anchors` random anchors per sequence, redrawn every step (dflash.md §4.2).

    Candidates are positions p ≤ S−2 with `loss_mask[p] == 1` and `loss_mask[p+1] == 1` (SpecForge
    HEAD rule: the anchor is a generated token and the first label is supervised). N = min(num_anchors,
    max #candidates over the batch); rows with fewer candidates get `keep = False` fill-ins.

    Args:
        loss_mask: [b, S] 0/1 (any integer or bool dtype).
    Returns:
        AnchorBatch with `anchors` long [b, N] sorted ascending, `keep` bool [b, N]; N ≥ 1.
    """
    lm = loss_mask.bool()
    b, s = lm.shape
    cand = torch.zeros_like(lm)
    cand[:, :-1] = lm[:, :-1] & lm[:, 1:]
    counts = cand.sum(dim=1)
    n = int(max(1, min(num_anchors, int(counts.max().item()) if b else 1)))
    scores = torch.rand((b, s), generator=generator, device=loss_mask.device)
    scores = torch.where(cand, scores, torch.full_like(scores, 2.0))  # non-candidates sort last
    idx = scores.argsort(dim=1)[:, :n]  # [b, N] random candidates first
    keep = torch.arange(n, device=loss_mask.device).unsqueeze(0) < counts.unsqueeze(1)
    idx = torch.where(keep, idx, torch.zeros_like(idx))
    # sort kept anchors by position; fill-ins (anchor 0, keep False) go after them
    order_key = torch.where(keep, idx, torch.full_like(idx, s + 1))
    order = order_key.argsort(dim=1)
    return AnchorBatch(anchors=idx.gather(1, order), keep=keep.gather(1, order))


def loss_decay_gamma(block_size: int) -> float:
    """γ of the position decay: 7 for B=16, 5 for B=10, 4 for B=8 (dflash.md §4.5, [P6] App. A.1);
    other sizes interpolate linearly between those points (and clamp at ≥ 1)."""
    table = {8: 4.0, 10: 5.0, 16: 7.0}
    if block_size in table:
        return table[block_size]
    if block_size < 10:
        return max(1.0, 4.0 + (block_size - 8) * 0.5)
    return 5.0 + (block_size - 10) * (2.0 / 6.0)


def block_inputs_and_labels(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: AnchorBatch,
    block_size: int,
    mask_token_id: int,
    gamma: Optional[float],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block tokens, positions, same-position labels and loss weights (dflash.md §4.3, §4.5).

    Slot k of the block anchored at p holds `input_ids[p]` (k = 0) or MASK, sits at position p+k, and
    is trained to predict `input_ids[p+k]` (same-position labels; slot 0 carries no loss).
    Weight = keep · [p+k < S] · [k ≥ 1] · loss_mask[p+k] · exp(−(k−1)/γ) (γ None → uniform).

    Returns:
        block_ids long [b, N·B], block_pos long [b, N·B], labels long [b, N·B], weights float [b, N·B].
    """
    b, s = input_ids.shape
    a, keep = anchors.anchors, anchors.keep
    n = a.shape[1]
    k = torch.arange(block_size, device=input_ids.device)
    pos = a.unsqueeze(-1) + k.view(1, 1, -1)  # [b, N, B]
    in_range = pos < s
    pos_c = pos.clamp(max=s - 1)
    labels = input_ids.gather(1, pos_c.view(b, -1)).view(b, n, block_size)
    lmask = loss_mask.gather(1, pos_c.view(b, -1)).view(b, n, block_size).bool()
    block_ids = torch.full_like(labels, mask_token_id)
    block_ids[:, :, 0] = input_ids.gather(1, a)
    decay = torch.ones(block_size, device=input_ids.device, dtype=torch.float32)
    if gamma is not None:
        decay = torch.exp(-(k.float() - 1.0) / gamma)
    decay[0] = 0.0
    valid = keep.unsqueeze(-1) & in_range & lmask & (k.view(1, 1, -1) >= 1)
    weights = valid.float() * decay.view(1, 1, -1)
    return block_ids.view(b, -1), pos.view(b, -1), labels.view(b, -1), weights.view(b, -1)


def decayed_cross_entropy(
    hidden: torch.Tensor,  # [b, Q, H] drafter output
    lm_head_weight: torch.Tensor,  # [V, H] frozen target LM head
    labels: torch.Tensor,  # long [b, Q]
    weights: torch.Tensor,  # float [b, Q]
    chunk_tokens: int = 4096,
    normalizer: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict]:
    """Weighted CE Σ w·CE / Σ w over slots with w > 0, computed in chunks of `chunk_tokens` slots
    under activation checkpointing so memory never holds [N·B, V] logits at once (dflash.md §4.5, §4.7).

    `normalizer` (float scalar) replaces the local Σ w as the divisor: `loss_normalizer` makes data-parallel ranks
    average to the global Σ w·CE / Σ w. Logits are computed in the LM head's dtype and upcast to float32 for the
    cross-entropy, so a bf16 head works with or without autocast.

    Returns `(loss, stats)`; `stats` holds per-slot correct/total counts and `weight_sum` (local Σ w). With no
    supervised slot the loss is `0 * hidden.sum()` so every rank still runs backward.
    """
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1)
    w = weights.reshape(-1)
    sel = (w > 0).nonzero(as_tuple=True)[0]
    total_w = w[sel].sum()
    if sel.numel() == 0:
        return hidden.sum() * 0.0, {"num_slots": 0, "weight_sum": 0.0}
    hs, ys, ws = h[sel], y[sel], w[sel]

    def chunk_loss(hc, yc, wc):
        logits = lm_head_logits(hc, lm_head_weight)
        ce = F.cross_entropy(logits, yc, reduction="none")
        return (ce * wc).sum(), (logits.argmax(-1) == yc)

    loss = hidden.new_zeros((), dtype=torch.float32)
    correct = []
    for i in range(0, hs.shape[0], chunk_tokens):
        part, ok = torch.utils.checkpoint.checkpoint(
            chunk_loss,
            hs[i : i + chunk_tokens],
            ys[i : i + chunk_tokens],
            ws[i : i + chunk_tokens],
            use_reentrant=False,
        )
        loss = loss + part
        correct.append(ok)
    denom = total_w if normalizer is None else normalizer.to(loss.device, torch.float32).clamp(min=1e-12)
    return loss / denom, {
        "num_slots": int(sel.numel()),
        "correct": torch.cat(correct),
        "index": sel,
        "weight_sum": float(total_w),
    }


def loss_normalizer(local_weight_sum: torch.Tensor, world_size: int, all_reduce_sum=None) -> torch.Tensor:
    """Divisor for `decayed_cross_entropy` on one of `world_size` data-parallel ranks.

    DDP averages gradients over ranks, so rank r's loss Σ_r w·CE / (Σ_all w / world_size) averages to the global Σ_all
    w·CE / Σ_all w: every supervised slot weighs the same whichever rank holds it. `all_reduce_sum` sums a float32
    scalar over ranks (`accelerator.reduce(t, "sum")`); None = one process.
    """
    total = local_weight_sum.detach().to(torch.float32).reshape(())
    if all_reduce_sum is not None and world_size > 1:
        total = all_reduce_sum(total.clone())
    return total / max(1, world_size)


def slot_accuracy(stats: dict, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-slot (k = 0..B−1) correct and total counts from `decayed_cross_entropy` stats."""
    correct = torch.zeros(block_size, dtype=torch.long)
    total = torch.zeros(block_size, dtype=torch.long)
    if stats.get("num_slots", 0):
        slot = (stats["index"] % block_size).cpu()
        correct.index_add_(0, slot, stats["correct"].long().cpu())
        total.index_add_(0, slot, torch.ones_like(slot))
    return correct, total


def expected_acceptance_length(slot_acc: list[float]) -> float:
    """EAL proxy τ ≈ 1 + Σ_k Π_{i≤k} acc_i over slots 1..B−1 (dflash.md §4.5, speculators metrics)."""
    tau, prod = 1.0, 1.0
    for acc in slot_acc[1:]:
        prod *= acc
        tau += prod
    return tau


def cosine_with_warmup(step: int, total: int, warmup: int) -> float:
    """LR multiplier: linear warmup over `warmup` steps, cosine to 0 at `total` (dflash.md §4.7)."""
    if step < warmup:
        return (step + 1) / max(1, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
