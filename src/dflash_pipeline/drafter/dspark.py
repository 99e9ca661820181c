"""DSpark: the DFlash backbone drafting a whole block from the anchor, a low-rank Markov logit bias on the
previous token, and a confidence head that sets how many drafts to verify.

The serving engine's files are the specification (read, not copied; vLLM 0.32
``vllm/model_executor/models/qwen3_dspark.py``, abbreviated ``qds``, and the V2-runner speculator
``vllm/v1/worker/gpu/spec_decode/dspark/speculator.py``, abbreviated ``sds``):

* Layout (``sds:10-17``, ``sample_from_anchor``): B query slots [anchor, MASK×(B−1)] at positions p..p+B−1 see
  the context < p and each other (the DFlash backbone, ``qds:192-231``); slot k predicts the token at p+k+1,
  so a block proposes B tokens (DFlash: B − 1). vLLM serves it with ``num_speculative_tokens`` = B.
* :class:`MarkovHead` (``qds:48-93``): ``markov_w1`` [V, r] embeds the previous token, ``markov_w2`` [V, r]
  maps it to a vocabulary bias added to the base logits ``lm_head(h_k)``. Drafting is sequential
  (``sds:156-199``): slot 0's previous token is the anchor, slot k's the token drafted at slot k − 1.
* :class:`ConfidenceHead` (``qds:164-189``): ``σ(proj([h_k ‖ markov_w1(prev_k)]))`` (without the Markov part
  when ``confidence_head_with_markov`` is false), in float32: the probability that draft k is accepted given
  the ones before it. vLLM verifies while the running product stays high (``adaptive_verification.py:46-70``).

Config keys (``config.json``): ``markov_rank`` at the top level (``qds:212``), ``markov_head_type``
(``vanilla``), ``enable_confidence_head``, ``confidence_head_with_markov``, ``sample_from_anchor: true``.
"""

from __future__ import annotations

import torch
from torch import nn

from dflash_pipeline.drafter.model import DFlashDrafter

ARCHITECTURE = "Qwen3DSparkModel"
MARKOV_HEAD_TYPES = ("vanilla",)


class MarkovHead(nn.Module):
    """``markov_w1`` (Embedding V → r) and ``markov_w2`` (Linear r → V, weight [V, r]); ``qds:48-93``.
    ``markov_w2`` starts at zero, so an untrained head adds no bias."""

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
    """``proj``: Linear(H (+ r) → 1, bias), run in float32 (``qds:164-189``)."""

    def __init__(self, input_dim: int, with_markov: bool):
        super().__init__()
        self.with_markov = with_markov
        self.proj = nn.Linear(input_dim, 1, bias=True)

    def forward(self, hidden: torch.Tensor, markov_embed: torch.Tensor) -> torch.Tensor:
        """Confidence logits [...] (float32) from hidden [..., H] and the Markov embedding [..., r]."""
        x = torch.cat([hidden, markov_embed], dim=-1) if self.with_markov else hidden
        return nn.functional.linear(x.float(), self.proj.weight.float(), self.proj.bias.float()).squeeze(-1)


class DSparkDrafter(DFlashDrafter):
    """DSpark (module docstring). Extra parameters ``markov_head.markov_w{1,2}.weight`` and, with the
    confidence head, ``confidence_head.proj.{weight,bias}`` — the names vLLM loads (``qds:312-372``)."""

    family = "dspark"
    architecture = ARCHITECTURE
    drafts_from_anchor = True  # B drafts per block (slot k predicts position p+k+1)

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
        """``(logits [..., V], markov_embed [..., r])``: base logits [..., V] plus the Markov bias of
        ``prev_ids`` [...] (``sds:179-190``)."""
        e = self.markov_head.embed(prev_ids)
        return base_logits + self.markov_head.bias(e).to(base_logits.dtype), e

    @torch.no_grad()
    def propose(self, embed_tokens, lm_head, bonus_token, new_context, start, cache, block_size=None):
        """DSpark's draft: block [bonus, MASK×(B−1)] → B tokens drafted left to right with the Markov bias
        (greedy), and each draft's confidence. Returns ``(drafts long [b, B], confidence float32 [b, B] or
        None)``."""
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


def verify_length(confidence: torch.Tensor | None, threshold: float, num_drafts: int) -> int:
    """How many of ``num_drafts`` drafts to verify: all when ``threshold`` ≤ 0 or there is no confidence
    head, else the longest prefix whose survival Π_{i≤k} conf_i stays ≥ ``threshold`` (at least 1).
    vLLM's adaptive verification ranks slots by the same survival product (``adaptive_verification.py:56-70``)
    under a cost model; batch 1 with a fixed threshold is its simplest case.

    Args:
        confidence: float [1, B] or None.
    """
    if confidence is None or threshold <= 0:
        return num_drafts
    survival = torch.cumprod(confidence[0, :num_drafts].double(), dim=0)
    return max(1, int((survival >= threshold).sum()))
