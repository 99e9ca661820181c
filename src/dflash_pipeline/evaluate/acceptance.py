"""Acceptance evaluation: τ of every drafter on every eval set, with a real speculative-decoding loop.

`evaluate` opens an `EvalSession` (target, tokenizer, eval sets), answers every prompt with each drafter
(`run_eval_set`, one response per user turn, against the drafter's own earlier answers) and aggregates
the a+1 values per set (`acceptance_stats`, reference/dflash.md §7.1: τ is the mean over responses of
each response's mean over verify steps), then τ across the `step_<N>/` exports. The loop:
`.speculative`; record, table and plots: `.outputs`; engine τ: `.engine_acceptance`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import torch

from dflash_pipeline.core.contracts import EVAL_SCHEMA_VERSION
from dflash_pipeline.core.provenance import provenance
from dflash_pipeline.core.shards import write_json
from dflash_pipeline.drafter import build as DB
from dflash_pipeline.drafter import families as FR
from dflash_pipeline.drafter import model as M
from dflash_pipeline.drafter.block_size import resolve_block_size
from dflash_pipeline.evaluate.context_length import tau_by_context_length
from dflash_pipeline.evaluate.eval_sets import load_eval_sets
from dflash_pipeline.evaluate.outputs import (
    TABLE_COLUMNS,
    EvalComparisonError,
    check_comparable,
    eval_table_rows,
    merge_eval_records,
    plot_acceptance,
    plot_tau_vs_step,
    plot_training,
    plot_validation,
    read_train_log,
    write_eval_outputs,
    write_eval_table,
)
from dflash_pipeline.evaluate.speculative import SpecResult, TargetCache, speculative_generate

#: This module's names and those re-exported from `.speculative` and `.eval_outputs` (scripts,
#: tests and other modules import them from here).
__all__ = [
    "EvalComparisonError",
    "EvalSession",
    "SpecResult",
    "TABLE_COLUMNS",
    "TargetCache",
    "acceptance_stats",
    "answer_eval_set",
    "eval_set_stats",
    "check_comparable",
    "checkpoint_info",
    "eval_table_rows",
    "evaluate",
    "load_eval_drafter",
    "load_eval_sets",
    "main",
    "merge_eval_records",
    "open_session",
    "plot_acceptance",
    "plot_tau_vs_step",
    "plot_training",
    "plot_validation",
    "read_train_log",
    "run_checkpoint_series",
    "run_drafters",
    "run_eval_set",
    "speculative_generate",
    "step_checkpoints",
    "write_eval_outputs",
    "write_eval_table",
]


def acceptance_stats(accept_lengths_per_response: Sequence[Sequence[int]], block_size: int) -> dict:
    """τ and friends from per-response lists of a+1 values (dflash.md §7.1).

    Returns `tau` (mean over responses of the per-response mean; responses with no verify step are
    left out), `per_position_acceptance` (k = 1..B−1: share of steps that accepted ≥ k drafts),
    `histogram` (counts of a+1 = 1..B), `num_responses`, `num_steps`, `tokens_per_step` (pooled).
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


def family_build_args(ckpt_dir: Optional[str | Path]) -> dict:
    """`build_drafter` keywords that make an untrained drafter of the family of the export in `ckpt_dir`, from its
    `DFlashConfig`.

    Raises:
        FileNotFoundError / ValueError: as `DFlashConfig.from_checkpoint`.
    """
    if ckpt_dir is None:
        return {}
    cfg = FR.load_config(ckpt_dir)
    family = FR.of_config(cfg)
    if family is FR.default():
        return {}
    layer_types = cfg.layer_types
    return {
        "family": family.name,
        "family_settings": family.settings_of(cfg.to_dict()),
        "layer_types": layer_types,
        "sliding_window": cfg.sliding_window if "sliding_attention" in (layer_types or []) else None,
    }


def checkpoint_info(ckpt_dir: str | Path) -> dict:
    """What a drafter checkpoint says about itself: `train_steps` (None when it does not say),
    `zero_target_features` (False when it does not say) and its trained `block_size`.

    Raises:
        FileNotFoundError / ValueError: no or a malformed `config.json` (naming the file and field)."""
    from dflash_pipeline.drafter.config import DFlashConfig, checkpoint_meta

    meta = checkpoint_meta(ckpt_dir)
    return {
        "train_steps": meta.get("train_steps"),
        "zero_target_features": bool(meta.get("zero_target_features", False)),
        "block_size": DFlashConfig.from_checkpoint(ckpt_dir).block_size,
    }


def step_checkpoints(run_dir: str | Path) -> dict[int, Path]:
    """The intermediate exports `<run_dir>/step_<N>/` written during training, by step (ascending)."""
    import re

    found = {}
    for d in Path(run_dir).glob("step_*"):
        m = re.fullmatch(r"step_(\d+)", d.name)
        if m and d.is_dir() and (d / "config.json").is_file() and (d / "model.safetensors").is_file():
            found[int(m.group(1))] = d
    return dict(sorted(found.items()))


def answer_eval_set(
    target,
    tok,
    drafter,
    prompts: Sequence[dict],
    *,
    block_size: int,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    thinking: str,
    stop_token_ids: Sequence[int],
    zero_target_features: bool = False,
    confidence_threshold: float = 0.0,
) -> list[list[SpecResult]]:
    """Answer every user turn of every eval record with the speculative loop: per record, one
    `SpecResult` per user turn.

    Each turn is answered against the record's `history`, its earlier turns and the loop's own answers to them (MT-Bench
    multi-turn).
    """
    from dflash_pipeline.target.chat import render

    dev = next(target.parameters()).device
    gen = torch.Generator(device=dev).manual_seed(seed)
    out: list[list[SpecResult]] = []
    for rec in prompts:
        history: list[dict] = [{"role": "system", "content": rec["system"]}] if rec.get("system") else []
        history += [dict(m) for m in rec.get("history") or []]
        answers = []
        for turn in rec["turns"]:
            history.append({"role": "user", "content": turn})
            prompt_ids = render(tok, history, thinking=thinking, add_generation_prompt=True, tokenize=True)
            res = speculative_generate(
                target,
                drafter,
                prompt_ids,
                block_size=block_size,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                stop_token_ids=stop_token_ids,
                generator=gen,
                zero_target_features=zero_target_features,
                confidence_threshold=confidence_threshold,
            )
            answers.append(res)
            history.append({"role": "assistant", "content": tok.decode(res.output_ids, skip_special_tokens=True)})
        out.append(answers)
    return out


def eval_set_stats(
    answers: Sequence[Sequence[SpecResult]],
    *,
    block_size: int,
    seconds: float,
    length_buckets: Sequence[int] = (),
    family: Optional[str] = None,
) -> dict:
    """`acceptance_stats` of a set's answers (`answer_eval_set`) plus `num_conversations`, `new_tokens`,
    `target_forwards`, `tokens_per_target_forward`, `seconds`, `tokens_per_s` and, with `length_buckets` (edges in
    tokens), `by_context_length`."""
    responses = [r for conv in answers for r in conv]
    new_tokens = sum(len(r.output_ids) for r in responses)
    forwards = sum(r.target_forwards for r in responses)
    # a+1 ≤ drafts + 1 (the family's acceptance slots: B, or B + 1 when it drafts from the anchor)
    stats = acceptance_stats([r.accept_lengths for r in responses], FR.get(family).acceptance_slots(block_size))
    stats.update(
        num_conversations=len(answers),
        new_tokens=new_tokens,
        target_forwards=forwards,
        tokens_per_target_forward=new_tokens / max(1, forwards),
        seconds=seconds,
        tokens_per_s=new_tokens / seconds if seconds > 0 else 0.0,
    )
    if length_buckets:
        stats["by_context_length"] = tau_by_context_length(
            [(r.context_lengths, r.accept_lengths) for r in responses], length_buckets
        )
    return stats


def run_eval_set(target, tok, drafter, prompts: Sequence[dict], *, length_buckets: Sequence[int] = (), **loop) -> dict:
    """τ and friends of one drafter on one eval set: `answer_eval_set` (`loop`: its keyword
    arguments), then `eval_set_stats`."""
    t0 = time.time()
    answers = answer_eval_set(target, tok, drafter, prompts, **loop)
    return eval_set_stats(
        answers,
        block_size=loop["block_size"],
        seconds=time.time() - t0,
        length_buckets=length_buckets,
        family=FR.of_drafter(drafter).name,
    )


@dataclass
class EvalSession:
    """The loaded target and everything a run of the speculative loop needs (see `open_session`)."""

    target: Any
    tokenizer: Any
    probe: dict
    eval_cfg: dict
    device: str
    sets: dict[str, list[dict]]
    set_info: dict[str, dict]
    settings: dict
    loop: dict
    length_buckets: Sequence[int] = ()
    untrained_family: dict = field(default_factory=dict)  # build_drafter keywords of the untrained floor


def open_session(
    *,
    target_dir,
    probe: dict,
    eval_cfg: dict,
    thinking: str,
    chat_template=None,
    trust_remote_code: bool = False,
    target_dtype: str = "auto",
    exclude_prompt_ids: Iterable[str] = (),
) -> EvalSession:
    """Load the target (`target.loading.load_target`), its tokenizer and the eval sets."""
    from dflash_pipeline.target.chat import load_tokenizer, render
    from dflash_pipeline.target.loading import load_target, module_dtype

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    target = load_target(target_dir, dtype=target_dtype, device=dev, trust_remote_code=trust_remote_code)
    tok = load_tokenizer(target_dir, chat_template=chat_template, trust_remote_code=trust_remote_code)
    stops = list(probe.get("tokenizer", {}).get("eos_token_ids") or [tok.eos_token_id])
    trained_bs = probe["drafter"]["block_size"]
    bs = resolve_block_size(eval_cfg["block_size"], trained_bs)
    temperature = float(eval_cfg["temperature"])
    from dflash_pipeline.evaluate.context_length import bucket_labels, length_buckets_of

    def count_tokens(messages: list[dict]) -> int:  # a long conversation's context (the generation prompt included)
        return len(render(tok, messages, thinking=thinking, add_generation_prompt=True, tokenize=True))

    sets, set_info = load_eval_sets(eval_cfg, exclude_prompt_ids, count_tokens=count_tokens)
    edges = length_buckets_of(eval_cfg)
    settings = {
        "block_size": bs,
        "trained_block_size": trained_bs,
        "max_new_tokens": eval_cfg["max_new_tokens"],
        "temperature": temperature,
        "draft_sampling": "greedy",
        "thinking": thinking,
        "seed": eval_cfg["seed"],
        "device": dev,
        "backend": "transformers",
        "batch_size": 1,
        "dtype": str(module_dtype(target)).replace("torch.", ""),
        "context_length_buckets": edges,
        "context_length_buckets_labels": bucket_labels(edges),
    }
    loop = dict(
        block_size=bs,
        max_new_tokens=eval_cfg["max_new_tokens"],
        temperature=temperature,
        seed=eval_cfg["seed"],
        thinking=thinking,
        stop_token_ids=stops,
    )
    if eval_cfg.get("confidence_threshold"):  # DSpark's verify gate; the params leave it out at its default 0
        loop["confidence_threshold"] = float(eval_cfg["confidence_threshold"])
        settings["confidence_threshold"] = loop["confidence_threshold"]
    return EvalSession(target, tok, probe, eval_cfg, dev, sets, set_info, settings, loop, edges)


def load_eval_drafter(session: EvalSession, label: str, ckpt: Optional[str | Path]) -> tuple[M.DFlashDrafter, dict]:
    """A drafter checkpoint (None: an untrained random init, the floor) in the target's dtype, and its
    `checkpoint_info`.

    Raises:
        BlockSizeError (a ValueError): `eval.block_size` exceeds the drafter's trained block size.
    """
    from dflash_pipeline.target.loading import drafter_dtype

    dt = drafter_dtype(session.target)
    if ckpt is None:  # the floor: an untrained drafter of the trained one's family (DFlash for DFlash runs)
        drafter, info = (
            DB.build_drafter(session.target, session.probe, seed=session.eval_cfg["seed"], **session.untrained_family),
            {"train_steps": 0, "zero_target_features": False},
        )
    else:
        drafter, info = DB.load_drafter(ckpt, dtype=dt, device=session.device), checkpoint_info(ckpt)
    resolve_block_size(session.loop["block_size"], drafter.block_size, key=f"eval.block_size (drafter {label})")
    return drafter.to(device=session.device, dtype=dt).eval(), info


def run_drafters(session: EvalSession, drafters: dict[str, Optional[str | Path]], *, target_dir=None) -> dict:
    """The eval record (schema `EVAL_SCHEMA_VERSION`): τ of every drafter on every eval set, plus
    `tau_over_untrained` when an `untrained` floor is among them."""
    probe, sets = session.probe, session.sets
    record: dict = {
        "schema_version": EVAL_SCHEMA_VERSION,
        "target": {
            "path": str(target_dir),
            "model_type": probe.get("model_type"),
            "architectures": probe.get("architectures"),
        },
        "settings": session.settings,
        "sets": session.set_info,
        "drafters": {},
        "provenance": provenance(
            target_dir=target_dir, device=session.settings["device"], dtype=session.settings["dtype"]
        ),
    }
    session.untrained_family = family_build_args(next((c for c in drafters.values() if c), None))
    for label, ckpt in drafters.items():
        drafter, info = load_eval_drafter(session, label, ckpt)
        entry = {
            "checkpoint": str(ckpt) if ckpt else None,
            "train_steps": info["train_steps"],
            "zero_target_features": info["zero_target_features"],
            "sets": {},
        }
        pooled = []  # (context lengths, a+1) of every response of every set: τ by context length over all sets
        for set_name, prompts in sets.items():
            t0 = time.time()
            answers = answer_eval_set(
                session.target,
                session.tokenizer,
                drafter,
                prompts,
                zero_target_features=info["zero_target_features"],
                **session.loop,
            )
            stats = eval_set_stats(
                answers,
                block_size=session.loop["block_size"],
                seconds=time.time() - t0,
                length_buckets=session.length_buckets,
                family=FR.of_drafter(drafter).name,
            )
            pooled += [(r.context_lengths, r.accept_lengths) for conv in answers for r in conv]
            entry["sets"][set_name] = stats
            print(
                f"[eval] {label:>14} {set_name:>10}: tau={stats['tau']:.3f} over {stats['num_responses']} responses "
                f"({stats['seconds']:.1f} s)",
                flush=True,
            )
        record["drafters"][label] = entry
        record.setdefault("by_context_length", {})[label] = tau_by_context_length(pooled, session.length_buckets)
    record["tau"] = {label: {s: e["sets"][s]["tau"] for s in sets} for label, e in record["drafters"].items()}
    if "untrained" in record["drafters"]:
        floor = record["tau"]["untrained"]
        record["tau_over_untrained"] = {
            label: {s: taus[s] / max(1e-9, floor[s]) for s in sets}
            for label, taus in record["tau"].items()
            if label != "untrained"
        }
        if "trained" in record["tau_over_untrained"]:
            record["trained_over_untrained"] = record["tau_over_untrained"]["trained"]
    return record


def run_checkpoint_series(session: EvalSession, checkpoint_series: dict[int, str | Path]) -> dict:
    """τ of each checkpoint (step → dir) on the first `eval.checkpoint_samples` prompts of every set."""
    n = int(session.eval_cfg["checkpoint_samples"])
    subsets = {name: prompts[:n] for name, prompts in session.sets.items()} if n > 0 else {}
    series = {
        "schema_version": EVAL_SCHEMA_VERSION,
        "settings": session.settings,
        "num_prompts": {s: len(p) for s, p in subsets.items()},
        "points": [],
    }
    for step, ckpt in sorted(checkpoint_series.items()) if subsets else []:
        drafter, info = load_eval_drafter(session, f"step {step}", ckpt)
        point = {"step": int(step), "checkpoint": str(ckpt), "sets": {}}
        for set_name, prompts in subsets.items():
            st = run_eval_set(
                session.target,
                session.tokenizer,
                drafter,
                prompts,
                zero_target_features=info["zero_target_features"],
                **session.loop,
            )
            point["sets"][set_name] = {
                k: st[k] for k in ("tau", "num_responses", "num_steps", "tokens_per_target_forward")
            }
        series["points"].append(point)
        print(
            f"[eval] step {step:>6}: " + " ".join(f"{s}={v['tau']:.2f}" for s, v in point["sets"].items()), flush=True
        )
    return series


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
    exclude_prompt_ids: Iterable[str] = (),
    table_tsv: Optional[str | Path] = None,
    checkpoint_series: Optional[dict[int, str | Path]] = None,
    series_json: Optional[str | Path] = None,
    series_png: Optional[str | Path] = None,
    train_log: Optional[str | Path] = None,
) -> dict:
    """Run the speculative loop for every drafter (label → checkpoint dir, or None for an untrained
    drafter as a floor) on every eval set; write the eval record JSON (+ a PNG plot, a TSV table).

    `exclude_prompt_ids`: training prompts, never drawn. `checkpoint_series` (step → checkpoint): τ of each
    on the first `eval.checkpoint_samples` prompts of every set, to `series_json` and `series_png`."""
    session = open_session(
        target_dir=target_dir,
        probe=probe,
        eval_cfg=eval_cfg,
        thinking=thinking,
        chat_template=chat_template,
        trust_remote_code=trust_remote_code,
        target_dtype=target_dtype,
        exclude_prompt_ids=exclude_prompt_ids,
    )
    record = run_drafters(session, drafters, target_dir=target_dir)
    write_eval_outputs(record, out_json, plot_png=plot_png, table_tsv=table_tsv)
    if checkpoint_series is not None and series_json is not None:
        series = run_checkpoint_series(session, checkpoint_series)
        write_json(series_json, series, skip_if_identical=False)
        if series_png is not None:
            plot_tau_vs_step(series, series_png, train_log=train_log)
    return record


def main(argv=None) -> None:
    """CLI: `dflash-eval --probe P --target T --eval-config JSON --out X [--drafter label=dir]…`."""
    import argparse

    p = argparse.ArgumentParser(
        prog="dflash-eval", description="Measure DFlash acceptance length τ with a speculative loop."
    )
    p.add_argument("--probe", required=True)
    p.add_argument("--target", required=True)
    p.add_argument("--eval-config", required=True, help="JSON of the validated `eval` config")
    p.add_argument("--thinking", default="disable")
    p.add_argument(
        "--drafter", action="append", default=[], help="label=checkpoint_dir (label=untrained for a random init)"
    )
    p.add_argument("--out", required=True)
    p.add_argument("--plot")
    p.add_argument("--target-dtype", default="auto", help="target.dtype (auto: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--trust-remote-code", action="store_true", help="target.trust_remote_code")
    a = p.parse_args(argv)
    drafters = {}
    for item in a.drafter:
        label, _, path = item.partition("=")
        drafters[label] = None if path in ("", "untrained") else path
    evaluate(
        target_dir=a.target,
        probe=json.loads(Path(a.probe).read_text()),
        drafters=drafters,
        eval_cfg=json.loads(a.eval_config),
        thinking=a.thinking,
        out_json=a.out,
        plot_png=a.plot,
        target_dtype=a.target_dtype,
        trust_remote_code=a.trust_remote_code,
    )


if __name__ == "__main__":
    main()
