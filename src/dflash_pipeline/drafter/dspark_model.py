"""DSpark's config, model and objective (the family: `dspark.DSparkFamily`): the DFlash backbone drafting a whole block from the anchor, a low-rank Markov logit bias on the
previous token, and a confidence head that sets how many drafts to verify.

The serving engine's files are the specification (read, not copied; vLLM 0.32
`vllm/model_executor/models/qwen3_dspark.py`, abbreviated `qds`, and the V2-runner speculator
`vllm/v1/worker/gpu/spec_decode/dspark/speculator.py`, abbreviated `sds`):

* Layout (`sds:10-17`): B query slots [anchor, MASK×(B−1)] at positions p..p+B−1 see the context < p and
  each other (`qds:192-231`); slot k predicts the token at p+k+1, so a block proposes B tokens (DFlash:
  B − 1). vLLM serves it with `num_speculative_tokens` = B.
* `MarkovHead` (`qds:48-93`): `markov_w1` [V, r] embeds the previous token, `markov_w2` [V, r] maps it to
  a vocabulary bias added to `lm_head(h_k)`. Drafting is sequential (`sds:156-199`).
* `ConfidenceHead` (`qds:164-189`): `σ(proj([h_k ‖ markov_w1(prev_k)]))` in float32, the probability
  that draft k is accepted given the ones before it (`adaptive_verification.py:46-70`).

Training: blocks of B + 1 label slots (`dspark_view`) and `dspark_objective` (CE or 0.1·CE + 0.9·TV with
the Markov bias, plus the confidence head's BCE; DSpark, arXiv 2607.05147; speculators
`algorithms/dspark.md`). Config keys: `markov_rank` (`qds:212`), `markov_head_type`,
`enable_confidence_head`, `confidence_head_with_markov`, `sample_from_anchor: true`.
"""

# no `from __future__ import annotations`: @strict validates DSparkConfig's fields against their evaluated types
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from huggingface_hub.dataclasses import strict
from torch import nn

from dflash_pipeline.drafter import blocks as BL
from dflash_pipeline.drafter.config import DFlashConfig
from dflash_pipeline.drafter.dflash2_model import _chunks
from dflash_pipeline.drafter.dspark import ARCHITECTURE, MARKOV_HEAD_TYPES
from dflash_pipeline.drafter.model import DFlashDrafter
from dflash_pipeline.target.loading import lm_head_logits


@strict
class DSparkConfig(DFlashConfig):
    """A DSpark drafter's config: `DFlashConfig` plus the top-level keys
    vLLM reads (`SETTINGS_KEYS`, `sample_from_anchor: true`), served as `Qwen3DSparkModel` with method
    `dspark`, B drafts per block."""

    markov_rank: int | None = None
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = False
    sample_from_anchor: bool = True

    architecture = ARCHITECTURE
    speculative_method = "dspark"
    drafts_from_anchor = True


class MarkovHead(nn.Module):
    """`markov_w1` (Embedding V → r) and `markov_w2` (Linear r → V, weight [V, r]); `qds:48-93`.
    `markov_w2` starts at zero, so an untrained head adds no bias."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        nn.init.normal_(self.markov_w1.weight, std=0.02)
        nn.init.zeros_(self.markov_w2.weight)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[...] → [..., r]."""
        return self.markov_w1(token_ids)

    def bias(self, markov_embed: torch.Tensor) -> torch.Tensor:
        """[..., r] → [..., V] logit bias."""
        return self.markov_w2(markov_embed)


class ConfidenceHead(nn.Module):
    """`proj`: Linear(H (+ r) → 1, bias), run in float32 (`qds:164-189`)."""

    def __init__(self, input_dim: int, with_markov: bool):
        super().__init__()
        self.with_markov = with_markov
        self.proj = nn.Linear(input_dim, 1, bias=True)

    def forward(self, hidden: torch.Tensor, markov_embed: torch.Tensor) -> torch.Tensor:
        """Confidence logits [...] (float32) from hidden [..., H] and the Markov embedding [..., r]."""
        x = torch.cat([hidden, markov_embed], dim=-1) if self.with_markov else hidden
        return nn.functional.linear(x.float(), self.proj.weight.float(), self.proj.bias.float()).squeeze(-1)


class DSparkDrafter(DFlashDrafter):
    """DSpark (module docstring). Extra parameters `markov_head.markov_w{1,2}.weight` and, with the
    confidence head, `confidence_head.proj.{weight,bias}` — the names vLLM loads (`qds:312-372`)."""

    architecture = ARCHITECTURE

    def __init__(self, config):
        rank = getattr(config, "markov_rank", None)
        if not isinstance(rank, int) or rank < 1:
            raise ValueError(f"config.markov_rank: a positive integer is required for DSpark, got {rank!r}")
        head = getattr(config, "markov_head_type", "vanilla")
        if head not in MARKOV_HEAD_TYPES:
            raise ValueError(
                f"config.markov_head_type: {head!r} is not supported (only {', '.join(MARKOV_HEAD_TYPES)})"
            )
        super().__init__(config)
        self.markov_head = MarkovHead(config.vocab_size, rank)
        self.confidence_head: ConfidenceHead | None = None
        if getattr(config, "enable_confidence_head", False):
            with_markov = bool(getattr(config, "confidence_head_with_markov", False))
            self.confidence_head = ConfidenceHead(config.hidden_size + (rank if with_markov else 0), with_markov)

    def step_logits(self, base_logits: torch.Tensor, prev_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(logits [..., V], markov_embed [..., r])`: base logits [..., V] plus the Markov bias of
        `prev_ids` [...] (`sds:179-190`)."""
        e = self.markov_head.embed(prev_ids)
        return base_logits + self.markov_head.bias(e).to(base_logits.dtype), e

    @torch.no_grad()
    def propose(self, embed_tokens, lm_head, bonus_token, new_context, start, cache, block_size=None):
        """DSpark's draft: block [bonus, MASK×(B−1)] → B tokens drafted left to right with the Markov bias
        (greedy), and each draft's confidence. Returns `(drafts long [b, B], confidence float32 [b, B] or
        None)`."""
        hidden = self.block_hidden(embed_tokens, bonus_token, new_context, start, cache, block_size)  # [b, B, H]
        base = lm_head(hidden.to(lm_head.weight.dtype))  # [b, B, V]
        prev = bonus_token.view(-1)
        drafts, embeds = [], []
        for k in range(hidden.shape[1]):
            logits, e = self.step_logits(base[:, k], prev)
            prev = logits.argmax(dim=-1)
            drafts.append(prev)
            embeds.append(e)
        conf = None
        if self.confidence_head is not None:
            conf = torch.sigmoid(self.confidence_head(hidden, torch.stack(embeds, dim=1).to(hidden.dtype)))
        return torch.stack(drafts, dim=1), conf

    def objective(self, hidden, lm_head_weight, blocks, **kwargs):
        """`dspark_objective` of this drafter (the family's training objective; keywords as there): `hidden` the
        final-normed block states [b, Q, H], `lm_head_weight` [V, H], `blocks` a `DSparkBlocks`; returns a
        `LossOutput`."""
        return dspark_objective(self, hidden, lm_head_weight, blocks, **kwargs)

    @staticmethod
    def training_view(ids, pos, labels, weights, block_size: int, gamma=None, rows=None):
        """`dspark_view`: the family's training blocks (`ids`, `pos`, `labels`, `weights` [b, N·(B+1)]) read shifted by
        one, as a `DSparkBlocks` of B slots per block."""
        return dspark_view(ids, pos, labels, weights, block_size, gamma, rows=rows)


def verify_length(confidence: torch.Tensor | None, threshold: float, num_drafts: int) -> int:
    """How many of `num_drafts` drafts to verify: all when `threshold` ≤ 0 or there is no confidence head, else the
    longest prefix whose survival Π_{i≤k} conf_i stays ≥ `threshold` (at least 1). vLLM's adaptive verification ranks
    slots by the same survival product (`adaptive_verification.py:56-70`) under a cost model.

    Args:
        confidence: float [1, B] or None.
    """
    if confidence is None or threshold <= 0:
        return num_drafts
    survival = torch.cumprod(confidence[0, :num_drafts].double(), dim=0)
    return max(1, int((survival >= threshold).sum()))


# --- Training: blocks drafted from the anchor, CE / TV with the Markov bias, the confidence head's BCE


@dataclass
class DSparkBlocks:
    """DSpark training blocks (all [b, N·B]): `ids` (anchor + MASK), `pos` (p..p+B−1), `labels` (token
    at p+k+1), `prev` (gold token at p+k: the Markov head's input), `rows` (label positions p+k+1, for the
    teacher), `weights` (float, decayed `exp(−k/γ)`, 0 = not supervised)."""

    ids: torch.Tensor
    pos: torch.Tensor
    labels: torch.Tensor
    prev: torch.Tensor
    rows: torch.Tensor
    weights: torch.Tensor


def dspark_view(ids, pos, labels, weights, block_size: int, gamma: float | None = None, rows=None) -> DSparkBlocks:
    """DSpark blocks from DFlash-layout blocks of B + 1 slots (each [b, N·(B+1)]): slot j ≥ 1's label is DSpark slot
    j − 1's. `rows`: the row index of each slot (default `pos`, as in unpacked rows)."""
    b = ids.shape[0]

    def view(t):
        return t.reshape(b, -1, block_size + 1)

    def flat(t):
        return t.reshape(b, -1)

    rows = pos if rows is None else rows
    ids, pos, labels, weights, rows = view(ids), view(pos), view(labels), view(weights), view(rows)
    k = torch.arange(block_size, device=ids.device, dtype=torch.float32)
    decay = torch.ones_like(k) if gamma is None else torch.exp(-k / gamma)
    return DSparkBlocks(
        ids=flat(ids[..., :block_size]),
        pos=flat(pos[..., :block_size]),
        labels=flat(labels[..., 1:]),
        prev=flat(labels[..., :block_size]),
        rows=flat(rows[..., 1:]),
        weights=flat((weights[..., 1:] > 0).float() * decay),
    )


def dspark_blocks(
    input_ids, loss_mask, anchors: BL.AnchorBatch, block_size: int, mask_token_id: int, gamma: float | None
) -> DSparkBlocks:
    """Blocks drafted from the anchor (`qwen3_dspark.py` / `dspark/speculator.py:10-17`): slot k of the block
    anchored at p sits at p+k and predicts `input_ids[p+k+1]`; weight = keep · [p+k+1 < S] · loss_mask[p+k+1] ·
    exp(−k/γ) (γ None → 1). Built from `drafter.blocks.block_inputs_and_labels` with B + 1 slots."""
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
) -> BL.LossOutput:
    """Σ_k w_k·[a·CE_k + c·TV_k + λ·BCE_k] with normaliser Σ w_k; `loss` `ce_decay`: a = 1, c = 0;
    `dspark_tv`: a = `ce_weight`, c = `tv_weight`, TV = ½ Σ_v |p_T − p_D| (one minus the acceptance rate of
    speculative sampling, Leviathan et al. 2023 §3). λ = `confidence_weight` with a confidence head (BCE
    against "the draft's argmax is the gold token"), else 0. Logits = `lm_head(h_k)` + the Markov bias of
    the gold previous token.

    Args:
        drafter: a `DSparkDrafter` (unwrapped).
        hidden: [b, N·B, H]; lm_head_weight: [V, H]; blocks: `dspark_blocks`.
        teacher_hidden: [b, N·B, H] target final hidden state per label (required for `dspark_tv`).
        logit_softcap: the target's `final_logit_softcapping`, applied to the teacher logits.
    Raises:
        ValueError: unknown `loss`, or `dspark_tv` without `teacher_hidden`."""
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
        return BL.LossOutput(total=hidden.sum() * 0.0, normalizer=norm, stats={"num_slots": 0})
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
    return BL.LossOutput(
        total=total, normalizer=norm, stats={"num_slots": int(index.numel()), "correct": torch.cat(oks), "index": index}
    )
