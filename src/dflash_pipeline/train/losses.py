"""Training objectives of the DFlash drafter: `ce_decay`, `dpace` and `kl` (config `train.loss`).

Each returns a `LossOutput` holding an unnormalised sum and its own normaliser, so the trainer divides by
the normaliser summed over ranks and micro-steps (anchors.md §F Automodel#2572). Notation as in
`model.py`; slot k predicts its own position's token (dflash.md §4.3); slot 0 carries no loss.

Sources: `ce_decay` dflash.md §4.5 (SpecForge's decayed CE, DFlash paper App. A.1); `dpace` dflash.md
§4.6 (D-PACE, arXiv 2605.18810; SpecForge `--loss-type dpace`); `kl` dflash.md §4.6 / anchors.md §F
(Model-Optimizer `dflash_self_logit_distillation`), T² from Hinton et al. 2015 §2.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from dflash_pipeline.drafter import model as M
from dflash_pipeline.drafter.blocks import LossOutput  # noqa: F401  (the objectives' result, defined beside the blocks)
from dflash_pipeline.target.loading import lm_head_logits

#: The objectives `train.loss` accepts.
LOSSES = ("ce_decay", "dpace", "kl")


def ce_decay(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    *,
    chunk_tokens: int = 4096,
) -> LossOutput:
    """Decayed cross-entropy Σ_k w_k·CE_k with normaliser Σ_k w_k (dflash.md §4.5).

    `w_k = exp(−(k−1)/γ)` on supervised slots. Computed by `drafter.model.decayed_cross_entropy`.

    Args:
        hidden: [b, Q, H] drafter output (any float dtype).
        lm_head_weight: [V, H] frozen target LM head.
        labels: long [b, Q]; weights: float [b, Q] (0 = not supervised).
    """
    loss, stats = M.decayed_cross_entropy(hidden, lm_head_weight, labels, weights, chunk_tokens)
    norm = weights.detach().float().clamp(min=0).sum()
    return LossOutput(total=loss * norm, normalizer=norm, stats=stats)


def slot_cross_entropy(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    index: torch.Tensor,
    chunk_tokens: int = 4096,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-slot CE (float32, with grad) and argmax correctness of the slots `index` (flat into [b·Q]).

    Logits are formed `chunk_tokens` slots at a time under activation checkpointing, as in
    `drafter.model.decayed_cross_entropy` (dflash.md §4.7), so [Q, V] never exists at once.
    Returns `(ce float32 [n], correct bool [n])`.
    """
    h = hidden.reshape(-1, hidden.shape[-1])[index]
    y = labels.reshape(-1)[index]

    def chunk(hc, yc):
        logits = lm_head_logits(hc, lm_head_weight)
        return F.cross_entropy(logits, yc, reduction="none"), logits.argmax(-1) == yc

    ces, oks = [], []
    for i in range(0, h.shape[0], chunk_tokens):
        ce, ok = torch.utils.checkpoint.checkpoint(
            chunk, h[i : i + chunk_tokens], y[i : i + chunk_tokens], use_reentrant=False
        )
        ces.append(ce)
        oks.append(ok)
    if not ces:
        return hidden.new_zeros(0, dtype=torch.float32), torch.zeros(0, dtype=torch.bool, device=hidden.device)
    return torch.cat(ces), torch.cat(oks)


def dpace_weights(ce: torch.Tensor, valid: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """D-PACE slot weights w_k = Σ_{m≥k} P_m·m_m per block (dflash.md §4.6).

    q_k = exp(−CE_k) (detached), q̃_k = (1−α)·q_k + α, P_k = Π_{i≤k} q̃_i over the block's valid slots
    (an invalid slot contributes the factor 1 and no term), m_k = valid_k.

    Args:
        ce: float [..., B] per-slot CE (any value on invalid slots).
        valid: bool [..., B].
    Returns:
        float32 [..., B] weights, 0 on invalid slots, no grad.
    """
    ce = ce.detach().float()
    q = torch.exp(-ce)
    q_s = torch.where(valid, (1.0 - alpha) * q + alpha, torch.ones_like(q))
    prefix = torch.cumprod(q_s, dim=-1) * valid  # P_m · m_m
    suffix = prefix.flip(-1).cumsum(-1).flip(-1)  # Σ_{m ≥ k}
    return suffix * valid


def dpace(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    block_size: int,
    *,
    alpha: float = 0.5,
    num_sequences: Optional[int] = None,
    chunk_tokens: int = 4096,
) -> LossOutput:
    """D-PACE: Σ_k w_k·m_k·CE_k with w from `dpace_weights`, normaliser = number of sequences
    (not weight-normalised; dflash.md §4.6, SpecForge `--loss-type dpace`). `num_sequences` defaults to
    the rows b; packed rows pass their record count, so packing does not change the loss scale.

    The position decay is not applied: `weights > 0` only marks the valid slots m_k.

    Args:
        hidden: [b, N·B, H]; lm_head_weight: [V, H]; labels: long [b, N·B]; weights: float [b, N·B].
        alpha: smoothing α of q̃ = (1−α)q + α (0.5 in D-PACE).
    """
    b, q_len = labels.shape
    if q_len % block_size:
        raise ValueError(f"dpace: {q_len} block slots is not a multiple of block_size {block_size}")
    valid = weights > 0
    index = valid.reshape(-1).nonzero(as_tuple=True)[0]
    ce, correct = slot_cross_entropy(hidden, lm_head_weight, labels, index, chunk_tokens)
    norm = hidden.new_tensor(float(b if num_sequences is None else num_sequences), dtype=torch.float32)
    if index.numel() == 0:
        return LossOutput(total=hidden.sum() * 0.0, normalizer=norm, stats={"num_slots": 0})
    full = torch.zeros(b * q_len, dtype=torch.float32, device=hidden.device)
    full = full.index_copy(0, index, ce.detach())
    w = dpace_weights(full.view(b, -1, block_size), valid.view(b, -1, block_size), alpha).reshape(-1)
    total = (w[index] * ce).sum()
    return LossOutput(
        total=total, normalizer=norm, stats={"num_slots": int(index.numel()), "correct": correct, "index": index}
    )


def teacher_slot_hidden(last_hidden: torch.Tensor, block_pos: torch.Tensor) -> torch.Tensor:
    """The target's final hidden state that predicts each slot's token: position `block_pos − 1`.

    The target's logits at position t−1 are its distribution of the token at t, the slot's label
    (same-position labels, dflash.md §4.3). Slot 0 (no loss) is clamped to position 0.

    Args:
        last_hidden: [b, S, H] target's final-normed hidden state.
        block_pos: long [b, Q] slot positions (from `block_inputs_and_labels`), < S.
    Returns:
        [b, Q, H] in `last_hidden`'s dtype.
    """
    idx = (block_pos - 1).clamp(min=0, max=last_hidden.shape[1] - 1)
    return last_hidden.gather(1, idx.unsqueeze(-1).expand(-1, -1, last_hidden.shape[-1]))


def kl(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    teacher_hidden: torch.Tensor,
    *,
    temperature: float = 1.0,
    ce_weight: float = 0.0,
    chunk_tokens: int = 4096,
    logit_softcap: Optional[float] = None,
) -> LossOutput:
    """Soft-label distillation to the target: Σ_k w_k·[(1−λ)·T²·KL(p_T ‖ p_S) + λ·CE_k], normaliser Σ w_k.

    p_T = softmax(lm_head(teacher_hidden) / T), p_S = softmax(lm_head(hidden) / T) over the full vocabulary;
    T² keeps the gradient scale independent of T (Hinton et al. 2015 §2). w_k are the decayed slot weights
    ("KD + decay", Model-Optimizer `dflash_self_logit_distillation`).

    Args:
        hidden: [b, Q, H] drafter output; lm_head_weight: [V, H] frozen target LM head.
        labels: long [b, Q]; weights: float [b, Q].
        teacher_hidden: [b, Q, H] target final hidden state per slot (`teacher_slot_hidden`).
        temperature: T > 0. ce_weight: λ in [0, 1].
        logit_softcap: the target's `final_logit_softcapping` c: teacher logits c·tanh(z/c) (HF
            `Gemma3ForCausalLM.forward`); the student's stay uncapped, as vLLM serves them. None: no cap.
    Raises:
        ValueError: T ≤ 0 or λ outside [0, 1]."""
    if temperature <= 0:
        raise ValueError(f"kl: temperature must be > 0, got {temperature}")
    if not 0.0 <= ce_weight <= 1.0:
        raise ValueError(f"kl: ce_weight must be in [0, 1], got {ce_weight}")
    w = weights.reshape(-1)
    index = (w > 0).nonzero(as_tuple=True)[0]
    norm = w.detach().float().clamp(min=0).sum()
    if index.numel() == 0:
        return LossOutput(total=hidden.sum() * 0.0, normalizer=norm, stats={"num_slots": 0})
    hs = hidden.reshape(-1, hidden.shape[-1])[index]
    ts = teacher_hidden.reshape(-1, teacher_hidden.shape[-1])[index].detach()
    ys = labels.reshape(-1)[index]
    ws = w[index].float()
    t = float(temperature)

    def chunk(hc, tc, yc, wc):
        student = lm_head_logits(hc, lm_head_weight)
        with torch.no_grad():
            teacher = lm_head_logits(tc, lm_head_weight)
            if logit_softcap:
                teacher = torch.tanh(teacher.float() / logit_softcap) * logit_softcap
        log_p_t = F.log_softmax(teacher / t, dim=-1)
        log_p_s = F.log_softmax(student / t, dim=-1)
        kl_k = (log_p_t.exp() * (log_p_t - log_p_s)).sum(-1) * (t * t)
        term = (1.0 - ce_weight) * kl_k
        if ce_weight:
            term = term + ce_weight * F.cross_entropy(student, yc, reduction="none")
        return (term * wc).sum(), student.argmax(-1) == yc

    total = hidden.new_zeros((), dtype=torch.float32)
    oks = []
    for i in range(0, hs.shape[0], chunk_tokens):
        s = slice(i, i + chunk_tokens)
        part, ok = torch.utils.checkpoint.checkpoint(chunk, hs[s], ts[s], ys[s], ws[s], use_reentrant=False)
        total = total + part
        oks.append(ok)
    return LossOutput(
        total=total, normalizer=norm, stats={"num_slots": int(index.numel()), "correct": torch.cat(oks), "index": index}
    )


def compute_loss(
    name: str,
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    block_size: int,
    *,
    teacher_hidden: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    ce_weight: float = 0.0,
    dpace_alpha: float = 0.5,
    num_sequences: Optional[int] = None,
    chunk_tokens: int = 4096,
    logit_softcap: Optional[float] = None,
) -> LossOutput:
    """Dispatch on `train.loss` (one of `LOSSES`). `teacher_hidden` is required for `kl`;
    `num_sequences` is D-PACE's normaliser (default: the rows of `labels`).

    Raises:
        ValueError: unknown name, or `kl` without `teacher_hidden`.
    """
    if name == "ce_decay":
        return ce_decay(hidden, lm_head_weight, labels, weights, chunk_tokens=chunk_tokens)
    if name == "dpace":
        return dpace(
            hidden,
            lm_head_weight,
            labels,
            weights,
            block_size,
            alpha=dpace_alpha,
            num_sequences=num_sequences,
            chunk_tokens=chunk_tokens,
        )
    if name == "kl":
        if teacher_hidden is None:
            raise ValueError("train.loss: kl needs the target's last hidden state (teacher_hidden)")
        return kl(
            hidden,
            lm_head_weight,
            labels,
            weights,
            teacher_hidden,
            temperature=temperature,
            ce_weight=ce_weight,
            chunk_tokens=chunk_tokens,
            logit_softcap=logit_softcap,
        )
    raise ValueError(f"train.loss: unknown objective {name!r}; expected one of {', '.join(LOSSES)}")
