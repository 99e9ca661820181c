"""The keep decisions of the prompts stage: whether one normalized prompt is kept (`_drop_reason`: the
`fraction` draw, dedup across sources, special-token text, language, length), with the options every source
shares (`_Filters`), checked before any source is read (`_checked_filters`).
`.sharding` applies them record by record."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from dflash_pipeline.core.errors import ConfigError
from dflash_pipeline.target.spans import control_token_strings, find_control_strings

from .language import _language_identifier, _source_languages, language_problems, language_sample

if TYPE_CHECKING:
    from .sharding import _SourceTally


def keep_score(seed: int, pid: str) -> float:
    """Uniform number in [0, 1) for the per-record `fraction` decision: sha256 of `"{seed}:{pid}"`."""
    digest = hashlib.sha256(f"{seed}:{pid}".encode("ascii")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def _count_tokens(tokenizer, messages: Sequence[dict]) -> int:
    total = 0
    for m in messages:
        try:
            ids = tokenizer.encode(m["content"], add_special_tokens=False)
        except TypeError:
            ids = tokenizer.encode(m["content"])
        total += len(ids)
    return total


@dataclass
class _Filters:
    """What every source shares: the seed of `fraction`, the length limit, the language identifier and
    the prompt ids kept so far (dedup across sources: the first source in config order wins)."""

    seed: int
    tokenizer: Any = None
    max_prompt_tokens: int | None = None
    identifier: Any = None
    seen: dict[str, str] = field(default_factory=dict)  # prompt_id -> the source that kept it
    control_strings: Sequence[str] = ()  # special-token strings of the target tokenizer (special_token_text)
    special_token_text: str | None = None  # drop | keep | None (no check)


def _language_filters(
    datasets: Mapping[str, Mapping[str, Any]], languages: Sequence[str] | None, min_language_confidence: float
) -> tuple[dict[str, tuple[frozenset, float] | None], Any]:
    """Each source's `(allowed languages, min confidence)` (None: no filter) and the py3langid
    identifier (None when no source filters). Raises ConfigError (see `build_prompt_shards`)."""
    problems = language_problems({"languages": languages, "min_language_confidence": min_language_confidence}, datasets)
    if problems:
        raise ConfigError("language filter: " + "; ".join(problems))
    lang_filters: dict[str, tuple[frozenset, float] | None] = {}
    identifier = None
    for name, raw_cfg in datasets.items():
        allowed, lang_key = _source_languages(languages, name, raw_cfg)
        if allowed is None:
            lang_filters[name] = None
            continue
        identifier = identifier or _language_identifier(lang_key)
        missing = sorted(set(allowed) - set(identifier.labels))
        if missing:  # a py3langid whose model differs from LANGUAGE_CODES
            raise ConfigError(f"{lang_key}: the installed py3langid model does not know {missing}")
        own_conf = raw_cfg.get("min_language_confidence")
        lang_filters[name] = (frozenset(allowed), float(min_language_confidence if own_conf is None else own_conf))
    return lang_filters, identifier


def _drop_reason(
    messages: list[dict],
    pid: str,
    fraction: float,
    lang_filter: tuple[frozenset, float] | None,
    filters: _Filters,
    tally: _SourceTally,
) -> tuple[str, str] | None:
    """Why a normalized prompt is not kept (`sampled_out`, `duplicate`, `special_token_text`,
    `language`, `low_language_confidence`, `too_long`, checked in that order) and a detail for its
    example, or None to keep it."""
    if fraction < 1.0 and keep_score(filters.seed, pid) >= fraction:
        return "sampled_out", f"fraction {fraction}"
    if pid in filters.seen:
        return "duplicate", f"same messages as a prompt kept from source {filters.seen[pid]}"
    if filters.special_token_text is not None and filters.control_strings:
        found = sorted({t for m in messages for t in find_control_strings(m["content"], filters.control_strings)})
        if found:
            role = next(m["role"] for m in messages if find_control_strings(m["content"], found))
            if filters.special_token_text == "drop":
                return "special_token_text", (
                    f"{role} text contains {found}, which the target's tokenizer (and the "
                    f"engines' chat rendering) would read as control tokens"
                )
            tally.special_kept += 1
    if lang_filter is not None:
        lang, prob = filters.identifier.classify(language_sample(messages))
        if lang not in lang_filter[0] or prob < lang_filter[1]:
            tally.dropped_langs[lang] += 1
            reason = "language" if lang not in lang_filter[0] else "low_language_confidence"
            return reason, f"detected {lang} (p={prob:.2f})"
    if filters.max_prompt_tokens is not None:
        n = _count_tokens(filters.tokenizer, messages)
        if n > filters.max_prompt_tokens:
            return "too_long", f"{n} tokens > prompts.max_prompt_tokens={filters.max_prompt_tokens}"
    return None


def _checked_filters(
    datasets: Mapping[str, Mapping[str, Any]],
    *,
    shard_size: int,
    seed: int,
    tokenizer,
    max_prompt_tokens: int | None,
    languages: Sequence[str] | None,
    min_language_confidence: float,
    special_token_text: str | None,
) -> tuple[_Filters, dict[str, tuple[frozenset, float] | None]]:
    """The options of `build_prompt_shards` checked before any source is read: the shared
    `_Filters` and each source's language filter (`_language_filters`).

    Raises:
        ConfigError: `shard_size` < 1, `max_prompt_tokens` without tokenizer, bad language settings, a language filter
            without py3langid installed, a `special_token_text` other than drop/keep/None or without tokenizer.
    """
    if shard_size < 1:
        raise ConfigError(f"prompts.shard_size must be >= 1, got {shard_size}")
    if max_prompt_tokens is not None and tokenizer is None:
        raise ConfigError("prompts.max_prompt_tokens is set but no tokenizer was given (the probe's target tokenizer)")
    lang_filters, identifier = _language_filters(datasets, languages, min_language_confidence)
    if special_token_text not in (None, "drop", "keep"):
        raise ConfigError(f"prompts.special_token_text: {special_token_text!r}; use drop or keep")
    if special_token_text is not None and tokenizer is None:
        raise ConfigError("prompts.special_token_text needs the target tokenizer (none was given)")
    filters = _Filters(
        seed=seed,
        tokenizer=tokenizer,
        max_prompt_tokens=max_prompt_tokens,
        identifier=identifier,
        control_strings=control_token_strings(tokenizer) if special_token_text else (),
        special_token_text=special_token_text,
    )
    return filters, lang_filters
