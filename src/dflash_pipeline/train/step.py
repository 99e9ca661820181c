"""One DFlash training step on a batch: target features -> anchors -> blocks -> drafter -> objective
(reference/dflash.md §4, §5.3), normalised globally over ranks.

`StepContext` holds what a step needs besides the batch; `step_objective` is the forward pass
(unnormalised), `training_step` the normalised loss of one micro-step; `.loop` drives them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from dflash_pipeline.drafter import families as FR
from dflash_pipeline.drafter import model as M
from dflash_pipeline.target import loading as T
from dflash_pipeline.target.hidden import target_features
from dflash_pipeline.train import losses as L
from dflash_pipeline.train import packing as P

#: Objectives that read the target's final-normed last hidden state (its distribution): `kl`, DSpark's `dspark_tv`.
TEACHER_LOSSES = ("kl", "dspark_tv")


@dataclass
class StepContext:
    """What `training_step` needs besides the batch (built once per run by `train.run.train`).

    `reduce_sum` sums a scalar over data-parallel ranks (None = one process) for the global loss
    normalisation (`drafter.model.loss_normalizer`). `loss`/`kl_*`/`dpace_alpha`:
    the objective (`train.loss`, `train.losses.compute_loss`).
    """

    drafter: Any
    target: Any
    probe: dict
    num_anchors: int
    block_size: int
    gamma: Optional[float]
    generator: torch.Generator
    zero_target_features: bool = False
    backend: str = "sdpa"
    world_size: int = 1
    reduce_sum: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    embed: Any = field(default=None)
    lm_head: Any = field(default=None)
    loss: str = "ce_decay"  # train.loss (dflash_pipeline.train.losses)
    kl_temperature: float = 1.0
    kl_ce_weight: float = 0.0
    dpace_alpha: float = 0.5
    loss_chunk_tokens: int = 4096  # train.loss_chunk_tokens: block slots whose logits are formed at once
    selector_gold: str = "insert"  # DFlash2 (train.selector_gold, dflash_pipeline.drafter.dflash2)
    selector_weight: float = 1.0
    confidence_weight: float = 1.0  # DSpark's confidence head (train.confidence_weight)
    #: the target's `final_logit_softcapping` (kl's teacher is capped like the target); None = read it
    #: from `target.config` when a target is given
    logit_softcap: Optional[float] = None
    #: `shards` / `stream` with a teacher loss: the target's final norm, applied to the batch's pre-norm
    #: `target_last_hidden` (`features.weights.load_final_norm`)
    final_norm: Any = None

    def __post_init__(self):
        if self.logit_softcap is None and self.target is not None:
            self.logit_softcap = T.final_logit_softcap(self.target.config)
        self.embed = self.embed if self.embed is not None else T.input_embeddings(self.target)
        self.lm_head = self.lm_head if self.lm_head is not None else T.lm_head(self.target)


def step_objective(ctx: StepContext, batch: dict) -> L.LossOutput:
    """One forward pass: target features → anchors → blocks → drafter → `ctx.loss` (dflash.md §4). The
    drafter family's hooks set how a block reads the anchor's labels (`training_blocks`) and the objective.

    `batch`: `input_ids` long [b, S], `loss_mask` uint8 [b, S], `attention_mask` long [b, S]; packed rows add
    `position_ids`/`segment_ids`. Precomputed `features` [b, S, K·H] (and `target_last_hidden` [b, S, H]
    for `kl`, before the final norm) replace the target forward. Dtypes: the target in its dtype, the
    drafter in its parameter dtype, the LM head in its dtype, the loss in float32.

    Returns the unnormalised `LossOutput` (the caller normalises globally).

    Raises:
        ValueError: `kl` without the target's last hidden state."""
    ids, lmask = batch["input_ids"], batch["loss_mask"]
    packed = "segment_ids" in batch
    d = ctx.probe["drafter"]
    feats, last = _batch_features(ctx, batch)
    core = getattr(ctx.drafter, "module", ctx.drafter)
    family = FR.of_drafter(core)  # its hooks: blocks and objective
    b, s = ids.shape
    if packed:
        pos, seg = batch["position_ids"], batch["segment_ids"]
        anchors = P.sample_packed_anchors(lmask.cpu(), seg.cpu(), ctx.num_anchors, generator=ctx.generator)
        anchors = M.AnchorBatch(anchors.anchors.to(ids.device), anchors.keep.to(ids.device))

        def build(slots, gamma):
            return P.packed_block_inputs_and_labels(ids, lmask, pos, seg, anchors, slots, d["mask_token_id"], gamma)

        mask = P.build_packed_training_masks(core, anchors.anchors, seg, ctx.backend)
        ctx_pos = pos
        num_sequences = int(batch["num_records"].sum())
    else:
        anchors = M.sample_anchors(lmask.cpu(), ctx.num_anchors, generator=ctx.generator)
        anchors = M.AnchorBatch(anchors.anchors.to(ids.device), anchors.keep.to(ids.device))

        def build(slots, gamma):
            block_ids, block_pos, labels, weights = M.block_inputs_and_labels(
                ids, lmask, anchors, slots, d["mask_token_id"], gamma
            )
            return P.Blocks(ids=block_ids, pos=block_pos, rows=block_pos, labels=labels, weights=weights)

        mask = M.build_training_masks(core, anchors.anchors, s, ctx.backend)
        ctx_pos = torch.arange(s, device=ids.device).expand(b, -1)
        num_sequences = b
    blk = family.training_blocks(build, ctx.block_size, ctx.gamma)
    with torch.no_grad():
        noise = ctx.embed(blk.ids)
    noise, feats = T.to_drafter_dtype(ctx.drafter, noise, feats)
    hidden = ctx.drafter(noise, feats, ctx_pos, blk.pos, attn_mask=mask)
    teacher = L.teacher_slot_hidden(last, blk.rows) if ctx.loss in TEACHER_LOSSES else None

    def base() -> L.LossOutput:  # the plain train.loss objective on the LM head's logits
        return L.compute_loss(
            ctx.loss,
            hidden,
            ctx.lm_head.weight,
            blk.labels,
            blk.weights,
            ctx.block_size,
            teacher_hidden=teacher,
            temperature=ctx.kl_temperature,
            ce_weight=ctx.kl_ce_weight,
            dpace_alpha=ctx.dpace_alpha,
            num_sequences=num_sequences,
            chunk_tokens=ctx.loss_chunk_tokens,
            logit_softcap=ctx.logit_softcap,
        )

    return family.objective(ctx, core, hidden, blk, teacher, base)


def _batch_features(ctx: StepContext, batch: dict) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """`(features [b, S, K·H], target last hidden [b, S, H] or None)` of `batch`, without gradients: the feature
    shards' when the batch carries them, zeros for the ablation (`zero_target_features`; the target runs only when `kl`
    needs its teacher), else the target's forward (packed rows keep records apart,
    `train.packing.packed_target_features`). The last hidden state (final-normed: the LM head's input) is kept for `kl`
    only.

    Raises:
        ValueError: `kl` without the target's last hidden state (feature shards written without it), or a
            carried last hidden state without `ctx.final_norm`.
    """
    ids, am = batch["input_ids"], batch["attention_mask"]
    d = ctx.probe["drafter"]
    teacher_needed = ctx.loss in TEACHER_LOSSES
    last = batch.get("target_last_hidden") if teacher_needed else None
    with torch.no_grad():
        if last is not None:  # pre-norm (shards / servers): the final norm makes it the LM head's input
            if ctx.final_norm is None:
                raise ValueError(
                    "a batch's target_last_hidden (pre-norm) needs the target's final norm (StepContext.final_norm)"
                )
            w = next(iter(ctx.final_norm.parameters()), None)
            last = ctx.final_norm(last.to(w.dtype if w is not None else torch.float32))
        if "features" in batch:  # feature shards (train.target_features: shards): the target never runs here
            feats = batch["features"]
            if ctx.zero_target_features:  # the ablation baseline: same shapes, no target information
                feats = torch.zeros_like(feats)
        elif ctx.zero_target_features and not teacher_needed:  # the ablation never looks at the target
            k_h = len(d["target_layer_ids"]) * ctx.embed.weight.shape[1]
            feats = torch.zeros(*ids.shape, k_h, dtype=ctx.embed.weight.dtype, device=ids.device)  # [b, S, K·H]
        else:
            if "segment_ids" in batch:  # packed rows
                feats, out = P.packed_target_features(ctx.target, ids, batch["position_ids"], d["target_layer_ids"])
            else:
                feats, out = target_features(ctx.target, ids, am, d["target_layer_ids"])  # [b, S, K·H]
            last = out.hidden_states[-1] if teacher_needed else None  # final-normed: lm_head's input
            if ctx.zero_target_features:
                feats = torch.zeros_like(feats)
    if teacher_needed and last is None:
        raise ValueError("train.loss: kl needs the target's last hidden state (target_last_hidden in feature shards)")
    return feats, last


def training_step(ctx: StepContext, batch: dict) -> tuple[torch.Tensor, dict]:
    """`step_objective` normalised for one micro-step: its total divided by the global normaliser over ranks / world
    size, so DDP's gradient average is the global Σ terms / Σ normaliser. Returns `(loss scalar float32, stats)`."""
    out = step_objective(ctx, batch)
    norm = M.loss_normalizer(out.normalizer, ctx.world_size, ctx.reduce_sum)
    return out.total / norm.to(out.total.device).clamp(min=1e-12), out.stats
