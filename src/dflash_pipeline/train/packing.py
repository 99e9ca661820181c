"""Sequence packing for drafter training: several token records per row, never a token across records.

A packed row is `[record_a ‖ record_b ‖ … ‖ pad]` with per-token `segment_ids` (−1 on padding) and
`position_ids` restarting at 0 in every record, so the target builds a block-diagonal causal mask from
the position restarts (`transformers.masking_utils.find_packed_sequence_indices`; proved per target by
`check_target_isolates_records`), anchors and block contexts stay inside their record (dflash.md §4.4)
and block positions are record-relative. A padded batch is one record per row (`padded_segments`).
`bench/bench_train.py` measures the speedup.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from dflash_pipeline.drafter import model as M

# --- Packing records into rows


def pack_records(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """First-fit-decreasing bins of record indices with Σ length ≤ `max_tokens` per bin.

    A record longer than `max_tokens` gets a bin of its own (records are already cut at
    `tokens.max_length`; packing never truncates). Deterministic: ties keep index order, and each bin
    lists its records in index order.

    Raises:
        ValueError: `max_tokens` < 1.
    """
    if max_tokens < 1:
        raise ValueError(f"train.pack_max_tokens must be ≥ 1, got {max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = int(lengths[i])
        for b, r in enumerate(room):
            if n <= r:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(max(0, max_tokens - n))
    return [sorted(b) for b in bins]


class PackedDataset(torch.utils.data.Dataset):
    """Map-style dataset whose items are packed rows: lists of `(input_ids int32 [S_i], loss_mask uint8
    [S_i][, features [S_i, K*H][, last_hidden [S_i, H]]])` records (see `collate_packed`). Rows are
    fixed once (`pack_records`); the DataLoader shuffles rows per epoch. `lengths`: the records'
    token counts when known (feature shards: from their offsets, so no record is read to pack)."""

    def __init__(self, records, max_tokens: int, lengths: Optional[Sequence[int]] = None):
        self.records = records
        lengths = [len(rec[0]) for rec in records] if lengths is None else [int(n) for n in lengths]
        self.bins = pack_records(lengths, max_tokens)

    def __len__(self):
        return len(self.bins)

    def __getitem__(self, i):
        return [self.records[j] for j in self.bins[i]]


def collate_packed(rows, pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Concatenate each row's records and right-pad rows to the longest.

    Returns `input_ids` long, `loss_mask` uint8, `attention_mask` long (1 on record tokens), `position_ids` long,
    `segment_ids` long (record
    slot in the row; −1 on padding), all [b, S_max], and `num_records` long [b]. Records from feature shards also give
    `features` [b, S_max, K*H] (and `target_last_hidden` [b, S_max, H]), each record's own at its segment, zero on
    padding.
    """
    s = max(sum(len(rec[0]) for rec in row) for row in rows)
    b = len(rows)
    ids = torch.full((b, s), pad_id, dtype=torch.long)
    lm = torch.zeros((b, s), dtype=torch.uint8)
    am = torch.zeros((b, s), dtype=torch.long)
    pos = torch.zeros((b, s), dtype=torch.long)
    seg = torch.full((b, s), -1, dtype=torch.long)
    first = rows[0][0]
    extra = [torch.zeros((b, s, t.shape[-1]), dtype=t.dtype) for t in first[2:]]  # features[, last hidden]
    for r, row in enumerate(rows):
        at = 0
        for k, (i, m, *tensors) in enumerate(row):
            n = len(i)
            for dst, t in zip(extra, tensors):
                dst[r, at : at + n] = t
            ids[r, at : at + n] = torch.from_numpy(np.asarray(i, dtype=np.int64))
            lm[r, at : at + n] = torch.from_numpy(np.asarray(m, dtype=np.uint8))
            am[r, at : at + n] = 1
            pos[r, at : at + n] = torch.arange(n)
            seg[r, at : at + n] = k
            at += n
        pos[r, at:] = torch.arange(s - at)
    return {
        "input_ids": ids,
        "loss_mask": lm,
        "attention_mask": am,
        "position_ids": pos,
        "segment_ids": seg,
        "num_records": torch.tensor([len(row) for row in rows], dtype=torch.long),
        **dict(zip(("features", "target_last_hidden"), extra)),
    }


def padded_segments(attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(position_ids, segment_ids)` [b, S] long of a right-padded batch (one record per row)."""
    b, s = attention_mask.shape
    pos = torch.arange(s, device=attention_mask.device).expand(b, -1).clone()
    seg = torch.where(attention_mask.bool(), torch.zeros_like(pos), torch.full_like(pos, -1))
    return pos, seg


# --- Anchors, blocks and masks that respect record boundaries


def anchor_candidates(loss_mask: torch.Tensor, segment_ids: torch.Tensor) -> torch.Tensor:
    """bool [b, S]: p ≤ S−2 with `loss_mask[p] = loss_mask[p+1] = 1` in the same record (the
    SpecForge HEAD rule of `drafter.model.sample_anchors`, plus the record predicate)."""
    lm = loss_mask.bool()
    cand = torch.zeros_like(lm)
    cand[:, :-1] = lm[:, :-1] & lm[:, 1:] & (segment_ids[:, :-1] == segment_ids[:, 1:]) & (segment_ids[:, :-1] >= 0)
    return cand


def sample_packed_anchors(
    loss_mask: torch.Tensor, segment_ids: torch.Tensor, num_anchors: int, generator: Optional[torch.Generator] = None
) -> M.AnchorBatch:
    """Up to `num_anchors` random anchors *per record* among `anchor_candidates`, redrawn every
    call (dflash.md §4.2): a packed record gets the blocks it would get alone in a padded row, so packing
    changes the step time, not the training signal. Per row N = max kept; anchors sorted by position,
    `keep` False fill-ins (anchor 0) after them, as `drafter.model.sample_anchors`.

    Returns AnchorBatch `anchors` long [b, N], `keep` bool [b, N] (N ≥ 1).
    """
    cand = anchor_candidates(loss_mask, segment_ids)
    b, s = cand.shape
    dev = cand.device
    scores = torch.rand((b, s), generator=generator, dtype=torch.float64).to(dev)
    key = torch.where(cand, segment_ids.double() * 2.0 + scores, torch.full_like(scores, float("inf")))
    order = key.argsort(dim=1)  # candidates grouped by record, random inside each
    seg_sorted, cand_sorted = segment_ids.gather(1, order), cand.gather(1, order)
    idx = torch.arange(s, device=dev).expand(b, -1)
    starts = cand_sorted & torch.cat(
        [torch.ones_like(seg_sorted[:, :1], dtype=torch.bool), seg_sorted[:, 1:] != seg_sorted[:, :-1]], dim=1
    )
    first = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
    chosen = cand_sorted & (idx - first < num_anchors)  # rank inside the record < num_anchors
    counts = chosen.sum(dim=1)
    n = int(max(1, int(counts.max().item()) if b else 1))
    by_pos = torch.where(chosen, order, order + s + 1).argsort(dim=1)[:, :n]  # chosen ones by position
    anchors = order.gather(1, by_pos)
    keep = torch.arange(n, device=dev).unsqueeze(0) < counts.unsqueeze(1)
    return M.AnchorBatch(anchors=torch.where(keep, anchors, torch.zeros_like(anchors)), keep=keep)


@dataclass
class Blocks:
    """Block inputs of a (packed) batch. All long/float [b, N·B].

    `ids` block tokens; `pos` record-relative positions (RoPE); `rows` row indices a+k; `labels`; `weights`.
    """

    ids: torch.Tensor
    pos: torch.Tensor
    rows: torch.Tensor
    labels: torch.Tensor
    weights: torch.Tensor


def packed_block_inputs_and_labels(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    position_ids: torch.Tensor,
    segment_ids: torch.Tensor,
    anchors: M.AnchorBatch,
    block_size: int,
    mask_token_id: int,
    gamma: Optional[float],
) -> Blocks:
    """`drafter.model.block_inputs_and_labels` with slots outside the anchor's record
    weighted 0 and positions made record-relative (`position_ids[anchor] + k`)."""
    ids, rows, labels, weights = M.block_inputs_and_labels(
        input_ids, loss_mask, anchors, block_size, mask_token_id, gamma
    )
    b, s = input_ids.shape
    a_rep = anchors.anchors.repeat_interleave(block_size, dim=1)  # [b, Q]
    same = segment_ids.gather(1, rows.clamp(max=s - 1)) == segment_ids.gather(1, a_rep)
    weights = weights * same.to(weights.dtype)
    k = rows - a_rep
    pos = position_ids.gather(1, a_rep) + k
    return Blocks(ids=ids, pos=pos, rows=rows, labels=labels, weights=weights)


def build_packed_block_mask(
    anchors: torch.Tensor,
    segment_ids: torch.Tensor,
    block_size: int,
    *,
    sliding_window: Optional[int] = None,
    block_causal: bool = True,
) -> torch.Tensor:
    """Dense training mask of `drafter.model.build_block_mask` (True = attend) restricted to
    the anchor's record: context key j is visible iff `j < anchor` and `segment_ids[j] ==
    segment_ids[anchor]` (and, on sliding layers, within the window). bool [b, 1, N·B, S + N·B]."""
    s = segment_ids.shape[1]
    mask = M.build_block_mask(anchors, s, block_size, sliding_window=sliding_window, block_causal=block_causal)
    q_seg = segment_ids.gather(1, anchors).repeat_interleave(block_size, dim=1)  # [b, Q]
    same = segment_ids.unsqueeze(1) == q_seg.unsqueeze(-1)  # [b, Q, S]
    mask[:, 0, :, :s] &= same
    return mask


def build_packed_flex_block_mask(
    anchors: torch.Tensor,
    segment_ids: torch.Tensor,
    block_size: int,
    *,
    sliding_window: Optional[int] = None,
    block_causal: bool = True,
):
    """`build_packed_block_mask`'s predicate as a FlexAttention `BlockMask` (no dense tensor):
    `drafter.model.build_flex_block_mask` with the record test."""
    return M.build_flex_block_mask(
        anchors,
        segment_ids.shape[1],
        block_size,
        sliding_window=sliding_window,
        segment_ids=segment_ids,
        block_causal=block_causal,
    )


def build_packed_training_masks(drafter, anchors: torch.Tensor, segment_ids: torch.Tensor, backend: str = "sdpa"):
    """Masks per layer type, as `drafter.model.build_training_masks` (one mask or a dict)."""
    build = build_packed_flex_block_mask if backend == "flex" else build_packed_block_mask
    return M.masks_per_layer_type(drafter, lambda **kw: build(anchors, segment_ids, drafter.block_size, **kw))


# --- The target on packed rows


def packed_target_features(target, input_ids: torch.Tensor, position_ids: torch.Tensor, layer_ids: Sequence[int]):
    """`train.run.target_features` on packed rows: `position_ids` restart per record,
    no 2-D attention mask and no cache, so Hugging Face builds the block-diagonal causal mask.
    Returns `(features [b, S, K·H], model output)`."""
    from dflash_pipeline.target.hidden import target_features

    return target_features(target, input_ids, None, layer_ids, position_ids=position_ids, use_cache=False)


def check_target_isolates_records(target, layer_ids: Sequence[int], *, atol: float = 1e-4) -> None:
    """Run two short random records packed in one row and alone; their features must agree.

    Targets whose layers carry state across tokens without an attention mask (linear attention, SSM /
    Gated DeltaNet hybrids) or whose attention ignores packed position ids would leak one record into
    the next; training on such rows would be silently wrong.

    Raises:
        ValueError: the packed features differ (names the target class and the largest difference).
    """
    cfg = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    dev = next(target.parameters()).device
    g = torch.Generator().manual_seed(0)
    a = torch.randint(0, int(cfg.vocab_size), (1, 9), generator=g).to(dev)
    c = torch.randint(0, int(cfg.vocab_size), (1, 6), generator=g).to(dev)
    row = torch.cat([a, c], dim=1)
    pos = torch.cat([torch.arange(9), torch.arange(6)]).view(1, -1).to(dev)
    from dflash_pipeline.target.hidden import target_features

    with torch.no_grad():
        packed, _ = packed_target_features(target, row, pos, layer_ids)
        fa, _ = target_features(target, a, None, layer_ids)
        fc, _ = target_features(target, c, None, layer_ids)
    diff = max(float((packed[0, :9] - fa[0]).abs().max()), float((packed[0, 9:] - fc[0]).abs().max()))
    scale = float(torch.cat([fa, fc], dim=1).abs().max()) or 1.0
    if diff > atol * max(1.0, scale):
        raise ValueError(
            f"train.packing: target {type(target).__name__} does not keep packed records apart (features differ by "
            f"{diff:.3g}); its layers see across records. Set train.packing: false for this target."
        )
