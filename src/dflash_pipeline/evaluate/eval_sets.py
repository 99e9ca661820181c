"""The held-out eval sets: each set's prompts drawn with the eval seed after the training prompts are left out
(`load_eval_sets`), long conversations built up to a token count (`build_to_tokens`), and the training prompt ids those
draws exclude."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable


def training_prompt_ids(manifest_path: str | Path) -> set[str]:
    """`prompt_id` of every training prompt in the shards listed by the prompts manifest."""
    from dflash_pipeline.core.shards import read_json, read_parquet

    manifest_path = Path(manifest_path)
    ids: set[str] = set()
    for ds in read_json(manifest_path)["datasets"].values():
        for shard in ds["shards"]:
            ids.update(read_parquet(manifest_path.parent / shard["path"]).column("prompt_id").to_pylist())
    return ids


def load_eval_sets(
    eval_cfg: dict, exclude_prompt_ids: Iterable[str] = (), *, count_tokens=None
) -> tuple[dict[str, list[dict]], dict[str, dict]]:
    """Each eval set's prompts (`load_eval_prompts`), training prompts removed before the seeded draw of
    `num_samples`. A set with `build_to_tokens` is built of long conversations
    (`load_long_conversations`; needs `count_tokens(messages)`, the rendered length).

    Returns `(sets, info)`: name → records, and name → `{path, format, num_samples, available,
    excluded_training_prompts, num_prompts, num_turns}` (+ `build_to_tokens` and `context_tokens`, the mean
    rendered tokens before the answered turn).

    Raises:
        ConfigError: a set left with no prompt (every one was a training prompt)."""
    from dflash_pipeline.core.errors import ConfigError
    from dflash_pipeline.prompts import load_eval_prompts

    exclude = set(exclude_prompt_ids)
    sets, info = {}, {}
    for name, s in eval_cfg["sets"].items():
        if s.get("build_to_tokens") is not None:
            sets[name], info[name] = _long_set(name, s, eval_cfg["seed"], exclude, count_tokens)
            continue
        fmt = s.get("format", "auto")
        every = load_eval_prompts(s["path"], fmt=fmt, num_samples=10**9, seed=eval_cfg["seed"])  # seeded shuffle
        held_out = [r for r in every if r["prompt_id"] not in exclude]
        chosen = held_out[: s["num_samples"]]
        if not chosen:
            raise ConfigError(
                f"eval.sets.{name}: no prompt left in {s['path']} ({len(every)} prompts, all of them also training "
                f"prompts); train on fewer of them (datasets.<name>.max_prompts) or set eval.exclude_training_prompts: false"
            )
        sets[name] = chosen
        info[name] = {
            "path": str(s["path"]),
            "format": fmt,
            "num_samples": s["num_samples"],
            "available": len(every),
            "excluded_training_prompts": len(every) - len(held_out),
            "num_prompts": len(chosen),
            "num_turns": sum(len(r["turns"]) for r in chosen),
        }
    return sets, info


def long_set_token_counter(
    eval_cfg: dict, target_dir, *, thinking: str, chat_template=None, trust_remote_code: bool = False
):
    """`count_tokens(messages)` for `load_eval_sets`, or None when no eval set has `build_to_tokens` (no tokenizer
    loaded)."""
    if not any(s.get("build_to_tokens") is not None for s in eval_cfg["sets"].values()):
        return None
    from dflash_pipeline.target.chat import load_tokenizer, render

    tok = load_tokenizer(target_dir, chat_template=chat_template, trust_remote_code=trust_remote_code)
    return lambda messages: len(render(tok, messages, thinking=thinking, add_generation_prompt=True, tokenize=True))


def _long_set(name: str, s: dict, seed: int, exclude: set, count_tokens) -> tuple[list[dict], dict]:
    """One long-conversation eval set and its info (`load_eval_sets`).

    Raises:
        ConfigError: no `count_tokens`, or not one conversation reaches `build_to_tokens`.
    """
    from dflash_pipeline.core.errors import ConfigError
    from dflash_pipeline.evaluate.long_conversations import load_long_conversations

    if count_tokens is None:
        raise ConfigError(f"eval.sets.{name}: build_to_tokens needs the target tokenizer (count_tokens)")
    records, found = load_long_conversations(
        s["path"],
        build_to_tokens=s["build_to_tokens"],
        num_samples=s["num_samples"],
        seed=seed,
        count_tokens=count_tokens,
        exclude_prompt_ids=exclude,
    )
    if not records:
        raise ConfigError(
            f"eval.sets.{name}: the conversations of {s['path']} (training prompts left out) do not "
            f"add up to one of build_to_tokens={s['build_to_tokens']} tokens; lower it or add "
            "conversations"
        )
    context = [count_tokens([*r["history"], {"role": "user", "content": r["turns"][0]}]) for r in records]
    return records, {
        "path": str(s["path"]),
        "format": s.get("format", "auto"),
        "num_samples": s["num_samples"],
        **found,
        "num_prompts": len(records),
        "num_turns": len(records),
        "build_to_tokens": s["build_to_tokens"],
        "context_tokens": round(sum(context) / len(context), 1),
    }
