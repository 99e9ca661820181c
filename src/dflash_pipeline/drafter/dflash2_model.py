"""DFlash2's config, model and objective (the family: `dflash2.DFlash2Family`): the DFlash drafter with dynamic grouped convolutions around every sublayer and a low-rank
candidate selector that re-ranks each mask slot's top-K and walks one path from the anchor.

The serving engine's model file is the specification (read, not copied; vLLM 0.32
`vllm/model_executor/models/qwen3_dflash2.py`, abbreviated `qd2`, and its V2-runner speculator
`vllm/v1/worker/gpu/spec_decode/dflash2/speculator.py`, abbreviated `sd2`):

* `GroupedConv` — `qd2:170-226`, arithmetic `qd2:25-78` (Triton) = `qd2:144-167` (CPU): per query row r at
  block offset `o = r mod B` and channel c of group `g = c // group_size`,
  `out[r, c] = Σ_{t < taps, t ≤ o} (base[t, c] + delta[r, t, g]) · x[r − t, c]`; taps never cross a block.
  `delta` comes from `kernel_projection` of the sublayer's normed input (`prepare` / `finish` halves).
* `DFlash2DecoderLayer` — `qd2:267-287`: `x += finish_a(attn(prepare_a(ln1(x))))`, then
  `x += finish_m(mlp(prepare_m(ln2(x))))`. The injected context K/V skip the convolution.
* `CandidateSelector` — `qd2:290-358`: for mask slot l with top-K candidates c_{l,·} of the unary
  logits u, `score[l, i, j] = u[l, j] + ⟨pred[c_{l−1,i}] ⊙ W_h h_l, succ[c_{l,j}]⟩` with `c_{0,·}` = the
  anchor; unary logits are `softcap(output_multiplier · lm_head(h))` on the top-K only
  (`vllm/model_executor/layers/logits_processor.py:253-318`).
* `walk` — `sd2:15-75` at temperature 0: from candidate 0 of the anchor row, each slot takes the
  best-scoring candidate given the previous slot's choice.
* Attention: every layer non-causal (`qwen3_dflash.py:86-97`); sliding layers see the window of the
  context and the whole block.

Training: the `train.loss` objective on the unary logits plus `train.selector_weight` × the selector's
K-way CE (`selector_term`, teacher-forced). Block B = 1 + `num_speculative_tokens` (`qd2:255-256`).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from huggingface_hub.dataclasses import strict
from torch import nn

from dflash_pipeline.drafter.config import DFlashConfig
from dflash_pipeline.drafter.dflash2 import ARCHITECTURE, SELECTOR_GOLD, SETTINGS_KEYS
from dflash_pipeline.drafter.model import DFlashDecoderLayer, DFlashDrafter
from dflash_pipeline.target.loading import lm_head_logits


@strict
class DFlash2Config(DFlashConfig):
    """A DFlash2 drafter's config: `DFlashConfig` whose `dflash_config`
    also carries `SETTINGS_KEYS` and `causal: false` (where vLLM reads them), served as
    `DFlash2DraftModel` with method `dflash`; sliding layers see the whole block."""

    architecture = ARCHITECTURE
    sliding_window_non_causal = True

    def settings(self) -> dict:
        """The `drafter.dflash2` section this config was written from."""
        return {k: self.dflash_config[k] for k in SETTINGS_KEYS}


def grouped_conv(
    x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block_size: int, group_size: int
) -> torch.Tensor:
    """Dynamic grouped causal convolution inside blocks of `block_size` query slots (`qd2:25-78`).

    Args:
        x: [b, Q, H] (Q a multiple of `block_size`, or Q ≤ `block_size` for one block).
        delta: [b, Q, taps, G] per-row tap offsets, G = H / `group_size`.
        base: [taps, H] static taps.
    Returns:
        [b, Q, H] in `x`'s dtype; computed in float32 as the kernel does (its accumulator is fp32).
    """
    b, q, h = x.shape
    taps = base.shape[0]
    groups = h // group_size
    xs = x.float().view(b, q, groups, group_size)
    coef = base.float().view(1, 1, taps, groups, group_size) + delta.float().unsqueeze(-1)  # [b, Q, taps, G, gs]
    out = coef[:, :, 0] * xs
    offset = torch.arange(q, device=x.device) % block_size
    for t in range(1, taps):
        shifted = F.pad(xs[:, :-t], (0, 0, 0, 0, t, 0))  # row r sees row r − t
        out = out + coef[:, :, t] * shifted * (offset >= t).view(1, -1, 1, 1)
    return out.view(b, q, h).to(x.dtype)


class GroupedConv(nn.Module):
    """`base_kernel` [2, taps, H] and `kernel_projection` (H → 2·taps·G), the weight names vLLM loads. Side 0 wraps a
    sublayer's input, side 1 its output.

    Init: tap 0 of both sides 1, the rest 0, and a zero projection — the convolution starts as the identity,
    so an untrained DFlash2 layer is a DFlash layer."""

    def __init__(self, hidden_size: int, taps: int, group_size: int):
        super().__init__()
        if taps < 1 or hidden_size % group_size:
            raise ValueError(
                f"drafter.dflash2: conv_group_size {group_size} must divide hidden_size {hidden_size} "
                f"and conv_kernel_size ({taps}) be ≥ 1"
            )
        self.taps, self.group_size, self.num_groups = taps, group_size, hidden_size // group_size
        base = torch.zeros(2, taps, hidden_size)
        base[:, 0] = 1.0
        self.base_kernel = nn.Parameter(base)
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.num_groups, bias=False)
        nn.init.zeros_(self.kernel_projection.weight)

    def prepare(self, h: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`(conv_0(h) [b, Q, H], the output side's delta [b, Q, taps, G])` (`qd2:217-221`)."""
        b, q, _ = h.shape
        delta = self.kernel_projection(h).view(b, q, 2, self.taps, self.num_groups)
        return grouped_conv(h, delta[:, :, 0], self.base_kernel[0], block_size, self.group_size), delta[:, :, 1]

    def finish(self, y: torch.Tensor, delta: torch.Tensor, block_size: int) -> torch.Tensor:
        """conv_1 of the sublayer's output `y` [b, Q, H] (`qd2:223-226`)."""
        return grouped_conv(y, delta, self.base_kernel[1], block_size, self.group_size)


class DFlash2DecoderLayer(DFlashDecoderLayer):
    """`drafter.model.DFlashDecoderLayer` with `attention_conv` and `mlp_conv`
    (`qd2:229-287`)."""

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        d = config.dflash_config
        taps, group = int(d["conv_kernel_size"]), int(d["conv_group_size"])
        self.attention_conv = GroupedConv(config.hidden_size, taps, group)
        self.mlp_conv = GroupedConv(config.hidden_size, taps, group)
        self.conv_block_size = int(config.block_size)

    def forward(self, x, context, ctx_rope, block_rope, attn_mask=None, cache=None):
        if isinstance(attn_mask, dict):
            attn_mask = attn_mask[self.attention_type]
        bs = self.conv_block_size
        h, delta = self.attention_conv.prepare(self.input_layernorm(x), bs)
        x = x + self.attention_conv.finish(
            self.self_attn(h, context, ctx_rope, block_rope, attn_mask, cache), delta, bs
        )
        h, delta = self.mlp_conv.prepare(self.post_attention_layernorm(x), bs)
        return x + self.mlp_conv.finish(self.mlp(h), delta, bs)


class CandidateSelector(nn.Module):
    """Low-rank edge scores between consecutive slots' candidates (`qd2:290-358`): `predecessor_codebook`
    and `successor_codebook` [V, r], `hidden_projection` (H → r)."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.randn(vocab_size, rank) * 0.02)
        self.successor_codebook = nn.Parameter(torch.randn(vocab_size, rank) * 0.02)
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def edge(self, hidden: torch.Tensor, prev_ids: torch.Tensor, cand_ids: torch.Tensor) -> torch.Tensor:
        """⟨pred[prev] ⊙ W_h h, succ[cand]⟩: hidden [n, H], prev_ids [n, P], cand_ids [n, C] → [n, P, C] float32."""
        hid = self.hidden_projection(hidden).float()  # [n, r]
        pred = self.predecessor_codebook[prev_ids].float() * hid.unsqueeze(1)  # [n, P, r]
        return torch.einsum("npr,ncr->npc", pred, self.successor_codebook[cand_ids].float())

    def scores(
        self, hidden: torch.Tensor, cand_ids: torch.Tensor, unary: torch.Tensor, anchor_ids: torch.Tensor
    ) -> torch.Tensor:
        """Every slot's [K_prev, K] score table (`qd2:290-310`).

        Args:
            hidden: [n, L, H] final-normed hidden of the L mask slots; cand_ids long [n, L, K];
            unary: float [n, L, K]; anchor_ids long [n] (block slot 0).
        Returns:
            float32 [n, L, K, K]: `[n, l, i, j]` scores candidate j at slot l after candidate i at slot l − 1.
        """
        n, L, k = cand_ids.shape
        prev = torch.cat([anchor_ids.view(n, 1, 1).expand(n, 1, k), cand_ids[:, :-1]], dim=1)  # [n, L, K]
        e = self.edge(hidden.reshape(n * L, -1), prev.reshape(n * L, k), cand_ids.reshape(n * L, k))
        return unary.float().unsqueeze(2) + e.view(n, L, k, k)


def unary_top_k(
    logits: torch.Tensor, k: int, output_multiplier: float, softcap: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(ids long [..., K], unary float32 [..., K])`: the top-K of raw `logits` [..., V], then scale, then
    cap (`logits_processor.py:298-318`; both monotonic, so the selection is the raw logits' top-K)."""
    values, ids = logits.topk(k, dim=-1)
    return ids, cap_logits(values.float(), output_multiplier, softcap)


def cap_logits(values: torch.Tensor, output_multiplier: float, softcap: float | None) -> torch.Tensor:
    """`softcap · tanh(multiplier · v / softcap)` (no cap when `softcap` is None or ≤ 0)."""
    if output_multiplier != 1.0:
        values = values * output_multiplier
    if softcap:
        values = torch.tanh(values / softcap) * softcap
    return values


def walk(scores: torch.Tensor, cand_ids: torch.Tensor) -> torch.Tensor:
    """Greedy candidate walk (`sd2:31-75` at temperature 0; first index on ties, as argmax).

    Args:
        scores: [n, L, K, K] from `CandidateSelector.scores`; cand_ids long [n, L, K].
    Returns:
        long [n, L] drafted tokens.
    """
    n, L = scores.shape[:2]
    prev = torch.zeros(n, dtype=torch.long, device=scores.device)
    rows = torch.arange(n, device=scores.device)
    out = []
    for step in range(L):
        idx = scores[rows, step, prev].argmax(dim=-1)  # [n]
        out.append(cand_ids[rows, step, idx])
        prev = idx
    return torch.stack(out, dim=1)


class DFlash2Drafter(DFlashDrafter):
    """DFlash2 (module docstring). Extra parameters: `layers.N.{attention_conv,mlp_conv}.*` and
    `candidate_selector.*`; the config's `dflash_config` carries `conv_kernel_size`, `conv_group_size`,
    `selector_rank`, `selector_top_k`, `output_multiplier`, `final_logit_softcapping`."""

    architecture = ARCHITECTURE
    sliding_block_causal = False  # "non-causal sliding window": sliding layers see the whole block

    def __init__(self, config):
        d = config.dflash_config
        for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            if not isinstance(d.get(key), int) or d[key] < 1:
                raise ValueError(f"dflash_config.{key}: a positive integer is required for DFlash2, got {d.get(key)!r}")
        if d["selector_top_k"] > config.vocab_size:
            raise ValueError(
                f"dflash_config.selector_top_k {d['selector_top_k']} exceeds vocab_size {config.vocab_size}"
            )
        super().__init__(config, layer_cls=DFlash2DecoderLayer)
        self.top_k = int(d["selector_top_k"])
        self.output_multiplier = float(d.get("output_multiplier", 1.0) or 1.0)
        self.softcap = float(d.get("final_logit_softcapping") or 0.0) or None
        self.candidate_selector = CandidateSelector(
            config.hidden_size, config.vocab_size, int(d["selector_rank"]), self.top_k
        )
        self._init_weights(self.candidate_selector.hidden_projection)
        for layer in self.layers:  # the base init re-drew every Linear: back to identity convolutions
            for conv in (layer.attention_conv, layer.mlp_conv):
                nn.init.zeros_(conv.kernel_projection.weight)

    def forward(self, noise_embedding, target_hidden, ctx_position_ids, block_position_ids, attn_mask=None, cache=None):
        """As `DFlashDrafter.forward`; the convolutions' block is the drafter's block size, or the query
        length when it is one shorter block (inference at `eval.block_size` < the trained one)."""
        q = noise_embedding.shape[1]
        bs = min(self.block_size, q)
        for layer in self.layers:
            layer.conv_block_size = bs
        return super().forward(noise_embedding, target_hidden, ctx_position_ids, block_position_ids, attn_mask, cache)

    @torch.no_grad()
    def propose(self, embed_tokens, lm_head, bonus_token, new_context, start, cache, block_size=None):
        """DFlash2's draft: block [bonus, MASK×(B−1)], top-K unary candidates per mask slot, selector scores,
        greedy walk (`sd2:206-265`). Returns `(drafts long [b, B−1], None)`."""
        hidden = self.block_hidden(embed_tokens, bonus_token, new_context, start, cache, block_size)[:, 1:]  # [b, L, H]
        logits = lm_head(hidden.to(lm_head.weight.dtype))
        cand, unary = unary_top_k(logits, self.top_k, self.output_multiplier, self.softcap)
        scores = self.candidate_selector.scores(hidden, cand, unary, bonus_token.view(-1))
        return walk(scores, cand), None

    def selector_objective(
        self, base, hidden, lm_head_weight, labels, weights, block_size, *, gold: str, selector_weight: float
    ):
        """`dflash2_objective` of this drafter (the family's training objective): `base` the `train.loss` objective (a
        `LossOutput`), `hidden` the final-normed block states [b, Q, H], `lm_head_weight` [V, H], `labels` long and
        `weights` float [b, Q]; returns a `LossOutput`.

        Raises:
            ValueError: `gold` is not one of `SELECTOR_GOLD`."""
        return dflash2_objective(
            base, self, hidden, lm_head_weight, labels, weights, block_size, gold=gold, selector_weight=selector_weight
        )

    def teacher_forced_hits(self, lm_head, hidden: torch.Tensor, blocks) -> torch.Tensor:
        """bool [b, Q]: whether the selector's best candidate after the gold token of slot k − 1 is slot k's label
        (`blocks.labels` [b, Q]; `hidden` [b, Q, H] final-normed); a gold token outside the top-K is a miss, as at
        serving."""
        labels, prev = blocks.labels, blocks.labels.roll(1, dims=1)
        hits = torch.zeros(labels.shape, dtype=torch.bool, device=labels.device)
        for i in range(0, hidden.shape[1], 4096):  # chunks of slots: never [Q, V] logits at once
            h, y, p = hidden[:, i : i + 4096], labels[:, i : i + 4096], prev[:, i : i + 4096]
            logits = lm_head(h.to(lm_head.weight.dtype)).float()
            cand, unary = unary_top_k(logits, self.top_k, self.output_multiplier, self.softcap)
            n, q = y.shape
            e = self.candidate_selector.edge(h.reshape(n * q, -1), p.reshape(-1, 1), cand.reshape(n * q, -1))
            best = (unary.reshape(n * q, -1) + e[:, 0]).argmax(-1, keepdim=True)
            hits[:, i : i + 4096] = cand.reshape(n * q, -1).gather(1, best).view(n, q) == y
        return hits


# --- Training: the selector's objective (teacher-forced walk)


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
    """Σ_k w_k · CE_K(selector scores, gold) over mask slots, teacher-forced: slot k's predecessor is the
    gold token of slot k − 1 (the anchor for k = 1), its candidates the unary top-K. A gold token outside
    them: `insert` replaces the K-th candidate for the loss (speculators #1006, SpecForge #772), `drop`
    leaves the slot out (NeMo Automodel). Scores as `CandidateSelector.scores` with the gold predecessor.

    Args:
        drafter: a `DFlash2Drafter` (unwrapped).
        hidden: [b, N·B, H]; lm_head_weight: [V, H]; labels: long [b, N·B] (slot 0 = the anchor);
            weights: float [b, N·B] (0 = not supervised; slot 0 always 0).
        gold: `insert` or `drop`.
    Returns:
        `(Σ w·CE float32 with grad, Σ w of the slots it covers, stats)`; stats: `selector_slots`,
        `selector_correct`, `gold_in_top_k`.
    Raises:
        ValueError: unknown `gold`."""
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
    base,
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
):
    """`base` (the `train.loss` objective on the unary logits, a
    `LossOutput`) + `selector_weight` × `selector_term`, scaled to
    `base`'s normaliser: the reported loss is base + λ · (weighted mean selector CE)."""
    if selector_weight == 0:
        return base
    sel_total, _, stats = selector_term(
        drafter, hidden, lm_head_weight, labels, weights, block_size, gold=gold, chunk_tokens=chunk_tokens
    )
    wsum = weights.detach().float().clamp(min=0).sum()
    scale = base.normalizer.detach() / wsum.clamp(min=1e-12)
    return dataclasses.replace(
        base, total=base.total + selector_weight * scale * sel_total, stats={**base.stats, **stats}
    )
