"""Acceptance evaluation: a real speculative-decoding loop (target verifies the drafter's blocks).

Loop: reference/dflash.md §2.5 (z-lab ``dflash_generate``). Metrics: §7.1 — per verify step the
accepted drafts plus the bonus token (a+1); a response's τ is the mean over its steps; the reported τ
is the mean over responses. The draft is always greedy; the target samples at ``temperature``
(greedy when 0), so the output distribution is the target's.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import torch

from . import model as M
from .contracts import EVAL_SCHEMA_VERSION
from .shards import write_json


@dataclass
class SpecResult:
    """One response: ``output_ids`` (generated tokens, prompt excluded, eos kept), ``accept_lengths``
    (a+1 per verify step), ``target_forwards`` (verify forwards, prefill excluded)."""

    output_ids: list[int]
    accept_lengths: list[int] = field(default_factory=list)
    target_forwards: int = 0


def _sample(logits: torch.Tensor, temperature: float, generator: Optional[torch.Generator]) -> torch.Tensor:
    """logits [..., V] → token ids [...] (argmax when temperature < 1e-5)."""
    if temperature < 1e-5:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


def _cache_kw(target, cache) -> dict:
    """transformers ≥5.24 names the KV cache argument ``cache`` (``past_key_values`` is deprecated)."""
    import inspect

    params = inspect.signature(target.forward).parameters
    return {"cache": cache} if "cache" in params else {"past_key_values": cache}


def _crop(cache, length: int) -> None:
    """Crop a DynamicCache to ``length`` tokens (newer transformers take a negative count to remove)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


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
) -> SpecResult:
    """Generate up to ``max_new_tokens`` tokens for one prompt with DFlash speculative decoding (batch 1).

    ``block_size`` ≤ the drafter's trained block size. Returns a :class:`SpecResult`.

    Raises:
        ValueError: ``block_size`` larger than the drafter's, or an empty prompt.
    """
    from transformers import DynamicCache

    from .train import target_features

    if block_size > drafter.block_size or block_size < 2:
        raise ValueError(f"block_size {block_size} must be in [2, trained block size {drafter.block_size}]")
    if not prompt_ids:
        raise ValueError("empty prompt")
    dev = next(target.parameters()).device
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    layer_ids = drafter.target_layer_ids
    stops = set(int(t) for t in stop_token_ids)

    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=dev)
    cache = DynamicCache()
    feats, out = target_features(target, ids, None, layer_ids, use_cache=True, **_cache_kw(target, cache))
    bonus = _sample(out.logits[:, -1], temperature, generator)  # [1]
    result = SpecResult(output_ids=[int(bonus)])
    start = ids.shape[1]  # position of the bonus token
    pending = feats  # target features not yet in the draft cache, positions cache.length .. start-1
    dcache = M.DraftContextCache(len(drafter.layers))
    dtype = next(drafter.parameters()).dtype
    while int(bonus) not in stops and len(result.output_ids) < max_new_tokens:
        logits = drafter.draft_block(embed, lm_head, bonus, pending.to(dtype), start, dcache, block_size)
        draft = logits[:, 1:].argmax(dim=-1)  # [1, B-1], greedy
        verify = torch.cat([bonus.view(1, 1), draft], dim=1)  # [1, B]
        feats, out = target_features(target, verify, None, layer_ids, use_cache=True, **_cache_kw(target, cache))
        result.target_forwards += 1
        tgt = _sample(out.logits[0], temperature, generator)  # [B]: target's token after each slot
        a = 0
        while a < block_size - 1 and int(draft[0, a]) == int(tgt[a]):
            a += 1
        new = draft[0, :a].tolist() + [int(tgt[a])]
        result.accept_lengths.append(a + 1)
        for t in new:
            result.output_ids.append(int(t))
            if int(t) in stops or len(result.output_ids) >= max_new_tokens:
                break
        pending = feats[:, : a + 1]  # features of slots 0..a (positions start..start+a)
        start += a + 1
        _crop(cache, start)
        bonus = tgt[a : a + 1]
        if result.output_ids[-1] in stops:
            break
    return result


def acceptance_stats(accept_lengths_per_response: Sequence[Sequence[int]], block_size: int) -> dict:
    """τ and friends from per-response lists of a+1 values (dflash.md §7.1).

    Returns ``tau`` (mean over responses of the per-response mean; responses with no verify step are
    left out), ``per_position_acceptance`` (k = 1..B−1: share of steps that accepted ≥ k drafts),
    ``histogram`` (counts of a+1 = 1..B), ``num_responses``, ``num_steps``, ``tokens_per_step`` (pooled).
    """
    per_resp = [sum(r) / len(r) for r in accept_lengths_per_response if len(r)]
    steps = [x for r in accept_lengths_per_response for x in r]
    hist = [0] * block_size
    for x in steps:
        hist[x - 1] += 1
    n = len(steps)
    per_pos = [sum(1 for x in steps if x - 1 >= k) / n if n else 0.0 for k in range(1, block_size)]
    return {
        "tau": sum(per_resp) / len(per_resp) if per_resp else 0.0,
        "per_position_acceptance": per_pos,
        "histogram": {str(i + 1): c for i, c in enumerate(hist)},
        "num_responses": len(accept_lengths_per_response),
        "num_steps": n,
        "tokens_per_step": sum(steps) / n if n else 0.0,
    }


def evaluate(
    *,
    target_dir: str | Path,
    probe: dict,
    drafters: dict[str, Optional[str | Path]],
    eval_cfg: dict,
    thinking: str,
    out_json: str | Path,
    plot_png: Optional[str | Path] = None,
    chat_template: Optional[str | Path] = None,
    trust_remote_code: bool = False,
    target_dtype: str = "auto",
) -> dict:
    """Run the speculative loop for every drafter (label → checkpoint dir, or None for an untrained
    random-init drafter as a floor) on every eval set; write the eval record JSON (+ a PNG plot).

    Multi-turn sets (MT-Bench) feed the answer to turn i back as history for turn i+1.
    """
    from .chat import load_tokenizer, render
    from .prompts import load_eval_prompts
    from .train import build_drafter, load_target

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    target = load_target(target_dir, dtype=target_dtype, device=dev)
    tok = load_tokenizer(target_dir, chat_template=chat_template, trust_remote_code=trust_remote_code)
    stops = list(probe.get("tokenizer", {}).get("eos_token_ids") or [tok.eos_token_id])
    trained_bs = probe["drafter"]["block_size"]
    bs = eval_cfg.get("block_size") or trained_bs
    temperature = float(eval_cfg["temperature"])

    sets = {
        name: load_eval_prompts(s["path"], fmt=s["format"], num_samples=s["num_samples"], seed=eval_cfg["seed"])
        for name, s in eval_cfg["sets"].items()
    }
    record: dict = {
        "schema_version": EVAL_SCHEMA_VERSION,
        "target": {"path": str(target_dir), "model_type": probe.get("model_type"), "architectures": probe.get("architectures")},
        "settings": {
            "block_size": bs, "trained_block_size": trained_bs, "max_new_tokens": eval_cfg["max_new_tokens"],
            "temperature": temperature, "thinking": thinking, "seed": eval_cfg["seed"], "device": dev,
        },
        "drafters": {},
    }
    for label, ckpt in drafters.items():
        if ckpt is None:
            drafter = build_drafter(target, probe, seed=eval_cfg["seed"]).to(dev)
        else:
            drafter = M.load_drafter(ckpt, device=dev)
        if bs > drafter.block_size:
            raise ValueError(f"eval.block_size {bs} exceeds drafter {label}'s trained block size {drafter.block_size}")
        drafter.eval()
        entry = {"checkpoint": str(ckpt) if ckpt else None, "sets": {}}
        for set_name, prompts in sets.items():
            gen = torch.Generator(device=dev).manual_seed(eval_cfg["seed"])
            lengths, t0, new_tokens, forwards = [], time.time(), 0, 0
            for rec in prompts:
                history: list[dict] = []
                acc: list[int] = []
                for turn in rec["turns"]:
                    history.append({"role": "user", "content": turn})
                    prompt_ids = render(tok, history, thinking=thinking, add_generation_prompt=True, tokenize=True)
                    res = speculative_generate(
                        target, drafter, prompt_ids, block_size=bs, max_new_tokens=eval_cfg["max_new_tokens"],
                        temperature=temperature, stop_token_ids=stops, generator=gen,
                    )
                    acc.extend(res.accept_lengths)
                    new_tokens += len(res.output_ids)
                    forwards += res.target_forwards
                    history.append({"role": "assistant", "content": tok.decode(res.output_ids, skip_special_tokens=True)})
                lengths.append(acc)
            stats = acceptance_stats(lengths, bs)
            stats["tokens_per_target_forward"] = new_tokens / max(1, forwards)
            stats["seconds"] = time.time() - t0
            entry["sets"][set_name] = stats
            print(f"[eval] {label:>10} {set_name:>10}: tau={stats['tau']:.3f} over {stats['num_responses']} responses", flush=True)
        record["drafters"][label] = entry
    if "trained" in record["drafters"] and "untrained" in record["drafters"]:
        record["trained_over_untrained"] = {
            s: record["drafters"]["trained"]["sets"][s]["tau"] / max(1e-9, record["drafters"]["untrained"]["sets"][s]["tau"])
            for s in sets
        }
    write_json(out_json, record, skip_if_identical=False)
    if plot_png is not None:
        plot_acceptance(record, plot_png)
    return record


def plot_acceptance(record: dict, path: str | Path) -> None:
    """PNG: per-position acceptance (k = 1..B−1) per drafter and eval set, τ in the legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    for label, entry in record["drafters"].items():
        for set_name, s in entry["sets"].items():
            ks = list(range(1, len(s["per_position_acceptance"]) + 1))
            ax.plot(ks, s["per_position_acceptance"], marker="o", label=f"{label} / {set_name} (τ={s['tau']:.2f})")
    st = record["settings"]
    ax.set_xlabel("draft position k")
    ax.set_ylabel("P(accepted ≥ k)")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"DFlash acceptance — block {st['block_size']}, T={st['temperature']}, thinking={st['thinking']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> None:
    """CLI: ``python -m dflash_pipeline.evaluate --probe P --target T --eval-config JSON --out X [--drafter label=dir]…``."""
    import argparse

    p = argparse.ArgumentParser(description="Measure DFlash acceptance length τ with a speculative loop.")
    p.add_argument("--probe", required=True)
    p.add_argument("--target", required=True)
    p.add_argument("--eval-config", required=True, help="JSON of the validated `eval` config")
    p.add_argument("--thinking", default="disable")
    p.add_argument("--drafter", action="append", default=[], help="label=checkpoint_dir (label=untrained for a random init)")
    p.add_argument("--out", required=True)
    p.add_argument("--plot")
    a = p.parse_args(argv)
    drafters = {}
    for item in a.drafter:
        label, _, path = item.partition("=")
        drafters[label] = None if path in ("", "untrained") else path
    evaluate(
        target_dir=a.target, probe=json.loads(Path(a.probe).read_text()), drafters=drafters,
        eval_cfg=json.loads(a.eval_config), thinking=a.thinking, out_json=a.out, plot_png=a.plot,
    )


if __name__ == "__main__":
    main()
