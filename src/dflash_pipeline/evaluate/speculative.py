"""The speculative-decoding loop of the eval stage: the drafter drafts a block, the target verifies it.

Loop: reference/dflash.md §2.5 (z-lab `dflash_generate`), batch 1. The draft is greedy; the target samples
at `temperature` (greedy at 0), so the output distribution is the target's. Each verify step records a+1
(§7.1); `TargetCache` keeps the target's cache as if it had only seen the accepted tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from dflash_pipeline.drafter import model as M
from dflash_pipeline.drafter.block_size import resolve_block_size


@dataclass
class SpecResult:
    """One response: `output_ids` (generated tokens, prompt excluded, eos kept), `accept_lengths` (a+1 per verify
    step), `context_lengths` (per verify step, the tokens before its verify block), `target_forwards` (verify
    forwards, prefill and `recompute` re-runs excluded), `cache_policy` (`TargetCache`)."""

    output_ids: list[int]
    accept_lengths: list[int] = field(default_factory=list)
    target_forwards: int = 0
    cache_policy: str = ""  # TargetCache.policy: crop | recompute
    context_lengths: list[int] = field(default_factory=list)


def _sample(logits: torch.Tensor, temperature: float, generator: Optional[torch.Generator]) -> torch.Tensor:
    """logits [..., V] → token ids [...] (argmax when temperature < 1e-5)."""
    if temperature < 1e-5:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


def _cache_kw(target, cache) -> dict:
    """transformers ≥5.24 names the KV cache argument `cache` (`past_key_values` is deprecated)."""
    import inspect

    params = inspect.signature(target.forward).parameters
    return {"cache": cache} if "cache" in params else {"past_key_values": cache}


def recurrent_rollback_kwargs(activate_past_recording, max_rollback: int) -> dict:
    """Keywords for `cache.activate_past_recording`: `recurrent_states_to_keep=max_rollback` where the method
    takes it (transformers ≥ 5.25: linear-attention / SSM layers then keep their recurrent states for the last
    `max_rollback` tokens of a forward and are croppable). Where it takes no argument those layers are not
    croppable and `TargetCache` snapshots them (`recompute`)."""
    import inspect

    params = inspect.signature(activate_past_recording).parameters.values()
    takes = any(p.kind is p.VAR_KEYWORD or p.name == "recurrent_states_to_keep" for p in params)
    return {"recurrent_states_to_keep": int(max_rollback)} if takes else {}


def _unrecorded(layer, n_tokens: int, max_rollback: int) -> bool:
    """Whether `layer`, which claims to be croppable, kept fewer recurrent states over the forward of `n_tokens` than
    a rollback of `min(n_tokens, max_rollback)` tokens needs: a model that hands its cache only the last state leaves
    one entry, and `crop` would index past it."""
    history = getattr(layer, "recurrent_states_history", None)
    if not isinstance(history, dict) or n_tokens < 2:
        return False
    started = getattr(layer, "is_recurrent_states_initialized", {})
    need = min(n_tokens, max_rollback)
    return any(started.get(i) and len(states) < need for i, states in history.items())


def _has_sliding_layers(config) -> bool:
    """Whether a target config (or its `text_config`) has sliding-window attention layers."""
    cfg = getattr(config, "text_config", None) or config
    return "sliding_attention" in (getattr(cfg, "layer_types", None) or ()) or bool(
        getattr(cfg, "sliding_window", None)
    )


class TargetCache:
    """The target's cache in the verify loop, with one rollback policy for every cache type transformers
    ships (dflash.md §2.5: after a verify step only the bonus token and the accepted drafts stay).

    The cache is `DynamicCache(config=target.config)` (a type per layer) with `activate_past_recording`, and
    recurrent states recorded for the last `max_rollback` tokens (transformers ≥ 5.25). After the prefill,
    `policy` is

    * `crop`: every layer can be cut back (`cache.is_croppable`): the rejected tokens are cropped;
    * `recompute`: some layer holds a recurrent state that cannot: those layers are snapshotted before each verify
      forward and restored on a rejection, and the target re-runs the accepted tokens.

    Either way the cache afterwards equals the cache of a target that only ever saw the accepted tokens."""

    def __init__(self, target, *, max_rollback: int):
        from transformers import DynamicCache

        self.target = target
        self.cache = None
        # Without recurrent-state recording (transformers < 5.25) a config-typed cache gives sliding layers a window-sized
        # layer whose masks no longer match its keys after a crop (gpt-oss on 5.17: "size of tensor a (302) must
        # match the size of tensor b (11)"); full layers with the sliding mask compute the same attention.
        recording = recurrent_rollback_kwargs(getattr(DynamicCache, "activate_past_recording", lambda: None), 1)
        if recording or not _has_sliding_layers(target.config):
            try:
                self.cache = DynamicCache(config=target.config)
            except (TypeError, ValueError, AttributeError):  # older transformers: layers appear lazily
                pass
        if self.cache is None:
            self.cache = DynamicCache()
        if hasattr(self.cache, "activate_past_recording"):
            rec = self.cache.activate_past_recording
            rec(**recurrent_rollback_kwargs(rec, max_rollback))
        self.policy: Optional[str] = None
        self.max_rollback = int(max_rollback)
        self._uncroppable: list[int] = []  # layers the recompute policy snapshots
        self._snapshot: Optional[dict] = None
        self.recomputes = 0

    def forward(self, ids: torch.Tensor, layer_ids: Sequence[int]):
        """Target forward of `ids` [1, n] on the cache → `(features [1, n, K·H], output)`."""
        from dflash_pipeline.target.hidden import target_features

        if self.policy == "recompute":
            import copy

            self._snapshot = {i: copy.deepcopy(self.cache.layers[i]) for i in self._uncroppable}
        feats, out = target_features(
            self.target, ids, None, layer_ids, use_cache=True, need_logits=True, **_cache_kw(self.target, self.cache)
        )
        if self.policy is None:  # after the prefill every layer type is known
            self._uncroppable = [
                i
                for i, layer in enumerate(getattr(self.cache, "layers", []))
                if not getattr(layer, "is_croppable", False) or _unrecorded(layer, ids.shape[1], self.max_rollback)
            ]
            croppable = getattr(self.cache, "is_croppable", True) and not self._uncroppable
            self.policy = "crop" if croppable else "recompute"
        return feats, out

    def keep(self, ids: torch.Tensor, n_keep: int, layer_ids: Sequence[int]) -> None:
        """After verifying `ids` [1, n], keep only its first `n_keep` tokens in the cache."""
        n_drop = ids.shape[1] - n_keep
        if self.policy == "crop" or n_drop == 0:
            self.cache.crop(-n_drop)  # crop(0) restricts sliding/conv states back to their window
            return
        for i, layer in enumerate(self.cache.layers):
            if i in self._snapshot:
                self.cache.layers[i] = self._snapshot[i]
            else:
                layer.crop(-ids.shape[1])
        self._snapshot = None
        self.recomputes += 1
        from dflash_pipeline.target.hidden import target_features

        target_features(
            self.target, ids[:, :n_keep], None, layer_ids, use_cache=True, **_cache_kw(self.target, self.cache)
        )
        self.cache.crop(0)  # back to the minimal sliding/conv states, as after a crop


def _check_loop_args(drafter: M.DFlashDrafter, prompt_ids: Sequence[int], block_size: int) -> None:
    """Raises ValueError: `block_size` outside [2, the drafter's trained block size]
    (`resolve_block_size`), or an empty prompt."""
    resolve_block_size(block_size, drafter.block_size, key="block_size")
    if not prompt_ids:
        raise ValueError("empty prompt")


def _drafter_features(feats: torch.Tensor, zero_target_features: bool) -> torch.Tensor:
    """Target features [1, n, K·H] as the drafter sees them: zeros for a drafter trained without them."""
    return torch.zeros_like(feats) if zero_target_features else feats


def _accepted_drafts(draft: torch.Tensor, tgt: torch.Tensor, block_size: int) -> int:
    """a: how many leading drafts `draft` [1, n] equal the target's tokens `tgt` [n+1] (acceptance is a
    prefix, dflash.md §2.5); n is B − 1 for DFlash/DFlash2, up to B for DSpark (`block_size` is unused)."""
    a = 0
    while a < draft.shape[1] and int(draft[0, a]) == int(tgt[a]):
        a += 1
    return a


def _propose(drafter, embed, head, bonus, pending, start, dcache, block_size: int, confidence_threshold: float):
    """The family's drafts for one verify step, cut to the verify length: `drafts` long [1, n].

    DFlash and DFlash2 propose B − 1 tokens, DSpark B, of which it verifies the prefix its confidence head admits."""
    if not hasattr(drafter, "propose"):
        return drafter.draft_block(embed, head, bonus, pending, start, dcache, block_size)[:, 1:].argmax(dim=-1)
    drafts, conf = drafter.propose(embed, head, bonus, pending, start, dcache, block_size)
    if conf is not None:
        from dflash_pipeline.drafter.dspark_model import verify_length

        drafts = drafts[:, : verify_length(conf, confidence_threshold, drafts.shape[1])]
    return drafts


def _finished(output_ids: list[int], stops: set[int], max_new_tokens: int) -> bool:
    """The response ends: its last token is a stop token, or it has `max_new_tokens` tokens."""
    return int(output_ids[-1]) in stops or len(output_ids) >= max_new_tokens


def _append_until_stop(output_ids: list[int], new: Sequence[int], stops: set[int], max_new_tokens: int) -> None:
    """Append the accepted tokens `new` to `output_ids` up to and including a stop token or the limit."""
    for t in new:
        output_ids.append(int(t))
        if _finished(output_ids, stops, max_new_tokens):
            break


@torch.no_grad()
def speculative_generate(
    target,
    drafter: M.DFlashDrafter,
    prompt_ids: Sequence[int],
    *,
    block_size: int,
    max_new_tokens: int,
    temperature: float = 0.0,
    stop_token_ids: Sequence[int] = (),
    generator: Optional[torch.Generator] = None,
    zero_target_features: bool = False,
    confidence_threshold: float = 0.0,
) -> SpecResult:
    """Generate up to `max_new_tokens` tokens for one prompt with DFlash speculative decoding (batch 1).

    `block_size` ≤ the drafter's trained one. Drafts and verify rule are the family's
    (`DFlashDrafter.propose`); DSpark verifies the prefix its confidence admits at `confidence_threshold`
    (0: all). `zero_target_features` feeds the drafter zeros (the baseline trained that way). The target
    cache follows `TargetCache`; the drafter runs in its own dtype. Returns a `SpecResult`.

    Raises:
        ValueError: `block_size` larger than the drafter's, or an empty prompt."""
    from dflash_pipeline.target.loading import input_embeddings, lm_head

    _check_loop_args(drafter, prompt_ids, block_size)
    dev = next(target.parameters()).device
    embed, head = input_embeddings(target), lm_head(target)
    layer_ids = drafter.target_layer_ids
    stops = set(int(t) for t in stop_token_ids)

    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=dev)
    tcache = TargetCache(target, max_rollback=block_size + 1)  # a verify forward: bonus + up to B drafts
    feats, out = tcache.forward(ids, layer_ids)
    bonus = _sample(out.logits[:, -1], temperature, generator)  # [1]
    result = SpecResult(output_ids=[int(bonus)], cache_policy=tcache.policy)
    start = ids.shape[1]  # position of the bonus token
    pending = _drafter_features(feats, zero_target_features)  # not yet in the draft cache: cache.length .. start-1
    dcache = M.DraftContextCache(len(drafter.layers))
    while int(bonus) not in stops and len(result.output_ids) < max_new_tokens:
        draft = _propose(
            drafter, embed, head, bonus, pending, start, dcache, block_size, confidence_threshold
        )  # [1, n]
        verify = torch.cat([bonus.view(1, 1), draft], dim=1)  # [1, n+1]
        feats, out = tcache.forward(verify, layer_ids)
        result.target_forwards += 1
        tgt = _sample(out.logits[0], temperature, generator)  # [n+1]: target's token after each slot
        a = _accepted_drafts(draft, tgt, block_size)
        result.accept_lengths.append(a + 1)
        result.context_lengths.append(start)  # the bonus token sits at position `start`: `start` tokens before it
        _append_until_stop(result.output_ids, draft[0, :a].tolist() + [int(tgt[a])], stops, max_new_tokens)
        pending = _drafter_features(feats[:, : a + 1], zero_target_features)  # slots 0..a (start..start+a)
        start += a + 1
        if _finished(result.output_ids, stops, max_new_tokens):
            break
        tcache.keep(verify, a + 1, layer_ids)
        bonus = tgt[a : a + 1]
    return result
