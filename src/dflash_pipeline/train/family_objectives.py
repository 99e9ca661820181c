"""Training objectives of the DFlash2 and DSpark drafter families (config ``drafter.family``).

* DFlash2 (:func:`selector_term`): the family's token objective (``train.loss``, on the unary logits) plus
  ``train.selector_weight`` × a K-way cross-entropy of the candidate selector. The selector is trained
  teacher-forced: slot k's predecessor is the gold token of slot k − 1 (the anchor for k = 1), its candidates
  the unary top-K. When the gold token is not among them, ``train.selector_gold`` decides: ``insert`` puts it
  in place of the K-th candidate, for the loss only (speculators #1006, SpecForge #772), ``drop`` leaves the
  slot out of the selector term (NeMo Automodel). Serving never sees the inserted token.
* DSpark (:func:`dspark_blocks`, :func:`dspark_objective`): blocks drafted from the anchor (slot k predicts
  position p+k+1, weight ``exp(−k/γ)``), logits = ``lm_head(h_k)`` + the Markov bias of the gold previous
  token, and ``train.loss`` ``dspark_tv`` = 0.1·CE + 0.9·TV(p_target, p_draft) (``ce_decay``: CE alone), plus
  ``train.confidence_weight`` × BCE of the confidence head against "the draft's argmax is the gold token"
  (DSpark, arXiv 2607.05147; speculators docs ``algorithms/dspark.md``: confidence head trained with BCE
  weighted by ``confidence_head_alpha``). TV = ½ Σ_v |p_T(v) − p_D(v)| is one minus the acceptance rate of
  speculative sampling (Leviathan et al. 2023, §3), so minimising it maximises the expected acceptance.

Every term is a Σ over supervised slots of w_k·(term); the :class:`dflash_pipeline.train.losses.LossOutput`
normaliser is Σ w_k, so the trainer's global normalisation applies unchanged. Notation as in
:mod:`dflash_pipeline.train.losses` (Q block slots, B block size, V vocabulary, K candidates, r rank).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dflash_pipeline.drafter import attention_masks as AM
from dflash_pipeline.drafter import blocks as BL
from dflash_pipeline.drafter import dflash2 as D2
from dflash_pipeline.drafter.dflash2 import cap_logits
from dflash_pipeline.target import loading as T
from dflash_pipeline.target.loading import lm_head_logits
from dflash_pipeline.train import losses as L

SELECTOR_GOLD = ("insert", "drop")


def _chunks(n: int, size: int):
    for i in range(0, n, size):
        yield slice(i, i + size)


def selector_term(
    drafter,
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    block_size: int,
    *,
    gold: str = "insert",
    chunk_tokens: int = 4096,
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Σ_k w_k · CE_K(selector scores, gold) over mask slots (module docstring).

    Scores of slot k: ``unary_j + ⟨pred[y_{k−1}] ⊙ W_h h_k, succ[c_j]⟩`` over its candidates c (the unary
    top-K, ``softcap(multiplier · logits)``), as :meth:`dflash_pipeline.drafter.dflash2.CandidateSelector.scores`
    with the gold predecessor.

    Args:
        drafter: a :class:`dflash_pipeline.drafter.dflash2.DFlash2Drafter` (unwrapped).
        hidden: [b, N·B, H]; lm_head_weight: [V, H]; labels: long [b, N·B] (same-position labels, slot 0 =
            the anchor); weights: float [b, N·B] (0 = not supervised; slot 0 always 0).
        gold: ``insert`` or ``drop``.
    Returns:
        ``(Σ w·CE float32 with grad, Σ w of the slots it covers, stats)``; stats: ``selector_slots``,
        ``selector_correct`` (argmax = gold), ``gold_in_top_k`` (slots whose gold token was a candidate).
    Raises:
        ValueError: unknown ``gold``.
    """
    if gold not in SELECTOR_GOLD:
        raise ValueError(f"train.selector_gold: {gold!r}; expected one of {', '.join(SELECTOR_GOLD)}")
    b, q = labels.shape
    w = weights.reshape(-1)
    index = (w > 0).nonzero(as_tuple=True)[0]  # slot ≥ 1 of its block, so index − 1 is its predecessor
    h = hidden.reshape(b * q, -1)
    y = labels.reshape(-1)
    k = drafter.top_k
    sel = drafter.candidate_selector

    def chunk(hc, yc, pc, wc):
        logits = lm_head_logits(hc, lm_head_weight)  # [n, V] float32
        with torch.no_grad():
            cand = logits.topk(k, dim=-1).indices  # [n, K]
            hit = cand == yc.unsqueeze(1)
            in_top = hit.any(dim=1)
            if gold == "insert":
                cand[:, -1] = torch.where(in_top, cand[:, -1], yc)
                hit = cand == yc.unsqueeze(1)
            keep = torch.ones_like(in_top) if gold == "insert" else in_top
            target = hit.float().argmax(dim=1)
        unary = cap_logits(logits.gather(1, cand), drafter.output_multiplier, drafter.softcap)
        scores = unary + sel.edge(hc, pc.unsqueeze(1), cand)[:, 0]  # [n, K]
        ce = F.cross_entropy(scores, target, reduction="none")
        wk = wc * keep.float()
        return (ce * wk).sum(), wk.sum(), (scores.argmax(1) == target) & keep, in_top

    total = hidden.new_zeros((), dtype=torch.float32)
    covered = hidden.new_zeros((), dtype=torch.float32)
    correct, in_tops = [], []
    for s in _chunks(index.numel(), chunk_tokens):
        i = index[s]
        part, wsum, ok, it = torch.utils.checkpoint.checkpoint(
            chunk, h[i], y[i], y[i - 1], w[i].float(), use_reentrant=False
        )
        total, covered = total + part, covered + wsum.detach()
        correct.append(ok)
        in_tops.append(it)
    stats = {
        "selector_slots": int(index.numel()),
        "selector_correct": int(torch.cat(correct).sum()) if correct else 0,
        "gold_in_top_k": int(torch.cat(in_tops).sum()) if in_tops else 0,
    }
    return total, covered, stats


def dflash2_objective(
    base: L.LossOutput,
    drafter,
    hidden,
    lm_head_weight,
    labels,
    weights,
    block_size,
    *,
    gold: str,
    selector_weight: float,
    chunk_tokens: int = 4096,
) -> L.LossOutput:
    """``base`` (the ``train.loss`` objective on the unary logits) + ``selector_weight`` × the selector term,
    scaled to ``base``'s normaliser: the reported loss is base + λ · (weighted mean selector CE)."""
    if selector_weight == 0:
        return base
    sel_total, _, stats = selector_term(
        drafter, hidden, lm_head_weight, labels, weights, block_size, gold=gold, chunk_tokens=chunk_tokens
    )
    wsum = weights.detach().float().clamp(min=0).sum()
    scale = base.normalizer.detach() / wsum.clamp(min=1e-12)
    return L.LossOutput(
        total=base.total + selector_weight * scale * sel_total,
        normalizer=base.normalizer,
        stats={**base.stats, **stats},
    )


@dataclass
class DSparkBlocks:
    """DSpark training blocks (all [b, N·B]): ``ids`` (anchor + MASK), ``pos`` (p..p+B−1), ``labels`` (token
    at p+k+1), ``prev`` (gold token at p+k: the Markov head's input), ``rows`` (label positions p+k+1, for the
    teacher), ``weights`` (float, decayed ``exp(−k/γ)``, 0 = not supervised)."""

    ids: torch.Tensor
    pos: torch.Tensor
    labels: torch.Tensor
    prev: torch.Tensor
    rows: torch.Tensor
    weights: torch.Tensor


def dspark_view(ids, pos, labels, weights, block_size: int, gamma: float | None = None) -> DSparkBlocks:
    """DSpark blocks from DFlash-layout blocks of B + 1 slots (each [b, N·(B+1)]): slot j ≥ 1's label is DSpark
    slot j − 1's (:func:`dspark_blocks`; also the packed blocks of :mod:`dflash_pipeline.train.packing`)."""
    b = ids.shape[0]

    def view(t):
        return t.reshape(b, -1, block_size + 1)

    def flat(t):
        return t.reshape(b, -1)

    ids, pos, labels, weights = view(ids), view(pos), view(labels), view(weights)
    k = torch.arange(block_size, device=ids.device, dtype=torch.float32)
    decay = torch.ones_like(k) if gamma is None else torch.exp(-k / gamma)
    return DSparkBlocks(
        ids=flat(ids[..., :block_size]),
        pos=flat(pos[..., :block_size]),
        labels=flat(labels[..., 1:]),
        prev=flat(labels[..., :block_size]),
        rows=flat(pos[..., 1:]),
        weights=flat((weights[..., 1:] > 0).float() * decay),
    )


def greedy_hits(core, lm_head, hidden: torch.Tensor, labels: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """Teacher-forced greedy hits of a family's draft rule, bool [b, Q]: DFlash2 — the selector's best candidate
    after the gold predecessor ``prev`` (a gold token outside the top-K is a miss, as at serving); DSpark — the
    argmax of the Markov-biased logits after ``prev``. ``hidden`` [b, Q, H]; ``labels``/``prev`` long [b, Q]."""
    hits = torch.zeros(labels.shape, dtype=torch.bool, device=labels.device)
    for i in range(0, hidden.shape[1], 4096):  # chunks of slots: never [Q, V] logits at once
        h, y, p = hidden[:, i : i + 4096], labels[:, i : i + 4096], prev[:, i : i + 4096]
        logits = lm_head(h.to(lm_head.weight.dtype)).float()
        if core.family == "dspark":
            pick = core.step_logits(logits, p)[0].argmax(-1)
        else:
            cand, unary = D2.unary_top_k(logits, core.top_k, core.output_multiplier, core.softcap)
            n, q = y.shape
            e = core.candidate_selector.edge(h.reshape(n * q, -1), p.reshape(-1, 1), cand.reshape(n * q, -1))
            best = (unary.reshape(n * q, -1) + e[:, 0]).argmax(-1, keepdim=True)
            pick = cand.reshape(n * q, -1).gather(1, best).view(n, q)
        hits[:, i : i + 4096] = pick == y
    return hits


def dspark_blocks(
    input_ids, loss_mask, anchors: BL.AnchorBatch, block_size: int, mask_token_id: int, gamma: float | None
) -> DSparkBlocks:
    """Blocks drafted from the anchor (``qwen3_dspark.py`` / ``dspark/speculator.py:10-17``): slot k of the
    block anchored at p sits at p+k and predicts ``input_ids[p+k+1]``; weight = keep · [p+k+1 < S] ·
    loss_mask[p+k+1] · exp(−k/γ) (γ None → 1). Built from :func:`dflash_pipeline.drafter.blocks.block_inputs_and_labels`
    with B + 1 slots (its slot j ≥ 1 is DSpark's label of slot j − 1)."""
    ids, pos, labels, weights = BL.block_inputs_and_labels(
        input_ids, loss_mask, anchors, block_size + 1, mask_token_id, None
    )
    return dspark_view(ids, pos, labels, weights, block_size, gamma)


def dspark_objective(
    drafter,
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    blocks: DSparkBlocks,
    *,
    loss: str = "dspark_tv",
    teacher_hidden: torch.Tensor | None = None,
    ce_weight: float = 0.1,
    tv_weight: float = 0.9,
    confidence_weight: float = 1.0,
    chunk_tokens: int = 4096,
    logit_softcap: float | None = None,
) -> L.LossOutput:
    """Σ_k w_k·[a·CE_k + c·TV_k + λ·BCE_k] with normaliser Σ w_k (module docstring); ``loss`` ``ce_decay``:
    a = 1, c = 0; ``dspark_tv``: a = ``ce_weight``, c = ``tv_weight``. λ = ``confidence_weight`` when the
    drafter has a confidence head, else 0.

    Args:
        drafter: a :class:`dflash_pipeline.drafter.dspark.DSparkDrafter` (unwrapped).
        hidden: [b, N·B, H]; lm_head_weight: [V, H]; blocks: :func:`dspark_blocks`.
        teacher_hidden: [b, N·B, H] target final hidden state predicting each label (required for ``dspark_tv``).
        logit_softcap: the target's ``final_logit_softcapping``: its teacher logits are capped as the target's
            are (:func:`dflash_pipeline.train.losses.kl` does the same).
    Raises:
        ValueError: unknown ``loss``, or ``dspark_tv`` without ``teacher_hidden``.
    """
    if loss not in ("ce_decay", "dspark_tv"):
        raise ValueError(f"train.loss: {loss} cannot train a DSpark drafter (ce_decay or dspark_tv)")
    if loss == "dspark_tv" and teacher_hidden is None:
        raise ValueError("train.loss: dspark_tv needs the target's last hidden state (teacher_hidden)")
    a, c = (1.0, 0.0) if loss == "ce_decay" else (ce_weight, tv_weight)
    conf_head = drafter.confidence_head
    lam = confidence_weight if conf_head is not None else 0.0
    w = blocks.weights.reshape(-1)
    index = (w > 0).nonzero(as_tuple=True)[0]
    norm = w.detach().float().sum()
    if index.numel() == 0:
        return L.LossOutput(total=hidden.sum() * 0.0, normalizer=norm, stats={"num_slots": 0})
    h = hidden.reshape(-1, hidden.shape[-1])[index]
    y, prev, ws = blocks.labels.reshape(-1)[index], blocks.prev.reshape(-1)[index], w[index].float()
    t = teacher_hidden.reshape(-1, teacher_hidden.shape[-1])[index].detach() if c else None

    def chunk(hc, yc, pc, wc, tc):
        logits, e = drafter.step_logits(lm_head_logits(hc, lm_head_weight), pc)  # [n, V] float32, [n, r]
        term = a * F.cross_entropy(logits, yc, reduction="none")
        if c:
            with torch.no_grad():
                z_t = lm_head_logits(tc, lm_head_weight)
                if logit_softcap:
                    z_t = torch.tanh(z_t / logit_softcap) * logit_softcap
                p_t = torch.softmax(z_t, dim=-1)
            term = term + c * 0.5 * (torch.softmax(logits, dim=-1) - p_t).abs().sum(-1)
        ok = logits.argmax(-1) == yc
        if lam:
            conf = conf_head(hc, e.to(hc.dtype))
            term = term + lam * F.binary_cross_entropy_with_logits(conf, ok.float(), reduction="none")
        return (term * wc).sum(), ok

    total = hidden.new_zeros((), dtype=torch.float32)
    oks = []
    for s in _chunks(index.numel(), chunk_tokens):
        tc = t[s] if t is not None else h[s][:, :0]
        part, ok = torch.utils.checkpoint.checkpoint(chunk, h[s], y[s], prev[s], ws[s], tc, use_reentrant=False)
        total = total + part
        oks.append(ok)
    return L.LossOutput(
        total=total, normalizer=norm, stats={"num_slots": int(index.numel()), "correct": torch.cat(oks), "index": index}
    )


def dspark_step(
    ctx, core, ids: torch.Tensor, lmask: torch.Tensor, feats: torch.Tensor, last: torch.Tensor | None
) -> L.LossOutput:
    """One DSpark forward pass on unpacked rows (packing is refused at planning): anchors → blocks drafted
    from the anchor (:func:`dspark_blocks`) → the drafter under the DFlash training mask (context < anchor,
    own block) → :func:`dspark_objective`. ``ctx``: the step's
    :class:`dflash_pipeline.train.step.StepContext`; ``core``: the unwrapped drafter; ``feats`` [b, S, K·H];
    ``last`` [b, S, H] (the target's final-normed last hidden state, for ``dspark_tv``)."""
    b, s = ids.shape
    anchors = BL.sample_anchors(lmask.cpu(), ctx.num_anchors, generator=ctx.generator)
    anchors = BL.AnchorBatch(anchors.anchors.to(ids.device), anchors.keep.to(ids.device))
    blk = dspark_blocks(ids, lmask, anchors, ctx.block_size, ctx.probe["drafter"]["mask_token_id"], ctx.gamma)
    mask = AM.build_training_masks(core, anchors.anchors, s, ctx.backend)
    ctx_pos = torch.arange(s, device=ids.device).expand(b, -1)
    with torch.no_grad():
        noise = ctx.embed(blk.ids)
    noise, feats = T.to_drafter_dtype(ctx.drafter, noise, feats)
    hidden = ctx.drafter(noise, feats, ctx_pos, blk.pos, attn_mask=mask)
    teacher = L.teacher_slot_hidden(last, blk.rows) if ctx.loss == "dspark_tv" else None
    return dspark_objective(
        core,
        hidden,
        ctx.lm_head.weight,
        blk,
        loss=ctx.loss,
        teacher_hidden=teacher,
        confidence_weight=ctx.confidence_weight,
        logit_softcap=ctx.logit_softcap,
    )
