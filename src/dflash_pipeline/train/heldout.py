"""Held-out validation during training: expected acceptance per block, not marginal slot accuracy.

A block's accepted length is 1 + Σ_k Π_{i≤k} a_i, the cumulative product of per-slot acceptance inside the
block (speculators SP#1032, SpecForge's `simulated_acc_len`; accuracy alone misleads, z-lab#41). The
product of marginal accuracies (`expected_acceptance_length`) is logged beside it. Validation runs the
training forward on records never trained on (`heldout_mask`) with deterministic anchors and greedy
acceptance a_k = [argmax drafter logits == label].
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence

import torch

from dflash_pipeline.drafter import families as FR
from dflash_pipeline.drafter import model as M
from dflash_pipeline.target import loading as T
from dflash_pipeline.train import packing as P


@dataclass
class AcceptanceCounts:
    """Additive counts (sum them over batches and ranks). All float64 CPU tensors.

    `blocks` scalar: blocks simulated. `chain` [B−1]: Σ over blocks of Π_{i≤k} a_i·m_i for slots
    k = 1..B−1. `correct`/`valid` [B−1]: marginal per-slot hits and supervised slots.
    With context-length bucket `edges` (tokens, ascending; `train.validation_length_buckets`):
    `bucket_blocks` [len(edges)+1] blocks per bucket of the tokens before the block's anchor, and
    `bucket_chain` [len(edges)+1] their Σ_k chain_k (empty without edges).
    """

    blocks: torch.Tensor
    chain: torch.Tensor
    correct: torch.Tensor
    valid: torch.Tensor
    bucket_blocks: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.float64))
    bucket_chain: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.float64))
    edges: tuple = ()

    @classmethod
    def zeros(cls, block_size: int, edges: Sequence[int] = ()) -> "AcceptanceCounts":
        z = torch.zeros(block_size - 1, dtype=torch.float64)
        nb = torch.zeros(len(edges) + 1 if edges else 0, dtype=torch.float64)
        return cls(
            torch.zeros((), dtype=torch.float64), z.clone(), z.clone(), z.clone(), nb.clone(), nb.clone(), tuple(edges)
        )

    def __add__(self, other: "AcceptanceCounts") -> "AcceptanceCounts":
        if tuple(self.edges) != tuple(other.edges):
            raise ValueError(f"cannot add acceptance counts of bucket edges {self.edges} and {other.edges}")
        return AcceptanceCounts(
            self.blocks + other.blocks,
            self.chain + other.chain,
            self.correct + other.correct,
            self.valid + other.valid,
            self.bucket_blocks + other.bucket_blocks,
            self.bucket_chain + other.bucket_chain,
            tuple(self.edges),
        )

    def as_tensor(self) -> torch.Tensor:
        """Flat float64 [1 + 3(B−1) + 2·buckets] (for one all-reduce)."""
        return torch.cat(
            [self.blocks.view(1), self.chain, self.correct, self.valid, self.bucket_blocks, self.bucket_chain]
        )

    @classmethod
    def from_tensor(cls, t: torch.Tensor, edges: Sequence[int] = ()) -> "AcceptanceCounts":
        """Inverse of `as_tensor` (`edges`: those of the counts flattened)."""
        t = t.detach().double().cpu()
        nb = len(edges) + 1 if edges else 0
        k = (t.numel() - 1 - 2 * nb) // 3
        e = 1 + 3 * k
        return cls(t[0], t[1 : 1 + k], t[1 + k : 1 + 2 * k], t[1 + 2 * k : e], t[e : e + nb], t[e + nb :], tuple(edges))

    def summary(self) -> dict:
        """`tau` (mean accepted length per block, bonus token included, in [1, B]),
        `per_position_acceptance` [B−1] (fraction of blocks whose slot k is accepted, chain included),
        `slot_acc` [B−1] (marginal accuracy), `tau_marginal` (the product-of-marginals proxy),
        `num_blocks`; with bucket edges `by_context_length`: label → `{tau, num_blocks, range}` of the
        buckets with blocks (labels and ranges of `evaluate.context_length`)."""
        n = max(1.0, float(self.blocks))
        per_pos = (self.chain / n).tolist()
        acc = (self.correct / self.valid.clamp(min=1)).tolist()
        out = {
            "tau": 1.0 + sum(per_pos),
            "per_position_acceptance": per_pos,
            "slot_acc": acc,
            "tau_marginal": M.expected_acceptance_length([0.0] + acc),
            "num_blocks": int(self.blocks),
        }
        if self.edges:
            from dflash_pipeline.evaluate import bucket_labels, bucket_ranges

            out["by_context_length"] = {
                label: {"tau": 1.0 + float(c) / float(b), "num_blocks": int(b), "range": rng}
                for label, rng, b, c in zip(
                    bucket_labels(self.edges), bucket_ranges(self.edges), self.bucket_blocks, self.bucket_chain
                )
                if b > 0
            }
        return out


def block_acceptance(
    accept: torch.Tensor, valid: torch.Tensor, contexts: Optional[torch.Tensor] = None, edges: Sequence[int] = ()
) -> AcceptanceCounts:
    """Per-block acceptance simulator: chain_k = Π_{i≤k} a_i·m_i inside each block.

    A slot that is not supervised ends the block's chain: generation cannot accept a token past the response.

    Args:
        accept: [n_blocks, B−1] bool or float in [0, 1].
        valid: bool [n_blocks, B−1] (m_k).
        contexts: long [n_blocks], the tokens of each block's record before its anchor (with `edges`).
        edges: context-length bucket edges (tokens, ascending); () = no buckets.
    Returns:
        `AcceptanceCounts` over these blocks.
    """
    a = accept.double() * valid.double()
    chain = torch.cumprod(a, dim=-1)
    counts = AcceptanceCounts(
        blocks=torch.tensor(float(a.shape[0]), dtype=torch.float64),
        chain=chain.sum(0).cpu(),
        correct=a.sum(0).cpu(),
        valid=valid.double().sum(0).cpu(),
    )
    if edges:
        b = torch.bucketize(contexts.cpu(), torch.tensor(list(edges)), right=True)  # bisect_right: [lo, hi)
        counts.bucket_blocks = torch.bincount(b, minlength=len(edges) + 1).double()
        counts.bucket_chain = torch.zeros(len(edges) + 1, dtype=torch.float64).index_add_(0, b, chain.sum(-1).cpu())
        counts.edges = tuple(edges)
    return counts


def deterministic_anchors(loss_mask: torch.Tensor, segment_ids: torch.Tensor, num_anchors: int) -> M.AnchorBatch:
    """Up to `num_anchors` anchors per record, evenly spaced over its candidates (the training rule,
    `train.packing.anchor_candidates`), the same every time; a packed row gets what its
    records would get alone. Shapes as `sample_anchors`: `anchors` long [b, N], `keep` bool [b, N]."""
    cand = P.anchor_candidates(loss_mask, segment_ids)
    rows = []
    for c, seg in zip(cand, segment_ids):
        picked = []
        for sid in torch.unique(seg[c]).tolist():
            r = (c & (seg == sid)).nonzero(as_tuple=True)[0]
            if len(r) > num_anchors:
                r = r[torch.linspace(0, len(r) - 1, num_anchors, device=r.device).round().long()]
            picked.append(r)
        rows.append(torch.cat(picked).sort().values if picked else cand.new_zeros(0, dtype=torch.long))
    b = cand.shape[0]
    n = max(1, max((len(r) for r in rows), default=1))
    anchors = torch.zeros((b, n), dtype=torch.long, device=cand.device)
    keep = torch.zeros((b, n), dtype=torch.bool, device=cand.device)
    for i, r in enumerate(rows):
        anchors[i, : len(r)] = r
        keep[i, : len(r)] = True
    return M.AnchorBatch(anchors, keep)


@torch.no_grad()
def batch_acceptance(
    drafter,
    target,
    embed,
    lm_head,
    batch: dict,
    *,
    target_layer_ids: Sequence[int],
    mask_token_id: int,
    num_anchors: int,
    backend: str = "sdpa",
    features=None,
    length_buckets: Sequence[int] = (),
) -> AcceptanceCounts:
    """Teacher-forced acceptance of one (padded or packed) batch.

    `batch`: `input_ids`/`loss_mask` [b, S] and either `attention_mask` (padded) or
    `position_ids` + `segment_ids` (packed, `train.packing.collate_packed`).
    `features`: precomputed target features [b, S, K·H] (feature shards) instead of running `target`.
    """
    core = drafter.module if hasattr(drafter, "module") else drafter
    ids, lmask = batch["input_ids"], batch["loss_mask"]
    bsz = core.block_size
    if "segment_ids" in batch:
        pos, seg = batch["position_ids"], batch["segment_ids"]
    else:
        pos, seg = P.padded_segments(batch["attention_mask"])
    if features is None:
        if "segment_ids" in batch:
            features, _ = P.packed_target_features(target, ids, pos, target_layer_ids)
        else:
            from dflash_pipeline.target.hidden import target_features

            features, _ = target_features(target, ids, batch["attention_mask"], target_layer_ids)
    anchors = deterministic_anchors(lmask, seg, num_anchors)
    family = FR.of_drafter(core)

    def build(slots, gamma):
        return P.packed_block_inputs_and_labels(ids, lmask, pos, seg, anchors, slots, mask_token_id, gamma)

    blk = family.training_blocks(build, bsz, None)  # as the family trains, undecayed
    mask = P.build_packed_training_masks(core, anchors.anchors, seg, backend)
    noise, feats = T.to_drafter_dtype(drafter, embed(blk.ids), features)  # as train.step does (feature shards: bf16)
    hidden = drafter(noise, feats, pos, blk.pos, attn_mask=mask)
    b = ids.shape[0]
    n = anchors.anchors.shape[1]
    keep = anchors.keep.reshape(-1)
    contexts = pos.gather(1, anchors.anchors).reshape(-1)[keep]  # tokens of its record before each block's anchor
    hits = family.teacher_forced_hits(core, lm_head, hidden, blk).view(b * n, bsz)  # the family's own draft rule
    valid = (blk.weights > 0).view(b * n, bsz)
    first = family.first_draft_slot
    return block_acceptance(hits[:, first:][keep], valid[:, first:][keep], contexts, length_buckets)


def heldout_acceptance(
    drafter,
    target,
    embed,
    lm_head,
    batches: Iterable[dict],
    *,
    target_layer_ids: Sequence[int],
    mask_token_id: int,
    num_anchors: int,
    backend: str = "sdpa",
    reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    length_buckets: Sequence[int] = (),
) -> dict:
    """`batch_acceptance` summed over `batches` (this rank's share of the held-out rows), then summed over ranks with
    `reduce`, summarised. Puts the drafter in eval mode and back."""
    core = drafter.module if hasattr(drafter, "module") else drafter
    was_training = core.training
    drafter.eval()
    total = AcceptanceCounts.zeros(FR.of_drafter(core).acceptance_slots(core.block_size), length_buckets)
    try:
        for batch in batches:
            total = total + batch_acceptance(
                drafter,
                target,
                embed,
                lm_head,
                batch,
                target_layer_ids=target_layer_ids,
                mask_token_id=mask_token_id,
                num_anchors=num_anchors,
                backend=backend,
                length_buckets=length_buckets,
            )
    finally:
        drafter.train(was_training)
    if reduce is not None:
        dev = next(core.parameters()).device
        total = AcceptanceCounts.from_tensor(reduce(total.as_tensor().to(dev)), length_buckets)
    return total.summary()


def heldout_mask(
    prompt_ids: Sequence[str], fraction: float, *, seed: int = 0, max_records: Optional[int] = None
) -> list[bool]:
    """Which records are held out: whole prompts, chosen by sha1(seed, prompt_id) < fraction — stable when shards are
    reordered or added. `max_records` caps the held-out rows.

    Raises:
        ValueError: `fraction` outside [0, 1).
    """
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"train.validation.fraction must be in [0, 1), got {fraction}")

    def u(pid: str) -> float:
        return int(hashlib.sha1(f"{seed}\0{pid}".encode()).hexdigest()[:12], 16) / float(16**12)

    scores = [u(p) for p in prompt_ids]
    out = [s < fraction for s in scores]
    if max_records is not None and sum(out) > max_records:
        rows: dict[str, int] = {}
        for p, o in zip(prompt_ids, out):
            if o:
                rows[p] = rows.get(p, 0) + 1
        kept, n = set(), 0
        for p in sorted(rows, key=u):  # whole prompts, lowest hash first
            if n + rows[p] > max_records:
                break
            kept.add(p)
            n += rows[p]
        out = [p in kept for p in prompt_ids]
    return out
