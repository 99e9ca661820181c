"""Held-out eval prompts in the DFlash authors' formats (reference/dflash.md §7.2), read with the prompt
stage's readers and normalization."""

from __future__ import annotations

import logging
import os
import random
from typing import Any, Mapping

from dflash_pipeline.core.contracts import prompt_id
from dflash_pipeline.core.errors import ConfigError, DataError

from .normalize import _MISSING, FORMATS, RejectedRecord, _type_error, normalize_record
from .readers import read_records

log = logging.getLogger(__package__)  # one logger for the whole prompts stage

#: Extra formats only `load_eval_prompts` understands (the DFlash authors' eval prompt formats).
EVAL_FORMATS = FORMATS + ("gsm8k", "humaneval")

#: DFlash eval prompt formats (reference/dflash.md §7.2).
GSM8K_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL_TEMPLATE = (
    "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{prompt}\n```"
)


def _eval_format(record: Mapping[str, Any]) -> str:
    if isinstance(record.get("prompt"), str) and "entry_point" in record and "task_id" in record:
        return "humaneval"
    if isinstance(record.get("question"), str) and isinstance(record.get("answer"), str) and "####" in record["answer"]:
        return "gsm8k"
    return "auto"


def load_eval_prompts(path: str | os.PathLike, *, fmt: str = "auto", num_samples: int, seed: int) -> list[dict]:
    """Held-out eval prompts in the DFlash authors' formats (reference/dflash.md §7.2).

    Formats: `gsm8k` (`question + GSM8K_SUFFIX`), `humaneval` (`HUMANEVAL_TEMPLATE`), `mt_bench` (its
    `turns`), any `FORMATS` entry (the user turns of `normalize_record`); `auto` recognizes HumanEval and
    GSM8K records.

    Returns:
        `num_samples` records (all when fewer) `{prompt_id, turns: [user strings], system: str | None}`,
        drawn by `random.Random(seed).shuffle` of the file-ordered records.

    Raises:
        DataError: unreadable/malformed file, or a record without the format's field.
        ConfigError: unknown `fmt` or `num_samples < 1`."""
    if fmt not in EVAL_FORMATS:
        raise ConfigError(f"eval set format {fmt!r} unknown; use one of {EVAL_FORMATS}")
    if num_samples < 1:
        raise ConfigError(f"eval.sets.*.num_samples must be >= 1, got {num_samples}")
    items: list[dict] = []
    for loc, rec in read_records(path, strict=True):
        kind = _eval_format(rec) if fmt == "auto" else fmt
        system = None
        try:
            if kind == "gsm8k":
                q = rec.get("question", _MISSING)
                if not isinstance(q, str):
                    raise _type_error("question", q, "a string", rec)
                turns = [q + GSM8K_SUFFIX]
            elif kind == "humaneval":
                p = rec.get("prompt", _MISSING)
                if not isinstance(p, str):
                    raise _type_error("prompt", p, "a string", rec)
                turns = [HUMANEVAL_TEMPLATE.format(prompt=p)]
            else:
                messages = normalize_record(rec, fmt=kind)
                if any(m["role"] not in ("system", "user") for m in messages):
                    raise RejectedRecord("tool_conversation", "tool calls are not replayed by the eval loop")
                turns = [m["content"] for m in messages if m["role"] == "user"]
                systems = [m["content"] for m in messages if m["role"] == "system"]
                system = "\n\n".join(systems) if systems else None
        except RejectedRecord as rej:
            log.warning("%s: eval record skipped (%s)", loc, rej)
            continue
        except DataError as exc:
            raise DataError(f"{loc}: {exc}") from None
        msgs = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": t} for t in turns
        ]
        items.append({"prompt_id": prompt_id(msgs), "turns": turns, "system": system})
    random.Random(seed).shuffle(items)
    return items[:num_samples]
